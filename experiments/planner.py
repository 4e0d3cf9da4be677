"""Load, recompute or both: TTFT of each plan, and of the planner, across disk read limits.

    python -m experiments.planner [--model smollm2-135m] [--quick] [--json PATH] [--figure PNG]

Per prefix length, two stores hold the same workload (one for the full policy, one for
impress, reordered once after its warm-up queries) and are read under each disk read limit
in turn (the store's reads held to that many MB/s, standing in for slower disks). Rows:
recompute (no store), load with every chunk (full), load of the impress selection, and the
planner (plan auto: recompute, load or both per request, by the cost model) over each
store. The measured queries go round the rows one query at a time, so that whatever else
the machine runs slows every row alike; with --repeats, each row's TTFT of a query is the
least of its repeats (noise only adds). Recompute reads no disk: it is measured at the
first limit and stands at the others (--recompute-each-limit measures it at each).

The planner is warmed up as a server would be: its prefill curve is calibrated when the run
starts (measured afresh unless --calibration-cache names a directory to reuse), and at each
limit a new planner (a server started on that disk) serves the warm-up queries before the
measured ones, learning the disk's bandwidth, the policy's scoring time and its own error.
KL is against recompute (exact KV). GPU and CPU tiers are empty: every load is from disk.

A second table is the cost model alone (no measurement) for OPT-30B on a GPU, from
published figures: recompute of a 5,120-token prefix 0.42 s, 1.38 MB of KV per token, disk
1.25 GB/s, pinned CPU->GPU copies 55 GB/s.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from disk_layout.io import ReadLimit
from impress_flexgen import prefix_plan
from impress_flexgen.cli import ArgumentParser, finite_float, int_range, run_main, write_json
from impress_flexgen.costs import Bandwidth, CostModel, PrefillCurve
from impress_flexgen.engine import Engine, Request, TierSizes
from impress_flexgen.errors import UserError
from impress_flexgen.planner import choose
from impress_flexgen.runtime import Runtime, RuntimeConfig
from impress_flexgen.serving import RunConfig, kl_divergence, kv_bytes_per_token, prepared
from impress_flexgen.workload import WorkloadConfig, build_workload
from policies import make_policy

DEFAULT_LIMITS = "5,20,80,320,none"          # MB/s; none: unlimited
QUICK_LIMITS = "5,50,none"
DEFAULT_PREFIXES = "1024,2048,4096,8000"     # smollm2-135m has 8,192 positions
ROWS = ("recompute", "load full", "load impress", "planner full", "planner impress")
STORES = {"load full": "full", "load impress": "impress:all"}       # row -> its policy
PLANNERS = {"planner full": "load full", "planner impress": "load impress"}   # -> its store
# A planner's plans against the best of: the exact plans (full: recompute, load full), or
# every row (impress: its selection loads less than full, so the best load is either).
BASELINES = {"planner full": ("recompute", "load full"),
             "planner impress": ("recompute", "load full", "load impress")}
# The targets: no worse than the best baseline (5% for noise), and clearly better where
# recompute and the best load are within 2x of each other (where splitting can pay).
NO_WORSE, BETTER, CLOSE = 1.05, 0.8, 2.0


def _limits(p, text: str) -> list[float | None]:
    out: list[float | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item in ("none", "unlimited", "0"):
            out.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            p.error(f"--limits: {item!r} is not a number of MB/s (or none)")
        if not 0 < value < float("inf"):
            p.error(f"--limits: {item} must be a positive number of MB/s (or none)")
        out.append(value)
    if not out:
        p.error("--limits: give at least one limit")
    return out


def _lengths(p, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"--prefix-tokens: {text!r} is not a comma-separated list of integers")
    if not out or min(out) < 64:
        p.error("--prefix-tokens: each prefix needs at least 64 tokens")
    return out


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.planner",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true",
                   help=f"one 1,024-token prefix, 2 queries, 3 repeats, limits {QUICK_LIMITS} "
                        "MB/s")
    p.add_argument("--prefix-tokens", default=DEFAULT_PREFIXES,
                   help=f"comma-separated prefix lengths ({DEFAULT_PREFIXES})")
    p.add_argument("--limits", default=DEFAULT_LIMITS,
                   help=f"comma-separated disk read limits in MB/s, none: unlimited "
                        f"({DEFAULT_LIMITS})")
    p.add_argument("--prefixes", type=int_range(1), default=2)
    p.add_argument("--queries", type=int_range(1), default=3, help="measured queries per prefix")
    p.add_argument("--warmup", type=int_range(1), default=2,
                   help="warm-up queries per prefix (importance; the planner's learning) (2)")
    p.add_argument("--repeats", type=int_range(1), default=1,
                   help="times each measured query is served per row; the least TTFT counts")
    p.add_argument("--recompute-each-limit", action="store_true",
                   help="measure recompute at every limit (default: at the first; it reads "
                        "no disk)")
    p.add_argument("--query-tokens", type=int_range(1), default=64)
    p.add_argument("--retention", type=finite_float(0, 1, low_open=True), default=0.25)
    p.add_argument("--chunk-size", type=int_range(1), default=16)
    p.add_argument("--threads", type=int_range(1), default=1,
                   help="torch threads (1: on a shared machine, the steadiest timings)")
    p.add_argument("--calibration-cache", metavar="DIR",
                   help="reuse the prefill calibration cached in DIR (default: measure it "
                        "afresh at the start of the run)")
    p.add_argument("--store-root", help="where the stores go (default: a temp dir on local disk)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="measure nothing: join the cells of these --json outputs (parts of one "
                        "grid run one after another), then print, --json and --figure them")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--figure", metavar="PNG", help="TTFT against disk read limit")
    args = p.parse_args(argv)
    if args.quick:
        args.prefix_tokens, args.limits = "1024", QUICK_LIMITS
        args.prefixes, args.queries, args.repeats = 1, 2, 3
    args.prefix_list = _lengths(p, args.prefix_tokens)
    args.limit_list = _limits(p, args.limits)
    return args


# -- measured ----------------------------------------------------------------------------

def _run(policy: str, plan: str, args) -> RunConfig:
    if policy == "impress:all":
        # As experiments.ttft's "impress" row: whole chunks ranked by every head's probe.
        return RunConfig(policy, policy, args.retention, granularity="chunk",
                         threshold="none", probe_heads="auto", probe_format="int4",
                         chunk_size=args.chunk_size, plan=plan)
    return RunConfig(policy, policy, args.retention, chunk_size=args.chunk_size, plan=plan)


def set_read_limit(store, mb_s: float | None) -> None:
    """Hold the store's disk reads to mb_s MB/s from now on (None: unlimited)."""
    store.reader.limit = ReadLimit(mb_s * 1e6) if mb_s else None
    store.config = dataclasses.replace(store.config, read_limit_mb_s=mb_s)


