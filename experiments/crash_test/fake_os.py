"""Stand-ins for `os` that fail chosen system calls (installed by patching.patched_os)."""
from __future__ import annotations

import errno
import os
import threading


class FaultyOS:
    """Stands in for `os` where the store makes its system calls (patching.patched_os): reads of files
    named in `eio_names` fail with EIO (the descriptor is marked when the file is opened),
    and fsync call number `fsync_fail_at` fails with EIO."""

    def __init__(self, eio_names=(), fsync_fail_at: int | None = None):
        self.eio_names = set(eio_names)
        self.fsync_fail_at = fsync_fail_at
        self.bad_fds: set[int] = set()
        self.fsyncs = 0
        self.fired = 0
        self.fsync_mode = ""
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
        if os.path.basename(os.fspath(path)) in self.eio_names:
            with self._lock:
                self.bad_fds.add(fd)
        return fd

    def close(self, fd):
        with self._lock:
            self.bad_fds.discard(fd)
        return os.close(fd)

    def _check_read(self, fd) -> None:
        if fd in self.bad_fds:
            with self._lock:
                self.fired += 1
            raise OSError(errno.EIO, "Input/output error (injected)")

    def preadv(self, fd, buffers, offset, *flags):
        self._check_read(fd)
        return os.preadv(fd, buffers, offset, *flags)

    def pread(self, fd, n, offset):
        self._check_read(fd)
        return os.pread(fd, n, offset)

    def readv(self, fd, buffers):
        self._check_read(fd)
        return os.readv(fd, buffers)

    def read(self, fd, n):
        self._check_read(fd)
        return os.read(fd, n)

    def fsync(self, fd):
        with self._lock:
            n, self.fsyncs = self.fsyncs, self.fsyncs + 1
        if n == self.fsync_fail_at:
            self.fired += 1
            self.fsync_mode = "directory" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"
            raise OSError(errno.EIO, "Input/output error (injected fsync failure)")
        return os.fsync(fd)

    fdatasync = fsync


class NoSpaceOS:
    """Stands in for `os` during a durable write: the temporary file is created and sized,
    then pwrite fails with ENOSPC, as on a disk that fills up while a file is written."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


class SmallDiskOS:
    """Stands in for `os` as a file system of `capacity` bytes holding `root` (a store's
    directory): every regular file under it counts (the metadata database and its log
    too, which SQLite writes itself), statvfs reports what is left, and sizing or
    writing a file beyond it fails with ENOSPC. `peak` is the most ever found in use: above
    `capacity`, SQLite's own writes would have failed on such a disk."""

    BLOCK = 4096

    def __init__(self, root, capacity: int):
        self.root, self.capacity, self.peak = str(root), capacity, 0
        self.refused = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(os, name)

    def used(self) -> int:
        seen, total = set(), 0
        for parent, _, names in os.walk(self.root):
            for name in names:
                try:
                    st = os.lstat(os.path.join(parent, name))
                except FileNotFoundError:
                    continue
                if (st.st_dev, st.st_ino) not in seen and not os.path.islink(
                        os.path.join(parent, name)):
                    seen.add((st.st_dev, st.st_ino))   # a hard link is one file
                    total += st.st_size
        self.peak = max(self.peak, total)
        return total

    def _grow(self, fd, end: int) -> None:
        with self._lock:
            grow = end - os.fstat(fd).st_size
            if grow > 0 and self.used() + grow > self.capacity:
                self.refused += 1
                raise OSError(errno.ENOSPC, "No space left on device (small disk)")

    def ftruncate(self, fd, length):
        self._grow(fd, length)
        return os.ftruncate(fd, length)

    def pwrite(self, fd, data, offset):
        self._grow(fd, offset + len(data))
        return os.pwrite(fd, data, offset)

    def statvfs(self, path):
        free = max(0, self.capacity - self.used()) // self.BLOCK
        blocks = self.capacity // self.BLOCK
        return os.statvfs_result((self.BLOCK, self.BLOCK, blocks, free, free, 1 << 20,
                                  1 << 20, 1 << 20, 0, 255))
