"""The pool's values prove what they claim; chunks are held only whole; half-written chunks
expire; keys separate models, tenants and approximate KV; passwords never reach a log."""
from __future__ import annotations

import functools
import logging
import struct
import zlib

import pytest
import redis
import torch

from impress_flexgen.errors import UserError
from impress_flexgen.tiers.pool import shared_pool
from impress_flexgen.tiers.remote import (
    ORPHAN_TTL_S,
    RedisTier,
    RemoteNamespace,
    chunk_hashes,
    decode_value,
    encode_value,
    layer_key,
    marker_key,
    redact_url,
    validate_url,
)
from tests.helpers.fixtures import redis_server as server  # noqa: F401 - a fixture
from tests.helpers.kv import seeded_kv
from tests.redis_server import free_port

NS = RemoteNamespace(model="llama-tiny", n_layers=3, n_kv_heads=2, head_dim=8,
                     dtype="float16", chunk_size=4)


_kv = functools.partial(seeded_kv, NS)     # _kv(n_tokens, seed)


@pytest.fixture
def raw(server):
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    return client


def _published(url, secret=None, ttl_s=None, n_tokens=12, seed=1):
    tier = RedisTier(url, NS, timeout_s=2.0, secret=secret, ttl_s=ttl_s)
    hs = chunk_hashes(tier.namespace, list(range(100, 100 + n_tokens)))
    assert tier.publish(hs, 0, _kv(n_tokens, seed)) == len(hs) and tier.flush(10)
    return tier, hs


def _old_format(payload: torch.Tensor) -> bytes:
    """A value as a writer that checks the payload alone would make it (CRC of the payload)."""
    body = payload.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    header = struct.pack("<4sBBH4I", b"IFKV", 2, 1, 0, *NS.value_shape)
    return header + struct.pack("<I", zlib.crc32(body)).ljust(32, b"\0") + body


def test_swapped_layers_are_refused_counted_and_unmarked(server, raw):
    tier, hs = _published(server.url)
    try:
        a, b = layer_key(hs[1], 0), layer_key(hs[1], 2)
        va, vb = raw.get(a), raw.get(b)
        raw.set(a, vb)
        raw.set(b, va)
        got = tier.wait(tier.submit_get([(hs[1], i) for i in range(3)], whole=True))
        assert got[0] is None and got[2] is None and got[1] is not None
        m = tier.metrics()
        assert m["corrupt_values"] == 2 and m["incomplete_chunks"] == 1
        assert not raw.exists(marker_key(hs[1]))
        assert tier.batch_exists_chunks(hs) == 1
    finally:
        tier.close()


def test_value_moved_to_another_chunk_is_refused(server, raw):
    tier, hs = _published(server.url)
    try:
        raw.set(layer_key(hs[2], 1), raw.get(layer_key(hs[0], 1)))
        assert tier.wait(tier.submit_get([(hs[2], 1)])) == [None]
        assert tier.metrics()["corrupt_values"] == 1
    finally:
        tier.close()


def test_all_zero_kv_with_a_payload_checksum_is_refused(server, raw):
    tier, hs = _published(server.url)
    try:
        raw.set(layer_key(hs[0], 0), _old_format(torch.zeros(NS.value_shape).half()))
        assert tier.wait(tier.submit_get([(hs[0], 0)])) == [None]
        assert tier.metrics()["corrupt_values"] == 1
    finally:
        tier.close()


def test_with_a_secret_a_forged_value_is_refused(server, raw):
    tier, hs = _published(server.url, secret="s3cret")
    try:
        assert tier.namespace.keyed
        zeros = torch.zeros(NS.value_shape).half()
        # Right key, right header, a correct tag for everything but the secret.
        raw.set(layer_key(hs[0], 0), encode_value(zeros, tier.namespace, hs[0], 0))
        raw.set(layer_key(hs[0], 1), encode_value(zeros, tier.namespace, hs[0], 1, b"guess"))
        got = tier.wait(tier.submit_get([(hs[0], 0), (hs[0], 1), (hs[0], 2)]))
        assert got[0] is None and got[1] is None and got[2] is not None
        assert tier.metrics()["corrupt_values"] == 2
    finally:
        tier.close()


def test_keyed_and_plain_pools_use_different_keys(server, raw):
    keyed, hs = _published(server.url, secret=b"k")
    try:
        plain = RedisTier(server.url, NS, timeout_s=2.0)
        try:
            mine = chunk_hashes(plain.namespace, list(range(100, 112)))
            assert not set(mine) & set(hs) and plain.batch_exists_chunks(mine) == 0
            t = torch.randn(NS.value_shape).half()
            value = encode_value(t, keyed.namespace, hs[0], 0, b"k")
            assert torch.equal(decode_value(value, keyed.namespace, hs[0], 0, b"k"), t)
            assert isinstance(decode_value(value, keyed.namespace, hs[0], 0, None), str)
        finally:
            plain.close()
    finally:
        keyed.close()


def test_a_chunk_missing_a_layer_is_not_held_and_its_marker_goes(server, raw):
    tier, hs = _published(server.url)
    try:
        raw.delete(layer_key(hs[1], 2))          # evicted
        assert raw.exists(marker_key(hs[1]))
        assert tier.batch_exists_chunks(hs) == 1
        assert not raw.exists(marker_key(hs[1])) and tier.metrics()["incomplete_chunks"] == 1
        # Written again whole, it is held again.
        tier.publish(hs, 1, [(k[:, 4:8], v[:, 4:8]) for k, v in _kv(12, 1)])
        assert tier.flush(10) and tier.batch_exists_chunks(hs) == 3
    finally:
        tier.close()


