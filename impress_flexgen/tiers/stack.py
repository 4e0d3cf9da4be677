"""The tiers a load asks, fastest first: the memory chain (GPU, CPU), then the disk.

    stack = TierStack(memory=ChunkCache(...))    # memory tiers: optional
    stack.attach_disk(disk_tier)                 # the store's DiskTier (disk.py), always last
    load = stack.submit(ChunkLoad(entry, {"k": ids, "v": ids}, ratios, node))
    chunks, served = stack.wait(load)   # {kind: chunks}; bytes per tier name, "disk_chunks"

Every tier holds a chunk as the store keeps it (its KV format: int4 chunks as their packed
bytes, so a memory tier of N bytes holds 3.2x more of them than of fp16); wait() hands
back values ((heads, C, head_dim); int4 decoded to float32 on the chunk's device).

Each tier is a `Tier` (base.py) and is called through submit_get/wait and put. A chunk the
memory chain misses goes to the disk, asked by file (the load's entry, {kind: missed ids});
what the disk returns is offered to the memory chain after (put, scored by the chunk's
important-token ratio), which keeps the chain's score-ranked admission, promotion and
demotion (chain.py). Chunks read ahead of time (prefetch) are taken in place of a disk read
and offered to the memory chain the same way.

The shared pool (tiers/pool.py) is not in this list: it holds whole prefixes across servers
and is asked before the local match is extended, not per chunk.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from disk_layout.format import decode_chunks

from .base import ChunkLoad
from .chain import DISK, ChunkCache, TierConfig
from .memory_chain import MemoryChain


@dataclasses.dataclass
class StackLoad:
    """A load in flight: memory hits (and prefetched chunks) in `out`, disk reads pending."""

    load: ChunkLoad
    out: list
    served: dict
    keys: list
    ratios: Sequence[float]
    misses: list = dataclasses.field(default_factory=list)     # slots the disk reads
    disk: object = None                                        # the disk tier's pending read

    def crc(self, slot: int) -> int:
        """The CRC-32 a copy of the slot's chunk keeps."""
        key = self.keys[slot]
        return self.load.entry.crc(key[3], key[4])


@dataclasses.dataclass
class Prefetch:
    """A read ahead in flight (TierStack.prefetch): the chunks read, by kind."""

    wanted: dict
    disk: object


