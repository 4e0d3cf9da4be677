"""Storing a request's new prefix KV behind its decode steps.

A request's first token goes out before its new prefix KV is stored; the store write
(encoding, CRCs, a file and an fsync per layer) then runs on a writer thread while the
request, and every other request in its batch, decodes. Three rules keep what a request
sees the same as when stores were written in line:

- a request opened after another's store was handed over waits for it (`wait_idle`), so
  it matches that prefix just as it would have;
- a response is made only once its own store is done (`Engine.finish` waits), so a
  caller that has the response finds the prefix stored;
- the engine's close waits for every store handed over.

The thread is started on demand and exits when nothing is left to write.
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from typing import Callable

from .. import cpu_threads


class StoreWriter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: collections.deque = collections.deque()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def submit(self, write: Callable[[], None]) -> Future:
        """Run `write` on the writer thread, after those submitted before it."""
        done: Future = Future()
        with self._lock:
            self._jobs.append((write, done))
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prefix-store-writer",
                                                daemon=True)
                self._thread.start()
        return done

    def wait_idle(self) -> None:
        """Return once every store handed over so far is written (or has failed)."""
        with self._lock:
            while self._pending:
                self._idle.wait()

    def _run(self) -> None:
        cpu_threads.helper_thread()
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                write, done = self._jobs.popleft()
            try:
                done.set_result(write())
            except BaseException as exc:  # noqa: BLE001 - kept for whoever waits on it
                done.set_exception(exc)
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle.notify_all()
