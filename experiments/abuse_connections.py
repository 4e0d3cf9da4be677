"""Slow clients against the server: experiments.abuse_test's slow_clients class.

Connections that send nothing, half their headers, or their headers and half a body, three
times as many as the server's connection cap, on loopback. It passes when

- a normal request sent after them is answered long before the read deadline (the cap
  gives a waiting connection the place of the slow one that waited longest);
- every slow connection is closed within the deadline (a margin added), those that sent
  part of a request with a 408 when they are answered at all;
- the server's warnings about them are throttled: a line a second per kind at most.

Outside --quick, also the descriptor-limit case: `python -m impress_flexgen.serve` under a
256-descriptor limit and 300 half-sent connections (more than the limit): a normal request
is answered, no "Too many open files" is logged, every slow connection is closed.
"""
from __future__ import annotations

import logging
import math
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "llama-tiny"
ROOT = Path(__file__).resolve().parents[1]
SLOW = (b"",                                                      # connects, sends nothing
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-",  # half its headers
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{\"model\": ")               # headers, half its body
SMALL = {"model": MODEL, "prompt": "Hello there", "max_tokens": 1, "temperature": 0}


def open_slow(host: str, port: int, n: int) -> list[socket.socket]:
    """`n` connections, each sending one of SLOW's beginnings and nothing more."""
    socks = []
    for i in range(n):
        s = socket.create_connection((host, port), timeout=10)
        if SLOW[i % len(SLOW)]:
            s.sendall(SLOW[i % len(SLOW)])
        socks.append(s)
    return socks


def wait_closed(socks: list[socket.socket], until: float) -> tuple[list, list[bytes]]:
    """Read every socket until the server closes it or `until` (monotonic) passes: the
    sockets still open, and what the closed ones were answered."""
    for s in socks:
        s.setblocking(False)
    open_, answers, got = list(socks), [], {s: b"" for s in socks}
    while open_ and time.monotonic() < until:
        ready, _, _ = select.select(open_, [], [], max(0.0, until - time.monotonic()))
        for s in ready:
            try:
                data = s.recv(4096)
            except OSError:           # reset: closed while its bytes were unread
                data = b""
            if data:
                got[s] += data
                continue
            open_.remove(s)
            answers.append(got[s])
    return open_, answers


class Warnings(logging.Handler):
    """The server's lines about slow clients and accept errors, counted."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith(("closed a connection", "at the connection cap",
                               "cannot accept")):
            self.lines.append(message)


def slow_clients(service, quick: bool = True) -> str | None:
    """The class's round (see the module's notes); an error line, or None if it passed."""
    import httpx2

    from impress_flexgen.entrypoints.openai.guard import ServerOptions
    from impress_flexgen.entrypoints.openai.server import background_server

    deadline_s, cap = 3.0, 8
    warnings = Warnings()
    server_log = logging.getLogger("uvicorn.error")
    server_log.addHandler(warnings)
    options = ServerOptions(read_timeout_s=deadline_s, max_connections=cap)
    socks = []
    try:
        with background_server(service, options=options) as url:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            t0 = time.monotonic()
            socks = open_slow(host, int(port), 3 * cap)
            t1 = time.monotonic()
            r = httpx2.post(url + "/v1/completions", json=SMALL, timeout=30)
            took = time.monotonic() - t1
            if r.status_code != 200 or took > deadline_s / 2:
                return (f"a normal request behind {3 * cap} slow connections (cap {cap}): "
                        f"{r.status_code} after {took:.2f} s")
            still, answers = wait_closed(socks, t0 + deadline_s + 2.0)
            elapsed = time.monotonic() - t0
            if still:
                return (f"{len(still)} of {len(socks)} slow connections still open "
                        f"{elapsed:.1f} s after they connected (deadline {deadline_s:g} s)")
            wrong = [a[:30] for a in answers if a and not a.startswith(b"HTTP/1.1 408")]
            if wrong or not any(answers):
                return f"slow connections answered {wrong[:2] or 'never with a 408'}"
        lines = len(warnings.lines)
        if lines > 3 * (math.ceil(elapsed) + 1):
            return f"{lines} warnings in {elapsed:.1f} s: not throttled to one a second"
    finally:
        server_log.removeHandler(warnings)
        for s in socks:
            s.close()
    return None if quick else descriptor_flood()


def descriptor_flood(limit: int = 256, slow: int = 300, deadline_s: float = 3.0) -> str | None:
    """The server program under a descriptor limit, more half-sent connections than it."""
    import httpx2

    def lower_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    with tempfile.TemporaryDirectory(prefix="abuse-fd-") as tmp:
        err_path = Path(tmp) / "stderr"
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "impress_flexgen.serve", "--model", MODEL,
                 "--port", "0", "--store-dir", f"{tmp}/st", "--offload-dir", f"{tmp}/off",
                 "--log-level", "warning", "--read-timeout-s", str(deadline_s)],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=lower_limit)
        socks = []
        try:
            url = None
            while url is None:
                line = proc.stdout.readline()
                if not line:
                    return f"the server did not start: {err_path.read_text()[-300:]}"
                if line.startswith("serving "):
                    url = line.split(" on ")[1].split("/v1")[0]
            host, port = url.removeprefix("http://").rsplit(":", 1)
            t0 = time.monotonic()
            socks = open_slow(host, int(port), slow)
            t1 = time.monotonic()
            r = httpx2.post(url + "/v1/completions", json=SMALL, timeout=30)
            took = time.monotonic() - t1
            still, _ = wait_closed(socks, t0 + deadline_s + 5.0)
        finally:
            for s in socks:
                s.close()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        text = err_path.read_text(errors="replace")
    if r.status_code != 200 or took > deadline_s:
        return f"{slow} slow connections under a {limit} limit: {r.status_code} after {took:.1f} s"
    if still:
        return f"{len(still)} of {slow} slow connections still open"
    if "Too many open files" in text or len(text.splitlines()) > 40:
        return (f"the server logged {len(text.splitlines())} lines, "
                f"{text.count('Too many open files')} 'Too many open files'")
    return None
