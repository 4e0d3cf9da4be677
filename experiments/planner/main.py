"""experiments.planner's command line: arguments, calibration, the run and its JSON."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from impress_flexgen.bench.runner import prepared
from impress_flexgen.bench.workload import WorkloadConfig, build_workload
from impress_flexgen.entrypoints.args import ArgumentParser, finite_float, int_range, write_json
from impress_flexgen.errors import UserError
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.planner import planner as planner_module
from impress_flexgen.tiers import TierConfig

from . import __doc__ as _DOC
from .cells import PLANNERS, ROWS, _run, measure, summary
from .report import GpuFigures, opt30b_table, plot, print_measured, print_opt30b

DEFAULT_LIMITS = "5,20,80,320,none"          # MB/s; none: unlimited
QUICK_LIMITS = "5,50,none"
DEFAULT_PREFIXES = "1024,2048,4096,8000"     # smollm2-135m has 8,192 positions


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
                       description=_DOC.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true",
                   help=f"one 1,024-token prefix, 2 queries, 5 repeats, limits {QUICK_LIMITS} "
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
        args.prefixes, args.queries, args.repeats = 1, 2, 5
    args.prefix_list = _lengths(p, args.prefix_tokens)
    args.limit_list = _limits(p, args.limits)
    return args



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
    planner_module.CALIBRATION_BUDGET_S = None
    t0 = time.perf_counter()
    with prepared(rt, build_workload(rt.tokenizer, WorkloadConfig(
            n_prefixes=1, prefix_tokens=64, queries_per_prefix=1, warmup_queries=1,
            query_tokens=8)), _run("full", "auto", args), TierConfig(0, 0),
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
                if args.figure:
                    plot(cells, args.figure, args.model)

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


