"""A model on FlexGen, ready to generate: devices, placement policy, weights, tokenizer.

    with Runtime(RuntimeConfig(model="smollm2-135m")) as rt:
        out = rt.generate([rt.tokenizer.encode("It is a truth")], max_new_tokens=16)
"""
from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from .. import cpu_threads, progress
from ..errors import UserError
from ..paths import offload_dir as default_offload_dir
from ..store import scratch
from . import ModelSpec, compat, dtypes, resolve, weight_sets, weights
from .placement import AUTO, AutoPlacement, Placement, Plan, make_plan  # noqa: F401 - re-exported
from .quant import Groups

# A start-up step (weights, tokenizer) that may be a quick cache hit is announced on stderr
# once it has taken this long.
ANNOUNCE_AFTER_S = 1.0


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    model: str = "smollm2-135m"
    model_path: str | None = None
    placement: Placement | AutoPlacement = Placement()  # AUTO: chosen from free memory and disk
    offload_dir: str | None = None
    seed: int = 0
    dtype: object = None          # np.float32 / np.float16 / dtypes.BF16; None: the model's default
    overlap: bool = True          # overlap I/O and compute (FlexGen's pipelined loop)
    sep_layer: bool = True
    # FlexGen's group-wise 4-bit weights (dequantised per layer on the compute device just
    # before use) and KV cache (FlexGen's cache, and the serving engine's decode context).
    # compress_weight None: --placement auto decides (4-bit when the dtype does not fit).
    compress_weight: bool | None = False
    compress_cache: bool = False
    weight_groups: Groups = Groups(64, 0)   # FlexGen's defaults: along a weight's rows,
    cache_groups: Groups = Groups(64, 2)    # along a KV head's channels
    # FlexGen's block: sequences per micro-batch and micro-batches per block. The serving
    # engine computes a decode step in micro-batches of gpu_batch_size only under the block
    # schedule (ServiceConfig.throughput); otherwise a step's batch is computed whole.
    gpu_batch_size: int = 1
    num_gpu_batches: int = 1
    attn_sparsity: float = 1.0    # FlexGen's top-k attention in decode (OPT only); 1: dense
    # Attention over a KV cache in CPU memory computed on the CPU (FlexGen's), not copied to
    # the GPU: the serving engine's decode context and FlexGen's loop (OPT in fp16).
    cpu_cache_compute: bool = False
    max_seq_len: int | None = None  # more positions (random weights only: OPT's table grows)
    # Memory the caller will use beside the model (the store's GPU and CPU tiers): the
    # placement plan leaves it free.
    gpu_reserve_bytes: int = 0
    cpu_reserve_bytes: int = 0
    # The most RAM and disk this run may use (--max-ram-gb, --max-disk-gb); None: what is
    # free less a few GiB (placement.machine_resources).
    max_ram_bytes: int | None = None
    max_disk_bytes: int | None = None
    # Throughput work: its prompt + new tokens (the cache and working memory are sized by
    # them, not by the model's every position), and the policy search's choice and
    # prediction, said in the plan line.
    work_tokens: int | None = None
    searched: str = ""


@dataclasses.dataclass
class Generation:
    prompt_len: int
    new_ids: list[list[int]]          # per prompt, the generated tokens
    logits: list[torch.Tensor] | None  # per prompt, (new_tokens, vocab) float32
    prefill_s: float
    decode_s_per_token: float


def make_env(offload_root: Path):
    """FlexGen's ExecutionEnv. Without CUDA the 'GPU' is a separate CPU device object, so
    every copy FlexGen would make between GPU and CPU still happens (and is tested).
    FlexGen's disk files go to a new scratch directory under `offload_root` (directories
    left there by killed runs are removed first)."""
    from flexgen.pytorch_backend import TorchDevice, TorchDisk, TorchMixedDevice
    from flexgen.utils import ExecutionEnv

    try:
        path = scratch.make(offload_root, "flexgen")
    except OSError as exc:
        raise UserError(f"cannot use offload directory {offload_root}: "
                        f"{exc.strerror or exc}") from None
    gpu = TorchDevice("cuda:0" if torch.cuda.is_available() else "cpu")
    cpu = TorchDevice("cpu")  # created last: FlexGen's global CPU device
    try:
        disk = TorchDisk(str(path))
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    compat.register_disk(disk)
    return ExecutionEnv(gpu=gpu, cpu=cpu, disk=disk, mixed=TorchMixedDevice([gpu, cpu, disk]))


