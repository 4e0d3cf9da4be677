"""The harness's one reach into the store's internals.

Faults that fail system calls replace `os` in disk_layout.io, through which the store makes
every one of them (STORE_IO); the durable write (traced by the writer, failed with ENOSPC) is
replaced there too. That holds while the store calls io's functions as attributes of the
module (`io.write_durable(...)`, not a name imported from it). Also here: the hook that
sees a node removed, the metadata database's connection and the tiers a store serves
through.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sqlite3

import disk_layout.io as disk_io

# Where the store calls `os` and `write_durable`.
STORE_IO = ("disk_layout.io",)

# The real objects a patch replaces (and puts back).
REAL = {"os": os, "write_durable": disk_io.write_durable}


def patch(name: str, value) -> callable:
    """Replace the real `name` (see REAL) in every STORE_IO module that holds it; returns
    the function that puts it back."""
    mods = [m for m in map(importlib.import_module, STORE_IO)
            if getattr(m, name, None) is REAL[name]]
    for m in mods:
        setattr(m, name, value)

    def restore() -> None:
        for m in mods:
            setattr(m, name, REAL[name])
    return restore


@contextlib.contextmanager
def patched(name: str, value):
    restore = patch(name, value)
    try:
        yield value
    finally:
        restore()


def patched_os(fake):
    """The store's system calls go to `fake` (an object standing in for `os`)."""
    return patched("os", fake)


def real_write_durable(path, chunks, total_bytes) -> None:
    REAL["write_durable"](path, chunks, total_bytes)


def on_node_removal(store, before, after=None) -> None:
    """Call before(node) before the store removes a node (eviction, quarantine) and after()
    once it is gone. Without the store's subtree removal, before() is called from the
    metadata's row deletion (splits delete rows too: more may be reported than goes)."""
    removal = getattr(store, "removal", None)
    real = getattr(removal, "remove_subtree", None)
    if real is not None:
        def remove_subtree(node, *a, **kw):
            before(node)
            out = real(node, *a, **kw)
            if after is not None:
                after()
            return out
        removal.remove_subtree = remove_subtree
        return
    real_delete = store.inspect().state.meta.delete_node

    def delete_node(nid, *a, **kw):
        node = store.inspect().state.tree.nodes.get(nid)
        if node is not None:
            before(node)
        return real_delete(nid, *a, **kw)
    store.inspect().state.meta.delete_node = delete_node


def metadata_connection(store) -> sqlite3.Connection | None:
    """The store's SQLite connection (the sqlite_full fault limits its pages)."""
    db = getattr(store.inspect().state.meta, "db", None)
    return db if isinstance(db, sqlite3.Connection) else None


def attach_tiers(store, cache) -> None:
    """Serve the store's chunks through `cache` (GPU and CPU tiers)."""
    store.tiers.use_memory(cache)
