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

import numpy as np

from policies import Segment

from .split import PrefixCosts


class StoreView:
    """The few things the planner reads of a store (the engine's PrefixStore): its chunk
    size, a layer's entry, the last query's selection, where a chunk resides and the disk's
    read limit."""

    def __init__(self, store):
        self._store = store

    @property
    def chunk_size(self) -> int:
        return self._store.config.chunk_size

    @property
    def read_limit(self) -> float | None:
        """The store's disk read limit in bytes/s (None: unlimited)."""
        limit = self._store.reader.limit
        return None if limit is None else limit.rate

    def entry(self, node, layer: int):
        return self._store.entry(node, layer)

    def last_selected_chunks(self, entry) -> np.ndarray:
        return self._store.last_selected_chunks(entry)

    def tier_of(self, entry, chunk: int) -> str | None:
        """The memory tier holding the chunk's K (None: on disk only, or no tiers)."""
        cache = self._store.tiers.cache
        if cache is None or not any(t.capacity > 0 for t in cache.tiers):
            return None
        return cache.resident((entry.node_id, entry.layer, entry.version, "k", int(chunk)))


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
    budget = policy.config.budget(matched) if keeps_front and matched else 0
    io_after, kept_after = np.zeros(n + 1), np.zeros(n + 1)
    probe_bytes = 0
    last_segment = len(segments_nodes) - 1
    for layer in range(L):
        # keeps_front: each segment's candidate chunks in the policy's likely order, their
        # seconds and their tokens per logical chunk (rows) for the budget walk below.
        order_s, order_tokens, order_forced = [], [], []
        for si, (node, used) in enumerate(segments_nodes):
            entry = view.entry(node, layer)
            seg = Segment(node, used, entry)
            if policy.reads_probe and policy.probes_layer(layer):
                probe_bytes += entry.layout.probe_stride
            chunk_of = seg.logical_to_chunk()
            held = np.unique(chunk_of)
            # The logical chunk each token lies in (a split m still loads tokens of k >= m).
            k_of = np.minimum((seg.start + np.arange(used)) // T, n - 1)
            if keeps_front:
                recorded = np.intersect1d(view.last_selected_chunks(entry), held)
                forced = np.unique(chunk_of[-T:]) if si == last_segment else held[:0]
                rest = np.setdiff1d(held, np.union1d(recorded, forced))
                ids = np.concatenate([forced, np.setdiff1d(recorded, forced), rest])
                row = np.full(entry.layout.n_chunks, -1, dtype=np.int64)
                row[ids] = np.arange(len(ids))
                tokens = np.zeros((len(ids), n))
                np.add.at(tokens, (row[chunk_of], k_of), 1.0)
                order_s.append(seconds_of(entry, ids))
                order_tokens.append(tokens)
                order_forced.append(np.arange(len(ids)) < len(forced))
                continue
            share = 1.0
            if policy.loads_everything:
                ids = held
            else:
                ids = np.intersect1d(view.last_selected_chunks(entry), held)
                if len(ids) == 0:      # nothing recorded yet: a share of every chunk
                    ids, share = held, load_share
            # A chunk is loaded while m <= the logical chunk of its last token.
            last_k = np.full(entry.layout.n_chunks, -1, dtype=np.int64)
            np.maximum.at(last_k, chunk_of, k_of)
            tokens = np.bincount(chunk_of, minlength=entry.layout.n_chunks)
            add_io, add_kept = np.zeros(n + 1), np.zeros(n + 1)
            np.add.at(add_io, last_k[ids], seconds_of(entry, ids) * share)
            np.add.at(add_kept, last_k[ids], tokens[ids] * share / L)
            io_after += np.cumsum(add_io[::-1])[::-1]
            kept_after += np.cumsum(add_kept[::-1])[::-1]
        if keeps_front and order_s and n:
            io, kept = _budget_walk(np.concatenate(order_s), np.concatenate(order_tokens),
                                    np.concatenate(order_forced), budget, T)
            io_after[:n] += io
            kept_after[:n] += kept / L
    io_after[n] = kept_after[n] = 0.0
    select_s = select_rate * n_new * matched if not policy.loads_everything else 0.0
    return PrefixCosts(n, T, n_new, tuple(io_after.tolist()), tuple(kept_after.tolist()),
                       probe_bytes / probe_bandwidth, select_s)


def _budget_walk(seconds: np.ndarray, tokens: np.ndarray, forced: np.ndarray, budget: int,
                 T: int) -> tuple[np.ndarray, np.ndarray]:
    """Per split m < n: seconds and tokens past the front of the chunks a keeps_front policy
    loads. tokens[c, k]: chunk c's tokens in logical chunk k; chunks in the policy's order,
    the forced ones first (taken whenever they hold a token past the front), the others
    taken while the tokens past the front taken before them are under budget - m*T."""
    n = tokens.shape[1]
    past = np.cumsum(tokens[:, ::-1], axis=1)[:, ::-1]          # (chunks, m): tokens >= m*T
    need = budget - T * np.arange(n)                              # (m,)
    free = np.where(forced[:, None], 0.0, past)
    before = past[forced].sum(axis=0)[None] + np.cumsum(free, axis=0) - free
    take = (past > 0) & (forced[:, None] | (before < need[None]))
    return (take * seconds[:, None]).sum(axis=0), (take * past).sum(axis=0)
