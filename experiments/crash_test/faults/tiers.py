"""tiers: four threads serve overlapping prefixes through GPU and CPU tiers (on the CPU)
while inserts split nodes and background reorders and evictions run; every chunk loaded
is compared with the KV of its logical positions, then every node read back."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from impress_flexgen.store import CorruptNode, PrefixStore, StoreWriteFailed
from impress_flexgen.tiers import ChunkLoad

from ..kv import C, FORMATS, MAX_CHUNKS, SHAPE, Prefixes, expected_bits, kv_from_bits, \
    store_config, tensor_bits
from ..patching import attach_tiers
from ..readback import check_node, expected_probe, is_wrong, orphans, prefix_bytes
from ..registry import Context, fault
from ..report import Report, StoreWarnings, error_text


def tier_request(store: PrefixStore, tokens: np.ndarray, rng, stats: dict,
                 whole: bool = False) -> None:
    """Serve one request through the tiers, checking every chunk against the KV of its
    logical positions; store what is missing. `whole`: every chunk of every layer."""
    aligned = len(tokens) // C * C
    match = store.match_prefix(tokens)
    try:
        for node, used in match.segments:
            # The node's own tokens after the matched part: a partly used node holds more.
            full = np.concatenate([tokens[:node.start], node.tokens])
            want = expected_bits(full)
            layers = range(SHAPE.n_layers) if whole else \
                rng.choice(SHAPE.n_layers, size=2, replace=False).tolist()
            for layer in layers:
                entry = store.entry(node, layer)
                n = entry.layout.n_chunks
                ids = list(range(n)) if whole else \
                    sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
                ratios = store.chunk_ratios(entry, ids)
                chunks, served = store.tiers.wait(store.tiers.submit(ChunkLoad(
                    entry, {"k": ids, "v": ids}, {"k": ratios, "v": ratios}, node)))
                for tier in ("gpu", "cpu", "disk"):
                    stats[tier] += served[tier]
                for kind_i, kind in enumerate("kv"):
                    for i, chunk in zip(ids, chunks[kind]):
                        pos = node.start + entry.logical_positions([i])
                        stats["chunks"] += 1
                        got = tensor_bits(chunk.cpu())
                        if not np.array_equal(got, want[layer, kind_i][:, pos]):
                            stats["wrong"] += 1
                            stats["wrong_keys"].append((entry.node_id, layer, entry.version,
                                                        kind, i))
                if whole or rng.random() < 0.25:
                    probe = store.start_probe(entry, node).result()
                    stats["probes"] += 1
                    want_probe = expected_probe(store, entry,
                                                want[layer, 0][:, node.start:node.end])
                    if not torch.equal(probe.view(torch.int32), want_probe.view(torch.int32)):
                        stats["wrong"] += 1
                        stats["wrong_keys"].append((entry.node_id, layer, entry.version,
                                                    "probe", -1))
                scores = rng.random(entry.layout.n_tokens).astype(np.float32)
                store.record_selection(entry, scores, scores > 0.7, ids)
        if match.length < aligned:
            try:
                store.insert(tokens, match.length,
                             kv_from_bits(expected_bits(tokens[:aligned]), match.length))
            except StoreWriteFailed:   # not stored (full, or contended): served all the same
                stats["store_full"] += 1
    finally:
        store.release(match)


def tiers_threads(base: Path, runs: int, requests: int, seed: int, report: Report) -> dict:
    from impress_flexgen.tiers import ChunkCache, TierConfig

    cls = "tiers"
    res = {"runs": runs, "threads": 4, "requests": 0, "chunks": 0, "probes": 0, "wrong": 0,
           "errors": 0, "store_full": 0, "gpu_bytes_served": 0, "cpu_bytes_served": 0,
           "disk_bytes_served": 0, "splits": 0, "reorders": 0, "evictions": 0,
           "orphans": 0, "reorder_races": 0, "reorder_race_messages": []}
    chunk_bytes = SHAPE.n_kv_heads * C * SHAPE.head_dim * 2
    for r in range(runs):
        fmt = FORMATS[r % len(FORMATS)]
        prefixes = Prefixes(seed * 1000 + 61 + r)
        pool = [prefixes.tokens(p) for p in range(16)]
        cap = int(4 * prefix_bytes(fmt, base / f"tiers-{fmt}-size", MAX_CHUNKS))
        sdir = base / f"tiers-{r}-{fmt}"
        config = store_config(fmt, reorder_interval=3, disk_capacity_bytes=cap)
        problems: list[str] = []
        stats_all = []
        with StoreWarnings():
            store = PrefixStore(sdir, SHAPE, config)
            attach_tiers(store, ChunkCache(TierConfig(gpu_bytes=24 * chunk_bytes,
                                                      cpu_bytes=48 * chunk_bytes),
                                           gpu_device=torch.device("cpu")))
            try:
                def worker(t: int, stats: dict) -> None:
                    rng = np.random.default_rng([seed, 71, r, t])
                    for q in range(requests):
                        try:
                            tier_request(store, pool[int(rng.integers(len(pool)))], rng, stats)
                            stats["requests"] += 1
                        except Exception as exc:  # noqa: BLE001 - nothing is damaged: reported
                            stats["errors"] += 1
                            stats["messages"].append(f"thread {t}: {error_text(exc)}")
                        if q % 9 == 8:
                            try:
                                store.reorder_now()
                            except CorruptNode as exc:
                                # A reorder retiring the version another one reads (reported,
                                # as in the kill loop); the nodes are read back after.
                                stats["reorder_races"] += 1
                                stats["race_messages"].append(f"thread {t}: {exc}")

                def fresh() -> dict:
                    return {"chunks": 0, "probes": 0, "wrong": 0, "wrong_keys": [], "gpu": 0,
                            "cpu": 0, "disk": 0, "store_full": 0, "requests": 0, "errors": 0,
                            "reorder_races": 0, "messages": [], "race_messages": []}

                threads = []
                for t in range(4):
                    stats_all.append(fresh())
                    threads.append(threading.Thread(target=worker, args=(t, stats_all[-1]),
                                                    name=f"request-{t}"))
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                # Then every prefix once more, every chunk, with the tiers as they are now.
                final = fresh()
                stats_all.append(final)
                rng = np.random.default_rng([seed, 72, r])
                for tokens in pool:
                    try:
                        tier_request(store, tokens, rng, final, whole=True)
                    except Exception as exc:  # noqa: BLE001 - reported
                        final["errors"] += 1
                        final["messages"].append(f"final pass: {error_text(exc)}")
                res["splits"] += store.inspect().state.metrics.splits
                res["reorders"] += store.inspect().state.metrics.reorders
                res["evictions"] += store.inspect().state.metrics.evictions
            finally:
                store.close()
        for st in stats_all:
            for key in ("chunks", "probes", "wrong", "store_full", "requests", "errors",
                        "reorder_races"):
                res[key] += st[key]
            for tier in ("gpu", "cpu", "disk"):
                res[f"{tier}_bytes_served"] += st[tier]
            problems += st["messages"][:3]
            res["reorder_race_messages"] += st["race_messages"][:2]
            if st["wrong"]:
                problems.append(f"{st['wrong']} chunks differ from their logical positions' KV "
                                f"(keys {st['wrong_keys'][:4]})")
        wrong = sum(st["wrong"] for st in stats_all)
        try:
            with PrefixStore(sdir, SHAPE, config) as store:
                left = orphans(store)
                res["orphans"] += len(left)
                problems += [f"orphan after reopen: {n}" for n in left]
                for node in list(store.inspect().state.tree.nodes.values()):
                    why = check_node(store, node)
                    if why:
                        wrong += is_wrong(why)
                        problems.append(f"after reopen, node {node.id}: {why}")
        except Exception as exc:  # noqa: BLE001 - reported
            problems.append(f"reopening raised {error_text(exc)}")
        for line in problems:
            report.fail(cls, f"run {r} ({fmt}): {line}")
        res["wrong"] = res["wrong"] + wrong - sum(st["wrong"] for st in stats_all)
        report.count(cls, injected=1, harmless=not problems, served_wrong=wrong)
    return res


@fault("tiers")
def run(ctx: Context) -> dict:
    return tiers_threads(ctx.base, 2 if ctx.quick else 4, 15 if ctx.quick else 50, ctx.seed,
                         ctx.report)
