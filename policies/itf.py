"""ITF, important-token identification: probe heads score the prefix before it is loaded.

1. Probe: the new tokens' queries of a few heads attend over the probe copy of the
   prefix keys; softmax column sums (H2O-style) score every prefix token per probe head.
2. Each probe head takes its top-k, k = ceil(r * n).
3. Agreement: mean pairwise Jaccard of those sets against a threshold, fixed (e.g. 0.85)
   or adaptive, t = j^alpha with j = (k/n) / (2 - k/n), the Jaccard of two random sets.
4. Pass: vote to one shared set for all heads. Fail: the layer loads the whole prefix.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .base import LayerContext, ServingConfig


def probe_scores(ctx: LayerContext) -> torch.Tensor:
    """(n_probe, n_prefix) softmax column sums of each probe head over the prefix."""
    keys = ctx.read_probe()                                   # (n_probe_kv, n, d)
    d = keys.shape[-1]
    kv_of = [ctx.probe_kv_heads.index(h // ctx.group) for h in ctx.probe_heads]
    k_prefix = keys[kv_of]                                    # (P, n, d)
    q = ctx.q[list(ctx.probe_heads)]                          # (P, s, d)
    k_new = ctx.k_new[[h // ctx.group for h in ctx.probe_heads]]
    s = k_new.shape[1]
    last = ctx.config.probe_queries
    if 0 < last < s:
        # Only the last queries probe: on CPU scoring costs as much as one full attention
        # product, and the end of a request is what the next tokens follow.
        q = q[:, -last:]
    q = q * (1.0 / math.sqrt(d))
    logits_prefix = q @ k_prefix.transpose(1, 2)              # (P, s', n)
    if ctx.n_pad:
        logits_prefix[..., : ctx.n_pad] = float("-inf")     # pad tokens: never important
    causal = torch.ones(q.shape[1], s, dtype=torch.bool).tril(diagonal=s - q.shape[1])
    logits_new = (q @ k_new.transpose(1, 2)).masked_fill_(~causal, float("-inf"))
    # The new tokens also attend to each other: normalise over everything they see. Done
    # in place on the prefix part (no concatenated copy): this runs on every layer.
    peak = torch.maximum(logits_prefix.amax(-1, keepdim=True), logits_new.amax(-1, keepdim=True))
    probs = logits_prefix.sub_(peak).exp_()
    total = probs.sum(-1, keepdim=True) + (logits_new - peak).exp().sum(-1, keepdim=True)
    return probs.div_(total).sum(dim=1)


def top_k_sets(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(P, n) scores -> (P, n) bool membership of each head's top-k."""
    idx = scores.topk(k, dim=1).indices
    member = torch.zeros_like(scores, dtype=torch.bool)
    member.scatter_(1, idx, True)
    return member


def mean_pairwise_jaccard(member: torch.Tensor) -> float:
    if member.shape[0] < 2:
        return 1.0
    m = member.float()
    inter = m @ m.T
    sizes = m.sum(1)
    union = sizes[:, None] + sizes[None, :] - inter
    pairs = torch.triu_indices(m.shape[0], m.shape[0], offset=1)
    jac = inter[pairs[0], pairs[1]] / union[pairs[0], pairs[1]].clamp(min=1)
    return float(jac.mean())


def threshold(config: ServingConfig, k: int, n: int) -> float:
    if config.threshold == "none":
        return 0.0
    if config.threshold == "fixed":
        return config.threshold_value
    frac = k / n
    return (frac / (2 - frac)) ** config.adaptive_alpha


def vote(member: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """One shared set: tokens ranked by how many heads chose them, ties by summed score."""
    votes = member.sum(0).double()
    summed = scores.sum(0).double()
    rank = votes * (summed.max() + 1) + summed  # lexicographic (votes, summed score)
    keep = torch.zeros(scores.shape[1], dtype=torch.bool)
    keep[rank.topk(k).indices] = True
    return keep


def chunk_selection(ctx: LayerContext, token_scores: np.ndarray, budget: int
                    ) -> list[np.ndarray]:
    """Whole chunks ranked by summed token scores, up to `budget` prefix tokens.

    The sink chunk (the prefix's first tokens) and the chunk(s) holding the most recent
    tokens are always kept. Returns per segment the chosen physical chunk ids.
    """
    c = ctx.segments[0].entry.layout.chunk_size
    candidates = []  # (score, segment, chunk, useful tokens)
    forced = set()
    per_segment = ctx.split(token_scores)
    for si, (seg, scores) in enumerate(zip(ctx.segments, per_segment)):
        chunk_of = seg.logical_to_chunk()
        sums = np.bincount(chunk_of, weights=scores, minlength=seg.entry.layout.n_chunks)
        counts = np.bincount(chunk_of, minlength=seg.entry.layout.n_chunks)
        for ch in np.flatnonzero(counts):
            candidates.append((float(sums[ch]), si, int(ch), int(counts[ch])))
        if seg.start == 0:
            forced.add((si, int(chunk_of[0])))
    last = len(ctx.segments) - 1
    recent = ctx.segments[last].logical_to_chunk()[-c:]
    forced.update((last, int(ch)) for ch in np.unique(recent))

    chosen, taken = set(), 0
    for si, ch in forced:
        chosen.add((si, ch))
    taken = sum(n for _, si, ch, n in candidates if (si, ch) in chosen)
    for score, si, ch, n in sorted(candidates, key=lambda t: -t[0]):
        if taken >= budget:
            break
        if (si, ch) not in chosen:
            chosen.add((si, ch))
            taken += n
    return [np.array(sorted(ch for s, ch in chosen if s == si), dtype=np.int64)
            for si in range(len(ctx.segments))]
