"""A compute device that is not the host, on any machine: device mismatches show without a GPU.

    with FakeDevice() as dev:               # dev.device: torch.device("meta")
        x = torch.zeros(3, device=dev.device)      # "on the device" (host memory, tagged)
        x + torch.ones(3)                   # DeviceMismatch, as on a GPU
        x.numpy()                           # TypeError, as on a GPU
        x.cpu().numpy()                     # fine: one copy to the host, counted

Tensors "on" the fake device are host tensors of a subclass (`OnFake`); they compute
exactly as host tensors do, so results can be compared bit for bit with a host run. The mode
sees every torch call on its thread: a call mixing fake-device tensors with host tensors of
one or more dimensions (or numpy arrays) raises, like CUDA; a 0-dim host tensor mixes freely,
as on CUDA. Stricter than CUDA in one way: indexing a device tensor with a host index tensor
raises (CUDA copies the index over and waits), since that is a hidden copy per call. The
meta device stands for it: `x.device` of a fake tensor reads meta, so code that checks for
"cpu" takes its device path, and a tensor really created on meta outside the mode fails at
once on its first use.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("meta")


class DeviceMismatch(RuntimeError):
    pass


class OnFake(torch.Tensor):
    """A host tensor standing for one on the fake device (torch's default subclass handling
    keeps results of operations on it in the subclass)."""


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def _fake(t):
    if not isinstance(t, torch.Tensor) or isinstance(t, OnFake):
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(OnFake)


def _is_fake_device(device) -> bool:
    return device is not None and torch.device(device).type == FAKE.type


_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
               torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}


class FakeDevice(TorchFunctionMode):
    """Counts `to_host` (copies back to the host and reads of values: each is a wait for the
    device) and `to_device` (copies from the host)."""

    device = FAKE

    def __init__(self):
        super().__init__()
        self.to_host = 0
        self.to_device = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        first = args[0] if args else None
        on_fake = isinstance(first, OnFake)
        if func == torch.Tensor.device.__get__:
            return FAKE if on_fake else func(*args, **kwargs)
        if func == torch.Tensor.is_cpu.__get__ and on_fake:
            return False
        if func == torch.Tensor.numpy and on_fake:
            raise TypeError("can't convert meta device type tensor to numpy. Use Tensor.cpu() "
                            "to copy the tensor to host memory first.")
        if func in _HOST_READS and on_fake:
            self.to_host += 1
            return func(*args, **kwargs)
        if func == torch.Tensor.cpu and on_fake:
            self.to_host += 1
            return _plain(first).clone()
        if func == torch.Tensor.to:
            options = {k: v for k, v in kwargs.items() if k != "copy"}
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **options)
            if device is not None and (on_fake or device.type == FAKE.type):
                return self._move(first, dtype or first.dtype, device)
        if _is_fake_device(kwargs.get("device")):        # a factory: torch.zeros(..., device=)
            kwargs["device"] = "cpu"
            self._check(func, args, kwargs)
            return tree_map(_fake, func(*args, **kwargs))
        self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _move(self, t: torch.Tensor, dtype, device: torch.device):
        """A move onto, off or on the fake device. The fake device's memory is the host's,
        whatever the machine has (on a GPU machine too)."""
        if device.type != FAKE.type:             # off it: to the host (or a real GPU)
            self.to_host += 1
            return _plain(t).to(device, dtype, copy=True)
        if isinstance(t, OnFake):                # on it: a conversion at most
            return _fake(_plain(t).to(dtype))
        self.to_device += 1
        return _fake(t.to("cpu", dtype, copy=True))

    @staticmethod
    def _check(func, args, kwargs) -> None:
        leaves, _ = tree_flatten((args, kwargs))
        fake = any(isinstance(x, OnFake) for x in leaves)
        if not fake:
            return
        host = [x for x in leaves if (isinstance(x, torch.Tensor) and not isinstance(x, OnFake)
                                      and x.dim() > 0) or
                (isinstance(x, np.ndarray) and x.ndim > 0)]
        if host:
            name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
            raise DeviceMismatch(f"{name}: tensors on the fake device and on the host "
                                 f"(a host one of shape {tuple(host[0].shape)})")
