"""Sizes: KV, probe copies, padding, metadata and quarantine, for the overhead figures."""
from __future__ import annotations

import logging

from disk_layout.metadata import MetadataError

from .eviction import disk_bytes
from .files import LayerFiles
from .importance import Importance
from .state import StoreState

log = logging.getLogger("impress_flexgen.store")


class Accounting:
    """Byte accounting of the store."""

    def __init__(self, state: StoreState, importance: Importance, files: LayerFiles) -> None:
        self.state = state
        self.importance = importance
        self.files = files

    def disk_bytes(self) -> int:
        return disk_bytes(self.state)

    def kv_bytes(self) -> int:
        """Bytes of K and V payload (no padding, no probe copies)."""
        with self.state.lock:
            return sum(2 * e.layout.n_chunks * e.layout.chunk_bytes
                       for n in self.state.tree.nodes.values() for e in n.layers)

    def probe_bytes(self) -> int:
        with self.state.lock:
            return sum(e.layout.probe_bytes
                       for n in self.state.tree.nodes.values() for e in n.layers)

    def overheads(self) -> dict:
        self.importance.flush_stats()
        state = self.state
        with state.lock:
            try:
                state.meta.checkpoint()
            except MetadataError as exc:
                log.warning("store %s: WAL checkpoint failed: %s", state.dir, exc)
            kv, probe, files = self.kv_bytes(), self.probe_bytes(), self.disk_bytes()
            meta = state.meta.size_bytes()
        return {"kv_bytes": kv, "metadata_bytes": meta, "probe_bytes": probe,
                "file_bytes": files, "quarantine_bytes": self.files.quarantine_bytes(),
                "metadata_fraction": meta / kv if kv else 0.0,
                "probe_fraction": probe / kv if kv else 0.0,
                "padding_fraction": (files - kv - probe) / kv if kv else 0.0}
