"""The CPU compatibility layer and FlexGen's disk threads."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from impress_flexgen.models import compat

ROOT = Path(__file__).resolve().parents[1]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


def _python(code: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@no_cuda
def test_apply_patches_flexgen_only_without_cuda():
    from flexgen import flex_opt, pytorch_backend as pb

    assert compat.apply() is True
    assert flex_opt.torch.cuda.is_available() is False
    assert pb.copy_worker_func is compat.cpu_copy_worker
    # The shim is FlexGen's view only: torch itself is untouched.
    assert torch.cuda.Stream is not flex_opt.torch.cuda.Stream
    with flex_opt.torch.cuda.stream(flex_opt.torch.cuda.Stream()):
        flex_opt.torch.cuda.synchronize()
    # Pinned allocations are refused by CPU-only torch; the patched device never asks.
    dev = pb.TorchDevice("cpu")
    t = dev.allocate((4, 4), np.float16, pin_memory=True)
    assert t.data.shape == (4, 4) and not t.data.is_pinned()


def test_apply_is_a_no_op_with_cuda(monkeypatch):
    """On CUDA, FlexGen runs as published: apply() must not touch it."""
    monkeypatch.setattr(compat, "_applied", False)
    monkeypatch.setattr(compat, "cuda_available", lambda: True)
    from flexgen import flex_opt

    before = flex_opt.torch
    assert compat.apply() is False
    assert flex_opt.torch is before


@pytest.mark.slow
@no_cuda
def test_unpatched_flexgen_fails_on_cpu_as_documented():
    """Guards the premise of the compat layer: plain FlexGen cannot build on CPU-only torch."""
    r = _python("""
        import torch
        from flexgen.flex_opt import OptLM, Policy
        try:
            torch.cuda.Stream()
        except Exception as e:
            print("stream-fails", type(e).__name__)
    """, timeout=120)
    assert "stream-fails" in r.stdout, r.stderr


@pytest.mark.slow
def test_disk_threads_never_hang_exit(tmp_path):
    """A process that builds a runtime with disk placement and forgets to close it exits."""
    r = _python(f"""
        from impress_flexgen.models.runtime import Runtime, RuntimeConfig, Placement
        rt = Runtime(RuntimeConfig(model="opt-tiny", placement=Placement.parse("disk"),
                                   offload_dir={str(tmp_path)!r}))
        out = rt.generate([[5, 6, 7]], max_new_tokens=3)
        print("generated", out.new_ids)
        # no rt.close(): the exit hook must stop FlexGen's copy threads
    """, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "generated" in r.stdout


@pytest.mark.slow
@no_cuda
def test_raw_flexgen_disk_threads_would_hang_exit(tmp_path):
    """Without our exit hook FlexGen's non-daemon copy threads keep the process alive."""
    code = f"""
        from impress_flexgen.models import compat
        compat.apply()
        from flexgen.pytorch_backend import TorchDisk
        disk = TorchDisk({str(tmp_path / 'raw')!r})
        print("built", flush=True)
    """
    with pytest.raises(subprocess.TimeoutExpired):
        _python(code, timeout=15)


def test_failed_copy_raises_instead_of_hanging(tmp_path):
    compat.apply()
    from flexgen.pytorch_backend import TorchDevice, TorchDisk, general_copy

    disk = TorchDisk(str(tmp_path / "d"), num_copy_threads=2)
    compat.register_disk(disk)
    try:
        src = disk.allocate((4, 8), np.float16)
        dst = TorchDevice("cpu").allocate((3, 8), np.float16)  # wrong shape
        general_copy(dst, None, src, None)
        if torch.cuda.is_available():
            pytest.skip("CUDA copy worker is FlexGen's own")
        with pytest.raises(RuntimeError, match="disk copy failed"):
            disk.synchronize()
        # The worker survived: a good copy still goes through.
        ok = TorchDevice("cpu").allocate((4, 8), np.float16)
        general_copy(ok, None, src, None)
        disk.synchronize()
    finally:
        compat.close_disk(disk)
        compat.close_disk(disk)  # idempotent
    assert disk.copy_queue is None


@pytest.mark.parametrize("shape,dtype", [((512,), np.float16), ((3, 5, 7), np.float32),
                                         ((1, 1), np.int64), ((2048, 12, 64), np.float16)])
def test_open_npy_matches_numpy_and_writes_through(tmp_path, shape, dtype):
    path = str(tmp_path / "t.npy")
    want = (np.arange(int(np.prod(shape))) % 1000).reshape(shape).astype(dtype)
    np.save(path, want)
    got = compat.open_npy(path)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    got[(0,) * len(shape)] = 7           # FlexGen's copy threads write into disk tensors
    got.flush()
    assert np.load(path)[(0,) * len(shape)] == 7


def test_open_npy_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match="not a .npy file"):
        compat.open_npy(str(bad))
    fortran = str(tmp_path / "f.npy")
    np.save(fortran, np.asfortranarray(np.ones((3, 4))))
    with pytest.raises(ValueError, match="unsupported"):
        compat.open_npy(fortran)


def test_disk_tensor_reads_bypass_numpys_parser(tmp_path, monkeypatch):
    """numpy's header reader parses with `ast`, which CPython 3.11 cannot run from several
    threads at once; FlexGen's copy threads must not reach it."""
    from flexgen import pytorch_backend as pb

    compat.apply()
    disk = pb.TorchDisk(str(tmp_path / "off"), num_copy_threads=1)
    try:
        t = disk.allocate((4, 8), np.float16)
        t.load_from_np(np.full((4, 8), 3, dtype=np.float16))

        def no_parser(*a, **k):
            raise AssertionError("numpy header parser used")

        monkeypatch.setattr(ast, "literal_eval", no_parser)
        with pytest.raises(AssertionError):   # numpy's reader does use it
            np.lib.format.open_memmap(t.data)
        got = pb.map_to_torch_tensor(t, (slice(1, 3),))
        assert got.shape == (2, 8) and float(got.float().sum()) == 48.0
    finally:
        disk.close_copy_threads()
