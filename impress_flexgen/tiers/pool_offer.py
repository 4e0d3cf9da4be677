"""Stored prefixes offered to the pool: a prefix stored here before the pool was configured
(or while it was down) is published the first time a request loads it and the pool does not
hold it whole.

    offers = StoredOffers(pool, store)
    offers.offer(prefix, hashes, tenant)    # from the request: returns at once
    offers.flush(timeout_s)                 # tests, close: wait until offered chunks are queued

Off the request's path: one thread asks the pool which of the chunks it holds, reads the
missing ones' KV of every layer back from the local store (CRC-checked: a damaged chunk is
never published) and queues them on the tier's writer, which drops what finds its queue full.
Only exactly computed KV goes: the local match is exact-only, in the request's tenant. A
chunk found held (or offered) is not asked about again for MEMO_S, so a prefix in constant
use costs the pool one check a minute, not one a request.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Protocol

import torch

from .. import cpu_threads
from .remote_codec import RemoteNamespace

if TYPE_CHECKING:   # the Redis client is imported only where a pool is configured
    from .remote import RedisTier

log = logging.getLogger("impress_flexgen.tiers.remote")

# Seconds a chunk known held (or just offered) is not asked about again.
MEMO_S = 60.0
# Chunk hashes remembered at most (oldest forgotten first).
MEMO_CHUNKS = 1 << 16
# Offers waiting at most; a request that finds them all taken offers nothing (counted).
WAITING = 2


class OfferTarget(Protocol):
    """What an offer needs of the pool client (pool.SharedPrefix), which owns the offers."""

    tier: RedisTier
    tier_name: str
    namespace: RemoteNamespace
    chunk_size: int
    n_layers: int


class StoredOffers:
    """A thread that publishes chunks this store holds and the pool does not."""

    def __init__(self, pool: OfferTarget, store) -> None:
        self.pool = pool
        self.store = store
        self._cv = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._busy = False
        self._stop = False
        self._known: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._thread: threading.Thread | None = None
        self.counters = {"offers": 0, "offers_dropped": 0, "chunks_offered": 0}

    # -- the request's side -----------------------------------------------------------------
    def offer(self, prefix, hashes: list[bytes], tenant: str = "") -> bool:
        """Check these leading chunks of `prefix` (found in the local store) in the background;
        False when nothing was queued (all known held, or no room)."""
        now = time.monotonic()
        with self._cv:
            if self._stop:
                return False
            if all(now - self._known.get(h, -MEMO_S) < MEMO_S for h in hashes):
                return False
            if len(self._jobs) >= WAITING:
                self.counters["offers_dropped"] += 1
                return False
            for h in hashes:    # asked about once, until the check says otherwise
                self._remember(h, now)
            tokens = list(prefix[:len(hashes) * self.pool.chunk_size])
            self._jobs.append((tokens, list(hashes), tenant))
            self.counters["offers"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"{self.pool.tier_name}-offers")
                self._thread.start()
            self._cv.notify_all()
        return True

    def _remember(self, h: bytes, now: float) -> None:
        self._known[h] = now
        self._known.move_to_end(h)
        while len(self._known) > MEMO_CHUNKS:
            self._known.popitem(last=False)

    # -- the thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        cpu_threads.helper_thread()
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._publish_missing(*job)
            except Exception:  # noqa: BLE001 - an offer that fails is only an offer lost
                log.exception("shared pool: publishing a stored prefix failed")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _publish_missing(self, tokens: list[int], hashes: list[bytes], tenant: str) -> None:
        tier = self.pool.tier
        whole = tier.chunks_whole(hashes)
        if tier.metrics()["down"]:
            with self._cv:     # not known either way: ask again on a later use
                for h in hashes:
                    self._known.pop(h, None)
            return
        missing = [i for i, w in enumerate(whole) if not w]
        if not missing:
            return
        c = self.pool.chunk_size
        match = self.store.match_prefix(tokens, namespace=tenant, exact_only=True)
        try:
            end = min(match.length // c, missing[-1] + 1)
            missing = [i for i in missing if i < end]
            if not missing or self._stop:
                return
            kv = self._read(match.segments, end * c)
        finally:
            self.store.release(match)
        for a, b in _runs(missing):
            if self._stop:
                return
            queued = tier.publish(hashes, a, [(k[:, a * c:b * c], v[:, a * c:b * c])
                                              for k, v in kv])
            self.counters["chunks_offered"] += queued

    def _read(self, segments, n_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) of every layer over the first n_tokens of the matched nodes (CRC-checked)."""
        dtype = self.pool.namespace.value_dtype
        out = []
        for layer in range(self.pool.n_layers):
            ks, vs, got = [], [], 0
            for node, used in segments:
                if got >= n_tokens:
                    break
                take = min(used, n_tokens - got)
                k, v = self.store.inspect().reads.read_layer(node.layers[layer], node)
                ks.append(k[:, :take])
                vs.append(v[:, :take])
                got += take
            out.append((torch.cat(ks, 1).to(dtype), torch.cat(vs, 1).to(dtype)))
        return out

    # -- waiting and stopping ---------------------------------------------------------------
    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every offer has been checked and its chunks queued; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs and not self._busy,
                                     timeout=timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Drop waiting offers, stop the thread (the one in progress stops between runs)."""
        with self._cv:
            self._jobs.clear()
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as half-open runs: [1, 2, 3, 7] -> [(1, 4), (7, 8)]."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
