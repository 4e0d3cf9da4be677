"""On a CPU, the thread that computes uses every core; the runtime's other threads use one.

torch's CPU build runs a parallel operation on an OpenMP team that belongs to the calling
thread and lives as long as that thread does. While a second long-lived thread owns a team
(the main thread that loaded the weights, another service's scheduler), the computing
thread's small matrix products run at about half speed: `python -m
experiments.bench_compute_thread` decoded 29.4 tokens/s on a worker thread with one team
and 17.0 with a second one (docs/design.md, "One thread computes"). So the weights load
single-threaded, start-up calibration runs on a thread that ends with it, a service's
scheduler thread ends when idle, the helper threads (store writer, disk readers, tiers,
page prefetch) run torch on themselves alone, and whoever holds an engine's ComputeLock
computes with every core. torch starts each new thread from one process-wide count, which
a helper's count of one would otherwise hand on: the lock sets its holder's count each
time. A GPU's arithmetic is not affected.
"""
from __future__ import annotations

import contextlib
import threading

import torch

# The count the process starts with (the cores it may use, or what the user set before
# importing the runtime): the computing thread's.
COMPUTE_THREADS = torch.get_num_threads()


def helper_thread() -> None:
    """First thing on a helper thread: its torch operations run on this thread alone."""
    torch.set_num_threads(1)


def compute_thread() -> None:
    """The calling thread computes: with COMPUTE_THREADS threads."""
    if torch.get_num_threads() != COMPUTE_THREADS:
        torch.set_num_threads(COMPUTE_THREADS)


def loading():
    """Context for loading weights: single-threaded where the CPU computes (the loading
    thread keeps no team); unchanged where a GPU computes, whose loads are host-side
    copies that every core speeds up."""
    return contextlib.nullcontext() if torch.cuda.is_available() else single_threaded()


@contextlib.contextmanager
def single_threaded():
    """Run the block's torch operations on the calling thread alone (no team is started),
    then restore its count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def on_passing_thread(fn, *args):
    """fn(*args) on a thread that ends with it (its result, or its exception raised here):
    computing done before the serving thread starts (calibrating at start-up) leaves no
    team behind on the caller's thread."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="compute-once")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


class ComputeLock:
    """An engine's lock: one holder at a time (FlexGen's weight buffers and a policy's
    per-layer state belong to one request at a time), computing with every core.
    Reentrant."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> "ComputeLock":
        self._lock.acquire()
        compute_thread()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()
