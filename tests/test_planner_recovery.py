"""The planner recovers: a cached prefill curve 10x off either way is measured again, a
plan not chosen for a while is tried again, and every plan says why it was chosen."""
from __future__ import annotations

import hashlib
import json
import types

import pytest
import torch

from impress_flexgen.planner import PrefixCosts, choose_plan, overlap, split_compute
from impress_flexgen.planner import planner as planning
from impress_flexgen.planner.costs import (CACHE_VERSION, DEFAULT_POINTS, Bandwidth, CostModel,
                                           PrefillCurve, machine_key)

L, N, T, Q = 8, 64, 16, 64
# The machine as it is: a 1,088-token prefill ~0.46 s, the query over the prefix ~0.03 s.
TRUE = PrefillCurve(a=2e-3, b=4e-4, c=2e-8)
TRUE_MODEL = CostModel(TRUE, Bandwidth({"disk": 1e9}), L)


class FakeEngine:
    """What Planner.for_engine reads of an engine; its prefills take TRUE's time."""

    def __init__(self):
        self.max_positions = 8192
        self.tier_names = ("gpu", "cpu", "disk")
        self.policy = types.SimpleNamespace(loads_everything=True)
        self.config = types.SimpleNamespace(retention=1.0)
        self.rt = types.SimpleNamespace(spec=types.SimpleNamespace(name="fake-model"))
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.math = types.SimpleNamespace(n_layers=L)
        self.store = types.SimpleNamespace(
            tiers=types.SimpleNamespace(disk=types.SimpleNamespace(read_limit=None)),
            config=types.SimpleNamespace(chunk_size=T))
        self.measured = 0

    def measure_prefill(self, n, ctx=0):
        self.measured += 1
        return TRUE.predict(n, ctx)


def _cache_file(engine, tmp_path, curve: PrefillCurve):
    """A cached calibration of `curve`, consistent with its own points (so it passes every
    plausibility check): as if calibrated while the machine was 10x slower or faster."""
    key = machine_key(engine.rt.spec.name, engine.device, engine.dtype)
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = tmp_path / "costs" / f"{name}.json"
    path.parent.mkdir(parents=True)
    points = [[n, ctx, curve.predict(n, ctx)] for n, ctx in DEFAULT_POINTS]
    path.write_text(json.dumps({"version": CACHE_VERSION,
                                "key": key + f";budget={planning.CALIBRATION_BUDGET_S}",
                                "points": points, "coef": curve.coef}))
    return path


def _serve(planner, prefix):
    """One request: the plan the planner chooses, run on the true machine."""
    plan = planner.choose("auto", None, N * T, Q)
    compute = split_compute(TRUE_MODEL, prefix, plan.split_chunks)
    ttft = compute if plan.split_chunks >= N else \
        overlap(compute, prefix.io_after[plan.split_chunks], L)
    stats = types.SimpleNamespace(plan=plan.mode, plan_split=plan.split_chunks,
                                  compute_s=compute, ttft_s=ttft, chunks_loaded=0,
                                  computed_tokens=Q, matched_tokens=N * T, select_s=0.0)
    planner.observe(stats, 0, 0.0, 0)
    planner.wait_recalibration(30)
    return plan, ttft


@pytest.mark.parametrize("wrong", [10.0, 0.1])
@pytest.mark.parametrize("per_chunk_s", [0.014, 0.0005])
def test_a_curve_10x_wrong_is_measured_again(tmp_path, monkeypatch, wrong, per_chunk_s):
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path))
    engine = FakeEngine()
    cache = _cache_file(engine, tmp_path, TRUE.scaled(wrong))
    planner = planning.Planner.for_engine(engine)
    prefix = PrefixCosts.uniform(N, T, Q, [per_chunk_s] * N)
    monkeypatch.setattr(planner, "prefix_costs", lambda *a: prefix)
    assert planner.cost().prefill == TRUE.scaled(wrong)     # the cache was trusted
    best = choose_plan("auto", TRUE_MODEL, prefix)
    best_s = [*(overlap(split_compute(TRUE_MODEL, prefix, m), prefix.io_after[m], L)
                for m in range(N)), split_compute(TRUE_MODEL, prefix, N)]
    fastest = min(best_s)
    served = [_serve(planner, prefix) for _ in range(8)]
    # Back on the faster plan within a few requests, and staying there.
    assert all(ttft <= 1.1 * fastest for _, ttft in served[4:]), \
        [(p.mode, p.split_chunks, round(t, 3)) for p, t in served]
    assert served[-1][0].mode == best.mode
    if any(ttft > 1.1 * fastest for _, ttft in served[:4]):   # the wrong curve misled it
        assert planner.recalibrations == 1 and engine.measured > 0
        doc = json.loads(cache.read_text())   # the cache rewritten with the new curve
        assert doc["coef"] == pytest.approx(TRUE.coef, rel=1e-3)
    assert {p.reason for p, _ in served} == {"predicted"}


