"""The cost model: prefill curve fit, calibration cache, bandwidth EWMA, CostModel."""
from __future__ import annotations

import json
import threading

import pytest

from impress_flexgen.planner.costs import (DEFAULT_POINTS, Bandwidth, CostModel, PrefillCurve,
                                           calibrate, machine_key)

TRUE = PrefillCurve(a=2e-3, b=5e-5, c=1e-8)


def _points(curve, grid=DEFAULT_POINTS):
    return [(n, ctx, curve.predict(n, ctx)) for n, ctx in grid]


def test_predict_follows_the_formula():
    assert TRUE.predict(100, 50) == pytest.approx(2e-3 + 5e-5 * 100 + 1e-8 * 100 * 150)
    assert TRUE.predict(0, 1000) == 0.0   # nothing to prefill
    assert TRUE.predict(64, 4096) > TRUE.predict(64, 0)   # attention over the context


def test_fit_recovers_exact_coefficients():
    fit = PrefillCurve.fit(_points(TRUE))
    for got, want in zip(fit.coef, TRUE.coef):
        assert got == pytest.approx(want, rel=1e-6)
    assert fit.predict(3000, 1000) == pytest.approx(TRUE.predict(3000, 1000), rel=1e-6)


def test_fit_never_goes_negative():
    # Pure per-token cost, measured a little low on long prefills: unconstrained least
    # squares would answer with a negative intercept or attention term.
    pts = [(n, ctx, 1e-4 * n * (0.97 if n >= 1024 else 1.0)) for n, ctx in DEFAULT_POINTS]
    fit = PrefillCurve.fit(pts)
    assert min(fit.coef) >= 0
    for n, ctx, s in pts:
        assert fit.predict(n, ctx) == pytest.approx(s, rel=0.1)


@pytest.mark.parametrize("pts", [
    [(16, 0, 0.1), (32, 0, 0.2)],                      # too few points
    [(16, 0, 0.1), (32, 0, 0.2), (0, 0, 0.1)],         # no new tokens
    [(16, 0, 0.1), (32, 0, 0.2), (64, -1, 0.1)],       # negative context
    [(16, 0, 0.1), (32, 0, 0.2), (64, 0, float("nan"))],
    [(16, 0, 0.1), (32, 0, 0.2), (64, 0, 0.0)],
])
def test_fit_refuses_bad_points(pts):
    with pytest.raises(ValueError):
        PrefillCurve.fit(pts)


def test_curve_refuses_negative_coefficients():
    with pytest.raises(ValueError, match="coefficient"):
        PrefillCurve(1e-3, -1e-5, 0.0)


