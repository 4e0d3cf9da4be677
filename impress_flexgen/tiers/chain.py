"""The memory tiers of the prefix-KV store, chained fastest first, ranked by an importance score.

Disk always holds every chunk, so the memory tiers only decide which *copies* are worth the
scarce fast memory. IMPRESS argues that recency is the wrong signal for that: a chunk that is
read often *and* holds many important tokens saves the most disk I/O, so each chunk is scored
by frequency x important_ratio**alpha and each tier keeps its highest-scoring chunks. LRU and
LFU are kept as baselines. Evicted chunks never need writing back. Every move is decided by
one comparison: a chunk enters a tier when its score beats that tier's minimum (the fewest
lowest-scored chunks leave to make room).

Non-exclusive tiers (the default, as in the paper): the same chunk may sit in GPU memory, CPU
memory and on disk at once. A disk read is offered to every tier and each takes it by its own
comparison; a CPU hit that beats the GPU minimum is copied up and keeps its CPU copy; an
evicted copy whose chunk another tier still holds costs nothing (no copy, nothing lost), and
one held nowhere else is demoted to the next tier by the comparison, or from the last tier
dropped to disk-only. Since every tier ranks by the same score, the CPU tends to hold the GPU's
chunks too (GPU evictions are then free), but nothing enforces inclusion: the CPU may evict a
chunk the GPU keeps. The price is capacity: a chunk held twice takes room in both.
Exclusive tiers (TierConfig.exclusive): a chunk has at most one memory copy; a disk read goes
to the first tier that takes it, a promotion moves the chunk, and every eviction from the GPU
is a demotion (a copy) or a drop. More distinct chunks fit; every move copies.

Keys (node_id, layer, version, kind, idx) name immutable bytes: the store never reuses a node
id and bumps the version when it rewrites a layer. Invalidation therefore leaves a tombstone,
so a disk read that started before it cannot re-admit the stale chunk when it finishes. Each
copy keeps the CRC-32 its bytes had on disk (when the caller gives one); a copy is checked
before it is promoted, and every hit with TierConfig.verify_hits.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from collections.abc import Callable, Hashable

import torch

from ..errors import UserError
from .base import ChunkKey, nbytes
from .memory import ChunkStats, MemoryTier, Resident

GPU = "gpu"
CPU = "cpu"
DISK = "disk"
REMOTE = "remote"
_POLICIES = ("score", "lru", "lfu")


@dataclasses.dataclass(frozen=True)
class TierSpec:
    name: str             # what metrics and resident_keys call the tier
    capacity_bytes: int   # 0 = tier disabled
    device: str           # where its copies live ("cuda", "cpu", ...)


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """The tiers in front of the disk and the shared pool behind it: one record for the
    memory chain, the engine and the service.
    The engine gives its chain the serving policy's tier policy."""

    gpu_bytes: int = 0        # capacity of the GPU tier in bytes (0 = tier disabled)
    cpu_bytes: int = 0        # capacity of the CPU tier in bytes (0 = tier disabled)
    policy: str = "score"     # "score" | "lru" | "lfu"
    alpha: float = 1.2        # exponent on the important-token ratio (score policy)
    exclusive: bool = False   # True: a chunk has at most one memory copy (default: copies
                              # in several tiers at once, the paper's non-exclusive tiers)
    verify_hits: bool = False  # True: check every hit's CRC (a GPU copy via the host); debug
    remote_url: str | None = None  # a shared pool (redis://HOST:PORT/DB) behind the disk
    remote_secret: str | None = dataclasses.field(default=None, repr=False)  # values' HMAC key
    remote_ttl: int | None = None  # seconds the pool keeps a chunk (None: until evicted)

    def memory_tiers(self, accelerator: str | None = None) -> tuple[TierSpec, ...]:
        """The memory tiers, fastest first; the one place they are named and ordered.
        accelerator: the GPU tier's device (default: CUDA when available, else the host)."""
        if accelerator is None:
            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        return (TierSpec(GPU, self.gpu_bytes, str(accelerator)),
                TierSpec(CPU, self.cpu_bytes, "cpu"))

    @property
    def copies(self) -> str:
        """How the memory tiers share chunks, in words (start-up lines, result records)."""
        return "exclusive" if self.exclusive else "non-exclusive"

    def names(self, remote: bool) -> tuple[str, ...]:
        """Every tier a chunk can be served from, fastest first (for per-tier counters)."""
        return tuple(s.name for s in self.memory_tiers()) + (DISK,) + ((REMOTE,) if remote else ())


