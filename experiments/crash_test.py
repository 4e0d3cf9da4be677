"""Crash, corruption and disk-full torture test of the prefix KV store.

    python -m experiments.crash_test                          # every class, >= 200 iterations
    python -m experiments.crash_test --quick --json out.json  # fewer, under 2 minutes
    python -m experiments.crash_test --iterations 200 --dir /mnt/nvme/crash-test
    python -m experiments.crash_test --only power_loss,sqlite_damage

Small shapes (4 layers, 2 KV heads of 32, chunks of 16 tokens), an int4-probe and an
fp16-probe store alternately. KV is regenerated from token ids, so any process can check
bits. Each part injects one class of fault and counts, per class: injected; detected (the
store refused or reported it: CorruptNode, UserError, StoreFull, a dropped node); harmless
(everything read back bit-exact anyway); served_wrong (KV that differs, not reported); lost
(a committed prefix gone without a reason).

kill            A writer process inserts prefixes (many share leading chunks, so nodes are
                split), reads what it matched, feeds importance back and reorders (on
                demand and in the background), printing `COMMITTED <id>` after each insert.
                SIGKILL after a random delay; the store is reopened here and every node is
                read back (probe copy and K/V) against KV regenerated from its tokens. A
                committed prefix is lost unless its whole chunk-aligned length matches and
                reads back exact. Files in data/ no live layer references, and *.tmp files,
                are orphans.
power_loss      The same writer, reorders off, copies store.sqlite and its WAL (and links
                the files they reference) after every committed insert. After the kill the
                last copy is put back (what a power loss after that commit leaves: it was
                fsynced), data files it does not reference are deleted, truncated or
                zero-filled (unsynced data), a torn frame may be appended to the WAL. Every
                prefix committed up to that copy must read back exact, no orphan remain.
crash_recovery  Killed while opening a store with many orphan files to delete,
crash_eviction  while a capacity-limited store evicts,
crash_quarantine  while damaged nodes are served, quarantined and recomputed. What the
                writer reported removing (before removing it) may be gone, never wrong.
corruption      Bit flips (K, V, probe), truncations and deleted files in (node, layer) files
                of nodes none of which lies below another; every prefix is served like a
                request (CorruptNode: quarantine, recompute, insert) and must then be exact.
torn_write      A suffix of a referenced file truncated or overwritten (a lying fsync);
                the quarantine stays within StoreConfig.quarantine_bytes and is counted.
io_error        EIO from pread/preadv, a directory, a FIFO or a symlink in place of a layer
                file: CorruptNode, quarantine, recompute; a FIFO must not block readers.
capacity        A store with room for about three prefixes takes ten: it evicts, stays under
                its capacity and serves the newest.
enospc          write_durable fails with ENOSPC (before or part-way through a write) during
                inserts, splits, reorders: StoreFull, reorder skipped, no file left behind,
                earlier prefixes exact, the same operation works without the fault.
fsync           os.fsync fails with EIO (file or directory) in the same operations: the
                operation fails (StoreFull, StoreWriteFailed or OSError: counted by type),
                the rest as enospc.
sqlite_full     SQLite's page limit reached during an insert: StoreFull, no file left.
sqlite_damage   Copies of a store taken during a run get bits flipped (anywhere, or in the
                layers index), pages zeroed, the database or WAL truncated, or become a
                zero-length or foreign database. Opening one either refuses with UserError
                (data/ untouched, a foreign database unchanged) or serves only exact KV;
                nodes it drops (saying so, unless the WAL was damaged: SQLite then serves
                an earlier commit) are detected, and their files must not stay in data/.
                A seeded fuzz loop; each iteration replays from (seed, iteration).
tiers           Four threads serve overlapping prefixes through GPU and CPU tiers (on the
                CPU) while inserts split nodes and background reorders and evictions run;
                every chunk loaded is compared with the KV of its logical positions.

Exit status 0 only when no fault class has served_wrong or lost, no orphan remains after
recovery, every injected fault is detected or harmless and no other failure was recorded
(a writer dying on its own, a node reading back wrong, a store over its capacity).
Expectations that come with store features this tree does not have yet (found by feature
checks: StoreConfig.quarantine_bytes, disk_layout.metadata.NodeRow) are run and reported
under "not_yet" without failing the run; --strict enforces them anyway. Also reported
without failing: CorruptNode raised by a reorder in the writer (a reorder racing another).

--json writes "faults" ({class: {injected, detected, harmless, served_wrong, lost}}),
"served_wrong", "lost" and "orphans" (= "orphans_after_recovery") over the enforced
classes, "iterations" (every injected fault of every class), "not_yet" and "pending", the
kill loop's "committed", the corruption, capacity and ENOSPC totals, and per part details
(timings, failures) under "details".
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

import disk_layout.io as disk_io
import disk_layout.metadata as meta_mod
import impress_flexgen.store as store_mod

# The store's modules that touch the file system (faults are injected into each).
STORE_FILE_MODULES = ()     # the store makes every system call through disk_layout.io
from disk_layout.format import decode_probe, encode_probe
from impress_flexgen.cli import ArgumentParser, finite_float, run_main, write_json
from impress_flexgen.errors import UserError
from impress_flexgen.store import CorruptNode, ModelShape, PrefixStore, StoreConfig, StoreFull

ROOT = Path(__file__).resolve().parents[1]
PROG = "python -m experiments.crash_test"
SHAPE = ModelShape("crash", n_layers=4, n_kv_heads=2, head_dim=32)
C = 16
FORMATS = ("int4", "fp16")
MAX_CHUNKS = 10
M64 = (1 << 64) - 1
COUNTERS = ("injected", "detected", "harmless", "served_wrong", "lost")
PARTS = ("kill", "power_loss", "crash_recovery", "crash_eviction", "crash_quarantine",
         "corruption", "torn_write", "io_error", "capacity", "enospc", "fsync", "sqlite_full",
         "sqlite_damage", "tiers")

# Feature checks: the expectations of a class are enforced once the store has the feature
# they come with; before that they run and are reported as "not yet".
NEW_STORE = "quarantine_bytes" in {f.name for f in dataclasses.fields(StoreConfig)}
NEW_METADATA = hasattr(meta_mod, "NodeRow")
# What an insert raises when it stores nothing and the request is served anyway.
WRITE_FAILED = getattr(store_mod, "StoreWriteFailed", StoreFull)


def pending_classes(strict: bool) -> dict[str, str]:
    """Fault classes whose expectations the store is not meant to meet yet, and why."""
    if strict:
        return {}
    out = {}
    if not NEW_STORE:
        why = ("StoreConfig has no quarantine_bytes: reads do not yet turn every OSError "
               "into CorruptNode, failed writes and a full SQLite are not yet cleaned up")
        for cls in ("io_error", "fsync", "sqlite_full"):
            out[cls] = why
    if not (NEW_STORE and NEW_METADATA):
        why = ("disk_layout.metadata has no NodeRow or StoreConfig no quarantine_bytes: rows "
               "carry no checksums and node ids may be reused")
        for cls in ("sqlite_damage", "tiers"):
            out[cls] = why
    return out


class Report:
    """Per fault class counters, failures (fail the run) and not-yet notes (do not)."""

    def __init__(self, pending: dict[str, str]):
        self.pending = pending
        self.failures: list[str] = []
        self.not_yet: list[str] = []
        self.faults: dict[str, dict[str, int]] = {}

    def count(self, cls: str, **n: int) -> None:
        row = self.faults.setdefault(cls, dict.fromkeys(COUNTERS, 0))
        for key, value in n.items():
            row[key] += int(value)

    def fail(self, cls: str, message: str) -> None:
        (self.not_yet if cls in self.pending else self.failures).append(f"{cls}: {message}")


# ---------------------------------------------------------------------------------------
# Deterministic prefixes and KV: any process can regenerate the expected bits.

def store_config(fmt: str, **kw) -> StoreConfig:
    base = dict(chunk_size=C, probe_heads=(0,) if fmt == "int4" else (0, 1),
                probe_format=fmt, reorder_interval=0, read_threads=2)
    base.update(kw)
    return StoreConfig(**base)


def _mix_int(x: int) -> int:
    """splitmix64 finalizer on a Python int."""
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_GRID = (np.arange(SHAPE.n_layers * 2 * SHAPE.n_kv_heads * SHAPE.head_dim, dtype=np.uint64)
         .reshape(SHAPE.n_layers, 2, SHAPE.n_kv_heads, 1, SHAPE.head_dim)
         * np.uint64(0x9E3779B97F4A7C15))


def expected_bits(tokens) -> np.ndarray:
    """uint16 bits of fp16 KV (layers, 2, heads, n, head_dim) for every position of `tokens`.

    The value at position i is a function of tokens[:i + 1] (a rolling hash), as a model's
    KV is: prefixes sharing leading tokens share that part of their KV exactly, and KV of
    one prefix can never pass for another's. Every fp16 bit pattern but NaN/Inf occurs.
    """
    toks = np.asarray(tokens, dtype=np.int64).tolist()
    h, hashes = 0x243F6A8885A308D3, np.empty(len(toks), dtype=np.uint64)
    for i, t in enumerate(toks):
        h = _mix_int(h ^ ((t + 1) * 0x100000001B3 + i))
        hashes[i] = h
    with np.errstate(over="ignore"):
        bits = (_mix(hashes[None, None, None, :, None] ^ _GRID) >> np.uint64(48)).astype(np.uint16)
    special = (bits & 0x7C00) == 0x7C00          # exponent all ones: Inf or NaN
    bits[special] &= np.uint16(0xBFFF)
    return bits


def kv_from_bits(bits: np.ndarray, start: int = 0, end: int | None = None):
    """Per layer (K, V) fp16 tensors of positions start..end."""
    t = torch.from_numpy(np.ascontiguousarray(bits[:, :, :, start:end]).view(np.float16))
    return [(t[layer, 0], t[layer, 1]) for layer in range(SHAPE.n_layers)]


def insert_prefix(store: PrefixStore, tokens: np.ndarray) -> list:
    """Store `tokens`' regenerated KV past what is matched, as a request does; the path."""
    match = store.match_prefix(tokens)
    try:
        aligned = len(tokens) // C * C
        return store.insert(tokens, match.length,
                            kv_from_bits(expected_bits(tokens[:aligned]), match.length))
    finally:
        store.release(match)


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def digest(tokens) -> str:
    return hashlib.sha1(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:16]