def test_a_close_plan_not_chosen_for_a_while_is_explored(tmp_path, monkeypatch):
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path))
    engine = FakeEngine()
    planner = planning.Planner.for_engine(engine)
    planner.cost()
    # One chunk: no interior split; load predicted a little dearer than recompute.
    recompute = TRUE.predict(T + Q)
    prefix = PrefixCosts.uniform(1, T, Q, [recompute * 1.2])
    monkeypatch.setattr(planner, "prefix_costs", lambda *a: prefix)
    reasons = [(p.mode, p.reason) for p, _ in
               (_serve(planner, prefix) for _ in range(2 * planning.EXPLORE_AFTER + 2))]
    explored = [i for i, r in enumerate(reasons) if r[1] == "explore"]
    assert [reasons[i] for i in explored] == [("load", "explore")] * 2
    assert explored[0] == planning.EXPLORE_AFTER - 1   # after EXPLORE_AFTER without it
    assert all(r == ("recompute", "predicted") for i, r in enumerate(reasons)
               if i not in explored)
    assert planner.snapshot()["explored"] == 2


def test_a_plan_far_dearer_is_never_explored(tmp_path, monkeypatch):
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path))
    planner = planning.Planner.for_engine(FakeEngine())
    prefix = PrefixCosts.uniform(1, T, Q, [TRUE.predict(T + Q) * 10])
    monkeypatch.setattr(planner, "prefix_costs", lambda *a: prefix)
    plans = [_serve(planner, prefix)[0] for _ in range(3 * planning.EXPLORE_AFTER)]
    assert {(p.mode, p.reason) for p in plans} == {("recompute", "predicted")}


def test_a_forced_plan_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path))
    planner = planning.Planner.for_engine(FakeEngine())
    prefix = PrefixCosts.uniform(N, T, Q, [0.001] * N)
    monkeypatch.setattr(planner, "prefix_costs", lambda *a: prefix)
    plan = planner.choose("both", None, N * T, Q)
    assert (plan.mode, plan.reason) == ("both", "forced")


def test_millisecond_requests_never_trigger_a_recalibration(tmp_path, monkeypatch):
    # A tiny model's prefills are overheads more than curve: 5x off in milliseconds is noise.
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path))
    engine = FakeEngine()
    engine.measure_prefill = lambda n, ctx=0: TRUE.predict(n, ctx) / 10   # ~1 ms prefills
    planner = planning.Planner.for_engine(engine)
    prefix = PrefixCosts.uniform(1, T, 4, [1e-5])
    monkeypatch.setattr(planner, "prefix_costs", lambda *a: prefix)
    for _ in range(10):
        plan = planner.choose("auto", None, T, 4)
        stats = types.SimpleNamespace(plan=plan.mode, plan_split=plan.split_chunks,
                                      compute_s=0.0, ttft_s=0.015,
                                      chunks_loaded=0, computed_tokens=4, matched_tokens=T,
                                      select_s=0.0)
        assert stats.ttft_s > 10 * plan.predicted_s
        planner.observe(stats, 0, 0.0, 0)
    assert planner.wait_recalibration(5) and planner.recalibrations == 0


def test_closing_stops_a_recalibration_under_way(tmp_path, monkeypatch):
    """A recalibration runs prefills on the engine from its own thread: closing the planner
    stops it after the point it is measuring and waits for it, so it never outlives the
    engine (a thread still inside the model when the process exits aborts the process)."""
    import threading
    import time

    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path))
    engine = FakeEngine()
    measuring = threading.Event()

    def slow(n, ctx=0):
        measuring.set()
        time.sleep(0.2)
        return TRUE.predict(n, ctx)

    engine.measure_prefill = slow
    planner = planning.Planner.for_engine(engine)
    planner.budget_s = None                    # every point: far longer than the test waits
    planner.recalibrate()
    assert measuring.wait(5)
    t0 = time.perf_counter()
    planner.close()
    assert time.perf_counter() - t0 < 1.0
    assert planner.wait_recalibration(0) and planner.recalibrations == 0
