"""What a model needs in memory, independent of where it goes: the bytes of each FlexGen
layer's weight tensors, of its KV cache and of a forward pass's working memory.

    fp = footprint(spec, batch=1)
    weights, staged = fp.weights_on(w_gpu=50, w_cpu=50)   # bytes per device
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

# Working memory is sized for a forward pass over this many tokens (or the model's
# positions, if fewer): long prompts need more, and get it from the margins.
ACT_TOKENS = 2048
DEVICES = ("gpu", "cpu", "disk")


def weight_shapes(spec) -> list[list[tuple[int, ...]]]:
    """Per FlexGen layer, in build order, the shapes its init_weight asks for (each layer is
    placed on its own: FlexGen splits every layer by the same percentages)."""
    c = spec.config
    if spec.family == "opt":
        h, v, s = c.input_dim, c.vocab_size, c.max_seq_len
        attn = [(h, h), (h,)] * 4 + [(h,), (h,)]
        mlp = [(4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,)]  # FlexGen's MLP is 4h wide
        first = [(v, h), (s + 2, h)]                                # token and position tables
        last = [(h,), (h,), (v, h)]                                 # a second copy of the tokens
    else:
        h, q, kv, ffn = c.hidden_size, c.n_head * c.head_dim, c.n_kv_head * c.head_dim, \
            c.intermediate_size
        attn = [(q, h), (kv, h), (kv, h), (h, q), (h,)]
        mlp = [(ffn, h), (ffn, h), (h, ffn), (h,)]
        first = [(c.vocab_size, h)]
        last = [(h,), (c.vocab_size, h)]
    return [first] + [attn, mlp] * c.num_hidden_layers + [last]


def _tensor_bytes(shape, itemsize: int, compress: bool) -> int:
    n = int(np.prod(shape))
    if compress and len(shape) >= 2:
        # FlexGen's 4-bit groups of 64: packed nibbles plus an fp16 scale and minimum each.
        return n // 2 + (n + 63) // 64 * 4
    return n * itemsize


def _split_layer(sizes: list[int], w_gpu: float, w_cpu: float) -> list[str]:
    """The device of each tensor of one layer, by FlexGen's rule: where its middle byte falls
    in the layer's byte range, the first part going to disk, then CPU, then GPU."""
    cuts = np.cumsum([100 - w_gpu - w_cpu, w_cpu, w_gpu])
    cum = np.cumsum(sizes)
    homes = []
    for size, c in zip(sizes, cum):
        mid = (c - size / 2) / cum[-1] * 100
        homes.append(next((d for d, cut in zip(("disk", "cpu", "gpu"), cuts) if mid < cut),
                          "gpu"))
    return homes


@dataclasses.dataclass(frozen=True)
class Footprint:
    """A model's memory, independent of where it goes."""

    layers: tuple[tuple[int, ...], ...]  # per FlexGen layer, bytes of each weight tensor
    counts: tuple[int, ...]              # how many layers have that byte list
    cache_bytes: int                     # FlexGen's KV cache of a full-length generation
    act_bytes: int                       # working memory of one forward pass
    load_bytes: int                      # transient while the largest tensor is made or loaded
    dtype: str

    @property
    def weight_bytes(self) -> int:
        return sum(sum(layer) * n for layer, n in zip(self.layers, self.counts))

    def weights_on(self, w_gpu: float, w_cpu: float) -> tuple[dict[str, int], int]:
        """(bytes of weights per device, bytes of the largest layer's share off the GPU: what
        a copy into the compute device stages per layer)."""
        out = dict.fromkeys(DEVICES, 0)
        staged = 0
        for layer, n in zip(self.layers, self.counts):
            off = 0
            for size, home in zip(layer, _split_layer(list(layer), w_gpu, w_cpu)):
                out[home] += size * n
                off += size if home != "gpu" else 0
            staged = max(staged, off)
        return out, staged

    def cache_on(self, cache_gpu: float, cache_cpu: float, heads: int, batch: int
                 ) -> dict[str, int]:
        """Bytes of KV cache per device. A split cache is cut along (batch x heads) in whole
        multiples of the head count, as FlexGen's mixed device (and ours for Llama) does."""
        out = dict.fromkeys(DEVICES, 0)
        if cache_gpu == 100:
            out["gpu"] = self.cache_bytes
        elif cache_cpu == 100:
            out["cpu"] = self.cache_bytes
        elif cache_gpu + cache_cpu == 0:
            out["disk"] = self.cache_bytes
        else:
            n = batch * heads
            gpu = int(n * cache_gpu / 100) // heads * heads
            cpu = n - gpu if cache_gpu + cache_cpu == 100 else \
                int(n * cache_cpu / 100) // heads * heads
            for dev, rows in (("gpu", gpu), ("cpu", cpu), ("disk", n - gpu - cpu)):
                out[dev] = self.cache_bytes * rows // n
        return out


def cache_heads(spec) -> int:
    c = spec.config
    return c.n_head if spec.family == "opt" else c.n_kv_head


def footprint(spec, batch: int = 1, compress_weight: bool = False) -> Footprint:
    c = spec.config
    itemsize = np.dtype(c.dtype).itemsize
    shapes = weight_shapes(spec)
    counts = Counter(tuple(_tensor_bytes(s, itemsize, compress_weight) for s in layer)
                     for layer in shapes)
    layers = tuple(counts)
    if spec.family == "opt":
        hidden, heads, ffn = c.input_dim, c.n_head, 4 * c.input_dim
        head_dim = hidden // heads
    else:
        hidden, heads, head_dim, ffn = c.hidden_size, c.n_head, c.head_dim, c.intermediate_size
    # FlexGen sizes it prompt + new - 1 rows; a generation fills at most every position.
    rows = c.max_seq_len - 1
    cache = 2 * c.num_hidden_layers * rows * batch * cache_heads(spec) * head_dim * itemsize
    s = min(c.max_seq_len, ACT_TOKENS)
    act = (batch * s * (8 * hidden + 2 * ffn) * itemsize      # hidden states, q/k/v, MLP
           + 3 * batch * heads * s * s * 4                     # attention scores (fp32)
           + 2 * batch * c.vocab_size * 4)                     # logits
    largest = max(int(np.prod(sh)) for layer in shapes for sh in layer)
    return Footprint(layers, tuple(counts.values()), cache, act, largest * (4 + itemsize),
                     np.dtype(c.dtype).name)
