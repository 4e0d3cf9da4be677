"""One injected write fault in each of a series of inserts, splits and reorders, and what
must hold after it (shared by the enospc and fsync classes)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from impress_flexgen.store import PrefixStore

from .kv import C, SHAPE, Prefixes, insert_prefix, store_config
from .readback import fill_store, live_files, orphans, prefix_exact, stray_files
from .report import StoreWarnings, error_text


def write_faults(sdir: Path, n_inject: int, rng, prefixes: Prefixes, fmt: str, make_fault,
                 per_file: int, accepted: tuple, fail) -> dict:
    """Inserts, splits and reorders with one injected write fault each (make_fault(j,
    fail_at): a context manager with .fired and .mode; per_file: faultable calls per file
    written). An insert must raise one of `accepted`, a reorder skip the layer; no new file
    may stay behind, earlier prefixes must read back exact, and the operation must work
    once the fault is gone."""
    res = {"injected": 0, "handled": 0, "left_files": 0, "by_case": {}, "raised": {},
           "earlier_lost": 0}
    with StoreWarnings() as warned, PrefixStore(sdir, SHAPE, store_config(fmt)) as store:
        done: list[np.ndarray] = []
        for p in range(4):
            fill_store(store, prefixes, [p], rng)
            done.append(prefixes.tokens(p))
        for j in range(n_inject):
            case = ("insert", "split", "reorder")[j % 3]
            if case == "reorder":
                node = list(store.inspect().state.tree.nodes.values())[int(rng.integers(len(store.inspect().state.tree)))]
                for layer in range(SHAPE.n_layers):
                    scores = rng.random(node.n_tokens).astype(np.float32)
                    store.record_selection(store.entry(node, layer), scores, None, None)
                fail_at = int(rng.integers(per_file * SHAPE.n_layers))
                tokens = None
            else:
                if case == "split":  # shares the first chunk of a stored node's prefix
                    base_tokens = done[int(rng.integers(len(done)))]
                    new = rng.integers(0, 1 << 20, size=3 * C).astype(np.int32)
                    tokens = np.concatenate([base_tokens[:C], new])
                    match = store.match_prefix(tokens)
                    needs_split = match.segments and match.segments[-1][1] < \
                        match.segments[-1][0].n_tokens
                    store.release(match)
                    fail_at = int(rng.integers(per_file * (3 if needs_split else 1) *
                                               SHAPE.n_layers))
                else:
                    tokens = rng.integers(0, 1 << 20, size=2 * C + 3).astype(np.int32)
                    fail_at = int(rng.integers(per_file * SHAPE.n_layers))
            before = live_files(store)
            stray_before = stray_files(store)  # left by earlier cases: not counted again
            ok, why = True, ""
            with make_fault(j, fail_at) as patch:
                if tokens is None:
                    try:
                        n_done = store.inspect().reorderer.reorder_node(node)
                        if n_done >= SHAPE.n_layers:
                            ok, why = False, "reorder did every layer despite the fault"
                    except Exception as exc:  # noqa: BLE001 - reported as unhandled
                        ok, why = False, f"reorder raised {error_text(exc)}"
                else:
                    try:
                        insert_prefix(store, tokens)
                        ok, why = False, "insert returned despite the fault"
                    except accepted as exc:
                        name = type(exc).__name__
                        res["raised"][name] = res["raised"].get(name, 0) + 1
                    except Exception as exc:  # noqa: BLE001 - reported as unhandled
                        ok, why = False, f"insert raised {error_text(exc)}"
            if not patch.fired:
                continue  # nothing was written (the op had nothing to do): not injected
            res["injected"] += 1
            label = f"{case}/{patch.mode}"
            stray = stray_files(store) - stray_before
            if stray:
                res["left_files"] += len(stray)
                ok, why = False, f"files left behind: {sorted(stray)}"
            if case == "insert" and live_files(store) != before:
                ok, why = False, "the failed insert changed the store's files"
            lost = [t for t in done if not prefix_exact(store, t)]
            if lost:
                res["earlier_lost"] += len(lost)
                ok, why = False, "an earlier prefix no longer reads back bit-exact"
            # Without the fault the same operation works.
            try:
                if tokens is None:
                    store.inspect().reorderer.reorder_node(node)
                    affected = []
                    for t in done:  # the prefixes whose path holds the reordered node
                        match = store.match_prefix(t)
                        if node in match.nodes:
                            affected.append(t)
                        store.release(match)
                else:
                    insert_prefix(store, tokens)
                    done.append(tokens)
                    affected = [tokens]
                if not all(prefix_exact(store, t) for t in affected):
                    ok, why = False, "not bit-exact after the retry without the fault"
            except Exception as exc:  # noqa: BLE001 - reported
                ok, why = False, f"the retry without the fault raised {error_text(exc)}"
            by_case = res["by_case"].setdefault(label, {"injected": 0, "handled": 0})
            by_case["injected"] += 1
            if ok:
                res["handled"] += 1
                by_case["handled"] += 1
            else:
                fail(f"{sdir.name} {label} (call {fail_at}): {why}")
    res["reorder_skipped_warnings"] = sum("skipped" in m for m in warned.messages)
    # Stray files are only removed when the store is opened again.
    with PrefixStore(sdir, SHAPE, store_config(fmt)) as store:
        res["orphans_after_reopen"] = len(orphans(store))
    if res["orphans_after_reopen"]:
        fail(f"{sdir.name}: {res['orphans_after_reopen']} orphans after reopen")
    return res
