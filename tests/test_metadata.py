"""The store's SQLite metadata checks itself: ids are never reused, every hard-state row
is checksummed and shape-checked on read, damaged or foreign databases and a full disk
come out as MetadataError subclasses with one-line messages."""
from __future__ import annotations

import json
import os
import sqlite3
import struct

import numpy as np
import pytest

from disk_layout import metadata as md
from disk_layout.metadata import (
    SCHEMA_VERSION,
    LayerRow,
    Metadata,
    MetadataError,
    MetadataFull,
    NodeRow,
    valid_file_name,
)

C = 64
NAME = "0123456789abcdef0123456789abcdef.kv"

# The schema of version 1, as released (no row checksums, rowid-allocated node ids).
SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY,
    parent INTEGER,
    start INTEGER NOT NULL,
    tokens BLOB NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    last_access REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS layers (
    node INTEGER NOT NULL,
    layer INTEGER NOT NULL,
    version INTEGER NOT NULL,
    file TEXT NOT NULL,
    mapping BLOB,
    crcs BLOB NOT NULL,
    importance BLOB,
    bitmaps BLOB,
    access BLOB,
    ratio BLOB,
    PRIMARY KEY (node, layer)
);
"""


def _name(i: int) -> str:
    return f"{i:032x}.kv"


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50000, n).astype(np.int32)


@pytest.fixture
def meta(tmp_path):
    m = Metadata(str(tmp_path / "store.sqlite"))
    yield m
    m.close()


def _raw(meta: Metadata) -> sqlite3.Connection:
    """A second connection to the same database, to damage rows behind the API's back."""
    return sqlite3.connect(meta.path, isolation_level=None)


