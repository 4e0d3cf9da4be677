"""Load the whole stored prefix: `full` (the accuracy reference) and `as_like`
(AttentionStore-like: everything through LRU tiers)."""
from __future__ import annotations

from .base import ServingPolicy


class Full(ServingPolicy):
    name = "full"
    loads_everything = True
    exact_reads = True


class AsLike(ServingPolicy):
    name = "as_like"
    tier_policy = "lru"
    exact_reads = True
