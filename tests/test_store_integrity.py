"""The store never serves wrong KV and never touches files outside itself: identities,
paths, metadata integrity, full databases, I/O errors, quarantine bounds."""
from __future__ import annotations

import errno
import os
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import disk_layout.io as disk_io
from disk_layout.metadata import layer_crc
from impress_flexgen.errors import UserError
from impress_flexgen.store import (CorruptNode, ModelShape, PrefixStore, StoreConfig, StoreFull,
                                   StoreWriteFailed)
from impress_flexgen.tiers import ChunkCache, ChunkLoad, TierConfig
from tests.helpers.kv import load_chunks, token_kv

SHAPE = ModelShape("trust", n_layers=2, n_kv_heads=2, head_dim=16)
C = 16


def config(**kw):
    base = dict(chunk_size=C, probe_heads=(0, 1), probe_format="fp16", reorder_interval=0)
    base.update(kw)
    return StoreConfig(**base)


def make_kv(tokens, start: int = 0):
    """KV that is a function of the token ids, so any prefix's is known."""
    return token_kv(tokens, SHAPE, start)


def stored(store, tokens):
    """(matched length, per layer (K, V) in logical order) through the tiers."""
    match = store.match_prefix(tokens)
    try:
        layers = []
        for layer in range(SHAPE.n_layers):
            ks, vs = [], []
            for node, used in match.segments:
                entry = store.entry(node, layer)
                ids = list(range(used // C))
                chunks, _ = load_chunks(store, entry, {"k": ids, "v": ids}, node)
                for kind, out in (("k", ks), ("v", vs)):
                    phys = torch.cat(chunks[kind], 1)
                    logical = torch.empty_like(phys)
                    pos = entry.logical_positions(ids)
                    logical[:, torch.from_numpy(pos)] = phys
                    out.append(logical[:, :used])
            layers.append((torch.cat(ks, 1), torch.cat(vs, 1)))
        return match.length, layers
    finally:
        store.release(match)


def assert_exact(store, tokens, length):
    got_len, got = stored(store, tokens)
    assert got_len == length
    for (k, v), (k2, v2) in zip(make_kv(tokens[:length]), got):
        assert torch.equal(k.view(torch.int16), k2.view(torch.int16))
        assert torch.equal(v.view(torch.int16), v2.view(torch.int16))


def tiers():
    chunk = SHAPE.n_kv_heads * C * SHAPE.head_dim * 2
    return ChunkCache(TierConfig(gpu_bytes=8 * chunk, cpu_bytes=32 * chunk),
                      gpu_device=torch.device("cpu"))


def tokens_of(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, n).astype(np.int32)


# -- 1. identities ------------------------------------------------------------------------
def test_node_ids_are_never_reused_after_eviction_and_reopen(tmp_path):
    seen = set()
    for round_ in range(3):
        with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
            for i in range(3):
                t = tokens_of(100 * round_ + i, 2 * C)
                (node,) = store.insert(t, 0, make_kv(t))
                assert node.id not in seen
                seen.add(node.id)
                assert store.inspect().removal.evict_leaf() is node      # the highest id goes first
    assert len(seen) == 9


def test_stale_tier_copies_of_a_split_node_are_refused(tmp_path):
    """A load through the tiers with an entry of a node that a split replaced (as decode over
    the full prefix does after its own insert) must not leave copies under the dead id."""
    with PrefixStore(tmp_path / "s", SHAPE, config(), memory=tiers()) as store:
        a = tokens_of(1, 4 * C)
        store.insert(a, 0, make_kv(a))
        match = store.match_prefix(a)                  # the request holds the node
        node = match.nodes[0]
        old = [store.entry(node, layer) for layer in range(SHAPE.n_layers)]
        b = np.concatenate([a[:2 * C], tokens_of(2, 2 * C)])
        store.insert(b, 2 * C, make_kv(b, 2 * C))
        assert not node.live
        for entry in old:                              # late loads of the old version
            load_chunks(store, entry, {"k": [0, 1], "v": [0, 1]}, node)
        store.release(match)
        for tier in ("gpu", "cpu"):
            assert not [k for k in store.tiers.cache.resident_keys(tier) if k[0] == node.id]
        assert_exact(store, a, 4 * C)
        assert_exact(store, b, 4 * C)


def test_late_read_after_split_then_new_prefix_serves_its_own_kv(tmp_path):
    with PrefixStore(tmp_path / "s", SHAPE, config(), memory=tiers()) as store:
        a = tokens_of(3, 4 * C)
        store.insert(a, 0, make_kv(a))
        match = store.match_prefix(a)
        node = match.nodes[0]
        entry = store.entry(node, 0)
        load = store.tiers.submit(ChunkLoad(entry, {"k": [0, 1, 2, 3], "v": [0, 1, 2, 3]}, node=node))
        b = np.concatenate([a[:C], tokens_of(4, 3 * C)])
        store.insert(b, C, make_kv(b, C))               # splits node while A reads it
        store.tiers.wait(load)                    # A's late admits
        store.release(match)
        while store.inspect().removal.evict_leaf() is not None:
            pass
        c = tokens_of(5, 4 * C)
        (fresh,) = store.insert(c, 0, make_kv(c))
        assert fresh.id != node.id
        for _ in range(3):                              # disk, then the tiers
            assert_exact(store, c, 4 * C)


# -- 2. paths -----------------------------------------------------------------------------
def _set_file(db_path, node_id, layer, name):
    """Point a layer row at `name`, with a row checksum that matches (so only the name
    check can catch it)."""
    db = sqlite3.connect(db_path)
    node, ver, mapping, crcs = db.execute(
        "SELECT node, version, mapping, crcs FROM layers WHERE node = ? AND layer = ?",
        (node_id, layer)).fetchone()
    db.execute("UPDATE layers SET file = ?, crc = ? WHERE node = ? AND layer = ?",
               (name, layer_crc(node, layer, ver, name, mapping, crcs), node_id, layer))
    db.commit()
    db.close()


@pytest.mark.parametrize("name", ["../../victim.kv", "ABSOLUTE", "sub/x.kv", ".."])
def test_file_names_from_metadata_never_escape_the_store(tmp_path, name):
    victim = tmp_path / "victim.kv"
    victim.write_bytes(b"not the store's")
    if name == "ABSOLUTE":
        name = str(victim)
    sdir = tmp_path / "s"
    t = tokens_of(6, 2 * C)
    with PrefixStore(sdir, SHAPE, config()) as store:
        (node,) = store.insert(t, 0, make_kv(t))
        nid = node.id
    _set_file(sdir / "store.sqlite", nid, 1, name)
    with PrefixStore(sdir, SHAPE, config()) as store:
        assert store.match_prefix(t).length == 0       # not served
        assert store.inspect().state.metrics.invalid_rows == 1
        store.insert(t, 0, make_kv(t))
        while store.inspect().removal.evict_leaf() is not None:
            pass
    assert victim.read_bytes() == b"not the store's"


def test_symlinked_layer_file_is_corrupt_and_its_target_untouched(tmp_path):
    """Even a link to a file with the right bytes is refused: the store reads only its own
    regular files."""
    victim = tmp_path / "victim.kv"
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        t = tokens_of(7, 2 * C)
        (node,) = store.insert(t, 0, make_kv(t))
        entry = store.entry(node, 0)
        victim.write_bytes(Path(entry.path).read_bytes())
        original = victim.read_bytes()
        os.unlink(entry.path)
        os.symlink(victim, entry.path)
        store.inspect().state.reader.forget(entry.path)
        with pytest.raises(CorruptNode):
            store.inspect().reads.read_layer(entry, node)
        store.quarantine(node, "symlink")
        assert store.match_prefix(t).length == 0
    assert victim.read_bytes() == original


# -- 3. metadata integrity -----------------------------------------------------------------
def _flip_mapping_bit(db_path, node_id, layer):
    db = sqlite3.connect(db_path)
    (blob,) = db.execute("SELECT mapping FROM layers WHERE node = ? AND layer = ?",
                         (node_id, layer)).fetchone()
    flipped = bytearray(blob)
    flipped[3] ^= 0x01
    db.execute("UPDATE layers SET mapping = ? WHERE node = ? AND layer = ?",
               (bytes(flipped), node_id, layer))
    db.commit()
    db.close()


def _reordered_store(sdir):
    t = tokens_of(8, 6 * C)
    with PrefixStore(sdir, SHAPE, config()) as store:
        (node,) = store.insert(t, 0, make_kv(t))
        entry = store.entry(node, 0)
        store.record_selection(entry, np.random.default_rng(0).random(6 * C), None)
        assert store.inspect().reorderer.reorder_node(node, [0]) == 1
        assert store.entry(node, 0).mapping is not None
        return t, node.id


def test_flipped_bit_in_a_mapping_is_detected(tmp_path):
    sdir = tmp_path / "s"
    t, nid = _reordered_store(sdir)
    _flip_mapping_bit(sdir / "store.sqlite", nid, 0)
    with PrefixStore(sdir, SHAPE, config()) as store:
        assert store.match_prefix(t).length == 0
        assert store.inspect().state.metrics.invalid_rows == 1
        store.insert(t, 0, make_kv(t))
        assert_exact(store, t, 6 * C)


def test_short_mapping_with_a_matching_checksum_is_refused(tmp_path):
    sdir = tmp_path / "s"
    t, nid = _reordered_store(sdir)
    db = sqlite3.connect(sdir / "store.sqlite")
    ver, file, crcs = db.execute("SELECT version, file, crcs FROM layers WHERE node = ? AND "
                                 "layer = 0", (nid,)).fetchone()
    one = np.zeros(1, np.uint16).tobytes()
    db.execute("UPDATE layers SET mapping = ?, crc = ? WHERE node = ? AND layer = 0",
               (one, layer_crc(nid, 0, ver, file, one, crcs), nid))
    db.commit()
    db.close()
    with PrefixStore(sdir, SHAPE, config()) as store:
        assert store.match_prefix(t).length == 0


def test_empty_database_beside_data_files_is_refused_and_nothing_deleted(tmp_path):
    sdir = tmp_path / "s"
    t = tokens_of(9, 2 * C)
    with PrefixStore(sdir, SHAPE, config()) as store:
        store.insert(t, 0, make_kv(t))
        store.inspect().state.meta.checkpoint()
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(sdir / "store.sqlite") + suffix)
        if p.exists():
            p.unlink()
    (sdir / "store.sqlite").write_bytes(b"")
    before = sorted(os.listdir(sdir / "data"))
    assert before
    with pytest.raises(UserError, match="empty"):
        PrefixStore(sdir, SHAPE, config())
    assert sorted(os.listdir(sdir / "data")) == before
    assert (sdir / "store.sqlite").read_bytes() == b""


def test_damaged_database_header_is_refused_in_one_line(tmp_path):
    sdir = tmp_path / "s"
    t = tokens_of(10, 2 * C)
    with PrefixStore(sdir, SHAPE, config()) as store:
        store.insert(t, 0, make_kv(t))
        store.inspect().state.meta.checkpoint()
    db = sdir / "store.sqlite"
    raw = bytearray(db.read_bytes())
    raw[0:16] = b"garbage garbage!"
    db.write_bytes(bytes(raw))
    before = sorted(os.listdir(sdir / "data"))
    with pytest.raises(UserError) as err:
        PrefixStore(sdir, SHAPE, config())
    assert "\n" not in str(err.value)
    assert sorted(os.listdir(sdir / "data")) == before
    assert db.read_bytes() == bytes(raw)


# -- 4. full database ------------------------------------------------------------------------
def _fill_database(store):
    pages = store.inspect().state.meta.db.execute("PRAGMA page_count").fetchone()[0]
    store.inspect().state.meta.db.execute(f"PRAGMA max_page_count = {pages}")


def test_full_database_is_store_full_and_leaves_no_files(tmp_path):
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        a = tokens_of(11, 2 * C)
        store.insert(a, 0, make_kv(a))
        _fill_database(store)
        before = set(os.listdir(store.inspect().state.data_dir))
        with pytest.raises(StoreFull):
            for i in range(50):                  # until the pages run out
                t = tokens_of(200 + i, 16 * C)
                store.insert(t, 0, make_kv(t))
        assert set(os.listdir(store.inspect().state.data_dir)) - before <= \
            {os.path.basename(e.path) for n in store.inspect().state.tree.nodes.values() for e in n.layers}
        live = {os.path.basename(e.path) for n in store.inspect().state.tree.nodes.values() for e in n.layers}
        assert set(os.listdir(store.inspect().state.data_dir)) == live
        assert_exact(store, a, 2 * C)
        store.inspect().state.meta.db.execute("PRAGMA max_page_count = 1073741823")
        store.insert(t, 0, make_kv(t))            # usable again once there is room


def test_reorder_keeps_its_statistics_when_the_commit_fails(tmp_path, monkeypatch):
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        t = tokens_of(12, 6 * C)
        (node,) = store.insert(t, 0, make_kv(t))
        entry = store.entry(node, 0)
        selected = np.zeros(6 * C, bool)
        selected[2 * C:3 * C] = True
        store.record_selection(entry, np.linspace(0, 1, 6 * C), selected, [2])
        stats = store.inspect().importance.layer_stats(entry)
        before = (stats.bitmaps.copy(), stats.access.copy(), stats.ratio.copy())

        def full(*_a, **_k):
            raise StoreFull("metadata database full while reordering")
        monkeypatch.setattr("impress_flexgen.store.reorder.meta_write", full)
        assert store.inspect().reorderer.reorder_node(node, [0]) == 0
        assert store.entry(node, 0) is entry
        for a, b in zip(before, (stats.bitmaps, stats.access, stats.ratio)):
            assert np.array_equal(a, b)
        assert set(os.listdir(store.inspect().state.data_dir)) == \
            {os.path.basename(e.path) for e in node.layers}


# -- 5. I/O errors ----------------------------------------------------------------------------
def test_eio_on_read_is_a_corrupt_node(tmp_path, monkeypatch):
    with PrefixStore(tmp_path / "s", SHAPE, config(direct_io=False)) as store:
        t = tokens_of(13, 2 * C)
        (node,) = store.insert(t, 0, make_kv(t))
        real = os.preadv

        def failing(fd, buffers, offset):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(disk_io.os, "preadv", failing)
        with pytest.raises(CorruptNode) as err:
            load_chunks(store, store.entry(node, 1), {"k": [0], "v": [0]}, node)
        assert err.value.node is node
        monkeypatch.setattr(disk_io.os, "preadv", real)
        store.quarantine(node, str(err.value))
        assert store.inspect().state.metrics.quarantined_nodes == 1


@pytest.mark.parametrize("kind", ["directory", "fifo"])
@pytest.mark.timeout(60)
def test_directory_or_fifo_in_place_of_a_file_is_corrupt_and_blocks_nobody(tmp_path, kind):
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        t, u = tokens_of(14, 2 * C), tokens_of(15, 2 * C)
        (bad,) = store.insert(t, 0, make_kv(t))
        store.insert(u, 0, make_kv(u))
        entry = store.entry(bad, 0)
        os.unlink(entry.path)
        if kind == "directory":
            os.mkdir(entry.path)
        else:
            os.mkfifo(entry.path)
        store.inspect().state.reader.forget(entry.path)
        result = {}

        def read_bad():
            try:
                store.inspect().reads.read_layer(entry, bad)
            except CorruptNode as exc:
                result["err"] = exc
        thread = threading.Thread(target=read_bad, daemon=True)
        thread.start()
        assert_exact(store, u, 2 * C)            # another prefix reads meanwhile
        thread.join(timeout=20)
        assert not thread.is_alive() and result["err"].node is bad
        store.quarantine(bad, str(result["err"]))
        if kind == "directory":
            os.rmdir(entry.path)


# -- 7. quarantine ----------------------------------------------------------------------------
def test_quarantine_is_bounded_and_counted(tmp_path):
    one_file = None
    with PrefixStore(tmp_path / "s", SHAPE, config()) as probe:
        t = tokens_of(16, 2 * C)
        (node,) = probe.insert(t, 0, make_kv(t))
        one_file = os.path.getsize(node.layers[0].path)
    cap = 3 * one_file
    with PrefixStore(tmp_path / "q", SHAPE, config(quarantine_bytes=cap)) as store:
        for i in range(4):
            t = tokens_of(300 + i, 2 * C)
            (node,) = store.insert(t, 0, make_kv(t))
            store.quarantine(node, "test")
        files = os.listdir(store.inspect().state.quarantine_dir)
        assert 0 < len(files) <= 3
        assert store.inspect().files.quarantine_bytes() <= cap
        assert store.inspect().accounting.overheads()["quarantine_bytes"] == store.inspect().files.quarantine_bytes()
        assert store.inspect().state.metrics.quarantined_nodes == 4


def test_failed_writes_are_not_fatal_and_leave_nothing(tmp_path, monkeypatch):
    """An fsync failure while storing is StoreWriteFailed (the request goes on), no file
    stays behind and the store is consistent after reopening."""
    sdir = tmp_path / "s"
    with PrefixStore(sdir, SHAPE, config()) as store:
        a = tokens_of(17, 2 * C)
        store.insert(a, 0, make_kv(a))

        def eio(fd):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(disk_io.os, "fsync", eio)
        b = tokens_of(18, 2 * C)
        with pytest.raises(StoreWriteFailed):
            store.insert(b, 0, make_kv(b))
        monkeypatch.undo()
        assert sorted(os.listdir(store.inspect().state.data_dir)) == \
            sorted(os.path.basename(e.path) for n in store.inspect().state.tree.nodes.values() for e in n.layers)
    with PrefixStore(sdir, SHAPE, config()) as store:
        assert_exact(store, a, 2 * C)
        assert store.match_prefix(b).length == 0
