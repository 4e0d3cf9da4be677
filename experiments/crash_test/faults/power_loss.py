"""power_loss: the same writer, reorders off, copies store.sqlite and its WAL (and links
the files they reference) after every committed insert. After the kill the last copy is
put back (what a power loss after that commit leaves: it was fsynced), data files it does
not reference are deleted, truncated or zero-filled (unsynced data), a torn frame may be
appended to the WAL. Every prefix committed up to that copy must read back exact, no
orphan remain."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from ..kills import KillState, final_read_back, run_child, verify_after_crash, writer_argv, \
    writer_died
from ..kv import FORMATS, Prefixes
from ..registry import Context, fault
from ..report import Report


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
        # More inserts than the writer makes before the latest kill (max_delay): a writer
        # that finished first leaves nothing unsynced to tear.
        lines, err, rc = run_child(writer_argv(st.dir, st.fmt, pseed, st.next_id, 400, "power",
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


@fault("power_loss")
def run(ctx: Context) -> dict:
    return power_loss(ctx.base, 4 if ctx.quick else 30, ctx.seed, ctx.max_delay, ctx.report,
                      ctx.keep_logs)
