"""Model weights in FlexGen's per-tensor format: seeded random, or converted once and cached.

FlexGen reads weights from a directory holding one np.save file per parameter (Hugging Face
names without the "model." prefix, no .npy suffix). Its `_DUMMY_` weights are all ones, which
turns every activation into NaN; we replace FlexGen's `init_weight_list` with one that also
understands a *random-weight marker* path and fills each tensor with seeded normal values
directly on its home device (on the GPU when it lives there, so OPT-30B shapes build quickly).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from ..errors import UserError
from ..store import scratch
from . import conversion_keys, dtypes
from .conversion_keys import file_identity

log = logging.getLogger("impress_flexgen.models.weights")

RANDOM_MARKER = "<random-weights"
# A 4-bit matrix of a weight set (weight_sets.py): its packed bytes and its fp16 scales.
PACKED, SCALES = ".q4", ".q4s"
_RANDOM_RE = re.compile(r"<random-weights seed=(\d+) std=([0-9.eE+-]+)>/?(.*)$")


def random_weight_path(seed: int = 0, std: float = 0.02) -> str:
    """A pseudo-directory: FlexGen layers join parameter names onto it as onto a real path."""
    return f"{RANDOM_MARKER} seed={seed} std={std}>"


def generator_device() -> torch.device:
    """Random weights are drawn on the GPU when there is one (fast for 30B shapes), and on
    that one device whatever the placement, so every placement gets the same weights."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def random_tensor(name: str, shape, seed: int, std: float, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Deterministic per (seed, parameter name); lives on generator_device(). `out`: a
    float32 tensor of `shape` there to draw into (the same values, without a second copy
    of every weight)."""
    device = generator_device()
    leaf = name.rsplit("/", 1)[-1]
    into = out is not None and out.dtype == torch.float32 == dtype and out.device == device
    if leaf.endswith("norm.weight"):
        return out.fill_(1) if into else torch.ones(shape, dtype=dtype, device=device)
    if leaf.endswith(".bias"):
        return out.zero_() if into else torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(leaf.encode())) % (2**63))
    if into:
        return torch.randn(shape, generator=gen, out=out).mul_(std)
    # Draw in fp32 (fp16 randn is slow or missing on CPU), then cast.
    values = torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * std
    return values.to(dtype)


def parse_random_path(filename: str):
    """(seed, std, parameter name) of a random-weight marker path, or None for a real file."""
    match = _RANDOM_RE.match(filename)
    if match is None:
        return None
    return int(match.group(1)), float(match.group(2)), match.group(3)


def init_weight_list(weight_specs, policy, env):
    """Drop-in for flexgen.flex_opt.init_weight_list: same placement, real or seeded weights.
    Files of a weight set (weight_sets.py) are read as they are: 4-bit matrices from their
    packed bytes and scales, and what lives on disk is used where it lies (never copied
    into the offload directory, never deleted with the model)."""
    from flexgen.flex_opt import get_choice
    from flexgen.pytorch_backend import DeviceType
    from flexgen.utils import np_dtype_to_torch_dtype

    dev_percents = [policy.w_disk_percent, policy.w_cpu_percent, policy.w_gpu_percent]
    dev_choices = [env.disk, env.cpu, env.gpu]
    sizes = [int(np.prod(spec[0])) for spec in weight_specs]
    sizes_cumsum = np.cumsum(sizes)
    ret = []
    for (shape, dtype, filename), size, cum in zip(weight_specs, sizes, sizes_cumsum):
        # FlexGen places each tensor by where its middle falls in the layer's elements.
        mid_percent = (cum - size / 2) / sizes_cumsum[-1]
        home = get_choice(mid_percent * 100, dev_percents, dev_choices)
        small = len(shape) < 2
        compress = policy.compress_weight and not small
        pin = True if small else policy.pin_weight
        random = parse_random_path(filename)
        on_disk = home.device_type == DeviceType.DISK
        if random is None and on_disk:
            weight = _in_place(shape, dtype, filename, home, compress, policy)
            if weight is not None:
                ret.append(weight)
                continue
        if compress:
            weight = home.compressed_device.allocate(shape, dtype, policy.comp_weight_config,
                                                     pin_memory=pin)
        else:
            weight = home.allocate(shape, dtype, pin_memory=pin)

        if random is None:
            _read(weight, filename, dtype, compress, on_disk)
        else:
            direct = not compress and home.device_type in (DeviceType.CPU, DeviceType.CUDA)
            values = random_tensor(random[2], shape, random[0], random[1],
                                   np_dtype_to_torch_dtype[dtype],
                                   out=weight.data if direct else None)
            if direct:
                if values is not weight.data:  # drawn elsewhere, or in another dtype
                    weight.data.copy_(values)
            else:  # disk or compressed: through numpy, as FlexGen loads files
                weight.load_from_np(dtypes.to_numpy(values.cpu()))
        _loaded(weight)
        ret.append(weight)
    return ret


_bar = None   # the progress bar of the weights being loaded (loading() sets it)


def _loaded(weight) -> None:
    if _bar is not None:
        _bar.update(_held_bytes(weight))


def _held_bytes(weight) -> int:
    from flexgen.pytorch_backend import DeviceType

    if weight.device.device_type == DeviceType.COMPRESSED:
        return sum(_held_bytes(part) for part in weight.data[:2])
    return int(np.prod(weight.shape)) * weight.data.element_size() \
        if isinstance(weight.data, torch.Tensor) else int(weight.bytes)


class loading:
    """`with loading(total_bytes):` a progress bar over the weights init_weight_list
    places (rate and time left)."""

    def __init__(self, total: int):
        from .. import progress

        self.bar = progress.bar(total, "loading weights")

    def __enter__(self):
        global _bar
        _bar = self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        global _bar
        _bar = None
        return self.bar.__exit__(*exc)


def _in_place(shape, dtype, filename, disk, compress: bool, policy):
    """A disk-homed weight read from `filename` (and its packed parts) where it lies, or
    None when the file is not in the form the tensor needs (then it is copied, as FlexGen
    does)."""
    from flexgen.pytorch_backend import TorchTensor
    from flexgen.utils import np_dtype_to_torch_dtype

    def file_tensor(path, want_dtype):
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError):
            return None
        if array.dtype != np.dtype(want_dtype):
            return None
        t = TorchTensor(tuple(array.shape), dtypes.torch_dtype(want_dtype),
                        str(path), disk)
        t.delete_file = False     # the weights cache's, not the model's
        return t

    if compress:
        data = file_tensor(filename + PACKED, np.uint8)
        scale = file_tensor(filename + SCALES, np.float16)
        if data is None or scale is None:
            return None
        return TorchTensor(tuple(shape), np_dtype_to_torch_dtype[dtype],
                           (data, scale, policy.comp_weight_config), disk.compressed_device)
    return file_tensor(filename, dtype)


def _read(weight, filename: str, dtype, compress: bool, on_disk: bool) -> None:
    """Fill an allocated weight from its file(s): packed 4-bit parts when they are there."""
    with warnings.catch_warnings():
        # A read-only memory map read into a tensor: torch warns it could not write to it.
        warnings.simplefilter("ignore", UserWarning)
        if compress and os.path.exists(filename + PACKED):
            for part, suffix in zip(weight.data[:2], (PACKED, SCALES)):
                part.load_from_np(np.load(filename + suffix, mmap_mode="r"))
            return
        if not os.path.exists(filename):
            raise UserError(f"weight file missing: {filename}")
        if on_disk and np.load(filename, mmap_mode="r").dtype != np.dtype(dtype):
            # FlexGen would copy the file as it is: cast it (fp16 files, fp32 compute).
            weight.load_from_np(dtypes.cast(np.load(filename), dtype))
        else:
            weight.load_from_np(np.load(filename, mmap_mode="r"))


def install() -> None:
    """Route FlexGen's weight loading through `init_weight_list` above."""
    from flexgen import flex_opt

    flex_opt.init_weight_list = init_weight_list


