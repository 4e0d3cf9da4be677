"""Weights made once: seeded random weights and conversions are written into the weights
cache under their digest at the first start and read back, unchanged, by the next."""
from __future__ import annotations

import os

import numpy as np
import pytest

from impress_flexgen import progress
from impress_flexgen.models import weight_sets
from impress_flexgen.models.runtime import Placement, Runtime, RuntimeConfig

PROMPT = [101, 2045, 318, 257, 1332, 286]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(path))
    return path / "weights"


def _files(root):
    """{relative path: (inode, mtime_ns)} of every file under `root`."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_ino, st.st_mtime_ns)
    return out


def _counting(monkeypatch) -> list:
    written = []
    real = weight_sets._write

    def write(out, name, shape, values, fmt):
        written.append(name)
        return real(out, name, shape, values, fmt)

    monkeypatch.setattr(weight_sets, "_write", write)
    return written


@pytest.mark.parametrize("model,compress", [("opt-tiny", False), ("opt-tiny", True),
                                            ("llama-tiny", True)])
def test_the_second_start_reads_what_the_first_wrote(model, compress, cache, offload_dir,
                                                     monkeypatch):
    written = _counting(monkeypatch)
    outs = []
    for start in range(2):
        with Runtime(RuntimeConfig(model=model, compress_weight=compress,
                                   offload_dir=str(offload_dir))) as rt:
            outs.append(rt.generate([PROMPT], 3, record_logits=True))
            assert rt.plan.weights_source == "cache"
            assert rt.plan.weights_write == (0 if start else rt.plan.weights_write)
            if start == 0:
                assert rt.plan.weights_write > 0
                first = _files(cache)
                made = len(written)
    assert made > 0 and len(written) == made        # nothing drawn or written again
    assert _files(cache) == first                   # same files: inodes and mtimes
    assert outs[0].new_ids == outs[1].new_ids
    assert np.array_equal(outs[0].logits[0].numpy(), outs[1].logits[0].numpy())


@pytest.mark.parametrize("compress", [False, True])
def test_disk_placed_weights_are_read_where_they_lie(compress, cache, offload_dir):
    """Nothing of the weights is copied into the offload directory, and closing the model
    deletes nothing of the cache."""
    from flexgen.pytorch_backend import DeviceType

    with Runtime(RuntimeConfig(model="opt-tiny", placement=Placement.parse("disk"),
                               compress_weight=compress, offload_dir=str(offload_dir))) as rt:
        paths = []
        for home in rt.model.weight_home:
            for t in home.val:
                parts = t.data[:2] if t.device.device_type == DeviceType.COMPRESSED else [t]
                paths += [p.data for p in parts]
        set_dir = rt.spec.weight_path
        assert paths and all(os.path.dirname(p) == set_dir for p in paths)
        assert [p for p in offload_dir.rglob("*") if p.is_file()] == []
        rt.generate([PROMPT], 2)
    assert all(os.path.exists(p) for p in paths)


def test_the_same_weights_drawn_in_place_and_made_once(cache, offload_dir, monkeypatch):
    from impress_flexgen.models import placement

    def weights(rt):
        return [t.data.clone() for home in rt.model.weight_home for t in home.val]

    with Runtime(RuntimeConfig(model="llama-tiny", offload_dir=str(offload_dir))) as rt:
        made = weights(rt)
    monkeypatch.setattr(placement, "_sources", lambda spec, fmt, cuda: [("drawn", None, 0)])
    with Runtime(RuntimeConfig(model="llama-tiny", offload_dir=str(offload_dir))) as rt:
        assert rt.plan.weights_source == "drawn"
        drawn = weights(rt)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(made, drawn))


def test_a_changed_or_missing_file_is_made_again(cache, offload_dir, monkeypatch):
    cfg = RuntimeConfig(model="opt-tiny", offload_dir=str(offload_dir))
    with Runtime(cfg) as rt:
        set_dir = rt.spec.weight_path
    victim = os.path.join(set_dir, "decoder.layers.0.fc1.weight")
    with open(victim, "r+b") as f:                   # an edit in place
        f.seek(200)
        f.write(b"\0" * 8)
    written = _counting(monkeypatch)
    with Runtime(cfg) as rt:
        assert rt.plan.weights_write > 0 and rt.spec.weight_path == set_dir
    assert written
    os.remove(victim)
    with Runtime(cfg) as rt:
        assert rt.plan.weights_write > 0
    assert os.path.exists(victim)


def test_a_killed_making_leaves_nothing_that_looks_made(cache, offload_dir, monkeypatch):
    def die(*args):
        raise KeyboardInterrupt

    cfg = RuntimeConfig(model="opt-tiny", offload_dir=str(offload_dir))
    monkeypatch.setattr(weight_sets, "_write", die)
    with pytest.raises(KeyboardInterrupt):
        Runtime(cfg)
    assert [p.name for p in cache.iterdir() if not p.name.startswith("weights-")] == []
    monkeypatch.undo()
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(cache.parent))
    with Runtime(cfg) as rt:
        assert rt.plan.weights_source == "cache"


def test_an_fp16_conversion_computed_in_fp32_is_cast_once(tiny_opt_checkpoint, cache,
                                                         offload_dir, monkeypatch):
    """A checkpoint's fp16 files, fp32 compute, weights on disk: cast once into the
    weights cache, then read where they lie (before, every start wrote a cast copy into
    the offload directory)."""
    cfg = RuntimeConfig(model="hf", model_path=str(tiny_opt_checkpoint),
                        placement=Placement.parse("disk"), offload_dir=str(offload_dir))
    with Runtime(cfg) as rt:
        if rt.spec.config.dtype != np.float32:
            pytest.skip("with CUDA the compute dtype is the files' (fp16)")
        assert rt.plan.weights_source == "cache" and rt.plan.weights_write > 0
        out = rt.generate([PROMPT], 3).new_ids
    written = _counting(monkeypatch)
    with Runtime(cfg) as rt:
        assert rt.plan.weights_write == 0 and rt.generate([PROMPT], 3).new_ids == out
        assert [p for p in offload_dir.rglob("*") if p.is_file()] == []
    assert written == []


def test_the_first_line_says_how_much_and_how_long_then_a_bar(cache, offload_dir,
                                                              monkeypatch, capsys):
    monkeypatch.setenv("IMPRESS_FLEXGEN_PROGRESS", "1")
    with Runtime(RuntimeConfig(model="opt-tiny", compress_weight=True,
                               offload_dir=str(offload_dir))):
        pass
    err = capsys.readouterr().err
    first = next(line for line in err.splitlines() if line.startswith(progress.PREFIX))
    assert "once:" in first and "GiB to write to" in first and "about " in first
    assert "making weights" in err and "loading weights" in err and "B/s" in err
