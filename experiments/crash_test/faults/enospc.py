"""enospc: write_durable fails with ENOSPC (before or part-way through a write) during
inserts, splits, reorders: StoreFull, reorder skipped, no file left behind, earlier
prefixes exact, the same operation works without the fault."""
from __future__ import annotations

import errno
from pathlib import Path

import numpy as np

from impress_flexgen.store import StoreFull

from ..fake_os import NoSpaceOS
from ..kv import Prefixes
from ..patching import patch, patched_os, real_write_durable
from ..registry import Context, fault
from ..write_faults import write_faults


class NoSpace:
    """Stands in for the store's durable write: call number `fail_at` fails with ENOSPC,
    either before touching the disk ("before-write") or inside the real write path
    ("mid-write": temporary file created and sized, then pwrite fails)."""

    def __init__(self, fail_at: int, mode: str):
        self.fail_at, self.mode, self.calls, self.fired = fail_at, mode, 0, False
        self._restore = None

    def __call__(self, path, chunks, total_bytes):
        n, self.calls = self.calls, self.calls + 1
        if n != self.fail_at:
            return real_write_durable(path, chunks, total_bytes)
        self.fired = True
        if self.mode == "before-write":
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        with patched_os(NoSpaceOS()):
            return real_write_durable(path, chunks, total_bytes)

    def __enter__(self):
        self._restore = patch("write_durable", self)
        return self

    def __exit__(self, *exc):
        self._restore()
        return False


def enospc(base: Path, n_inject: int, seed: int, failures: list[str]) -> dict:
    def fault(j: int, fail_at: int) -> NoSpace:
        return NoSpace(fail_at, ("before-write", "mid-write")[(j // 3) % 2])

    return write_faults(base / "enospc", n_inject, np.random.default_rng([seed, 4]),
                        Prefixes(seed * 1000 + 99), "fp16", fault, 1, (StoreFull,),
                        lambda m: failures.append(f"enospc: {m}"))


@fault("enospc", orphans="orphans_after_reopen")
def run(ctx: Context) -> dict:
    res = enospc(ctx.base, n_inject=12 if ctx.quick else 30, seed=ctx.seed,
                 failures=ctx.failures)
    ctx.report.count("enospc", injected=res["injected"], detected=res["handled"],
                     lost=res["earlier_lost"])
    return res