# ---------------------------------------------------------------------------------------
# Conversion of real checkpoints, done once and cached.

def _conversion_key(content: dict[str, str], extra: str) -> str:
    """The name of a conversion's directory: what its checkpoint's files hold (each file's
    name within the checkpoint and SHA-256), converted how. Identical checkpoints at any
    path share it."""
    h = hashlib.sha256(f"impress_flexgen-conversion-v3:{extra}".encode())
    for name, digest in sorted(content.items()):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()[:16]


def _source_content(cache_root: Path, sources: list[Path]):
    """({name within the checkpoint: SHA-256}, [identity of each file]) of the sources,
    hashed once per file identity (conversion_keys)."""
    hashed = conversion_keys.content_hashes(cache_root, sources)
    base = os.path.commonpath([str(Path(s).absolute().parent) for s in sources])
    names = [os.path.relpath(Path(s).absolute(), base) for s in sources]
    return dict(zip(names, (h for _, h in hashed))), [i for i, _ in hashed]


def save_tensor(out_dir: Path, name: str, array: np.ndarray) -> None:
    # fsynced before the directory is renamed into place: a crash must never leave a
    # finished-looking conversion with empty or partial files in it.
    with open(out_dir / name, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())


CONVERTED = "CONVERTED.json"
DIGEST = "DIGEST.json"          # the content digest, keyed by the files' identities
_HEX64 = re.compile(r"[0-9a-f]{64}")


def fsync_tree(path: Path) -> None:
    """fsync every regular file under `path`, then its directories (before a rename that
    publishes them)."""
    for root, dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for root, _, _ in os.walk(path, topdown=False):
        _fsync_dir(root)


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _weight_files(directory: Path) -> list[os.DirEntry]:
    return sorted((e for e in os.scandir(directory) if e.is_file(follow_symlinks=False)
                   and e.name not in (CONVERTED, DIGEST) and not e.name.endswith(".tmp")),
                  key=lambda e: e.name)


