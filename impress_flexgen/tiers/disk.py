"""The local disk store seen through the tier interface (`base.Tier`): the last tier of
a store's TierStack, which every load of stored KV goes through.

Keys are the memory tiers' (node_id, layer, version, kind, chunk) (`base.chunk_key`): a key
is held while its node is live and that layer's current entry has that version and at least
chunk+1 chunks. Reads go through the store's own disk read (coalesced, CRC-checked), one
round trip per layer file whatever the number of keys in it.

The load path asks by file (`submit_get(ChunkLoad(entry, {kind: ids}, node=node))`): the
entry its request holds, which may be a version a reorder has since replaced (its file stays
until the request lets go). Such a read is of that file, in the asked order; a failed check
there is not quarantined here but handed back (`pending.error`) for the caller, which holds
the node, to raise.

The disk is written by inserts of whole prefixes (`PrefixStore.insert`), never chunk by
chunk: `put` refuses every offer (`writable` is False). A chunk that fails its check is a
miss and its node is quarantined; a node is removed (`invalidate`) only while no request
holds it. Nothing here raises to the caller for a bad disk or a closed store: it misses.

The store's parts it reads through (its state, its disk reads, its removals) are given to it
by the store that owns them.
"""
from __future__ import annotations

import dataclasses
import logging
import numbers
import threading
from collections.abc import Sequence

import torch

from ..errors import CorruptNode, StoreWriteFailed
from .base import ChunkKey, ChunkLoad
from .chain import DISK

log = logging.getLogger("impress_flexgen.store")

_KINDS = ("k", "v")
COUNTERS = ("hits", "misses", "bytes_served", "corrupt_reads", "invalidated_nodes")


@dataclasses.dataclass
class _Group:
    """The keys of one request that fall in one layer file: one read."""

    node: object            # its radix node
    entry: object           # its layer entry
    slots: dict = dataclasses.field(default_factory=dict)   # (kind, chunk) -> result slots
    read: object = None                                      # DiskReads.start_chunks's read
    error: CorruptNode | None = None


@dataclasses.dataclass
class _DiskGet:
    """What submit_get returns: the reads in flight, and where their chunks go; after
    wait(), the bytes read from disk (padding included) and, for a read at a named entry,
    the failure to raise (None: none)."""

    n_keys: int
    groups: list[_Group]
    load: ChunkLoad | None = None       # a read of one named file, in asked order
    bytes_read: int = 0
    error: Exception | None = None


