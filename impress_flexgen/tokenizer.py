"""Tokenizers, all offline.

- A checkpoint's own tokenizer when `--model-path` has one.
- smollm2-135m: the tokenizer inside its GGUF file (converted once, then cached).
- Random-weight models have no vocabulary of their own; text is encoded with the SmolLM2
  tokenizer (49,152 ids), which fits OPT's 50,272-entry embedding and llama-tiny's. For a
  model with a smaller vocabulary (Llama-2 shapes, 32,000) ids are folded modulo the
  vocabulary size; such text is only a realistic id stream, which is all random weights need.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from . import scratch
from .paths import cache_dir
from .weights import fsync_tree


class Tokenizer:
    def __init__(self, hf_tokenizer, vocab_size: int, source: str):
        self.hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.source = source
        self.folded = len(hf_tokenizer) > vocab_size

    def encode(self, text: str) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False)
        return [i % self.vocab_size for i in ids] if self.folded else ids

    def decode(self, ids) -> str:
        if self.folded:
            return " ".join(str(i) for i in ids)
        return self.hf.decode(list(ids), skip_special_tokens=True)


def _gguf_tokenizer(gguf_file: Path):
    from transformers import AutoTokenizer

    log = logging.getLogger("impress_flexgen")
    cached = cache_dir() / "tokenizers" / gguf_file.stem
    if (cached / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # noqa: BLE001 - any damage: the cache is only a shortcut
            log.warning("cached tokenizer in %s is damaged (%s): converting it again",
                        cached, " ".join(str(exc).split())[:200] or type(exc).__name__)
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    # The cache only saves the conversion next time: an unwritable cache is no reason to
    # fail, and a save cut short (or not yet on disk at a crash) must never be found as a
    # cached tokenizer: written, fsynced, then renamed into place.
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with scratch.directory(cached.parent, "tokenizer") as tmp:
            tok.save_pretrained(str(tmp))
            fsync_tree(tmp)
            if cached.exists() or cached.is_symlink():
                old = cached.with_name(f"{cached.name}.damaged-{os.getpid()}")
                os.replace(cached, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, cached)
    except OSError as exc:
        log.warning("tokenizer not cached in %s: %s", cached, exc.strerror or exc)
    return tok


def load_tokenizer(spec) -> Tokenizer:
    from transformers import AutoTokenizer

    vocab = spec.config.vocab_size
    if spec.tokenizer_dir is not None:
        return Tokenizer(AutoTokenizer.from_pretrained(str(spec.tokenizer_dir)), vocab,
                         f"checkpoint ({spec.tokenizer_dir})")
    if spec.gguf_file is not None:
        return Tokenizer(_gguf_tokenizer(spec.gguf_file), vocab, f"GGUF ({spec.gguf_file.name})")
    from .models import smollm2_gguf

    return Tokenizer(_gguf_tokenizer(smollm2_gguf()), vocab, "SmolLM2 (offline stand-in)")
