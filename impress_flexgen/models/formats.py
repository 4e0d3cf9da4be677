"""How a model's weights are held: a dtype (which they compute in, too), or FlexGen's 4-bit
groups of it (dequantised per layer on the compute device just before use).

    fmt = WeightFormat("int4", np.float32, Groups(64, 0))
    candidates(cuda=False, dtype=None, compress=None)   # what --placement auto weighs

--placement auto weighs the formats of AUTO_FORMATS for its compute device, fastest first,
and keeps the first that holds every weight in memory (else the one that leaves the least
on disk). A format joins the list for a device once it computes there well: the list is
the only place to change. Formats that work but that auto never picks on a device are in
SLOW_FORMATS, with why: a refusal still names them when they would fit.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from . import dtypes
from .dtypes import BF16
from .quant import Groups


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    name: str                     # what the user reads: fp32, bf16, fp16, int4
    dtype: type                   # the compute dtype (uncompressed weights are held in it)
    groups: Groups | None = None  # FlexGen's 4-bit groups; None: held in the dtype

    @property
    def compress(self) -> bool:
        return self.groups is not None

    @property
    def dtype_name(self) -> str:
        return dtypes.name(self.dtype)

    @property
    def label(self) -> str:
        """Names the format in file names: fp32, int4-g64a0-float32."""
        if self.groups is None:
            return self.name
        return f"int4-g{self.groups.size}a{self.groups.dim}-{self.dtype_name}"

    def describe(self) -> str:
        if self.groups is None:
            return self.name
        return f"int4 ({self.groups.describe()}, computed in {self.dtype_name})"

    def flags(self) -> str:
        """The command-line flags that ask for this format."""
        return f"--dtype {dtypes.flag(self.dtype)}" + (" --compress-weight" if self.compress else "")

    def digest(self, weights_digest: str) -> str:
        """The identity of what computes with weights of `weights_digest` held this way:
        4-bit weights are other weights (their KV is not the dtype's)."""
        if self.groups is None or not weights_digest:
            return weights_digest
        return hashlib.sha256(f"{weights_digest}:{self.label}".encode()).hexdigest()


# Fastest first, per compute device (measured, docs/design.md "Placement"): on a CPU fp32
# (its half-precision products are two orders of magnitude slower), then 4-bit weights
# dequantised to fp32 (capacity, not speed: torch's packed int4 CPU kernels were slower
# than fp32); with CUDA fp16, then 4-bit dequantised to fp16.
AUTO_FORMATS = {
    "cpu": (("fp32", np.float32, False), ("int4", np.float32, True)),
    "cuda": (("fp16", np.float16, False), ("int4", np.float16, True)),
}
SLOW_FORMATS = {
    "cpu": ((("bf16", BF16, False), "rounds every value to 8 bits of mantissa"),
            (("int4", BF16, True), "rounds every value to 8 bits of mantissa"),
            (("fp16", np.float16, False), "computes far slower on a CPU"),
            (("int4", np.float16, True), "computes far slower on a CPU")),
    "cuda": ((("bf16", BF16, False), "the bytes of fp16, with fewer bits of mantissa"),
             (("fp32", np.float32, False), "twice the bytes of fp16")),
}


def _make(entry, groups: Groups) -> WeightFormat:
    name, dtype, compress = entry
    return WeightFormat(name, dtype, groups if compress else None)


def _allowed(fmt: WeightFormat, dtype, compress: bool | None) -> bool:
    return (dtype is None or dtypes.same(dtype, fmt.dtype)) and \
        (compress is None or compress == fmt.compress)


def candidates(cuda: bool, dtype=None, compress: bool | None = None,
               groups: Groups = Groups(64, 0)) -> list[WeightFormat]:
    """The formats auto weighs on this device, fastest first, within what the user pinned
    (`dtype`, `compress`: None leaves it open). Pinned to a format auto would not pick,
    that format alone."""
    device = "cuda" if cuda else "cpu"
    out = [_make(e, groups) for e in AUTO_FORMATS[device]]
    out += [_make(e, groups) for e, _ in SLOW_FORMATS.get(device, ())]
    picked = [f for f in out if _allowed(f, dtype, compress)]
    auto = [f for f in picked if f in [_make(e, groups) for e in AUTO_FORMATS[device]]]
    return auto or picked[:1]


def others(cuda: bool, groups: Groups = Groups(64, 0)) -> list[tuple[WeightFormat, str]]:
    """Every format this device can compute in, with a note (empty for auto's own)."""
    device = "cuda" if cuda else "cpu"
    return [(_make(e, groups), "") for e in AUTO_FORMATS[device]] + \
        [(_make(e, groups), why) for e, why in SLOW_FORMATS.get(device, ())]
