"""A remote tier on Redis/Valkey (one server or a cluster): one pool of prefix KV shared by
several serving processes.

Keys, values and their checks are in remote_codec: chunks are named by content, and a value
is only served when its tag proves it is the layer of the chunk its key names. A chunk is
held only while its completion marker AND every one of its layers are there: a chunk that
lost a layer (evicted) has its marker deleted (counted) and is written again by the next
process that computes it. Layer values are written with an expiry that is lifted only once
the marker is set (or kept, with ttl_s), so a half-written chunk never outlives its writer
by long.

The tier degrades, never fails: a Redis error or timeout marks it down for retry_after_s, and
while down every call answers misses at once without touching the network. Writes go through
a bounded queue to a writer thread; a full queue drops the chunk (counted), never the caller.
It measures itself (an EWMA of each command's latency and of its seconds per byte), so that
a caller can tell when loading from it would be slower than computing.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

import redis
import redis.backoff
import redis.exceptions
import redis.retry
import torch

from ..errors import UserError
from .base import nbytes, payload_crc
from .remote_codec import (  # noqa: F401 - re-exported: the tier's public names
    DIGEST_SIZE,
    HEADER_SIZE,
    KEY_PREFIX,
    LAYOUT_VERSION,
    RemoteNamespace,
    chunk_hashes,
    decode_value,
    encode_value,
    layer_key,
    marker_key,
)
from .remote_url import cluster_nodes, is_cluster, redact_url, validate_url  # noqa: F401

log = logging.getLogger("impress_flexgen.tiers.remote")

_COUNTERS = ("hits", "misses", "bytes_in", "bytes_served", "corrupt_values", "errors",
             "dropped_writes", "refused_puts", "chunks_written", "down_events",
             "incomplete_chunks", "skipped_requests")
# Layer values of a chunk whose marker is not written yet expire after this (no ttl_s).
ORPHAN_TTL_S = 600
# Weight of the newest sample in the latency and bandwidth averages.
EWMA = 0.3
# Bytes a connection reads from its socket at once: a layer of a long prefix is megabytes.
READ_SIZE = 1 << 20

class _Pending:
    """What submit_get returns: a future, or an answer known at once (tier down, no keys)."""
    __slots__ = ("future", "ready")

    def __init__(self, future: concurrent.futures.Future | None = None,
                 ready: list | None = None) -> None:
        self.future = future
        self.ready = ready


class RedisTier:
    """Remote tier; keys are (chunk_hash, layer), or a bare chunk_hash for a whole chunk."""

    # Readers serve submit_get; two let one fetch overlap another's decode.
    reader_threads = 2
    # How long close() lets the writer drain before dropping what is left.
    close_wait_s = 2.0

    def __init__(self, url: str, namespace: RemoteNamespace, *, timeout_s: float = 0.5,
                 retry_after_s: float = 5.0, queue_chunks: int = 1024,
                 ttl_s: int | None = None, secret: bytes | str | None = None,
                 name: str = "remote") -> None:
        validate_url(url)
        if not isinstance(namespace, RemoteNamespace):
            raise UserError("remote tier: namespace must be a RemoteNamespace")
        if not timeout_s > 0:
            raise UserError(f"remote tier: timeout_s must be > 0, got {timeout_s!r}")
        if not retry_after_s >= 0:
            raise UserError(f"remote tier: retry_after_s must be >= 0, got {retry_after_s!r}")
        if not isinstance(queue_chunks, int) or queue_chunks < 1:
            raise UserError(f"remote tier: queue_chunks must be a positive integer, "
                            f"got {queue_chunks!r}")
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s < 1):
            raise UserError(f"remote tier: ttl_s must be a positive number of seconds or None, "
                            f"got {ttl_s!r}")
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
        self.timeout_s = float(timeout_s)
        self.retry_after_s = float(retry_after_s)
        self.queue_chunks = queue_chunks
        self.ttl_s = ttl_s
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
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._down = False
        self._down_until = 0.0
        self._closed = False

        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[bytes, torch.Tensor]] = collections.deque()
        self._writing = False
        self._stop = False
        self._writer = threading.Thread(target=self._write_loop, name=f"{name}-writer",
                                        daemon=True)
        self._writer.start()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._readers = [threading.Thread(target=self._read_loop, name=f"{name}-reader-{i}",
                                          daemon=True) for i in range(self.reader_threads)]
        for t in self._readers:
            t.start()

    # ---- health -------------------------------------------------------------------------

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

    def _exists_key(self, key: Any) -> bytes:
        """The Redis key that answers 'held?': a layer's value, or a whole chunk's marker."""
        if isinstance(key, bytes):
            return marker_key(self._check_hash(key))
        return layer_key(*self._check_key(key))

    # ---- lookups ------------------------------------------------------------------------

    def _leading(self, rkeys: list[bytes], what: str) -> int:
        if not rkeys or not self._reachable():
            return 0
        try:
            client = self._client      # (a cluster's first use maps its slots: not timed)
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k in rkeys:
                pipe.exists(k)
            found = pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, what)
            return 0
        self._timed(time.perf_counter() - t0)
        self._ok()
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def contains(self, key: Any) -> bool:
        if isinstance(key, bytes):
            return self.batch_exists_chunks([key]) == 1
        return self._leading([self._exists_key(key)], "contains") == 1

    def batch_exists(self, keys: Sequence[Any]) -> int:
        """Leading run of keys held; a bare chunk hash tests the whole chunk."""
        if keys and all(isinstance(k, bytes) for k in keys):
            return self.batch_exists_chunks(keys)
        return self._leading([self._exists_key(k) for k in keys], "batch_exists")

    def batch_exists_chunks(self, hashes: Sequence[bytes]) -> int:
        """Leading run of chunks held whole: the marker and every layer there (one EXISTS
        of one slot per chunk, all in one pipeline). A marker whose chunk lost a layer is
        deleted and counted, so that the chunk is written again."""
        hashes = [self._check_hash(h) for h in hashes]
        if not hashes or not self._reachable():
            return 0
        n_layers = self.namespace.n_layers
        try:
            client = self._client      # (a cluster's first use maps its slots: not timed)
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(marker_key(h), *(layer_key(h, i) for i in range(n_layers)))
            found = pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, "batch_exists_chunks")
            return 0
        self._timed(time.perf_counter() - t0)
        self._ok()
        n = 0
        while n < len(hashes) and found[n] == n_layers + 1:
            n += 1
        # Markers over a lost layer (evicted, deleted): the chunk is no longer whole.
        broken = [h for h, f in zip(hashes, found) if f and f != n_layers + 1]
        if broken:
            self._unmark(broken)
        return n

    def _unmark(self, hashes: Sequence[bytes]) -> None:
        """Delete the markers of chunks found missing a layer, counting those that had one."""
        try:
            pipe = self._client.pipeline(transaction=False)
            for h in hashes:
                pipe.delete(marker_key(h))
            deleted = pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, "delete the marker of an incomplete chunk")
            return
        self._count(incomplete_chunks=int(sum(deleted)))
        if any(deleted):
            log.warning("remote tier %s: %d chunk(s) lost a layer (evicted, or unusable); no longer "
                        "held", self.name, int(sum(deleted)))

    def submit_get(self, keys: Sequence[Any], whole: bool = False) -> _Pending:
        """Start fetching `keys` on a reader thread; returns at once. whole: the chunks were
        found whole just now, so a missing value means one lost a layer (its marker goes)."""
        pairs = [self._check_key(k) for k in keys]
        if not pairs:
            return _Pending(ready=[])
        if not self._reachable():
            self._count(misses=len(pairs))
            return _Pending(ready=[None] * len(pairs))
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, pairs, whole))
        return _Pending(future=future)

    def wait(self, pending: _Pending) -> list[torch.Tensor | None]:
        if pending.future is None:
            return list(pending.ready or [])
        return pending.future.result()

    def _read_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, pairs, whole = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._fetch(pairs, whole))
            except Exception as exc:  # noqa: BLE001 - passed to the waiter, never lost
                future.set_exception(exc)

    def _fetch(self, pairs: list[tuple[bytes, int]], whole: bool) -> list[torch.Tensor | None]:
        misses = [None] * len(pairs)
        if not self._reachable():
            self._count(misses=len(pairs))
            return misses
        rkeys = [layer_key(h, layer) for h, layer in pairs]
        try:
            client = self._client
            t0 = time.perf_counter()
            # One round trip: a cluster's client sends one MGET per slot, to every node at
            # once, and puts the answers back in order.
            values = client.mget_nonatomic(rkeys) if self.cluster else client.mget(rkeys)
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, "get")
            self._count(misses=len(pairs))
            return misses
        self._timed(time.perf_counter() - t0, sum(len(v) for v in values if v))
        self._ok()
        out: list[torch.Tensor | None] = []
        bad: list[bytes] = []
        lost: list[bytes] = []
        hits = served = 0
        for (h, layer), rk, value in zip(pairs, rkeys, values):
            if value is None:
                if whole:
                    lost.append(h)
                out.append(None)
                continue
            got = decode_value(value, self.namespace, h, layer, self.secret)
            if isinstance(got, str):
                log.warning("remote tier %s: value %s is unusable (%s); deleting it",
                            self.name, rk.decode(), got)
                bad.append(rk)
                lost.append(h)     # the chunk is no longer whole
                out.append(None)
                continue
            hits += 1
            served += nbytes(got)
            out.append(got)
        self._count(hits=hits, misses=len(pairs) - hits, bytes_served=served,
                    corrupt_values=len(bad))
        if bad:
            try:
                pipe = self._client.pipeline(transaction=False)
                for rk in bad:
                    pipe.delete(rk)
                pipe.execute()
            except (redis.exceptions.RedisError, OSError) as exc:
                self._failed(exc, "delete corrupt value")
        if lost:
            self._unmark(list(dict.fromkeys(lost)))
        return out

    # ---- writes -------------------------------------------------------------------------

    def put(self, key: Any, tensor: torch.Tensor, crc: int | None = None) -> bool:
        """Write one layer of one chunk now; False when refused (server full, tier down)."""
        h, layer = self._check_key(key)
        if crc is not None and payload_crc(tensor) != int(crc) & 0xFFFFFFFF:
            # The bytes changed on their way here: never publish them under a fresh tag.
            self._count(refused_puts=1)
            return False
        value = encode_value(tensor, self.namespace, h, layer, self.secret)
        if not self._reachable():
            self._count(dropped_writes=1)
            return False
        try:
            self._client.set(layer_key(h, layer), value, ex=self.ttl_s)
        except redis.exceptions.OutOfMemoryError:
            self._count(refused_puts=1)
            self._ok()
            return False
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, "put")
            return False
        self._ok()
        self._count(bytes_in=len(value) - HEADER_SIZE)
        return True

    def publish(self, hashes: Sequence[bytes], first_chunk: int,
                kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Queue chunks first_chunk.. of every layer for the writer; returns chunks queued.

        kv[layer] = (K, V), each (kv_heads, n_tokens, head_dim) holding exactly the tokens of
        chunks [first_chunk, first_chunk + n_tokens // C). Never blocks on the network: a
        chunk that finds the queue full (or the tier down) is dropped and counted.
        """
        ns = self.namespace
        if len(kv) != ns.n_layers:
            raise ValueError(f"publish needs (K, V) for all {ns.n_layers} layers, got {len(kv)}")
        n_tokens = None
        for k, v in kv:
            for t in (k, v):
                if t.dim() != 3 or t.shape[0] != ns.n_kv_heads or t.shape[2] != ns.head_dim \
                        or t.dtype != ns.torch_dtype:
                    raise ValueError(f"publish: K and V must be {ns.dtype} "
                                     f"({ns.n_kv_heads}, n_tokens, {ns.head_dim}); got "
                                     f"{t.dtype} {tuple(t.shape)}")
            if n_tokens is None:
                n_tokens = k.shape[1]
            if k.shape[1] != n_tokens or v.shape[1] != n_tokens:
                raise ValueError("publish: every layer's K and V must hold the same tokens")
        c = ns.chunk_size
        if n_tokens % c:
            raise ValueError(f"publish: n_tokens={n_tokens} is not a whole number of "
                             f"chunks of {c}")
        n = n_tokens // c
        if first_chunk < 0 or first_chunk + n > len(hashes):
            raise ValueError(f"publish: chunks [{first_chunk}, {first_chunk + n}) are not all "
                             f"in the {len(hashes)} hashes given")
        chunk_hash = [self._check_hash(hashes[first_chunk + j]) for j in range(n)]
        if not self._reachable():
            self._count(dropped_writes=n)
            return 0
        queued = 0
        for j in range(n):
            with self._cv:
                room = len(self._queue) < self.queue_chunks and not self._stop
            if not room:  # checked first so a dropped chunk costs no copy
                self._count(dropped_writes=1)
                continue
            sl = slice(j * c, (j + 1) * c)
            # (layers, 2, kv_heads, C, head_dim): a copy, so the caller may reuse its buffers.
            block = torch.stack([torch.stack((k[:, sl], v[:, sl])) for k, v in kv])
            if block.device.type != "cpu":
                block = block.cpu()
            with self._cv:
                if len(self._queue) < self.queue_chunks and not self._stop:
                    self._queue.append((chunk_hash[j], block))
                    self._cv.notify()
                    queued += 1
                    continue
            self._count(dropped_writes=1)
        return queued

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                h, block = self._queue.popleft()
                self._writing = True
            try:
                self._write_chunk(h, block)
            except Exception:  # a bug here must not kill the writer
                log.exception("remote tier %s: writing a chunk failed", self.name)
                self._count(dropped_writes=1)
            finally:
                with self._cv:
                    self._writing = False
                    self._cv.notify_all()

    def _write_chunk(self, h: bytes, block: torch.Tensor) -> None:
        """All layers in one pipeline, each expiring unless its chunk is completed; then, only
        if every layer landed, the layers made lasting (or given ttl_s) and the marker set."""
        if not self._reachable():
            self._count(dropped_writes=1)
            return
        values = [encode_value(block[layer], self.namespace, h, layer, self.secret)
                  for layer in range(len(block))]
        keys = [layer_key(h, layer) for layer in range(len(block))]
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in zip(keys, values):
                pipe.set(key, value, ex=self.ttl_s or ORPHAN_TTL_S)
            results = pipe.execute(raise_on_error=False)
            refused = [r for r in results if isinstance(r, Exception)]
            if not refused:
                pipe = self._client.pipeline(transaction=False)
                if self.ttl_s is None:
                    for key in keys:
                        pipe.persist(key)
                pipe.set(marker_key(h), b"1", ex=self.ttl_s)
                done = pipe.execute(raise_on_error=False)
                refused = [r for r in done if isinstance(r, Exception)]
        except redis.exceptions.OutOfMemoryError:
            refused = [True]  # the marker itself was refused
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, "write")
            self._count(dropped_writes=1)
            return
        self._ok()
        if refused:
            if not all(isinstance(r, redis.exceptions.OutOfMemoryError) or r is True
                       for r in refused):
                self._failed(next(r for r in refused if isinstance(r, Exception)), "write")
            self._count(refused_puts=1)
            return
        self._count(chunks_written=1,
                    bytes_in=sum(len(v) - HEADER_SIZE for v in values))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued chunk is written (or dropped); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._writing,
                                     timeout=timeout_s)

    # ---- the rest of the protocol -------------------------------------------------------

    def invalidate(self, keys: Sequence[Any]) -> int:
        """Delete these layer values (a bare hash: every layer); returns values deleted."""
        layer_keys: list[bytes] = []
        markers: set[bytes] = set()
        for key in keys:
            if isinstance(key, bytes):
                h = self._check_hash(key)
                layer_keys += [layer_key(h, i) for i in range(self.namespace.n_layers)]
            else:
                h, layer = self._check_key(key)
                layer_keys.append(layer_key(h, layer))
            markers.add(marker_key(h))  # a chunk missing a layer is no longer whole
        if not layer_keys or not self._reachable():
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in (*layer_keys, *markers):   # one key a command: a cluster's keys
                pipe.delete(k)                  # of different chunks live on other slots
            deleted = pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, "invalidate")
            return 0
        self._ok()
        return int(sum(deleted[:len(layer_keys)]))

    def metrics(self) -> dict:
        with self._mu:
            out = dict(self._counters)
            out["down"] = int(self._down)
        with self._cv:
            out["queued"] = len(self._queue) + int(self._writing)  # chunks not yet written
        return out

    def close(self) -> None:
        """Stop the writer (after a bounded drain) and the readers; close the connections."""
        if self._closed:
            return
        self.flush(self.close_wait_s)
        with self._cv:
            left = len(self._queue)
            self._queue.clear()
            self._stop = True
            self._cv.notify_all()
        if left:
            self._count(dropped_writes=left)
        self._closed = True
        for _ in self._readers:
            self._jobs.put(None)
        self._writer.join(self.close_wait_s)
        for t in self._readers:
            t.join(self.close_wait_s)
        # A get submitted while closing may sit behind the stop signals: answer it with misses.
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job[0].set_running_or_notify_cancel():  # (future, pairs, whole)
                job[0].set_result([None] * len(job[1]))
        if self._pool is not None:
            self._pool.disconnect()
        if self._cluster_client is not None:
            self._cluster_client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
