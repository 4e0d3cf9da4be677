"""Every setting a run or a server is made with, each held once by the record of the layer
that owns it:

    RuntimeConfig   the model, its weights' placement and dtype      (runtime.py)
    RunConfig       the policy and every knob that shapes its result
    TierConfig      the GPU and CPU tiers and the shared pool behind the disk (tiers/)
    StoreOptions    where the stores live and how they behave on this machine
    ServiceConfig   the four above, plus the service's queue, timeout and batch

    config = ServiceConfig(model="smollm2-135m", store_root="/srv/stores")
    config.runtime.model, config.store.root, config.tiers.gpu_bytes

What shapes a store's files (chunk size, probe and KV formats) is the RunConfig's
(store_options()); the store's own format record is store.StoreConfig and its ModelShape.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from policies import ServingConfig

from .errors import UserError
from .models.runtime import AUTO, RuntimeConfig
from .store.config import CHUNK_SIZE
from .tiers import TierConfig
from .tiers.remote_url import SECRET_ENV, check_pool_trust

GB = 1 << 30
DEFAULT_TIER_BYTES = (256 << 20, 1 << 30)   # a server's GPU and CPU tiers, unless sized


def dtype_of(name: str | None):
    """--dtype's value (fp32, fp16, bf16) as the dtype a model's config holds (numpy's,
    bf16 as models.dtypes.BF16); None: the model's default."""
    from .models import dtypes

    return dtypes.of_name(name)


def runtime_memory_fields(args) -> dict:
    """The RuntimeConfig fields of the flags of entrypoints.args' "weights and memory"
    group (each left at its default where a program has not that flag)."""
    out = {}
    for flag in ("compress_weight", "compress_cache", "weight_groups", "cache_groups"):
        if getattr(args, flag, None) is not None:
            out[flag] = getattr(args, flag)
    for flag in ("gpu_batch_size", "num_gpu_batches", "overlap", "cpu_cache_compute"):
        if getattr(args, flag, None) is not None:
            out[flag] = getattr(args, flag)
    for flag, field in (("max_ram_gb", "max_ram_bytes"), ("max_disk_gb", "max_disk_bytes")):
        if getattr(args, flag, None) is not None:
            out[field] = int(getattr(args, flag) * GB)
    if "compress_weight" not in out and hasattr(args, "compress_weight"):
        out["compress_weight"] = None     # not given: --placement auto decides
    return out


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One row of a comparison: a policy and every knob that shapes its result."""

    label: str
    policy: str
    retention: float = 0.25
    granularity: str = "chunk"
    threshold: str = "none"
    threshold_value: float = 0.85
    adaptive_alpha: float = 0.6
    probe_heads: str | tuple[int, ...] = "auto"
    probe_format: str = "int4"
    chunk_size: int = CHUNK_SIZE
    decode_over: str = "kept"
    reorder_hot_fraction: float = 0.25   # see StoreConfig
    reorder_by: str = "importance"       # or "semantic" (StoreConfig)
    tier_policy: str | None = None       # override the policy's GPU/CPU tier policy
    probe_queries: int = 0               # see ServingConfig
    probe_stride: int = 1                # see ServingConfig
    probe_every: int = 1                 # see ServingConfig
    prefetch: bool = False               # see ServingConfig
    plan: str = "load"                   # see ServingConfig: load, recompute, both or auto
    # How the store keeps K and V (disk_layout.format.KV_FORMATS); None: the compute dtype,
    # so that stored KV is the computed KV bit for bit. Any other format is inexact: an
    # exact policy recomputes what such a store holds.
    kv_format: str | None = None

    def store_options(self) -> dict:
        """The knobs of this row that shape its store (open_store keyword arguments)."""
        return {"chunk_size": self.chunk_size, "probe_format": self.probe_format,
                "reorder_hot_fraction": self.reorder_hot_fraction,
                "reorder_by": self.reorder_by, "kv_format": self.kv_format}

    def serving(self) -> ServingConfig:
        return ServingConfig(retention=self.retention, granularity=self.granularity,
                             threshold=self.threshold, threshold_value=self.threshold_value,
                             adaptive_alpha=self.adaptive_alpha, probe_heads=self.probe_heads,
                             probe_queries=self.probe_queries,
                             probe_stride=self.probe_stride, probe_every=self.probe_every,
                             prefetch=self.prefetch,
                             decode_over=self.decode_over, plan=self.plan)


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Where a run's stores live and how they behave on this machine. What shapes a store's
    files (chunk size, probe format, layout) belongs to the RunConfig (store_options())."""

    root: str | Path | None = None          # None: <cache>/stores/<model>-<identity>
    disk_capacity_bytes: int | None = None  # None: unlimited
    reorder_interval: int = 50              # queries between background reorders; 0: never
    read_limit_mb_s: float | None = None    # disk read bandwidth cap; None: none

    def root_for(self, model) -> Path:
        """The folder of a model's stores (`model`: its store.ModelShape, or a bare name
        for callers that have no model): the root given, else one per model identity (its
        label and the short form of its fingerprint), so that other weights, another seed
        or checkpoint, or another dtype never open a store of KV they did not compute."""
        from .paths import cache_dir

        if self.root:
            return Path(self.root).expanduser()
        if isinstance(model, str):
            return cache_dir() / "stores" / model
        label = re.sub(r"[^A-Za-z0-9._-]+", "-", model.name).strip("-.") or "model"
        return cache_dir() / "stores" / (f"{label}-{model.short_id}" if model.short_id
                                         else label)

    def open_options(self) -> dict:
        """open_store keyword arguments (besides the RunConfig's)."""
        return {"disk_capacity_bytes": self.disk_capacity_bytes,
                "reorder_interval": self.reorder_interval,
                "read_limit_mb_s": self.read_limit_mb_s}


