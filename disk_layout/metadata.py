"""SQLite metadata of the prefix store (WAL mode): radix nodes and per-layer chunk tables.

Hard state (token ids, file names, physical->logical mapping lists, CRCs) changes only in
transactions that run after the data they describe is on disk and fsynced, so a crash at
any point leaves either the old or the new version visible, never a half-written one.
Soft state (accumulated importance, per-chunk importance bitmaps, 16-bit access counters,
8-bit important ratios) is flushed periodically: losing some of it costs a less informed
reorder, never KV.
"""
from __future__ import annotations

import dataclasses
import json
import sqlite3

import numpy as np

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY,
    parent INTEGER,              -- NULL: a child of the root
    start INTEGER NOT NULL,      -- position of the node's first token in the prefix
    tokens BLOB NOT NULL,        -- int32 token ids of this edge (whole chunks)
    hits INTEGER NOT NULL DEFAULT 0,
    last_access REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS layers (
    node INTEGER NOT NULL,
    layer INTEGER NOT NULL,
    version INTEGER NOT NULL,
    file TEXT NOT NULL,
    mapping BLOB,                -- uint16/int32 physical -> logical token order; NULL: identity
    crcs BLOB NOT NULL,          -- uint32: probe section, K chunks, V chunks
    importance BLOB,             -- float16 accumulated importance per logical token
    bitmaps BLOB,                -- per physical chunk, 1 bit per token: selected last time
    access BLOB,                 -- uint16 per physical chunk
    ratio BLOB,                  -- uint8 per physical chunk: important tokens / C * 255
    PRIMARY KEY (node, layer)
);
"""


@dataclasses.dataclass
class LayerRow:
    node: int
    layer: int
    version: int
    file: str
    mapping: np.ndarray | None
    crcs: np.ndarray
    importance: np.ndarray | None = None
    bitmaps: np.ndarray | None = None
    access: np.ndarray | None = None
    ratio: np.ndarray | None = None


def _blob(arr: np.ndarray | None):
    return None if arr is None else arr.tobytes()


def mapping_blob(mapping: np.ndarray | None):
    if mapping is None:
        return None
    dtype = np.uint16 if len(mapping) < 65536 else np.int32
    return mapping.astype(dtype).tobytes()


def mapping_from_blob(blob, n_tokens: int) -> np.ndarray | None:
    if blob is None:
        return None
    dtype = np.uint16 if n_tokens < 65536 else np.int32
    return np.frombuffer(blob, dtype=dtype).astype(np.int64)


class Metadata:
    """One connection, used under the store's lock (check_same_thread off for its threads)."""

    def __init__(self, path: str):
        self.path = path
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    # -- meta ---------------------------------------------------------------------------
    def get_meta(self) -> dict:
        return {k: json.loads(v) for k, v in self.db.execute("SELECT key, value FROM meta")}

    def set_meta(self, values: dict) -> None:
        with self.transaction():
            self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                [(k, json.dumps(v)) for k, v in values.items()])

    # -- transactions ---------------------------------------------------------------------
    def transaction(self):
        return _Transaction(self.db)

    # -- nodes ----------------------------------------------------------------------------
    def add_node(self, parent: int | None, start: int, tokens: np.ndarray) -> int:
        cur = self.db.execute("INSERT INTO nodes (parent, start, tokens) VALUES (?, ?, ?)",
                              (parent, start, tokens.astype(np.int32).tobytes()))
        return int(cur.lastrowid)

    def set_parent(self, node: int, parent: int | None) -> None:
        self.db.execute("UPDATE nodes SET parent = ? WHERE id = ?", (parent, node))

    def delete_node(self, node: int) -> None:
        self.db.execute("DELETE FROM layers WHERE node = ?", (node,))
        self.db.execute("DELETE FROM nodes WHERE id = ?", (node,))

    def nodes(self):
        for nid, parent, start, tokens, hits, last in self.db.execute(
                "SELECT id, parent, start, tokens, hits, last_access FROM nodes ORDER BY id"):
            yield nid, parent, start, np.frombuffer(tokens, dtype=np.int32), hits, last

    def touch_nodes(self, rows: list[tuple[int, float, int]]) -> None:
        self.db.executemany("UPDATE nodes SET hits = ?, last_access = ? WHERE id = ?",
                            [(h, t, n) for n, t, h in rows])

    # -- layers ---------------------------------------------------------------------------
    def put_layer(self, row: LayerRow) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO layers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (row.node, row.layer, row.version, row.file, mapping_blob(row.mapping),
             row.crcs.astype(np.uint32).tobytes(), _blob(row.importance), _blob(row.bitmaps),
             _blob(row.access), _blob(row.ratio)))

    def layers(self, node: int, n_tokens: int) -> list[LayerRow]:
        rows = []
        for (layer, version, file, mapping, crcs, imp, bitmaps, access, ratio) in self.db.execute(
                "SELECT layer, version, file, mapping, crcs, importance, bitmaps, access, ratio "
                "FROM layers WHERE node = ? ORDER BY layer", (node,)):
            rows.append(LayerRow(
                node, layer, version, file, mapping_from_blob(mapping, n_tokens),
                np.frombuffer(crcs, dtype=np.uint32).copy(),
                None if imp is None else np.frombuffer(imp, dtype=np.float16).astype(np.float32),
                None if bitmaps is None else np.frombuffer(bitmaps, dtype=np.uint8).copy(),
                None if access is None else np.frombuffer(access, dtype=np.uint16).copy(),
                None if ratio is None else np.frombuffer(ratio, dtype=np.uint8).copy()))
        return rows

    def put_soft_state(self, rows: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray,
                                              np.ndarray]]) -> None:
        """[(node, layer, importance f32, bitmaps u8, access u16, ratio u8)]."""
        self.db.executemany(
            "UPDATE layers SET importance = ?, bitmaps = ?, access = ?, ratio = ? "
            "WHERE node = ? AND layer = ?",
            [(imp.astype(np.float16).tobytes(), bm.tobytes(), acc.tobytes(), ratio.tobytes(),
              node, layer) for node, layer, imp, bm, acc, ratio in rows])

    def referenced_files(self) -> set[str]:
        return {f for (f,) in self.db.execute("SELECT file FROM layers")}

    def size_bytes(self) -> int:
        """Bytes of the database and its WAL: the metadata overhead."""
        import os

        return sum(os.path.getsize(p) for p in (self.path, self.path + "-wal")
                   if os.path.exists(p))

    def checkpoint(self) -> None:
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self.db.close()


class _Transaction:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb):
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        return False
