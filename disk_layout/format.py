"""The bytes of one (radix node, layer) file: probe keys, then K chunks, then V chunks.

    [probe section][K chunk 0][K chunk 1]...[V chunk 0][V chunk 1]...

- A chunk holds C consecutive (physical) tokens of one layer, all KV heads, head-major
  ((heads, C, head_dim), so one head's keys are contiguous), in the store's KV format
  (KV_FORMATS: fp32, fp16, bf16 or int4; one format per store, in its metadata). An int4
  chunk is its (heads, C, head_dim) values in groups of 32 consecutive ones (along head_dim:
  with head_dim 64 a token's row of one head is two groups), two 4-bit codes a byte, then
  each group's fp16 scale and minimum: 5/8 of a byte a value, 5/16 of fp16's bytes.
  Aligned layout: every chunk starts on a 4 KiB boundary and is padded to a multiple of
  4 KiB, so any run of adjacent chunks is one O_DIRECT read. Packed layout (chosen when a chunk is not a whole
  number of pages, e.g. 16 tokens x 3 heads x 64 dims = 6 KiB): chunks follow each other
  without padding and a read covers the pages a run of chunks touches, so padding is paid
  once per run instead of once per chunk (8 KiB read per 6 KiB chunk otherwise). The K and
  V sections each start on a page boundary.
- The probe section holds the probe heads' keys for all tokens of the node, in the same
  physical order, readable in one sequential read: fp16 as in the paper, or int4 with one
  fp16 scale and minimum per group of 32 values (scoring only needs approximate keys).
- K and V are separate chunks, so a policy can read keys without values.
- Each chunk and the probe section carry a CRC32 (kept in the metadata, verified on read).
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import torch

ALIGN = 4096
INT4_GROUP = 32

# How stored K and V values are kept, by the name a store records (`--kv-format`), and
# the dtype of a stored chunk's tensor (int4: its packed bytes). A store made before stores
# recorded their format holds fp16.
KV_FORMATS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16,
                                      "bf16": torch.bfloat16, "int4": torch.uint8}
LEGACY_KV_FORMAT = "fp16"
INT4_KV = "int4"


def kv_dtype_name(fmt: str) -> str:
    """The dtype name of a KV format's values ("float32", "float16", "bfloat16"; "int4")."""
    if fmt == INT4_KV:
        return INT4_KV
    return str(KV_FORMATS[fmt]).removeprefix("torch.")


def kv_bytes(fmt: str, n_values: int) -> int:
    """Stored bytes of `n_values` K or V values in `fmt` (int4: whole groups of 32)."""
    if fmt == INT4_KV:
        return n_values * 5 // 8        # codes, and an fp16 scale and minimum per 32 values
    return n_values * KV_FORMATS[fmt].itemsize


def kv_format_fits(fmt: str, head_dim: int) -> bool:
    """Can `fmt` keep K and V of heads of `head_dim`? (int4: a chunk, a multiple of 8
    tokens, is then whole groups.)"""
    return fmt != INT4_KV or head_dim % 4 == 0


