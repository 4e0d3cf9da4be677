"""Weights read from FlexGen's disk files past the page cache (O_DIRECT).

FlexGen keeps a disk-resident tensor as a .npy file and its copy threads read it through a
memory map, that is through the page cache: on a machine whose RAM holds the model the
second step reads memory, not the disk. Here a whole-tensor copy from the disk into a
contiguous CPU tensor (every weight load of an offloaded layer) is read with O_DIRECT in
pieces of PIECE bytes through a page-aligned buffer of the reading thread. Where O_DIRECT
is refused (tmpfs) the read is buffered and its pages dropped after it
(posix_fadvise DONTNEED), so that the next read goes to the device again.

A file of SPLIT bytes or more is read as READERS spans at once (the copy thread reads one,
reader threads the others): one O_DIRECT stream of 8 MiB reads leaves the disk idle between
requests while the piece is copied out, and two streams read ~1.5x one on our machine.

A token table needs only the rows of the tokens it embeds: `want_rows(table, ids)` before
its load has the next copy of that disk tensor read just those rows (the other rows of the
destination are left unwritten, and the embedding reads only the rows it was given). A
decode step of a model whose token table is on the disk reads a few KiB instead of the
whole table; many scattered rows are read as the whole table (`row_runs`).

    read_npy(path, dst)      # dst (contiguous, CPU) filled with the file's array
    read_rows(path, dst, rows)
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import cpu_threads

ALIGN = 4096
PIECE = 8 << 20
SPLIT = 32 << 20
READERS = 2
# Reader threads for the other spans: one per FlexGen copy thread, so that copy threads
# splitting files at once never queue behind each other's spans.
READER_THREADS = 4
# A scattered row read costs about as much time as this many bytes read in sequence.
SEEK_BYTES = 64 << 10
_local = threading.local()
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_rows: dict[int, list[int]] = {}


def _scratch() -> tuple[mmap.mmap, torch.Tensor]:
    """This thread's page-aligned read buffer (anonymous maps are page-aligned)."""
    held = getattr(_local, "buf", None)
    if held is None:
        buf = mmap.mmap(-1, PIECE)
        held = _local.buf = (buf, torch.frombuffer(buf, dtype=torch.uint8))
    return held


def _readers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            # Idle workers end with the interpreter (concurrent.futures joins them at exit).
            _pool = ThreadPoolExecutor(READER_THREADS * (READERS - 1),
                                       thread_name_prefix="direct-read",
                                       initializer=cpu_threads.helper_thread)
        return _pool


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


def _aligned(lo: int, hi: int) -> tuple[int, int]:
    """The page-aligned file span holding bytes [lo, hi)."""
    return lo - lo % ALIGN, -(-hi // ALIGN) * ALIGN


def _span(fd: int, path: str, start: int, out: torch.Tensor, lo: int, hi: int) -> None:
    """Bytes [lo, hi) of the array (which starts at file offset `start`) into out[lo:hi]."""
    buf, view = _scratch()
    pos = _aligned(start + lo, start + hi)[0]   # O_DIRECT: aligned offsets, lengths, buffers
    done = lo
    while done < hi:
        skip = start + done - pos
        want = min(PIECE, -(-(skip + hi - done) // ALIGN) * ALIGN)
        got = os.preadv(fd, [memoryview(buf)[:want]], pos)
        take = min(got - skip, hi - done)
        if take <= 0:
            raise OSError(errno.EIO, f"{path}: file ends before its array")
        out[done:done + take].copy_(view[skip:skip + take])
        done += take
        pos += want


def _read_spans(path: str, out: torch.Tensor, spans: list[tuple[int, int]]) -> None:
    start = npy_offset(path)
    fd, direct = _open(path)
    try:
        if len(spans) > 1 and sum(hi - lo for lo, hi in spans) >= SPLIT:
            # A large read in READERS streams: this thread takes a share, the readers the rest.
            shares = [spans[i::READERS] for i in range(READERS)]
            pending = [_readers().submit(_each_span, fd, path, start, out, share)
                       for share in shares[1:] if share]
            try:
                _each_span(fd, path, start, out, shares[0])
            finally:
                for f in pending:
                    f.result()
        else:
            _each_span(fd, path, start, out, spans)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _each_span(fd, path, start, out, spans) -> None:
    for lo, hi in spans:
        _span(fd, path, start, out, lo, hi)


def read_npy(path: str, dst: torch.Tensor) -> int:
    """Fill contiguous CPU `dst` with the array of the .npy file `path`; the bytes read."""
    n = dst.numel() * dst.element_size()
    piece = max(PIECE, -(-n // READERS // PIECE) * PIECE)
    spans = [(lo, min(n, lo + piece)) for lo in range(0, n, piece)]
    _read_spans(path, dst.view(-1).view(torch.uint8), spans)
    return n


def row_runs(rows, n_rows: int, row_bytes: int) -> list[tuple[int, int]] | None:
    """Runs [first, end) of consecutive wanted rows (neighbours within a page merged), or
    None where reading them costs more than reading the whole table."""
    wanted = sorted({int(r) for r in rows})
    if not wanted or wanted[0] < 0 or wanted[-1] >= n_rows:
        return None
    gap = max(1, ALIGN // row_bytes)
    runs = [[wanted[0], wanted[0] + 1]]
    for r in wanted[1:]:
        if r - runs[-1][1] <= gap:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    cost = sum((end - first) * row_bytes + ALIGN for first, end in runs) + len(runs) * SEEK_BYTES
    return None if cost >= n_rows * row_bytes else [tuple(run) for run in runs]


def rows_bytes(runs: list[tuple[int, int]], row_bytes: int) -> int:
    """The array bytes a read of these runs takes (as read_npy counts a whole table)."""
    return sum(end - first for first, end in runs) * row_bytes


def read_rows(path: str, dst: torch.Tensor, rows) -> int:
    """Fill rows `rows` of contiguous CPU `dst` (n_rows, ...) from the .npy file `path`
    (the whole table where that is cheaper); the array bytes read."""
    row_bytes = dst[0].numel() * dst.element_size()
    runs = row_runs(rows, dst.shape[0], row_bytes)
    if runs is None:
        return read_npy(path, dst)
    spans = [(first * row_bytes, end * row_bytes) for first, end in runs]
    _read_spans(path, dst.view(-1).view(torch.uint8), spans)
    return rows_bytes(runs, row_bytes)


def want_rows(table, rows) -> None:
    """The next copy of disk tensor `table` (a FlexGen TorchTensor) reads only `rows`."""
    _rows[id(table)] = list(rows)


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

    if src.device.device_type != DeviceType.DISK:
        return False
    rows = _rows.pop(id(src), None)
    if dst.device.device_type != DeviceType.CPU:
        return False
    data = dst.data
    if not (torch.is_tensor(data) and data.is_contiguous() and data.device.type == "cpu"
            and whole(src_indices, src.shape) and whole(dst_indices, dst.shape)
            and tuple(data.shape) == tuple(src.shape)):
        return False
    if rows is not None:
        read_rows(src.data, data, rows)
    else:
        read_npy(src.data, data)
    return True
