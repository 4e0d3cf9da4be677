"""corruption: bit flips (K, V, probe), truncations and deleted files in (node, layer) files
of nodes none of which lies below another; every prefix is served like a request
(CorruptNode: quarantine, recompute, insert) and must then be exact."""
from __future__ import annotations

from ..damage import corruption
from ..registry import Context, fault


@fault("corruption")
def run(ctx: Context) -> dict:
    q = ctx.quick
    res = corruption(ctx.base, n_prefixes=12 if q else 40, faults_per_store=4 if q else 12,
                     seed=ctx.seed, failures=ctx.failures)
    ctx.report.count("corruption", injected=res["injected"], detected=res["detected"],
                     served_wrong=res["served_corrupt"], lost=res["not_repaired"])
    return res