def make_policy(cfg: RuntimeConfig):
    from flexgen.compression import CompressionConfig
    from flexgen.flex_opt import Policy

    p = cfg.placement
    if isinstance(p, AutoPlacement):
        raise ValueError("make_policy needs a resolved placement (make_plan chooses one)")
    return Policy(
        gpu_batch_size=cfg.gpu_batch_size, num_gpu_batches=cfg.num_gpu_batches,
        w_gpu_percent=p.w_gpu, w_cpu_percent=p.w_cpu,
        cache_gpu_percent=p.cache_gpu, cache_cpu_percent=p.cache_cpu,
        act_gpu_percent=p.act_gpu, act_cpu_percent=p.act_cpu,
        overlap=cfg.overlap, sep_layer=cfg.sep_layer,
        pin_weight=torch.cuda.is_available(), cpu_cache_compute=cfg.cpu_cache_compute,
        attn_sparsity=cfg.attn_sparsity,
        compress_weight=bool(cfg.compress_weight),
        comp_weight_config=CompressionConfig(num_bits=4, group_size=cfg.weight_groups.size,
                                             group_dim=cfg.weight_groups.dim, symmetric=False),
        compress_cache=cfg.compress_cache,
        comp_cache_config=CompressionConfig(num_bits=4, group_size=cfg.cache_groups.size,
                                            group_dim=cfg.cache_groups.dim, symmetric=False),
    )


def _resolve(cfg: RuntimeConfig, dtype) -> ModelSpec:
    # A first start converts the weights (tens of seconds): said on stderr if it is slow.
    with progress.step(f"preparing the weights of {cfg.model_path or cfg.model} (converted "
                       "once, then cached)", after_s=ANNOUNCE_AFTER_S), cpu_threads.loading():
        spec = resolve(cfg.model, cfg.model_path, cfg.seed, dtype)
    if cfg.max_seq_len is not None and cfg.max_seq_len != spec.config.max_seq_len:
        if not spec.random_weights:
            raise UserError("max_seq_len can only be changed for random-weight models")
        spec = dataclasses.replace(spec, config=dataclasses.replace(
            spec.config, max_seq_len=cfg.max_seq_len))
    return spec


def in_format(cfg: RuntimeConfig, spec: ModelSpec, fmt) -> ModelSpec:
    """`spec` holding its weights in `fmt` (resolved again when it computes in another
    dtype: a conversion's files depend on it)."""
    if not dtypes.same(fmt.dtype, spec.config.dtype):
        spec = _resolve(cfg, fmt.dtype)
    return dataclasses.replace(spec, weight_format=fmt)


def resolve_spec(cfg: RuntimeConfig, check_placement: bool = True) -> ModelSpec:
    """The model `cfg` asks for (config, weights, tokenizer source, and the format its
    weights are held in), nothing built or written yet; with `check_placement`, a placement
    this machine cannot hold is refused here (UserError)."""
    spec = _resolve(cfg, cfg.dtype)
    try:
        plan = make_plan(spec, cfg)
    except UserError:
        if check_placement:
            raise
        # Planned again (and refused) by whoever builds it: the format auto weighs first.
        from .formats import candidates

        compress = cfg.compress_weight if isinstance(cfg.placement, AutoPlacement) \
            else bool(cfg.compress_weight)
        fmt = candidates(torch.cuda.is_available(), cfg.dtype or spec.config.dtype,
                         compress, cfg.weight_groups)[0]
        return in_format(cfg, spec, fmt)
    return in_format(cfg, spec, plan.format)
def dry_run(cfg: RuntimeConfig, spec: ModelSpec) -> str:
    """The plan a start with `cfg` would follow, with the bytes it writes and how long
    making and loading its weights would take; nothing allocated or written."""
    plan = make_plan(spec, cfg)
    seconds, basis = weight_sets.first_start_s(plan, spec)
    took = "unknown" if seconds is None else f"about {weight_sets.duration(seconds)}"
    writes = f"{plan.weights_write / 2**30:.2f} GiB of weights to the weights cache" \
        if plan.weights_write else "no weights"
    return (f"{plan.describe()}\nfirst start: writes {writes}; making and loading the "
            f"weights {took} ({basis}); serving not counted\ndry run: nothing was "
            "allocated or written")


def load_tokenizer(spec: ModelSpec):
    """The model's tokenizer; a first start builds it (seconds): said on stderr if slow."""
    from .tokenizer import load_tokenizer as load

    with progress.step(f"loading the tokenizer of {spec.name} (built once, then cached)",
                       after_s=ANNOUNCE_AFTER_S):
        return load(spec)


def check_lengths(spec: ModelSpec, prompt_tokens: int, new_tokens: int,
                  what: str = "the prompt") -> None:
    """UserError unless a `prompt_tokens` prompt plus `new_tokens` generated fit the model's
    positions; checked before anything is built (past them FlexGen fails deep inside)."""
    if prompt_tokens < 1:
        raise UserError(f"{what} is empty: it needs at least one token")
    if new_tokens < 1:
        raise UserError("at least 1 new token must be generated")
    limit = spec.config.max_seq_len
    if prompt_tokens + new_tokens > limit:
        raise UserError(f"{what}: {prompt_tokens} tokens + {new_tokens} new tokens need "
                        f"{prompt_tokens + new_tokens} positions, more than {spec.name}'s "
                        f"{limit}")