def _hash_files(entries) -> str:
    h = hashlib.sha256(b"impress_flexgen-weights-v1")
    for e in entries:
        with open(e.path, "rb") as f:
            inner = hashlib.file_digest(f, "sha256").hexdigest()
        h.update(f"{e.name}\0{inner}\n".encode())
    return h.hexdigest()


def content_digest(directory: Path) -> str:
    """SHA-256 over the names and contents of a converted directory's weight files. Hashed
    once, then cached beside them (DIGEST.json) keyed by every file's identity: a file
    changed in place (its mtime put back or not) is hashed again, and so becomes another
    model identity."""
    directory = Path(directory)
    entries = _weight_files(directory)
    key = {e.name: file_identity(e.stat(follow_symlinks=False)) for e in entries}
    try:
        cached = json.loads((directory / DIGEST).read_text())
        if cached.get("files") == key and _HEX64.fullmatch(str(cached.get("digest"))):
            return cached["digest"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = _hash_files(entries)
    try:       # a cache that cannot be written only costs a hash next time
        tmp = directory / f"{DIGEST}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"files": key, "digest": digest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / DIGEST)
    except OSError:
        pass
    return digest


def _conversion_problem(final: Path, content: dict[str, str]) -> str | None:
    """Why a finished conversion cannot be used (made from other content, its files
    missing, cut short or changed since it was made), or None."""
    try:
        done = json.loads((final / CONVERTED).read_text())
    except (OSError, ValueError) as exc:
        return f"{CONVERTED} unreadable ({exc.__class__.__name__})"
    if not isinstance(done, dict) or done.get("source_content") != content:
        return "it was converted from other files"
    sizes = done.get("sizes")
    if not isinstance(sizes, dict):
        return f"{CONVERTED} lists no files"
    have = {e.name: e.stat().st_size for e in _weight_files(final)}
    if have != sizes:
        return "its files are not those the conversion wrote"
    want = done.get("digest")
    if isinstance(want, str) and content_digest(final) != want:
        return "its files changed since the conversion"
    return None


def converted_dir(cache_root: Path, label: str, sources: list[Path], dtype: np.dtype,
                  convert: Callable[[Path], None]) -> Path:
    """Return the cached conversion of `sources`, running `convert(tmp_dir)` if absent.

    Keyed by what the sources hold: a checkpoint changed in place is converted again under
    its new key (the old conversion stays, for the old content). The conversion is written
    to a temporary directory, fsynced and renamed into place, so an interrupted conversion
    is never mistaken for a finished one; one whose files were damaged or changed
    afterwards is converted again, in its place.
    """
    content, identities = _source_content(cache_root, sources)
    key = _conversion_key(content, f"{label}:{dtypes.name(dtype)}")
    final = cache_root / f"{label}-{dtypes.name(dtype)}-{key}"
    if (final / CONVERTED).exists():
        problem = _conversion_problem(final, content)
        if problem is None:
            return final
        log.warning("converted weights in %s cannot be used (%s): converting again", final,
                    problem)
    for gone in conversion_keys.prune_path_keyed(cache_root, CONVERTED):
        log.info("removed %s: keyed by checkpoint paths that are gone", gone)
    try:
        # A scratch directory: one a killed conversion left is removed by the next one.
        # Renamed into place, it keeps the cache's usual permissions.
        tmp = scratch.make(cache_root, "convert", mode=0o777)
    except OSError as exc:
        raise UserError(f"cannot convert weights into {cache_root}: "
                        f"{exc.strerror or exc}") from None
    try:
        convert(tmp)
        # What was converted must be what was hashed: never file one content's weights
        # under another's key.
        if [file_identity(Path(s).stat()) for s in sources] != identities:
            raise UserError(f"the checkpoint's files changed while they were converted "
                            f"({', '.join(map(str, sources))}): run again")
        digest = content_digest(tmp)      # cached in tmp: the rename keeps the identities
        with open(tmp / CONVERTED, "w") as f:
            json.dump({"sources": [str(s) for s in sources], "dtype": dtypes.name(dtype),
                       "source_content": content,
                       "sizes": {e.name: e.stat().st_size for e in _weight_files(tmp)},
                       "digest": digest}, f)
        fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(cache_root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def checkpoint_files(model_path: Path) -> list[Path]:
    files = sorted(model_path.glob("*.safetensors")) or sorted(model_path.glob("pytorch_model*.bin"))
    if not files:
        raise UserError(f"no *.safetensors or pytorch_model*.bin files in {model_path}")
    return files


def iter_checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, so a large checkpoint never sits in memory whole."""
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
        else:
            state = torch.load(f, map_location="cpu", weights_only=True)
            yield from state.items()
            del state
