"""capacity: a store with room for about three and a half prefixes takes ten: it evicts,
stays under its capacity (counted and on disk), serves the newest exact and what is left
of older ones exact, and leaves no file behind."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from impress_flexgen.store import CorruptNode, PrefixStore, StoreFull

from ..kv import C, SHAPE, expected_bits, kv_from_bits, store_config, tensor_bits
from ..readback import orphans, prefix_exact, read_prefix
from ..registry import Context, fault


def capacity(base: Path, seed: int, failures: list[str]) -> dict:
    rng = np.random.default_rng([seed, 3])
    n = 4 * C
    tokens = []
    for i in range(10):  # every other prefix shares its first chunks with the one before
        new = rng.integers(0, 1 << 20, size=n + 5).astype(np.int32)
        if i % 2 and tokens:
            new[:2 * C] = tokens[-1][:2 * C]
        tokens.append(new)
    with PrefixStore(base / "capacity-size", SHAPE, store_config("int4")) as probe:
        probe.insert(tokens[0], 0, kv_from_bits(expected_bits(tokens[0][:n])))
        one = probe.inspect().accounting.disk_bytes()
    cap = int(3.5 * one)
    res = {"capacity_bytes": cap, "prefix_bytes": one, "over_capacity": 0, "newest_missed": 0,
           "stale_reads": 0, "store_full": 0}
    config = store_config("int4", disk_capacity_bytes=cap)
    with PrefixStore(base / "capacity", SHAPE, config) as store:
        for i, t in enumerate(tokens):
            match = store.match_prefix(t)
            try:
                store.insert(t, match.length, kv_from_bits(expected_bits(t[:n]), match.length))
            except StoreFull as exc:
                res["store_full"] += 1
                failures.append(f"capacity: insert {i} raised StoreFull: {exc}")
            finally:
                store.release(match)
            on_disk = sum(f.stat().st_size for f in (store.inspect().state.dir / "data").iterdir())
            if store.inspect().accounting.disk_bytes() > cap or on_disk > cap:
                res["over_capacity"] += 1
                failures.append(f"capacity: after insert {i}: {store.inspect().accounting.disk_bytes()} bytes "
                                f"counted, {on_disk} on disk, capacity {cap}")
            if not prefix_exact(store, t):
                res["newest_missed"] += 1
                failures.append(f"capacity: newest prefix {i} not served bit-exact")
        for j, older in enumerate(tokens):  # what is left of older ones is exact
            match = store.match_prefix(older)
            try:
                got = read_prefix(store, match)
                want = expected_bits(older[:match.length])
                why = None if all(np.array_equal(tensor_bits(k), want[layer, 0]) and
                                  np.array_equal(tensor_bits(v), want[layer, 1])
                                  for layer, (k, v) in enumerate(got)) else "bits differ"
            except CorruptNode as exc:
                why = str(exc)
            finally:
                store.release(match)
            if why:
                res["stale_reads"] += 1
                failures.append(f"capacity: stored part of prefix {j}: {why}")
        res["evictions"] = store.inspect().state.metrics.evictions
        left = orphans(store)
    if res["evictions"] == 0:
        failures.append("capacity: no eviction happened")
    if left:
        failures.append(f"capacity: files left in data/: {left}")
    return res


@fault("capacity", orphans=None)
def run(ctx: Context) -> dict:
    return capacity(ctx.base, ctx.seed, ctx.failures)
