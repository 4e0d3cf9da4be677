"""Stored KV belongs to the weights that computed it: a store is keyed by a fingerprint of
the weights' content (the seed for random weights), the dtypes, the chunk size and the
layout; never by the model's name or shape alone."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from impress_flexgen.engine import model_shape
from impress_flexgen.entrypoints import run
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.errors import UserError
from impress_flexgen.models import resolve
from impress_flexgen.store import ModelShape, PrefixStore, StoreConfig

BOOK = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife. However little known the feelings or views of such "
        "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
        "minds of the surrounding families, that he is considered the rightful property of some "
        "one or other of their daughters.")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache: default store folders (and converted weights) land in it."""
    path = tmp_path / "cache"
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(path))
    return path


def _requests(path):
    path.write_text("".join(json.dumps(x) + "\n" for x in (
        {"id": "a", "prompt": BOOK + " Mr. Bennet said", "max_tokens": 4, "temperature": 0},
        {"id": "b", "prompt": BOOK + " Mrs. Bennet replied", "max_tokens": 4, "temperature": 0})))
    return path


def _serve(tmp_path, requests, *model_args, store_dir=None) -> list[dict]:
    out = tmp_path / "out.jsonl"
    extra = ["--store-dir", str(store_dir)] if store_dir is not None else []
    assert run.main([*model_args, "--requests", str(requests), "--output", str(out),
                     "--offload-dir", str(tmp_path / "off"), *extra]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_another_seed_takes_nothing_from_the_store_of_the_first(tmp_path, cache, monkeypatch):
    requests = _requests(tmp_path / "in.jsonl")
    seed0 = _serve(tmp_path, requests, "--model", "llama-tiny", "--seed", "0")
    assert seed0[1]["stats"]["matched_tokens"] > 0          # the store works within a seed
    seed1 = _serve(tmp_path, requests, "--model", "llama-tiny", "--seed", "1")
    assert [x["stats"]["matched_tokens"] for x in seed1][0] == 0
    # What a fresh seed-1 run (an empty cache) generates.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(fresh / "cache"))
    alone = _serve(fresh, requests, "--model", "llama-tiny", "--seed", "1")
    assert [x["token_ids"] for x in seed1] == [x["token_ids"] for x in alone]
    assert [x["token_ids"] for x in seed1] != [x["token_ids"] for x in seed0]
    assert len(list((cache / "stores").iterdir())) == 2     # one folder per identity


@pytest.mark.slow
def test_a_given_store_dir_of_another_seed_is_refused_in_one_line(tmp_path, cache, capsys):
    requests = _requests(tmp_path / "in.jsonl")
    stores = tmp_path / "stores"
    _serve(tmp_path, requests, "--model", "llama-tiny", "--seed", "0", store_dir=stores)
    capsys.readouterr()
    out = tmp_path / "out2.jsonl"
    rc = run_main("run", run.main, [
        "--model", "llama-tiny", "--seed", "1", "--requests", str(requests), "--output",
        str(out), "--offload-dir", str(tmp_path / "off"), "--store-dir", str(stores)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "another model" in err and len(err.splitlines()) == 1


def _checkpoint(path, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.slow
def test_two_checkpoints_of_one_shape_never_share_kv(tmp_path, cache, monkeypatch):
    base = _checkpoint(tmp_path / "base-model", 11)
    tuned = _checkpoint(tmp_path / "fine-tune", 12)
    requests = _requests(tmp_path / "in.jsonl")
    first = _serve(tmp_path, requests, "--model-path", str(base))
    assert first[1]["stats"]["matched_tokens"] > 0
    second = _serve(tmp_path, requests, "--model-path", str(tuned))
    assert second[0]["stats"]["matched_tokens"] == 0
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(fresh / "cache"))
    alone = _serve(fresh, requests, "--model-path", str(tuned))
    assert [x["token_ids"] for x in second] == [x["token_ids"] for x in alone]
    # Each store folder is named after its checkpoint, never after the default model.
    names = sorted(p.name for p in (cache / "stores").iterdir())
    assert [n.rsplit("-", 1)[0] for n in names] == ["base-model", "fine-tune"]


def test_the_label_of_a_checkpoint_comes_from_the_checkpoint(tiny_llama_checkpoint):
    assert resolve("smollm2-135m", str(tiny_llama_checkpoint)).name == \
        tiny_llama_checkpoint.name                          # the default --model is no label
    assert resolve(None, str(tiny_llama_checkpoint)).name == tiny_llama_checkpoint.name
    assert resolve("my-label", str(tiny_llama_checkpoint)).name == "my-label"


def test_the_fingerprint_follows_weights_dtype_and_chunk_size():
    a = resolve("llama-tiny", seed=0, dtype=np.float32)
    b = resolve("llama-tiny", seed=1, dtype=np.float32)
    c = resolve("llama-tiny", seed=0, dtype=np.float16)
    fps = {model_shape(a).fingerprint, model_shape(b).fingerprint,
           model_shape(c).fingerprint, model_shape(a, 32).fingerprint}
    assert len(fps) == 4 and all(len(f) == 64 for f in fps)
    assert model_shape(resolve("llama-tiny", seed=0, dtype=np.float32)).fingerprint == \
        model_shape(a).fingerprint                          # stable across resolves


def test_a_store_of_another_identity_is_refused(tmp_path):
    shape = ModelShape("m", 2, 2, 16, "a" * 64)
    PrefixStore(tmp_path / "s", shape, StoreConfig(direct_io=False)).close()
    other = ModelShape("m", 2, 2, 16, "b" * 64)
    with pytest.raises(UserError, match="another model"):
        PrefixStore(tmp_path / "s", other, StoreConfig(direct_io=False))
    PrefixStore(tmp_path / "s", shape, StoreConfig(direct_io=False)).close()


def test_a_store_from_before_fingerprints_is_refused_with_what_to_do(tmp_path):
    bare = ModelShape("m", 2, 2, 16)
    PrefixStore(tmp_path / "s", bare, StoreConfig(direct_io=False)).close()
    # Such a store's meta has no fingerprint at all (the format before identities).
    import sqlite3
    db = sqlite3.connect(tmp_path / "s" / "store.sqlite")
    db.execute("DELETE FROM meta WHERE key = 'fingerprint'")
    db.commit()
    db.close()
    with pytest.raises(UserError, match="delete it or use another --store-dir"):
        PrefixStore(tmp_path / "s", ModelShape("m", 2, 2, 16, "c" * 64),
                    StoreConfig(direct_io=False))
