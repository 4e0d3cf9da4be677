"""How a program of this package ends: one line and exit status 2 for a user's mistake
(UserError), 130 for Ctrl-C, 143 for SIGTERM, each after the program's own cleanup ran.

    sys.exit(run_main("python -m impress_flexgen.run", main))
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

from ..errors import UserError


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `finally:` blocks and context managers
    clean up (scratch directories, disk threads) before the program exits."""


def _in_finalizer(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _raise_terminated(signum, frame):
    # An exception raised inside a finalizer is swallowed by Python: send the signal again
    # once the finalizer has returned.
    if _in_finalizer(frame):
        threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
        return
    # A second SIGTERM while cleaning up ends the program at once.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated()


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated in the main thread (elsewhere: no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_main(prog: str, main, argv=None) -> int:
    """Call main(argv); turn UserError into one line and exit status 2, Ctrl-C into 130 and
    SIGTERM into 143, each after the program's own cleanup has run."""
    try:
        with sigterm_exits():
            return main(argv) or 0
    except UserError as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
