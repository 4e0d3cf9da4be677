"""The memory tiers (a `ChunkCache`: GPU, then CPU) as one `Tier`, the first of a TierStack.

    chain = MemoryChain(ChunkCache(TierConfig(gpu_bytes=..., cpu_bytes=...)))
    pending = chain.submit_get(keys, ratios)   # memory answers at once: counts an access
    chunks = chain.wait(pending)               # tensors or None; pending.served_by: tier names
    chain.put(key, tensor, crc, ratio)         # admit a copy read from below

Lookups and admissions keep the chain's score-ranked min-heaps, promotion to the first
tier and demotion down the chain (chain.py); `ratios` (each chunk's important-token ratio)
feed the score. The chain's own counters count a key once (a hit in any tier, or a miss in
all), beside each tier's counters (`metrics()["tiers"]`).
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import torch

from .base import ChunkKey, nbytes
from .chain import ChunkCache

COUNTERS = ("hits", "misses", "bytes_in", "bytes_served")


@dataclasses.dataclass
class MemoryGet:
    """What submit_get returns: the answers, and which tier served each (None: a miss)."""

    chunks: list
    served_by: list


class MemoryChain:
    """A ChunkCache through the Tier protocol."""

    name = "memory"
    writable = True

    def __init__(self, cache: ChunkCache) -> None:
        self.cache = cache
        self._mu = threading.Lock()
        self.counters = dict.fromkeys(COUNTERS, 0)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return self.cache.tier_names

    # ------------------------------------------------------------------ the Tier protocol
    def contains(self, key: ChunkKey) -> bool:
        """Held by some memory tier (no access counted)."""
        return self.cache.resident(key) is not None

    def batch_exists(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    def submit_get(self, keys: Sequence[ChunkKey], ratios: Sequence[float] | None = None
                   ) -> MemoryGet:
        """Look each key up, fastest tier first, counting one access scored with its ratio
        (0 when none is given); a hit below the first tier may be promoted."""
        chunks: list[torch.Tensor | None] = []
        served_by: list[str | None] = []
        hits = served = 0
        for j, key in enumerate(keys):
            hit = self.cache.get(key, 0.0 if ratios is None else float(ratios[j]))
            if hit is None:
                chunks.append(None)
                served_by.append(None)
                continue
            served_by.append(hit[0])
            chunks.append(hit[1])
            hits += 1
            served += nbytes(hit[1])
        self._count(hits=hits, misses=len(chunks) - hits, bytes_served=served)
        return MemoryGet(chunks, served_by)

    def wait(self, pending: MemoryGet) -> list[torch.Tensor | None]:
        """The tiers' own copies: do not change them."""
        return list(pending.chunks)

    def put(self, key: ChunkKey, tensor: torch.Tensor, crc: int | None = None,
            ratio: float = 0.0) -> bool:
        """Admit a copy (read from a lower tier) where its score earns a place; True when a
        memory tier holds the key after."""
        held = self.contains(key)
        taken = self.cache.admit(key, tensor, ratio, crc=crc) is not None
        if taken and not held:
            self._count(bytes_in=nbytes(tensor))
        return taken

    def invalidate(self, keys: Sequence[ChunkKey]) -> int:
        """Drop these keys' copies; they may be admitted again. Returns how many of the
        keys the chain held (a chunk held by two tiers counts once)."""
        return self.cache.forget(list(keys))

    def metrics(self) -> dict:
        with self._mu:
            out: dict = dict(self.counters)
        out["tiers"] = self.cache.metrics
        return out

    # ------------------------------------------------------------------ the store's removals
    def invalidate_node(self, node_id) -> int:
        """Every copy of a radix node, refused from now on (chain.py's tombstones)."""
        return self.cache.invalidate(node_id)

    def invalidate_version(self, node_id, layer: int, version: int) -> int:
        return self.cache.invalidate_version(node_id, layer, version)

    def _count(self, **deltas: int) -> None:
        with self._mu:
            for name, n in deltas.items():
                self.counters[name] += n
