"""One line on stderr when a slow start-up step begins, and its time when it ends.

A cold start converts weights, builds a tokenizer and calibrates the planner: tens of
seconds that would otherwise pass in silence. A step that may be quick (a cache hit) is
announced only once it has run `after_s` seconds, so a warm start stays quiet.

    with progress.step("converting weights"):          # announced at once
        ...
    with progress.step("loading the tokenizer", after_s=0.5):
        ...

IMPRESS_FLEXGEN_PROGRESS=0 in the environment silences these lines (scripts that read
stderr line by line, the test suite).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator

PREFIX = "impress_flexgen: "


def _say(text: str) -> None:
    if os.environ.get("IMPRESS_FLEXGEN_PROGRESS", "1") == "0":
        return
    try:
        print(PREFIX + text, file=sys.stderr, flush=True)
    except (OSError, ValueError):   # a closed or broken stderr is no reason to fail
        pass


class Stopped(Exception):
    """A step given up on purpose (its owner is closing): said as stopped, not failed."""


@contextlib.contextmanager
def step(what: str, after_s: float = 0.0) -> Iterator[None]:
    """Say `what...` when the block has run `after_s` seconds (0: at once), and
    `what: done in X s` (or `what: failed after X s`, `stopped after X s`) when it ends, if
    it was announced."""
    t0 = time.perf_counter()
    said = threading.Event()
    lock = threading.Lock()

    def announce() -> None:
        with lock:
            if not said.is_set():
                said.set()
                _say(f"{what}...")

    timer = None
    if after_s <= 0:
        announce()
    else:
        timer = threading.Timer(after_s, announce)
        timer.daemon = True
        timer.start()
    ok, outcome = False, "failed after"
    try:
        yield
        ok = True
    except Stopped:
        outcome = "stopped after"
        raise
    finally:
        if timer is not None:
            timer.cancel()
        with lock:
            announced = said.is_set()
            said.set()          # a timer firing now says nothing
        if announced:
            took = time.perf_counter() - t0
            _say(f"{what}: {'done in' if ok else outcome} {took:.1f} s")


def enabled() -> bool:
    return os.environ.get("IMPRESS_FLEXGEN_PROGRESS", "1") != "0"


def say(text: str) -> None:
    """One line on stderr (silenced as the steps are)."""
    _say(text)


def bar(total: float, what: str, unit: str = "B"):
    """A tqdm progress bar on stderr with rate and time left (bytes by default); a no-op
    bar when progress is silenced. Use as a context manager; `.update(n)` as work is done."""
    from tqdm import tqdm

    scale = unit == "B"
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    # A log file gets a line every 10 s rather than a redraw twice a second.
    return tqdm(total=total, desc=PREFIX + what, unit=unit, unit_scale=scale,
                unit_divisor=1024 if scale else 1000, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5 if tty else 10, disable=not enabled(), leave=True)
