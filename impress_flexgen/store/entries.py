"""What the store knows of each (node, layer): its file version, its learned importance,
and the store's counters."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from disk_layout.format import LayerFileLayout

@dataclasses.dataclass(frozen=True)
class LayerEntry:
    """One version of one (node, layer): which file, how its tokens are ordered."""

    node_id: int
    layer: int
    version: int
    path: str
    layout: LayerFileLayout
    mapping: np.ndarray | None   # physical position -> logical position; None: identity
    crcs: np.ndarray             # probe, K chunks..., V chunks...

    def crc(self, kind: str, index: int) -> int:
        return int(self.chunk_crcs(kind, np.asarray([index]))[0])

    def chunk_crcs(self, kind: str, ids: np.ndarray) -> np.ndarray:
        """CRC-32s of chunks `ids` of K or V (the probe section's comes first)."""
        return self.crcs[1 + ids + (0 if kind == "k" else self.layout.n_chunks)]

    @functools.cached_property
    def physical_of(self) -> np.ndarray | None:
        """logical position -> physical position (mapping's inverse); None: identity.
        Kept: every request over this version needs it on every layer."""
        return None if self.mapping is None else np.argsort(self.mapping)

    def logical_positions(self, chunk_ids) -> np.ndarray:
        """Logical token positions held by the given physical chunks, chunk after chunk."""
        c = self.layout.chunk_size
        phys = (np.asarray(chunk_ids)[:, None] * c + np.arange(c)[None, :]).reshape(-1)
        return phys if self.mapping is None else self.mapping[phys]

    def physical_chunks_of(self, logical: np.ndarray) -> np.ndarray:
        """Sorted physical chunk ids holding the given logical positions."""
        phys = logical if self.mapping is None else self.physical_of[logical]
        return np.unique(phys // self.layout.chunk_size)


@dataclasses.dataclass
class LayerStats:
    """Soft state of one (node, layer): what selection has learned about its tokens."""

    importance: np.ndarray       # float32 per logical token, accumulated over queries
    bitmaps: np.ndarray          # uint8 (n_chunks, C/8): tokens selected last time, physical
    access: np.ndarray           # uint16 per physical chunk
    ratio: np.ndarray            # uint8 per physical chunk: important fraction * 255
    dirty: bool = False          # importance changed since the last reorder

    @classmethod
    def fresh(cls, n_tokens: int, chunk_size: int) -> "LayerStats":
        n_chunks = n_tokens // chunk_size
        return cls(np.zeros(n_tokens, np.float32), np.zeros((n_chunks, chunk_size // 8), np.uint8),
                   np.zeros(n_chunks, np.uint16), np.zeros(n_chunks, np.uint8))

    def relayout(self, old_mapping: np.ndarray | None, new_mapping: np.ndarray) -> None:
        """The node's tokens moved (a reorder): carry the last selection over to the new
        physical order (it predicts the next one); access counts start again."""
        c = self.bitmaps.shape[1] * 8
        logical = np.unpackbits(self.bitmaps, axis=1).reshape(-1).astype(bool)
        if old_mapping is not None:          # physical p held logical old_mapping[p]
            logical[old_mapping] = logical.copy()
        per_chunk = logical[new_mapping].reshape(-1, c)
        self.bitmaps[:] = np.packbits(per_chunk, axis=1)
        self.ratio[:] = np.round(per_chunk.mean(axis=1) * 255).astype(np.uint8)
        self.access[:] = 0


@dataclasses.dataclass
class StoreMetrics:
    chunks_read: int = 0          # from disk
    bytes_read: int = 0           # from disk, padding included
    probe_bytes_read: int = 0
    bytes_needed: int = 0         # bytes of the tokens a request actually needed
    reorders: int = 0
    splits: int = 0
    evictions: int = 0
    corruptions: int = 0          # CRC mismatches and read errors of stored files
    invalid_rows: int = 0         # metadata rows that failed their checks on open
    quarantined_nodes: int = 0
    inserts: int = 0
    insert_retries: int = 0       # inserts redone because the tree changed meanwhile
    superseded: int = 0           # inexact nodes removed for exact KV of the same tokens

    @property
    def read_amplification(self) -> float:
        return (self.bytes_read + self.probe_bytes_read) / self.bytes_needed \
            if self.bytes_needed else 0.0
