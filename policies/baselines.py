"""Selection baselines at the same budget: `random` chunks and `sink_recent` (the first
chunk and the most recent chunks). They read no probe keys; they show what a selection
without importance keeps."""
from __future__ import annotations

import numpy as np

from .base import LayerContext, LayerPlan, ServingPolicy
from .itf import chunk_selection


class RandomChunks(ServingPolicy):
    name = "random"

    def plan_layer(self, ctx: LayerContext) -> LayerPlan:
        rng = np.random.default_rng([self.config.seed, ctx.layer, ctx.n_prefix])
        chunks = chunk_selection(ctx, rng.random(ctx.n_prefix), self.config.budget(ctx.n_prefix))
        return LayerPlan(chunks, chunks, [None] * len(chunks))


class SinkRecent(ServingPolicy):
    name = "sink_recent"

    def plan_layer(self, ctx: LayerContext) -> LayerPlan:
        # Later tokens score higher, so chunks are taken from the most recent backwards.
        recency = np.arange(ctx.n_prefix, dtype=np.float64)
        chunks = chunk_selection(ctx, recency, self.config.budget(ctx.n_prefix))
        return LayerPlan(chunks, chunks, [None] * len(chunks))
