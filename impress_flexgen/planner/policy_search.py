"""FlexGen's cost model and policy search: how fast a placement and block of sequences
decodes on this machine, and the policy that decodes fastest within the memory limits.

    machine = measure_machine(cuda=False)             # a few short products and reads, cached
    shape = model_shape(spec)                         # per FlexGen layer: its tensors
    predict(shape, Policy(...), machine, Workload(512, 32)).decode_tokens_per_s
    best = search(shape, machine, limits, Workload(512, 32))   # a SearchResult
    best = search(shape, lambda dtype: measure_machine(False, dtype), limits)  # per format

A decode step runs every FlexGen layer (the embedding, each layer's attention and MLP, the
output) once per micro-batch: `num_gpu_batches` micro-batches of `gpu_batch_size`
sequences share one load of the layer's weights (FlexGen's block schedule). Per layer:

    read    = weights off the compute device: disk files (a fixed cost per file plus bytes
              at the disk's rate), CPU memory (bytes over the CPU-GPU link; without CUDA a
              memory copy); and per micro-batch the KV cache off the compute device
    compute = per micro-batch: the layer's fixed cost (Python and kernel launches), its
              products (weight elements at the rate measured for that many rows), 4-bit
              weights' unpacking, the attention's pass over the cache, and in a prefill
              the element-wise work around the products (PASS_OPS)

With overlap (FlexGen's pipelined loop) the next layer is read while this one computes:
max(read, compute + lost), where `lost` is what the compute loses to the reading's copies
on the same cores (a CPU without CUDA: the read's core time, copying out of its buffers or
between memory buffers, times `contention`, measured; the disk itself moves its bytes
beside the compute); in sync, read + compute. Every
second the CPU spends (compute, a file's fixed cost, a memory copy without CUDA) is
stretched by the share of a core a thread gets now (`share`: other programs); the disk's
bytes are not (the disk moves them while another program has the core). The
search weighs every weight format, weight percentages in steps, where the KV cache goes,
batch sizes in powers of two and 4-bit cache, keeps those whose bytes fit every device
(placement.needs, the accounting --placement uses) and returns the most tokens/s.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from ..models.footprint import cache_heads, footprint, layer_homes, weight_names
from ..models.placement import Placement, fits, in_dtype, needs
from ..models.quant import Groups
from .machine import Machine, measure_machine  # noqa: F401 - re-exported

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
GPU_BATCHES = (1, 2, 4, 8)
WEIGHT_STEPS = tuple(range(0, 101, 10))
CACHE_GROUPS = Groups(64, 2)     # FlexGen's 4-bit KV groups (RuntimeConfig.cache_groups)


@dataclasses.dataclass(frozen=True)
class Workload:
    prompt_len: int = 512
    gen_len: int = 32
    # Prompt tokens per sequence an exact policy computes by canonical tiles (its prefix's
    # whole chunks: engine/attention.py), a pass's such rows padded to whole tiles of
    # `tile` rows; 0: every prompt row as it comes.
    tiled: int = 0
    tile: int = 256
    # Prompt tokens per sequence whose KV is read from the store, not computed: a stored
    # prefix that the block's sequences share, read once per pass (engine/pass_reads.py).
    stored: int = 0

    def prefill_calls(self, sequences: int) -> tuple[int, ...]:
        """Token rows of each product call of a prefill pass of `sequences`: the tiled rows
        in whole tiles, then the others in one call."""
        tiles = -(-sequences * self.tiled // self.tile)
        rest = sequences * (self.prompt_len - self.tiled - self.stored)
        return (self.tile,) * tiles + ((rest,) if rest else ())

    def prefill_rows(self, sequences: int) -> int:
        """Token rows a prefill pass of `sequences` multiplies."""
        return sum(self.prefill_calls(sequences))


@dataclasses.dataclass(frozen=True)
class Policy:
    """FlexGen's policy as the cost model sees it (activations live where they compute)."""

    w_gpu: float = 100
    w_cpu: float = 0
    cache_gpu: float = 100
    cache_cpu: float = 0
    gpu_batch_size: int = 1
    num_gpu_batches: int = 1
    compress_weight: bool = False
    compress_cache: bool = False
    act_gpu: float = 100
    act_cpu: float = 0

    @property
    def block(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def placement(self) -> Placement:
        return Placement(self.w_gpu, self.w_cpu, self.cache_gpu, self.cache_cpu,
                         self.act_gpu, self.act_cpu)

    def describe(self) -> str:
        p = self.placement
        comp = [w for w, on in (("weights", self.compress_weight),
                                ("cache", self.compress_cache)) if on]
        return (f"{p.describe()}, batch {self.gpu_batch_size} x {self.num_gpu_batches} "
                f"micro-batches" + (f", 4-bit {' and '.join(comp)}" if comp else ""))


@dataclasses.dataclass(frozen=True)
class Layer:
    kind: str                        # embed, attention, mlp or output
    elements: tuple[int, ...]        # per tensor
    matrix: tuple[bool, ...]         # two-dimensional (multiplied, or 4-bit when compressed)
    count: int = 1                   # how many such layers, one after another


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the cost model needs of a model: its FlexGen layers and its KV per token."""

    name: str
    layers: tuple[Layer, ...]
    kv_width: int                    # K (or V) values per token per sequence per layer
    itemsize: int                    # bytes of a value in the compute dtype
    spec: object = None              # the ModelSpec, for the memory accounting
    hidden: int = 0                  # the hidden width (a token row's activation)


def model_shape(spec) -> Shape:
    layers: dict[Layer, int] = {}     # alike layers counted once (the model is predicted
    names = weight_names(spec)        # per layer, in whatever order: a sum of max())
    for i, layer in enumerate(names):
        kind = "embed" if i == 0 else "output" if i == len(names) - 1 else \
            "attention" if any("self_attn" in n for n, _ in layer) else "mlp"
        one = Layer(kind, tuple(int(np.prod(s)) for _, s in layer),
                    tuple(len(s) >= 2 for _, s in layer))
        layers[one] = layers.get(one, 0) + 1
    c = spec.config
    if spec.family == "opt":
        kv = c.input_dim
    else:
        kv = c.n_kv_head * c.head_dim
    counted = tuple(dataclasses.replace(x, count=n) for x, n in layers.items())
    return Shape(spec.name, counted, kv, np.dtype(c.dtype).itemsize, spec, c.hidden_size)


@dataclasses.dataclass(frozen=True)
class Prediction:
    policy: Policy
    prefill_s: float
    decode_step_s: float             # one decode step of the whole block
    read_s: float                    # a decode step's reads alone
    compute_s: float                 # a decode step's compute alone
    tokens_per_s: float              # generated tokens over prefill and decode
    decode_tokens_per_s: float
    overlap: bool

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["policy"] = dataclasses.asdict(self.policy)
        return out


def _value_bytes(elements: float, itemsize: int, compressed: bool) -> float:
    # 4-bit: half a byte per value plus an fp16 scale and minimum per group of 64.
    return elements * (0.5 + 4 / 64) if compressed else elements * itemsize


@functools.lru_cache(maxsize=4096)
def _homes(elements: tuple[int, ...], w_gpu: float, w_cpu: float) -> tuple[str, ...]:
    return tuple(layer_homes(list(elements), w_gpu, w_cpu))


def _weight_read(layer: Layer, shape: Shape, p: Policy, m: Machine,
                 rows: int) -> tuple[float, float]:
    """(seconds, core seconds) to bring one layer's weights to the compute device: the time
    the read takes and the time of a core it spends copying; `rows` token rows embedded (a
    token table on the disk, loaded into CPU memory, is read for those rows alone)."""
    seconds = core = 0.0
    cpu = m.share if not m.cuda else 1.0      # a copy in memory takes a core
    for i, (elements, matrix, home) in enumerate(zip(layer.elements, layer.matrix,
                                                     _homes(layer.elements, p.w_gpu, p.w_cpu))):
        packed = p.compress_weight and matrix
        nbytes = _value_bytes(elements, shape.itemsize, packed)
        vocab = getattr(getattr(shape.spec, "config", None), "vocab_size", 0)
        if (layer.kind == "embed" and i == 0 and home == "disk" and not packed
                and not m.cuda and vocab):
            nbytes = min(nbytes, rows * nbytes / vocab + rows * 64 * 1024)
        if home == "disk":
            seconds += m.disk_file_s * (2 if packed else 1) / m.share + \
                nbytes / m.disk_bytes_per_s
            core += _disk_core(m, nbytes)
        elif home == "cpu":         # a copy in memory: all of its time on a core
            copy = nbytes / m.link_bytes_per_s / cpu
            seconds, core = seconds + copy, core + copy
    return seconds, core


def _disk_core(m: Machine, nbytes: float) -> float:
    """Core seconds a disk read of `nbytes` spends (copying out of its read buffer)."""
    return nbytes / m.disk_cpu_bytes_per_s / m.share if m.disk_cpu_bytes_per_s else 0.0


def _cache_read(shape: Shape, p: Policy, m: Machine, tokens: float,
                new: float) -> tuple[float, float]:
    """(seconds, core seconds), per micro-batch, to bring an attention layer's KV (K and V
    of `tokens` positions) to the compute device and store the `new` positions back."""
    values = 2 * p.gpu_batch_size * shape.kv_width
    total = _value_bytes(values * tokens, shape.itemsize, p.compress_cache)
    stored = _value_bytes(values * new, shape.itemsize, p.compress_cache)
    disk = (100 - p.cache_gpu - p.cache_cpu) / 100
    cpu = m.share if not m.cuda else 1.0
    seconds = core = p.cache_cpu / 100 * (total + stored) / m.link_bytes_per_s / cpu
    if disk:
        seconds += 4 * m.disk_file_s / m.share + disk * (total + stored) / m.disk_bytes_per_s
        core += _disk_core(m, disk * (total + stored))
    return seconds, core


# A prefill's element-wise work around its products (norms, residuals, the activation,
# rotary, tiles gathered and scattered, KV concatenated, softmax), in element-wise
# operations over the hidden width per token row and model layer: profiles of the serving
# engine's prefill on a CPU put it at 13-15 us a row and layer for OPT-125M (768 wide) and
# SmolLM2 (576), where one such operation took 0.105 ns a value (Machine.activation_s).
PASS_OPS = 200
# A sequence's handling of its stored prefix in each layer of a prefill (matching its chunks,
# the policy's plan, gathering and concatenating them, the mask), in layers' fixed costs:
# 0.4-0.65 ms a sequence and layer in profiles of SmolLM2 and OPT-125M on a CPU whose layer's
# fixed cost was 0.17-0.2 ms.
STORED_LAYER_COSTS = 3


def _compute(layer: Layer, shape: Shape, p: Policy, m: Machine, calls: tuple[float, ...],
             tokens: float, queries: int, share: float = 1.0, stored: bool = False) -> float:
    """Seconds of one micro-batch through one layer: product calls of `calls` token rows
    each, `share` of them the micro-batch's (a prefill pass's calls are the whole block's),
    `queries` new tokens per sequence attending over `tokens` positions, some of them a
    `stored` prefix's."""
    b = p.gpu_batch_size
    family = getattr(shape.spec, "family", "opt")
    seconds = m.layer_seconds(b, family)
    if stored and layer.kind == "attention":
        seconds += b * STORED_LAYER_COSTS * m.layer_seconds(1, family)
    matrices = sum(e for e, mat in zip(layer.elements, layer.matrix) if mat)
    if p.compress_weight:
        seconds += matrices / m.unpack_per_s
    if layer.kind == "output":      # the last position only (base.output_logits)
        seconds += matrices * m.element_seconds(b)
    elif layer.kind in ("attention", "mlp"):
        seconds += share * matrices * sum(m.element_seconds(n) for n in calls)
    if queries > 1 and layer.kind in ("attention", "mlp"):
        # Half of a model layer's in each of its two FlexGen layers. A decode step's is in
        # the layer's fixed cost, measured on decode steps.
        seconds += share * sum(calls) * shape.hidden * PASS_OPS / 2 * m.activation_s
    if layer.kind == "attention":
        kv = 2 * b * shape.kv_width * tokens
        seconds += kv * shape.itemsize / m.bytes_per_s + 2 * kv * queries / m.flops_per_s
        if p.compress_cache:
            seconds += kv / m.unpack_per_s
    return seconds / m.share      # other programs' turns on the cores stretch it


