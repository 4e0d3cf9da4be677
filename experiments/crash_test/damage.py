"""Damage to (node, layer) files and the loop that serves a damaged store: every prefix
served like a request (CorruptNode: quarantine, recompute, insert) and then exact."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from impress_flexgen.store import PrefixStore

from .kv import FORMATS, SHAPE, Prefixes, store_config
from .readback import check_node, disjoint_nodes, fill_store, orphans, prefix_exact, serve
from .report import StoreWarnings

CORRUPTIONS = ("flip_k", "flip_v", "flip_probe", "truncate", "delete")
TORN = ("torn_truncate", "torn_garbage", "torn_zero")


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
                    node = store.inspect().state.tree.nodes.get(nid)
                    if node is None or check_node(store, node) is None:
                        harmless.add(nid)
            if quarantine_bytes is not None:
                size = quarantine_size(sdir)
                counted = store.inspect().accounting.overheads().get("quarantine_bytes")
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
