"""crash_recovery: a writer killed while opening a store with many orphan files to delete
(the first kill as soon as opening starts); the store reopened here must hold every
committed prefix exact and no orphan."""
from __future__ import annotations

from ..crash_loop import run_crash
from ..registry import Context, fault


@fault("crash_recovery")
def run(ctx: Context) -> dict:
    return run_crash(ctx, "recovery")
