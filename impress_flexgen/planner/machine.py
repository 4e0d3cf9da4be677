"""This machine's rates for the policy search's cost model, measured in seconds and cached
beside RATES.json in the weights cache.

    machine = measure_machine(cuda=torch.cuda.is_available())

Everything is measured in one compute dtype (a weight format's: bf16 products run other
kernels than fp32's, at other rates) and cached per dtype. Reused from the planner's
estimate (estimate.measure_rates): the compute dtype's product rate and the bytes a one-row
product streams. Measured here, each the best of a few short runs: the time per weight
element of products of 1, 4, 16 and 64 rows through the models' own product
(models.base.linear: a few bf16 rows go by other kernels than F.linear's), over matrices
twice the size of the CPU's last cache (at least 128 MiB; this machine's is 480 MiB) so
that they come from memory, as a large model's weights do (a decode block's products are
neither one row nor a prefill's many; past 64 rows a product costs the same per row);
4-bit unpacking; reading FlexGen's disk files the way its
copy threads do (memory maps of .npy files copied into new tensors by four threads at once:
a fixed cost per file and a rate, from small and large files, so what is measured is what
FlexGen sees, the page cache included); a copy between memory buffers (CPU to "GPU" without
CUDA; with CUDA the CPU-GPU link); how much a copy slows a product running beside it
(`contention`: 0 for perfect overlap, 1 for none); one FlexGen layer's fixed cost, from
decode steps of the 2-layer opt-tiny in the same dtype at batch 1 and 8 (Python and kernel
launches, what a small model's decode mostly is). With one CPU thread a product is timed by
its thread's CPU time. At every call, not cached: the share of a core a busy thread gets now (other
programs' load), which stretches every predicted second.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time

import numpy as np
import torch

from .. import paths
from .costs import machine_key
from .estimate import Rates, measure_rates

CACHE_FILE = "MACHINE.json"
CACHE_VERSION = 5   # 2: products over 128 MiB of matrices, disk read by four threads;
                    # 3: read past the page cache, as the runtime reads disk weights;
                    # 4: products through models.base.linear, over twice the last cache,
                    #    layer cost in the dtype, disk read in 64 MiB files;
                    # 5: a llama layer's fixed cost apart from OPT's
ROWS = (1, 4, 16, 64)
_SIDE = 2048
_MATRICES = 8           # of 16 MiB each in fp32: 128 MiB, the least measured over
_MAX_MATRIX_BYTES = 2 << 30


def _last_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), 0 where unknown."""
    from pathlib import Path

    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
        except (OSError, ValueError):
            pass
    return max(sizes)


@dataclasses.dataclass(frozen=True)
class Machine:
    """Rates the cost model predicts from (seconds and bytes)."""

    cuda: bool
    flops_per_s: float                  # a prefill's products (multiply-adds x 2)
    bytes_per_s: float                  # weight bytes a one-row product streams
    unpack_per_s: float                 # 4-bit values unpacked into the compute dtype
    row_seconds: tuple[float, ...]      # per weight element, products of ROWS rows
    disk_bytes_per_s: float             # FlexGen's disk reads (memory-mapped file copies)
    disk_file_s: float                  # and the fixed cost of each file
    link_bytes_per_s: float             # CPU -> compute device (a memory copy without CUDA)
    layer_s: tuple[float, float]        # one FlexGen layer's fixed cost at batch 1 and 8
    contention: float = 0.0             # the share of the shorter of read and compute lost
    share: float = 1.0                  # of a core, what a busy thread gets now (other work)
    # The same of a llama layer (RMSNorm, rotary tables, SiLU: more small operations than
    # OPT's; SmolLM2's decode step was predicted 27% short on OPT's); None: OPT's.
    llama_layer_s: tuple[float, float] | None = None

    def element_seconds(self, rows: int) -> float:
        """Seconds per weight element of a product of `rows` rows: interpolated between
        the measured row counts; past the last, each row costs what one of its rows did
        (the product is bound by arithmetic there, at the rate measured in this product's
        shape and kernels: a 4096-square product's `flops_per_s` may run other ones)."""
        xs = np.array(ROWS, dtype=float)
        ys = np.array(self.row_seconds)
        if rows <= ROWS[-1]:
            return float(np.interp(rows, xs, ys))
        return float(ys[-1]) * rows / ROWS[-1]

    def layer_seconds(self, batch: int, family: str = "opt") -> float:
        """A layer's fixed cost for a micro-batch of `batch` sequences (linear in it, never
        below batch 1's: a batch of 8 measured cheaper was another program's turn in the
        batch-1 steps), in the model family's layers."""
        one, eight = self.llama_layer_s if family == "llama" and self.llama_layer_s \
            else self.layer_s
        one = min(one, eight)
        return one + (eight - one) * (batch - 1) / 7

    def scaled(self, **rates: float) -> "Machine":
        """This machine with some rates replaced (what the search would do elsewhere)."""
        return dataclasses.replace(self, **rates)


