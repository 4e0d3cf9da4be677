"""Time to first token per policy on a workload of reused natural-text prefixes.

    python -m experiments.ttft [--model smollm2-135m] [--quick] [--kv-formats F,...] [--json PATH]

Several prefixes, each reused by several queries; every configuration gets a fresh store,
the same workload and the same tier capacities (smaller than the pool, so GPU tier, CPU
tier and disk all serve). Disk reads are cold (O_DIRECT). KL is against `full` (all stored
KV loaded) over the query tokens. All rows are measured side by side in one run.
`--kv-formats fp16,int4`: instead, per store format every chunk loaded (`random` at
retention 1.0; `full` is exact and recomputes a lossy format) and impress, beside `full`.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from disk_layout.format import KV_FORMATS
from impress_flexgen.bench.workload import WorkloadConfig, build_workload
from impress_flexgen.entrypoints.args import ArgumentParser, choose_list, finite_float, write_json
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.tiers import TierConfig

from impress_flexgen.bench.runner import RunConfig, kv_bytes_per_token, run_workload


def default_runs(retention: float, chunk_size: int) -> list[RunConfig]:
    return [
        RunConfig("full", "full", chunk_size=chunk_size),
        RunConfig("recomp", "recomp", chunk_size=chunk_size),
        RunConfig("as_like", "as_like", chunk_size=chunk_size),
        RunConfig("as_h2o_lru", "as_h2o_lru", retention, chunk_size=chunk_size),
        RunConfig("as_h2o_lfu", "as_h2o_lfu", retention, chunk_size=chunk_size),
        # Ours: whole chunks ranked by every head's probe scores on an importance-reordered
        # layout, int4 probe copy, score-based tiers, no fallback.
        RunConfig("impress", "impress:all", retention, granularity="chunk", threshold="none",
                  probe_heads="auto", probe_format="int4", chunk_size=chunk_size),
        # The same with the paper's agreement test (adaptive threshold): fewer risks, more bytes.
        RunConfig("impress-adaptive", "impress:all", retention, granularity="chunk",
                  threshold="adaptive", probe_heads="auto", probe_format="int4",
                  chunk_size=chunk_size),
        # The paper's mechanism: voted tokens, every chunk holding one is read; heads 0, 1, 2;
        # fp16 probe copy; 64-token chunks; adaptive agreement threshold.
        RunConfig("impress-token (paper)", "impress:all", retention, granularity="token",
                  threshold="adaptive", probe_heads=(0, 1, 2), probe_format="fp16",
                  chunk_size=64),
    ]


def format_runs(formats, retention: float, chunk_size: int) -> list[RunConfig]:
    """`full` (the compute dtype's store), then per store format every chunk and impress."""
    return [RunConfig("full", "full", chunk_size=chunk_size), *(
        r for f in formats for r in (
            RunConfig(f"every chunk [{f}]", "random", 1.0, chunk_size=chunk_size, kv_format=f),
            RunConfig(f"impress [{f}]", "impress:all", retention, granularity="chunk",
                      threshold="none", probe_heads="auto", probe_format="int4",
                      chunk_size=chunk_size, kv_format=f)))]


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true", help="2 prefixes x 1024 tokens, 3 queries each")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--queries", type=int, default=5, help="measured queries per prefix")
    p.add_argument("--query-tokens", type=int, default=64)
    p.add_argument("--retention", type=float, default=0.25)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--gpu-cache-fraction", type=finite_float(0), default=0.1,
                   help="GPU tier capacity as a fraction of the pool's KV bytes")
    p.add_argument("--cpu-cache-fraction", type=finite_float(0), default=0.25)
    p.add_argument("--exclusive-tiers", action="store_true",
                   help="at most one memory copy of a chunk (default: non-exclusive tiers)")
    p.add_argument("--only", help="comma-separated labels of rows to run (full always runs)")
    p.add_argument("--kv-formats", help="comma-separated store formats (fp32, fp16, bf16, "
                                        "int4): rows per format instead of the policies")
    p.add_argument("--store-root", help="where the stores go (default: a temp dir on local disk)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.kv_formats is not None:
        args.kv_formats = choose_list(p, "--kv-formats", args.kv_formats, KV_FORMATS)
    if args.quick:
        args.prefixes, args.prefix_tokens, args.queries = 2, 1024, 3
    if not 0 < args.retention <= 1:
        p.error("--retention must be in (0, 1]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = format_runs(args.kv_formats, args.retention, args.chunk_size) if args.kv_formats \
        else default_runs(args.retention, args.chunk_size)
    if args.only:
        keep = set(args.only.split(",")) | {"full"}
        runs = [r for r in runs if r.label in keep]
    with Runtime(RuntimeConfig(model=args.model)) as rt:
        wl = build_workload(rt.tokenizer, WorkloadConfig(
            n_prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
            queries_per_prefix=args.queries, query_tokens=args.query_tokens))
        pool = args.prefixes * args.prefix_tokens * kv_bytes_per_token(rt)
        tiers = TierConfig(int(pool * args.gpu_cache_fraction),
                          int(pool * args.cpu_cache_fraction), exclusive=args.exclusive_tiers)
        reference: dict = {}
        results = []
        root = Path(args.store_root) if args.store_root else Path(tempfile.gettempdir())
        with tqdm(total=len(runs) * len(wl.queries), desc="requests", unit="req") as bar:
            for run in runs:
                results.append(run_workload(rt, wl, run, tiers, store_root=root, reference=reference,
                                            progress=bar))
    by = {r["label"]: r for r in results}
    base = by.get("as_like")
    for r in results:
        if base and base["bytes_loaded_fraction"]:
            r["bytes_vs_as_like"] = r["bytes_loaded_fraction"] / base["bytes_loaded_fraction"]
            r["io_speedup_vs_as_like"] = base["io_time_s"] / r["io_time_s"] if r["io_time_s"] else None
    print_table(results)
    write_json(args.json, {"model": args.model, "workload": {
        "prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens,
        "queries": len(wl.queries), "query_tokens": args.query_tokens, "sources": wl.sources,
        "pool_kv_bytes": pool, "gpu_tier_bytes": tiers.gpu_bytes,
        "cpu_tier_bytes": tiers.cpu_bytes, "tier_copies": tiers.copies}, "results": results})
    return 0


def print_table(results) -> None:
    head = (f"{'config':<24}{'TTFT mean':>10}{'P99':>8}{'I/O s':>8}{'compute':>9}"
            f"{'loaded%':>9}{'KiB/req':>9}{'gpu hit':>8}{'fallbk':>7}{'KL':>8}")
    print(head)
    for r in results:
        kl = "-" if r["kl"] is None else f"{r['kl']:.4f}"
        print(f"{r['label']:<24}{r['ttft_mean_s']:>10.3f}{r['ttft_p99_s']:>8.3f}"
              f"{r['io_time_s']:>8.3f}{r['ttft_breakdown_s']['compute_s']:>9.3f}"
              f"{100 * r['bytes_loaded_fraction']:>8.1f}%"
              f"{r['bytes_read_total'] / r['queries'] / 1024:>9.1f}{r['gpu_hit_ratio']:>8.2f}"
              f"{r['fallback_rate']:>7.2f}{kl:>8}")


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.ttft", main))
