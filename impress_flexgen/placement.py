"""Where a model's weights and KV cache go: FlexGen's six percentages, and a plan that checks
them against this machine's free GPU memory, RAM and disk before anything is allocated.

    plan = make_plan(spec, cfg)          # cfg.placement: a Placement, or AUTO
    print(plan.describe())               # bytes of weights and cache per device
    plan.placement                       # what FlexGen's Policy gets

`auto` fills the compute device first (the GPU; without CUDA, RAM), then CPU memory (with
CUDA), then the disk of the offload directory, keeping margins for activations, the store's
tiers and the rest of the machine. An explicit placement gets the same accounting and is
refused when a device cannot hold its share: the kernel's OOM killer never decides.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np

from .errors import UserError
# What the model needs, wherever it goes (footprint.py; its names stay readable here).
from .footprint import (ACT_TOKENS, DEVICES, Footprint, cache_heads,  # noqa: F401
                        footprint, weight_shapes)

GiB = 1 << 30
# FlexGen's disk copy threads each pin a 1 Gi-element fp16 relay buffer when CUDA is present.
CUDA_RELAY_BYTES = 4 * 2 * GiB


@dataclasses.dataclass(frozen=True)
class Placement:
    """FlexGen's six percentages: weights, KV cache and activations on GPU / CPU (rest: disk)."""

    w_gpu: float = 100
    w_cpu: float = 0
    cache_gpu: float = 100
    cache_cpu: float = 0
    act_gpu: float = 100
    act_cpu: float = 0

    NAMED = {  # what the CLI's --placement accepts besides six numbers and "auto"
        "gpu": (100, 0, 100, 0, 100, 0),
        "cpu": (0, 100, 0, 100, 100, 0),
        "disk": (0, 0, 0, 0, 100, 0),
        "mixed": (30, 40, 30, 40, 100, 0),
    }

    @classmethod
    def parse(cls, values) -> "Placement | AutoPlacement":
        """"auto", a name from NAMED, "a,b,c,d,e,f", or a sequence of six numbers."""
        if isinstance(values, str):
            if values == "auto":
                return AUTO
            if values in cls.NAMED:
                values = cls.NAMED[values]
            elif "," in values:
                values = values.split(",")
            else:
                raise UserError(f"unknown placement '{values}'; use auto, "
                                f"{', '.join(cls.NAMED)} or six comma-separated percentages")
        try:
            values = tuple(float(v) for v in values)
        except ValueError:
            raise UserError(f"placement percentages must be numbers: {values}") from None
        if len(values) != 6:
            raise UserError("a placement is six percentages: "
                            "W_GPU W_CPU CACHE_GPU CACHE_CPU ACT_GPU ACT_CPU")
        if not all(np.isfinite(values)):
            raise UserError(f"placement percentages must be finite: {values}")
        return cls(*values).check()

    def check(self) -> "Placement":
        """This placement if FlexGen can run it, else UserError (one line)."""
        p = self
        for what, gpu, cpu in (("weights", p.w_gpu, p.w_cpu), ("cache", p.cache_gpu, p.cache_cpu),
                               ("activations", p.act_gpu, p.act_cpu)):
            if not (np.isfinite(gpu) and np.isfinite(cpu)) or min(gpu, cpu) < 0 \
                    or gpu + cpu > 100:
                raise UserError(f"placement of {what}: GPU {gpu:g}% + CPU {cpu:g}% must be "
                                "non-negative and at most 100%")
        if 100 not in (p.act_gpu, p.act_cpu, 100 - p.act_gpu - p.act_cpu):
            raise UserError("activations must live wholly on one device (FlexGen's rule)")
        if p.act_gpu + p.act_cpu == 0:
            # FlexGen's disk copies cannot move a layer's hidden states: it fails mid-run.
            raise UserError("activations cannot live on disk: give ACT_GPU or ACT_CPU 100 "
                            f"(placement {','.join(f'{v:g}' for v in p.percentages)})")
        return p

    @property
    def uses_disk(self) -> bool:
        return self.w_gpu + self.w_cpu < 100 or self.cache_gpu + self.cache_cpu < 100

    @property
    def percentages(self) -> tuple[float, ...]:
        return (self.w_gpu, self.w_cpu, self.cache_gpu, self.cache_cpu, self.act_gpu,
                self.act_cpu)

    def describe(self) -> str:
        return (f"weights {self.w_gpu:g}/{self.w_cpu:g}/{100 - self.w_gpu - self.w_cpu:g}, "
                f"cache {self.cache_gpu:g}/{self.cache_cpu:g}/"
                f"{100 - self.cache_gpu - self.cache_cpu:g} (GPU/CPU/disk %)")


