"""The pool's connection: one Redis/Valkey server or a cluster, its health and its speed.

The link degrades, never fails: a Redis error or timeout marks it down for retry_after_s,
and while down every caller answers misses at once without touching the network. It
measures itself (an EWMA of each command's latency and of its seconds per byte), so that a
caller can tell when loading from the pool would be slower than computing.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import redis
import redis.backoff
import redis.exceptions
import redis.retry
import torch

from ..errors import UserError
from .remote_codec import DIGEST_SIZE, RemoteNamespace
from .remote_url import cluster_nodes, is_cluster, redact_url, validate_url

# One logger for the whole tier (its link, reads and writer).
log = logging.getLogger("impress_flexgen.tiers.remote")

COUNTERS = ("hits", "misses", "bytes_in", "bytes_served", "corrupt_values", "errors",
            "dropped_writes", "refused_puts", "chunks_written", "down_events",
            "incomplete_chunks", "skipped_requests")
# Weight of the newest sample in the latency and bandwidth averages.
EWMA = 0.3
# Bytes a connection reads from its socket at once: a layer of a long prefix is megabytes.
READ_SIZE = 1 << 20


class PoolLink:
    """The client of one pool, its health (up, or down until a retry is due), its measured
    latency and bandwidth, and its counters."""

    def __init__(self, url: str, namespace: RemoteNamespace, *, timeout_s: float,
                 retry_after_s: float, secret: bytes | str | None, name: str) -> None:
        validate_url(url)
        if not isinstance(namespace, RemoteNamespace):
            raise UserError("remote tier: namespace must be a RemoteNamespace")
        if not timeout_s > 0:
            raise UserError(f"remote tier: timeout_s must be > 0, got {timeout_s!r}")
        if not retry_after_s >= 0:
            raise UserError(f"remote tier: retry_after_s must be >= 0, got {retry_after_s!r}")
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and not secret:
            raise UserError("remote tier: the shared secret is empty")
        self.secret = secret
        self.name = name
        self.url = url
        self.shown_url = redact_url(url)   # what logs print: never a password
        # Keyed and plain values live under different keys: neither reads the other's.
        self.namespace = dataclasses.replace(namespace, keyed=secret is not None)
        self._timeout_s = float(timeout_s)
        self.retry_after_s = float(retry_after_s)
        self.cluster = is_cluster(url)
        self._pool = None
        self._cluster_client = None
        if not self.cluster:
            try:
                # No retries inside redis-py: one failure marks the tier down, so no request
                # waits longer than one timeout on a dead server.
                self._pool = redis.ConnectionPool.from_url(
                    url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                    socket_read_size=READ_SIZE,
                    retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
            except ValueError as exc:
                raise UserError(f"remote tier: bad url {self.shown_url!r}: {exc}") from None
            self._single = redis.Redis(connection_pool=self._pool)
        self._latency_s = 0.0005      # EWMA of one small command's round trip
        self._s_per_byte = 1e-9       # EWMA of the seconds each byte read adds (1 GB/s)
        self._timed_small = self._timed_large = 0

        self._mu = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._down = False
        self._down_until = 0.0
        self._closed = False

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        """Changed after start: connections opened from now on use it."""
        self._timeout_s = float(seconds)
        if self._pool is not None:
            self._pool.connection_kwargs.update(socket_timeout=self._timeout_s,
                                                socket_connect_timeout=self._timeout_s)

    def reachable(self) -> bool:
        """False while down and not yet due for a retry (a caller then skips asking)."""
        return self._reachable()

    def count_skipped(self) -> None:
        """A request its caller did not send (not worth asking): counted as skipped."""
        self._count(skipped_requests=1)

    def _reachable(self) -> bool:
        """False while down and not yet due for a retry: answer without the network."""
        if self._closed:
            return False
        return not self._down or time.monotonic() >= self._down_until

    def _ok(self) -> None:
        if self._down:
            with self._mu:
                if not self._down:
                    return
                self._down = False
            log.info("remote tier %s at %s is back", self.name, self.shown_url)

    def _failed(self, exc: Exception, what: str) -> None:
        """Count a failure; a connection error or timeout marks the tier down."""
        with self._mu:
            self._counters["errors"] += 1
            if isinstance(exc, redis.exceptions.ResponseError):
                # The server answered (wrong type, read-only replica...): it is up.
                transition = False
            else:
                self._down_until = time.monotonic() + self.retry_after_s
                transition = not self._down
                if transition:
                    self._down = True
                    self._counters["down_events"] += 1
        if transition:
            log.warning("remote tier %s at %s is down (%s: %s); answering misses for %.1fs "
                        "before retrying", self.name, self.shown_url, what, exc, self.retry_after_s)
        elif isinstance(exc, redis.exceptions.ResponseError):
            log.warning("remote tier %s: %s refused: %s", self.name, what, exc)

    @property
    def _client(self):
        """The client: one server's, or the cluster's (made on first use: a cluster that is
        unreachable at start-up is an error of the first command, like a server's)."""
        if not self.cluster:
            return self._single
        if self._cluster_client is None:
            from redis.cluster import ClusterNode, RedisCluster

            nodes, user, password, tls = cluster_nodes(self.url)
            client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in nodes], username=user,
                password=password, ssl=tls, socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s, require_full_coverage=False,
                retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
            with self._mu:
                if self._cluster_client is None:
                    self._cluster_client = client
                else:
                    client.close()
        return self._cluster_client

    def _timed(self, seconds: float, n_bytes: int = 0) -> None:
        """Learn from one command: small ones teach the latency, large ones the bandwidth."""
        with self._mu:
            if n_bytes <= 64 * 1024:
                # The very first command also opened a connection: not a measure of the pool.
                # The next one replaces the prior: a slow pool is known from then on.
                self._timed_small += 1
                if self._timed_small == 1:
                    return
                w = EWMA if self._timed_small > 2 else 1.0
                self._latency_s += w * (seconds - self._latency_s)
            else:
                per = max(seconds - self._latency_s, 0.0) / n_bytes
                w = EWMA if self._timed_large else 1.0
                self._timed_large += 1
                self._s_per_byte += w * (per - self._s_per_byte)

    def load_estimate_s(self, n_chunks: int) -> float:
        """Predicted seconds to read n_chunks whole chunks, one round trip per layer."""
        ns = self.namespace
        value = 2 * ns.n_kv_heads * ns.chunk_size * ns.head_dim * \
            torch.empty((), dtype=ns.torch_dtype).element_size()
        with self._mu:
            return ns.n_layers * (self._latency_s + n_chunks * value * self._s_per_byte)

    def latency_s(self) -> float:
        with self._mu:
            return self._latency_s

    def _count(self, **deltas: int) -> None:
        with self._mu:
            for k, v in deltas.items():
                self._counters[k] += v

    def _disconnect(self) -> None:
        if self._pool is not None:
            self._pool.disconnect()
        if self._cluster_client is not None:
            self._cluster_client.close()

    # ---- keys ---------------------------------------------------------------------------

    def _check_hash(self, h: Any) -> bytes:
        if not isinstance(h, bytes) or len(h) != DIGEST_SIZE:
            raise ValueError(f"a chunk hash is {DIGEST_SIZE} bytes (from chunk_hashes), "
                             f"got {h!r:.60}")
        return h

    def _check_key(self, key: Any) -> tuple[bytes, int]:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise ValueError(f"remote tier keys are (chunk_hash, layer), got {key!r:.80}")
        h, layer = key
        self._check_hash(h)
        if not isinstance(layer, int) or isinstance(layer, bool) \
                or not 0 <= layer < self.namespace.n_layers:
            raise ValueError(f"layer must be in [0, {self.namespace.n_layers}), got {layer!r}")
        return h, layer

