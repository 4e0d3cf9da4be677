"""Reordering a node's layers by accumulated importance (or key similarity), copy-on-write,
and the background thread that does it every few queries."""
from __future__ import annotations

import dataclasses
import logging
import math
import threading

import numpy as np
import torch

from disk_layout import io as dio
from disk_layout.metadata import LayerRow, MetadataError

from .. import cpu_threads
from ..errors import CorruptNode, StoreWriteFailed
from .entries import LayerEntry, LayerStats
from .eviction import Removal
from .files import LayerFiles, new_file_name
from .importance import Importance
from .radix import RadixNode
from .reads import DiskReads
from .state import StoreState, meta_write

log = logging.getLogger("impress_flexgen.store")


class Reorderer:
    """Copy-on-write reorders of a node's layers. `tiers`: the TierStack whose copies of a
    replaced version are dropped."""

    def __init__(self, state: StoreState, files: LayerFiles, reads: DiskReads,
                 removal: Removal, importance: Importance, tiers) -> None:
        self.state = state
        self.files = files
        self.reads = reads
        self.removal = removal
        self.importance = importance
        self.tiers = tiers

    def reorder_node(self, node: RadixNode, layers=None) -> int:
        """Rewrite layers of `node` so tokens sit in order of accumulated importance.

        Copy-on-write: the new version is written and fsynced outside the lock, then the
        metadata switches in one transaction; readers holding the old entry are unaffected.
        """
        # One reorder at a time (background and on-demand ones would race on the same
        # versions), and the node pinned like a request: nothing deletes the files we read.
        with self.state.reorder_lock:
            with self.state.lock:
                if not node.live:
                    return 0
                self.state.tree.pin(node)
            try:
                return self._reorder_pinned(node, layers)
            except CorruptNode as exc:
                self.removal.quarantine(exc.node, str(exc))
                return 0
            finally:
                with self.state.lock:
                    for freed in self.state.tree.unpin(node):
                        self.files.delete_retired(freed)

    def _reorder_pinned(self, node: RadixNode, layers) -> int:
        done = 0
        for layer in (range(self.state.shape.n_layers) if layers is None else layers):
            with self.state.lock:
                if not node.live:
                    return done
                old = node.layers[layer]
                stats = self.state.stats[(node.id, layer)]
                importance = stats.importance.copy()
                stats.dirty = False
            if self.state.config.reorder_by == "semantic":
                if old.mapping is not None:
                    continue                      # query-agnostic: laid out once
                k, v = self.reads.read_layer(old, node)
                order = self._semantic_order(node, k)
            else:
                order = self._importance_order(node, importance)
                if old.mapping is not None and np.array_equal(order, old.mapping):
                    continue
                k, v = self.reads.read_layer(old, node)
            name = new_file_name()
            try:
                crcs = self.files.write_layer_file(self.state.data_dir / name, old.layout, k, v,
                                                   order)
            except OSError as exc:
                dio.unlink_missing_ok(self.state.data_dir / name)
                log.warning("reorder of node %d layer %d skipped: %s", node.id, layer, exc)
                continue
            with self.state.lock:
                if not node.live or node.layers[layer] is not old:
                    dio.unlink(self.state.data_dir / name)
                    continue
                new = LayerEntry(node.id, layer, old.version + 1, str(self.state.data_dir / name),
                                 old.layout, order, crcs)
                # The statistics follow the new layout only once it is committed.
                moved = dataclasses.replace(stats, bitmaps=stats.bitmaps.copy(),
                                            access=stats.access.copy(), ratio=stats.ratio.copy())
                moved.relayout(old.mapping, order)
                try:
                    meta_write(lambda: self._commit_layer(new, name, moved), "reordering")
                except StoreWriteFailed as exc:
                    dio.unlink(self.state.data_dir / name)
                    log.warning("reorder of node %d layer %d skipped: %s", node.id, layer, exc)
                    continue
                stats.bitmaps[:], stats.access[:], stats.ratio[:] = \
                    moved.bitmaps, moved.access, moved.ratio
                node.layers[layer] = new
                node.retired_files.append(old.path)
                self.tiers.invalidate_version(node.id, layer, old.version)
                self.state.metrics.reorders += 1
                done += 1
        return done

    def _commit_layer(self, new: LayerEntry, name: str, stats: LayerStats) -> None:
        with self.state.meta.transaction():
            self.state.meta.put_layer(LayerRow(new.node_id, new.layer, new.version, name,
                                               new.mapping, new.crcs, stats.importance,
                                               stats.bitmaps, stats.access, stats.ratio))

    def _movable_range(self, node: RadixNode, n: int) -> tuple[int, int]:
        """Tokens [lo, hi) a reorder may move: all, or all but the sink chunk (of a node that
        starts the prefix) and the last chunk."""
        c, lo, hi = self.state.config.chunk_size, 0, n
        if self.state.config.reorder_keep_ends:
            if node.start == 0:
                lo = c
            if n - c >= lo:
                hi = n - c
        return lo, hi

    def _importance_order(self, node: RadixNode, importance: np.ndarray) -> np.ndarray:
        """Physical -> logical mapping: most important first, sink and last chunk in place."""
        c, n = self.state.config.chunk_size, len(importance)
        lo, hi = self._movable_range(node, n)
        ranked = np.argsort(-importance[lo:hi], kind="stable")
        if self.state.config.reorder_hot_fraction < 1:
            # The hot set fills whole chunks; cold tokens stay in positional order.
            hot_n = math.ceil(self.state.config.reorder_hot_fraction * (hi - lo) / c) * c
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

        c, n = self.state.config.chunk_size, k.shape[1]
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
        with self.state.lock:
            nodes = [n for n in self.state.tree.nodes.values()
                     if any(getattr(self.state.stats.get((n.id, layer)), "dirty", False)
                            for layer in range(self.state.shape.n_layers))]
        done = sum(self.reorder_node(n) for n in nodes)
        self.importance.flush_stats()
        if done:
            # A pass rewrites many rows: fold the WAL into the database and cut it back,
            # so the journal of a burst does not stay on disk beside the metadata.
            with self.state.lock:
                try:
                    self.state.meta.checkpoint()
                except MetadataError as exc:
                    log.warning("store %s: WAL checkpoint failed: %s", self.state.dir, exc)
        return done


class ReorderEngine:
    """Background thread: reorders dirty nodes every `reorder_interval` queries.
    `reorderer`: anything with reorder_dirty() and state.config (the store's Reorderer)."""

    def __init__(self, reorderer):
        self.reorderer = reorderer
        self.interval = reorderer.state.config.reorder_interval
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
        cpu_threads.helper_thread()
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            try:
                self.reorderer.reorder_dirty()
            except Exception as exc:  # noqa: BLE001 - a failed reorder must not stop serving
                log.warning("background reorder failed: %s", exc)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self.thread.join()
