"""The store's disk reader: runs read in parallel by a small thread pool, O_DIRECT where the
file system allows, each run's CRC-32s checked by the thread that read it. Every system
call goes through disk_layout.io's `os` (one patch point); importable from disk_layout.io."""
from __future__ import annotations

import errno
import logging
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from . import io as dio
from .format import ALIGN
from .io import ChecksumMismatch, NotRegularFile, ShortRead
from .runs import BufferPool, Extents, Run, _read_limit, coalesce

log = logging.getLogger("impress_flexgen.disk")
_warned_buffered = False


class _Fd:
    __slots__ = ("fd", "direct", "users", "doomed")

    def __init__(self, fd: int, direct: bool):
        self.fd, self.direct, self.users, self.doomed = fd, direct, 0, False


class DiskReader:
    """Cold reads of aligned extents from immutable files, several in flight.

    Files are opened outside the reader's lock and only if they are regular files (no
    symbolic link followed, a FIFO never waited on), so one bad path cannot stall other
    reads. Every failure of a read reaches wait() as an OSError (ShortRead for a
    truncated file) or as ChecksumMismatch.

    A request's extents are coalesced into runs of adjacent extents (at most
    MAX_RUN_BYTES each); every run is one read into its own page-aligned buffer, and all
    runs of a request are in flight together on the thread pool. With checks, the worker
    verifies the CRC32 of each extent as soon as its run is in memory (os.preadv and
    zlib.crc32 release the GIL), so checking overlaps the other reads.

    rate_limit_bytes_s limits the reads to that many bytes/s, all threads together (None
    or 0: unlimited). busy_s counts the wall time during which at least one read was in
    flight, limiter sleeps included, so bytes_read / busy_s is the throughput the disk path
    delivered (counters() gives both at once).
    """

    def __init__(self, threads: int = 4, direct: bool = True, max_open_files: int = 256,
                 pool_bytes: int = 256 << 20, rate_limit_bytes_s: float | None = None):
        self.limit = _read_limit(rate_limit_bytes_s)
        self.direct = direct and hasattr(dio.os, "O_DIRECT")
        # Readers run torch on themselves alone: a CPU team of their own would slow the
        # computing thread's products (impress_flexgen.cpu_threads).
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-read",
                                       initializer=torch.set_num_threads, initargs=(1,))
        self.buffers = BufferPool(pool_bytes)
        self._fds: OrderedDict[str, _Fd] = OrderedDict()
        self._lock = threading.Lock()
        self._forgets = 0   # bumped by forget(): an open racing it is not cached
        self.max_open_files = max_open_files
        self.bytes_read = 0
        self.reads = 0
        self._busy_s = 0.0
        self._in_flight = 0
        self._busy_since = 0.0

    # -- descriptors: cached, counted while in use so eviction never closes a busy one --
    def _open(self, path: str) -> tuple[int, bool]:
        """(descriptor, direct) of a regular file; raises OSError (NotRegularFile, ELOOP
        for a symbolic link, ENOENT, ...)."""
        global _warned_buffered
        refused = False
        if self.direct:
            try:
                return dio.open_regular(path, dio.os.O_RDONLY | dio.os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL or isinstance(exc, NotRegularFile):
                    raise
                refused = True   # tmpfs, or a FIFO / directory (ext4 refuses those too)
        fd = dio.open_regular(path, dio.os.O_RDONLY)
        if refused and not _warned_buffered:
            log.warning("O_DIRECT refused on %s (tmpfs?): buffered reads with "
                        "posix_fadvise(DONTNEED) instead", dio.os.path.dirname(path))
            _warned_buffered = True
        return fd, False

    def _acquire(self, path: str) -> _Fd:
        with self._lock:
            ent = self._fds.get(path)
            if ent is not None:
                self._fds.move_to_end(path)
                ent.users += 1
                return ent
            forgets = self._forgets
        # Opened without the lock: a slow device (or anything that blocks in open) must
        # not hold up reads of other files.
        fd, direct = self._open(path)
        with self._lock:
            ent = self._fds.get(path)
            if ent is not None:          # another thread opened it meanwhile: use theirs
                self._fds.move_to_end(path)
                ent.users += 1
                dio.os.close(fd)
                return ent
            ent = _Fd(fd, direct)
            ent.users = 1
            if self._forgets != forgets:
                # A forget() ran while we opened: the file may be on its way out, so this
                # descriptor serves this read only and is closed on release.
                ent.doomed = True
                return ent
            self._fds[path] = ent
            self._trim()
            return ent

    def _trim(self) -> None:
        """Close idle descriptors, least recently used first, down to max_open_files."""
        if len(self._fds) > self.max_open_files:
            for old_path in [p for p, e in self._fds.items() if e.users == 0]:
                if len(self._fds) <= self.max_open_files:
                    break
                dio.os.close(self._fds.pop(old_path).fd)

    def _release(self, ent: _Fd) -> None:
        with self._lock:
            ent.users -= 1
            if ent.doomed and ent.users == 0:
                dio.os.close(ent.fd)
            elif ent.users == 0:
                self._trim()

    def _fd(self, path: str) -> tuple[int, bool]:
        """(descriptor, direct) of `path`, opened and cached if need be."""
        ent = self._acquire(path)
        self._release(ent)
        return ent.fd, ent.direct

    def forget(self, path: str) -> None:
        """Close a cached descriptor (before its file is deleted); a busy one on release."""
        with self._lock:
            self._forgets += 1
            ent = self._fds.pop(path, None)
            if ent is None:
                return
            if ent.users:
                ent.doomed = True
            else:
                dio.os.close(ent.fd)

    # -- busy time: from the first read in flight to the last one done ------------------
    def _begin(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += 1

    def _end(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._busy_s += time.monotonic() - self._busy_since

    @property
    def busy_s(self) -> float:
        """Seconds with at least one read in flight (the current stretch included)."""
        return self.counters()[1]

    def counters(self) -> tuple[int, float]:
        """(bytes_read, busy_s), read together (for deltas around a request)."""
        with self._lock:
            busy = self._busy_s
            if self._in_flight:
                busy += time.monotonic() - self._busy_since
            return self.bytes_read, busy

    # -- reading ------------------------------------------------------------------------
    @staticmethod
    def _verify(data: torch.Tensor, checks) -> None:
        """Verify a run's buffer: checks is [(extent index, start in run, payload_len, crc)]
        or, for extents of one length, (first index, stride, payload_len, [crc, ...])."""
        if isinstance(checks, tuple):
            first, stride, payload, crcs = checks
            if dio._crc32_at is not None:
                addr = data.data_ptr()
                for k, expect in enumerate(crcs):
                    if dio._crc32_at(0, addr + k * stride, payload) != expect:
                        raise ChecksumMismatch(first + k)
            else:
                view = memoryview(data.numpy())
                for k, expect in enumerate(crcs):
                    if zlib.crc32(view[k * stride:k * stride + payload]) != expect:
                        raise ChecksumMismatch(first + k)
        elif dio._crc32_at is not None:
            addr = data.data_ptr()
            for index, start, payload, expect in checks:
                if dio._crc32_at(0, addr + start, payload) != expect:
                    raise ChecksumMismatch(index)
        else:
            view = memoryview(data.numpy())
            for index, start, payload, expect in checks:
                if zlib.crc32(view[start:start + payload]) != expect:
                    raise ChecksumMismatch(index)

    verify = _verify   # for callers that check slices of a run themselves

    def _read_run(self, path: str, ent: _Fd, data: torch.Tensor, offset: int, checks) -> None:
        """Fill `data` from `offset`, then verify `checks` while other reads are in flight."""
        view = memoryview(data.numpy())
        length = len(view)
        done = 0
        self._begin()
        try:
            if self.limit is not None:
                self.limit.take(length)
            while done < length:
                n = dio.os.preadv(ent.fd, [view[done:]], offset + done)
                if n == 0 or (ent.direct and n % ALIGN and done + n < length):
                    # With O_DIRECT a short, unaligned read is the end of the file too
                    # (the next read would fail on alignment instead of saying so).
                    raise ShortRead(errno.EIO, f"{path}: file ends at {offset + done + n}, "
                                               f"expected {offset + length}")
                done += n
            if not ent.direct:
                dio.os.posix_fadvise(ent.fd, offset, length, dio.os.POSIX_FADV_DONTNEED)
            with self._lock:
                self.bytes_read += length
                self.reads += 1
        finally:
            self._end()
        if checks:
            self._verify(data, checks)

    def submit(self, path: str, extents, checks=None):
        """Start reading extents of `path`: [(offset, length)] sorted and aligned, or an
        Extents (one length, offsets in an array: no per-extent Python objects).

        checks (with a list): None, or per extent (payload_len, crc32) to verify on its
        first payload_len bytes, or a list [(start, payload_len, crc32, index)] of payloads
        inside the extent (a mismatch reports `index`); an Extents carries its own. Returns a
        handle for wait().
        A file that cannot be opened raises OSError here: FileNotFoundError when missing,
        NotRegularFile for a directory, FIFO or device, ELOOP for a symbolic link.
        """
        ent = self._acquire(path)
        runs: list[Run] = []
        futures = []
        try:
            if isinstance(extents, Extents):
                plan = extents.runs()
            else:
                plan = []
                for r_off, r_len, members in coalesce(extents):
                    these = []
                    if checks is not None:
                        for i in members:
                            base = extents[i][0] - r_off
                            if isinstance(checks[i], list):   # several payloads in one extent
                                these += [(index, base + start, payload, int(crc))
                                          for start, payload, crc, index in checks[i]]
                            else:
                                payload, crc = checks[i]
                                these.append((i, base, payload, int(crc)))
                    plan.append((r_off, r_len, members, these))
            for r_off, r_len, members, these in plan:
                data = self.buffers.get(r_len)
                runs.append(Run(r_off, data, members))
                futures.append(self.pool.submit(self._read_run, path, ent, data, r_off, these))
        except BaseException:
            self._finish((ent, runs, futures))
            raise
        return ent, runs, futures

    def _finish(self, handle) -> None:
        """Wait for every read (even after a failure: none may still fill a buffer), then
        raise the first failure: a ShortRead or other OSError, else the CRC mismatch of the
        lowest extent."""
        ent, runs, futures = handle
        errors = []
        try:
            for fut in futures:
                exc = fut.exception()
                if exc is not None:
                    errors.append(exc)
        finally:
            self._release(ent)
        if errors:
            others = [e for e in errors if not isinstance(e, ChecksumMismatch)]
            raise others[0] if others else min(errors, key=lambda e: e.index)

    def wait(self, handle) -> list[Run]:
        """The runs of a submit(), read and checked."""
        self._finish(handle)
        return handle[1]

    def read_runs(self, path: str, extents, checks=None) -> list[Run]:
        """submit() and wait(): the runs, each a buffer of adjacent extents."""
        return self.wait(self.submit(path, extents, checks))

    def read(self, path: str, extents: list[tuple[int, int]], checks=None) -> list[memoryview]:
        """Read extents [(offset, length)] (sorted, aligned) -> one buffer per extent."""
        return self.read_many([(path, extents)], None if checks is None else [checks])[0]

    def read_many(self, requests: list[tuple[str, list[tuple[int, int]]]],
                  checks=None) -> list[list[memoryview]]:
        """Several files at once: all their runs are in flight together."""
        handles = []
        try:
            for j, (path, extents) in enumerate(requests):
                handles.append((extents, self.submit(path, extents,
                                                     None if checks is None else checks[j])))
        except BaseException:
            for _, handle in handles:
                try:
                    self.wait(handle)
                except Exception:  # noqa: BLE001 - the error already raised wins
                    pass
            raise
        results, first_error = [], None
        for extents, handle in handles:
            try:
                runs = self.wait(handle)
            except Exception as exc:  # noqa: BLE001 - wait for the others, then raise
                first_error = first_error or exc
                continue
            out: list[memoryview] = [None] * len(extents)  # type: ignore[list-item]
            for run in runs:
                view = memoryview(run.data.numpy())
                for i in run.members:
                    off, length = extents[i]
                    out[i] = view[off - run.offset: off - run.offset + length]
            results.append(out)
        if first_error is not None:
            raise first_error
        return results

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        with self._lock:
            for ent in self._fds.values():
                dio.os.close(ent.fd)
            self._fds.clear()


def drop_page_cache(path: str) -> None:
    """Evict one file from the page cache (for cold buffered baselines)."""
    fd = dio.open_regular(path, dio.os.O_RDONLY)
    try:
        dio.os.posix_fadvise(fd, 0, 0, dio.os.POSIX_FADV_DONTNEED)
    finally:
        dio.os.close(fd)
