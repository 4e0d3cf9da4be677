"""The per-family math of a transformer layer the engine computes itself (OPT, Llama).

    math = FamilyMath(runtime.spec)
    q, k, v = math.qkv(weights, x, positions, math.rope(positions, x.dtype))
    shape = model_shape(runtime.spec)           # what the store's KV of this model is, and
                                                # whether it is the computed KV exactly
    heads, kv_heads = probe_setup(runtime.spec, policy.config)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from disk_layout.format import kv_format_lossless, kv_format_of
from policies import ServingConfig
from policies.base import resolve_probe_heads

from ..errors import UserError
from ..models import dtypes
from ..store import CHUNK_SIZE, ModelShape, model_fingerprint
from ..models.base import linear
from ..models.llama import llama_out, llama_qkv, rms_norm, rope_cos_sin
from ..models.opt import opt_out, opt_qkv


class FamilyMath:
    """The per-family pieces of a transformer layer the engine computes itself."""

    def __init__(self, spec):
        c = spec.config
        self.config = c
        self.family = spec.family
        if spec.family == "opt":
            self.n_head, self.n_kv_head = c.n_head, c.n_head
            self.head_dim = c.input_dim // c.n_head
        else:
            self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.n_layers = c.num_hidden_layers
        self._rope: dict = {}

    def rope(self, positions: torch.Tensor, dtype) -> tuple | None:
        """The rotary tables of `positions`, shared by every layer of a pass (None: OPT).
        Looked up in one table of every position, computed once: a position's values are
        then the same in every call (a vectorised cos of a longer or shorter list may round
        an element differently)."""
        if self.family == "opt":
            return None
        key = (dtype, positions.device)
        table = self._rope.get(key)
        need = int(positions.max()) + 1 if positions.numel() else 0
        if table is None or table[0].shape[0] < need:
            every = torch.arange(max(need, self.config.max_seq_len), device=positions.device)
            cos, sin = rope_cos_sin(every[None], self.head_dim, self.config.rope_theta, dtype)
            table = self._rope[key] = (cos[0, 0], sin[0, 0])
        return table[0][positions][:, None], table[1][positions][:, None]

    def qkv(self, weights, x, positions, rope=None):
        if self.family == "opt":
            return opt_qkv(self.config, weights, x)
        return llama_qkv(self.config, weights, x, positions, rope)

    def out(self, weights, attn, x):
        if self.family == "opt":
            return opt_out(self.config, weights, attn, x)
        return llama_out(self.config, weights, attn, x)

    def logits(self, weights, hidden: torch.Tensor) -> torch.Tensor:
        """(s, h) last hidden states -> (s, vocab) float32 logits."""
        if self.family == "opt":
            w_ln, b_ln, w_token = weights
            h = F.layer_norm(hidden, (hidden.shape[-1],), w_ln.data, b_ln.data)
        else:
            w_norm, w_token = weights
            h = rms_norm(hidden, w_norm.data, self.config.rms_norm_eps)
        return linear(h, w_token.data).float()


def model_shape(spec, chunk_size: int = CHUNK_SIZE, kv_format: str | None = None
                ) -> ModelShape:
    """The shape and identity of `spec`'s stored KV at `chunk_size`, kept in `kv_format`
    (None: the compute dtype's, so that stored KV is the computed KV bit for bit): the
    fingerprint covers the weights' content, the compute dtype, the KV format, the chunk
    size and the layout."""
    m = FamilyMath(spec)
    compute = dtypes.torch_dtype(spec.config.dtype)
    kv_format = kv_format or kv_format_of(compute)
    # 4-bit weights are other weights than those they were made from: their identity.
    digest = getattr(spec, "identity", None)
    if digest is None:
        digest = getattr(spec, "weights_digest", "")
    fingerprint = model_fingerprint(digest, dtypes.name(compute), chunk_size, kv_format) \
        if digest else ""
    return ModelShape(spec.name, m.n_layers, m.n_kv_head, m.head_dim, fingerprint, kv_format,
                      kv_format_lossless(kv_format, compute))


def probe_setup(spec, config: ServingConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(probe query heads, KV heads whose keys the store's probe copy holds)."""
    m = FamilyMath(spec)
    try:
        heads = resolve_probe_heads(config.probe_heads, m.n_head, m.n_kv_head, config.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    group = m.n_head // m.n_kv_head
    return tuple(heads), tuple(sorted({h // group for h in heads}))
