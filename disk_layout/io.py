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

This module holds the system calls (durable writes, opening layer files, the store's other
file-system calls), the CRC-32 and the read errors; the reader (reader.py) and its runs and
buffers (runs.py) call the file system through this module's `os`, so replacing `os` here
reaches every system call of the store. Their names are importable from here too.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import logging
import os
import stat
import threading
import zlib

log = logging.getLogger("impress_flexgen.disk")
# Longer runs are split so several reads are in flight. 4 MiB measured best here against
# 1, 2, 8 and 16 MiB (fewer reads: less CPU per byte; still 4 reads per 16 MiB request).
MAX_RUN_BYTES = 4 << 20


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


class ChecksumMismatch(Exception):
    """Extent `index` of a request failed its CRC32."""

    def __init__(self, index: int):
        super().__init__(f"extent {index}: CRC mismatch")
        self.index = index


# The reader and its runs live in reader.py and runs.py (they call the file system through
# this module); their names stay importable from here.
_LAZY = {"coalesce": "runs", "Run": "runs", "Extents": "runs", "BufferPool": "runs",
         "ReadLimit": "runs", "DiskReader": "reader", "drop_page_cache": "reader"}


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__package__}.{where}"), name)