class ChunkCache:
    """Score-ranked memory tiers holding copies of disk chunks. All methods are thread-safe."""

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
            raise UserError(f"unknown tier policy {config.policy!r}; expected one of "
                            f"{', '.join(_POLICIES)}")
        self.config = config
        specs = config.memory_tiers(None if gpu_device is None else str(gpu_device))
        self.gpu_device = torch.device(specs[0].device)
        # pin_memory=True raises on CPU-only torch; pinned host copies make promotions async.
        pin = torch.cuda.is_available()
        self._lock = threading.Lock()  # shared with the tiers: one lock guards the chain
        self.tiers: list[MemoryTier] = [
            MemoryTier(s.name, s.capacity_bytes, s.device, score=self._score,
                       pin=pin and i > 0, verify=config.verify_hits, lock=self._lock)
            for i, s in enumerate(specs)]
        self.tier_names: tuple[str, ...] = tuple(t.name for t in self.tiers)
        self._by_name = {t.name: t for t in self.tiers}
        # Every tier empty by configuration: per-chunk statistics would cost time on every
        # read and never decide anything.
        self._off = all(t.capacity <= 0 for t in self.tiers)
        self._stats: collections.OrderedDict[ChunkKey, ChunkStats] = collections.OrderedDict()
        self._by_node: dict[Hashable, set[ChunkKey]] = {}  # so invalidation never scans
        self._clock = itertools.count(1)
        self._drops = 0            # evicted copies of chunks no tier holds after: disk-only
        self._free_evictions = 0   # evicted copies of chunks another tier still holds
        # Tombstones (see max_tombstones): invalidated nodes, and per node the newest
        # invalidated version of each layer (that version and older ones are dead).
        self._dead_nodes: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._dead_versions: collections.OrderedDict[Hashable, dict] = collections.OrderedDict()
        self._n_dead_versions = 0  # (node, layer) floors held in _dead_versions

    # ------------------------------------------------------------------ public API
    def get(self, key: ChunkKey, important_ratio: float) -> tuple[str, torch.Tensor] | None:
        """Look a chunk up, tier by tier, and count one access; a hit below the first tier
        may be promoted to the first.

        The label names the tier that served the hit (what its bytes cost); a hit that gets
        promoted returns (its tier, its new first-tier copy). The tensor is the tier's copy:
        do not mutate it. A copy whose CRC no longer matches (checked before a promotion, and
        on every hit with verify_hits) is dropped and is a miss there: the lookup goes on down
        the tiers, then to disk. A key of an invalidated node or version is always a miss.
        """
        with self._lock:
            if self._off or self._dead(key):  # nothing can be held: only count the misses
                for tier in self.tiers:
                    tier.counters["misses"] += 1
                return None
            self._touch(key, important_ratio)
            verify = self.config.verify_hits
            first = self.tiers[0]
            for j, tier in enumerate(self.tiers):
                res = tier.chunks.get(key)
                if res is None:
                    tier.counters["misses"] += 1
                    continue
                victims = first.victims(res.nbytes, self._score(res.stats)) if j > 0 else None
                # A promoted copy is served from the first tier for as long as it stays there,
                # unchecked unless verify_hits: so its source is always checked first.
                if (victims is not None or verify) and not self._sound(tier, key, res):
                    tier.counters["misses"] += 1
                    continue
                tier.counters["hits"] += 1
                tier.counters["bytes_served"] += res.nbytes
                if victims is None:
                    return tier.name, res.tensor
                return tier.name, self._promote(j, key, res, victims)
            return None

    def admit(self, key: ChunkKey, tensor: torch.Tensor, important_ratio: float,
              crc: int | None = None) -> str | None:
        """Offer a chunk just read from disk; returns the first tier that took a copy, or None.

        Non-exclusive tiers: every tier takes a copy whose comparison the chunk wins (its score
        beats the tier's minimum); exclusive tiers: only the first that takes it.
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
            size = nbytes(tensor)
            placed: int | None = None
            for i, tier in enumerate(self.tiers):
                if self._place(i, key, stats, size, lambda t=tier: t.copy_in(tensor), crc):
                    placed = i if placed is None else placed
                    if self.config.exclusive:
                        break
            return None if placed is None else self.tiers[placed].name

    def invalidate(self, node_id: Hashable) -> int:
        """Forget every chunk and statistic of a radix node and refuse its keys from now on
        (see max_tombstones); returns tier copies dropped."""
        with self._lock:
            dropped, _ = self._forget(list(self._by_node.get(node_id, ())))
            if not self._off:
                self._bury_node(node_id)
            return dropped

    def invalidate_version(self, node_id: Hashable, layer: int, version: int) -> int:
        """Forget (node, layer) at `version` and every older version, and refuse those keys
        from now on (see max_tombstones); returns tier copies dropped."""
        with self._lock:
            keys = [k for k in self._by_node.get(node_id, ()) if k[1] == layer and k[2] <= version]
            dropped, _ = self._forget(keys)
            if not self._off and node_id not in self._dead_nodes:
                self._bury_version(node_id, layer, version)
            return dropped

    def forget(self, keys: list[ChunkKey]) -> int:
        """Drop these keys' copies and statistics, without a tombstone (they may come
        back); returns how many of the keys had a copy (in one tier or several)."""
        with self._lock:
            return self._forget(keys)[1]

    def clear(self) -> None:
        """Drop every cached copy and all statistics (metrics are kept; see reset_metrics).
        Tombstones are kept: reads in flight may still try to admit invalidated chunks."""
        with self._lock:
            for tier in self.tiers:
                tier.clear()
            self._stats.clear()
            self._by_node.clear()

    def resident(self, key: ChunkKey) -> str | None:
        """The first tier that holds a chunk, without counting an access."""
        with self._lock:
            return self._where(key)

    def residents(self, keys) -> list[str | None]:
        """resident() of each key, under one taking of the lock."""
        with self._lock:
            return [self._where(key) for key in keys]

    def duplicate_bytes(self) -> int:
        """Bytes of the chunks held by more than one tier, each counted once: what
        non-exclusive tiers spend on duplicates. A scan of the copies (results, tests), so
        it is not one of `metrics`, which a server reads often."""
        with self._lock:
            seen: set = set()
            shared = 0
            for i, tier in enumerate(self.tiers):
                for key, res in tier.chunks.items():
                    if key not in seen and any(key in t.chunks for t in self.tiers[i + 1:]):
                        seen.add(key)
                        shared += res.nbytes
            return shared

    def resident_keys(self, tier: str) -> frozenset:
        """Keys held by one tier (by name, e.g. "gpu" or "cpu"); for diagnostics and tests."""
        held = self._by_name.get(tier)
        if held is None:
            raise UserError(f"unknown tier {tier!r}; expected one of {', '.join(self.tier_names)}")
        with self._lock:
            return frozenset(held.chunks)

    @property
    def metrics(self) -> dict:
        with self._lock:
            out: dict = {}
            for tier in self.tiers:
                out[tier.name] = dict(tier.counters, used_bytes=tier.used,
                                      capacity_bytes=tier.capacity)
            out["drops"] = self._drops
            out["free_evictions"] = self._free_evictions
            out["corrupt_copies"] = sum(t.corrupt_copies for t in self.tiers)
            return out

    def reset_metrics(self) -> None:
        with self._lock:
            for tier in self.tiers:
                tier.reset_counters()
            self._drops = 0
            self._free_evictions = 0

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

    # ------------------------------------------------------------------ scoring
    def _score(self, s: ChunkStats) -> float:
        policy = self.config.policy
        if policy == "score":
            return s.freq * (s.ratio ** self.config.alpha) if s.ratio > 0 else 0.0
        if policy == "lru":
            return float(s.clock)
        return float(s.freq)

    def _touch(self, key: ChunkKey, ratio: float) -> ChunkStats:
        stats = self._stats.get(key)
        if stats is None:
            # Statistics may have aged out of the bounded dict while the chunk stayed cached.
            res = next((t.chunks[key] for t in self.tiers if key in t.chunks), None)
            stats = res.stats if res is not None else ChunkStats()
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
        for tier in self.tiers:  # the score changed: re-rank every copy
            tier.rerank(key)
        return stats

    # ------------------------------------------------------------------ checksums
    def _sound(self, tier: MemoryTier, key: ChunkKey, res: Resident) -> bool:
        """Check a copy against its CRC; a bad one leaves its tier (the caller reads on)."""
        if tier.sound(key, res):
            return True
        self._unindex_if_gone(key)
        return False

    # ------------------------------------------------------------------ placement
    def _place(self, i: int, key: ChunkKey, stats: ChunkStats, size: int,
               make_copy: Callable[[], torch.Tensor], crc: int | None) -> bool:
        tier = self.tiers[i]
        victims = tier.victims(size, self._score(stats))
        if victims is None:
            return False
        self._evict(i, victims)
        tier.insert(key, make_copy(), size, stats, crc)
        self._by_node.setdefault(key[0], set()).add(key)
        return True

    def _evict(self, i: int, victims: list[ChunkKey]) -> None:
        """Evict from tier i. A victim another tier still holds (non-exclusive tiers) costs
        nothing; the others are demoted to tier i+1 best-first (so the next tier keeps the
        more valuable ones) where they win its comparison, else dropped to disk-only."""
        removed = self.tiers[i].evict(victims)
        nxt = self.tiers[i + 1] if i + 1 < len(self.tiers) else None
        for key, res in reversed(removed):
            if self._where(key) is not None:
                self._free_evictions += 1
            elif nxt is not None and self._place(i + 1, key, res.stats, res.nbytes,
                                                 lambda t=res.tensor: nxt.copy_in(t), res.crc):
                self.tiers[i].counters["demotions"] += 1
                nxt.counters["demotions"] += 1
            else:
                self._drops += 1
        for key, _ in removed:
            self._unindex_if_gone(key)

    def _promote(self, j: int, key: ChunkKey, res: Resident,
                 victims: list[ChunkKey]) -> torch.Tensor:
        """Copy tier j's chunk to the first tier, evicting `victims` (from victims()); tier j
        keeps its copy unless the tiers are exclusive."""
        source, first = self.tiers[j], self.tiers[0]
        if self.config.exclusive:
            # Leave tier j first so that the first tier's demoted minimums can use the space.
            source.remove(key)
        # Non-exclusive: the first tier's victims all score below this chunk, so none of the
        # demotions below can push its own copy out of tier j.
        self._evict(0, victims)
        # Pinned source: the copy may overlap; the caching host allocator keeps the source
        # alive until it completes even where tier j no longer references it.
        copy = first.copy_in(res.tensor, non_blocking=source.pin)
        first.insert(key, copy, res.nbytes, res.stats, res.crc)
        first.counters["promotions"] += 1
        source.counters["promotions"] += 1
        return copy

    def _forget(self, keys: list[ChunkKey]) -> tuple[int, int]:
        """(copies dropped, keys that had at least one)."""
        dropped = held = 0
        for key in keys:
            copies = dropped
            for tier in self.tiers:
                if key in tier.chunks:
                    tier.remove(key)
                    dropped += 1
            held += dropped > copies
            self._stats.pop(key, None)
            self._unindex_if_gone(key)
        return dropped, held

    def _where(self, key: ChunkKey) -> str | None:
        return next((t.name for t in self.tiers if key in t.chunks), None)

    def _unindex_if_gone(self, key: ChunkKey) -> None:
        if key in self._stats or self._where(key) is not None:
            return
        keys = self._by_node.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_node[key[0]]
