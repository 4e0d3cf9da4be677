"""Sizes: KV, probe copies, padding, metadata and quarantine, for the overhead figures."""
from __future__ import annotations

import logging

from disk_layout.metadata import MetadataError

log = logging.getLogger("impress_flexgen.store")


class _Accounting:
    """Byte accounting of the store (part of PrefixStore)."""

    def disk_bytes(self) -> int:
        with self.lock:
            return sum(e.layout.file_bytes for n in self.tree.nodes.values() for e in n.layers)

    def kv_bytes(self) -> int:
        """Bytes of K and V payload (no padding, no probe copies)."""
        with self.lock:
            return sum(2 * e.layout.n_chunks * e.layout.chunk_bytes
                       for n in self.tree.nodes.values() for e in n.layers)

    def probe_bytes(self) -> int:
        with self.lock:
            return sum(e.layout.probe_bytes for n in self.tree.nodes.values() for e in n.layers)

    def overheads(self) -> dict:
        self.flush_stats()
        with self.lock:
            try:
                self.meta.checkpoint()
            except MetadataError as exc:
                log.warning("store %s: WAL checkpoint failed: %s", self.dir, exc)
            kv, probe, files = self.kv_bytes(), self.probe_bytes(), self.disk_bytes()
            meta = self.meta.size_bytes()
        return {"kv_bytes": kv, "metadata_bytes": meta, "probe_bytes": probe,
                "file_bytes": files, "quarantine_bytes": self.quarantine_bytes(),
                "metadata_fraction": meta / kv if kv else 0.0,
                "probe_fraction": probe / kv if kv else 0.0,
                "padding_fraction": (files - kv - probe) / kv if kv else 0.0}
