"""The same weights in Hugging Face transformers: the yardstick our runtime is checked against."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

from . import ModelSpec, dtypes
from .weights import parse_random_path, random_tensor, random_weight_path


def hf_config(spec: ModelSpec):
    from transformers import LlamaConfig as HFLlamaConfig, OPTConfig

    c = spec.config
    if spec.family == "opt":
        return OPTConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
            ffn_dim=c.ffn_embed_dim, num_attention_heads=c.n_head,
            max_position_embeddings=c.max_seq_len, do_layer_norm_before=True,
            word_embed_proj_dim=c.hidden_size, pad_token_id=c.pad_token_id,
            tie_word_embeddings=True)
    return HFLlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings)


def our_name(spec: ModelSpec, hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    if spec.family == "opt":
        name = name.replace("decoder.final_layer_norm", "decoder.layer_norm")
    return name


def reference_dtype(spec: ModelSpec) -> torch.dtype:
    """What the reference computes in: bf16 for a bf16 runtime (the same dtype), float32
    otherwise (fp16 weights' values held in float32: transformers' fp16 on a CPU is slow)."""
    dtype = dtypes.torch_dtype(spec.config.dtype)
    return dtype if dtype == torch.bfloat16 else torch.float32


def load_reference(spec: ModelSpec):
    """A transformers model (in reference_dtype) holding exactly the weights our runtime
    holds."""
    from transformers import AutoModelForCausalLM

    compute = reference_dtype(spec)
    if spec.gguf_file is not None:
        model = AutoModelForCausalLM.from_pretrained(
            str(spec.gguf_file.parent), gguf_file=spec.gguf_file.name, dtype=compute)
    elif spec.checkpoint is not None:
        model = AutoModelForCausalLM.from_pretrained(str(spec.checkpoint), dtype=compute)
    else:
        # Seeded weights: drawn here as the runtime drew them, also when it reads them from
        # the set it made once in the weights cache (its weight_path then names that set).
        model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=compute)
        shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
        model.load_state_dict(dict(seeded_tensors(spec, shapes)), strict=False)
        model.tie_weights()
    return model.eval()


def seeded_tensors(spec: ModelSpec, shapes: dict):
    """(transformers name, tensor in reference_dtype) of a seeded-weights model, one at a
    time, for `shapes` (name -> shape); a tied lm_head is left out."""
    marker = parse_random_path(spec.weight_path + "/x") or \
        parse_random_path(random_weight_path(spec.seed) + "/x")
    seed, std, _ = marker
    compute, ours = reference_dtype(spec), dtypes.torch_dtype(spec.config.dtype)
    tied = hf_config(spec).tie_word_embeddings
    for hf_name, shape in shapes.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        # Round through the runtime's dtype, so both hold identical values.
        yield hf_name, random_tensor(our_name(spec, hf_name), shape, seed, std,
                                     ours).to(compute).cpu().contiguous()


def save_seeded_checkpoint(spec: ModelSpec, out: Path, shard_bytes: int = 2 << 30) -> None:
    """A seeded-weights model as a transformers checkpoint in `out`, written a tensor at a
    time into safetensors shards, so a model larger than memory is never held whole."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = hf_config(spec)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=reference_dtype(spec))
    shapes = {name: tuple(p.shape) for name, p in meta.state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    weight_map, shard, held, total = {}, {}, 0, 0

    def flush():
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in shard})
        shard.clear()

    for hf_name, t in seeded_tensors(spec, shapes):
        shard[hf_name] = t
        held += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if held >= shard_bytes:
            flush()
            held = 0
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    config.save_pretrained(out)


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding with the model's KV cache; returns tokens and per-step logits."""
    # transformers renamed `past_key_values` to `cache` (5.x); accept either release.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    tokens, logits = [], []
    for step in range(max_new_tokens):
        step_logits = out.logits[0, -1].float()
        logits.append(step_logits)
        nxt = int(step_logits.argmax())
        tokens.append(nxt)
        if step + 1 == max_new_tokens:
            break
        mask = torch.ones(1, len(prompt) + step + 1, dtype=torch.long)
        past = getattr(out, "cache", None) or out.past_key_values
        out = model(input_ids=torch.tensor([[nxt]]), attention_mask=mask,
                    use_cache=True, **{cache_arg: past})
    return tokens, torch.stack(logits)
