"""AttentionStore + H2O: load all keys, let each KV head keep its own top-k, load only the
values of chunks that hold a kept token (K and V chunks are stored apart, so this is
possible). Exact scores, so no probe copy is used; the price is reading every key. The keys
are scored where the layer computes (moved there as loaded); only the kept sets come back."""
from __future__ import annotations

import math

import numpy as np
import torch

from .base import LayerContext, LayerPlan, ServingPolicy, join_chunks, to_host, tokens_of_chunks


class AsH2O(ServingPolicy):
    def __init__(self, config, tier_policy: str):
        super().__init__(config)
        self.tier_policy = tier_policy
        self.name = f"as_h2o_{tier_policy}"

    def plan_layer(self, ctx: LayerContext) -> LayerPlan:
        n = ctx.n_prefix
        k = self.config.budget(n)
        device = ctx.device
        chunks_k = [seg.all_chunks() for seg in ctx.segments]
        keys = []
        for si, (seg, ids) in enumerate(zip(ctx.segments, chunks_k)):
            rows, logical = tokens_of_chunks(seg, ids)
            loaded = join_chunks(ctx.load("k", si, ids), device)
            loaded = loaded[:, torch.from_numpy(rows).to(device)]
            seg_keys = torch.empty(loaded.shape[0], seg.used, loaded.shape[2], device=device)
            seg_keys[:, torch.from_numpy(logical).to(device)] = loaded.float()
            keys.append(seg_keys)
        prefix_keys = torch.cat(keys, dim=1)                          # (KV, n, d)
        d = prefix_keys.shape[-1]
        g = ctx.group
        kv_keys = prefix_keys.repeat_interleave(g, dim=0)              # (H, n, d)
        s = ctx.q.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
        logits = torch.cat([ctx.q @ kv_keys.transpose(1, 2),
                            (ctx.q @ ctx.k_new.repeat_interleave(g, 0).transpose(1, 2))
                            .masked_fill(~causal, float("-inf"))], dim=-1) / math.sqrt(d)
        logits[..., : ctx.n_pad] = float("-inf")     # pad tokens: never heavy hitters
        probs = torch.softmax(logits, dim=-1)[..., :n].sum(dim=1)      # (H, n)
        per_kv = probs.view(-1, g, n).sum(dim=1)                       # (KV, n)
        keep = torch.zeros_like(per_kv, dtype=torch.bool)
        keep.scatter_(1, per_kv.topk(k, dim=1).indices, True)
        keep_np, summed = to_host(keep, per_kv.sum(0))
        attend = ctx.split(keep_np.T)
        attend = [a.T for a in attend]
        chunks_v = [np.unique(seg.logical_to_chunk()[a.any(axis=0)])
                    for seg, a in zip(ctx.segments, attend)]
        return LayerPlan(chunks_k, chunks_v, attend, scores=ctx.split(summed),
                         selected=ctx.split(keep_np.any(axis=0)))
