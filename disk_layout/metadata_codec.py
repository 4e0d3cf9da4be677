"""Compact encodings of a layer row's per-token fields: the physical -> logical mapping and
the accumulated importance.

They are the only per-token metadata kept per layer, and a small model keeps little KV per
token and layer (SmolLM2-135M: 768 bytes), so each byte here is 0.13% of the KV.

Mapping (hard state, under the row's CRC): a reorder keeps the sink chunk in place, puts
the hot tokens first and leaves the rest in positional order. A mapping is stored as the
length of its identity head, the explicit entries after it, bit-packed at the width the
node's length needs, and nothing for its ascending tail (the sorted rest of the tokens).
Any permutation can be stored; a reordered layer costs about a quarter of its tokens at
ceil(log2 n) bits each.

Importance (soft state): 10 bits per token on a log scale between the row's smallest
positive and largest value (float32 each), 0 for exactly zero, under a CRC-32. The scale
spans at most 2^24 (float32's own resolution), so neighbouring codes are 1.6% apart.
Quantising is monotonic: a reorder ranks tokens as before except among tokens that share a
code (on SmolLM2's serving workload 0.14% of a layer's hot tokens move to other chunks;
8 bits: 0.46%, experiments/importance_codes.py).
The in-memory importance stays float32: only a reopened store ranks by stored values.
Rows with negative or non-finite values keep float16 (the encoding before schema 4).

Decoders take any bytes: a blob that is not a valid encoding for the row's length comes
back as None with the reason, never as wrong data.
"""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np

_MAPPING = struct.Struct("<cIIIB")    # tag, n tokens, identity head, explicit count, width
_MAPPING_TAG = b"P"
_LOG = struct.Struct("<cBffI")        # tag, bits per code, smallest positive, largest, CRC-32
                                      # of those three and the codes
_LOG_TAG = b"L"
_HALF = struct.Struct("<cI")          # tag, CRC-32 of the float16 values
_HALF_TAG = b"H"
# Largest / smallest positive value the codes tell apart: float32's own resolution.
LOG_SPAN = 2.0 ** 24
IMPORTANCE_BITS = 10


# -- mapping --------------------------------------------------------------------------------
def _width(span: int) -> int:
    """Bits per explicit entry: values lie in [0, span)."""
    return max(1, (span - 1).bit_length())


def _pack(values: np.ndarray, width: int) -> bytes:
    bits = np.empty((len(values), width), dtype=np.uint8)
    v = values.astype(np.uint64)
    for b in range(width):
        bits[:, b] = (v >> np.uint64(b)) & np.uint64(1)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def _unpack(payload: bytes, count: int, width: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), bitorder="little",
                         count=count * width).reshape(count, width)
    out = np.zeros(count, dtype=np.uint64)
    for b in range(width):
        out |= bits[:, b].astype(np.uint64) << np.uint64(b)
    return out.astype(np.int64)


def encode_mapping(mapping: np.ndarray) -> bytes:
    """The blob of a permutation of range(len(mapping)) (ValueError for anything else)."""
    m = np.asarray(mapping).astype(np.int64, copy=False)
    n = len(m)
    if m.ndim != 1 or n >= 1 << 32 or (n and (m.min() < 0 or m.max() >= n)) or \
            (n and not (np.bincount(m, minlength=n) == 1).all()):
        raise ValueError("a mapping must be a permutation of the node's tokens")
    same = m == np.arange(n)
    head = n if same.all() else int(np.argmin(same))
    rest = m[head:]
    falls = np.flatnonzero(np.diff(rest) < 0)      # the tail after the last fall ascends
    count = 0 if len(falls) == 0 else int(falls[-1]) + 1
    width = _width(n - head)
    return _MAPPING.pack(_MAPPING_TAG, n, head, count, width) + \
        _pack(rest[:count] - head, width)


def decode_mapping(blob, n_tokens: int) -> tuple[np.ndarray | None, str | None]:
    """(mapping as int64, None), or (None, why the blob is not a mapping of n_tokens)."""
    if not isinstance(blob, bytes) or len(blob) < _MAPPING.size:
        return None, "mapping blob too short"
    tag, n, head, count, width = _MAPPING.unpack_from(blob)
    if tag != _MAPPING_TAG:
        return None, "mapping blob of an unknown encoding"
    if n != n_tokens:
        return None, f"mapping of {n} tokens for {n_tokens}"
    if head > n or count > n - head or width != _width(n - head):
        return None, "mapping header does not fit the node"
    if len(blob) != _MAPPING.size + (count * width + 7) // 8:
        return None, f"mapping blob of {len(blob)} bytes for its header"
    explicit = _unpack(blob[_MAPPING.size:], count, width)
    if count and (explicit.max() >= n - head or
                  not (np.bincount(explicit, minlength=n - head) <= 1).all()):
        return None, "mapping is not a permutation of the node's tokens"
    free = np.ones(n - head, dtype=bool)
    free[explicit] = False
    return np.concatenate([np.arange(head), head + explicit,
                           head + np.flatnonzero(free)]).astype(np.int64), None


