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
from collections import Counter
from pathlib import Path

import numpy as np

from .errors import UserError

GiB = 1 << 30
# Working memory is sized for a forward pass over this many tokens (or the model's
# positions, if fewer): long prompts need more, and get it from the margins.
ACT_TOKENS = 2048
# FlexGen's disk copy threads each pin a 1 Gi-element fp16 relay buffer when CUDA is present.
CUDA_RELAY_BYTES = 4 * 2 * GiB
DEVICES = ("gpu", "cpu", "disk")


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
# What the model needs

def weight_shapes(spec) -> list[list[tuple[int, ...]]]:
    """Per FlexGen layer, in build order, the shapes its init_weight asks for (each layer is
    placed on its own: FlexGen splits every layer by the same percentages)."""
    c = spec.config
    if spec.family == "opt":
        h, v, s = c.input_dim, c.vocab_size, c.max_seq_len
        attn = [(h, h), (h,)] * 4 + [(h,), (h,)]
        mlp = [(4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,)]  # FlexGen's MLP is 4h wide
        first = [(v, h), (s + 2, h)]                                # token and position tables
        last = [(h,), (h,), (v, h)]                                 # a second copy of the tokens
    else:
        h, q, kv, ffn = c.hidden_size, c.n_head * c.head_dim, c.n_kv_head * c.head_dim, \
            c.intermediate_size
        attn = [(q, h), (kv, h), (kv, h), (h, q), (h,)]
        mlp = [(ffn, h), (ffn, h), (h, ffn), (h,)]
        first = [(c.vocab_size, h)]
        last = [(h,), (c.vocab_size, h)]
    return [first] + [attn, mlp] * c.num_hidden_layers + [last]


def _tensor_bytes(shape, itemsize: int, compress: bool) -> int:
    n = int(np.prod(shape))
    if compress and len(shape) >= 2:
        # FlexGen's 4-bit groups of 64: packed nibbles plus an fp16 scale and minimum each.
        return n // 2 + (n + 63) // 64 * 4
    return n * itemsize


def _split_layer(sizes: list[int], w_gpu: float, w_cpu: float) -> list[str]:
    """The device of each tensor of one layer, by FlexGen's rule: where its middle byte falls
    in the layer's byte range, the first part going to disk, then CPU, then GPU."""
    cuts = np.cumsum([100 - w_gpu - w_cpu, w_cpu, w_gpu])
    cum = np.cumsum(sizes)
    homes = []
    for size, c in zip(sizes, cum):
        mid = (c - size / 2) / cum[-1] * 100
        homes.append(next((d for d, cut in zip(("disk", "cpu", "gpu"), cuts) if mid < cut),
                          "gpu"))
    return homes


@dataclasses.dataclass(frozen=True)
class Footprint:
    """A model's memory, independent of where it goes."""

    layers: tuple[tuple[int, ...], ...]  # per FlexGen layer, bytes of each weight tensor
    counts: tuple[int, ...]              # how many layers have that byte list
    cache_bytes: int                     # FlexGen's KV cache of a full-length generation
    act_bytes: int                       # working memory of one forward pass
    load_bytes: int                      # transient while the largest tensor is made or loaded
    dtype: str

    @property
    def weight_bytes(self) -> int:
        return sum(sum(layer) * n for layer, n in zip(self.layers, self.counts))

    def weights_on(self, w_gpu: float, w_cpu: float) -> tuple[dict[str, int], int]:
        """(bytes of weights per device, bytes of the largest layer's share off the GPU: what
        a copy into the compute device stages per layer)."""
        out = dict.fromkeys(DEVICES, 0)
        staged = 0
        for layer, n in zip(self.layers, self.counts):
            off = 0
            for size, home in zip(layer, _split_layer(list(layer), w_gpu, w_cpu)):
                out[home] += size * n
                off += size if home != "gpu" else 0
            staged = max(staged, off)
        return out, staged

    def cache_on(self, cache_gpu: float, cache_cpu: float, heads: int, batch: int
                 ) -> dict[str, int]:
        """Bytes of KV cache per device. A split cache is cut along (batch x heads) in whole
        multiples of the head count, as FlexGen's mixed device (and ours for Llama) does."""
        out = dict.fromkeys(DEVICES, 0)
        if cache_gpu == 100:
            out["gpu"] = self.cache_bytes
        elif cache_cpu == 100:
            out["cpu"] = self.cache_bytes
        elif cache_gpu + cache_cpu == 0:
            out["disk"] = self.cache_bytes
        else:
            n = batch * heads
            gpu = int(n * cache_gpu / 100) // heads * heads
            cpu = n - gpu if cache_gpu + cache_cpu == 100 else \
                int(n * cache_cpu / 100) // heads * heads
            for dev, rows in (("gpu", gpu), ("cpu", cpu), ("disk", n - gpu - cpu)):
                out[dev] = self.cache_bytes * rows // n
        return out


def cache_heads(spec) -> int:
    c = spec.config
    return c.n_head if spec.family == "opt" else c.n_kv_head


def footprint(spec, batch: int = 1, compress_weight: bool = False) -> Footprint:
    c = spec.config
    itemsize = np.dtype(c.dtype).itemsize
    shapes = weight_shapes(spec)
    counts = Counter(tuple(_tensor_bytes(s, itemsize, compress_weight) for s in layer)
                     for layer in shapes)
    layers = tuple(counts)
    if spec.family == "opt":
        hidden, heads, ffn = c.input_dim, c.n_head, 4 * c.input_dim
        head_dim = hidden // heads
    else:
        hidden, heads, head_dim, ffn = c.hidden_size, c.n_head, c.head_dim, c.intermediate_size
    # FlexGen sizes it prompt + new - 1 rows; a generation fills at most every position.
    rows = c.max_seq_len - 1
    cache = 2 * c.num_hidden_layers * rows * batch * cache_heads(spec) * head_dim * itemsize
    s = min(c.max_seq_len, ACT_TOKENS)
    act = (batch * s * (8 * hidden + 2 * ffn) * itemsize      # hidden states, q/k/v, MLP
           + 3 * batch * heads * s * s * 4                     # attention scores (fp32)
           + 2 * batch * c.vocab_size * 4)                     # logits
    largest = max(int(np.prod(sh)) for layer in shapes for sh in layer)
    return Footprint(layers, tuple(counts.values()), cache, act, largest * (4 + itemsize),
                     np.dtype(c.dtype).name)


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
