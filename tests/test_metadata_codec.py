"""The compact per-token metadata: mappings and importance round-trip at every size, damage
is detected, stores of schema 3 open (migrated in place, their KV served exactly), and a
reordered layer's metadata stays under 0.5% of its KV for SmolLM2-135M's shape."""
from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest
import torch

from disk_layout import metadata as md
from disk_layout.metadata import SCHEMA_VERSION, LayerRow, Metadata
from disk_layout.metadata_codec import (LOG_SPAN, decode_importance, decode_mapping,
                                        encode_importance, encode_mapping)
from impress_flexgen.store import ModelShape, PrefixStore, StoreConfig
from tests.helpers.kv import token_kv

NAME = "0123456789abcdef0123456789abcdef.kv"
SIZES = [0, 1, 2, 3, 8, 255, 256, 257, 2048, 65535, 65536, 65537, 70000]


def _reordered(n: int, rng, c: int = 16, hot: float = 0.25) -> np.ndarray:
    """A mapping as an importance reorder makes one: sink and last chunk in place, the hot
    tokens first (by importance), the rest in positional order."""
    lo, hi = (c, n - c) if n >= 3 * c else (0, n)
    middle = np.arange(lo, hi)
    k = int(hot * len(middle))
    hot_ids = rng.choice(middle, size=k, replace=False)
    cold = np.setdiff1d(middle, hot_ids)
    return np.concatenate([np.arange(lo), hot_ids, cold, np.arange(hi, n)])


# -- mapping ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
def test_mapping_round_trips_at_every_size(n):
    rng = np.random.default_rng(n)
    for m in (np.arange(n), rng.permutation(n), _reordered(n, rng), np.arange(n)[::-1]):
        blob = encode_mapping(m)
        got, problem = decode_mapping(blob, n)
        assert problem is None and got.dtype == np.int64 and np.array_equal(got, m)
    # Any permutation costs at most ceil(log2 n) bits per token and a 14-byte header.
    width = max(1, (n - 1).bit_length())
    assert len(encode_mapping(rng.permutation(n))) <= 14 + (n * width + 7) // 8


def test_reordered_mapping_costs_a_quarter_of_its_tokens():
    m = _reordered(2048, np.random.default_rng(0))
    # 504 hot tokens at 11 bits: 0.35 bytes per token, against 2 bytes as uint16.
    assert len(encode_mapping(m)) == 14 + (504 * 11 + 7) // 8
    assert len(encode_mapping(np.arange(2048))) == 14


@pytest.mark.parametrize("bad", [[0, 0], [1, 2], [-1, 0], [[0, 1]]])
def test_only_permutations_are_encoded(bad):
    with pytest.raises(ValueError):
        encode_mapping(np.array(bad))


def test_damaged_mapping_blobs_decode_to_a_reason_or_a_permutation():
    """Any byte damaged: never an exception and never anything but a permutation of the
    node's tokens (which permutation is the row checksum's to vouch for)."""
    n = 300
    blob = encode_mapping(_reordered(n, np.random.default_rng(1)))
    rng = np.random.default_rng(2)
    outcomes = set()
    for i in range(len(blob)):
        for bit in (0, 3, 7):
            bad = bytearray(blob)
            bad[i] ^= 1 << bit
            got, problem = decode_mapping(bytes(bad), n)
            if got is None:
                assert problem
            else:
                assert np.array_equal(np.sort(got), np.arange(n))
            outcomes.add(got is None)
    for cut in (0, 5, 13, 14, len(blob) - 1):
        assert decode_mapping(blob[:cut], n)[0] is None
    assert decode_mapping(blob + b"\0", n)[0] is None
    assert decode_mapping(blob, n + 1)[0] is None
    assert decode_mapping(rng.bytes(len(blob)), n)[0] is None
    assert decode_mapping(None, n)[0] is None and outcomes == {True, False}


