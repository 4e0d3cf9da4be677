"""The prefix KV store: layout, radix tree, crash safety, reorder, eviction, corruption."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from disk_layout.format import INT4_GROUP, decode_probe, encode_probe
from impress_flexgen.errors import UserError
from impress_flexgen.store import CorruptNode, ModelShape, PrefixStore, StoreConfig, StoreFull
from impress_flexgen.tiers import ChunkLoad
from tests.helpers.kv import load_chunks, seeded_kv

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ModelShape("test", n_layers=2, n_kv_heads=2, head_dim=16)
C = 16


def config(**kw):
    base = dict(chunk_size=C, probe_heads=(0, 1), probe_format="fp16", reorder_interval=0)
    base.update(kw)
    return StoreConfig(**base)


# make_kv(n_tokens, seed, start=0): per layer (K, V) of positions start..start+n of the
# deterministic prefix named by `seed`.
make_kv = functools.partial(seeded_kv, SHAPE)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def stored_kv(store, tokens):
    """Whole stored KV of `tokens`' matched prefix, per layer, logical order."""
    match = store.match_prefix(tokens)
    try:
        layers = []
        for layer in range(SHAPE.n_layers):
            ks, vs = [], []
            for node, used in match.segments:
                k, v = store.inspect().reads.read_layer(store.entry(node, layer), node)
                ks.append(k[:, :used])
                vs.append(v[:, :used])
            layers.append((torch.cat(ks, 1), torch.cat(vs, 1)))
        return match.length, layers
    finally:
        store.release(match)


def test_round_trip_is_bit_exact(tmp_path):
    tokens = np.arange(3 * C + 5)  # the 5 trailing tokens are not a whole chunk
    kv = make_kv(len(tokens), seed=1)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(tokens, 0, kv)
        length, got = stored_kv(store, tokens)
    assert length == 3 * C
    for (k, v), (k2, v2) in zip(kv, got):
        assert torch.equal(bits(k[:, :length]), bits(k2)) and torch.equal(bits(v[:, :length]), bits(v2))


@pytest.mark.parametrize("packed", [False, True])
def test_files_are_aligned_and_head_major(tmp_path, packed):
    tokens = np.arange(2 * C)
    kv = make_kv(len(tokens), seed=2)
    with PrefixStore(tmp_path / "s", SHAPE, config(packed=packed)) as store:
        (node,) = store.insert(tokens, 0, kv)
        entry = store.entry(node, 1)
        lay = entry.layout
        assert lay.packed == packed
        assert os.path.getsize(entry.path) == lay.file_bytes
        assert lay.chunk_offset("k", 0) % 4096 == 0 and lay.chunk_offset("v", 0) % 4096 == 0
        if packed:   # no padding between chunks
            assert lay.chunk_offset("k", 1) - lay.chunk_offset("k", 0) == lay.chunk_bytes
        else:
            assert lay.chunk_stride % 4096 == 0
        raw = Path(entry.path).read_bytes()
        off = lay.chunk_offset("v", 1)
        chunk = np.frombuffer(raw[off:off + lay.chunk_bytes], dtype=np.float16)
        expect = kv[1][1][:, C:2 * C, :].contiguous().numpy().reshape(-1)  # (heads, C, d)
        assert np.array_equal(chunk, expect)


def test_radix_split_and_sharing(tmp_path):
    a = np.arange(4 * C)
    b = np.concatenate([a[:2 * C], 1000 + np.arange(3 * C)])  # shares two chunks with a
    kv_a, kv_b = make_kv(len(a), seed=3), make_kv(len(b), seed=4)
    # b's KV for the shared part must equal a's (same tokens, same positions): use a's.
    kv_b = [(torch.cat([ka[:, :2 * C], kb[:, 2 * C:]], 1), torch.cat([va[:, :2 * C], vb[:, 2 * C:]], 1))
            for (ka, va), (kb, vb) in zip(kv_a, kv_b)]
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(a, 0, kv_a)
        m = store.match_prefix(b)
        assert m.length == 2 * C and len(m.segments) == 1
        store.release(m)
        nodes = store.insert(b, m.length, [(k[:, 2 * C:], v[:, 2 * C:]) for k, v in kv_b])
        assert [n.n_tokens for n in nodes] == [2 * C, 3 * C]
        assert store.inspect().state.metrics.splits == 1 and len(store.inspect().state.tree) == 3
        for tokens, kv in ((a, kv_a), (b, kv_b)):
            length, got = stored_kv(store, tokens)
            assert length == len(tokens)
            for (k, v), (k2, v2) in zip(kv, got):
                assert torch.equal(bits(k), bits(k2)) and torch.equal(bits(v), bits(v2))
        # Retired files of the split node are gone; nothing unreferenced stays on disk.
        referenced = {Path(e.path).name for n in store.inspect().state.tree.nodes.values() for e in n.layers}
        assert {f.name for f in (tmp_path / "s" / "data").iterdir()} == referenced


