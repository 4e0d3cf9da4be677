"""SQLite metadata of the prefix store (WAL mode): radix nodes and per-layer chunk tables.

Hard state (token ids, file names, physical->logical mapping lists, CRCs) changes only in
transactions that run after the data they describe is on disk and fsynced, so a crash at
any point leaves either the old or the new version visible, never a half-written one.
Every hard-state row carries a CRC32 of its fields, checked on each read together with
the row's shape (lengths, permutation, file name), so a damaged row is reported invalid
instead of returning wrong KV. Soft state (accumulated importance, per-chunk importance
bitmaps, 16-bit access counters, 8-bit important ratios) is flushed periodically; only the
importance carries its own CRC: losing or damaging any of it costs a less informed reorder,
never KV. Per-token fields are compact (metadata_codec): a reordered layer's metadata is
a few bits per token, well under 0.5% of its KV even for a small model.

Node ids come from a persisted counter (meta `next_node_id`), never from SQLite's rowid
allocation, so an id is never handed out twice: caches keyed by node id cannot confuse a
deleted node with a new one.
"""
from __future__ import annotations

import json
import logging
import os
import sqlite3

import numpy as np

# The errors and the rows are part of this module's interface.
from .metadata_errors import (MetadataError, MetadataFull, MetadataIOError,  # noqa: F401
                              MetadataReadOnly, _Guard, _one_line, _translatable, _translate)
from .metadata_codec import decode_mapping
from .metadata_migration import compact_layer_rows
from .metadata_rows import (_NAMESPACE, LayerRow, NodeRow, _blob, _check_layer,  # noqa: F401
                            _soft_state, importance_blob, layer_crc, mapping_blob, node_crc,
                            valid_file_name)

log = logging.getLogger("impress_flexgen.metadata")

SCHEMA_VERSION = 4      # 3: nodes carry `exact` and `namespace`; 4: compact mapping and
                        # importance (metadata_codec)
# The WAL is cut back to this after a checkpoint: it holds a burst of writes (a reorder
# pass), not the store's metadata, and must not stay on disk at its high-water mark.
JOURNAL_SIZE_LIMIT = 1 << 20

_TABLES = {
    "meta": """CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)""",
    "nodes": """CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY,
    parent INTEGER,              -- NULL: a child of the root
    start INTEGER NOT NULL,      -- position of the node's first token in the prefix
    tokens BLOB NOT NULL,        -- int32 token ids of this edge (whole chunks)
    hits INTEGER NOT NULL DEFAULT 0,
    last_access REAL NOT NULL DEFAULT 0,
    crc INTEGER,                 -- CRC32 of (id, parent, start, tokens[, inexact][, namespace])
    exact INTEGER NOT NULL DEFAULT 1,    -- 0: KV computed over a selection of its prefix
    namespace TEXT NOT NULL DEFAULT ''   -- the tenant's key ('': the shared namespace)
)""",
    "layers": """CREATE TABLE IF NOT EXISTS layers (
    node INTEGER NOT NULL,
    layer INTEGER NOT NULL,
    version INTEGER NOT NULL,
    file TEXT NOT NULL,
    mapping BLOB,                -- physical -> logical token order (metadata_codec); NULL: identity
    crcs BLOB NOT NULL,          -- uint32: probe section, K chunks, V chunks
    importance BLOB,             -- accumulated importance per logical token, a byte each
    bitmaps BLOB,                -- per physical chunk, 1 bit per token: selected last time
    access BLOB,                 -- uint16 per physical chunk
    ratio BLOB,                  -- uint8 per physical chunk: important tokens / C * 255
    crc INTEGER,                 -- CRC32 of (node, layer, version, file, mapping, crcs)
    PRIMARY KEY (node, layer)
)""",
}
SCHEMA = ";\n".join(_TABLES.values()) + ";\n"

# Columns every schema this code can read has (schema 1 lacks the `crc` ones).
_COLUMNS = {
    "meta": {"key", "value"},
    "nodes": {"id", "parent", "start", "tokens", "hits", "last_access"},
    "layers": {"node", "layer", "version", "file", "mapping", "crcs", "importance",
               "bitmaps", "access", "ratio"},
}
# Node columns added by schema 3, with what rows of older stores hold.
_NODE_COLUMNS_3 = {"exact": "INTEGER NOT NULL DEFAULT 1", "namespace": "TEXT NOT NULL DEFAULT ''"}


