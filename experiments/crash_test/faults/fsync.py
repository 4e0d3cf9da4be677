"""fsync: os.fsync fails with EIO (file or directory) during inserts, splits, reorders: the
operation fails (StoreFull, StoreWriteFailed or OSError: counted by type), reorder
skipped, no file left behind, earlier prefixes exact, the same operation works without
the fault."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from impress_flexgen.store import StoreFull, StoreWriteFailed

from ..fake_os import FaultyOS
from ..kv import Prefixes
from ..patching import patched_os
from ..registry import Context, fault
from ..report import Report
from ..write_faults import write_faults


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


def fsync_failures(base: Path, n_inject: int, seed: int, report: Report) -> dict:
    res = write_faults(base / "fsync", n_inject, np.random.default_rng([seed, 6]),
                       Prefixes(seed * 1000 + 83), "int4", lambda j, at: FsyncFault(at), 2,
                       (StoreFull, StoreWriteFailed, OSError), lambda m: report.fail("fsync", m))
    report.count("fsync", injected=res["injected"], detected=res["handled"],
                 lost=res["earlier_lost"])
    return res


@fault("fsync", orphans="orphans_after_reopen")
def run(ctx: Context) -> dict:
    return fsync_failures(ctx.base, 9 if ctx.quick else 30, ctx.seed, ctx.report)
