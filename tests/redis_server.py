"""A real redis-server on a free loopback port, for the remote tier's tests.

No persistence, its own scratch dir, optional maxmemory. stop()/kill()/pause() simulate an
outage; start() brings it back on the same port so a client's url stays valid.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

_CANDIDATES = ("/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server")
MISSING = ("redis-server was not found (PATH, /usr/bin, /usr/sbin, /usr/local/bin). Install it "
           "(Debian/Ubuntu: apt-get install redis-server) or set IMPRESS_SKIP_REDIS=1 to skip "
           "the tests that need it.")


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    for path in _CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return None


def require_redis_server() -> str:
    """The binary; otherwise FAIL the test (skip only when IMPRESS_SKIP_REDIS=1)."""
    import pytest   # here: benchmarks start servers with this module and need no pytest

    path = find_redis_server()
    if path is None:
        if os.environ.get("IMPRESS_SKIP_REDIS") == "1":
            pytest.skip("redis-server not installed and IMPRESS_SKIP_REDIS=1")
        pytest.fail(MISSING, pytrace=False)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """Context manager: `with RedisServer() as srv: RedisTier(srv.url, ...)`."""

    start_timeout_s = 10.0

    def __init__(self, binary: str | None = None, *, maxmemory: str | None = None,
                 db: int = 0) -> None:
        self.binary = binary or require_redis_server()
        self.maxmemory = maxmemory
        self.port = free_port()
        self.db = db
        self._dir = tempfile.TemporaryDirectory(prefix="redis-test-")
        self._proc: subprocess.Popen | None = None
        self._paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/{self.db}"

    def _log_tail(self) -> str:
        try:
            return (Path(self._dir.name) / "redis.log").read_text()[-2000:]
        except OSError:
            return ""

    def start(self) -> Self:
        if self._proc is not None and self._proc.poll() is None:
            return self
        args = [self.binary, "--save", "", "--appendonly", "no", "--port", str(self.port),
                "--bind", "127.0.0.1", "--dir", self._dir.name, "--daemonize", "no",
                "--logfile", str(Path(self._dir.name) / "redis.log")]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while not ping(self.port):
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode} on port "
                                   f"{self.port}:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port} "
                                   f"within {self.start_timeout_s}s:\n{self._log_tail()}")
            time.sleep(0.02)
        return self

    def _end(self, sig: int) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if self._paused:  # a stopped process never handles SIGTERM
            proc.send_signal(signal.SIGCONT)
            self._paused = False
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        self._end(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: connections still open but nothing answers (a hung server)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        if self._proc is not None and self._paused:
            self._proc.send_signal(signal.SIGCONT)
            self._paused = False

    def close(self) -> None:
        self.kill()
        self._dir.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class SlowProxy:
    """A TCP proxy in front of a server that holds every client command `delay_s` before
    passing it on: a pool that answers, slowly (a congested or distant Redis)."""

    def __init__(self, port: int, delay_s: float) -> None:
        import threading

        self.target, self.delay_s = port, delay_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._open: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        import threading

        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._open += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, self.delay_s),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, 0.0),
                             daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while data := src.recv(1 << 20):
                if delay_s:
                    time.sleep(delay_s)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        for s in self._open:
            try:
                s.close()
            except OSError:
                pass
