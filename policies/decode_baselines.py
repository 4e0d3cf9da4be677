"""Decode-phase page baselines at the icecache budget: `page_window` (sink pages and a recent
window filling the whole budget, StreamingLLM-like: no retrieval), `page_random` (the same
sink and window as icecache plus random position-ordered pages) and `page_oracle` (the same
sink and window plus the pages with the most exact attention mass). The first two show what a
decode-time selection without the query is worth; the oracle bounds what any page retriever can
reach at the budget, since it scores every paged token with the true query. Prefill is the
`full` policy's.

`page_oracle` variants say which pages it picks from: position-ordered pages of 16 (default, the
pages quest ranks), `semantic` (icecache's pages: bounds icecache's retrieval on its own pages)
or `token` (single tokens: bounds any sparse selection of that many tokens).
"""
from __future__ import annotations

import torch

from .decode_pages import PagedDecodePolicyMixin, PageSelector, PositionalPages
from .full import Full
from .page_index import PageIndex, PagePool, top_ids


class PlainPages(PageSelector):
    """Position-ordered pages; picks random valid pages (seeded by layer and step)."""

    name = "positional"

    def build(self, keys, values, positions) -> PositionalPages:
        return PositionalPages(keys, values, positions, self.config.page_size)

    def select(self, struct: PositionalPages, q, n_pages, layer, step):
        kv, n = struct.pool.k.shape[0], struct.pool.n_pages
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + layer * 10_007 + step)
        return torch.stack([torch.randperm(n, generator=gen)[:n_pages] for _ in range(kv)])


def attention_mass(pool: PagePool, q: torch.Tensor) -> torch.Tensor:
    """q (H, d) -> (KV, P) share of attention each page gets from the query heads of its KV
    group: exact softmax over every paged token, per query head, summed over the group. Per-head
    normalisation keeps a head with flat attention from outvoting a head that needs one page."""
    kv, n = pool.k.shape[0], pool.n_pages
    qf = q.detach().float().cpu().view(kv, q.shape[0] // kv, -1)
    scores = torch.einsum("kgd,knsd->kgns", qf, pool.k[:, :n].float()) * qf.shape[-1] ** -0.5
    scores = scores.masked_fill(~pool.valid[:, None, :n], -float("inf"))
    prob = torch.softmax(scores.flatten(2), -1).view_as(scores).nan_to_num(0.0)
    mass = prob.sum((1, 3))
    return mass.masked_fill(~pool.valid[:, :n].any(-1), -float("inf"))


class ExactPages(PageSelector):
    """Pages ranked by their exact attention mass for the current query (an oracle)."""

    name = "exact"

    def __init__(self, config, layout: str = "positional"):
        super().__init__(config)
        self.layout = layout

    def build(self, keys, values, positions):
        if self.layout == "semantic":
            return PageIndex(keys, values, positions, self.config.index)
        size = 1 if self.layout == "token" else self.config.page_size
        return PositionalPages(keys, values, positions, size)

    def insert(self, struct, keys, values, positions):
        if self.layout == "semantic":
            return struct.insert(keys, values, positions)
        return struct.append(keys, values, positions)

    def select(self, struct, q, n_pages, layer, step):
        # n_pages pages' worth of slots; the caller keeps the best ones that fit the budget.
        slots = n_pages * self.config.page_size // struct.pool.k.shape[2]
        return top_ids(attention_mass(struct.pool, q), slots)


class PageWindow(PagedDecodePolicyMixin, Full):
    name = "page_window"
    window_only = True

    def make_selector(self) -> PageSelector:
        return PlainPages(self.decode)


class PageRandom(PagedDecodePolicyMixin, Full):
    name = "page_random"

    def make_selector(self) -> PageSelector:
        return PlainPages(self.decode)


class PageOracle(PagedDecodePolicyMixin, Full):
    name = "page_oracle"
    LAYOUTS = ("positional", "semantic", "token")

    def __init__(self, config, decode=None, variant: str = ""):
        layout = variant or "positional"
        if layout not in self.LAYOUTS:
            raise ValueError(f"page_oracle has variants: semantic, token (got '{variant}')")
        super().__init__(config, decode)
        self.layout = layout

    def make_selector(self) -> PageSelector:
        return ExactPages(self.decode, self.layout)

    def describe(self) -> dict:
        return {**super().describe(), "layout": self.layout}
