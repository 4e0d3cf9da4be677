"""Safety of the chunk tiers: invalidation that late reads cannot undo, and CRC-checked copies."""
from __future__ import annotations

import dataclasses
import threading
import time
import zlib

import pytest
import torch

from impress_flexgen.tiers import ChunkCache, TierConfig, payload_crc
from impress_flexgen.tiers import base as tier_base
from tests.helpers.kv import random_bits, same_bits

CHUNK_ELEMS = 256                 # fp16 elements per test chunk
CHUNK_BYTES = CHUNK_ELEMS * 2
CPU = torch.device("cpu")        # stands in for the GPU, so every test runs without CUDA


def key(node: int, idx: int, layer: int = 0, version: int = 0, kind: str = "k") -> tuple:
    return (node, layer, version, kind, idx)


def chunk(seed: int, elems: int = CHUNK_ELEMS) -> torch.Tensor:
    return random_bits(seed, (elems,))


def disk_crc(t: torch.Tensor) -> int:
    """What the store keeps in its metadata: zlib's CRC-32 of the payload bytes."""
    return zlib.crc32(t.contiguous().numpy().tobytes())


def flip(cache: ChunkCache, tier: str, k: tuple) -> None:
    res = cache.tiers[cache.tier_names.index(tier)].chunks[k]
    res.tensor.view(torch.uint8)[0] ^= 1


@pytest.fixture(params=["libdeflate", "zlib"])
def crc_impl(request, monkeypatch):
    if request.param == "zlib":
        monkeypatch.setattr(tier_base, "_crc32_at", None)
    elif tier_base._crc32_at is None:
        pytest.skip("libdeflate not available")
    return request.param


def test_late_admit_after_invalidate_node_stores_nothing():
    cache = ChunkCache(TierConfig(gpu_bytes=4 * CHUNK_BYTES, cpu_bytes=4 * CHUNK_BYTES),
                       gpu_device=CPU)
    k = key(7, 0)
    assert cache.get(k, 0.9) is None            # a reader misses and starts a disk read ...
    assert cache.invalidate(7) == 0             # ... the node is split meanwhile ...
    assert cache.admit(k, chunk(0), 0.9) is None  # ... and the late read must not re-admit
    assert cache.resident(k) is None and cache.get(k, 0.9) is None
    assert cache.admit(key(7, 1), chunk(1), 0.9) is None
    assert not cache.resident_keys("gpu") and not cache.resident_keys("cpu")
    assert cache.metrics["gpu"]["used_bytes"] == cache.metrics["cpu"]["used_bytes"] == 0
    m = cache.metrics                            # a refused lookup is still one miss per tier
    assert m["gpu"]["misses"] == m["cpu"]["misses"] == 2
    assert cache.admit(key(8, 0), chunk(2), 0.9) == "gpu"   # other nodes are unaffected


def test_late_admit_of_an_invalidated_version_is_refused():
    cache = ChunkCache(TierConfig(gpu_bytes=8 * CHUNK_BYTES, cpu_bytes=8 * CHUNK_BYTES),
                       gpu_device=CPU)
    late = key(3, 0, layer=1, version=1)
    assert cache.get(late, 0.5) is None          # read of version 1 starts, reorder meanwhile
    assert cache.invalidate_version(3, 1, 1) == 0
    assert cache.admit(late, chunk(0), 0.5) is None and cache.resident(late) is None
    assert cache.admit(key(3, 0, layer=1, version=2), chunk(2), 0.5) == "gpu"
    # A floor also covers older versions, and drops their copies.
    assert cache.admit(key(4, 0, layer=1, version=0), chunk(6), 0.5) == "gpu"
    assert cache.invalidate_version(4, 1, 1) == 2     # its GPU copy and its CPU copy
    for version in (0, 1):
        k = key(4, 0, layer=1, version=version)
        assert cache.admit(k, chunk(1), 0.5) is None
        assert cache.resident(k) is None and cache.get(k, 0.5) is None
    assert cache.admit(key(3, 0, layer=0, version=1), chunk(3), 0.5) == "gpu"  # other layer
    cache.invalidate_version(3, 1, 0)            # an older floor never lowers the newer one
    assert cache.admit(key(3, 1, layer=1, version=1), chunk(4), 0.5) is None
    cache.invalidate(3)                           # the node tombstone covers every version
    assert cache.admit(key(3, 0, layer=1, version=5), chunk(5), 0.5) is None
    assert 3 not in cache._dead_versions


