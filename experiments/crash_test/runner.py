"""The run: arguments, every registered fault class in turn, the summary and exit status."""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from impress_flexgen.entrypoints.args import ArgumentParser, finite_float, write_json
from impress_flexgen.errors import UserError

from . import faults  # noqa: F401 - registers every fault class
from .kv import FORMATS
from .registry import FAULTS, Context
from .report import Report
from .writer import writer

PROG = "python -m experiments.crash_test"
DESCRIPTION = "Crash, corruption and disk-full torture test of the prefix KV store."
PARTS = tuple(FAULTS)


def parse_args(argv):
    p = ArgumentParser(prog=PROG, description=DESCRIPTION)
    p.add_argument("--quick", action="store_true",
                   help="8 kill iterations and fewer of every other fault (under 2 minutes)")
    p.add_argument("--iterations", type=int, help="kill iterations (default 60; quick 8)")
    p.add_argument("--fuzz", type=int,
                   help="damaged-database iterations (default 300; quick 60)")
    p.add_argument("--only", metavar="PART[,PART]",
                   help=f"run only these parts: {', '.join(PARTS)}")
    p.add_argument("--dir", metavar="DIR",
                   help="where the test stores go (absent or empty; kept afterwards); "
                        "default: a temporary directory, removed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-delay", type=finite_float(0, low_open=True), default=1.0,
                   help="kill the writer up to this many seconds after it is ready")
    p.add_argument("--json", metavar="PATH")
    # Hidden: the writer subprocess of the kill loops.
    p.add_argument("--writer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--format", choices=FORMATS, help=argparse.SUPPRESS)
    p.add_argument("--start-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max-inserts", type=int, default=40, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("kill", "power", "open", "evict", "serve"),
                   default="kill", help=argparse.SUPPRESS)
    p.add_argument("--snapshots", help=argparse.SUPPRESS)
    p.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.iterations is None:
        args.iterations = 8 if args.quick else 60
    if args.iterations < 1:
        p.error("--iterations must be positive")
    if args.fuzz is None:
        args.fuzz = 60 if args.quick else 300
    if args.fuzz < 1:
        p.error("--fuzz must be positive")
    if args.only is not None:
        args.only = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [x for x in args.only if x not in PARTS]
        if unknown or not args.only:
            p.error(f"--only: unknown part {', '.join(unknown) or '(none given)'}; "
                    f"parts: {', '.join(PARTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.writer:
        return writer(args)
    t0 = time.perf_counter()
    if args.dir:
        base = Path(args.dir)
        if base.exists() and (not base.is_dir() or any(base.iterdir())):
            raise UserError(f"--dir {base} must be absent or an empty directory")
        base.mkdir(parents=True, exist_ok=True)
    else:
        base = Path(tempfile.mkdtemp(prefix="crash-test-"))
    report = Report()
    ctx = Context(base=base, quick=args.quick, iterations=args.iterations, fuzz=args.fuzz,
                  seed=args.seed, max_delay=args.max_delay, keep_logs=bool(args.dir),
                  report=report)
    seconds: dict[str, float] = {}
    results: dict[str, dict] = {}
    try:
        for name, fault in FAULTS.items():
            if args.only is None or name in args.only:
                t = time.perf_counter()
                results[name] = fault.run(ctx)
                seconds[name] = round(time.perf_counter() - t, 1)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    result, ok = summary(report, results, seconds, time.perf_counter() - t0)
    write_json(args.json, result)
    for line in report.failures[:20]:
        print(f"  {line}", file=sys.stderr)
    classes = ", ".join(f"{c} {f['detected'] + f['harmless']}/{f['injected']}"
                        for c, f in report.faults.items())
    print(f"crash test {'PASS' if ok else 'FAIL'}: {result['iterations']} iterations, "
          f"{result['committed']} committed, {result['lost']} lost, "
          f"{result['served_wrong']} served wrong, {result['orphans']} orphans; detected or "
          f"harmless: {classes}; {result['capacity_evictions']} evictions; "
          f"{result['seconds']} s")
    return 0 if ok else 1


def summary(report: Report, results: dict, seconds: dict, elapsed: float) -> tuple[dict, bool]:
    """The JSON written by --json, and whether the run passes: no fault class served wrong
    KV or lost a committed prefix, no orphan after recovery, every injected fault detected
    or harmless, no other failure."""
    failures = report.failures
    kills = results.get("kill", {"committed": 0, "lost": 0, "orphans": 0, "writer_errors": 0,
                                 "bad_nodes": 0})
    corrupt_res = results.get("corruption", {"injected": 0, "detected": 0, "orphans": 0})
    nospace_res = results.get("enospc", {"injected": 0, "handled": 0})
    orphans_of = {name: results[name].get(f.orphans, 0) for name, f in FAULTS.items()
                  if f.orphans is not None and name in results}
    orphan_total = sum(orphans_of.values())
    served_wrong = sum(f["served_wrong"] for f in report.faults.values())
    lost = sum(f["lost"] for f in report.faults.values())
    for cls in PARTS:
        f = report.faults.get(cls)
        if cls in results and f is not None and f["injected"] == 0:
            report.fail(cls, "no fault could be injected")
    unaccounted = {c: f["injected"] - f["detected"] - f["harmless"]
                   for c, f in report.faults.items()
                   if f["injected"] != f["detected"] + f["harmless"]}
    result = {
        "iterations": sum(f["injected"] for f in report.faults.values()),
        "committed": kills["committed"],
        "lost": lost,
        "served_wrong": served_wrong,
        "corruptions_injected": corrupt_res["injected"],
        "corruptions_detected": corrupt_res["detected"],
        "orphans_after_recovery": orphan_total,
        "orphans": orphan_total,
        "capacity_evictions": results.get("capacity", {}).get("evictions", 0),
        "enospc_injected": nospace_res["injected"],
        "enospc_handled": nospace_res["handled"],
        "faults": report.faults,
        "seconds": round(elapsed, 1),
        "details": {"seconds": seconds, "kill_loop": kills, "corruption": corrupt_res,
                    "capacity": results.get("capacity", {}), "enospc": nospace_res,
                    **{name: results[name] for name in results
                       if name not in ("kill", "corruption", "capacity", "enospc")},
                    "orphans_by_class": orphans_of, "unaccounted": unaccounted,
                    "failures": failures},
    }
    ok = (lost == 0 and served_wrong == 0 and orphan_total == 0 and not unaccounted and
          not failures and result["corruptions_detected"] == result["corruptions_injected"] and
          kills["writer_errors"] == 0 and kills["bad_nodes"] == 0)
    return result, ok
