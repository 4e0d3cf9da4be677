"""The remote tier against a real redis-server: content keys, round trips, sharing between
processes' clients, corruption, outages, a full server, bad configuration."""
from __future__ import annotations

import dataclasses
import logging
import time

import pytest
import redis
import redis_server
import torch
from redis_server import RedisServer, require_redis_server

from impress_flexgen.errors import UserError
from impress_flexgen.tiers import Tier, payload_crc
from impress_flexgen.tiers.remote import (
    DIGEST_SIZE,
    RedisTier,
    RemoteNamespace,
    chunk_hashes,
    layer_key,
    marker_key,
)
from tests.helpers.fixtures import redis_server as server  # noqa: F401 - a fixture
from tests.helpers.kv import seeded_kv

NS = RemoteNamespace(model="llama-tiny", n_layers=3, n_kv_heads=2, head_dim=8,
                     dtype="float16", chunk_size=4)


def _value(seed: int, ns: RemoteNamespace = NS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ns.value_shape, generator=g).to(ns.torch_dtype)


def _kv(n_tokens: int, seed: int, ns: RemoteNamespace = NS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return seeded_kv(ns, n_tokens, seed, dtype=ns.torch_dtype)


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50000, (n,), generator=g).tolist()


@pytest.fixture
def tier(server):
    redis.Redis.from_url(server.url).flushdb()
    t = RedisTier(server.url, NS, timeout_s=1.0, retry_after_s=0.2)
    yield t
    t.close()


def test_missing_redis_server_fails_unless_skipping_is_asked(monkeypatch):
    monkeypatch.setattr(redis_server, "find_redis_server", lambda: None)
    monkeypatch.delenv("IMPRESS_SKIP_REDIS", raising=False)
    with pytest.raises(pytest.fail.Exception, match="IMPRESS_SKIP_REDIS=1"):
        redis_server.require_redis_server()
    monkeypatch.setenv("IMPRESS_SKIP_REDIS", "1")
    with pytest.raises(pytest.skip.Exception):
        redis_server.require_redis_server()


# ---- content keys (no server) ----------------------------------------------------------

def test_same_prefix_same_keys_and_partial_tail_has_none():
    toks = _tokens(1, 14)
    hs = chunk_hashes(NS, toks)
    assert len(hs) == 3 and all(isinstance(h, bytes) and len(h) == DIGEST_SIZE for h in hs)
    assert chunk_hashes(NS, list(toks)) == hs
    assert chunk_hashes(NS, torch.tensor(toks)) == hs
    # A longer prompt with the same prefix extends the chain, never changes it.
    assert chunk_hashes(NS, toks + _tokens(2, 6))[:3] == hs
    assert chunk_hashes(NS, toks[:3]) == []


def test_one_differing_token_changes_that_chunk_and_all_later():
    toks = _tokens(3, 16)
    other = list(toks)
    other[5] += 1  # inside chunk 1
    a, b = chunk_hashes(NS, toks), chunk_hashes(NS, other)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))


@pytest.mark.parametrize("field,value", [("model", "opt-tiny"), ("n_layers", 4),
                                         ("n_kv_heads", 4), ("head_dim", 16),
                                         ("dtype", "bfloat16"), ("chunk_size", 2)])
def test_namespace_fields_change_keys(field, value):
    toks = _tokens(4, 16)
    other = dataclasses.replace(NS, **{field: value})
    assert chunk_hashes(other, toks)[0] != chunk_hashes(NS, toks)[0]


def test_bad_namespace_and_bad_url_are_user_errors():
    with pytest.raises(UserError, match="dtype"):
        dataclasses.replace(NS, dtype="int8")
    with pytest.raises(UserError, match="chunk_size"):
        dataclasses.replace(NS, chunk_size=0)
    for url in ("localhost:6379", "http://127.0.0.1:6379/0", "redis://", "redis://h:99999/0",
                "redis://h:6379/zero", ""):
        with pytest.raises(UserError, match="remote tier"):
            RedisTier(url, NS)
    with pytest.raises(UserError, match="queue_chunks"):
        RedisTier("redis://127.0.0.1:6379/0", NS, queue_chunks=0)


# ---- round trips -----------------------------------------------------------------------

def test_put_wait_round_trip_is_bit_exact(tier):
    assert isinstance(tier, Tier)
    hs = chunk_hashes(NS, _tokens(5, 8))
    sent = {(h, layer): _value(10 * i + layer) for i, h in enumerate(hs)
            for layer in range(NS.n_layers)}
    for key, t in sent.items():
        assert tier.put(key, t, crc=payload_crc(t))
    keys = list(sent) + [(chunk_hashes(NS, _tokens(6, 4))[0], 0)]
    got = tier.wait(tier.submit_get(keys))
    assert got[-1] is None
    for (key, t), g in zip(sent.items(), got):
        assert g.dtype == t.dtype and torch.equal(g.view(torch.int16), t.view(torch.int16))
    m = tier.metrics()
    assert m["hits"] == len(sent) and m["misses"] == 1
    assert m["bytes_served"] == m["bytes_in"] == len(sent) * t.numel() * 2
    assert tier.contains(keys[0]) and not tier.contains(keys[-1])


