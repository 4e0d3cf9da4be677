"""The shared pool: prefix KV that serving processes on other machines (or other stores)
computed, in a remote tier, for the prefix tokens right after what the local store holds.

    given = pool.open(prefix, matched, stats)   # chunks the pool holds past `matched`
    given.start(layer)                          # fetch a layer ahead (background)
    k, v = given.kv(layer, device, dtype)       # that layer's KV of those tokens
    pool.publish(prefix, start, kv)             # after a local insert: write-through

The pool is keyed by the content of the prompt (chained hashes of its chunks), not by the
local radix tree, so any process serving the same model finds the same chunks. A chunk the
pool lost between the check and the fetch (evicted, corrupt, server gone) raises SharedMiss:
the request is served again without the pool, never with a hole in its prefix.
"""
from __future__ import annotations

import torch

from ..tiers.base import nbytes
from ..tiers.remote import RedisTier, RemoteNamespace, chunk_hashes


class SharedMiss(Exception):
    """A chunk the pool said it had could not be fetched whole and checked."""


class SharedPrefix:
    def __init__(self, tier: RedisTier, namespace: RemoteNamespace, tier_name: str):
        self.tier = tier
        self.namespace = namespace
        self.tier_name = tier_name
        self.chunk_size = namespace.chunk_size
        self.n_layers = namespace.n_layers

    def open(self, prefix, matched: int, stats, tenant: str = "") -> "GivenKV | None":
        """The run of whole chunks of `prefix` after token `matched` that the pool holds
        (None: none). `matched` is chunk-aligned (the local radix match)."""
        hashes = chunk_hashes(self.namespace, prefix)
        first = matched // self.chunk_size
        held = self.tier.batch_exists_chunks(hashes[first:]) if first < len(hashes) else 0
        if held == 0:
            return None
        stats.shared_tokens = held * self.chunk_size
        return GivenKV(self, hashes[first:first + held], stats)

    def publish(self, prefix, start: int, kv, tenant: str = "") -> int:
        """Queue the whole chunks of tokens [start, ...) for the pool; kv[layer] = (K, V) of
        those tokens, (kv_heads, n, head_dim). Returns chunks queued."""
        c = self.chunk_size
        n = kv[0][0].shape[1] // c * c if kv else 0
        if n == 0 or start % c:
            return 0
        hashes = chunk_hashes(self.namespace, prefix)
        dtype = self.namespace.torch_dtype
        return self.tier.publish(hashes, start // c,
                                 [(k[:, :n].to(dtype), v[:, :n].to(dtype)) for k, v in kv])


class GivenKV:
    """One request's KV from the pool: every layer of `hashes`' chunks, fetched a layer
    ahead of the compute that needs it."""

    def __init__(self, pool: SharedPrefix, hashes: list[bytes], stats):
        self.pool = pool
        self.hashes = hashes
        self.n_tokens = len(hashes) * pool.chunk_size
        self.stats = stats
        self.pending: dict[int, object] = {}

    def start(self, layer: int) -> None:
        if layer < self.pool.n_layers and layer not in self.pending:
            self.pending[layer] = self.pool.tier.submit_get([(h, layer) for h in self.hashes])

    def kv(self, layer: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of the given tokens at `layer`, each (kv_heads, n_tokens, head_dim)."""
        self.start(layer)
        chunks = self.pool.tier.wait(self.pending.pop(layer))
        if any(c is None for c in chunks):
            raise SharedMiss(f"layer {layer}: {sum(c is None for c in chunks)} of "
                             f"{len(chunks)} shared chunks could not be fetched")
        self.stats.bytes_read[self.pool.tier_name] += sum(nbytes(c) for c in chunks)
        both = torch.cat(chunks, dim=2).to(device, dtype)     # (2, kv_heads, n, head_dim)
        return both[0], both[1]

    def close(self) -> None:
        """Wait for fetches nobody will use."""
        for pending in self.pending.values():
            try:
                self.pool.tier.wait(pending)
            except Exception:  # noqa: BLE001 - nobody asked for these chunks
                pass
        self.pending.clear()


def shared_pool(url: str, store, dtype: torch.dtype) -> SharedPrefix:
    """The pool at `url` for the model and chunk size of `store` (KV kept as it is stored
    on disk: float16)."""
    from ..tiers.chain import REMOTE

    shape = store.shape
    namespace = RemoteNamespace(shape.name, shape.n_layers, shape.n_kv_heads, shape.head_dim,
                                "float16", store.config.chunk_size)
    return SharedPrefix(RedisTier(url, namespace, name=REMOTE), namespace, REMOTE)
