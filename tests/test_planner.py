"""The plan choice (load / recompute / both) on synthetic costs."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from impress_flexgen.planner import (BOTH_MARGIN, PLANS, Plan, PrefixCosts, choose,
                                     choose_plan, overlap, split_compute, split_costs)
from impress_flexgen.planner.costs import Bandwidth, CostModel, PrefillCurve

L = 30
N, T, Q = 64, 16, 64   # a 1,024-token prefix in 16-token chunks, a 64-token query
COST = CostModel(PrefillCurve(a=1e-3, b=1e-4, c=2e-8), Bandwidth({"disk": 1e9}), n_layers=L)


def _io(per_chunk: float, n: int = N) -> list[float]:
    return [per_chunk] * n


def _equal_io_per_chunk() -> float:
    """Per-chunk load time at which load and recompute are predicted equal."""
    recompute = COST.compute_s(N * T + Q, 0)
    query = COST.compute_s(Q, N * T)
    return (recompute - query / L) / N   # load = io + query / L when io > query


def test_overlap_hides_all_but_one_layer_of_the_shorter():
    assert overlap(3.0, 1.0, 10) == pytest.approx(3.1)
    assert overlap(1.0, 3.0, 10) == overlap(3.0, 1.0, 10)


def test_fast_disk_loads():
    plan = choose("auto", COST, N, T, Q, _io(1e-6))
    assert (plan.mode, plan.split_chunks) == ("load", 0)
    assert plan.predicted_s == plan.predicted["load"] < plan.predicted["recompute"]


def test_slow_disk_recomputes():
    plan = choose("auto", COST, N, T, Q, _io(0.5))   # one chunk outlasts recompute
    assert (plan.mode, plan.split_chunks) == ("recompute", N)
    assert plan.predicted_s == plan.predicted["recompute"] == COST.compute_s(N * T + Q, 0)


def test_comparable_costs_do_both():
    plan = choose("auto", COST, N, T, Q, _io(_equal_io_per_chunk()))
    p = plan.predicted
    assert p["load"] == pytest.approx(p["recompute"], rel=1e-9)
    assert plan.mode == "both" and 0 < plan.split_chunks < N
    assert plan.predicted_s == p["both"] < 0.8 * min(p["recompute"], p["load"])
    # The split is where both halves meet: neither side much longer than the other.
    m = plan.split_chunks
    # The front and the query in one pass over the chunks left to load.
    compute = COST.compute_s(m * T + Q, (N - m) * T)
    io = (N - m) * _equal_io_per_chunk()
    assert abs(compute - io) < 0.1 * max(compute, io)


def test_slower_disk_never_lowers_the_split():
    base = _equal_io_per_chunk()
    for mode in ("auto", "both"):
        splits = [choose(mode, COST, N, T, Q, _io(base * k), probe_s=1e-3 * k).split_chunks
                  for k in np.geomspace(0.01, 100, 60)]
        assert splits == sorted(splits), mode
        if mode == "auto":
            assert splits[0] == 0 and splits[-1] == N   # from load through both to recompute
        assert len(set(splits)) > 3


def test_uneven_chunks_monotonic_too():
    # Some chunks in GPU memory (0 s), some on the CPU tier, the rest on disk.
    rng = np.random.default_rng(0)
    shape = rng.choice([0.0, 0.1, 1.0], size=N)
    splits = [choose("both", COST, N, T, Q, list(shape * _equal_io_per_chunk() * k)).split_chunks
              for k in np.geomspace(0.1, 10, 40)]
    assert splits == sorted(splits)


@pytest.mark.parametrize("per_chunk", [1e-6, 0.5])
def test_forced_modes_are_honoured(per_chunk):
    io = _io(per_chunk)
    load = choose("load", COST, N, T, Q, io)
    assert (load.mode, load.split_chunks, load.predicted_s) == ("load", 0, load.predicted["load"])
    rec = choose("recompute", COST, N, T, Q, io)
    assert (rec.mode, rec.split_chunks) == ("recompute", N)
    both = choose("both", COST, N, T, Q, io)
    assert both.mode == "both" and 0 < both.split_chunks < N
    assert both.predicted_s == both.predicted["both"]
    # Every mode predicts the same candidates; only the choice differs.
    assert load.predicted == rec.predicted == both.predicted


def test_both_without_an_interior_split_takes_the_better_end():
    fast = choose("both", COST, 1, T, Q, [1e-6])
    slow = choose("both", COST, 1, T, Q, [10.0])
    assert (fast.mode, fast.split_chunks) == ("load", 0)
    assert (slow.mode, slow.split_chunks) == ("recompute", 1)
    assert slow.predicted["both"] == slow.predicted["recompute"]


def test_probe_reads_count_against_any_load():
    io = _io(1e-4)
    assert choose("auto", COST, N, T, Q, io).mode == "load"
    # The probe is read whole whatever part loads: it never favours a split over loading.
    small = choose("auto", COST, N, T, Q, io, probe_s=0.01)
    assert small.predicted["load"] == pytest.approx(
        overlap(COST.compute_s(Q, N * T), N * 1e-4 + 0.01, L))
    assert choose("auto", COST, N, T, Q, io, probe_s=100.0).mode == "recompute"


def test_scoring_time_counts_on_the_compute_side():
    io = _io(1e-6)
    plain = choose("load", COST, N, T, Q, io).predicted_s
    scored = choose("load", COST, N, T, Q, io, select_s=0.5).predicted_s
    assert scored == pytest.approx(plain + 0.5, rel=1e-3)   # compute-bound: adds up


def test_kept_fraction_only_shortens_attention():
    io = _io(1e-6)
    full = choose("load", COST, N, T, Q, io).predicted_s
    quarter = choose("load", COST, N, T, Q, io, kept_fraction=0.25).predicted_s
    c = COST.prefill.c
    assert full - quarter == pytest.approx(c * Q * 0.75 * N * T, rel=1e-3)


def test_split_costs_ends_are_load_and_recompute():
    prefix = PrefixCosts.uniform(N, T, Q, _io(2e-3), probe_s=0.01, select_s=0.02)
    costs = split_costs(COST, prefix)
    assert len(costs) == N + 1
    assert costs[0] == pytest.approx(overlap(COST.compute_s(Q, N * T) + 0.02,
                                             N * 2e-3 + 0.01, L))
    assert costs[N] == COST.compute_s(N * T + Q, 0)
    assert split_compute(COST, prefix, N) == costs[N]


def test_reads_at_the_tail_leave_nothing_to_split():
    # A policy whose selection sits in the last chunks (recent tokens): recomputing the
    # front spares none of its reads, so a split there only adds compute; one that pays
    # must reach into the tail.
    tail = 8
    io = [0.0] * (N - tail) + [_equal_io_per_chunk() * N / tail] * tail
    prefix = PrefixCosts.uniform(N, T, Q, io, kept_fraction=tail / N)
    costs = split_costs(COST, prefix)
    assert all(costs[m] >= costs[0] for m in range(1, N - tail))
    plan = choose_plan("auto", COST, prefix)
    assert plan.mode != "both" or plan.split_chunks > N - tail


def _one_split(gain: float) -> tuple[PrefixCosts, int]:
    """Load predicted at 0.1 s (below recompute), one split m* predicted `gain` cheaper,
    every other split far dearer: reads (io-bound) set to give exactly those costs."""
    m_star, end = N // 2, 0.1
    base = PrefixCosts.uniform(N, T, Q, _io(0.0))
    io = [1e3] * (N + 1)
    io[N] = 0.0
    io[0] = end - split_compute(COST, base, 0) / L
    io[m_star] = end * (1 - gain) - split_compute(COST, base, m_star) / L
    return dataclasses.replace(base, io_after=tuple(io)), m_star


def test_an_interior_split_must_win_by_the_margin():
    close, m_star = _one_split(BOTH_MARGIN / 3)
    costs = split_costs(COST, close)
    assert costs[0] == pytest.approx(0.1) and costs[0] < costs[N]
    assert costs[m_star] < costs[0]
    assert choose_plan("auto", COST, close).mode == "load"          # within the margin
    forced = choose_plan("both", COST, close)
    assert (forced.mode, forced.split_chunks) == ("both", m_star)   # asked for: taken
    clear, _ = _one_split(3 * BOTH_MARGIN)
    auto = choose_plan("auto", COST, clear)
    assert (auto.mode, auto.split_chunks) == ("both", m_star)


def test_prefix_costs_refuse_bad_tables():
    good = PrefixCosts.uniform(N, T, Q, _io(1e-3))
    with pytest.raises(ValueError, match="io_after"):
        dataclasses.replace(good, io_after=good.io_after[:-1])
    with pytest.raises(ValueError, match="kept_after"):
        dataclasses.replace(good, kept_after=(-1.0,) + good.kept_after[1:])
    with pytest.raises(ValueError, match="select_s"):
        dataclasses.replace(good, select_s=float("nan"))
    with pytest.raises(ValueError, match="kept_fraction"):
        PrefixCosts.uniform(N, T, Q, _io(1e-3), kept_fraction=1.5)
    assert good.io_after[0] == pytest.approx(N * 1e-3) and good.io_after[N] == 0.0
    assert good.kept_after == tuple(float((N - m) * T) for m in range(N + 1))


def test_nothing_matched_recomputes_the_query():
    for mode in PLANS:
        plan = choose(mode, COST, 0, T, Q, [])
        assert plan == Plan("recompute", 0, COST.compute_s(Q, 0), plan.predicted)
        assert set(plan.predicted) == {"recompute", "load", "both"}


def test_unknown_mode_lists_the_plans():
    with pytest.raises(ValueError) as err:
        choose("fastest", COST, N, T, Q, _io(1e-3))
    assert all(p in str(err.value) for p in PLANS)


@pytest.mark.parametrize("args", [
    {"n_chunks": -1, "chunk_io_s": []},
    {"chunk_tokens": 0},
    {"query_tokens": -1},
    {"chunk_io_s": _io(1e-3, N - 1)},   # one entry short
    {"chunk_io_s": [-1e-3] + _io(1e-3, N - 1)},
    {"chunk_io_s": [float("nan")] + _io(1e-3, N - 1)},
    {"probe_s": -1.0},
    {"probe_s": float("inf")},
])
def test_invalid_inputs(args):
    kw = {"n_chunks": N, "chunk_tokens": T, "query_tokens": Q, "chunk_io_s": _io(1e-3),
          "probe_s": 0.0}
    kw.update(args)
    with pytest.raises(ValueError):
        choose("auto", COST, kw["n_chunks"], kw["chunk_tokens"], kw["query_tokens"],
               kw["chunk_io_s"], kw["probe_s"])


def test_a_recomputed_front_attends_over_its_own_keys_only():
    # The engine's front attends to itself (m*T x m*T); the query to the kept tokens, the
    # front and itself; one pass, so the per-call term once. Not the front over the whole
    # context, which overcharged every split by c * front * kept.
    prefix = PrefixCosts.uniform(N, T, Q, _io(1e-3))
    m = N // 2
    F, K = m * T, (N - m) * T
    p = COST.prefill
    expected = p.a + p.b * (F + Q) + p.c * (F * F + Q * (K + F + Q))
    assert split_compute(COST, prefix, m) == pytest.approx(expected)
    assert split_compute(COST, prefix, m) < COST.compute_s(F + Q, K)
    assert split_compute(COST, prefix, 0) == pytest.approx(COST.compute_s(Q, N * T))
