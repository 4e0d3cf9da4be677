"""What the shared pool stores and how a value proves what it claims to be.

Keys are named by content: chunk i's key is a chained hash over the prompt's token ids up to
the end of chunk i (behind the hash of the first chunk of its slot group: see chunk_hashes),
seeded with everything that fixes the KV bytes (model and its weights' fingerprint, shape,
dtype, chunk size, LAYOUT_VERSION), the tenant (tenants never share an entry), that the KV was
computed exactly (approximate KV lives under other keys, which an exact reader never asks for)
and whether values are keyed with a secret.

One value holds one chunk of one layer, K and V stacked as (2, kv_heads, C, head_dim), behind
a header (magic, version, dtype, flags, shape, tag). The tag is computed over the namespace
seed, the chunk hash, the layer and the header as well as the payload: a value copied under
another key (two layers swapped) or with its payload replaced (all zeros under a correct
header) fails it. Without a secret the tag is a CRC-32 (catches damage and misplacement);
with one it is an HMAC-SHA256, which a writer without the secret cannot forge.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import struct
import zlib
from typing import Any

import numpy as np
import torch

from disk_layout.format import kv_bytes

from ..errors import UserError
from .base import nbytes

try:  # libdeflate's CRC-32 through ctypes (no copy, GIL released), when the library loads
    from disk_layout.io import _crc32_at
except ImportError:  # pragma: no cover - disk_layout ships with this package
    _crc32_at = None

# Bump when the value layout or the key derivation changes: old keys then simply miss.
LAYOUT_VERSION = 3
CHAIN_SIZE = 16                 # one link of the chain of chunk digests
DIGEST_SIZE = 2 * CHAIN_SIZE    # a chunk's hash: its own link, then its slot group's first
# Tokens of a prompt whose chunks' keys share one cluster slot: a layer of a long prefix is
# then read with one MGET per SLOT_GROUP_TOKENS (not one per chunk), and prefixes still
# spread over a cluster's nodes group by group.
SLOT_GROUP_TOKENS = 1024
KEY_PREFIX = b"ifkv:"

DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "float16": (1, torch.float16),
    "bfloat16": (2, torch.bfloat16),
    "float32": (3, torch.float32),
    "int4": (4, torch.uint8),           # a store's int4 chunks (disk_layout.format), packed
}
# magic, layout version, dtype code, flags, 4-D shape | tag (CRC-32 padded, or HMAC-SHA256)
_FIXED = struct.Struct("<4sBBH4I")
HEADER_SIZE = _FIXED.size + 32
_MAGIC = b"IFKV"
_KEYED = 1


@dataclasses.dataclass(frozen=True)
class RemoteNamespace:
    """Everything that fixes the bytes of a chunk's KV; two processes share keys iff equal."""
    model: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # "float16" | "bfloat16" | "float32" | "int4"
    chunk_size: int
    fingerprint: str = ""   # the model's weights (two checkpoints of one name differ)
    tenant: str = ""        # who may read it: tenants never share an entry
    exact: bool = True      # KV computed over the whole prefix (no policy dropped any of it)
    keyed: bool = False     # values carry an HMAC under a shared secret

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise UserError("remote namespace: model must be a non-empty name")
        for field in ("n_layers", "n_kv_heads", "head_dim", "chunk_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"remote namespace: {field} must be a positive integer, "
                                f"got {value!r}")
        if self.dtype not in DTYPES:
            raise UserError(f"remote namespace: dtype {self.dtype!r} is not supported; "
                            f"expected one of {sorted(DTYPES)}")
        for field in ("fingerprint", "tenant"):
            if not isinstance(getattr(self, field), str):
                raise UserError(f"remote namespace: {field} must be a string")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][1]

    @property
    def value_shape(self) -> tuple[int, int, int, int]:
        """Shape of one stored value: K and V of one chunk of one layer (int4: each one's
        packed bytes)."""
        if self.dtype == "int4":
            return (2, 1, 1, kv_bytes("int4", self.n_kv_heads * self.chunk_size * self.head_dim))
        return (2, self.n_kv_heads, self.chunk_size, self.head_dim)

    @property
    def kv_values(self) -> tuple[int, int, int]:
        """(kv_heads, C, head_dim): the values of one chunk's K or V."""
        return (self.n_kv_heads, self.chunk_size, self.head_dim)

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype publish() takes K and V in (int4: float32, encoded per chunk)."""
        return torch.float32 if self.dtype == "int4" else self.torch_dtype

    def seed(self) -> bytes:
        """h_0 of the chain. JSON of a list keeps the encoding unambiguous for any name."""
        return _seed(self)


@functools.lru_cache(maxsize=256)
def _seed(namespace: RemoteNamespace) -> bytes:
    n = namespace
    fields = [LAYOUT_VERSION, n.model, n.n_layers, n.n_kv_heads, n.head_dim, n.dtype,
              n.chunk_size, n.fingerprint, n.tenant, "exact" if n.exact else "approximate",
              "keyed" if n.keyed else "crc"]
    encoded = json.dumps(fields, separators=(",", ":")).encode()
    return hashlib.blake2b(encoded, digest_size=CHAIN_SIZE).digest()


@functools.lru_cache(maxsize=256)
def _layout(namespace: RemoteNamespace, keyed: bool) -> tuple[bytes, int]:
    """The fixed header a good value of this namespace starts with, and its whole length."""
    fixed = _FIXED.pack(_MAGIC, LAYOUT_VERSION, DTYPES[namespace.dtype][0],
                        _KEYED if keyed else 0, *namespace.value_shape)
    n = int(np.prod(namespace.value_shape)) * torch.empty((), dtype=namespace.torch_dtype
                                                          ).element_size()
    return fixed, HEADER_SIZE + n


def chunk_hashes(namespace: RemoteNamespace, tokens: Any) -> list[bytes]:
    """One hash per whole chunk of `tokens`: h_{i+1} = blake2b(h_i || int32 tokens of chunk i),
    followed by the h of the first chunk of its slot group (chunks g*G .. g*G + G - 1, with
    G = SLOT_GROUP_TOKENS // chunk_size), which names the cluster slot of its keys.

    The hash of chunk i thus names its KV given every token before it. A partial tail chunk
    has no hash (its KV is never shared).
    """
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"tokens must be a 1-D sequence of integer ids, got shape "
                         f"{ids.shape} of {ids.dtype}")
    info = np.iinfo(np.int32)
    if ids.size and (ids.min() < info.min or ids.max() > info.max):
        raise ValueError("token ids must fit in int32")
    # Little-endian explicitly: keys must agree across machines.
    raw = ids.astype("<i4", copy=False).tobytes()
    c = namespace.chunk_size
    step = 4 * c
    group = max(1, SLOT_GROUP_TOKENS // c)
    out: list[bytes] = []
    h = first = namespace.seed()
    for i in range(ids.size // c):
        m = hashlib.blake2b(h, digest_size=CHAIN_SIZE)
        m.update(raw[i * step:(i + 1) * step])
        h = m.digest()
        if i % group == 0:
            first = h
        out.append(h + first)
    return out


def _tag(chunk_hash: bytes) -> bytes:
    # The braces are a cluster hash tag: every key of a slot group's chunks maps to one
    # slot, so a chunk's layers and marker are written and checked on one node in one round
    # trip, and a layer's chunks of one group are read with one MGET.
    return KEY_PREFIX + b"{" + chunk_hash[CHAIN_SIZE:].hex().encode() + b"}" + \
        chunk_hash[:CHAIN_SIZE].hex().encode()


def layer_key(chunk_hash: bytes, layer: int) -> bytes:
    """Redis key of one layer of one chunk."""
    return _tag(chunk_hash) + b":" + str(layer).encode()


def marker_key(chunk_hash: bytes) -> bytes:
    """Redis key set once every layer of the chunk has been written."""
    return _tag(chunk_hash) + b":done"


def _binding(namespace: RemoteNamespace, chunk_hash: bytes, layer: int, fixed: bytes) -> bytes:
    return namespace.seed() + chunk_hash + struct.pack("<I", layer) + fixed


def _crc(prefix: bytes, payload) -> int:
    start = zlib.crc32(prefix)
    if _crc32_at is not None and isinstance(payload, torch.Tensor):
        return int(_crc32_at(start, payload.data_ptr(), nbytes(payload))) & 0xFFFFFFFF
    view = payload.reshape(-1).view(torch.uint8).numpy() if isinstance(payload, torch.Tensor) \
        else payload
    return zlib.crc32(view, start) & 0xFFFFFFFF


def _tag_of(secret: bytes | None, prefix: bytes, payload: torch.Tensor) -> bytes:
    if secret is None:
        return struct.pack("<I", _crc(prefix, payload)).ljust(32, b"\0")
    mac = hmac.new(secret, prefix, hashlib.sha256)
    mac.update(payload.reshape(-1).view(torch.uint8).numpy())
    return mac.digest()


def encode_value(tensor: torch.Tensor, namespace: RemoteNamespace, chunk_hash: bytes,
                 layer: int, secret: bytes | None = None) -> bytes:
    """Header + payload bytes of one (2, kv_heads, C, head_dim) tensor, bound to its key."""
    if tuple(tensor.shape) != namespace.value_shape or tensor.dtype != namespace.torch_dtype:
        raise ValueError(f"remote tier stores {namespace.dtype} tensors of shape "
                         f"{namespace.value_shape}; got {tensor.dtype} {tuple(tensor.shape)}")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    fixed = _FIXED.pack(_MAGIC, LAYOUT_VERSION, DTYPES[namespace.dtype][0],
                        _KEYED if secret is not None else 0, *namespace.value_shape)
    tag = _tag_of(secret, _binding(namespace, chunk_hash, layer, fixed), t)
    return b"".join((fixed, tag, t.reshape(-1).view(torch.uint8).numpy()))


def decode_value(value: bytes, namespace: RemoteNamespace, chunk_hash: bytes, layer: int,
                 secret: bytes | None = None) -> torch.Tensor | str:
    """The tensor in `value` if it proves to be this chunk's layer; else the reason (a str)."""
    fixed, length = _layout(namespace, secret is not None)
    if len(value) == length and value.startswith(fixed):
        # The common case, checked with as little Python as a chunk allows: a pool read
        # decodes thousands of values per request.
        buf = bytearray(memoryview(value)[HEADER_SIZE:])
        tensor = torch.frombuffer(buf, dtype=namespace.torch_dtype).view(namespace.value_shape)
        binding = _seed(namespace) + chunk_hash + struct.pack("<I", layer) + fixed
        if secret is None and _crc32_at is not None:
            start = zlib.crc32(binding)
            ok = int(_crc32_at(start, tensor.data_ptr(), len(buf))) & 0xFFFFFFFF == \
                int.from_bytes(value[_FIXED.size:_FIXED.size + 4], "little") and \
                value[_FIXED.size + 4:HEADER_SIZE] == bytes(28)
        else:
            ok = hmac.compare_digest(_tag_of(secret, binding, tensor),
                                     value[_FIXED.size:HEADER_SIZE])
        if ok:
            return tensor
        return "HMAC mismatch (forged, or not this chunk's layer)" if secret is not None \
            else "checksum mismatch (damaged, or not this chunk's layer)"
    return _why_not(value, namespace, secret)


def _why_not(value: bytes, namespace: RemoteNamespace, secret: bytes | None) -> str:
    """Why a value that is not laid out as this namespace's values are is unusable."""
    if len(value) < HEADER_SIZE:
        return "truncated header"
    magic, version, code, flags, *shape = _FIXED.unpack_from(value)
    if magic != _MAGIC:
        return "bad magic"
    if version != LAYOUT_VERSION:
        return f"layout version {version}"
    if code != DTYPES[namespace.dtype][0]:
        return f"dtype code {code}"
    if tuple(shape) != namespace.value_shape:
        return f"shape {tuple(shape)}"
    if bool(flags & _KEYED) != (secret is not None):
        return "not signed with the shared secret" if secret is not None else \
            "signed, and no secret is configured here"
    expected = _layout(namespace, secret is not None)[1] - HEADER_SIZE
    return f"payload of {len(value) - HEADER_SIZE} bytes, expected {expected}"