# -- importance -----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 2048, 70000])
def test_importance_round_trips_within_half_a_step_and_keeps_its_order(n):
    rng = np.random.default_rng(n)
    imp = (rng.gamma(0.3, 1.0, n) * 40).astype(np.float32)
    imp[rng.random(n) < 0.1] = 0
    blob = encode_importance(imp)
    assert len(blob) == 14 + (10 * n + 7) // 8          # 10 bits per token
    got = decode_importance(blob, n)
    assert got.dtype == np.float32 and np.array_equal(got == 0, imp == 0)
    big = imp >= imp.max() / LOG_SPAN
    # Half a step of 24 octaves in 1,022 steps: 0.82%.
    assert np.all(np.abs(got[big] - imp[big]) <= 0.0082 * imp[big])
    for bits in (2, 8, 16):
        coarse = decode_importance(encode_importance(imp, bits), n)
        assert np.array_equal(coarse == 0, imp == 0)
        assert np.all(np.diff(coarse[np.argsort(imp, kind="stable")]) >= 0)
    # Monotonic: a reorder ranks as before, ties within a code aside.
    order = np.argsort(imp, kind="stable")
    assert np.all(np.diff(got[order]) >= 0)


def test_importance_edge_values():
    for imp in (np.zeros(5), np.full(5, 3.0), np.array([1e-30, 1.0, 0.0]),
                np.array([1e30, 1.0]), np.array([np.finfo(np.float32).smallest_subnormal])):
        imp = imp.astype(np.float32)
        got = decode_importance(encode_importance(imp), len(imp))
        assert np.all(np.isfinite(got)) and np.array_equal(got == 0, imp == 0)
        assert got.max() == pytest.approx(imp.max(), rel=1e-6)
    # Negative values keep float16, as before.
    imp = np.array([-1.5, 2.0, 0.25], np.float32)
    blob = encode_importance(imp)
    assert len(blob) == 5 + 2 * 3 and np.array_equal(decode_importance(blob, 3), imp)


def test_damaged_importance_is_refused():
    imp = np.linspace(0, 5, 64).astype(np.float32)
    for blob in (encode_importance(imp), encode_importance(-imp)):
        for i in range(len(blob)):
            bad = bytearray(blob)
            bad[i] ^= 0x10
            assert decode_importance(bytes(bad), 64) is None, i
        assert decode_importance(blob[:-1], 64) is None
        assert decode_importance(blob, 63) is None
    with pytest.raises(ValueError):
        encode_importance(imp, 17)


def test_damaged_importance_drops_the_soft_state_not_the_row(tmp_path):
    meta = Metadata(str(tmp_path / "store.sqlite"))
    try:
        with meta.transaction():
            nid = meta.add_node(None, 0, np.arange(64, dtype=np.int32))
            meta.put_layer(LayerRow(nid, 0, 1, NAME, None, np.arange(9, dtype=np.uint32),
                                    np.linspace(0, 1, 64), np.zeros((4, 2), np.uint8),
                                    np.zeros(4, np.uint16), np.zeros(4, np.uint8)))
        raw = sqlite3.connect(meta.path, isolation_level=None)
        blob = bytearray(raw.execute("SELECT importance FROM layers").fetchone()[0])
        blob[40] ^= 0x01                            # a code: only the checksum sees it
        raw.execute("UPDATE layers SET importance = ?", (bytes(blob),))
        raw.close()
        (row,) = meta.layers(nid, 64, n_crcs=9)
        assert row.valid and row.importance is None and row.bitmaps is None
    finally:
        meta.close()


# -- stores of schema 3 ----------------------------------------------------------------------
SHAPE = ModelShape("codec", n_layers=2, n_kv_heads=2, head_dim=16)
C = 16


def _config():
    return StoreConfig(chunk_size=C, probe_heads=(0, 1), probe_format="fp16",
                       reorder_interval=0)


def _as_schema_3(path) -> None:
    """Rewrite a closed store's rows the way schema 3 stored them: uint16 (int32 from
    65,536 tokens) mappings, float16 importance, the row checksums over those blobs."""
    db = sqlite3.connect(path, isolation_level=None)
    rows = db.execute("SELECT l.node, l.layer, l.version, l.file, l.mapping, l.crcs, "
                      "l.importance, length(n.tokens) / 4 FROM layers l JOIN nodes n "
                      "ON n.id = l.node").fetchall()
    for node, layer, version, file, mapping, crcs, imp, n in rows:
        if mapping is not None:
            order = decode_mapping(mapping, n)[0]
            mapping = order.astype(np.uint16 if n < 65536 else np.int32).tobytes()
        if imp is not None:
            imp = decode_importance(imp, n).astype(np.float16).tobytes()
        db.execute("UPDATE layers SET mapping = ?, importance = ?, crc = ? "
                   "WHERE node = ? AND layer = ?",
                   (mapping, imp, md.layer_crc(node, layer, version, file, mapping, crcs),
                    node, layer))
    db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (json.dumps(3),))
    db.close()


