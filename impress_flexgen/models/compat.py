"""Make FlexGen 0.1.8 run on CPU-only torch, and close its disk threads at exit.

FlexGen assumes CUDA. On a machine without it, building an OptLM fails in five places:
CUDA streams in OptLM.__init__, pinned allocations in TorchDevice.allocate,
torch.cuda.synchronize in OptLM.sync / TorchDevice.synchronize, the disk copy threads
(which call torch.cuda.set_device, die, and leave every later join hanging), and
`.cuda().half()` in the CPU branches of mha_gen (inside mha_gen only, on that thread only,
they keep the tensor where it is, in the layer's compute dtype: fp32 without CUDA).
`apply()` patches exactly these, and only when CUDA is absent: on a CUDA machine FlexGen
runs as published.

Independently of CUDA, FlexGen's TorchDisk starts non-daemon copy threads and keeps a
global reference to itself, so a process that forgets close_copy_threads() hangs at
interpreter exit. `register_disk()` closes them from a hook that runs before Python joins
non-daemon threads. And its copy threads open .npy files with numpy's header reader, which
parses the header with `ast`; CPython 3.11's parser is not thread-safe ("AST constructor
recursion depth mismatch"), so `apply()` swaps in a reader that needs no parser.

FlexGen's 4-bit compression (TorchCompressedDevice) fails on a CPU whatever the placement:
its CPU decompression writes into a workspace allocated only for a compressed KV cache
computed on the CPU (`TypeError: object of type 'NoneType' has no len()` for weights), it
accepts only fp16 tensors, and it returns fp16 on a GPU even for fp32 weights. `apply()`
routes its compress and decompress through quant.py (the same bytes and arithmetic, any
device, any float dtype), on every machine.
"""
from __future__ import annotations

import contextlib
import queue as queue_mod
import re
import threading
import types
import weakref

import numpy as np
import torch

from .. import cpu_threads
from . import direct_read, dtypes, quant

_applied = False
_open_disks: "weakref.WeakSet" = weakref.WeakSet()
_exit_hook_installed = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


class _NullStream:
    """Stands in for torch.cuda.Stream: work on CPU is already synchronous."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


def _cpu_cuda_namespace() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        Stream=lambda *a, **k: _NullStream(),
        stream=lambda s=None: contextlib.nullcontext(),
        synchronize=lambda *a, **k: None,
        set_device=lambda *a, **k: None,
        is_available=lambda: False,
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        empty_cache=lambda: None,
    )


class _TorchWithoutCuda(types.ModuleType):
    """The torch module as FlexGen sees it on a CPU-only machine: `torch.cuda` is a no-op shim."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _cpu_cuda_namespace()

    def __getattr__(self, name):
        return getattr(torch, name)


def cpu_copy_worker(copy_queue: queue_mod.Queue, cuda_id: int = 0) -> None:
    """FlexGen's disk copy worker without CUDA (whole weights read with O_DIRECT).

    A failed copy must not kill the thread: FlexGen joins the queue, so a dead worker
    means a hang. The error is kept and raised by the next synchronize().
    """
    from flexgen import pytorch_backend as pb

    # Its copies run on this thread alone, as cpu_threads has helper threads do (one team
    # of OpenMP threads, the computing thread's).
    cpu_threads.helper_thread()
    while True:
        item = copy_queue.get()
        if item is None:
            copy_queue.task_done()
            return
        try:
            dst, dst_indices, src, src_indices = item
            # A weight load from the disk is read past the page cache (direct_read).
            if not direct_read.try_copy(dst, dst_indices, src, src_indices):
                src_data = pb.map_to_torch_tensor(src, src_indices)
                dst_data = pb.map_to_torch_tensor(dst, dst_indices)
                dst_data.copy_(src_data)
        except BaseException as exc:  # noqa: BLE001 - reported by synchronize()
            _copy_errors.append(exc)
        finally:
            copy_queue.task_done()


_copy_errors: list = []


def _raise_copy_errors() -> None:
    if _copy_errors:
        exc = _copy_errors.pop(0)
        _copy_errors.clear()
        raise RuntimeError(f"FlexGen disk copy failed: {exc!r}") from exc


_in_attention = threading.local()  # .dtype: the compute dtype while this thread is in mha_gen


