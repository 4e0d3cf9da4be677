"""Scratch directories: a killed owner's are swept by the next start, nothing else ever is."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from impress_flexgen.models import weights
from impress_flexgen.models.conversion_keys import INDEX
from impress_flexgen.store import scratch

ROOT = Path(__file__).resolve().parents[1]

# Makes a scratch directory with a file in it, says where, then waits to be killed.
CHILD = """
import sys, time
from pathlib import Path
from impress_flexgen.store import scratch
path = scratch.make(Path(sys.argv[1]), "flexgen")
(path / "weights.bin").write_bytes(b"x" * 4096)
print(path, flush=True)
time.sleep(120)
"""


def _start_owner(root: Path) -> tuple[subprocess.Popen, Path]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    path = Path(child.stdout.readline().strip())
    assert path.parent == root and path.is_dir()
    return child, path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _name(label: str, pid: int, start: int, host: str | None = None) -> str:
    return f"{label}-{host or scratch.host_key()}-{pid}-{start}-0123abcd"


def test_a_sigkilled_owners_directory_is_swept(tmp_path):
    child, path = _start_owner(tmp_path)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert path.is_dir()  # SIGKILL runs no cleanup
    assert scratch.sweep_stale(tmp_path) == [path]
    assert list(tmp_path.iterdir()) == []


def test_a_live_owners_directory_is_kept(tmp_path):
    child, path = _start_owner(tmp_path)
    try:
        assert scratch.sweep_stale(tmp_path) == []
        mine = scratch.make(tmp_path, "store")  # sweeps too
        assert path.is_dir() and (path / "weights.bin").exists() and mine.is_dir()
    finally:
        child.kill()
        child.wait()
    assert scratch.sweep_stale(tmp_path) == [path]
    assert mine.is_dir()  # ours: this process is alive


def test_a_reused_pid_does_not_keep_a_directory(tmp_path):
    """The name's pid is alive (ours) but was started at another time: the owner is gone."""
    start = scratch.start_time(os.getpid())
    stale = tmp_path / _name("flexgen", os.getpid(), start + 1)
    stale.mkdir()
    live = tmp_path / _name("flexgen", os.getpid(), start)
    live.mkdir()
    assert scratch.sweep_stale(tmp_path) == [stale]
    assert live.is_dir()


def test_only_exact_scratch_directories_are_touched(tmp_path):
    dead = _dead_pid()
    keep = [
        tmp_path / f"flexgen-{dead}-abcdefgh",                 # the old naming: not ours
        tmp_path / _name("flexgen", dead, 5)[:-1],              # suffix too short
        tmp_path / (_name("flexgen", dead, 5) + "x"),           # suffix too long
        tmp_path / _name("Flexgen", dead, 5),                   # label not lowercase
        tmp_path / _name("flexgen", dead, 5, host="00000000"),  # made on another host
        tmp_path / "notes",
    ]
    for d in keep:
        d.mkdir()
        (d / "f").write_text("keep")
    plain_file = tmp_path / _name("store", dead, 7)  # matches, but is a file
    plain_file.write_text("keep")
    stale = tmp_path / _name("store", dead, 9)
    (stale / "sub").mkdir(parents=True)
    assert scratch.sweep_stale(tmp_path) == [stale]
    assert all((d / "f").read_text() == "keep" for d in keep)
    assert plain_file.read_text() == "keep"


def test_symbolic_links_are_never_followed(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "precious").write_text("data")
    dead = _dead_pid()
    link = root / _name("flexgen", dead, 3)
    link.symlink_to(outside, target_is_directory=True)
    stale = root / _name("flexgen", dead, 4)
    stale.mkdir()
    (stale / "escape").symlink_to(outside, target_is_directory=True)
    (stale / "escape-file").symlink_to(outside / "precious")
    assert scratch.sweep_stale(root) == [stale]
    assert link.is_symlink()  # a link named like a scratch directory is left alone
    assert (outside / "precious").read_text() == "data"


def test_make_refuses_a_root_that_is_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(NotADirectoryError):
        scratch.make(blocker, "flexgen")
    with pytest.raises(NotADirectoryError):
        scratch.make(blocker / "below", "flexgen")
    with pytest.raises(ValueError):
        scratch.make(tmp_path, "Bad-Label")


def test_the_scratch_context_removes_its_directory(tmp_path):
    with pytest.raises(RuntimeError):
        with scratch.directory(tmp_path, "store") as path:
            (path / "x").write_text("")
            raise RuntimeError
    assert list(tmp_path.iterdir()) == []


def test_runtime_creation_sweeps_its_offload_root(tmp_path):
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    stale = tmp_path / _name("flexgen", _dead_pid(), 1)
    stale.mkdir()
    (stale / "w").write_bytes(b"0" * 100)
    with Runtime(RuntimeConfig(model="opt-tiny", offload_dir=str(tmp_path))) as rt:
        assert not stale.exists()
        assert scratch.NAME_RE.match(Path(rt.env.disk.path).name)
    assert list(tmp_path.iterdir()) == []