class Prefixes:
    """Token ids of prefix p: a pure function of (seed, p); about 60% share leading chunks
    (some or all of them) with an earlier prefix, the rest are new."""

    def __init__(self, seed: int):
        self.seed = seed
        self._tokens: dict[int, np.ndarray] = {}

    def tokens(self, p: int) -> np.ndarray:
        if p not in self._tokens:
            rng = np.random.default_rng([self.seed, 7919, p])
            shared = np.zeros(0, dtype=np.int32)
            if p > 0 and rng.random() < 0.6:
                base = self.aligned(int(rng.integers(0, p)))
                n_base = len(base) // C
                k = int(rng.integers(1, n_base + 1))
                shared = base[:min(k, MAX_CHUNKS - 1) * C]
            room = MAX_CHUNKS - len(shared) // C
            n_new = int(rng.integers(1, min(room, 5) + 1)) * C + int(rng.integers(0, C))
            new = rng.integers(0, 1 << 20, size=n_new).astype(np.int32)
            self._tokens[p] = np.concatenate([shared, new]).astype(np.int32)
        return self._tokens[p]

    def aligned(self, p: int) -> np.ndarray:
        t = self.tokens(p)
        return t[:len(t) // C * C]


class StoreWarnings(logging.Handler):
    """Collects the store's log records (quarantines, skipped reorders, dropped rows)
    instead of printing them."""

    LOGGERS = ("impress_flexgen.store", "impress_flexgen.metadata", "disk_layout")

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)
        return False


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


# ---------------------------------------------------------------------------------------
# Reading a store back

def files_on_disk(store_dir: Path) -> tuple[set[str], list[str]]:
    """Names in data/ other than directories, and every *.tmp anywhere under the store
    directory. (A directory in data/ is not the store's to delete: it is reported apart.)"""
    data = store_dir / "data"
    names = {e.name for e in os.scandir(data) if not e.is_dir(follow_symlinks=False)} \
        if data.is_dir() else set()
    tmps = [str(p.relative_to(store_dir)) for p in store_dir.rglob("*.tmp")]
    return names, tmps


def live_files(store: PrefixStore) -> set[str]:
    return {os.path.basename(e.path) for n in store.tree.nodes.values() for e in n.layers}


def stray_files(store: PrefixStore) -> set[str]:
    """Files in data/ that no live layer entry references, and *.tmp files anywhere."""
    names, tmps = files_on_disk(store.dir)
    return {f"data/{n}" for n in names - live_files(store)} | set(tmps)


def orphans(store: PrefixStore) -> list[str]:
    return sorted(stray_files(store))


def is_wrong(why: str | None) -> bool:
    """check_node's verdict says bits differ (not: unreadable, which the store reports)."""
    return why is not None and not why.startswith(("unreadable", "error"))


def expected_probe(store: PrefixStore, entry, want_k: np.ndarray) -> torch.Tensor:
    """The probe section `entry` should hold, from logical K bits (heads, n, head_dim)."""
    k_phys = torch.from_numpy(np.ascontiguousarray(want_k).view(np.float16))
    if entry.mapping is not None:
        k_phys = k_phys[:, torch.from_numpy(np.asarray(entry.mapping, dtype=np.int64))]
    lay = entry.layout
    return decode_probe(encode_probe(k_phys[list(store.config.probe_heads)], lay.probe_format),
                        lay.probe_format, (lay.n_probe, lay.n_tokens, lay.head_dim))


def check_node(store: PrefixStore, node) -> str | None:
    """Read every layer of `node` (probe copy and K/V); None if bit-exact, else why not:
    "unreadable: ..." (CorruptNode), "error: ..." (any other exception), or how bits differ."""
    try:
        tokens = np.concatenate([n.tokens for n in store.tree.path_to(node)])
        want = expected_bits(tokens)[:, :, :, node.start:node.end]
        for layer in range(SHAPE.n_layers):
            entry = store.entry(node, layer)
            try:
                probe = store.read_probe(entry, node)
                k, v = store.read_layer(entry, node)
            except CorruptNode as exc:
                return f"unreadable: {exc}"
            if not (k.shape == v.shape == want[layer, 0].shape and
                    np.array_equal(tensor_bits(k), want[layer, 0]) and
                    np.array_equal(tensor_bits(v), want[layer, 1])):
                return f"layer {layer} K/V differ from the expected bits"
            want_probe = expected_probe(store, entry, want[layer, 0])
            if probe.shape != want_probe.shape or \
                    not torch.equal(probe.view(torch.int32), want_probe.view(torch.int32)):
                return f"layer {layer} probe copy differs from the expected keys"
    except Exception as exc:  # noqa: BLE001 - reported: the store must say CorruptNode
        return f"error: {error_text(exc)}"
    return None


def read_prefix(store: PrefixStore, match) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A request's read of its matched prefix: probe and K/V of every layer, logical order."""
    out = []
    for layer in range(SHAPE.n_layers):
        ks, vs = [], []
        for node, used in match.segments:
            entry = store.entry(node, layer)
            store.read_probe(entry, node)
            k, v = store.read_layer(entry, node)
            ks.append(k[:, :used])
            vs.append(v[:, :used])
        empty = torch.zeros(SHAPE.n_kv_heads, 0, SHAPE.head_dim, dtype=torch.float16)
        out.append((torch.cat(ks, 1) if ks else empty, torch.cat(vs, 1) if vs else empty))
    return out


def prefix_exact(store: PrefixStore, tokens: np.ndarray) -> bool:
    """The store covers tokens' whole chunk-aligned length and reads it back bit-exact."""
    aligned = len(tokens) // C * C
    match = store.match_prefix(tokens)
    try:
        if match.length != aligned:
            return False
        try:
            got = read_prefix(store, match)
        except Exception:  # noqa: BLE001 - CorruptNode, or an error counted elsewhere
            return False
        want = expected_bits(tokens[:aligned])
        return all(np.array_equal(tensor_bits(k), want[layer, 0]) and
                   np.array_equal(tensor_bits(v), want[layer, 1])
                   for layer, (k, v) in enumerate(got))
    finally:
        store.release(match)


def serve(store: PrefixStore, tokens: np.ndarray, hits: list[int], stats: dict,
          say=None) -> bool:
    """Serve a prefix like a request: read what is stored; on CorruptNode quarantine and
    retry; recompute (regenerate) and insert what is missing. True if it is then exact.
    Any other exception is recorded in stats["errors"] (the store should have said
    CorruptNode) and the prefix is given up."""
    aligned = len(tokens) // C * C
    want = expected_bits(tokens[:aligned])
    for _ in range(SHAPE.n_layers * 4):
        match = store.match_prefix(tokens)
        corrupt = None
        try:
            got = read_prefix(store, match)
            if not all(np.array_equal(tensor_bits(k), want[layer, 0, :, :match.length]) and
                       np.array_equal(tensor_bits(v), want[layer, 1, :, :match.length])
                       for layer, (k, v) in enumerate(got)):
                stats["served_corrupt"] = stats.get("served_corrupt", 0) + 1
                if say:
                    say("WRONG")
            if match.length < aligned:
                stats["recomputed"] = stats.get("recomputed", 0) + 1
                store.insert(tokens, match.length, kv_from_bits(want, match.length))
        except CorruptNode as exc:
            corrupt = exc
        except Exception as exc:  # noqa: BLE001 - recorded, the caller reports it
            stats.setdefault("errors", []).append(error_text(exc))
            store.release(match)
            return False
        store.release(match)
        if corrupt is None:
            return prefix_exact(store, tokens)
        hits.append(corrupt.node.id)
        if say:
            say(f"CORRUPT {corrupt.node.id}")
        try:
            store.quarantine(corrupt.node, str(corrupt))
        except Exception as exc:  # noqa: BLE001 - recorded, the caller reports it
            stats.setdefault("errors", []).append(f"quarantine: {error_text(exc)}")
            return False
        if say:
            say("QUARANTINED")
    return False


def fill_store(store: PrefixStore, prefixes: Prefixes, ids, rng) -> None:
    """Insert prefixes like requests, feed random importance back, reorder now and then."""
    for i, p in enumerate(ids):
        tokens = prefixes.tokens(p)
        path = insert_prefix(store, tokens)
        for node in path:
            for layer in range(SHAPE.n_layers):
                scores = rng.random(node.n_tokens).astype(np.float32)
                store.record_selection(store.entry(node, layer), scores, scores > 0.8, None)
        if i % 4 == 3:
            store.reorder_now()


def disjoint_nodes(store: PrefixStore, rng, n: int) -> list:
    """Up to n nodes of which none lies below another: quarantining one never hides another."""
    chosen: list = []
    for nid in rng.permutation(sorted(store.tree.nodes)).tolist():
        node = store.tree.nodes[nid]
        family = set(store.tree.path_to(node)) | set(store.tree.subtree(node))
        if not any(c in family for c in chosen):
            chosen.append(node)
        if len(chosen) == n:
            break
    return chosen


