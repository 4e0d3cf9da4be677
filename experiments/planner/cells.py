"""The measured cells of experiments.planner: each row's TTFT of the same queries, served
round the rows, and the targets a planner row is held to."""
from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from disk_layout.io import ReadLimit
from impress_flexgen.bench.runner import RunConfig, kl_divergence, kv_bytes_per_token, prepared
from impress_flexgen.bench.workload import WorkloadConfig, build_workload
from impress_flexgen.engine import Engine, Request, assemble
from impress_flexgen.tiers import TierConfig
from policies import make_policy

ROWS = ("recompute", "load full", "load impress", "planner full", "planner impress")
STORES = {"load full": "full", "load impress": "impress:all"}       # row -> its policy
PLANNERS = {"planner full": "load full", "planner impress": "load impress"}   # -> its store
# A planner's plans against the best of the ends it can choose between: recompute, or load
# what its policy selects (full: every chunk; impress: its selection). `load full` is not
# one of impress's plans: where it beats `load impress` (a fast disk, where loading every
# chunk costs less than impress's scoring), that is the policy's cost, not the planner's;
# the table shows it beside them.
BASELINES = {"planner full": ("recompute", "load full"),
             "planner impress": ("recompute", "load impress")}
# The targets: no worse than the best baseline (5% for noise), and clearly better where
# recompute and the best load are within 2x of each other (where splitting can pay).
NO_WORSE, BETTER, CLOSE = 1.05, 0.8, 2.0


def _run(policy: str, plan: str, args) -> RunConfig:
    if policy == "impress:all":
        # As experiments.ttft's "impress" row: whole chunks ranked by every head's probe.
        return RunConfig(policy, policy, args.retention, granularity="chunk",
                         threshold="none", probe_heads="auto", probe_format="int4",
                         chunk_size=args.chunk_size, plan=plan)
    return RunConfig(policy, policy, args.retention, chunk_size=args.chunk_size, plan=plan)


def set_read_limit(store, mb_s: float | None) -> None:
    """Hold the store's disk reads to mb_s MB/s from now on (None: unlimited)."""
    store.inspect().state.reader.limit = ReadLimit(mb_s * 1e6) if mb_s else None
    store.inspect().state.config = dataclasses.replace(store.config, read_limit_mb_s=mb_s)


def _planner_engine(rt, ready, policy: str, args, tiers) -> Engine:
    """A new engine planning over `ready`'s store: a server started on this disk."""
    run = _run(policy, "auto", args)
    engine = assemble(rt, make_policy(run.policy, run.serving()), ready.store, tiers, cache=ready.store.tiers.cache).engine
    engine.planner.cost()   # the calibration cached at the start of the run
    return engine


def _record(resp, plan_row: bool) -> dict:
    st = resp.stats
    out = {"ttft_s": float(st.ttft_s), "first_token": int(resp.tokens[0]),
           "disk_bytes": int(st.bytes_read.get("disk", 0)), "probe_bytes": int(st.probe_bytes),
           "compute_s": float(st.compute_s), "select_s": float(st.select_s),
           "load_s": float(st.load_s), "probe_s": float(st.probe_s)}
    if plan_row:
        out.update(plan=st.plan, split_chunks=int(st.plan_split), plan_s=float(st.plan_s),
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
        tiers = TierConfig(0, 0)
        bar.set_description(f"{length}-token prefixes: storing")
        with contextlib.ExitStack() as stack:
            stores = {label: stack.enter_context(prepared(rt, wl, _run(policy, "load", args),
                                                          tiers, store_root=root))
                      for label, policy in STORES.items()}
            engines = {"recompute": assemble(rt, make_policy("recomp"), None, tiers).engine,
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
    """Serve the measured queries round the rows (a row's TTFT: the median of its repeats).
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
        best = [sorted(tries, key=lambda r: r["ttft_s"])[(len(tries) - 1) // 2]
                for _, tries in sorted(per[label].items())]          # the median try
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
                       plan_ms_mean=1000 * float(np.mean([r["plan_s"] for r in every])),
                       learned=engines[label].planner.snapshot())
        rows[label] = row
    rows["recompute"]["measured_here"] = "recompute" in measured
    cell = {"prefix_tokens": length, "read_limit_mb_s": limit, "pool_kv_bytes": pool,
            "ttft_mean_s": {label: rows[label]["ttft_mean_s"] for label in ROWS},
            "rows": rows}
    cell["targets"] = {label: _targets(cell["ttft_mean_s"], label, rows[label]["plans"])
                       for label in PLANNERS}
    return cell


# The plan of each baseline row, for a planner row that chose it for every request.
BASELINE_PLANS = {"recompute": "recompute", "load full": "load", "load impress": "load"}


def _targets(ttft: dict, planner: str, plans: dict | None = None) -> dict:
    """The target of a planner row in a cell. `plans`: how often it chose each plan. Where
    the target is to be no worse than the best baseline and the planner chose that
    baseline's own plan every time (over the same store and policy), it ran the same code
    as that baseline: its ratio is then run-to-run noise plus the planner's own time
    (`plan_s`, reported), and the cell counts as met ("same_plan")."""
    base = {label: ttft[label] for label in BASELINES[planner]}
    best = min(base, key=base.get)
    loads = [s for label, s in base.items() if label != "recompute"]
    close = max(ttft["recompute"], min(loads)) <= CLOSE * min(ttft["recompute"], min(loads))
    ratio = ttft[planner] / base[best]
    target = BETTER if close else NO_WORSE
    # Every baseline of a planner runs its own policy, so its plan is the planner's code.
    same_plan = bool(not close and plans and set(plans) == {BASELINE_PLANS[best]})
    return {"over_best": ratio, "best": best, "close": close, "target": target,
            "same_plan": same_plan, "met": bool(ratio <= target or same_plan)}


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
                      "max_kl": max(c["rows"][label]["kl"] for c in cells),
                      "plan_ms_mean": float(np.mean([c["rows"][label]["plan_ms_mean"]
                                                     for c in cells]))}
    return out

