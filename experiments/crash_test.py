"""Crash, corruption and disk-full torture test of the prefix KV store.

    python -m experiments.crash_test                          # 60 kill iterations
    python -m experiments.crash_test --quick --json out.json  # 8 iterations, under 90 s
    python -m experiments.crash_test --iterations 200 --dir /mnt/nvme/crash-test

Three parts, on small shapes (4 layers, 2 KV heads of 32, chunks of 16 tokens), each
with an int4-probe store and an fp16-probe store, alternately:

1. Kill loop. Each iteration starts a writer process on a store directory that inserts
   prefixes (many share leading chunks with earlier ones, so nodes are split), reads what
   it matched like a request does, feeds random importance back and reorders (on demand
   and in the background), printing `COMMITTED <id>` after each insert returns. It is
   killed with SIGKILL after a random delay. The store is then reopened here and every
   node is read back (probe copy and K/V) and compared bit for bit with KV regenerated
   from its tokens; a committed prefix is lost unless the match covers its whole
   chunk-aligned length and every node on its path is bit-exact. Files in data/ that no
   live layer references, and *.tmp files, are orphans.
2. Corruption. Byte flips (K, V and probe sections), truncations and deleted files are
   injected into (node, layer) files of nodes none of which lies below another, so each
   fault is hit once. Every prefix is then served like a request: CorruptNode leads to
   quarantine and recompute (the regenerated KV is inserted again) and the prefix must
   then read back bit-exact.
3. Capacity and ENOSPC. A store with room for about three prefixes takes ten; it must
   evict, stay under its capacity and serve the newest. Then the store's write_durable
   fails with ENOSPC (before writing, or part-way through via the real write path) during
   inserts, splits and reorders: inserts must raise StoreFull, reorders must be skipped,
   no new file may stay behind and earlier prefixes must still read back bit-exact.

Exit status 0 only when no committed prefix is lost, every injected corruption is
detected, no orphan remains after recovery, no node reads back wrong and no writer died
on its own. Also reported, without failing the run: CorruptNode raised by a reorder in
the writer (a reorder racing with another one), stray files after ENOSPC.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import disk_layout.io as disk_io
import impress_flexgen.store as store_mod
from disk_layout.format import decode_probe, encode_probe
from impress_flexgen.cli import ArgumentParser, run_main, write_json
from impress_flexgen.errors import UserError
from impress_flexgen.store import CorruptNode, ModelShape, PrefixStore, StoreConfig, StoreFull

ROOT = Path(__file__).resolve().parents[1]
PROG = "python -m experiments.crash_test"
SHAPE = ModelShape("crash", n_layers=4, n_kv_heads=2, head_dim=32)
C = 16
FORMATS = ("int4", "fp16")
MAX_CHUNKS = 10
M64 = (1 << 64) - 1


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


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


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
    """Collects the store's log records (quarantines, skipped reorders) instead of
    printing them."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("impress_flexgen.store").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("impress_flexgen.store").removeHandler(self)
        return False


# ---------------------------------------------------------------------------------------
# Reading a store back

def files_on_disk(store_dir: Path) -> tuple[set[str], list[str]]:
    """Names in data/, and every *.tmp anywhere under the store directory."""
    data = store_dir / "data"
    names = {f.name for f in data.iterdir()} if data.is_dir() else set()
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


def check_node(store: PrefixStore, node) -> str | None:
    """Read every layer of `node` (probe copy and K/V); None if bit-exact, else why not."""
    tokens = np.concatenate([n.tokens for n in store.tree.path_to(node)])
    want = expected_bits(tokens)[:, :, :, node.start:node.end]
    lay_heads = list(store.config.probe_heads)
    for layer in range(SHAPE.n_layers):
        entry = store.entry(node, layer)
        try:
            probe = store.read_probe(entry, node)
            k, v = store.read_layer(entry, node)
        except CorruptNode as exc:
            return f"unreadable: {exc}"
        if not (np.array_equal(tensor_bits(k), want[layer, 0]) and
                np.array_equal(tensor_bits(v), want[layer, 1])):
            return f"layer {layer} K/V differ from the expected bits"
        k_phys = torch.from_numpy(want[layer, 0].view(np.float16))
        if entry.mapping is not None:
            k_phys = k_phys[:, torch.from_numpy(entry.mapping)]
        lay = entry.layout
        want_probe = decode_probe(encode_probe(k_phys[lay_heads], lay.probe_format),
                                  lay.probe_format, (lay.n_probe, lay.n_tokens, lay.head_dim))
        if not torch.equal(probe.view(torch.int32), want_probe.view(torch.int32)):
            return f"layer {layer} probe copy differs from the expected keys"
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
        except CorruptNode:
            return False
        want = expected_bits(tokens[:aligned])
        return all(np.array_equal(tensor_bits(k), want[layer, 0]) and
                   np.array_equal(tensor_bits(v), want[layer, 1])
                   for layer, (k, v) in enumerate(got))
    finally:
        store.release(match)


