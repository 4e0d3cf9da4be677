"""The shared pool on a Redis Cluster of three masters on loopback: two processes share a
prefix through it bit for bit; a master killed mid-run costs misses, never wrong KV."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import redis
import torch

from impress_flexgen.engine import Request
from impress_flexgen.errors import UserError
from impress_flexgen.tiers.remote import RedisTier, RemoteNamespace, chunk_hashes, layer_key, \
    marker_key
from impress_flexgen.tiers.remote_codec import SLOT_GROUP_TOKENS
from impress_flexgen.tiers.remote_url import cluster_nodes, validate_url
from tests.redis_cluster import RedisCluster, find_redis_cli
from tests.redis_server import require_redis_server
from tests.test_shared_pool import _engine, _reference, _serve_in_process

NS = RemoteNamespace(model="llama-tiny", n_layers=3, n_kv_heads=2, head_dim=8,
                     dtype="float16", chunk_size=4)


@pytest.fixture(scope="module")
def cluster():
    require_redis_server()
    if find_redis_cli() is None:
        pytest.fail("redis-cli (shipped with redis-server) is needed for the cluster tests",
                    pytrace=False)
    with RedisCluster(3) as c:
        yield c


def test_cluster_urls_are_checked():
    validate_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
    nodes, user, password, tls = cluster_nodes("rediss+cluster://u:p%40w@a:1,b:2")
    assert nodes == [("a", 1), ("b", 2)] and (user, password, tls) == ("u", "p@w", True)
    for bad in ("redis+cluster://", "redis+cluster://a:1,b", "redis+cluster://a:1/3"):
        with pytest.raises(UserError):
            validate_url(bad)


def test_a_slot_group_of_chunks_is_read_with_one_mget_per_layer():
    # A layer's chunks of SLOT_GROUP_TOKENS consecutive tokens share one cluster slot (one
    # MGET, not one a chunk); their markers too (a chunk is checked with one EXISTS).
    from redis.crc import key_slot

    group = SLOT_GROUP_TOKENS // NS.chunk_size
    hs = chunk_hashes(NS, list(range(3 * SLOT_GROUP_TOKENS)))
    for layer in range(NS.n_layers):
        slots = [key_slot(layer_key(h, layer)) for h in hs]
        assert [len(set(slots[g:g + group])) for g in range(0, len(hs), group)] == [1, 1, 1]
        assert len(set(slots)) == 3
        assert {key_slot(marker_key(h)) for h in hs[:group]} == {slots[0]}
    # The same chunk hashes whatever follows a prefix.
    assert chunk_hashes(NS, list(range(SLOT_GROUP_TOKENS + 8)))[:group + 2] == hs[:group + 2]


@pytest.mark.slow
def test_chunk_keys_spread_over_the_masters_and_read_back_bit_exact(cluster):
    cluster.flush()
    ns = dataclasses.replace(NS, chunk_size=64)
    tier = RedisTier(cluster.url, ns, timeout_s=2.0)
    try:
        n = 8 * SLOT_GROUP_TOKENS        # eight slot groups of 16 chunks
        hs = chunk_hashes(ns, list(range(n)))
        g = torch.Generator().manual_seed(3)
        kv = [(torch.randn(2, n, 8, generator=g).half(), torch.randn(2, n, 8, generator=g).half())
              for _ in range(3)]
        assert tier.publish(hs, 0, kv) == len(hs) and tier.flush(30)
        assert tier.batch_exists_chunks(hs) == len(hs)
        for layer in range(3):
            got = tier.wait(tier.submit_get([(h, layer) for h in hs], whole=True))
            assert torch.equal(torch.cat([c[0] for c in got], 1), kv[layer][0])
            assert torch.equal(torch.cat([c[1] for c in got], 1), kv[layer][1])
        # Every master holds some chunks: the pool spans the cluster.
        sizes = [redis.Redis(port=p).dbsize() for p in cluster.ports]
        assert all(n > 0 for n in sizes), sizes
    finally:
        tier.close()


@pytest.mark.slow
def test_two_processes_share_a_prefix_through_the_cluster(cluster, tmp_path):
    cluster.flush()
    a = _serve_in_process(tmp_path, "a", cluster.url)
    b = _serve_in_process(tmp_path, "b", cluster.url)
    assert a["stats"]["shared_tokens"] == 0
    assert b["stats"]["shared_tokens"] == 128 and b["stats"]["matched_tokens"] == 0
    assert b["tokens"] == a["tokens"]
    for (ka, va), (kb, vb) in zip(a["kv"], b["kv"]):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.slow
def test_a_master_killed_mid_run_costs_misses_never_wrong_kv(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    prompts = [(np.random.default_rng(500 + i).integers(10, 40000, 96).tolist(),
                np.random.default_rng(600 + i).integers(10, 40000, 5).tolist()) for i in range(4)]
    with RedisCluster(3) as c:
        writer, wstore = _engine(rt, tmp_path / "w", c.url)
        try:
            for prefix, query in prompts:
                writer.serve(Request(prefix, query, 1))
            assert writer.shared.tier.flush(10)
        finally:
            writer.close()
            wstore.close()
        reader, rstore = _engine(rt, tmp_path / "r", c.url, budget=False)
        reader.shared.tier.retry_after_s = 0.0     # keep asking the broken cluster
        try:
            for i, (prefix, query) in enumerate(prompts):
                if i == 1:
                    c.kill(1)
                resp = reader.serve(Request(prefix, query, 3))
                assert resp.tokens == _reference(rt, prefix, query), i
                if i == 0:
                    assert resp.stats.shared_tokens == 96
            m = reader.shared.tier.metrics()
            assert m["errors"] >= 1 and m["corrupt_values"] == 0
        finally:
            reader.close()
            rstore.close()
