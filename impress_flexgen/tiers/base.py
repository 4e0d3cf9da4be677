"""The tier interface: what every place that can hold a chunk's KV offers.

Tiers are listed fastest first (GPU memory, CPU memory, the local disk store, a remote
pool), in one place (`TierConfig`). A store's loads go through its `TierStack` (stack.py):
the memory chain, then the disk tier; the engine never names a tier. The remote pool is
asked separately, for whole chunks past the local match (store/shared.py). Every tier
answers the same questions:

    tier.contains(key)              is the chunk held here (no access counted)?
    tier.batch_exists(keys)         how many of `keys`, from the first, are held?
    pending = tier.submit_get(keys) start fetching them (may return before they arrive);
                                    a tier of stored layer files also takes a ChunkLoad
    tier.wait(pending)              the chunks, in order; None for a miss or a copy that
                                    failed its checksum (never wrong bytes)
    tier.put(key, tensor, crc)      offer a copy; False when refused (full, unwanted)
    tier.invalidate(keys)           drop these keys; returns how many copies went
    tier.metrics()                  counters: hits, misses, bytes_in, bytes_served, ...

A chunk is a tensor whose bytes are the KV of a run of tokens of one layer; the `crc` that
goes with it is the CRC-32 of its bytes (`payload_crc`), kept by the tier and checked before
it is served where the tier says so. A tier that cannot answer (a remote server down) answers
with misses and counts it; it never raises to the engine.
"""
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

try:  # libdeflate's CRC-32 through ctypes (no copy, GIL released), when the library loads
    from disk_layout.io import _crc32_at
except ImportError:  # pragma: no cover - disk_layout ships with this package
    _crc32_at = None

ChunkKey = Hashable


def chunk_key(entry, kind: str, index: int) -> tuple:
    """A stored chunk's key in every tier: (node_id, layer, version, kind, chunk) of a
    store's layer entry; it names immutable bytes (node ids are never reused, a rewrite
    bumps the version)."""
    return (entry.node_id, entry.layer, entry.version, kind, index)


@dataclasses.dataclass
class ChunkLoad:
    """What a load asks the tiers for: chunks of one stored layer file. `entry`: the
    store's LayerEntry (which file, which version); `wanted`: {kind: chunk ids} in asked
    order; `ratios`: per kind each chunk's important-token ratio (None: 0), which ranks
    it in the memory tiers; `node`: the radix node holding the entry, when the caller
    holds it (a failed check is then raised for it, not quarantined behind its back)."""

    entry: Any
    wanted: dict
    ratios: dict | None = None
    node: Any = None

    def __post_init__(self) -> None:
        self.wanted = {kind: [int(i) for i in ids] for kind, ids in self.wanted.items()}

    def keys(self) -> list[tuple]:
        """Every chunk's key, in asked order (kinds in turn)."""
        return [chunk_key(self.entry, kind, i) for kind, ids in self.wanted.items()
                for i in ids]

    def flat_ratios(self) -> list[float]:
        if self.ratios is None:
            return [0.0] * sum(len(ids) for ids in self.wanted.values())
        return [float(x) for kind in self.wanted for x in self.ratios[kind]]


@runtime_checkable
class Tier(Protocol):
    name: str

    def contains(self, key: ChunkKey) -> bool: ...

    def batch_exists(self, keys: Sequence[ChunkKey]) -> int: ...

    def submit_get(self, keys: Sequence[ChunkKey] | ChunkLoad) -> Any: ...

    def wait(self, pending: Any) -> list[torch.Tensor | None]: ...

    def put(self, key: ChunkKey, tensor: torch.Tensor, crc: int | None = None) -> bool: ...

    def invalidate(self, keys: Sequence[ChunkKey]) -> int: ...

    def metrics(self) -> dict: ...


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def payload_crc(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's contiguous bytes (zlib's polynomial; device tensors via the host)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    n = nbytes(t)
    if n == 0:
        return 0
    if _crc32_at is not None:
        return int(_crc32_at(0, t.data_ptr(), n))
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) & 0xFFFFFFFF