def test_corrupted_cpu_copy_is_not_promoted(crc_impl):
    # Exclusive tiers: the CRC must travel with a demoted copy (non-exclusive: below).
    cache = ChunkCache(TierConfig(gpu_bytes=CHUNK_BYTES, cpu_bytes=8 * CHUNK_BYTES,
                                  policy="lfu", exclusive=True), gpu_device=CPU)
    a, x = key(1, 0), key(1, 1)
    disk = {a: chunk(1), x: chunk(2)}
    assert cache.admit(a, disk[a], 1.0, crc=disk_crc(disk[a])) == "gpu"
    assert cache.admit(x, disk[x], 1.0, crc=disk_crc(disk[x])) == "cpu"
    flip(cache, "cpu", x)
    assert cache.get(x, 1.0) is None             # would be promoted: checked, refused
    m = cache.metrics
    assert m["corrupt_copies"] == 1 and cache.resident(x) is None
    assert m["cpu"]["hits"] == 0 and m["cpu"]["misses"] == 1 and m["cpu"]["bytes_served"] == 0
    assert m["gpu"]["promotions"] == 0 and cache.resident(a) == "gpu"   # nothing displaced
    # The caller reads disk and admits again (x now beats a: 3 accesses to 1).
    assert cache.admit(x, disk[x], 1.0, crc=disk_crc(disk[x])) == "gpu"
    where, t = cache.get(x, 1.0)
    assert where == "gpu" and same_bits(t, disk[x])
    # a was demoted to the CPU tier and kept its CRC there.
    assert cache.resident(a) == "cpu"
    flip(cache, "cpu", a)
    served = 0
    while cache.get(a, 1.0) is not None:         # unchecked CPU hits until it would promote
        served += 1
        assert served < 10
    assert served == 3                           # lfu: a needs 5 accesses to beat x's 4
    assert cache.metrics["corrupt_copies"] == 2 and cache.resident(a) is None


def test_copies_without_crc_are_never_checked():
    cache = ChunkCache(TierConfig(gpu_bytes=CHUNK_BYTES, cpu_bytes=8 * CHUNK_BYTES,
                                  policy="lfu", verify_hits=True), gpu_device=CPU)
    a, x = key(1, 0), key(1, 1)
    cache.admit(a, chunk(1), 1.0)
    cache.admit(x, chunk(2), 1.0)
    flip(cache, "cpu", x)
    where, _ = cache.get(x, 1.0)
    assert where == "cpu" and cache.resident(x) == "gpu"
    assert cache.metrics["corrupt_copies"] == 0


def test_verify_hits_refuses_corrupted_copies(crc_impl):
    cfg = TierConfig(gpu_bytes=4 * CHUNK_BYTES, cpu_bytes=4 * CHUNK_BYTES, verify_hits=True,
                     exclusive=True)
    cache = ChunkCache(cfg, gpu_device=CPU)
    k = key(2, 0)
    t = chunk(5)
    assert cache.admit(k, t, 0.8, crc=disk_crc(t)) == "gpu"
    assert same_bits(cache.get(k, 0.8)[1], t)          # a sound copy is served
    flip(cache, "gpu", k)
    assert cache.get(k, 0.8) is None
    m = cache.metrics
    assert m["corrupt_copies"] == 1 and cache.resident(k) is None
    assert m["gpu"]["hits"] == 1 and m["gpu"]["misses"] == 1 and m["cpu"]["misses"] == 1
    # Non-exclusive: the CPU's sound copy is served and promoted in place of the bad one.
    both = ChunkCache(dataclasses.replace(cfg, exclusive=False), gpu_device=CPU)
    assert both.admit(k, t, 0.8, crc=disk_crc(t)) == "gpu"
    flip(both, "gpu", k)
    where, served = both.get(k, 0.8)
    assert where == "cpu" and same_bits(served, t) and both.metrics["corrupt_copies"] == 1
    assert both.resident(k) == "gpu" and same_bits(both.get(k, 0.8)[1], t)
    assert k in both.resident_keys("cpu")
    # A CPU hit that is not promoted is checked too.
    tiny = ChunkCache(TierConfig(gpu_bytes=0, cpu_bytes=4 * CHUNK_BYTES, verify_hits=True),
                      gpu_device=CPU)
    assert tiny.admit(k, t, 0.8, crc=disk_crc(t)) == "cpu"
    flip(tiny, "cpu", k)
    assert tiny.get(k, 0.8) is None and tiny.metrics["corrupt_copies"] == 1
    # Without verify_hits a GPU hit is served as is (the check costs a device round trip).
    fast = ChunkCache(TierConfig(gpu_bytes=4 * CHUNK_BYTES), gpu_device=CPU)
    fast.admit(k, t, 0.8, crc=disk_crc(t))
    flip(fast, "gpu", k)
    assert fast.get(k, 0.8)[0] == "gpu" and fast.metrics["corrupt_copies"] == 0


