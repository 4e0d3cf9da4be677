"""Prefix-KV serving policies, one module each; `make_policy` builds one by name.

    recomp        recompute the whole prefix (no store)
    full          load the whole stored prefix (the accuracy reference)
    as_like       AttentionStore-like: the whole prefix through LRU tiers
    as_h2o_lru    all keys, per-head top-k, only those values; LRU tiers
    as_h2o_lfu    the same with LFU tiers
    impress       ITF + selective loading + reorder + score tiers (ablation: itf, itf_ro, all)
    random        random chunks at the same budget
    sink_recent   the first chunk and the most recent chunks at the same budget
"""
from __future__ import annotations

from .base import LayerContext, LayerPlan, Segment, ServingConfig, ServingPolicy
from .baselines import RandomChunks, SinkRecent
from .full import AsLike, Full
from .h2o import AsH2O
from .impress import ABLATIONS, Impress
from .recomp import Recomp

POLICY_NAMES = ("recomp", "full", "as_like", "as_h2o_lru", "as_h2o_lfu", "impress",
                "random", "sink_recent")


def make_policy(name: str, config: ServingConfig = ServingConfig(),
                ablation: str = "all") -> ServingPolicy:
    """A policy by name; `impress:itf` style names pick an ablation."""
    base, _, variant = name.partition(":")
    if base == "impress":
        return Impress(config, variant or ablation)
    if variant:
        raise ValueError(f"policy {base} has no variants")
    if base in ("as_h2o_lru", "as_h2o_lfu"):
        return AsH2O(config, base.rsplit("_", 1)[1])
    classes = {"recomp": Recomp, "full": Full, "as_like": AsLike, "random": RandomChunks,
               "sink_recent": SinkRecent}
    if base not in classes:
        raise ValueError(f"unknown policy '{name}'; choose from {', '.join(POLICY_NAMES)}")
    return classes[base](config)


__all__ = ["ABLATIONS", "POLICY_NAMES", "LayerContext", "LayerPlan", "Segment", "ServingConfig",
           "ServingPolicy", "make_policy"]