class Meter:
    """A fake measure(): TRUE's time plus noise that shrinks with each repeat."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def __call__(self, n, ctx):
        self.calls.append((n, ctx))
        repeat = sum(1 for c in self.calls if c == (n, ctx))
        return TRUE.predict(n, ctx) * (1 + 0.5 / repeat)   # 1.5x, 1.25x, ...


def test_calibrate_takes_the_min_of_repeats_and_caches(tmp_path):
    cache = tmp_path / "sub" / "prefill.json"
    meter = Meter()
    curve = calibrate(meter, DEFAULT_POINTS, cache, key="k1", repeats=2)
    assert len(meter.calls) == 2 * len(DEFAULT_POINTS)
    assert curve.predict(1024, 0) == pytest.approx(TRUE.predict(1024, 0) * 1.25, rel=1e-6)
    doc = json.loads(cache.read_text())
    assert set(doc) == {"version", "key", "points", "coef"}
    assert doc["key"] == "k1" and doc["coef"] == pytest.approx(curve.coef)
    assert [tuple(p[:2]) for p in doc["points"]] == list(DEFAULT_POINTS)
    assert sorted(p.name for p in cache.parent.iterdir()) == ["prefill.json"]  # no tmp left

    def refuse(n, ctx):
        raise AssertionError("a cached calibration must not measure")

    assert calibrate(refuse, DEFAULT_POINTS, cache, key="k1") == curve
    other = Meter()
    calibrate(other, DEFAULT_POINTS, cache, key="k2", repeats=1)   # another machine
    assert len(other.calls) == len(DEFAULT_POINTS)
    assert json.loads(cache.read_text())["key"] == "k2"


@pytest.mark.parametrize("garbage", [
    b"\x00\xffnot json", b"[1, 2, 3]", b'{"version": 1, "key": "k", "coef": [1, 2]}',
    b'{"version": 1, "key": "k", "coef": [0.1, -1, 0]}',
    b'{"version": 1, "key": "k", "coef": ["a", "b", "c"]}',
    b'{"version": 1, "key": "k"}',
])
def test_corrupt_cache_is_measured_again_and_rewritten(tmp_path, garbage):
    cache = tmp_path / "prefill.json"
    cache.write_bytes(garbage)
    meter = Meter()
    curve = calibrate(meter, DEFAULT_POINTS, cache, key="k", repeats=1)
    assert len(meter.calls) == len(DEFAULT_POINTS)
    doc = json.loads(cache.read_text())
    assert doc["key"] == "k" and doc["coef"] == pytest.approx(curve.coef)


def test_calibrate_without_cache_and_bad_repeats():
    meter = Meter()
    calibrate(meter, DEFAULT_POINTS, None, repeats=3)
    assert len(meter.calls) == 3 * len(DEFAULT_POINTS)
    with pytest.raises(ValueError, match="repeats"):
        calibrate(meter, DEFAULT_POINTS, None, repeats=0)


def test_machine_key_names_what_the_curve_depends_on():
    import torch

    key = machine_key("smollm2-135m", "cpu", torch.float32)
    assert "smollm2-135m" in key and "float32" in key and torch.__version__ in key
    assert key == machine_key("smollm2-135m", "cpu", torch.float32)
    assert key != machine_key("smollm2-135m", "cpu", torch.bfloat16)
    assert key != machine_key("opt-125m", "cpu", torch.float32)


def test_bandwidth_default_then_ewma():
    bw = Bandwidth({"disk": 1e9, "cpu": 1e10})
    assert bw.get("disk") == 1e9
    bw.observe("disk", 1 << 20, (1 << 20) / 2e8)   # first observation replaces the default
    assert bw.get("disk") == pytest.approx(2e8)
    bw.observe("disk", 1 << 20, (1 << 20) / 4e8)
    assert bw.get("disk") == pytest.approx(2e8 + 0.3 * (4e8 - 2e8))
    bw.observe("disk", 1000, 1e-9)              # tiny: overhead, not bandwidth
    bw.observe("disk", 1 << 20, 0.0)
    bw.observe("disk", 1 << 20, -1.0)
    assert bw.get("disk") == pytest.approx(2.6e8)
    assert bw.get("cpu") == 1e10
    assert bw.snapshot() == {"disk": pytest.approx(2.6e8), "cpu": 1e10}


def test_bandwidth_is_thread_safe():
    bw = Bandwidth({"disk": 1.0})

    def observe():
        for _ in range(2000):
            bw.observe("disk", 1 << 20, (1 << 20) / 5e8)

    threads = [threading.Thread(target=observe) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bw.get("disk") == pytest.approx(5e8)


def test_bandwidth_refuses_bad_defaults_and_unknown_tiers():
    with pytest.raises(ValueError, match="disk"):
        Bandwidth({"disk": 0})
    with pytest.raises(KeyError, match="nvme"):
        Bandwidth({"disk": 1e9}).get("nvme")


def test_cost_model():
    cost = CostModel(TRUE, Bandwidth({"disk": 1e9, "cpu": 1e10}), n_layers=30)
    assert cost.compute_s(64, 1024) == TRUE.predict(64, 1024)
    assert cost.io_s({"disk": 10 ** 9, "cpu": 10 ** 10}) == pytest.approx(2.0)
    assert cost.io_s({"disk": 0, "gpu": 0}) == 0.0   # nothing to read: no bandwidth needed
    with pytest.raises(ValueError, match="n_layers"):
        CostModel(TRUE, Bandwidth({}), n_layers=0)


def test_scaled_curve_is_the_same_curve_slower():
    slow = TRUE.scaled(1.5)
    assert slow.coef == pytest.approx([1.5 * x for x in TRUE.coef])
    assert slow.predict(300, 700) == pytest.approx(1.5 * TRUE.predict(300, 700))
    with pytest.raises(ValueError, match="coefficient"):
        TRUE.scaled(-1.0)


def test_calibrate_within_a_budget_leaves_out_the_longest_points():
    meter = Meter()
    # TRUE's points cost 3 ms to 0.43 s (first runs): 0.2 s keeps the cheap ones only.
    curve = calibrate(meter, DEFAULT_POINTS, None, repeats=1, budget_s=0.2)
    measured = sorted(set(meter.calls))
    assert 3 <= len(measured) < len(DEFAULT_POINTS)
    assert sum(TRUE.predict(n, ctx) * 1.5 for n, ctx in measured) <= 0.2 + \
        max(TRUE.predict(n, ctx) * 1.5 for n, ctx in measured)
    assert (4096, 0) not in measured and (16, 0) in measured
    assert curve.predict(64, 0) == pytest.approx(TRUE.predict(64, 0) * 1.5, rel=0.05)


# -- the calibration cache as untrusted input -------------------------------------------

def _cached(coef, points=None, key="k"):
    from impress_flexgen.planner.costs import CACHE_VERSION

    doc = {"version": CACHE_VERSION, "key": key, "coef": coef}
    if points is not None:
        doc["points"] = points
    return json.dumps(doc).encode()


def _measured_again(tmp_path, caplog, content: bytes | None = None, setup=None):
    cache = tmp_path / "prefill.json"
    if content is not None:
        cache.write_bytes(content)
    if setup is not None:
        setup(cache)
    meter = Meter()
    done = {}

    def go():
        done["curve"] = calibrate(meter, DEFAULT_POINTS, cache, key="k", repeats=1)

    t = threading.Thread(target=go, daemon=True)
    with caplog.at_level("WARNING", logger="impress_flexgen.planner.costs"):
        t.start()
        t.join(10)
    assert not t.is_alive(), "reading the calibration cache blocked"
    assert len(meter.calls) == len(DEFAULT_POINTS)
    assert "ignoring prefill calibration cache" in caplog.text
    doc = json.loads(cache.read_text())   # rewritten as a regular file
    assert doc["coef"] == pytest.approx(done["curve"].coef)
    return done["curve"]


def test_a_fifo_in_place_of_the_cache_never_blocks(tmp_path, caplog):
    import os

    _measured_again(tmp_path, caplog, setup=lambda p: os.mkfifo(p))


def test_deeply_nested_json_is_a_warning_not_a_traceback(tmp_path, caplog):
    _measured_again(tmp_path, caplog, b"[" * 200_000 + b"]" * 200_000)


def test_an_oversized_cache_is_not_read(tmp_path, caplog):
    good = PrefillCurve.fit(_points(TRUE))
    _measured_again(tmp_path, caplog, _cached(good.coef) + b" " * (2 << 20))


@pytest.mark.parametrize("coef", [
    [0, 0, 0],                 # free prefills: every request would recompute forever
    [0.5, 0, 0],               # no per-token work
    [0, 1e3, 0],               # a 1,024-token prefill in 12 days
    [1e-12, 1e-15, 0],         # ... or in a picosecond
    [False, 1e-4, 1e-8],       # not numbers
])
def test_implausible_coefficients_are_measured_again(tmp_path, caplog, coef):
    curve = _measured_again(tmp_path, caplog, _cached(coef))
    assert curve.predict(1024, 0) == pytest.approx(TRUE.predict(1024, 0) * 1.5, rel=1e-6)


def test_coefficients_far_from_their_own_points_are_measured_again(tmp_path, caplog):
    # Plausible on their own, but 10x the points they claim to be fitted to (edited).
    points = [[n, ctx, TRUE.predict(n, ctx)] for n, ctx in DEFAULT_POINTS]
    _measured_again(tmp_path, caplog, _cached([10 * c for c in TRUE.coef], points))


def test_a_plausible_cache_is_used(tmp_path):
    points = [[n, ctx, TRUE.predict(n, ctx)] for n, ctx in DEFAULT_POINTS]
    cache = tmp_path / "prefill.json"
    cache.write_bytes(_cached(TRUE.coef, points))

    def refuse(n, ctx):
        raise AssertionError("a plausible cached calibration must not measure")

    assert calibrate(refuse, DEFAULT_POINTS, cache, key="k") == TRUE


def test_the_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    from impress_flexgen.planner import planner as planning

    monkeypatch.delenv("IMPRESS_FLEXGEN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert planning.cache_dir() == tmp_path / "xdg" / "impress_flexgen"
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "own"))
    assert planning.cache_dir() == tmp_path / "own"


def test_the_cache_file_is_private(tmp_path):
    cache = tmp_path / "prefill.json"
    calibrate(Meter(), DEFAULT_POINTS, cache, key="k", repeats=1)
    assert cache.stat().st_mode & 0o077 == 0


# -- a budget no single point fits: a model far larger than memory -----------------------

class PassMeter:
    """A fake measure() whose every point is a pass over a huge model: `pass_s` seconds
    plus TRUE's per-token cost, said (not slept)."""

    def __init__(self, pass_s: float):
        self.pass_s = pass_s
        self.calls: list[tuple[int, int]] = []

    def curve(self) -> PrefillCurve:
        return PrefillCurve(self.pass_s, TRUE.b, TRUE.c)

    def __call__(self, n, ctx):
        self.calls.append((n, ctx))
        return self.curve().predict(n, ctx)


