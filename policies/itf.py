"""ITF, important-token identification: probe heads score the prefix before it is loaded.

1. Probe: the new tokens' queries of a few heads attend over the probe copy of the
   prefix keys; softmax column sums (H2O-style) score every prefix token per probe head.
2. Each probe head takes its top-k, k = ceil(r * n).
3. Agreement: mean pairwise Jaccard of those sets against a threshold, fixed (e.g. 0.85)
   or adaptive, t = j^alpha with j = (k/n) / (2 - k/n), the Jaccard of two random sets.
4. Pass: vote to one shared set for all heads. Fail: the layer loads the whole prefix.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .base import LayerContext, ProbeKeys, ServingConfig


def probe_scores(ctx: LayerContext) -> torch.Tensor:
    """(n_probe, n_prefix) softmax column sums of each probe head over the prefix.

    Heads sharing a KV head are scored in one product against its keys, without copying
    the keys per head (on a CPU this product is the cost of probing); columns are scored
    in their stored order and the scores mapped to logical positions afterwards. Everything
    runs in float32 on the device of the queries (the probe keys were moved there when read).
    """
    probe = ctx.probe
    keys = probe.keys                                         # (n_probe_kv, columns, d)
    device = ctx.q.device
    d = keys.shape[-1]
    s = ctx.k_new.shape[1]
    # Which new tokens' queries probe (all by default). On a CPU scoring costs about one
    # full attention product, so fewer can be asked for: the last N (the end of a request
    # is what the next tokens follow) and/or every k-th of them.
    rows = _probe_rows(s, ctx.config.probe_queries, ctx.config.probe_stride)
    q = ctx.q if rows is None else ctx.q[:, rows]
    # Logits in base 2 (log2(e) folded into the query scale): exp2 is the same softmax
    # and costs half of exp on a CPU.
    q = q * (math.log2(math.e) / math.sqrt(d))
    column_mask = _column_mask(probe, ctx.n_pad)              # (columns,) additive, or None
    causal = _causal_mask(s, ctx.config.probe_queries, ctx.config.probe_stride,
                          device)                             # (s', s)

    # Probe heads by the probe KV head they read: one batch when every group is the same
    # size (the default), else one batch per group.
    by_kv: dict[int, list[int]] = {}
    for i, h in enumerate(ctx.probe_heads):
        by_kv.setdefault(ctx.probe_kv_heads.index(h // ctx.group), []).append(i)
    groups = list(by_kv.items())
    batches = [groups] if len({len(v) for _, v in groups}) == 1 else [[g] for g in groups]
    out = torch.empty(len(ctx.probe_heads), keys.shape[1], device=device)
    for batch in batches:
        kv = [j for j, _ in batch]
        at = [i for _, heads in batch for i in heads]             # rows of `out`, in order
        g, b, sq = len(batch[0][1]), len(batch), q.shape[1]
        qb = q[[ctx.probe_heads[i] for i in at]].reshape(b, g * sq, d)
        kb = keys if kv == list(range(keys.shape[0])) else keys[kv]
        kn = ctx.k_new[[ctx.probe_kv_heads[j] for j in kv]]
        logits = torch.bmm(qb, kb.transpose(1, 2))                       # (b, g*s', columns)
        if column_mask is not None:
            logits += column_mask
        logits_new = torch.bmm(qb, kn.transpose(1, 2)).view(b, g, sq, s).add_(causal)
        logits_new = logits_new.view(b, g * sq, s)
        # The new tokens also attend to each other: normalise over everything they see,
        # in place on the prefix part (this runs on every layer).
        peak = torch.maximum(logits.amax(-1, keepdim=True), logits_new.amax(-1, keepdim=True))
        probs = logits.sub_(peak).exp2_()
        total = probs.sum(-1) + logits_new.sub_(peak).exp2_().sum(-1)      # (b, g*s')
        # Column sums of the normalised rows: one (1, s') x (s', columns) product per head.
        weights = total.reciprocal_().view(b * g, 1, sq)
        out[at] = torch.bmm(weights, probs.view(b * g, sq, -1)).view(b * g, -1)
    if probe.column_of is not None:
        out = out[:, probe.columns()]
    return out


def _column_mask(probe: ProbeKeys, n_pad: int) -> torch.Tensor | None:
    """-inf on columns that are padding (never important) or hold no prefix token."""
    dead = probe.dead_columns()
    if not n_pad and dead is None:
        return None
    # Made on the host (a few kB) and moved in one copy.
    mask = torch.zeros(probe.keys.shape[1])
    if dead is not None:
        mask[torch.from_numpy(dead)] = float("-inf")
    if n_pad:
        pads = slice(0, n_pad) if probe.column_of is None else \
            torch.from_numpy(probe.column_of[:n_pad])
        mask[pads] = float("-inf")
    return mask.to(probe.keys.device)


def _probe_rows(s: int, last: int, stride: int) -> slice | None:
    """The new tokens (of s) whose queries probe: the last `last` (0: all), every
    `stride`-th of them counting back from the last token; None: all s."""
    first = s - last if 0 < last < s else 0
    if first == 0 and stride == 1:
        return None
    return slice(first + (s - 1 - first) % stride, s, stride)


@functools.lru_cache(maxsize=16)
def _causal_mask(s: int, last: int, stride: int, device: torch.device) -> torch.Tensor:
    """(probing queries, s) additive mask: each probing new token sees those before it."""
    rows = _probe_rows(s, last, stride) or slice(0, s)
    position = torch.arange(s, device=device)[rows]
    allowed = torch.arange(s, device=device)[None, :] <= position[:, None]
    return torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))


def top_k_sets(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(P, n) scores -> (P, n) bool membership of each head's top-k."""
    idx = scores.topk(k, dim=1).indices
    member = torch.zeros_like(scores, dtype=torch.bool)
    member.scatter_(1, idx, True)
    return member