class TierStack:
    """The memory chain (if any), then the disk tier: what every load of stored KV asks."""

    def __init__(self, memory: ChunkCache | None = None, disk=None) -> None:
        self.memory: MemoryChain | None = None
        self.disk = disk
        self.use_memory(memory)

    def use_memory(self, cache: ChunkCache | None) -> None:
        """Put a ChunkCache (GPU and CPU tiers) in front of the disk, or none; engines that
        share a store share its memory tiers."""
        self.memory = MemoryChain(cache) if cache is not None else None

    def attach_disk(self, disk) -> None:
        self.disk = disk

    @property
    def cache(self) -> ChunkCache | None:
        """The memory tiers' ChunkCache (metrics, resident keys), or None."""
        return None if self.memory is None else self.memory.cache

    @property
    def tiers(self) -> list:
        """Every tier, fastest first."""
        return ([self.memory] if self.memory is not None else []) + [self.disk]

    @property
    def names(self) -> tuple[str, ...]:
        """Where a load may be served from, fastest first: the memory tiers, the disk."""
        if self.memory is None:
            return TierConfig().names(remote=False)
        return (*self.memory.tier_names, DISK)

    # ------------------------------------------------------------------ removals
    def invalidate_node(self, node_id) -> None:
        """A node left the store: its memory copies go and are refused from now on."""
        if self.memory is not None:
            self.memory.invalidate_node(node_id)

    def invalidate_version(self, node_id, layer: int, version: int) -> None:
        """A reorder replaced (node, layer) at `version`: copies of it and older go."""
        if self.memory is not None:
            self.memory.invalidate_version(node_id, layer, version)

    def in_memory(self, key) -> bool:
        """Held by a memory tier (no access counted)."""
        return self.memory is not None and self.memory.contains(key)

    # ------------------------------------------------------------------ loads
    def submit(self, load: ChunkLoad, ahead: dict | None = None) -> StackLoad:
        """Serve what the memory chain holds and start the disk read of the rest.

        ahead: chunks already read ({kind: {chunk id: chunk}}, a prefetch's), taken in place
        of a disk read. Every submit must be waited for, even when the caller gives up on
        the result."""
        keys = load.keys()
        ratios = load.flat_ratios()
        chunk_bytes = load.entry.layout.chunk_bytes
        out = StackLoad(load, [None] * len(keys),
                        dict.fromkeys(self.names, 0) | {"disk_chunks": 0}, keys, ratios)
        memory = self.memory
        missing: dict[str, list[int]] = {}
        for j, key in enumerate(keys):
            # One key at a time: an admission of a chunk read ahead may demote or evict
            # what the next lookup would have found.
            if memory is not None:
                got = memory.submit_get([key], [ratios[j]])
                if got.chunks[0] is not None:
                    out.out[j] = memory.wait(got)[0]
                    out.served[got.served_by[0]] += chunk_bytes
                    continue
            kind, chunk = key[3], key[4]
            early = (ahead or {}).get(kind, {}).get(chunk)
            if early is not None:
                out.out[j] = early
                if memory is not None:
                    memory.put(key, early, out.crc(j), ratios[j])
            else:
                out.misses.append(j)
                missing.setdefault(kind, []).append(chunk)
        if out.misses:
            out.disk = self.disk.submit_get(ChunkLoad(load.entry, missing, node=load.node))
            if out.disk.error is not None:      # the file could not be opened
                self.disk.wait(out.disk)
                raise out.disk.error
        return out

    def wait(self, pending: StackLoad) -> tuple[dict[str, list], dict]:
        """({kind: chunks in asked order}, bytes served per tier and "disk_chunks": chunks
        read); a chunk that fails its check raises the store's CorruptNode."""
        if pending.disk is not None:
            fresh = self.disk.wait(pending.disk)
            if pending.disk.error is not None:
                raise pending.disk.error
            pending.served[DISK] += pending.disk.bytes_read
            pending.served["disk_chunks"] = len(pending.misses)
            memory = self.memory
            for j, tensor in zip(pending.misses, fresh):
                pending.out[j] = tensor
                if memory is not None:
                    # The CRC goes with the copy: checked before a promotion serves it.
                    # A node invalidated while this read was in flight is refused.
                    memory.put(pending.keys[j], tensor, pending.crc(j), pending.ratios[j])
        # The tiers keep chunks as stored (int4: packed bytes); the caller gets values.
        values = decode_chunks(pending.out, pending.load.entry.layout)
        chunks, at = {}, 0
        for kind, ids in pending.load.wanted.items():
            chunks[kind] = values[at:at + len(ids)]
            at += len(ids)
        return chunks, pending.served

    def prefetch(self, load: ChunkLoad) -> Prefetch:
        """Start reading chunks a load is expected to ask for soon, except those a memory
        tier holds; no tier counts anything until the load (submit(..., ahead=...) counts
        hits and misses and admits as if it had read the misses itself). Every prefetch
        must be finished."""
        wanted: dict[str, list[int]] = {}
        for key in load.keys():
            if not self.in_memory(key):
                wanted.setdefault(key[3], []).append(key[4])
        read = self.disk.submit_get(ChunkLoad(load.entry, wanted, node=load.node))
        if read.error is not None:               # the file could not be opened
            self.disk.wait(read)
            raise read.error
        return Prefetch(wanted, read)

    def finish_prefetch(self, pending: Prefetch) -> tuple[dict[str, dict[int, torch.Tensor]],
                                                          int]:
        """Wait for a prefetch: ({kind: {chunk id: chunk}}, bytes read from disk); a failed
        check raises."""
        chunks = self.disk.wait(pending.disk)
        if pending.disk.error is not None:
            raise pending.disk.error
        out: dict[str, dict[int, torch.Tensor]] = {kind: {} for kind in pending.wanted}
        flat = iter(chunks)
        for kind, ids in pending.wanted.items():
            for i in ids:
                out[kind][i] = next(flat)
        return out, pending.disk.bytes_read