def _stored_read(shape: Shape, m: Machine, tokens: int) -> tuple[float, float]:
    """(seconds, core seconds) to read an attention layer's stored KV of `tokens` positions
    from the store's disk (its K and V files), once for the pass."""
    if not tokens:
        return 0.0, 0.0
    nbytes = 2 * shape.kv_width * tokens * shape.itemsize
    return 2 * m.disk_file_s / m.share + nbytes / m.disk_bytes_per_s, _disk_core(m, nbytes)


def _step(shape: Shape, p: Policy, m: Machine, calls: tuple[float, ...], tokens: float,
          queries: int, new: float, overlap: bool, share: float = 1.0,
          stored: int = 0) -> tuple[float, float, float]:
    """(step seconds, reads alone, compute alone) of one pass of the block."""
    k = p.num_gpu_batches
    rows = sum(calls) * share           # per micro-batch
    step = reads = computes = 0.0
    for layer in shape.layers:
        read, core = _weight_read(layer, shape, p, m, rows * k)
        if layer.kind == "attention":
            kv, kv_core = _cache_read(shape, p, m, tokens, new)
            held, held_core = _stored_read(shape, m, stored)
            read, core = read + k * kv + held, core + k * kv_core + held_core
        compute = k * _compute(layer, shape, p, m, calls, tokens, queries, share, stored > 0)
        reads += layer.count * read
        computes += layer.count * compute
        if overlap:
            # The disk moves its bytes beside the compute; the compute loses what the
            # reading's copies take of its cores (`contention` of their core time, which
            # lies within the read's own time): never more than read + compute.
            lost = m.contention * min(core, read, compute)
            step += layer.count * max(read, compute + lost)
        else:
            step += layer.count * (read + compute)
    return step, reads, computes


