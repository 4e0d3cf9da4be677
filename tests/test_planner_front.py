"""The "both" plan over a reordered impress node: the recomputed front counts as kept, so
the load reads only the rest of the budget, and the planner predicts those reads."""
from __future__ import annotations

import numpy as np
import pytest

from impress_flexgen.engine import Request, assemble, open_store
from impress_flexgen.planner import Plan
from impress_flexgen.tiers import TierConfig
from policies import ServingConfig, make_policy

T, PREFIX, RETENTION = 16, 256, 0.5
N = PREFIX // T


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 40000, n).tolist()


@pytest.fixture
def reordered(tiny_runtimes, tmp_path, monkeypatch):
    """(engine with plan auto, store, prefix): impress over a node reordered by importance."""
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "cache"))
    rt = tiny_runtimes["llama-tiny"]
    cfg = ServingConfig(retention=RETENTION, plan="auto")
    policy = make_policy("impress", cfg)
    store = open_store(tmp_path / "s", rt, cfg, policy, chunk_size=T)
    try:
        engine = assemble(rt, policy, store, TierConfig(0, 0)).engine
        prefix = _ids(1, PREFIX)
        engine.serve(Request(prefix, _ids(2, 5), 1))                # stores the prefix
        for seed in (3, 4, 5):
            engine.serve(Request(prefix, _ids(seed, 5), 1))         # importance
        assert store.reorder_now() > 0
        yield engine, store, prefix
    finally:
        store.close()


def _serve_split(engine, monkeypatch, prefix, m: int, query):
    """Serve with the split m forced; the K and V chunks it loaded, per chunk."""
    monkeypatch.setattr(engine.planner, "choose",
                        lambda *a, **k: Plan("both" if 0 < m < N else "load", m, 1.0, {}))
    stats = engine.serve(Request(prefix, query, 1)).stats
    assert stats.plan_split == m
    return stats.chunks_loaded / 2


