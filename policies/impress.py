"""IMPRESS: ITF before each layer's KV load, selective chunk loading, reorder, score tiers.

Ablation switches (the paper's Fig. 18): `itf` = ITF with LRU tiers; `itf_ro` = + background
importance reordering; `all` = + score-based tiers. Granularity `token` is the paper's
(the k voted tokens; every chunk holding one is read); `chunk` selects whole chunks.
"""
from __future__ import annotations

import numpy as np

from .base import LayerContext, LayerPlan, ServingConfig, ServingPolicy, to_host
from .itf import (chunk_selection, pairwise_jaccard, probe_scores, threshold, top_k_sets,
                  vote)

ABLATIONS = {"itf": ("lru", False), "itf_ro": ("lru", True), "all": ("score", True)}


class Impress(ServingPolicy):
    name = "impress"
    reads_probe = True
    # A recomputed front counts as kept: only the rest of the budget is loaded, so the
    # "both" plan reads less even when reordered chunks mix tokens from all over the prefix.
    keeps_front = True

    def __init__(self, config: ServingConfig = ServingConfig(), ablation: str = "all"):
        super().__init__(config)
        if ablation not in ABLATIONS:
            raise ValueError(f"ablation must be one of {', '.join(ABLATIONS)}")
        self.ablation = ablation
        self.tier_policy, self.reorder = ABLATIONS[ablation]
        self._probed = (-1, None)     # (layer, scores) of the request's last probed layer

    @property
    def prefetch_last_selection(self) -> bool:
        # Consecutive queries on a prefix select mostly the same chunks (more so once the
        # reorder has packed the hot ones): reading those ahead hides the load behind the
        # previous layer's compute, at the price of the few that are not chosen again.
        return self.config.prefetch

    @property
    def keeps_layer_state(self) -> bool:
        return self.config.probe_every > 1      # layers between probes reuse its scores

    def probes_layer(self, layer: int) -> bool:
        return layer % self.config.probe_every == 0

    def plan_layer(self, ctx: LayerContext) -> LayerPlan:
        cfg = self.config
        n = ctx.n_prefix
        k = cfg.budget(n)
        if self.probes_layer(ctx.layer):
            scores = probe_scores(ctx)                  # (P, n)
            self._probed = (ctx.layer, scores)
        else:
            # Neighbouring layers attend alike: reuse the last probed layer's scores (by
            # logical position; each layer maps them onto its own chunk layout).
            layer, scores = self._probed
            assert layer == ctx.layer - ctx.layer % cfg.probe_every and scores.shape[1] == n
        test = cfg.threshold != "none" or cfg.granularity == "token"
        member = top_k_sets(scores, k) if test else None
        front = min(ctx.front, n)
        # What this query selects of the whole prefix (recorded as its importance feedback,
        # whatever the plan), and what it loads: with a recomputed front, the front counts
        # as kept and the rest of the budget goes to the tokens after it. Voted before the
        # agreement test, so that one copy brings every result of the device to the host.
        keep = load = None
        if cfg.granularity == "token" and k < n:
            keep = vote(member, scores, k)
            if front and k > front and front < n:
                load = vote(member[:, front:], scores[:, front:], k - front)
        summed, jaccard, keep, load = to_host(
            scores.sum(0), pairwise_jaccard(member) if test else None, keep, load)
        jaccard = None if jaccard is None else float(jaccard)
        if k >= n or (jaccard is not None and jaccard < threshold(cfg, k, n)):
            plan = LayerPlan.everything(ctx.segments)
            plan.fallback, plan.jaccard = k < n, jaccard
            plan.scores, plan.selected = ctx.split(summed), ctx.split(np.ones(n, bool))
            return plan
        if cfg.granularity == "token":
            if front:
                after, load = load, np.zeros(n, dtype=bool)
                if after is not None:
                    load[front:] = after
            else:
                load = keep
            chunks = [np.unique(seg.logical_to_chunk()[sel])
                      for seg, sel in zip(ctx.segments, ctx.split(load))]
            n_kv = ctx.k_new.shape[0]
            attend = [np.broadcast_to(sel, (n_kv, len(sel))) for sel in ctx.split(load)]
            return LayerPlan(chunks, chunks, attend, jaccard=jaccard,
                             scores=ctx.split(summed), selected=ctx.split(keep))
        chosen = chunk_selection(ctx, summed, k)
        selected = [seg.in_chunks(ch) for seg, ch in zip(ctx.segments, chosen)]
        chunks = chosen if not front else chunk_selection(ctx, summed, k - front, front)
        return LayerPlan(chunks, chunks, [None] * len(chunks), jaccard=jaccard,
                         scores=ctx.split(summed), selected=selected)

    def describe(self) -> dict:
        c = self.config
        return {**super().describe(), "ablation": self.ablation, "retention": c.retention,
                "granularity": c.granularity, "threshold": c.threshold,
                "threshold_value": c.threshold_value if c.threshold == "fixed" else None,
                "adaptive_alpha": c.adaptive_alpha if c.threshold == "adaptive" else None}