# -- importance ------------------------------------------------------------------------------
def encode_importance(importance: np.ndarray, bits: int = IMPORTANCE_BITS) -> bytes:
    """`bits` per token on a log scale (float16 for negative or non-finite values)."""
    if not 2 <= bits <= 16:
        raise ValueError("importance codes are 2 to 16 bits")
    v = np.asarray(importance, dtype=np.float32).reshape(-1)
    if not np.isfinite(v).all() or (v < 0).any():
        half = v.astype(np.float16).tobytes()
        return _HALF.pack(_HALF_TAG, zlib.crc32(half)) + half
    positive = v > 0
    codes = np.zeros(len(v), dtype=np.int64)
    hi = lo = np.float32(0)
    if positive.any():
        hi = np.float32(v[positive].max())
        lo = np.float32(max(float(v[positive].min()), float(hi) / LOG_SPAN))
        if lo <= 0 or not np.isfinite(lo):       # hi / LOG_SPAN underflowed float32
            lo = np.float32(np.finfo(np.float32).smallest_subnormal)
        steps = (1 << bits) - 2
        if hi > lo:
            scale = steps / math.log(float(hi) / float(lo))
            at = np.log(np.maximum(v[positive], lo).astype(np.float64) / float(lo)) * scale
            codes[positive] = 1 + np.clip(np.rint(at), 0, steps).astype(np.int64)
        else:
            codes[positive] = 1
    head = struct.pack("<Bff", bits, float(lo), float(hi))
    data = _pack(codes, bits)
    return _LOG.pack(_LOG_TAG, bits, float(lo), float(hi), zlib.crc32(head + data)) + data


def decode_importance(blob, n_tokens: int) -> np.ndarray | None:
    """Importance as float32, or None for a blob that is not one of n_tokens values."""
    if not isinstance(blob, bytes) or len(blob) < 1:
        return None
    if blob[:1] == _HALF_TAG and len(blob) == _HALF.size + 2 * n_tokens:
        _, crc = _HALF.unpack_from(blob)
        data = blob[_HALF.size:]
        if zlib.crc32(data) != crc:
            return None
        return np.frombuffer(data, dtype=np.float16).astype(np.float32)
    if blob[:1] != _LOG_TAG or len(blob) < _LOG.size:
        return None
    _, bits, lo, hi, crc = _LOG.unpack_from(blob)
    data = blob[_LOG.size:]
    if not 2 <= bits <= 16 or len(data) != (n_tokens * bits + 7) // 8 or \
            zlib.crc32(blob[1:_LOG.size - 4] + data) != crc or \
            not (math.isfinite(lo) and math.isfinite(hi)) or lo < 0 or hi < lo or \
            (lo == 0) != (hi == 0):
        return None
    codes = _unpack(data, n_tokens, bits)
    if hi == 0:
        return None if codes.any() else np.zeros(n_tokens, dtype=np.float32)
    step = 0.0 if hi == lo else math.log(hi / lo) / ((1 << bits) - 2)
    values = lo * np.exp((codes.astype(np.float64) - 1) * step)
    return np.where(codes == 0, 0.0, values).astype(np.float32)


def old_importance(blob) -> np.ndarray | None:
    """Importance as schema 3 and before stored it: float16 per token, no checksum."""
    if not isinstance(blob, bytes) or len(blob) % 2:
        return None
    return np.frombuffer(blob, dtype=np.float16).astype(np.float32)


def old_mapping(blob) -> np.ndarray | None:
    """A mapping as schema 3 and before stored it (uint16 below 65,536 tokens, int32 from
    there; the blob's length tells which), or None when it is not a permutation."""
    if not isinstance(blob, bytes):
        return None
    if len(blob) % 2 == 0 and len(blob) // 2 < 65536:
        m = np.frombuffer(blob, dtype=np.uint16).astype(np.int64)
    elif len(blob) % 4 == 0 and len(blob) // 4 >= 65536:
        m = np.frombuffer(blob, dtype=np.int32).astype(np.int64)
    else:
        return None
    n = len(m)
    if n and (m.min() < 0 or m.max() >= n or not (np.bincount(m, minlength=n) == 1).all()):
        return None
    return m