def _one_node(meta: Metadata, n_tokens: int = 2 * C, mapping=None, soft=True) -> int:
    rng = np.random.default_rng(3)
    n_chunks = n_tokens // C
    with meta.transaction():
        nid = meta.add_node(None, 0, _tokens(n_tokens, 1))
        meta.put_layer(LayerRow(
            nid, 0, 1, NAME, mapping, np.arange(1 + 2 * n_chunks, dtype=np.uint32),
            rng.random(n_tokens).astype(np.float32) if soft else None,
            np.zeros((n_chunks, C // 8), np.uint8) if soft else None,
            np.arange(n_chunks, dtype=np.uint16) if soft else None,
            np.full(n_chunks, 7, np.uint8) if soft else None))
    return nid


# -- ids --------------------------------------------------------------------------------
def test_node_ids_are_never_reused_after_delete_and_reopen(tmp_path):
    path = str(tmp_path / "store.sqlite")
    m = Metadata(path)
    with m.transaction():
        ids = [m.add_node(None, 0, _tokens(C, i)) for i in range(3)]
    assert ids == sorted(ids) and len(set(ids)) == 3
    with m.transaction():
        for nid in ids:
            m.delete_node(nid)
    with m.transaction():
        again = m.add_node(None, 0, _tokens(C, 9))
    assert again > max(ids)
    with m.transaction():
        m.delete_node(again)
    m.close()
    m = Metadata(path)
    try:
        assert list(m.nodes()) == []
        with m.transaction():
            later = m.add_node(None, 0, _tokens(C, 10))
        assert later > again
        # A rolled-back insert's id is not handed out again by this process either.
        with pytest.raises(RuntimeError), m.transaction():
            lost = m.add_node(None, 0, _tokens(C, 11))
            raise RuntimeError("abort")
        with m.transaction():
            assert m.add_node(None, 0, _tokens(C, 12)) > lost
    finally:
        m.close()


# -- migration --------------------------------------------------------------------------
def test_schema_1_database_is_migrated_in_place(tmp_path):
    path = str(tmp_path / "store.sqlite")
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(SCHEMA_V1)
    db.executemany("INSERT INTO meta VALUES (?, ?)",
                   [("format", json.dumps("impress-1")), ("schema", json.dumps(1)),
                    ("chunk_size", json.dumps(C))])
    toks = {1: _tokens(C, 1), 2: _tokens(2 * C, 2), 5: _tokens(C, 5)}
    for nid, parent in ((1, None), (2, 1), (5, 2)):
        db.execute("INSERT INTO nodes (id, parent, start, tokens, hits, last_access) "
                   "VALUES (?, ?, ?, ?, 3, 1.5)", (nid, parent, nid * C, toks[nid].tobytes()))
    order = np.random.default_rng(0).permutation(2 * C)
    db.execute("INSERT INTO layers (node, layer, version, file, mapping, crcs) "
               "VALUES (2, 0, 4, ?, ?, ?)",
               (_name(2), order.astype(np.uint16).tobytes(),
                np.arange(5, dtype=np.uint32).tobytes()))
    db.close()

    m = Metadata(path)
    try:
        got = m.get_meta()
        assert got["schema"] == SCHEMA_VERSION == 4 and got["next_node_id"] == 6
        assert got["format"] == "impress-1" and got["chunk_size"] == C
        rows = list(m.nodes())
        assert [r.id for r in rows] == [1, 2, 5] and all(r.valid for r in rows)
        assert [r.parent for r in rows] == [None, 1, 2]
        for r in rows:
            assert np.array_equal(r.tokens, toks[r.id]) and r.hits == 3
        (layer,) = m.layers(2, 2 * C, n_crcs=5)
        assert layer.valid and layer.version == 4 and layer.file == _name(2)
        assert np.array_equal(layer.mapping, order)
        with m.transaction():
            assert m.add_node(5, 6 * C, _tokens(C, 6)) == 6
    finally:
        m.close()
    # Idempotent: opening again changes nothing.
    m = Metadata(path)
    try:
        assert m.get_meta()["schema"] == 4 and len(list(m.nodes())) == 4
    finally:
        m.close()


# -- row checks -------------------------------------------------------------------------
def test_node_rows_are_checked_and_still_iterate_as_tuples(meta):
    nid = _one_node(meta)
    (row,) = list(meta.nodes())
    assert isinstance(row, NodeRow) and row.valid and row.problem is None
    i, parent, start, tokens, hits, _last = row         # the old 6-tuple
    assert (i, parent, start, hits) == (nid, None, 0, 0)
    assert np.array_equal(tokens, _tokens(2 * C, 1))
    raw = _raw(meta)
    blob = bytearray(raw.execute("SELECT tokens FROM nodes").fetchone()[0])
    blob[17] ^= 0x04
    raw.execute("UPDATE nodes SET tokens = ?", (bytes(blob),))
    (row,) = list(meta.nodes())
    assert not row.valid and "checksum" in row.problem
    # Re-parenting must not re-sign a damaged row.
    with meta.transaction():
        meta.set_parent(nid, None)
    assert not next(meta.nodes()).valid
    raw.close()


def test_set_parent_keeps_a_good_row_valid(meta):
    with meta.transaction():
        a = meta.add_node(None, 0, _tokens(C, 1))
        b = meta.add_node(None, 0, _tokens(C, 2))
        meta.set_parent(b, a)
    rows = {r.id: r for r in meta.nodes()}
    assert rows[b].parent == a and rows[b].valid and rows[a].valid


def test_flipped_bit_in_mapping_makes_the_row_invalid(meta):
    order = np.random.default_rng(1).permutation(2 * C)
    nid = _one_node(meta, mapping=order)
    (good,) = meta.layers(nid, 2 * C, n_crcs=5)
    assert good.valid and np.array_equal(good.mapping, order)
    raw = _raw(meta)
    blob = bytearray(raw.execute("SELECT mapping FROM layers").fetchone()[0])
    blob[6] ^= 0x01
    raw.execute("UPDATE layers SET mapping = ?", (bytes(blob),))
    (bad,) = meta.layers(nid, 2 * C, n_crcs=5)
    assert not bad.valid and bad.problem
    # Two entries swapped: still a permutation, caught by the row checksum.
    swapped = order.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    raw.execute("UPDATE layers SET mapping = ?", (md.mapping_blob(swapped),))
    (bad,) = meta.layers(nid, 2 * C, n_crcs=5)
    assert not bad.valid and "checksum" in bad.problem
    raw.close()


def _rewrite_layer(meta, nid, **fields):
    """Rewrite a layer row with `fields` and a matching row checksum (a consistent but
    wrong row: only the shape checks can catch it)."""
    raw = _raw(meta)
    cols = ("layer", "version", "file", "mapping", "crcs")
    row = dict(zip(cols, raw.execute(f"SELECT {', '.join(cols)} FROM layers WHERE node = ?",
                                     (nid,)).fetchone()))
    row.update(fields)
    crc = md.layer_crc(nid, row["layer"], row["version"], row["file"], row["mapping"],
                       row["crcs"])
    raw.execute("UPDATE layers SET file = ?, mapping = ?, crcs = ?, crc = ? WHERE node = ?",
                (row["file"], row["mapping"], row["crcs"], crc, nid))
    raw.close()


def test_one_entry_mapping_is_invalid(meta):
    nid = _one_node(meta)
    _rewrite_layer(meta, nid, mapping=np.array([0], np.uint16).tobytes())
    (row,) = meta.layers(nid, 2 * C)
    assert not row.valid and "mapping" in row.problem and row.mapping is None


def test_mapping_that_is_not_a_permutation_is_invalid(meta):
    nid = _one_node(meta)
    # Explicit entries 4 and 4, the rest implied: decodes to 2C+1 entries, one twice.
    width = (2 * C - 1).bit_length()
    bits = np.zeros(2 * width, np.uint8)
    bits[2] = bits[width + 2] = 1
    dup = struct.pack("<cIIIB", b"P", 2 * C, 0, 2, width) + \
        np.packbits(bits, bitorder="little").tobytes()
    _rewrite_layer(meta, nid, mapping=dup)
    (row,) = meta.layers(nid, 2 * C)
    assert not row.valid and "permutation" in row.problem


def test_wrong_number_of_chunk_crcs_is_invalid(meta):
    nid = _one_node(meta)
    assert meta.layers(nid, 2 * C, n_crcs=5)[0].valid
    row = meta.layers(nid, 2 * C, n_crcs=7)[0]
    assert not row.valid and "CRCs" in row.problem
    _rewrite_layer(meta, nid, crcs=b"\x01\x02\x03")
    assert not meta.layers(nid, 2 * C)[0].valid


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "../" + NAME, "a/b.kv",
                                 "/tmp/" + NAME, NAME.upper(), NAME + "\n", ""])
