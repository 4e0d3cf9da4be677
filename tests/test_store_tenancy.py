"""What a store serves to whom: exact KV never mixed with KV computed over a selection of a
prefix, tenants (namespaces) never sharing a node; store files private to their owner; a
full disk makes room instead of never storing again."""
from __future__ import annotations

import errno
import functools
import os
import sqlite3
import stat

import numpy as np
import pytest

from impress_flexgen.store import ModelShape, PrefixStore, StoreConfig, StoreWriteFailed
from tests.helpers.kv import seeded_kv

SHAPE = ModelShape("tenancy", n_layers=2, n_kv_heads=2, head_dim=16, fingerprint="f" * 64)
C = 16


def config(**kw):
    return StoreConfig(**{"chunk_size": C, "probe_heads": (0,), "probe_format": "fp16",
                          "reorder_interval": 0, "direct_io": False, **kw})


make_kv = functools.partial(seeded_kv, SHAPE)     # make_kv(n, seed)


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 40000, n).astype(np.int32)


def matched(store, t, namespace="", exact_only=False) -> int:
    m = store.match_prefix(t, namespace, exact_only)
    store.release(m)
    return m.length


# -- tenants ------------------------------------------------------------------------------
def test_namespaces_never_share_a_prefix_and_stay_apart_after_reopening(tmp_path):
    t = tokens(1, 4 * C)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(t, 0, make_kv(4 * C, 1), namespace="key-A")
        assert matched(store, t, "key-A") == 4 * C
        assert matched(store, t) == 0 and matched(store, t, "key-B") == 0
        store.insert(t, 0, make_kv(4 * C, 2))             # the shared namespace's own copy
        assert matched(store, t) == 4 * C
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        assert matched(store, t, "key-A") == 4 * C and matched(store, t, "key-B") == 0
        assert matched(store, t) == 4 * C
        assert {n.namespace for n in store.inspect().state.tree.nodes.values()} >= {""}
    raw = (tmp_path / "s" / "store.sqlite").read_bytes()
    assert b"key-A" not in raw                            # a digest is kept, not the key


def test_a_split_keeps_its_namespace(tmp_path):
    a, b = tokens(2, 4 * C), tokens(2, 4 * C)
    b[2 * C:] += 1
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(a, 0, make_kv(4 * C, 1), namespace="t")
        store.insert(b, 2 * C, [(k[:, 2 * C:], v[:, 2 * C:]) for k, v in make_kv(4 * C, 3)],
                     namespace="t")
        assert matched(store, b, "t") == 4 * C and matched(store, a, "t") == 4 * C
        assert matched(store, a) == 0
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        assert matched(store, b, "t") == 4 * C and len(store.inspect().state.tree) == 3


# -- exactness ----------------------------------------------------------------------------
def test_an_exact_reader_never_matches_inexact_kv(tmp_path):
    t = tokens(3, 4 * C)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(t[:2 * C], 0, make_kv(2 * C, 1))                 # exact
        store.insert(t, 2 * C, make_kv(2 * C, 2), exact=False)        # computed sparsely
        assert matched(store, t) == 4 * C
        assert matched(store, t, exact_only=True) == 2 * C
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:     # the flag persists
        assert matched(store, t, exact_only=True) == 2 * C and matched(store, t) == 4 * C


def test_exact_kv_supersedes_the_inexact_copy(tmp_path):
    t = tokens(4, 4 * C)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        (old,) = store.insert(t, 0, make_kv(4 * C, 1), exact=False)
        files = [e.path for e in old.layers]
        store.insert(t, 0, make_kv(4 * C, 2), exact=True)
        assert matched(store, t, exact_only=True) == 4 * C
        assert store.inspect().state.metrics.superseded == 1 and not old.live
        assert not any(os.path.exists(f) for f in files)
        assert all(n.exact for n in store.inspect().state.tree.nodes.values())


def test_an_inexact_copy_in_use_is_not_replaced(tmp_path):
    t = tokens(5, 2 * C)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(t, 0, make_kv(2 * C, 1), exact=False)
        held = store.match_prefix(t)                       # a request reads it right now
        with pytest.raises(StoreWriteFailed, match="in use"):
            store.insert(t, 0, make_kv(2 * C, 2), exact=True)
        store.release(held)
        store.insert(t, 0, make_kv(2 * C, 2), exact=True)
        assert matched(store, t, exact_only=True) == 2 * C


def test_exact_kv_below_an_inexact_prefix_is_inexact_by_descent(tmp_path):
    t = tokens(6, 4 * C)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(t[:2 * C], 0, make_kv(2 * C, 1), exact=False)
        held = store.match_prefix(t)
        store.insert(t, 2 * C, make_kv(2 * C, 2), exact=True)
        store.release(held)
        assert matched(store, t) == 4 * C and matched(store, t, exact_only=True) == 0


