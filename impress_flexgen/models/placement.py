"""Where a model's weights and KV cache go: FlexGen's six percentages, the format its
weights are held in, and a plan that checks them against this machine's free GPU memory,
RAM and disk before anything is allocated or written.

    plan = make_plan(spec, cfg)          # cfg.placement: a Placement, or AUTO
    print(plan.describe())               # bytes of weights and cache per device, and why
    plan.placement, plan.format          # what FlexGen's Policy gets

`auto` weighs the weight formats of formats.AUTO_FORMATS for the compute device, fastest
first, and keeps the first that holds every weight in memory, else the one that leaves the
fewest bytes on disk (each step reads those again). Within a format it fills the compute
device first (the GPU; without CUDA, RAM), then CPU memory (with CUDA), then disk, keeping
margins for activations, the store's tiers and the rest of the machine (--max-ram-gb,
--max-disk-gb; by default what is free less a few GiB). An explicit placement gets the same
accounting and is refused when a device cannot hold its share: the kernel's OOM killer
never decides. A refusal names every option that would fit.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np

from ..errors import UserError
from . import plan_text
# What the model needs, wherever it goes (footprint.py; its names stay readable here).
from .footprint import (ACT_TOKENS, DEVICES, Footprint, cache_heads,  # noqa: F401
                        footprint, weight_shapes)
from .formats import WeightFormat, candidates

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
    """Free bytes per device, what is kept back from each, and the caps asked for."""

    cuda: bool
    gpu_free: int
    gpu_keep: int
    ram_free: int
    ram_keep: int
    disk_free: int
    disk_keep: int
    offload_root: str
    ram_cap: int | None = None    # --max-ram-gb: replaces "free less what is kept back"
    disk_cap: int | None = None   # --max-disk-gb

    @property
    def gpu(self) -> int:
        return max(0, self.gpu_free - self.gpu_keep)

    @property
    def ram(self) -> int:
        if self.ram_cap is not None:
            return max(0, min(self.ram_cap, self.ram_free))
        return max(0, self.ram_free - self.ram_keep)

    @property
    def disk(self) -> int:
        if self.disk_cap is not None:
            return max(0, min(self.disk_cap, self.disk_free))
        return max(0, self.disk_free - self.disk_keep)

    def uncapped(self) -> "Resources":
        return dataclasses.replace(self, ram_cap=None, disk_cap=None)


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def machine_resources(offload_root: Path, max_ram: int | None = None,
                      max_disk: int | None = None) -> Resources:
    """Free GPU memory (torch.cuda.mem_get_info), available RAM (psutil) and free disk under
    `offload_root` and the weights cache (the lesser), after removing scratch directories
    that dead processes left there. Kept back unless capped: 5% of the GPU (at least 1 GiB)
    for the CUDA allocator, 10% of RAM (at least 4 GiB) for the OS and other programs, 5% of
    the file system (at least 4 GiB)."""
    import psutil
    import torch

    from ..paths import weights_dir
    from ..store import scratch

    offload_root = Path(offload_root).expanduser()
    if offload_root.is_dir():
        scratch.sweep_stale(offload_root)
    cuda = torch.cuda.is_available()
    gpu_free = gpu_keep = 0
    if cuda:
        gpu_free, gpu_total = torch.cuda.mem_get_info()
        gpu_keep = max(GiB, gpu_total // 20)
    vm = psutil.virtual_memory()
    disk_free = disk_keep = 0
    try:
        for where in (offload_root, weights_dir()):
            du = shutil.disk_usage(_existing_parent(where))
            if not disk_free or du.free < disk_free:
                disk_free, disk_keep = du.free, max(4 * GiB, du.total // 20)
    except OSError:
        disk_free = disk_keep = 0
    return Resources(cuda, int(gpu_free), int(gpu_keep), int(vm.available),
                     max(4 * GiB, vm.total // 10), int(disk_free), int(disk_keep),
                     str(offload_root), max_ram, max_disk)


# ---------------------------------------------------------------------------------------
# The plan

@dataclasses.dataclass(frozen=True)
class Plan:
    placement: Placement
    auto: bool
    model: str
    format: WeightFormat
    weights: dict        # bytes per device (gpu, cpu, disk)
    cache: dict          # bytes per device, at the model's every position
    needs: dict          # everything each device must hold (weights, cache, working memory)
    available: dict      # what each device can give (free less what is kept back)
    resources: Resources
    weights_source: str = "drawn"   # made once ("cache"), or "files", or "drawn" each start
    weights_path: str | None = None  # the weights cache's set (made once), if any
    weights_write: int = 0          # bytes this start writes there (0: made already)
    why: str = ""                   # why this format (auto)
    searched: str = ""              # the policy search's choice and prediction, if it chose

    @property
    def dtype(self) -> str:
        return self.format.dtype_name

    def describe(self) -> str:
        """The percentages and format, bytes per device against what is usable, and where
        the weights come from (and, chosen by auto, why this format)."""
        return plan_text.describe(self)

    def as_dict(self) -> dict:
        return {"placement": dataclasses.asdict(self.placement), "auto": self.auto,
                "dtype": self.dtype, "format": self.format.label,
                "weights_bytes": dict(self.weights), "cache_bytes": dict(self.cache),
                "needs_bytes": dict(self.needs), "available_bytes": dict(self.available),
                "weights_source": self.weights_source, "weights_path": self.weights_path,
                "weights_write_bytes": self.weights_write, "why": self.why,
                "searched": self.searched}


def needs(fp: Footprint, res: Resources, weights: dict, staged: int, cache: dict,
           gpu_reserve: int, cpu_reserve: int, in_files: bool = False, write: int = 0
           ) -> dict:
    """Bytes each device must hold: with CUDA the GPU computes (activations, staged layers,
    random weights drawn there); without it all of that is RAM. Weights read from files
    (`in_files`) take no new disk where they lie on it; `write`: bytes this start adds to
    the weights cache."""
    # 2: overlapped layers; weights read from files need no room to be made in.
    work = fp.act_bytes + (2 * staged if staged else 0) + (0 if in_files else fp.load_bytes)
    need = {d: weights[d] + cache[d] for d in DEVICES}
    if in_files:
        need["disk"] -= weights["disk"]
    need["disk"] += write
    if res.cuda:
        need["gpu"] += work + gpu_reserve
        need["cpu"] += CUDA_RELAY_BYTES + cpu_reserve
    else:
        need["cpu"] += need.pop("gpu") + work + cpu_reserve + gpu_reserve
        need["gpu"] = 0
    return need


def fits(need: dict, res: Resources) -> str | None:
    """The first device that cannot hold its share, or None."""
    avail = {"gpu": res.gpu, "cpu": res.ram, "disk": res.disk}
    for d in DEVICES:
        if need[d] > avail[d]:
            return d
    return None


def _choose(fp: Footprint, res: Resources, heads: int, batch: int, gpu_reserve: int,
            cpu_reserve: int, in_files: bool, write: int) -> Placement | None:
    """The placement auto picks: weights fill the compute device, then (with CUDA) CPU
    memory, then disk; the KV cache goes whole to the fastest device with room left."""
    none = dict.fromkeys(DEVICES, 0)

    def need(w_gpu, w_cpu, cache):
        weights, staged = fp.weights_on(w_gpu, w_cpu)
        return needs(fp, res, weights, staged, cache, gpu_reserve, cpu_reserve, in_files,
                      write)

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
        if fits(need(w_gpu, w_cpu, fp.cache_on(cache_gpu, cache_cpu, heads, batch)),
                 res) is None:
            return Placement(w_gpu, w_cpu, cache_gpu, cache_cpu, 100, 0)
    return None


def in_dtype(spec, dtype):
    """`spec` computing in `dtype` (its config's dtype replaced)."""
    if np.dtype(spec.config.dtype) == np.dtype(dtype):
        return spec
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, dtype=dtype))