def test_file_names_outside_the_store_are_invalid_and_never_referenced(meta, bad):
    assert not valid_file_name(bad)
    nid = _one_node(meta)
    with pytest.raises(ValueError):
        meta.put_layer(LayerRow(nid, 1, 1, bad, None, np.zeros(5, np.uint32)))
    _rewrite_layer(meta, nid, file=bad)
    (row,) = meta.layers(nid, 2 * C)
    assert not row.valid and "file name" in row.problem and row.file == ""
    assert meta.referenced_files() == set()


def test_referenced_files_keep_damaged_rows_with_good_names(meta):
    nid = _one_node(meta)
    raw = _raw(meta)
    raw.execute("UPDATE layers SET version = 9")         # row checksum now wrong
    raw.close()
    assert not meta.layers(nid, 2 * C)[0].valid
    assert meta.referenced_files() == {NAME} and valid_file_name(NAME)


def test_damaged_soft_state_is_dropped_not_the_row(meta):
    nid = _one_node(meta)
    row = meta.layers(nid, 2 * C, n_crcs=5)[0]
    assert row.importance is not None and len(row.importance) == 2 * C
    assert row.bitmaps is not None and len(row.access) == 2 and len(row.ratio) == 2
    raw = _raw(meta)
    raw.execute("UPDATE layers SET access = ?", (b"\x01\x02\x03",))
    raw.close()
    row = meta.layers(nid, 2 * C, n_crcs=5)[0]
    assert row.valid and row.importance is None and row.bitmaps is None
    assert row.access is None and row.ratio is None


def test_put_soft_state_round_trips(meta):
    nid = _one_node(meta, soft=False)
    row = meta.layers(nid, 2 * C)[0]
    assert row.valid and row.importance is None
    imp = np.linspace(0, 1, 2 * C).astype(np.float32)
    with meta.transaction():
        meta.put_soft_state([(nid, 0, imp, np.full((2, C // 8), 3, np.uint8),
                              np.array([5, 6], np.uint16), np.array([1, 2], np.uint8))])
    row = meta.layers(nid, 2 * C, n_crcs=5)[0]
    # 10 bits per token on a log scale: within 0.82% (half a step) of each value.
    assert row.valid and np.allclose(row.importance, imp, rtol=0.0082, atol=0)
    assert row.access.tolist() == [5, 6] and row.ratio.tolist() == [1, 2]


# -- damaged or foreign databases -------------------------------------------------------
def _assert_one_line(exc: BaseException, path) -> None:
    text = str(exc)
    assert "\n" not in text and str(path) in text
    assert not isinstance(exc, sqlite3.Error)


def test_garbage_file_is_a_metadata_error(tmp_path):
    path = tmp_path / "store.sqlite"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8).tobytes())
    with pytest.raises(MetadataError) as err:
        Metadata(str(path))
    _assert_one_line(err.value, path)