class Runtime:
    """Owns the devices, the model and the disk threads; close() (or `with`) releases all."""

    def __init__(self, cfg: RuntimeConfig, spec: ModelSpec | None = None, tokenizer=None):
        """`spec` (from resolve_spec(cfg)) and `tokenizer`, when the caller has them
        already, are used instead of resolving and loading them again."""
        compat.apply()
        weights.install()
        spec = spec if spec is not None else resolve_spec(cfg, False)
        # Planned (and refused if it cannot fit) before anything is allocated or written.
        self.plan: Plan = make_plan(spec, cfg)
        if self.plan.auto or self.plan.weights_write or self.plan.searched:
            print(self.plan.describe(), flush=True)
        fmt = self.plan.format
        self.spec: ModelSpec = in_format(cfg, spec, fmt)
        self.cfg = dataclasses.replace(cfg, placement=self.plan.placement, dtype=fmt.dtype,
                                       compress_weight=fmt.compress,
                                       weight_groups=fmt.groups or cfg.weight_groups)
        self.policy = make_policy(self.cfg)
        self._tokenizer = tokenizer
        # One request at a time through the model's buffers, whichever engine serves it.
        self.compute_lock = cpu_threads.ComputeLock()
        if self.plan.weights_source == "cache":
            # Written once under their digest (a progress bar; the first line says how
            # long and how much), read back at every later start.
            with cpu_threads.loading():
                self.spec = weight_sets.ensure(self.spec, fmt)
        self.env = make_env(Path(cfg.offload_dir).expanduser() if cfg.offload_dir
                            else default_offload_dir())
        try:
            t0 = time.perf_counter()
            # The thread that computes should be the only one owning a CPU team (cpu_threads).
            loaded = sum(self.plan.weights.values())
            with cpu_threads.loading(), weights.loading(loaded):
                self.model = self._build()
            self.load_s = time.perf_counter() - t0
            if loaded >= 1 << 30 and self.plan.weights_source != "drawn":
                weight_sets.record_rate("load_bytes_per_s", loaded / self.load_s)
        except BaseException:
            self.close()
            raise

    def _build(self):
        if self.spec.family == "opt":
            from .opt import OptModel as cls
        else:
            from .llama import LlamaModel as cls
        return cls(self.spec.config, self.env, self.spec.weight_path, self.policy)

    @property
    def placement(self) -> Placement:
        """The placement in use (`auto` resolved by the plan)."""
        return self.cfg.placement

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.spec)
        return self._tokenizer

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 32,
                 record_logits: bool = False) -> Generation:
        """Greedy generation. Prompts of unequal length are left-padded (and masked)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UserError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise UserError("max_new_tokens must be at least 1")
        config = self.spec.config
        prompt_len = max(len(p) for p in prompts)
        if prompt_len + max_new_tokens > config.max_seq_len:
            raise UserError(f"{prompt_len} prompt + {max_new_tokens} new tokens exceed "
                            f"{config.name}'s {config.max_seq_len} positions")
        if self.policy.cpu_cache_compute and (self.spec.family != "opt" or
                                              config.dtype != np.float16):
            raise UserError("FlexGen's own loop computes CPU cache attention for OPT in fp16 "
                            "only; --cpu-cache-compute serves any model in the engine")
        bad = [i for p in prompts for i in p if not 0 <= i < config.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary (0..{config.vocab_size - 1})")

        from flexgen.timer import timers

        bs = self.policy.gpu_batch_size * self.policy.num_gpu_batches
        new_ids, logits, prefill, decode = [], [], [], []
        for start in range(0, len(prompts), bs):
            group = prompts[start:start + bs]
            padded = group + [group[-1]] * (bs - len(group))  # FlexGen needs full batches
            inputs = [[config.pad_token_id] * (prompt_len - len(p)) + list(p) for p in padded]
            log: list | None = [] if record_logits else None
            self.model.output_layer.log = log
            timers("generate").reset()
            out = self.model.generate(inputs, max_new_tokens=max_new_tokens)
            self.model.output_layer.log = None
            costs = timers("generate").costs
            prefill.append(costs[0])
            decode.extend(costs[1:])
            for r in range(len(group)):
                new_ids.append([int(t) for t in out[r, prompt_len:]])
                if log is not None:
                    logits.append(torch.stack([step[r] for step in log]))
        return Generation(prompt_len, new_ids, logits if record_logits else None,
                          float(np.mean(prefill)), float(np.mean(decode)) if decode else 0.0)

    def close(self) -> None:
        env = getattr(self, "env", None)
        if env is None:
            return
        model = self.__dict__.pop("model", None)
        if model is not None:
            model.delete_all_weights()
        compat.close_disk(env.disk)
        shutil.rmtree(env.disk.path, ignore_errors=True)
        self.env = None

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