def _planner_engine(rt, ready, policy: str, args, tiers) -> Engine:
    """A new engine planning over `ready`'s store: a server started on this disk."""
    run = _run(policy, "auto", args)
    engine = Engine(rt, ready.store, make_policy(run.policy, run.serving()), tiers,
                    cache=ready.store.tiers.cache)
    engine.planner.cost()   # the calibration cached at the start of the run
    return engine


def _record(resp, plan_row: bool) -> dict:
    st = resp.stats
    out = {"ttft_s": float(st.ttft_s), "first_token": int(resp.tokens[0]),
           "disk_bytes": int(st.bytes_read.get("disk", 0)), "probe_bytes": int(st.probe_bytes),
           "compute_s": float(st.compute_s), "select_s": float(st.select_s),
           "load_s": float(st.load_s), "probe_s": float(st.probe_s)}
    if plan_row:
        out.update(plan=st.plan, split_chunks=int(st.plan_split),
                   predicted_ttft_s=float(st.predicted_ttft_s), plan_reason=st.plan_reason)
    return out


def measure(rt, args, bar, on_cell=None) -> list[dict]:
    """Every cell (prefix length x read limit); on_cell(cells so far) after each."""
    root = Path(args.store_root) if args.store_root else Path(tempfile.gettempdir())
    cells = []
    for length in args.prefix_list:
        wl = build_workload(rt.tokenizer, WorkloadConfig(
            n_prefixes=args.prefixes, prefix_tokens=length, queries_per_prefix=args.queries,
            warmup_queries=args.warmup, query_tokens=args.query_tokens))
        pool = args.prefixes * length * kv_bytes_per_token(rt)
        tiers = TierSizes(0, 0)
        bar.set_description(f"{length}-token prefixes: storing")
        with contextlib.ExitStack() as stack:
            stores = {label: stack.enter_context(prepared(rt, wl, _run(policy, "load", args),
                                                          tiers, store_root=root))
                      for label, policy in STORES.items()}
            engines = {"recompute": Engine(rt, None, make_policy("recomp"), tiers),
                       **{label: ready.engine for label, ready in stores.items()}}
            # Recompute reads no disk: measured at the first limit (round the rows like
            # the others), its requests stand for it at the next ones unless asked again.
            recompute: dict = {}
            for limit in args.limit_list:
                name = "none" if limit is None else f"{limit:g}"
                bar.set_description(f"{length} tokens, {name} MB/s")
                for ready in stores.values():
                    set_read_limit(ready.store, limit)
                planners = {label: _planner_engine(rt, stores[base], STORES[base], args, tiers)
                            for label, base in PLANNERS.items()}
                try:
                    for engine in planners.values():   # the warm-up a server would see
                        for p, query in wl.warmup:
                            engine.serve(Request(wl.prefixes[p], query, 1))
                            bar.update(1)
                    rows = {**engines, **planners}
                    cells.append(_cell(length, limit, pool, wl, rows, recompute, args, bar))
                    if on_cell is not None:
                        on_cell(cells)
                    if args.recompute_each_limit:
                        recompute.clear()
                finally:
                    for engine in planners.values():
                        engine.close()
    return cells


