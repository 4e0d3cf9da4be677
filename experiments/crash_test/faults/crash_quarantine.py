"""crash_quarantine: files of disjoint nodes damaged, then a writer serving every prefix is
killed while damaged nodes are served, quarantined and recomputed (every other kill a few
milliseconds after the first quarantine starts). Every damage is detected by the writer,
by the store on opening or by serving here; nothing is served wrong."""
from __future__ import annotations

from ..crash_loop import run_crash
from ..registry import Context, fault


@fault("crash_quarantine")
def run(ctx: Context) -> dict:
    return run_crash(ctx, "quarantine")
