"""What every tier must do (the `Tier` protocol of impress_flexgen.tiers.base), checked the same
way for each tier in TIERS; then what is particular to the disk tier, the memory tier's own
ranking, and the chain over N of them.

TIERS holds the tiers a load calls, as it calls them: the memory chain (`MemoryChain`, the
first tier of a store's TierStack), the store's own `DiskTier` (`store.tiers.disk`, the
last), and the remote tier (`RedisTier`); and the single memory tiers, alone and inside a
chain.

A factory takes the pytest request and a capacity in chunks and returns a `Subject`: the
tier (CRC checks on), its i-th distinct chunk key, chunks of the shape it holds, and how
to fill it, measure it and damage it behind its back. A write-once tier (`writable = False`:
the disk, written by whole-prefix inserts) is filled its own way, never through put().
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from impress_flexgen.errors import UserError
from impress_flexgen.store import ModelShape, PrefixStore, StoreConfig, StoreFull
from impress_flexgen.tiers.memory_chain import MemoryChain
from impress_flexgen.tiers.stack import TierStack
from impress_flexgen.tiers import (
    ChunkLoad,
    DiskTier,
    DISK,
    REMOTE,
    ChunkCache,
    MemoryTier,
    Tier,
    TierConfig,
    TierSpec,
    payload_crc,
)
from impress_flexgen.tiers.remote import DIGEST_SIZE, RedisTier, RemoteNamespace, layer_key
from tests.helpers.kv import random_bits, same_bits
from tests.redis_server import RedisServer, require_redis_server

CHUNK_ELEMS = 256
CHUNK_BYTES = CHUNK_ELEMS * 2     # fp16


def chunk_key(i: int) -> tuple:
    return (1, 0, 0, "k", i)   # (node, layer, version, kind, chunk index)


def chunk(seed: int, elems: int = CHUNK_ELEMS) -> torch.Tensor:
    return random_bits(seed, (elems,))


def flip_byte(t: torch.Tensor, at: int = 3) -> None:
    t.view(torch.uint8).view(-1)[at] ^= 0x20


def read(tier, keys: list) -> list:
    return tier.wait(tier.submit_get(keys))


# ---------------------------------------------------------------------- subjects
@dataclasses.dataclass
class Subject:
    """One tier under test and how the suite drives it."""

    tier: Tier
    key: Callable[[int], object]                    # the i-th distinct chunk key
    payload: Callable[[int, bool], torch.Tensor]    # (seed, small) -> a chunk it holds
    fill: Callable[[int, torch.Tensor], bool]       # hold it as key(i); False: refused
    used: Callable[[], int]                         # bytes held, by the tier's own measure
    damage: Callable[[int], None]                   # corrupt the stored copy of key(i)
    capacity: int                                   # bytes it may hold
    chunk_bytes: int                                # payload bytes of one chunk
    slack: int = 0                                  # how far `used` may pass `capacity`
    oversize: Callable[[int], torch.Tensor] | None = None   # a chunk that can never fit
    close: Callable[[], None] = lambda: None


def _memory_subject(tier: MemoryTier, capacity: int) -> Subject:
    return Subject(
        tier, chunk_key,
        lambda seed, small: chunk(seed, CHUNK_ELEMS // 2 if small else CHUNK_ELEMS),
        lambda i, t: tier.put(chunk_key(i), t, payload_crc(t)), lambda: tier.used,
        lambda i: flip_byte(tier.chunks[chunk_key(i)].tensor), capacity, CHUNK_BYTES,
        oversize=lambda seed: chunk(seed, capacity // 2 + 1))


def memory_tier(name: str) -> Callable:
    def make(request, n_chunks: int) -> Subject:
        capacity = n_chunks * CHUNK_BYTES
        return _memory_subject(MemoryTier(name, capacity, "cpu", verify=True), capacity)
    return make


def chained_tier(position: int) -> Callable:
    """A tier of a ChunkCache used through the protocol (it shares the chain's lock)."""
    def make(request, n_chunks: int) -> Subject:
        capacity = n_chunks * CHUNK_BYTES
        cfg = TierConfig(gpu_bytes=capacity, cpu_bytes=capacity, verify_hits=True)
        tier = ChunkCache(cfg, gpu_device=torch.device("cpu")).tiers[position]
        return _memory_subject(tier, capacity)
    return make


def memory_chain(exclusive: bool) -> Callable:
    def make(request, n_chunks: int) -> Subject:
        return _memory_chain(n_chunks, exclusive)
    return make


def _memory_chain(n_chunks: int, exclusive: bool) -> Subject:
    """The GPU and CPU tiers as one tier, as a store's TierStack holds them (half the
    capacity each); CRC checks on every hit."""
    capacity = n_chunks * CHUNK_BYTES
    cfg = TierConfig(gpu_bytes=capacity // 2, cpu_bytes=capacity - capacity // 2,
                     exclusive=exclusive, verify_hits=True)
    chain = TierStack(ChunkCache(cfg, gpu_device=torch.device("cpu"))).memory
    cache = chain.cache

    def damage(i: int) -> None:
        # Every copy: a sound copy in another tier would rightly be served instead.
        for held in (t for t in cache.tiers if chunk_key(i) in t.chunks):
            flip_byte(held.chunks[chunk_key(i)].tensor)

    return Subject(
        chain, chunk_key,
        lambda seed, small: chunk(seed, CHUNK_ELEMS // 2 if small else CHUNK_ELEMS),
        lambda i, t: chain.put(chunk_key(i), t, payload_crc(t)),
        lambda: sum(t.used for t in cache.tiers), damage, capacity, CHUNK_BYTES,
        oversize=lambda seed: chunk(seed, capacity // 2 + 1))


SHAPE = ModelShape("conformance", n_layers=2, n_kv_heads=2, head_dim=16)
C = 16


def disk_config(**kw) -> StoreConfig:
    # Buffered reads: tmp_path may be a file system that refuses O_DIRECT.
    base = {"chunk_size": C, "probe_heads": (0,), "probe_format": "fp16",
            "reorder_interval": 0, "direct_io": False}
    return StoreConfig(**{**base, **kw})


def prefix_tokens(i: int, n_chunks: int = 1) -> np.ndarray:
    """A prefix whose first chunk no other index shares: its own radix node."""
    return np.arange(n_chunks * C, dtype=np.int32) + 1000 * (i + 1)


def disk_kv(first: torch.Tensor, seed: int):
    """KV of a prefix whose layer 0 K is `first` (kv_heads, n, head_dim); the rest random."""
    out = [(first, random_bits(seed, first.shape))]
    for layer in range(1, SHAPE.n_layers):
        out.append(tuple(random_bits(seed * 10 + layer * 2 + j, first.shape) for j in (0, 1)))
    return out


def disk_tier(request, n_chunks: int) -> Subject:
    """The store in a tmp dir; key(i) is layer 0's first K chunk of prefix i (its own node)."""
    tmp = request.getfixturevalue("tmp_path")
    with PrefixStore(tmp / "measure", SHAPE, disk_config()) as probe:
        node_bytes = SHAPE.n_layers * probe.inspect().state.layout(C).file_bytes
    capacity = n_chunks * node_bytes
    store = PrefixStore(tmp / "store", SHAPE, disk_config(disk_capacity_bytes=capacity))
    tier = store.tiers.disk
    node_of: dict[int, int] = {}

    def key(i: int) -> tuple:
        # A prefix never stored names a node id no store hands out this early: a miss.
        return (node_of.get(i, 10 ** 9 + i), 0, 1, "k", 0)

    def fill(i: int, t: torch.Tensor) -> bool:
        try:
            nodes = store.insert(prefix_tokens(i, t.shape[1] // C), 0, disk_kv(t, i))
        except StoreFull:
            return False
        node_of[i] = nodes[-1].id
        return True

    def damage(i: int) -> None:
        entry = store.inspect().state.tree.nodes[node_of[i]].layers[0]
        with open(entry.path, "r+b") as f:
            f.seek(entry.layout.chunk_offset("k", 0) + 7)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
        store.inspect().state.reader.forget(entry.path)

    too_many = next(m for m in range(1, 10 ** 4)
                    if SHAPE.n_layers * store.inspect().state.layout(m * C).file_bytes > capacity)
    return Subject(tier, key, lambda seed, small: random_bits(seed, (2, C, 16)), fill,
                   store.inspect().accounting.disk_bytes, damage, capacity, 2 * C * 16 * 2,
                   oversize=lambda seed: random_bits(seed, (2, too_many * C, 16)),
                   close=store.close)


REDIS_NS = RemoteNamespace("conformance", n_layers=2, n_kv_heads=4, head_dim=64,
                           dtype="float16", chunk_size=64)          # 64 KiB a value
REDIS_VALUE_BYTES = 2 * 4 * 64 * 64 * 2


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer(require_redis_server()) as srv:
        yield srv


def redis_tier(request, n_chunks: int) -> Subject:
    """A RedisTier on a real server whose maxmemory leaves room for `n_chunks` values over
    what it uses empty, measured as Redis measures itself (used_memory). Redis counts its
    own overheads too (allocator size classes, connections, and the query buffer that holds
    a write's argument while maxmemory is checked), so the room has a headroom of two
    values; and it checks before a write lands, so it may pass maxmemory by what one write
    and its buffers take (`slack`). A write past maxmemory is put() == False."""
    server = request.getfixturevalue("redis_server")
    raw = redis.Redis.from_url(server.url)
    raw.flushdb()
    raw.config_set("maxmemory", 0)
    capacity = (n_chunks + 2) * REDIS_VALUE_BYTES
    tier = RedisTier(server.url, REDIS_NS, timeout_s=2.0, retry_after_s=0.2)
    base = int(raw.info("memory")["used_memory"])
    raw.config_set("maxmemory", base + capacity)

    def key(i: int) -> tuple:
        return (hashlib.blake2b(b"%d" % i, digest_size=DIGEST_SIZE).digest(), i % REDIS_NS.n_layers)

    def fill(i: int, t: torch.Tensor) -> bool:
        return tier.put(key(i), t, payload_crc(t))

    def damage(i: int) -> None:
        rk = layer_key(*key(i))
        value = bytearray(raw.get(rk))
        value[-3] ^= 0x40
        limit = raw.config_get("maxmemory")["maxmemory"]
        raw.config_set("maxmemory", 0)          # the damage is not a write the limit refuses
        raw.set(rk, bytes(value))
        raw.config_set("maxmemory", limit)

    def close() -> None:
        tier.close()
        raw.config_set("maxmemory", 0)
        raw.flushdb()
        raw.close()

    return Subject(tier, key, lambda seed, small: random_bits(seed, REDIS_NS.value_shape), fill,
                   lambda: int(raw.info("memory")["used_memory"]) - base, damage, capacity,
                   REDIS_VALUE_BYTES, slack=3 * REDIS_VALUE_BYTES, close=close)


TIERS: dict[str, Callable[..., Subject]] = {
    "memory-gpu-on-host": memory_tier("gpu"),
    "memory-cpu": memory_tier("cpu"),
    "chain-gpu-on-host": chained_tier(0),
    "chain-cpu": chained_tier(1),
    "memory-chain": memory_chain(exclusive=False),
    "memory-chain-exclusive": memory_chain(exclusive=True),
    "disk": disk_tier,
    "redis": redis_tier,
}


@pytest.fixture(params=sorted(TIERS))
def make(request):
    made: list[Subject] = []

    def build(n_chunks: int) -> Subject:
        made.append(TIERS[request.param](request, n_chunks))
        return made[-1]
    yield build
    for s in made:
        s.close()


# ---------------------------------------------------------------------- the protocol
def test_implements_the_protocol(make):
    s = make(4)
    assert isinstance(s.tier, Tier) and isinstance(s.tier.name, str) and s.tier.name


def test_a_store_loads_through_the_tiers_under_test(tmp_path):
    """The classes this suite checks are the ones a store's loads call, in order."""
    cache = ChunkCache(TierConfig(cpu_bytes=1 << 20), gpu_device=torch.device("cpu"))
    with PrefixStore(tmp_path / "s", SHAPE, disk_config(), memory=cache) as store:
        memory, disk = store.tiers.tiers
        assert type(memory) is MemoryChain and memory.cache is cache
        assert type(disk) is DiskTier and store.tiers.disk is disk
        store_, node, kv = stored(tmp_path, 2, store=store)
        entry = store.entry(node, 0)
        calls = []
        for tier in (memory, disk):
            for name in ("submit_get", "wait", "put"):
                real = getattr(tier, name)
                setattr(tier, name, lambda *a, _r=real, _n=f"{tier.name}.{name}", **k:
                        calls.append(_n) or _r(*a, **k))
        chunks, served = store.tiers.wait(store.tiers.submit(ChunkLoad(entry, {"k": [0, 1]},
                                                                          node=node)))
        assert calls == ["memory.submit_get", "memory.submit_get", "disk.submit_get",
                         "disk.wait", "memory.put", "memory.put"]
        assert served["disk_chunks"] == 2 and served["disk"] > 0
        for i, t in enumerate(chunks["k"]):
            assert same_bits(t, kv_chunk(kv, 0, "k", i).contiguous())
        calls.clear()
        chunks, served = store.tiers.wait(store.tiers.submit(ChunkLoad(entry, {"k": [0, 1]},
                                                                          node=node)))
        assert "disk.submit_get" not in calls and served["cpu"] == 2 * entry.layout.chunk_bytes
        assert memory.metrics()["hits"] == 2


def test_round_trip_is_bit_exact_and_owned(make):
    s = make(8)
    disk = {i: s.payload(i, False) for i in range(4)}
    for i, t in disk.items():
        assert s.fill(i, t) is True
    sent = {i: t.clone() for i, t in disk.items()}
    for t in disk.values():          # the tier keeps its own copy, not the caller's tensor
        t.view(torch.int16).neg_()
    got = read(s.tier, [s.key(2), s.key(9), s.key(0), s.key(3), s.key(1)])
    assert got[1] is None
    for i, t in zip([2, 0, 3, 1], got[:1] + got[2:]):
        assert t is not None and same_bits(t, sent[i])


def test_contains_and_batch_exists_leading_run(make):
    s = make(8)
    for i in (0, 1, 2, 4):
        assert s.fill(i, s.payload(i, False))
    key, tier = s.key, s.tier
    before = tier.metrics()
    assert tier.contains(key(2)) and not tier.contains(key(3))
    assert tier.batch_exists([key(i) for i in range(5)]) == 3
    assert tier.batch_exists([key(3), key(0)]) == 0
    assert tier.batch_exists([key(4), key(0)]) == 2
    assert tier.batch_exists([]) == 0
    after = tier.metrics()             # asking is not an access
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


def test_invalidate_drops_only_those_keys(make):
    s = make(8)
    disk = {i: s.payload(i, False) for i in range(4)}
    for i, t in disk.items():
        s.fill(i, t)
    key, tier = s.key, s.tier
    assert tier.invalidate([key(1), key(3), key(7)]) == 2
    assert tier.invalidate([key(1)]) == 0 and tier.invalidate([]) == 0
    assert not tier.contains(key(1)) and not tier.contains(key(3))
    got = read(tier, [key(0), key(1), key(2), key(3)])
    assert got[1] is None and got[3] is None
    assert same_bits(got[0], disk[0]) and same_bits(got[2], disk[2])


def test_capacity_is_never_exceeded_and_refusals_are_reported(make):
    """Memory tiers refuse or evict by score, the disk evicts whole prefixes
    (disk_capacity_bytes), Redis refuses writes past its maxmemory."""
    s = make(4)
    tier = s.tier
    refused = 0
    for rounds in range(3):
        for i in range(12):
            was = tier.contains(s.key(i))
            taken = s.fill(i, s.payload(100 + i, small=i % 3 == 0))
            refused += not taken
            # A refused offer of a key already held leaves that copy (a full Redis
            # refuses even the rewrite of a held key); nothing else holds a refused key.
            assert tier.contains(s.key(i)) == (taken or was)
            assert s.used() <= s.capacity + s.slack
    assert refused > 0 or tier.metrics().get("evictions", 0) > 0   # something had to give
    held = [i for i in range(12) if tier.contains(s.key(i))]
    assert held and all(same_bits(t, s.payload(100 + i, small=i % 3 == 0))
                        for i, t in zip(held, read(tier, [s.key(i) for i in held])))
    if s.oversize is not None:                               # never fits at all
        assert s.fill(99, s.oversize(7)) is False
        assert not tier.contains(s.key(99)) and read(tier, [s.key(99)]) == [None]
    assert s.used() <= s.capacity + s.slack


def test_a_corrupted_copy_is_never_served(make):
    s = make(4)
    t = s.payload(5, False)
    assert s.fill(0, t) and s.fill(1, s.payload(6, False))
    (served,) = read(s.tier, [s.key(0)])
    assert same_bits(served, t)
    # Mutating what was served reaches the held copy where the tier hands out its own
    # memory; a tier that serves fresh copies must then still serve the original bytes.
    flip_byte(served)
    again = read(s.tier, [s.key(0)])
    assert again[0] is None or same_bits(again[0], t)
    assert read(s.tier, [s.key(0)])[0] is None or same_bits(read(s.tier, [s.key(0)])[0], t)
    # Damage behind the tier's back (a flipped bit in memory, in the layer file, in the
    # Redis value) is a miss, never wrong bytes nor an exception; the copy is gone.
    s.damage(1)
    assert read(s.tier, [s.key(1)]) == [None]
    assert not s.tier.contains(s.key(1))


def test_metrics_counters_move(make):
    s = make(4)
    tier = s.tier
    m0 = tier.metrics()
    names = ("hits", "misses", "bytes_served") + (("bytes_in",) if getattr(
        tier, "writable", True) else ())
    for name in names:
        assert isinstance(m0[name], int)
    assert s.fill(0, s.payload(1, False))
    m1 = tier.metrics()
    if "bytes_in" in names:
        assert m1["bytes_in"] == m0["bytes_in"] + s.chunk_bytes
    read(tier, [s.key(0), s.key(1)])
    m2 = tier.metrics()
    assert m2["hits"] == m1["hits"] + 1 and m2["misses"] == m1["misses"] + 1
    assert m2["bytes_served"] == m1["bytes_served"] + s.chunk_bytes


def test_wait_on_an_empty_key_list(make):
    s = make(4)
    assert s.tier.wait(s.tier.submit_get([])) == []


def test_a_write_once_tier_refuses_every_put(make):
    s = make(4)
    t = s.payload(3, False)
    if getattr(s.tier, "writable", True):
        assert s.tier.put(s.key(0), t, payload_crc(t)) is True
    else:
        assert s.tier.put(s.key(0), t, payload_crc(t)) is False
        assert not s.tier.contains(s.key(0)) and read(s.tier, [s.key(0)]) == [None]
        assert s.fill(0, t) and s.tier.put(s.key(0), t) is False   # held: still refused
        assert same_bits(read(s.tier, [s.key(0)])[0], t)


# ---------------------------------------------------------------------- the disk tier's own
def stored(tmp_path: Path, n_chunks: int, seed: int = 1, store=None):
    """A store holding prefix `seed` of `n_chunks` chunks: (store, node, kv)."""
    store = store or PrefixStore(tmp_path / "s", SHAPE, disk_config())
    kv = disk_kv(random_bits(seed, (2, n_chunks * C, 16)), seed)
    (node,) = store.insert(prefix_tokens(seed, n_chunks), 0, kv)
    return store, node, kv


def kv_chunk(kv, layer: int, kind: str, i: int) -> torch.Tensor:
    return kv[layer][0 if kind == "k" else 1][:, i * C:(i + 1) * C]


def test_disk_reads_each_layer_file_once_whatever_the_keys(tmp_path):
    store, node, kv = stored(tmp_path, 4)
    tier = store.tiers.disk
    n = node.id
    asked = [(n, 1, 1, "v", 2), (n, 0, 1, "k", 3), (n, 0, 1, "v", 0), (n, 1, 1, "k", 1),
             (n, 0, 1, "k", np.int64(3)),            # the same chunk again, a numpy index
             (n, 0, 2, "k", 0), (n, 0, 1, "k", 4), (n, 0, 1, "q", 0), (n, 5, 1, "k", 0),
             (n + 1, 0, 1, "k", 0), ("not", "a", "key"), (n, 0, 1, "k", 1.0)]
    submits = []
    real = store.inspect().state.reader.submit
    store.inspect().state.reader.submit = lambda *a, **k: submits.append(a[0]) or real(*a, **k)
    got = read(tier, asked)
    assert len(submits) == 2 and len(set(submits)) == 2       # one read per layer file
    want = [kv_chunk(kv, 1, "v", 2), kv_chunk(kv, 0, "k", 3), kv_chunk(kv, 0, "v", 0),
            kv_chunk(kv, 1, "k", 1), kv_chunk(kv, 0, "k", 3)]
    for t, w in zip(got, want):
        assert t is not None and same_bits(t, w.contiguous())
    assert got[4] is not got[1]                    # asked twice: two tensors, one each
    assert got[5:] == [None] * 7                   # stale version, out of range, not a key
    assert not any(tier.contains(k) for k in asked[5:])
    m = tier.metrics()
    assert (m["hits"], m["misses"], m["bytes_served"]) == (5, 7, 5 * 2 * C * 16 * 2)
    assert m["chunks_read"] == 4 and m["bytes_read"] > 0     # the duplicate is read once
    store.close()


def test_disk_a_failed_check_is_a_miss_and_quarantines_only_that_node(tmp_path):
    store, a, kv_a = stored(tmp_path, 3, seed=1)
    _, b, kv_b = stored(tmp_path, 2, seed=2, store=store)
    tier = store.tiers.disk
    entry = a.layers[1]
    with open(entry.path, "r+b") as f:             # one bit of A's layer 1 V chunk 2
        f.seek(entry.layout.chunk_offset("v", 2) + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    store.inspect().state.reader.forget(entry.path)
    keys = [(a.id, 0, 1, "k", 1), (a.id, 1, 1, "v", 2), (a.id, 1, 1, "k", 0), (b.id, 1, 1, "v", 1)]
    got = read(tier, keys)
    # A's layer 0 was read whole and checked: served or not, never wrong bytes.
    assert got[0] is None or same_bits(got[0], kv_chunk(kv_a, 0, "k", 1).contiguous())
    assert got[1] is None and got[2] is None       # the damaged file: every key of it
    assert same_bits(got[3], kv_chunk(kv_b, 1, "v", 1).contiguous())
    assert not any(tier.contains(k) for k in keys[:3]) and tier.contains(keys[3])
    m = tier.metrics()
    assert m["corruptions"] == 1 and m["quarantined_nodes"] == 1 and m["corrupt_reads"] == 1
    assert (tmp_path / "s" / "quarantine" / Path(entry.path).name).exists()
    assert store.match_prefix(prefix_tokens(1, 3)).length == 0
    store.close()


def test_disk_invalidate_spares_held_prefixes_and_takes_what_lies_below(tmp_path):
    store, parent, _ = stored(tmp_path, 2)
    longer = prefix_tokens(1, 3)
    kv = disk_kv(random_bits(9, (2, C, 16)), 9)
    (_, child) = store.insert(longer, 2 * C, kv)
    tier = store.tiers.disk
    pkey, ckey = (parent.id, 0, 1, "k", 0), (child.id, 1, 1, "v", 0)
    held = store.match_prefix(longer)              # a request holds the child
    assert tier.invalidate([pkey]) == 0 and tier.contains(pkey) and tier.contains(ckey)
    store.release(held)
    files = [Path(e.path) for n in (parent, child) for e in n.layers]
    assert tier.invalidate([pkey, pkey, (parent.id, 0, 1, "v", 1)]) == 2
    assert not tier.contains(pkey) and not tier.contains(ckey)   # the child went with it
    assert len(store.inspect().state.tree) == 0 and not any(f.exists() for f in files)
    assert tier.metrics()["invalidated_nodes"] == 1 and store.inspect().state.metrics.evictions == 0
    store.close()


def test_disk_a_read_in_flight_keeps_its_files(tmp_path):
    store, node, kv = stored(tmp_path, 2)
    tier = store.tiers.disk
    key = (node.id, 1, 1, "k", 1)
    pending = tier.submit_get([key])
    assert tier.invalidate([key]) == 0             # pinned by the read
    store.quarantine(node, "taken out while a read is in flight")
    path = Path(node.layers[1].path)
    assert path.exists()                           # deleted once the read is done
    (got,) = tier.wait(pending)
    assert same_bits(got, kv_chunk(kv, 1, "k", 1).contiguous()) and not path.exists()
    assert not tier.contains(key)
    store.close()


def test_disk_a_closed_store_answers_misses(tmp_path):
    store, node, _ = stored(tmp_path, 1)
    tier = store.tiers.disk
    key = (node.id, 0, 1, "k", 0)
    assert tier.contains(key)
    store.close()
    assert not tier.contains(key) and tier.batch_exists([key]) == 0
    assert read(tier, [key]) == [None] and tier.invalidate([key]) == 0
    assert tier.metrics()["misses"] == 1


def test_disk_tier_concurrent_reads_and_invalidations_never_serve_wrong_bytes(tmp_path):
    store = PrefixStore(tmp_path / "s", SHAPE, disk_config())
    kvs, keys = {}, {}
    for seed in range(1, 7):
        _, node, kvs[seed] = stored(tmp_path, 2, seed=seed, store=store)
        keys[seed] = (node.id, 1, 1, "v", 1)
    tier = store.tiers.disk
    failures = []

    def reader():
        for _ in range(20):
            for seed, t in zip(kvs, read(tier, list(keys.values()))):
                if t is not None and not same_bits(t, kv_chunk(kvs[seed], 1, "v", 1).contiguous()):
                    failures.append(seed)
    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for seed in kvs:
        tier.invalidate([keys[seed]])
    for t in threads:
        t.join()
    assert not failures
    tier.invalidate(list(keys.values()))           # those a read held then go now
    assert len(store.inspect().state.tree) == 0 and read(tier, list(keys.values())) == [None] * len(keys)
    store.close()


# ---------------------------------------------------------------------- MemoryTier alone
def test_memory_tier_alone_ranks_by_put_count():
    tier = MemoryTier("cpu", 2 * CHUNK_BYTES, "cpu")
    a, b, c = chunk_key(0), chunk_key(1), chunk_key(2)
    assert tier.put(a, chunk(0)) and tier.put(b, chunk(1))
    assert tier.put(a, chunk(0))                       # held: counted, not copied again
    assert tier.metrics()["bytes_in"] == 2 * CHUNK_BYTES
    assert tier.put(c, chunk(2)) is False               # 1 put does not beat b's 1
    assert tier.put(c, chunk(2)) is True                # 2 beats b: b leaves, a (2) stays
    assert tier.contains(a) and tier.contains(c) and not tier.contains(b)
    m = tier.metrics()
    assert m["evictions"] == 1 and m["used_bytes"] == m["capacity_bytes"] == 2 * CHUNK_BYTES
    assert MemoryTier("gpu", 0, "cpu").put(a, chunk(0)) is False     # a disabled tier


def test_memory_tier_without_crc_or_verify_serves_as_is():
    tier = MemoryTier("cpu", CHUNK_BYTES, "cpu")      # verify off: no check on reads
    t = chunk(3)
    tier.put(chunk_key(0), t, payload_crc(t))
    tier.chunks[chunk_key(0)].tensor.view(torch.uint8)[0] ^= 1
    assert read(tier, [chunk_key(0)])[0] is not None
    checked = MemoryTier("cpu", CHUNK_BYTES, "cpu", verify=True)
    checked.put(chunk_key(0), t)                      # no CRC given: never checked
    checked.chunks[chunk_key(0)].tensor.view(torch.uint8)[0] ^= 1
    assert read(checked, [chunk_key(0)])[0] is not None
    assert checked.metrics()["corrupt_copies"] == 0


# ---------------------------------------------------------------------- tier names and order
def test_tier_config_names_and_orders_the_tiers():
    cfg = TierConfig(gpu_bytes=3, cpu_bytes=5)
    gpu, cpu = cfg.memory_tiers()
    assert (gpu.name, gpu.capacity_bytes, cpu.name, cpu.capacity_bytes) == ("gpu", 3, "cpu", 5)
    assert gpu.device == ("cuda" if torch.cuda.is_available() else "cpu") and cpu.device == "cpu"
    assert cfg.memory_tiers(accelerator="cuda:1")[0].device == "cuda:1"
    assert cfg.names(remote=False) == ("gpu", "cpu", DISK)
    assert cfg.names(remote=True) == ("gpu", "cpu", DISK, REMOTE)
    cache = ChunkCache(cfg, gpu_device=torch.device("cpu"))
    assert cache.tier_names == ("gpu", "cpu")
    assert all(isinstance(t, MemoryTier) for t in cache.tiers)
    assert [t.capacity for t in cache.tiers] == [3, 5]


def test_bad_tier_configuration_is_a_user_error():
    with pytest.raises(UserError, match="unknown tier policy"):
        ChunkCache(TierConfig(policy="magic"))
    with pytest.raises(UserError, match="unknown tier 'disk'"):
        ChunkCache(TierConfig(gpu_bytes=1)).resident_keys(DISK)


# ---------------------------------------------------------------------- a chain of N tiers
@dataclasses.dataclass(frozen=True)
class ThreeTiers(TierConfig):
    """Three host tiers of one chunk each, to drive the chain past two tiers."""

    def memory_tiers(self, accelerator: str | None = None) -> tuple[TierSpec, ...]:
        return tuple(TierSpec(f"t{i}", CHUNK_BYTES, "cpu") for i in range(3))


def test_three_tiers_promote_to_the_first_and_demote_down_the_chain():
    cache = ChunkCache(ThreeTiers(policy="lfu", exclusive=True))
    a, b, c, d = (chunk_key(i) for i in range(4))
    disk = {k: chunk(i) for i, k in enumerate((a, b, c, d))}
    assert cache.admit(a, disk[a], 1.0) == "t0"
    for _ in range(2):
        assert cache.get(a, 1.0)[0] == "t0"                 # a: 3 accesses
    assert cache.admit(b, disk[b], 1.0) == "t1"             # 1 does not beat a's 3
    assert cache.get(b, 1.0)[0] == "t1"                     # b: 2, still below a
    assert cache.admit(c, disk[c], 1.0) == "t2"             # 1 beats neither a nor b
    assert [cache.get(c, 1.0)[0] for _ in range(2)] == ["t2", "t2"]   # c: 3 ties a
    assert cache.resident(c) == "t2"
    where, t = cache.get(c, 1.0)                            # c: 4 > 3: promoted
    assert where == "t2" and same_bits(t, disk[c])
    # a is demoted to t1 and pushes b (2 < 3) on to t2, which c's promotion emptied.
    assert [cache.resident(k) for k in (a, b, c)] == ["t1", "t2", "t0"]
    m = cache.metrics
    assert (m["t0"]["promotions"], m["t2"]["promotions"]) == (1, 1)
    assert (m["t0"]["demotions"], m["t1"]["demotions"], m["t2"]["demotions"]) == (1, 2, 1)
    assert m["drops"] == 0
    assert cache.get(d, 1.0) is None                        # a miss counts in every tier
    after = cache.metrics
    assert all(after[n]["misses"] == m[n]["misses"] + 1 for n in cache.tier_names)
    assert cache.admit(d, disk[d], 1.0) is None             # d: 2 beats none of 4, 3, 2
    assert cache.get(d, 1.0) is None
    assert cache.admit(d, disk[d], 1.0) == "t1"             # d: 4 beats a (3), not c (4)
    # a is demoted to the last tier, whose minimum b (2) is dropped to disk-only.
    assert [cache.resident(k) for k in (a, b, c, d)] == ["t2", None, "t0", "t1"]
    assert cache.metrics["drops"] == 1 and cache.metrics["t2"]["evictions"] == 1
    for k in (a, c, d):
        assert same_bits(cache.get(k, 1.0)[1], disk[k])


def test_three_tiers_non_exclusive_admit_offers_every_tier():
    cache = ChunkCache(ThreeTiers(policy="lfu"))
    a, b = chunk_key(0), chunk_key(1)
    assert cache.admit(a, chunk(0), 1.0) == "t0"
    assert [a in cache.resident_keys(n) for n in cache.tier_names] == [True, True, True]
    assert cache.admit(b, chunk(1), 1.0) is None            # every tier holds a (tie)
    assert cache.get(b, 1.0) is None                        # b: 2, then 3 with the admit
    assert cache.admit(b, chunk(1), 1.0) == "t0"            # beats a in every tier
    assert [cache.resident_keys(n) for n in cache.tier_names] == [{b}, {b}, {b}]
    # a left t0 and t1 for free (a copy was still further down), then t2 dropped it.
    m = cache.metrics
    assert m["free_evictions"] == 2 and m["drops"] == 1
    assert cache.duplicate_bytes() == CHUNK_BYTES
    cache.invalidate(1)                                     # node 1: every copy of b
    assert all(not cache.resident_keys(n) for n in cache.tier_names)