def test_a_recomputed_front_counts_as_kept_and_is_predicted(reordered, monkeypatch):
    engine, store, prefix = reordered
    query = _ids(6, 5)
    engine.serve(Request(prefix, query, 1))                     # the selection to predict
    match = store.match_prefix(prefix)
    try:
        costs = engine.planner.prefix_costs(match.segments, PREFIX, len(query))
        node = match.segments[0][0]
    finally:
        store.release(match)
    L = engine.math.n_layers
    chunk_s = 2 * store.entry(node, 0).layout.chunk_bytes / engine.planner.disk_bandwidth()
    # The last T tokens lie in these chunks on each layer: always loaded (the recent ones).
    recent = sum(len(np.unique(np.asarray(store.entry(node, layer).physical_of)[PREFIX - T:]
                               // T)) for layer in range(L))
    budget_chunks = int(RETENTION * PREFIX) // T                # 8 of 16
    loaded = {m: _serve_split(engine, monkeypatch, prefix, m, query)
              for m in (0, budget_chunks // 2, budget_chunks)}
    # The layout mixes positions: at m = 0 the selection spans the front...
    assert loaded[0] >= L * budget_chunks
    # ...yet a front that covers half the budget halves the reads of the rest, and one that
    # covers the whole budget leaves only the recent chunks to read.
    assert loaded[budget_chunks // 2] <= 0.6 * loaded[0] + recent
    assert loaded[budget_chunks] <= recent
    for m, chunks in loaded.items():
        predicted = costs.io_after[m] / chunk_s
        assert predicted == pytest.approx(chunks, rel=0.15, abs=L), m


class _Entry:
    def __init__(self, n, c, physical_of):
        self.physical_of, self.mapping = physical_of, np.argsort(physical_of)
        self.layout = type("L", (), {"n_tokens": n, "chunk_size": c, "n_chunks": n // c})


class _Ctx:
    def __init__(self, segments):
        self.segments = segments

    def split(self, values):
        return [values]


def test_chunk_selection_spends_only_the_rest_of_the_budget_past_a_front():
    from policies.base import Segment
    from policies.itf import chunk_selection

    # As a reordered node: chunks 0..6 each mix tokens from all over the first 112, round
    # robin; chunk 7 holds the last 16 (the recent ones).
    logical = np.arange(128)
    physical_of = np.where(logical < 112, (logical % 7) * 16 + logical // 7, logical)
    seg = Segment(type("N", (), {"start": 0})(), 128, _Entry(128, 16, physical_of))
    scores = np.linspace(1.0, 2.0, 128)
    ctx = _Ctx([seg])
    everything = chunk_selection(ctx, scores, 64)[0].tolist()
    assert len(everything) == 4 and {0, 7} <= set(everything)   # sink, recent and two more
    # A front of 48 tokens counted as kept leaves 16 of the budget: the recent chunk alone
    # (every chunk of the selection holds tokens past the front, so dropping the front's
    # chunks would still read all four).
    assert chunk_selection(ctx, scores, 64 - 48, front=48)[0].tolist() == [7]
    assert chunk_selection(ctx, scores, 0, front=96)[0].tolist() == [7]
    # With budget to spare past the front, chunks are counted by their tokens past it.
    wider = chunk_selection(ctx, scores, 96 - 48, front=48)[0].tolist()
    assert 7 in wider and 0 < len(wider) - 1 and len(wider) > 48 // 16


# -- prefix_costs over kept layouts: bit for bit the plain per-layer computation ---------

def _reference_prefix_costs(view, policy, n_layers, segments_nodes, matched, n_new, seconds_of,
                            load_share, select_rate, probe_bandwidth):
    """reads.prefix_costs as a plain loop over layers and segments, nothing kept."""
    from impress_flexgen.planner import PrefixCosts
    from policies.base import Segment

    T, L = view.chunk_size, n_layers
    n = matched // T
    keeps_front = bool(getattr(policy, "keeps_front", False)) and not policy.loads_everything
    budget = policy.config.budget(matched) if keeps_front and matched else 0
    io_after, kept_after = np.zeros(n + 1), np.zeros(n + 1)
    probe_bytes = 0
    for layer in range(L):
        order_s, order_tokens, order_forced = [], [], []
        for si, (node, used) in enumerate(segments_nodes):
            entry = view.entry(node, layer)
            seg = Segment(node, used, entry)
            if policy.reads_probe and policy.probes_layer(layer):
                probe_bytes += entry.layout.probe_stride
            chunk_of = seg.logical_to_chunk()
            held = np.unique(chunk_of)
            k_of = np.minimum((seg.start + np.arange(used)) // T, n - 1)
            if keeps_front:
                recorded = np.intersect1d(view.last_selected_chunks(entry), held)
                forced = (np.unique(chunk_of[-T:]) if si == len(segments_nodes) - 1
                          else held[:0])
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
            ids = held if policy.loads_everything else \
                np.intersect1d(view.last_selected_chunks(entry), held)
            if len(ids) == 0:
                ids, share = held, load_share
            last_k = np.full(entry.layout.n_chunks, -1, dtype=np.int64)
            np.maximum.at(last_k, chunk_of, k_of)
            tokens = np.bincount(chunk_of, minlength=entry.layout.n_chunks)
            add_io, add_kept = np.zeros(n + 1), np.zeros(n + 1)
            np.add.at(add_io, last_k[ids], seconds_of(entry, ids) * share)
            np.add.at(add_kept, last_k[ids], tokens[ids] * share / L)
            io_after += np.cumsum(add_io[::-1])[::-1]
            kept_after += np.cumsum(add_kept[::-1])[::-1]
        if keeps_front and order_s and n:
            seconds, forced = np.concatenate(order_s), np.concatenate(order_forced)
            tokens = np.concatenate(order_tokens)
            past = np.cumsum(tokens[:, ::-1], axis=1)[:, ::-1]
            need = budget - T * np.arange(n)
            free = np.where(forced[:, None], 0.0, past)
            before = past[forced].sum(axis=0)[None] + np.cumsum(free, axis=0) - free
            take = (past > 0) & (forced[:, None] | (before < need[None]))
            io_after[:n] += (take * seconds[:, None]).sum(axis=0)
            kept_after[:n] += (take * past).sum(axis=0) / L
    io_after[n] = kept_after[n] = 0.0
    select_s = select_rate * n_new * matched if not policy.loads_everything else 0.0
    return PrefixCosts(n, T, n_new, tuple(io_after.tolist()), tuple(kept_after.tolist()),
                       probe_bytes / probe_bandwidth, select_s)


def test_prefix_costs_kept_layouts_match_the_plain_computation_across_a_reorder(tmp_path):
    from impress_flexgen.planner import StoreView, prefix_costs
    from impress_flexgen.store import ModelShape, PrefixStore, StoreConfig
    from tests.helpers.kv import seeded_kv

    shape = ModelShape("test", n_layers=3, n_kv_heads=2, head_dim=16)
    cfg = StoreConfig(chunk_size=T, probe_heads=(0,), probe_format="fp16", reorder_interval=0)
    tokens = np.arange(PREFIX) + (1 << 20)
    kv = seeded_kv(shape, PREFIX, seed=1)
    rng = np.random.default_rng(0)

    def select(store):      # a query's importance and selection on every (segment, layer)
        match = store.match_prefix(tokens)
        for node, _ in match.segments:
            for layer in range(shape.n_layers):
                e = store.entry(node, layer)
                n = e.layout.n_tokens
                store.record_selection(e, rng.random(n).astype(np.float32), rng.random(n) < 0.3)
        store.release(match)

    def seconds_of(entry, ids):     # uneven, so that the order of float sums shows
        return 1e-3 * (1 + (np.asarray(ids) % 5) / 7 + entry.layer / 3)

    policies = [make_policy(name, ServingConfig(retention=RETENTION))
                for name in ("impress", "full", "as_like")]
    with PrefixStore(tmp_path / "s", shape, cfg) as store:
        for end in (64, 128, PREFIX):             # three segments: 64, 64 and 128 tokens
            store.insert(tokens[:end], 0, [(k[:, :end], v[:, :end]) for k, v in kv])
        view = StoreView(store)
        results = []
        for rnd in range(2):
            select(store)
            if rnd:
                assert store.reorder_now() > 0      # new versions, their tokens moved
                select(store)
            match = store.match_prefix(tokens)
            try:
                assert len(match.segments) == 3
                for policy in policies:
                    args = (policy, shape.n_layers, match.segments, PREFIX, 5, seconds_of,
                            0.6, 1e-9, 1e9)
                    want = _reference_prefix_costs(view, *args)
                    cold = prefix_costs(StoreView(store), *args)      # nothing kept
                    assert prefix_costs(view, *args) == cold == want, type(policy).__name__
                    assert prefix_costs(view, *args) == want          # kept
                    results.append(want)
            finally:
                store.release(match)
        # The reorder changed what the keeps_front policy would read: a layout kept from
        # before it would have given the old numbers.
        assert results[0] != results[3]