def kv_format_of(dtype) -> str:
    """The KV format that holds `dtype`'s values as they are (a torch or numpy dtype, or
    its name)."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    formats = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
    if name not in formats:
        raise ValueError(f"no KV format holds {name} values")
    return formats[name]


def kv_format_lossless(fmt: str, compute_dtype) -> bool:
    """Does `fmt` give back exactly the values computed in `compute_dtype`? (fp32 holds
    fp16 and bf16 values; fp16 and bf16 hold only their own; int4 none.)"""
    return fmt == "fp32" or fmt == kv_format_of(compute_dtype)


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def crc32(buf) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class LayerFileLayout:
    """Offsets inside one (node, layer) file."""

    n_tokens: int
    chunk_size: int
    n_kv_heads: int
    head_dim: int
    n_probe: int
    probe_format: str  # "fp16" | "int4"
    packed: bool = False
    kv_format: str = LEGACY_KV_FORMAT   # a KV_FORMATS name

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of a chunk's values as they lie in the file."""
        return KV_FORMATS[self.kv_format]

    @property
    def n_chunks(self) -> int:
        return self.n_tokens // self.chunk_size

    @property
    def chunk_values(self) -> tuple[int, int, int]:
        """The shape of one chunk's K (or V) values: (heads, C, head_dim)."""
        return (self.n_kv_heads, self.chunk_size, self.head_dim)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The shape of a chunk as read (kv_dtype): its values, or int4's packed bytes."""
        return (self.chunk_bytes,) if self.kv_format == INT4_KV else self.chunk_values

    @property
    def chunk_bytes(self) -> int:
        """Payload of one chunk (without padding)."""
        return kv_bytes(self.kv_format, self.n_kv_heads * self.chunk_size * self.head_dim)

    @property
    def chunk_stride(self) -> int:
        return self.chunk_bytes if self.packed else align_up(self.chunk_bytes)

    @property
    def section_bytes(self) -> int:
        """Bytes of the K (or V) section, padded to a page."""
        return align_up(self.n_chunks * self.chunk_stride)

    @property
    def probe_bytes(self) -> int:
        values = self.n_probe * self.n_tokens * self.head_dim
        if self.probe_format == "fp16":
            return values * 2
        return values // 2 + (values // INT4_GROUP) * 4  # packed nibbles + fp16 scale, min

    @property
    def probe_stride(self) -> int:
        return align_up(self.probe_bytes)

    def chunk_offset(self, kind: str, index: int) -> int:
        base = self.probe_stride + (0 if kind == "k" else self.section_bytes)
        return base + index * self.chunk_stride

    @property
    def file_bytes(self) -> int:
        return self.probe_stride + 2 * self.section_bytes


def packed_by_default(chunk_bytes: int) -> bool:
    """Pack chunks when padding each to whole pages would waste space and bandwidth."""
    return chunk_bytes % ALIGN != 0


# ---------------------------------------------------------------------------------------
# Probe keys

def encode_probe(keys: torch.Tensor, fmt: str) -> bytes:
    """keys: (n_probe, n_tokens, head_dim) -> bytes of the probe section (unpadded)."""
    arr = keys.detach().to(torch.float16).cpu().contiguous().numpy()
    if fmt == "fp16":
        return arr.tobytes()
    if fmt != "int4":
        raise ValueError(f"unknown probe format {fmt}")
    groups = arr.astype(np.float32).reshape(-1, INT4_GROUP)
    lo, hi = groups.min(axis=1, keepdims=True), groups.max(axis=1, keepdims=True)
    scale = ((hi - lo) / 15.0).astype(np.float16)
    lo16 = lo.astype(np.float16)
    # Quantize against the fp16-rounded scale and minimum: those are what decode sees. A
    # group whose range rounds to a zero scale (a constant group) is all zero codes: decode
    # gives back its minimum, which is every value exactly (or within fp16's smallest step).
    step = scale.astype(np.float32)
    offset = groups - lo16.astype(np.float32)
    q = np.zeros_like(groups)
    np.divide(offset, step, out=q, where=step > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8).reshape(-1, 2)
    packed = (q[:, 0] | (q[:, 1] << 4)).astype(np.uint8)
    return packed.tobytes() + np.concatenate([scale, lo16], axis=1).tobytes()


