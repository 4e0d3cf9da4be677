"""One memory tier: a device, a capacity, its chunk copies ranked by score in a min-heap.

Used alone, a tier is a `Tier` (base.py) that scores a chunk by how often it was put, so it
behaves like an LFU cache. Inside a `ChunkCache` (chain.py) the chain places, ranks, demotes
and promotes copies through the lower-level methods (victims, insert, evict, remove, rerank)
while holding the lock it shares with its tiers, and scores every copy of a chunk from the
statistics the copies share.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from .base import ChunkKey, nbytes, payload_crc

log = logging.getLogger("impress_flexgen.tiers")

COUNTERS = ("hits", "misses", "bytes_in", "bytes_served", "evictions", "promotions",
            "demotions")


class ChunkStats:
    """Access statistics of one chunk; shared by its copies so every tier ranks it alike."""
    __slots__ = ("clock", "freq", "ratio")

    def __init__(self) -> None:
        self.freq = 0
        self.ratio = 0.0
        self.clock = 0


class Resident:
    """One tier's copy of a chunk."""
    __slots__ = ("crc", "entry", "nbytes", "stats", "tensor")

    def __init__(self, tensor: torch.Tensor, size: int, stats: ChunkStats,
                 crc: int | None = None) -> None:
        self.tensor = tensor
        self.nbytes = size
        self.stats = stats
        self.entry: tuple = ()  # the heap entry that is currently valid for this copy
        self.crc = crc          # CRC-32 of the payload as read from disk; None: unchecked


def put_count(stats: ChunkStats) -> float:
    """The standalone score: how often a chunk was offered (LFU)."""
    return float(stats.freq)


class MemoryTier:
    """Chunk copies in one device's memory, at most `capacity` bytes, lowest score out first."""

    # Bound on the put counts a standalone tier remembers for chunks it does not hold.
    max_stats: int = 100_000

    def __init__(self, name: str, capacity: int, device: torch.device | str, *,
                 score: Callable[[ChunkStats], float] = put_count, pin: bool = False,
                 verify: bool = False, lock: threading.Lock | None = None) -> None:
        self.name = name
        self.capacity = max(0, int(capacity))
        self.device = torch.device(device)
        self.score = score
        # Pinned host copies let a later copy to the accelerator run asynchronously.
        self.pin = bool(pin) and self.device.type == "cpu"
        self.verify = verify      # check a copy's CRC before serving it (protocol reads)
        self.used = 0
        self.chunks: dict[ChunkKey, Resident] = {}
        # Min-heap of (score, clock, stamp, key). Entries are never removed in place: an entry is
        # live only while it is its chunk's `entry` (identity), so a score update is one push.
        # The unique stamp keeps heapq from ever comparing keys.
        self.heap: list[tuple] = []
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.corrupt_copies = 0
        self._stamp = itertools.count()
        self._clock = itertools.count(1)
        self._put_stats: collections.OrderedDict[ChunkKey, ChunkStats] = \
            collections.OrderedDict()
        # A chain passes its own lock: the tier's protocol methods then never race the chain.
        self._lock = lock if lock is not None else threading.Lock()

    # ------------------------------------------------------------------ the Tier protocol
    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self.chunks

    def batch_exists(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                if key not in self.chunks:
                    break
                n += 1
            return n

    def submit_get(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor | None]:
        """Memory answers at once: the pending handle is the result list itself."""
        with self._lock:
            out: list[torch.Tensor | None] = []
            for key in keys:
                res = self.chunks.get(key)
                if res is None or (self.verify and not self.sound(key, res)):
                    self.counters["misses"] += 1
                    out.append(None)
                    continue
                self.counters["hits"] += 1
                self.counters["bytes_served"] += res.nbytes
                out.append(res.tensor)
            return out

    def wait(self, pending: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return list(pending)

    def put(self, key: ChunkKey, tensor: torch.Tensor, crc: int | None = None) -> bool:
        """Keep a copy if there is room once chunks of strictly lower put count are evicted."""
        if crc is not None:
            crc = int(crc) & 0xFFFFFFFF
        with self._lock:
            stats = self._put_stats.get(key)
            if stats is None:
                res = self.chunks.get(key)
                stats = res.stats if res is not None else ChunkStats()
                self._put_stats[key] = stats
                while len(self._put_stats) > self.max_stats:
                    self._put_stats.popitem(last=False)
            else:
                self._put_stats.move_to_end(key)
            stats.freq += 1
            stats.clock = next(self._clock)
            if key in self.chunks:  # keys name immutable bytes: the held copy stays
                self.rerank(key)
                return True
            size = nbytes(tensor)
            victims = self.victims(size, self.score(stats))
            if victims is None:
                return False
            self.evict(victims)
            self.insert(key, self.copy_in(tensor), size, stats, crc)
            return True

    def invalidate(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            dropped = 0
            for key in keys:
                self._put_stats.pop(key, None)
                if key in self.chunks:
                    self.remove(key)
                    dropped += 1
            return dropped

    def metrics(self) -> dict:
        with self._lock:
            return dict(self.counters, used_bytes=self.used, capacity_bytes=self.capacity,
                        corrupt_copies=self.corrupt_copies)

    # ------------------------------------------------------------------ used by the chain
    # None of these take the lock: the caller holds it.
    def sound(self, key: ChunkKey, res: Resident) -> bool:
        """Check a copy against its CRC; a bad one leaves the tier and is counted."""
        if res.crc is None or payload_crc(res.tensor) == res.crc:
            return True
        self.remove(key)
        self.corrupt_copies += 1
        log.warning("%s tier copy of chunk %r failed its CRC check; dropped, reading disk",
                    self.name, key)
        return False

    def victims(self, size: int, score: float) -> list[ChunkKey] | None:
        """The fewest lowest-scored chunks that must leave for `size` bytes to fit, all
        scored strictly below `score`; None if the chunk may not enter."""
        if self.capacity <= 0 or size > self.capacity:
            return None
        need = self.used + size - self.capacity
        taken: list[tuple] = []
        ok = True
        while need > 0:
            entry = self._live_min()
            if entry is None or not score > entry[0]:
                ok = False
                break
            taken.append(heapq.heappop(self.heap))
            need -= self.chunks[entry[3]].nbytes
        for entry in taken:  # only peeked: the victims are evicted by the caller, if at all
            heapq.heappush(self.heap, entry)
        return [e[3] for e in taken] if ok else None

    def insert(self, key: ChunkKey, tensor: torch.Tensor, size: int, stats: ChunkStats,
               crc: int | None) -> None:
        res = Resident(tensor, size, stats, crc)
        self.chunks[key] = res
        self.used += size
        self.counters["bytes_in"] += size
        self._push(res, key)

    def remove(self, key: ChunkKey) -> Resident:
        res = self.chunks.pop(key)
        self.used -= res.nbytes
        return res

    def evict(self, keys: list[ChunkKey]) -> list[tuple[ChunkKey, Resident]]:
        """Remove victims (from victims()), counted as evictions; lowest score first."""
        removed = [(key, self.remove(key)) for key in keys]
        self.counters["evictions"] += len(removed)
        return removed

    def rerank(self, key: ChunkKey) -> None:
        """The chunk's statistics changed: rank its copy anew (if held)."""
        res = self.chunks.get(key)
        if res is not None:
            self._push(res, key)

    def clear(self) -> None:
        self.chunks.clear()
        self.heap.clear()
        self.used = 0
        self._put_stats.clear()

    def reset_counters(self) -> None:
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.corrupt_copies = 0

    def copy_in(self, tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """A copy of `tensor` in this tier's memory, never sharing the caller's storage."""
        if self.device.type == "cpu":
            out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
            # Blocking copy: the result may be handed out before any stream sync.
            return out.copy_(tensor)
        out = tensor.to(self.device, non_blocking=non_blocking)
        # .to() returns its input when it is already on the device: the tier owns its memory.
        return tensor.clone() if out is tensor else out

    # ------------------------------------------------------------------ the heap
    def _push(self, res: Resident, key: ChunkKey) -> None:
        res.entry = (self.score(res.stats), res.stats.clock, next(self._stamp), key)
        heapq.heappush(self.heap, res.entry)
        if len(self.heap) > 2 * len(self.chunks) + 64:
            # Stale entries pile up with every re-rank; rebuilding is amortised O(1) per push.
            self.heap = [r.entry for r in self.chunks.values()]
            heapq.heapify(self.heap)

    def _live_min(self) -> tuple | None:
        heap = self.heap
        while heap:
            entry = heap[0]
            res = self.chunks.get(entry[3])
            if res is not None and res.entry is entry:
                return entry
            heapq.heappop(heap)
        return None
