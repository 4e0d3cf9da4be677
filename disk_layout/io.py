"""Disk I/O for the prefix store: durable writes, cold O_DIRECT reads in parallel.

Reads bypass the page cache (O_DIRECT) so that what we time is the disk, and so that a
store larger than memory behaves as one. Adjacent chunks are coalesced into one read and
several reads are kept in flight by a small thread pool (os.preadv and zlib.crc32 release
the GIL). Where O_DIRECT is refused (tmpfs), reads fall back to buffered I/O followed by
posix_fadvise(DONTNEED), and we say so once.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from .format import ALIGN

log = logging.getLogger("impress_flexgen.disk")
MAX_RUN_BYTES = 8 << 20  # split longer runs so several reads are in flight

_warned_buffered = False


class ShortRead(OSError):
    """The file ended before the bytes the metadata promised (truncated file)."""


def write_durable(path: str, chunks, total_bytes: int) -> None:
    """Write `chunks` [(offset, bytes), ...] into a new file at `path`, fsync it and its dir.

    Written under a temporary name and renamed, so a crash never leaves a partial file
    under a name the metadata could point to.
    """
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def coalesce(extents: list[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """[(offset, length)] sorted by offset -> runs [(offset, length, [extent indices])]."""
    runs: list[tuple[int, int, list[int]]] = []
    for i, (off, length) in enumerate(extents):
        if runs:
            r_off, r_len, members = runs[-1]
            if r_off + r_len == off and r_len + length <= MAX_RUN_BYTES:
                runs[-1] = (r_off, r_len + length, members + [i])
                continue
        runs.append((off, length, [i]))
    return runs


class DiskReader:
    """Cold reads of aligned extents from immutable files, several in flight."""

    def __init__(self, threads: int = 4, direct: bool = True, max_open_files: int = 256):
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-read")
        self._fds: OrderedDict[str, tuple[int, bool]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_open_files = max_open_files
        self.bytes_read = 0
        self.reads = 0

    def _fd(self, path: str) -> tuple[int, bool]:
        global _warned_buffered
        with self._lock:
            if path in self._fds:
                self._fds.move_to_end(path)
                return self._fds[path]
            direct = False
            fd = -1
            if self.direct:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    direct = True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    if not _warned_buffered:
                        log.warning("O_DIRECT refused on %s (tmpfs?): buffered reads with "
                                    "posix_fadvise(DONTNEED) instead", os.path.dirname(path))
                        _warned_buffered = True
            if fd < 0:
                fd = os.open(path, os.O_RDONLY)
            self._fds[path] = (fd, direct)
            while len(self._fds) > self.max_open_files:
                _, (old, _) = self._fds.popitem(last=False)
                os.close(old)
            return fd, direct

    def forget(self, path: str) -> None:
        """Close a cached descriptor (before its file is deleted)."""
        with self._lock:
            entry = self._fds.pop(path, None)
        if entry:
            os.close(entry[0])

    def _read_run(self, path: str, offset: int, length: int) -> memoryview:
        fd, direct = self._fd(path)
        # An anonymous mapping is page-aligned, as O_DIRECT requires of the buffer.
        buf = mmap.mmap(-1, max(length, ALIGN))
        view = memoryview(buf)[:length]
        done = 0
        while done < length:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise ShortRead(errno.EIO, f"{path}: file ends at {offset + done}, "
                                           f"expected {offset + length}")
            done += n
        if not direct:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.bytes_read += length
            self.reads += 1
        return view

    def read(self, path: str, extents: list[tuple[int, int]]) -> list[memoryview]:
        """Read extents [(offset, length)] (sorted, aligned) -> one buffer per extent."""
        return self.read_many([(path, extents)])[0]

    def read_many(self, requests: list[tuple[str, list[tuple[int, int]]]]) -> list[list[memoryview]]:
        """Several files at once: all their runs are in flight together."""
        plans = []
        for path, extents in requests:
            runs = coalesce(extents)
            plans.append((extents, runs, [self.pool.submit(self._read_run, path, off, length)
                                          for off, length, _ in runs]))
        results = []
        for extents, runs, futures in plans:
            out: list[memoryview] = [None] * len(extents)  # type: ignore[list-item]
            for (r_off, _, members), fut in zip(runs, futures):
                view = fut.result()
                for i in members:
                    off, length = extents[i]
                    out[i] = view[off - r_off: off - r_off + length]
            results.append(out)
        return results

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


def drop_page_cache(path: str) -> None:
    """Evict one file from the page cache (for cold buffered baselines)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
