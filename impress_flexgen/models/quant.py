"""FlexGen's group-wise 4-bit format, on any device and for any float dtype.

A tensor is cut into groups of `group_size` values along `group_dim` (the last group
zero-padded). Each group keeps its minimum and 15 / (max - min), in fp16 (`scale`, of shape
(..., groups, 2, ...) at group_dim); each value is q = round((x - min) * scale), 4 bits,
two to a byte along group_dim (the first of a pair in the high nibble). Back: q / scale +
min. These are the bytes and the arithmetic of flexgen/compression.py, so a tensor packed
by either is read by the other. What differs is where they run: FlexGen's CPU branch writes
into a workspace it allocates only for a compressed KV cache and returns fp16 on a GPU
whatever the tensor holds; here a CPU works in float32 (its fp16 arithmetic is slow) and
the result is in the tensor's own dtype, so weights compressed from fp32 come back fp32.

    data, scale = compress(w, group_size=64, group_dim=0)
    w4 = decompress(data, scale, w.shape, 64, 0, torch.float32)
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading

import numpy as np
import torch

from .. import cpu_threads
from ..errors import UserError

BITS = 4
LEVELS = 2 ** BITS - 1


@dataclasses.dataclass(frozen=True)
class Groups:
    """How a tensor is cut: `size` values along axis `dim` share a minimum and a scale."""

    size: int = 64
    dim: int = 0

    def check(self, ndim: int, what: str) -> "Groups":
        if self.size < 2 or self.size % 2:
            raise UserError(f"{what}: the group size must be an even number of at least 2 "
                            f"(got {self.size})")
        if not 0 <= self.dim < ndim:
            raise UserError(f"{what}: the group axis must be between 0 and {ndim - 1} "
                            f"(got {self.dim})")
        return self

    def describe(self) -> str:
        return f"groups of {self.size} along axis {self.dim}"


def packed_shapes(shape, group_size: int, group_dim: int) -> tuple[tuple, tuple]:
    """(shape of the packed bytes, shape of the fp16 scale and minimum) of a `shape` tensor."""
    shape = tuple(shape)
    groups = (shape[group_dim] + group_size - 1) // group_size
    data = shape[:group_dim] + (groups * (group_size // 2),) + shape[group_dim + 1:]
    scale = shape[:group_dim] + (groups, 2) + shape[group_dim + 1:]
    return data, scale


def packed_bytes(shape, group_size: int, group_dim: int) -> int:
    data, scale = packed_shapes(shape, group_size, group_dim)
    n_data = 1
    for s in data:
        n_data *= s
    n_scale = 1
    for s in scale:
        n_scale *= s
    return n_data + 2 * n_scale


def _work_dtype(dtype: torch.dtype, on_cuda: bool) -> torch.dtype:
    """FlexGen's arithmetic: fp16 stays fp16 on a GPU; everything else (and every dtype on
    a CPU, where half-precision elementwise work is slow) is worked in float32."""
    return dtype if on_cuda and dtype == torch.float16 else torch.float32


def _grouped(x: torch.Tensor, group_size: int, group_dim: int) -> torch.Tensor:
    """x padded with zeros to whole groups and viewed (..., groups, group_size, ...)."""
    shape = x.shape
    groups = (shape[group_dim] + group_size - 1) // group_size
    pad = groups * group_size - shape[group_dim]
    if pad:
        zeros = torch.zeros(shape[:group_dim] + (pad,) + shape[group_dim + 1:],
                            dtype=x.dtype, device=x.device)
        x = torch.cat([x, zeros], dim=group_dim)
    return x.reshape(shape[:group_dim] + (groups, group_size) + shape[group_dim + 1:])


# Below this many values a CPU works on one thread: the four elementwise passes of a small
# tensor are over before a second thread would help, and a second thread waits for a busy
# core (unpacking a 1536 x 576 matrix: 0.65 ms on two threads, 0.53 ms on one, while
# another process used one of the two cores).
ONE_THREAD_BELOW = 1 << 22


def _threads_for(n: int, device):
    if device.type == "cpu" and n < ONE_THREAD_BELOW and torch.get_num_threads() > 1:
        return cpu_threads.single_threaded()
    return contextlib.nullcontext()


def compress(x: torch.Tensor, group_size: int, group_dim: int,
             on_cuda: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 data, fp16 scale and minimum) of `x`, on x's device. `on_cuda`: which
    arithmetic (default: x's device); tests pass True to run the GPU branch on a CPU."""
    with _threads_for(x.numel(), x.device):
        return _compress(x, group_size, group_dim, on_cuda)


