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
from impress_flexgen.models import conversion_keys, weights
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
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [conversion_keys.INDEX]
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
    # Under its new content's key; the old conversion stays, whole, for the old content.
    assert sorted(p.name for p in cache.iterdir()) == \
        sorted([done.name, again.name, conversion_keys.INDEX])
    assert weights.content_digest(done) == digest


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


# A conversion is keyed by what its checkpoint's files hold, not where they lie.

def _counting(convert_calls: list):
    def convert(out):
        convert_calls.append(out)
        weights.save_tensor(out, "a", np.arange(100, dtype=np.float32))
    return convert


def _hashes(monkeypatch) -> list[str]:
    """Record every source file read to hash it from now on."""
    read = []
    real = conversion_keys.file_sha256
    monkeypatch.setattr(conversion_keys, "file_sha256", lambda p: read.append(p) or real(p))
    return read


def test_the_same_checkpoint_at_two_paths_is_converted_once(tmp_path):
    calls = []
    cache = tmp_path / "cache"
    made = []
    for where in ("venv-a", "venv-b"):       # the same package, installed twice
        (tmp_path / where).mkdir()
        src = tmp_path / where / "model.bin"
        src.write_bytes(b"the same checkpoint")
        made.append(weights.converted_dir(cache, "m", [src], np.float32, _counting(calls)))
    assert len(calls) == 1 and made[0] == made[1]
    other = tmp_path / "other" / "model.bin"    # other content: its own conversion
    other.parent.mkdir()
    other.write_bytes(b"another checkpoint")
    assert weights.converted_dir(cache, "m", [other], np.float32, _counting(calls)) != made[0]
    assert len(calls) == 2


def test_copies_of_a_hf_checkpoint_share_one_conversion_and_identity(tiny_llama_checkpoint,
                                                                     tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "cache"))
    specs = []
    for where in ("a", "b"):
        copy = tmp_path / where / tiny_llama_checkpoint.name
        shutil.copytree(tiny_llama_checkpoint, copy)
        specs.append(resolve(None, str(copy), dtype=np.float32))
    assert specs[0].weight_path == specs[1].weight_path
    assert specs[0].weights_digest == specs[1].weights_digest
    converted = [p for p in (tmp_path / "cache" / "weights").iterdir() if p.is_dir()]
    assert len(converted) == 1


def test_a_checkpoint_edited_in_place_and_back_is_converted_by_its_content(tmp_path):
    """Changed in place with its mtime put back: converted again under its new content's
    key; put back as it was: the first conversion serves again, nothing converted."""
    src = tmp_path / "model.bin"
    src.write_bytes(np.arange(64, dtype=np.uint8).tobytes())
    calls = []
    cache = tmp_path / "cache"
    first = weights.converted_dir(cache, "m", [src], np.float32, _counting(calls))
    _edit_keeping_mtime(src)
    edited = weights.converted_dir(cache, "m", [src], np.float32, _counting(calls))
    assert edited != first and len(calls) == 2
    _edit_keeping_mtime(src)                   # the byte flipped back: the first content
    assert weights.converted_dir(cache, "m", [src], np.float32, _counting(calls)) == first
    assert len(calls) == 2


def test_a_second_start_reads_no_source_bytes(tmp_path, monkeypatch):
    srcs = [tmp_path / "model-1.bin", tmp_path / "model-2.bin"]
    for i, s in enumerate(srcs):
        s.write_bytes(bytes([i]) * 1000)
    read = _hashes(monkeypatch)
    cache = tmp_path / "cache"
    calls = []
    done = weights.converted_dir(cache, "m", srcs, np.float32, _counting(calls))
    assert sorted(read) == sorted(str(s.resolve()) for s in srcs)
    read.clear()
    assert weights.converted_dir(cache, "m", srcs, np.float32, _counting(calls)) == done
    assert read == [] and len(calls) == 1           # from the index, by identity
    _edit_keeping_mtime(srcs[1])                    # only the changed file is read again
    weights.converted_dir(cache, "m", srcs, np.float32, _counting(calls))
    assert read == [str(srcs[1].resolve())] and len(calls) == 2