def _tensor_method_in_attention(original, replacement):
    """`original`, except inside mha_gen on this thread (other threads are unaffected)."""
    def method(t, *args, **kwargs):
        dtype = getattr(_in_attention, "dtype", None)
        if dtype is None:
            return original(t, *args, **kwargs)
        return replacement(t, dtype)

    method.__name__ = original.__name__
    method.__doc__ = original.__doc__
    return method


def _mha_gen_without_cuda(original):
    def mha_gen(self, inputs, *args, **kwargs):
        # The CPU branches of mha_gen end in `.cuda().half()`: on a CPU-only machine the
        # result stays where it is, in the dtype the layer computes in (fp32 weights would
        # otherwise meet an fp16 attention output).
        outer = getattr(_in_attention, "dtype", None)
        _in_attention.dtype = inputs.data.dtype
        try:
            return original(self, inputs, *args, **kwargs)
        finally:
            _in_attention.dtype = outer

    return mha_gen


def _allocate_unpinned(original):
    def allocate(self, shape, dtype, pin_memory=None, name=None):
        return original(self, shape, dtype, pin_memory=False, name=name)

    return allocate


def _synchronize_disk(original):
    def synchronize(self):
        original(self)
        _raise_copy_errors()

    return synchronize


_NPY_HEADER = re.compile(
    r"'descr':\s*(?:'(?P<descr>[^']+)'|(?P<bf16>\[\('bfloat16',\s*'<u2'\)\])),\s*'fortran_order':\s*(?P<fortran>True|False),"
    r"\s*'shape':\s*\((?P<shape>[0-9,\s]*)\)")


def open_npy(path: str) -> np.memmap:
    """np.lib.format.open_memmap(path) for the files FlexGen writes, without `ast`.

    Safe to call from many threads at once (numpy's own reader is not on CPython 3.11).
    """
    with open(path, "rb") as f:
        magic = f.read(8)
        if magic[:6] != b"\x93NUMPY":
            raise ValueError(f"{path}: not a .npy file")
        size_bytes = 2 if magic[6] == 1 else 4
        header_len = int.from_bytes(f.read(size_bytes), "little")
        header = f.read(header_len).decode("latin1")
    m = _NPY_HEADER.search(header)
    if m is None or m["fortran"] == "True":
        raise ValueError(f"{path}: unsupported .npy header {header.strip()!r}")
    shape = tuple(int(x) for x in m["shape"].replace(" ", "").split(",") if x)
    dtype = dtypes.BF16 if m["bf16"] else np.dtype(m["descr"])
    return np.memmap(path, dtype=dtype, mode="r+",
                     offset=8 + size_bytes + header_len, shape=shape, order="C")


def _map_to_torch_tensor(original):
    from flexgen.pytorch_backend import DeviceType

    def map_to_torch_tensor(tensor, indices):
        if isinstance(indices, list):   # FlexGen's compressed copies index with lists
            indices = tuple(indices)
        if tensor.device.device_type != DeviceType.DISK:
            return original(tensor, indices)
        data = dtypes.from_numpy(open_npy(tensor.data))
        if torch.is_tensor(indices):
            from flexgen.pytorch_backend import vector_gather
            return vector_gather(data, indices)
        return data[indices] if indices else data

    return map_to_torch_tensor


_thread_safe_npy = False


def _make_npy_reads_thread_safe() -> None:
    global _thread_safe_npy
    if _thread_safe_npy:
        return
    from flexgen import pytorch_backend as pb

    pb.map_to_torch_tensor = _map_to_torch_tensor(pb.map_to_torch_tensor)
    _thread_safe_npy = True


def compressed_allocate(self, shape, dtype, comp_config, pin_memory=None, name=None):
    """TorchCompressedDevice.allocate for any float dtype (FlexGen's asserts fp16): the
    tensor says what it holds; its bytes are FlexGen's (uint8 pairs, fp16 scale)."""
    from flexgen.pytorch_backend import TorchTensor
    from flexgen.utils import np_dtype_to_torch_dtype

    if comp_config.num_bits != quant.BITS:
        raise ValueError(f"only {quant.BITS}-bit compression exists (got {comp_config.num_bits})")
    data_shape, scale_shape = quant.packed_shapes(shape, comp_config.group_size,
                                                  comp_config.group_dim)
    data = self.base_device.allocate(data_shape, np.uint8, pin_memory=pin_memory)
    scale = self.base_device.allocate(scale_shape, np.float16, pin_memory=pin_memory)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else np_dtype_to_torch_dtype[dtype]
    return TorchTensor(tuple(shape), torch_dtype, (data, scale, comp_config), self, name=name)