@pytest.mark.slow
def test_store_survives_restart_in_a_new_process(tmp_path):
    tokens = np.arange(5 * C)
    kv = make_kv(len(tokens), seed=5)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(tokens, 0, kv)
    code = textwrap.dedent(f"""
        import numpy as np, torch, sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.test_prefix_store import SHAPE, config, stored_kv, make_kv, bits
        from impress_flexgen.store import PrefixStore
        tokens = np.arange({5 * C})
        with PrefixStore({str(tmp_path / 's')!r}, SHAPE, config()) as store:
            assert store.inspect().reopened
            length, got = stored_kv(store, tokens)
        kv = make_kv(len(tokens), seed=5)
        ok = length == len(tokens) and all(torch.equal(bits(k), bits(k2)) and
                                           torch.equal(bits(v), bits(v2))
                                           for (k, v), (k2, v2) in zip(kv, got))
        print("SAME" if ok else "DIFFERENT", length)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert "SAME" in r.stdout, r.stderr


def test_reorder_keeps_logical_kv_and_concurrent_readers_see_no_change(tmp_path):
    tokens = np.arange(8 * C)
    kv = make_kv(len(tokens), seed=6)
    rng = np.random.default_rng(0)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        (node,) = store.insert(tokens, 0, kv)
        stop, errors, reads = threading.Event(), [], [0]

        def reader():
            while not stop.is_set():
                for layer in range(SHAPE.n_layers):
                    entry = store.entry(node, layer)
                    k, v = store.inspect().reads.read_layer(entry, node)
                    if not (torch.equal(bits(k), bits(kv[layer][0])) and
                            torch.equal(bits(v), bits(kv[layer][1]))):
                        errors.append(entry.version)
                    reads[0] += 1

        match = store.match_prefix(tokens)  # hold the node, as a request in flight does
        t = threading.Thread(target=reader)
        t.start()
        for _ in range(6):
            for layer in range(SHAPE.n_layers):
                entry = store.entry(node, layer)
                store.record_selection(entry, rng.random(len(tokens)).astype(np.float32), None)
            assert store.reorder_now() == SHAPE.n_layers
        stop.set()
        t.join()
        store.release(match)
        assert not errors and reads[0] > 0
        assert store.inspect().state.metrics.reorders == 6 * SHAPE.n_layers
        entry = store.entry(node, 0)
        assert entry.version == 7 and entry.mapping is not None
        # Sink chunk and last chunk stay in place.
        assert np.array_equal(entry.mapping[:C], np.arange(C))
        assert np.array_equal(entry.mapping[-C:], np.arange(len(tokens) - C, len(tokens)))
        # Old versions were deleted once the request released the node.
        assert len(list((tmp_path / "s" / "data").iterdir())) == SHAPE.n_layers
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:  # the mapping persists
        _, got = stored_kv(store, tokens)
        assert torch.equal(bits(got[0][0]), bits(kv[0][0]))


def test_importance_reorder_concentrates_important_tokens(tmp_path):
    tokens = np.arange(8 * C)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        (node,) = store.insert(tokens, 0, make_kv(len(tokens), seed=7))
        important = np.zeros(len(tokens), bool)
        important[np.random.default_rng(1).choice(np.arange(C, 7 * C), 2 * C, replace=False)] = True
        before = store.entry(node, 0).physical_chunks_of(np.flatnonzero(important))
        store.record_selection(store.entry(node, 0), important.astype(np.float32), important)
        store.inspect().reorderer.reorder_node(node, [0])
        after = store.entry(node, 0).physical_chunks_of(np.flatnonzero(important))
        assert len(after) == 2 < len(before)


def test_uncommitted_files_are_removed_on_open(tmp_path):
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(np.arange(2 * C), 0, make_kv(2 * C, seed=8))
    data = tmp_path / "s" / "data"
    (data / "deadbeef.kv").write_bytes(b"x" * 100)
    (data / "cafe.kv.tmp").write_bytes(b"y")
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        assert len(store.inspect().state.tree) == 1
    assert sorted(f.suffix for f in data.iterdir()) == [".kv", ".kv"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corruption_is_detected_never_served(tmp_path, damage):
    tokens = np.arange(4 * C)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        (node,) = store.insert(tokens, 0, make_kv(len(tokens), seed=9))
        entry = store.entry(node, 1)
        path = Path(entry.path)
        if damage == "flip":
            with open(path, "r+b") as f:
                f.seek(entry.layout.chunk_offset("v", 2) + 7)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x10]))
        elif damage == "truncate":
            os.truncate(path, entry.layout.chunk_offset("v", 1))
        else:
            path.unlink()
        store.inspect().state.reader.forget(str(path))
        with pytest.raises(CorruptNode) as err:
            store.inspect().reads.read_layer(entry, node)
        assert err.value.node is node
        store.quarantine(node, str(err.value))
        assert len(store.inspect().state.tree) == 0 and store.match_prefix(tokens).length == 0


def test_probe_copy_int4_is_close_and_small():
    keys = torch.randn(3, 64, 64)
    q = decode_probe(encode_probe(keys, "int4"), "int4", (3, 64, 64))
    f = decode_probe(encode_probe(keys, "fp16"), "fp16", (3, 64, 64))
    groups = keys.reshape(-1, INT4_GROUP)
    step = (groups.max(1).values - groups.min(1).values) / 15
    assert ((q - keys).reshape(-1, INT4_GROUP).abs() <= step[:, None] * 0.51 + 1e-2).all()
    assert torch.allclose(f, keys, atol=2e-3)
    # 4 bits per value plus an fp16 scale and minimum per 32 values: 3.2x smaller than fp16
    assert len(encode_probe(keys, "int4")) * 3.2 == len(encode_probe(keys, "fp16"))


def test_probe_int4_constant_groups_round_trip_without_dividing_by_zero():
    """A group of equal values has a zero range: its codes are all zero and decode gives
    the constant back exactly, with no 0/0 on the way (numpy errors are raised here)."""
    keys = torch.randn(3, 64, 64)
    keys[0] = 0.0                                 # constant groups of zeros
    keys[1, :32] = 0.7                            # constant non-zero groups
    keys[2, 0, :INT4_GROUP] = 1.0                 # one constant group among varied ones
    keys[2, 1, :INT4_GROUP] = 1.0 + torch.arange(INT4_GROUP) * 1e-7  # range below fp16's step
    with np.errstate(all="raise"):
        raw = encode_probe(keys, "int4")
    back = decode_probe(raw, "int4", (3, 64, 64))
    assert not back.isnan().any()
    exact = keys.half().float()
    assert torch.equal(back[0], exact[0])
    assert torch.equal(back[1, :32], exact[1, :32])
    assert torch.equal(back[2, 0, :INT4_GROUP], exact[2, 0, :INT4_GROUP])
    assert (back[2, 1, :INT4_GROUP] - keys[2, 1, :INT4_GROUP]).abs().max() < 1e-5


@pytest.mark.parametrize("fmt", ["int4", "fp16"])
def test_probe_decode_from_a_read_buffer_equals_the_plain_formula(fmt):
    """The store decodes straight from the reader's uint8 buffer (a slice of a longer,
    page-padded run); the result is the format's formula, value for value."""
    shape = (3, 96, 64)
    raw = encode_probe(torch.randn(*shape) * 4, fmt)
    run = torch.zeros(len(raw) + 4096, dtype=torch.uint8)
    run[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    got = decode_probe(run[:len(raw)], fmt, shape)
    assert torch.equal(got, decode_probe(raw, fmt, shape))
    n = int(np.prod(shape))
    if fmt == "fp16":
        want = np.frombuffer(raw, np.float16).astype(np.float32)
    else:
        packed = np.frombuffer(raw, np.uint8, count=n // 2)
        nibbles = np.stack([packed & 15, packed >> 4], 1).reshape(-1, INT4_GROUP)
        scale, low = np.frombuffer(raw, np.float16, offset=n // 2).reshape(-1, 2).T
        want = nibbles.astype(np.float32) * scale.astype(np.float32)[:, None] \
            + low.astype(np.float32)[:, None]
    assert torch.equal(got, torch.from_numpy(want.reshape(shape).astype(np.float32)))


def test_capacity_evicts_unlocked_leaves(tmp_path):
    one_node = None
    with PrefixStore(tmp_path / "probe", SHAPE, config()) as store:
        store.insert(np.arange(2 * C), 0, make_kv(2 * C, 1))
        one_node = store.inspect().accounting.disk_bytes()
    cap = int(2.5 * one_node)
    with PrefixStore(tmp_path / "s", SHAPE, config(disk_capacity_bytes=cap)) as store:
        prefixes = [i * 10000 + np.arange(2 * C) for i in range(4)]
        store.insert(prefixes[0], 0, make_kv(2 * C, 0))
        held = store.match_prefix(prefixes[0])  # in use: must survive
        for i in (1, 2, 3):
            store.insert(prefixes[i], 0, make_kv(2 * C, i))
            assert store.inspect().accounting.disk_bytes() <= cap
        assert store.inspect().state.metrics.evictions == 2
        assert store.match_prefix(prefixes[0]).length == 2 * C
        assert store.match_prefix(prefixes[3]).length == 2 * C
        store.release(held)
    with PrefixStore(tmp_path / "t", SHAPE, config(disk_capacity_bytes=one_node // 2)) as store:
        with pytest.raises(StoreFull):
            store.insert(np.arange(2 * C), 0, make_kv(2 * C, 0))


def test_directory_checks(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        PrefixStore(other, SHAPE, config())
    with PrefixStore(tmp_path / "s", SHAPE, config()):
        with pytest.raises(UserError, match="in use"):
            PrefixStore(tmp_path / "s", SHAPE, config())
    with pytest.raises(UserError, match="chunk_size"):
        PrefixStore(tmp_path / "s", SHAPE, config(chunk_size=32))
    with pytest.raises(UserError, match="model"):
        PrefixStore(tmp_path / "s", ModelShape("other", 2, 2, 16), config())


def test_metadata_overhead_is_measured(tmp_path):
    shape = ModelShape("opt-like", n_layers=4, n_kv_heads=32, head_dim=128)
    with PrefixStore(tmp_path / "s", shape, StoreConfig(chunk_size=64, probe_heads=(0, 1, 2),
                                                        reorder_interval=0)) as store:
        n = 1024
        kv = [(torch.randn(32, n, 128).half(), torch.randn(32, n, 128).half()) for _ in range(4)]
        (node,) = store.insert(np.arange(n), 0, kv)
        for layer in range(4):
            store.record_selection(store.entry(node, layer), np.ones(n, np.float32),
                                   np.ones(n, bool), range(4))
        o = store.inspect().accounting.overheads()
    assert o["kv_bytes"] == 2 * 4 * n * 32 * 128 * 2
    assert 0 < o["metadata_fraction"] < 0.005
    assert o["probe_fraction"] < 3 / 32 / 2  # int4 copy of 3 of 32 heads' keys


@pytest.mark.parametrize("policy", ["score", "lru", "lfu"])
@pytest.mark.parametrize("exclusive", [True, False])
def test_disk_cpu_gpu_round_trips_are_bit_exact(tmp_path, policy, exclusive):
    """Chunks moving disk -> CPU tier -> GPU tier -> CPU tier come back bit for bit."""
    from impress_flexgen.tiers import ChunkCache, TierConfig

    tokens = np.arange(8 * C)
    kv = make_kv(len(tokens), seed=11)
    chunk = SHAPE.n_kv_heads * C * SHAPE.head_dim * 2
    # Tiers smaller than the node: chunks are promoted, demoted and dropped as they go.
    cache = ChunkCache(TierConfig(gpu_bytes=3 * chunk, cpu_bytes=4 * chunk, policy=policy,
                                  exclusive=exclusive))
    rng = np.random.default_rng(2)
    with PrefixStore(tmp_path / "s", SHAPE, config(), memory=cache) as store:
        (node,) = store.insert(tokens, 0, make_kv(len(tokens), seed=11))
        served = {"gpu": 0, "cpu": 0, "disk": 0}
        for _ in range(60):
            layer, kind = int(rng.integers(2)), "kv"[int(rng.integers(2))]
            ids = sorted(rng.choice(8, size=int(rng.integers(1, 5)), replace=False).tolist())
            entry = store.entry(node, layer)
            chunks, by_tier = load_chunks(store, entry, {kind: ids}, node,
                                          {kind: rng.random(len(ids))})
            chunks = chunks[kind]
            for tier in served:
                served[tier] += by_tier[tier]
            want = kv[layer][0 if kind == "k" else 1]
            for i, t in zip(ids, chunks):
                assert torch.equal(bits(t.cpu()), bits(want[:, i * C:(i + 1) * C]))
        m = cache.metrics
        assert served["gpu"] > 0 and served["cpu"] > 0 and served["disk"] > 0
        assert m["gpu"]["promotions"] > 0
        assert m["gpu"]["used_bytes"] <= 3 * chunk and m["cpu"]["used_bytes"] <= 4 * chunk
        # A reorder makes the old version's cached chunks unreachable: they are dropped.
        store.record_selection(store.entry(node, 0), rng.random(len(tokens)).astype(np.float32), None)
        store.inspect().reorderer.reorder_node(node, [0])
        assert not any(k[1] == 0 and k[2] == 1 for tier in ("gpu", "cpu")
                       for k in cache.resident_keys(tier))


@pytest.mark.parametrize("chunk_size", [16, 24, 48])
def test_packed_reads_any_selection_bit_exact(tmp_path, chunk_size):
    """Packed chunks (not page multiples) read back exactly for any set of chunk ids, and
    reading a run of neighbours costs fewer bytes than padding every chunk would."""
    shape = ModelShape("odd", n_layers=1, n_kv_heads=3, head_dim=64)   # 6 KiB per 16 tokens
    n = 20 * chunk_size
    kv = seeded_kv(shape, n, 5)
    cfg = StoreConfig(chunk_size=chunk_size, probe_heads=(0,), probe_format="fp16",
                      reorder_interval=0)
    rng = np.random.default_rng(3)
    with PrefixStore(tmp_path / "s", shape, cfg) as store:
        (node,) = store.insert(np.arange(n), 0, kv)
        entry = store.entry(node, 0)
        assert entry.layout.packed
        for _ in range(30):
            ids = rng.choice(20, size=int(rng.integers(1, 21)), replace=False).tolist()
            for kind, full in (("k", kv[0][0]), ("v", kv[0][1])):
                chunks, nbytes = store.inspect().reads.read_chunks_counted(entry, kind, ids, node)
                for i, t in zip(ids, chunks):
                    assert torch.equal(t, full[:, i * chunk_size:(i + 1) * chunk_size])
                assert nbytes % 4096 == 0
        _, run_bytes = store.inspect().reads.read_chunks_counted(entry, "k", list(range(20)), node)
        assert run_bytes < 20 * entry.layout.chunk_bytes + 2 * 4096
        # A corrupt packed chunk is detected and names its chunk.
        with open(entry.path, "r+b") as f:
            f.seek(entry.layout.chunk_offset("v", 7) + 5)
            byte = f.read(1)
            f.seek(entry.layout.chunk_offset("v", 7) + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(CorruptNode, match="V chunk 7"):
            store.inspect().reads.read_chunks_counted(entry, "v", [6, 7, 8], node)


@pytest.mark.parametrize("hot", [0.25, 1.0])
def test_reorder_packs_hot_tokens_and_keeps_the_rest_in_order(tmp_path, hot):
    n = 8 * C
    tokens = np.arange(n)
    with PrefixStore(tmp_path / "s", SHAPE, config(reorder_hot_fraction=hot)) as store:
        (node,) = store.insert(tokens, 0, make_kv(n, seed=4))
        importance = np.random.default_rng(0).random(n).astype(np.float32)
        store.record_selection(store.entry(node, 0), importance, None)
        store.inspect().reorderer.reorder_node(node, [0])
        mapping = store.entry(node, 0).mapping
        middle = mapping[C:n - C]                      # sink and last chunk stay in place
        assert np.array_equal(mapping[:C], np.arange(C))
        assert np.array_equal(mapping[n - C:], np.arange(n - C, n))
        ranked = C + np.argsort(-importance[C:n - C], kind="stable")
        if hot == 1.0:
            assert np.array_equal(middle, ranked)
        else:
            n_hot = int(np.ceil(hot * (n - 2 * C) / C)) * C
            assert np.array_equal(middle[:n_hot], ranked[:n_hot])
            cold = middle[n_hot:]
            assert np.all(np.diff(cold) > 0)           # positional order


def test_selection_on_the_head_of_a_node_is_recorded(tmp_path):
    """A request that uses only the first chunks of a node feeds back only those tokens."""
    tokens = np.arange(4 * C)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        (node,) = store.insert(tokens, 0, make_kv(len(tokens), seed=6))
        entry = store.entry(node, 0)
        scores = np.ones(2 * C, np.float32)
        store.record_selection(entry, scores, np.ones(2 * C, bool))
        imp = store.inspect().state.stats[(node.id, 0)].importance
        assert imp[:2 * C].sum() == 2 * C and imp[2 * C:].sum() == 0
        assert list(store.inspect().state.stats[(node.id, 0)].ratio) == [255, 255, 0, 0]


@pytest.mark.parametrize("packed", [False, True])
def test_reading_no_chunks_reads_nothing(tmp_path, packed):
    with PrefixStore(tmp_path / "s", SHAPE, config(packed=packed)) as store:
        (node,) = store.insert(np.arange(2 * C), 0, make_kv(2 * C, seed=8))
        entry = store.entry(node, 0)
        assert store.inspect().reads.read_chunks(entry, "k", [], node) == []
        chunks, served = load_chunks(store, entry, {"v": []}, node)
        assert chunks["v"] == [] and served["disk"] == 0


@pytest.mark.parametrize("packed", [False, True])
def test_k_and_v_load_in_one_round_trip(tmp_path, packed):
    """load_kv_chunks reads K and V together (one submission, reads of both in flight) and
    gives exactly what separate loads give; a corrupt V chunk is still caught."""
    # 3 heads x 16 tokens x 64 x fp16 = 6 KiB chunks are packed; 2 heads make 4 KiB pages.
    shape = ModelShape("kv", n_layers=1, n_kv_heads=3 if packed else 2, head_dim=64)
    n = 8 * C
    kv = seeded_kv(shape, n, 9)
    with PrefixStore(tmp_path / "s", shape, config()) as store:
        (node,) = store.insert(np.arange(n), 0, kv)
        entry = store.entry(node, 0)
        assert entry.layout.packed == packed
        submits = []
        real_submit = store.inspect().state.reader.submit
        store.inspect().state.reader.submit = lambda *a, **k: submits.append(a[0]) or real_submit(*a, **k)
        ids_k, ids_v = [5, 1, 2], [0, 2, 7]
        got, served = load_chunks(store, entry, {"k": ids_k, "v": ids_v}, node)
        assert len(submits) == 1 and served["disk_chunks"] == 6
        for kind, ids, want in (("k", ids_k, kv[0][0]), ("v", ids_v, kv[0][1])):
            for i, t in zip(ids, got[kind]):
                assert torch.equal(bits(t), bits(want[:, i * C:(i + 1) * C]))
        store.inspect().state.reader.submit = real_submit
        # The two halves: start submits, finish waits; a bad V chunk raises at finish.
        v_off = entry.layout.chunk_offset("v", 0) + 7 * entry.layout.chunk_stride
        with open(entry.path, "r+b") as f:
            f.seek(v_off + 10)
            byte = f.read(1)
            f.seek(v_off + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
        pending = store.tiers.submit(ChunkLoad(entry, {"k": [0], "v": [7]}, node=node))
        with pytest.raises(CorruptNode, match="V chunk 7"):
            store.tiers.wait(pending)


def test_last_selection_survives_a_reorder_and_stale_entries_leave_it_alone(tmp_path):
    """The chunks the last query selected are the prefetch guess: after a reorder they are
    the chunks now holding those tokens; a selection recorded against a replaced layout
    does not overwrite it."""
    n = 8 * C
    tokens = np.arange(n)
    with PrefixStore(tmp_path / "s", SHAPE, config(reorder_hot_fraction=1.0)) as store:
        (node,) = store.insert(tokens, 0, make_kv(n, seed=12))
        entry = store.entry(node, 0)
        assert store.last_selected_chunks(entry).tolist() == []
        selected = np.zeros(n, bool)
        selected[5 * C:6 * C] = True                       # logical chunk 5
        importance = np.zeros(n, np.float32)
        importance[5 * C:6 * C] = 1.0
        store.record_selection(entry, importance, selected)
        assert store.last_selected_chunks(entry).tolist() == [5]
        store.inspect().reorderer.reorder_node(node, [0])
        new = store.entry(node, 0)
        assert new is not entry and new.mapping is not None
        assert store.last_selected_chunks(entry).tolist() == []     # stale layout: no guess
        want = np.unique(new.physical_of[5 * C:6 * C] // C).tolist()
        assert store.last_selected_chunks(new).tolist() == want == [1]   # after the sink
        other = np.zeros(n, bool)
        other[:C] = True
        store.record_selection(entry, None, other)                  # the old version's
        assert store.last_selected_chunks(new).tolist() == want


def test_prefetched_chunks_serve_a_load_as_a_disk_read_would(tmp_path):
    """Chunks read ahead are taken instead of read again, and the tiers count and admit
    exactly as when the load reads them itself."""
    from impress_flexgen.tiers import ChunkCache, TierConfig

    n = 8 * C
    kv = make_kv(n, seed=13)
    chunk = SHAPE.n_kv_heads * C * SHAPE.head_dim * 2
    outcomes = []
    for ahead in (False, True):
        cache = ChunkCache(TierConfig(gpu_bytes=0, cpu_bytes=6 * chunk, policy="lru"))
        with PrefixStore(tmp_path / f"s{ahead}", SHAPE, config(), memory=cache) as store:
            (node,) = store.insert(np.arange(n), 0, kv)
            entry = store.entry(node, 0)
            load_chunks(store, entry, {"k": [1, 2]}, node)            # now in the CPU tier
            early = None
            if ahead:
                read = store.tiers.prefetch(ChunkLoad(entry, {"k": [1, 2, 3, 4], "v": [4]}, node=node))
                assert read.wanted["k"] == [3, 4]     # tier-resident ones skipped
                early, nbytes = store.tiers.finish_prefetch(read)
                assert nbytes > 0
            load = store.tiers.submit(ChunkLoad(entry, {"k": [2, 3, 5], "v": [4, 6]}, node=node),
                                      ahead=early)
            got, served = store.tiers.wait(load)
            for kind, ids in (("k", [2, 3, 5]), ("v", [4, 6])):
                want = kv[0][0 if kind == "k" else 1]
                for i, t in zip(ids, got[kind]):
                    assert torch.equal(bits(t), bits(want[:, i * C:(i + 1) * C]))
            outcomes.append((served["cpu"], cache.metrics["cpu"],
                             sorted(cache.resident_keys("cpu"))))
            if ahead:
                assert served["disk_chunks"] == 2          # k5 and v6; k3 and v4 came ahead
    assert outcomes[0][0] == outcomes[1][0]
    assert outcomes[0][1] == outcomes[1][1]
    assert [k[3:] for k in outcomes[0][2]] == [k[3:] for k in outcomes[1][2]]
