"""OPT on FlexGen: its published layers, our weights, logits recorded at the output."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from flexgen import flex_opt
from flexgen.opt_config import OptConfig, get_opt_config
from flexgen.pytorch_backend import TorchTensor

from ..errors import UserError
from .base import (FlexGenModel, LogitsRecorder, allocate_cache, check_compressed_cache,
                   compressed_new, compressed_step, dense, linear, output_logits,
                   pick_next_token)
from .weights import checkpoint_files, converted_dir, iter_checkpoint_tensors, save_tensor

PUBLISHED = ("opt-125m", "opt-1.3b", "opt-6.7b", "opt-13b", "opt-30b")

# Tiny shapes for tests. The vocabulary is OPT's, so any GPT-2-sized tokenizer's ids fit.
TINY = {
    "opt-tiny": dict(num_hidden_layers=2, hidden_size=64, input_dim=64, n_head=4,
                     ffn_embed_dim=256, max_seq_len=1024),
    "opt-mini": dict(num_hidden_layers=4, hidden_size=128, input_dim=128, n_head=8,
                     ffn_embed_dim=512, max_seq_len=2048),
}


def opt_config(name: str) -> OptConfig:
    if name in TINY:
        return OptConfig(name=name, **TINY[name])
    return get_opt_config(name)


def opt_config_from_hf(model_path: Path, name: str) -> OptConfig:
    cfg = json.loads((model_path / "config.json").read_text())
    if cfg.get("model_type") != "opt":
        raise UserError(f"{model_path} holds a '{cfg.get('model_type')}' model, not OPT")
    if not cfg.get("do_layer_norm_before", True) or \
            cfg.get("word_embed_proj_dim", cfg["hidden_size"]) != cfg["hidden_size"]:
        raise UserError("post-layer-norm OPT variants (opt-350m) are not supported by FlexGen")
    return OptConfig(
        name=name,
        num_hidden_layers=cfg["num_hidden_layers"],
        max_seq_len=cfg["max_position_embeddings"],
        hidden_size=cfg["hidden_size"],
        input_dim=cfg["hidden_size"],
        n_head=cfg["num_attention_heads"],
        ffn_embed_dim=cfg["ffn_dim"],
        vocab_size=cfg["vocab_size"],
        pad_token_id=cfg.get("pad_token_id", 1),
    )


def convert_hf_opt(model_path: Path, cache_root: Path) -> Path:
    """Hugging Face OPT checkpoint -> FlexGen per-tensor fp16 files (cached)."""
    files = checkpoint_files(model_path)

    def convert(out: Path) -> None:
        for name, tensor in iter_checkpoint_tensors(files):
            if name.startswith("lm_head"):
                continue  # tied to the token embedding
            name = name.removeprefix("model.").replace("decoder.final_layer_norm",
                                                       "decoder.layer_norm")
            save_tensor(out, name, tensor.float().numpy().astype(np.float16))

    return converted_dir(cache_root, f"opt-{model_path.name}", files, np.float16, convert)


class OptOutputEmbed(flex_opt.OutputEmbed, LogitsRecorder):
    """FlexGen's OutputEmbed, keeping the logits (FlexGen returns only the argmax)."""

    def forward(self, hidden, cache_read_buf, weight_read_buf, attention_mask,
                cache_write_buf, i, k):
        if k == self.policy.num_gpu_batches - 1:
            (w_ln, _), (b_ln, _), (w_token, _) = weight_read_buf.pop()
        else:
            (w_ln, _), (b_ln, _), (w_token, _) = weight_read_buf.val
        h = self.config.input_dim
        logits = output_logits(self.compute, hidden.val,
                               lambda x: F.layer_norm(x, (h,), w_ln.data, b_ln.data), w_token)
        self.record(logits)
        ids = pick_next_token(logits, self.task.do_sample, self.task.temperature)
        hidden.val.delete()
        hidden.val = TorchTensor.create_from_torch(ids, self.compute)


class OptMLP(flex_opt.MLP):
    """FlexGen's MLP, its products through models.base.linear, where a few bf16 rows go by
    the kernels fast for them (FlexGen's own calls F.linear). The same operations in the
    same order: float32 values are unchanged."""

    def forward(self, hidden, cache_read_buf, weight_read_buf, attention_mask,
                cache_write_buf, i, k):
        held = weight_read_buf.pop() if k == self.policy.num_gpu_batches - 1 \
            else weight_read_buf.val
        wi, bi, wo, bo, w_ln, b_ln = (dense(w).data for w, _ in held)
        x = hidden.val.data
        out = F.layer_norm(x, (x.shape[-1],), weight=w_ln, bias=b_ln)
        out = linear(out, wi, bias=bi)
        F.relu(out, inplace=True)
        out = linear(out, wo, bias=bo)
        out.add_(x)
        hidden.val = TorchTensor.create_from_torch(out, self.compute)


