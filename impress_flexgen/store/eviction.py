"""Removing prefixes: eviction under the capacity, quarantine of corrupt nodes, and the
deletion of files once no request holds them."""
from __future__ import annotations

import logging
from pathlib import Path

from ..errors import StoreFull, StoreWriteFailed
from .files import LayerFiles
from .radix import RadixNode
from .state import StoreState, meta_write

log = logging.getLogger("impress_flexgen.store")


class Removal:
    """Takes prefixes out of the store: eviction under the capacity, quarantine of corrupt
    nodes, superseded inexact nodes; their tier copies go at once, their files once no
    request holds them. `tiers`: the TierStack whose memory copies are dropped."""

    def __init__(self, state: StoreState, files: LayerFiles, tiers) -> None:
        self.state = state
        self.files = files
        self.tiers = tiers
        self.said_full = False      # the full file system was reported (once an open)

    def retire_node(self, node: RadixNode) -> None:
        node.retired_files.extend(e.path for e in node.layers)
        for layer in range(len(node.layers)):
            self.state.stats.pop((node.id, layer), None)
        self.tiers.invalidate_node(node.id)
        if node.lock_count == 0:
            self.files.delete_retired(node)

    def unlock(self, freed: list[RadixNode]) -> None:
        """Delete the retired files of nodes no request holds any more (tree.unlock/unpin's
        answer); under the lock."""
        for node in freed:
            self.files.delete_retired(node)

    def remove_subtree(self, node: RadixNode) -> list[RadixNode]:
        """Delete a node and everything below it: rows first (one transaction), then the
        tree, the tier copies and, once unlocked, the files."""
        doomed = self.state.tree.subtree(node)

        def delete():
            with self.state.meta.transaction():
                for n in doomed:
                    self.state.meta.delete_node(n.id)
        meta_write(delete, "removing a prefix")
        for n in reversed(doomed):
            self.state.tree.detach(n)
            self.retire_node(n)
        return doomed

    def supersede(self, node: RadixNode) -> None:
        """Under the lock: remove an inexact node (and the prefixes below it, inexact by
        descent) that exact KV of the same tokens replaces."""
        doomed = self.state.tree.subtree(node)
        if any(n.lock_count for n in doomed):
            raise StoreWriteFailed("an approximate copy of this prefix is in use; its exact "
                                   "KV is not stored this time")
        self.remove_subtree(node)
        self.state.metrics.superseded += len(doomed)

    def evict_leaf(self) -> RadixNode | None:
        """Evict the unlocked leaf with the lowest score (hits) or the least recent use."""
        with self.state.lock:
            leaves = self.state.tree.evictable_leaves()
            if not leaves:
                return None
            key = (lambda n: (n.hits, n.last_access)) if self.state.config.eviction == "score" \
                else (lambda n: n.last_access)
            victim = min(leaves, key=key)
            self.remove_subtree(victim)
            self.state.metrics.evictions += 1
            return victim

    def evict_bytes(self, nbytes: int) -> int:
        """Evict unlocked leaves until their files add up to `nbytes` (the file system is
        full, or nearly); returns the bytes freed (0: nothing could go). Said once per store
        open: on a disk kept full it happens at every insert."""
        freed = 0
        with self.state.lock:
            while freed < nbytes:
                try:
                    victim = self.evict_leaf()
                except StoreWriteFailed:
                    break
                if victim is None:
                    break
                freed += sum(e.layout.file_bytes for e in victim.layers)
        if freed and not self.said_full:
            self.said_full = True
            log.warning("store %s: its file system is full; evicting prefixes to store new "
                        "ones (set a disk capacity to keep the store smaller)", self.state.dir)
        return freed

    def make_room(self, new_bytes: int) -> None:
        """Evict until `new_bytes` more fit under the capacity, or without one, on the file
        system with its headroom left free; then reserve them (files being written by
        concurrent inserts count before they are committed). The caller gives the
        reservation back (state.reserved -= new_bytes) when done."""
        cap = self.state.config.disk_capacity_bytes
        with self.state.lock:
            if cap is not None:
                if new_bytes > cap:
                    raise StoreFull(f"{new_bytes} bytes of KV exceed the store capacity {cap}")
                while disk_bytes(self.state) + self.state.reserved + new_bytes > cap:
                    if self.evict_leaf() is None:
                        raise StoreFull("store capacity reached and every leaf is in use")
            else:
                self._keep_headroom(new_bytes)
            self.state.reserved += new_bytes

    def _keep_headroom(self, new_bytes: int) -> None:
        """No capacity: evict before the new files would leave the file system with less
        than its headroom free. Layer files that took its last bytes would leave the
        metadata no room to record even the eviction that frees them. Where too little can
        go, the write is tried all the same (and a full disk is handled by the insert)."""
        free = self.files.free_bytes()
        if free is None:
            return
        short = new_bytes + self.state.reserved + self.state.config.disk_headroom_bytes - free
        if short > 0:
            self.evict_bytes(short)

    def quarantine(self, node: RadixNode, reason: str) -> None:
        """Take a corrupt node (and the prefixes below it, unreachable now) out of service.

        Its files are kept in quarantine/ for inspection (bounded by
        StoreConfig.quarantine_bytes); requests recompute and re-insert.
        """
        with self.state.lock:
            if not node.live:
                return
            log.warning("corrupt KV in store %s, node %d (%s): quarantined, serving by "
                        "recompute", self.state.dir, node.id, reason)
            for entry in node.layers:
                self.files.quarantine_file(Path(entry.path))
            self.state.metrics.quarantined_nodes += 1
            try:
                self.remove_subtree(node)
            except StoreWriteFailed as exc:
                # Out of service all the same; its rows stay and are caught again on read.
                log.warning("store %s: rows of quarantined node %d not deleted: %s",
                            self.state.dir, node.id, exc)
                for n in reversed(self.state.tree.subtree(node)):
                    self.state.tree.detach(n)
                    self.retire_node(n)
            self.files.trim_quarantine()


def disk_bytes(state: StoreState) -> int:
    """Bytes of every layer file the tree references."""
    with state.lock:
        return sum(e.layout.file_bytes for n in state.tree.nodes.values() for e in n.layers)
