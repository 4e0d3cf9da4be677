"""Maximum inner product search as nearest-neighbour search (the transform IceCache indexes).

Attention wants the keys with the largest q.k, but clustering and tree descent work in a
metric space. With c >= every key norm,

    T_K(k) = [k / c, sqrt(1 - |k|^2 / c^2)]        (unit length)
    T_Q(q) = [q / |q|, 0]                          (unit length)

gives |T_Q(q) - T_K(k)|^2 = 2 - 2 q.k / (|q| c): for a fixed query the Euclidean order of the
transformed keys is exactly the inner-product order of the raw keys. (The formula in the doc,
sqrt(c^2 - |k|^2) appended before dividing by c, is the same vector.)

Keys keep arriving during decode and one may exceed c. Its extra coordinate would be the root
of a negative number, so `MipsTransform.fit` leaves head room (c = margin * max norm) and the
owner checks `needs_refit` on every insert; when a key does exceed c the owner refits c and
re-transforms its stored keys (cheap: one pass over d + 1 columns) and rebuilds whatever was
derived from them. Raising c rescales every transformed key the same way, so the inner-product
order never changes, only distances shrink.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class MipsTransform:
    c: float                       # >= the norm of every key transformed so far

    @classmethod
    def fit(cls, keys: torch.Tensor, margin: float = 1.25) -> "MipsTransform":
        """c from keys (..., d) with head room for keys that arrive later."""
        top = float(keys.norm(dim=-1).max()) if keys.numel() else 1.0
        return cls(max(top, 1e-6) * margin)

    def needs_refit(self, keys: torch.Tensor) -> bool:
        return bool(keys.numel()) and float(keys.norm(dim=-1).max()) > self.c

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., d + 1) unit vectors."""
        scaled = k.float() / self.c
        extra = (1.0 - scaled.pow(2).sum(-1, keepdim=True)).clamp_min(0.0).sqrt()
        return torch.cat([scaled, extra], dim=-1)

    @staticmethod
    def queries(q: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., d + 1) unit vectors with a zero last coordinate."""
        q = q.float()
        unit = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return torch.cat([unit, torch.zeros_like(unit[..., :1])], dim=-1)