# ---------------------------------------------------------------------------------------
# 1. The writer (a subprocess) and the kill loop

def writer(args) -> int:
    """Insert, read, record importance and reorder until killed; one line per event."""
    out = sys.stdout
    real_write = store_mod.write_durable

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    def traced_write(path, chunks, total_bytes):
        say("WRITE")
        real_write(path, chunks, total_bytes)
        say("WROTE")

    store_mod.write_durable = traced_write
    rng = np.random.default_rng([args.seed, 104729, args.start_id])
    prefixes = Prefixes(args.seed)
    store = PrefixStore(args.store, SHAPE, store_config(args.format, reorder_interval=5))
    say("READY")
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
        path = store.insert(tokens, match.length, kv)
        say(f"COMMITTED {p}")
        store.release(match)
        for node in path[-2:]:
            for layer in range(SHAPE.n_layers):
                entry = store.entry(node, layer)
                scores = rng.random(node.n_tokens).astype(np.float32)
                store.record_selection(entry, scores, scores > 0.8, None)
        for every, what in ((3, "node"), (7, "all")):
            if p % every:
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


def run_writer(store_dir: Path, fmt: str, seed: int, start_id: int, delay: float,
               max_inserts: int, log_dir: Path) -> tuple[list[str], str, int | None]:
    """Start a writer, SIGKILL it `delay` seconds after it is ready; (lines, stderr, rc)."""
    out_path, err_path = log_dir / "writer.out", log_dir / "writer.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.crash_test", "--writer", "--store", str(store_dir),
             "--format", fmt, "--seed", str(seed), "--start-id", str(start_id),
             "--max-inserts", str(max_inserts)],
            cwd=ROOT, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        rc = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if "READY" in out_path.read_text():
                time.sleep(delay)
                break
            time.sleep(0.01)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        else:
            rc = proc.returncode  # it ended on its own: finished, or died
    return out_path.read_text().splitlines(), err_path.read_text(), rc


@dataclasses.dataclass
class KillState:
    dir: Path
    fmt: str
    next_id: int = 0
    committed: set = dataclasses.field(default_factory=set)
    lost: set = dataclasses.field(default_factory=set)
    verified: set = dataclasses.field(default_factory=set)  # file names read back exact


def verify_after_crash(st: KillState, prefixes: Prefixes, failures: list[str], rng,
                       resample: float = 0.1) -> dict:
    """Reopen the store; check files, every node's bits and every committed prefix.

    Files are immutable (a reorder or split writes new ones), so a node whose files were
    all read back bit-exact after an earlier kill only has their presence and size
    checked, and is read back again with probability `resample`; the final read-back
    reads everything.
    """
    before, _ = files_on_disk(st.dir)
    with PrefixStore(st.dir, SHAPE, store_config(st.fmt)) as store:
        cleaned = len(before - live_files(store))
        left = orphans(store)
        bad, read_back = {}, 0
        for node in list(store.tree.nodes.values()):
            names = [os.path.basename(e.path) for e in node.layers]
            why = None
            if all(n in st.verified for n in names) and rng.random() >= resample:
                for e in node.layers:
                    size = os.path.getsize(e.path) if os.path.exists(e.path) else None
                    if size != e.layout.file_bytes:
                        why = f"layer {e.layer} file {e.path}: size {size}, " \
                              f"expected {e.layout.file_bytes}"
            else:
                why = check_node(store, node)
                read_back += 1
                if why is None:
                    st.verified.update(names)
            if why:
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
        n_nodes = len(store.tree)
    return {"orphans": len(left), "bad_nodes": len(bad), "cleaned": cleaned, "nodes": n_nodes,
            "nodes_read_back": read_back}


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