def test_batch_exists_counts_the_leading_run(tier):
    hs = chunk_hashes(NS, _tokens(7, 16))
    for i in (0, 1, 3):
        tier.put((hs[i], 0), _value(i))
    assert tier.batch_exists([(h, 0) for h in hs]) == 2
    assert tier.batch_exists([(hs[2], 0), (hs[3], 0)]) == 0
    assert tier.batch_exists([]) == 0
    # put writes no completion marker: only publish says a chunk is whole.
    assert tier.batch_exists_chunks(hs) == 0


def test_publish_then_a_second_client_reads_it_bit_exact(tier, server):
    toks = _tokens(8, 18)  # 4 whole chunks and a partial tail
    hs = chunk_hashes(NS, toks)
    kv = _kv(3 * NS.chunk_size, 9)  # chunks 1..3, as computed after a 1-chunk hit
    want = [[torch.stack((k[:, j * 4:(j + 1) * 4], v[:, j * 4:(j + 1) * 4])) for k, v in kv]
            for j in range(3)]
    assert tier.publish(hs, 1, kv) == 3
    for k, v in kv:  # the caller reuses its buffers at once
        k.zero_()
        v.zero_()
    assert tier.flush(10.0)
    assert tier.metrics()["chunks_written"] == 3 and tier.metrics()["queued"] == 0

    other = RedisTier(server.url, NS, timeout_s=1.0)
    try:
        assert other.batch_exists_chunks(hs) == 0  # chunk 0 was never published
        assert other.batch_exists_chunks(hs[1:]) == 3
        assert other.batch_exists(hs[1:]) == 3  # bare hashes test markers too
        keys = [(hs[1 + j], layer) for j in range(3) for layer in range(NS.n_layers)]
        got = other.wait(other.submit_get(keys))
        for (j, layer), g in zip([(j, l) for j in range(3) for l in range(NS.n_layers)], got):
            assert torch.equal(g.view(torch.int16), want[j][layer].view(torch.int16))
        # Invalidating one layer breaks the chunk's completion marker.
        assert other.invalidate([(hs[2], 1)]) == 1
        assert other.batch_exists_chunks(hs[1:]) == 1
        assert other.invalidate([hs[1]]) == NS.n_layers
        assert other.batch_exists(hs[1:]) == 0
    finally:
        other.close()


def test_publish_rejects_wrong_shapes(tier):
    hs = chunk_hashes(NS, _tokens(10, 8))
    with pytest.raises(ValueError, match="whole number of chunks"):
        tier.publish(hs, 0, _kv(6, 1))
    with pytest.raises(ValueError, match="not all"):
        tier.publish(hs, 1, _kv(8, 1))
    with pytest.raises(ValueError, match="all 3 layers"):
        tier.publish(hs, 0, _kv(8, 1)[:2])
    with pytest.raises(ValueError, match="remote tier stores"):
        tier.put((hs[0], 0), torch.zeros(3, 3))


def test_corrupted_value_is_a_counted_miss_and_deleted(tier, server, caplog):
    hs = chunk_hashes(NS, _tokens(11, 8))
    kv = _kv(8, 12)
    assert tier.publish(hs, 0, kv) == 2 and tier.flush(10.0)
    raw = redis.Redis.from_url(server.url)
    rk = layer_key(hs[0], 2)
    value = bytearray(raw.get(rk))
    value[-3] ^= 0x40  # one payload bit
    raw.set(rk, bytes(value))
    raw.set(layer_key(hs[1], 0), b"not a chunk" * 10)
    with caplog.at_level(logging.WARNING, logger="impress_flexgen.tiers.remote"):
        got = tier.wait(tier.submit_get([(hs[0], 1), (hs[0], 2), (hs[1], 0)]))
    assert got[0] is not None and got[1] is None and got[2] is None
    assert tier.metrics()["corrupt_values"] == 2
    assert "checksum mismatch" in caplog.text and "bad magic" in caplog.text
    assert raw.exists(rk) == 0 and raw.exists(marker_key(hs[0])) == 0
    assert raw.exists(layer_key(hs[0], 1)) == 1


def test_full_queue_drops_without_blocking(server):
    """A hung server holds the writer; further chunks overflow a 2-chunk queue."""
    redis.Redis.from_url(server.url).flushdb()
    hs = chunk_hashes(NS, _tokens(13, 40))
    t = RedisTier(server.url, NS, timeout_s=1.0, retry_after_s=0.2, queue_chunks=2)
    try:
        server.pause()
        t.publish(hs, 0, _kv(4, 1))  # the writer takes it and waits on the socket
        queued = t.publish(hs, 1, _kv(5 * NS.chunk_size, 2))
        assert queued <= 2
        assert t.metrics()["dropped_writes"] >= 3
    finally:
        server.resume()
        t.close()


