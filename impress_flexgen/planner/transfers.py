"""How fast bytes move on this machine, for the policy search's rates (planner/machine.py):
the disk as the runtime reads its weights (a rate, a fixed cost per file, and the core time
a read spends), a copy between memory buffers, and how much a copy slows a product running
beside it.

    rate, per_file, per_core_second = disk_rates(root, cuda=False)
    link_rate(cuda=False); contention(cuda=False)
"""
from __future__ import annotations

import os
import resource
import shutil
import threading
import time

import numpy as np
import torch

SIDE = 2048     # the product timed beside a copy: SIDE x 2 SIDE


def fastest(fn, repeats: int = 5, sync=lambda: None, clock=time.perf_counter) -> float:
    """Seconds of the fastest of `repeats` runs of `fn` (after one untimed: it faults pages
    in and picks kernels), by `clock`."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        sync()
        best = min(best, clock() - t0)
    return max(best, 1e-9)


COPY_THREADS = 4     # FlexGen's TorchDisk copy threads, reading files side by side
FILES = 8


def disk_rates(root, cuda: bool) -> tuple[float, float, float]:
    """(bytes/s, seconds per file, bytes per core second) of the runtime's disk weight
    reads: FILES .npy files of 256 KiB, then of 64 MiB (a large model's matrix, read in two
    streams as the runtime reads one), each read into a new tensor by COPY_THREADS threads
    at once, as FlexGen's copy threads do: past the page cache (direct_read) where the
    runtime reads so (weights loaded into CPU memory), through a memory map where FlexGen's
    own copy does. Half a GiB a pass: a decode step reads gigabytes, and a shorter read
    meets a virtual disk's bursts (8 MiB files gave 1.4-1.8 GB/s here where a step's reads
    ran at 0.7-1.0 GB/s). The core seconds are the whole process's over the large files'
    fastest pass."""
    from concurrent.futures import ThreadPoolExecutor

    from ..models import direct_read

    where = root / f"machine-{os.getpid()}"
    where.mkdir(parents=True, exist_ok=True)

    def read(path):
        torch.set_num_threads(1)
        src = np.lib.format.open_memmap(path, mode="r+")
        dst = torch.empty(src.shape, dtype=torch.float32)
        if cuda:
            dst.copy_(torch.from_numpy(np.asarray(src)))
        else:
            direct_read.read_npy(str(path), dst)

    try:
        times = []
        with ThreadPoolExecutor(COPY_THREADS) as pool:
            for nbytes in (256 << 10, 64 << 20):
                paths = [where / f"{nbytes}-{i}.npy" for i in range(FILES)]
                for path in paths:
                    np.save(path, np.ones(nbytes // 4, dtype=np.float32))
                times.append((FILES * nbytes, FILES,
                              *_timed_with_cores(lambda: list(pool.map(read, paths)), 3)))
        (n0, f0, t0, _), (n1, _, t1, cores) = times
        rate = (n1 - n0) / max(t1 - t0, 1e-9)
        return rate, max((t0 - n0 / rate) / f0, 1e-6), n1 / max(cores, 1e-9)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _timed_with_cores(fn, repeats: int) -> tuple[float, float]:
    """(seconds, core seconds of the whole process) of the fastest of `repeats` runs of
    `fn`, after one untimed."""
    def cores() -> float:
        use = resource.getrusage(resource.RUSAGE_SELF)
        return use.ru_utime + use.ru_stime

    fn()
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), cores()
        fn()
        best = min(best, (time.perf_counter() - t0, cores() - c0))
    return best


def link_rate(cuda: bool) -> float:
    """Bytes per second of a copy between memory buffers (with CUDA: pinned memory to the
    GPU)."""
    n = 32 << 20
    src = torch.ones(n // 4)
    if cuda:
        src = src.pin_memory()
        dst = torch.empty(n // 4, device="cuda")
        return n / fastest(lambda: dst.copy_(src, non_blocking=True),
                           sync=torch.cuda.synchronize)
    return n / fastest(lambda: torch.empty(n // 4).copy_(src))


def contention(cuda: bool) -> float:
    """How much of the shorter of a copy and a product is lost when they run together
    (0: none, the step is their max; 1: their sum): the share of a copy's core time that a
    product beside it loses. A GPU's copies take no cores."""
    if cuda:
        return 0.0
    w = torch.randn(SIDE, 2 * SIDE)
    x = torch.randn(4, 2 * SIDE)
    src = torch.ones(4 << 20)

    def product():
        for _ in range(4):
            torch.nn.functional.linear(x, w)

    def copy():
        torch.set_num_threads(1)    # as FlexGen's copy threads (cpu_threads.helper_thread)
        for _ in range(4):
            torch.empty_like(src).copy_(src)

    def both():
        t = threading.Thread(target=copy)
        t.start()
        product()
        t.join()
    threads = torch.get_num_threads()
    lost = []
    for _ in range(5):      # each trial pairs its three runs: the machine's load alike
        alone_p = fastest(product, 2)
        alone_c = fastest(lambda: _on_thread(copy), 2)
        together = fastest(both, 2)
        lost.append((together - max(alone_p, alone_c)) / max(min(alone_p, alone_c), 1e-9))
    torch.set_num_threads(threads)
    return float(min(max(np.median(lost), 0.0), 1.0))


def _on_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join()