def kill_loop(base: Path, iterations: int, seed: int, max_delay: float, max_inserts: int,
              failures: list[str], keep_logs: bool = True) -> dict:
    rng = np.random.default_rng([seed, 1])
    states = [KillState(base / f"kill-{fmt}", fmt) for fmt in FORMATS]
    prefixes = Prefixes(seed)
    phases: dict[str, int] = {}
    totals = {"orphans": 0, "bad_nodes": 0, "cleaned": 0, "writer_errors": 0,
              "writer_finished": 0, "background_reorder_failures": 0,
              "reorder_corrupt_node_errors": 0}
    reorder_errors: list[str] = []
    log_dir = base / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for it in range(iterations):
        st = states[it % len(states)]
        delay = float(rng.uniform(0.0, max_delay))
        lines, err, rc = run_writer(st.dir, st.fmt, seed, st.next_id, delay, max_inserts, log_dir)
        if rc is not None:
            if rc == 0 and lines and lines[-1] == "DONE":
                totals["writer_finished"] += 1
            else:
                totals["writer_errors"] += 1
                kept = log_dir / f"writer-{it}.err"
                shutil.copy(log_dir / "writer.err", kept)
                shutil.copy(log_dir / "writer.out", log_dir / f"writer-{it}.out")
                why = exception_lines(err) or err.strip().splitlines()[-1:] or ["no message"]
                failures.append(f"iteration {it}: writer exited {rc} on its own "
                                f"({'; '.join(why)}); log kept in "
                                f"{kept}" + ("" if keep_logs else " (removed with the "
                                             "temporary directory; use --dir)"))
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
        st.committed.update(int(x.split()[1]) for x in lines if x.startswith("COMMITTED "))
        st.next_id = max(begun) + 1 if begun else st.next_id
        res = verify_after_crash(st, prefixes, failures, rng)
        for key in ("orphans", "bad_nodes", "cleaned", "nodes_read_back"):
            totals[key] = totals.get(key, 0) + res[key]
    # Finally read every node and every committed prefix back whole.
    for st in states:
        with PrefixStore(st.dir, SHAPE, store_config(st.fmt)) as store:
            for node in list(store.tree.nodes.values()):
                why = check_node(store, node)
                if why:
                    totals["bad_nodes"] += 1
                    failures.append(f"{st.dir.name}: final read-back: node {node.id}: {why}")
            for p in sorted(st.committed - st.lost):
                if not prefix_exact(store, prefixes.tokens(p)):
                    st.lost.add(p)
                    failures.append(f"{st.dir.name}: committed prefix {p} not bit-exact "
                                    "in the final read-back")
            nodes = len(store.tree)
            totals.setdefault("final_nodes", {})[st.fmt] = nodes
    return {"committed": sum(len(s.committed) for s in states),
            "lost": sum(len(s.lost) for s in states),
            "kills_by_phase": dict(sorted(phases.items())), **totals,
            "reorder_errors": reorder_errors}


# ---------------------------------------------------------------------------------------
# 2. Corruption

def serve(store: PrefixStore, tokens: np.ndarray, hits: list[int], stats: dict) -> bool:
    """Serve a prefix like a request: read what is stored; on CorruptNode quarantine and
    retry; recompute (regenerate) and insert what is missing. True if it is then exact."""
    aligned = len(tokens) // C * C
    want = expected_bits(tokens[:aligned])
    for _ in range(SHAPE.n_layers * 4):
        match = store.match_prefix(tokens)
        try:
            got = read_prefix(store, match)
        except CorruptNode as exc:
            store.release(match)
            hits.append(exc.node.id)
            store.quarantine(exc.node, str(exc))
            continue
        if not all(np.array_equal(tensor_bits(k), want[layer, 0, :, :match.length]) and
                   np.array_equal(tensor_bits(v), want[layer, 1, :, :match.length])
                   for layer, (k, v) in enumerate(got)):
            stats["served_corrupt"] += 1
        if match.length < aligned:
            stats["recomputed"] += 1
            store.insert(tokens, match.length, kv_from_bits(want, match.length))
        store.release(match)
        return prefix_exact(store, tokens)
    return False


