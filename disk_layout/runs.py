"""Read runs: adjacent extents coalesced into one read each (at most MAX_RUN_BYTES), the
page-aligned buffers they land in (reused once nothing views them), and the read bandwidth
limit. Used by the reader (reader.py); importable from disk_layout.io."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque

import numpy as np
import torch

from . import io as dio
from .format import ALIGN


def coalesce(extents: list[tuple[int, int]],
             max_run: int | None = None) -> list[tuple[int, int, list[int]]]:
    """[(offset, length)] sorted by offset -> runs [(offset, length, [extent indices])].

    Adjacent extents join one run (one read, one buffer) while it stays within `max_run`
    bytes (default MAX_RUN_BYTES), so a long stretch becomes several reads in flight.
    """
    limit = dio.MAX_RUN_BYTES if max_run is None else max_run
    runs: list[tuple[int, int, list[int]]] = []
    for i, (off, length) in enumerate(extents):
        if runs:
            r_off, r_len, members = runs[-1]
            if r_off + r_len == off and r_len + length <= limit:
                members.append(i)
                runs[-1] = (r_off, r_len + length, members)
                continue
        runs.append((off, length, [i]))
    return runs


@dataclasses.dataclass
class Run:
    """Adjacent extents read into one buffer: `data` is a uint8 tensor of the run's bytes."""

    offset: int
    data: torch.Tensor
    members: list[int] | range   # indices of the request's extents, in file order


@dataclasses.dataclass(frozen=True)
class Extents:
    """Sorted, aligned extents all `length` bytes long, at `offsets` (int64 array); with
    `crcs`, each extent's first `payload` bytes are checked against its CRC32."""

    offsets: np.ndarray
    length: int
    payload: int = 0
    crcs: np.ndarray | None = None

    def runs(self) -> list[tuple[int, int, range, tuple | list]]:
        """[(offset, length, extent indices, checks)]: adjacent extents coalesced (at most
        MAX_RUN_BYTES, at least one extent per run)."""
        offs, n, size = self.offsets, len(self.offsets), self.length
        if n == 0:
            return []
        per_run = max(1, dio.MAX_RUN_BYTES // size)
        breaks = np.flatnonzero(offs[1:] != offs[:-1] + size) + 1
        bounds = [0, *breaks.tolist(), n]
        crcs = None if self.crcs is None else self.crcs.tolist()
        plan = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            for s in range(a, b, per_run):
                e = min(s + per_run, b)
                checks = (s, size, self.payload, crcs[s:e]) if crcs is not None else []
                plan.append((int(offs[s]), (e - s) * size, range(s, e), checks))
        return plan


def _use_count_fn():
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None
    try:  # the count must see views: otherwise a busy buffer would look free
        t = torch.empty(ALIGN, dtype=torch.uint8)
        s = t.untyped_storage()
        base = fn(s._cdata)
        v = t[1:]
        ok = fn(s._cdata) == base + 1
        del v
        return fn if ok and fn(s._cdata) == base else None
    except Exception:  # noqa: BLE001 - private API: without it, no pooling
        return None


class BufferPool:
    """Page-aligned read buffers, reused once nothing views them any more.

    Reads land in buffers that are handed out without a copy (chunk tensors are views),
    so a buffer is free again only when every view of it has died: its storage's use
    count tells. Reusing buffers spares the page faults (and zeroing) of fresh memory,
    which on a VM cost about as much CPU as checking the CRCs. Buffers come in
    power-of-two sizes from MIN_POOLED up, each size a ring checked oldest first (the
    one handed out longest ago is the likeliest free); at most `max_bytes` are kept,
    beyond that (or without the use count) a read gets fresh memory.
    """

    MIN_POOLED = 4 << 10
    SCAN = 16   # buffers looked at before taking fresh memory

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._use_count = _use_count_fn()
        self._rings: dict[int, deque] = {}   # size -> deque[(tensor, storage, idle count)]
        self._held = 0
        self._lock = threading.Lock()

    def get(self, length: int) -> torch.Tensor:
        """A writable uint8 tensor of `length` bytes starting on a 4 KiB boundary."""
        if self._use_count is None or length < self.MIN_POOLED or length > self.max_bytes:
            return self._fresh(length)[0]
        size = 1 << (length - 1).bit_length()
        count = self._use_count
        with self._lock:
            ring = self._rings.setdefault(size, deque())
            for _ in range(min(len(ring), self.SCAN)):
                entry = ring[0]
                ring.rotate(-1)   # to the back: handed out now, or still busy
                if count(entry[1]._cdata) == entry[2]:
                    return entry[0][:length]
            if self._held + size > self.max_bytes:
                self._evict_idle(size)
                if self._held + size > self.max_bytes:
                    return self._fresh(length)[0]
            buf, storage = self._fresh(size)
            ring.append((buf, storage, count(storage._cdata)))
            self._held += size
            return buf[:length]

    def _evict_idle(self, need: int) -> None:
        for size, ring in self._rings.items():
            keep = []
            for entry in ring:
                if self._held + need > self.max_bytes and \
                        self._use_count(entry[1]._cdata) == entry[2]:
                    self._held -= size   # idle: dropped, its memory goes back
                else:
                    keep.append(entry)
            ring.clear()
            ring.extend(keep)

    @staticmethod
    def _fresh(length: int):
        raw = torch.empty(length + ALIGN, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % ALIGN
        buf = raw[skip:skip + length]
        return buf, buf.untyped_storage()


class ReadLimit:
    """Token bucket of read bytes shared by a reader's threads: `rate` bytes/s.

    A run takes its length before it is read. The bucket saves up at most
    max(MIN_BURST, that run's bytes), so a run of any size can pass; a take larger than
    what is saved leaves a deficit that the taker sleeps off (outside the lock), and later
    takers queue behind it, so threads together never beat the rate beyond one burst.
    """

    MIN_BURST = 1 << 20

    def __init__(self, rate_bytes_s: float):
        rate = float(rate_bytes_s)
        if not rate > 0 or rate == float("inf"):
            raise ValueError(f"read limit must be a positive number of bytes/s, got "
                             f"{rate_bytes_s!r}")
        self.rate = rate
        self._tokens = float(self.MIN_BURST)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> float:
        """Take `nbytes`, sleeping as long as the rate requires; returns seconds slept."""
        with self._lock:
            now = time.monotonic()
            burst = max(self.MIN_BURST, nbytes)
            saved = self._tokens + (now - self._last) * self.rate
            self._tokens = min(saved, burst) - nbytes
            self._last = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait


def _read_limit(rate_bytes_s: float | None) -> ReadLimit | None:
    """None, 0 or infinity: unlimited; a negative (or NaN) limit is a mistake."""
    if rate_bytes_s is None:
        return None
    rate = float(rate_bytes_s)
    if rate == 0 or rate == float("inf"):
        return None
    if not rate > 0:
        raise ValueError(f"read limit must be >= 0 bytes/s (0: unlimited), got "
                         f"{rate_bytes_s!r}")
    return ReadLimit(rate)