# ---------------------------------------------------------------------------------------
# The writer (a subprocess) and the loops that kill it

def snapshot(store: PrefixStore, root: Path, k: int) -> None:
    """What a power loss right now would leave: everything is fsynced at commit (WAL,
    synchronous=FULL), so the database, its WAL and the files they reference as they are.
    Files are linked, not copied: they are never changed once written."""
    part, final = root / f"{k}.part", root / str(k)
    shutil.rmtree(part, ignore_errors=True)
    (part / "data").mkdir(parents=True)
    for name in ("store.sqlite", "store.sqlite-wal"):
        if (store.dir / name).exists():
            shutil.copyfile(store.dir / name, part / name)
    for name in live_files(store):
        os.link(store.dir / "data" / name, part / "data" / name)
    os.rename(part, final)
    shutil.rmtree(root / str(k - 2), ignore_errors=True)  # the parent needs the last one


def removal_record(store: PrefixStore, node) -> str:
    """`<n> <digest>`: prefixes whose first n tokens have that digest pass through `node`
    (n reaches into its first chunk) and lose their part from n - C on if it goes."""
    tokens = np.concatenate([n.tokens for n in store.tree.path_to(node)])
    n = node.start + C
    return f"{n} {digest(tokens[:n])}"


def report_removals(store: PrefixStore, say) -> None:
    """Print `REMOVE <record>` before the store removes a node (eviction, quarantine)."""
    def record(node) -> str:
        return removal_record(store, node)

    real = getattr(getattr(store, "removal", None), "remove_subtree", None)
    if real is not None:
        def remove_subtree(node, *a, **kw):
            say(f"REMOVE {record(node)}")
            out = real(node, *a, **kw)
            say("REMOVED")
            return out
        store.removal.remove_subtree = remove_subtree
        return
    real_delete = store.meta.delete_node   # splits delete rows too: more is allowed to go

    def delete_node(nid, *a, **kw):
        node = store.tree.nodes.get(nid)
        if node is not None:
            say(f"REMOVE {record(node)}")
        return real_delete(nid, *a, **kw)
    store.meta.delete_node = delete_node


def writer(args) -> int:
    """Insert, read, record importance and (mode kill) reorder until killed; one line per
    event. Mode power: snapshot after each commit; evict: a capacity-limited store;
    open: the interesting part is opening; serve: serve prefixes of a damaged store."""
    out = sys.stdout

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    real_write = disk_io.write_durable

    def traced_write(path, chunks, total_bytes):
        say("WRITE")
        real_write(path, chunks, total_bytes)
        say("WROTE")

    disk_io.write_durable = traced_write
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
        report_removals(store, say)
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
            store.read_probe(entry, node)
            ids = sorted(rng.choice(entry.layout.n_chunks, size=min(2, entry.layout.n_chunks),
                                    replace=False).tolist())
            store.read_chunks(entry, "k", ids, node)
            scores = rng.random(node.n_tokens).astype(np.float32)
            store.record_selection(entry, scores, scores > 0.7, ids)
        split = bool(match.segments) and match.length < aligned and \
            match.segments[-1][1] < match.segments[-1][0].n_tokens
        say(f"INSERT {p} {'split' if split else 'plain'}")
        kv = kv_from_bits(expected_bits(tokens[:aligned]), match.length)
        try:
            path = store.insert(tokens, match.length, kv)
        except WRITE_FAILED as exc:
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
                    store.reorder_node(path[int(rng.integers(len(path)))])
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


def run_child(argv: list[str], log_dir: Path, start_word: str, delay: float,
              poll: float = 0.01) -> tuple[list[str], str, int | None]:
    """Start a writer, SIGKILL it `delay` seconds after it printed `start_word`;
    (lines, stderr, rc: None when killed)."""
    out_path, err_path = log_dir / "writer.out", log_dir / "writer.err"
    mark = f"\n{start_word}"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.crash_test", "--writer", *argv],
            cwd=ROOT, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        rc = None
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if mark in "\n" + out_path.read_text():
                    time.sleep(delay)
                    break
                time.sleep(poll)
        finally:   # also when this process is interrupted: no writer outlives it
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            else:
                rc = proc.returncode  # it ended on its own: finished, or died
    text = out_path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()            # cut short by the kill
    return lines, err_path.read_text(), rc


def writer_argv(store_dir: Path, fmt: str, seed: int, start_id: int, max_inserts: int,
                mode: str = "kill", snapshots: Path | None = None,
                capacity: int | None = None) -> list[str]:
    argv = ["--store", str(store_dir), "--format", fmt, "--seed", str(seed), "--start-id",
            str(start_id), "--max-inserts", str(max_inserts), "--mode", mode]
    if snapshots is not None:
        argv += ["--snapshots", str(snapshots)]
    if capacity is not None:
        argv += ["--capacity", str(capacity)]
    return argv


def run_writer(store_dir: Path, fmt: str, seed: int, start_id: int, delay: float,
               max_inserts: int, log_dir: Path) -> tuple[list[str], str, int | None]:
    """Start a writer, SIGKILL it `delay` seconds after it is ready; (lines, stderr, rc)."""
    return run_child(writer_argv(store_dir, fmt, seed, start_id, max_inserts), log_dir,
                     "READY", delay)


@dataclasses.dataclass
class KillState:
    dir: Path
    fmt: str
    next_id: int = 0
    committed: set = dataclasses.field(default_factory=set)
    lost: set = dataclasses.field(default_factory=set)
    verified: set = dataclasses.field(default_factory=set)  # file names read back exact
    gone: set = dataclasses.field(default_factory=set)      # removed by design, may be short
    config: StoreConfig | None = None

    def store_config(self) -> StoreConfig:
        return self.config or store_config(self.fmt)


def apply_events(st: KillState, lines: list[str], prefixes: Prefixes) -> int:
    """COMMITTED and REMOVE lines in the order printed; returns the removals seen."""
    removals = 0
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "COMMITTED":
            p = int(rest)
            st.committed.add(p)
            st.gone.discard(p)
        elif word == "REMOVE":
            n_text, h = rest.split()
            n, removals = int(n_text), removals + 1
            for p in list(st.committed):
                t = prefixes.aligned(p)
                if len(t) >= n and digest(t[:n]) == h:
                    st.committed.discard(p)
                    st.gone.add(p)
    return removals


def verify_after_crash(st: KillState, prefixes: Prefixes, failures: list[str], rng,
                       resample: float = 0.1, expected_bad: set | None = None) -> dict:
    """Reopen the store; check files, every node's bits and every committed prefix.

    Files are immutable (a reorder or split writes new ones), so a node whose files were
    all read back bit-exact after an earlier kill only has their presence and size
    checked, and is read back again with probability `resample`; the final read-back
    reads everything. Nodes in `expected_bad` (damaged on purpose, not yet detected) may
    be unreadable, and prefixes through them are not lost.
    """
    expected_bad = expected_bad or set()
    before, _ = files_on_disk(st.dir)
    cap = st.store_config().disk_capacity_bytes
    with PrefixStore(st.dir, SHAPE, st.store_config()) as store:
        cleaned = len(before - live_files(store))
        left = orphans(store)
        bad, wrong, read_back = {}, 0, 0
        for node in list(store.tree.nodes.values()):
            names = [os.path.basename(e.path) for e in node.layers]
            why = None
            if all(n in st.verified for n in names) and rng.random() >= resample:
                for e in node.layers:
                    size = os.path.getsize(e.path) if os.path.exists(e.path) else None
                    if size != e.layout.file_bytes:   # what a read reports as CorruptNode
                        why = f"unreadable: layer {e.layer} file {e.path}: size {size}, " \
                              f"expected {e.layout.file_bytes}"
            else:
                why = check_node(store, node)
                read_back += 1
                if why is None:
                    st.verified.update(names)
            if why and is_wrong(why):
                wrong += 1
            if why and not (node.id in expected_bad and not is_wrong(why)):
                bad[node.id] = why
        for p in sorted(st.committed - st.lost):
            tokens = prefixes.tokens(p)
            match = store.match_prefix(tokens)
            ok = match.length == len(tokens) // C * C and not any(n.id in bad for n in match.nodes)
            store.release(match)
            if not ok:
                st.lost.add(p)
                failures.append(f"{st.dir.name}: committed prefix {p} lost (matched "
                                f"{match.length} of {len(tokens) // C * C} tokens; bad nodes "
                                f"{[n.id for n in match.nodes if n.id in bad]})")
        for nid, why in bad.items():
            failures.append(f"{st.dir.name}: node {nid}: {why}")
        for name in left:
            failures.append(f"{st.dir.name}: orphan after recovery: {name}")
        over = 0
        if cap is not None and store.disk_bytes() > cap:
            over = 1
            failures.append(f"{st.dir.name}: {store.disk_bytes()} bytes stored after "
                            f"recovery, capacity {cap}")
        n_nodes = len(store.tree)
    return {"orphans": len(left), "bad_nodes": len(bad), "wrong_nodes": wrong,
            "cleaned": cleaned, "nodes": n_nodes, "nodes_read_back": read_back,
            "over_capacity": over}


def exception_lines(err: str) -> list[str]:
    """The 'Type: message' line of each traceback in a stderr text."""
    lines, out = err.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("Traceback "):
            for nxt in lines[i + 1:]:
                if nxt and not nxt.startswith(" "):
                    out.append(nxt)
                    break
    return out


