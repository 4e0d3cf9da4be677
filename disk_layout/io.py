"""Disk I/O for the prefix store: durable writes, cold O_DIRECT reads in parallel.

Reads bypass the page cache (O_DIRECT) so that what we time is the disk, and so that a
store larger than memory behaves as one. Adjacent chunks are coalesced into runs of at
most MAX_RUN_BYTES; each run is one read into a page-aligned buffer that is handed out
without a copy (and reused once nothing views it). A small thread pool keeps several runs
in flight, and each worker verifies the CRC32s of its run as soon as it is read, while the
other reads proceed (os.preadv and the CRC release the GIL). Where O_DIRECT is refused
(tmpfs), reads fall back to buffered I/O followed by posix_fadvise(DONTNEED), and we say
so once. A DiskReader may be given a read bandwidth limit (ReadLimit), to stand in for a
slower disk than the one under the store.
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import itertools
import logging
import os
import stat
import threading
import time
import zlib
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .format import ALIGN

log = logging.getLogger("impress_flexgen.disk")
# Longer runs are split so several reads are in flight. 4 MiB measured best here against
# 1, 2, 8 and 16 MiB (fewer reads: less CPU per byte; still 4 reads per 16 MiB request).
MAX_RUN_BYTES = 4 << 20

_warned_buffered = False


def _libdeflate_crc32():
    """libdeflate's CRC-32 (carry-less multiply; ~3x zlib's here), or None.

    The same CRC-32 as zlib.crc32, checked here on a few lengths before use. Called
    through ctypes, which releases the GIL, so reader threads check in parallel. Set
    IMPRESS_FLEXGEN_CRC=zlib to use zlib.crc32 instead.
    """
    if os.environ.get("IMPRESS_FLEXGEN_CRC", "").lower() == "zlib":
        return None
    for name in ("libdeflate.so.0", "libdeflate.so"):
        try:
            fn = ctypes.CDLL(name).libdeflate_crc32
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    sample = bytes(range(256)) * 40 + b"tail"
    buf = ctypes.create_string_buffer(sample, len(sample))
    for n in (0, 1, 31, 4096, len(sample) - 3):
        if fn(0, ctypes.addressof(buf) + 3, n) != zlib.crc32(sample[3:3 + n]):
            return None
    return fn


_crc32_at = _libdeflate_crc32()   # (0, address, length) -> CRC-32, or None: zlib
CRC32_IMPL = "libdeflate" if _crc32_at is not None else "zlib"


class ShortRead(OSError):
    """The file ended before the bytes the metadata promised (truncated file)."""


class NotRegularFile(OSError):
    """A path that should name a layer file names a directory, FIFO, device or socket."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def is_regular_file(path) -> bool:
    """True for a regular file; False for anything else, a symbolic link included (not
    followed), and for a path that does not exist."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular(path: str, flags: int = os.O_RDONLY) -> int:
    """os.open(path, flags) for a regular file only, without following a final symbolic
    link (ELOOP) and without blocking on a FIFO: anything but a regular file is closed
    again and raises NotRegularFile. The descriptor is returned in blocking mode."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, f"{path} is {_kind(mode)}, not a layer file")
        if not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


_tmp_serial = itertools.count()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_durable(path: str, chunks, total_bytes: int) -> None:
    """Write `chunks` [(offset, bytes), ...] into a new file at `path`, fsync it and its dir.

    Written under a temporary name (unique to the process and thread, ending in ".tmp"),
    then renamed, so a crash never leaves a partial file under a name the metadata could
    point to. On any failure neither the temporary file nor `path` is left behind.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    for _ in range(8):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.{next(_tmp_serial)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600)     # store files hold prompts' KV: owner only
            break
        except FileExistsError:   # a leftover of a killed process with our pid
            continue
    else:
        raise FileExistsError(errno.EEXIST, f"no free temporary name next to {path}")
    try:
        try:
            os.ftruncate(fd, total_bytes)
            for offset, data in chunks:
                view = memoryview(data)
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        # A failed write (ENOSPC, EIO, say) must not leave its partial file behind on a
        # disk that may already be full.
        _unlink_quietly(tmp)
        raise
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    try:
        fsync_dir(os.path.dirname(path))
    except BaseException:
        # The name may not be durable: no metadata will point to it, so it goes.
        _unlink_quietly(path)
        raise


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The store's other file-system calls. Every system call of the store goes through this
# module (the reader and write_durable above included), so a fault-injection harness that
# replaces `os` here, or one of these functions, reaches all of them.
def open_fd(path, flags: int, mode: int = 0o600) -> int:
    return os.open(path, flags, mode)


def close_fd(fd: int) -> None:
    os.close(fd)


def lock_exclusive(fd: int) -> None:
    """Take an exclusive advisory lock on `fd` without waiting (BlockingIOError if held)."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def unlink(path) -> None:
    os.unlink(path)