class OptSelfAttention(flex_opt.SelfAttention):
    """FlexGen's attention with its KV cache in the model's dtype (FlexGen's is always fp16,
    which fp32 queries cannot be multiplied with on a split cache). A decode step over a
    compressed cache runs FlexGen's mha_gen over the cache decompressed here and stores the
    new token by compressed_new (FlexGen's own loses a token at group boundaries when the
    groups run along the sequence)."""

    def init_cache_one_gpu_batch(self, cache_home):
        c = self.config
        cache_home.store(allocate_cache(self, c.n_head, c.input_dim // c.n_head, c.dtype))

    def forward(self, hidden, cache_read_buf, weight_read_buf, attention_mask,
                cache_write_buf, i, k):
        if i == 0 or not self.policy.compress_cache:
            return super().forward(hidden, cache_read_buf, weight_read_buf, attention_mask,
                                   cache_write_buf, i, k)
        donate = [False] * 14
        donate[0] = True
        held = weight_read_buf.pop() if k == self.policy.num_gpu_batches - 1 \
            else weight_read_buf.val
        w = [x for x, _ in held]
        mask, donate[1] = attention_mask.val.smart_copy(self.attention_compute)
        (k_cache, _), (v_cache, _) = cache_read_buf.pop()
        rows = mask.shape[1]
        k_ctx = compressed_step(self.compute, k_cache, rows)
        v_ctx = compressed_step(self.compute, v_cache, rows)
        h, _, _ = self.compute.mha_gen(
            hidden.val, mask, *w, self.config.n_head,
            TorchTensor.create_from_torch(k_ctx, self.compute),
            TorchTensor.create_from_torch(v_ctx, self.compute), donate,
            self.policy.attn_sparsity, False, None)
        # mha_gen wrote the new token's K and V into the last row of the contexts.
        config = self.policy.comp_cache_config
        cache_write_buf.store((compressed_new(self.compute, k_ctx, k_ctx[rows - 1:], config),
                               compressed_new(self.compute, v_ctx, v_ctx[rows - 1:], config)))
        hidden.val = h


def check_policy(config: OptConfig, policy) -> None:
    # Compression works in any dtype (compat routes it through quant.py); sparse attention
    # is FlexGen's fp16 kernel. CPU cache compute is checked where FlexGen's loop runs
    # (Runtime.generate): the serving engine's decode computes it in any dtype.
    if config.dtype != np.float16 and policy.attn_sparsity < 1.0:
        raise UserError("FlexGen's sparse attention kernels need fp16 (--dtype fp16)")
    check_compressed_cache(policy)


class OptModel(FlexGenModel, flex_opt.OptLM):
    def __init__(self, config: OptConfig, env, weight_path: str, policy):
        check_policy(config, policy)
        self.weight_path = weight_path
        super().__init__(config, env, weight_path, policy)
        for layer in self.layers:
            attention, mlp = (layer.attention, layer.mlp) \
                if isinstance(layer, flex_opt.TransformerLayer) else (layer, layer)
            if type(attention) is flex_opt.SelfAttention:
                attention.__class__ = OptSelfAttention
            if type(mlp) is flex_opt.MLP:
                mlp.__class__ = OptMLP
        self.layers[-1].__class__ = OptOutputEmbed


def opt_qkv(c: OptConfig, weights, x: torch.Tensor, positions=None):
    """Hidden states (b, s, h) -> q, k, v each (b, heads, s, d). OPT's positions enter at
    the embedding, so `positions` is unused here. q is not pre-scaled."""
    w_q, b_q, w_k, b_k, w_v, b_v, _, _, w_ln, b_ln = weights
    b, s, h = x.shape
    d = h // c.n_head
    hid = F.layer_norm(x, (h,), weight=w_ln.data, bias=b_ln.data)

    def heads(w, bias):
        return linear(hid, w.data, bias=bias.data).view(b, s, c.n_head, d).transpose(1, 2)

    return heads(w_q, b_q), heads(w_k, b_k), heads(w_v, b_v)


def opt_out(c: OptConfig, weights, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Attention output (b, heads, s, d) -> out_proj + residual (b, s, h)."""
    w_out, b_out = weights[6], weights[7]
    b, _, s, _ = attn.shape
    return linear(attn.transpose(1, 2).reshape(b, s, c.input_dim), w_out.data,
                    bias=b_out.data) + x