def predict(shape: Shape, policy: Policy, machine: Machine,
            workload: Workload = Workload(), overlap: bool = True) -> Prediction:
    """Predicted prefill and decode time of `policy` for `workload` on `machine`."""
    p, w = policy, workload
    k = p.num_gpu_batches
    prefill, _, _ = _step(shape, p, machine, w.prefill_calls(p.block), w.prompt_len,
                          w.prompt_len - w.stored, w.prompt_len - w.stored, overlap,
                          share=1 / k, stored=w.stored)
    context = w.prompt_len + w.gen_len / 2     # the decode steps' mean context
    decode, reads, computes = _step(shape, p, machine, (p.gpu_batch_size,), context, 1, 1,
                                    overlap)
    total = prefill + max(w.gen_len - 1, 0) * decode
    return Prediction(p, prefill, decode, reads, computes, p.block * w.gen_len / total,
                      p.block / decode, overlap)


# ---------------------------------------------------------------------------------------
# The search

@dataclasses.dataclass(frozen=True)
class SearchResult:
    prediction: Prediction
    format: object                   # the WeightFormat chosen
    needs: dict                      # bytes per device the policy needs
    weighed: int                     # policies that fit and were predicted

    @property
    def policy(self) -> Policy:
        return self.prediction.policy

    def describe(self) -> str:
        pr = self.prediction
        return (f"policy search: {self.policy.describe()} in {self.format.name}; predicted "
                f"{pr.decode_tokens_per_s:.3g} decode tokens/s ({pr.tokens_per_s:.3g} tokens/s "
                f"with the prefill; best of {self.weighed} that fit)")


