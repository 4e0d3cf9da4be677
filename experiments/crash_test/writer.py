"""The writer: a subprocess that inserts, reads, feeds importance back and reorders until
it is killed, printing one line per event (`COMMITTED <id>` after each insert).

    python -m experiments.crash_test --writer --store DIR --format int4 --seed 0 \
        --start-id 0 --max-inserts 40 --mode kill

Modes: kill (reorders on), power (a snapshot after each commit), open (what matters is
opening), evict (a capacity-limited store), serve (prefixes of a damaged store).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from impress_flexgen.store import CorruptNode, PrefixStore, StoreWriteFailed

from .kv import C, SHAPE, Prefixes, digest, expected_bits, kv_from_bits, store_config
from .patching import on_node_removal, patch, real_write_durable
from .readback import live_files, serve


def snapshot(store: PrefixStore, root: Path, k: int) -> None:
    """What a power loss right now would leave: everything is fsynced at commit (WAL,
    synchronous=FULL), so the database, its WAL and the files they reference as they are.
    Files are linked, not copied: they are never changed once written."""
    part, final = root / f"{k}.part", root / str(k)
    shutil.rmtree(part, ignore_errors=True)
    (part / "data").mkdir(parents=True)
    for name in ("store.sqlite", "store.sqlite-wal"):
        if (store.inspect().state.dir / name).exists():
            shutil.copyfile(store.inspect().state.dir / name, part / name)
    for name in live_files(store):
        os.link(store.inspect().state.dir / "data" / name, part / "data" / name)
    os.rename(part, final)
    shutil.rmtree(root / str(k - 2), ignore_errors=True)  # the parent needs the last one


def removal_record(store: PrefixStore, node) -> str:
    """`<n> <digest>`: prefixes whose first n tokens have that digest pass through `node`
    (n reaches into its first chunk) and lose their part from n - C on if it goes."""
    tokens = np.concatenate([n.tokens for n in store.inspect().state.tree.path_to(node)])
    n = node.start + C
    return f"{n} {digest(tokens[:n])}"


def writer(args) -> int:
    """Insert, read, record importance and (mode kill) reorder until killed; one line per
    event. Mode power: snapshot after each commit; evict: a capacity-limited store;
    open: the interesting part is opening; serve: serve prefixes of a damaged store."""
    out = sys.stdout

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    def traced_write(path, chunks, total_bytes):
        say("WRITE")
        real_write_durable(path, chunks, total_bytes)
        say("WROTE")

    patch("write_durable", traced_write)
    rng = np.random.default_rng([args.seed, 104729, args.start_id])
    prefixes = Prefixes(args.seed)
    reorders = args.mode == "kill"
    config = store_config(args.format, reorder_interval=5 if reorders else 0,
                          disk_capacity_bytes=args.capacity)
    say("OPENING")
    t0 = time.perf_counter()
    store = PrefixStore(args.store, SHAPE, config)
    say(f"OPENED {time.perf_counter() - t0:.4f}")
    if args.mode in ("evict", "serve"):
        # Printed before the store removes a node (eviction, quarantine).
        on_node_removal(store, lambda node: say(f"REMOVE {removal_record(store, node)}"),
                        lambda: say("REMOVED"))
    snaps = Path(args.snapshots) if args.snapshots else None
    k = 0
    if snaps:
        snapshot(store, snaps, k)
        say(f"SNAPSHOT {k} -1")
    say("READY")
    if args.mode == "serve":
        ids = rng.permutation(np.arange(args.start_id, args.start_id + args.max_inserts))
        t0 = time.perf_counter()
        stats: dict = {}
        for p in ids.tolist():
            say(f"SERVE {p}")
            ok = serve(store, prefixes.tokens(p), [], stats, say)
            say(f"COMMITTED {p}" if ok else f"UNSERVED {p} {stats.get('errors', [''])[-1]}")
        say(f"SERVED {time.perf_counter() - t0:.4f}")
        say("DONE")
        store.close()
        return 0
    for p in range(args.start_id, args.start_id + args.max_inserts):
        tokens = prefixes.tokens(p)
        aligned = len(tokens) // C * C
        match = store.match_prefix(tokens)
        # Read what the request matched and feed the selection back, as decoding would.
        for node, used in match.segments:
            layer = int(rng.integers(SHAPE.n_layers))
            entry = store.entry(node, layer)
            store.start_probe(entry, node).result()
            ids = sorted(rng.choice(entry.layout.n_chunks, size=min(2, entry.layout.n_chunks),
                                    replace=False).tolist())
            store.inspect().reads.read_chunks(entry, "k", ids, node)
            scores = rng.random(node.n_tokens).astype(np.float32)
            store.record_selection(entry, scores, scores > 0.7, ids)
        split = bool(match.segments) and match.length < aligned and \
            match.segments[-1][1] < match.segments[-1][0].n_tokens
        say(f"INSERT {p} {'split' if split else 'plain'}")
        kv = kv_from_bits(expected_bits(tokens[:aligned]), match.length)
        try:
            path = store.insert(tokens, match.length, kv)
        except StoreWriteFailed as exc:
            say(f"STOREFULL {p} {exc}")
            store.release(match)
            continue
        say(f"COMMITTED {p}")
        store.release(match)
        if snaps:
            k += 1
            snapshot(store, snaps, k)
            say(f"SNAPSHOT {k} {p}")
        for node in path[-2:]:
            for layer in range(SHAPE.n_layers):
                entry = store.entry(node, layer)
                scores = rng.random(node.n_tokens).astype(np.float32)
                store.record_selection(entry, scores, scores > 0.8, None)
        for every, what in ((3, "node"), (7, "all")):
            if p % every or not reorders:
                continue
            say(f"REORDER {what}")
            try:
                if what == "node":
                    store.inspect().reorderer.reorder_node(path[int(rng.integers(len(path)))])
                else:
                    store.reorder_now()
            except CorruptNode as exc:
                # Seen when the background reorder retired the version this reorder was
                # reading (a store race, reported); the node itself is checked after
                # the kill, so a real corruption would not pass unnoticed.
                say(f"REORDER_FAILED {exc}")
            say("REORDERED")
    say("DONE")
    store.close()
    return 0


def kill_phase(lines: list[str]) -> str:
    """Where the writer was when it was killed, from the last events it printed."""
    op, writes, in_write = "between operations", 0, 0
    for line in lines:
        word = line.split(" ", 1)[0]
        if word == "INSERT":
            op, writes = ("split" if line.endswith("split") else "insert"), 0
        elif word == "COMMITTED" or word == "REORDERED":
            op = "between operations"
        elif word == "REORDER":
            op = "reorder"
        elif word == "WRITE":
            in_write += 1
        elif word == "WROTE":
            in_write -= 1
            writes += 1
    if in_write > 0:
        return "file write+fsync"
    if op == "split" and writes < 2 * SHAPE.n_layers:
        return "split"
    if op in ("insert", "split") and writes >= SHAPE.n_layers:
        return "metadata commit"
    return op