def compressed_compress(self, tensor, comp_config):
    """TorchCompressedDevice.compress: a torch tensor into a compressed TorchTensor on this
    device's base device (its scale already in fp16, as a store into FlexGen's buffers
    would make it)."""
    from flexgen.pytorch_backend import TorchTensor

    if comp_config.num_bits != quant.BITS or comp_config.symmetric:
        raise ValueError("FlexGen's compression is asymmetric 4-bit")
    data, scale = quant.compress(tensor, comp_config.group_size, comp_config.group_dim)
    return TorchTensor(tuple(tensor.shape), tensor.dtype,
                       (TorchTensor.create_from_torch(data, self.base_device),
                        TorchTensor.create_from_torch(scale, self.base_device), comp_config),
                       self)


def compressed_decompress(self, tensor) -> torch.Tensor:
    """TorchCompressedDevice.decompress: the plain tensor, in the tensor's dtype, on the
    device that holds its bytes (a fresh one each call: FlexGen's CPU workspace is not
    needed, so every placement works)."""
    data, scale, comp_config = tensor.data
    return quant.decompress(data.data, scale.data, tensor.shape, comp_config.group_size,
                            comp_config.group_dim, tensor.dtype)


_compression_routed = False


def _route_compression() -> None:
    global _compression_routed
    if _compression_routed:
        return
    from flexgen import compression

    indices = compression.get_compressed_indices

    def get_compressed_indices(tensor, idx, shape):
        # Tuples: torch reads a list of slices as a tensor index from 2.9 on.
        data, scale = indices(tensor, idx, shape)
        return tuple(data), tuple(scale)

    compression.get_compressed_indices = get_compressed_indices
    dev = compression.TorchCompressedDevice
    dev.allocate = compressed_allocate
    dev.compress = compressed_compress
    dev.decompress = compressed_decompress
    _compression_routed = True


def apply() -> bool:
    """Patch FlexGen for CPU-only torch. Returns True when patches were applied.

    The thread-safe .npy reader, bf16 (dtypes.py) and the compression routed through
    quant.py are installed on every machine."""
    global _applied
    dtypes.register_with_flexgen()
    _make_npy_reads_thread_safe()
    _route_compression()
    if _applied:
        return True
    if cuda_available():
        return False
    from flexgen import flex_opt, pytorch_backend as pb

    shim = _TorchWithoutCuda()
    flex_opt.torch = shim
    pb.torch = shim
    pb.TorchDevice.allocate = _allocate_unpinned(pb.TorchDevice.allocate)
    pb.TorchDevice.mha_gen = _mha_gen_without_cuda(pb.TorchDevice.mha_gen)
    torch.Tensor.cuda = _tensor_method_in_attention(torch.Tensor.cuda, lambda t, dtype: t)
    torch.Tensor.half = _tensor_method_in_attention(torch.Tensor.half,
                                                    lambda t, dtype: t.to(dtype))
    pb.TorchDisk.synchronize = _synchronize_disk(pb.TorchDisk.synchronize)
    pb.copy_worker_func = cpu_copy_worker
    _applied = True
    return True


def close_disk(disk) -> None:
    """Stop a TorchDisk's copy threads; safe to call twice."""
    if disk is None or getattr(disk, "copy_queue", None) is None:
        return
    disk.close_copy_threads()


def _close_open_disks() -> None:
    for disk in list(_open_disks):
        try:
            close_disk(disk)
        except Exception:  # noqa: BLE001 - exiting anyway; never hang or crash here
            pass


def register_disk(disk) -> None:
    """Make sure `disk`'s copy threads are closed before the interpreter joins threads."""
    global _exit_hook_installed
    _open_disks.add(disk)
    if not _exit_hook_installed:
        # threading._register_atexit hooks run before non-daemon threads are joined
        # (plain atexit hooks run after, too late to prevent the hang).
        threading._register_atexit(_close_open_disks)
        _exit_hook_installed = True
