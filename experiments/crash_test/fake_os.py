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
