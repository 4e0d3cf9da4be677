"""`icecache`: decode over semantic pages retrieved from a per-(layer, KV head) index.

Prefill is the `full` policy's: every stored prefix chunk is loaded and attended, so the first
token is exact. After prefill each layer's KV moves to CPU memory as pages of similar keys under
a hierarchical index (policies/page_index.py); sink and window pages stay on the compute device;
each decode step retrieves, per layer and KV head, the pages the current query needs under the
token budget (ServingConfig.decode_budget, 256 by default = 1 sink + 3 window + 12 retrieved
pages of 16). The first `dense_layers` layers attend over everything, as in the paper. Variants:
`icecache:reuse` shares one selection among 3 consecutive layers (IceCache(r)); prefetching the
next layer's pages with a predicted query is DecodeConfig(prefetch=True).
"""
from __future__ import annotations

import dataclasses

from .decode_pages import DecodeConfig, PagedDecodePolicyMixin, PageSelector
from .full import Full
from .page_index import PageIndex


class SemanticPages(PageSelector):
    name = "semantic"

    def build(self, keys, values, positions) -> PageIndex:
        return PageIndex(keys, values, positions, self.config.index)

    def insert(self, struct: PageIndex, keys, values, positions):
        return struct.insert(keys, values, positions)

    def select(self, struct: PageIndex, q, n_pages, layer, step):
        return struct.search(q, n_pages)


class IceCache(PagedDecodePolicyMixin, Full):
    name = "icecache"

    def __init__(self, config, decode: DecodeConfig | None = None, variant: str = ""):
        if variant not in ("", "reuse"):
            raise ValueError(f"icecache has variants: reuse (got '{variant}')")
        decode = decode or DecodeConfig()
        if variant == "reuse":
            decode = dataclasses.replace(decode, reuse_layers=3)
        super().__init__(config, decode)
        self.variant = variant

    def make_selector(self) -> PageSelector:
        return SemanticPages(self.decode)