class Metadata:
    """One connection, used under the store's lock (check_same_thread off for its threads).

    Every sqlite3 error leaves a method as MetadataError (MetadataFull for SQLITE_FULL,
    MetadataIOError for SQLITE_IOERR*). Opening runs `PRAGMA integrity_check`, rejects
    databases of another schema, and migrates schema 1 in place.
    """

    def __init__(self, path: str):
        self.path = path
        self._guard = _Guard(path)
        self._next_floor = 1    # ids handed out by this process, even in rolled-back work
        self.newer_schema = False
        self.db = None
        try:
            with self._guard:
                self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
                # A database cannot make us run its own functions from its schema.
                self.db.execute("PRAGMA trusted_schema=OFF")
                self._integrity_check()
                # Inspected before anything is written: a database that is not ours is
                # left exactly as it was, journal mode included.
                if self._inspect_schema():
                    self.db.execute("PRAGMA journal_mode=WAL")
                    self.db.execute("PRAGMA synchronous=FULL")
                    self.db.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
                    self._prepare_schema()
        except BaseException:
            if self.db is not None:
                try:
                    self.db.close()
                except sqlite3.Error:
                    pass
            raise

    def _integrity_check(self) -> None:
        # integrity_check, not quick_check: only it finds an index that disagrees with its
        # table, which would hide a node's layer rows from the lookups recovery makes.
        problems = [r[0] for r in self.db.execute("PRAGMA integrity_check")]
        if problems != ["ok"]:
            first = _one_line(problems[0]) if problems else "no result"
            raise MetadataError(f"{self.path}: failed its integrity check ({first})")

    def _columns(self, table: str) -> set[str]:
        return {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}

    def _inspect_schema(self) -> bool:
        """Reject a foreign schema (reading only); False for one of a newer version, which
        is left untouched (the store reports the mismatch from get_meta())."""
        objects = self.db.execute(
            "SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'").fetchall()
        tables = {name for kind, name in objects if kind == "table"}
        foreign = sorted(name for kind, name in objects
                         if kind in ("table", "view", "trigger") and name not in _TABLES)
        if foreign:
            raise MetadataError(f"{self.path}: not a prefix store database "
                                f"(has {', '.join(foreign)})")
        if "meta" in tables:
            if not {"key", "value"} <= self._columns("meta"):
                raise MetadataError(f"{self.path}: not a prefix store database "
                                    "(table meta has other columns)")
            schema = self._meta_value("schema")
            if isinstance(schema, int) and schema > SCHEMA_VERSION:
                self.newer_schema = True
                return False
        for table in tables:
            missing = _COLUMNS[table] - self._columns(table)
            if missing:
                raise MetadataError(f"{self.path}: not a prefix store database (table "
                                    f"{table} lacks {', '.join(sorted(missing))})")
        return True

    def _prepare_schema(self) -> None:
        """Create missing tables and migrate schemas 1 to 3, in one transaction."""
        tables = {name for (name,) in self.db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        need_tables = set(_TABLES) - tables
        need_crc = [t for t in ("nodes", "layers") if t in tables and "crc" not in
                    self._columns(t)]
        need_cols = [c for c in _NODE_COLUMNS_3 if "nodes" in tables
                     and c not in self._columns("nodes")]
        old_schema = "meta" in tables and self._meta_value("schema") in (1, 2, 3)
        if not need_tables and not need_crc and not need_cols and not old_schema:
            return
        with self.transaction():
            for table in sorted(need_tables):
                self.db.execute(_TABLES[table])
            for table in need_crc:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN crc INTEGER")
            for column in need_cols:
                # Rows of older stores: exact, in the shared namespace (their checksums
                # stay valid: node_crc adds only flags that are set).
                self.db.execute(f"ALTER TABLE nodes ADD COLUMN {column} "
                                f"{_NODE_COLUMNS_3[column]}")
            if "nodes" in need_crc:
                self.db.executemany("UPDATE nodes SET crc = ? WHERE id = ?", [
                    (node_crc(nid, parent, start, tokens), nid) for nid, parent, start, tokens
                    in self.db.execute("SELECT id, parent, start, tokens FROM nodes")])
            if "layers" in need_crc:
                self.db.executemany(
                    "UPDATE layers SET crc = ? WHERE node = ? AND layer = ?",
                    [(layer_crc(node, layer, version, file, mapping, crcs), node, layer)
                     for node, layer, version, file, mapping, crcs in self.db.execute(
                         "SELECT node, layer, version, file, mapping, crcs FROM layers")])
            if old_schema and "layers" in tables:
                compact_layer_rows(self.db)
            if old_schema or (not self._is_empty()
                              and self._meta_value("next_node_id") is None):
                values = {}
                if self._meta_value("next_node_id") is None or \
                        self._meta_value("schema") == 1:
                    top = self.db.execute("SELECT MAX(id) FROM nodes").fetchone()[0]
                    values["next_node_id"] = (top if isinstance(top, int) else 0) + 1
                if old_schema:
                    values["schema"] = SCHEMA_VERSION
                self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                    [(k, json.dumps(v)) for k, v in values.items()])
                log.info("%s: metadata migrated to schema %d", self.path, SCHEMA_VERSION)

    def _meta_value(self, key: str):
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        try:
            return json.loads(row[0])
        except (TypeError, ValueError):
            return None

    def _is_empty(self) -> bool:
        return not self.db.execute(
            "SELECT EXISTS(SELECT 1 FROM meta) OR EXISTS(SELECT 1 FROM nodes) "
            "OR EXISTS(SELECT 1 FROM layers)").fetchone()[0]

    def is_empty(self) -> bool:
        """No meta, node or layer rows: a new database (or one emptied by damage: the
        store decides which)."""
        with self._guard:
            return self._is_empty()

    # -- meta ---------------------------------------------------------------------------
    def get_meta(self) -> dict:
        with self._guard:
            rows = self.db.execute("SELECT key, value FROM meta").fetchall()
        out = {}
        for k, v in rows:
            try:
                out[k] = json.loads(v)
            except (TypeError, ValueError):
                raise MetadataError(f"{self.path}: damaged meta value for {k!r}") from None
        return out

    def set_meta(self, values: dict) -> None:
        with self.transaction(), self._guard:
            self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                [(k, json.dumps(v)) for k, v in values.items()])

    # -- transactions ---------------------------------------------------------------------
    def transaction(self):
        return _Transaction(self.db, self.path)

    # -- nodes ----------------------------------------------------------------------------
    def add_node(self, parent: int | None, start: int, tokens: np.ndarray, exact: bool = True,
                 namespace: str = "") -> int:
        """Insert a node under a fresh id (never one used before, even by a deleted node)."""
        if not _NAMESPACE.fullmatch(namespace):
            raise ValueError(f"not a namespace key: {namespace!r}")
        if not self.db.in_transaction:
            with self.transaction():
                return self.add_node(parent, start, tokens, exact, namespace)
        blob = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        with self._guard:
            counter = self._meta_value("next_node_id")
            top = self.db.execute("SELECT MAX(id) FROM nodes").fetchone()[0]
            nid = max(counter if isinstance(counter, int) and not isinstance(counter, bool)
                      else 1,
                      (top if isinstance(top, int) else 0) + 1, self._next_floor)
            self.db.execute(
                "INSERT INTO nodes (id, parent, start, tokens, crc, exact, namespace) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (nid, parent, int(start), blob,
                 node_crc(nid, parent, int(start), blob, bool(exact), namespace),
                 int(bool(exact)), namespace))
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('next_node_id', ?)",
                            (json.dumps(nid + 1),))
        self._next_floor = nid + 1
        return nid

    def set_parent(self, node: int, parent: int | None) -> None:
        with self._guard:
            row = self.db.execute("SELECT parent, start, tokens, crc, exact, namespace "
                                  "FROM nodes WHERE id = ?", (node,)).fetchone()
            if row is None:
                return
            old_parent, start, tokens, crc, exact, namespace = row
            # Re-sign only a row that verified: a damaged one must stay detectably damaged.
            new = node_crc(node, parent, start, tokens, exact, namespace) \
                if crc is not None and \
                node_crc(node, old_parent, start, tokens, exact, namespace) == crc else None
            self.db.execute("UPDATE nodes SET parent = ?, crc = ? WHERE id = ?",
                            (parent, new, node))

    def delete_node(self, node: int) -> None:
        with self._guard:
            self.db.execute("DELETE FROM layers WHERE node = ?", (node,))
            self.db.execute("DELETE FROM nodes WHERE id = ?", (node,))

    def nodes(self):
        """NodeRow per node, by id; rows that fail their checks come with valid=False."""
        with self._guard:
            rows = self.db.execute("SELECT id, parent, start, tokens, hits, last_access, crc, "
                                   "exact, namespace FROM nodes ORDER BY id").fetchall()
        for nid, parent, start, tokens, hits, last, crc, exact, namespace in rows:
            problem = None
            if crc is None:
                problem = "no row checksum"
            elif not isinstance(tokens, bytes):
                problem = "damaged tokens type"
            elif exact not in (0, 1) or isinstance(exact, float) or \
                    not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
                problem = "bad exact flag or namespace"
            elif node_crc(nid, parent, start, tokens, exact, namespace) != crc:
                problem = "row checksum mismatch"
            elif len(tokens) % 4:
                problem = f"tokens blob of {len(tokens)} bytes"
            elif len(tokens) == 0:
                problem = "no tokens"
            elif not isinstance(start, int) or start < 0:
                problem = f"bad start {start!r}"
            elif parent is not None and (not isinstance(parent, int) or parent == nid):
                problem = f"bad parent {parent!r}"
            blob = tokens if isinstance(tokens, bytes) else b""
            arr = np.frombuffer(blob[:len(blob) // 4 * 4], dtype=np.int32).copy()
            yield NodeRow(nid, parent, start, arr,
                          hits if isinstance(hits, int) else 0,
                          float(last) if isinstance(last, (int, float)) else 0.0,
                          problem is None, problem, exact == 1,
                          namespace if isinstance(namespace, str) else "")

    def touch_nodes(self, rows: list[tuple[int, float, int]]) -> None:
        with self._guard:
            self.db.executemany("UPDATE nodes SET hits = ?, last_access = ? WHERE id = ?",
                                [(h, t, n) for n, t, h in rows])

    # -- layers ---------------------------------------------------------------------------
    def put_layer(self, row: LayerRow) -> None:
        if not valid_file_name(row.file):
            raise ValueError(f"not a store file name: {row.file!r}")
        mapping = mapping_blob(row.mapping)
        crcs = np.ascontiguousarray(row.crcs, dtype=np.uint32).tobytes()
        with self._guard:
            self.db.execute(
                "INSERT OR REPLACE INTO layers (node, layer, version, file, mapping, crcs, "
                "importance, bitmaps, access, ratio, crc) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (row.node, row.layer, row.version, row.file, mapping, crcs,
                 importance_blob(row.importance), _blob(row.bitmaps), _blob(row.access),
                 _blob(row.ratio),
                 layer_crc(row.node, row.layer, row.version, row.file, mapping, crcs)))

    def layers(self, node: int, n_tokens: int, n_crcs: int | None = None) -> list[LayerRow]:
        """The node's layer rows by layer; a row whose hard state fails its checks comes
        with valid=False, one whose soft state is damaged with soft fields None."""
        with self._guard:
            found = self.db.execute(
                "SELECT layer, version, file, mapping, crcs, importance, bitmaps, access, "
                "ratio, crc FROM layers WHERE node = ? ORDER BY layer", (node,)).fetchall()
        rows = []
        for (layer, version, file, mapping, crcs, imp, bitmaps, access, ratio, crc) in found:
            problem = _check_layer(node, layer, version, file, mapping, crcs, crc, n_tokens,
                                   n_crcs)
            if problem is None:
                mapping_arr = None if mapping is None else decode_mapping(mapping, n_tokens)[0]
                crcs_arr = np.frombuffer(crcs, dtype=np.uint32).copy()
            else:
                mapping_arr = None
                crcs_arr = np.zeros(0, np.uint32)
            soft = _soft_state(imp, bitmaps, access, ratio, n_tokens)
            # A name that is not a store file name is never handed out, not even to report.
            rows.append(LayerRow(node, layer, version, file if valid_file_name(file) else "",
                                 mapping_arr, crcs_arr, *soft, valid=problem is None,
                                 problem=problem))
        return rows

    def put_soft_state(self, rows: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray,
                                              np.ndarray]]) -> None:
        """[(node, layer, importance f32, bitmaps u8, access u16, ratio u8)]."""
        with self._guard:
            self.db.executemany(
                "UPDATE layers SET importance = ?, bitmaps = ?, access = ?, ratio = ? "
                "WHERE node = ? AND layer = ?",
                [(importance_blob(imp), bm.tobytes(), acc.tobytes(),
                  ratio.tobytes(), node, layer) for node, layer, imp, bm, acc, ratio in rows])

    def referenced_files(self) -> set[str]:
        """Store file names the layer rows name (damaged rows included, so their files are
        not taken for leftovers); a name that is not a store file name is never returned."""
        with self._guard:
            names = self.db.execute("SELECT file FROM layers").fetchall()
        return {f for (f,) in names if valid_file_name(f)}

    def size_bytes(self) -> int:
        """Bytes of the database and its WAL: the metadata overhead."""
        total = 0
        for p in (self.path, self.path + "-wal"):
            try:
                total += os.path.getsize(p)
            except OSError:
                pass
        return total

    def checkpoint(self) -> None:
        with self._guard:
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        with self._guard:
            self.db.close()


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT; ROLLBACK on an exception. sqlite3 errors from the body
    or from COMMIT leave as MetadataError subclasses (MetadataFull for SQLITE_FULL)."""

    def __init__(self, db: sqlite3.Connection, path: str = "metadata"):
        self.db = db
        self.path = path

    def __enter__(self):
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            if _translatable(exc):
                raise _translate(self.path, exc) from exc
            raise
        return self.db

    def _rollback(self) -> None:
        # SQLite rolls some errors back itself (SQLITE_FULL may): roll back only what is
        # still open, and let no rollback error hide the one that brought us here.
        if not self.db.in_transaction:
            return
        try:
            self.db.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.warning("%s: rollback failed: %s", self.path, _one_line(exc))

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
            except sqlite3.Error as err:
                self._rollback()
                if _translatable(err):
                    raise _translate(self.path, err) from err
                raise
            return False
        self._rollback()
        if _translatable(exc):
            raise _translate(self.path, exc) from exc
        return False
