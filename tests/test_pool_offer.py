"""A prefix stored before the pool held it (stored with no pool configured, or while it was
down) is published the first time a request loads it: off the request's path, exact KV
only, the very bytes the local store holds."""
from __future__ import annotations

import threading

import pytest
import redis
import torch

from impress_flexgen.engine import Request
from impress_flexgen.store.radix import PrefixMatch
from impress_flexgen.tiers import pool_offer
from impress_flexgen.tiers.pool import shared_pool
from impress_flexgen.tiers.remote import chunk_hashes
from tests.redis_server import RedisServer, require_redis_server
from tests.test_pool_integrity import _Store
from tests.test_shared_pool import PREFIX, QUERY, _engine, _local_kv, _reference


SECRET = "pool-secret"


@pytest.fixture(scope="module")
def server():
    with RedisServer(require_redis_server()) as srv:
        yield srv


def _store_without_pool(rt, path, prefix, query):
    engine, store = _engine(rt, path, None)
    try:
        engine.serve(Request(prefix, query, 3))
    finally:
        engine.close()
        store.close()


def test_prefix_stored_before_the_pool_is_published_on_first_use(tiny_runtimes, tmp_path,
                                                                 server):
    rt = tiny_runtimes["llama-tiny"]
    redis.Redis.from_url(server.url).flushdb()
    prefix, query = PREFIX[:96], QUERY
    _store_without_pool(rt, tmp_path / "w", prefix, query)
    # The same store, now with the pool: the request loads the whole prefix from disk.
    engine, store = _engine(rt, tmp_path / "w", server.url, SECRET)
    try:
        resp = engine.serve(Request(prefix, query, 3))
        assert resp.stats.matched_tokens == 96 and resp.tokens == _reference(rt, prefix, query)
        assert engine.shared.flush(10)
        hashes = chunk_hashes(engine.shared.namespace_for(""), prefix)
        assert engine.shared.tier.batch_exists_chunks(hashes) == 6
        written = engine.shared.tier.metrics()["chunks_written"]
        assert written == 6
        # Used again: the pool holds it, nothing is written twice.
        engine.serve(Request(prefix, query, 3))
        assert engine.shared.flush(10)
        assert engine.shared.tier.metrics()["chunks_written"] == written
    finally:
        engine.close()
        store.close()
    # A process with an empty store takes every chunk from the pool: the stored bytes (kept
    # locally: the pool's servers share a secret).
    reader, rstore = _engine(rt, tmp_path / "r", server.url, SECRET, budget=False)
    check, cstore = _engine(rt, tmp_path / "w", None)
    try:
        resp = reader.serve(Request(prefix, query, 3))
        assert resp.stats.shared_tokens == 96 and resp.stats.matched_tokens == 0
        assert resp.tokens == _reference(rt, prefix, query)
        assert reader.shared.flush(10)
        for mine, truth in zip(_local_kv(rstore, prefix), _local_kv(cstore, prefix)):
            for a, b in zip(mine, truth):
                assert torch.equal(a, b)
    finally:
        for e, s in ((reader, rstore), (check, cstore)):
            e.close()
            s.close()


def test_only_missing_chunks_are_published(tiny_runtimes, tmp_path, server):
    rt = tiny_runtimes["llama-tiny"]
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    prefix, query = PREFIX[:96], QUERY
    # The pool holds the first 2 chunks (another process wrote them); the store all 6.
    writer, wstore = _engine(rt, tmp_path / "x", server.url)
    try:
        writer.serve(Request(prefix[:32], query, 1))
        assert writer.shared.flush(10)
    finally:
        writer.close()
        wstore.close()
    _store_without_pool(rt, tmp_path / "w", prefix, query)
    engine, store = _engine(rt, tmp_path / "w", server.url)
    try:
        engine.serve(Request(prefix, query, 3))
        assert engine.shared.flush(10)
        assert engine.shared.tier.metrics()["chunks_written"] == 4
        hashes = chunk_hashes(engine.shared.namespace_for(""), prefix)
        assert engine.shared.tier.batch_exists_chunks(hashes) == 6
    finally:
        engine.close()
        store.close()


def test_publishing_a_stored_prefix_never_blocks_the_request(tiny_runtimes, tmp_path, server,
                                                             monkeypatch):
    rt = tiny_runtimes["llama-tiny"]
    redis.Redis.from_url(server.url).flushdb()
    prefix, query = PREFIX[:96], QUERY
    _store_without_pool(rt, tmp_path / "w", prefix, query)
    release = threading.Event()
    original = pool_offer.StoredOffers._publish_missing

    def stuck(self, *job):
        release.wait(30)
        return original(self, *job)

    monkeypatch.setattr(pool_offer.StoredOffers, "_publish_missing", stuck)
    engine, store = _engine(rt, tmp_path / "w", server.url)
    try:
        for _ in range(2):     # served while the offer waits; the second finds it known
            resp = engine.serve(Request(prefix, query, 3))
            assert resp.stats.matched_tokens == 96
        assert engine.shared.offers.counters["offers"] == 1
        release.set()
        assert engine.shared.flush(10)
        assert engine.shared.tier.metrics()["chunks_written"] == 6
    finally:
        release.set()
        engine.close()
        store.close()


class _NothingExact(_Store):
    """A store whose every prefix was computed over a selection: an exact-only match finds
    nothing. Records what it is asked."""

    def __init__(self):
        super().__init__("")
        self.asked = []

    def match_prefix(self, tokens, namespace="", exact_only=False):
        self.asked.append((len(tokens), namespace, exact_only))
        return PrefixMatch([])

    def release(self, match):
        pass


def test_only_exact_stored_kv_of_the_tenant_is_offered(server):
    redis.Redis.from_url(server.url).flushdb()
    store = _NothingExact()
    pool = shared_pool(server.url, store, torch.float16)
    try:
        prefix = list(range(700, 712))
        hashes = chunk_hashes(pool.namespace_for("t"), prefix)
        assert pool.offers.offer(prefix, hashes[:2], "t")
        assert not pool.offers.offer(prefix, hashes[:2], "t")     # known: not asked twice
        assert pool.flush(10)
        assert store.asked == [(8, "t", True)]
        assert pool.tier.metrics()["chunks_written"] == 0
    finally:
        pool.close()
