"""Building the serving stack: the store shaped for a runtime's model and a policy.

    store = open_store(directory, runtime, policy.config, policy)
    engine = Engine(runtime, store, policy, TierSizes(gpu_bytes=1 << 30))
"""
from __future__ import annotations

from pathlib import Path

from policies import ServingConfig, ServingPolicy

from ..runtime import Runtime
from ..store import CHUNK_SIZE, PrefixStore, StoreConfig
from .family import model_shape, probe_setup


def open_store(directory: str | Path, runtime: Runtime, config: ServingConfig,
               policy: ServingPolicy, chunk_size: int = CHUNK_SIZE, probe_format: str = "int4",
               disk_capacity_bytes: int | None = None, reorder_interval: int = 50,
               direct_io: bool = True, reorder_hot_fraction: float = 0.25,
               reorder_by: str = "importance", read_limit_mb_s: float | None = None
               ) -> PrefixStore:
    """A store shaped for `runtime`'s model, with the probe copy `config` needs."""
    _, probe_kv = probe_setup(runtime.spec, config)
    store_cfg = StoreConfig(chunk_size=chunk_size, probe_heads=probe_kv, probe_format=probe_format,
                            disk_capacity_bytes=disk_capacity_bytes,
                            reorder_interval=reorder_interval if policy.reorder else 0,
                            direct_io=direct_io, reorder_hot_fraction=reorder_hot_fraction,
                            reorder_by=reorder_by, read_limit_mb_s=read_limit_mb_s)
    return PrefixStore(directory, model_shape(runtime.spec, chunk_size), store_cfg)
