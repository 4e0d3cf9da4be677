"""Prefix-KV serving policies, one module each; `make_policy` builds one by name.

    recomp        recompute the whole prefix (no store)
    full          load the whole stored prefix (the accuracy reference)
    as_like       AttentionStore-like: the whole prefix through LRU tiers
    as_h2o_lru    all keys, per-head top-k, only those values; LRU tiers
    as_h2o_lfu    the same with LFU tiers
    impress       ITF + selective loading + reorder + score tiers (ablation: itf, itf_ro, all)
    random        random chunks at the same budget
    sink_recent   the first chunk and the most recent chunks at the same budget
    replay:PATH   impress with selections replayed from a recorded trace (policies.replay;
                  needs a trace, so not in POLICY_NAMES)

Decode-phase policies (prefill as `full`; per decode step, pages under `decode_budget` tokens):
    icecache      semantic pages under a per-(layer, KV head) index (icecache:reuse shares one
                  selection among 3 layers)
    quest         position-ordered pages ranked by per-page key bounds
    page_window   sink and recent window only
    page_random   sink, window and random pages
    page_oracle   sink, window and the pages with the most exact attention mass (a bound;
                  page_oracle:semantic on icecache's pages, page_oracle:token on single tokens)
"""
from __future__ import annotations

from .base import LayerContext, LayerPlan, Segment, ServingConfig, ServingPolicy
from .baselines import RandomChunks, SinkRecent
from .decode_baselines import PageOracle, PageRandom, PageWindow
from .decode_pages import DecodeConfig
from .full import AsLike, Full
from .h2o import AsH2O
from .icecache import IceCache
from .impress import ABLATIONS, Impress
from .quest import Quest
from .recomp import Recomp
from .replay import Replay

POLICY_NAMES = ("recomp", "full", "as_like", "as_h2o_lru", "as_h2o_lfu", "impress",
                "random", "sink_recent", "icecache", "quest", "page_window", "page_random",
                "page_oracle")
DECODE_POLICIES = {"icecache": IceCache, "quest": Quest, "page_window": PageWindow,
                   "page_random": PageRandom, "page_oracle": PageOracle}


def make_policy(name: str, config: ServingConfig = ServingConfig(),
                ablation: str = "all", decode: DecodeConfig | None = None) -> ServingPolicy:
    """A policy by name; `impress:itf` style names pick an ablation, `icecache:reuse` the
    layer-reuse variant; `decode` configures the decode-phase policies."""
    base, _, variant = name.partition(":")
    if base == "impress":
        return Impress(config, variant or ablation)
    if base == "icecache":
        return IceCache(config, decode, variant)
    if base == "replay":
        return Replay(config, variant)
    if base == "page_oracle":
        return PageOracle(config, decode, variant)
    if variant:
        raise ValueError(f"policy {base} has no variants")
    if base in ("as_h2o_lru", "as_h2o_lfu"):
        return AsH2O(config, base.rsplit("_", 1)[1])
    if base in DECODE_POLICIES:
        return DECODE_POLICIES[base](config, decode)
    classes = {"recomp": Recomp, "full": Full, "as_like": AsLike, "random": RandomChunks,
               "sink_recent": SinkRecent}
    if base not in classes:
        raise ValueError(f"unknown policy '{name}'; choose from {', '.join(POLICY_NAMES)}")
    return classes[base](config)


__all__ = ["ABLATIONS", "DECODE_POLICIES", "POLICY_NAMES", "DecodeConfig", "LayerContext", "LayerPlan", "Segment", "ServingConfig",
           "ServingPolicy", "make_policy"]
