"""Deterministic prefixes and KV: any process can regenerate the expected bits.

    bits = expected_bits(tokens)                 # uint16, (layers, 2, heads, n, head_dim)
    kv = kv_from_bits(bits, start)               # per layer (K, V) fp16, positions start..
    kv = token_kv(tokens, shape, start)          # the same for any model shape

The value at position i is a function of tokens[:i + 1] (a rolling hash), as a model's KV
is: prefixes sharing leading tokens share that part of their KV exactly, and KV of one
prefix can never pass for another's. Every fp16 bit pattern but NaN/Inf occurs.
"""
from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from impress_flexgen.store import ModelShape, PrefixStore, StoreConfig

SHAPE = ModelShape("crash", n_layers=4, n_kv_heads=2, head_dim=32)
C = 16
FORMATS = ("int4", "fp16")
MAX_CHUNKS = 10
M64 = (1 << 64) - 1


def store_config(fmt: str, **kw) -> StoreConfig:
    base = dict(chunk_size=C, probe_heads=(0,) if fmt == "int4" else (0, 1),
                probe_format=fmt, reorder_interval=0, read_threads=2)
    base.update(kw)
    return StoreConfig(**base)


def _mix_int(x: int) -> int:
    """splitmix64 finalizer on a Python int."""
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=16)
def _grid(n_layers: int, n_kv_heads: int, head_dim: int) -> np.ndarray:
    return (np.arange(n_layers * 2 * n_kv_heads * head_dim, dtype=np.uint64)
            .reshape(n_layers, 2, n_kv_heads, 1, head_dim) * np.uint64(0x9E3779B97F4A7C15))


def expected_bits(tokens, shape=SHAPE) -> np.ndarray:
    """uint16 bits of fp16 KV (layers, 2, heads, n, head_dim) for every position of `tokens`;
    `shape`: anything with n_layers, n_kv_heads and head_dim."""
    toks = np.asarray(tokens, dtype=np.int64).tolist()
    h, hashes = 0x243F6A8885A308D3, np.empty(len(toks), dtype=np.uint64)
    for i, t in enumerate(toks):
        h = _mix_int(h ^ ((t + 1) * 0x100000001B3 + i))
        hashes[i] = h
    grid = _grid(shape.n_layers, shape.n_kv_heads, shape.head_dim)
    with np.errstate(over="ignore"):
        bits = (_mix(hashes[None, None, None, :, None] ^ grid) >> np.uint64(48)).astype(np.uint16)
    special = (bits & 0x7C00) == 0x7C00          # exponent all ones: Inf or NaN
    bits[special] &= np.uint16(0xBFFF)
    return bits


def kv_from_bits(bits: np.ndarray, start: int = 0, end: int | None = None):
    """Per layer (K, V) fp16 tensors of positions start..end."""
    t = torch.from_numpy(np.ascontiguousarray(bits[:, :, :, start:end]).view(np.float16))
    return [(t[layer, 0], t[layer, 1]) for layer in range(bits.shape[0])]


def token_kv(tokens, shape=SHAPE, start: int = 0, end: int | None = None):
    """Per layer (K, V) fp16 of `tokens`' positions start..end, for a model of `shape`."""
    return kv_from_bits(expected_bits(tokens, shape), start, end)


def insert_prefix(store: PrefixStore, tokens: np.ndarray) -> list:
    """Store `tokens`' regenerated KV past what is matched, as a request does; the path."""
    match = store.match_prefix(tokens)
    try:
        aligned = len(tokens) // C * C
        return store.insert(tokens, match.length,
                            kv_from_bits(expected_bits(tokens[:aligned]), match.length))
    finally:
        store.release(match)


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def digest(tokens) -> str:
    return hashlib.sha1(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:16]


class Prefixes:
    """Token ids of prefix p: a pure function of (seed, p); about 60% share leading chunks
    (some or all of them) with an earlier prefix, the rest are new."""

    def __init__(self, seed: int):
        self.seed = seed
        self._tokens: dict[int, np.ndarray] = {}

    def tokens(self, p: int) -> np.ndarray:
        if p not in self._tokens:
            rng = np.random.default_rng([self.seed, 7919, p])
            shared = np.zeros(0, dtype=np.int32)
            if p > 0 and rng.random() < 0.6:
                base = self.aligned(int(rng.integers(0, p)))
                n_base = len(base) // C
                k = int(rng.integers(1, n_base + 1))
                shared = base[:min(k, MAX_CHUNKS - 1) * C]
            room = MAX_CHUNKS - len(shared) // C
            n_new = int(rng.integers(1, min(room, 5) + 1)) * C + int(rng.integers(0, C))
            new = rng.integers(0, 1 << 20, size=n_new).astype(np.int32)
            self._tokens[p] = np.concatenate([shared, new]).astype(np.int32)
        return self._tokens[p]

    def aligned(self, p: int) -> np.ndarray:
        t = self.tokens(p)
        return t[:len(t) // C * C]