def test_damaged_header_is_a_metadata_error(tmp_path):
    path = tmp_path / "store.sqlite"
    m = Metadata(str(path))
    with m.transaction():
        for i in range(50):
            m.add_node(None, 0, _tokens(4 * C, i))
    m.checkpoint()
    m.close()
    raw = bytearray(path.read_bytes())
    raw[36:40] = (7).to_bytes(4, "big")                  # freelist page count
    path.write_bytes(bytes(raw))
    with pytest.raises(MetadataError) as err:
        Metadata(str(path))
    _assert_one_line(err.value, path)
    raw[0:16] = b"not a database!\0"
    path.write_bytes(bytes(raw))
    with pytest.raises(MetadataError) as err:
        Metadata(str(path))
    _assert_one_line(err.value, path)


def test_zero_length_file_opens_empty_and_says_so(tmp_path):
    path = tmp_path / "store.sqlite"
    path.write_bytes(b"")
    m = Metadata(str(path))
    try:
        assert m.is_empty()
        m.set_meta({"format": "x"})
        assert not m.is_empty()
    finally:
        m.close()


def test_foreign_database_is_refused_untouched(tmp_path):
    path = tmp_path / "store.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE users (name TEXT)")
    db.execute("INSERT INTO users VALUES ('ada')")
    db.commit()
    db.close()
    before = path.read_bytes()
    with pytest.raises(MetadataError) as err:
        Metadata(str(path))
    _assert_one_line(err.value, path)
    # Not ours to change: no tables added, not even its journal mode switched to WAL.
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store.sqlite"]


def test_damaged_meta_value_is_a_metadata_error(meta):
    meta.set_meta({"format": "x", "schema": SCHEMA_VERSION})
    raw = _raw(meta)
    raw.execute("UPDATE meta SET value = '{\"trunc' WHERE key = 'format'")
    raw.close()
    with pytest.raises(MetadataError) as err:
        meta.get_meta()
    _assert_one_line(err.value, meta.path)


def test_directory_in_place_of_the_database_is_a_metadata_error(tmp_path):
    path = tmp_path / "store.sqlite"
    path.mkdir()
    with pytest.raises(MetadataError) as err:
        Metadata(str(path))
    _assert_one_line(err.value, path)


# -- full database ----------------------------------------------------------------------
def test_full_database_raises_metadata_full_and_stays_usable(meta):
    keep = _one_node(meta)
    pages = meta.db.execute("PRAGMA page_count").fetchone()[0]
    meta.db.execute(f"PRAGMA max_page_count = {pages + 1}")
    big = _tokens(64 * C, 5)
    with pytest.raises(MetadataFull) as err, meta.transaction():
        for i in range(20):
            nid = meta.add_node(None, 0, big)
            meta.put_layer(LayerRow(nid, 0, 1, _name(100 + i), None,
                                    np.zeros(129, np.uint32)))
    assert "full" in str(err.value) and "rollback" not in str(err.value)
    _assert_one_line(err.value, meta.path)
    assert not meta.db.in_transaction
    assert [r.id for r in meta.nodes()] == [keep]
    assert meta.referenced_files() == {NAME}
    # Space again: the same connection works.
    meta.db.execute("PRAGMA max_page_count = 1073741823")
    with meta.transaction():
        nid = meta.add_node(None, 0, big)
    assert nid > keep and len(list(meta.nodes())) == 2


class _FailingCommit:
    """A connection whose COMMIT fails with SQLITE_FULL while the transaction stays open."""

    def __init__(self, db):
        self.db, self.rolled_back = db, False

    @property
    def in_transaction(self):
        return self.db.in_transaction

    def execute(self, sql, *args):
        if sql == "COMMIT":
            exc = sqlite3.OperationalError("database or disk is full")
            exc.sqlite_errorcode = sqlite3.SQLITE_FULL
            raise exc
        if sql == "ROLLBACK":
            self.rolled_back = True
        return self.db.execute(sql, *args)


def test_commit_failure_rolls_back_and_raises_metadata_full(meta):
    fake = _FailingCommit(meta.db)
    with pytest.raises(MetadataFull), md._Transaction(fake, meta.path):
        meta.db.execute("INSERT INTO meta VALUES ('x', '1')")
    assert fake.rolled_back and not meta.db.in_transaction
    assert "x" not in meta.get_meta()


def test_other_errors_in_a_transaction_pass_through(meta):
    with pytest.raises(KeyError), meta.transaction():
        meta.add_node(None, 0, _tokens(C, 1))
        raise KeyError("mine")
    assert list(meta.nodes()) == []


def test_size_bytes_and_checkpoint(meta):
    _one_node(meta)
    meta.checkpoint()
    assert meta.size_bytes() == os.path.getsize(meta.path) > 0