def inject(entry, kind: str, rng) -> str:
    """Damage one (node, layer) file; returns a description."""
    lay, path = entry.layout, entry.path
    if kind == "delete":
        os.unlink(path)
        return f"deleted {os.path.basename(path)}"
    if kind == "truncate":
        size = int(rng.integers(0, lay.file_bytes))
        os.truncate(path, size)
        return f"truncated {os.path.basename(path)} to {size} of {lay.file_bytes} bytes"
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
    return f"flipped bit {bit:#04x} at byte {offset} of {os.path.basename(path)}"


def fill_store(store: PrefixStore, prefixes: Prefixes, ids, rng) -> None:
    """Insert prefixes like requests, feed random importance back, reorder now and then."""
    for i, p in enumerate(ids):
        tokens = prefixes.tokens(p)
        aligned = len(tokens) // C * C
        match = store.match_prefix(tokens)
        path = store.insert(tokens, match.length,
                            kv_from_bits(expected_bits(tokens[:aligned]), match.length))
        store.release(match)
        for node in path:
            for layer in range(SHAPE.n_layers):
                scores = rng.random(node.n_tokens).astype(np.float32)
                store.record_selection(store.entry(node, layer), scores, scores > 0.8, None)
        if i % 4 == 3:
            store.reorder_now()


def corruption(base: Path, n_prefixes: int, faults_per_store: int, seed: int,
               failures: list[str]) -> dict:
    kinds = ("flip_k", "flip_v", "flip_probe", "truncate", "delete")
    res = {"injected": 0, "detected": 0, "false_detections": 0, "served_corrupt": 0,
           "recomputed": 0, "not_repaired": 0, "orphans": 0, "quarantined_files": 0}
    for s, fmt in enumerate(FORMATS):
        rng = np.random.default_rng([seed, 2, s])
        prefixes = Prefixes(seed * 1000 + 17 + s)
        sdir = base / f"corrupt-{fmt}"
        ids = list(range(n_prefixes))
        with PrefixStore(sdir, SHAPE, store_config(fmt)) as store:
            fill_store(store, prefixes, ids, rng)
            # Nodes of which none lies below another: quarantining one never hides another.
            chosen: list = []
            for nid in rng.permutation(sorted(store.tree.nodes)).tolist():
                node = store.tree.nodes[nid]
                family = set(store.tree.path_to(node)) | set(store.tree.subtree(node))
                if not any(c in family for c in chosen):
                    chosen.append(node)
                if len(chosen) == faults_per_store:
                    break
            targets = [(node.id, store.entry(node, int(rng.integers(SHAPE.n_layers))))
                       for node in chosen]
        injected = {}
        for j, (nid, entry) in enumerate(targets):
            kind = kinds[(j + s) % len(kinds)]
            injected[nid] = f"{kind}: {inject(entry, kind, rng)}"
        res["injected"] += len(injected)
        hits: list[int] = []
        with StoreWarnings() as warned, PrefixStore(sdir, SHAPE, store_config(fmt)) as store:
            for p in rng.permutation(ids).tolist():
                if not serve(store, prefixes.tokens(p), hits, res):
                    res["not_repaired"] += 1
                    failures.append(f"{sdir.name}: prefix {p} not exact after recompute")
            for p in ids:  # everything is served again, from disk, bit-exact
                if not prefix_exact(store, prefixes.tokens(p)):
                    res["not_repaired"] += 1
                    failures.append(f"{sdir.name}: prefix {p} not exact after repair")
        hit = set(hits)
        res["quarantine_warnings"] = res.get("quarantine_warnings", 0) + \
            sum("quarantined" in m for m in warned.messages)
        res["detected"] += len(hit & set(injected))
        res["false_detections"] += len(hit - set(injected))
        for nid in sorted(set(injected) - hit):
            failures.append(f"{sdir.name}: corruption of node {nid} not detected "
                            f"({injected[nid]})")
        for nid in sorted(hit - set(injected)):
            failures.append(f"{sdir.name}: node {nid} reported corrupt but was not damaged")
        with PrefixStore(sdir, SHAPE, store_config(fmt)) as store:
            left = orphans(store)
            res["orphans"] += len(left)
            failures.extend(f"{sdir.name}: orphan after quarantine and reopen: {n}" for n in left)
            for p in ids:
                if not prefix_exact(store, prefixes.tokens(p)):
                    res["not_repaired"] += 1
                    failures.append(f"{sdir.name}: prefix {p} not exact after reopen")
        qdir = sdir / "quarantine"
        res["quarantined_files"] += len(list(qdir.iterdir())) if qdir.is_dir() else 0
    return res


