"""Building the serving stack, the one way for the service, the workload runner, the
experiments and the tests: the policy, the store shaped for the runtime's model, the memory
tiers in front of it, the engine.

    stack = assemble(runtime, make_policy("impress", config),
                     StoreSpec(directory, reorder_interval=0), TierConfig(gpu_bytes=1 << 30))
    try:
        response = stack.engine.serve(Request(prefix_ids, query_ids))
    finally:
        stack.close()           # the engine's pool threads, then the store (not the runtime)

A store opened by the caller (a PrefixStore) may be given instead of a StoreSpec: it stays
the caller's to close.
"""
from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

from policies import ServingConfig, ServingPolicy, make_policy

from ..errors import UserError
from ..models.runtime import Runtime
from ..store import CHUNK_SIZE, PrefixStore, StoreConfig
from ..tiers import ChunkCache, TierConfig
from .engine import Engine
from .family import model_shape, probe_setup
from .scheduler import SchedulerConfig


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """Where a store lives and how it is opened (see StoreConfig for each knob)."""

    directory: Path
    chunk_size: int = CHUNK_SIZE
    probe_format: str = "int4"
    disk_capacity_bytes: int | None = None
    reorder_interval: int = 50           # the policy's reordering off: never
    direct_io: bool = True
    reorder_hot_fraction: float = 0.25
    reorder_by: str = "importance"
    read_limit_mb_s: float | None = None
    kv_format: str | None = None         # None: the compute dtype's (model_shape)


@dataclasses.dataclass
class Stack:
    """What assemble() built. The runtime stays its owner's to close."""

    runtime: Runtime
    policy: ServingPolicy
    store: PrefixStore | None
    engine: Engine
    warnings: list[str] = dataclasses.field(default_factory=list)   # from start_engine
    owns_store: bool = True        # opened by assemble (a store given stays the giver's)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            if self.store is not None and self.owns_store:
                self.store.close()


def make_serving_policy(name: str, config: ServingConfig,
                        tier_policy: str | None = None) -> ServingPolicy:
    """The policy `name` with `config`; `tier_policy` overrides its GPU/CPU tier policy."""
    policy = make_policy(name, config)
    if tier_policy is not None:
        policy.tier_policy = tier_policy
    return policy


def assemble(runtime: Runtime, policy: ServingPolicy, store: StoreSpec | PrefixStore | None = None,
             tiers: TierConfig = TierConfig(), *, cache: ChunkCache | None = None,
             scheduling: SchedulerConfig = SchedulerConfig(), start: bool = False) -> Stack:
    """The engine serving `runtime`'s model with `policy`, over a store opened as `store`
    says when the policy reuses stored KV (none otherwise, or without `store`; a PrefixStore
    is used as it is), behind memory tiers of `tiers`' sizes (or `cache`, shared with
    another engine on the same store), batching as `scheduling` says. `start`: run
    start_engine() before returning (its warnings in the stack). A store that cannot be
    opened is a UserError naming its directory."""
    opened, owned = None, False
    if isinstance(store, PrefixStore):
        opened = store
    elif store is not None and policy.reuse:
        opened, owned = _open(store, runtime, policy), True
    try:
        engine = Engine(runtime, opened, policy, tiers, scheduling)
        if opened is not None and policy.reuse:
            # The memory tiers (GPU, CPU) in front of the store's disk; engines that share
            # a store share them.
            opened.tiers.use_memory(cache if cache is not None else ChunkCache(
                TierConfig(tiers.gpu_bytes, tiers.cpu_bytes, policy.tier_policy, tiers.alpha,
                           tiers.exclusive, verify_hits=tiers.verify_hits),
                gpu_device=engine.device))
    except BaseException:
        if owned:
            opened.close()
        raise
    stack = Stack(runtime, policy, opened, engine, owns_store=owned)
    if start:
        try:
            stack.warnings = start_engine(engine)
        except BaseException:
            stack.close()
            raise
    return stack


def start_engine(engine: Engine) -> list[str]:
    """What a server or a run does once its engine is built, before any request: calibrate
    the planner (a few short prefills, or the cached curve), so that no request pays for it;
    ask the shared pool once, so that one that does not answer is known now (it then
    answers misses at once and requests are served locally until it is back). Returns
    warnings for the user."""
    from ..tiers.remote_codec import DIGEST_SIZE
    from ..tiers.remote_url import redact_url

    if engine.planner is not None:
        engine.planner.cost()
    warnings = []
    store = engine.store
    if store is not None and engine.policy.exact_reads and not store.shape.kv_exact:
        warnings.append(f"{engine.policy.name} is exact and the store keeps "
                        f"{store.shape.kv_format} KV, which is not the computed KV: every "
                        "prefix is recomputed (--kv-format sets the store's format)")
    if engine.shared is not None:
        pool = engine.shared.tier
        pool.batch_exists_chunks([bytes(DIGEST_SIZE)])   # one round trip, or marked down
        if pool.metrics()["down"]:
            warnings.append(f"the shared pool at {redact_url(pool.url)} does not answer; "
                            "requests are served from the local tiers and store until it does")
        if not engine.shared.keyed:
            warnings.append(f"the shared pool at {redact_url(pool.url)} has no secret "
                            "(--remote-secret): anyone able to write to it can change answers; "
                            "what it gives is used but never stored locally")
    return warnings


def _open(spec: StoreSpec, runtime: Runtime, policy: ServingPolicy) -> PrefixStore:
    """open_store, with a directory that cannot be opened (permissions, not a directory, a
    database SQLite cannot read) reported as a UserError naming it."""
    options = dataclasses.asdict(spec)
    path = options.pop("directory")
    try:
        return open_store(path, runtime, policy.config, policy, **options)
    except (OSError, sqlite3.DatabaseError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UserError(f"cannot open the store in {path}: {why}") from None


def open_store(directory: str | Path, runtime: Runtime, config: ServingConfig,
               policy: ServingPolicy, chunk_size: int = CHUNK_SIZE, probe_format: str = "int4",
               disk_capacity_bytes: int | None = None, reorder_interval: int = 50,
               direct_io: bool = True, reorder_hot_fraction: float = 0.25,
               reorder_by: str = "importance", read_limit_mb_s: float | None = None,
               kv_format: str | None = None) -> PrefixStore:
    """A store shaped for `runtime`'s model, with the probe copy `config` needs, keeping
    K and V in `kv_format` (None: the compute dtype's)."""
    _, probe_kv = probe_setup(runtime.spec, config)
    store_cfg = StoreConfig(chunk_size=chunk_size, probe_heads=probe_kv, probe_format=probe_format,
                            disk_capacity_bytes=disk_capacity_bytes,
                            reorder_interval=reorder_interval if policy.reorder else 0,
                            direct_io=direct_io, reorder_hot_fraction=reorder_hot_fraction,
                            reorder_by=reorder_by, read_limit_mb_s=read_limit_mb_s)
    return PrefixStore(directory, model_shape(runtime.spec, chunk_size, kv_format), store_cfg)
