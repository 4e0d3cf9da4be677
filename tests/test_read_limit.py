"""The disk read limit of DiskReader (a token bucket shared by its threads) and busy time.

A limit is only checked from below (reads take at least bytes / rate, less one burst): a
lower bound holds however loaded the machine is.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

from disk_layout.io import DiskReader, ReadLimit, write_durable

MIB = 1 << 20
RATE = 20e6   # bytes/s


def _file(path, n_mib: int) -> bytes:
    data = os.urandom(n_mib * MIB)
    write_durable(str(path), [(0, data)], len(data))
    return data


def _extents(n_mib: int) -> list[tuple[int, int]]:
    return [(i * MIB, MIB) for i in range(n_mib)]


def _read(reader, path, n_mib: int) -> bytes:
    runs = reader.read_runs(str(path), _extents(n_mib))
    return b"".join(run.data.numpy().tobytes() for run in runs)


def test_limited_read_takes_at_least_bytes_over_rate(tmp_path):
    want = _file(tmp_path / "a.kv", 8)
    reader = DiskReader(threads=2, rate_limit_bytes_s=RATE)   # made now: nothing saved up
    try:
        start = time.monotonic()
        got = _read(reader, tmp_path / "a.kv", 8)
        elapsed = time.monotonic() - start
        bytes_read, busy = reader.counters()
    finally:
        reader.close()
    assert got == want
    floor = (8 * MIB - ReadLimit.MIN_BURST) / RATE   # 0.37 s: one burst may go at once
    assert elapsed >= floor * 0.95
    assert bytes_read == 8 * MIB
    assert floor * 0.95 <= busy <= elapsed + 1e-3   # limiter sleeps count as busy


def test_unlimited_read_is_correct_and_counts_busy_time(tmp_path):
    want = _file(tmp_path / "a.kv", 8)
    for limit in (None, 0):
        reader = DiskReader(threads=3, rate_limit_bytes_s=limit)
        try:
            assert reader.limit is None
            assert reader.counters() == (0, 0.0)
            start = time.monotonic()
            got = _read(reader, tmp_path / "a.kv", 8)
            elapsed = time.monotonic() - start
            assert got == want
            assert reader.bytes_read == 8 * MIB
            assert 0 < reader.busy_s <= elapsed + 1e-3
            idle = reader.busy_s
            time.sleep(0.01)
            assert reader.busy_s == idle   # nothing in flight: busy time stands still
        finally:
            reader.close()


def test_threads_share_one_bucket(tmp_path):
    want = {name: _file(tmp_path / name, 4) for name in ("a.kv", "b.kv")}
    reader = DiskReader(threads=4, rate_limit_bytes_s=RATE)
    got: dict[str, bytes] = {}
    barrier = threading.Barrier(2)

    def read(name):
        barrier.wait()
        got[name] = _read(reader, tmp_path / name, 4)

    try:
        threads = [threading.Thread(target=read, args=(n,)) for n in want]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
    finally:
        reader.close()
    assert got == want
    # Each read alone is one 4 MiB run (0.16 s at this rate); together they share the
    # bucket, so 8 MiB go at the one rate.
    assert elapsed >= (8 * MIB - ReadLimit.MIN_BURST) / RATE * 0.95


@pytest.mark.parametrize("bad", [-1, -20e6, float("nan")])
def test_bad_limit_is_refused(bad):
    with pytest.raises(ValueError, match="read limit"):
        DiskReader(threads=1, rate_limit_bytes_s=bad)


def test_infinite_limit_is_unlimited():
    reader = DiskReader(threads=1, rate_limit_bytes_s=float("inf"))
    try:
        assert reader.limit is None
    finally:
        reader.close()
