"""The remote benchmark end to end on a tiny model: every way serves, the Redis-only way
takes the whole prefix from the pool and answers as the local disk does."""
from __future__ import annotations

import json

import pytest

from experiments import bench_remote
from tests.redis_server import require_redis_server


@pytest.mark.slow
def test_bench_remote_tiny(tmp_path):
    require_redis_server()
    out = tmp_path / "remote.json"
    assert bench_remote.main(["--model", "llama-tiny", "--prefix-tokens", "64", "--queries", "1",
                              "--store-root", str(tmp_path / "stores"),
                              "--offload-dir", str(tmp_path / "off"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["way"]: r for r in report["results"]}
    assert list(rows) == [bench_remote.RECOMPUTE, bench_remote.DISK, bench_remote.REDIS,
                          bench_remote.CLUSTER, bench_remote.IMPRESS]
    assert all(r["ttft_median_s"] > 0 and r["queries"] == 1 for r in rows.values())
    assert rows[bench_remote.RECOMPUTE]["ttft_vs_recompute"] == 1.0
    disk, pool = rows[bench_remote.DISK], rows[bench_remote.REDIS]
    assert disk["matched_tokens"] == 64 and disk["bytes_read_per_request"]["disk"] > 0
    assert disk["bytes_read_per_request"]["remote"] == 0
    # Every chunk from the pool, none from the (empty) local store.
    assert pool["shared_tokens"] == 64 and pool["matched_tokens"] == 0
    assert pool["bytes_read_per_request"]["remote"] > 0
    assert pool["bytes_read_per_request"]["disk"] == 0
    # The same float16 KV as the local disk: the same answer, bit for bit.
    assert pool["first_token_equals_local_disk"] and pool["max_logit_diff_vs_local_disk"] == 0
    assert isinstance(pool["first_token_equals_recompute"], bool)
    # The same from a Redis Cluster.
    cluster = rows[bench_remote.CLUSTER]
    assert cluster["shared_tokens"] == 64 and cluster["matched_tokens"] == 0
    assert cluster["first_token_equals_local_disk"]
    assert cluster["max_logit_diff_vs_local_disk"] == 0
    assert report["environment"]["redis_server"].startswith("Redis server")
