"""Deterministic KV for tests: one generator, the crash harness's (a rolling hash over token
ids: prefixes sharing leading tokens share that part of their KV bit for bit, every fp16 bit
pattern but NaN/Inf occurs), for any shape with n_layers, n_kv_heads and head_dim.

    kv = token_kv(tokens, SHAPE, start)          # per layer (K, V) of positions start..
    kv = seeded_kv(SHAPE, n, seed, start)        # the same for a sequence named by a seed
    payload = random_bits(seed, (256,))          # a chunk: every 16-bit pattern, NaN included
"""
from __future__ import annotations

import numpy as np
import torch

from experiments.crash_test.kv import expected_bits, tensor_bits, token_kv

__all__ = ["expected_bits", "random_bits", "same_bits", "seed_tokens", "seeded_kv",
           "tensor_bits", "token_kv"]


def seed_tokens(seed: int, n: int) -> np.ndarray:
    """The first n token ids of the sequence named by `seed` (a longer n extends it)."""
    return np.arange(n, dtype=np.int64) + seed * (1 << 20)


def seeded_kv(shape, n_tokens: int, seed: int, start: int = 0, dtype=torch.float16):
    """Per layer (K, V) of positions start..start + n_tokens of the sequence named by
    `seed`: KV given at two starts of one seed joins up as one prefix's; another seed's
    differs everywhere."""
    kv = token_kv(seed_tokens(seed, start + n_tokens), shape, start)
    return kv if dtype == torch.float16 else [(k.to(dtype), v.to(dtype)) for k, v in kv]


def random_bits(seed: int, shape) -> torch.Tensor:
    """fp16 from random bit patterns, so NaN payloads, -0, inf and subnormals occur."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2 ** 15), 2 ** 15, tuple(shape), dtype=torch.int32, generator=g)
    return bits.to(torch.int16).view(torch.float16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.detach().cpu().view(torch.int16), b.detach().cpu().view(torch.int16)))


def load_chunks(store, entry, wanted: dict, node=None, ratios=None):
    """({kind: chunks}, bytes served per tier) of one layer file's chunks, loaded through
    the store's tiers as a request loads them."""
    from impress_flexgen.tiers import ChunkLoad

    return store.tiers.wait(store.tiers.submit(ChunkLoad(entry, wanted, ratios, node)))
