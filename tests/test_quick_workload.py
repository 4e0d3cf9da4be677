"""`run --quick` on a model whose passes are slow: the workload chosen from the predicted
cost, and the bytes-and-FLOPs estimate of the prefill curve that predicts it."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from impress_flexgen.planner.costs import PrefillCurve
from impress_flexgen.entrypoints.quick import DEFAULT, RUNGS, TARGET_S, choose, predicted_s
from impress_flexgen.models.footprint import footprint
from impress_flexgen.models.formats import WeightFormat
from impress_flexgen.planner.estimate import Rates, estimate_curve
from impress_flexgen.models.quant import Groups
from impress_flexgen.models.runtime import RuntimeConfig, resolve_spec

# A CPU ten times slower than the 2-core development machine (which measured about
# 1.4e11 flop/s, 4.8e10 B/s streamed, 2e9 4-bit values/s unpacked).
SLOW = Rates(flops_per_s=1.4e10, bytes_per_s=4.8e9, unpack_per_s=2e8, disk_bytes_per_s=1e8)


def test_predicted_cost_counts_every_prefill_and_decode_step():
    per_token = PrefillCurve(0.0, 1.0, 0.0)       # one second per token computed
    w = DEFAULT
    # prefixes, one warm-up query each, measured queries; a query's first new token comes
    # with its prefill, every later one is a one-token pass.
    want = w.prefixes * (w.prefix_tokens + w.query_tokens
                         + w.queries * (w.query_tokens + w.new_tokens - 1))
    assert predicted_s(w, per_token.predict) == pytest.approx(want)
    per_pass = PrefillCurve(1.0, 0.0, 0.0)        # one second per pass over the model
    assert predicted_s(w, per_pass.predict) == pytest.approx(
        w.prefixes * (2 + w.queries * w.new_tokens))


def test_a_fast_model_keeps_the_default_quick_workload():
    w, why = choose(PrefillCurve(0.01, 1e-3, 1e-7).predict)
    assert (w, why) == (DEFAULT, None)
    # What the flags ask for is kept too.
    w, why = choose(PrefillCurve(0.01, 1e-3, 1e-7).predict, query_tokens=16, new_tokens=3)
    assert why is None and (w.query_tokens, w.new_tokens) == (16, 3)
    assert (w.prefixes, w.prefix_tokens, w.queries) == (2, 512, 2)


def test_a_slow_model_gets_the_first_rung_that_fits_and_says_why():
    curve = PrefillCurve(30.0, 0.3, 1e-5)         # OPT-30B in 4-bit on a 2-core CPU
    w, why = choose(curve.predict)
    assert predicted_s(DEFAULT, curve.predict) > TARGET_S
    assert predicted_s(w, curve.predict) <= TARGET_S
    assert w in RUNGS
    bigger = RUNGS[:RUNGS.index(w)]
    assert all(predicted_s(r, curve.predict) > TARGET_S for r in bigger)
    assert why is not None and "predicted at" in why and "min" in why


def test_a_model_too_slow_for_any_rung_gets_the_smallest_and_flags_are_a_ceiling():
    w, why = choose(PrefillCurve(600.0, 1.0, 0.0).predict)
    assert w == RUNGS[-1] and why is not None
    w, _ = choose(PrefillCurve(600.0, 1.0, 0.0).predict, query_tokens=4, new_tokens=1)
    assert (w.query_tokens, w.new_tokens) == (4, 1)


@pytest.mark.parametrize("model", ["opt-tiny", "smollm2-135m"])
def test_small_models_keep_the_default_even_on_a_slow_cpu(model):
    spec = resolve_spec(RuntimeConfig(model=model), check_placement=False)
    weights = footprint(spec).weight_bytes
    plan = SimpleNamespace(format=WeightFormat("fp32", spec.config.dtype),
                           weights={"gpu": weights, "cpu": 0, "disk": 0})
    assert choose(estimate_curve(spec, plan, SLOW).predict) == (DEFAULT, None)


def test_estimate_reads_disk_unpacks_4bit_and_multiplies_every_weight():
    spec = resolve_spec(RuntimeConfig(model="opt-tiny"), check_placement=False)
    fp = footprint(spec)
    params = sum(e * n for layer, n in zip(fp.elements, fp.counts) for e in layer)
    rates = Rates(flops_per_s=1e9, bytes_per_s=1e8, unpack_per_s=1e7, disk_bytes_per_s=1e6)
    fp32 = WeightFormat("fp32", spec.config.dtype)
    in_ram = estimate_curve(spec, SimpleNamespace(format=fp32, weights={
        "gpu": fp.weight_bytes, "cpu": 0, "disk": 0}), rates)
    assert in_ram.a == pytest.approx(fp.weight_bytes / 1e8)
    assert in_ram.b == pytest.approx(2 * params / 1e9)
    c = spec.config
    assert in_ram.c == pytest.approx(4 * c.input_dim * c.num_hidden_layers / 1e9)
    int4 = dataclasses.replace(fp32, name="int4", groups=Groups(64, 0))
    on_disk = estimate_curve(spec, SimpleNamespace(format=int4, weights={
        "gpu": 1000, "cpu": 0, "disk": 5000}), rates)
    assert on_disk.a == pytest.approx(5000 / 1e6 + params / 1e7 + params * 4 / 1e8)
    assert on_disk.b == in_ram.b


def test_quick_prefers_the_curve_an_earlier_start_measured(tmp_path, monkeypatch, capsys):
    import torch

    from impress_flexgen.planner.costs import machine_key
    from impress_flexgen.entrypoints.run import parse_args
    from impress_flexgen.entrypoints.workload import quick_for
    from impress_flexgen.planner import planner as planner_mod
    from impress_flexgen.planner.costs import _write_cache

    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = resolve_spec(RuntimeConfig(model="opt-tiny"), check_placement=False)
    rt = SimpleNamespace(spec=spec, plan=SimpleNamespace(
        format=WeightFormat("fp32", spec.config.dtype),
        weights={"gpu": footprint(spec).weight_bytes, "cpu": 0, "disk": 0}))
    args = parse_args(["--model", "opt-tiny", "--quick"])
    quick_for(rt, args)                      # estimated: a tiny model keeps the default
    assert (args.prefixes, args.prefix_tokens, args.queries) == (2, 512, 2)
    assert capsys.readouterr().out == ""
    # An earlier start measured a slow curve here (as if each pass took a minute).
    slow = PrefillCurve(60.0, 0.5, 0.0)
    path, key = planner_mod.cache_entry(
        machine_key(spec.name, torch.device("cpu"), torch.float32),
        planner_mod.CALIBRATION_BUDGET_S)
    _write_cache(path, key, [(16, 0, slow.predict(16)), (64, 0, slow.predict(64)),
                             (256, 0, slow.predict(256))], slow)
    quick_for(rt, args)
    w, _ = choose(slow.predict)
    assert (args.prefixes, args.prefix_tokens, args.queries, args.query_tokens,
            args.max_new_tokens) == (w.prefixes, w.prefix_tokens, w.queries, w.query_tokens,
                                     w.new_tokens)
    printed = capsys.readouterr().out
    assert printed.startswith("quick workload: ") and "measured here" in printed