@pytest.mark.parametrize("index", ["{broken", "[1, 2]", '{"x": 3}', ""])
def test_a_damaged_hash_index_only_costs_a_hash(tmp_path, monkeypatch, index):
    src = tmp_path / "model.bin"
    src.write_bytes(b"weights")
    cache = tmp_path / "cache"
    calls = []
    done = weights.converted_dir(cache, "m", [src], np.float32, _counting(calls))
    (cache / conversion_keys.INDEX).write_text(index)
    read = _hashes(monkeypatch)
    assert weights.converted_dir(cache, "m", [src], np.float32, _counting(calls)) == done
    assert len(calls) == 1 and len(read) == 1
    recorded = json.loads((cache / conversion_keys.INDEX).read_text())   # whole again
    assert list(recorded) == [str(src.resolve())]
    # A recorded hash that is not one is not believed either.
    recorded[str(src.resolve())]["sha256"] = "not a digest"
    (cache / conversion_keys.INDEX).write_text(json.dumps(recorded))
    assert weights.converted_dir(cache, "m", [src], np.float32, _counting(calls)) == done
    assert len(calls) == 1 and len(read) == 2


def test_a_checkpoint_changed_while_converted_is_not_filed(tmp_path):
    src = tmp_path / "model.bin"
    src.write_bytes(b"before")

    def convert(out):
        weights.save_tensor(out, "a", np.ones(3))
        src.write_bytes(b"after!")              # a download still writing, say

    cache = tmp_path / "cache"
    with pytest.raises(UserError, match="changed while they were converted"):
        weights.converted_dir(cache, "m", [src], np.float32, convert)
    assert [p.name for p in cache.iterdir()] == [conversion_keys.INDEX]


def _path_keyed(cache, name: str, sources, age_s: float):
    """A conversion as the path-keyed scheme wrote it."""
    d = cache / f"m-float32-{name:0>16}"
    d.mkdir(parents=True)
    weights.save_tensor(d, "a", np.ones(3))
    (d / weights.CONVERTED).write_text(json.dumps(
        {"sources": [str(s) for s in sources], "source_files": {str(s): [1] for s in sources},
         "sizes": {"a": (d / "a").stat().st_size}}))
    then = time.time() - age_s
    os.utime(d / weights.CONVERTED, (then, then))
    return d


def test_path_keyed_conversions_nothing_can_use_are_removed(tmp_path):
    cache = tmp_path / "cache"
    gone, kept = tmp_path / "deleted-venv" / "model.bin", tmp_path / "model.bin"
    kept.write_bytes(b"still here")
    old = 2 * conversion_keys.DAY
    removed = _path_keyed(cache, "1", [gone], old)
    sources_left = _path_keyed(cache, "2", [gone, kept], old)
    recent = _path_keyed(cache, "3", [gone], 3600)
    in_use = _path_keyed(cache, "4", [gone], old)
    mapped = _path_keyed(cache, "5", [gone], old)
    src = tmp_path / "new.bin"
    src.write_bytes(b"x")
    weights_read = np.load(mapped / "a", mmap_mode="r")     # disk-placed weights in use
    with open(in_use / "a", "rb"):
        done = weights.converted_dir(cache, "m", [src], np.float32, _counting([]))
    os.utime(done / weights.CONVERTED, (time.time() - old,) * 2)
    assert not removed.exists()
    assert sources_left.exists() and recent.exists() and in_use.exists() and mapped.exists()
    del weights_read
    weights.converted_dir(cache, "m", [kept], np.float32, _counting([]))
    assert not in_use.exists() and not mapped.exists()
    assert done.exists()                        # a content-keyed one is never pruned
