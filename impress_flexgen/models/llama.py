"""Llama-family models as FlexGen layers: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Each layer follows FlexGen's protocol (init_weight / load_weight / init_cache_one_gpu_batch /
load_cache / store_cache / forward), so FlexGen's Policy places weights, KV cache and
activations across GPU, CPU and disk exactly as it does for OPT. The KV cache keeps FlexGen's
layout, (seq, batch * kv_heads, head_dim), with one entry per KV head: grouped-query models
store n_kv_head heads, not n_head. Keys are cached after RoPE, as Hugging Face does.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from flexgen import flex_opt
from flexgen.pytorch_backend import TorchTensor

from ..errors import UserError
from . import dtypes
from .base import (FlexGenModel, LogitsRecorder, allocate_cache, check_compressed_cache,
                   compressed_new, compressed_step, dense, fuse_rows, fused, linear,
                   output_logits, pick_next_token)
from .weights import checkpoint_files, converted_dir, iter_checkpoint_tensors, save_tensor


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    name: str
    num_hidden_layers: int
    hidden_size: int
    n_head: int
    n_kv_head: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Padding is masked and never looked up, so no real token id is given up for it.
    pad_token_id: int = -1
    dtype: type = np.float16

    @property
    def input_dim(self) -> int:  # FlexGen's name for the hidden size
        return self.hidden_size

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_kv_head

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return 2 * self.num_hidden_layers * self.n_kv_head * self.head_dim * bytes_per_value


SHAPES = {
    "smollm2-135m": LlamaConfig(
        name="smollm2-135m", num_hidden_layers=30, hidden_size=576, n_head=9, n_kv_head=3,
        head_dim=64, intermediate_size=1536, vocab_size=49152, max_seq_len=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-2-7b": LlamaConfig(
        name="llama-2-7b", num_hidden_layers=32, hidden_size=4096, n_head=32, n_kv_head=32,
        head_dim=128, intermediate_size=11008, vocab_size=32000, max_seq_len=4096),
    "llama-2-13b": LlamaConfig(
        name="llama-2-13b", num_hidden_layers=40, hidden_size=5120, n_head=40, n_kv_head=40,
        head_dim=128, intermediate_size=13824, vocab_size=32000, max_seq_len=4096),
    # Tests: grouped-query like SmolLM2, with its vocabulary so its tokenizer fits.
    "llama-tiny": LlamaConfig(
        name="llama-tiny", num_hidden_layers=2, hidden_size=64, n_head=4, n_kv_head=2,
        head_dim=16, intermediate_size=128, vocab_size=49152, max_seq_len=2048,
        rope_theta=10000.0),
}


def llama_config_from_hf(model_path: Path, name: str) -> LlamaConfig:
    cfg = json.loads((model_path / "config.json").read_text())
    if cfg.get("model_type") not in ("llama", "mistral"):
        raise UserError(f"{model_path} holds a '{cfg.get('model_type')}' model, not Llama")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise UserError(f"RoPE scaling '{rope.get('rope_type')}' is not supported")
    n_head = cfg["num_attention_heads"]
    return LlamaConfig(
        name=name,
        num_hidden_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        n_head=n_head,
        n_kv_head=cfg.get("num_key_value_heads", n_head),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg.get("max_position_embeddings", 4096),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
    )


def convert_hf_llama(model_path: Path, cache_root: Path, dtype) -> Path:
    files = checkpoint_files(model_path)

    def convert(out: Path) -> None:
        for name, tensor in iter_checkpoint_tensors(files):
            if "rotary_emb" in name:
                continue
            save_tensor(out, name.removeprefix("model."), dtypes.cast(tensor.float().numpy(), dtype))

    return converted_dir(cache_root, f"llama-{model_path.name}", files, dtype, convert)


# ---------------------------------------------------------------------------------------
# Tensor operations (plain torch, on the compute device)

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's fused op: the same arithmetic (in float32) as the transformers reference.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """positions: (b, s) -> cos, sin of shape (b, 1, s, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, :, None] * inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position of each token = number of unpadded tokens before it (left padding allowed)."""
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)


def grouped_attention(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """q: (b, n_head, s_q, d); k, v: (b, n_kv, s_k, d); allowed: bool, broadcastable to
    (b, 1, s_q, s_k). Query head h reads KV head h // (n_head / n_kv)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                          enable_gqa=q.shape[1] != k.shape[1])


def to_cache_layout(x: torch.Tensor) -> torch.Tensor:
    """(b, n_kv, s, d) -> FlexGen's (s, b * n_kv, d)."""
    b, n, s, d = x.shape
    return x.permute(2, 0, 1, 3).reshape(s, b * n, d)


