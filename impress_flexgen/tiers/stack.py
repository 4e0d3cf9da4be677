"""The tiers a load asks, fastest first: the memory chain (GPU, CPU), then the disk.

    stack = TierStack(memory=ChunkCache(...))    # memory tiers: optional
    stack.attach_disk(disk_tier)                 # the store's DiskTier, always last
    load = stack.submit(keys, ratios, at=(node, entry), crc_of=..., chunk_bytes=...)
    chunks, served = stack.wait(load)            # served: bytes per tier name, "disk_chunks"

Each tier is a `Tier` (base.py) and is called through submit_get/wait and put. A key the
memory chain misses goes to the disk; what the disk returns is offered to the memory chain
after (put, scored by the chunk's important-token ratio), which keeps the chain's
score-ranked admission, promotion and demotion (chain.py). Chunks read ahead of time
(prefetch) are taken in place of a disk read and offered to the memory chain the same way.

The shared pool (tiers/remote.py) is not in this list: it holds whole prefixes across
servers and is asked before the local match is extended (store/shared.py), not per chunk.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from .chain import DISK, ChunkCache, TierConfig
from .memory_chain import MemoryChain


@dataclasses.dataclass
class StackLoad:
    """A load in flight: memory hits (and prefetched chunks) in `out`, disk reads pending."""

    out: list
    served: dict
    misses: list = dataclasses.field(default_factory=list)     # slots the disk reads
    ratios: Sequence[float] = ()
    crc_of: Callable[[int], int] | None = None
    keys: list = dataclasses.field(default_factory=list)
    disk: object = None                                        # the disk tier's pending read


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
    def submit(self, keys: list, ratios: Sequence[float], at: tuple, crc_of: Callable[[int], int],
               chunk_bytes: int, ahead: Sequence | None = None) -> StackLoad:
        """Serve what the memory chain holds and start the disk read of the rest.

        keys: chunks of one layer file, `at` = (node or None, entry) (the disk reads that
        entry's file); ratios: each key's important-token ratio; crc_of(slot): the CRC-32
        a copy keeps; ahead: per key a chunk already read (or None). Every submit must be
        waited for, even when the caller gives up on the result."""
        load = StackLoad([None] * len(keys), dict.fromkeys(self.names, 0) | {"disk_chunks": 0},
                         ratios=ratios, crc_of=crc_of, keys=keys)
        memory = self.memory
        for j, key in enumerate(keys):
            # One key at a time: an admission of a chunk read ahead may demote or evict
            # what the next lookup would have found.
            if memory is not None:
                got = memory.submit_get([key], [ratios[j]])
                if got.chunks[0] is not None:
                    load.out[j] = memory.wait(got)[0]
                    load.served[got.served_by[0]] += chunk_bytes
                    continue
            early = ahead[j] if ahead is not None else None
            if early is not None:
                load.out[j] = early
                if memory is not None:
                    memory.put(key, early, crc_of(j), ratios[j])
            else:
                load.misses.append(j)
        if load.misses:
            load.disk = self.disk.submit_get([keys[j] for j in load.misses], at=at)
            if load.disk.error is not None:      # the file could not be opened
                self.disk.wait(load.disk)
                raise load.disk.error
        return load

    def wait(self, load: StackLoad) -> tuple[list, dict]:
        """(chunks in asked order, bytes served per tier and "disk_chunks": chunks read);
        a chunk that fails its check raises the store's CorruptNode."""
        if load.disk is not None:
            fresh = self.disk.wait(load.disk)
            if load.disk.error is not None:
                raise load.disk.error
            load.served[DISK] += load.disk.bytes_read
            load.served["disk_chunks"] = len(load.misses)
            memory = self.memory
            for j, tensor in zip(load.misses, fresh):
                load.out[j] = tensor
                if memory is not None:
                    # The CRC goes with the copy: checked before a promotion serves it.
                    # A node invalidated while this read was in flight is refused.
                    memory.put(load.keys[j], tensor, load.crc_of(j), load.ratios[j])
        return load.out, load.served

    def prefetch(self, keys: list, at: tuple):
        """Start reading chunks a load is expected to ask for soon, except those a memory
        tier holds; no tier counts anything until the load. finish_prefetch() waits."""
        keys = [k for k in keys if not self.in_memory(k)]
        read = self.disk.submit_get(keys, at=at)
        if read.error is not None:               # the file could not be opened
            self.disk.wait(read)
            raise read.error
        return keys, read

    def finish_prefetch(self, pending) -> tuple[list, list[torch.Tensor], int]:
        """(keys, chunks, bytes read from disk) of a prefetch; a failed check raises."""
        keys, read = pending
        chunks = self.disk.wait(read)
        if read.error is not None:
            raise read.error
        return keys, chunks, read.bytes_read