def _cell(length, limit, pool, wl, engines, recompute, args, bar) -> dict:
    """Serve the measured queries round the rows (a row's TTFT: the least of its repeats).
    `recompute`: {"per": ..., "logits": ...} of an earlier cell at this length, reused
    (filled here when empty)."""
    per: dict[str, dict[int, list[dict]]] = {r: {} for r in ROWS}
    logits: dict[str, dict[int, torch.Tensor]] = {r: {} for r in ROWS}
    measured = [r for r in ROWS if not (r == "recompute" and recompute)]
    order = list(measured)
    for rep in range(args.repeats):
        for qi, (p, query) in enumerate(wl.queries):
            order = order[1:] + order[:1]   # who goes first moves round
            for label in order:
                resp = engines[label].serve(Request(wl.prefixes[p], query, 1),
                                            query_logits=True)
                per[label].setdefault(qi, []).append(_record(resp, label in PLANNERS))
                logits[label].setdefault(qi, resp.query_logits)
                bar.update(1)
    if recompute:
        per["recompute"], logits["recompute"] = recompute["per"], recompute["logits"]
    else:
        recompute.update(per=per["recompute"], logits=logits["recompute"])
    reference = logits["recompute"]    # exact KV
    rows = {}
    for label in ROWS:
        best = [min(tries, key=lambda r: r["ttft_s"]) for _, tries in sorted(per[label].items())]
        every = [r for _, tries in sorted(per[label].items()) for r in tries]
        row = {"ttft_mean_s": float(np.mean([r["ttft_s"] for r in best])),
               "ttft_s": [r["ttft_s"] for r in best],
               "kl": float(np.mean([kl_divergence(reference[qi], lg)
                                    for qi, lg in logits[label].items()])),
               "first_token_as_recompute": float(np.mean(
                   [r["first_token"] == per["recompute"][qi][0]["first_token"]
                    for qi, tries in per[label].items() for r in tries])),
               "disk_bytes_mean": float(np.mean([r["disk_bytes"] + r["probe_bytes"]
                                                 for r in every])),
               "breakdown_s": {k: float(np.mean([r[k] for r in best]))
                               for k in ("compute_s", "select_s", "load_s", "probe_s")},
               "requests": every}
        if label in PLANNERS:
            errors = [abs(r["predicted_ttft_s"] - r["ttft_s"]) / r["ttft_s"] for r in every
                      if r["predicted_ttft_s"] > 0 and r["ttft_s"] > 0]
            row.update(plans=dict(Counter(r["plan"] for r in every)),
                       split_mean=float(np.mean([r["split_chunks"] for r in every])),
                       prediction_abs_error=float(np.mean(errors)) if errors else None,
                       learned=engines[label].planner.snapshot())
        rows[label] = row
    rows["recompute"]["measured_here"] = "recompute" in measured
    cell = {"prefix_tokens": length, "read_limit_mb_s": limit, "pool_kv_bytes": pool,
            "ttft_mean_s": {label: rows[label]["ttft_mean_s"] for label in ROWS},
            "rows": rows}
    cell["targets"] = {label: _targets(cell["ttft_mean_s"], label) for label in PLANNERS}
    return cell


