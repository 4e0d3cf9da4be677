"""The pool's flags reach it, and what it refused, lost or skipped shows in /metrics."""
from __future__ import annotations

import pytest
import redis

from impress_flexgen.entrypoints.openai import server as serve
from impress_flexgen.entrypoints.openai.server import background_server
from impress_flexgen.service import Service, ServiceConfig
from impress_flexgen.tiers.remote import chunk_hashes, layer_key
from tests.redis_server import RedisServer, require_redis_server
from tests.test_service_config import MODEL, _ids, _metric, _metrics, private_cost_cache, runtime

__all__ = ["private_cost_cache", "runtime"]   # fixtures


@pytest.fixture(scope="module")
def pool():
    with RedisServer(require_redis_server()) as srv:
        yield srv


def _service(runtime, root, url, *flags):
    args = serve.parse_args(["--model", MODEL, "--plan", "load", "--remote-tier", url,
                             "--store-dir", str(root), *flags])
    return Service(ServiceConfig.from_args(args), runtime=runtime)


@pytest.mark.parametrize("flags, message", [
    (["--remote-ttl", "0"], "--remote-ttl must be positive"),
    (["--remote-ttl", "soon"], "invalid int value: 'soon'"),
    (["--remote-tier", "redis+cluster://a:1,b"], "must be HOST:PORT"),
])
def test_bad_pool_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(flags)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_pool_events_in_metrics_and_flags_reach_the_pool(runtime, tmp_path, pool):
    redis.Redis.from_url(pool.url).flushdb()
    swapped, evicted = _ids(21, 96), _ids(22, 96)
    flags = ("--remote-secret", "s", "--remote-ttl", "600")
    with _service(runtime, tmp_path / "a", pool.url, *flags) as writer:
        assert writer.engine.shared.tier.secret == b"s"
        assert writer.engine.shared.tier.ttl_s == 600
        for prefix in (swapped, evicted):
            writer.complete(writer.frontend.build(prompt_ids=prefix + [7], max_tokens=1))
        assert writer.engine.shared.tier.flush(10)
        ns = writer.engine.shared.namespace_for("")
        hs, he = chunk_hashes(ns, swapped), chunk_hashes(ns, evicted)
    client = redis.Redis.from_url(pool.url)
    a, b = layer_key(hs[2], 0), layer_key(hs[2], 1)
    va, vb = client.get(a), client.get(b)
    client.set(a, vb)
    client.set(b, va)
    client.delete(layer_key(he[4], 1))
    with _service(runtime, tmp_path / "b", pool.url, *flags) as reader, \
            background_server(reader) as url:
        reader.engine.shared.recompute_s = lambda n, ctx: 1e9   # no budget skips here
        for prefix, seed in ((swapped, 23), (evicted, 24)):
            got = reader.complete(reader.frontend.build(prompt_ids=prefix + _ids(seed, 5),
                                                        max_tokens=1))
            assert 0 < got.stats["shared_tokens"] < 96
        m = _metrics(url)
    assert _metric(m, "shared_pool_events_total", event="corrupt_values") == 2
    assert _metric(m, "shared_pool_events_total", event="incomplete_chunks") == 2
    assert _metric(m, "shared_pool_events_total", event="skipped_requests") == 0
    assert _metric(m, "shared_pool_fallbacks_total") == 1
