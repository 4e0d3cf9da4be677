"""Weights made once: a model's weights in the format a run holds them in (its dtype, or
FlexGen's 4-bit groups), written once into the weights cache and read back at every later
start.

    ws = weight_set(spec, fmt)            # None: the model's own files serve as they are
    if not ws.made():
        make(ws, spec, fmt)               # a progress bar; the first line says how long
    spec.weight_path = ws.path            # FlexGen's init_weight_list reads it

A set is a directory under the weights cache named by the model, the format and a digest
of what its weights are (seeded random weights: the family, shape and seed; converted ones:
their files' content) and of every tensor's name and shape. It holds one np.save file per
tensor (FlexGen's names, no suffix), or for a 4-bit matrix its packed bytes (`NAME.q4`)
and fp16 scales (`NAME.q4s`), and WEIGHTS.json, written last, with each file's identity
(size, mtime, ctime, inode): a set whose files changed or went missing is made again. It is
made in a scratch directory and renamed into place, so a killed start leaves nothing that
looks finished (the next start sweeps the scratch). Seeded random weights of any size and
conversions (a cast, or 4-bit groups of a checkpoint's files) all go through here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from .. import progress
from ..errors import UserError
from ..paths import weights_dir
from ..store import scratch
from . import dtypes, quant
from .footprint import weight_names
from .formats import WeightFormat
from .weights import PACKED, SCALES, file_identity, fsync_tree, parse_random_path, random_tensor

log = logging.getLogger("impress_flexgen.models.weight_sets")

MANIFEST = "WEIGHTS.json"
RATES = "RATES.json"          # what the last set made here measured: an estimate's basis
SAMPLE = 1 << 22              # parameters made to estimate the rate when none was measured


@dataclasses.dataclass(frozen=True)
class WeightSet:
    path: Path
    tensors: tuple[tuple[str, tuple[int, ...]], ...]   # unique (name, shape)
    fmt: WeightFormat
    nbytes: int                                         # what its files hold

    @property
    def params(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors)

    def made(self) -> bool:
        """Complete and unchanged since it was made (a stat of each file, no reading)."""
        return _problem(self) is None


def _files(name: str, shape, fmt: WeightFormat) -> list[str]:
    return [name + PACKED, name + SCALES] if fmt.compress and len(shape) >= 2 else [name]


def _file_bytes(shape, fmt: WeightFormat) -> int:
    if fmt.compress and len(shape) >= 2:
        return quant.packed_bytes(shape, fmt.groups.size, fmt.groups.dim)
    return int(np.prod(shape)) * dtypes.itemsize(fmt.dtype)


def served_as_is(spec, fmt: WeightFormat) -> bool:
    """A converted checkpoint's own files already hold `fmt` (same dtype, uncompressed)."""
    if spec.random_weights or fmt.compress:
        return False
    first = Path(spec.weight_path) / weight_names(spec)[0][0][0]
    try:
        return np.load(first, mmap_mode="r").dtype == np.dtype(fmt.dtype)
    except (OSError, ValueError):
        return False


def weight_set(spec, fmt: WeightFormat) -> WeightSet | None:
    """Where `spec`'s weights in `fmt` are (or will be) made; None when its own files serve."""
    if served_as_is(spec, fmt):
        return None
    tensors = tuple(dict.fromkeys((n, tuple(s)) for layer in weight_names(spec)
                                  for n, s in layer))
    key = hashlib.sha256(json.dumps([spec.weights_digest, fmt.label, tensors]).encode())
    label = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in spec.name)
    path = weights_dir() / f"{label}-{fmt.label}-{key.hexdigest()[:16]}"
    return WeightSet(path, tensors, fmt, sum(_file_bytes(s, fmt) for _, s in tensors))


