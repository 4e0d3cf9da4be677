"""Requests at the edges: a one-token prompt (no prefix), streaming across a retry."""
from __future__ import annotations

from impress_flexgen.engine import Engine, Request, TierSizes, _Relay, open_store
from policies import ServingConfig, make_policy


def test_one_token_prompt_equals_plain_generation(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    ref = rt.generate([[123]], 4)
    cfg = ServingConfig(retention=0.25)
    policy = make_policy("impress", cfg)
    store = open_store(tmp_path / "s", rt, cfg, policy, chunk_size=16)
    try:
        seen = []
        resp = Engine(rt, store, policy, TierSizes()).serve(
            Request([], [123], 4, on_token=lambda t: seen.append(t) is None))
    finally:
        store.close()
    assert resp.tokens == ref.new_ids[0] == seen


def test_relay_passes_each_token_once_over_retries():
    got = []
    relay = _Relay(lambda t: got.append(t) is None)
    relay.restart()
    for t in (5, 6):                 # an attempt that failed after two tokens
        assert relay(t)
    relay.restart()
    for t in (5, 6, 7, 8):           # the retry produces them again, then more
        assert relay(t)
    assert got == [5, 6, 7, 8]
