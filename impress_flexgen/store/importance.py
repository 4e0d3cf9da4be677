"""Importance soft state: what each query selected feeds the reorder, the tiers and the
next query's read-ahead."""
from __future__ import annotations

import logging

import numpy as np

from disk_layout.metadata import MetadataError

from .entries import LayerEntry, LayerStats
from .state import StoreState

log = logging.getLogger("impress_flexgen.store")


class Importance:
    """Per-(node, layer) importance and selection feedback."""

    def __init__(self, state: StoreState) -> None:
        self.state = state

    def layer_stats(self, entry: LayerEntry) -> LayerStats:
        return self.state.stats[(entry.node_id, entry.layer)]

    def record_selection(self, entry: LayerEntry, scores: np.ndarray | None,
                         selected: np.ndarray | None, chunks_read=None) -> None:
        """Feed one query's importance back: scores and selection are per logical token,
        for the first len(scores) tokens of the node (a request may use only its head)."""
        n = entry.layout.n_tokens
        if scores is not None and len(scores) < n:
            scores = np.concatenate([scores, np.zeros(n - len(scores), scores.dtype)])
        if selected is not None and len(selected) < n:
            selected = np.concatenate([selected, np.zeros(n - len(selected), bool)])
        with self.state.lock:
            stats = self.state.stats.get((entry.node_id, entry.layer))
            if stats is None:  # the node was split, evicted or quarantined meanwhile
                return
            if scores is not None:
                stats.importance += scores.astype(np.float32)
                stats.dirty = True
            current = self.state.is_current(entry)
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
        with self.state.lock:
            stats = self.state.stats.get((entry.node_id, entry.layer))
            if stats is None or not self.state.is_current(entry):
                return np.zeros(0, dtype=np.int64)
            return np.flatnonzero(stats.bitmaps.any(axis=1))

    def chunk_ratios(self, entry: LayerEntry, chunk_ids) -> np.ndarray:
        with self.state.lock:
            stats = self.state.stats.get((entry.node_id, entry.layer))
            if stats is None:
                return np.zeros(len(chunk_ids))
            return stats.ratio[np.asarray(chunk_ids, dtype=np.int64)] / 255.0

    def flush_stats(self) -> None:
        """Persist soft state (importance, bitmaps, counters, ratios) and node hit counts.
        A full database only loses these hints (logged), never KV."""
        with self.state.lock:
            rows = [(nid, layer, s.importance, s.bitmaps, s.access, s.ratio)
                    for (nid, layer), s in self.state.stats.items() if nid in self.state.tree.nodes]
            touched = [(n.id, n.last_access, n.hits) for n in self.state.tree.nodes.values()]
            try:
                with self.state.meta.transaction():
                    self.state.meta.put_soft_state(rows)
                    self.state.meta.touch_nodes(touched)
            except MetadataError as exc:
                log.warning("store %s: statistics not saved: %s", self.state.dir, exc)
