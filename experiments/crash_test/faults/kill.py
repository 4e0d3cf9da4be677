"""kill: a writer process inserts prefixes (many share leading chunks, so nodes are split),
reads what it matched, feeds importance back and reorders (on demand and in the
background), printing `COMMITTED <id>` after each insert. SIGKILL after a random delay;
the store is reopened here and every node is read back (probe copy and K/V) against KV
regenerated from its tokens. A committed prefix is lost unless its whole chunk-aligned
length matches and reads back exact. Files in data/ no live layer references, and *.tmp
files, are orphans."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..kills import (KillState, apply_events, final_read_back, run_writer, verify_after_crash,
                     writer_died)
from ..kv import FORMATS, Prefixes
from ..registry import Context, fault
from ..report import Report
from ..writer import kill_phase


def kill_loop(base: Path, iterations: int, seed: int, max_delay: float, max_inserts: int,
              failures: list[str], keep_logs: bool = True, report: Report | None = None) -> dict:
    rng = np.random.default_rng([seed, 1])
    states = [KillState(base / f"kill-{fmt}", fmt) for fmt in FORMATS]
    prefixes = Prefixes(seed)
    phases: dict[str, int] = {}
    totals = {"orphans": 0, "bad_nodes": 0, "wrong_nodes": 0, "cleaned": 0, "writer_errors": 0,
              "writer_finished": 0, "background_reorder_failures": 0,
              "reorder_corrupt_node_errors": 0}
    reorder_errors: list[str] = []
    log_dir = base / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    harmless = 0
    for it in range(iterations):
        st = states[it % len(states)]
        delay = float(rng.uniform(0.0, max_delay))
        lines, err, rc = run_writer(st.dir, st.fmt, seed, st.next_id, delay, max_inserts, log_dir)
        if rc is not None:
            if rc == 0 and lines and lines[-1] == "DONE":
                totals["writer_finished"] += 1
            else:
                totals["writer_errors"] += 1
                failures.append(writer_died(it, rc, err, log_dir, keep_logs, "writer"))
        else:
            phase = kill_phase(lines)
            phases[phase] = phases.get(phase, 0) + 1
        totals["background_reorder_failures"] += err.count("background reorder failed")
        for x in lines:
            if x.startswith("REORDER_FAILED "):
                totals["reorder_corrupt_node_errors"] += 1
                if len(reorder_errors) < 5:
                    reorder_errors.append(f"iteration {it}: {x[len('REORDER_FAILED '):]}")
        begun = [int(x.split()[1]) for x in lines if x.startswith("INSERT ")]
        apply_events(st, lines, prefixes)
        st.next_id = max(begun) + 1 if begun else st.next_id
        lost_before = len(st.lost)
        res = verify_after_crash(st, prefixes, failures, rng)
        for key in ("orphans", "bad_nodes", "wrong_nodes", "cleaned", "nodes_read_back"):
            totals[key] = totals.get(key, 0) + res[key]
        harmless += res["bad_nodes"] == 0 and res["orphans"] == 0 and \
            len(st.lost) == lost_before and (rc is None or rc == 0)
    # Finally read every node and every committed prefix back whole.
    for st in states:
        res = final_read_back(st, prefixes, failures)
        totals["bad_nodes"] += res["bad_nodes"]
        totals["wrong_nodes"] += res["wrong_nodes"]
        totals.setdefault("final_nodes", {})[st.fmt] = res["nodes"]
    out = {"iterations": iterations, "committed": sum(len(s.committed) for s in states),
           "lost": sum(len(s.lost) for s in states),
           "kills_by_phase": dict(sorted(phases.items())), **totals,
           "reorder_errors": reorder_errors}
    if report is not None:
        report.count("kill", injected=iterations, harmless=harmless,
                     served_wrong=totals["wrong_nodes"], lost=out["lost"])
    return out


@fault("kill")
def run(ctx: Context) -> dict:
    return kill_loop(ctx.base, ctx.iterations, ctx.seed, ctx.max_delay, max_inserts=40,
                     failures=ctx.failures, keep_logs=ctx.keep_logs, report=ctx.report)
