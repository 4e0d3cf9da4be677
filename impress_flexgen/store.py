"""The prefix KV store: chunked files on disk, a radix tree in SQLite, copy-on-write reorders.

A request's life in the store:

    match = store.match_prefix(tokens)          # longest chunk-aligned prefix, locked
    for layer in range(n_layers):
        entry = store.entry(node, layer)        # one immutable version of (node, layer)
        probe = store.read_probe(entry)         # probe heads' keys, physical order
        k = store.load_chunks(entry, "k", ids)  # GPU tier -> CPU tier -> disk, CRC checked
        store.record_selection(entry, ...)      # importance feeds reorder and the tiers
    store.insert(tokens, match.length, kv)      # the newly computed prefix part
    store.release(match)

Writers fsync data before the metadata transaction that makes it visible; files no
committed row references are removed when the store is opened. A reorder writes a new
version of a layer and switches the metadata in one transaction; readers holding the old
entry keep reading the old file, which is deleted once no request has its node locked.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import logging
import math
import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from disk_layout.format import (ALIGN, LayerFileLayout, align_up, chunk_payload, crc32,
                                decode_probe, encode_probe, packed_by_default,
                                probe_supported)
from disk_layout.io import DiskReader, ShortRead, write_durable
from disk_layout.metadata import SCHEMA_VERSION, LayerRow, Metadata

from .errors import UserError
from .radix import PrefixMatch, RadixNode, RadixTree

log = logging.getLogger("impress_flexgen.store")
STORE_FORMAT = "impress_flexgen-prefix-store"


class CorruptNode(Exception):
    """A chunk or probe section failed its CRC, or its file is short or missing."""

    def __init__(self, node: RadixNode, detail: str):
        super().__init__(f"node {node.id}: {detail}")
        self.node = node


class StoreFull(Exception):
    """No room for new KV even after evicting every unlocked leaf."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a store's KV belongs to; a store refuses KV of another shape."""

    name: str
    n_layers: int
    n_kv_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    chunk_size: int = 64
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
    packed: bool | None = None             # chunk layout (disk_layout.format); None: by size

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
    corruptions: int = 0
    inserts: int = 0

    @property
    def read_amplification(self) -> float:
        return (self.bytes_read + self.probe_bytes_read) / self.bytes_needed \
            if self.bytes_needed else 0.0


@dataclasses.dataclass
class _ProbeRead:
    """A probe section in flight (PrefixStore.start_probe)."""

    entry: LayerEntry
    node: object
    handle: object


@dataclasses.dataclass
class _ChunkRead:
    """Chunk reads of one layer file in flight (PrefixStore._start_chunks): the ids asked
    for per kind, and, when anything is read, the reads sorted by offset."""

    entry: LayerEntry
    node: object
    ids_of: dict
    kinds: list = dataclasses.field(default_factory=list)   # per chunk read, in asked order
    all_ids: np.ndarray | None = None
    order: np.ndarray | None = None                         # j-th read by offset: its asked index
    assemble: object = None                                 # runs -> chunk tensors
    nbytes: int = 0
    handle: object = None


@dataclasses.dataclass
class _KVLoad:
    """A load through the tiers in flight (PrefixStore.start_kv_chunks)."""

    entry: LayerEntry
    served: dict
    out: dict = dataclasses.field(default_factory=dict)     # kind -> chunks, asked order
    misses: dict = dataclasses.field(default_factory=dict)  # kind -> [(slot, id, ratio)]
    read: _ChunkRead | None = None


