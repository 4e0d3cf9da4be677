"""Decode-phase page baselines at the icecache budget: `page_window` (sink pages and a recent
window filling the whole budget, StreamingLLM-like: no retrieval) and `page_random` (the same
sink and window as icecache plus random position-ordered pages). They show what a decode-time
selection without the query is worth. Prefill is the `full` policy's."""
from __future__ import annotations

import torch

from .decode_pages import PagedDecodePolicyMixin, PageSelector, PositionalPages
from .full import Full


class PlainPages(PageSelector):
    """Position-ordered pages; picks random valid pages (seeded by layer and step)."""

    name = "positional"

    def build(self, keys, values, positions) -> PositionalPages:
        return PositionalPages(keys, values, positions, self.config.page_size)

    def select(self, struct: PositionalPages, q, n_pages, layer, step):
        kv, n = struct.pool.k.shape[0], struct.pool.n_pages
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + layer * 10_007 + step)
        return torch.stack([torch.randperm(n, generator=gen)[:n_pages] for _ in range(kv)])


class PageWindow(PagedDecodePolicyMixin, Full):
    name = "page_window"
    window_only = True

    def make_selector(self) -> PageSelector:
        return PlainPages(self.decode)


class PageRandom(PagedDecodePolicyMixin, Full):
    name = "page_random"

    def make_selector(self) -> PageSelector:
        return PlainPages(self.decode)