def pairwise_jaccard(member: torch.Tensor) -> torch.Tensor:
    """Mean pairwise Jaccard of the heads' sets, a 0-dim tensor on their device."""
    if member.shape[0] < 2:
        return torch.ones((), device=member.device)
    m = member.float()
    inter = m @ m.T
    sizes = m.sum(1)
    union = sizes[:, None] + sizes[None, :] - inter
    pairs = torch.triu_indices(m.shape[0], m.shape[0], offset=1, device=member.device)
    jac = inter[pairs[0], pairs[1]] / union[pairs[0], pairs[1]].clamp(min=1)
    return jac.mean()


def mean_pairwise_jaccard(member: torch.Tensor) -> float:
    return float(pairwise_jaccard(member))


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
    keep = torch.zeros(scores.shape[1], dtype=torch.bool, device=scores.device)
    keep[rank.topk(k).indices] = True
    return keep


def chunk_selection(ctx: LayerContext, token_scores: np.ndarray, budget: int, front: int = 0
                    ) -> list[np.ndarray]:
    """Whole chunks ranked by summed token scores, up to `budget` prefix tokens.

    The sink chunk (the prefix's first tokens) and the chunk(s) holding the most recent
    tokens are always kept. `front`: the prefix tokens before it are recomputed, not loaded:
    chunks are ranked and counted by their tokens from `front` on only, and a chunk holding
    none of those is never chosen (the sink is then in the front). Returns per segment the
    chosen physical chunk ids.
    """
    c = ctx.segments[0].entry.layout.chunk_size
    scores, counts, owner, chunk, forced = [], [], [], [], []
    last = len(ctx.segments) - 1
    for si, (seg, seg_scores) in enumerate(zip(ctx.segments, ctx.split(token_scores))):
        first = min(seg.used, max(0, front - seg.start))
        chunk_of = seg.logical_to_chunk()[first:]
        n_chunks = seg.entry.layout.n_chunks
        held = np.bincount(chunk_of, minlength=n_chunks)
        ids = np.flatnonzero(held)
        must = np.zeros(n_chunks, dtype=bool)
        if seg.start == 0 and first == 0:
            must[chunk_of[0]] = True
        if si == last and len(chunk_of):
            must[chunk_of[-c:]] = True
        scores.append(np.bincount(chunk_of, weights=seg_scores[first:], minlength=n_chunks)[ids])
        counts.append(held[ids])
        owner.append(np.full(len(ids), si))
        chunk.append(ids)
        forced.append(must[ids])
    scores, counts = np.concatenate(scores), np.concatenate(counts)
    owner, chunk, forced = np.concatenate(owner), np.concatenate(chunk), np.concatenate(forced)
    # Forced chunks first, then the rest by score (ties: segment, then chunk order); a chunk
    # is taken while the tokens taken before it are still under budget.
    rest = np.flatnonzero(~forced)
    rest = rest[np.argsort(-scores[rest], kind="stable")]
    before = int(counts[forced].sum()) + np.cumsum(counts[rest]) - counts[rest]
    take = forced.copy()
    take[rest[before < budget]] = True
    return [np.sort(chunk[take & (owner == si)]) for si in range(len(ctx.segments))]
