"""Tests for the score-based GPU/CPU chunk tiers (impress_flexgen.tiers)."""
from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
import torch

from impress_flexgen.tiers import ChunkCache, TierConfig
from tests.helpers.kv import random_bits, same_bits

CHUNK_ELEMS = 256                 # fp16 elements per test chunk
CHUNK_BYTES = CHUNK_ELEMS * 2
COUNTERS = ("hits", "misses", "bytes_in", "bytes_served", "evictions", "promotions",
            "demotions", "used_bytes", "capacity_bytes")


def key(node: int, idx: int, layer: int = 0, version: int = 0, kind: str = "k") -> tuple:
    return (node, layer, version, kind, idx)


def chunk(seed: int, elems: int = CHUNK_ELEMS) -> torch.Tensor:
    """fp16 chunk from random bit patterns, so NaN payloads, -0, inf and subnormals occur."""
    return random_bits(seed, (elems,))


def read(cache: ChunkCache, k: tuple, disk: dict, ratio: float) -> str | None:
    """What a serving thread does: look up the tiers, on a miss read disk and admit."""
    hit = cache.get(k, ratio)
    if hit is not None:
        return hit[0]
    cache.admit(k, disk[k], ratio)
    return None


def check_accounting(cache: ChunkCache) -> None:
    m = cache.metrics
    gpu, cpu = cache.resident_keys("gpu"), cache.resident_keys("cpu")
    for name, keys in (("gpu", gpu), ("cpu", cpu)):
        tier = cache.tiers[cache.tier_names.index(name)]
        assert m[name]["used_bytes"] == sum(tier.chunks[k].nbytes for k in keys)
        assert m[name]["used_bytes"] <= m[name]["capacity_bytes"]
    both = gpu & cpu
    if cache.config.exclusive:
        assert not both
    assert cache.duplicate_bytes() == sum(cache.tiers[0].chunks[k].nbytes for k in both)


@pytest.mark.parametrize("exclusive", [True, False])
def test_round_trip_disk_cpu_gpu_cpu_is_bit_exact(exclusive: bool):
    # GPU holds one chunk; CPU plenty. Lfu so that frequencies alone decide the moves.
    cache = ChunkCache(TierConfig(gpu_bytes=CHUNK_BYTES, cpu_bytes=8 * CHUNK_BYTES, policy="lfu",
                                  exclusive=exclusive))
    a, x = key(1, 0), key(1, 1)
    disk = {a: chunk(1), x: chunk(2)}
    assert cache.admit(a, disk[a], 1.0) == "gpu"
    assert cache.admit(x, disk[x], 1.0) == "cpu"            # freq 1 does not beat a's 1
    where, t = cache.get(x, 1.0)                             # freq 2 > 1: promoted, a demoted
    assert where == "cpu"                                    # served by the CPU tier ...
    assert cache.resident(x) == "gpu" and t.device.type == cache.gpu_device.type  # ... now GPU
    assert same_bits(t, disk[x]) and t.data_ptr() != disk[x].data_ptr()
    assert cache.resident(a) == "cpu"
    for _ in range(2):                                       # a: 3 accesses > x's 2
        where, t = cache.get(a, 1.0)
    assert where == "cpu" and cache.resident(a) == "gpu" and cache.resident(x) == "cpu"
    where, back = cache.get(x, 0.0)    # ratio is irrelevant to lfu; x (3) ties a (3): stays
    assert where == "cpu" and same_bits(back, disk[x]) and same_bits(t, disk[a])
    m = cache.metrics
    assert m["gpu"]["promotions"] == 2 and m["cpu"]["promotions"] == 2
    assert m["gpu"]["evictions"] == 2 and m["drops"] == 0
    assert m["gpu"]["hits"] == 0 and m["gpu"]["misses"] == 4 and m["cpu"]["hits"] == 4
    if exclusive:       # each GPU eviction copied its chunk down
        assert m["gpu"]["demotions"] == 2 and m["cpu"]["demotions"] == 2
        assert m["free_evictions"] == 0 and cache.duplicate_bytes() == 0
    else:               # the CPU kept both copies: the GPU's evictions cost nothing
        assert m["gpu"]["demotions"] == 0 and m["cpu"]["demotions"] == 0
        assert m["free_evictions"] == 2 and cache.duplicate_bytes() == CHUNK_BYTES
        assert cache.resident_keys("cpu") == {a, x} and cache.resident_keys("gpu") == {a}
    check_accounting(cache)