def writer_died(it: int, rc: int, err: str, log_dir: Path, keep_logs: bool, what: str) -> str:
    kept = log_dir / f"{what}-{it}.err"
    shutil.copy(log_dir / "writer.err", kept)
    shutil.copy(log_dir / "writer.out", log_dir / f"{what}-{it}.out")
    why = exception_lines(err) or err.strip().splitlines()[-1:] or ["no message"]
    return (f"{what} iteration {it}: writer exited {rc} on its own ({'; '.join(why)}); log "
            f"kept in {kept}" + ("" if keep_logs else " (removed with the temporary "
                                 "directory; use --dir)"))


def final_read_back(st: KillState, prefixes: Prefixes, failures: list[str]) -> dict:
    """Every node and every committed prefix read back whole."""
    bad = wrong = 0
    with PrefixStore(st.dir, SHAPE, st.store_config()) as store:
        for node in list(store.tree.nodes.values()):
            why = check_node(store, node)
            if why:
                bad += 1
                wrong += is_wrong(why)
                failures.append(f"{st.dir.name}: final read-back: node {node.id}: {why}")
        for p in sorted(st.committed - st.lost):
            if not prefix_exact(store, prefixes.tokens(p)):
                st.lost.add(p)
                failures.append(f"{st.dir.name}: committed prefix {p} not bit-exact "
                                "in the final read-back")
        nodes = len(store.tree)
    return {"bad_nodes": bad, "wrong_nodes": wrong, "nodes": nodes}


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


# ---------------------------------------------------------------------------------------
# Power loss: the last fsynced state, unsynced files lost or torn

