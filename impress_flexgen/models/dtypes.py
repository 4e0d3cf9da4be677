"""The compute dtypes a model runs in (fp32, fp16, bf16), as FlexGen and numpy see them.

FlexGen names a tensor's dtype by a numpy type (np.float16, np.float32) and numpy has no
bfloat16, so bf16 is `BF16` on the numpy side: a 2-byte type whose one field holds the raw
16-bit word of a bfloat16 value. Files keep these words (np.save writes them as they are)
and torch reads them back by reinterpreting the bits, never by converting values.

    dtype = of_name("bf16")                 # what RuntimeConfig.dtype and configs hold
    torch_dtype(dtype), name(dtype)         # torch.bfloat16, "bfloat16"
    array = to_numpy(t); t = from_numpy(array)   # bit for bit, whatever the dtype
"""
from __future__ import annotations

import numpy as np
import torch

BF16 = np.dtype([("bfloat16", "<u2")])

# The names --dtype takes (and every message that lists them).
NAMES = {"fp32": np.float32, "fp16": np.float16, "bf16": BF16}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def of_name(flag: str | None):
    """--dtype's value (fp32, fp16, bf16) as the dtype configs hold; None stays None."""
    if flag is None:
        return None
    try:
        return NAMES[flag]
    except KeyError:
        raise ValueError(f"unknown dtype {flag!r}: choose one of {', '.join(NAMES)}") from None


def name(dtype) -> str:
    """"float32", "float16" or "bfloat16" for any form of a compute dtype (numpy type or
    dtype, BF16, torch dtype, or one of those names)."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype in _TORCH:
        return dtype
    d = np.dtype(dtype)
    return "bfloat16" if d == BF16 else d.name


def flag(dtype) -> str:
    """The --dtype name of a compute dtype: fp32, fp16 or bf16."""
    n = name(dtype)
    return next(k for k, v in NAMES.items() if name(v) == n)


def same(a, b) -> bool:
    return name(a) == name(b)


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a compute dtype (or of any numpy dtype torch has)."""
    n = name(dtype)
    if n in _TORCH:
        return _TORCH[n]
    return torch.from_numpy(np.empty(0, np.dtype(dtype))).dtype


def itemsize(dtype) -> int:
    return torch_dtype(dtype).itemsize


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy holds them: bf16 as BF16 words (no copy)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """torch.from_numpy, reading BF16 words back as bf16 values (no copy)."""
    if array.dtype == BF16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def cast(array: np.ndarray, dtype) -> np.ndarray:
    """A float array's values in `dtype` (to bf16: rounded to nearest, as torch rounds)."""
    if np.dtype(dtype) != BF16 and array.dtype != BF16:
        return array.astype(dtype)
    values = from_numpy(np.ascontiguousarray(array))
    return to_numpy(values.to(torch_dtype(dtype)))


_registered = False


def register_with_flexgen() -> None:
    """Teach FlexGen's dtype tables and its numpy-to-torch load about BF16."""
    global _registered
    if _registered:
        return
    from flexgen import pytorch_backend as pb, utils

    utils.np_dtype_to_torch_dtype[BF16] = torch.bfloat16
    utils.torch_dtype_to_np_dtype[torch.bfloat16] = BF16
    utils.torch_dtype_to_num_bytes[torch.bfloat16] = 2
    original = pb.TorchTensor.load_from_np

    def load_from_np(self, np_array):
        # FlexGen copies torch.from_numpy(array) into the tensor, which would convert
        # BF16's words as integers: they are read as the bf16 values they hold.
        if np_array.dtype == BF16 and self.device.device_type != pb.DeviceType.DISK:
            values = from_numpy(np.ascontiguousarray(np_array))
            if self.device.device_type == pb.DeviceType.COMPRESSED:
                packed = pb.global_cpu_device.compressed_device.compress(values, self.data[2])
                pb.general_copy(self, None, packed, None)
            else:
                self.data.copy_(values)
            return
        original(self, np_array)

    pb.TorchTensor.load_from_np = load_from_np
    _registered = True