@pytest.mark.parametrize("exclusive", [True, False])
@pytest.mark.parametrize("policy", ["score", "lru", "lfu"])
def test_random_workload_respects_capacity(policy: str, exclusive: bool):
    rng = random.Random(7)
    sizes = [64, 128, 256, 512, 1024]
    disk = {key(n, i): chunk(n * 100 + i, rng.choice(sizes)) for n in range(8) for i in range(30)}
    keys = list(disk)
    cache = ChunkCache(TierConfig(gpu_bytes=9_000, cpu_bytes=20_000, policy=policy,
                                  exclusive=exclusive))
    gets = shared = 0
    for step in range(2500):
        k = keys[min(int(rng.paretovariate(1.2)) - 1, len(keys) - 1) if rng.random() < 0.7
                  else rng.randrange(len(keys))]
        read(cache, k, disk, rng.random())
        gets += 1
        if step % 400 == 399:
            cache.invalidate_version(rng.randrange(8), 0, 0)
        check_accounting(cache)
        shared += cache.duplicate_bytes() > 0
    m = cache.metrics
    # Non-exclusive tiers hold chunks in both at once, most of the time.
    assert (shared == 0) if exclusive else (shared > 1000), shared
    assert (m["free_evictions"] == 0) == exclusive
    assert m["gpu"]["hits"] + m["gpu"]["misses"] == gets
    assert m["cpu"]["hits"] + m["cpu"]["misses"] == m["gpu"]["misses"]
    assert m["gpu"]["evictions"] > 0 and m["cpu"]["evictions"] > 0
    for k in cache.resident_keys("gpu") | cache.resident_keys("cpu"):
        if cache.resident(k) is None:  # an earlier get's promotion may have pushed it out
            continue
        hit = cache.get(k, 0.5)
        assert hit is not None and same_bits(hit[1], disk[k])


def zipf_trace(n_keys: int, n_req: int, seed: int) -> tuple[list[int], list[float]]:
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** 1.1 for r in range(n_keys)]
    # Popular chunks tend to hold more important tokens, with noise.
    ratios = [min(1.0, max(0.02, 0.9 - 0.6 * r / n_keys + rng.uniform(-0.3, 0.3)))
              for r in range(n_keys)]
    order = list(range(n_keys))
    rng.shuffle(order)                       # popularity must not follow key order
    trace = [order[i] for i in rng.choices(range(n_keys), weights=weights, k=n_req)]
    ratio_of = [0.0] * n_keys
    for r, k in enumerate(order):
        ratio_of[k] = ratios[r]
    return trace, ratio_of


def run_trace(policy: str, trace: list[int], ratios: list[float],
              exclusive: bool = False) -> ChunkCache:
    disk = {key(0, i): chunk(i) for i in set(trace)}
    cache = ChunkCache(TierConfig(gpu_bytes=20 * CHUNK_BYTES, cpu_bytes=40 * CHUNK_BYTES,
                                  policy=policy, exclusive=exclusive))
    for i in trace:
        read(cache, key(0, i), disk, ratios[i])
    return cache


@pytest.mark.parametrize("exclusive", [True, False])
def test_score_policy_keeps_valuable_chunks_on_gpu(exclusive: bool):
    trace, ratios = zipf_trace(300, 6000, seed=3)
    score, lru = (run_trace(p, trace, ratios, exclusive) for p in ("score", "lru"))
    hit_ratio = {}
    for name, cache in (("score", score), ("lru", lru)):
        g = cache.metrics["gpu"]
        hit_ratio[name] = g["hits"] / (g["hits"] + g["misses"])
        check_accounting(cache)
    assert hit_ratio["score"] >= hit_ratio["lru"], hit_ratio
    counts = {i: trace.count(i) for i in set(trace)}
    best = sorted(counts, key=lambda i: counts[i] * ratios[i] ** 1.2, reverse=True)[:10]
    assert sum(score.resident(key(0, i)) == "gpu" for i in best) >= 9
    m = score.metrics
    assert m["gpu"]["promotions"] > 0
    # Exclusive: every GPU eviction copies down or drops; non-exclusive: the CPU still held
    # most of the GPU's victims.
    g = m["gpu"]
    if exclusive:
        assert m["cpu"]["demotions"] > 0 and m["free_evictions"] == 0
    else:
        assert m["free_evictions"] > 0 and g["demotions"] < g["evictions"] / 2