def _weight_set(spec, fmt):
    from . import weight_sets

    return weight_sets.weight_set(spec, fmt)


def _sources(spec, fmt: WeightFormat, cuda: bool) -> list[tuple[str, str | None, int]]:
    """Where the weights may come from, preferred first: (kind, path, bytes to write). Made
    once ("cache") where making them again costs more than reading them back: on a CPU,
    and for 4-bit weights; on a GPU drawing is faster (unless some live on disk: _option)."""
    ws = _weight_set(spec, fmt)
    if ws is None:
        return [("files", None, 0)]
    made = ("cache", str(ws.path), 0 if ws.made() else ws.nbytes)
    drawn = ("drawn", None, 0)
    return [drawn, made] if cuda and not fmt.compress else [made, drawn]


def _option(spec, cfg, res: Resources, fmt: WeightFormat, auto: bool):
    """(a Plan of `fmt` on this machine, auto or as cfg says, or None; and the shortfall of
    an explicit placement that cannot fit: (device, needs, available))."""
    spec = in_dtype(spec, fmt.dtype)
    # FlexGen keeps a cache per micro-batch: the block's sequences all hold one.
    block = cfg.gpu_batch_size * getattr(cfg, "num_gpu_batches", 1)
    fp = footprint(spec, block, fmt.groups, cfg.cache_groups if cfg.compress_cache else None,
                   getattr(cfg, "work_tokens", None))
    heads, batch = cache_heads(spec), block
    avail = {"gpu": res.gpu, "cpu": res.ram, "disk": res.disk}
    found, short = [], None
    for source, path, write in _sources(spec, fmt, res.cuda):
        in_files = source != "drawn"
        placement = _choose(fp, res, heads, batch, cfg.gpu_reserve_bytes,
                            cfg.cpu_reserve_bytes, in_files, write) if auto \
            else cfg.placement.check()
        if placement is None:
            continue
        weights, staged = fp.weights_on(placement.w_gpu, placement.w_cpu)
        cache = fp.cache_on(placement.cache_gpu, placement.cache_cpu, heads, batch)
        need = needs(fp, res, weights, staged, cache, cfg.gpu_reserve_bytes,
                      cfg.cpu_reserve_bytes, in_files, write)
        full = fits(need, res)
        if full is None:
            found.append(Plan(placement, auto, spec.name, fmt, weights, cache, need, avail,
                              res, source, path, write))
        elif short is None:
            short = (placement, full, need)
    # Drawn at every start only while none of them lives on disk.
    keep = [p for p in found if not (p.weights_source == "drawn" and p.weights["disk"]
                                     and any(q.weights_source == "cache" for q in found))]
    return (keep[0] if keep else None), short


