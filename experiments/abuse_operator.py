"""What a careless or unlucky operator does to a machine, counted like the hostile clients
(experiments.abuse_test runs these classes beside its own):

cost_fifo        a FIFO in place of the planner's calibration cache: start-up measures
                 again within seconds instead of blocking on the FIFO forever;
cost_nested      a cache of deeply nested JSON: a warning and a fresh measurement, never a
                 traceback;
cost_zero        cached coefficients [0, 0, 0] (every prefill free, so every request would
                 recompute forever): refused and measured again;
output_is_input  `run --requests F --output F`: refused in one line, exit status 2, and F
                 still holds its requests;
placement_zero   `--placement 0,0,0,0,0,0` (activations on disk): refused in one line at
                 argument checking, exit status 2.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import threading
from pathlib import Path

OPERATOR_CLASSES = ("cost_fifo", "cost_nested", "cost_zero", "output_is_input",
                    "placement_zero")
MODEL = "llama-tiny"


def _curve_points():
    from impress_flexgen.planner.costs import DEFAULT_POINTS

    return DEFAULT_POINTS


def _measure(n: int, ctx: int) -> float:
    """A plausible prefill time (seconds) for the calibration to fit."""
    return 1e-3 + 1e-4 * n + 1e-8 * n * ctx


def _calibrates_again(setup, limit_s: float = 10.0) -> str | None:
    """Calibrate with a cache file prepared by `setup(path)`: it must measure (not trust the
    file, not block, not raise) within `limit_s`."""
    from impress_flexgen.planner.costs import calibrate

    with tempfile.TemporaryDirectory(prefix="abuse-cost-") as tmp:
        path = Path(tmp) / "prefill.json"
        setup(path)
        measured, got = [], {}

        def measure(n, ctx):
            measured.append((n, ctx))
            return _measure(n, ctx)

        def go():
            try:
                got["curve"] = calibrate(measure, _curve_points(), path, key="abuse",
                                         repeats=1)
            except BaseException as exc:  # noqa: BLE001 - reported
                got["error"] = exc

        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        thread.join(limit_s)
        if thread.is_alive():
            return f"calibration still blocked after {limit_s:g} s"
        if "error" in got:
            return f"calibration raised {type(got['error']).__name__}: {got['error']}"
        if not measured:
            return "the bad cache was trusted (nothing measured)"
        predicted = got["curve"].predict(1024, 0)
        if not predicted > 0:
            return f"the fitted curve predicts {predicted} s for 1,024 tokens"
    return None


def cost_fifo() -> str | None:
    return _calibrates_again(lambda p: os.mkfifo(p))


def cost_nested() -> str | None:
    return _calibrates_again(lambda p: p.write_bytes(b"[" * 200_000 + b"]" * 200_000))


def cost_zero() -> str | None:
    from impress_flexgen.planner.costs import CACHE_VERSION, DEFAULT_POINTS

    # Well formed, for this very key: only the plausibility check can refuse it.
    doc = {"version": CACHE_VERSION, "key": "abuse", "coef": [0, 0, 0],
           "points": [[n, ctx, 0.0] for n, ctx in DEFAULT_POINTS]}
    return _calibrates_again(lambda p: p.write_text(json.dumps(doc)))


def _run_cli(argv) -> tuple[int, list[str]]:
    from impress_flexgen.entrypoints import run
    from impress_flexgen.entrypoints.process import run_main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = run_main("python -m impress_flexgen.run", run.main, argv)
        except SystemExit as exc:       # argparse refuses a flag: usage, then one error line
            rc = exc.code
    lines = err.getvalue().strip().splitlines()
    return rc, [line for line in lines if not line.startswith(("usage:", " "))]


def output_is_input() -> str | None:
    with tempfile.TemporaryDirectory(prefix="abuse-files-") as tmp:
        requests = Path(tmp) / "requests.jsonl"
        text = json.dumps({"prompt": "Hello there", "max_tokens": 1}) + "\n"
        requests.write_text(text)
        rc, err = _run_cli(["--model", MODEL, "--requests", str(requests),
                            "--output", str(requests), "--store-dir", str(Path(tmp) / "st"),
                            "--offload-dir", str(Path(tmp) / "off")])
        if rc != 2 or len(err) != 1:
            return f"exit {rc}, stderr {err[:3]}"
        if requests.read_text() != text:
            return "the request file was changed"
    return None


def placement_zero() -> str | None:
    rc, err = _run_cli(["--model", MODEL, "--placement", "0,0,0,0,0,0", "--quick"])
    if rc != 2 or len(err) != 1 or "Traceback" in "\n".join(err):
        return f"exit {rc}, stderr {err[:3]}"
    return None


def run_operator(name: str) -> str | None:
    return globals()[name]()