def test_zero_ratio_chunk_never_displaces_anything():
    cache = ChunkCache(TierConfig(gpu_bytes=CHUNK_BYTES, cpu_bytes=2 * CHUNK_BYTES))
    assert cache.admit(key(1, 0), chunk(0), 0.1) == "gpu"       # and a CPU copy
    assert cache.admit(key(1, 1), chunk(1), 0.1) == "cpu"
    for _ in range(20):
        assert cache.get(key(1, 2), 0.0) is None
        assert cache.admit(key(1, 2), chunk(2), 0.0) is None
    assert cache.metrics["gpu"]["evictions"] == cache.metrics["cpu"]["evictions"] == 0


def test_frequent_chunk_earns_its_way_in_and_stats_are_bounded():
    cache = ChunkCache(TierConfig(gpu_bytes=2 * CHUNK_BYTES, policy="lfu"))
    cache.max_stats = 50
    for i in range(2):
        for _ in range(3):
            read(cache, key(1, i), {key(1, i): chunk(i)}, 1.0)
    newcomer = key(2, 0)
    rounds = 0
    while cache.resident(newcomer) is None:     # each miss + admit is two accesses
        read(cache, newcomer, {newcomer: chunk(9)}, 1.0)
        rounds += 1
        assert rounds < 10
    assert rounds == 3 and cache.resident(newcomer) == "gpu"
    assert cache.metrics["drops"] == 1          # no CPU tier: the victim went to disk-only
    for i in range(200):
        cache.get(key(3, i), 1.0)
    assert len(cache._stats) <= 50
    assert cache.resident(newcomer) == "gpu"     # resident chunks survive stats aging


def test_tiers_are_non_exclusive_by_default():
    assert TierConfig().exclusive is False and TierConfig().copies == "non-exclusive"
    assert TierConfig(exclusive=True).copies == "exclusive"
    cache = ChunkCache(TierConfig(gpu_bytes=4 * CHUNK_BYTES, cpu_bytes=4 * CHUNK_BYTES))
    k = key(1, 0)
    assert cache.admit(k, chunk(0), 0.8) == "gpu"
    assert k in cache.resident_keys("gpu") and k in cache.resident_keys("cpu")
    check_accounting(cache)


def test_exclusive_vs_non_exclusive_residency():
    big = TierConfig(gpu_bytes=4 * CHUNK_BYTES, cpu_bytes=4 * CHUNK_BYTES, exclusive=False)
    cache = ChunkCache(big)
    k = key(1, 0)
    assert cache.admit(k, chunk(0), 0.8) == "gpu"
    assert k in cache.resident_keys("gpu") and k in cache.resident_keys("cpu")
    # A non-exclusive promotion keeps the CPU copy.
    inc = ChunkCache(TierConfig(gpu_bytes=CHUNK_BYTES, cpu_bytes=4 * CHUNK_BYTES,
                                policy="lfu", exclusive=False))
    inc.admit(key(1, 0), chunk(0), 1.0)
    inc.admit(key(1, 1), chunk(1), 1.0)             # CPU only: GPU full and no better
    assert inc.resident_keys("gpu") == {key(1, 0)}
    assert inc.get(key(1, 1), 1.0)[0] == "cpu"      # a CPU hit, promoted
    assert key(1, 1) in inc.resident_keys("gpu")    # ... and its CPU copy stays
    assert key(1, 1) in inc.resident_keys("cpu") and key(1, 0) in inc.resident_keys("cpu")
    assert inc.metrics["gpu"]["demotions"] == 0     # key(1,0) already had a CPU copy
    check_accounting(inc)
    exc = ChunkCache(dataclasses.replace(big, exclusive=True))
    assert exc.admit(k, chunk(0), 0.8) == "gpu"
    assert exc.resident_keys("cpu") == frozenset()


