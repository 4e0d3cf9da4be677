"""Per fault class counters and the failures that fail the run."""
from __future__ import annotations

import logging

COUNTERS = ("injected", "detected", "harmless", "served_wrong", "lost")


class Report:
    """Per fault class counters ({class: {injected, detected, harmless, served_wrong,
    lost}}) and failures (each fails the run)."""

    def __init__(self):
        self.failures: list[str] = []
        self.faults: dict[str, dict[str, int]] = {}

    def count(self, cls: str, **n: int) -> None:
        row = self.faults.setdefault(cls, dict.fromkeys(COUNTERS, 0))
        for key, value in n.items():
            row[key] += int(value)

    def fail(self, cls: str, message: str) -> None:
        self.failures.append(f"{cls}: {message}")


class StoreWarnings(logging.Handler):
    """Collects the store's log records (quarantines, skipped reorders, dropped rows)
    instead of printing them."""

    LOGGERS = ("impress_flexgen.store", "impress_flexgen.metadata", "disk_layout")

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)
        return False


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