# ---------------------------------------------------------------------------------------
# 3. Capacity and ENOSPC

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
    with PrefixStore(base / "capacity", SHAPE, store_config("int4", disk_capacity_bytes=cap)) as store:
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
    """Patch impress_flexgen.store.write_durable: call number `fail_at` fails with ENOSPC,
    either before touching the disk ("before-write") or inside the real write path
    ("mid-write": temporary file created and sized, then pwrite fails)."""

    def __init__(self, fail_at: int, mode: str):
        self.fail_at, self.mode, self.calls, self.fired = fail_at, mode, 0, False
        self.real = store_mod.write_durable

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
        store_mod.write_durable = self
        return self

    def __exit__(self, *exc):
        store_mod.write_durable = self.real
        return False


def enospc(base: Path, n_inject: int, seed: int, failures: list[str]) -> dict:
    rng = np.random.default_rng([seed, 4])
    prefixes = Prefixes(seed * 1000 + 99)
    res = {"injected": 0, "handled": 0, "left_files": 0, "by_case": {}}
    fmt = "fp16"
    with StoreWarnings() as warned, PrefixStore(base / "enospc", SHAPE, store_config(fmt)) as store:
        done: list[np.ndarray] = []
        for p in range(4):
            fill_store(store, prefixes, [p], rng)
            done.append(prefixes.tokens(p))
        fresh = 1000
        for j in range(n_inject):
            case = ("insert", "split", "reorder")[j % 3]
            mode = ("before-write", "mid-write")[(j // 3) % 2]
            if case == "reorder":
                node = list(store.tree.nodes.values())[int(rng.integers(len(store.tree)))]
                for layer in range(SHAPE.n_layers):
                    scores = rng.random(node.n_tokens).astype(np.float32)
                    store.record_selection(store.entry(node, layer), scores, None, None)
                fail_at = int(rng.integers(SHAPE.n_layers))
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
                    fail_at = int(rng.integers((3 if needs_split else 1) * SHAPE.n_layers))
                else:
                    tokens = rng.integers(0, 1 << 20, size=2 * C + 3).astype(np.int32)
                    fail_at = int(rng.integers(SHAPE.n_layers))
                fresh += 1
            label = f"{case}/{mode}"
            before = live_files(store)
            stray_before = stray_files(store)  # left by earlier cases: not counted again
            ok, why = True, ""
            with NoSpace(fail_at, mode) as patch:
                if tokens is None:
                    n_done = store.reorder_node(node)
                    if n_done >= SHAPE.n_layers:
                        ok, why = False, "reorder did every layer despite ENOSPC"
                else:
                    match = store.match_prefix(tokens)
                    try:
                        aligned = len(tokens) // C * C
                        store.insert(tokens, match.length,
                                     kv_from_bits(expected_bits(tokens[:aligned]), match.length))
                        ok, why = False, "insert returned despite ENOSPC"
                    except StoreFull:
                        pass
                    except Exception as exc:  # noqa: BLE001 - reported as unhandled
                        ok, why = False, f"insert raised {type(exc).__name__}: {exc}"
                    finally:
                        store.release(match)
            if not patch.fired:
                continue  # nothing was written (the op had nothing to do): not injected
            res["injected"] += 1
            stray = stray_files(store) - stray_before
            if stray:
                res["left_files"] += len(stray)
                ok, why = False, f"files left behind: {sorted(stray)}"
            if case == "insert" and live_files(store) != before:
                ok, why = False, "the failed insert changed the store's files"
            for t in done:
                if not prefix_exact(store, t):
                    ok, why = False, "an earlier prefix no longer reads back bit-exact"
            # Without the fault the same operation works.
            if tokens is None:
                store.reorder_node(node)
                affected = []
                for t in done:  # the prefixes whose path holds the reordered node
                    match = store.match_prefix(t)
                    if node in match.nodes:
                        affected.append(t)
                    store.release(match)
            else:
                match = store.match_prefix(tokens)
                aligned = len(tokens) // C * C
                store.insert(tokens, match.length,
                             kv_from_bits(expected_bits(tokens[:aligned]), match.length))
                store.release(match)
                done.append(tokens)
                affected = [tokens]
            if not all(prefix_exact(store, t) for t in affected):
                ok, why = False, "not bit-exact after the retry without the fault"
            by_case = res["by_case"].setdefault(label, {"injected": 0, "handled": 0})
            by_case["injected"] += 1
            if ok:
                res["handled"] += 1
                by_case["handled"] += 1
            else:
                failures.append(f"enospc {label} (write {fail_at}): {why}")
    res["reorder_skipped_warnings"] = sum("skipped" in m for m in warned.messages)
    # Stray files are only removed when the store is opened again.
    with PrefixStore(base / "enospc", SHAPE, store_config(fmt)) as store:
        res["orphans_after_reopen"] = len(orphans(store))
    return res


# ---------------------------------------------------------------------------------------

def parse_args(argv):
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="8 kill iterations and fewer prefixes and faults (under 90 s)")
    p.add_argument("--iterations", type=int, help="kill iterations (default 60; quick 8)")
    p.add_argument("--dir", metavar="DIR",
                   help="where the test stores go (absent or empty; kept afterwards); "
                        "default: a temporary directory, removed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=1.0,
                   help="kill the writer up to this many seconds after it is ready")
    p.add_argument("--json", metavar="PATH")
    # Hidden: the writer subprocess of the kill loop.
    p.add_argument("--writer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--format", choices=FORMATS, help=argparse.SUPPRESS)
    p.add_argument("--start-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max-inserts", type=int, default=40, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.iterations is None:
        args.iterations = 8 if args.quick else 60
    if args.iterations < 1:
        p.error("--iterations must be positive")
    if args.max_delay <= 0:
        p.error("--max-delay must be positive")
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
    failures: list[str] = []
    seconds = {}
    try:
        t = time.perf_counter()
        kills = kill_loop(base, args.iterations, args.seed, args.max_delay,
                          max_inserts=40, failures=failures, keep_logs=bool(args.dir))
        seconds["kill_loop"], t = round(time.perf_counter() - t, 1), time.perf_counter()
        corrupt = corruption(base, n_prefixes=12 if args.quick else 40,
                             faults_per_store=4 if args.quick else 12, seed=args.seed,
                             failures=failures)
        seconds["corruption"], t = round(time.perf_counter() - t, 1), time.perf_counter()
        cap = capacity(base, args.seed, failures)
        seconds["capacity"], t = round(time.perf_counter() - t, 1), time.perf_counter()
        nospace = enospc(base, n_inject=12 if args.quick else 30, seed=args.seed,
                         failures=failures)
        seconds["enospc"] = round(time.perf_counter() - t, 1)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    result = {
        "iterations": args.iterations,
        "committed": kills["committed"],
        "lost": kills["lost"],
        "corruptions_injected": corrupt["injected"],
        "corruptions_detected": corrupt["detected"],
        "orphans_after_recovery": kills["orphans"] + corrupt["orphans"],
        "capacity_evictions": cap["evictions"],
        "enospc_injected": nospace["injected"],
        "enospc_handled": nospace["handled"],
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {"seconds": seconds, "kill_loop": kills, "corruption": corrupt, "capacity": cap,
                    "enospc": nospace, "failures": failures},
    }
    ok = (result["lost"] == 0 and result["orphans_after_recovery"] == 0 and
          result["corruptions_detected"] == result["corruptions_injected"] and
          kills["writer_errors"] == 0 and kills["bad_nodes"] == 0)
    write_json(args.json, result)
    for line in failures[:20]:
        print(f"  {line}", file=sys.stderr)
    print(f"crash test {'PASS' if ok else 'FAIL'}: {result['iterations']} kills, "
          f"{result['committed']} committed, {result['lost']} lost, "
          f"{result['orphans_after_recovery']} orphans; corruptions "
          f"{result['corruptions_detected']}/{result['corruptions_injected']} detected; "
          f"{result['capacity_evictions']} evictions; ENOSPC "
          f"{result['enospc_handled']}/{result['enospc_injected']} handled; "
          f"{result['seconds']} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_main(PROG, main))