def test_calibrate_measures_nothing_when_the_prior_puts_one_point_past_the_budget(tmp_path):
    meter = PassMeter(30.0)
    said = []
    prior = PrefillCurve(25.0, TRUE.b, TRUE.c)   # an estimate, a little optimistic
    cache = tmp_path / "prefill.json"
    curve = calibrate(meter, DEFAULT_POINTS, cache, key="k", budget_s=20.0, prior=lambda: prior,
                      say=said.append)
    assert meter.calls == []                      # not one pass over the model
    assert curve == prior
    assert len(said) == 1 and "estimated" in said[0] and "20 s" in said[0]
    assert not cache.exists()                     # an estimate is not a measurement


def test_calibrate_scales_the_prior_by_the_points_it_could_afford():
    # Each point takes 6 s: one run each of three would be 18 s, so the prior (2x too
    # low) lets the first through, then, scaled by what it took, the second, not a third.
    meter = PassMeter(6.0)
    prior = PrefillCurve(3.0, TRUE.b / 2, TRUE.c / 2)
    curve = calibrate(meter, DEFAULT_POINTS, None, repeats=2, budget_s=13.0,
                      prior=lambda: prior, say=lambda _: None)
    spent = sum(meter.curve().predict(n, ctx) for n, ctx in meter.calls)
    assert spent <= 13.0
    assert 1 <= len(set(meter.calls)) < 3
    assert curve.predict(16, 0) == pytest.approx(meter.curve().predict(16, 0), rel=0.01)


def test_calibrate_with_a_prior_that_fits_measures_as_without_one():
    with_prior, without = Meter(), Meter()
    a = calibrate(with_prior, DEFAULT_POINTS, None, repeats=1, budget_s=0.2,
                  prior=lambda: TRUE)
    b = calibrate(without, DEFAULT_POINTS, None, repeats=1, budget_s=0.2)
    assert with_prior.calls == without.calls and a == b
    none = Meter()   # a prior that has no estimate (a GPU): as without one
    assert calibrate(none, DEFAULT_POINTS, None, repeats=1, budget_s=0.2,
                     prior=lambda: None) == b and none.calls == without.calls
