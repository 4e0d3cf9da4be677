"""Serving processes share prefix KV through a real redis-server: a prefix stored by one is
served bit-exact to another whose local store is empty; a pool that dies, or hands back a
damaged value, never fails a request nor changes its tokens."""
from __future__ import annotations

import pytest
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import redis
import torch

from impress_flexgen.engine import Request, assemble, open_store
from impress_flexgen.tiers import TierConfig
from impress_flexgen.tiers.remote import chunk_hashes, encode_value, layer_key, marker_key
from policies import ServingConfig, make_policy
from tests.helpers.fixtures import redis_server as server  # noqa: F401 - a fixture
from tests.redis_server import RedisServer, SlowProxy, require_redis_server

ROOT = Path(__file__).resolve().parents[1]
PREFIX = np.random.default_rng(11).integers(10, 40000, 136).tolist()   # 8 chunks of 16 + 8
QUERY = np.random.default_rng(12).integers(10, 40000, 6).tolist()

# One serving process: serve PREFIX + QUERY once with its own store and the shared pool,
# then dump its tokens, stats and the KV its local store now holds.
ROLE = textwrap.dedent("""
    import json, sys, torch
    from impress_flexgen.engine import Request, assemble, open_store
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig
    from impress_flexgen.tiers import TierConfig
    from policies import ServingConfig, make_policy
    store_dir, url, out, off = sys.argv[1:5]
    prefix, query = json.loads(sys.argv[5]), json.loads(sys.argv[6])
    rt = Runtime(RuntimeConfig(model="llama-tiny", offload_dir=off))
    cfg = ServingConfig(retention=1.0)
    policy = make_policy("full", cfg)
    store = open_store(store_dir, rt, cfg, policy, chunk_size=16)
    engine = assemble(rt, policy, store, TierConfig(0, 0, remote_url=url)).engine
    resp = engine.serve(Request(prefix, query, 4))
    engine.shared.tier.flush(10)
    match = store.match_prefix(prefix)
    reads = store.inspect().reads
    kv = [[torch.cat([reads.read_layer(n.layers[layer], n)[i][:, :u] for n, u in match.segments], 1)
           for i in (0, 1)] for layer in range(len(match.nodes[0].layers))]
    store.release(match)
    torch.save({"tokens": resp.tokens, "stats": resp.stats.as_dict(), "kv": kv}, out)
    engine.close(); store.close(); rt.close()
""")


def _serve_in_process(tmp_path, name, url):
    """One serving process of a pool whose servers share a secret (so that what it reads
    from the pool is stored locally too)."""
    out = tmp_path / f"{name}.pt"
    subprocess.run([sys.executable, "-c", ROLE, str(tmp_path / f"store-{name}"), url, str(out),
                    str(tmp_path / f"off-{name}"), json.dumps(PREFIX), json.dumps(QUERY)],
                   cwd=ROOT, check=True, timeout=300,
                   env={**os.environ, "IMPRESS_REMOTE_SECRET": "pool-secret"})
    return torch.load(out)


@pytest.mark.slow
def test_second_process_serves_the_prefix_from_the_pool_bit_exact(server, tmp_path):
    redis.Redis.from_url(server.url).flushdb()
    a = _serve_in_process(tmp_path, "a", server.url)
    b = _serve_in_process(tmp_path, "b", server.url)
    assert a["stats"]["shared_tokens"] == 0 and a["stats"]["matched_tokens"] == 0
    # B's local store was empty: the 128 whole-chunk tokens came from the pool.
    assert b["stats"]["shared_tokens"] == 128 and b["stats"]["matched_tokens"] == 0
    assert b["stats"]["computed_tokens"] == 8 + 6
    assert b["stats"]["bytes_read"]["remote"] > 0
    assert b["tokens"] == a["tokens"]
    assert len(a["kv"]) == len(b["kv"]) == 2
    for (ka, va), (kb, vb) in zip(a["kv"], b["kv"]):
        assert ka.shape[1] == kb.shape[1] == 128
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def _engine(rt, store_dir, url, secret=None, budget=True):
    cfg = ServingConfig(retention=1.0)
    policy = make_policy("full", cfg)
    store = open_store(store_dir, rt, cfg, policy, chunk_size=16)
    engine = assemble(rt, policy, store, TierConfig(0, 0, remote_url=url, remote_secret=secret)).engine
    if not budget:   # the pool always worth reading: these tests are about what it holds
        engine.shared.recompute_s = lambda n, ctx: 1e9
    return engine, store


def _reference(rt, prefix, query, n=3):
    return rt.generate([prefix + query], n).new_ids[0]


