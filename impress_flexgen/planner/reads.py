"""What each split of a matched prefix leaves to read: the I/O side of the plan.

    view = StoreView(store)
    prefix = prefix_costs(view, policy, n_layers, segments_nodes, matched, n_new,
                          seconds_of, load_share, select_rate, probe_bandwidth)

A split m recomputes the prefix's first m chunks' worth of tokens (positions [0, m*T)) and
loads what the policy wants of the rest, layer by layer. Which chunks that is depends on the
policy:
- one that loads everything reads every chunk holding a token at or past m*T;
- one that selects as if nothing were recomputed (not `keeps_front`) reads the chunks its
  last query selected on that (node, layer) that hold such a token (a learned share of all
  chunks where none is recorded). A reordered node's hot chunks mix tokens from all over the
  prefix, so for such a policy recomputing the front spares few reads;
- one that `keeps_front` counts the recomputed front as kept and fills only the rest of its
  budget (k - m*T tokens) with chunks, ranked by their tokens past the front. Predicted as
  the policy ranks: the chunks holding the prefix's last tokens first, then those its last
  query selected, then the others, each in stored order (a reordered node stores its hottest
  chunks first), taken while the tokens past the front taken before them are under budget.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from policies import Segment

from .split import PrefixCosts


class SegmentLayout:
    """What prefix_costs reads of one segment's stored layout on one layer for a prefix of
    n chunks of T tokens. It depends on nothing a request changes (only on the entry's
    version, the segment's place and length), so StoreView keeps it between requests."""

    def __init__(self, seg: Segment, n: int, T: int):
        chunk_of = seg.logical_to_chunk()
        self.n_chunks = n_chunks = seg.entry.layout.n_chunks
        self.size = len(chunk_of)
        self.tokens = np.bincount(chunk_of, minlength=n_chunks)     # per physical chunk
        self.is_held = self.tokens > 0
        self.held = np.flatnonzero(self.is_held)                     # np.unique(chunk_of)
        self.recent = np.unique(chunk_of[-T:])      # the chunks of the segment's last T tokens
        # The logical chunk each token lies in (a split m still loads tokens of k >= m).
        k_of = np.minimum((seg.start + np.arange(len(chunk_of))) // T, n - 1)
        # A chunk is loaded while m <= the logical chunk of its last token.
        self.last_k = np.full(n_chunks, -1, dtype=np.int64)
        np.maximum.at(self.last_k, chunk_of, k_of)
        # past[c, m]: chunk c's tokens at or past m*T, m < n (the budget walk's rows).
        per_k = (np.bincount(chunk_of * n + k_of, minlength=n_chunks * n) if n else
                 np.zeros(0, dtype=np.int64)).reshape(n_chunks, n)
        self.past = np.cumsum(per_k[:, ::-1], axis=1)[:, ::-1].astype(np.int32)
        self.nbytes = self.past.nbytes + 3 * self.tokens.nbytes + self.held.nbytes

    def held_of(self, chunks) -> np.ndarray:
        """The held chunks among `chunks`, sorted (np.intersect1d(chunks, held))."""
        mask = np.zeros(self.n_chunks, dtype=bool)
        mask[np.asarray(chunks, dtype=np.int64)] = True
        return np.flatnonzero(mask & self.is_held)

    def ranked(self, recorded: np.ndarray, forced: np.ndarray) -> np.ndarray:
        """Every held chunk: the forced first, then the recorded, then the rest, each in
        stored order (a stable sort on that rank)."""
        rank = np.full(self.n_chunks, 2, dtype=np.int8)
        rank[recorded] = 1
        rank[forced] = 0
        return self.held[np.argsort(rank[self.held], kind="stable")]


class StoreView:
    """The few things the planner reads of a store (the engine's PrefixStore): its chunk
    size, a layer's entry, the last query's selection, where a chunk resides and the disk's
    read limit; and the segments' layouts, kept between requests."""

    # Bytes of layouts kept, the least recently used dropped first (a 1,024-token prefix's
    # 30 layers take about 0.5 MB).
    LAYOUT_BYTES = 64 << 20

    def __init__(self, store):
        self._store = store
        self._layouts: OrderedDict[tuple, SegmentLayout] = OrderedDict()
        self._layout_bytes = 0
        self._lock = threading.Lock()

    @property
    def chunk_size(self) -> int:
        return self._store.config.chunk_size

    @property
    def read_limit(self) -> float | None:
        """The store's disk read limit in bytes/s (None: unlimited)."""
        limit = self._store.tiers.disk.read_limit
        return None if limit is None else limit.rate

    def entry(self, node, layer: int):
        return self._store.entry(node, layer)

    def last_selected_chunks(self, entry) -> np.ndarray:
        return self._store.last_selected_chunks(entry)

    def memory_tiers_on(self) -> bool:
        """Can a memory tier hold a chunk (one with capacity)? If not, all are on disk."""
        cache = self._store.tiers.cache
        return cache is not None and any(t.capacity > 0 for t in cache.tiers)

    def tiers_of(self, entry, chunks) -> list[str | None]:
        """The memory tier holding each chunk's K (None: on disk only, or no tiers)."""
        cache = self._store.tiers.cache
        if cache is None or not self.memory_tiers_on():
            return [None] * len(chunks)
        return cache.residents([(entry.node_id, entry.layer, entry.version, "k", int(c))
                                for c in chunks])

    def layout(self, node, used: int, entry, n: int) -> SegmentLayout:
        """The layout of `used` tokens of `node` as stored in `entry`, for a prefix of n
        chunks. Keyed by the entry's version: a reorder writes a new one (node ids are
        never reused), so a kept layout is never stale."""
        key = (entry.node_id, entry.layer, entry.version, node.start, used, n)
        with self._lock:
            layout = self._layouts.get(key)
            if layout is not None:
                self._layouts.move_to_end(key)
                return layout
        layout = SegmentLayout(Segment(node, used, entry), n, self.chunk_size)
        with self._lock:
            if key not in self._layouts:
                self._layouts[key] = layout
                self._layout_bytes += layout.nbytes
            while self._layout_bytes > self.LAYOUT_BYTES and len(self._layouts) > 1:
                self._layout_bytes -= self._layouts.popitem(last=False)[1].nbytes
        return layout


def prefix_costs(view: StoreView, policy, n_layers: int, segments_nodes, matched: int,
                 n_new: int, seconds_of, load_share: float, select_rate: float,
                 probe_bandwidth: float) -> PrefixCosts:
    """PrefixCosts of the matched prefix (see the module docstring).

    seconds_of(entry, chunk_ids) -> seconds to read each chunk's K and V; load_share: the
    learned share of chunks loaded where no selection is recorded; select_rate: scoring
    seconds per (new token x stored token); probe_bandwidth: bytes/s of the probe reads."""
    T, L = view.chunk_size, n_layers
    n = matched // T
    keeps_front = bool(getattr(policy, "keeps_front", False)) and not policy.loads_everything
    probe_bytes = sum(view.entry(node, layer).layout.probe_stride
                      for layer in range(L) if policy.reads_probe and policy.probes_layer(layer)
                      for node, _ in segments_nodes)
    if keeps_front:
        budget = policy.config.budget(matched) if matched else 0
        io_after, kept_after = _front_reads(view, L, segments_nodes, n, T, budget, seconds_of)
    else:
        io_after, kept_after = _selected_reads(view, policy, L, segments_nodes, n, seconds_of,
                                               load_share)
    io_after[n] = kept_after[n] = 0.0
    select_s = select_rate * n_new * matched if not policy.loads_everything else 0.0
    return PrefixCosts(n, T, n_new, tuple(io_after.tolist()), tuple(kept_after.tolist()),
                       probe_bytes / probe_bandwidth, select_s)


# Both halves below gather every (layer, segment) first and do the arithmetic in a few
# array operations: per piece, a dozen small numpy calls cost milliseconds a request. Float
# sums keep the order of a loop over layers, then segments (the results are bit for bit
# those of one), and sums of whole token counts are exact in any order.

def _selected_reads(view: StoreView, policy, L: int, segments_nodes, n: int, seconds_of,
                    load_share: float) -> tuple[np.ndarray, np.ndarray]:
    """io_after, kept_after (n + 1 each) of a policy that loads everything, or what its last
    query selected (a share of every chunk where nothing is recorded)."""
    last_k, io_w, kept_w = [], [], []
    for layer in range(L):
        for node, used in segments_nodes:
            entry = view.entry(node, layer)
            lay = view.layout(node, used, entry, n)
            share = 1.0
            if policy.loads_everything:
                ids = lay.held
            else:
                ids = lay.held_of(view.last_selected_chunks(entry))
                if len(ids) == 0:      # nothing recorded yet: a share of every chunk
                    ids, share = lay.held, load_share
            last_k.append(lay.last_k[ids])
            io_w.append(seconds_of(entry, ids) * share)
            kept_w.append(lay.tokens[ids] * share / L)
    if not last_k:
        return np.zeros(n + 1), np.zeros(n + 1)
    # add[p, k]: piece p's chunks whose last token lies in logical chunk k; a chunk is
    # loaded while m <= k, so piece p leaves the reverse cumulative sum to read at split m.
    piece = np.repeat(np.arange(len(last_k)), [len(k) for k in last_k])
    at = (piece, np.concatenate(last_k))
    out = []
    for weights in (io_w, kept_w):
        add = np.zeros((len(last_k), n + 1))
        np.add.at(add, at, np.concatenate(weights))
        after = np.cumsum(add[:, ::-1], axis=1)[:, ::-1]
        out.append(np.cumsum(after, axis=0)[-1])        # summed piece after piece
    return out[0], out[1]


def _front_reads(view: StoreView, L: int, segments_nodes, n: int, T: int, budget: int,
                 seconds_of) -> tuple[np.ndarray, np.ndarray]:
    """io_after, kept_after (n + 1 each) of a keeps_front policy: per layer, each segment's
    chunks in the policy's likely order, their seconds and tokens past each split m (rows),
    walked against the budget (_budget_walk)."""
    past, seconds, forced, rows = [], [], [], []
    last_segment = len(segments_nodes) - 1
    for layer in range(L):
        rows.append(0)
        for si, (node, used) in enumerate(segments_nodes):
            entry = view.entry(node, layer)
            lay = view.layout(node, used, entry, n)
            recorded = lay.held_of(view.last_selected_chunks(entry))
            front = lay.recent if si == last_segment else lay.held[:0]
            ids = lay.ranked(recorded, front)
            past.append(lay.past[ids])
            seconds.append(seconds_of(entry, ids))
            forced.append(np.arange(len(ids)) < len(front))
            rows[-1] += len(ids)
    io_after, kept_after = np.zeros(n + 1), np.zeros(n + 1)
    if not past or not n:
        return io_after, kept_after
    # Layers side by side, padded to as many rows as the longest (empty rows take nothing),
    # a block of layers at a time so that the arrays stay a few MB.
    R = max(rows)
    layer_of = np.repeat(np.arange(L), rows)
    row_of = np.arange(len(layer_of)) - np.repeat(np.cumsum(rows) - rows, rows)
    grid = np.zeros((L, R, n)), np.zeros((L, R)), np.zeros((L, R), dtype=bool)
    for array, values in zip(grid, (past, seconds, forced)):
        array[layer_of, row_of] = np.concatenate(values)
    step = max(1, (1 << 20) // max(1, R * n))
    for first in range(0, L, step):
        block = slice(first, first + step)
        take = _budget_walk(grid[0][block], grid[2][block], budget, T)
        kept = (take * grid[0][block]).sum(axis=1)
        for i, layer in enumerate(range(L)[block]):
            # Each layer's seconds summed over its own rows, as a walk per layer did.
            r = rows[layer]
            io_after[:n] += (take[i, :r] * grid[1][layer, :r, None]).sum(axis=0)
            kept_after[:n] += kept[i] / L
    return io_after, kept_after


def _budget_walk(past: np.ndarray, forced: np.ndarray, budget: int, T: int) -> np.ndarray:
    """take[l, c, m]: does a keeps_front policy load chunk c of layer l at split m < n?
    past[l, c, m]: chunk c's tokens at or past m*T; chunks in the policy's order, the
    forced ones first (taken whenever they hold a token past the front), the others taken
    while the tokens past the front taken before them are under budget - m*T."""
    n = past.shape[2]
    need = budget - T * np.arange(n)                              # (m,)
    is_forced = forced[:, :, None]
    free = np.where(is_forced, 0.0, past)
    before = (np.where(is_forced, past, 0.0).sum(axis=1, keepdims=True)
              + np.cumsum(free, axis=1) - free)
    return (past > 0) & (is_forced | (before < need))