def _compress(x, group_size, group_dim, on_cuda):
    if on_cuda is None:
        on_cuda = x.is_cuda
    if group_size % 2:
        raise ValueError("4-bit groups need an even size")
    data = _grouped(x.to(_work_dtype(x.dtype, on_cuda)), group_size, group_dim)
    mn = torch.min(data, dim=group_dim + 1, keepdim=True)[0]
    mx = torch.max(data, dim=group_dim + 1, keepdim=True)[0]
    scale = LEVELS / (mx - mn)
    data = data - mn
    data.mul_(scale)
    q = data.clamp_(0, LEVELS).round_().to(torch.uint8)
    # Two values to a byte along the group: even positions high, odd positions low.
    idx = [slice(None)] * q.dim()
    idx[group_dim + 1] = slice(0, None, 2)
    high = q[tuple(idx)]
    idx[group_dim + 1] = slice(1, None, 2)
    packed = torch.bitwise_or(high.bitwise_left_shift(4), q[tuple(idx)])
    data_shape, scale_shape = packed_shapes(x.shape, group_size, group_dim)
    return (packed.reshape(data_shape),
            torch.cat([scale, mn], dim=group_dim + 1).to(torch.float16).reshape(scale_shape))


class Workspace:
    """Buffers that decompression writes into, reused from call to call on a CPU: a fresh
    tensor of a layer's size is fresh pages, and faulting them in cost three times the
    arithmetic (torch's CPU allocator hands blocks that large back to the kernel). A
    buffer is taken again only once nothing else holds its storage (the weight it held
    is no longer used), so a decompressed tensor a caller keeps is never overwritten; the
    workspace holds at most what was in use at once.

    Each buffer is a numpy byte array handed out through torch.from_numpy: the storage of
    every tensor made from it, views included, holds a reference to the array, so the
    array's reference count says whether any of them is still alive."""

    def __init__(self):
        self._local = threading.local()

    def take(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            raise ValueError("the workspace holds CPU buffers")
        pool = self._local.__dict__.setdefault("pool", {})
        held = pool.setdefault((tuple(shape), dtype), [])
        for buf in held:
            if sys.getrefcount(buf) <= _FREE_REFS:
                return _as_tensor(buf, shape, dtype)
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        buf = np.empty(n, dtype=np.uint8)
        held.append(buf)
        return _as_tensor(buf, shape, dtype)

    def clear(self) -> None:
        self._local.__dict__.pop("pool", None)


def _as_tensor(buf: np.ndarray, shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(buf).view(dtype).view(shape)


def _free_refs() -> int:
    """The reference count `take` sees for a buffer nothing outside the pool holds: the
    pool's list, the loop's name and getrefcount's argument."""
    held = [np.empty(1, dtype=np.uint8)]
    for buf in held:
        return sys.getrefcount(buf)


_FREE_REFS = _free_refs()
WORKSPACE = Workspace()


def decompress(data: torch.Tensor, scale: torch.Tensor, shape, group_size: int,
               group_dim: int, dtype: torch.dtype, on_cuda: bool | None = None
               ) -> torch.Tensor:
    """The `shape` tensor, in `dtype`, that `data` and `scale` (from compress) hold, on
    data's device. `on_cuda`: as for compress. On a CPU the result may live in WORKSPACE
    (reused once the caller drops it)."""
    with _threads_for(2 * data.numel(), data.device):
        return _decompress(data, scale, shape, group_size, group_dim, dtype, on_cuda)


def _decompress(data, scale, shape, group_size, group_dim, dtype, on_cuda):
    if on_cuda is None:
        on_cuda = data.is_cuda
    shape = tuple(shape)
    work = _work_dtype(dtype, on_cuda)
    half = group_size // 2
    dshape = tuple(data.shape)
    groups = dshape[group_dim] // half
    packed = data.reshape(dshape[:group_dim] + (groups, half, 1) + dshape[group_dim + 1:])
    grouped = dshape[:group_dim] + (groups, group_size) + dshape[group_dim + 1:]
    pairs = dshape[:group_dim] + (groups, half, 2) + dshape[group_dim + 1:]
    if data.device.type == "cpu":
        # Unpacked as bytes, then widened into a reused buffer: both passes are fast on
        # memory already faulted in.
        q = WORKSPACE.take(pairs, torch.uint8, data.device)
        out = WORKSPACE.take(grouped, work, data.device)
    else:
        q = torch.empty(pairs, dtype=torch.uint8, device=data.device)
        out = torch.empty(grouped, dtype=work, device=data.device)
    idx = [slice(None)] * q.dim()
    idx[group_dim + 2] = slice(0, 1)
    torch.bitwise_right_shift(packed, 4, out=q[tuple(idx)])
    idx[group_dim + 2] = slice(1, 2)
    torch.bitwise_and(packed, 0xF, out=q[tuple(idx)])
    out.copy_(q.view(grouped))
    sc, mn = scale.to(work).split(1, dim=group_dim + 1)
    if work == torch.float32:
        # FlexGen's q / scale + min in one pass: the same roundings as its div_ then add_
        # in float32 (the fused kernel computes in float32 too).
        torch.addcdiv(mn, out, sc, out=out)
    else:
        out.div_(sc).add_(mn)     # half precision: rounded after each, as FlexGen does
    full = dshape[:group_dim] + (groups * group_size,) + dshape[group_dim + 1:]
    out = out.view(full)
    if full[group_dim] != shape[group_dim]:
        out = out.narrow(group_dim, 0, shape[group_dim])   # rows: still contiguous
    out = out.reshape(shape)
    return out if out.dtype == dtype else out.to(dtype)