def _clock():
    """The clock of a product: with one CPU thread computing, that thread's CPU time (what
    the work takes, however the machine's load interleaves it, which Machine.share counts);
    else the wall clock."""
    if torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _best(fn, repeats: int = 5, sync=lambda: None, clock=time.perf_counter) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        sync()
        best = min(best, clock() - t0)
    return max(best, 1e-9)


def _row_seconds(device: str, dtype: torch.dtype, sync) -> tuple[float, ...]:
    """Seconds per weight element of a product of each of ROWS rows, over matrices that
    together outgrow the CPU's caches (a decode step streams every weight from memory: one
    matrix used again and again would be read from the cache), by the models' product."""
    from ..models.base import linear

    gen = torch.Generator().manual_seed(0)
    first = torch.randn(_SIDE // 2, 2 * _SIDE, generator=gen).to(device, dtype)
    one = first.numel() * first.element_size()
    wanted = 2 * _last_cache_bytes() if device == "cpu" else 0
    count = max(_MATRICES, min(-(-wanted // one), _MAX_MATRIX_BYTES // one))
    mats = [first] + [first.clone() for _ in range(count - 1)]   # the values do not matter
    inputs = [torch.randn(rows, 2 * _SIDE, generator=gen).to(device, dtype) for rows in ROWS]
    best = [[float("inf")] * len(mats) for _ in ROWS]
    clock = _clock() if device == "cpu" else time.perf_counter
    # The row counts take turns, each product timed alone (short enough to run undisturbed),
    # so that another program's turn weighs on every row count alike.
    for _ in range(4):
        for r, x in enumerate(inputs):
            for i, w in enumerate(mats):
                sync()
                t0 = clock()
                linear(x, w)
                sync()
                best[r][i] = min(best[r][i], clock() - t0)
    seconds = [sum(b[1:]) / sum(w.numel() for w in mats[1:]) for b in best]  # [0]: first touch
    # A product of fewer rows is part of one of more: it costs no more per weight element
    # (a few rows measured slower than more were slowed by another program).
    return tuple(min(seconds[r:]) for r in range(len(ROWS)))


COPY_THREADS = 4     # FlexGen's TorchDisk copy threads, reading files side by side
FILES = 8


def _disk(root, cuda: bool) -> tuple[float, float]:
    """(bytes/s, seconds per file) of the runtime's disk weight reads: FILES .npy files of
    256 KiB, then of 64 MiB (a large model's matrix, read in two streams as the runtime reads
    one), each read into a new tensor by COPY_THREADS threads at once, as FlexGen's copy
    threads do: past the page cache (direct_read) where the runtime reads so (weights loaded
    into CPU memory), through a memory map where FlexGen's own copy does. Half a GiB a pass:
    a decode step reads gigabytes, and a shorter read meets a virtual disk's bursts (8 MiB
    files gave 1.4-1.8 GB/s here where a step's reads ran at 0.7-1.0 GB/s)."""
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
                              _best(lambda: list(pool.map(read, paths)), 3)))
        (n0, f0, t0), (n1, _, t1) = times
        rate = (n1 - n0) / max(t1 - t0, 1e-9)
        return rate, max((t0 - n0 / rate) / f0, 1e-6)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _link(cuda: bool) -> float:
    n = 32 << 20
    src = torch.ones(n // 4)
    if cuda:
        src = src.pin_memory()
        dst = torch.empty(n // 4, device="cuda")
        return n / _best(lambda: dst.copy_(src, non_blocking=True), sync=torch.cuda.synchronize)
    return n / _best(lambda: torch.empty(n // 4).copy_(src))


def _contention(cuda: bool) -> float:
    """How much of the shorter of a copy and a product is lost when they run together
    (0: none, the step is their max; 1: their sum). A GPU's copies take no cores."""
    if cuda:
        return 0.0
    w = torch.randn(_SIDE, 2 * _SIDE)
    x = torch.randn(4, 2 * _SIDE)
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
        alone_p = _best(product, 2)
        alone_c = _best(lambda: _on_thread(copy), 2)
        together = _best(both, 2)
        lost.append((together - max(alone_p, alone_c)) / max(min(alone_p, alone_c), 1e-9))
    torch.set_num_threads(threads)
    return float(min(max(np.median(lost), 0.0), 1.0))


def _on_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def _layer_s(dtype: torch.dtype, model: str = "opt-tiny") -> tuple[float, float]:
    """One FlexGen layer's fixed cost at batch 1 and 8: the fastest decode step of `model`
    (opt-tiny, llama-tiny) in `dtype` over its six layers (its products are a few thousand
    elements), the two batches taking turns so that other work on the machine weighs on
    both alike."""
    from contextlib import ExitStack

    from flexgen.timer import timers

    from ..models import dtypes
    from ..models.placement import Placement
    from ..models.runtime import Runtime, RuntimeConfig

    with ExitStack() as stack:
        runtimes = {b: stack.enter_context(Runtime(RuntimeConfig(
            model=model, placement=Placement(), gpu_batch_size=b, work_tokens=32,
            dtype=dtypes.of_name(dtypes.flag(dtype)), max_ram_bytes=1 << 30)))
            for b in (1, 8)}
        steps: dict[int, list[float]] = {1: [], 8: []}
        for _ in range(3):
            for b, rt in runtimes.items():
                rt.generate([[5 + i + j for j in range(16)] for i in range(b)], 8)
                steps[b] += timers("generate").costs[1:]      # the decode steps
        layers = len(runtimes[1].model.layers)
    return min(steps[1]) / layers, min(steps[8]) / layers


def _unpack_per_s(dtype: torch.dtype) -> float:
    """4-bit values unpacked per second, on a 1024 x 4096 matrix (the estimate's 4096 x 4096
    takes long enough on a CPU that other programs' turns land in it, and the prediction
    counts those apart: Machine.share)."""
    from ..models import quant

    w = torch.randn(_SIDE // 2, 2 * _SIDE, generator=torch.Generator().manual_seed(0))
    data, scale = quant.compress(w, 64, 0)
    return w.numel() / _best(lambda: quant.decompress(data, scale, w.shape, 64, 0, dtype),
                             clock=_clock())


def _measure(cuda: bool, dtype: torch.dtype) -> Machine:
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rates = measure_rates(dtype) if not cuda else _cuda_rates(dtype)
    if not cuda:
        rates = dataclasses.replace(rates, unpack_per_s=_unpack_per_s(dtype))
    disk_rate, disk_file = _disk(paths.offload_dir(), cuda)
    return Machine(cuda, rates.flops_per_s, rates.bytes_per_s, rates.unpack_per_s,
                   _row_seconds(device, dtype, sync),
                   disk_rate, disk_file, _link(cuda), _layer_s(dtype), _contention(cuda),
                   llama_layer_s=_layer_s(dtype, "llama-tiny"))


def _cuda_rates(dtype) -> Rates:
    from ..models import quant

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 4096, generator=gen).to("cuda", dtype)
    x = torch.randn(64, 4096, generator=gen).to("cuda", dtype)
    sync = torch.cuda.synchronize
    flops = 2 * 64 * w.numel() / _best(lambda: torch.nn.functional.linear(x, w), sync=sync)
    streamed = w.numel() * w.element_size() / _best(
        lambda: torch.nn.functional.linear(x[:1], w), sync=sync)
    data, scale = quant.compress(w.float(), 64, 0)
    unpack = w.numel() / _best(lambda: quant.decompress(data, scale, w.shape, 64, 0, dtype),
                               sync=sync)
    return Rates(flops, streamed, unpack)


def cpu_share(seconds: float = 0.25) -> float:
    """The share of a core a busy thread gets now: its CPU time over the wall time of a
    spin. Each rate above is the best of a few runs short enough to fit between other
    programs' turns; a decode step is not, and on a shared machine takes 1 / share times
    as long."""
    t0, c0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds:
        sum(range(1000))
    return min(max((time.thread_time() - c0) / (time.perf_counter() - t0), 0.05), 1.0)


def measure_machine(cuda: bool | None = None, dtype: torch.dtype | None = None,
                    use_cache: bool = True) -> Machine:
    """This machine's rates: the cached ones when an earlier start measured them for the
    same machine, torch and dtype; else measured now (TRIES times, the fastest of each
    rate kept: about half a minute on a CPU) and cached. The share of a core (cpu_share) is
    measured at every call: it is the machine's load now."""
    return dataclasses.replace(_rates(cuda, dtype, use_cache), share=cpu_share())


def _rates(cuda: bool | None, dtype: torch.dtype | None, use_cache: bool) -> Machine:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    dtype = dtype or (torch.float16 if cuda else torch.float32)
    key = machine_key("policy-search", "cuda" if cuda else "cpu", dtype)
    path = paths.weights_dir() / CACHE_FILE
    if use_cache:
        try:
            doc = json.loads(path.read_text())
            entry = doc.get(key) if doc.get("version") == CACHE_VERSION else None
            if entry is not None:
                entry = {k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()}
                return Machine(**entry)
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    tries = [_measure(cuda, dtype) for _ in range(TRIES)]
    machine = tries[0]
    for other in tries[1:]:
        machine = faster(machine, other)
    # The disk is not slowed by other programs' turns on the cores, but its rate wanders
    # (a virtual disk shared with other machines): its middle try, not its fastest.
    middle = sorted(tries, key=lambda m: m.disk_bytes_per_s)[len(tries) // 2]
    machine = dataclasses.replace(machine, disk_bytes_per_s=middle.disk_bytes_per_s,
                                  disk_file_s=middle.disk_file_s)
    _write(path, key, machine)
    return machine


# Measurements of all the rates, the fastest of each kept: on a shared machine another
# program's turn lands in some of a rate's runs (a two-thread product waits for its slower
# thread), and a rate cached from one loaded moment would stretch every later prediction,
# which counts the load of its own moment apart (`share`).
TRIES = 3


def faster(a: Machine, b: Machine) -> Machine:
    """Each rate the faster of two measurements of it (other work only ever slows one)."""
    out = {}
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name.endswith("per_s"):
            out[f.name] = max(x, y)
        elif isinstance(x, tuple):
            out[f.name] = tuple(min(u, v) for u, v in zip(x, y))
        elif isinstance(x, float) and f.name != "share":
            out[f.name] = min(x, y)
    return dataclasses.replace(a, **out)


def _write(path, key: str, machine: Machine) -> None:
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") != CACHE_VERSION:
            doc = {}
    except (OSError, ValueError, AttributeError):
        doc = {}
    doc["version"] = CACHE_VERSION
    doc[key] = dataclasses.asdict(machine)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{CACHE_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError:
        pass
