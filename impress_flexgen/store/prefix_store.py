"""The durable radix store: one object a request talks to, from match to release.

    match = store.match_prefix(tokens, namespace, exact_only)   # longest stored prefix, locked
    for layer in range(n_layers):
        entry = store.entry(node, layer)        # one immutable version of (node, layer)
        probe = store.read_probe(entry)         # probe heads' keys, physical order
        load = store.submit(entry, {"k": ids, "v": ids})   # memory tiers, then the disk tier
        chunks, served = store.wait(load)       # CRC-checked; bytes served per tier
        store.record_selection(entry, ...)      # importance feeds reorder and the tiers
    store.insert(tokens, match.length, kv, namespace, exact)   # the newly computed part
    store.release(match)

`PrefixStore` is a facade: its parts are plain classes over one `StoreState` (state.py),
each in its own file and given the parts it calls: opening and recovery (opening.py), layer
files and quarantine (files.py), disk reads (reads.py), loads through the tier stack
(loads.py, tiers/stack.py, with the disk as the last tier: disk_tier.py), importance
feedback (importance.py), inserts and splits (inserts.py), removal: eviction, quarantine,
supersession (eviction.py), reorders (reorder.py), sizes (accounting.py). Every file-system
call goes through disk_layout.io. Writers fsync data before the metadata transaction that
makes it visible; files no committed row references are removed when the store is opened. A
reorder writes a new version of a layer and switches the metadata in one transaction;
readers holding the old entry keep reading the old file, which is deleted once no request
has its node locked.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from disk_layout import io as dio
from disk_layout.format import packed_by_default
from disk_layout.io import DiskReader
from disk_layout.metadata import MetadataError

from ..errors import UserError
from ..radix import PrefixMatch, RadixNode
from ..tiers.stack import TierStack
from .accounting import Accounting
from .config import ModelShape, StoreConfig, StoreWriteFailed, namespace_key
from .disk_tier import DiskTier
from .entries import LayerEntry
from .eviction import Removal
from .files import LayerFiles
from .importance import Importance
from .inserts import Inserter
from .loads import Loads
from .opening import StoreOpener
from .reads import DiskReads
from .reorder import ReorderEngine, Reorderer
from .state import StoreState


class PrefixStore:
    """Prefix KV of one model in a directory: chunked layer files under a radix tree whose
    rows live in SQLite, read through a stack of tiers (`tiers`: memory tiers, if given
    one, in front of the disk). `memory`: a tiers.ChunkCache for the memory tiers (an
    engine gives its own with TierStack.use_memory when it has none)."""

    def __init__(self, directory: str | os.PathLike, shape: ModelShape,
                 config: StoreConfig = StoreConfig(), memory=None):
        chunk_bytes = shape.n_kv_heads * config.chunk_size * shape.head_dim * \
            shape.kv_value_bytes
        packed = packed_by_default(chunk_bytes) if config.packed is None else config.packed
        if any(h >= shape.n_kv_heads for h in config.probe_heads):
            raise UserError(f"probe heads {config.probe_heads} exceed {shape.n_kv_heads} KV heads")
        self.state = state = StoreState(Path(directory), shape, config, packed)
        self.files = LayerFiles(state)
        opener = StoreOpener(state, self.files)
        opener.check_directory()
        state.lock_fd = opener.lock_directory()
        try:
            opener.open_metadata()
        except BaseException as exc:
            if state.meta is not None:
                state.meta.close()
            dio.close_fd(state.lock_fd)
            # UnicodeError: text in the database that is not what any store writes.
            if isinstance(exc, (MetadataError, StoreWriteFailed, UnicodeError)):
                raise UserError(f"store {state.dir}: {exc}; the store was left as it is "
                                "(move it away or choose another --store-dir)") from None
            raise
        self.reopened = len(state.tree) > 0
        limit = config.read_limit_mb_s * 1e6 if config.read_limit_mb_s else None
        state.reader = DiskReader(config.read_threads, config.direct_io,
                                  rate_limit_bytes_s=limit)
        self.reads = DiskReads(state)
        self.tiers = TierStack(memory)
        self.removal = Removal(state, self.files, self.tiers)
        self.tiers.attach_disk(DiskTier(state, self.reads, self.removal))
        self.loads = Loads(self.tiers)
        self.importance = Importance(state)
        self.inserter = Inserter(state, self.files, self.reads, self.removal)
        self.reorderer = Reorderer(state, self.files, self.reads, self.removal,
                                   self.importance, self.tiers)
        self.accounting = Accounting(state, self.importance, self.files)
        self._reorder = ReorderEngine(self) if config.reorder_interval > 0 else None

    # ------------------------------------------------------------------ a request's steps
    def match_prefix(self, tokens, namespace: str = "", exact_only: bool = False
                     ) -> PrefixMatch:
        """Longest chunk-aligned stored prefix of `tokens` in `namespace` (a tenant: prefixes
        are never shared across namespaces), locked until release(). `exact_only`: stop
        before the first node whose KV was computed over a selection of its prefix."""
        state = self.state
        with state.lock:
            match = state.tree.match_prefix(tokens, namespace_key(namespace), exact_only)
            state.tree.lock(match)
            now = time.time()
            for node in match.nodes:
                node.hits += 1
                node.last_access = now
            return match

    def entry(self, node: RadixNode, layer: int) -> LayerEntry:
        return node.layers[layer]

    def read_probe(self, entry: LayerEntry, node=None):
        """The probe heads' keys for every token of the node, float32, physical order."""
        return self.reads.read_probe(entry, node)

    def submit(self, entry: LayerEntry, wanted: dict, node=None, ratios=None,
               ahead: dict | None = None):
        """Start loading chunks {"k": ids, "v": ids} of one layer file through the tiers
        (ratios: each chunk's important-token ratio, per kind; ahead: prefetched chunks,
        {kind: {id: chunk}}). Every submit must be waited for."""
        return self.loads.submit(entry, wanted, node, ratios, ahead)

    def wait(self, load) -> tuple[dict, dict[str, int]]:
        """({kind: chunks in asked order}, bytes served per tier name and "disk_chunks");
        a chunk that fails its CRC check raises CorruptNode."""
        return self.loads.wait(load)

    def record_selection(self, entry: LayerEntry, scores, selected, chunks_read=None) -> None:
        self.importance.record_selection(entry, scores, selected, chunks_read)

    def insert(self, tokens, start: int, kv, namespace: str = "", exact: bool = True
               ) -> list[RadixNode]:
        """Store the KV of tokens[start:end] (end: the last whole chunk); see Inserter."""
        return self.inserter.insert(tokens, start, kv, namespace, exact)

    def release(self, match: PrefixMatch) -> None:
        with self.state.lock:
            self.removal.unlock(self.state.tree.unlock(match))
            self.state.queries += 1
        if self._reorder is not None:
            self._reorder.note_query()

    def quarantine(self, node: RadixNode, reason: str) -> None:
        """Take a corrupt node (and what lies below it) out of service."""
        self.removal.quarantine(node, reason)

    def reorder_now(self) -> int:
        """Reorder every node whose importance changed, in the caller's thread."""
        return self.reorderer.reorder_dirty()

    def overheads(self) -> dict:
        return self.accounting.overheads()

    @property
    def closed(self) -> bool:
        return self.state.closed

    def close(self) -> None:
        state = self.state
        if state.closed:
            return
        state.closed = True
        if self._reorder is not None:
            self._reorder.stop()
        try:
            self.importance.flush_stats()
        finally:
            state.reader.close()
            state.meta.close()
            dio.close_fd(state.lock_fd)

    def __enter__(self) -> "PrefixStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the parts' own calls
    # Kept on the facade for the engine's read-ahead, the experiments and the tests.
    start_probe = property(lambda self: self.reads.start_probe)
    finish_probe = property(lambda self: self.reads.finish_probe)
    read_chunks = property(lambda self: self.reads.read_chunks)
    read_layer = property(lambda self: self.reads.read_layer)
    start_prefetch = property(lambda self: self.loads.start_prefetch)
    finish_prefetch = property(lambda self: self.loads.finish_prefetch)
    last_selected_chunks = property(lambda self: self.importance.last_selected_chunks)
    chunk_ratios = property(lambda self: self.importance.chunk_ratios)
    layer_stats = property(lambda self: self.importance.layer_stats)
    flush_stats = property(lambda self: self.importance.flush_stats)
    evict_leaf = property(lambda self: self.removal.evict_leaf)
    reorder_node = property(lambda self: self.reorderer.reorder_node)
    reorder_dirty = property(lambda self: self.reorderer.reorder_dirty)
    disk_bytes = property(lambda self: self.accounting.disk_bytes)
    kv_bytes = property(lambda self: self.accounting.kv_bytes)
    probe_bytes = property(lambda self: self.accounting.probe_bytes)
    quarantine_bytes = property(lambda self: self.files.quarantine_bytes)

    def load_chunks(self, entry: LayerEntry, kind: str, chunk_ids, node=None, ratios=None):
        """One kind's chunks through the tiers: (chunks, bytes served per tier)."""
        chunks, served = self.load_kv_chunks(entry, {kind: chunk_ids}, node,
                                             None if ratios is None else {kind: ratios})
        return chunks[kind], served

    def load_kv_chunks(self, entry: LayerEntry, wanted: dict, node=None, ratios=None):
        return self.wait(self.submit(entry, wanted, node, ratios))

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Where a load may be served from, fastest first: the memory tiers, the disk."""
        return self.tiers.names

    # The shared state, read by the engine, the server's metrics and the tools.
    dir = property(lambda self: self.state.dir)
    shape = property(lambda self: self.state.shape)
    config = property(lambda self: self.state.config)
    packed = property(lambda self: self.state.packed)
    data_dir = property(lambda self: self.state.data_dir)
    quarantine_dir = property(lambda self: self.state.quarantine_dir)
    lock = property(lambda self: self.state.lock)
    tree = property(lambda self: self.state.tree)
    stats = property(lambda self: self.state.stats)
    meta = property(lambda self: self.state.meta)
    metrics = property(lambda self: self.state.metrics)
    reader = property(lambda self: self.state.reader)
    queries = property(lambda self: self.state.queries)
