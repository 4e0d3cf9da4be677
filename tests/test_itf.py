"""ITF building blocks: agreement, thresholds, vote, chunk selection."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from policies import ServingConfig
from policies.base import Segment, resolve_probe_heads
from policies.itf import chunk_selection, mean_pairwise_jaccard, threshold, top_k_sets, vote


def test_jaccard_of_known_sets():
    a = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    # pairs: (0,1) = 1, (0,2) = 0, (1,2) = 0
    assert mean_pairwise_jaccard(a) == pytest.approx(1 / 3)
    b = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    assert mean_pairwise_jaccard(b) == pytest.approx(2 / 4)


def test_thresholds():
    assert threshold(ServingConfig(threshold="fixed", threshold_value=0.85), 25, 100) == 0.85
    t = threshold(ServingConfig(threshold="adaptive", adaptive_alpha=0.6), 25, 100)
    assert t == pytest.approx((0.25 / 1.75) ** 0.6)  # 0.311: the paper's ~0.3 at r = 25%
    assert threshold(ServingConfig(threshold="none"), 25, 100) == 0.0


def test_top_k_and_vote():
    scores = torch.tensor([[5.0, 4.0, 0.0, 1.0], [5.0, 0.0, 4.0, 1.0], [5.0, 4.1, 0.0, 0.0]])
    member = top_k_sets(scores, 2)
    assert member.sum(1).tolist() == [2, 2, 2]
    keep = vote(member, scores, 2)
    assert keep.tolist() == [True, True, False, False]  # token 0: 3 votes; token 1: 2 votes


class _Entry:
    def __init__(self, n, c, mapping=None):
        self.mapping = mapping
        self.physical_of = None if mapping is None else np.argsort(mapping)
        self.layout = type("L", (), {"n_tokens": n, "chunk_size": c, "n_chunks": n // c})


class _Ctx:
    def __init__(self, segments):
        self.segments = segments

    def split(self, values):
        bounds = np.cumsum([0] + [s.used for s in self.segments])
        return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def test_chunk_selection_keeps_sink_and_recent_and_budget():
    node = type("N", (), {"start": 0})()
    seg = Segment(node, 128, _Entry(128, 16))
    scores = np.zeros(128)
    scores[64:80] = 5.0   # chunk 4 is the important one
    chosen = chunk_selection(_Ctx([seg]), scores, budget=48)
    assert chosen[0].tolist() == [0, 4, 7]  # sink, top chunk, most recent


def test_chunk_selection_follows_a_reordered_layout():
    node = type("N", (), {"start": 0})()
    mapping = np.arange(64)[::-1].copy()   # physical p holds logical 63 - p
    seg = Segment(node, 64, _Entry(64, 16, mapping))
    scores = np.zeros(64)
    scores[20:24] = 1.0   # logical 20..23 sit in physical 40..43: chunk 2
    chosen = chunk_selection(_Ctx([seg]), scores, budget=48)
    assert 2 in chosen[0].tolist()
    assert 3 in chosen[0].tolist()   # physical chunk 3 holds logical 0..15: the sink
    assert 0 in chosen[0].tolist()   # physical chunk 0 holds logical 48..63: the most recent


def test_probe_head_specs():
    assert resolve_probe_heads("auto", 9, 3) == tuple(range(9))
    assert resolve_probe_heads("auto", 32, 32) == (0, 1, 2)
    assert resolve_probe_heads("group", 9, 3) == (0, 3, 6)
    assert resolve_probe_heads("first:2", 9, 3) == (0, 1)
    assert resolve_probe_heads("fraction:0.1", 32, 32) == (0, 1, 2, 3)
    r = resolve_probe_heads("random:3", 32, 32, seed=1)
    assert len(set(r)) == 3 and r == resolve_probe_heads("random:3", 32, 32, seed=1)
    assert resolve_probe_heads("1,5", 9, 3) == (1, 5)
    with pytest.raises(ValueError):
        resolve_probe_heads("12", 9, 3)
    with pytest.raises(ValueError):
        resolve_probe_heads("bogus", 9, 3)


@pytest.mark.parametrize("last", [0, 3, 8, 20])
def test_probe_scores_with_the_last_queries(last):
    """probe_queries=N: the last N new tokens score the prefix, each normalised over the
    prefix and the new tokens it sees (causal); 0 or N >= s means every query."""
    import types

    from policies import ServingConfig
    from policies.itf import probe_scores

    g = torch.Generator().manual_seed(3)
    P, s, n, d = 3, 8, 40, 16
    q, k, k_new = (torch.randn(P, s, d, generator=g), torch.randn(P, n, d, generator=g),
                   torch.randn(P, s, d, generator=g))
    from policies.base import ProbeKeys

    ctx = types.SimpleNamespace(probe=ProbeKeys(k.clone()), probe_kv_heads=(0, 1, 2),
                                probe_heads=(0, 1, 2), group=1, q=q, k_new=k_new, n_pad=2,
                                config=ServingConfig(probe_queries=last))
    want = torch.zeros(P, n)
    for p in range(P):
        for i in range(s - (last if 0 < last < s else s), s):
            logits = torch.cat([k[p] @ q[p, i], k_new[p, : i + 1] @ q[p, i]]) / d ** 0.5
            logits[:2] = float("-inf")       # pads
            want[p] += torch.softmax(logits, 0)[:n]
    assert torch.allclose(probe_scores(ctx), want, atol=1e-5)


def _reference_chunk_selection(ctx, token_scores, budget):
    """The selection rule written out plainly: forced chunks, then by score."""
    c = ctx.segments[0].entry.layout.chunk_size
    candidates, forced = [], set()
    for si, (seg, scores) in enumerate(zip(ctx.segments, ctx.split(token_scores))):
        chunk_of = seg.logical_to_chunk()
        for ch in np.unique(chunk_of):
            candidates.append((float(scores[chunk_of == ch].sum()), si, int(ch),
                               int((chunk_of == ch).sum())))
        if seg.start == 0:
            forced.add((si, int(chunk_of[0])))
    last = len(ctx.segments) - 1
    forced.update((last, int(ch)) for ch in ctx.segments[last].logical_to_chunk()[-c:])
    chosen = set(forced)
    taken = sum(n for _, si, ch, n in candidates if (si, ch) in chosen)
    for _, si, ch, n in sorted(candidates, key=lambda t: -t[0]):
        if taken >= budget:
            break
        if (si, ch) not in chosen:
            chosen.add((si, ch))
            taken += n
    return [sorted(ch for s, ch in chosen if s == si) for si in range(len(ctx.segments))]


@pytest.mark.parametrize("seed", range(6))
def test_chunk_selection_matches_the_plain_rule(seed):
    """Several segments (one partly used, some reordered), random scores and budgets."""
    rng = np.random.default_rng(seed)
    c, segments, start = 16, [], 0
    for n, used in ((128, 128), (64, 64), (96, int(rng.integers(20, 96)))):
        mapping = rng.permutation(n) if rng.random() < 0.5 else None
        segments.append(Segment(type("N", (), {"start": start})(), used, _Entry(n, c, mapping)))
        start += used
    ctx = _Ctx(segments)
    scores = rng.random(start).round(1)   # ties happen: their order must match too
    for budget in (1, 40, int(0.25 * start), start // 2, start):
        got = [ids.tolist() for ids in chunk_selection(ctx, scores, budget)]
        assert got == _reference_chunk_selection(ctx, scores, budget)


def _score_reference(q, keys_logical, k_new, heads, kv_of_head, n_pad, rows):
    """Per head, per probing query: softmax over (prefix, causal new), prefix part summed."""
    d = q.shape[-1]
    s = k_new.shape[1]
    out = torch.zeros(len(heads), keys_logical.shape[1])
    for p, h in enumerate(heads):
        j = kv_of_head[h]
        for i in rows:
            logits = torch.cat([keys_logical[j] @ q[h, i], k_new[j, : i + 1] @ q[h, i]]) / d ** 0.5
            logits[:n_pad] = float("-inf")
            out[p] += torch.softmax(logits, 0)[: keys_logical.shape[1]]
    return out


@pytest.mark.parametrize("heads", [(0, 1, 2, 3, 4, 5), (0, 1, 3), (4,)])
@pytest.mark.parametrize("stride", [1, 3])
def test_probe_scores_over_stored_order_match_logical_scoring(heads, stride):
    """Scores computed over keys in stored (physical) order, with unused columns, map back
    to exactly the scores of logically ordered keys; grouped heads of unequal counts."""
    import types

    from policies.base import ProbeKeys
    from policies.itf import probe_scores

    g = torch.Generator().manual_seed(5)
    H, KV, s, n_store, used, d = 6, 2, 7, 48, 40, 16
    q = torch.randn(H, s, d, generator=g)
    k_new = torch.randn(KV, s, d, generator=g)
    stored = torch.randn(KV, n_store, d, generator=g)          # physical order
    mapping = torch.randperm(n_store, generator=g).numpy()      # physical -> logical
    physical_of = np.argsort(mapping)
    probe = ProbeKeys(stored, physical_of[:used])               # logical -> column
    logical = stored[:, torch.from_numpy(physical_of[:used])]
    ctx = types.SimpleNamespace(probe=probe, probe_kv_heads=(0, 1),
                                probe_heads=heads, group=H // KV, q=q, k_new=k_new, n_pad=3,
                                config=ServingConfig(probe_stride=stride))
    rows = range((s - 1) % stride, s, stride)
    want = _score_reference(q, logical, k_new, heads, {h: h // 3 for h in range(H)}, 3, rows)
    assert torch.allclose(probe_scores(ctx), want, atol=1e-5)
    assert torch.equal(probe.logical(), logical)


def test_chunk_selection_when_every_chunk_is_forced():
    """A prefix of one chunk: it is the sink and the most recent; nothing else to rank."""
    node = type("N", (), {"start": 0})()
    seg = Segment(node, 16, _Entry(16, 16))
    assert [c.tolist() for c in chunk_selection(_Ctx([seg]), np.ones(16), budget=4)] == [[0]]
