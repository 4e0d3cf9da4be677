"""The "both" plan over a reordered impress node: the recomputed front counts as kept, so
the load reads only the rest of the budget, and the planner predicts those reads."""
from __future__ import annotations

import numpy as np
import pytest

from impress_flexgen.engine import Engine, Request, TierSizes, open_store
from impress_flexgen.planner import Plan
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
        engine = Engine(rt, store, policy, TierSizes(0, 0))
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
