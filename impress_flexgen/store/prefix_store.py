"""The durable radix store: one object a request talks to, from match to release.

    match = store.match_prefix(tokens, namespace, exact_only)   # longest stored prefix, locked
    for layer in range(n_layers):
        entry = store.entry(node, layer)        # one immutable version of (node, layer)
        probe = store.read_probe(entry)         # probe heads' keys, physical order
        load = store.submit(entry, {"k": ids, "v": ids})   # tiers first, then the disk
        chunks, served = store.wait(load)       # CRC-checked; bytes served per tier
        store.record_selection(entry, ...)      # importance feeds reorder and the tiers
    store.insert(tokens, match.length, kv, namespace, exact)   # the newly computed part
    store.release(match)

Its jobs live one per file: opening and recovery (opening.py), disk reads (reads.py),
loads through the tiers (tiered.py), importance feedback (importance.py), inserts and
splits (inserts.py), eviction and quarantine (eviction.py), reorders (reorder.py), sizes
(accounting.py). Writers fsync data before the metadata transaction that makes it visible;
files no committed row references are removed when the store is opened. A reorder writes a
new version of a layer and switches the metadata in one transaction; readers holding the old
entry keep reading the old file, which is deleted once no request has its node locked.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

from disk_layout.format import packed_by_default
from disk_layout.io import DiskReader
from disk_layout.metadata import MetadataError

from ..errors import UserError
from ..radix import PrefixMatch, RadixNode, RadixTree
from .accounting import _Accounting
from .config import ModelShape, StoreConfig, StoreWriteFailed, namespace_key
from .entries import LayerEntry, LayerStats, StoreMetrics
from .eviction import _Eviction
from .importance import _Importance
from .inserts import _Inserts
from .opening import _Opening
from .reads import _Reads
from .reorder import ReorderEngine, _Reorders
from .tiered import _TieredLoads


class PrefixStore(_Opening, _Reads, _TieredLoads, _Importance, _Inserts, _Eviction, _Reorders,
                  _Accounting):
    """Prefix KV of one model in a directory: chunked layer files under a radix tree whose
    rows live in SQLite, with tiers of chunk copies in front (`cache`)."""

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
        limit = config.read_limit_mb_s * 1e6 if config.read_limit_mb_s else None
        self.reader = DiskReader(config.read_threads, config.direct_io,
                                 rate_limit_bytes_s=limit)
        self._reorder = ReorderEngine(self) if config.reorder_interval > 0 else None
        self._closed = False

    def match_prefix(self, tokens, namespace: str = "", exact_only: bool = False
                     ) -> PrefixMatch:
        """Longest chunk-aligned stored prefix of `tokens` in `namespace` (a tenant: prefixes
        are never shared across namespaces), locked until release(). `exact_only`: stop
        before the first node whose KV was computed over a selection of its prefix."""
        with self.lock:
            match = self.tree.match_prefix(tokens, namespace_key(namespace), exact_only)
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

    def _node(self, node, entry: LayerEntry) -> RadixNode:
        if isinstance(node, RadixNode):
            return node
        return self.tree.nodes.get(entry.node_id) or RadixNode(entry.node_id, None, 0,
                                                               np.zeros(0, np.int32))

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
