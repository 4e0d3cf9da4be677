"""Writers killed while opening a store (recovery), while a capacity-limited store evicts,
and while damaged nodes are served, quarantined and recomputed: what the writer reported
removing (before removing it) may be gone, never wrong."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from impress_flexgen.store import PrefixStore

from .damage import inject
from .kills import KillState, apply_events, final_read_back, run_child, verify_after_crash, \
    writer_argv, writer_died
from .kv import FORMATS, MAX_CHUNKS, SHAPE, Prefixes, store_config
from .readback import disjoint_nodes, fill_store, prefix_bytes, serve
from .registry import Context
from .report import Report, StoreWarnings
from .writer import kill_phase, removal_record


def make_orphans(data: Path, n: int, rng) -> None:
    """Files a crashed writer may leave: layer files never committed and *.tmp files."""
    for i in range(n):
        name = f"{rng.bytes(16).hex()}.kv" + (".tmp" if i % 4 == 0 else "")
        with open(data / name, "wb") as f:
            f.write(bytes(int(rng.choice([0, 512, 4096]))))


def crash_loop(base: Path, kind: str, iterations: int, seed: int, max_delay: float,
               report: Report, keep_logs: bool, n_orphans: int = 1500, n_fill: int = 10) -> dict:
    """kind: recovery, eviction or quarantine (see the module docstring)."""
    cls = f"crash_{kind}"
    index = ("recovery", "eviction", "quarantine").index(kind)
    rng = np.random.default_rng([seed, 21, index])
    kseed = seed * 1000 + 41 + index
    prefixes = Prefixes(kseed)
    log_dir = base / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    states = []
    for fmt in FORMATS:
        st = KillState(base / f"{cls}-{fmt}", fmt)
        if kind == "eviction":
            cap = int(3 * prefix_bytes(fmt, base / f"{cls}-{fmt}-size", MAX_CHUNKS))
            st.config = store_config(fmt, disk_capacity_bytes=cap)
            # Filled to near its capacity (a prefix takes at most a third): the writer's
            # first inserts already evict.
            with PrefixStore(st.dir, SHAPE, store_config(fmt)) as store:
                while store.inspect().accounting.disk_bytes() <= 0.6 * cap:
                    fill_store(store, prefixes, [st.next_id], rng)
                    st.committed.add(st.next_id)
                    st.next_id += 1
        else:
            with PrefixStore(st.dir, SHAPE, st.store_config()) as store:
                fill_store(store, prefixes, range(n_fill), rng)
            st.committed = set(range(n_fill))
            st.next_id = n_fill
        states.append(st)
    res = {"iterations": iterations, "kills_by_phase": {}, "writer_errors": 0,
           "writer_finished": 0, "orphans": 0, "bad_nodes": 0, "removals": 0,
           "over_capacity": 0}
    if kind == "quarantine":
        res.update(corruptions_injected=0, corruptions_detected=0, detected_by_writer=0,
                   false_detections=0, not_repaired=0)
    estimate = {"recovery": 0.05, "eviction": max_delay, "quarantine": 0.5}[kind]
    harmless = wrong = injected = detected = 0
    for it in range(iterations):
        st = states[it % len(states)]
        damaged: dict[int, str] = {}
        if kind == "recovery":
            make_orphans(st.dir / "data", n_orphans, rng)
            argv = writer_argv(st.dir, st.fmt, kseed, st.next_id, 6, "open")
            # The first kill as soon as opening starts: recovery is under way then.
            delay = 0.0 if it == 0 else float(rng.uniform(0, 1.5 * estimate))
            start, poll = "OPENING", 0.001
        elif kind == "eviction":
            argv = writer_argv(st.dir, st.fmt, kseed, st.next_id, 40, "evict",
                               capacity=st.config.disk_capacity_bytes)
            # Every other kill a few milliseconds after an eviction starts.
            start, delay, poll = ("READY", float(rng.uniform(0, estimate)), 0.01) if it % 2 \
                else ("REMOVE", float(rng.uniform(0, 0.005)), 0.001)
        else:
            with PrefixStore(st.dir, SHAPE, st.store_config()) as store:
                chosen = disjoint_nodes(store, rng, 3)
                targets = [(node.id, store.entry(node, int(rng.integers(SHAPE.n_layers))))
                           for node in chosen]
                # A store may also drop a damaged node itself when it opens (saying so):
                # prefixes through one need not be whole until they are served again.
                records = [f"REMOVE {removal_record(store, node)}" for node in chosen]
            apply_events(st, records, prefixes)
            for j, (nid, entry) in enumerate(targets):
                kind_j = ("flip_k", "flip_v", "flip_probe", "truncate", "delete")[(it + j) % 5]
                damaged[nid] = f"{kind_j}: {inject(entry, kind_j, rng)}"
                st.verified.discard(os.path.basename(entry.path))
            res["corruptions_injected"] += len(damaged)
            argv = writer_argv(st.dir, st.fmt, kseed, 0, len(st.committed | st.gone), "serve")
            # Every other kill a few milliseconds after the first quarantine starts.
            start, delay, poll = ("READY", float(rng.uniform(0, 1.2 * estimate)), 0.01) \
                if it % 2 else ("CORRUPT", float(rng.uniform(0, 0.005)), 0.001)
        lines, err, rc = run_child(argv, log_dir, start, delay, poll)
        if rc is not None:
            if rc == 0 and lines and lines[-1] == "DONE":
                res["writer_finished"] += 1
            else:
                res["writer_errors"] += 1
                report.fail(cls, writer_died(it, rc, err, log_dir, keep_logs, cls))
        words = [x.split(" ", 1)[0] for x in lines]
        for x in lines:
            if x.startswith(("OPENED ", "SERVED ")):
                estimate = max(estimate, float(x.split()[1]))
        if rc is not None:
            phase = "finished"
        elif kind == "recovery":
            phase = "before opening" if "OPENING" not in words else \
                "opening (recovery)" if "OPENED" not in words else "after opening"
        elif kind == "eviction":
            phase = "removing" if words.count("REMOVE") > words.count("REMOVED") else \
                kill_phase(lines)
        else:
            phase = "before serving" if "SERVE" not in words else \
                "quarantining" if words.count("CORRUPT") > words.count("QUARANTINED") else \
                "removing" if words.count("REMOVE") > words.count("REMOVED") else "serving"
        res["kills_by_phase"][phase] = res["kills_by_phase"].get(phase, 0) + 1
        begun = [int(x.split()[1]) for x in lines if x.startswith("INSERT ")]
        if begun:
            st.next_id = max(begun) + 1
        res["removals"] += apply_events(st, lines, prefixes)
        writer_hits = {int(x.split()[1]) for x in lines if x.startswith("CORRUPT ")}
        writer_wrong = words.count("WRONG")
        for x in lines:
            if x.startswith("UNSERVED "):
                report.fail(cls, f"iteration {it}: the writer could not serve prefix "
                                 f"{x.split(' ', 2)[1]}: {x.split(' ', 2)[2:]}")
        lost_before = len(st.lost)
        failures: list[str] = []
        out = verify_after_crash(st, prefixes, failures, rng, resample=0.25,
                                 expected_bad=set(damaged))
        res["orphans"] += out["orphans"]
        res["bad_nodes"] += out["bad_nodes"]
        res["over_capacity"] += out["over_capacity"]
        wrong += out["wrong_nodes"] + writer_wrong
        if writer_wrong:
            failures.append(f"iteration {it}: the writer read {writer_wrong} prefixes with "
                            "KV that differs")
        if kind == "quarantine":
            # Serve everything here: what the writer did not reach is detected now.
            hits: list[int] = []
            stats: dict = {}
            ids = sorted(st.committed | st.gone)
            with StoreWarnings(), PrefixStore(st.dir, SHAPE, st.store_config()) as store:
                dropped = {nid for nid in damaged if nid not in store.inspect().state.tree.nodes} - writer_hits
                for p in ids:
                    if not serve(store, prefixes.tokens(p), hits, stats):
                        res["not_repaired"] += 1
                        failures.append(f"iteration {it}: prefix {p} not exact after "
                                        f"recompute {stats.get('errors', [])[-1:]}")
            wrong += stats.get("served_corrupt", 0)
            found = (writer_hits | set(hits) | dropped) & set(damaged)
            res["corruptions_detected"] += len(found)
            res["detected_by_writer"] += len(writer_hits & set(damaged))
            detected += len(found)
            for nid in sorted(set(damaged) - found):
                failures.append(f"iteration {it}: damage to node {nid} not detected "
                                f"({damaged[nid]})")
            false = set(hits) - set(damaged)
            res["false_detections"] += len(false)
            for nid in sorted(false):
                failures.append(f"iteration {it}: node {nid} reported corrupt, not damaged")
            st.committed, st.gone = set(ids), set()
        for line in failures:
            report.fail(cls, line)
        injected += 1 + len(damaged)
        harmless += not failures and len(st.lost) == lost_before and (rc is None or rc == 0)
    for st in states:
        failures = []
        out = final_read_back(st, prefixes, failures)
        for line in failures:
            report.fail(cls, line)
        res["bad_nodes"] += out["bad_nodes"]
        wrong += out["wrong_nodes"]
    res["committed"] = sum(len(s.committed) for s in states)
    res["removed_by_design"] = sum(len(s.gone) for s in states)
    res["lost"] = sum(len(s.lost) for s in states)
    report.count(cls, injected=injected, detected=detected, harmless=harmless,
                 served_wrong=wrong, lost=res["lost"])
    return res


def run_crash(ctx: Context, kind: str) -> dict:
    q = ctx.quick
    return crash_loop(ctx.base, kind, 2 if q else 10, ctx.seed, ctx.max_delay, ctx.report,
                      ctx.keep_logs, n_orphans=600 if q else 2500, n_fill=6 if q else 10)