def unlink_missing_ok(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def link(src, dst) -> None:
    """A hard link to `src` itself (a symbolic link is linked, never its target)."""
    os.link(src, dst, follow_symlinks=False)


def make_dir(path, mode: int, parents: bool = False) -> None:
    """mkdir that accepts an existing directory (as Path.mkdir(exist_ok=True) does)."""
    try:
        if parents:
            os.makedirs(path, mode)
        else:
            os.mkdir(path, mode)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def chmod(path, mode: int) -> None:
    os.chmod(path, mode)


def lstat(path) -> os.stat_result:
    return os.lstat(path)


def stat_path(path) -> os.stat_result:
    """stat, following a symbolic link."""
    return os.stat(path)


def scandir(path) -> list[os.DirEntry]:
    with os.scandir(path) as it:
        return list(it)


def statvfs(path) -> os.statvfs_result:
    return os.statvfs(path)


def coalesce(extents: list[tuple[int, int]],
             max_run: int | None = None) -> list[tuple[int, int, list[int]]]:
    """[(offset, length)] sorted by offset -> runs [(offset, length, [extent indices])].

    Adjacent extents join one run (one read, one buffer) while it stays within `max_run`
    bytes (default MAX_RUN_BYTES), so a long stretch becomes several reads in flight.
    """
    limit = MAX_RUN_BYTES if max_run is None else max_run
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


class ChecksumMismatch(Exception):
    """Extent `index` of a request failed its CRC32."""

    def __init__(self, index: int):
        super().__init__(f"extent {index}: CRC mismatch")
        self.index = index


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
        per_run = max(1, MAX_RUN_BYTES // size)
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
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-read")
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
                return open_regular(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL or isinstance(exc, NotRegularFile):
                    raise
                refused = True   # tmpfs, or a FIFO / directory (ext4 refuses those too)
        fd = open_regular(path, os.O_RDONLY)
        if refused and not _warned_buffered:
            log.warning("O_DIRECT refused on %s (tmpfs?): buffered reads with "
                        "posix_fadvise(DONTNEED) instead", os.path.dirname(path))
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
                os.close(fd)
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
                os.close(self._fds.pop(old_path).fd)

    def _release(self, ent: _Fd) -> None:
        with self._lock:
            ent.users -= 1
            if ent.doomed and ent.users == 0:
                os.close(ent.fd)
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
                os.close(ent.fd)

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
            if _crc32_at is not None:
                addr = data.data_ptr()
                for k, expect in enumerate(crcs):
                    if _crc32_at(0, addr + k * stride, payload) != expect:
                        raise ChecksumMismatch(first + k)
            else:
                view = memoryview(data.numpy())
                for k, expect in enumerate(crcs):
                    if zlib.crc32(view[k * stride:k * stride + payload]) != expect:
                        raise ChecksumMismatch(first + k)
        elif _crc32_at is not None:
            addr = data.data_ptr()
            for index, start, payload, expect in checks:
                if _crc32_at(0, addr + start, payload) != expect:
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
                n = os.preadv(ent.fd, [view[done:]], offset + done)
                if n == 0 or (ent.direct and n % ALIGN and done + n < length):
                    # With O_DIRECT a short, unaligned read is the end of the file too
                    # (the next read would fail on alignment instead of saying so).
                    raise ShortRead(errno.EIO, f"{path}: file ends at {offset + done + n}, "
                                               f"expected {offset + length}")
                done += n
            if not ent.direct:
                os.posix_fadvise(ent.fd, offset, length, os.POSIX_FADV_DONTNEED)
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
                os.close(ent.fd)
            self._fds.clear()


def drop_page_cache(path: str) -> None:
    """Evict one file from the page cache (for cold buffered baselines)."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
