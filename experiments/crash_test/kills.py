"""Killing a writer and checking what it leaves: start it, SIGKILL it after a delay, apply
the events it printed, reopen the store and read every node and committed prefix back."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from impress_flexgen.store import PrefixStore, StoreConfig

from .kv import C, SHAPE, Prefixes, digest, store_config
from .readback import check_node, files_on_disk, is_wrong, live_files, orphans, prefix_exact

ROOT = Path(__file__).resolve().parents[2]


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
        for node in list(store.inspect().state.tree.nodes.values()):
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
        if cap is not None and store.inspect().accounting.disk_bytes() > cap:
            over = 1
            failures.append(f"{st.dir.name}: {store.inspect().accounting.disk_bytes()} bytes stored after "
                            f"recovery, capacity {cap}")
        n_nodes = len(store.inspect().state.tree)
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
        for node in list(store.inspect().state.tree.nodes.values()):
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
        nodes = len(store.inspect().state.tree)
    return {"bad_nodes": bad, "wrong_nodes": wrong, "nodes": nodes}