def _targets(ttft: dict, planner: str) -> dict:
    base = {label: ttft[label] for label in BASELINES[planner]}
    best = min(base.values())
    loads = [s for label, s in base.items() if label != "recompute"]
    close = max(ttft["recompute"], min(loads)) <= CLOSE * min(ttft["recompute"], min(loads))
    ratio = ttft[planner] / best
    return {"over_best": ratio, "best": min(base, key=base.get), "close": close,
            "target": BETTER if close else NO_WORSE,
            "met": bool(ratio <= (BETTER if close else NO_WORSE))}


def summary(cells) -> dict:
    """Per planner: how many cells met their target, and the mean prediction error."""
    out = {}
    for label in PLANNERS:
        errors = [abs(r["predicted_ttft_s"] - r["ttft_s"]) / r["ttft_s"]
                  for c in cells for r in c["rows"][label]["requests"]
                  if r["predicted_ttft_s"] > 0 and r["ttft_s"] > 0]
        out[label] = {"cells": len(cells),
                      "targets_met": sum(c["targets"][label]["met"] for c in cells),
                      "mean_abs_prediction_error": float(np.mean(errors)) if errors else None,
                      "max_kl": max(c["rows"][label]["kl"] for c in cells)}
    return out


def print_measured(cells, summ) -> None:
    print("Measured TTFT (s, mean over queries), disk reads limited; planner = plan auto")
    print(f"{'prefix':>7}{'MB/s':>6}{'recomp':>8}{'full':>8}{'impress':>8}"
          f"{'pl full':>8}{'/best':>6}{'plans':>14}{'err':>5}"
          f"{'pl imp':>8}{'/best':>6}{'plans':>14}{'err':>5}{'KL imp':>8}")
    for c in cells:
        t = c["ttft_mean_s"]
        limit = "none" if c["read_limit_mb_s"] is None else f"{c['read_limit_mb_s']:g}"
        line = (f"{c['prefix_tokens']:>7}{limit:>6}{t['recompute']:>8.3f}{t['load full']:>8.3f}"
                f"{t['load impress']:>8.3f}")
        for label in PLANNERS:
            row, tg = c["rows"][label], c["targets"][label]
            mark = "" if tg["met"] else "!"
            plans = ",".join(f"{k[0]}{v}" for k, v in sorted(row["plans"].items()))
            if "both" in row["plans"]:
                plans += f" m~{row['split_mean']:.0f}"
            err = row["prediction_abs_error"]
            line += (f"{t[label]:>8.3f}{tg['over_best']:>5.2f}{mark:1}{plans:>14}"
                     f"{_fmt(None if err is None else 100 * err, '.0f'):>5}")
        print(line + f"{c['rows']['planner impress']['kl']:>8.4f}")
    print(f"/best: planner over the best of its baselines (full: recompute, load full; "
          f"impress: also load impress); target {NO_WORSE}x, {BETTER}x where recompute and "
          f"the best load are within {CLOSE:g}x ('!': missed). plans: l(oad), r(ecompute), "
          f"b(oth), m: mean chunks recomputed. err: mean |predicted - measured| / measured "
          f"TTFT (%)")
    for label, s in summ.items():
        err = s["mean_abs_prediction_error"]
        print(f"{label}: targets met in {s['targets_met']}/{s['cells']} cells, mean prediction "
              f"error {_fmt(None if err is None else 100 * err, '.1f')}%, "
              f"max KL {s['max_kl']:.2e}")


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


# -- the cost model alone: OPT-30B on a GPU ----------------------------------------------

@dataclasses.dataclass(frozen=True)
class GpuFigures:
    """Published figures the OPT-30B table is computed from (a model, not a measurement)."""

    n_layers: int = 48
    hidden: int = 7168
    params: float = 30e9
    prefix_tokens: int = 5120
    recompute_s: float = 0.42        # prefill of the 5,120-token prefix
    kv_bytes_per_token: float = 1.38e6
    disk_bytes_s: float = 1.25e9
    cpu_bytes_s: float = 55e9        # pinned CPU->GPU copies
    chunk_tokens: int = 64
    query_tokens: int = 64
    # impress: retention of the chunks, and its int4 probe copy of every head's keys
    # (half of the KV at a quarter of fp16's bits: 1/8 of the KV bytes).
    retention: float = 0.25
    probe_fraction: float = 0.125

    def curve(self) -> PrefillCurve:
        """t(n, ctx) through recompute_s, split between linear work and attention by their
        FLOPs: 2 * params per token, 4 * hidden * layers per (query, key) pair."""
        ratio = 4 * self.hidden * self.n_layers / (2 * self.params)   # c / b
        n = self.prefix_tokens
        b = self.recompute_s / (n + ratio * n * n)
        return PrefillCurve(0.0, b, ratio * b)