# The block of --throughput when neither --gpu-batch-size nor --num-gpu-batches is given:
# 8 micro-batches of 8 (a block of 64 shares each weight load).
THROUGHPUT_BLOCK = (8, 8)


def throughput_runtime(runtime: RuntimeConfig) -> RuntimeConfig:
    """The runtime of the block schedule: its block as given, or THROUGHPUT_BLOCK."""
    if runtime.gpu_batch_size * runtime.num_gpu_batches > 1:
        return runtime
    size, n = THROUGHPUT_BLOCK
    return dataclasses.replace(runtime, gpu_batch_size=size, num_gpu_batches=n)


def _default_runtime() -> RuntimeConfig:
    return RuntimeConfig(placement=AUTO)


def _default_tiers() -> TierConfig:
    return TierConfig(*DEFAULT_TIER_BYTES)


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """Everything a server or a run serves with, each part held once by the layer that owns
    it: the model and its placement, the policy's knobs, the tiers, the store."""

    runtime: RuntimeConfig = dataclasses.field(default_factory=_default_runtime)
    run: RunConfig = RunConfig("full", "full")     # exact: answers never depend on a hit
    tiers: TierConfig = dataclasses.field(default_factory=_default_tiers)
    store: StoreOptions = StoreOptions()
    queue_size: int = 16                    # requests waiting (the one being served aside)
    timeout_s: float = 600.0                # per request, from its arrival
    max_batch_size: int = 8                 # requests decoded together (continuous batching)
    max_batch_tokens: int = 8192            # tokens per step: decode plus prefilled prompts
    # An idle server waits this long after a request for others arriving with it: without
    # it, clients that send at once see the first prefilled alone and the rest wait for it.
    batch_gather_s: float = 0.01
    # A scored prompt's tokens prefilled per step: what another request that arrives
    # meanwhile waits for, and the rows of logits held at once (None: engine.scheduler's).
    score_piece_tokens: int | None = None
    # The block schedule (FlexGen's, for throughput work): a block of up to the runtime's
    # gpu_batch_size x num_gpu_batches sequences decoded together, each layer's weights
    # brought once for the block and computed in micro-batches of gpu_batch_size; the
    # block replaces max_batch_size (THROUGHPUT_BLOCK where the runtime's is 1 x 1).
    throughput: bool = False
    # Shorthands for the parts most often set (a model, a store root, tier sizes): each is
    # folded into the part that owns it when the config is made, and never stored apart;
    # read runtime.model, store.root, tiers.gpu_bytes and tiers.cpu_bytes.
    model: dataclasses.InitVar[str | None] = None
    store_root: dataclasses.InitVar[str | Path | None] = None
    gpu_cache_bytes: dataclasses.InitVar[int | None] = None
    cpu_cache_bytes: dataclasses.InitVar[int | None] = None

    def __post_init__(self, model, store_root, gpu_cache_bytes, cpu_cache_bytes):
        if self.queue_size < 1:
            raise UserError("the queue must hold at least 1 request")
        if not self.timeout_s > 0:   # inf: no deadline
            raise UserError("the request timeout must be a positive number of seconds")
        if self.max_batch_size < 1 or self.max_batch_tokens < 1:
            raise UserError("the batch must hold at least 1 request and 1 token")
        if self.score_piece_tokens is not None and self.score_piece_tokens < 1:
            raise UserError("a scored prompt's pieces need at least 1 token")
        if not 0 <= self.batch_gather_s <= 10:
            raise UserError("the batch gather wait must be between 0 and 10 seconds")
        fold = object.__setattr__    # frozen: only here, while the object is being made
        if self.throughput:
            fold(self, "runtime", throughput_runtime(self.runtime))
            r = self.runtime
            fold(self, "max_batch_size", r.gpu_batch_size * r.num_gpu_batches)
            fold(self, "queue_size", max(self.queue_size, self.max_batch_size))
        if model is not None:
            fold(self, "runtime", dataclasses.replace(self.runtime, model=model))
        if store_root is not None:
            fold(self, "store", dataclasses.replace(self.store, root=store_root))
        for name, size in (("gpu_bytes", gpu_cache_bytes), ("cpu_bytes", cpu_cache_bytes)):
            if size is not None:
                fold(self, "tiers", dataclasses.replace(self.tiers, **{name: size}))

    @classmethod
    def from_args(cls, args, *, policy: str | None = None,
                  default_tiers: tuple[int, int] = DEFAULT_TIER_BYTES,
                  **fields) -> ServiceConfig:
        """The configuration the flags of entrypoints.args (add_model_args and
        add_serving_args) ask for, for the main job and the server alike. `policy`: one of
        --compare's (default --policy); `default_tiers`: GPU and CPU tier bytes where
        --gpu-cache-gb and --cpu-cache-gb are not given; `fields`: the rest (queue_size,
        timeout_s)."""
        name = policy or args.policy
        run = RunConfig(
            label=name, policy=name, retention=args.retention, granularity=args.granularity,
            threshold=args.threshold, threshold_value=args.threshold_value,
            adaptive_alpha=args.adaptive_alpha, probe_heads=args.probe_heads,
            probe_format=args.probe_format, chunk_size=args.chunk_size,
            reorder_hot_fraction=args.reorder_hot_fraction, reorder_by=args.reorder_by,
            probe_queries=args.probe_queries, probe_stride=args.probe_stride,
            probe_every=args.probe_every, prefetch=args.prefetch, plan=args.plan,
            kv_format=getattr(args, "kv_format", None))
        gpu, cpu = (default if gb is None else int(gb * GB) for gb, default in
                    zip((args.gpu_cache_gb, args.cpu_cache_gb), default_tiers))
        check_pool_trust(args.remote_tier, args.remote_secret or os.environ.get(SECRET_ENV),
                         getattr(args, "remote_insecure", False))
        tiers = TierConfig(gpu, cpu, exclusive=args.exclusive_tiers,
                           verify_hits=args.verify_tier_hits,
                           remote_url=args.remote_tier, remote_secret=args.remote_secret,
                           remote_ttl=args.remote_ttl)
        store = StoreOptions(root=args.store_dir, reorder_interval=args.reorder_interval,
                             disk_capacity_bytes=None if args.disk_capacity_gb is None
                             else int(args.disk_capacity_gb * GB),
                             read_limit_mb_s=args.disk_read_limit)
        runtime = RuntimeConfig(model=args.model, model_path=args.model_path,
                                placement=args.placement, offload_dir=args.offload_dir,
                                seed=args.seed, dtype=dtype_of(args.dtype),
                                **runtime_memory_fields(args))
        batching = {k: getattr(args, k) for k in ("max_batch_size", "max_batch_tokens",
                                                  "score_piece_tokens", "throughput")
                    if getattr(args, k, None) is not None}
        if getattr(args, "batch_gather_ms", None) is not None:
            batching["batch_gather_s"] = args.batch_gather_ms / 1000
        return cls(runtime=runtime, run=run, tiers=tiers, store=store, **{**batching, **fields})

    def runtime_config(self) -> RuntimeConfig:
        """The runtime's configuration, leaving room for the tiers."""
        return dataclasses.replace(self.runtime, gpu_reserve_bytes=self.tiers.gpu_bytes,
                                   cpu_reserve_bytes=self.tiers.cpu_bytes)

    def plan_line(self) -> str:
        """The plan mode, the shared pool and the disk read limit, for a start-up line."""
        from .tiers.remote_url import redact_url

        plan = {"auto": "auto (load, recompute or both per request, by the cost model)",
                "both": "both (recompute the front while the rest loads)"}
        line = f"plan {plan.get(self.run.plan, self.run.plan)}; "
        line += (f"shared pool {redact_url(self.tiers.remote_url)}" if self.tiers.remote_url
                 else "no shared pool")
        if self.store.read_limit_mb_s is not None:
            line += f"; disk reads held to {self.store.read_limit_mb_s:g} MB/s"
        return line
