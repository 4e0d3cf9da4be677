"""This machine's rates for the policy search's cost model, measured in seconds and cached
beside RATES.json in the weights cache.

    machine = measure_machine(cuda=torch.cuda.is_available())

Everything is measured in one compute dtype (a weight format's: bf16 products run other
kernels than fp32's, at other rates) and cached per dtype. Reused from the planner's
estimate (estimate.measure_rates): the compute dtype's product rate and the bytes a one-row
product streams. Measured here, each the best of a few short runs: the time per weight
element of products of 1, 4, 16, 64 and 256 rows through the models' own product
(models.base.linear: a few bf16 rows go by other kernels than F.linear's), over matrices
twice the size of the CPU's last cache (at least 128 MiB; this machine's is 480 MiB) so
that they come from memory, as a large model's weights do (a decode block's products are
neither one row nor a prefill's many; 256 rows is an exact prefill's tile, and past it a
product costs the same per row); the time per value of an element-wise operation on a
64-row activation (`activation_s`: a prefill's norms, residuals and tile copies);
4-bit unpacking; reading FlexGen's disk files the way its
copy threads do (memory maps of .npy files copied into new tensors by four threads at once:
a fixed cost per file and a rate, from small and large files, so what is measured is what
FlexGen sees, the page cache included; and the core time the large files' reads took,
`disk_cpu_bytes_per_s`: copying out of the read buffers takes a core from the compute
beside it); a copy between memory buffers (CPU to "GPU" without
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
import time

import numpy as np
import torch

from .. import paths
from .costs import machine_key
from .estimate import Rates, measure_rates
from .transfers import contention, disk_rates, fastest, link_rate

CACHE_FILE = "MACHINE.json"
CACHE_VERSION = 6   # 2: products over 128 MiB of matrices, disk read by four threads;
                    # 3: read past the page cache, as the runtime reads disk weights;
                    # 4: products through models.base.linear, over twice the last cache,
                    #    layer cost in the dtype, disk read in 64 MiB files;
                    # 5: a llama layer's fixed cost apart from OPT's;
                    # 6: products of 256 rows, element-wise operations, a disk
                    #    read's core time
ROWS = (1, 4, 16, 64, 256)
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
    # Seconds per value of one element-wise operation on a 64-row activation (an
    # attention tile's); 0 with CUDA, whose element-wise kernels run behind its products.
    activation_s: float = 0.0
    # Bytes a disk read moves per second of a core it spends (copying out of its read
    # buffers, the system calls); 0: not measured, a read is taken to spend none.
    disk_cpu_bytes_per_s: float = 0.0

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


_ACTIVATION = (64, 768)      # an attention tile's rows, of a small model's width


def _activation_s(dtype: torch.dtype) -> float:
    """Seconds per value of one element-wise operation (an add, a product, a concatenation
    and a copy, by turns) on a 64-row activation: what a prefill's work around its products
    costs per value, small tensors' per-call cost included, as the engine meets them."""
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(*_ACTIVATION, generator=gen).to(dtype) for _ in range(2))
    out = torch.empty_like(x)

    def ops():
        for _ in range(10):
            z = (x + y) * y
            torch.cat((z, x))
            out.copy_(z)
    return fastest(ops, 10, clock=_clock()) / (40 * x.numel())


def _unpack_per_s(dtype: torch.dtype) -> float:
    """4-bit values unpacked per second, on a 1024 x 4096 matrix (the estimate's 4096 x 4096
    takes long enough on a CPU that other programs' turns land in it, and the prediction
    counts those apart: Machine.share)."""
    from ..models import quant

    w = torch.randn(_SIDE // 2, 2 * _SIDE, generator=torch.Generator().manual_seed(0))
    data, scale = quant.compress(w, 64, 0)
    return w.numel() / fastest(lambda: quant.decompress(data, scale, w.shape, 64, 0, dtype),
                             clock=_clock())


def _measure(cuda: bool, dtype: torch.dtype) -> Machine:
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rates = measure_rates(dtype) if not cuda else _cuda_rates(dtype)
    if not cuda:
        rates = dataclasses.replace(rates, unpack_per_s=_unpack_per_s(dtype))
    disk_rate, disk_file, disk_cpu = disk_rates(paths.offload_dir(), cuda)
    return Machine(cuda, rates.flops_per_s, rates.bytes_per_s, rates.unpack_per_s,
                   _row_seconds(device, dtype, sync),
                   disk_rate, disk_file, link_rate(cuda), _layer_s(dtype), contention(cuda),
                   llama_layer_s=_layer_s(dtype, "llama-tiny"),
                   activation_s=0.0 if cuda else _activation_s(dtype),
                   disk_cpu_bytes_per_s=disk_cpu)


def _cuda_rates(dtype) -> Rates:
    from ..models import quant

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 4096, generator=gen).to("cuda", dtype)
    x = torch.randn(64, 4096, generator=gen).to("cuda", dtype)
    sync = torch.cuda.synchronize
    flops = 2 * 64 * w.numel() / fastest(lambda: torch.nn.functional.linear(x, w), sync=sync)
    streamed = w.numel() * w.element_size() / fastest(
        lambda: torch.nn.functional.linear(x[:1], w), sync=sync)
    data, scale = quant.compress(w.float(), 64, 0)
    unpack = w.numel() / fastest(lambda: quant.decompress(data, scale, w.shape, 64, 0, dtype),
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
