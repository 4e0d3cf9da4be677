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
from disk_layout.io import ChecksumMismatch, DiskReader, write_durable
from disk_layout.metadata import (SCHEMA_VERSION, LayerRow, Metadata, MetadataError,
                                  MetadataFull, valid_file_name)

from .errors import UserError
from .radix import PrefixMatch, RadixNode, RadixTree

log = logging.getLogger("impress_flexgen.store")
STORE_FORMAT = "impress_flexgen-prefix-store"


class CorruptNode(Exception):
    """A chunk or probe section failed its CRC, or reading its file failed in any way
    (short, missing, not a regular file, a symbolic link, an I/O error)."""

    def __init__(self, node: RadixNode, detail: str):
        super().__init__(f"node {node.id}: {detail}")
        self.node = node


class StoreWriteFailed(Exception):
    """New KV could not be committed (the request is still served; its prefix is not
    stored)."""


class StoreFull(StoreWriteFailed):
    """No room for new KV even after evicting every unlocked leaf, or the disk or the
    metadata database is full."""


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
    # Files of quarantined nodes are kept for inspection up to this many bytes (oldest go
    # first): a disk that keeps failing must not fill up with evidence.
    quarantine_bytes: int = 256 << 20

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
        if self.quarantine_bytes < 0:
            raise UserError("quarantine bytes must not be negative")


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
        self.data_dir = self.dir / "data"
        self.quarantine_dir = self.dir / "quarantine"
        self._check_directory()
        self._lock_fd = self._lock_directory()
        # One lock for the tree, the statistics, the metadata connection and the metrics.
        # Held only for bookkeeping: file writes, fsyncs and reads happen outside it.
        self.lock = threading.RLock()
        self._reorder_lock = threading.Lock()
        self.metrics = StoreMetrics()
        self.tree = RadixTree(config.chunk_size)
        self.stats: dict[tuple[int, int], LayerStats] = {}
        self.queries = 0
        self._reserved = 0      # bytes of files being written for inserts not yet committed
        self.meta = None
        try:
            self._open_metadata()
        except BaseException as exc:
            if self.meta is not None:
                self.meta.close()
            os.close(self._lock_fd)
            # UnicodeError: text in the database that is not what any store writes.
            if isinstance(exc, (MetadataError, StoreWriteFailed, UnicodeError)):
                raise UserError(f"store {self.dir}: {exc}; the store was left as it is "
                                "(move it away or choose another --store-dir)") from None
            raise
        self.reopened = len(self.tree) > 0
        self.reader = DiskReader(config.read_threads, config.direct_io)
        self._reorder = ReorderEngine(self) if config.reorder_interval > 0 else None
        self._closed = False

    def _open_metadata(self) -> None:
        self._refuse_lost_metadata()
        self.meta = Metadata(str(self.dir / "store.sqlite"))
        self._init_meta()
        self._recover()

    # -- opening ------------------------------------------------------------------------
    def _check_directory(self) -> None:
        if self.dir.is_symlink() or (self.dir.exists() and not self.dir.is_dir()):
            raise UserError(f"store directory {self.dir} is not a directory")
        if self.dir.is_dir() and any(self.dir.iterdir()) and \
                not (self.dir / "store.sqlite").exists():
            raise UserError(f"{self.dir} is not empty and holds no impress_flexgen store; "
                            "choose another --store-dir")
        for path in (self.data_dir, self.quarantine_dir):
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                raise UserError(f"{path} is not a directory; the store was left as it is")
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            # Root ignores permission bits: only a real write proves the directory writable.
            probe = self.dir / f".write-test-{os.getpid()}-{threading.get_ident()}"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise UserError(f"cannot write the store directory {self.dir}: "
                            f"{exc.strerror or exc}") from None

    def _lock_directory(self) -> int:
        try:
            fd = os.open(self.dir / "store.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise UserError(f"cannot open {self.dir / 'store.lock'}: "
                            f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"store {self.dir} is in use by another process") from None
        return fd

    def _data_entries(self) -> list[str]:
        return [e.name for e in os.scandir(self.data_dir)]

    def _refuse_lost_metadata(self) -> None:
        """A missing or empty database beside data files is damage, not a new store:
        opening it as new would delete every file recovery finds unreferenced."""
        db = self.dir / "store.sqlite"
        if db.is_symlink():
            raise UserError(f"store {self.dir}: store.sqlite is a symbolic link; refused")
        if (not db.exists() or db.stat().st_size == 0) and self._data_entries():
            raise UserError(f"store {self.dir}: store.sqlite is missing or empty but data/ "
                            "holds files; the store was left as it is (move it away or "
                            "choose another --store-dir)")

    def _init_meta(self) -> None:
        want = {"format": STORE_FORMAT, "schema": SCHEMA_VERSION,
                "model": dataclasses.asdict(self.shape), "chunk_size": self.config.chunk_size,
                "probe_heads": list(self.config.probe_heads),
                "probe_format": self.config.probe_format, "packed": self.packed}
        have = self.meta.get_meta()
        if self.meta.is_empty():
            if self._data_entries():
                raise UserError(f"store {self.dir}: its database holds nothing but data/ "
                                "holds files; the store was left as it is (move it away or "
                                "choose another --store-dir)")
            self._meta_write(lambda: self.meta.set_meta(want), "initialising the store")
            return
        if have.get("format") != STORE_FORMAT:
            raise UserError(f"{self.dir} holds a database that is not an impress_flexgen store")
        have.setdefault("packed", False)      # stores from before the packed layout
        for key in ("schema", "model", "chunk_size", "probe_heads", "probe_format", "packed"):
            if have.get(key) != want[key]:
                raise UserError(f"store {self.dir} was made with {key}={have.get(key)}, "
                                f"not {want[key]}; use another --store-dir")

    def _recover(self) -> None:
        """Load the tree from committed rows that pass their checks; take nodes that fail
        them (and the prefixes below them) out of the store; delete files no committed row
        references."""
        c = self.config.chunk_size
        rows_of: dict[int, tuple] = {}
        bad: dict[int, str] = {}
        children: dict[int | None, list[int]] = {}
        for row in self.meta.nodes():
            nid, parent, start, tokens = row.id, row.parent, row.start, row.tokens
            children.setdefault(parent, []).append(nid)
            if not row.valid:
                bad[nid] = row.problem or "row checksum mismatch"
                continue
            if len(tokens) == 0 or len(tokens) % c or start < 0 or start % c:
                bad[nid] = f"{len(tokens)} tokens at {start}: not whole chunks"
                continue
            layout = self._layout(len(tokens))
            layers = self.meta.layers(nid, len(tokens), n_crcs=1 + 2 * layout.n_chunks)
            problems = [r.problem or "invalid row" for r in layers if not r.valid]
            if [r.layer for r in layers] != list(range(self.shape.n_layers)):
                problems.append(f"{len(layers)} layer rows for {self.shape.n_layers} layers")
            if problems:
                bad[nid] = problems[0]
                continue
            rows_of[nid] = (row, layers)
        # Attach parents before children (a child's id may be older than its parent's:
        # splits re-parent). A node whose parent is missing or bad, or whose start does not
        # continue its parent's tokens, is unreachable: it goes too.
        attached: set[int] = set()
        frontier: list[int | None] = [None]
        while frontier:
            parent_id = frontier.pop()
            parent = self.tree.nodes.get(parent_id) if parent_id is not None else None
            for nid in children.get(parent_id, []):
                if nid not in rows_of:
                    continue
                row, layers = rows_of[nid]
                expect = parent.end if parent is not None else 0
                if row.start != expect:
                    bad[nid] = f"starts at {row.start}, its parent ends at {expect}"
                    continue
                node = RadixNode(nid, parent, row.start, row.tokens.copy(), hits=row.hits,
                                 last_access=row.last_access)
                node.layers = [self._entry(r, len(row.tokens)) for r in layers]
                try:
                    self.tree.attach(node)
                except ValueError:
                    bad[nid] = "a sibling starts with the same chunk"
                    continue
                for r in layers:
                    self.stats[(nid, r.layer)] = self._stats_from_row(r, len(row.tokens))
                attached.add(nid)
                frontier.append(nid)
        dropped = [nid for nid, _ in rows_of.items() if nid not in attached] + list(bad)
        if dropped:
            self._drop_rows(dropped, bad)
        referenced = self.meta.referenced_files()
        removed = 0
        for entry in os.scandir(self.data_dir):
            if entry.name in referenced:
                continue
            if entry.is_dir(follow_symlinks=False):
                log.warning("store %s: leaving unexpected directory %s alone", self.dir,
                            entry.path)
                continue
            os.unlink(entry.path)       # a link goes, never what it points to
            removed += 1
        if removed:
            log.info("removed %d uncommitted files from %s", removed, self.data_dir)

    def _drop_rows(self, node_ids: list[int], why: dict[int, str]) -> None:
        """Delete the rows of nodes recovery cannot serve; keep their files for inspection."""
        names = []
        for nid in node_ids:
            names += [r.file for r in self.meta.layers(nid, 0, n_crcs=None)
                      if valid_file_name(r.file)]
        for nid in node_ids:
            if nid in why:
                log.warning("store %s: node %d not served (%s): its prefix will be recomputed",
                            self.dir, nid, why[nid])
        self.metrics.invalid_rows += len(why)
        self.metrics.quarantined_nodes += len(node_ids)

        def delete():
            with self.meta.transaction():
                for nid in node_ids:
                    self.meta.delete_node(nid)
        self._meta_write(delete, "dropping damaged rows")
        for name in names:
            self._quarantine_file(self.data_dir / name)
        self._trim_quarantine()

    def _layout(self, n_tokens: int) -> LayerFileLayout:
        return LayerFileLayout(n_tokens, self.config.chunk_size, self.shape.n_kv_heads,
                               self.shape.head_dim, len(self.config.probe_heads),
                               self.config.probe_format, self.packed)

    def _entry(self, row: LayerRow, n_tokens: int) -> LayerEntry:
        return LayerEntry(row.node, row.layer, row.version, str(self.data_dir / row.file),
                          self._layout(n_tokens), row.mapping, row.crcs)

    def _stats_from_row(self, row: LayerRow, n_tokens: int) -> LayerStats:
        """Soft state from a row; any piece of the wrong size starts fresh (it is a hint)."""
        stats = LayerStats.fresh(n_tokens, self.config.chunk_size)
        sizes = ((row.importance, stats.importance), (row.bitmaps, stats.bitmaps),
                 (row.access, stats.access), (row.ratio, stats.ratio))
        if all(have is not None and have.size == want.size for have, want in sizes) and \
                np.isfinite(row.importance).all():
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
        with self.lock:
            self.metrics.probe_bytes_read += lay.probe_stride
        return decode_probe(run.data[:lay.probe_bytes], lay.probe_format,
                            (lay.n_probe, lay.n_tokens, lay.head_dim))

    def _submit(self, entry: LayerEntry, node, extents, checks):
        """Start reads of `entry`'s file; any failure to open it raises CorruptNode."""
        try:
            return self.reader.submit(entry.path, extents, checks)
        except OSError as exc:
            self._count_corruption()
            raise CorruptNode(self._node(node, entry), f"{entry.path}: {exc}") from None

    def _wait(self, entry: LayerEntry, node, handle, describe):
        """The runs of a _submit(), read and CRC-checked; a mismatch (described by
        describe(extent index)) or any read error (short, EIO, ...) raises CorruptNode."""
        try:
            return self.reader.wait(handle)
        except ChecksumMismatch as exc:
            self._count_corruption()
            raise CorruptNode(self._node(node, entry), describe(exc.index)) from None
        except OSError as exc:
            self._count_corruption()
            raise CorruptNode(self._node(node, entry), f"{entry.path}: {exc}") from None

    def _count_corruption(self) -> None:
        with self.lock:
            self.metrics.corruptions += 1

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
        with self.lock:
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
                        self.cache.admit(self._key(entry, kind, i), got[j], ratio,
                                         crc=entry.crc(kind, i))
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
                        # The CRC goes with the copy: checked before a promotion serves it.
                        # A node invalidated while this read was in flight is refused.
                        self.cache.admit(self._key(load.entry, kind, i), tensor, ratio,
                                         crc=load.entry.crc(kind, i))
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
        with self.lock:
            stats = self.stats.get((entry.node_id, entry.layer))
            if stats is None:
                return np.zeros(len(chunk_ids))
            return stats.ratio[np.asarray(chunk_ids, dtype=np.int64)] / 255.0

    def flush_stats(self) -> None:
        """Persist soft state (importance, bitmaps, counters, ratios) and node hit counts.
        A full database only loses these hints (logged), never KV."""
        with self.lock:
            rows = [(nid, layer, s.importance, s.bitmaps, s.access, s.ratio)
                    for (nid, layer), s in self.stats.items() if nid in self.tree.nodes]
            touched = [(n.id, n.last_access, n.hits) for n in self.tree.nodes.values()]
            try:
                with self.meta.transaction():
                    self.meta.put_soft_state(rows)
                    self.meta.touch_nodes(touched)
            except MetadataError as exc:
                log.warning("store %s: statistics not saved: %s", self.dir, exc)

    def _meta_write(self, write, what: str):
        """Run a metadata write; a full or failing database becomes StoreFull /
        StoreWriteFailed (the request goes on without storing)."""
        try:
            return write()
        except MetadataFull as exc:
            raise StoreFull(f"metadata database full while {what}: {exc}") from None
        except MetadataError as exc:
            raise StoreWriteFailed(f"metadata write failed while {what}: {exc}") from None

    # -- inserting ----------------------------------------------------------------------
    def insert(self, tokens, start: int, kv) -> list[RadixNode]:
        """Store the KV of tokens[start:end] (end = last whole chunk of `tokens`).

        `kv[layer]` is (K, V), each (kv_heads, n, head_dim) for positions start..start+n,
        n >= end - start. `start` must be chunk-aligned and lie within the stored prefix of
        `tokens` (normally match.length). Returns the nodes now covering tokens[:end].

        Files are written and fsynced with the path pinned but without the store lock, so
        other requests go on meanwhile; the commit then checks that the tree still looks as
        it did (another insert, a split or a reorder may have changed it) and otherwise
        starts again from the new tree.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        c = self.config.chunk_size
        end = len(tokens) // c * c
        if start % c:
            raise ValueError("insert start must be chunk-aligned")
        for _ in range(8):
            with self.lock:
                match = self.tree.match_prefix(tokens[:end])
                have = match.length
                if have < start:
                    # Only a quarantine removes a pinned prefix: nothing to attach to now.
                    raise StoreWriteFailed(f"insert at {start} but only {have} tokens are "
                                           "stored (removed meanwhile)")
                if have >= end:
                    return match.nodes
                # Pinned: nothing evicts the nodes we read and attach under, or deletes
                # their files.
                self.tree.lock(match)
                last, used = match.segments[-1] if match.segments else (None, 0)
                split_at = used if last is not None and used < last.n_tokens else None
                # The layers to split: a reorder may replace them meanwhile, which changes
                # only their physical order, so the halves (written in logical order) hold.
                seen = list(last.layers) if split_at is not None else None
            try:
                node = self._insert_pinned(tokens[:end], start, kv, match, have, split_at, seen)
            finally:
                with self.lock:
                    for freed in self.tree.unlock(match):
                        self._delete_retired(freed)
            if node is not None:
                with self.lock:
                    return self.tree.path_to(node)
        raise StoreWriteFailed("the prefix tree kept changing while this prefix was written")

    def _insert_pinned(self, tokens, start, kv, match: PrefixMatch, have: int,
                       split_at: int | None, seen) -> RadixNode | None:
        """Write the files of an insert (and of the split it needs), then commit them if the
        tree is unchanged; None: it changed, nothing was kept."""
        last = match.segments[-1][0] if match.segments else None
        new_tokens = tokens[have:]
        offset = have - start
        layers = [(k[:, offset:offset + len(new_tokens)], v[:, offset:offset + len(new_tokens)])
                  for k, v in kv]
        layout = self._layout(len(new_tokens))
        need = self.shape.n_layers * layout.file_bytes
        if split_at is not None:
            need += self.shape.n_layers * (self._layout(split_at).file_bytes +
                                          self._layout(last.n_tokens - split_at).file_bytes)
        self._make_room(need)       # reserves `need`; given back below
        names: list[str] = []
        try:
            split = None
            if split_at is not None:
                split = self._write_split(last, split_at, seen, names)
            files = self._write_files(layout, layers, names)
            with self.lock:
                if self.tree.match_prefix(tokens).segments != match.segments:
                    self.metrics.insert_retries += 1
                    return None
                node = self._commit_insert(last, split, have, new_tokens, layout, files)
                names = []            # committed: the files are the store's now
                self.metrics.inserts += 1
                return node
        finally:
            self._discard(names)
            with self.lock:
                self._reserved -= need

    def _write_files(self, layout: LayerFileLayout, layers, names: list[str]) -> list:
        """Write one file per layer (fsynced); [(name, crcs)]. Names go to `names` as they
        are made, so the caller can remove them if anything fails."""
        out = []
        for k, v in layers:
            name = f"{uuid.uuid4().hex}.kv"
            names.append(name)
            try:
                crcs = self._write_layer_file(self.data_dir / name, layout, k, v)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise StoreFull(f"disk full while writing {self.data_dir}") from None
                raise StoreWriteFailed(f"cannot write {self.data_dir}: {exc}") from None
            out.append((name, crcs))
        return out

    def _write_split(self, node: RadixNode, at: int, seen, names: list[str]) -> dict:
        """Rewrite `node` as two nodes split at chunk boundary `at` (files only)."""
        head, tail = [], []
        for entry in seen:
            k, v = self.read_layer(entry, node)
            head.append((k[:, :at], v[:, :at]))
            tail.append((k[:, at:], v[:, at:]))
        head_layout, tail_layout = self._layout(at), self._layout(node.n_tokens - at)
        return {"node": node, "at": at, "head": (head_layout, self._write_files(head_layout, head, names)),
                "tail": (tail_layout, self._write_files(tail_layout, tail, names))}

    def _commit_insert(self, last: RadixNode | None, split: dict | None, have: int,
                       tokens: np.ndarray, layout: LayerFileLayout, files) -> RadixNode:
        """Under the lock: one transaction makes the split (if any) and the new node visible,
        then the tree follows."""
        def commit():
            with self.meta.transaction():
                parent_id = last.id if last is not None else None
                if split is not None:
                    old = split["node"]
                    grand = old.parent if old.parent is not self.tree.root else None
                    head_id = self.meta.add_node(grand.id if grand else None, old.start,
                                                 old.tokens[:split["at"]])
                    tail_id = self.meta.add_node(head_id, old.start + split["at"],
                                                 old.tokens[split["at"]:])
                    for nid, part in ((head_id, "head"), (tail_id, "tail")):
                        for layer, (name, crcs) in enumerate(split[part][1]):
                            self.meta.put_layer(LayerRow(nid, layer, 1, name, None, crcs))
                    for child in old.children.values():
                        self.meta.set_parent(child.id, tail_id)
                    self.meta.delete_node(old.id)
                    split["ids"] = (head_id, tail_id)
                    parent_id = head_id
                nid = self.meta.add_node(parent_id, have, tokens)
                for layer, (name, crcs) in enumerate(files):
                    self.meta.put_layer(LayerRow(nid, layer, 1, name, None, crcs))
                return nid

        nid = self._meta_write(commit, "storing a prefix")
        parent = last
        if split is not None:
            parent = self._apply_split(split)
        node = RadixNode(nid, parent, have, tokens.copy(), last_access=time.time())
        node.layers = [LayerEntry(nid, layer, 1, str(self.data_dir / name), layout, None, crcs)
                       for layer, (name, crcs) in enumerate(files)]
        for layer in range(len(files)):
            self.stats[(nid, layer)] = LayerStats.fresh(len(tokens), self.config.chunk_size)
        self.tree.attach(node)
        return node

    def _apply_split(self, split: dict) -> RadixNode:
        """The tree side of a committed split: head and tail replace the node; its
        statistics are divided between them. Returns the head."""
        node, at = split["node"], split["at"]
        halves = []
        for nid, part, sl, start in ((split["ids"][0], "head", slice(0, at), node.start),
                                     (split["ids"][1], "tail", slice(at, None), node.start + at)):
            layout, files = split[part]
            new = RadixNode(nid, None, start, node.tokens[sl].copy(), hits=node.hits,
                            last_access=node.last_access)
            new.layers = [LayerEntry(nid, layer, 1, str(self.data_dir / name), layout, None,
                                     crcs) for layer, (name, crcs) in enumerate(files)]
            for layer in range(len(files)):
                s = LayerStats.fresh(new.n_tokens, self.config.chunk_size)
                s.importance[:] = self.stats[(node.id, layer)].importance[sl]
                s.dirty = True
                self.stats[(nid, layer)] = s
            # Whoever holds the node holds its halves: nothing evicts them meanwhile.
            new.lock_count = node.lock_count
            halves.append(new)
        node.successors = halves
        self.tree.replace(node, halves)
        self._retire_node(node)
        self.metrics.splits += 1
        return halves[0]

    def _discard(self, names: list[str]) -> None:
        for name in names:
            (self.data_dir / name).unlink(missing_ok=True)

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
                os.unlink(path)         # a symbolic link goes, never its target
            except FileNotFoundError:
                pass
            except OSError as exc:      # e.g. a directory put in its place: left alone
                log.warning("store %s: cannot remove %s: %s", self.dir, path, exc)
        node.retired_files.clear()

    def _remove_subtree(self, node: RadixNode) -> list[RadixNode]:
        """Delete a node and everything below it: rows first (one transaction), then the
        tree, the tier copies and, once unlocked, the files."""
        doomed = self.tree.subtree(node)

        def delete():
            with self.meta.transaction():
                for n in doomed:
                    self.meta.delete_node(n.id)
        self._meta_write(delete, "removing a prefix")
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
        """Evict until `new_bytes` more fit under the capacity, then reserve them (files
        being written by concurrent inserts count before they are committed); the caller
        gives the reservation back (self._reserved -= new_bytes) when done."""
        cap = self.config.disk_capacity_bytes
        with self.lock:
            if cap is not None:
                if new_bytes > cap:
                    raise StoreFull(f"{new_bytes} bytes of KV exceed the store capacity {cap}")
                while self.disk_bytes() + self._reserved + new_bytes > cap:
                    if self.evict_leaf() is None:
                        raise StoreFull("store capacity reached and every leaf is in use")
            self._reserved += new_bytes

    def quarantine(self, node: RadixNode, reason: str) -> None:
        """Take a corrupt node (and the prefixes below it, unreachable now) out of service.

        Its files are kept in quarantine/ for inspection (bounded by
        StoreConfig.quarantine_bytes); requests recompute and re-insert.
        """
        with self.lock:
            if not node.live:
                return
            log.warning("corrupt KV in store %s, node %d (%s): quarantined, serving by "
                        "recompute", self.dir, node.id, reason)
            for entry in node.layers:
                self._quarantine_file(Path(entry.path))
            self.metrics.quarantined_nodes += 1
            try:
                self._remove_subtree(node)
            except StoreWriteFailed as exc:
                # Out of service all the same; its rows stay and are caught again on read.
                log.warning("store %s: rows of quarantined node %d not deleted: %s",
                            self.dir, node.id, exc)
                for n in reversed(self.tree.subtree(node)):
                    self.tree.detach(n)
                    self._retire_node(n)
            self._trim_quarantine()

    def _quarantine_file(self, path: Path) -> None:
        """Keep a hard link to a store file in quarantine/ (a link, never its target)."""
        try:
            self.quarantine_dir.mkdir(exist_ok=True)
            os.link(path, self.quarantine_dir / path.name, follow_symlinks=False)
        except OSError:
            pass      # gone, or a link across file systems: nothing to keep

    def _quarantine_files(self) -> list[os.DirEntry]:
        try:
            return [e for e in os.scandir(self.quarantine_dir)
                    if e.is_file(follow_symlinks=False) or e.is_symlink()]
        except FileNotFoundError:
            return []

    def quarantine_bytes(self) -> int:
        return sum(e.stat(follow_symlinks=False).st_size for e in self._quarantine_files())

    def _trim_quarantine(self) -> None:
        """Delete the oldest quarantined files beyond StoreConfig.quarantine_bytes."""
        entries = [(e.stat(follow_symlinks=False), e) for e in self._quarantine_files()]
        total = sum(st.st_size for st, _ in entries)
        for st, e in sorted(entries, key=lambda x: x[0].st_ctime):
            if total <= self.config.quarantine_bytes:
                break
            os.unlink(e.path)
            total -= st.st_size

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
                self.tree.pin(node)
            try:
                return self._reorder_pinned(node, layers)
            except CorruptNode as exc:
                self.quarantine(exc.node, str(exc))
                return 0
            finally:
                with self.lock:
                    for freed in self.tree.unpin(node):
                        self._delete_retired(freed)

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
                # The statistics follow the new layout only once it is committed.
                moved = dataclasses.replace(stats, bitmaps=stats.bitmaps.copy(),
                                            access=stats.access.copy(), ratio=stats.ratio.copy())
                moved.relayout(old.mapping, order)
                try:
                    self._meta_write(lambda: self._commit_layer(new, name, moved), "reordering")
                except StoreWriteFailed as exc:
                    os.unlink(self.data_dir / name)
                    log.warning("reorder of node %d layer %d skipped: %s", node.id, layer, exc)
                    continue
                stats.bitmaps[:], stats.access[:], stats.ratio[:] = \
                    moved.bitmaps, moved.access, moved.ratio
                node.layers[layer] = new
                node.retired_files.append(old.path)
                if self.cache is not None:
                    self.cache.invalidate_version(node.id, layer, old.version)
                self.metrics.reorders += 1
                done += 1
        return done

    def _commit_layer(self, new: LayerEntry, name: str, stats: LayerStats) -> None:
        with self.meta.transaction():
            self.meta.put_layer(LayerRow(new.node_id, new.layer, new.version, name, new.mapping,
                                         new.crcs, stats.importance, stats.bitmaps,
                                         stats.access, stats.ratio))

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
        with self.lock:
            return sum(e.layout.file_bytes for n in self.tree.nodes.values() for e in n.layers)

    def kv_bytes(self) -> int:
        """Bytes of K and V payload (no padding, no probe copies)."""
        with self.lock:
            return sum(2 * e.layout.n_chunks * e.layout.chunk_bytes
                       for n in self.tree.nodes.values() for e in n.layers)

    def probe_bytes(self) -> int:
        with self.lock:
            return sum(e.layout.probe_bytes for n in self.tree.nodes.values() for e in n.layers)

    def overheads(self) -> dict:
        self.flush_stats()
        with self.lock:
            try:
                self.meta.checkpoint()
            except MetadataError as exc:
                log.warning("store %s: WAL checkpoint failed: %s", self.dir, exc)
            kv, probe, files = self.kv_bytes(), self.probe_bytes(), self.disk_bytes()
            meta = self.meta.size_bytes()
        return {"kv_bytes": kv, "metadata_bytes": meta, "probe_bytes": probe,
                "file_bytes": files, "quarantine_bytes": self.quarantine_bytes(),
                "metadata_fraction": meta / kv if kv else 0.0,
                "probe_fraction": probe / kv if kv else 0.0,
                "padding_fraction": (files - kv - probe) / kv if kv else 0.0}

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
        self._count_lock = threading.Lock()   # requests finish on several threads
        self.thread = threading.Thread(target=self._run, name="kv-reorder", daemon=True)
        self.thread.start()

    def note_query(self) -> None:
        with self._count_lock:
            self._since += 1
            if self._since < self.interval:
                return
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
