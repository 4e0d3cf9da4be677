"""`quest`: decode over position-ordered pages ranked by per-page key bounds (Quest, Tang et
al. 2024), the query-aware paging baseline for icecache at the same budget and sink/window rule.

Each page of 16 consecutive tokens keeps, per KV head, the elementwise minimum and maximum of
its keys. For a query q, sum_d max(q_d min_d, q_d max_d) bounds q.k from above for every key in
the page; the pages with the largest bounds are attended. Query heads of a KV group vote with
their bound relative to their own best page (the pages are shared by the group). Prefill is the
`full` policy's.
"""
from __future__ import annotations

import math

import torch

from .decode_pages import PagedDecodePolicyMixin, PageSelector, PositionalPages
from .full import Full
from .page_index import top_ids


class BoundedPages(PositionalPages):
    """Positional pages plus each page's per-dimension key minimum and maximum."""

    def __init__(self, keys, values, positions, page_size):
        kv, _, d = keys.shape
        self.lo = torch.zeros(kv, 0, d)
        self.hi = torch.zeros(kv, 0, d)
        super().__init__(keys, values, positions, page_size)

    def append(self, keys, values, positions):
        changed = super().append(keys, values, positions)
        n = self.pool.n_pages
        first = self.lo.shape[1]
        k = self.pool.k[:, first:n].float()
        valid = self.pool.valid[:, first:n, :, None]
        self.lo = torch.cat([self.lo, k.masked_fill(~valid, math.inf).amin(2)], 1)
        self.hi = torch.cat([self.hi, k.masked_fill(~valid, -math.inf).amax(2)], 1)
        return changed


class QuestPages(PageSelector):
    name = "quest"

    def build(self, keys, values, positions) -> BoundedPages:
        return BoundedPages(keys, values, positions, self.config.page_size)

    def select(self, struct: BoundedPages, q, n_pages, layer, step):
        kv, n = struct.lo.shape[0], struct.pool.n_pages
        group = q.shape[0] // kv
        qf = q.detach().float().cpu().view(kv, group, 1, -1)
        bound = torch.maximum(qf * struct.lo[:, None, :n], qf * struct.hi[:, None, :n]).sum(-1)
        bound = bound.nan_to_num(nan=-math.inf)                # empty pages (inf * 0)
        rel = bound - bound.amax(-1, keepdim=True)
        return top_ids(rel.amax(1), n_pages)


class Quest(PagedDecodePolicyMixin, Full):
    name = "quest"

    def make_selector(self) -> PageSelector:
        return QuestPages(self.decode)
