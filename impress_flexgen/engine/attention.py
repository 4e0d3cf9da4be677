"""Attention of new tokens over a kept prefix plus themselves (causal among the new).

    out = attend(q, keys, values, mask, causal_tail=s, group=n_head // n_kv_head,
                 device=device)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(q, keys, values, mask, causal_tail: int, front: int = 0, *, group: int,
           device) -> torch.Tensor:
    """q (1, H, s, d) over keys/values (KV, m, d); mask (KV, m) says which keys each KV
    head may see; the last `causal_tail` keys are the new tokens themselves (causal).
    The first `front` queries (a recomputed prefix front) see none of the keys before
    the tail: those are prefix tokens after them. `group`: query heads per KV head."""
    s, m = q.shape[2], keys.shape[1]
    if front:
        # The front over its own keys only (the first of the tail), the rest over all:
        # masking the prefix out of the front's rows would still compute them.
        lo = m - causal_tail
        head = attend(q[:, :, :front], keys[:, lo:lo + front], values[:, lo:lo + front],
                      mask[:, lo:lo + front], front, group=group, device=device)
        rest = attend(q[:, :, front:], keys, values, mask, causal_tail - front, group=group,
                      device=device)
        return torch.cat([head, rest], dim=2)
    # Whole-chunk selection gives every KV head the same keys: one (s, m) mask then
    # serves all heads, instead of a copy per head.
    shared = mask.shape[0] == 1 or bool((mask == mask[:1]).all())
    rows = mask[:1] if shared else mask
    allowed = rows[:, None, :].expand(-1, s, -1).clone()          # (KV or 1, s, m)
    tail = torch.ones(s, causal_tail, dtype=torch.bool, device=device).tril(
        diagonal=causal_tail - s)
    allowed[:, :, m - causal_tail:] &= tail
    # A token always sees itself: masked pad tokens would otherwise see nothing (NaN).
    allowed[:, :, m - causal_tail:] |= _diagonal(s, causal_tail, device)
    allowed = allowed[None] if shared else \
        allowed.repeat_interleave(group, dim=0)[None]             # (1, H or 1, s, m)
    work = torch.float32 if device.type == "cpu" else q.dtype
    out = F.scaled_dot_product_attention(
        q.to(work), keys[None].to(work), values[None].to(work), attn_mask=allowed,
        enable_gqa=group > 1)
    return out.to(q.dtype)


def _diagonal(s: int, tail: int, device) -> torch.Tensor:
    """(s, tail) bool: query i (of the last s tokens) against itself among the last `tail`."""
    out = torch.zeros(s, tail, dtype=torch.bool, device=device)
    idx = torch.arange(s, device=device)
    out[idx, idx + tail - s] = True
    return out
