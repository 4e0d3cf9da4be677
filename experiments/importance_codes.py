"""Does ranking by the stored importance codes change the reorder, the chunks read, KL?

    python -m experiments.importance_codes                  # the serving part's workload
    python -m experiments.importance_codes --quick --json out.json

The store keeps accumulated importance as float32 in memory and writes it as short log
codes (disk_layout.metadata_codec); only a reopened store ranks tokens by the stored
values. This serves the reproduce serving part's workload (SmolLM2-135M, impress with
whole chunks and in the paper's token mode): the prefixes and warm-up queries, then, once
with the float32 importance and once per code width with the importance replaced by its
decoded codes, one reorder and the measured queries. Per width: how many of a layer's hot
tokens (the reorder's first quarter) and of all its tokens land in another chunk than with
float32, KL against full KV on the same queries, top-1 agreement and bytes read.
"""
from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np

from disk_layout.metadata_codec import IMPORTANCE_BITS, decode_importance, encode_importance
from experiments.reproduce import FULL, PAPER_TOKEN, QUICK
from impress_flexgen.bench.runner import (RunConfig, kl_divergence, kv_bytes_per_token, prepared,
                                          run_workload)
from impress_flexgen.bench.workload import build_workload
from impress_flexgen.config import StoreOptions
from impress_flexgen.engine import Request
from impress_flexgen.entrypoints.args import ArgumentParser, write_json
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.tiers import TierConfig

RUNS = (RunConfig("impress", "impress"), RunConfig("impress-token (paper)", "impress",
                                                   **PAPER_TOKEN))


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.importance_codes",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", default=f"8,{IMPORTANCE_BITS}",
                   help=f"comma-separated code widths, 2-16 (default 8,{IMPORTANCE_BITS})")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true", help="the quick serving workload, "
                   "impress with whole chunks only")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    try:
        args.bits = [int(b) for b in args.bits.split(",") if b]
    except ValueError:
        p.error("--bits must be comma-separated integers")
    if not args.bits or any(not 2 <= b <= 16 for b in args.bits):
        p.error("--bits must be widths from 2 to 16")
    return args


def serve(rt, wl, run: RunConfig, tiers: TierConfig, reference: dict, bits: int | None):
    """One reorder after the warm-up (importance as stored in `bits`-bit codes, or float32
    for None), then the measured queries: (orders per (node start, layer), row)."""
    with prepared(rt, wl, run, tiers, store=StoreOptions(reorder_interval=0)) as ready:
        store = ready.store
        if bits is not None:
            with store.inspect().state.lock:
                for stats in store.inspect().state.stats.values():
                    stats.importance[:] = decode_importance(
                        encode_importance(stats.importance, bits), len(stats.importance))
        store.reorder_now()
        orders = {(node.start, layer): store.entry(node, layer).mapping
                  for node in store.inspect().state.tree.nodes.values()
                  for layer in range(len(node.layers))}
        kls, top1, read = [], [], 0
        for qi, (p, query) in enumerate(wl.queries):
            resp = ready.engine.serve(Request(wl.prefixes[p], query, 1, n_pad=wl.pad_of(p)),
                                      query_logits=True)
            kls.append(kl_divergence(reference[qi], resp.query_logits))
            top1.append(float((reference[qi].argmax(-1) ==
                               resp.query_logits.argmax(-1)).float().mean()))
            read += sum(resp.stats.bytes_read.values())
    return orders, {"kl_median": float(np.median(kls)), "kl_mean": float(np.mean(kls)),
                    "top1_agreement": float(np.mean(top1)), "bytes_read": int(read)}


def compare(exact: dict, other: dict, c: int) -> dict:
    """Per layer, the share of hot tokens (the first quarter after the sink chunk) and of
    all tokens whose chunk differs between two reorders."""
    hot_moved, moved = [], []
    for key, a in exact.items():
        b = other[key]
        if a is None or b is None:
            continue
        n = len(a)
        lo = c if key[0] == 0 else 0
        hot_n = min(n - lo, math.ceil(0.25 * (n - lo - c) / c) * c)
        hot_a, hot_b = set(a[lo:lo + hot_n].tolist()), set(b[lo:lo + hot_n].tolist())
        hot_moved.append(len(hot_a - hot_b) / max(1, hot_n))
        chunk_a, chunk_b = np.empty(n, np.int64), np.empty(n, np.int64)
        chunk_a[a], chunk_b[b] = np.arange(n) // c, np.arange(n) // c
        moved.append(float((chunk_a != chunk_b).mean()))
    return {"layers": len(moved), "hot_tokens_moved_mean": float(np.mean(hot_moved)),
            "hot_tokens_moved_max": float(np.max(hot_moved)),
            "tokens_in_another_chunk_mean": float(np.mean(moved))}


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = (QUICK if args.quick else FULL).serving
    runs = RUNS[:1] if args.quick else RUNS
    rows = []
    with Runtime(RuntimeConfig(model=args.model)) as rt:
        wl = build_workload(rt.tokenizer, cfg)
        pool = cfg.n_prefixes * cfg.prefix_tokens * kv_bytes_per_token(rt)
        tiers = TierConfig(int(pool * 0.10), int(pool * 0.25))
        reference: dict = {}
        run_workload(rt, wl, RunConfig("full", "full", 1.0), tiers, reference=reference)
        for run in runs:
            exact, row = serve(rt, wl, run, tiers, reference, None)
            rows.append({"run": run.label, "importance": "float32", **row})
            for bits in args.bits:
                orders, row = serve(rt, wl, run, tiers, reference, bits)
                rows.append({"run": run.label, "importance": f"{bits}-bit codes", **row,
                             **compare(exact, orders, run.chunk_size)})
    print(f"{'run':<24}{'importance':<16}{'KL median':>10}{'top-1':>8}{'MB read':>9}"
          f"{'hot moved':>11}")
    for r in rows:
        moved = f"{100 * r['hot_tokens_moved_mean']:.2f}%" if "layers" in r else ""
        print(f"{r['run']:<24}{r['importance']:<16}{r['kl_median']:>10.4f}"
              f"{r['top1_agreement']:>8.3f}{r['bytes_read'] / 1e6:>9.1f}{moved:>11}")
    write_json(args.json, {"model": args.model, "quick": args.quick,
                           "workload": dataclasses.asdict(cfg), "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.importance_codes", main))