def test_a_chunk_being_written_keeps_the_marker_its_writer_sets(server, raw, monkeypatch):
    # Every layer there but no marker yet: a writer between its two round trips, not a
    # broken chunk. Should the writer set the marker right after the check, it stays.
    tier, hs = _published(server.url)
    try:
        raw.delete(marker_key(hs[1]))
        timed = tier._timed

        def writer_finishes_right_after_the_check(*args):
            raw.set(marker_key(hs[1]), b"1")
            return timed(*args)

        monkeypatch.setattr(tier, "_timed", writer_finishes_right_after_the_check)
        assert tier.batch_exists_chunks(hs) == 1
        assert raw.exists(marker_key(hs[1])) and tier.metrics()["incomplete_chunks"] == 0
        assert tier.batch_exists_chunks(hs) == 3
    finally:
        tier.close()


def test_layers_expire_until_their_chunk_is_complete(server, raw, monkeypatch):
    tier = RedisTier(server.url, NS, timeout_s=2.0)
    try:
        hs = chunk_hashes(tier.namespace, list(range(8)))
        real = tier._single.pipeline
        calls = []

        def pipeline(*a, **k):
            calls.append(1)
            if len(calls) == 2:   # the writer dies before completing the chunk
                raise redis.exceptions.ConnectionError("gone")
            return real(*a, **k)

        monkeypatch.setattr(tier._single, "pipeline", pipeline)
        tier.publish(hs, 0, [(k[:, :4], v[:, :4]) for k, v in _kv(8, 2)])
        assert tier.flush(10)
        assert not raw.exists(marker_key(hs[0]))
        ttls = [raw.ttl(layer_key(hs[0], i)) for i in range(3)]
        assert all(0 < t <= ORPHAN_TTL_S for t in ttls), ttls
    finally:
        tier.close()
    # A completed chunk's layers last (no --remote-ttl) ...
    tier, hs = _published(server.url, seed=3)
    try:
        assert raw.ttl(layer_key(hs[0], 0)) == -1 and raw.ttl(marker_key(hs[0])) == -1
    finally:
        tier.close()
    # ... or all expire with it (--remote-ttl).
    tier, hs = _published(server.url, ttl_s=50, seed=4)
    try:
        assert 0 < raw.ttl(layer_key(hs[0], 0)) <= 50 and 0 < raw.ttl(marker_key(hs[0])) <= 50
    finally:
        tier.close()


def test_namespace_separates_fingerprint_tenant_and_approximate_kv():
    tokens = list(range(16))
    base = chunk_hashes(NS, tokens)
    for change in ({"fingerprint": "sha256:abc"}, {"tenant": "acme"}, {"exact": False},
                   {"keyed": True}):
        import dataclasses
        assert not set(chunk_hashes(dataclasses.replace(NS, **change), tokens)) & set(base)


class _Shape:
    name, n_layers, n_kv_heads, head_dim = "llama-tiny", 3, 2, 8

    def __init__(self, fingerprint):
        self.fingerprint = fingerprint


class _Store:
    def __init__(self, fingerprint):
        self.shape = _Shape(fingerprint)
        self.config = type("C", (), {"chunk_size": 4})()


def test_pool_reads_model_fingerprint_and_keeps_tenants_apart(server, raw):
    a = shared_pool(server.url, _Store("w1"), torch.float16)
    b = shared_pool(server.url, _Store("w2"), torch.float16)
    try:
        assert a.tier.namespace.fingerprint == "w1" and a.namespace_for("t").exact
        prefix = list(range(500, 512))

        class Stats:
            shared_tokens = 0

        assert a.publish(prefix, 0, _kv(12, 5), tenant="t1") == 3 and a.tier.flush(10)
        assert a.open(prefix, 0, Stats(), tenant="t1").n_tokens == 12
        assert a.open(prefix, 0, Stats(), tenant="t2") is None
        assert a.open(prefix, 0, Stats()) is None
        assert b.open(prefix, 0, Stats(), tenant="t1") is None   # another checkpoint
    finally:
        a.tier.close()
        b.tier.close()


def test_secret_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("IMPRESS_REMOTE_SECRET", "from-env")
    pool = shared_pool(server.url, _Store(""), torch.float16)
    try:
        assert pool.tier.secret == b"from-env" and pool.namespace.keyed
    finally:
        pool.tier.close()


def test_password_never_reaches_a_log_or_an_error(caplog):
    assert redact_url("redis://:pw1@h:1/0?password=pw2") == "redis://:***@h:1/0?password=***"
    assert redact_url("redis://h:1/0?db=0&password=pw2") == "redis://h:1/0?db=0&password=***"
    assert redact_url("redis+cluster://u:pw1@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redact_url("rediss://token@h:1") == "rediss://***@h:1"
    with pytest.raises(UserError) as err:
        validate_url("redis://:pw1@h:notaport/0")
    assert "pw1" not in str(err.value)
    for url in (f"redis://:pw1@127.0.0.1:{free_port()}/0",
                f"redis://127.0.0.1:{free_port()}/0?password=pw2"):
        tier = RedisTier(url, NS, timeout_s=0.2, retry_after_s=0.0)
        try:
            with caplog.at_level(logging.INFO, logger="impress_flexgen.tiers.remote"):
                assert tier.batch_exists_chunks(chunk_hashes(NS, list(range(4)))) == 0
            assert "down" in caplog.text
            assert "pw1" not in caplog.text and "pw2" not in caplog.text
        finally:
            tier.close()