def formats_for(spec, cfg, cuda: bool, auto: bool) -> list[WeightFormat]:
    """The formats this plan weighs: auto's for the device within what cfg pins (its dtype,
    its compression); an explicit placement, or a spec whose format is chosen, one."""
    pinned = getattr(spec, "weight_format", None)
    if pinned is not None:
        return [pinned]
    compress = cfg.compress_weight if auto else bool(cfg.compress_weight)
    dtype = cfg.dtype if cfg.dtype is not None or auto else spec.config.dtype
    found = candidates(cuda, dtype, compress, cfg.weight_groups)
    return found if auto else found[:1]


def pick(options: list[Plan]) -> Plan:
    """Auto's choice among the formats that fit, fastest first: the first with every weight
    in memory, else the one that leaves the fewest bytes on disk; with why."""
    whole = [p for p in options if not p.weights["disk"]]
    chosen = whole[0] if whole else min(options, key=lambda p: p.weights["disk"])
    return dataclasses.replace(chosen, why=plan_text.why(chosen, options))


def _what_would_fit(spec, cfg, res: Resources, tried: list[WeightFormat], auto: bool
                    ) -> list[str]:
    """Every option that would fit where `tried` does not: --placement auto, another
    format, a raised --max-ram-gb / --max-disk-gb."""
    from .formats import others

    fits = []
    if not auto:
        plan, _ = _option(spec, cfg, res, tried[0], True)
        if plan is not None:
            fits.append(plan_text.option_text("--placement auto", plan))
    for fmt, note in others(res.cuda, cfg.weight_groups):
        if fmt in tried:
            continue
        plan, _ = _option(spec, cfg, res, fmt, True)
        if plan is not None:
            fits.append(plan_text.option_text(fmt.flags(), plan, note))
    if res.ram_cap is not None or res.disk_cap is not None:
        for fmt in tried:
            plan, _ = _option(spec, cfg, res.uncapped(), fmt, auto)
            if plan is not None:
                flags = [plan_text.cap_flag(name, plan.needs[dev])
                         for name, dev, cap in (("max-ram-gb", "cpu", res.ram_cap),
                                                ("max-disk-gb", "disk", res.disk_cap))
                         if cap is not None and plan.needs[dev] > cap]
                fits.append(plan_text.option_text(" ".join(flags), plan))
                break
    return fits


def make_plan(spec, cfg, resources: Resources | None = None) -> Plan:
    """The placement and weight format `cfg` asks for (auto or explicit) with its bytes per
    device; UserError when this machine cannot hold it, before anything is allocated or
    written, naming every option that would fit."""
    from ..paths import offload_dir as default_offload_dir

    root = Path(cfg.offload_dir).expanduser() if cfg.offload_dir else default_offload_dir()
    res = resources if resources is not None else machine_resources(
        root, cfg.max_ram_bytes, cfg.max_disk_bytes)
    auto = isinstance(cfg.placement, AutoPlacement)
    formats = formats_for(spec, cfg, res.cuda, auto)
    tried = [_option(spec, cfg, res, f, auto) for f in formats]
    options = [plan for plan, _ in tried if plan is not None]
    if options:
        plan = pick(options) if auto else options[0]
        return dataclasses.replace(plan, searched=cfg.searched) if cfg.searched else plan
    short = None
    if not auto and tried[0][1] is not None:
        placement, dev, need = tried[0][1]
        short = plan_text.too_much(spec.name, placement, dev, need,
                                   {"gpu": res.gpu, "cpu": res.ram, "disk": res.disk}, res)
    footprints = [(f, footprint(in_dtype(spec, f.dtype), cfg.gpu_batch_size, f.groups))
                  for f in formats]
    raise UserError(plan_text.refusal(spec, res, footprints,
                                      _what_would_fit(spec, cfg, res, formats, auto), short))
