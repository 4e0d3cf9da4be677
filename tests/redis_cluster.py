"""A real Redis Cluster of three masters (no replicas) on free loopback ports, for the pool's
tests and its benchmark: redis-server --cluster-enabled yes on each port, then
redis-cli --cluster create. kill(i) takes master i down for good (a crashed node)."""
from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from tests.redis_server import find_redis_server, ping


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port(taken: list[int]) -> int:
    """A free port P whose bus port P + 10000 is free too (so P <= 55535)."""
    rng = random.Random()
    for _ in range(1000):
        p = rng.randrange(20000, 45000)
        if p not in taken and p + 10000 not in taken and _free(p) and _free(p + 10000):
            return p
    raise RuntimeError("no free port pair for a cluster node")


def find_redis_cli() -> str | None:
    server = find_redis_server()
    found = shutil.which("redis-cli")
    if found:
        return found
    if server:
        candidate = Path(server).with_name("redis-cli")
        if candidate.exists():
            return str(candidate)
    return None


class RedisCluster:
    """Context manager: `with RedisCluster() as c: RedisTier(c.url, ...)`."""

    start_timeout_s = 20.0

    def __init__(self, n_masters: int = 3, server: str | None = None,
                 cli: str | None = None) -> None:
        self.server = server or find_redis_server()
        self.cli = cli or find_redis_cli()
        if self.server is None or self.cli is None:
            raise RuntimeError("a Redis Cluster needs redis-server and redis-cli")
        self.ports: list[int] = []
        for _ in range(n_masters):
            self.ports.append(free_cluster_port(self.ports))
        self._dir = tempfile.TemporaryDirectory(prefix="redis-cluster-")
        self._procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _start_node(self, port: int) -> None:
        d = Path(self._dir.name) / str(port)
        d.mkdir(exist_ok=True)
        self._procs[port] = subprocess.Popen(
            [self.server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "2000",
             "--cluster-require-full-coverage", "no", "--save", "", "--appendonly", "no",
             "--dir", str(d), "--daemonize", "no", "--logfile", str(d / "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def start(self) -> Self:
        if self._procs:     # started already (a second start would orphan these nodes)
            return self
        for port in self.ports:
            self._start_node(port)
        deadline = time.monotonic() + self.start_timeout_s
        for port in self.ports:
            while not ping(port):
                if self._procs[port].poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"cluster node on port {port} did not start")
                time.sleep(0.02)
        done = subprocess.run(
            [self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            self.close()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-800:]}"
                               f"{done.stderr[-800:]}")
        while not self._ok():
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def _ok(self) -> bool:
        for port in self.ports:
            out = subprocess.run([self.cli, "-p", str(port), "cluster", "info"],
                                 capture_output=True, text=True, timeout=10).stdout
            if "cluster_state:ok" not in out:
                return False
        return True

    def flush(self) -> None:
        for port in self.ports:
            if port in self._procs and self._procs[port].poll() is None:
                subprocess.run([self.cli, "-p", str(port), "flushall"], capture_output=True,
                               timeout=10)

    def kill(self, i: int) -> None:
        proc = self._procs.pop(self.ports[i], None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        for port in list(self._procs):
            proc = self._procs.pop(port)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._dir.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
