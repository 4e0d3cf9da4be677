"""crash_eviction: a writer killed while a capacity-limited store, filled near its capacity,
evicts (every other kill a few milliseconds after an eviction starts). What the writer
reported removing may be gone, never wrong; the store stays within its capacity."""
from __future__ import annotations

from ..crash_loop import run_crash
from ..registry import Context, fault


@fault("crash_eviction")
def run(ctx: Context) -> dict:
    return run_crash(ctx, "eviction")
