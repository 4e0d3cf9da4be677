"""What the GPU check's TTFT rows should take there: store sizes and seconds per row, from
bytes and the figures measured on the GPU machine (a model, not a measurement).

    python -m experiments.gpu_check_expect        # the table in docs/reproduction.md

Figures (../shared/docs/environment.md, measured on the H200 machine; the H100's disk is
assumed alike): cold O_DIRECT reads 1.1 GB/s, direct writes 1.2 GB/s, OPT-30B-shaped fp16
prefill of 5,120 tokens 0.42 s and a 64-token query over them 0.037 s (other models scaled
by their weight bytes). Per row, as experiments.gpu_repro serves it: each prefix inserted
once (prefill, KV written), one warm-up and two measured queries per prefix; the GPU and CPU
tiers (10% and 25% of the pool) spare that share of the loads. impress writes an int4 probe
copy (1/8 of the KV) beside the KV, reorders once after the warm-up (the pool read and
written again) and loads its retained quarter plus the probe copy; as_like and as_h2o_lfu
load every chunk (H2O picks its heads' top-k after loading); recomp only computes. Building
a model draws its random weights on the GPU (assumed 10 GB/s).
"""
from __future__ import annotations

import dataclasses

from experiments.gpu_check import FULL
from experiments.gpu_repro import _kv_per_token, model_workload, weight_bytes
from impress_flexgen.bench.workload import WorkloadConfig
from impress_flexgen.models import resolve

READ, WRITE, DRAW = 1.1e9, 1.2e9, 10e9          # bytes per second
PREFILL_30B, QUERY_30B = 0.42, 0.037            # seconds, OPT-30B, 5,120-token prefix
WEIGHTS_30B = 59.9e9
IN_MEMORY, RETENTION, PROBE = 0.35, 0.25, 0.125


@dataclasses.dataclass
class Expected:
    model: str
    prefixes: int
    prefix_bytes: int
    pool_bytes: int
    weights_bytes: int
    rows: dict          # policy -> seconds
    build_s: float

    @property
    def total_s(self) -> float:
        # impress runs twice (random-weight and replayed selection)
        return self.build_s + sum(self.rows.values()) + self.rows["impress"]


def expected(name: str, sizes=FULL) -> Expected:
    import numpy as np

    spec = resolve(name, None, 0, np.float16)
    wcfg = model_workload(WorkloadConfig(n_prefixes=2, prefix_tokens=sizes.prefix_tokens),
                          _kv_per_token(spec), sizes.max_pool_gib)
    n = wcfg.n_prefixes
    prefix = wcfg.prefix_tokens * _kv_per_token(spec)
    weights = weight_bytes(spec)
    scale = weights / WEIGHTS_30B * wcfg.prefix_tokens / 5120
    prefill, query = PREFILL_30B * scale, QUERY_30B * scale
    loads = 3 * n                                          # warm-up + two queries per prefix
    from_disk = (1 - IN_MEMORY) * prefix / READ            # a full load's disk seconds
    every_chunk = n * (prefill + prefix / WRITE) + loads * (query + from_disk)
    rows = {"recomp": (n + loads) * prefill,
            "as_like": every_chunk, "as_h2o_lfu": every_chunk,
            "impress": n * (prefill + (1 + PROBE) * prefix / WRITE)
            + n * prefix * (1 / READ + 1 / WRITE)
            + loads * (query + (RETENTION + PROBE) * from_disk)}
    return Expected(name, n, prefix, n * prefix, weights, rows, weights / DRAW)


def table(sizes=FULL) -> list[str]:
    gb = 1e9
    lines = ["| model | weights (GB) | prefixes | KV per prefix (GB) | store per row (GB) "
             "| recomp (s) | as_like (s) | as_h2o_lfu (s) | impress (s, each mode) "
             "| model in all (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    total = 0.0
    for name in sizes.models.split(","):
        e = expected(name, sizes)
        total += e.total_s
        r = e.rows
        lines.append(f"| {name} | {e.weights_bytes / gb:.1f} | {e.prefixes} x "
                     f"{sizes.prefix_tokens} | {e.prefix_bytes / gb:.2f} | "
                     f"{(1 + PROBE) * e.pool_bytes / gb:.1f} | {r['recomp']:.0f} | "
                     f"{r['as_like']:.0f} | {r['as_h2o_lfu']:.0f} | {r['impress']:.0f} | "
                     f"{e.total_s:.0f} |")
    lines.append(f"\nAll three models: {total:.0f} s of rows (before per-row overheads).")
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