def test_pool_killed_mid_run_requests_keep_being_served(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    with RedisServer(require_redis_server()) as srv:
        engine, store = _engine(rt, tmp_path / "s", srv.url)
        engine.shared.tier.retry_after_s = 60.0
        try:
            prompts = [(np.random.default_rng(100 + i).integers(10, 40000, 80).tolist(),
                        np.random.default_rng(200 + i).integers(10, 40000, 5).tolist())
                       for i in range(4)]
            for i, (prefix, query) in enumerate(prompts):
                if i == 2:
                    srv.kill()
                resp = engine.serve(Request(prefix, query, 3))
                assert resp.tokens == _reference(rt, prefix, query), i
            assert engine.shared.tier.metrics()["down"] == 1
            # Stored locally all the same: the next request over a prefix hits the disk.
            again = engine.serve(Request(prompts[3][0], prompts[3][1], 3))
            assert again.stats.matched_tokens == 80 and again.tokens == _reference(rt, *prompts[3])
        finally:
            engine.close()
            store.close()


def test_corrupted_pool_value_is_detected_and_recomputed(tiny_runtimes, tmp_path, server):
    rt = tiny_runtimes["llama-tiny"]
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    prefix, query = PREFIX[:96], QUERY
    writer, wstore = _engine(rt, tmp_path / "w", server.url)
    try:
        writer.serve(Request(prefix, query, 3))
        assert writer.shared.tier.flush(10)
    finally:
        writer.close()
        wstore.close()
    keys = sorted(k for k in client.keys(b"ifkv:*") if not k.endswith(b":done"))
    assert keys
    victim = keys[len(keys) // 2]
    value = bytearray(client.get(victim))
    value[-5] ^= 0xFF
    client.set(victim, bytes(value))
    reader, rstore = _engine(rt, tmp_path / "r", server.url, budget=False)
    try:
        resp = reader.serve(Request(prefix, query, 3))
        assert resp.tokens == _reference(rt, prefix, query)
        assert reader.shared.tier.metrics()["corrupt_values"] >= 1, reader.shared.tier.metrics()
        assert reader.shared_fallbacks == 1
        # Served again with the chunks before the damaged one, the rest computed ...
        assert resp.stats.shared_tokens < 96
        assert resp.stats.computed_tokens == 96 - resp.stats.shared_tokens + 6
        # ... and published back: the pool holds the whole prefix again.
        assert reader.shared.tier.flush(10)
        hashes = chunk_hashes(reader.shared.namespace_for(""), prefix)
        assert reader.shared.tier.batch_exists_chunks(hashes) == 6
    finally:
        reader.close()
        rstore.close()


def _fill(rt, tmp_path, url, prefix, query, secret=None):
    writer, wstore = _engine(rt, tmp_path / "w", url, secret)
    try:
        writer.serve(Request(prefix, query, 3))
        assert writer.shared.tier.flush(10)
        return chunk_hashes(writer.shared.namespace_for(""), prefix)
    finally:
        writer.close()
        wstore.close()


def _local_kv(store, prefix):
    match = store.match_prefix(prefix)
    try:
        return [[torch.cat([store.inspect().reads.read_layer(n.layers[layer], n)[i][:, :u]
                            for n, u in match.segments], 1) for i in (0, 1)]
                for layer in range(len(match.nodes[0].layers))]
    finally:
        store.release(match)


def _read_back(rt, tmp_path, url, prefix, query, hashes, secret=None):
    """A reader on an empty store: tokens as computing, the pool whole again after, and its
    local copy the very KV a writer computed."""
    reader, rstore = _engine(rt, tmp_path / "r", url, secret, budget=False)
    try:
        resp = reader.serve(Request(prefix, query, 3))
        assert resp.tokens == _reference(rt, prefix, query)
        assert reader.shared.tier.flush(10)
        assert reader.shared.tier.batch_exists_chunks(hashes) == len(hashes)
        if secret is None and resp.stats.shared_tokens:
            # Unauthenticated KV served the request; none of it became local state.
            assert len(rstore.inspect().state.tree) == 0 and reader.prefix.shared_unstored == 1
            return resp, reader.shared.tier.metrics(), reader.shared_fallbacks
        # What came from the pool is the writer's bytes; what was computed again agrees
        # with them to rounding (another prefill's kernels); nothing else was kept.
        check, cstore = _engine(rt, tmp_path / "w", None)
        n = resp.stats.shared_tokens
        try:
            for mine, truth in zip(_local_kv(rstore, prefix), _local_kv(cstore, prefix)):
                for a, b in zip(mine, truth):
                    assert a.shape == b.shape and torch.equal(a[:, :n], b[:, :n])
                    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
        finally:
            check.close()
            cstore.close()
        return resp, reader.shared.tier.metrics(), reader.shared_fallbacks
    finally:
        reader.close()
        rstore.close()


def test_swapped_layers_are_recomputed_and_republished(tiny_runtimes, tmp_path, server):
    rt = tiny_runtimes["llama-tiny"]
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    prefix, query = PREFIX[:96], QUERY
    hashes = _fill(rt, tmp_path, server.url, prefix, query)
    a, b = layer_key(hashes[3], 0), layer_key(hashes[3], 1)
    va, vb = client.get(a), client.get(b)
    client.set(a, vb)
    client.set(b, va)
    resp, m, fallbacks = _read_back(rt, tmp_path, server.url, prefix, query, hashes)
    assert m["corrupt_values"] >= 1 and fallbacks == 1
    assert resp.stats.shared_tokens == 3 * 16      # the chunks before the swapped one


def test_forged_value_without_the_secret_is_refused(tiny_runtimes, tmp_path, server):
    rt = tiny_runtimes["llama-tiny"]
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    prefix, query = PREFIX[:96], QUERY
    hashes = _fill(rt, tmp_path, server.url, prefix, query, secret="pool-secret")
    # Someone able to write to Redis, without the secret: all-zero KV under the right key
    # and a correct header, tagged as well as one can without the secret.
    writer, wstore = _engine(rt, tmp_path / "x", server.url, secret="pool-secret")
    ns = writer.shared.namespace
    writer.close()
    wstore.close()
    zeros = torch.zeros(ns.value_shape, dtype=ns.torch_dtype)
    client.set(layer_key(hashes[0], 1), encode_value(zeros, ns, hashes[0], 1, b"a guess"))
    client.set(layer_key(hashes[2], 0), encode_value(zeros, ns, hashes[2], 0))
    resp, m, _ = _read_back(rt, tmp_path, server.url, prefix, query, hashes, "pool-secret")
    assert m["corrupt_values"] >= 1


@pytest.mark.slow
def test_a_pool_without_a_secret_is_used_but_never_becomes_local_state(tiny_runtimes,
                                                                       tmp_path, server):
    """Without a secret, anyone able to write to the pool can hand out KV with a valid CRC
    (here all zeros): the request that reads it uses it, but the reader's store keeps
    nothing of it, nor of what was computed over it; the next request computes afresh."""
    rt = tiny_runtimes["llama-tiny"]
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    prefix, query = PREFIX[:96], QUERY
    hashes = _fill(rt, tmp_path, server.url, prefix, query)
    writer, wstore = _engine(rt, tmp_path / "x", server.url)
    ns = writer.shared.namespace
    writer.close()
    wstore.close()
    zeros = torch.zeros(ns.value_shape, dtype=ns.torch_dtype)
    for h in hashes:
        for layer in range(ns.n_layers):
            client.set(layer_key(h, layer), encode_value(zeros, ns, h, layer))
    reader, rstore = _engine(rt, tmp_path / "r", server.url, budget=False)
    try:
        resp = reader.serve(Request(prefix, query, 3))
        assert resp.stats.shared_tokens == 96       # the forged values pass their CRC
        assert reader.shared.tier.flush(10)
        assert len(rstore.inspect().state.tree) == 0, "unauthenticated KV was stored locally"
        assert reader.prefix.shared_unstored == 1 and not reader.shared.keyed
    finally:
        reader.close()
        rstore.close()
    alone, astore = _engine(rt, tmp_path / "r", None)   # the same store, no pool
    try:
        again = alone.serve(Request(prefix, query, 3))
        assert again.stats.matched_tokens == 0
        assert again.tokens == _reference(rt, prefix, query)
    finally:
        alone.close()
        astore.close()


def test_evicted_layer_is_not_read_and_is_written_again(tiny_runtimes, tmp_path, server):
    rt = tiny_runtimes["llama-tiny"]
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    prefix, query = PREFIX[:96], QUERY
    hashes = _fill(rt, tmp_path, server.url, prefix, query)
    client.delete(layer_key(hashes[2], 1))           # as allkeys-lru would
    assert client.exists(marker_key(hashes[2]))
    resp, m, fallbacks = _read_back(rt, tmp_path, server.url, prefix, query, hashes)
    assert m["incomplete_chunks"] == 1 and fallbacks == 0
    assert resp.stats.shared_tokens == 2 * 16


@pytest.mark.slow
def test_slow_pool_is_skipped_by_the_budget(tiny_runtimes, tmp_path, server):
    rt = tiny_runtimes["llama-tiny"]
    redis.Redis.from_url(server.url).flushdb()
    prompts = [(np.random.default_rng(300 + i).integers(10, 40000, 512).tolist(),
                np.random.default_rng(400 + i).integers(10, 40000, 4).tolist()) for i in range(3)]
    writer, wstore = _engine(rt, tmp_path / "w", server.url)
    try:
        for prefix, query in prompts:
            writer.serve(Request(prefix, query, 1))
        assert writer.shared.tier.flush(20)
    finally:
        writer.close()
        wstore.close()
    proxy = SlowProxy(server.port, 0.4)
    reader, rstore = _engine(rt, tmp_path / "r", proxy.url)
    try:
        reader.shared.tier.timeout_s = 5.0
        # The cost model says 512 tokens compute in 50 ms; a layer's round trip takes 0.4 s.
        reader.shared.recompute_s = lambda n, ctx: n * 1e-4
        shared = []
        for prefix, query in prompts:
            resp = reader.serve(Request(prefix, query, 2))
            assert resp.tokens == _reference(rt, prefix, query, 2)
            shared.append(resp.stats.shared_tokens)
        m = reader.shared.tier.metrics()
        # The first request's first command opened the connection (not a measure); from
        # the second command on the pool is known slow and skipped.
        assert shared[1:] == [0, 0] and m["skipped_requests"] >= 2, (shared, m)
        assert m["down"] == 0
    finally:
        reader.close()
        rstore.close()
        proxy.close()