class AutoPlacement:
    """`--placement auto`: percentages chosen by make_plan from what this machine has free."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def describe(self) -> str:
        return "auto"

    def __repr__(self) -> str:
        return "AUTO"

    def __reduce__(self):
        return (AutoPlacement, ())


AUTO = AutoPlacement()


# ---------------------------------------------------------------------------------------
# What the machine has

@dataclasses.dataclass(frozen=True)
class Resources:
    """Free bytes per device, and what is kept back from each."""

    cuda: bool
    gpu_free: int
    gpu_keep: int
    ram_free: int
    ram_keep: int
    disk_free: int
    disk_keep: int
    offload_root: str

    @property
    def gpu(self) -> int:
        return max(0, self.gpu_free - self.gpu_keep)

    @property
    def ram(self) -> int:
        return max(0, self.ram_free - self.ram_keep)

    @property
    def disk(self) -> int:
        return max(0, self.disk_free - self.disk_keep)


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def machine_resources(offload_root: Path) -> Resources:
    """Free GPU memory (torch.cuda.mem_get_info), available RAM (psutil) and free disk under
    `offload_root`, after removing scratch directories that dead processes left there.
    Kept back: 5% of the GPU (at least 1 GiB) for the CUDA allocator, 10% of RAM (at least
    1 GiB) for the OS and other programs, 5% of the file system (at least 2 GiB)."""
    import psutil
    import torch

    from . import scratch

    offload_root = Path(offload_root).expanduser()
    if offload_root.is_dir():
        scratch.sweep_stale(offload_root)
    cuda = torch.cuda.is_available()
    gpu_free = gpu_keep = 0
    if cuda:
        gpu_free, gpu_total = torch.cuda.mem_get_info()
        gpu_keep = max(GiB, gpu_total // 20)
    vm = psutil.virtual_memory()
    try:
        du = shutil.disk_usage(_existing_parent(offload_root))
        disk_free, disk_keep = du.free, max(2 * GiB, du.total // 20)
    except OSError:
        disk_free = disk_keep = 0
    return Resources(cuda, int(gpu_free), int(gpu_keep), int(vm.available),
                     max(GiB, vm.total // 10), int(disk_free), int(disk_keep), str(offload_root))


# ---------------------------------------------------------------------------------------
# The plan

@dataclasses.dataclass(frozen=True)
class Plan:
    placement: Placement
    auto: bool
    model: str
    dtype: str
    weights: dict        # bytes per device (gpu, cpu, disk)
    cache: dict          # bytes per device, at the model's every position
    needs: dict          # everything each device must hold (weights, cache, working memory)
    available: dict      # what each device can give (free less what is kept back)
    resources: Resources

    def describe(self) -> str:
        """Two lines: the percentages, then bytes per device against what is usable."""
        cuda = self.resources.cuda
        names = {"gpu": "GPU", "cpu": "CPU RAM", "disk": "disk"} if cuda else \
            {"gpu": "RAM", "cpu": "RAM", "disk": "disk"}

        def where(by_dev) -> str:
            merged: dict[str, int] = {}
            for dev, n in by_dev.items():
                if n:
                    merged[names[dev]] = merged.get(names[dev], 0) + n
            return " + ".join(f"{_size(n)} {name}" for name, n in merged.items()) or "nothing"

        usage = ", ".join(f"{names[d]} {_size(self.needs[d])} of {_size(self.available[d])}"
                          for d in (DEVICES if cuda else ("cpu", "disk")))
        head = (f"placement{' auto:' if self.auto else ''} {self.placement.describe()}; "
                f"{self.model} in {self.dtype}")
        if not cuda:
            head += " (no CUDA: FlexGen's GPU is this CPU's memory)"
        return (f"{head}\nmemory plan: weights {where(self.weights)}, KV cache up to "
                f"{where(self.cache)}; needed of usable: {usage} "
                f"(offload dir {self.resources.offload_root})")

    def as_dict(self) -> dict:
        return {"placement": dataclasses.asdict(self.placement), "auto": self.auto,
                "dtype": self.dtype, "weights_bytes": dict(self.weights),
                "cache_bytes": dict(self.cache), "needs_bytes": dict(self.needs),
                "available_bytes": dict(self.available)}


def _size(n: int) -> str:
    if n < GiB:
        return f"{n / 2**20:.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.1f} MiB"
    return f"{n / GiB:.2f} GiB" if n < 10 * GiB else f"{n / GiB:.1f} GiB"


def _needs(fp: Footprint, res: Resources, weights: dict, staged: int, cache: dict,
           gpu_reserve: int, cpu_reserve: int) -> dict:
    """Bytes each device must hold: with CUDA the GPU computes (activations, staged layers,
    random weights drawn there); without it all of that is RAM."""
    work = fp.act_bytes + (2 * staged if staged else 0) + fp.load_bytes  # 2: overlapped layers
    need = {d: weights[d] + cache[d] for d in DEVICES}
    if res.cuda:
        need["gpu"] += work + gpu_reserve
        need["cpu"] += CUDA_RELAY_BYTES + cpu_reserve
    else:
        need["cpu"] += need.pop("gpu") + work + cpu_reserve + gpu_reserve
        need["gpu"] = 0
    return need


def _fits(need: dict, res: Resources) -> str | None:
    """The first device that cannot hold its share, or None."""
    avail = {"gpu": res.gpu, "cpu": res.ram, "disk": res.disk}
    for d in DEVICES:
        if need[d] > avail[d]:
            return d
    return None


def _choose(fp: Footprint, res: Resources, heads: int, batch: int, gpu_reserve: int,
            cpu_reserve: int) -> Placement | None:
    """The placement auto picks: weights fill the compute device, then (with CUDA) CPU
    memory, then disk; the KV cache goes whole to the fastest device with room left."""
    none = dict.fromkeys(DEVICES, 0)

    def need(w_gpu, w_cpu, cache):
        weights, staged = fp.weights_on(w_gpu, w_cpu)
        return _needs(fp, res, weights, staged, cache, gpu_reserve, cpu_reserve)

    fast = "gpu" if res.cuda else "cpu"
    avail = {"gpu": res.gpu, "cpu": res.ram, "disk": res.disk}
    w_gpu = next((p for p in range(100, -1, -1)
                  if need(p, 0, none)[fast] <= avail[fast]), None)
    if w_gpu is None:
        return None
    w_cpu = 0
    if res.cuda:
        w_cpu = next((q for q in range(100 - w_gpu, -1, -1)
                      if need(w_gpu, q, none)["cpu"] <= avail["cpu"]), 0)
    options = [(100, 0), (0, 100), (0, 0)] if res.cuda else [(100, 0), (0, 0)]
    for cache_gpu, cache_cpu in options:
        if _fits(need(w_gpu, w_cpu, fp.cache_on(cache_gpu, cache_cpu, heads, batch)),
                 res) is None:
            return Placement(w_gpu, w_cpu, cache_gpu, cache_cpu, 100, 0)
    return None


def make_plan(spec, cfg, resources: Resources | None = None) -> Plan:
    """The placement `cfg` asks for (auto or explicit) with its bytes per device; UserError
    when this machine cannot hold it, before anything is allocated or written."""
    from .paths import offload_dir as default_offload_dir

    root = Path(cfg.offload_dir).expanduser() if cfg.offload_dir else default_offload_dir()
    res = resources if resources is not None else machine_resources(root)
    fp = footprint(spec, cfg.gpu_batch_size, cfg.compress_weight)
    heads, batch = cache_heads(spec), cfg.gpu_batch_size
    gpu_reserve, cpu_reserve = cfg.gpu_reserve_bytes, cfg.cpu_reserve_bytes
    auto = isinstance(cfg.placement, AutoPlacement)
    placement = _choose(fp, res, heads, batch, gpu_reserve, cpu_reserve) if auto \
        else cfg.placement.check()
    if placement is None:
        raise UserError(_no_fit(spec, fp, res))
    weights, staged = fp.weights_on(placement.w_gpu, placement.w_cpu)
    cache = fp.cache_on(placement.cache_gpu, placement.cache_cpu, heads, batch)
    need = _needs(fp, res, weights, staged, cache, gpu_reserve, cpu_reserve)
    avail = {"gpu": res.gpu, "cpu": res.ram, "disk": res.disk}
    full = _fits(need, res)
    if full is not None:
        raise UserError(_too_much(spec, placement, full, need, avail, res))
    return Plan(placement, auto, spec.name, fp.dtype, weights, cache, need, avail, res)


def _too_much(spec, placement: Placement, dev: str, need: dict, avail: dict,
              res: Resources) -> str:
    name = {"gpu": "GPU memory", "disk": f"free disk under {res.offload_root}",
            "cpu": "RAM" if res.cuda else "RAM (the compute device without CUDA)"}[dev]
    return (f"placement {placement.describe()} needs {_size(need[dev])} of {name} for "
            f"{spec.name}, {_size(avail[dev])} is usable; --placement auto chooses one that "
            "fits")


def _no_fit(spec, fp: Footprint, res: Resources) -> str:
    total = fp.weight_bytes + fp.cache_bytes
    room = res.ram + res.gpu + res.disk
    msg = (f"{spec.name} does not fit this machine: its weights are {_size(fp.weight_bytes)} "
           f"in {fp.dtype} and its KV cache up to {_size(fp.cache_bytes)}, {_size(total)} in "
           f"all, against {_size(res.ram)} of usable RAM"
           + (f", {_size(res.gpu)} of GPU memory" if res.cuda else "")
           + f" and {_size(res.disk)} of free disk under {res.offload_root}")
    hints = []
    if fp.dtype == "float32":
        half = total // 2
        verdict = "would fit" if half + fp.act_bytes < room else "would not fit either"
        slow = "; fp16 computes far slower on a CPU" if not res.cuda else ""
        hints.append(f"--dtype fp16 ({_size(half)}: {verdict}{slow})")
    hints.append("an --offload-dir on a disk with more free space")
    if not res.cuda:
        hints.append("a GPU")
    hints.append("a smaller model")
    return f"{msg}; try {', '.join(hints)}"
