"""The pool's writer: chunks queued by publish() are written by one thread, each chunk's
layers expiring unless the chunk is completed, so a half-written chunk never outlives its
writer by long. A full queue drops the chunk (counted), never the caller.
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import redis
import redis.exceptions
import torch

from .. import cpu_threads
from ..errors import UserError
from .base import payload_crc
from disk_layout.format import encode_int4_chunks

from .remote_codec import HEADER_SIZE, encode_value, layer_key, marker_key
from .remote_link import PoolLink, log

# Layer values of a chunk whose marker is not written yet expire after this (no ttl_s).
ORPHAN_TTL_S = 600


class ChunkWriter(PoolLink):
    """A pool link that also writes: put() now, publish() through a bounded queue."""

    # How long close() lets the writer drain before dropping what is left.
    close_wait_s = 2.0

    def _start_writer(self, queue_chunks: int, ttl_s: int | None) -> None:
        if not isinstance(queue_chunks, int) or queue_chunks < 1:
            raise UserError(f"remote tier: queue_chunks must be a positive integer, "
                            f"got {queue_chunks!r}")
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s < 1):
            raise UserError(f"remote tier: ttl_s must be a positive number of seconds or None, "
                            f"got {ttl_s!r}")
        self.queue_chunks = queue_chunks
        self.ttl_s = ttl_s
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[bytes, torch.Tensor]] = collections.deque()
        self._writing = False
        self._stop = False
        self._writer = threading.Thread(target=self._write_loop, name=f"{self.name}-writer",
                                        daemon=True)
        self._writer.start()

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
                        or t.dtype != ns.value_dtype:
                    raise ValueError(f"publish: K and V must be {ns.value_dtype} "
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
            if ns.dtype == "int4":      # each layer's K and V as the store keeps them
                block = encode_int4_chunks(block.flatten(0, 1)).view(-1, *ns.value_shape)
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
        cpu_threads.helper_thread()
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


    def _stop_writer(self) -> None:
        """Let the writer drain (bounded by close_wait_s), then drop what is left and stop it."""
        self.flush(self.close_wait_s)
        with self._cv:
            left = len(self._queue)
            self._queue.clear()
            self._stop = True
            self._cv.notify_all()
        if left:
            self._count(dropped_writes=left)

    def _queued(self) -> int:
        with self._cv:
            return len(self._queue) + int(self._writing)  # chunks not yet written