def test_corrupt_copies_metric_and_reset():
    cache = ChunkCache(TierConfig(gpu_bytes=2 * CHUNK_BYTES, verify_hits=True), gpu_device=CPU)
    assert cache.metrics["corrupt_copies"] == 0
    t = chunk(3)
    cache.admit(key(1, 0), t, 0.5, crc=disk_crc(t) ^ 0x10)   # a CRC that does not match
    assert cache.get(key(1, 0), 0.5) is None and cache.metrics["corrupt_copies"] == 1
    cache.reset_metrics()
    assert cache.metrics["corrupt_copies"] == 0


def test_payload_crc_matches_zlib(crc_impl):
    for seed, elems in ((0, 0), (1, 1), (2, 777), (3, 4096)):
        t = chunk(seed, elems)
        assert payload_crc(t) == disk_crc(t)
    base = chunk(9, 64).view(8, 8)
    strided = base.t()                                   # not contiguous
    assert payload_crc(strided) == disk_crc(strided.contiguous())


def test_tombstones_are_bounded():
    cache = ChunkCache(TierConfig(gpu_bytes=4 * CHUNK_BYTES), gpu_device=CPU)
    cache.max_tombstones = 100
    for node in range(300):
        cache.invalidate(node)
    assert len(cache._dead_nodes) <= 100
    assert cache.admit(key(299, 0), chunk(0), 0.9) is None    # recent ones are remembered
    assert cache.admit(key(0, 0), chunk(0), 0.9) == "gpu"      # the oldest were forgotten
    for node in range(1000, 1300):
        for layer in range(2):
            cache.invalidate_version(node, layer, 0)
    assert cache._n_dead_versions <= 100 and len(cache._dead_versions) <= 100
    assert sum(len(v) for v in cache._dead_versions.values()) == cache._n_dead_versions
    assert cache.admit(key(1299, 0, layer=1), chunk(1), 0.9) is None
    off = ChunkCache(TierConfig(), gpu_device=CPU)            # nothing can be admitted there
    for node in range(50):
        off.invalidate(node)
        off.invalidate_version(node, 0, 3)
    assert not off._dead_nodes and not off._dead_versions


def test_invalidate_wins_over_a_concurrent_admitter():
    cache = ChunkCache(TierConfig(gpu_bytes=16 * CHUNK_BYTES, cpu_bytes=32 * CHUNK_BYTES),
                       gpu_device=CPU)
    disk = [chunk(i) for i in range(32)]
    started, invalidated, stop = threading.Event(), threading.Event(), threading.Event()
    after = [0]
    errors: list[BaseException] = []

    def admitter() -> None:
        i = 0
        try:
            while not stop.is_set():
                k = key(5, i % 32)
                if cache.get(k, 0.9) is None:
                    cache.admit(k, disk[i % 32], 0.9)
                started.set()
                if invalidated.is_set():
                    after[0] += 1
                i += 1
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    def invalidator() -> None:
        started.wait(5)
        for _ in range(60):
            cache.invalidate(5)
            time.sleep(0)                             # let the admitter interleave
        invalidated.set()

    threads = [threading.Thread(target=admitter), threading.Thread(target=invalidator)]
    for t in threads:
        t.start()
    threads[1].join()
    deadline = time.monotonic() + 5
    while after[0] < 200 and time.monotonic() < deadline:   # reads finishing late
        time.sleep(0.001)
    stop.set()
    threads[0].join()
    assert not errors, errors
    assert after[0] >= 200
    held = cache.resident_keys("gpu") | cache.resident_keys("cpu")
    assert not [k for k in held if k[0] == 5]