def _problem(ws: WeightSet) -> str | None:
    try:
        done = json.loads((ws.path / MANIFEST).read_text())
        files = done["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "not made yet"
    want = [f for name, shape in ws.tensors for f in _files(name, shape, ws.fmt)]
    if sorted(files) != sorted(want):
        return "its files are not those of this model"
    for name, identity in files.items():
        try:
            if file_identity((ws.path / name).stat()) != identity:
                return f"{name} changed since it was made"
        except OSError:
            return f"{name} is missing"
    return None


def _values(spec, name: str, shape, source: Path | None, dtype: torch.dtype) -> torch.Tensor:
    """One tensor's values in `dtype`: drawn from the seed, or read from the checkpoint's
    converted file."""
    if source is None:
        seed, std, _ = parse_random_path(spec.weight_path)
        return random_tensor(name, shape, seed, std, dtype)
    array = np.load(source / name, mmap_mode="r")
    if tuple(array.shape) != tuple(shape):
        raise UserError(f"{source / name}: shape {array.shape}, the model needs {shape}")
    return dtypes.from_numpy(np.ascontiguousarray(array)).to(dtype)


def _write(out: Path, name: str, shape, values: torch.Tensor, fmt: WeightFormat) -> int:
    """Write one tensor in `fmt`; returns the bytes written."""
    def save(file: str, t: torch.Tensor) -> int:
        array = dtypes.to_numpy(t.cpu())
        with open(out / file, "wb") as f:
            np.save(f, array)
        return array.nbytes

    if fmt.compress and len(shape) >= 2:
        data, scale = quant.compress(values, fmt.groups.size, fmt.groups.dim)
        return save(name + PACKED, data) + save(name + SCALES, scale)
    return save(name, values)


def _rates() -> dict:
    try:
        rates = json.loads((weights_dir() / RATES).read_text())
        return {k: float(v) for k, v in rates.items() if k in RATE_KEYS}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


RATE_KEYS = ("params_per_s", "bytes_per_s", "load_bytes_per_s")


def record_rate(name: str, value: float) -> None:
    """Keep what a start measured (making, loading) for the next estimate."""
    rates = _rates()
    rates[name] = value
    try:
        weights_dir().mkdir(parents=True, exist_ok=True)
        tmp = weights_dir() / f"{RATES}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(rates))
        os.replace(tmp, weights_dir() / RATES)
    except OSError:
        pass


def first_start_s(plan, spec) -> tuple[float | None, str]:
    """(seconds a start with `plan` takes to make and load its weights, how it was
    estimated); None when nothing measured here tells how fast loading is."""
    made, basis = 0.0, []
    if plan.weights_write:
        ws = weight_set(spec, plan.format)
        made, how = estimate_s(ws, spec)
        basis.append(f"making: {how}")
    load = _rates().get("load_bytes_per_s")
    total = sum(plan.weights.values())
    if load is None:
        return (made or None), "; ".join(basis + ["loading: not measured here yet"])
    basis.append("loading: the rate the last start here measured")
    return made + total / load, "; ".join(basis)


def estimate_s(ws: WeightSet, spec) -> tuple[float, str]:
    """(seconds to make `ws`, how that was estimated): from what the last set made here
    measured, else from a sample of SAMPLE parameters made in memory now."""
    rates = _rates()
    if rates:
        return ws.params / rates["params_per_s"], "the rate the last set made here measured"
    dtype = dtypes.torch_dtype(ws.fmt.dtype)
    name, shape = max(ws.tensors, key=lambda t: int(np.prod(t[1])))
    rows = max(1, min(shape[0], SAMPLE // max(1, int(np.prod(shape[1:])))))
    sample = (rows,) + tuple(shape[1:])
    t0 = time.perf_counter()
    if spec.random_weights:
        values = random_tensor(name, sample, 0, 0.02, dtype)
    else:
        values = torch.zeros(sample, dtype=dtype)
    if ws.fmt.compress and len(sample) >= 2:
        quant.compress(values, ws.fmt.groups.size, ws.fmt.groups.dim)
    rate = int(np.prod(sample)) / max(time.perf_counter() - t0, 1e-6)
    return ws.params / rate, "a sample made in memory now (writing not counted)"


def make(ws: WeightSet, spec) -> None:
    """Make `ws` once: each tensor drawn or converted, written in its format, then the
    manifest; renamed into place. The first line says what and how long."""
    root = ws.path.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = scratch.make(root, "weights", mode=0o777)
    except OSError as exc:
        raise UserError(f"cannot make weights in {root}: {exc.strerror or exc}") from None
    source = None if spec.random_weights else Path(spec.weight_path)
    dtype = dtypes.torch_dtype(ws.fmt.dtype)
    seconds, basis = estimate_s(ws, spec)
    what = "drawing the seeded random" if source is None else "converting the"
    progress.say(f"{what} weights of {spec.name} into {ws.fmt.describe()}, once: "
                 f"{ws.nbytes / 2**30:.2f} GiB to write to {ws.path}, about "
                 f"{duration(seconds)} (from {basis}); later starts read them back")
    t0 = time.perf_counter()
    try:
        with progress.bar(ws.nbytes, "making weights") as bar:
            for name, shape in ws.tensors:
                values = _values(spec, name, shape, source, dtype)
                bar.update(_write(tmp, name, shape, values, ws.fmt))
                del values
        files = {f: None for n, s in ws.tensors for f in _files(n, s, ws.fmt)}
        fsync_tree(tmp)
        files = {f: file_identity((tmp / f).stat()) for f in files}
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"model": spec.name, "format": ws.fmt.label, "files": files,
                       "weights_digest": spec.weights_digest}, f)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(ws.path, ignore_errors=True)
        os.replace(tmp, ws.path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    took = time.perf_counter() - t0
    _record_rates(ws, took)
    progress.say(f"weights of {spec.name} made in {took:.1f} s ({ws.nbytes / 2**30:.2f} GiB "
                 f"in {ws.path})")


def _record_rates(ws: WeightSet, took: float) -> None:
    if ws.params >= 50 * SAMPLE:      # a small set says nothing about a big one
        record_rate("params_per_s", ws.params / took)
        record_rate("bytes_per_s", ws.nbytes / took)


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def ensure(spec, fmt: WeightFormat):
    """`spec` reading its weights in `fmt` from a set made once (made now if it is not),
    or `spec` unchanged when its own files serve."""
    ws = weight_set(spec, fmt)
    if ws is None:
        return spec
    problem = _problem(ws)
    if problem is not None:
        if problem != "not made yet":
            log.warning("weights in %s cannot be used (%s): making them again", ws.path,
                        problem)
        make(ws, spec)
    return dataclasses.replace(spec, weight_path=str(ws.path))
