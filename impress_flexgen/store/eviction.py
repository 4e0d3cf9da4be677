"""Removing prefixes: eviction under the capacity, quarantine of corrupt nodes, and the
deletion of files once no request holds them."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..radix import RadixNode
from .config import StoreFull, StoreWriteFailed

log = logging.getLogger("impress_flexgen.store")


class _Eviction:
    """Eviction, quarantine and file retirement (part of PrefixStore)."""

    def _retire_node(self, node: RadixNode) -> None:
        node.retired_files.extend(e.path for e in node.layers)
        for layer in range(len(node.layers)):
            self.stats.pop((node.id, layer), None)
        if self.cache is not None:
            self.cache.invalidate(node.id)
        if node.lock_count == 0:
            self._delete_retired(node)

    def _delete_retired(self, node: RadixNode) -> None:
        for path in node.retired_files:
            self.reader.forget(path)
            try:
                os.unlink(path)         # a symbolic link goes, never its target
            except FileNotFoundError:
                pass
            except OSError as exc:      # e.g. a directory put in its place: left alone
                log.warning("store %s: cannot remove %s: %s", self.dir, path, exc)
        node.retired_files.clear()

    def _remove_subtree(self, node: RadixNode) -> list[RadixNode]:
        """Delete a node and everything below it: rows first (one transaction), then the
        tree, the tier copies and, once unlocked, the files."""
        doomed = self.tree.subtree(node)

        def delete():
            with self.meta.transaction():
                for n in doomed:
                    self.meta.delete_node(n.id)
        self._meta_write(delete, "removing a prefix")
        for n in reversed(doomed):
            self.tree.detach(n)
            self._retire_node(n)
        return doomed

    def evict_leaf(self) -> RadixNode | None:
        """Evict the unlocked leaf with the lowest score (hits) or the least recent use."""
        with self.lock:
            leaves = self.tree.evictable_leaves()
            if not leaves:
                return None
            key = (lambda n: (n.hits, n.last_access)) if self.config.eviction == "score" \
                else (lambda n: n.last_access)
            victim = min(leaves, key=key)
            self._remove_subtree(victim)
            self.metrics.evictions += 1
            return victim

    def _evict_bytes(self, nbytes: int) -> int:
        """Evict unlocked leaves until their files add up to `nbytes` (a disk found full);
        returns the bytes freed (0: nothing could go)."""
        freed = 0
        with self.lock:
            while freed < nbytes:
                try:
                    victim = self.evict_leaf()
                except StoreWriteFailed:
                    break
                if victim is None:
                    break
                freed += sum(e.layout.file_bytes for e in victim.layers)
        if freed:
            log.warning("store %s: disk full; evicted %d bytes of prefixes to store a new one",
                        self.dir, freed)
        return freed

    def _make_room(self, new_bytes: int) -> None:
        """Evict until `new_bytes` more fit under the capacity, then reserve them (files
        being written by concurrent inserts count before they are committed); the caller
        gives the reservation back (self._reserved -= new_bytes) when done."""
        cap = self.config.disk_capacity_bytes
        with self.lock:
            if cap is not None:
                if new_bytes > cap:
                    raise StoreFull(f"{new_bytes} bytes of KV exceed the store capacity {cap}")
                while self.disk_bytes() + self._reserved + new_bytes > cap:
                    if self.evict_leaf() is None:
                        raise StoreFull("store capacity reached and every leaf is in use")
            self._reserved += new_bytes

    def quarantine(self, node: RadixNode, reason: str) -> None:
        """Take a corrupt node (and the prefixes below it, unreachable now) out of service.

        Its files are kept in quarantine/ for inspection (bounded by
        StoreConfig.quarantine_bytes); requests recompute and re-insert.
        """
        with self.lock:
            if not node.live:
                return
            log.warning("corrupt KV in store %s, node %d (%s): quarantined, serving by "
                        "recompute", self.dir, node.id, reason)
            for entry in node.layers:
                self._quarantine_file(Path(entry.path))
            self.metrics.quarantined_nodes += 1
            try:
                self._remove_subtree(node)
            except StoreWriteFailed as exc:
                # Out of service all the same; its rows stay and are caught again on read.
                log.warning("store %s: rows of quarantined node %d not deleted: %s",
                            self.dir, node.id, exc)
                for n in reversed(self.tree.subtree(node)):
                    self.tree.detach(n)
                    self._retire_node(n)
            self._trim_quarantine()

    def _quarantine_file(self, path: Path) -> None:
        """Keep a hard link to a store file in quarantine/ (a link, never its target)."""
        try:
            self.quarantine_dir.mkdir(mode=0o700, exist_ok=True)
            os.link(path, self.quarantine_dir / path.name, follow_symlinks=False)
        except OSError:
            pass      # gone, or a link across file systems: nothing to keep

    def _quarantine_files(self) -> list[os.DirEntry]:
        try:
            return [e for e in os.scandir(self.quarantine_dir)
                    if e.is_file(follow_symlinks=False) or e.is_symlink()]
        except FileNotFoundError:
            return []

    def quarantine_bytes(self) -> int:
        return sum(e.stat(follow_symlinks=False).st_size for e in self._quarantine_files())

    def _trim_quarantine(self) -> None:
        """Delete the oldest quarantined files beyond StoreConfig.quarantine_bytes."""
        entries = [(e.stat(follow_symlinks=False), e) for e in self._quarantine_files()]
        total = sum(st.st_size for st, _ in entries)
        for st, e in sorted(entries, key=lambda x: x[0].st_ctime):
            if total <= self.config.quarantine_bytes:
                break
            os.unlink(e.path)
            total -= st.st_size
