"""Layer-file I/O refuses what is not a regular file, never blocks other reads on one
bad path, reports every read failure as OSError, and never leaves temporary files or
follows links when writing."""
from __future__ import annotations

import errno
import os
import threading
import zlib

import numpy as np
import pytest

import disk_layout.io as disk_io
from disk_layout.io import (
    DiskReader,
    NotRegularFile,
    ShortRead,
    is_regular_file,
    open_regular,
    write_durable,
)

STRIDE = 4096


def _file(path, n: int = 4, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, n * STRIDE, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


@pytest.fixture
def reader():
    r = DiskReader(threads=2)
    yield r
    r.close()


def _read_all(reader, path, n=4) -> bytes:
    runs = reader.read_runs(str(path), [(i * STRIDE, STRIDE) for i in range(n)])
    return b"".join(run.data.numpy().tobytes() for run in runs)


def test_fifo_is_refused_promptly_and_blocks_no_other_read(tmp_path, reader):
    fifo = tmp_path / "fifo.kv"
    os.mkfifo(fifo)
    good = tmp_path / "good.kv"
    want = _file(good)
    outcome: dict[str, object] = {}

    def read_fifo():
        try:
            reader.submit(str(fifo), [(0, STRIDE)])
            outcome["fifo"] = "opened"
        except OSError as exc:
            outcome["fifo"] = exc

    def read_good():
        outcome["good"] = _read_all(reader, good)

    t1 = threading.Thread(target=read_fifo, daemon=True)
    t2 = threading.Thread(target=read_good, daemon=True)
    try:
        t1.start()
        t1.join(0.2)
        t2.start()
        t1.join(3)
        t2.join(3)
        assert not t1.is_alive() and not t2.is_alive(), "a read blocked on the FIFO"
        assert isinstance(outcome["fifo"], NotRegularFile)
        assert str(fifo) in str(outcome["fifo"])
        assert outcome["good"] == want
    finally:
        _unblock(fifo, t1, t2)


def _unblock(fifo, *threads) -> None:
    """Hold a writer open on the FIFO while the threads finish: an open() stuck waiting
    for one returns, so no thread (or lock) is left held after a failure."""
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        for t in threads:
            t.join(5)
    finally:
        os.close(fd)


@needs_proc
def test_directory_is_refused_at_submit_without_leaking(tmp_path, reader):
    d = tmp_path / "dir.kv"
    d.mkdir()
    before = _open_fds()
    for _ in range(3):
        with pytest.raises(NotRegularFile) as err:
            reader.submit(str(d), [(0, STRIDE)])
        assert isinstance(err.value, OSError) and err.value.errno == errno.EINVAL
        assert "directory" in str(err.value)
    assert _open_fds() == before and not reader._fds


@needs_proc
def test_symlink_is_not_followed(tmp_path, reader):
    target = tmp_path / "victim"
    want = _file(target, seed=3)
    link = tmp_path / "link.kv"
    link.symlink_to(target)
    before = _open_fds()
    with pytest.raises(OSError) as err:
        reader.submit(str(link), [(0, STRIDE)])
    assert err.value.errno == errno.ELOOP
    assert _open_fds() == before and not reader._fds
    assert target.read_bytes() == want
    assert _read_all(reader, target) == want
    assert not is_regular_file(link) and is_regular_file(target)
    assert not is_regular_file(tmp_path / "missing") and not is_regular_file(tmp_path)


def test_open_regular_only_opens_regular_files(tmp_path):
    f = tmp_path / "f"
    _file(f, 1)
    fd = open_regular(str(f))
    try:
        assert os.get_blocking(fd)
        assert os.pread(fd, 8, 0) == f.read_bytes()[:8]
    finally:
        os.close(fd)
    os.mkfifo(tmp_path / "p")
    with pytest.raises(NotRegularFile):
        open_regular(str(tmp_path / "p"))
    with pytest.raises(FileNotFoundError):
        open_regular(str(tmp_path / "nothing"))


def test_drop_page_cache_refuses_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "p")
    done = []

    def run():
        try:
            disk_io.drop_page_cache(str(tmp_path / "p"))
        except OSError as exc:
            done.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(3)
    try:
        assert not t.is_alive() and isinstance(done[0], NotRegularFile)
    finally:
        _unblock(tmp_path / "p", t)


def test_eio_in_a_worker_reaches_wait_as_oserror(tmp_path, reader, monkeypatch):
    path = tmp_path / "f.kv"
    want = _file(path)
    calls = {"n": 0}
    real = os.preadv

    def failing(fd, buffers, offset, *rest):
        calls["n"] += 1
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(os, "preadv", failing)
    handle = reader.submit(str(path), [(0, STRIDE), (2 * STRIDE, STRIDE)])
    with pytest.raises(OSError) as err:
        reader.wait(handle)
    assert err.value.errno == errno.EIO and calls["n"] >= 1
    with pytest.raises(OSError):
        reader.read(str(path), [(0, STRIDE)])
    monkeypatch.setattr(os, "preadv", real)
    # The descriptor was released each time: the reader still works and can forget it.
    assert all(e.users == 0 for e in reader._fds.values())
    assert _read_all(reader, path) == want
    reader.forget(str(path))
    assert not reader._fds