def _cache_options(cuda: bool) -> list[tuple[int, int]]:
    return [(100, 0), (0, 100), (0, 0)] if cuda else [(100, 0), (0, 0)]


def _weight_options(cuda: bool):
    for g in WEIGHT_STEPS:
        for c in (WEIGHT_STEPS if cuda else (0,)):
            if g + c <= 100:
                yield g, c


def _needs(fp, placed, heads: int, p: Policy, limits, reserve: tuple[int, int]) -> dict:
    """Bytes per device of `p` (`fp`: the footprint of its format, block and workload;
    `placed`: fp.weights_on for its weights) by the accounting --placement uses
    (placement.needs: a cache and working memory for the whole block), counting what a
    first start adds: weights drawn in memory, and written to the weights cache."""
    weights, staged = placed
    cache = fp.cache_on(p.cache_gpu, p.cache_cpu, heads, p.block)
    return needs(fp, limits, weights, staged, cache, reserve[0], reserve[1], False,
                 fp.weight_bytes)


def search(shape: Shape, machine, limits, workload: Workload = Workload(),
           formats=None, reserve: tuple[int, int] = (0, 0), compress_cache: bool | None = None,
           max_block: int | None = None) -> SearchResult | None:
    """The policy with the most tokens/s for `workload` among those whose bytes fit
    `limits` (placement.Resources: --max-ram-gb, --max-disk-gb, free GPU memory); None
    when none fits. `machine`: the rates, a Machine, or a function of a format's compute
    dtype (torch) giving those measured in it, asked once per format that has a policy
    that fits. `formats`: the weight formats weighed (default: --placement auto's for the
    device); `compress_cache` None weighs both; `max_block`: at most this many sequences in
    a block (the prompts there are)."""
    from ..models import dtypes
    from ..models.formats import candidates

    machines: dict = {}

    def rates(fmt) -> Machine:
        if not callable(machine):
            return machine
        key = dtypes.name(fmt.dtype)
        if key not in machines:
            machines[key] = machine(dtypes.torch_dtype(fmt.dtype))
        return machines[key]

    formats = formats or candidates(limits.cuda)
    caches = (False, True) if compress_cache is None else (compress_cache,)
    blocks = [(b, k) for b in BATCH_SIZES for k in GPU_BATCHES
              if max_block is None or b * k <= max(max_block, 1)]
    best, weighed, footprints, placed = None, 0, {}, {}
    for fmt, cq, (b, k) in itertools.product(formats, caches, blocks):
        spec = in_dtype(shape.spec, fmt.dtype)
        fmt_shape = dataclasses.replace(shape, itemsize=np.dtype(fmt.dtype).itemsize)
        if (fmt, cq, b * k) not in footprints:
            footprints[fmt, cq, b * k] = footprint(spec, b * k, fmt.groups,
                                                   CACHE_GROUPS if cq else None,
                                                   workload.prompt_len + workload.gen_len)
        fp = footprints[fmt, cq, b * k]
        for (wg, wc), (cg, cc) in itertools.product(_weight_options(limits.cuda),
                                                    _cache_options(limits.cuda)):
            p = Policy(wg, wc, cg, cc, b, k, fmt.compress, cq)
            if (fmt, wg, wc) not in placed:     # the weights' bytes: the same for any block
                placed[fmt, wg, wc] = fp.weights_on(wg, wc)
            need = _needs(fp, placed[fmt, wg, wc], cache_heads(spec), p, limits, reserve)
            if fits(need, limits) is not None:
                continue
            weighed += 1
            pr = predict(fmt_shape, p, rates(fmt), workload)
            # At equal speed (reads hidden behind compute), the weights and cache nearer
            # the compute: fewer bytes moved, fewer cores taken.
            key = (pr.tokens_per_s, wg, wc, cg, cc)
            if best is None or key > best[3]:
                best = (pr, fmt, need, key)
    if best is None:
        return None
    return SearchResult(best[0], best[1], best[2], weighed)


def error(predicted: float, measured: float) -> float | None:
    """Measured over predicted, less one (+0.2: 20% faster than predicted)."""
    if not (predicted > 0 and measured > 0):
        return None
    return measured / predicted - 1.0


__all__ = ["Layer", "Machine", "Policy", "Prediction", "SearchResult", "Shape", "Workload",
           "error", "measure_machine", "model_shape", "predict", "search"]