class PrefixStore:
    def __init__(self, directory: str | os.PathLike, shape: ModelShape,
                 config: StoreConfig = StoreConfig(), cache=None):
        self.dir = Path(directory)
        self.shape = shape
        self.config = config
        self.cache = cache  # tiers.ChunkCache or None
        chunk_bytes = shape.n_kv_heads * config.chunk_size * shape.head_dim * 2
        self.packed = packed_by_default(chunk_bytes) if config.packed is None else config.packed
        if any(h >= shape.n_kv_heads for h in config.probe_heads):
            raise UserError(f"probe heads {config.probe_heads} exceed {shape.n_kv_heads} KV heads")
        self._check_directory()
        self.data_dir = self.dir / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock_directory()
        self.lock = threading.RLock()
        self._reorder_lock = threading.Lock()
        self.metrics = StoreMetrics()
        self.tree = RadixTree(config.chunk_size)
        self.stats: dict[tuple[int, int], LayerStats] = {}
        self.queries = 0
        self.meta = None
        try:
            self.meta = Metadata(str(self.dir / "store.sqlite"))
            self._init_meta()
            self._recover()
        except BaseException:
            if self.meta is not None:
                self.meta.close()
            os.close(self._lock_fd)
            raise
        self.reopened = len(self.tree) > 0
        self.reader = DiskReader(config.read_threads, config.direct_io)
        self._reorder = ReorderEngine(self) if config.reorder_interval > 0 else None
        self._closed = False

    # -- opening ------------------------------------------------------------------------
    def _check_directory(self) -> None:
        if self.dir.exists() and not self.dir.is_dir():
            raise UserError(f"store directory {self.dir} is a file")
        if self.dir.is_dir() and any(self.dir.iterdir()) and \
                not (self.dir / "store.sqlite").exists():
            raise UserError(f"{self.dir} is not empty and holds no impress_flexgen store; "
                            "choose another --store-dir")
        self.dir.mkdir(parents=True, exist_ok=True)

    def _lock_directory(self) -> int:
        fd = os.open(self.dir / "store.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"store {self.dir} is in use by another process") from None
        return fd

    def _init_meta(self) -> None:
        want = {"format": STORE_FORMAT, "schema": SCHEMA_VERSION,
                "model": dataclasses.asdict(self.shape), "chunk_size": self.config.chunk_size,
                "probe_heads": list(self.config.probe_heads),
                "probe_format": self.config.probe_format, "packed": self.packed}
        have = self.meta.get_meta()
        if not have:
            self.meta.set_meta(want)
            return
        if have.get("format") != STORE_FORMAT:
            raise UserError(f"{self.dir} holds a database that is not an impress_flexgen store")
        have.setdefault("packed", False)      # stores from before the packed layout
        for key in ("schema", "model", "chunk_size", "probe_heads", "probe_format", "packed"):
            if have.get(key) != want[key]:
                raise UserError(f"store {self.dir} was made with {key}={have.get(key)}, "
                                f"not {want[key]}; use another --store-dir")

    def _recover(self) -> None:
        """Load the tree from committed rows; delete files no committed row references."""
        referenced = self.meta.referenced_files()
        removed = 0
        for f in self.data_dir.iterdir():
            if f.name not in referenced:
                f.unlink()
                removed += 1
        if removed:
            log.info("removed %d uncommitted files from %s", removed, self.data_dir)
        pending: dict[int | None, list[RadixNode]] = {}
        for nid, parent, start, tokens, hits, last in self.meta.nodes():
            node = RadixNode(nid, None, start, tokens.copy(), hits=hits, last_access=last)
            rows = self.meta.layers(nid, len(tokens))
            if len(rows) != self.shape.n_layers:
                continue  # cannot happen after a committed insert; skip defensively
            node.layers = [self._entry(row, len(tokens)) for row in rows]
            for row in rows:
                self.stats[(nid, row.layer)] = self._stats_from_row(row, len(tokens))
            pending.setdefault(parent, []).append(node)
        # Attach parents before children (ids grow with insertion, but splits re-parent).
        frontier = [None]
        while frontier:
            parent_id = frontier.pop()
            for node in pending.pop(parent_id, []):
                node.parent = self.tree.nodes.get(parent_id) if parent_id else None
                self.tree.attach(node)
                frontier.append(node.id)

    def _layout(self, n_tokens: int) -> LayerFileLayout:
        return LayerFileLayout(n_tokens, self.config.chunk_size, self.shape.n_kv_heads,
                               self.shape.head_dim, len(self.config.probe_heads),
                               self.config.probe_format, self.packed)

    def _entry(self, row: LayerRow, n_tokens: int) -> LayerEntry:
        return LayerEntry(row.node, row.layer, row.version, str(self.data_dir / row.file),
                          self._layout(n_tokens), row.mapping, row.crcs)

    def _stats_from_row(self, row: LayerRow, n_tokens: int) -> LayerStats:
        stats = LayerStats.fresh(n_tokens, self.config.chunk_size)
        if row.importance is not None and len(row.importance) == n_tokens:
            stats.importance[:] = row.importance
            stats.bitmaps[:] = row.bitmaps.reshape(stats.bitmaps.shape)
            stats.access[:] = row.access
            stats.ratio[:] = row.ratio
        return stats

    # -- matching -----------------------------------------------------------------------
    def match_prefix(self, tokens) -> PrefixMatch:
        """Longest chunk-aligned stored prefix of `tokens`, locked until release()."""
        with self.lock:
            match = self.tree.match_prefix(tokens)
            self.tree.lock(match)
            now = time.time()
            for node in match.nodes:
                node.hits += 1
                node.last_access = now
            return match

    def release(self, match: PrefixMatch) -> None:
        with self.lock:
            for node in self.tree.unlock(match):
                self._delete_retired(node)
            self.queries += 1
        if self._reorder is not None:
            self._reorder.note_query()

    def entry(self, node: RadixNode, layer: int) -> LayerEntry:
        return node.layers[layer]

    def layer_stats(self, entry: LayerEntry) -> LayerStats:
        return self.stats[(entry.node_id, entry.layer)]

    # -- reading ------------------------------------------------------------------------
    def _node(self, node, entry: LayerEntry) -> RadixNode:
        if isinstance(node, RadixNode):
            return node
        return self.tree.nodes.get(entry.node_id) or RadixNode(entry.node_id, None, 0,
                                                               np.zeros(0, np.int32))

    def read_probe(self, entry: LayerEntry, node=None) -> torch.Tensor:
        """The probe heads' keys for every token of the node, float32, physical order."""
        return self.finish_probe(self.start_probe(entry, node))

    def start_probe(self, entry: LayerEntry, node=None) -> "_ProbeRead":
        """Start reading the probe section (on the reader threads); finish_probe() waits,
        checks and decodes it. Lets a caller read the next layer's probe while it computes."""
        lay = entry.layout
        handle = self._submit(entry, node, [(0, lay.probe_stride)],
                              [(lay.probe_bytes, int(entry.crcs[0]))])
        return _ProbeRead(entry, node, handle)

    def finish_probe(self, pending: "_ProbeRead") -> torch.Tensor:
        entry, lay = pending.entry, pending.entry.layout
        (run,) = self._wait(entry, pending.node, pending.handle,
                            lambda _: f"probe keys of layer {entry.layer}: CRC mismatch")
        self.metrics.probe_bytes_read += lay.probe_stride
        return decode_probe(run.data[:lay.probe_bytes], lay.probe_format,
                            (lay.n_probe, lay.n_tokens, lay.head_dim))

    def _submit(self, entry: LayerEntry, node, extents, checks):
        """Start reads of `entry`'s file; a missing file raises CorruptNode."""
        try:
            return self.reader.submit(entry.path, extents, checks)
        except FileNotFoundError as exc:
            raise CorruptNode(self._node(node, entry), f"{entry.path}: {exc}") from None

    def _wait(self, entry: LayerEntry, node, handle, describe):
        """The runs of a _submit(), read and CRC-checked; a mismatch (described by
        describe(extent index)), a short file or a missing one raises CorruptNode."""
        from disk_layout.io import ChecksumMismatch

        try:
            return self.reader.wait(handle)
        except ChecksumMismatch as exc:
            raise CorruptNode(self._node(node, entry), describe(exc.index)) from None
        except (ShortRead, FileNotFoundError) as exc:
            raise CorruptNode(self._node(node, entry), f"{entry.path}: {exc}") from None

    def read_chunks(self, entry: LayerEntry, kind: str, chunk_ids, node=None) -> list[torch.Tensor]:
        """Physical chunks from disk (coalesced, CRC-checked): (heads, C, head_dim) fp16 each.

        The tensors are views of the buffers the reads landed in (no copy): writable, and
        each keeps its run of adjacent chunks in memory while it lives (the tiers copy).
        """
        return self._read_chunks(entry, kind, chunk_ids, node)[0]

    def _read_chunks(self, entry: LayerEntry, kind: str, chunk_ids, node=None
                     ) -> tuple[list[torch.Tensor], int]:
        """read_chunks() and the bytes read from disk for them (padding included)."""
        chunks, nbytes = self._finish_chunks(self._start_chunks(entry, {kind: chunk_ids}, node))
        return chunks[kind], nbytes

    def _start_chunks(self, entry: LayerEntry, wanted: dict, node=None) -> "_ChunkRead":
        """Submit reads of chunks of several kinds ({"k": ids, "v": ids}) of one layer file,
        all in flight together (one round trip to the disk, not one per kind);
        _finish_chunks() waits for them."""
        lay = entry.layout
        ids_of = {kind: np.asarray([int(i) for i in chunk_ids], dtype=np.int64)
                  for kind, chunk_ids in wanted.items()}
        for ids in ids_of.values():
            if len(ids) and (ids.min() < 0 or ids.max() >= lay.n_chunks):
                raise IndexError(f"chunk ids outside 0..{lay.n_chunks - 1}")
        read = _ChunkRead(entry, node, ids_of)
        if not any(len(ids) for ids in ids_of.values()):
            return read
        read.kinds = [kind for kind, ids in ids_of.items() for _ in ids]
        read.all_ids = np.concatenate(list(ids_of.values()))
        offs = np.concatenate([lay.chunk_offset(k, 0) + ids * lay.chunk_stride
                               for k, ids in ids_of.items()])
        crcs = np.concatenate([entry.chunk_crcs(k, ids) for k, ids in ids_of.items()])
        read.order = np.argsort(offs, kind="stable")
        plan = self._plan_packed if lay.packed else self._plan_aligned
        extents, checks, read.assemble, read.nbytes = plan(entry, offs[read.order],
                                                           crcs[read.order])
        read.handle = self._submit(entry, node, extents, checks)
        return read

    def _finish_chunks(self, read: "_ChunkRead") -> tuple[dict[str, list[torch.Tensor]], int]:
        if read.handle is None:
            return {kind: [] for kind in read.ids_of}, 0

        def describe(j: int) -> str:
            self.metrics.corruptions += 1
            i = int(read.order[j])
            return (f"layer {read.entry.layer} {read.kinds[i].upper()} chunk "
                    f"{int(read.all_ids[i])}: CRC mismatch")

        runs = self._wait(read.entry, read.node, read.handle, describe)
        unsorted: list[torch.Tensor] = [None] * len(read.order)  # type: ignore[list-item]
        for i, chunk in zip(read.order.tolist(), read.assemble(runs)):
            unsorted[i] = chunk
        out, at = {}, 0
        for kind, ids in read.ids_of.items():
            out[kind] = unsorted[at:at + len(ids)]
            at += len(ids)
        self.metrics.chunks_read += len(read.all_ids)
        self.metrics.bytes_read += read.nbytes
        return out, read.nbytes

    def _plan_aligned(self, entry: LayerEntry, offs, crcs):
        """Page-aligned layout: every chunk is whole pages, runs of them are single reads.
        offs: sorted chunk offsets. Returns (extents, checks, assemble(runs), bytes)."""
        from disk_layout.io import Extents

        lay = entry.layout
        stride = lay.chunk_stride
        shape = (lay.n_kv_heads, lay.chunk_size, lay.head_dim)

        def assemble(runs) -> list[torch.Tensor]:
            chunks: list[torch.Tensor] = []
            for run in runs:
                m = len(run.members)
                payload = run.data.view(m, stride)[:, :lay.chunk_bytes].view(torch.float16)
                chunks.extend(payload.view(m, *shape).unbind(0))
            return chunks

        return Extents(offs, stride, lay.chunk_bytes, crcs), None, assemble, len(offs) * stride

    def _plan_packed(self, entry: LayerEntry, offs, crcs):
        """Packed layout: each run of adjacent chunks is read as the pages it touches.
        offs: sorted chunk offsets. Returns (extents, checks, assemble(runs), bytes)."""
        from disk_layout.io import MAX_RUN_BYTES

        lay = entry.layout
        size = lay.chunk_bytes
        breaks = np.flatnonzero(offs[1:] != offs[:-1] + size) + 1
        bounds = [0, *breaks.tolist(), len(offs)]
        per_run = max(1, MAX_RUN_BYTES // size)
        groups, extents = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            for g0 in range(a, b, per_run):
                g1 = min(g0 + per_run, b)
                # A run may share its first page with the previous run (chunks smaller
                # than a page): that page is read twice, in separate buffers.
                lo = int(offs[g0]) // ALIGN * ALIGN
                hi = align_up(int(offs[g1 - 1]) + size)
                groups.append((g0, g1))
                extents.append((lo, hi - lo))
        # CRCs are checked by the reader threads as each run lands.
        checks = [[(int(offs[j]) - lo, size, int(crcs[j]), j) for j in range(g0, g1)]
                  for (g0, g1), (lo, _) in zip(groups, extents)]
        shape = (lay.n_kv_heads, lay.chunk_size, lay.head_dim)

        def assemble(runs) -> list[torch.Tensor]:
            chunks: list[torch.Tensor] = []
            for run in runs:
                for i in run.members:
                    # One view per group of adjacent chunks (slices of the run's buffer, so
                    # the buffer pool sees them), split into chunks.
                    g0, g1 = groups[i]
                    start = int(offs[g0]) - run.offset
                    span = run.data[start:start + (g1 - g0) * size]
                    chunks.extend(span.view(torch.float16).view(g1 - g0, *shape).unbind(0))
            return chunks

        return extents, checks, assemble, sum(length for _, length in extents)

    def load_chunks(self, entry: LayerEntry, kind: str, chunk_ids, node=None,
                    ratios=None) -> tuple[list[torch.Tensor], dict[str, int]]:
        """Chunks through the tiers: GPU cache, then CPU cache, then disk (admitted after).

        Returns the chunks (on the GPU tier's device when they came from it, else host
        memory) and bytes served per tier {"gpu", "cpu", "disk"}, and "disk_chunks".
        """
        chunks, served = self.load_kv_chunks(entry, {kind: chunk_ids}, node,
                                             None if ratios is None else {kind: ratios})
        return chunks[kind], served

    def load_kv_chunks(self, entry: LayerEntry, wanted: dict, node=None, ratios=None
                       ) -> tuple[dict[str, list[torch.Tensor]], dict[str, int]]:
        """load_chunks() for several kinds at once ({"k": ids, "v": ids}, ratios per id of
        each): what the tiers miss is read from disk in one round trip."""
        return self.finish_kv_chunks(self.start_kv_chunks(entry, wanted, node, ratios))

    def start_prefetch(self, entry: LayerEntry, wanted: dict, node=None) -> "_ChunkRead":
        """Start reading chunks a load is expected to ask for soon ({"k": ids, "v": ids}),
        except those a tier holds. Tiers see nothing until the load: start_kv_chunks(...,
        ahead=finish_prefetch(...)[0]) then counts hits and misses and admits as if it had
        read the misses itself. Every start must be finished."""
        if self.cache is not None:
            wanted = {kind: [int(i) for i in ids
                             if self.cache.resident(self._key(entry, kind, int(i))) is None]
                      for kind, ids in wanted.items()}
        return self._start_chunks(entry, wanted, node)

    def finish_prefetch(self, read: "_ChunkRead") -> tuple[dict[str, dict[int, torch.Tensor]], int]:
        """Wait for a prefetch: ({kind: {chunk id: chunk}}, bytes read from disk)."""
        chunks, nbytes = self._finish_chunks(read)
        return {kind: dict(zip(read.ids_of[kind].tolist(), chunks[kind]))
                for kind in read.ids_of}, nbytes

    def start_kv_chunks(self, entry: LayerEntry, wanted: dict, node=None, ratios=None,
                        ahead: dict | None = None) -> "_KVLoad":
        """load_kv_chunks() in two halves: this one serves the tier hits and submits the
        disk reads; finish_kv_chunks() waits for them (the caller computes meanwhile).
        A miss found in `ahead` (prefetched: {kind: {id: chunk}}) is taken from there, not
        read again (its bytes were counted by the prefetch). Every start must be finished,
        even when the caller gives up on the result."""
        load = _KVLoad(entry, {"gpu": 0, "cpu": 0, "disk": 0, "disk_chunks": 0})
        for kind, chunk_ids in wanted.items():
            ids = [int(i) for i in chunk_ids]
            r = [0.0] * len(ids) if ratios is None else [float(x) for x in ratios[kind]]
            got: list[torch.Tensor] = [None] * len(ids)  # type: ignore[list-item]
            early = (ahead or {}).get(kind, {})
            for j, (i, ratio) in enumerate(zip(ids, r)):
                hit = self.cache.get(self._key(entry, kind, i), ratio) if self.cache else None
                if hit is not None:
                    tier, got[j] = hit
                    load.served[tier] += entry.layout.chunk_bytes
                elif i in early:
                    got[j] = early[i]
                    if self.cache is not None:
                        self.cache.admit(self._key(entry, kind, i), got[j], ratio)
                else:
                    load.misses.setdefault(kind, []).append((j, i, ratio))
            load.out[kind] = got
        if load.misses:
            load.read = self._start_chunks(
                entry, {k: [i for _, i, _ in m] for k, m in load.misses.items()}, node)
        return load

    def finish_kv_chunks(self, load: "_KVLoad"
                         ) -> tuple[dict[str, list[torch.Tensor]], dict[str, int]]:
        if load.read is not None:
            fresh, nbytes = self._finish_chunks(load.read)
            load.served["disk"] += nbytes
            load.served["disk_chunks"] = sum(len(m) for m in load.misses.values())
            for kind, misses in load.misses.items():
                for (j, i, ratio), tensor in zip(misses, fresh[kind]):
                    load.out[kind][j] = tensor
                    if self.cache is not None:
                        self.cache.admit(self._key(load.entry, kind, i), tensor, ratio)
        return load.out, load.served

    @staticmethod
    def _key(entry: LayerEntry, kind: str, index: int) -> tuple:
        return (entry.node_id, entry.layer, entry.version, kind, index)

    def read_layer(self, entry: LayerEntry, node=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole K and V of a (node, layer) in logical order: (heads, n_tokens, head_dim)."""
        ids = range(entry.layout.n_chunks)
        k = torch.cat(self.read_chunks(entry, "k", ids, node), dim=1)
        v = torch.cat(self.read_chunks(entry, "v", ids, node), dim=1)
        if entry.mapping is not None:
            to_physical = torch.from_numpy(entry.physical_of)
            k, v = k[:, to_physical], v[:, to_physical]
        return k, v

    # -- selection feedback ---------------------------------------------------------------
    def record_selection(self, entry: LayerEntry, scores: np.ndarray | None,
                         selected: np.ndarray | None, chunks_read=None) -> None:
        """Feed one query's importance back: scores and selection are per logical token,
        for the first len(scores) tokens of the node (a request may use only its head)."""
        n = entry.layout.n_tokens
        if scores is not None and len(scores) < n:
            scores = np.concatenate([scores, np.zeros(n - len(scores), scores.dtype)])
        if selected is not None and len(selected) < n:
            selected = np.concatenate([selected, np.zeros(n - len(selected), bool)])
        with self.lock:
            stats = self.stats.get((entry.node_id, entry.layer))
            if stats is None:  # the node was split, evicted or quarantined meanwhile
                return
            if scores is not None:
                stats.importance += scores.astype(np.float32)
                stats.dirty = True
            current = self._is_current(entry)
            if selected is not None and current:   # bitmaps are in the current layout
                c = entry.layout.chunk_size
                phys_sel = selected if entry.mapping is None else selected[entry.mapping]
                per_chunk = phys_sel.reshape(-1, c)
                stats.bitmaps[:] = np.packbits(per_chunk, axis=1)
                stats.ratio[:] = np.round(per_chunk.mean(axis=1) * 255).astype(np.uint8)
            if chunks_read is not None and current:
                ids = np.asarray(list(chunks_read), dtype=np.int64)
                stats.access[ids] = np.minimum(stats.access[ids].astype(np.int64) + 1, 65535)

    def last_selected_chunks(self, entry: LayerEntry) -> np.ndarray:
        """Physical chunks of `entry` that held tokens the last query selected (empty when
        none has been recorded for its layout): the best guess at the next selection."""
        with self.lock:
            stats = self.stats.get((entry.node_id, entry.layer))
            if stats is None or not self._is_current(entry):
                return np.zeros(0, dtype=np.int64)
            return np.flatnonzero(stats.bitmaps.any(axis=1))

    def _is_current(self, entry: LayerEntry) -> bool:
        """Is `entry` its node's layout now (not one a reorder replaced)? Under the lock."""
        node = self.tree.nodes.get(entry.node_id)
        return node is not None and node.layers[entry.layer] is entry

    def chunk_ratios(self, entry: LayerEntry, chunk_ids) -> np.ndarray:
        stats = self.stats.get((entry.node_id, entry.layer))
        if stats is None:
            return np.zeros(len(chunk_ids))
        return stats.ratio[np.asarray(chunk_ids, dtype=np.int64)] / 255.0

    def flush_stats(self) -> None:
        """Persist soft state (importance, bitmaps, counters, ratios) and node hit counts."""
        with self.lock:
            rows = [(nid, layer, s.importance, s.bitmaps, s.access, s.ratio)
                    for (nid, layer), s in self.stats.items() if nid in self.tree.nodes]
            with self.meta.transaction():
                self.meta.put_soft_state(rows)
                self.meta.touch_nodes([(n.id, n.last_access, n.hits)
                                       for n in self.tree.nodes.values()])

    # -- inserting ----------------------------------------------------------------------
    def insert(self, tokens, start: int, kv) -> list[RadixNode]:
        """Store the KV of tokens[start:end] (end = last whole chunk of `tokens`).

        `kv[layer]` is (K, V), each (kv_heads, n, head_dim) for positions start..start+n,
        n >= end - start. `start` must be chunk-aligned and lie within the stored prefix of
        `tokens` (normally match.length). Returns the nodes now covering tokens[:end].
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        c = self.config.chunk_size
        end = len(tokens) // c * c
        if start % c:
            raise ValueError("insert start must be chunk-aligned")
        with self.lock:
            match = self.tree.match_prefix(tokens[:end])
            have = match.length
            if have < start:
                raise ValueError(f"insert at {start} but only {have} tokens are stored")
            if have >= end:
                return match.nodes
            # Lock the path so making room never evicts the nodes we attach under.
            self.tree.lock(match)
            try:
                parent = None
                if match.segments:
                    last, used = match.segments[-1]
                    parent = self._split(last, used) if used < last.n_tokens else last
                    if parent is not last:
                        parent.lock_count += 1
                        match.segments.append((parent, 0))
                offset = have - start
                new_tokens = tokens[have:end]
                layers = [(k[:, offset:offset + len(new_tokens)],
                           v[:, offset:offset + len(new_tokens)]) for k, v in kv]
                node = self._write_node(parent, have, new_tokens, layers)
            finally:
                for freed in self.tree.unlock(match):
                    self._delete_retired(freed)
            self.metrics.inserts += 1
            return self.tree.path_to(node)

    def _write_node(self, parent: RadixNode | None, start: int, tokens: np.ndarray,
                    layers, mappings=None, stats=None) -> RadixNode:
        """Write files for a new node (fsynced), then commit its rows, then attach it."""
        layout = self._layout(len(tokens))
        self._make_room(self.shape.n_layers * layout.file_bytes)
        files, rows = [], []
        try:
            for layer, (k, v) in enumerate(layers):
                mapping = None if mappings is None else mappings[layer]
                name = f"{uuid.uuid4().hex}.kv"
                crcs = self._write_layer_file(self.data_dir / name, layout, k, v)
                files.append(name)
                rows.append(LayerRow(0, layer, 1, name, mapping, crcs))
        except OSError as exc:
            for name in files:
                (self.data_dir / name).unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise StoreFull(f"disk full while writing {self.data_dir}") from None
            raise
        with self.meta.transaction():
            nid = self.meta.add_node(parent.id if parent else None, start, tokens)
            for row in rows:
                row.node = nid
                self.meta.put_layer(row)
        node = RadixNode(nid, parent, start, tokens.copy(), last_access=time.time())
        node.layers = [self._entry(row, len(tokens)) for row in rows]
        for layer in range(len(rows)):
            self.stats[(nid, layer)] = stats[layer] if stats else \
                LayerStats.fresh(len(tokens), self.config.chunk_size)
        self.tree.attach(node)
        return node

    def _write_layer_file(self, path: Path, layout: LayerFileLayout, k_logical: torch.Tensor,
                          v_logical: torch.Tensor, mapping: np.ndarray | None = None) -> np.ndarray:
        """Write one (node, layer) file in the physical order given by `mapping`."""
        k = k_logical.detach().to(torch.float16).cpu()
        v = v_logical.detach().to(torch.float16).cpu()
        if mapping is not None:
            order = torch.from_numpy(np.asarray(mapping, dtype=np.int64))
            k, v = k[:, order], v[:, order]
        k, v = k.contiguous(), v.contiguous()
        probe_heads = list(self.config.probe_heads)
        if self.config.probe_format == "int4" and not probe_supported(
                len(probe_heads), layout.n_tokens, layout.head_dim):
            raise ValueError("int4 probe copy needs probe values in groups of 32")
        probe = encode_probe(k[probe_heads], self.config.probe_format)
        pieces = [(0, probe)]
        crcs = [crc32(probe)]
        for kind, tensor in (("k", k), ("v", v)):
            for i in range(layout.n_chunks):
                payload = chunk_payload(tensor, i, layout.chunk_size)
                pieces.append((layout.chunk_offset(kind, i), payload))
                crcs.append(crc32(payload))
        write_durable(str(path), pieces, layout.file_bytes)
        return np.asarray(crcs, dtype=np.uint32)

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Split `node` at chunk boundary `at`: rewrite both halves, switch in one transaction."""
        head_tokens, tail_tokens = node.tokens[:at], node.tokens[at:]
        head_layers, tail_layers, head_stats, tail_stats = [], [], [], []
        for layer, entry in enumerate(node.layers):
            k, v = self.read_layer(entry, node)
            head_layers.append((k[:, :at], v[:, :at]))
            tail_layers.append((k[:, at:], v[:, at:]))
            old = self.stats[(node.id, layer)]
            for part, sl, out in ((head_tokens, slice(0, at), head_stats),
                                  (tail_tokens, slice(at, None), tail_stats)):
                s = LayerStats.fresh(len(part), self.config.chunk_size)
                s.importance[:] = old.importance[sl]
                s.dirty = True
                out.append(s)
        head_layout, tail_layout = self._layout(len(head_tokens)), self._layout(len(tail_tokens))
        self._make_room(self.shape.n_layers * (head_layout.file_bytes + tail_layout.file_bytes))
        names = {"head": [], "tail": []}
        crcs = {"head": [], "tail": []}
        try:
            for part, layout, layers in (("head", head_layout, head_layers),
                                         ("tail", tail_layout, tail_layers)):
                for k, v in layers:
                    name = f"{uuid.uuid4().hex}.kv"
                    names[part].append(name)
                    crcs[part].append(self._write_layer_file(self.data_dir / name, layout, k, v))
        except OSError as exc:
            for name in names["head"] + names["tail"]:
                (self.data_dir / name).unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise StoreFull("disk full while splitting a node") from None
            raise
        parent = node.parent if node.parent is not self.tree.root else None
        with self.meta.transaction():
            head_id = self.meta.add_node(parent.id if parent else None, node.start, head_tokens)
            tail_id = self.meta.add_node(head_id, node.start + at, tail_tokens)
            for nid, part in ((head_id, "head"), (tail_id, "tail")):
                for layer, (name, crc) in enumerate(zip(names[part], crcs[part])):
                    self.meta.put_layer(LayerRow(nid, layer, 1, name, None, crc))
            for child in node.children.values():
                self.meta.set_parent(child.id, tail_id)
            self.meta.delete_node(node.id)
        head = RadixNode(head_id, None, node.start, head_tokens.copy(), hits=node.hits,
                         last_access=node.last_access)
        tail = RadixNode(tail_id, None, node.start + at, tail_tokens.copy(), hits=node.hits,
                         last_access=node.last_access)
        for new, part, layout, stats in ((head, "head", head_layout, head_stats),
                                         (tail, "tail", tail_layout, tail_stats)):
            new.layers = [LayerEntry(new.id, layer, 1, str(self.data_dir / name), layout, None,
                                     crc) for layer, (name, crc) in
                          enumerate(zip(names[part], crcs[part]))]
            for layer, s in enumerate(stats):
                self.stats[(new.id, layer)] = s
        self.tree.replace(node, [head, tail])
        self._retire_node(node)
        self.metrics.splits += 1
        return head

    # -- removing -----------------------------------------------------------------------
    def _retire_node(self, node: RadixNode) -> None:
        node.retired_files.extend(e.path for e in node.layers)
        for layer in range(len(node.layers)):
            self.stats.pop((node.id, layer), None)
        if self.cache is not None:
            self.cache.invalidate(node.id)
        if node.lock_count == 0:
            self._delete_retired(node)

    def _delete_retired(self, node: RadixNode) -> None:
        for path in node.retired_files:
            self.reader.forget(path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        node.retired_files.clear()

    def _remove_subtree(self, node: RadixNode) -> list[RadixNode]:
        doomed = self.tree.subtree(node)
        with self.meta.transaction():
            for n in doomed:
                self.meta.delete_node(n.id)
        for n in reversed(doomed):
            self.tree.detach(n)
            self._retire_node(n)
        return doomed

    def evict_leaf(self) -> RadixNode | None:
        """Evict the unlocked leaf with the lowest score (hits) or the least recent use."""
        with self.lock:
            leaves = self.tree.evictable_leaves()
            if not leaves:
                return None
            key = (lambda n: (n.hits, n.last_access)) if self.config.eviction == "score" \
                else (lambda n: n.last_access)
            victim = min(leaves, key=key)
            self._remove_subtree(victim)
            self.metrics.evictions += 1
            return victim

    def _make_room(self, new_bytes: int) -> None:
        cap = self.config.disk_capacity_bytes
        if cap is None:
            return
        if new_bytes > cap:
            raise StoreFull(f"{new_bytes} bytes of KV exceed the store capacity {cap}")
        while self.disk_bytes() + new_bytes > cap:
            if self.evict_leaf() is None:
                raise StoreFull("store capacity reached and every leaf is in use")

    def quarantine(self, node: RadixNode, reason: str) -> None:
        """Take a corrupt node (and the prefixes below it, unreachable now) out of service.

        Its files move to quarantine/ for inspection; requests recompute and re-insert.
        """
        with self.lock:
            if not node.live:
                return
            log.warning("corrupt KV in store %s, node %d (%s): quarantined, serving by "
                        "recompute", self.dir, node.id, reason)
            qdir = self.dir / "quarantine"
            qdir.mkdir(exist_ok=True)
            for entry in node.layers:
                try:
                    os.link(entry.path, qdir / os.path.basename(entry.path))
                except OSError:
                    pass
            self._remove_subtree(node)

    # -- reordering ---------------------------------------------------------------------
    def reorder_node(self, node: RadixNode, layers=None) -> int:
        """Rewrite layers of `node` so tokens sit in order of accumulated importance.

        Copy-on-write: the new version is written and fsynced outside the lock, then the
        metadata switches in one transaction; readers holding the old entry are unaffected.
        """
        # One reorder at a time (background and on-demand ones would race on the same
        # versions), and the node pinned like a request: nothing deletes the files we read.
        with self._reorder_lock:
            with self.lock:
                if not node.live:
                    return 0
                node.lock_count += 1
            try:
                return self._reorder_pinned(node, layers)
            finally:
                with self.lock:
                    node.lock_count -= 1
                    if node.lock_count == 0:
                        self._delete_retired(node)

    def _reorder_pinned(self, node: RadixNode, layers) -> int:
        done = 0
        for layer in (range(self.shape.n_layers) if layers is None else layers):
            with self.lock:
                if not node.live:
                    return done
                old = node.layers[layer]
                stats = self.stats[(node.id, layer)]
                importance = stats.importance.copy()
                stats.dirty = False
            if self.config.reorder_by == "semantic":
                if old.mapping is not None:
                    continue                      # query-agnostic: laid out once
                k, v = self.read_layer(old, node)
                order = self._semantic_order(node, k)
            else:
                order = self._importance_order(node, importance)
                if old.mapping is not None and np.array_equal(order, old.mapping):
                    continue
                k, v = self.read_layer(old, node)
            name = f"{uuid.uuid4().hex}.kv"
            try:
                crcs = self._write_layer_file(self.data_dir / name, old.layout, k, v, order)
            except OSError as exc:
                (self.data_dir / name).unlink(missing_ok=True)
                log.warning("reorder of node %d layer %d skipped: %s", node.id, layer, exc)
                continue
            with self.lock:
                if not node.live or node.layers[layer] is not old:
                    os.unlink(self.data_dir / name)
                    continue
                new = LayerEntry(node.id, layer, old.version + 1, str(self.data_dir / name),
                                 old.layout, order, crcs)
                stats.relayout(old.mapping, order)
                with self.meta.transaction():
                    self.meta.put_layer(LayerRow(node.id, layer, new.version, name, order, crcs,
                                                 stats.importance, stats.bitmaps, stats.access,
                                                 stats.ratio))
                node.layers[layer] = new
                node.retired_files.append(old.path)
                if self.cache is not None:
                    self.cache.invalidate_version(node.id, layer, old.version)
                self.metrics.reorders += 1
                done += 1
        return done

    def _movable_range(self, node: RadixNode, n: int) -> tuple[int, int]:
        """Tokens [lo, hi) a reorder may move: all, or all but the sink chunk (of a node that
        starts the prefix) and the last chunk."""
        c, lo, hi = self.config.chunk_size, 0, n
        if self.config.reorder_keep_ends:
            if node.start == 0:
                lo = c
            if n - c >= lo:
                hi = n - c
        return lo, hi

    def _importance_order(self, node: RadixNode, importance: np.ndarray) -> np.ndarray:
        """Physical -> logical mapping: most important first, sink and last chunk in place."""
        c, n = self.config.chunk_size, len(importance)
        lo, hi = self._movable_range(node, n)
        ranked = np.argsort(-importance[lo:hi], kind="stable")
        if self.config.reorder_hot_fraction < 1:
            # The hot set fills whole chunks; cold tokens stay in positional order.
            hot_n = math.ceil(self.config.reorder_hot_fraction * (hi - lo) / c) * c
            hot = ranked[:hot_n]
            hot = hot[importance[lo:hi][hot] > 0]
            cold = np.ones(hi - lo, dtype=bool)
            cold[hot] = False
            ranked = np.concatenate([hot, np.flatnonzero(cold)])
        middle = lo + ranked
        return np.concatenate([np.arange(lo), middle, np.arange(hi, n)]).astype(np.int64)

    def _semantic_order(self, node: RadixNode, k: torch.Tensor) -> np.ndarray:
        """Physical -> logical mapping: chunks of tokens with similar keys (all KV heads'
        keys of a token, each head normalised, side by side), sink and last chunk in place."""
        from policies.page_index import balanced_kmeans  # policies import the engine's modules

        c, n = self.config.chunk_size, k.shape[1]
        lo, hi = self._movable_range(node, n)
        if hi - lo <= c:
            return np.arange(n, dtype=np.int64)
        feats = torch.nn.functional.normalize(k[:, lo:hi].float(), dim=-1)
        feats = feats.transpose(0, 1).reshape(hi - lo, -1)
        cluster = balanced_kmeans(feats, (hi - lo) // c, c, iters=4)
        middle = lo + np.lexsort((np.arange(hi - lo), cluster))
        return np.concatenate([np.arange(lo), middle, np.arange(hi, n)]).astype(np.int64)

    def reorder_dirty(self) -> int:
        """Reorder every node whose importance changed since its last reorder."""
        with self.lock:
            nodes = [n for n in self.tree.nodes.values()
                     if any(getattr(self.stats.get((n.id, layer)), "dirty", False)
                            for layer in range(self.shape.n_layers))]
        done = sum(self.reorder_node(n) for n in nodes)
        self.flush_stats()
        return done

    def reorder_now(self) -> int:
        """Reorder on demand, in the caller's thread."""
        return self.reorder_dirty()

    # -- sizes and closing ----------------------------------------------------------------
    def disk_bytes(self) -> int:
        return sum(e.layout.file_bytes for n in self.tree.nodes.values() for e in n.layers)

    def kv_bytes(self) -> int:
        """Bytes of K and V payload (no padding, no probe copies)."""
        return sum(2 * e.layout.n_chunks * e.layout.chunk_bytes
                   for n in self.tree.nodes.values() for e in n.layers)

    def probe_bytes(self) -> int:
        return sum(e.layout.probe_bytes for n in self.tree.nodes.values() for e in n.layers)

    def overheads(self) -> dict:
        self.flush_stats()
        self.meta.checkpoint()
        kv = self.kv_bytes()
        return {"kv_bytes": kv, "metadata_bytes": self.meta.size_bytes(),
                "probe_bytes": self.probe_bytes(), "file_bytes": self.disk_bytes(),
                "metadata_fraction": self.meta.size_bytes() / kv if kv else 0.0,
                "probe_fraction": self.probe_bytes() / kv if kv else 0.0,
                "padding_fraction": (self.disk_bytes() - kv - self.probe_bytes()) / kv if kv else 0.0}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reorder is not None:
            self._reorder.stop()
        try:
            self.flush_stats()
        finally:
            self.reader.close()
            self.meta.close()
            os.close(self._lock_fd)

    def __enter__(self) -> "PrefixStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReorderEngine:
    """Background thread: reorders dirty nodes every `reorder_interval` queries."""

    def __init__(self, store: PrefixStore):
        self.store = store
        self.interval = store.config.reorder_interval
        self._wake = threading.Event()
        self._stopping = False
        self._since = 0
        self.thread = threading.Thread(target=self._run, name="kv-reorder", daemon=True)
        self.thread.start()

    def note_query(self) -> None:
        self._since += 1
        if self._since >= self.interval:
            self._since = 0
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            try:
                self.store.reorder_dirty()
            except Exception as exc:  # noqa: BLE001 - a failed reorder must not stop serving
                log.warning("background reorder failed: %s", exc)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self.thread.join()
