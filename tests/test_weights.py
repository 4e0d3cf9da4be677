"""Weights: seeded random, Hugging Face conversion (cached), GGUF layout."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

from impress_flexgen.errors import UserError
from impress_flexgen.models import _unpermute_gguf_qk, resolve
from impress_flexgen.models import weights
from impress_flexgen.models.runtime import Placement, Runtime, RuntimeConfig


def _first_matrix(rt):
    """The q projection of the first attention layer, as a float32 numpy array."""
    from flexgen.pytorch_backend import DeviceType

    home = rt.model.weight_home[1].val[0]
    if home.device.device_type == DeviceType.DISK:
        return np.load(home.data).astype(np.float32)
    return home.data.float().cpu().numpy()


@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
def test_random_weights_are_seeded_and_placement_independent(model, offload_dir):
    got = {}
    for placement in ("gpu", "cpu", "disk"):
        with Runtime(RuntimeConfig(model=model, placement=Placement.parse(placement),
                                   offload_dir=str(offload_dir))) as rt:
            got[placement] = _first_matrix(rt)
    with Runtime(RuntimeConfig(model=model, seed=7, offload_dir=str(offload_dir))) as rt:
        other_seed = _first_matrix(rt)
    w = got["gpu"]
    assert np.isfinite(w).all()
    assert 0.015 < w.std() < 0.025  # N(0, 0.02), never FlexGen's all-ones dummy
    assert np.array_equal(w, got["cpu"]) and np.array_equal(w, got["disk"])
    assert not np.array_equal(w, other_seed)


def test_hf_opt_conversion_is_exact_and_cached(tiny_opt_checkpoint):
    from safetensors.torch import load_file

    spec = resolve("opt-test", str(tiny_opt_checkpoint))
    assert spec.family == "opt" and spec.config.num_hidden_layers == 2
    out = spec.weight_path
    hf = load_file(str(tiny_opt_checkpoint / "model.safetensors"))
    q = np.load(f"{out}/decoder.layers.1.self_attn.q_proj.weight")
    assert q.dtype == np.float16
    assert np.array_equal(q, hf["model.decoder.layers.1.self_attn.q_proj.weight"].half().numpy())
    final_ln = np.load(f"{out}/decoder.layer_norm.weight")  # renamed from final_layer_norm
    assert final_ln.shape == (64,)

    stamp = (weights.Path(out) / "CONVERTED.json").stat().st_mtime_ns
    again = resolve("opt-test", str(tiny_opt_checkpoint))
    assert again.weight_path == out
    assert (weights.Path(out) / "CONVERTED.json").stat().st_mtime_ns == stamp


def test_hf_llama_conversion(tiny_llama_checkpoint):
    spec = resolve("llama-test", str(tiny_llama_checkpoint), dtype=np.float32)
    assert spec.family == "llama"
    c = spec.config
    assert (c.n_head, c.n_kv_head, c.head_dim, c.tie_word_embeddings) == (4, 2, 16, False)
    k = np.load(f"{spec.weight_path}/layers.0.self_attn.k_proj.weight")
    assert k.shape == (32, 64) and k.dtype == np.float32
    assert np.load(f"{spec.weight_path}/lm_head.weight").shape == (49152, 64)


def test_interrupted_conversion_is_never_used(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x")

    def broken(out):
        weights.save_tensor(out, "a", np.zeros(3))
        raise OSError("disk full")

    with pytest.raises(OSError):
        weights.converted_dir(tmp_path / "cache", "m", [src], np.float16, broken)
    assert list((tmp_path / "cache").iterdir()) == []
    done = weights.converted_dir(tmp_path / "cache", "m", [src], np.float16,
                                 lambda out: weights.save_tensor(out, "a", np.ones(3)))
    assert np.array_equal(np.load(done / "a"), np.ones(3))


def test_gguf_qk_unpermute_inverts_llama_cpp_layout():
    n_heads, head_dim, hidden = 3, 8, 12
    hf = torch.randn(n_heads * head_dim, hidden).numpy()
    # llama.cpp's converter: per head, interleave the two RoPE halves.
    gguf = hf.reshape(n_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(gguf, hf)
    assert np.array_equal(_unpermute_gguf_qk(gguf, n_heads), hf)


def test_bad_checkpoints_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        resolve("x", str(tmp_path / "missing"))
    with pytest.raises(UserError, match="no config.json"):
        resolve("x", str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(UserError, match="not supported"):
        resolve("x", str(tmp_path))
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(UserError, match="not valid JSON"):
        resolve("x", str(tmp_path))


def _later(path) -> None:
    """A rewrite within the clock's granularity may keep the mtime: make it visible."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def _fsynced(monkeypatch) -> list[str]:
    """Record the path of every file descriptor fsynced from now on."""
    seen = []
    real = os.fsync

    def record(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    monkeypatch.setattr(os, "fsync", record)
    return seen


def test_a_conversion_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x")
    seen = _fsynced(monkeypatch)
    done = weights.converted_dir(tmp_path / "cache", "m", [src], np.float16,
                                 lambda out: weights.save_tensor(out, "a", np.ones(3)))
    synced = {os.path.basename(p) for p in seen if "convert-" in p}
    assert {"a", "CONVERTED.json"} <= synced
    assert (done / "CONVERTED.json").exists()


def test_a_damaged_conversion_is_converted_again(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x")
    calls = []

    def convert(out):
        calls.append(out)
        weights.save_tensor(out, "a", np.arange(1000, dtype=np.float32))

    done = weights.converted_dir(tmp_path / "cache", "m", [src], np.float32, convert)
    digest = weights.content_digest(done)
    with open(done / "a", "r+b") as f:           # cut short (a crash, a full disk)
        f.truncate(100)
    again = weights.converted_dir(tmp_path / "cache", "m", [src], np.float32, convert)
    assert len(calls) == 2 and again == done
    assert np.array_equal(np.load(done / "a"), np.arange(1000, dtype=np.float32))
    assert weights.content_digest(done) == digest
    # Same size, other bytes, written later: changed since the conversion.
    data = bytearray((done / "a").read_bytes())
    data[-1] ^= 0xFF
    (done / "a").write_bytes(bytes(data))
    _later(done / "a")
    weights.converted_dir(tmp_path / "cache", "m", [src], np.float32, convert)
    assert len(calls) == 3


def test_the_content_digest_is_cached_and_follows_the_files(tmp_path, monkeypatch):
    d = tmp_path / "w"
    d.mkdir()
    weights.save_tensor(d, "a", np.ones(4))
    first = weights.content_digest(d)
    hashed = []
    real = weights._hash_files
    monkeypatch.setattr(weights, "_hash_files", lambda e: hashed.append(1) or real(e))
    assert weights.content_digest(d) == first and hashed == []      # from DIGEST.json
    weights.save_tensor(d, "a", np.zeros(4))
    _later(d / "a")
    assert weights.content_digest(d) != first and hashed == [1]


def _edit_keeping_mtime(path) -> None:
    """Change a byte in place (same size, same inode) and put the mtime back, as a careful
    editor would; only the ctime tells."""
    st = os.stat(path)
    time.sleep(0.05)             # the ctime moves with the kernel's clock tick: let one pass
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == \
        (st.st_size, st.st_mtime_ns, st.st_ino)


def test_the_content_digest_sees_an_edit_whose_mtime_was_put_back(tmp_path):
    d = tmp_path / "w"
    d.mkdir()
    weights.save_tensor(d, "a", np.arange(16, dtype=np.float32))
    first = weights.content_digest(d)
    _edit_keeping_mtime(d / "a")
    assert weights.content_digest(d) != first


def test_a_converted_file_edited_with_its_mtime_put_back_is_converted_again(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x")
    calls = []

    def convert(out):
        calls.append(out)
        weights.save_tensor(out, "a", np.arange(1000, dtype=np.float32))

    done = weights.converted_dir(tmp_path / "cache", "m", [src], np.float32, convert)
    digest = weights.content_digest(done)
    _edit_keeping_mtime(done / "a")
    assert weights.converted_dir(tmp_path / "cache", "m", [src], np.float32, convert) == done
    assert len(calls) == 2                           # the edit was seen: converted again
    assert np.array_equal(np.load(done / "a"), np.arange(1000, dtype=np.float32))
    assert weights.content_digest(done) == digest    # the weights the digest names


def test_an_edited_checkpoint_with_its_mtime_put_back_is_converted_again(tmp_path):
    """The conversion follows its checkpoint's bytes, and so does the digest that keys the
    stored KV: KV computed with the old weights is never read with the new ones."""
    src = tmp_path / "src.bin"
    src.write_bytes(np.arange(64, dtype=np.uint8).tobytes())

    def convert(out):
        weights.save_tensor(out, "a", np.frombuffer(src.read_bytes(), dtype=np.uint8) * 2.0)

    cache = tmp_path / "cache"
    done = weights.converted_dir(cache, "m", [src], np.float32, convert)
    digest = weights.content_digest(done)
    _edit_keeping_mtime(src)
    again = weights.converted_dir(cache, "m", [src], np.float32, convert)
    assert np.load(again / "a")[-1] == (63 ^ 0xFF) * 2.0
    assert weights.content_digest(again) != digest
    assert [p.name for p in cache.iterdir()] == [again.name]    # replaced, not piled up


@pytest.mark.slow
def test_a_damaged_cached_tokenizer_is_rebuilt(tmp_path, monkeypatch):
    from impress_flexgen.models.tokenizer import load_tokenizer

    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "cache"))
    spec = resolve("llama-tiny")
    ids = load_tokenizer(spec).encode("It is a truth universally acknowledged")
    (cached,) = (tmp_path / "cache" / "tokenizers").iterdir()
    (cached / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    seen = _fsynced(monkeypatch)
    assert load_tokenizer(spec).encode("It is a truth universally acknowledged") == ids
    assert any(p.endswith("tokenizer.json") for p in seen)          # durable this time
    json.loads((cached / "tokenizer.json").read_text())             # and whole again
