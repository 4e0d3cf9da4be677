"""A remote tier on Redis/Valkey (one server or a cluster): one pool of prefix KV shared by
several serving processes. This file is the tier's read protocol; its connection, health and
measured speed are in remote_link, its writer in remote_writer, keys and values in
remote_codec.

Chunks are named by content, and a value is only served when its tag proves it is the layer
of the chunk its key names. A chunk is held only while its completion marker AND every one
of its layers are there: a chunk that lost a layer (evicted) has its marker deleted
(counted) and is written again by the next process that computes it.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

import redis
import redis.exceptions
import torch

from .. import cpu_threads
from .base import nbytes
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
from .remote_link import COUNTERS, EWMA, READ_SIZE, log  # noqa: F401
from .remote_url import cluster_nodes, is_cluster, redact_url, validate_url  # noqa: F401
from .remote_writer import ORPHAN_TTL_S, ChunkWriter  # noqa: F401


class _Pending:
    """What submit_get returns: a future, or an answer known at once (tier down, no keys)."""
    __slots__ = ("future", "ready")

    def __init__(self, future: concurrent.futures.Future | None = None,
                 ready: list | None = None) -> None:
        self.future = future
        self.ready = ready


class RedisTier(ChunkWriter):
    """Remote tier; keys are (chunk_hash, layer), or a bare chunk_hash for a whole chunk."""

    # Readers serve submit_get; two let one fetch overlap another's decode.
    reader_threads = 2

    def __init__(self, url: str, namespace: RemoteNamespace, *, timeout_s: float = 0.5,
                 retry_after_s: float = 5.0, queue_chunks: int = 1024,
                 ttl_s: int | None = None, secret: bytes | str | None = None,
                 name: str = "remote") -> None:
        super().__init__(url, namespace, timeout_s=timeout_s, retry_after_s=retry_after_s,
                         secret=secret, name=name)
        self._start_writer(queue_chunks, ttl_s)
        # Stopped first on close: what reads elsewhere to write through this tier.
        self.before_close: list[Callable[[], None]] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._readers = [threading.Thread(target=self._read_loop, name=f"{name}-reader-{i}",
                                          daemon=True) for i in range(self.reader_threads)]
        for t in self._readers:
            t.start()

    # ---- keys ---------------------------------------------------------------------------

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
        """Leading run of chunks held whole (see chunks_whole)."""
        whole = self.chunks_whole(hashes)
        n = 0
        while n < len(whole) and whole[n]:
            n += 1
        return n

    def chunks_whole(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each chunk is held whole: the marker and every layer there (one EXISTS of
        one slot per chunk, all in one pipeline; all False while the tier is down). A marker
        whose chunk lost a layer is deleted and counted, so that the chunk is written again."""
        hashes = [self._check_hash(h) for h in hashes]
        if not hashes or not self._reachable():
            return [False] * len(hashes)
        n_layers = self.namespace.n_layers
        try:
            client = self._client      # (a cluster's first use maps its slots: not timed)
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(marker_key(h), *(layer_key(h, i) for i in range(n_layers)))
            found = pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, "chunks_whole")
            return [False] * len(hashes)
        self._timed(time.perf_counter() - t0)
        self._ok()
        # Some keys but not all: a marker over a lost layer (evicted, deleted), or a chunk
        # whose writer has not set its marker yet. Only the first is broken.
        partial = [h for h, f in zip(hashes, found) if f and f != n_layers + 1]
        broken = self._broken(partial) if partial else []
        if broken:
            self._unmark(broken)
        return [f == n_layers + 1 for f in found]

    def _broken(self, hashes: list[bytes]) -> list[bytes]:
        """Those of `hashes` marked complete yet missing a layer, asked again key by kind: a
        writer sets the marker only after every layer, so a chunk without one is in flight."""
        n_layers = self.namespace.n_layers
        try:
            pipe = self._client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(marker_key(h))
                pipe.exists(*(layer_key(h, i) for i in range(n_layers)))
            found = pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, "check incomplete chunks")
            return []
        return [h for h, marked, layers in zip(hashes, found[::2], found[1::2])
                if marked and layers < n_layers]

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
            log.warning("remote tier %s: %d chunk(s) lost a layer (evicted, or unusable); "
                        "no longer held", self.name, int(sum(deleted)))

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
        cpu_threads.helper_thread()
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
        out["queued"] = self._queued()
        return out

    def close(self) -> None:
        """Stop the writer (after a bounded drain) and the readers; close the connections."""
        if self._closed:
            return
        for stop in self.before_close:
            stop()
        self._stop_writer()
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
        self._disconnect()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
