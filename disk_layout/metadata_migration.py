"""Schema 4's migration: the mappings and importance of older stores' layer rows rewritten
in the compact encodings (metadata_codec), inside the transaction that opens the store."""
from __future__ import annotations

import sqlite3

from .metadata_codec import old_importance, old_mapping
from .metadata_rows import importance_blob, layer_crc, mapping_blob


def compact_layer_rows(db: sqlite3.Connection) -> None:
    """Rewrite every layer row, one at a time (a store's rows need not fit in memory
    together). A row whose checksum or mapping fails its checks keeps its mapping and
    checksum, so it stays invalid; importance that is not float16 per token is dropped
    (soft state: the next queries rebuild it)."""
    keys = db.execute("SELECT node, layer FROM layers").fetchall()
    for key in keys:
        version, file, mapping, crcs, imp, crc = db.execute(
            "SELECT version, file, mapping, crcs, importance, crc FROM layers "
            "WHERE node = ? AND layer = ?", key).fetchone()
        signed = crc is not None and layer_crc(*key, version, file, mapping, crcs) == crc
        order = old_mapping(mapping) if signed and mapping is not None else None
        if order is not None:
            mapping = mapping_blob(order)
            crc = layer_crc(*key, version, file, mapping, crcs)
        db.execute("UPDATE layers SET mapping = ?, crc = ?, importance = ? "
                   "WHERE node = ? AND layer = ?",
                   (mapping, crc, importance_blob(old_importance(imp)), *key))