def decode_probe(buf, fmt: str, shape: tuple[int, int, int]) -> torch.Tensor:
    """Bytes of a probe section (bytes-like or a uint8 tensor) -> float32 keys of `shape`
    (n_probe, n_tokens, head_dim)."""
    n_values = int(np.prod(shape))
    raw = buf if isinstance(buf, torch.Tensor) else torch.frombuffer(bytearray(buf),
                                                                     dtype=torch.uint8)
    if fmt == "fp16":
        return raw[:2 * n_values].view(torch.float16).float().view(shape)
    packed = raw[:n_values // 2]
    n_params = (n_values // INT4_GROUP) * 2
    params = raw[n_values // 2:n_values // 2 + 2 * n_params].view(torch.float16).float()
    params = params.view(-1, 2)
    # torch rather than numpy: its fp16 conversion is vectorised and the scale and shift
    # run on the compute threads (this runs once per layer of every request).
    vals = torch.empty(n_values // 2, 2)
    vals[:, 0].copy_(packed & 0x0F)
    vals[:, 1].copy_(packed >> 4)
    groups = vals.view(-1, INT4_GROUP)
    groups.mul_(params[:, :1]).add_(params[:, 1:])
    return vals.view(shape)


def probe_supported(n_probe: int, n_tokens: int, head_dim: int) -> bool:
    return (n_probe * n_tokens * head_dim) % INT4_GROUP == 0


# ---------------------------------------------------------------------------------------
# Chunks

def section_image(kv: torch.Tensor, layout: LayerFileLayout) -> tuple[np.ndarray, list[int]]:
    """kv: (heads, n_tokens, head_dim) in physical order -> the bytes of its K (or V)
    section in the layout's KV format, every chunk at its offset (padding zeroed), and each
    chunk's CRC-32. Built in one copy, so a file is written with one write per section."""
    n, c, size = layout.n_chunks, layout.chunk_size, layout.chunk_bytes
    heads, _, d = kv.shape
    chunks = kv[:, :n * c].reshape(heads, n, c, d).transpose(0, 1)
    if layout.kv_format == INT4_KV:
        payload = encode_int4_chunks(chunks).numpy()
    else:
        payload = chunks.to(layout.kv_dtype).contiguous().view(torch.uint8).reshape(n, size) \
            .numpy()
    image = np.zeros(layout.section_bytes, dtype=np.uint8)
    image[:n * layout.chunk_stride].reshape(n, layout.chunk_stride)[:, :size] = payload
    return image, [crc32(payload[i]) for i in range(n)]


def encode_int4_chunks(chunks: torch.Tensor) -> torch.Tensor:
    """(n, heads, C, head_dim) values -> (n, chunk bytes) uint8: each chunk's 4-bit codes,
    then its groups' fp16 (scale, minimum). Groups are 32 values along head_dim."""
    n = chunks.shape[0]
    groups = chunks.detach().cpu().float().reshape(n, -1, INT4_GROUP)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale, lo16 = ((hi - lo) / 15).half(), lo.half()
    # Codes against the fp16-rounded scale and minimum, which decoding sees; a constant
    # group (zero scale) is all zero codes and decodes to its minimum.
    step = scale.float()
    q = torch.where(step > 0, (groups - lo16.float()) / step.clamp_min(1e-30),
                    torch.zeros(()))
    q = q.round_().clamp_(0, 15).to(torch.uint8).reshape(n, -1, 2)
    codes = q[..., 0] | (q[..., 1] << 4)
    params = torch.cat([scale, lo16], -1).reshape(n, -1).view(torch.uint8)
    return torch.cat([codes, params], 1)


def decode_int4_chunks(packed: torch.Tensor, values: tuple[int, int, int],
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n, chunk bytes) uint8 (on any device) -> (n, *values) in `dtype`: the inverse of
    encode_int4_chunks up to half a code step per value."""
    n, n_values = packed.shape[0], int(np.prod(values))
    codes = packed[:, :n_values // 2]
    params = packed[:, n_values // 2:].contiguous().view(torch.float16) \
        .reshape(n, -1, 2).float()
    out = torch.empty(n, n_values // 2, 2, device=packed.device)
    out[..., 0].copy_(codes & 0x0F)
    out[..., 1].copy_(codes >> 4)
    groups = out.view(n, -1, INT4_GROUP)
    groups.mul_(params[..., :1]).add_(params[..., 1:])
    return out.view(n, *values).to(dtype)


def decode_chunks(chunks: list[torch.Tensor], layout: LayerFileLayout,
                  dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Chunks as read (or as a tier holds them) -> (heads, C, head_dim) values: int4 chunks
    decoded to `dtype` (those on one device in one call), others as they are."""
    if layout.kv_format != INT4_KV or not chunks:
        return chunks
    out: list = [None] * len(chunks)
    by_device: dict = {}
    for i, c in enumerate(chunks):
        by_device.setdefault(c.device, []).append(i)
    for idx in by_device.values():
        values = decode_int4_chunks(torch.stack([chunks[i] for i in idx]),
                                    layout.chunk_values, dtype)
        for i, v in zip(idx, values.unbind(0)):
            out[i] = v
    return out
