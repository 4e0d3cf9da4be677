"""Requests at the edges: a one-token prompt (no prefix), streaming across a retry."""
from __future__ import annotations

from impress_flexgen.engine import Request, assemble, open_store
from impress_flexgen.engine.sequence import Relay
from impress_flexgen.tiers import TierConfig
from policies import ServingConfig, make_policy


def test_one_token_prompt_equals_plain_generation(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    ref = rt.generate([[123]], 4)
    cfg = ServingConfig(retention=0.25)
    policy = make_policy("impress", cfg)
    store = open_store(tmp_path / "s", rt, cfg, policy, chunk_size=16)
    try:
        seen = []
        resp = assemble(rt, policy, store, TierConfig()).engine.serve(
            Request([], [123], 4, on_token=lambda t: seen.append(t) is None))
    finally:
        store.close()
    assert resp.tokens == ref.new_ids[0] == seen


def test_relay_passes_each_token_once_over_retries():
    got = []
    relay = Relay(lambda t: got.append(t) is None)
    relay.restart()
    for t in (5, 6):                 # an attempt that failed after two tokens
        assert relay(t)
    relay.restart()
    for t in (5, 6, 7, 8):           # the retry produces them again, then more
        assert relay(t)
    assert got == [5, 6, 7, 8]


def test_a_corrupted_tier_copy_is_never_served(tiny_runtimes, tmp_path):
    """With --verify-tier-hits a damaged copy in a tier is dropped and the chunk is read
    from disk again: the answer is the one of a clean store."""
    import numpy as np
    import torch

    rt = tiny_runtimes["llama-tiny"]
    prefix = np.random.default_rng(3).integers(10, 40000, 64).tolist()
    query = [11, 12, 13]
    cfg = ServingConfig(retention=1.0)
    policy = make_policy("full", cfg)
    store = open_store(tmp_path / "s", rt, cfg, policy, chunk_size=16)
    try:
        engine = assemble(rt, policy, store, TierConfig(0, 1 << 20, verify_hits=True)).engine
        engine.serve(Request(prefix, query, 3))
        clean = engine.serve(Request(prefix, query, 3, keep_logits=True))  # disk, now tier
        cache = store.tiers.cache
        keys = sorted(cache.resident_keys("cpu"))
        assert keys
        cache.tiers[cache.tier_names.index("cpu")].chunks[keys[0]].tensor.view(torch.uint8).view(-1)[5] ^= 0x40
        again = engine.serve(Request(prefix, query, 3, keep_logits=True))
        assert cache.metrics["corrupt_copies"] == 1
        assert again.tokens == clean.tokens
        assert torch.equal(again.step_logits[0], clean.step_logits[0])
    finally:
        store.close()