def test_non_exclusive_admission_follows_each_tiers_comparison():
    cache = ChunkCache(TierConfig(gpu_bytes=2 * CHUNK_BYTES, cpu_bytes=3 * CHUNK_BYTES,
                                  policy="lfu"))
    a, b, c, d = (key(1, i) for i in range(4))
    assert cache.admit(a, chunk(0), 1.0) == "gpu" and cache.admit(b, chunk(1), 1.0) == "gpu"
    assert cache.admit(c, chunk(2), 1.0) == "cpu"   # GPU full, 1 ties its minimum; CPU room
    assert cache.admit(d, chunk(3), 1.0) is None    # both full, 1 beats neither minimum
    assert cache.get(d, 1.0) is None                # d: 2 accesses, then 3 with the admit
    assert cache.admit(d, chunk(3), 1.0) == "gpu"   # beats both minimums (a, the oldest 1)
    assert cache.resident_keys("gpu") == {b, d} and cache.resident_keys("cpu") == {b, c, d}
    m = cache.metrics
    # a's GPU copy left free (the CPU still had a), then the CPU dropped a to disk-only.
    assert m["gpu"]["evictions"] == m["cpu"]["evictions"] == 1
    assert m["free_evictions"] == 1 and m["drops"] == 1 and m["gpu"]["demotions"] == 0
    check_accounting(cache)
    assert same_bits(cache.get(d, 1.0)[1], chunk(3))


def test_non_exclusive_gpu_victim_without_a_cpu_copy_is_demoted():
    # Big chunks never fit the GPU tier; two of them push the small chunk a out of the CPU
    # while the GPU keeps it. A later GPU eviction of a must then copy it down.
    cache = ChunkCache(TierConfig(gpu_bytes=CHUNK_BYTES, cpu_bytes=4 * CHUNK_BYTES,
                                  policy="lfu"))
    a, x = key(1, 0), key(1, 1)
    big = {key(2, i): chunk(10 + i, 2 * CHUNK_ELEMS) for i in range(2)}
    assert cache.admit(a, chunk(0), 1.0) == "gpu"
    for k, t in big.items():
        assert read(cache, k, big, 1.0) is None and cache.resident(k) == "cpu"
    assert cache.resident_keys("gpu") == {a} and a not in cache.resident_keys("cpu")
    assert cache.metrics["free_evictions"] == 1         # a left the CPU, kept by the GPU
    for _ in range(3):
        assert cache.get(a, 1.0)[0] == "gpu"             # a: 4 accesses, above the big ones
    disk = {x: chunk(1)}
    while cache.resident(x) != "gpu":
        read(cache, x, disk, 1.0)
    m = cache.metrics
    assert m["gpu"]["demotions"] == m["cpu"]["demotions"] == 1 and m["drops"] >= 1
    assert cache.resident(a) == "cpu" and same_bits(cache.get(a, 1.0)[1], chunk(0))
    check_accounting(cache)


def test_chunk_bigger_than_tier_never_enters_it():
    cache = ChunkCache(TierConfig(gpu_bytes=1000, cpu_bytes=10_000))
    k = key(1, 0)
    assert cache.admit(k, chunk(0, 1000), 1.0) == "cpu"      # 2000 bytes > GPU capacity
    for _ in range(10):
        assert cache.get(k, 1.0)[0] == "cpu"
    assert cache.metrics["gpu"]["promotions"] == 0
    assert cache.admit(key(1, 1), chunk(1, 6000), 1.0) is None
    disabled = ChunkCache(TierConfig())
    assert disabled.admit(k, chunk(0, 0), 1.0) is None       # zero-size, zero-capacity
    check_accounting(cache)


@pytest.mark.parametrize("exclusive", [True, False])
def test_invalidate_drops_the_right_keys_and_frees_bytes(exclusive: bool):
    # 32 chunks: all fit (exclusive: 6 + 30 distinct; non-exclusive: the CPU alone holds 32).
    cache = ChunkCache(TierConfig(gpu_bytes=6 * CHUNK_BYTES,
                                  cpu_bytes=(30 if exclusive else 32) * CHUNK_BYTES,
                                  exclusive=exclusive))
    keys = [key(n, i, layer, ver, kind) for n in (1, 2) for layer in (0, 1) for ver in (0, 1)
            for kind in ("k", "v") for i in range(2)]
    for j, k in enumerate(keys):
        cache.admit(k, chunk(j), 0.5)
    assert all(cache.resident(k) is not None for k in keys)

    def copies(ks) -> int:
        return sum(k in cache.resident_keys(t) for t in ("gpu", "cpu") for k in ks)

    used = cache.metrics["gpu"]["used_bytes"] + cache.metrics["cpu"]["used_bytes"]
    gone = [k for k in keys if k[0] == 1 and k[1] == 1 and k[2] == 0]
    n_gone = copies(gone)
    assert len(gone) == 4 and n_gone == (4 if exclusive else 4 + len(
        set(gone) & cache.resident_keys("gpu")))
    assert cache.invalidate_version(1, 1, 0) == n_gone
    assert all(cache.resident(k) is None for k in gone)
    assert all(k not in cache._stats for k in gone)
    after = cache.metrics["gpu"]["used_bytes"] + cache.metrics["cpu"]["used_bytes"]
    assert after == used - n_gone * CHUNK_BYTES
    node2 = copies([k for k in keys if k[0] == 2])
    assert node2 >= 16 and cache.invalidate(2) == node2
    left = {k for k in keys if k[0] == 1 and k not in gone}
    assert cache.resident_keys("gpu") | cache.resident_keys("cpu") == left
    assert cache.invalidate(2) == 0 and cache.invalidate(99) == 0
    check_accounting(cache)
    assert cache.metrics["drops"] == 0           # invalidation is not an eviction
    cache.clear()
    assert cache.metrics["gpu"]["used_bytes"] == cache.metrics["cpu"]["used_bytes"] == 0
    assert cache.resident_keys("gpu") == cache.resident_keys("cpu") == frozenset()


