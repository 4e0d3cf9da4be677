"""A prefill curve estimated from bytes and FLOPs, before anything is measured.

    rates = measure_rates(torch.float32)        # a few products on this CPU, ~0.3 s
    curve = estimate_curve(spec, plan, rates)   # PrefillCurve(a, b, c)

On a model far larger than the machine's memory one point of the calibration is a whole
pass over the model (OPT-30B in 4-bit on a 2-core CPU: half a minute, most of it
unpacking 4-bit weights), so the calibration cannot measure even one within its budget.
This estimate says what a point would cost before it is measured (the calibration leaves
out what does not fit), stands in for the curve when nothing fits, and sizes the quick
workload. Each pass reads every weight once (the per-call term a): from disk what lies
there, 4-bit weights unpacked, the rest streamed from memory; every token multiplies by
every weight (b); every (query, key) pair costs 4 x hidden multiply-adds per layer (c).
The rates are measured here, on matrices large enough to leave the CPU's caches.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
import torch

from ..models import quant
from ..models.footprint import footprint
from .costs import PrefillCurve
from .transfers import fastest

_SIDE = 4096            # 64 MiB in fp32: out of any CPU cache
_PREFILL_ROWS = 64      # a prefill's products (a decode step's one row is memory-bound)
DISK_BYTES_PER_S = 1e9  # the planner's default for the disk until a read says otherwise


@dataclasses.dataclass(frozen=True)
class Rates:
    flops_per_s: float       # multiply-adds x 2 of a prefill's products
    bytes_per_s: float       # weight bytes a one-row product streams
    unpack_per_s: float      # 4-bit values unpacked into the compute dtype
    disk_bytes_per_s: float = DISK_BYTES_PER_S


@functools.lru_cache(maxsize=4)
def measure_rates(dtype: torch.dtype = torch.float32) -> Rates:
    """This CPU's rates in `dtype` (once per process and dtype), through the models' own
    product (a bf16 row goes by other kernels than F.linear's)."""
    from ..models.base import linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(_SIDE, _SIDE, generator=gen).to(dtype)
    x = torch.randn(_PREFILL_ROWS, _SIDE, generator=gen).to(dtype)
    one = x[:1].clone()
    flops = 2 * _PREFILL_ROWS * w.numel() / fastest(lambda: linear(x, w), 3)
    streamed = w.numel() * w.element_size() / fastest(lambda: linear(one, w), 3)
    data, scale = quant.compress(w.float(), 64, 0)
    unpack = w.numel() / fastest(lambda: quant.decompress(data, scale, w.shape, 64, 0, dtype),
                                   3)
    return Rates(flops, streamed, unpack)


def estimate_curve(spec, plan, rates: Rates) -> PrefillCurve:
    """The prefill curve of `spec` held as `plan` says (placement.Plan), at `rates`."""
    fmt = plan.format
    fp = footprint(spec)
    matrices = float(sum(e * n for layer, n in zip(fp.elements, fp.counts) for e in layer))
    on_disk = float(plan.weights.get("disk", 0))
    in_memory = float(sum(plan.weights.values())) - on_disk
    itemsize = np.dtype(fmt.dtype).itemsize
    per_pass = on_disk / rates.disk_bytes_per_s
    if fmt.compress:
        # Unpacked each pass, then multiplied from the unpacked copy.
        per_pass += matrices / rates.unpack_per_s + matrices * itemsize / rates.bytes_per_s
    else:
        per_pass += in_memory / rates.bytes_per_s
    c = spec.config
    hidden = c.input_dim if spec.family == "opt" else c.hidden_size
    per_pair = 4.0 * hidden * c.num_hidden_layers / rates.flops_per_s
    return PrefillCurve(per_pass, 2.0 * matrices / rates.flops_per_s, per_pair)


def estimate_for(runtime) -> PrefillCurve | None:
    """The estimate for a built Runtime on a CPU (None with CUDA: a GPU's calibration
    points take a moment, and these rates are the CPU's)."""
    plan = getattr(runtime, "plan", None)
    if plan is None or torch.cuda.is_available():
        return None
    return estimate_curve(runtime.spec, plan, measure_rates(_torch_dtype(plan.format.dtype)))


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype
