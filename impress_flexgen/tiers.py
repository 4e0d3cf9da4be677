"""GPU and CPU tiers of the prefix-KV store, ranked by an importance-aware score.

Disk always holds every chunk, so the tiers only decide which *copies* are worth the scarce
fast memory. IMPRESS argues that recency is the wrong signal for that: a chunk that is read
often *and* holds many important tokens saves the most disk I/O, so each chunk is scored by
frequency x important_ratio**alpha and each tier keeps its highest-scoring chunks. LRU and LFU
are kept as baselines. Because evicted chunks never need writing back, a GPU eviction is only a
demotion to CPU (when the chunk beats the CPU minimum) or a drop to disk-only.

Keys (node_id, layer, version, kind, idx) name immutable bytes: the store never reuses a node
id and bumps the version when it rewrites a layer. Invalidation therefore leaves a tombstone,
so a disk read that started before it cannot re-admit the stale chunk when it finishes. Each
copy keeps the CRC-32 its bytes had on disk (when the caller gives one); a CPU copy is checked
before it is promoted, and every hit with TierConfig.verify_hits.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import logging
import threading
import zlib
from collections.abc import Callable, Hashable

import torch

try:  # libdeflate's CRC-32 through ctypes (no copy, GIL released), when the library loads
    from disk_layout.io import _crc32_at
except ImportError:  # pragma: no cover - disk_layout ships with this package
    _crc32_at = None

log = logging.getLogger("impress_flexgen.tiers")

ChunkKey = Hashable  # (node_id, layer, version, kind, chunk_index)
_POLICIES = ("score", "lru", "lfu")
_COUNTERS = ("hits", "misses", "bytes_in", "bytes_served", "evictions", "promotions",
             "demotions")


@dataclasses.dataclass(frozen=True)
class TierConfig:
    gpu_bytes: int = 0        # capacity of the GPU tier in bytes (0 = tier disabled)
    cpu_bytes: int = 0        # capacity of the CPU tier in bytes (0 = tier disabled)
    policy: str = "score"     # "score" | "lru" | "lfu"
    alpha: float = 1.2        # exponent on the important-token ratio (score policy)
    exclusive: bool = True    # True: a chunk lives in at most one tier (as in the paper)
    verify_hits: bool = False  # True: check every hit's CRC (a GPU copy via the host); debug


class _Stats:
    """Access statistics of one chunk; shared by its tier copies so they always agree."""
    __slots__ = ("freq", "ratio", "clock")

    def __init__(self) -> None:
        self.freq = 0
        self.ratio = 0.0
        self.clock = 0


class _Resident:
    __slots__ = ("tensor", "nbytes", "stats", "entry", "crc")

    def __init__(self, tensor: torch.Tensor, nbytes: int, stats: _Stats,
                 crc: int | None = None) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.stats = stats
        self.entry: tuple = ()  # the heap entry that is currently valid for this copy
        self.crc = crc          # CRC-32 of the payload as read from disk; None: unchecked


class _Tier:
    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = max(0, int(capacity))
        self.used = 0
        self.chunks: dict[ChunkKey, _Resident] = {}
        # Min-heap of (score, clock, stamp, key). Entries are never removed in place: an entry is
        # live only while it is its chunk's `entry` (identity), so a score update is one push.
        # The unique stamp keeps heapq from ever comparing keys.
        self.heap: list[tuple] = []
        self.counters = dict.fromkeys(_COUNTERS, 0)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def payload_crc(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's contiguous bytes (zlib's polynomial; device tensors via the host)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    n = _nbytes(t)
    if n == 0:
        return 0
    if _crc32_at is not None:
        return int(_crc32_at(0, t.data_ptr(), n))
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) & 0xFFFFFFFF


class ChunkCache:
    """Score-ranked GPU and CPU tiers holding copies of disk chunks. All methods are thread-safe."""

    # Bound on remembered statistics: enough to let a re-read chunk earn its way back in,
    # small enough that a long-running server does not grow without limit.
    max_stats: int = 1_000_000
    # Bound on tombstones: at most this many invalidated node ids, and separately this many
    # (node, layer) version floors, the least recently set forgotten first (~100 bytes an
    # entry: some 10 MB each at most). A late admit is refused until this many more nodes (or
    # floors) have been invalidated after its own; a disk read is in flight for milliseconds.
    max_tombstones: int = 100_000

    def __init__(self, config: TierConfig, gpu_device: torch.device | None = None) -> None:
        if config.policy not in _POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}; expected one of {_POLICIES}")
        self.config = config
        if gpu_device is None:
            gpu_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.gpu_device = torch.device(gpu_device)
        # pin_memory=True raises on CPU-only torch; pinned host copies make promotions async.
        self._pin = torch.cuda.is_available()
        self._gpu = _Tier("gpu", config.gpu_bytes)
        self._cpu = _Tier("cpu", config.cpu_bytes)
        # Both tiers empty by configuration: per-chunk statistics would cost time on every
        # read and never decide anything.
        self._off = config.gpu_bytes <= 0 and config.cpu_bytes <= 0
        self._stats: collections.OrderedDict[ChunkKey, _Stats] = collections.OrderedDict()
        self._by_node: dict[Hashable, set[ChunkKey]] = {}  # so invalidation never scans
        self._clock = itertools.count(1)
        self._stamp = itertools.count()
        self._drops = 0
        self._corrupt_copies = 0
        # Tombstones (see max_tombstones): invalidated nodes, and per node the newest
        # invalidated version of each layer (that version and older ones are dead).
        self._dead_nodes: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._dead_versions: collections.OrderedDict[Hashable, dict] = collections.OrderedDict()
        self._n_dead_versions = 0  # (node, layer) floors held in _dead_versions
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public API
    def get(self, key: ChunkKey, important_ratio: float) -> tuple[str, torch.Tensor] | None:
        """Look a chunk up and count one access; a CPU hit may be promoted to the GPU tier.

        The label names the tier that served the hit (what its bytes cost); a CPU hit that
        gets promoted returns ("cpu", its new GPU copy). The tensor is the tier's copy: do not
        mutate it. A copy whose CRC no longer matches (checked before a promotion, and on
        every hit with verify_hits) is dropped and the lookup is a miss: read disk instead.
        A key of an invalidated node or version is always a miss.
        """
        with self._lock:
            gpu, cpu = self._gpu, self._cpu
            if self._off or self._dead(key):  # nothing can be held: only count the misses
                gpu.counters["misses"] += 1
                cpu.counters["misses"] += 1
                return None
            self._touch(key, important_ratio)
            verify = self.config.verify_hits
            res = gpu.chunks.get(key)
            if res is not None and not (verify and self._corrupt(gpu, key, res)):
                gpu.counters["hits"] += 1
                gpu.counters["bytes_served"] += res.nbytes
                return "gpu", res.tensor
            gpu.counters["misses"] += 1
            res = cpu.chunks.get(key)
            if res is None:
                cpu.counters["misses"] += 1
                return None
            victims = self._victims(gpu, res.nbytes, self._score(res.stats))
            # A promoted copy is served from the GPU for as long as it stays there, unchecked
            # unless verify_hits: so its source is always checked first.
            if (victims is not None or verify) and self._corrupt(cpu, key, res):
                cpu.counters["misses"] += 1
                return None
            cpu.counters["hits"] += 1
            cpu.counters["bytes_served"] += res.nbytes
            promoted = self._promote(key, res, victims) if victims is not None else None
            return "cpu", promoted if promoted is not None else res.tensor

    def admit(self, key: ChunkKey, tensor: torch.Tensor, important_ratio: float,
              crc: int | None = None) -> str | None:
        """Offer a chunk just read from disk; returns the tier that took a copy, or None.

        crc: the CRC-32 of the chunk's payload bytes as stored on disk (payload_crc(tensor)
        of the bytes read); kept with the copy to check it later. None: never checked.
        A key of an invalidated node or version is refused (None), even by a read that
        started before the invalidation.
        """
        if self._off:
            return None
        if crc is not None:
            crc = int(crc) & 0xFFFFFFFF
        with self._lock:  # the tombstone check and the insert are one step for invalidate()
            if self._dead(key):
                return None
            stats = self._touch(key, important_ratio)
            where = self._where(key)
            if where is not None:  # already cached (e.g. a racing reader): nothing to copy
                return where
            placed = None
            if self._place(self._gpu, key, stats, _nbytes(tensor),
                           lambda: self._to_gpu(tensor, non_blocking=False), crc):
                placed = "gpu"
            if placed is None or not self.config.exclusive:
                if self._place(self._cpu, key, stats, _nbytes(tensor),
                               lambda: self._to_cpu(tensor), crc):
                    placed = placed or "cpu"
            return placed

    def invalidate(self, node_id: Hashable) -> int:
        """Forget every chunk and statistic of a radix node and refuse its keys from now on
        (see max_tombstones); returns tier copies dropped."""
        with self._lock:
            dropped = self._forget(list(self._by_node.get(node_id, ())))
            if not self._off:
                self._bury_node(node_id)
            return dropped

    def invalidate_version(self, node_id: Hashable, layer: int, version: int) -> int:
        """Forget (node, layer) at `version` and every older version, and refuse those keys
        from now on (see max_tombstones); returns tier copies dropped."""
        with self._lock:
            keys = [k for k in self._by_node.get(node_id, ()) if k[1] == layer and k[2] <= version]
            dropped = self._forget(keys)
            if not self._off and node_id not in self._dead_nodes:
                self._bury_version(node_id, layer, version)
            return dropped

    def clear(self) -> None:
        """Drop every cached copy and all statistics (metrics are kept; see reset_metrics).
        Tombstones are kept: reads in flight may still try to admit invalidated chunks."""
        with self._lock:
            for tier in (self._gpu, self._cpu):
                tier.chunks.clear()
                tier.heap.clear()
                tier.used = 0
            self._stats.clear()
            self._by_node.clear()

    def resident(self, key: ChunkKey) -> str | None:
        """Where a chunk is cached ("gpu" first), without counting an access."""
        with self._lock:
            return self._where(key)

    def resident_keys(self, tier: str) -> frozenset:
        """Keys held by one tier ("gpu" or "cpu"); for diagnostics and tests."""
        with self._lock:
            return frozenset({"gpu": self._gpu, "cpu": self._cpu}[tier].chunks)

    @property
    def metrics(self) -> dict:
        with self._lock:
            out: dict = {}
            for tier in (self._gpu, self._cpu):
                out[tier.name] = dict(tier.counters, used_bytes=tier.used,
                                      capacity_bytes=tier.capacity)
            out["drops"] = self._drops
            out["corrupt_copies"] = self._corrupt_copies
            return out

    def reset_metrics(self) -> None:
        with self._lock:
            for tier in (self._gpu, self._cpu):
                tier.counters = dict.fromkeys(_COUNTERS, 0)
            self._drops = 0
            self._corrupt_copies = 0

    # ------------------------------------------------------------------ tombstones
    def _dead(self, key: ChunkKey) -> bool:
        node = key[0]
        if node in self._dead_nodes:
            return True
        layers = self._dead_versions.get(node)
        if layers is None:
            return False
        newest_dead = layers.get(key[1])
        return newest_dead is not None and key[2] <= newest_dead

    def _bury_node(self, node_id: Hashable) -> None:
        self._dead_nodes[node_id] = None
        self._dead_nodes.move_to_end(node_id)
        while len(self._dead_nodes) > self.max_tombstones:
            self._dead_nodes.popitem(last=False)
        # The node tombstone covers every version of it.
        layers = self._dead_versions.pop(node_id, None)
        if layers is not None:
            self._n_dead_versions -= len(layers)

    def _bury_version(self, node_id: Hashable, layer: int, version: int) -> None:
        layers = self._dead_versions.get(node_id)
        if layers is None:
            layers = self._dead_versions[node_id] = {}
        else:
            self._dead_versions.move_to_end(node_id)
        old = layers.get(layer)
        if old is None:
            self._n_dead_versions += 1
            layers[layer] = version
        elif version > old:
            layers[layer] = version
        while self._n_dead_versions > self.max_tombstones:
            _, gone = self._dead_versions.popitem(last=False)
            self._n_dead_versions -= len(gone)

    # ------------------------------------------------------------------ checksums
    def _corrupt(self, tier: _Tier, key: ChunkKey, res: _Resident) -> bool:
        """Check a copy against its CRC; a bad one leaves its tier (the caller reads disk)."""
        if res.crc is None or payload_crc(res.tensor) == res.crc:
            return False
        self._remove(tier, key)
        self._unindex_if_gone(key)
        self._corrupt_copies += 1
        log.warning("%s tier copy of chunk %r failed its CRC check; dropped, reading disk",
                    tier.name, key)
        return True

    # ------------------------------------------------------------------ scoring
    def _score(self, s: _Stats) -> float:
        policy = self.config.policy
        if policy == "score":
            return s.freq * (s.ratio ** self.config.alpha) if s.ratio > 0 else 0.0
        if policy == "lru":
            return float(s.clock)
        return float(s.freq)

    def _touch(self, key: ChunkKey, ratio: float) -> _Stats:
        stats = self._stats.get(key)
        if stats is None:
            # Statistics may have aged out of the bounded dict while the chunk stayed cached.
            res = self._gpu.chunks.get(key) or self._cpu.chunks.get(key)
            stats = res.stats if res is not None else _Stats()
            self._stats[key] = stats
            self._by_node.setdefault(key[0], set()).add(key)
            while len(self._stats) > self.max_stats:
                old, _ = self._stats.popitem(last=False)
                self._unindex_if_gone(old)
        else:
            self._stats.move_to_end(key)
        stats.freq += 1
        stats.ratio = min(1.0, max(0.0, float(ratio)))
        stats.clock = next(self._clock)
        for tier in (self._gpu, self._cpu):  # the score changed: re-rank every copy
            res = tier.chunks.get(key)
            if res is not None:
                self._push(tier, key, res)
        return stats

    def _push(self, tier: _Tier, key: ChunkKey, res: _Resident) -> None:
        res.entry = (self._score(res.stats), res.stats.clock, next(self._stamp), key)
        heapq.heappush(tier.heap, res.entry)
        if len(tier.heap) > 2 * len(tier.chunks) + 64:
            # Stale entries pile up with every re-rank; rebuilding is amortised O(1) per push.
            tier.heap = [r.entry for r in tier.chunks.values()]
            heapq.heapify(tier.heap)

    def _live_min(self, tier: _Tier) -> tuple | None:
        heap = tier.heap
        while heap:
            entry = heap[0]
            res = tier.chunks.get(entry[3])
            if res is not None and res.entry is entry:
                return entry
            heapq.heappop(heap)
        return None

    # ------------------------------------------------------------------ placement
    def _victims(self, tier: _Tier, nbytes: int, score: float) -> list[ChunkKey] | None:
        """The minimum chunks that must leave for `nbytes` to fit; None if it may not enter."""
        if tier.capacity <= 0 or nbytes > tier.capacity:
            return None
        need = tier.used + nbytes - tier.capacity
        taken: list[tuple] = []
        ok = True
        while need > 0:
            entry = self._live_min(tier)
            if entry is None or not score > entry[0]:
                ok = False
                break
            taken.append(heapq.heappop(tier.heap))
            need -= tier.chunks[entry[3]].nbytes
        for entry in taken:  # only peeked: the victims are evicted by the caller, if at all
            heapq.heappush(tier.heap, entry)
        return [e[3] for e in taken] if ok else None

    def _place(self, tier: _Tier, key: ChunkKey, stats: _Stats, nbytes: int,
               make_copy: Callable[[], torch.Tensor], crc: int | None) -> bool:
        victims = self._victims(tier, nbytes, self._score(stats))
        if victims is None:
            return False
        self._evict(tier, victims)
        self._insert(tier, key, make_copy(), nbytes, stats, crc)
        return True

    def _insert(self, tier: _Tier, key: ChunkKey, tensor: torch.Tensor, nbytes: int,
                stats: _Stats, crc: int | None) -> None:
        res = _Resident(tensor, nbytes, stats, crc)
        tier.chunks[key] = res
        tier.used += nbytes
        tier.counters["bytes_in"] += nbytes
        self._by_node.setdefault(key[0], set()).add(key)
        self._push(tier, key, res)

    def _remove(self, tier: _Tier, key: ChunkKey) -> _Resident:
        res = tier.chunks.pop(key)
        tier.used -= res.nbytes
        return res

    def _evict(self, tier: _Tier, victims: list[ChunkKey]) -> None:
        removed = [(key, self._remove(tier, key)) for key in victims]
        tier.counters["evictions"] += len(removed)
        if tier is self._cpu:
            self._drops += sum(1 for key, _ in removed if key not in self._gpu.chunks)
        else:
            # GPU victims are demoted best-first, so the CPU tier keeps the more valuable ones.
            for key, res in reversed(removed):
                if key in self._cpu.chunks:  # inclusive mode: the CPU copy already exists
                    continue
                if self._place(self._cpu, key, res.stats, res.nbytes,
                               lambda t=res.tensor: self._to_cpu(t), res.crc):
                    self._gpu.counters["demotions"] += 1
                    self._cpu.counters["demotions"] += 1
                else:
                    self._drops += 1
        for key, _ in removed:
            self._unindex_if_gone(key)

    def _promote(self, key: ChunkKey, res: _Resident, victims: list[ChunkKey]) -> torch.Tensor:
        """Copy a CPU-tier chunk to the GPU tier, evicting `victims` (from _victims)."""
        if self.config.exclusive:
            # Leave the CPU tier first so that the demoted GPU minimums can use the space.
            self._remove(self._cpu, key)
        self._evict(self._gpu, victims)
        # Pinned source: the copy may overlap; the caching host allocator keeps the source
        # alive until it completes even though the CPU tier no longer references it.
        gpu_copy = self._to_gpu(res.tensor, non_blocking=self._pin)
        self._insert(self._gpu, key, gpu_copy, res.nbytes, res.stats, res.crc)
        self._gpu.counters["promotions"] += 1
        self._cpu.counters["promotions"] += 1
        return gpu_copy

    def _forget(self, keys: list[ChunkKey]) -> int:
        dropped = 0
        for key in keys:
            for tier in (self._gpu, self._cpu):
                if key in tier.chunks:
                    self._remove(tier, key)
                    dropped += 1
            self._stats.pop(key, None)
            self._unindex_if_gone(key)
        return dropped

    def _where(self, key: ChunkKey) -> str | None:
        if key in self._gpu.chunks:
            return "gpu"
        return "cpu" if key in self._cpu.chunks else None

    def _unindex_if_gone(self, key: ChunkKey) -> None:
        if key in self._stats or self._where(key) is not None:
            return
        keys = self._by_node.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_node[key[0]]

    # ------------------------------------------------------------------ copies
    def _to_gpu(self, tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        out = tensor.to(self.gpu_device, non_blocking=non_blocking)
        # .to() returns its input when nothing moves (CPU "GPU pool", or an input already on
        # the device): clone so the tier always owns separate memory.
        return tensor.clone() if out is tensor else out

    def _to_cpu(self, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
        # Blocking copy: the result may be handed out by get() before any stream sync.
        return out.copy_(tensor)