def _reordered_store(sdir):
    """A store holding one 12-chunk prefix, both layers reordered by seeded importance;
    returns (tokens, KV, each layer's mapping, layer 0's importance)."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, 30000, 12 * C).astype(np.int32)
    kv = token_kv(tokens, SHAPE, 0)
    with PrefixStore(sdir, SHAPE, _config()) as store:
        (node,) = store.insert(tokens, 0, kv)
        for layer in range(SHAPE.n_layers):
            store.record_selection(store.entry(node, layer),
                                   rng.random(len(tokens)).astype(np.float32), None)
        assert store.inspect().reorderer.reorder_node(node) == SHAPE.n_layers
        orders = [store.entry(node, layer).mapping.copy() for layer in range(SHAPE.n_layers)]
        importance = store.inspect().state.stats[(node.id, 0)].importance.copy()
    return tokens, kv, orders, importance


def test_schema_3_store_opens_migrated_and_serves_the_same_kv(tmp_path):
    tokens, kv, orders, importance = _reordered_store(tmp_path / "s")
    _as_schema_3(tmp_path / "s" / "store.sqlite")
    with PrefixStore(tmp_path / "s", SHAPE, _config()) as store:
        match = store.match_prefix(tokens)
        try:
            assert match.length == len(tokens) and store.inspect().state.metrics.invalid_rows == 0
            node = match.segments[0][0]
            for layer in range(SHAPE.n_layers):
                entry = store.entry(node, layer)
                assert np.array_equal(entry.mapping, orders[layer])
                k, v = store.inspect().reads.read_layer(entry, node)
                assert torch.equal(k.view(torch.int16), kv[layer][0].view(torch.int16))
                assert torch.equal(v.view(torch.int16), kv[layer][1].view(torch.int16))
            got = store.inspect().state.stats[(node.id, 0)].importance
            assert np.allclose(got, importance, rtol=0.03, atol=1e-3)
        finally:
            store.release(match)
    db = sqlite3.connect(tmp_path / "s" / "store.sqlite")
    schema = json.loads(db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0])
    widths = [len(m) for (m,) in db.execute("SELECT mapping FROM layers")]
    db.close()
    assert schema == SCHEMA_VERSION == 4 and max(widths) < 2 * len(tokens)


def test_schema_3_row_damaged_before_migration_stays_invalid(tmp_path):
    tokens, *_ = _reordered_store(tmp_path / "s")
    _as_schema_3(tmp_path / "s" / "store.sqlite")
    db = sqlite3.connect(tmp_path / "s" / "store.sqlite", isolation_level=None)
    blob = bytearray(db.execute("SELECT mapping FROM layers WHERE layer = 1").fetchone()[0])
    blob[5] ^= 0x01
    db.execute("UPDATE layers SET mapping = ? WHERE layer = 1", (bytes(blob),))
    db.close()
    with PrefixStore(tmp_path / "s", SHAPE, _config()) as store:
        assert store.inspect().state.metrics.invalid_rows == 1
        assert store.match_prefix(tokens).length == 0


def test_schema_3_int32_mapping_is_migrated(tmp_path):
    n = 70000
    order = np.random.default_rng(5).permutation(n)
    meta = Metadata(str(tmp_path / "store.sqlite"))
    with meta.transaction():
        nid = meta.add_node(None, 0, np.arange(n, dtype=np.int32))
    meta.set_meta({"schema": 3})
    meta.close()
    old = order.astype(np.int32).tobytes()
    crcs = np.arange(3, dtype=np.uint32).tobytes()
    db = sqlite3.connect(tmp_path / "store.sqlite", isolation_level=None)
    db.execute("INSERT INTO layers (node, layer, version, file, mapping, crcs, crc) "
               "VALUES (?, 0, 2, ?, ?, ?, ?)",
               (nid, NAME, old, crcs, md.layer_crc(nid, 0, 2, NAME, old, crcs)))
    db.close()
    meta = Metadata(str(tmp_path / "store.sqlite"))
    try:
        assert meta.get_meta()["schema"] == SCHEMA_VERSION
        (row,) = meta.layers(nid, n, n_crcs=3)
        assert row.valid and np.array_equal(row.mapping, order)
    finally:
        meta.close()


# -- size -------------------------------------------------------------------------------------
SMOLLM2 = ModelShape("smollm2-135m-shape", n_layers=2, n_kv_heads=3, head_dim=64)
SMOLLM2_LAYERS = 30        # the model's: the node's token ids are shared by all of them


def test_reordered_layer_metadata_is_under_half_a_percent_of_smollm2_kv(tmp_path):
    """A 2,048-token prefix at SmolLM2-135M's KV shape (3 KV heads x 64 dims, fp16: 768
    bytes per token and layer), every layer reordered: its metadata per token and layer,
    as stored (the row's fields) and as SQLite keeps it (the pages of the layers table and
    its index), the node's token ids shared by the model's 30 layers, stays under 0.5% of
    the KV."""
    n, c = 2048, 16
    kv_per_token_layer = 2 * SMOLLM2.n_kv_heads * SMOLLM2.head_dim * 2
    assert kv_per_token_layer == 768
    tokens = np.random.default_rng(6).integers(1, 30000, n).astype(np.int32)
    config = StoreConfig(chunk_size=c, probe_heads=(0,), probe_format="int4",
                         reorder_interval=0)
    rng = np.random.default_rng(7)
    with PrefixStore(tmp_path / "s", SMOLLM2, config) as store:
        (node,) = store.insert(tokens, 0, token_kv(tokens, SMOLLM2, 0))
        for layer in range(SMOLLM2.n_layers):
            scores = rng.gamma(0.3, 1.0, n).astype(np.float32)
            store.record_selection(store.entry(node, layer), scores, scores > 0.5,
                                   list(range(10)))
        assert store.reorder_now() == SMOLLM2.n_layers
        db = store.inspect().state.meta.db
        fields = db.execute(
            "SELECT SUM(length(file) + length(mapping) + length(crcs) + length(importance) "
            "+ length(bitmaps) + length(access) + length(ratio) + 40) FROM layers").fetchone()[0]
        tokens_bytes = db.execute("SELECT SUM(length(tokens)) FROM nodes").fetchone()[0]
        try:
            # Overflow pages belong to one row each: whole; leaf and index pages are
            # shared by many rows in a store of any size: their used bytes.
            pages = db.execute(
                "SELECT SUM(CASE WHEN pagetype = 'overflow' THEN pgsize ELSE pgsize - unused "
                "END) FROM dbstat WHERE name IN ('layers', 'sqlite_autoindex_layers_1')"
            ).fetchone()[0]
        except sqlite3.OperationalError:        # SQLite built without the dbstat table
            pages = None
    per_token_layer = n * SMOLLM2.n_layers
    shared = tokens_bytes / (n * SMOLLM2_LAYERS)
    assert (fields / per_token_layer + shared) / kv_per_token_layer < 0.005 * 0.8
    if pages is not None:
        assert (pages / per_token_layer + shared) / kv_per_token_layer < 0.005


def test_reorder_pass_leaves_no_journal_on_disk(tmp_path):
    """The rows a reorder pass rewrites are folded into the database and the WAL cut back:
    a burst's journal does not stay on disk beside the metadata."""
    tokens = np.random.default_rng(8).integers(1, 30000, 12 * C).astype(np.int32)
    with PrefixStore(tmp_path / "s", SHAPE, _config()) as store:
        (node,) = store.insert(tokens, 0, token_kv(tokens, SHAPE, 0))
        for layer in range(SHAPE.n_layers):
            store.record_selection(store.entry(node, layer),
                                   np.linspace(1, 0, len(tokens)).astype(np.float32), None)
        wal = tmp_path / "s" / "store.sqlite-wal"
        assert wal.stat().st_size > 0                  # the insert's transaction
        assert store.reorder_now() == SHAPE.n_layers
        assert wal.stat().st_size == 0
        assert store.inspect().state.meta.db.execute("PRAGMA journal_size_limit").fetchone()[0] == \
            md.JOURNAL_SIZE_LIMIT


def test_metadata_size_experiment_quick(tmp_path):
    from experiments import metadata_size

    out = tmp_path / "m.json"
    assert metadata_size.main(["--quick", "--lengths", "32,2048", "--rows", "30",
                               "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    by = {r["tokens"]: r for r in res["results"]}
    assert by[2048]["share_of_kv"]["smollm2-135m"] < 0.005
    assert by[2048]["share_of_kv"]["opt-6.7b"] < 0.0003
    assert by[2048]["bytes_per_token_layer"] >= by[2048]["field_bytes_per_token_layer"]
    with pytest.raises(SystemExit) as exit_:
        metadata_size.main(["--lengths", "100"])
    assert exit_.value.code == 2
