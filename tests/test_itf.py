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
    ctx = types.SimpleNamespace(read_probe=lambda: k.clone(), probe_kv_heads=(0, 1, 2),
                                probe_heads=(0, 1, 2), group=1, q=q, k_new=k_new, n_pad=2,
                                config=ServingConfig(probe_queries=last))
    want = torch.zeros(P, n)
    for p in range(P):
        for i in range(s - (last if 0 < last < s else s), s):
            logits = torch.cat([k[p] @ q[p, i], k_new[p, : i + 1] @ q[p, i]]) / d ** 0.5
            logits[:2] = float("-inf")       # pads
            want[p] += torch.softmax(logits, 0)[:n]
    assert torch.allclose(probe_scores(ctx), want, atol=1e-5)
