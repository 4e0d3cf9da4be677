"""Inserting newly computed prefix KV: files written and fsynced outside the store lock,
then one metadata transaction (with the split of a partly matched node) makes them visible."""
from __future__ import annotations

import time

import numpy as np

from disk_layout.format import LayerFileLayout
from disk_layout.metadata import LayerRow

from ..errors import DiskFull, StoreWriteFailed
from .config import namespace_key
from .entries import LayerEntry, LayerStats
from .eviction import Removal
from .files import LayerFiles
from .radix import PrefixMatch, RadixNode
from .reads import DiskReads
from .state import StoreState, meta_write


class Inserter:
    """Durable inserts of newly computed prefix KV, and the splits they need."""

    def __init__(self, state: StoreState, files: LayerFiles, reads: DiskReads,
                 removal: Removal) -> None:
        self.state = state
        self.files = files
        self.reads = reads
        self.removal = removal

    def insert(self, tokens, start: int, kv, namespace: str = "", exact: bool = True
               ) -> list[RadixNode]:
        """Store the KV of tokens[start:end] (end = last whole chunk of `tokens`) in
        `namespace`.

        `kv[layer]` is (K, V), each (kv_heads, n, head_dim) for positions start..start+n,
        n >= end - start. `start` must be chunk-aligned and lie within the stored prefix of
        `tokens` (normally match.length). Returns the nodes now covering tokens[:end].

        `exact`: the KV was computed with full attention over an exact prefix. Inexact KV
        is stored flagged (exact-only matches stop before it); exact KV supersedes the
        inexact nodes in its way (removed, unless a request holds them: then nothing is
        stored). Exact KV whose stored prefix before `start` is inexact is stored inexact,
        and so is all KV of a store whose format does not keep the computed values.

        Files are written and fsynced with the path pinned but without the store lock, so
        other requests go on meanwhile; the commit then checks that the tree still looks as
        it did (another insert, a split or a reorder may have changed it) and otherwise
        starts again from the new tree.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        c = self.state.config.chunk_size
        end = len(tokens) // c * c
        if start % c:
            raise ValueError("insert start must be chunk-aligned")
        ns = namespace_key(namespace)
        exact = exact and self.state.shape.kv_exact
        # Room a full disk must make before a retry: the new files, a split's at most.
        need = 2 * self.state.shape.n_layers * self.state.layout(max(c, end - start)).file_bytes
        changed = 0         # commits found the tree changed (a full disk's rounds not counted)
        while changed < 8:
            with self.state.lock:
                if exact and self.state.tree.match_prefix(tokens[:end], ns, True).length < start:
                    exact = False     # below an inexact prefix: inexact by descent
                match = self.state.tree.match_prefix(tokens[:end], ns, exact_only=exact)
                have = match.length
                if exact and have < end:
                    blocker = self.state.tree.next_child(tokens[:end], match, ns)
                    if blocker is not None and not blocker.exact:
                        self.removal.supersede(blocker)
                        continue
                if have < start:
                    # Only a quarantine removes a pinned prefix: nothing to attach to now.
                    raise StoreWriteFailed(f"insert at {start} but only {have} tokens are "
                                           "stored (removed meanwhile)")
                if have >= end:
                    return match.nodes
                # Pinned: nothing evicts the nodes we read and attach under, or deletes
                # their files.
                self.state.tree.lock(match)
                last, used = match.segments[-1] if match.segments else (None, 0)
                split_at = used if last is not None and used < last.n_tokens else None
                # The layers to split: a reorder may replace them meanwhile, which changes
                # only their physical order, so the halves (written in logical order) hold.
                seen = list(last.layers) if split_at is not None else None
            try:
                node = self._insert_pinned(tokens[:end], start, kv, match, have, split_at, seen,
                                           ns, exact)
            except DiskFull:
                # No capacity set and the disk itself is full: evict leaves nobody holds
                # (this insert's path is pinned) and try again, until it fits or nothing
                # can go; each round evicts at least one leaf. A disk with room left (a
                # passing fault) evicts nothing.
                free = self.files.free_bytes()
                if self.state.config.disk_capacity_bytes is not None or (
                        free is not None
                        and free >= need + self.state.config.disk_headroom_bytes):
                    raise
                if not self.removal.evict_bytes(need):
                    raise
                continue
            finally:
                with self.state.lock:
                    for freed in self.state.tree.unlock(match):
                        self.files.delete_retired(freed)
            if node is not None:
                with self.state.lock:
                    return self.state.tree.path_to(node)
            changed += 1
        raise StoreWriteFailed("the prefix tree kept changing while this prefix was written")

    def _insert_pinned(self, tokens, start, kv, match: PrefixMatch, have: int,
                       split_at: int | None, seen, ns: str = "", exact: bool = True
                       ) -> RadixNode | None:
        """Write the files of an insert (and of the split it needs), then commit them if the
        tree is unchanged; None: it changed, nothing was kept."""
        last = match.segments[-1][0] if match.segments else None
        new_tokens = tokens[have:]
        offset = have - start
        layers = [(k[:, offset:offset + len(new_tokens)], v[:, offset:offset + len(new_tokens)])
                  for k, v in kv]
        layout = self.state.layout(len(new_tokens))
        need = self.state.shape.n_layers * layout.file_bytes
        if split_at is not None:
            need += self.state.shape.n_layers * (self.state.layout(split_at).file_bytes +
                                          self.state.layout(last.n_tokens - split_at).file_bytes)
        self.removal.make_room(need)       # reserves `need`; given back below
        names: list[str] = []
        try:
            split = None
            if split_at is not None:
                split = self._write_split(last, split_at, seen, names)
            files = self.files.write_files(layout, layers, names)
            with self.state.lock:
                if self.state.tree.match_prefix(tokens, ns, exact).segments != match.segments or \
                        (exact and (n := self.state.tree.next_child(tokens, match, ns)) is not None
                         and not n.exact):
                    self.state.metrics.insert_retries += 1
                    return None
                node = self._commit_insert(last, split, have, new_tokens, layout, files, ns,
                                           exact and (last is None or last.exact))
                names = []            # committed: the files are the store's now
                self.state.metrics.inserts += 1
                return node
        finally:
            self.files.discard(names)
            with self.state.lock:
                self.state.reserved -= need

    def _write_split(self, node: RadixNode, at: int, seen, names: list[str]) -> dict:
        """Rewrite `node` as two nodes split at chunk boundary `at` (files only)."""
        head, tail = [], []
        for entry in seen:
            k, v = self.reads.read_layer(entry, node)
            head.append((k[:, :at], v[:, :at]))
            tail.append((k[:, at:], v[:, at:]))
        head_layout, tail_layout = self.state.layout(at), self.state.layout(node.n_tokens - at)
        return {"node": node, "at": at,
                "head": (head_layout, self.files.write_files(head_layout, head, names)),
                "tail": (tail_layout, self.files.write_files(tail_layout, tail, names))}

    def _commit_insert(self, last: RadixNode | None, split: dict | None, have: int,
                       tokens: np.ndarray, layout: LayerFileLayout, files, ns: str = "",
                       exact: bool = True) -> RadixNode:
        """Under the lock: one transaction makes the split (if any) and the new node visible,
        then the tree follows."""
        def commit():
            with self.state.meta.transaction():
                parent_id = last.id if last is not None else None
                if split is not None:
                    old = split["node"]
                    grand = None if self.state.tree.is_root(old.parent) else old.parent
                    head_id = self.state.meta.add_node(grand.id if grand else None, old.start,
                                                 old.tokens[:split["at"]], old.exact,
                                                 old.namespace)
                    tail_id = self.state.meta.add_node(head_id, old.start + split["at"],
                                                 old.tokens[split["at"]:], old.exact,
                                                 old.namespace)
                    for nid, part in ((head_id, "head"), (tail_id, "tail")):
                        for layer, (name, crcs) in enumerate(split[part][1]):
                            self.state.meta.put_layer(LayerRow(nid, layer, 1, name, None, crcs))
                    for child in old.children.values():
                        self.state.meta.set_parent(child.id, tail_id)
                    self.state.meta.delete_node(old.id)
                    split["ids"] = (head_id, tail_id)
                    parent_id = head_id
                nid = self.state.meta.add_node(parent_id, have, tokens, exact, ns)
                for layer, (name, crcs) in enumerate(files):
                    self.state.meta.put_layer(LayerRow(nid, layer, 1, name, None, crcs))
                return nid

        nid = meta_write(commit, "storing a prefix")
        parent = last
        if split is not None:
            parent = self._apply_split(split)
        node = RadixNode(nid, parent, have, tokens.copy(), last_access=time.time(),
                         exact=exact, namespace=ns)
        data_dir, c = self.state.data_dir, self.state.config.chunk_size
        node.layers = [LayerEntry(nid, layer, 1, str(data_dir / name), layout, None, crcs)
                       for layer, (name, crcs) in enumerate(files)]
        for layer in range(len(files)):
            self.state.stats[(nid, layer)] = LayerStats.fresh(len(tokens), c)
        self.state.tree.attach(node)
        return node

    def _apply_split(self, split: dict) -> RadixNode:
        """The tree side of a committed split: head and tail replace the node; its
        statistics are divided between them. Returns the head."""
        node, at = split["node"], split["at"]
        halves = []
        for nid, part, sl, start in ((split["ids"][0], "head", slice(0, at), node.start),
                                     (split["ids"][1], "tail", slice(at, None), node.start + at)):
            layout, files = split[part]
            new = RadixNode(nid, None, start, node.tokens[sl].copy(), hits=node.hits,
                            last_access=node.last_access, exact=node.exact,
                            namespace=node.namespace)
            new.layers = [LayerEntry(nid, layer, 1, str(self.state.data_dir / name), layout, None,
                                     crcs) for layer, (name, crcs) in enumerate(files)]
            for layer in range(len(files)):
                s = LayerStats.fresh(new.n_tokens, self.state.config.chunk_size)
                s.importance[:] = self.state.stats[(node.id, layer)].importance[sl]
                s.dirty = True
                self.state.stats[(nid, layer)] = s
            # Whoever holds the node holds its halves: nothing evicts them meanwhile.
            new.lock_count = node.lock_count
            halves.append(new)
        node.successors = halves
        self.state.tree.replace(node, halves)
        self.removal.retire_node(node)
        self.state.metrics.splits += 1
        return halves[0]