def opt30b_table(fig: GpuFigures = GpuFigures()) -> list[dict]:
    cost = CostModel(fig.curve(), Bandwidth({"disk": fig.disk_bytes_s, "cpu": fig.cpu_bytes_s}),
                     fig.n_layers)
    n = fig.prefix_tokens // fig.chunk_tokens
    chunk_bytes = fig.chunk_tokens * fig.kv_bytes_per_token
    rows = []
    for tier in ("disk", "cpu"):
        bw = cost.bandwidth.get(tier)
        for selection, fraction, probe in (("full", 1.0, 0.0),
                                           ("impress", fig.retention, fig.probe_fraction)):
            io = [chunk_bytes * fraction / bw] * n
            probe_s = fig.prefix_tokens * fig.kv_bytes_per_token * probe / bw
            args = (cost, n, fig.chunk_tokens, fig.query_tokens, io, probe_s)
            plan = choose("auto", *args, kept_fraction=fraction)
            pred = plan.predicted
            rows.append({"tier": tier, "selection": selection,
                         "recompute_s": pred["recompute"], "load_s": pred["load"],
                         "both_s": pred["both"],
                         "both_split_chunks": choose("both", *args,
                                                     kept_fraction=fraction).split_chunks,
                         "plan": plan.mode, "plan_s": plan.predicted_s,
                         "split_chunks": plan.split_chunks, "chunks": n,
                         "plan_over_best_end": plan.predicted_s / min(pred["recompute"],
                                                                      pred["load"])})
    return rows


def print_opt30b(rows, fig: GpuFigures = GpuFigures()) -> None:
    print(f"\nOPT-30B on a GPU, from the cost model alone (a model, not a measurement): "
          f"{fig.prefix_tokens:,}-token prefix, recompute {fig.recompute_s} s, "
          f"{fig.kv_bytes_per_token / 1e6:.2f} MB KV/token, disk "
          f"{fig.disk_bytes_s / 1e9:g} GB/s, CPU->GPU {fig.cpu_bytes_s / 1e9:g} GB/s")
    print(f"{'KV from':<8}{'selection':<10}{'recomp':>8}{'load':>8}{'both':>8}{'m/n':>9}"
          f"{'plan':>11}{'/best end':>10}")
    for r in rows:
        print(f"{r['tier']:<8}{r['selection']:<10}{r['recompute_s']:>8.3f}{r['load_s']:>8.3f}"
              f"{r['both_s']:>8.3f}{r['both_split_chunks']:>5}/{r['chunks']:<3}"
              f"{r['plan']:>11}{r['plan_over_best_end']:>10.2f}")
    print(f"impress: {fig.retention:g} of the chunks read (spread evenly), plus an int4 probe "
          f"copy of {fig.probe_fraction:g} of the KV bytes; m: chunks recomputed by 'both'")


# -- figure ------------------------------------------------------------------------------

def plot(cells, path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({c["prefix_tokens"] for c in cells})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.6), squeeze=False)
    limited = [c["read_limit_mb_s"] for c in cells if c["read_limit_mb_s"] is not None]
    unlimited_x = 4 * max(limited) if limited else 1.0   # "none" drawn right of the others
    styles = {"recompute": ("k", "--"), "load full": ("C0", "o-"), "load impress": ("C1", "o-"),
              "planner full": ("C0", "s:"), "planner impress": ("C1", "s:")}
    for ax, length in zip(axes[0], lengths):
        these = sorted((c for c in cells if c["prefix_tokens"] == length),
                       key=lambda c: c["read_limit_mb_s"] or unlimited_x)
        xs = [c["read_limit_mb_s"] or unlimited_x for c in these]
        for label in ROWS:
            color, style = styles[label]
            ax.plot(xs, [c["ttft_mean_s"][label] for c in these], style, color=color,
                    label=label, lw=2 if label in PLANNERS else 1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{c['read_limit_mb_s']:g}" if c["read_limit_mb_s"] else "none"
                            for c in these])
        ax.minorticks_off()
        ax.set_xlabel("disk read limit (MB/s)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{length:,}-token prefix", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"TTFT against disk read limit, {model}", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)


