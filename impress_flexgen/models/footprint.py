"""What a model needs in memory, independent of where it goes: the bytes of each FlexGen
layer's weight tensors, of its KV cache and of a forward pass's working memory.

    fp = footprint(spec, batch=1)
    weights, staged = fp.weights_on(w_gpu=50, w_cpu=50)   # bytes per device
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from . import quant

# Working memory is sized for a forward pass over this many tokens (or the model's
# positions, if fewer): long prompts need more, and get it from the margins.
ACT_TOKENS = 2048
DEVICES = ("gpu", "cpu", "disk")


def weight_names(spec) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Per FlexGen layer, in build order, the (file name, shape) of each tensor its
    init_weight asks for (each layer is placed on its own: FlexGen splits every layer by
    the same percentages). A name may come twice (OPT reads its token table for the input
    and the output)."""
    c = spec.config
    layers = []
    if spec.family == "opt":
        h, v, s = c.input_dim, c.vocab_size, c.max_seq_len
        layers.append([("decoder.embed_tokens.weight", (v, h)),
                       ("decoder.embed_positions.weight", (s + 2, h))])
        for i in range(c.num_hidden_layers):
            a = f"decoder.layers.{i}.self_attn"
            attn = [(f"{a}.{p}_proj.{kind}", (h, h) if kind == "weight" else (h,))
                    for p in ("q", "k", "v", "out") for kind in ("weight", "bias")]
            layers.append(attn + [(f"{a}_layer_norm.weight", (h,)),
                                  (f"{a}_layer_norm.bias", (h,))])
            m = f"decoder.layers.{i}."     # FlexGen's MLP is 4h wide
            layers.append([(m + "fc1.weight", (4 * h, h)), (m + "fc1.bias", (4 * h,)),
                           (m + "fc2.weight", (h, 4 * h)), (m + "fc2.bias", (h,)),
                           (m + "final_layer_norm.weight", (h,)),
                           (m + "final_layer_norm.bias", (h,))])
        layers.append([("decoder.layer_norm.weight", (h,)), ("decoder.layer_norm.bias", (h,)),
                       ("decoder.embed_tokens.weight", (v, h))])
        return layers
    h, q, kv, ffn = c.hidden_size, c.n_head * c.head_dim, c.n_kv_head * c.head_dim, \
        c.intermediate_size
    layers.append([("embed_tokens.weight", (c.vocab_size, h))])
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        layers.append([(p + "self_attn.q_proj.weight", (q, h)),
                       (p + "self_attn.k_proj.weight", (kv, h)),
                       (p + "self_attn.v_proj.weight", (kv, h)),
                       (p + "self_attn.o_proj.weight", (h, q)),
                       (p + "input_layernorm.weight", (h,))])
        layers.append([(p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
                       (p + "mlp.down_proj.weight", (h, ffn)),
                       (p + "post_attention_layernorm.weight", (h,))])
    head = "embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    layers.append([("norm.weight", (h,)), (head, (c.vocab_size, h))])
    return layers


def weight_shapes(spec) -> list[list[tuple[int, ...]]]:
    """Per FlexGen layer, the shapes of weight_names."""
    return [[shape for _, shape in layer] for layer in weight_names(spec)]


def _tensor_bytes(shape, itemsize: int, groups) -> int:
    """Bytes of one tensor: in the dtype, or (matrices, with `groups`) FlexGen's 4-bit
    groups: packed pairs plus an fp16 scale and minimum per group."""
    if groups is not None and len(shape) >= 2:
        return quant.packed_bytes(shape, groups.size, groups.dim)
    return int(np.prod(shape)) * itemsize


def layer_homes(sizes: list[int], w_gpu: float, w_cpu: float) -> list[str]:
    """The device of each tensor of one layer, by FlexGen's rule: where its middle element
    falls in the layer's elements (counted uncompressed, whatever the format), the first
    part going to disk, then CPU, then GPU."""
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
    elements: tuple[tuple[int, ...], ...]  # per such layer, elements of each tensor
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
        for layer, n, elements in zip(self.layers, self.counts, self.elements):
            off = 0
            for size, home in zip(layer, layer_homes(list(elements), w_gpu, w_cpu)):
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


def footprint(spec, batch: int = 1, groups=None, cache_groups=None,
              tokens: int | None = None) -> Footprint:
    """What `spec` needs: weights in its dtype (4-bit matrices with `groups`), FlexGen's KV
    cache of a full-length generation (4-bit with `cache_groups`), working memory; with
    `tokens` (throughput work's prompt + new tokens, known before the start), the cache and
    working memory of generations that long."""
    c = spec.config
    itemsize = np.dtype(c.dtype).itemsize
    shapes = weight_shapes(spec)
    counts = Counter((tuple(_tensor_bytes(s, itemsize, groups) for s in layer),
                      tuple(int(np.prod(s)) for s in layer)) for layer in shapes)
    if spec.family == "opt":
        hidden, heads, ffn = c.input_dim, c.n_head, 4 * c.input_dim
        head_dim = hidden // heads
    else:
        hidden, heads, head_dim, ffn = c.hidden_size, c.n_head, c.head_dim, c.intermediate_size
    # FlexGen sizes it prompt + new - 1 rows; a generation fills at most every position.
    positions = c.max_seq_len if tokens is None else min(c.max_seq_len, max(tokens, 1))
    rows = max(positions - 1, 1)
    one = (rows, batch * cache_heads(spec), head_dim)
    cache = 2 * c.num_hidden_layers * _tensor_bytes(one, itemsize, cache_groups)
    s = min(positions, ACT_TOKENS)
    act = (batch * s * (8 * hidden + 2 * ffn) * itemsize      # hidden states, q/k/v, MLP
           + 3 * batch * heads * s * s * 4                     # attention scores (fp32)
           + 2 * batch * c.vocab_size * 4)                     # logits
    largest = max(int(np.prod(sh)) for layer in shapes for sh in layer)
    if groups is not None:
        # Dequantised per layer on the compute device: the largest layer's matrices at
        # once (FlexGen's MLP holds both), and while one is made, its unpacked bytes.
        layer_elements = max(sum(int(np.prod(sh)) for sh in layer if len(sh) >= 2)
                             for layer in shapes)
        act += layer_elements * itemsize + largest * 4
    return Footprint(tuple(k for k, _ in counts), tuple(counts.values()),
                     tuple(e for _, e in counts), cache, act, largest * (4 + itemsize),
                     np.dtype(c.dtype).name)