def tear(path: Path, rng) -> str:
    """Unsynced data after a power loss: gone, cut short, zeros where blocks were not
    written, or (written back in time) intact."""
    how = ("deleted", "truncated", "zeroed", "kept")[int(rng.integers(4))]
    if not path.is_file() or path.is_symlink():
        return "kept"
    size = path.stat().st_size
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, int(rng.integers(0, size)) if size else 0)
    elif how == "zeroed" and size:
        start = int(rng.integers(0, (size + 4095) // 4096)) * 4096
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(bytes(size - start))
    return how


def tear_wal_tail(wal: Path, rng) -> int:
    """Append a partly written WAL frame (a real frame header's salts, a random checksum,
    part of a page); returns its length."""
    head = wal.read_bytes()[:32] if wal.exists() else b""
    if len(head) == 32:
        page = int.from_bytes(head[8:12], "big") or 4096
        frame = (int(rng.integers(1, 64)).to_bytes(4, "big") +
                 int(rng.integers(1, 64)).to_bytes(4, "big") + head[16:24] + rng.bytes(8) +
                 rng.bytes(int(rng.integers(0, page))))
    else:
        frame = rng.bytes(int(rng.integers(1, 32)))
    with open(wal, "ab") as f:
        f.write(frame)
    return len(frame)


def restore_power_loss(store_dir: Path, snap: Path, rng, counts: dict) -> None:
    """Put the state of snapshot `snap` back, as a power loss after its commit leaves it."""
    for suffix in ("", "-wal", "-shm"):
        (store_dir / f"store.sqlite{suffix}").unlink(missing_ok=True)
    for name in ("store.sqlite", "store.sqlite-wal"):
        if (snap / name).exists():
            shutil.copyfile(snap / name, store_dir / name)
    referenced = {f.name for f in (snap / "data").iterdir()}
    data = store_dir / "data"
    present = set()
    for f in sorted(data.iterdir()):
        present.add(f.name)
        if f.name not in referenced:     # written after the commit: not fsynced by it
            how = tear(f, rng)
            counts[how] = counts.get(how, 0) + 1
    for name in sorted(referenced - present):   # retired after the commit; there before
        os.link(snap / "data" / name, data / name)
        counts["relinked"] = counts.get("relinked", 0) + 1
    if rng.random() < 0.5:
        tear_wal_tail(store_dir / "store.sqlite-wal", rng)
        counts["torn_wal_tail"] = counts.get("torn_wal_tail", 0) + 1


def power_loss(base: Path, iterations: int, seed: int, max_delay: float, report: Report,
               keep_logs: bool) -> dict:
    rng = np.random.default_rng([seed, 11])
    pseed = seed * 1000 + 31
    prefixes = Prefixes(pseed)
    states = [KillState(base / f"power-{fmt}", fmt) for fmt in FORMATS]
    log_dir = base / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    res = {"iterations": iterations, "restored": 0, "no_snapshot": 0, "writer_errors": 0,
           "writer_finished": 0, "committed": 0, "orphans": 0, "bad_nodes": 0,
           "rolled_back": 0, "files": {}}
    harmless = wrong = 0
    for it in range(iterations):
        st = states[it % len(states)]
        snaps = base / f"power-{st.fmt}-snapshots"
        shutil.rmtree(snaps, ignore_errors=True)
        snaps.mkdir(parents=True)
        delay = float(rng.uniform(0.0, max_delay))
        lines, err, rc = run_child(writer_argv(st.dir, st.fmt, pseed, st.next_id, 40, "power",
                                               snaps), log_dir, "READY", delay)
        if rc is not None:
            if rc == 0 and lines and lines[-1] == "DONE":
                res["writer_finished"] += 1
            else:
                res["writer_errors"] += 1
                report.fail("power_loss", writer_died(it, rc, err, log_dir, keep_logs, "power"))
        begun = [int(x.split()[1]) for x in lines if x.startswith("INSERT ")]
        st.next_id = max(begun) + 1 if begun else st.next_id
        taken = [(int(x.split()[1]), int(x.split()[2])) for x in lines
                 if x.startswith("SNAPSHOT ")]
        if taken:
            k = taken[-1][0]
            restore_power_loss(st.dir, snaps / str(k), rng, res["files"])
            res["restored"] += 1
            st.committed.update(p for _, p in taken if p >= 0)
            res["committed"] += sum(p >= 0 for _, p in taken)
            res["rolled_back"] += sum(x.startswith("COMMITTED ") for x in lines) - \
                sum(p >= 0 for _, p in taken)
        else:
            res["no_snapshot"] += 1    # killed before the store was open: nothing changed
        lost_before = len(st.lost)
        failures: list[str] = []
        out = verify_after_crash(st, prefixes, failures, rng, resample=0.25)
        for line in failures:
            report.fail("power_loss", line)
        res["orphans"] += out["orphans"]
        res["bad_nodes"] += out["bad_nodes"]
        wrong += out["wrong_nodes"]
        harmless += not failures and len(st.lost) == lost_before and (rc is None or rc == 0)
    for st in states:
        failures = []
        out = final_read_back(st, prefixes, failures)
        for line in failures:
            report.fail("power_loss", line)
        res["bad_nodes"] += out["bad_nodes"]
        wrong += out["wrong_nodes"]
        shutil.rmtree(base / f"power-{st.fmt}-snapshots", ignore_errors=True)
    res["lost"] = sum(len(s.lost) for s in states)
    report.count("power_loss", injected=iterations, harmless=harmless, served_wrong=wrong,
                 lost=res["lost"])
    return res


# ---------------------------------------------------------------------------------------
# Crashes during recovery, eviction and quarantine

def make_orphans(data: Path, n: int, rng) -> None:
    """Files a crashed writer may leave: layer files never committed and *.tmp files."""
    for i in range(n):
        name = f"{rng.bytes(16).hex()}.kv" + (".tmp" if i % 4 == 0 else "")
        with open(data / name, "wb") as f:
            f.write(bytes(int(rng.choice([0, 512, 4096]))))


def prefix_bytes(fmt: str, base: Path, chunks: int) -> int:
    """Bytes one prefix of `chunks` chunks takes in a store."""
    tokens = np.arange(chunks * C, dtype=np.int32)
    with PrefixStore(base, SHAPE, store_config(fmt)) as store:
        store.insert(tokens, 0, kv_from_bits(expected_bits(tokens)))
        n = store.disk_bytes()
    shutil.rmtree(base)
    return n


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
                while store.disk_bytes() <= 0.6 * cap:
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
                dropped = {nid for nid in damaged if nid not in store.tree.nodes} - writer_hits
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


# ---------------------------------------------------------------------------------------
# Corruption, torn writes and I/O errors of layer files

CORRUPTIONS = ("flip_k", "flip_v", "flip_probe", "truncate", "delete")
TORN = ("torn_truncate", "torn_garbage", "torn_zero")
IO_KINDS = ("eio", "directory", "fifo", "symlink")


def inject(entry, kind: str, rng) -> str:
    """Damage one (node, layer) file; returns a description."""
    lay, path = entry.layout, entry.path
    name = os.path.basename(path)
    if kind == "delete":
        os.unlink(path)
        return f"deleted {name}"
    if kind == "truncate":
        size = int(rng.integers(0, lay.file_bytes))
        os.truncate(path, size)
        return f"truncated {name} to {size} of {lay.file_bytes} bytes"
    if kind.startswith("torn_"):
        # A write the disk acknowledged but did not finish: its tail, from a sector on.
        at = int(rng.integers(0, max(1, lay.file_bytes // 512))) * 512
        if kind == "torn_truncate":
            os.truncate(path, at)
            return f"cut {name} at {at} of {lay.file_bytes} bytes"
        tail = rng.bytes(lay.file_bytes - at) if kind == "torn_garbage" else \
            bytes(lay.file_bytes - at)
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(tail)
            f.flush()
            os.fsync(f.fileno())
        what = "random bytes" if kind == "torn_garbage" else "zeros"
        return f"{what} over {name} from {at} of {lay.file_bytes} bytes"
    if kind == "flip_probe":
        offset = int(rng.integers(0, lay.probe_bytes))
    else:
        chunk = int(rng.integers(lay.n_chunks))
        offset = lay.chunk_offset(kind[-1], chunk) + int(rng.integers(0, lay.chunk_bytes))
    bit = 1 << int(rng.integers(8))
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ bit]))
        f.flush()
        os.fsync(f.fileno())
    return f"flipped bit {bit:#04x} at byte {offset} of {name}"


def quarantine_size(store_dir: Path) -> int:
    qdir = store_dir / "quarantine"
    return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(qdir)) \
        if qdir.is_dir() else 0


def corruption(base: Path, n_prefixes: int, faults_per_store: int, seed: int,
               failures: list[str], kinds=CORRUPTIONS, cls: str = "corruption",
               quarantine_bytes: int | None = None, fail=None) -> dict:
    """Damage files of disjoint nodes, serve everything, check repair. With torn-write
    kinds a fault may touch only padding: undetected, it is harmless if the node reads
    back exact. With quarantine_bytes the quarantine must stay within it and be counted."""
    fail = fail or failures.append
    res = {"injected": 0, "detected": 0, "harmless": 0, "false_detections": 0,
           "served_corrupt": 0, "recomputed": 0, "not_repaired": 0, "orphans": 0,
           "quarantined_files": 0}
    extra = {} if quarantine_bytes is None else {"quarantine_bytes": quarantine_bytes}
    stem, salt = ("corrupt", []) if cls == "corruption" else (cls.replace("_", "-"), [7])
    for s, fmt in enumerate(FORMATS):
        rng = np.random.default_rng([seed, 2, s, *salt])
        prefixes = Prefixes(seed * 1000 + 17 + s + sum(salt))
        sdir = base / f"{stem}-{fmt}"
        ids = list(range(n_prefixes))
        with PrefixStore(sdir, SHAPE, store_config(fmt, **extra)) as store:
            fill_store(store, prefixes, ids, rng)
            targets = [(node.id, store.entry(node, int(rng.integers(SHAPE.n_layers))))
                       for node in disjoint_nodes(store, rng, faults_per_store)]
        injected = {}
        for j, (nid, entry) in enumerate(targets):
            kind = kinds[(j + s) % len(kinds)]
            injected[nid] = f"{kind}: {inject(entry, kind, rng)}"
        res["injected"] += len(injected)
        hits: list[int] = []
        harmless: set[int] = set()
        config = store_config(fmt, **extra)
        with StoreWarnings() as warned, PrefixStore(sdir, SHAPE, config) as store:
            for p in rng.permutation(ids).tolist():
                if not serve(store, prefixes.tokens(p), hits, res):
                    res["not_repaired"] += 1
                    fail(f"{sdir.name}: prefix {p} not exact after recompute "
                         f"{res.get('errors', [])[-1:]}")
            for p in ids:  # everything is served again, from disk, bit-exact
                if not prefix_exact(store, prefixes.tokens(p)):
                    res["not_repaired"] += 1
                    fail(f"{sdir.name}: prefix {p} not exact after repair")
            if cls != "corruption":
                for nid in set(injected) - set(hits):
                    node = store.tree.nodes.get(nid)
                    if node is None or check_node(store, node) is None:
                        harmless.add(nid)
            if quarantine_bytes is not None:
                size = quarantine_size(sdir)
                counted = store.overheads().get("quarantine_bytes")
                res["quarantine_bytes"] = res.get("quarantine_bytes", 0) + size
                if size > quarantine_bytes:
                    fail(f"{sdir.name}: quarantine/ holds {size} bytes, bound "
                         f"{quarantine_bytes}")
                if counted != size:
                    fail(f"{sdir.name}: overheads() counts {counted} quarantine bytes, "
                         f"{size} on disk")
        hit = set(hits)
        res["quarantine_warnings"] = res.get("quarantine_warnings", 0) + \
            sum("quarantined" in m for m in warned.messages)
        res["detected"] += len(hit & set(injected))
        res["harmless"] += len(harmless)
        res["false_detections"] += len(hit - set(injected))
        for nid in sorted(set(injected) - hit - harmless):
            fail(f"{sdir.name}: corruption of node {nid} not detected ({injected[nid]})")
        for nid in sorted(hit - set(injected)):
            fail(f"{sdir.name}: node {nid} reported corrupt but was not damaged")
        with PrefixStore(sdir, SHAPE, store_config(fmt, **extra)) as store:
            left = orphans(store)
            res["orphans"] += len(left)
            for n in left:
                fail(f"{sdir.name}: orphan after quarantine and reopen: {n}")
            for p in ids:
                if not prefix_exact(store, prefixes.tokens(p)):
                    res["not_repaired"] += 1
                    fail(f"{sdir.name}: prefix {p} not exact after reopen")
        qdir = sdir / "quarantine"
        res["quarantined_files"] += len(list(qdir.iterdir())) if qdir.is_dir() else 0
    return res


class FaultyOS:
    """Stands in for `os` inside disk_layout.io and impress_flexgen.store: reads of files
    named in `eio_names` fail with EIO (the descriptor is marked when the file is opened),
    and fsync call number `fsync_fail_at` fails with EIO."""

    def __init__(self, eio_names=(), fsync_fail_at: int | None = None):
        self.eio_names = set(eio_names)
        self.fsync_fail_at = fsync_fail_at
        self.bad_fds: set[int] = set()
        self.fsyncs = 0
        self.fired = 0
        self.fsync_mode = ""
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
        if os.path.basename(os.fspath(path)) in self.eio_names:
            with self._lock:
                self.bad_fds.add(fd)
        return fd

    def close(self, fd):
        with self._lock:
            self.bad_fds.discard(fd)
        return os.close(fd)

    def _check_read(self, fd) -> None:
        if fd in self.bad_fds:
            with self._lock:
                self.fired += 1
            raise OSError(errno.EIO, "Input/output error (injected)")

    def preadv(self, fd, buffers, offset, *flags):
        self._check_read(fd)
        return os.preadv(fd, buffers, offset, *flags)

    def pread(self, fd, n, offset):
        self._check_read(fd)
        return os.pread(fd, n, offset)

    def readv(self, fd, buffers):
        self._check_read(fd)
        return os.readv(fd, buffers)

    def read(self, fd, n):
        self._check_read(fd)
        return os.read(fd, n)

    def fsync(self, fd):
        with self._lock:
            n, self.fsyncs = self.fsyncs, self.fsyncs + 1
        if n == self.fsync_fail_at:
            self.fired += 1
            self.fsync_mode = "directory" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"
            raise OSError(errno.EIO, "Input/output error (injected fsync failure)")
        return os.fsync(fd)

    fdatasync = fsync


@contextlib.contextmanager
def patched_os(fake: FaultyOS):
    mods = [m for m in (disk_io, *STORE_FILE_MODULES) if getattr(m, "os", None) is os]
    for m in mods:
        m.os = fake
    try:
        yield fake
    finally:
        for m in mods:
            m.os = os


class FifoWatchdog:
    """Once `after` seconds pass without a beat(), opens each FIFO for writing and closes
    it: that releases a reader blocked opening it (it then reads end of file), so a store
    that blocks on a FIFO is reported instead of hanging the test. Counts releases."""

    def __init__(self, fifos, after: float = 2.0):
        self.fifos, self.after = list(fifos), after
        self.last_beat = time.monotonic()
        self.released = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fifo-watchdog", daemon=True)

    def beat(self) -> None:
        """Called before each request: one request never takes `after` seconds."""
        self.last_beat = time.monotonic()

    def __enter__(self):
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            if time.monotonic() - self.last_beat < self.after:
                continue
            for path in self.fifos:
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    continue   # no reader waiting (ENXIO), or gone
                os.close(fd)
                self.released += 1


def io_errors(base: Path, n_prefixes: int, faults_per_store: int, seed: int,
              report: Report) -> dict:
    cls = "io_error"
    res = {"injected": 0, "detected": 0, "by_kind": {}, "served_corrupt": 0, "recomputed": 0,
           "not_repaired": 0, "orphans": 0, "directories_left": 0, "fifo_releases": 0,
           "eio_reads": 0, "corruptions_counted": 0, "errors": []}
    for s, fmt in enumerate(FORMATS):
        rng = np.random.default_rng([seed, 5, s])
        prefixes = Prefixes(seed * 1000 + 71 + s)
        sdir, away = base / f"ioerr-{fmt}", base / f"ioerr-{fmt}-elsewhere"
        away.mkdir(parents=True, exist_ok=True)
        ids = list(range(n_prefixes))
        with PrefixStore(sdir, SHAPE, store_config(fmt)) as store:
            fill_store(store, prefixes, ids, rng)
            targets = [(node.id, store.entry(node, int(rng.integers(SHAPE.n_layers))))
                       for node in disjoint_nodes(store, rng, faults_per_store)]
        injected, eio_names, fifos, outside = {}, set(), [], []
        for j, (nid, entry) in enumerate(targets):
            kind = IO_KINDS[(j + s) % len(IO_KINDS)]
            path = Path(entry.path)
            if kind == "eio":
                eio_names.add(path.name)
            elif kind == "directory":
                path.unlink()
                path.mkdir()
            elif kind == "fifo":
                path.unlink()
                os.mkfifo(path)
                fifos.append(path)
            else:   # a symlink to an exact copy outside the store: followed, it would pass
                copy = away / path.name
                shutil.copyfile(path, copy)
                path.unlink()
                path.symlink_to(copy)
                outside.append(copy)
            injected[nid] = kind
        res["injected"] += len(injected)
        hits: list[int] = []
        fake, dog = FaultyOS(eio_names=eio_names), FifoWatchdog(fifos)
        try:
            with patched_os(fake), dog, StoreWarnings():
                with PrefixStore(sdir, SHAPE, store_config(fmt)) as store:
                    for p in rng.permutation(ids).tolist():
                        dog.beat()
                        if not serve(store, prefixes.tokens(p), hits, res):
                            res["not_repaired"] += 1
                            report.fail(cls, f"{sdir.name}: prefix {p} not exact after "
                                             f"recompute {res['errors'][-1:]}")
                    for p in ids:
                        dog.beat()
                        if not prefix_exact(store, prefixes.tokens(p)):
                            res["not_repaired"] += 1
                            report.fail(cls, f"{sdir.name}: prefix {p} not exact after repair")
                    counted = getattr(store.metrics, "corruptions", 0)
            res["corruptions_counted"] += counted
            if counted < len(set(hits)):
                report.fail(cls, f"{sdir.name}: metrics.corruptions is {counted} after "
                                 f"{len(set(hits))} nodes were found corrupt")
        except Exception as exc:  # noqa: BLE001 - the store must not let these through
            report.fail(cls, f"{sdir.name}: serving raised {error_text(exc)}")
        res["fifo_releases"] += dog.released
        if dog.released:
            report.fail(cls, f"{sdir.name}: a read blocked on a FIFO in place of a layer file "
                             f"(released {dog.released} times after 2 s)")
        res["eio_reads"] += fake.fired
        for nid, kind in injected.items():
            row = res["by_kind"].setdefault(kind, {"injected": 0, "detected": 0})
            row["injected"] += 1
            if nid in hits:
                row["detected"] += 1
                res["detected"] += 1
            else:
                report.fail(cls, f"{sdir.name}: {kind} in place of a layer file of node {nid} "
                                 "not detected")
        for nid in sorted(set(hits) - set(injected)):
            report.fail(cls, f"{sdir.name}: node {nid} reported corrupt but was not damaged")
        dog = FifoWatchdog(fifos)
        try:
            with dog, StoreWarnings(), PrefixStore(sdir, SHAPE, store_config(fmt)) as store:
                left = orphans(store)
                res["orphans"] += len(left)
                for name in left:
                    report.fail(cls, f"{sdir.name}: orphan after reopen: {name}")
                for p in ids:
                    dog.beat()
                    if not prefix_exact(store, prefixes.tokens(p)):
                        res["not_repaired"] += 1
                        report.fail(cls, f"{sdir.name}: prefix {p} not exact after reopen")
        except Exception as exc:  # noqa: BLE001 - reported
            report.fail(cls, f"{sdir.name}: reopening raised {error_text(exc)}")
        if dog.released:
            res["fifo_releases"] += dog.released
            report.fail(cls, f"{sdir.name}: after reopening, a read blocked on a FIFO "
                             f"(released {dog.released} times after 2 s)")
        res["directories_left"] += sum(e.is_dir() for e in os.scandir(sdir / "data"))
        for copy in outside:
            if not copy.exists():
                report.fail(cls, f"{sdir.name}: {copy}, outside the store, was deleted")
    report.count(cls, injected=res["injected"], detected=res["detected"],
                 served_wrong=res.get("served_corrupt", 0), lost=res["not_repaired"])
    return res


# ---------------------------------------------------------------------------------------
# Capacity, ENOSPC, fsync failures, a full database

def capacity(base: Path, seed: int, failures: list[str]) -> dict:
    rng = np.random.default_rng([seed, 3])
    n = 4 * C
    tokens = []
    for i in range(10):  # every other prefix shares its first chunks with the one before
        new = rng.integers(0, 1 << 20, size=n + 5).astype(np.int32)
        if i % 2 and tokens:
            new[:2 * C] = tokens[-1][:2 * C]
        tokens.append(new)
    with PrefixStore(base / "capacity-size", SHAPE, store_config("int4")) as probe:
        probe.insert(tokens[0], 0, kv_from_bits(expected_bits(tokens[0][:n])))
        one = probe.disk_bytes()
    cap = int(3.5 * one)
    res = {"capacity_bytes": cap, "prefix_bytes": one, "over_capacity": 0, "newest_missed": 0,
           "stale_reads": 0, "store_full": 0}
    config = store_config("int4", disk_capacity_bytes=cap)
    with PrefixStore(base / "capacity", SHAPE, config) as store:
        for i, t in enumerate(tokens):
            match = store.match_prefix(t)
            try:
                store.insert(t, match.length, kv_from_bits(expected_bits(t[:n]), match.length))
            except StoreFull as exc:
                res["store_full"] += 1
                failures.append(f"capacity: insert {i} raised StoreFull: {exc}")
            finally:
                store.release(match)
            on_disk = sum(f.stat().st_size for f in (store.dir / "data").iterdir())
            if store.disk_bytes() > cap or on_disk > cap:
                res["over_capacity"] += 1
                failures.append(f"capacity: after insert {i}: {store.disk_bytes()} bytes "
                                f"counted, {on_disk} on disk, capacity {cap}")
            if not prefix_exact(store, t):
                res["newest_missed"] += 1
                failures.append(f"capacity: newest prefix {i} not served bit-exact")
        for j, older in enumerate(tokens):  # what is left of older ones is exact
            match = store.match_prefix(older)
            try:
                got = read_prefix(store, match)
                want = expected_bits(older[:match.length])
                why = None if all(np.array_equal(tensor_bits(k), want[layer, 0]) and
                                  np.array_equal(tensor_bits(v), want[layer, 1])
                                  for layer, (k, v) in enumerate(got)) else "bits differ"
            except CorruptNode as exc:
                why = str(exc)
            finally:
                store.release(match)
            if why:
                res["stale_reads"] += 1
                failures.append(f"capacity: stored part of prefix {j}: {why}")
        res["evictions"] = store.metrics.evictions
        left = orphans(store)
    if res["evictions"] == 0:
        failures.append("capacity: no eviction happened")
    if left:
        failures.append(f"capacity: files left in data/: {left}")
    return res


class _NoSpaceOS:
    """Stands in for `os` inside disk_layout.io: the temporary file is created and sized,
    then pwrite fails with ENOSPC, as on a disk that fills up while a file is written."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


class NoSpace:
    """Patch disk_layout.io.write_durable: call number `fail_at` fails with ENOSPC,
    either before touching the disk ("before-write") or inside the real write path
    ("mid-write": temporary file created and sized, then pwrite fails)."""

    def __init__(self, fail_at: int, mode: str):
        self.fail_at, self.mode, self.calls, self.fired = fail_at, mode, 0, False
        self.real = disk_io.write_durable

    def __call__(self, path, chunks, total_bytes):
        n, self.calls = self.calls, self.calls + 1
        if n != self.fail_at:
            return self.real(path, chunks, total_bytes)
        self.fired = True
        if self.mode == "before-write":
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        real_os = disk_io.os
        disk_io.os = _NoSpaceOS()
        try:
            return self.real(path, chunks, total_bytes)
        finally:
            disk_io.os = real_os

    def __enter__(self):
        disk_io.write_durable = self
        return self

    def __exit__(self, *exc):
        disk_io.write_durable = self.real
        return False


class FsyncFault:
    """os.fsync call number `fail_at` (file or directory) fails with EIO."""

    def __init__(self, fail_at: int):
        self.os = FaultyOS(fsync_fail_at=fail_at)
        self._patch = None

    @property
    def fired(self) -> bool:
        return self.os.fired > 0

    @property
    def mode(self) -> str:
        return f"{self.os.fsync_mode}-fsync"

    def __enter__(self):
        self._patch = patched_os(self.os)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        return self._patch.__exit__(*exc)


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
                node = list(store.tree.nodes.values())[int(rng.integers(len(store.tree)))]
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
                        n_done = store.reorder_node(node)
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
                    store.reorder_node(node)
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


def enospc(base: Path, n_inject: int, seed: int, failures: list[str]) -> dict:
    def fault(j: int, fail_at: int) -> NoSpace:
        return NoSpace(fail_at, ("before-write", "mid-write")[(j // 3) % 2])

    return write_faults(base / "enospc", n_inject, np.random.default_rng([seed, 4]),
                        Prefixes(seed * 1000 + 99), "fp16", fault, 1, (StoreFull,),
                        lambda m: failures.append(f"enospc: {m}"))


def fsync_failures(base: Path, n_inject: int, seed: int, report: Report) -> dict:
    res = write_faults(base / "fsync", n_inject, np.random.default_rng([seed, 6]),
                       Prefixes(seed * 1000 + 83), "int4", lambda j, at: FsyncFault(at), 2,
                       (StoreFull, WRITE_FAILED, OSError), lambda m: report.fail("fsync", m))
    report.count("fsync", injected=res["injected"], detected=res["handled"],
                 lost=res["earlier_lost"])
    return res


def sqlite_full(base: Path, n_inject: int, seed: int, report: Report) -> dict:
    """The metadata database cannot grow (PRAGMA max_page_count at its size): the insert
    that needs a new page must raise StoreFull and leave no file; then it works."""
    cls = "sqlite_full"
    rng = np.random.default_rng([seed, 8])
    prefixes = Prefixes(seed * 1000 + 87)
    res = {"injected": 0, "handled": 0, "raised": {}, "left_files": 0, "inserts_fitted": 0}
    sdir = base / "sqlite-full"
    with StoreWarnings(), PrefixStore(sdir, SHAPE, store_config("int4")) as store:
        db = getattr(store.meta, "db", None)
        if not isinstance(db, sqlite3.Connection):
            report.not_yet.append(f"{cls}: the store's metadata has no sqlite3 connection "
                                  "`meta.db` to limit; not run")
            return res
        done: list[np.ndarray] = []
        fill_store(store, prefixes, range(3), rng)
        done += [prefixes.tokens(p) for p in range(3)]
        p = 3
        limit = db.execute("PRAGMA max_page_count").fetchone()[0]
        for j in range(n_inject):
            stray_before = stray_files(store)
            how, tokens = None, None
            db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
            try:
                for _ in range(60):
                    tokens, p = prefixes.tokens(p), p + 1
                    try:
                        insert_prefix(store, tokens)
                    except StoreFull:
                        how = "StoreFull"
                    except Exception as exc:  # noqa: BLE001 - reported
                        how = error_text(exc)
                    if how:
                        break
                    res["inserts_fitted"] += 1   # fitted in free pages
                    done.append(tokens)
                    stray_before = stray_files(store)
            finally:
                db.execute(f"PRAGMA max_page_count = {limit}")
            if how is None:
                continue
            res["injected"] += 1
            res["raised"][how.split(":")[0]] = res["raised"].get(how.split(":")[0], 0) + 1
            problems = []
            if how != "StoreFull":
                problems.append(f"insert raised {how}, not StoreFull")
            stray = stray_files(store) - stray_before
            if stray:
                res["left_files"] += len(stray)
                problems.append(f"files left behind: {sorted(stray)}")
            if not all(prefix_exact(store, t) for t in done):
                problems.append("an earlier prefix no longer reads back bit-exact")
            try:
                insert_prefix(store, tokens)
                done.append(tokens)
                if not prefix_exact(store, tokens):
                    problems.append("not bit-exact after the retry")
            except Exception as exc:  # noqa: BLE001 - reported
                problems.append(f"the retry raised {error_text(exc)}")
            if problems:
                report.fail(cls, f"injection {j}: {'; '.join(problems)}")
            else:
                res["handled"] += 1
    try:
        with PrefixStore(sdir, SHAPE, store_config("int4")) as store:
            res["orphans_after_reopen"] = len(orphans(store))
            lost = sum(not prefix_exact(store, t) for t in done)
    except Exception as exc:  # noqa: BLE001 - reported
        report.fail(cls, f"reopening raised {error_text(exc)}")
        res["orphans_after_reopen"], lost = 0, len(done)
    if res["orphans_after_reopen"]:
        report.fail(cls, f"{res['orphans_after_reopen']} orphans after reopen")
    if lost:
        report.fail(cls, f"{lost} prefixes not exact after reopen")
    report.count(cls, injected=res["injected"], detected=res["handled"], lost=lost)
    return res


# ---------------------------------------------------------------------------------------
# Damaged metadata: copies of a store, corrupted, opened

DAMAGE = ("flip_db", "flip_db", "flip_wal", "zero_page", "trunc_db", "trunc_wal", "header",
          "index", "zero_length", "foreign", "garbage")


def hard_state(store: PrefixStore) -> dict:
    """What each node's KV depends on: parent, position, tokens, files, orders, CRCs."""
    return {nid: (n.parent.id if n.parent is not None and n.parent is not store.tree.root
                  else None, n.start, n.tokens.tobytes(),
                  tuple((e.version, os.path.basename(e.path),
                         None if e.mapping is None else np.asarray(e.mapping).tobytes(),
                         np.asarray(e.crcs).tobytes()) for e in n.layers))
            for nid, n in store.tree.nodes.items()}


def copy_store(src: Path, dst: Path) -> None:
    """The database and WAL copied, the (immutable) data files linked."""
    shutil.rmtree(dst, ignore_errors=True)
    (dst / "data").mkdir(parents=True)
    for name in ("store.sqlite", "store.sqlite-wal"):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    for f in (src / "data").iterdir():
        os.link(f, dst / "data" / f.name)


def flip_bits(path: Path, rng, n: int) -> list[int]:
    data = bytearray(path.read_bytes())
    offsets = sorted(int(x) for x in rng.integers(0, len(data), size=n))
    for off in offsets:
        data[off] ^= 1 << int(rng.integers(8))
    path.write_bytes(bytes(data))
    return offsets


def damage_db(work: Path, mode: str, rng) -> tuple[str, str]:
    """Damage the copy; returns (description, name of the file damaged)."""
    db, wal = work / "store.sqlite", work / "store.sqlite-wal"
    wal_size = wal.stat().st_size if wal.exists() else 0
    if mode.endswith("_wal") and wal_size <= 32:
        mode = mode[:-4] + "_db"
    target = wal if mode.endswith("_wal") else db
    size = target.stat().st_size if target.exists() else 0
    if mode in ("flip_db", "flip_wal"):
        offsets = flip_bits(target, rng, int(rng.integers(1, 5)))
        return f"{mode}: bits flipped at {offsets} of {size}", target.name
    if mode in ("trunc_db", "trunc_wal"):
        at = int(rng.integers(1 if mode == "trunc_db" else 0, max(2, size)))
        os.truncate(target, at)
        return f"{mode}: cut at {at} of {size}", target.name
    if mode == "zero_page":
        target = wal if wal_size > 32 and rng.random() < 0.5 else db
        size = target.stat().st_size
        at = int(rng.integers(0, max(1, size // 4096))) * 4096
        with open(target, "r+b") as f:
            f.seek(at)
            f.write(bytes(min(4096, size - at)))
        return f"zero_page: {target.name} bytes {at}..{at + 4096}", target.name
    if mode == "index":
        # A byte of the layers table's primary-key index: the index no longer matches the
        # table, which PRAGMA quick_check does not compare.
        with contextlib.closing(sqlite3.connect(db)) as con:
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # the page is in the DB file
            row = con.execute("SELECT rootpage FROM sqlite_master WHERE type = 'index' "
                              "AND tbl_name = 'layers'").fetchone()
            page = con.execute("PRAGMA page_size").fetchone()[0]
        if row is None:
            return damage_db(work, "flip_db", rng)
        data = bytearray(db.read_bytes())
        at = (row[0] - 1) * page
        head = at + (100 if row[0] == 1 else 0)
        content = int.from_bytes(data[head + 5:head + 7], "big") or 65536
        off = at + int(rng.integers(min(content, page - 1), page))
        data[off] ^= 1 << int(rng.integers(8))
        db.write_bytes(bytes(data))
        return f"index: bit flipped at {off} (page {row[0]}, the layers index)", db.name
    if mode == "header":
        offsets = sorted(int(x) for x in rng.integers(0, 100, size=int(rng.integers(1, 4))))
        data = bytearray(db.read_bytes())
        for off in offsets:
            data[off] = int(rng.integers(256))
        db.write_bytes(bytes(data))
        return f"header: bytes {offsets} overwritten", db.name
    if mode == "zero_length":
        os.truncate(db, 0)
        wal.unlink(missing_ok=True)
        return "zero_length: store.sqlite emptied, WAL removed", db.name
    if mode == "foreign":
        db.unlink()
        wal.unlink(missing_ok=True)
        other = sqlite3.connect(db)
        other.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
        other.execute("INSERT INTO notes (text) VALUES ('not a prefix store')")
        other.commit()
        other.close()
        return "foreign: another application's database", db.name
    db.write_bytes(rng.bytes(max(size, 4096)))
    wal.unlink(missing_ok=True)
    return "garbage: store.sqlite overwritten with random bytes", db.name


def file_hash(path: Path) -> str | None:
    return hashlib.sha1(path.read_bytes()).hexdigest() if path.exists() else None


def sqlite_damage(base: Path, iterations: int, seed: int, report: Report) -> dict:
    cls = "sqlite_damage"
    rng = np.random.default_rng([seed, 31])
    res = {"iterations": iterations, "refused": 0, "opened": 0, "dropped_nodes": 0,
           "unreadable_nodes": 0, "wrong_nodes": 0, "errors": 0, "by_mode": {},
           "stray_after_open": 0, "database_changed_on_refusal": 0, "sources": 0}
    sources = []      # (directory, fmt, hard state of its nodes)
    for s, fmt in enumerate(FORMATS):
        prefixes = Prefixes(seed * 1000 + 51 + s)
        live = base / f"sqlfuzz-{fmt}"
        n = 12
        points = set(rng.choice(np.arange(2, n), size=4, replace=False).tolist())
        with PrefixStore(live, SHAPE, store_config(fmt)) as store:
            for p in range(n):
                fill_store(store, prefixes, [p], rng)
                if rng.random() < 0.4:
                    store.reorder_now()
                if rng.random() < 0.3:
                    store.flush_stats()
                if p in points:
                    if rng.random() < 0.5:
                        store.overheads()   # checkpoints: the rows move from the WAL to the DB
                    dst = base / f"sqlfuzz-{fmt}-copy{p}"
                    copy_store(live, dst)
                    sources.append((dst, fmt, hard_state(store)))
    res["sources"] = len(sources)
    work = base / "sqlfuzz-work"
    for it in range(iterations):
        rng = np.random.default_rng([seed, 32, it])   # an iteration replays on its own
        src, fmt, ref = sources[int(rng.integers(len(sources)))]
        copy_store(src, work)
        mode = DAMAGE[int(rng.integers(len(DAMAGE)))]
        what, damaged = damage_db(work, mode, rng)
        row = res["by_mode"].setdefault(mode, {"injected": 0, "detected": 0, "harmless": 0})
        row["injected"] += 1
        names = {f.name for f in (work / "data").iterdir()}
        hashes = [file_hash(work / n) for n in ("store.sqlite", "store.sqlite-wal")]
        verdict, problems = None, []
        with StoreWarnings() as warned:
            try:
                store = PrefixStore(work, SHAPE, store_config(fmt))
            except UserError as exc:
                verdict = "detected"
                res["refused"] += 1
                if {f.name for f in (work / "data").iterdir()} != names:
                    problems.append(f"refused ({exc}) but changed data/")
                if [file_hash(work / n) for n in ("store.sqlite", "store.sqlite-wal")] != hashes:
                    if mode == "foreign":   # not the store's to change, even its journal mode
                        problems.append("refused another application's database but "
                                        "changed it")
                    res["database_changed_on_refusal"] += 1
                    row["database_changed_on_refusal"] = \
                        row.get("database_changed_on_refusal", 0) + 1
                if "\n" in str(exc):
                    problems.append("the refusal is not one line")
            except Exception as exc:  # noqa: BLE001 - must be UserError or open fine
                problems.append(f"opening raised {error_text(exc)}")
                res["errors"] += 1
            else:
                res["opened"] += 1
                try:
                    now = hard_state(store)
                    dropped = set(ref) - set(now)
                    changed = [nid for nid, h in now.items() if ref.get(nid) != h]
                    sample = [nid for nid in now if nid not in changed and rng.random() < 0.1]
                    wrong = unreadable = 0
                    for nid in changed + sample:
                        why = check_node(store, store.tree.nodes[nid])
                        if why is None:
                            continue
                        if why.startswith("error"):
                            problems.append(f"reading node {nid} raised {why[7:]}")
                        elif is_wrong(why):
                            wrong += 1
                            problems.append(f"node {nid}: {why}")
                        else:
                            unreadable += 1
                    stray = stray_files(store)
                    if stray and len(dropped) + len(changed):
                        res["stray_after_open"] += len(stray)
                        problems.append(f"{len(stray)} files of dropped nodes left in data/")
                    res["dropped_nodes"] += len(dropped)
                    res["unreadable_nodes"] += unreadable
                    res["wrong_nodes"] += wrong
                    # A damaged WAL ends the log early: SQLite serves the last commit
                    # before the damage, as after a power loss. Anything else that drops
                    # committed nodes must say so.
                    if dropped and not warned.messages and not damaged.endswith("-wal"):
                        problems.append(f"{len(dropped)} nodes dropped without a warning")
                    if not problems:
                        verdict = "detected" if dropped or unreadable else "harmless"
                    report.count(cls, served_wrong=wrong)
                except Exception as exc:  # noqa: BLE001 - reported
                    problems.append(f"serving raised {error_text(exc)}")
                finally:
                    try:
                        store.close()
                    except Exception as exc:  # noqa: BLE001 - reported
                        problems.append(f"closing raised {error_text(exc)}")
        if problems:
            verdict = None
            report.fail(cls, f"iteration {it} ({src.name}, {what}): {'; '.join(problems)}")
        report.count(cls, injected=1, **({verdict: 1} if verdict else {}))
        if verdict:
            row[verdict] += 1
    shutil.rmtree(work, ignore_errors=True)
    return res


# ---------------------------------------------------------------------------------------
# Tiers and request threads

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
                chunks, served = store.load_kv_chunks(entry, {"k": ids, "v": ids}, node,
                                                      {"k": ratios, "v": ratios})
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
                    probe = store.read_probe(entry, node)
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
            except WRITE_FAILED:   # not stored (full, or contended): served all the same
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
            store = PrefixStore(sdir, SHAPE, config, memory=ChunkCache(
                TierConfig(gpu_bytes=24 * chunk_bytes, cpu_bytes=48 * chunk_bytes),
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
                res["splits"] += store.metrics.splits
                res["reorders"] += store.metrics.reorders
                res["evictions"] += store.metrics.evictions
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
                for node in list(store.tree.nodes.values()):
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


# ---------------------------------------------------------------------------------------

def parse_args(argv):
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="8 kill iterations and fewer of every other fault (under 2 minutes)")
    p.add_argument("--iterations", type=int, help="kill iterations (default 60; quick 8)")
    p.add_argument("--fuzz", type=int,
                   help="damaged-database iterations (default 300; quick 60)")
    p.add_argument("--only", metavar="PART[,PART]",
                   help=f"run only these parts: {', '.join(PARTS)}")
    p.add_argument("--strict", action="store_true",
                   help="enforce every expectation, also those of store features this "
                        "tree does not have yet (reported as not_yet otherwise)")
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
    report = Report(pending_classes(args.strict))
    failures = report.failures
    seconds: dict[str, float] = {}
    results: dict[str, dict] = {}
    parts = set(args.only or PARTS)
    q, keep = args.quick, bool(args.dir)

    def run(name: str, fn) -> None:
        if name in parts:
            t = time.perf_counter()
            results[name] = fn()
            seconds[name] = round(time.perf_counter() - t, 1)

    def torn_write() -> dict:
        bound = 64 << 10 if NEW_STORE else None
        if bound is None:
            report.not_yet.append("torn_write: quarantine bound and count not checked "
                                  "(StoreConfig has no quarantine_bytes)")
        res = corruption(base, 10 if q else 30, 3 if q else 10, args.seed, failures,
                         kinds=TORN, cls="torn_write", quarantine_bytes=bound,
                         fail=lambda m: report.fail("torn_write", m))
        report.count("torn_write", injected=res["injected"], detected=res["detected"],
                     harmless=res["harmless"], served_wrong=res["served_corrupt"],
                     lost=res["not_repaired"])
        return res

    def corrupt() -> dict:
        res = corruption(base, n_prefixes=12 if q else 40, faults_per_store=4 if q else 12,
                         seed=args.seed, failures=failures)
        report.count("corruption", injected=res["injected"], detected=res["detected"],
                     served_wrong=res["served_corrupt"], lost=res["not_repaired"])
        return res

    def nospace() -> dict:
        res = enospc(base, n_inject=12 if q else 30, seed=args.seed, failures=failures)
        report.count("enospc", injected=res["injected"], detected=res["handled"],
                     lost=res["earlier_lost"])
        return res

    try:
        run("kill", lambda: kill_loop(base, args.iterations, args.seed, args.max_delay,
                                      max_inserts=40, failures=failures, keep_logs=keep,
                                      report=report))
        run("power_loss", lambda: power_loss(base, 4 if q else 30, args.seed, args.max_delay,
                                             report, keep))
        for kind in ("recovery", "eviction", "quarantine"):
            run(f"crash_{kind}", lambda kind=kind: crash_loop(
                base, kind, 2 if q else 10, args.seed, args.max_delay, report, keep,
                n_orphans=600 if q else 2500, n_fill=6 if q else 10))
        run("corruption", corrupt)
        run("torn_write", torn_write)
        run("io_error", lambda: io_errors(base, 10 if q else 24, 4 if q else 8, args.seed,
                                          report))
        run("capacity", lambda: capacity(base, args.seed, failures))
        run("enospc", nospace)
        run("fsync", lambda: fsync_failures(base, 9 if q else 30, args.seed, report))
        run("sqlite_full", lambda: sqlite_full(base, 3 if q else 8, args.seed, report))
        run("sqlite_damage", lambda: sqlite_damage(base, args.fuzz, args.seed, report))
        run("tiers", lambda: tiers_threads(base, 2 if q else 4, 15 if q else 50, args.seed,
                                           report))
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    kills = results.get("kill", {"committed": 0, "lost": 0, "orphans": 0, "writer_errors": 0,
                                 "bad_nodes": 0})
    corrupt_res = results.get("corruption", {"injected": 0, "detected": 0, "orphans": 0})
    nospace_res = results.get("enospc", {"injected": 0, "handled": 0})
    orphans_of = {
        "kill": kills["orphans"], "corruption": corrupt_res["orphans"],
        **{name: results[name].get("orphans", 0)
           for name in ("power_loss", "crash_recovery", "crash_eviction", "crash_quarantine",
                        "torn_write", "io_error", "tiers") if name in results},
        **{name: results[name].get("orphans_after_reopen", 0)
           for name in ("enospc", "fsync", "sqlite_full") if name in results}}
    pending = report.pending
    enforced = {c: f for c, f in report.faults.items() if c not in pending}
    orphan_total = sum(n for c, n in orphans_of.items() if c not in pending)
    served_wrong = sum(f["served_wrong"] for f in enforced.values())
    lost = sum(f["lost"] for f in enforced.values())
    for cls, f in report.faults.items():
        if cls in pending:
            report.not_yet.append(f"{cls}: {f}")
    for cls in PARTS:
        f = report.faults.get(cls)
        if cls in results and cls in report.faults and f["injected"] == 0:
            report.fail(cls, "no fault could be injected")
    unaccounted = {c: f["injected"] - f["detected"] - f["harmless"] for c, f in enforced.items()
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
        "not_yet": report.not_yet,
        "pending": pending,
        "features": {"StoreConfig.quarantine_bytes": NEW_STORE,
                     "disk_layout.metadata.NodeRow": NEW_METADATA},
        "seconds": round(time.perf_counter() - t0, 1),
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
    write_json(args.json, result)
    for line in failures[:20]:
        print(f"  {line}", file=sys.stderr)
    for line in report.not_yet[:10]:
        print(f"  not yet: {line}", file=sys.stderr)
    classes = ", ".join(f"{c} {f['detected'] + f['harmless']}/{f['injected']}"
                        f"{'' if c not in pending else ' (not yet)'}"
                        for c, f in report.faults.items())
    print(f"crash test {'PASS' if ok else 'FAIL'}: {result['iterations']} iterations, "
          f"{result['committed']} committed, {lost} lost, {served_wrong} served wrong, "
          f"{orphan_total} orphans; detected or harmless: {classes}; "
          f"{result['capacity_evictions']} evictions; {result['seconds']} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_main(PROG, main))
