"""The local disk store seen through the tier interface (`impress_flexgen.tiers.base.Tier`).

Keys are the memory tiers' (node_id, layer, version, kind, chunk) (`PrefixStore._key`): a
key is held while its node is live and that layer's current entry has that version and at
least chunk+1 chunks. Reads go through the store's own disk read (coalesced, CRC-checked),
one round trip per layer file whatever the number of keys in it.

The disk is written by inserts of whole prefixes (`PrefixStore.insert`), never chunk by
chunk: `put` refuses every offer (`writable` is False). A chunk that fails its check is a
miss and its node is quarantined; a node is removed (`invalidate`) only while no request
holds it. Nothing here raises to the caller for a bad disk or a closed store: it misses.
"""
from __future__ import annotations

import dataclasses
import logging
import numbers
import threading
from collections.abc import Sequence

import torch

from ..radix import RadixNode
from ..tiers.base import ChunkKey
from ..tiers.chain import DISK
from .config import CorruptNode, StoreWriteFailed
from .entries import LayerEntry

log = logging.getLogger("impress_flexgen.store")

_KINDS = ("k", "v")
COUNTERS = ("hits", "misses", "bytes_served", "corrupt_reads", "invalidated_nodes")


@dataclasses.dataclass
class _Group:
    """The keys of one request that fall in one layer file: one read."""

    node: RadixNode
    entry: LayerEntry
    slots: dict = dataclasses.field(default_factory=dict)   # (kind, chunk) -> result slots
    read: object = None                                      # the store's _ChunkRead
    error: CorruptNode | None = None


@dataclasses.dataclass
class _DiskGet:
    """What submit_get returns: the reads in flight, and where their chunks go."""

    n_keys: int
    groups: list[_Group]


