"""Bytes read and KL of the selection variants, side by side on one workload.

    python -m experiments.selection_sweep [--quick] [--json PATH]

Chunk size, agreement threshold and probe heads of `impress`, with `full`, `random` and
`as_h2o_lfu` for reference; natural-text prefixes on smollm2-135m; no tiers (every byte comes
from disk), so bytes_loaded_fraction is the selection's own footprint (probe copy included).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from impress_flexgen.bench.runner import RunConfig, run_workload
from impress_flexgen.bench.workload import WorkloadConfig, build_workload
from impress_flexgen.entrypoints.args import ArgumentParser, finite_float, write_json
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.tiers import TierConfig


def runs(retention: float, chunk_sizes) -> list[RunConfig]:
    out = [RunConfig("full", "full", chunk_size=chunk_sizes[0])]
    for cs in chunk_sizes:
        for threshold in ("none", "adaptive"):
            for heads in ("group", "all"):
                out.append(RunConfig(f"c{cs}-{threshold}-{heads}", "impress:all", retention,
                                     threshold=threshold, probe_heads=heads, chunk_size=cs))
    out.append(RunConfig("random", "random", retention, chunk_size=chunk_sizes[0]))
    out.append(RunConfig("as_h2o_lfu", "as_h2o_lfu", retention, chunk_size=chunk_sizes[0]))
    return out


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m experiments.selection_sweep",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--retention", type=finite_float(0, 1, low_open=True), default=0.25)
    p.add_argument("--quick", action="store_true", help="1 prefix x 512 tokens, 2 queries")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    wcfg = WorkloadConfig(n_prefixes=3, prefix_tokens=1024, queries_per_prefix=3,
                          warmup_queries=2)
    chunk_sizes = (16, 32)
    if args.quick:
        wcfg = WorkloadConfig(n_prefixes=1, prefix_tokens=512, queries_per_prefix=2,
                              warmup_queries=1)
        chunk_sizes = (16,)
    rows = []
    with Runtime(RuntimeConfig(model=args.model)) as rt:
        wl = build_workload(rt.tokenizer, wcfg)
        reference: dict = {}
        for run in runs(args.retention, chunk_sizes):
            r = run_workload(rt, wl, run, TierConfig(0, 0), store_root=Path(tempfile.gettempdir()),
                             reference=reference)
            rows.append(r)
            kl = "-" if r["kl"] is None else f"{r['kl']:.4f}"
            print(f"{run.label:<22} bytes {r['bytes_loaded_fraction']:.3f}  KL {kl}  "
                  f"fallback {r['fallback_rate']:.2f}", flush=True)
    write_json(args.json, {"model": args.model, "retention": args.retention,
                           "workload": {"prefixes": wcfg.n_prefixes,
                                        "prefix_tokens": wcfg.prefix_tokens,
                                        "queries": len(wl.queries)}, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.selection_sweep", main))