def from_cache_layout(x: torch.Tensor, b: int) -> torch.Tensor:
    s, bn, d = x.shape
    return x.reshape(s, b, bn // b, d).permute(1, 2, 0, 3)


# ---------------------------------------------------------------------------------------
# Layers

def _weights(weight_read_buf, k, num_gpu_batches):
    held = weight_read_buf.pop() if k == num_gpu_batches - 1 else weight_read_buf.val
    return [dense(w) for w, _ in held]


def _store_weights(layer, weight_home, weight_read_buf, k):
    """Matrices go to the (possibly compressed) weight buffer, vectors to the compute device."""
    if k == 0:
        weight_read_buf.store(tuple(
            w.smart_copy(layer.weight_load_dst if len(w.shape) > 1 else layer.compute)
            for w in weight_home.val))


class LlamaInputEmbed(flex_opt.InputEmbed):
    def init_weight(self, weight_home, path):
        c = self.config
        specs = [((c.vocab_size, c.hidden_size), c.dtype, path + "/embed_tokens.weight")]
        weight_home.store(flex_opt.init_weight_list(specs, self.policy, self.env))

    def load_weight(self, weight_home, weight_read_buf, k):
        _store_weights(self, weight_home, weight_read_buf, k)

    def forward(self, hidden, cache_read_buf, weight_read_buf, attention_mask,
                cache_write_buf, i, k):
        (w_token,) = _weights(weight_read_buf, k, self.policy.num_gpu_batches)
        ids = hidden.val.data.long().clamp(min=0)
        hidden.val = TorchTensor.create_from_torch(F.embedding(ids, w_token.data), self.compute)


class LlamaSelfAttention(flex_opt.SelfAttention):
    def init_weight(self, weight_home, path):
        c = self.config
        p = f"{path}/layers.{self.layer_id}."
        q_dim, kv_dim = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
        specs = [
            ((q_dim, c.hidden_size), c.dtype, p + "self_attn.q_proj.weight"),
            ((kv_dim, c.hidden_size), c.dtype, p + "self_attn.k_proj.weight"),
            ((kv_dim, c.hidden_size), c.dtype, p + "self_attn.v_proj.weight"),
            ((c.hidden_size, q_dim), c.dtype, p + "self_attn.o_proj.weight"),
            ((c.hidden_size,), c.dtype, p + "input_layernorm.weight"),
        ]
        weights = flex_opt.init_weight_list(specs, self.policy, self.env)
        fuse_rows(weights[:3], self.compute)
        weight_home.store(weights)

    def load_weight(self, weight_home, weight_read_buf, k):
        _store_weights(self, weight_home, weight_read_buf, k)

    def init_cache_one_gpu_batch(self, cache_home):
        c = self.config
        cache_home.store(allocate_cache(self, c.n_kv_head, c.head_dim, c.dtype))

    def forward(self, hidden, cache_read_buf, weight_read_buf, attention_mask,
                cache_write_buf, i, k):
        c = self.config
        weights = _weights(weight_read_buf, k, self.policy.num_gpu_batches)
        x = hidden.val.data
        b, s, _ = x.shape
        mask = attention_mask.val.data.to(x.device)  # (b, total length so far)
        q, k_new, v_new = llama_qkv(c, weights, x, positions_from_mask(mask)[:, -s:])

        if i == 0:  # prefill: causal over the prompt, padding masked
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            allowed = causal[None, None] & mask[:, None, None, :]
            # A padded query row still sees itself, so no row is all -inf (NaN would leak
            # through 0 * NaN into later layers' values).
            allowed |= torch.eye(s, dtype=torch.bool, device=x.device)[None, None]
            keys, values = k_new, v_new
        else:  # decode: the cache slice holds a free slot for this token, as in FlexGen
            (k_cache, _), (v_cache, _) = cache_read_buf.pop()
            rows = mask.shape[1]
            if self.policy.compress_cache:
                kc = compressed_step(self.compute, k_cache, rows)
                vc = compressed_step(self.compute, v_cache, rows)
            else:
                kc, vc = k_cache.data[:rows], v_cache.data[:rows]
            kc[-s:] = to_cache_layout(k_new)
            vc[-s:] = to_cache_layout(v_new)
            keys, values = from_cache_layout(kc, b), from_cache_layout(vc, b)
            allowed = mask[:, None, None, :]

        out = grouped_attention(q, keys, values, allowed)
        k_store, v_store = to_cache_layout(k_new), to_cache_layout(v_new)
        if self.policy.compress_cache:
            config = self.policy.comp_cache_config
            new = (self.compute.compressed_device.compress(k_store, config),
                   self.compute.compressed_device.compress(v_store, config)) if i == 0 else \
                (compressed_new(self.compute, kc, k_store, config),
                 compressed_new(self.compute, vc, v_store, config))
        else:
            new = (TorchTensor.create_from_torch(k_store, self.compute),
                   TorchTensor.create_from_torch(v_store, self.compute))
        cache_write_buf.store(new)
        hidden.val = TorchTensor.create_from_torch(llama_out(c, weights, out, x), self.compute)


def llama_qkv(c: LlamaConfig, weights, x: torch.Tensor, positions: torch.Tensor,
              rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Hidden states (b, s, h) at `positions` (b, s) -> q (b, H, s, d); k, v (b, KV, s, d).
    `rope`: the positions' (cos, sin), when the caller computed them once for all layers."""
    w_q, w_k, w_v, _, w_ln = weights
    b, s, _ = x.shape
    h = rms_norm(x, w_ln.data, c.rms_norm_eps)
    whole = fused(w_q)
    if whole is not None:
        q, k, v = linear(h, whole).split([w.shape[0] for w in (w_q, w_k, w_v)], dim=-1)
    else:
        q, k, v = linear(h, w_q.data), linear(h, w_k.data), linear(h, w_v.data)
    q = q.view(b, s, c.n_head, c.head_dim).transpose(1, 2)
    k = k.view(b, s, c.n_kv_head, c.head_dim).transpose(1, 2)
    v = v.view(b, s, c.n_kv_head, c.head_dim).transpose(1, 2)
    cos, sin = rope or rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def llama_out(c: LlamaConfig, weights, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Attention output (b, H, s, d) -> o_proj + residual (b, s, h)."""
    b, _, s, _ = attn.shape
    return linear(attn.transpose(1, 2).reshape(b, s, c.n_head * c.head_dim), weights[3].data) + x


class LlamaMLP(flex_opt.MLP):
    def init_weight(self, weight_home, path):
        c = self.config
        p = f"{path}/layers.{self.layer_id}."
        specs = [
            ((c.intermediate_size, c.hidden_size), c.dtype, p + "mlp.gate_proj.weight"),
            ((c.intermediate_size, c.hidden_size), c.dtype, p + "mlp.up_proj.weight"),
            ((c.hidden_size, c.intermediate_size), c.dtype, p + "mlp.down_proj.weight"),
            ((c.hidden_size,), c.dtype, p + "post_attention_layernorm.weight"),
        ]
        weights = flex_opt.init_weight_list(specs, self.policy, self.env)
        fuse_rows(weights[:2], self.compute)
        weight_home.store(weights)

    def load_weight(self, weight_home, weight_read_buf, k):
        _store_weights(self, weight_home, weight_read_buf, k)

    def forward(self, hidden, cache_read_buf, weight_read_buf, attention_mask,
                cache_write_buf, i, k):
        w_gate, w_up, w_down, w_ln = _weights(weight_read_buf, k, self.policy.num_gpu_batches)
        x = hidden.val.data
        h = rms_norm(x, w_ln.data, self.config.rms_norm_eps)
        whole = fused(w_gate)
        if whole is not None:
            gate, up = linear(h, whole).chunk(2, dim=-1)
        else:
            gate, up = linear(h, w_gate.data), linear(h, w_up.data)
        out = linear(F.silu(gate) * up, w_down.data)
        hidden.val = TorchTensor.create_from_torch(out + x, self.compute)


class LlamaTransformerLayer(flex_opt.TransformerLayer):
    def __init__(self, config, env, policy, i):
        self.attention = LlamaSelfAttention(config, env, policy, i)
        self.mlp = LlamaMLP(config, env, policy, i)
        self.policy = policy
        self.compute = self.attention.compute


class LlamaOutputEmbed(flex_opt.OutputEmbed, LogitsRecorder):
    def init_weight(self, weight_home, path):
        c = self.config
        head = "embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        specs = [((c.hidden_size,), c.dtype, path + "/norm.weight"),
                 ((c.vocab_size, c.hidden_size), c.dtype, f"{path}/{head}")]
        weight_home.store(flex_opt.init_weight_list(specs, self.policy, self.env))

    def load_weight(self, weight_home, weight_read_buf, k):
        _store_weights(self, weight_home, weight_read_buf, k)

    def forward(self, hidden, cache_read_buf, weight_read_buf, attention_mask,
                cache_write_buf, i, k):
        w_norm, w_token = _weights(weight_read_buf, k, self.policy.num_gpu_batches)
        eps = self.config.rms_norm_eps
        logits = output_logits(self.compute, hidden.val,
                               lambda x: rms_norm(x, w_norm.data, eps), w_token)
        self.record(logits)
        ids = pick_next_token(logits, self.task.do_sample, self.task.temperature)
        hidden.val = TorchTensor.create_from_torch(ids, self.compute)


def check_policy(config, policy) -> None:
    check_compressed_cache(policy)
    if policy.attn_sparsity < 1.0:
        raise UserError("attention sparsity is not supported for Llama models")


class LlamaModel(FlexGenModel, flex_opt.OptLM):
    """FlexGen's OptLM generation loops over Llama layers."""

    def __init__(self, config: LlamaConfig, env, weight_path: str, policy):
        check_policy(config, policy)
        self.weight_path = weight_path
        super().__init__(config, env, weight_path, policy)

    def build_layers(self):
        c, env, policy = self.config, self.env, self.policy
        layers = [LlamaInputEmbed(c, env, policy)]
        for i in range(c.num_hidden_layers):
            if policy.sep_layer:
                layers += [LlamaSelfAttention(c, env, policy, i), LlamaMLP(c, env, policy, i)]
            else:
                layers.append(LlamaTransformerLayer(c, env, policy, i))
        layers.append(LlamaOutputEmbed(c, env, policy))
        return layers

    def init_all_weights(self):
        # OptLM.__init__ builds OPT layer objects (no weights yet) and then calls this;
        # the layer count is the same, so the buffers it sized fit ours.
        self.layers = self.build_layers()
        super().init_all_weights()