class DiskTier:
    """A `PrefixStore`'s layer files as a tier: read-only through the protocol."""

    name = DISK
    # Chunks reach the disk only through inserts of whole prefixes: a chunk on its own has
    # no radix node to live in.
    writable = False

    def __init__(self, store) -> None:
        self.store = store
        self._mu = threading.Lock()   # the counters; the store's lock guards everything else
        self.counters = dict.fromkeys(COUNTERS, 0)

    # ------------------------------------------------------------------ the Tier protocol
    def contains(self, key: ChunkKey) -> bool:
        with self.store.lock:
            return self._find(key) is not None

    def batch_exists(self, keys: Sequence[ChunkKey]) -> int:
        with self.store.lock:
            n = 0
            for key in keys:
                if self._find(key) is None:
                    break
                n += 1
            return n

    def submit_get(self, keys: Sequence[ChunkKey]) -> _DiskGet:
        """Start reading `keys`, grouped by layer file; a key not held is a miss at once.
        The nodes read stay pinned until wait(): nothing deletes their files meanwhile."""
        keys = list(keys)
        groups: dict[tuple[int, int], _Group] = {}
        misses = 0
        store = self.store
        with store.lock:
            for slot, key in enumerate(keys):
                found = self._find(key)
                if found is None:
                    misses += 1
                    continue
                node, entry, kind, chunk = found
                group = groups.get((node.id, entry.layer))
                if group is None:
                    group = groups[(node.id, entry.layer)] = _Group(node, entry)
                    store.tree.pin(node)
                group.slots.setdefault((kind, chunk), []).append(slot)
        self._count(misses=misses)
        for group in groups.values():
            wanted: dict[str, list[int]] = {}
            for kind, chunk in group.slots:      # each chunk once, however often asked
                wanted.setdefault(kind, []).append(chunk)
            try:
                group.read = store._start_chunks(group.entry, wanted, group.node)
            except CorruptNode as exc:       # the file cannot be opened: a miss, in wait()
                group.error = exc
            except RuntimeError:             # the store closed meanwhile: misses
                pass
        return _DiskGet(len(keys), list(groups.values()))

    def wait(self, pending: _DiskGet) -> list[torch.Tensor | None]:
        """The chunks, in asked order: (kv_heads, C, head_dim) float16 tensors of their
        own read buffers (the caller's to keep or change). A layer file that fails a check
        or a read makes every key of it a miss, and its node leaves the store."""
        out: list[torch.Tensor | None] = [None] * pending.n_keys
        for group in pending.groups:
            try:
                if group.error is not None:
                    raise group.error
                if group.read is None:
                    self._count(misses=sum(map(len, group.slots.values())))
                    continue
                chunks, _ = self.store._finish_chunks(group.read)
            except CorruptNode as exc:
                self._count(misses=sum(map(len, group.slots.values())), corrupt_reads=1)
                # The store logs the quarantine; the caller sees only misses.
                self._quarantine(exc)
            else:
                self._serve(group, chunks, out)
            finally:
                self._unpin(group.node)
        return out

    def put(self, key: ChunkKey, tensor: torch.Tensor, crc: int | None = None) -> bool:
        """Always False: the disk takes whole prefixes through `PrefixStore.insert`."""
        return False

    def invalidate(self, keys: Sequence[ChunkKey]) -> int:
        """Remove the nodes of these keys, with the prefixes below them, where no request
        holds any of them (a held node stays). Every chunk of a removed node goes; the
        count is of the given keys that went."""
        store = self.store
        with store.lock:
            held: dict[int, set] = {}
            nodes: dict[int, RadixNode] = {}
            for key in keys:
                found = self._find(key)
                if found is not None:
                    nodes[found[0].id] = found[0]
                    held.setdefault(found[0].id, set()).add(key)
            for node in nodes.values():
                if not node.live or any(n.lock_count for n in store.tree.subtree(node)):
                    continue
                try:
                    store._remove_subtree(node)
                except StoreWriteFailed as exc:   # its rows stay: the node stays too
                    log.warning("store %s: node %d not invalidated: %s", store.dir, node.id, exc)
                    continue
                self._count(invalidated_nodes=1)
            return sum(1 for ks in held.values() for k in ks if self._find(k) is None)

    def metrics(self) -> dict:
        """This tier's hits, misses and bytes served (chunk payloads), with the store's
        own disk counters (chunks_read, bytes_read with padding, corruptions, ...)."""
        store = self.store
        with store.lock:
            out = dataclasses.asdict(store.metrics)
            out["used_bytes"] = store.disk_bytes()
            out["capacity_bytes"] = store.config.disk_capacity_bytes
        with self._mu:
            out.update(self.counters)
        return out

    # ------------------------------------------------------------------ helpers
    def _find(self, key) -> tuple[RadixNode, LayerEntry, str, int] | None:
        """(node, entry, kind, chunk) of a held key; None for anything else (a key of
        another shape is not held here, nor anything by a closed store). The caller holds
        the store's lock."""
        if self.store._closed or not isinstance(key, tuple) or len(key) != 5:
            return None
        node_id, layer, version, kind, chunk = key
        if not isinstance(kind, str) or kind not in _KINDS or \
                not all(_is_int(x) for x in (node_id, layer, version, chunk)):
            return None
        node = self.store.tree.nodes.get(int(node_id))
        if node is None or not node.live or not 0 <= layer < len(node.layers):
            return None
        entry = node.layers[int(layer)]
        if entry.version != version or not 0 <= chunk < entry.layout.n_chunks:
            return None
        return node, entry, kind, int(chunk)

    def _serve(self, group: _Group, chunks: dict, out: list) -> None:
        hits = 0
        at = dict.fromkeys(chunks, 0)
        for (kind, _), slots in group.slots.items():   # the order `wanted` was built in
            tensor = chunks[kind][at[kind]]
            at[kind] += 1
            for i, slot in enumerate(slots):
                # A key asked twice gets two tensors: no caller sees another's changes.
                out[slot] = tensor if i == 0 else tensor.clone()
            hits += len(slots)
        self._count(hits=hits, bytes_served=hits * group.entry.layout.chunk_bytes)

    def _quarantine(self, exc: CorruptNode) -> None:
        try:
            self.store.quarantine(exc.node, str(exc))
        except Exception as err:  # noqa: BLE001 - out of service or not, the caller misses
            log.warning("store %s: quarantine of node %d failed: %s", self.store.dir,
                        exc.node.id, err)

    def _unpin(self, node: RadixNode) -> None:
        store = self.store
        with store.lock:
            for freed in store.tree.unpin(node):
                store._delete_retired(freed)

    def _count(self, **deltas: int) -> None:
        with self._mu:
            for name, n in deltas.items():
                self.counters[name] += n


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
