"""Weights read from FlexGen's disk files past the page cache (O_DIRECT).

FlexGen keeps a disk-resident tensor as a .npy file and its copy threads read it through a
memory map, that is through the page cache: on a machine whose RAM holds the model the
second step reads memory, not the disk. Here a whole-tensor copy from the disk into a
contiguous CPU tensor (every weight load of an offloaded layer) is read with O_DIRECT in
pieces of PIECE bytes through a page-aligned buffer of the reading thread. Where O_DIRECT
is refused (tmpfs) the read is buffered and its pages dropped after it
(posix_fadvise DONTNEED), so that the next read goes to the device again.

    read_npy(path, dst)      # dst (contiguous, CPU) filled with the file's array
"""
from __future__ import annotations

import errno
import mmap
import os
import threading

import torch

ALIGN = 4096
PIECE = 8 << 20
_local = threading.local()


def _scratch() -> tuple[mmap.mmap, torch.Tensor]:
    """This thread's page-aligned read buffer (anonymous maps are page-aligned)."""
    held = getattr(_local, "buf", None)
    if held is None:
        buf = mmap.mmap(-1, PIECE)
        held = _local.buf = (buf, torch.frombuffer(buf, dtype=torch.uint8))
    return held


def npy_offset(path: str) -> int:
    """Where the array's bytes start in a .npy file (after its header)."""
    with open(path, "rb") as f:
        magic = f.read(8)
        if magic[:6] != b"\x93NUMPY":
            raise ValueError(f"{path}: not a .npy file")
        size_bytes = 2 if magic[6] == 1 else 4
        return 8 + size_bytes + int.from_bytes(f.read(size_bytes), "little")


def _open(path: str) -> tuple[int, bool]:
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY), False


def read_npy(path: str, dst: torch.Tensor) -> int:
    """Fill contiguous CPU `dst` with the array of the .npy file `path`; the bytes read."""
    n = dst.numel() * dst.element_size()
    out = dst.view(-1).view(torch.uint8)
    start = npy_offset(path)
    buf, view = _scratch()
    fd, direct = _open(path)
    try:
        pos = start - start % ALIGN       # O_DIRECT: aligned offsets, lengths and buffers
        done = 0
        while done < n:
            skip = start + done - pos
            want = min(PIECE, -(-(skip + n - done) // ALIGN) * ALIGN)
            got = os.preadv(fd, [memoryview(buf)[:want]], pos)
            take = min(got - skip, n - done)
            if take <= 0:
                raise OSError(errno.EIO, f"{path}: file ends before its array")
            out[done:done + take].copy_(view[skip:skip + take])
            done += take
            pos += want
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return n


def whole(indices, shape) -> bool:
    """FlexGen's copy indices (None, or slices) that name a whole tensor."""
    if not indices:
        return True
    if len(indices) != len(shape):
        return False
    return all(isinstance(s, slice) and s.step in (None, 1) and (s.start or 0) == 0
               and (s.stop is None or s.stop >= n) for s, n in zip(indices, shape))


def try_copy(dst, dst_indices, src, src_indices) -> bool:
    """One of FlexGen's queued copies done by read_npy when it is a whole .npy file into a
    whole contiguous CPU tensor (a weight load); False: not such a copy, left to FlexGen."""
    from flexgen.pytorch_backend import DeviceType

    if src.device.device_type != DeviceType.DISK or dst.device.device_type != DeviceType.CPU:
        return False
    data = dst.data
    if not (torch.is_tensor(data) and data.is_contiguous() and data.device.type == "cpu"
            and whole(src_indices, src.shape) and whole(dst_indices, dst.shape)
            and tuple(data.shape) == tuple(src.shape)):
        return False
    read_npy(src.data, data)
    return True