@contextlib.contextmanager
def _calibration_cache(directory: str | None):
    """$IMPRESS_FLEXGEN_CACHE for the run: `directory`, or a fresh one (calibrate now)."""
    old = os.environ.get("IMPRESS_FLEXGEN_CACHE")
    with contextlib.ExitStack() as stack:
        path = directory or stack.enter_context(tempfile.TemporaryDirectory(prefix="calib-"))
        os.environ["IMPRESS_FLEXGEN_CACHE"] = str(path)
        try:
            yield path
        finally:
            if old is None:
                os.environ.pop("IMPRESS_FLEXGEN_CACHE", None)
            else:
                os.environ["IMPRESS_FLEXGEN_CACHE"] = old


def _calibrate(rt, args) -> dict:
    """The prefill curve, measured (or read from the cache) before any request: every
    point, past the budget a server's start-up keeps to (the prefixes here reach 8k)."""
    prefix_plan.CALIBRATION_BUDGET_S = None
    t0 = time.perf_counter()
    with prepared(rt, build_workload(rt.tokenizer, WorkloadConfig(
            n_prefixes=1, prefix_tokens=64, queries_per_prefix=1, warmup_queries=1,
            query_tokens=8)), _run("full", "auto", args), TierSizes(0, 0),
            store_root=args.store_root) as ready:
        curve = ready.engine.planner.cost().prefill
        return {"a": curve.a, "b": curve.b, "c": curve.c,
                "seconds": time.perf_counter() - t0}


def _payload(args, argv, calibration, cells, complete: bool) -> dict:
    return {
        "model": args.model,
        "command": "python -m experiments.planner " + " ".join(argv if argv is not None
                                                                else sys.argv[1:]),
        "complete": complete,
        "workload": {"prefix_tokens": args.prefix_list, "prefixes": args.prefixes,
                     "queries_per_prefix": args.queries, "warmup_per_prefix": args.warmup,
                     "repeats": args.repeats, "query_tokens": args.query_tokens,
                     "chunk_size": args.chunk_size, "retention": args.retention,
                     "read_limits_mb_s": args.limit_list, "threads": args.threads,
                     "recompute_each_limit": args.recompute_each_limit},
        "calibration": calibration,
        "summary": summary(cells) if cells else None,
        "measured": cells,
        "opt30b_model": {"note": "computed from the cost model, not measured",
                         "figures": dataclasses.asdict(GpuFigures()),
                         "rows": opt30b_table()}}


def merge(paths) -> dict:
    """One payload of the cells of several parts (in the order given)."""
    parts = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
            cells = doc["measured"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"--merge: cannot read the cells of {path}: {exc}") from None
        parts.append((path, doc, cells))
    cells = [c for _, _, part in parts for c in part]
    if not cells:
        raise UserError("--merge: the files hold no measured cells")
    first = parts[0][1]
    return {"model": first.get("model"), "complete": all(d.get("complete") for _, d, _ in parts),
            "parts": [{"file": str(path), "command": d.get("command"),
                       "complete": d.get("complete"), "workload": d.get("workload"),
                       "calibration": d.get("calibration")} for path, d, _ in parts],
            "summary": summary(cells), "measured": cells,
            "opt30b_model": first.get("opt30b_model")}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        doc = merge(args.merge)
        print_measured(doc["measured"], doc["summary"])
        if args.figure:
            plot(doc["measured"], args.figure, doc["model"] or args.model)
        write_json(args.json, doc)
        return 0
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with _calibration_cache(args.calibration_cache), \
                Runtime(RuntimeConfig(model=args.model)) as rt:
            calibration = _calibrate(rt, args)
            print(f"prefill curve: t(n, ctx) = {calibration['a']:.3g} + {calibration['b']:.3g} n "
                  f"+ {calibration['c']:.3g} n (ctx + n) s ({calibration['seconds']:.0f} s "
                  f"to calibrate)")
            queries = args.prefixes * args.queries * args.repeats
            n_cells = len(args.prefix_list) * len(args.limit_list)
            total = n_cells * ((len(ROWS) - 1) * queries + len(PLANNERS) * args.prefixes *
                               args.warmup) + (n_cells if args.recompute_each_limit else
                                               len(args.prefix_list)) * queries

            def done_so_far(cells):   # a long run stopped midway keeps its finished cells
                write_json(args.json, _payload(args, argv, calibration, cells, False))

            with tqdm(total=total, desc="requests", unit="req") as bar:
                cells = measure(rt, args, bar, done_so_far)
    finally:
        torch.set_num_threads(threads)
    print_measured(cells, summary(cells))
    print_opt30b(opt30b_table())
    if args.figure:
        plot(cells, args.figure, args.model)
    write_json(args.json, _payload(args, argv, calibration, cells, True))
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.planner", main))