def test_truncated_file_is_a_short_read(tmp_path, reader):
    path = tmp_path / "f.kv"
    _file(path)
    os.truncate(path, 2 * STRIDE + 100)        # not a multiple of the alignment
    with pytest.raises(ShortRead) as err:
        reader.read(str(path), [(0, 4 * STRIDE)])
    assert isinstance(err.value, OSError) and str(path) in str(err.value)


@needs_proc
def test_open_racing_forget_is_not_cached(tmp_path, reader, monkeypatch):
    path = tmp_path / "f.kv"
    want = _file(path)
    real_open = reader._open

    def open_then_forget(p):
        out = real_open(p)
        reader.forget(p)            # the store forgets the file while we open it
        return out

    before = _open_fds()
    monkeypatch.setattr(reader, "_open", open_then_forget)
    assert _read_all(reader, path) == want
    assert str(path) not in reader._fds and _open_fds() == before


@needs_proc
def test_concurrent_open_of_one_path_keeps_one_descriptor(tmp_path, reader, monkeypatch):
    path = tmp_path / "f.kv"
    want = _file(path)
    real_open = reader._open
    state = {"first": True}

    def open_while_another_opens(p):
        out = real_open(p)
        if state["first"]:
            state["first"] = False
            reader._release(reader._acquire(p))   # the other thread wins the race
        return out

    before = _open_fds()
    monkeypatch.setattr(reader, "_open", open_while_another_opens)
    assert _read_all(reader, path) == want
    assert len(reader._fds) == 1 and reader._fds[str(path)].users == 0
    assert _open_fds() == before + 1


# -- write_durable ----------------------------------------------------------------------
def _leftovers(d):
    return sorted(p.name for p in d.iterdir())


def test_write_durable_fsync_eio_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "a.kv"

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError) as err:
        write_durable(str(target), [(0, b"x" * 100)], STRIDE)
    assert err.value.errno == errno.EIO
    assert _leftovers(tmp_path) == []


def test_write_durable_directory_fsync_eio_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "a.kv"
    real = os.fsync
    calls = {"n": 0}

    def second_fails(fd):
        calls["n"] += 1
        if calls["n"] == 2:                     # the directory's fsync, after the rename
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(fd)

    monkeypatch.setattr(os, "fsync", second_fails)
    with pytest.raises(OSError):
        write_durable(str(target), [(0, b"x" * 100)], STRIDE)
    assert _leftovers(tmp_path) == []


def test_write_durable_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "a.kv"
    (tmp_path / "a.kv.tmp").symlink_to(victim)        # the old fixed temporary name
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append(src)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    payload = bytes(range(256)) * 4
    write_durable(str(target), [(0, payload)], STRIDE)
    assert victim.read_bytes() == b"precious"
    assert target.read_bytes() == payload + b"\0" * (STRIDE - len(payload))
    (src,) = seen
    assert os.path.dirname(src) == str(tmp_path) and src.endswith(".tmp")
    assert src != str(target) + ".tmp"
    assert _leftovers(tmp_path) == ["a.kv", "a.kv.tmp", "victim"]


def test_write_durable_temporary_names_are_exclusive(tmp_path, monkeypatch):
    """A temporary name that already exists is never opened (O_EXCL): the next is used."""
    target = tmp_path / "a.kv"
    real_open = os.open
    flags_seen = []

    def spy(path, flags, *rest):
        flags_seen.append(flags)
        return real_open(path, flags, *rest)

    monkeypatch.setattr(os, "open", spy)
    write_durable(str(target), [(0, b"abc")], 3)
    need = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    assert flags_seen[0] & need == need
    assert target.read_bytes() == b"abc" and zlib.crc32(target.read_bytes())


@pytest.mark.parametrize("packed", [True, False])
def test_a_section_image_holds_each_chunk_at_its_offset(packed):
    """A K (or V) section built in one copy: every chunk's bytes at its offset, padding
    zero, and each chunk's CRC that of its own bytes."""
    import torch

    from disk_layout.format import LayerFileLayout, section_image

    layout = LayerFileLayout(n_tokens=48, chunk_size=16, n_kv_heads=3, head_dim=64, n_probe=1,
                             probe_format="fp16", packed=packed)
    kv = torch.randn(3, 48, 64, generator=torch.Generator().manual_seed(0)).half()
    image, crcs = section_image(kv, layout)
    assert image.nbytes == layout.section_bytes and len(crcs) == layout.n_chunks
    base = layout.chunk_offset("k", 0)
    used = np.zeros(image.nbytes, dtype=bool)
    for i in range(layout.n_chunks):
        want = kv[:, i * 16:(i + 1) * 16].contiguous().numpy().tobytes()
        at = layout.chunk_offset("k", i) - base
        assert image[at:at + len(want)].tobytes() == want
        assert crcs[i] == zlib.crc32(want) & 0xFFFFFFFF
        used[at:at + len(want)] = True
    assert not image[~used].any()
