"""The fault classes: each registers itself (faults/<name>.py) with what it runs.

    @fault("capacity", orphans=None)
    def capacity(ctx: Context) -> dict: ...     # counts into ctx.report; its details

The run calls each registered class in registration order (the import order of
faults/__init__.py) and puts what it returns under details.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from .report import Report


@dataclasses.dataclass
class Context:
    """What a fault class runs with."""
    base: Path            # its stores go in base / <name>...
    quick: bool
    iterations: int       # kill iterations
    fuzz: int             # damaged-database iterations
    seed: int
    max_delay: float      # a writer is killed up to this many seconds after it is ready
    keep_logs: bool       # base is kept afterwards (--dir)
    report: Report

    @property
    def failures(self) -> list[str]:
        return self.report.failures


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    run: Callable[[Context], dict]
    orphans: str | None   # key of its result holding the orphan files left after recovery


FAULTS: dict[str, Fault] = {}


def fault(name: str, orphans: str | None = "orphans"):
    """Register the decorated function as fault class `name`."""
    def register(fn: Callable[[Context], dict]):
        if name in FAULTS:
            raise ValueError(f"fault class {name} registered twice")
        FAULTS[name] = Fault(name, fn, orphans)
        return fn
    return register
