"""A remote tier on Redis/Valkey: one pool of prefix KV shared by several serving processes.

Chunks are named by content, not by a process's node ids: the key of chunk i is a chained
hash over the prompt's token ids up to the end of chunk i, seeded with everything that fixes
the KV layout (model, shape, dtype, chunk size, LAYOUT_VERSION). Any process serving the same
model and token prefix therefore computes the same keys and can read what another published.

One Redis value holds one chunk of one layer, K and V stacked as (2, kv_heads, C, head_dim),
behind a header (magic, version, CRC-32, dtype, shape) that is checked on every read: a bad
value is a miss and is deleted. After all layers of a chunk are written a small completion
marker is set, so "is this prefix held?" costs one key per chunk.

The tier degrades, never fails: a Redis error or timeout marks it down for retry_after_s, and
while down every call answers misses at once without touching the network. Writes go through
a bounded queue to a writer thread; a full queue drops the chunk (counted), never the caller.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import queue
import struct
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any, Self

import numpy as np
import redis
import redis.backoff
import redis.exceptions
import redis.retry
import torch

from ..errors import UserError
from .base import nbytes, payload_crc

log = logging.getLogger("impress_flexgen.tiers.remote")

# Bump when the value layout or the key derivation changes: old keys then simply miss.
LAYOUT_VERSION = 1
DIGEST_SIZE = 16
KEY_PREFIX = b"ifkv:"

_DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "float16": (1, torch.float16),
    "bfloat16": (2, torch.bfloat16),
    "float32": (3, torch.float32),
}
# magic, layout version, dtype code, reserved, CRC-32 of the payload, 4-D shape
_HEADER = struct.Struct("<4sBBHI4I")
_MAGIC = b"IFKV"
_SCHEMES = ("redis", "rediss", "unix")
_COUNTERS = ("hits", "misses", "bytes_in", "bytes_served", "corrupt_values", "errors",
             "dropped_writes", "refused_puts", "chunks_written", "down_events")


@dataclasses.dataclass(frozen=True)
class RemoteNamespace:
    """Everything that fixes the bytes of a chunk's KV; two processes share keys iff equal."""
    model: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # "float16" | "bfloat16" | "float32"
    chunk_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise UserError("remote namespace: model must be a non-empty name")
        for field in ("n_layers", "n_kv_heads", "head_dim", "chunk_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"remote namespace: {field} must be a positive integer, "
                                f"got {value!r}")
        if self.dtype not in _DTYPES:
            raise UserError(f"remote namespace: dtype {self.dtype!r} is not supported; "
                            f"expected one of {sorted(_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][1]

    @property
    def value_shape(self) -> tuple[int, int, int, int]:
        """Shape of one stored value: K and V of one chunk of one layer."""
        return (2, self.n_kv_heads, self.chunk_size, self.head_dim)

    def seed(self) -> bytes:
        """h_0 of the chain. JSON of a list keeps the encoding unambiguous for any model name."""
        fields = [LAYOUT_VERSION, self.model, self.n_layers, self.n_kv_heads, self.head_dim,
                  self.dtype, self.chunk_size]
        encoded = json.dumps(fields, separators=(",", ":")).encode()
        return hashlib.blake2b(encoded, digest_size=DIGEST_SIZE).digest()


def chunk_hashes(namespace: RemoteNamespace, tokens: Any) -> list[bytes]:
    """One digest per whole chunk of `tokens`: h_{i+1} = blake2b(h_i || int32 tokens of chunk i).

    The digest of chunk i thus names its KV given every token before it. A partial tail chunk
    has no digest (its KV is never shared).
    """
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"tokens must be a 1-D sequence of integer ids, got shape "
                         f"{ids.shape} of {ids.dtype}")
    info = np.iinfo(np.int32)
    if ids.size and (ids.min() < info.min or ids.max() > info.max):
        raise ValueError("token ids must fit in int32")
    # Little-endian explicitly: keys must agree across machines.
    raw = ids.astype("<i4", copy=False).tobytes()
    c = namespace.chunk_size
    step = 4 * c
    out: list[bytes] = []
    h = namespace.seed()
    for i in range(ids.size // c):
        m = hashlib.blake2b(h, digest_size=DIGEST_SIZE)
        m.update(raw[i * step:(i + 1) * step])
        h = m.digest()
        out.append(h)
    return out


def layer_key(chunk_hash: bytes, layer: int) -> bytes:
    """Redis key of one layer of one chunk."""
    return KEY_PREFIX + chunk_hash.hex().encode() + b":" + str(layer).encode()


def marker_key(chunk_hash: bytes) -> bytes:
    """Redis key set once every layer of the chunk has been written."""
    return KEY_PREFIX + chunk_hash.hex().encode() + b":done"


def encode_value(tensor: torch.Tensor, namespace: RemoteNamespace, crc: int | None = None) -> bytes:
    """Header + payload bytes of one (2, kv_heads, C, head_dim) tensor."""
    if tuple(tensor.shape) != namespace.value_shape or tensor.dtype != namespace.torch_dtype:
        raise ValueError(f"remote tier stores {namespace.dtype} tensors of shape "
                         f"{namespace.value_shape}; got {tensor.dtype} {tuple(tensor.shape)}")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # A given crc is the one the bytes had at their source: keeping it (not recomputing) lets
    # a reader catch a copy damaged on the way here.
    crc = payload_crc(t) if crc is None else int(crc) & 0xFFFFFFFF
    header = _HEADER.pack(_MAGIC, LAYOUT_VERSION, _DTYPES[namespace.dtype][0], 0, crc,
                          *namespace.value_shape)
    return b"".join((header, t.reshape(-1).view(torch.uint8).numpy()))


def decode_value(value: bytes, namespace: RemoteNamespace) -> torch.Tensor | str:
    """The tensor in `value`, or the reason it is unusable (a str)."""
    if len(value) < _HEADER.size:
        return "truncated header"
    magic, version, code, _, crc, *shape = _HEADER.unpack_from(value)
    if magic != _MAGIC:
        return "bad magic"
    if version != LAYOUT_VERSION:
        return f"layout version {version}"
    if code != _DTYPES[namespace.dtype][0]:
        return f"dtype code {code}"
    if tuple(shape) != namespace.value_shape:
        return f"shape {tuple(shape)}"
    dtype = namespace.torch_dtype
    expected = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if len(value) - _HEADER.size != expected:
        return f"payload of {len(value) - _HEADER.size} bytes, expected {expected}"
    # One copy into a writable buffer: the caller owns the tensor it gets.
    buf = bytearray(memoryview(value)[_HEADER.size:])
    tensor = torch.frombuffer(buf, dtype=dtype).view(*shape)
    if payload_crc(tensor) != crc:
        return "CRC mismatch"
    return tensor


def validate_url(url: str) -> None:
    if not isinstance(url, str) or not url:
        raise UserError("remote tier: url must be like redis://HOST:PORT/DB")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise UserError(f"remote tier: url {url!r} must start with one of "
                        f"{', '.join(s + '://' for s in _SCHEMES)} (e.g. redis://127.0.0.1:6379/0)")
    if parts.scheme == "unix":
        if not parts.path:
            raise UserError(f"remote tier: url {url!r} names no socket path")
        return
    if not parts.hostname:
        raise UserError(f"remote tier: url {url!r} names no host (e.g. redis://127.0.0.1:6379/0)")
    try:
        _ = parts.port  # raises on a non-numeric or out-of-range port
    except ValueError:
        raise UserError(f"remote tier: url {url!r} has a bad port; expected 1..65535") from None
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise UserError(f"remote tier: url {url!r} has a bad database {db!r}; expected a number")


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
                 ttl_s: int | None = None, name: str = "remote") -> None:
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
        self.name = name
        self.url = url
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.retry_after_s = float(retry_after_s)
        self.queue_chunks = queue_chunks
        self.ttl_s = ttl_s
        try:
            # No retries inside redis-py: one failure marks the tier down, so no request
            # waits longer than one timeout on a dead server.
            self._pool = redis.ConnectionPool.from_url(
                url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
        except ValueError as exc:
            raise UserError(f"remote tier: bad url {url!r}: {exc}") from None
        self._client = redis.Redis(connection_pool=self._pool)

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
            log.info("remote tier %s at %s is back", self.name, self.url)

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
                        "before retrying", self.name, self.url, what, exc, self.retry_after_s)
        elif isinstance(exc, redis.exceptions.ResponseError):
            log.warning("remote tier %s: %s refused: %s", self.name, what, exc)

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
            pipe = self._client.pipeline(transaction=False)
            for k in rkeys:
                pipe.exists(k)
            found = pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, what)
            return 0
        self._ok()
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def contains(self, key: Any) -> bool:
        return self._leading([self._exists_key(key)], "contains") == 1

    def batch_exists(self, keys: Sequence[Any]) -> int:
        """Leading run of keys held; a bare chunk hash tests its completion marker."""
        return self._leading([self._exists_key(k) for k in keys], "batch_exists")

    def batch_exists_chunks(self, hashes: Sequence[bytes]) -> int:
        """Leading run of chunks whose every layer was written (one key per chunk)."""
        return self._leading([marker_key(self._check_hash(h)) for h in hashes],
                             "batch_exists_chunks")

    def submit_get(self, keys: Sequence[Any]) -> _Pending:
        """Start fetching `keys` on a reader thread; returns at once."""
        pairs = [self._check_key(k) for k in keys]
        if not pairs:
            return _Pending(ready=[])
        if not self._reachable():
            self._count(misses=len(pairs))
            return _Pending(ready=[None] * len(pairs))
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, pairs))
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
            future, pairs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._fetch(pairs))
            except Exception as exc:  # noqa: BLE001 - passed to the waiter, never lost
                future.set_exception(exc)

    def _fetch(self, pairs: list[tuple[bytes, int]]) -> list[torch.Tensor | None]:
        misses = [None] * len(pairs)
        if not self._reachable():
            self._count(misses=len(pairs))
            return misses
        rkeys = [layer_key(h, layer) for h, layer in pairs]
        try:
            values = self._client.mget(rkeys)
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, "get")
            self._count(misses=len(pairs))
            return misses
        self._ok()
        out: list[torch.Tensor | None] = []
        bad: list[bytes] = []
        hits = served = 0
        for (h, _), rk, value in zip(pairs, rkeys, values):
            if value is None:
                out.append(None)
                continue
            got = decode_value(value, self.namespace)
            if isinstance(got, str):
                log.warning("remote tier %s: value %s is unusable (%s); deleting it",
                            self.name, rk.decode(), got)
                bad += [rk, marker_key(h)]  # the chunk is no longer whole
                out.append(None)
                continue
            hits += 1
            served += nbytes(got)
            out.append(got)
        self._count(hits=hits, misses=len(pairs) - hits, bytes_served=served,
                    corrupt_values=len(bad) // 2)
        if bad:
            try:
                self._client.delete(*bad)
            except (redis.exceptions.RedisError, OSError) as exc:
                self._failed(exc, "delete corrupt value")
        return out

    # ---- writes -------------------------------------------------------------------------

    def put(self, key: Any, tensor: torch.Tensor, crc: int | None = None) -> bool:
        """Write one layer of one chunk now; False when refused (server full, tier down)."""
        h, layer = self._check_key(key)
        value = encode_value(tensor, self.namespace, crc)
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
        self._count(bytes_in=len(value) - _HEADER.size)
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
        """All layers in one pipeline, then the completion marker only if every layer landed."""
        if not self._reachable():
            self._count(dropped_writes=1)
            return
        values = [encode_value(block[layer], self.namespace) for layer in range(len(block))]
        try:
            pipe = self._client.pipeline(transaction=False)
            for layer, value in enumerate(values):
                pipe.set(layer_key(h, layer), value, ex=self.ttl_s)
            results = pipe.execute(raise_on_error=False)
            refused = [r for r in results if isinstance(r, Exception)]
            if not refused:
                self._client.set(marker_key(h), b"1", ex=self.ttl_s)
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
                    bytes_in=sum(len(v) - _HEADER.size for v in values))

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
            for k in layer_keys:
                pipe.delete(k)
            pipe.delete(*markers)
            deleted = pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc, "invalidate")
            return 0
        self._ok()
        return int(sum(deleted[:-1]))

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
            if job is not None and job[0].set_running_or_notify_cancel():
                job[0].set_result([None] * len(job[1]))
        self._pool.disconnect()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
