"""A cold start is not silent: slow start-up steps say so on stderr, quick ones do not."""
from __future__ import annotations

import time

import pytest

from impress_flexgen import progress
from impress_flexgen.models import runtime
from impress_flexgen.planner.costs import DEFAULT_POINTS, PrefillCurve, calibrate


@pytest.fixture(autouse=True)
def progress_on(monkeypatch):
    monkeypatch.setenv("IMPRESS_FLEXGEN_PROGRESS", "1")


def test_the_environment_silences_progress(monkeypatch, capsys):
    monkeypatch.setenv("IMPRESS_FLEXGEN_PROGRESS", "0")
    with progress.step("converting weights"):
        pass
    assert capsys.readouterr().err == ""


def test_a_step_is_announced_and_timed(capsys):
    with progress.step("converting weights"):
        pass
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "impress_flexgen: converting weights..."
    assert err[1].startswith("impress_flexgen: converting weights: done in ")


def test_a_quick_step_stays_quiet_and_a_slow_one_speaks(capsys):
    with progress.step("quick", after_s=5):
        pass
    assert capsys.readouterr().err == ""
    with progress.step("slow", after_s=0.05):
        time.sleep(0.3)
    assert capsys.readouterr().err.splitlines() == [
        "impress_flexgen: slow...", "impress_flexgen: slow: done in 0.3 s"]
    with pytest.raises(RuntimeError):
        with progress.step("broken"):
            raise RuntimeError("x")
    assert "broken: failed after" in capsys.readouterr().err


def test_calibration_speaks_when_it_measures_not_when_cached(tmp_path, capsys):
    curve = PrefillCurve(2e-3, 5e-5, 1e-8)
    cache = tmp_path / "c.json"
    calibrate(curve.predict, DEFAULT_POINTS, cache, key="k", repeats=1,
              announce=progress.step)
    err = capsys.readouterr().err
    assert "calibrating the prefill cost curve" in err and "done in" in err
    calibrate(curve.predict, DEFAULT_POINTS, cache, key="k", announce=progress.step)
    assert capsys.readouterr().err == ""


def test_a_slow_weight_preparation_and_tokenizer_speak(monkeypatch, capsys):
    real = runtime.resolve

    def slow_resolve(*args):
        time.sleep(0.3)       # a first start converting the weights
        return real(*args)

    monkeypatch.setattr(runtime, "resolve", slow_resolve)
    monkeypatch.setattr(runtime, "ANNOUNCE_AFTER_S", 0.05)
    spec = runtime.resolve_spec(runtime.RuntimeConfig(model="llama-tiny"), False)
    err = capsys.readouterr().err
    assert "preparing the weights of llama-tiny" in err and "done in" in err

    import impress_flexgen.models.tokenizer as tok

    monkeypatch.setattr(tok, "load_tokenizer", lambda spec: time.sleep(0.3) or "tok")
    assert runtime.load_tokenizer(spec) == "tok"
    assert "loading the tokenizer of llama-tiny" in capsys.readouterr().err


def test_a_step_given_up_on_purpose_says_stopped(capsys):
    for raised, said in ((progress.Stopped(), "stopped after"), (OSError(), "failed after")):
        with pytest.raises(type(raised)):
            with progress.step("calibrating"):
                raise raised
        assert capsys.readouterr().err.splitlines()[-1].startswith(
            f"impress_flexgen: calibrating: {said} ")


def test_a_bar_redraws_often_on_a_terminal_and_seldom_in_a_log(monkeypatch):
    class Terminal:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

        def write(self, text):
            return len(text)

        def flush(self):
            pass

    for tty, every in ((True, 0.5), (False, 10)):
        monkeypatch.setattr("sys.stderr", Terminal(tty))
        with progress.bar(100, "making weights") as b:
            assert b.mininterval == every