# ---- outages ---------------------------------------------------------------------------

def test_dead_server_answers_misses_then_recovers(caplog):
    timeout_s = 0.5
    with RedisServer(require_redis_server()) as srv:
        t = RedisTier(srv.url, NS, timeout_s=timeout_s, retry_after_s=0.2)
        try:
            hs = chunk_hashes(NS, _tokens(14, 8))
            assert t.put((hs[0], 0), _value(1))
            srv.kill()
            with caplog.at_level(logging.INFO, logger="impress_flexgen.tiers.remote"):
                start = time.monotonic()
                assert t.wait(t.submit_get([(hs[0], 0)])) == [None]
                assert time.monotonic() - start < timeout_s + 2.0  # bounded, not tight
                m = t.metrics()
                assert m["down"] == 1 and m["down_events"] == 1 and m["errors"] >= 1
                # While down: immediate answers, nothing raised, writes dropped and counted.
                assert t.batch_exists([(hs[0], 0)]) == 0 and not t.contains((hs[0], 0))
                assert t.publish(hs, 0, _kv(8, 3)) == 0
                assert not t.put((hs[1], 0), _value(2))
                assert t.invalidate([(hs[0], 0)]) == 0
                assert t.metrics()["dropped_writes"] >= 2
                assert t.flush(5.0)

                srv.start()  # same port, empty (no persistence)
                deadline = time.monotonic() + 10.0
                while not t.put((hs[0], 0), _value(1)) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert t.metrics()["down"] == 0
                assert t.metrics()["down_events"] == 1  # one warning per transition
                got = t.wait(t.submit_get([(hs[0], 0)]))
                assert torch.equal(got[0].view(torch.int16), _value(1).view(torch.int16))
                assert t.publish(hs, 0, _kv(8, 4)) == 2 and t.flush(10.0)
                assert t.batch_exists_chunks(hs) == 2
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                        and "is down" in r.getMessage()]
            assert len(warnings) == 1
            assert any("is back" in r.getMessage() for r in caplog.records)
        finally:
            t.close()


def test_hung_server_times_out_into_misses():
    timeout_s = 0.3
    with RedisServer(require_redis_server()) as srv:
        t = RedisTier(srv.url, NS, timeout_s=timeout_s, retry_after_s=60.0)
        try:
            hs = chunk_hashes(NS, _tokens(15, 4))
            assert t.put((hs[0], 0), _value(1))
            srv.pause()
            start = time.monotonic()
            assert t.wait(t.submit_get([(hs[0], 0)])) == [None]
            assert time.monotonic() - start < timeout_s + 2.0
            assert t.metrics()["down"] == 1
            # Down for retry_after_s: no call touches the hung server again.
            def no_network(*a, **k):
                raise AssertionError("the network was used while the tier is down")
            t._client.pipeline = t._client.mget = t._client.set = no_network
            assert t.batch_exists_chunks(hs) == 0 and not t.put((hs[0], 0), _value(1))
            assert t.wait(t.submit_get([(hs[0], 0)])) == [None]
            assert t.publish(hs, 0, _kv(4, 1)) == 0 and t.flush(5.0)
        finally:
            srv.resume()
            t.close()


def test_full_server_refuses_puts_without_going_down():
    ns = dataclasses.replace(NS, n_kv_heads=4, head_dim=64, chunk_size=64)  # 64 KiB a value
    with RedisServer(require_redis_server(), maxmemory="3mb") as srv:
        t = RedisTier(srv.url, ns, timeout_s=1.0)
        try:
            hs = chunk_hashes(ns, _tokens(16, 64 * 80))
            results = [t.put((h, 0), _value(i, ns)) for i, h in enumerate(hs)]
            assert results[0] and not results[-1]
            m = t.metrics()
            assert m["refused_puts"] == results.count(False) > 0
            assert m["down"] == 0 and m["down_events"] == 0
            # Write-through is refused the same way: counted, no marker, no exception.
            assert t.publish(hs, 70, _kv(64, 5, ns)) == 1 and t.flush(10.0)
            assert t.metrics()["refused_puts"] == m["refused_puts"] + 1
            assert t.batch_exists_chunks(hs[70:71]) == 0
            got = t.wait(t.submit_get([(hs[0], 0)]))
            assert torch.equal(got[0].view(torch.int16), _value(0, ns).view(torch.int16))
        finally:
            t.close()


def test_closed_tier_answers_misses(server):
    t = RedisTier(server.url, NS)
    t.close()
    hs = chunk_hashes(NS, _tokens(17, 4))
    assert t.wait(t.submit_get([(hs[0], 0)])) == [None]
    assert t.batch_exists_chunks(hs) == 0 and not t.put((hs[0], 0), _value(1))
    t.close()  # idempotent
