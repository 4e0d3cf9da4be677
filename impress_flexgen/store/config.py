"""What a store is made for and how it behaves: its model shape, its settings (its errors
are errors.py's: the disk tier raises them too)."""
from __future__ import annotations

import dataclasses
import hashlib
import json

from disk_layout.format import (KV_FORMATS, LEGACY_KV_FORMAT, kv_bytes,
                                kv_dtype_name, kv_format_fits)

from ..errors import UserError

STORE_FORMAT = "impress_flexgen-prefix-store"


# Version of what a stored chunk's bytes mean (the layer file layout and how a chunk's
# tokens are laid out; the KV format is named beside it): part of every store identity.
LAYOUT_VERSION = 2

# Version of how an exact policy computes the prefix rows a store keeps (the canonical
# tiles of engine/attention.py): KV computed in other calls differs in its last bits, so
# it is another identity. 2: attention tiles of 64 positions.
ROWS_VERSION = 2


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a store's KV belongs to; a store refuses KV of another shape or identity.

    `fingerprint` says which weights computed the KV (model_fingerprint()); "" only for
    shapes made by hand (benchmarks, tests), which then share nothing with a real model's.
    `kv_format`: how the store keeps K and V (disk_layout.format.KV_FORMATS); `kv_exact`:
    whether that gives back the computed values bit for bit (the format holds the compute
    dtype). A store of an inexact format serves no exact reader."""

    name: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    fingerprint: str = ""
    kv_format: str = LEGACY_KV_FORMAT
    kv_exact: bool = True

    def __post_init__(self):
        if self.kv_format not in KV_FORMATS:
            raise UserError(f"unknown KV format {self.kv_format!r}; choose from "
                            f"{', '.join(KV_FORMATS)}")
        if not kv_format_fits(self.kv_format, self.head_dim):
            raise UserError(f"{self.kv_format} KV needs a head size that is a multiple of "
                            f"4; {self.name} has {self.head_dim}")

    def chunk_bytes(self, chunk_size: int) -> int:
        """Stored bytes of one chunk's K (or V) of one layer."""
        return kv_bytes(self.kv_format, self.n_kv_heads * chunk_size * self.head_dim)

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """Stored bytes of one token's K and V in one layer."""
        return 2 * kv_bytes(self.kv_format, self.n_kv_heads * self.head_dim)

    @property
    def short_id(self) -> str:
        """The fingerprint's first 12 hex digits (names of default store folders)."""
        return self.fingerprint[:12]


def model_fingerprint(weights_digest: str, compute_dtype: str, chunk_size: int,
                      kv_format: str = LEGACY_KV_FORMAT, layout: int = LAYOUT_VERSION) -> str:
    """The identity of stored KV: the same only for the same weights (content, not name),
    computed in the same dtype and the same calls, stored in the same format, chunk size
    and layout."""
    # Formats that are a dtype are named by it, as before stores had other formats: an fp16
    # store keeps the identity it had.
    kv = kv_dtype_name(kv_format) if kv_format in KV_FORMATS else kv_format
    text = json.dumps({"weights": weights_digest, "compute_dtype": compute_dtype,
                       "kv_dtype": kv, "chunk_size": int(chunk_size),
                       "layout": int(layout), "rows": ROWS_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def namespace_key(namespace: str) -> str:
    """What a store keeps of a request's namespace (its tenant): a digest, so that an API
    key never sits in the database; "" for the shared namespace."""
    if not isinstance(namespace, str):
        raise TypeError("a namespace is a string")
    if namespace == "":
        return ""
    return hashlib.sha256(b"impress_flexgen-namespace\0" +
                          namespace.encode("utf-8", "surrogatepass")).hexdigest()[:32]


# Tokens per stored chunk, everywhere a chunk size is not given (run, serve, request files,
# the library): small chunks let whole-chunk selection follow importance closely.
CHUNK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    chunk_size: int = CHUNK_SIZE
    probe_heads: tuple[int, ...] = (0,)     # KV heads whose keys are copied for probing
    probe_format: str = "int4"             # "fp16" (the paper) or "int4"
    disk_capacity_bytes: int | None = None
    eviction: str = "score"                # "score" (hits) or "lru"
    reorder_interval: int = 50             # queries between background reorders; 0: never
    reorder_keep_ends: bool = True         # keep the sink chunk and the last chunk in place
    # Share of a node's tokens (the most important) packed into the leading chunks; the
    # rest keep their positional order. 1.0 sorts every token by importance: tokens no past
    # query attended to are then scattered by noise, and a later query needing a phrase
    # nobody asked for before (a passkey) finds it spread over many chunks.
    reorder_hot_fraction: float = 0.25
    # What a reorder groups into chunks: "importance" (accumulated by queries, above) or
    # "semantic": tokens with similar keys share a chunk (balanced k-means over the layer's
    # keys, chunk-sized clusters), a query-agnostic layout done once per node, so that a
    # query's relevant tokens sit in few chunks (IceCache's semantic pages, on disk).
    reorder_by: str = "importance"
    direct_io: bool = True
    read_threads: int = 4
    # Disk read bandwidth cap in MB/s (a token bucket in the reader; None: none): lets a
    # CPU machine reproduce a GPU machine's ratio of compute to I/O.
    read_limit_mb_s: float | None = None
    packed: bool | None = None             # chunk layout (disk_layout.format); None: by size
    # Files of quarantined nodes are kept for inspection up to this many bytes (oldest go
    # first): a disk that keeps failing must not fill up with evidence.
    quarantine_bytes: int = 256 << 20
    # Without a capacity the file system's free space is the limit: inserts evict before
    # they would leave less than this free, so that the metadata database (whose log grows
    # by up to about 4 MiB between checkpoints) can always record an insert or an eviction.
    disk_headroom_bytes: int = 8 << 20

    def __post_init__(self):
        if not 16 <= self.chunk_size <= 256 or self.chunk_size % 8:
            raise UserError("chunk size must be a multiple of 8 between 16 and 256")
        if self.probe_format not in ("fp16", "int4"):
            raise UserError("probe format must be fp16 or int4")
        if self.eviction not in ("score", "lru"):
            raise UserError("disk eviction must be score or lru")
        if not 0 < self.reorder_hot_fraction <= 1:
            raise UserError("reorder hot fraction must be in (0, 1]")
        if self.reorder_by not in ("importance", "semantic"):
            raise UserError("reorder_by must be importance or semantic")
        if self.reorder_interval < 0:
            raise UserError("reorder interval must be 0 (never) or a positive query count")
        if self.disk_capacity_bytes is not None and self.disk_capacity_bytes < 0:
            raise UserError("disk capacity must not be negative")
        if self.read_limit_mb_s is not None and not self.read_limit_mb_s > 0:
            raise UserError("disk read limit must be a positive number of MB/s")
        if self.quarantine_bytes < 0:
            raise UserError("quarantine bytes must not be negative")
        if self.disk_headroom_bytes < 0:
            raise UserError("disk headroom must not be negative")