class DiskTier:
    """A `PrefixStore`'s layer files as a tier: read-only through the protocol."""

    name = DISK
    # Chunks reach the disk only through inserts of whole prefixes: a chunk on its own has
    # no radix node to live in.
    writable = False

    def __init__(self, state, reads, removal, used_bytes) -> None:
        """`state`: the store's StoreState; `reads`: its DiskReads; `removal`: its
        Removal; `used_bytes()`: bytes of its layer files."""
        self.state = state
        self.reads = reads
        self.removal = removal
        self.used_bytes = used_bytes
        self._mu = threading.Lock()   # the counters; the store's lock guards everything else
        self.counters = dict.fromkeys(COUNTERS, 0)

    # ------------------------------------------------------------------ the Tier protocol
    def contains(self, key: ChunkKey) -> bool:
        with self.state.lock:
            return self._find(key) is not None

    def batch_exists(self, keys: Sequence[ChunkKey]) -> int:
        with self.state.lock:
            n = 0
            for key in keys:
                if self._find(key) is None:
                    break
                n += 1
            return n

    def submit_get(self, keys: Sequence[ChunkKey] | ChunkLoad) -> _DiskGet:
        """Start reading `keys`, grouped by layer file; a key not held is a miss at once.
        The nodes read stay pinned until wait(): nothing deletes their files meanwhile.
        A ChunkLoad: one read of its entry's file (an entry its caller holds)."""
        if isinstance(keys, ChunkLoad):
            return self._submit_load(keys)
        keys = list(keys)
        groups: dict[tuple[int, int], _Group] = {}
        misses = 0
        state = self.state
        with state.lock:
            for slot, key in enumerate(keys):
                found = self._find(key)
                if found is None:
                    misses += 1
                    continue
                node, entry, kind, chunk = found
                group = groups.get((node.id, entry.layer))
                if group is None:
                    group = groups[(node.id, entry.layer)] = _Group(node, entry)
                    state.tree.pin(node)
                group.slots.setdefault((kind, chunk), []).append(slot)
        self._count(misses=misses)
        for group in groups.values():
            wanted: dict[str, list[int]] = {}
            for kind, chunk in group.slots:      # each chunk once, however often asked
                wanted.setdefault(kind, []).append(chunk)
            try:
                group.read = self.reads.start_chunks(group.entry, wanted, group.node)
            except CorruptNode as exc:       # the file cannot be opened: a miss, in wait()
                group.error = exc
            except RuntimeError:             # the store closed meanwhile: misses
                pass
        return _DiskGet(len(keys), list(groups.values()))

    def _submit_load(self, load: ChunkLoad) -> _DiskGet:
        """One read of the load's file, each chunk as often as it is asked."""
        group = _Group(load.node, load.entry)
        pending = _DiskGet(sum(map(len, load.wanted.values())), [group], load=load)
        try:
            group.read = self.reads.start_chunks(load.entry, load.wanted, load.node)
        except CorruptNode as exc:
            group.error = exc
        return pending

    def wait(self, pending: _DiskGet) -> list[torch.Tensor | None]:
        """The chunks, in asked order: (kv_heads, C, head_dim) tensors in the store's KV
        format, of their own read buffers (the caller's to keep or change). A layer file
        that fails a check or a read makes every key of it a miss, and its node leaves the
        store (a read at a named entry: the failure is left in pending.error for the
        caller)."""
        out: list[torch.Tensor | None] = [None] * pending.n_keys
        if pending.load is not None:
            self._wait_load(pending, out)
            return out
        for group in pending.groups:
            try:
                if group.error is not None:
                    raise group.error
                if group.read is None:
                    self._count(misses=sum(map(len, group.slots.values())))
                    continue
                chunks, nbytes = self.reads.finish_chunks(group.read)
                pending.bytes_read += nbytes
            except CorruptNode as exc:
                self._count(misses=sum(map(len, group.slots.values())), corrupt_reads=1)
                # The store logs the quarantine; the caller sees only misses.
                self._quarantine(exc)
            else:
                self._serve(group, chunks, out)
            finally:
                self._unpin(group.node)
        return out

    def _wait_load(self, pending: _DiskGet, out: list) -> None:
        (group,) = pending.groups
        try:
            if group.error is not None:
                raise group.error
            chunks, pending.bytes_read = self.reads.finish_chunks(group.read)
        except CorruptNode as exc:
            self._count(misses=pending.n_keys, corrupt_reads=1)
            pending.error = exc
            return
        out[:] = [chunk for kind in pending.load.wanted for chunk in chunks[kind]]
        self._count(hits=pending.n_keys,
                    bytes_served=pending.n_keys * group.entry.layout.chunk_bytes)

    def put(self, key: ChunkKey, tensor: torch.Tensor, crc: int | None = None) -> bool:
        """Always False: the disk takes whole prefixes through `PrefixStore.insert`."""
        return False

    def invalidate(self, keys: Sequence[ChunkKey]) -> int:
        """Remove the nodes of these keys, with the prefixes below them, where no request
        holds any of them (a held node stays). Every chunk of a removed node goes; the
        count is of the given keys that went."""
        state = self.state
        with state.lock:
            held: dict[int, set] = {}
            nodes: dict = {}
            for key in keys:
                found = self._find(key)
                if found is not None:
                    nodes[found[0].id] = found[0]
                    held.setdefault(found[0].id, set()).add(key)
            for node in nodes.values():
                if not node.live or any(n.lock_count for n in state.tree.subtree(node)):
                    continue
                try:
                    self.removal.remove_subtree(node)
                except StoreWriteFailed as exc:   # its rows stay: the node stays too
                    log.warning("store %s: node %d not invalidated: %s", state.dir, node.id, exc)
                    continue
                self._count(invalidated_nodes=1)
            return sum(1 for ks in held.values() for k in ks if self._find(k) is None)

    def read_counters(self) -> tuple[int, float]:
        """(bytes read from disk, seconds the reader threads were busy), so far."""
        return self.state.reader.counters()

    @property
    def read_limit(self) -> float | None:
        """The reads' rate limit in bytes per second (None: none)."""
        return self.state.reader.limit

    def metrics(self) -> dict:
        """This tier's hits, misses and bytes served (chunk payloads), with the store's
        own disk counters (chunks_read, bytes_read with padding, corruptions, ...)."""
        state = self.state
        with state.lock:
            out = dataclasses.asdict(state.metrics)
            out["used_bytes"] = self.used_bytes()
            out["capacity_bytes"] = state.config.disk_capacity_bytes
        with self._mu:
            out.update(self.counters)
        return out

    # ------------------------------------------------------------------ helpers
    def _find(self, key) -> tuple | None:
        """(node, entry, kind, chunk) of a held key; None for anything else (a key of
        another shape is not held here, nor anything by a closed store). The caller holds
        the store's lock."""
        if self.state.closed or not isinstance(key, tuple) or len(key) != 5:
            return None
        node_id, layer, version, kind, chunk = key
        if not isinstance(kind, str) or kind not in _KINDS or \
                not all(_is_int(x) for x in (node_id, layer, version, chunk)):
            return None
        node = self.state.tree.nodes.get(int(node_id))
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
            self.removal.quarantine(exc.node, str(exc))
        except Exception as err:  # noqa: BLE001 - out of service or not, the caller misses
            log.warning("store %s: quarantine of node %d failed: %s", self.state.dir,
                        exc.node.id, err)

    def _unpin(self, node) -> None:
        with self.state.lock:
            self.removal.unlock(self.state.tree.unpin(node))

    def _count(self, **deltas: int) -> None:
        with self._mu:
            for name, n in deltas.items():
                self.counters[name] += n


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
