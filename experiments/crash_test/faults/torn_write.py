"""torn_write: a suffix of a referenced file truncated or overwritten (a lying fsync); the
quarantine stays within StoreConfig.quarantine_bytes and is counted. A tear that touches
only padding goes undetected: harmless if the node reads back exact."""
from __future__ import annotations

from ..damage import TORN, corruption
from ..registry import Context, fault

QUARANTINE_BYTES = 64 << 10


@fault("torn_write")
def run(ctx: Context) -> dict:
    q, report = ctx.quick, ctx.report
    res = corruption(ctx.base, 10 if q else 30, 3 if q else 10, ctx.seed, ctx.failures,
                     kinds=TORN, cls="torn_write", quarantine_bytes=QUARANTINE_BYTES,
                     fail=lambda m: report.fail("torn_write", m))
    report.count("torn_write", injected=res["injected"], detected=res["detected"],
                 harmless=res["harmless"], served_wrong=res["served_corrupt"],
                 lost=res["not_repaired"])
    return res