def test_metrics_fields_and_reset():
    cache = ChunkCache(TierConfig(gpu_bytes=2 * CHUNK_BYTES, cpu_bytes=2 * CHUNK_BYTES))
    m = cache.metrics
    assert set(m) == {"gpu", "cpu", "drops", "corrupt_copies", "free_evictions"}
    for tier in ("gpu", "cpu"):
        assert set(m[tier]) == set(COUNTERS)
    assert m["gpu"]["capacity_bytes"] == 2 * CHUNK_BYTES
    disk = {key(1, i): chunk(i) for i in range(6)}
    for k in list(disk) * 3:
        read(cache, k, disk, 0.7)
    m = cache.metrics
    assert m["gpu"]["bytes_served"] == m["gpu"]["hits"] * CHUNK_BYTES
    assert m["cpu"]["bytes_served"] == m["cpu"]["hits"] * CHUNK_BYTES
    check_accounting(cache)
    cache.reset_metrics()
    m = cache.metrics
    assert m["drops"] == m["free_evictions"] == 0
    assert all(m[t][c] == 0 for t in ("gpu", "cpu") for c in COUNTERS[:7])
    assert m["gpu"]["used_bytes"] > 0          # reset clears counters, not residency


def test_two_threads_hammering_stay_consistent():
    cache = ChunkCache(TierConfig(gpu_bytes=8 * CHUNK_BYTES, cpu_bytes=16 * CHUNK_BYTES))
    disk = {key(n, i): chunk(n * 10 + i) for n in range(6) for i in range(10)}
    keys = list(disk)
    errors: list[BaseException] = []
    stop = time.monotonic() + 0.5

    def worker(seed: int, invalidates: bool) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop:
                k = rng.choice(keys)
                hit = cache.get(k, rng.random())
                if hit is None:
                    cache.admit(k, disk[k], rng.random())
                elif not same_bits(hit[1], disk[k]):
                    raise AssertionError(f"corrupt chunk {k}")
                if invalidates and rng.random() < 0.05:
                    if rng.random() < 0.5:
                        cache.invalidate(rng.randrange(6))
                    else:
                        cache.invalidate_version(rng.randrange(6), 0, 0)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s, s == 1)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    check_accounting(cache)
    m = cache.metrics
    assert m["gpu"]["hits"] > 0 and m["cpu"]["hits"] + m["cpu"]["misses"] == m["gpu"]["misses"]


def test_tiers_of_no_capacity_only_count_misses():
    """With both tiers sized 0 nothing is cached and no per-chunk statistics are kept (they
    would cost time on every read and never decide anything)."""
    cache = ChunkCache(TierConfig(gpu_bytes=0, cpu_bytes=0, policy="score"))
    t = torch.zeros(4, 16)
    for i in range(5):
        assert cache.get(("n", 0, 1, "k", i), 0.5) is None
        assert cache.admit(("n", 0, 1, "k", i), t, 0.5) is None
    m = cache.metrics
    assert m["gpu"]["misses"] == 5 and m["cpu"]["misses"] == 5
    assert m["gpu"]["hits"] == 0 and m["cpu"]["used_bytes"] == 0
    assert not cache.resident_keys("cpu") and len(cache._stats) == 0