def test_a_temporary_store_sweeps_its_root_and_is_removed(tmp_path, tiny_runtimes):
    from impress_flexgen.bench.runner import RunConfig, prepared
    from impress_flexgen.bench.workload import Workload, WorkloadConfig
    from impress_flexgen.tiers import TierConfig

    stale = tmp_path / _name("store", _dead_pid(), 1)
    stale.mkdir()
    prefix = list(range(100, 164))
    wl = Workload(WorkloadConfig(n_prefixes=1, prefix_tokens=64), [prefix], [], [], ["x"])
    seen = []
    with prepared(tiny_runtimes["opt-tiny"], wl, RunConfig("impress", "impress"), TierConfig(),
                  store_root=tmp_path) as ready:
        seen = list(tmp_path.iterdir())
        assert ready.store is not None
    assert not stale.exists()
    assert len(seen) == 1 and scratch.NAME_RE.match(seen[0].name)
    assert list(tmp_path.iterdir()) == []


def test_a_conversion_sweeps_its_root(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / _name("convert", _dead_pid(), 1)
    stale.mkdir()
    src = tmp_path / "src.bin"
    src.write_bytes(b"x")
    done = weights.converted_dir(cache, "m", [src], np.float16,
                                 lambda out: weights.save_tensor(out, "a", np.ones(3)))
    assert not stale.exists()
    assert sorted(p.name for p in cache.iterdir()) == sorted([done.name, INDEX])


@pytest.mark.slow
def test_a_sigkilled_run_leaves_nothing_after_the_next_start(tmp_path):
    """The whole path: a real run killed mid-generation, then a new runtime on that root."""
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    off = tmp_path / "off"
    child = subprocess.Popen(
        [sys.executable, "-m", "impress_flexgen.run", "--model", "opt-tiny", "--prompt-ids", "5",
         "--max-new-tokens", "1000", "--placement", "disk", "--offload-dir", str(off)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (off.is_dir() and any(off.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.poll() is None and any(off.iterdir())
    finally:
        child.kill()
        child.wait()
    assert len(list(off.iterdir())) == 1
    with Runtime(RuntimeConfig(model="opt-tiny", offload_dir=str(off))):
        assert len(list(off.iterdir())) == 1  # only the new runtime's own
    assert list(off.iterdir()) == []


def _key_with(monkeypatch, tmp_path, boot_id: str) -> str:
    """The machine key a host of this name would have with `boot_id`."""
    f = tmp_path / f"boot-{boot_id}"
    f.write_text(boot_id + "\n")
    with monkeypatch.context() as m:
        m.setattr(scratch, "_MACHINE_IDS", (str(f),), raising=False)
        return scratch.host_key()


def test_a_host_of_the_same_name_is_another_machine(tmp_path, monkeypatch):
    # Two hosts named alike share a home over NFS: pids of the other are not ours to judge.
    monkeypatch.setattr(scratch.socket, "gethostname", lambda: "node")
    root = tmp_path / "root"
    root.mkdir()
    here = _key_with(monkeypatch, tmp_path, "0f1e2d3c-aaaa-bbbb-cccc-000000000001")
    there = _key_with(monkeypatch, tmp_path, "0f1e2d3c-aaaa-bbbb-cccc-000000000002")
    assert here != there
    other = root / _name("flexgen", _dead_pid(), 5, host=there)
    other.mkdir()
    mine = root / _name("flexgen", _dead_pid(), 6, host=here)
    mine.mkdir()
    f = tmp_path / "boot-0f1e2d3c-aaaa-bbbb-cccc-000000000001"
    monkeypatch.setattr(scratch, "_MACHINE_IDS", (str(f),), raising=False)
    assert scratch.sweep_stale(root) == [mine]
    assert other.is_dir()


def test_an_empty_machine_id_falls_back(tmp_path, monkeypatch):
    empty, zeros = tmp_path / "empty", tmp_path / "zeros"
    empty.write_text("\n")
    zeros.write_text("0" * 32 + "\n")
    monkeypatch.setattr(scratch.socket, "gethostname", lambda: "node")
    monkeypatch.setattr(scratch, "_MACHINE_IDS", (str(empty), str(zeros)))
    assert scratch._machine_id() == "host=node"


def test_another_users_directory_is_never_swept(tmp_path, monkeypatch):
    stale = tmp_path / _name("flexgen", _dead_pid(), 7)
    stale.mkdir()
    uid = stale.stat().st_uid
    monkeypatch.setattr(scratch.os, "getuid", lambda: uid + 1)
    assert scratch.sweep_stale(tmp_path) == []
    assert stale.is_dir()
    monkeypatch.setattr(scratch.os, "getuid", lambda: uid)
    assert scratch.sweep_stale(tmp_path) == [stale]
