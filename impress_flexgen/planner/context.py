"""A stand-in for a loaded prefix while the planner's prefill curve is measured."""
from __future__ import annotations

import torch


class ContextKV:
    """KV of `n_tokens` earlier tokens (zeros) standing in for a loaded prefix while the
    prefill curve is measured: the compute sees a context of that length, no I/O happens."""

    def __init__(self, n_tokens: int, n_kv_heads: int, head_dim: int):
        self.n_tokens = n_tokens
        self.shape = (n_kv_heads, n_tokens, head_dim)

    def start(self, layer: int) -> None:
        pass

    def kv(self, layer: int, device, dtype):
        z = torch.zeros(self.shape, dtype=torch.float16).to(device, dtype)
        return z, z

    def close(self) -> None:
        pass