def test_a_damaged_exact_flag_is_caught_by_the_row_checksum(tmp_path):
    t = tokens(7, 2 * C)
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(t, 0, make_kv(2 * C, 1), exact=False)
    db = sqlite3.connect(tmp_path / "s" / "store.sqlite")
    db.execute("UPDATE nodes SET exact = 1")               # inexact KV passed off as exact
    db.commit()
    db.close()
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        assert matched(store, t) == 0 and store.inspect().state.metrics.invalid_rows == 1


# -- files ----------------------------------------------------------------------------------
def test_store_files_are_private_to_their_owner(tmp_path):
    old = os.umask(0o022)
    try:
        with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
            store.insert(tokens(8, 2 * C), 0, make_kv(2 * C, 1))
            paths = [store.inspect().state.dir, store.inspect().state.data_dir, store.inspect().state.dir / "store.sqlite",
                     store.inspect().state.dir / "store.lock", *store.inspect().state.data_dir.iterdir()]
            wal = store.inspect().state.dir / "store.sqlite-wal"
            if wal.exists():
                paths.append(wal)
            for path in paths:
                assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    finally:
        os.umask(old)


def test_an_older_world_readable_store_is_made_private_when_opened(tmp_path):
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        store.insert(tokens(9, 2 * C), 0, make_kv(2 * C, 1))
    for path in (tmp_path / "s", tmp_path / "s" / "store.sqlite"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    PrefixStore(tmp_path / "s", SHAPE, config()).close()
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "s" / "store.sqlite").stat().st_mode) == 0o600


def test_a_full_disk_evicts_unlocked_leaves_and_stores_the_new_prefix(tmp_path, monkeypatch):
    """No --disk-capacity-gb: ENOSPC from the disk itself makes room like a capacity."""
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        olds = [tokens(20 + i, 2 * C) for i in range(3)]
        for i, t in enumerate(olds):
            store.insert(t, 0, make_kv(2 * C, i))
        write = store.inspect().files.write_layer_file
        full = {"left": 1}

        def disk_full(*args, **kwargs):
            if full["left"]:
                full["left"] -= 1
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(*args, **kwargs)
        monkeypatch.setattr(store.inspect().files, "write_layer_file", disk_full)
        monkeypatch.setattr(store.inspect().files, "free_bytes", lambda: None)   # statvfs says nothing
        new = tokens(30, 2 * C)
        store.insert(new, 0, make_kv(2 * C, 9))
        assert matched(store, new) == 2 * C
        assert store.inspect().state.metrics.evictions >= 1
        assert sum(matched(store, t) > 0 for t in olds) < 3


@pytest.mark.slow
def test_a_small_disk_keeps_metadata_room_and_stores_every_prefix(tmp_path):
    """No capacity set, on a file system of 10.5 MiB that every file of the store counts
    against (the metadata database and its log too, which SQLite writes itself): each new
    prefix is stored, older unlocked ones evicted as the room runs out, and the layer files
    leave the headroom free. Files that took the disk's last bytes would leave SQLite no
    room to record even the eviction that frees them: inserts then fail for good, with old
    leaves still on disk."""
    from experiments.crash_test.fake_os import SmallDiskOS
    from experiments.crash_test.patching import patched_os

    shape = ModelShape("small-disk", n_layers=2, n_kv_heads=8, head_dim=64,
                       fingerprint="e" * 64)
    n = 8 * C                                    # 512 KiB of layer files a prefix
    headroom = 8 << 20                           # StoreConfig's default (checked below)
    disk = SmallDiskOS(tmp_path / "s", capacity=headroom + (5 << 19))
    news = [tokens(100 + i, n) for i in range(24)]
    with patched_os(disk), PrefixStore(tmp_path / "s", shape, config()) as store:
        for i, t in enumerate(news):
            store.insert(t, 0, seeded_kv(shape, n, 100 + i))
            assert matched(store, t) == n, f"prefix {i} not stored"
            free = disk.capacity - disk.used()
            assert free >= headroom // 2, f"after prefix {i}: {free} bytes free"
        assert store.inspect().state.metrics.evictions >= 24 - 5
        assert sum(matched(store, t) == n for t in news[:-1]) >= 2   # kept as room allows
    assert disk.peak <= disk.capacity
    assert StoreConfig().disk_headroom_bytes == headroom


def test_a_passing_enospc_on_a_disk_with_room_evicts_nothing(tmp_path, monkeypatch):
    with PrefixStore(tmp_path / "s", SHAPE, config()) as store:
        old = tokens(40, 2 * C)
        store.insert(old, 0, make_kv(2 * C, 1))

        def disk_full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(store.inspect().files, "write_layer_file", disk_full)
        with pytest.raises(StoreWriteFailed):
            store.insert(tokens(41, 2 * C), 0, make_kv(2 * C, 2))
        assert matched(store, old) == 2 * C and store.inspect().state.metrics.evictions == 0
