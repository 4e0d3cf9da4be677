"""The engine's planner: what it expects each part of a stored prefix to cost, and what it
learns from the requests it plans."""
from __future__ import annotations

import pytest

from impress_flexgen.engine import Request, RequestStats, assemble, open_store
from impress_flexgen.planner import split_compute
from impress_flexgen.planner.planner import _Learned
from impress_flexgen.tiers import TierConfig
from impress_flexgen.tiers.chain import DISK
from policies import ServingConfig, make_policy
from tests.helpers.ids import prompt_ids as _ids

T = 16


@pytest.fixture
def planned(tiny_runtimes, tmp_path, monkeypatch):
    """make(policy, read_limit) -> (engine with plan auto, store holding a 128-token
    prefix, that prefix)."""
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "cache"))
    rt = tiny_runtimes["llama-tiny"]
    stores = []

    def make(policy_name="full", read_limit=None):
        cfg = ServingConfig(retention=0.25, plan="auto")
        policy = make_policy(policy_name, cfg)
        store = open_store(tmp_path / f"s{len(stores)}", rt, cfg, policy, chunk_size=T,
                           read_limit_mb_s=read_limit)
        stores.append(store)
        engine = assemble(rt, policy, store, TierConfig(0, 0)).engine
        prefix = _ids(1, 128)
        engine.serve(Request(prefix, _ids(2, 5), 1))            # stores 128 tokens
        return engine, store, prefix

    yield make
    for store in stores:
        store.close()


def _costs(engine, store, prefix, n_new=5):
    match = store.match_prefix(prefix)
    try:
        matched = sum(u for _, u in match.segments)
        return engine.planner.prefix_costs(match.segments, matched, n_new), match.segments
    finally:
        store.release(match)


def test_learned_is_a_median_that_one_outlier_cannot_move():
    x = _Learned(1.0, prior_weight=2)
    assert x.value == 1.0
    x.observe(3.0)
    assert x.value == 1.0          # [1, 1, 3]
    x.observe(3.0)
    x.observe(3.0)
    assert x.value == 3.0          # a lasting change wins in a few
    for _ in range(5):
        x.observe(2.0)
    assert x.value == 2.0 and x.count == 8
    empty = _Learned(0.5)
    assert empty.value == 0.5
    empty.observe(0.1)
    assert empty.value == 0.1      # no prior weight: the first observation replaces it


def test_full_policy_pays_every_chunk_past_the_split(planned):
    engine, store, prefix = planned("full")
    costs, segments = _costs(engine, store, prefix)
    n, layers = 128 // T, engine.math.n_layers
    chunk = 2 * store.entry(segments[0][0], 0).layout.chunk_bytes   # K and V
    per_chunk = layers * chunk / engine.planner.disk_bandwidth()
    assert costs.n_chunks == n and costs.query_tokens == 5
    assert costs.io_after == pytest.approx([(n - m) * per_chunk for m in range(n + 1)])
    assert costs.kept_after == pytest.approx([(n - m) * T for m in range(n + 1)])
    assert costs.probe_s == 0.0 and costs.select_s == 0.0


def test_impress_expects_its_last_selection_and_the_whole_probe(planned):
    engine, store, prefix = planned("impress")
    engine.serve(Request(prefix, _ids(3, 5), 1))                 # records a selection
    costs, segments = _costs(engine, store, prefix)
    node = segments[0][0]
    bw = engine.planner.disk_bandwidth()
    selected = [store.last_selected_chunks(store.entry(node, layer))
                for layer in range(engine.math.n_layers)]
    assert all(0 < len(s) < 128 // T for s in selected)          # a selection, not all
    chunk = 2 * store.entry(node, 0).layout.chunk_bytes
    assert costs.io_after[0] == pytest.approx(sum(len(s) for s in selected) * chunk / bw)
    assert all(a >= b for a, b in zip(costs.io_after, costs.io_after[1:]))
    probe = sum(store.entry(node, layer).layout.probe_stride
                for layer in range(engine.math.n_layers))
    assert costs.probe_s == pytest.approx(probe / bw) and costs.probe_s > 0
    assert costs.select_s > 0          # learned from the request that recorded it


def test_a_read_limit_caps_the_learned_bandwidth(planned):
    engine, _, _ = planned("full", read_limit=0.5)
    engine.planner.bandwidth.observe(DISK, 1 << 30, 0.01)       # reads passed on credit
    assert engine.planner.disk_bandwidth() == pytest.approx(0.5e6)


def test_observe_learns_speed_and_correction_without_steering_the_choice(planned,
                                                                           monkeypatch):
    # The tiny model's prefills are shorter than what the planner trusts as a speed sample.
    monkeypatch.setattr("impress_flexgen.planner.planner._MIN_COMPUTE_S", 0.0)
    engine, store, prefix = planned("full")
    planner = engine.planner
    match = store.match_prefix(prefix)
    try:
        def served(plan, ttft_over_raw=1.5, compute_over_curve=1.2):
            """The stats of a request that ran `plan` (just chosen) this much slower."""
            raw = plan.predicted_s / planner.correction[plan.mode].value
            compute = split_compute(planner.cost(),
                                    planner.prefix_costs(match.segments, 128, 5),
                                    plan.split_chunks)
            return RequestStats(ttft_s=ttft_over_raw * raw,
                                compute_s=compute_over_curve * compute, plan=plan.mode,
                                plan_split=plan.split_chunks, predicted_ttft_s=plan.predicted_s,
                                matched_tokens=128, computed_tokens=5 + T * plan.split_chunks)

        def choose():
            return planner.choose("auto", match.segments, 128, 5)

        for _ in range(3):
            plan = choose()
            planner.observe(served(plan), 0, 0.0, 0)
        assert planner.speed.value == pytest.approx(1.2)
        assert planner.correction[plan.mode].value == pytest.approx(1.5)

        # Stats of another plan than the one chosen (a retry): nothing is learned.
        plan = choose()
        other = served(plan, ttft_over_raw=4.0, compute_over_curve=4.0)
        other.plan_split += 1
        planner.observe(other, 0, 0.0, 0)
        assert planner.speed.value == pytest.approx(1.2)
        assert planner.correction[plan.mode].value == pytest.approx(1.5)

        # A plan's correction scales what is reported, never which plan is chosen.
        before = choose()
        was = planner.correction[before.mode].value
        for mode, c in planner.correction.items():
            for _ in range(5):
                c.observe(0.5 if mode == before.mode else 2.0)
        after = choose()
        assert (after.mode, after.split_chunks) == (before.mode, before.split_chunks)
        assert after.predicted_s == pytest.approx(before.predicted_s / was * 0.5)
    finally:
        store.release(match)
