"""The I/O benchmark end to end in its quick mode, and the read path it measures."""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
import torch

import disk_layout.io as disk_io
from disk_layout.io import BufferPool, ChecksumMismatch, DiskReader, Extents, ShortRead
from experiments import bench_io

POSITIVE = ["raw_read_GBps", "store_read_GBps", "ratio", "selected_read_GBps",
            "selected_bytes_fraction", "selected_needed_GBps", "total_bytes", "kv_bytes",
            "threads", "chunk_size", "prefixes", "metadata_fraction", "probe_fraction",
            "store_serial_read_GBps", "raw_run_block_read_GBps", "raw_store_files_GBps",
            "build_s"]


@pytest.mark.slow
def test_bench_io_quick(tmp_path):
    out = tmp_path / "io.json"
    assert bench_io.main(["--quick", "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in POSITIVE:
        assert res[key] > 0, key
    assert res["statistic"] == "median"
    assert res["shape"]["n_layers"] == 32 and res["prefix_lengths"] == [512]
    for key in ("raw_read_s", "store_read_s", "selected_read_s", "store_serial_read_s"):
        assert len(res[key]) == res["repeats"] >= 2 and min(res[key]) > 0
    assert res["selected_bytes_fraction"] <= 1
    assert [p.name for p in tmp_path.iterdir()] == ["io.json"]  # the store is gone


def test_bench_io_refuses_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        bench_io.main(["--quick", "--prefix-len", "100", "--dir", str(tmp_path)])
    assert err.value.code == 2
    assert "--prefix-len" in capsys.readouterr().err


# -- the read path ---------------------------------------------------------------------

def test_buffer_pool_never_hands_out_a_buffer_still_viewed():
    pool = BufferPool(max_bytes=8 << 20)
    a = pool.get(1 << 20)
    assert a.data_ptr() % 4096 == 0 and a.numel() == 1 << 20
    view = a[100:200].view(torch.int16)  # a chunk tensor handed to a caller
    a_ptr = a.data_ptr()
    del a
    b = pool.get(1 << 20)
    b_ptr = b.data_ptr()
    assert b_ptr != a_ptr  # still viewed: not reused
    c = pool.get(1 << 20)
    c_ptr = c.data_ptr()
    assert c_ptr not in (a_ptr, b_ptr)
    del view, b, c
    again = [pool.get(1000 << 10) for _ in range(3)]  # nothing views them: all reused
    assert {t.data_ptr() for t in again} == {a_ptr, b_ptr, c_ptr}
    big = pool.get(16 << 20)  # over the pool's size: fresh memory, still aligned
    assert big.data_ptr() % 4096 == 0 and big.numel() == 16 << 20


def _chunk_file(path, n_chunks: int, stride: int, payload: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=n_chunks * stride, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    crcs = np.array([zlib.crc32(data[i * stride:i * stride + payload].tobytes())
                     for i in range(n_chunks)], dtype=np.uint32)
    return data, crcs


@pytest.mark.parametrize("crc", ["fast", "zlib"])
def test_reader_checks_every_extent_on_both_paths(tmp_path, monkeypatch, crc):
    if crc == "zlib":
        monkeypatch.setattr(disk_io, "_crc32_at", None)
    monkeypatch.setattr(disk_io, "MAX_RUN_BYTES", 3 * 8192)  # several runs per request
    path = tmp_path / "f.kv"
    stride, payload, n = 8192, 6144, 10
    data, crcs = _chunk_file(path, n, stride, payload)
    reader = DiskReader(threads=3)
    try:
        ids = np.array([0, 1, 2, 3, 5, 6, 9])
        runs = reader.read_runs(str(path), Extents(ids * stride, stride, payload, crcs[ids]))
        got = [i for run in runs for i in run.members]
        assert got == list(range(len(ids)))
        for run in runs:
            for k, i in enumerate(run.members):
                chunk = run.data[k * stride:(k + 1) * stride].numpy()
                assert np.array_equal(chunk, data[ids[i] * stride:(ids[i] + 1) * stride])
        # One flipped byte in chunk 5 (request index 4), on both the array and list paths.
        raw = bytearray(path.read_bytes())
        raw[5 * stride + 17] ^= 1
        path.write_bytes(bytes(raw))
        reader.forget(str(path))
        with pytest.raises(ChecksumMismatch) as err:
            reader.read_runs(str(path), Extents(ids * stride, stride, payload, crcs[ids]))
        assert err.value.index == 4
        with pytest.raises(ChecksumMismatch) as err:
            reader.read(str(path), [(int(i) * stride, stride) for i in ids],
                        [(payload, int(c)) for c in crcs[ids]])
        assert err.value.index == 4
        # Padding is not checked; without checks nothing is.
        raw[5 * stride + 17] ^= 1
        raw[5 * stride + payload + 1] ^= 1
        path.write_bytes(bytes(raw))
        reader.forget(str(path))
        reader.read_runs(str(path), Extents(ids * stride, stride, payload, crcs[ids]))
        # A truncated file is a short read.
        os.truncate(path, 8 * stride)
        reader.forget(str(path))
        with pytest.raises(ShortRead):
            reader.read_runs(str(path), Extents(ids * stride, stride, payload, crcs[ids]))
    finally:
        reader.close()


def test_reader_descriptor_cache_never_closes_a_busy_descriptor(tmp_path):
    stride = 4096
    files = []
    for i in range(6):
        path = tmp_path / f"{i}.kv"
        _chunk_file(path, 4, stride, stride, seed=i)
        files.append(str(path))
    reader = DiskReader(threads=4, max_open_files=2)
    try:
        handles = [reader.submit(f, [(j * stride, stride) for j in range(4)]) for f in files]
        reader.forget(files[0])  # in use: closed once its reads are done
        for f, h in zip(files, handles):
            runs = reader.wait(h)
            expect = np.frombuffer(open(f, "rb").read(), dtype=np.uint8)
            assert np.array_equal(runs[0].data.numpy(), expect)
        assert len(reader._fds) <= 2
    finally:
        reader.close()
