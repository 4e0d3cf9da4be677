"""io_error: EIO from pread/preadv, a directory, a FIFO or a symlink (to an exact copy
outside the store) in place of a layer file: CorruptNode, quarantine, recompute; a FIFO
must not block readers, nothing outside the store is deleted."""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from impress_flexgen.store import PrefixStore

from ..kv import FORMATS, SHAPE, Prefixes, store_config
from ..fake_os import FaultyOS
from ..patching import patched_os
from ..readback import disjoint_nodes, fill_store, orphans, prefix_exact, serve
from ..registry import Context, fault
from ..report import Report, StoreWarnings, error_text

IO_KINDS = ("eio", "directory", "fifo", "symlink")


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
                    counted = getattr(store.inspect().state.metrics, "corruptions", 0)
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


@fault("io_error")
def run(ctx: Context) -> dict:
    return io_errors(ctx.base, 10 if ctx.quick else 24, 4 if ctx.quick else 8, ctx.seed,
                     ctx.report)
