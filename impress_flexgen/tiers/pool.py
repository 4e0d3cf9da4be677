"""The shared pool: prefix KV that serving processes on other machines (or other stores)
computed, in a remote tier, for the prefix tokens right after what the local store holds.

    given = pool.open(prefix, matched, stats, tenant=t)   # chunks the pool holds past `matched`
    given.start(layer)                                    # fetch a layer ahead (background)
    k, v = given.kv(layer, device, dtype)                 # that layer's KV of those tokens
    pool.publish(prefix, start, kv, tenant=t)             # after a local insert: write-through
    pool.close()                                          # (also on the tier's close)

The pool is keyed by the content of the prompt (chained hashes of its chunks), not by the
local radix tree, so any process serving the same model (and tenant) finds the same chunks.
Only exactly computed KV is published: the namespace says so, and an exact reader asks for
nothing else. A prefix stored here before the pool held it (stored before the pool was
configured, or while it was down) is published when a request first loads it (pool_offer). A
chunk the pool lost between the check and the fetch (evicted, damaged, forged, server gone)
raises SharedMiss: the request is served again, the pool giving only what it still holds whole
and taking back the rest, never with a hole in its prefix.

Per request, the pool is weighed against computing: when its measured latency and bandwidth
predict loading its chunks slower than recomputing them, it is skipped (counted). While even
one round trip per layer is predicted slower, it is not asked at all, except for one probe
every PROBE_EVERY_S that measures it again.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from disk_layout.format import LEGACY_KV_FORMAT, decode_int4_chunks, kv_dtype_name

from .base import nbytes
from .pool_offer import StoredOffers
from .remote_codec import RemoteNamespace, chunk_hashes
from .remote_url import SECRET_ENV

if TYPE_CHECKING:   # the Redis client is imported only where a pool is configured
    from .remote import RedisTier
# Recompute speed assumed when the engine has no cost model (tokens per second): low, so
# that only a pool clearly slower than computing is skipped.
FALLBACK_TOKENS_PER_S = 1000.0
PROBE_EVERY_S = 10.0


class SharedMiss(Exception):
    """A chunk the pool said it had could not be fetched whole and checked."""


class SharedPrefix:
    def __init__(self, tier: RedisTier, namespace: RemoteNamespace, tier_name: str,
                 recompute_s: Callable[[int, int], float | None] | None = None,
                 store=None):
        self.tier = tier
        self.namespace = tier.namespace   # the tier's: keyed when it has a secret
        self.tier_name = tier_name
        self.chunk_size = namespace.chunk_size
        self.n_layers = namespace.n_layers
        # recompute_s(n, ctx): predicted seconds to compute n tokens after ctx (None: unknown).
        self.recompute_s = recompute_s
        self._mu = threading.Lock()
        self._namespaces: dict[str, RemoteNamespace] = {}
        self._quiet_until = 0.0     # no probe of a too slow pool before then
        # Chunks this store holds that the pool does not: published off the request's path.
        self.offers = StoredOffers(self, store) if store is not None else None
        if self.offers is not None:
            tier.before_close.append(self.offers.close)

    @property
    def keyed(self) -> bool:
        """Whether values carry an HMAC under a shared secret. Without one, anyone able to
        write to the pool can hand out KV with a valid CRC: it is then used for the request
        that reads it, never made local state (engine._store_new)."""
        return self.tier.secret is not None

    def namespace_for(self, tenant: str = "") -> RemoteNamespace:
        """The namespace of one tenant's entries (exact KV only)."""
        if not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string, got {tenant!r:.40}")
        with self._mu:
            ns = self._namespaces.get(tenant)
            if ns is None:
                ns = dataclasses.replace(self.tier.namespace, tenant=tenant, exact=True)
                self._namespaces[tenant] = ns
            return ns

    # -- the budget -----------------------------------------------------------------------
    def _compute_s(self, n_tokens: int, ctx: int) -> float:
        got = None
        if self.recompute_s is not None:
            try:
                got = self.recompute_s(n_tokens, ctx)
            except Exception:  # noqa: BLE001 - a cost model that cannot answer: assume
                got = None
        return float(got) if got is not None else n_tokens / FALLBACK_TOKENS_PER_S

    def worth_loading(self, n_chunks: int, ctx: int) -> bool:
        """Whether reading n_chunks from the pool is predicted faster than computing them."""
        return self.tier.load_estimate_s(n_chunks) <= \
            self._compute_s(n_chunks * self.chunk_size, ctx)

    def _skip(self) -> None:
        self.tier.count_skipped()

    # -- reads ----------------------------------------------------------------------------
    def open(self, prefix, matched: int, stats, tenant: str = "") -> "GivenKV | None":
        """The run of whole chunks of `prefix` after token `matched` that the pool holds and
        is worth reading (None: none). `matched` is chunk-aligned (the local radix match)."""
        hashes = chunk_hashes(self.namespace_for(tenant), prefix)
        first = matched // self.chunk_size
        now = time.monotonic()
        if first and self.offers is not None and now >= self._quiet_until \
                and self.tier.reachable():
            # The matched chunks may have been stored before the pool held them.
            self.offers.offer(prefix, hashes[:first], tenant)
        if first >= len(hashes):
            return None
        # Not even one round trip per layer pays for the whole rest of the prefix: do not
        # ask (but measure again now and then).
        upper = self.n_layers * self.tier.latency_s()
        if upper > self._compute_s((len(hashes) - first) * self.chunk_size, matched):
            if now < self._quiet_until:
                self._skip()
                return None
            self._quiet_until = now + PROBE_EVERY_S
        held = self.tier.batch_exists_chunks(hashes[first:])
        if held == 0:
            return None
        if not self.worth_loading(held, matched):
            self._quiet_until = now + PROBE_EVERY_S
            self._skip()
            return None
        stats.shared_tokens = held * self.chunk_size
        given = GivenKV(self, hashes[first:first + held], stats)
        given.start(0)
        return given

    # -- writes ---------------------------------------------------------------------------
    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until offered stored chunks are queued and every queued chunk is written."""
        deadline = time.monotonic() + timeout_s
        if self.offers is not None and not self.offers.flush(timeout_s):
            return False
        return self.tier.flush(max(deadline - time.monotonic(), 0.0))

    def close(self) -> None:
        """Stop publishing stored prefixes, then close the tier (its writer drains first)."""
        self.tier.close()

    def publish(self, prefix, start: int, kv, tenant: str = "") -> int:
        """Queue the whole chunks of tokens [start, ...) for the pool; kv[layer] = (K, V) of
        those tokens, (kv_heads, n, head_dim), computed exactly (over the whole prefix).
        Returns chunks queued."""
        c = self.chunk_size
        n = kv[0][0].shape[1] // c * c if kv else 0
        if n == 0 or start % c:
            return 0
        hashes = chunk_hashes(self.namespace_for(tenant), prefix)
        dtype = self.namespace.value_dtype
        return self.tier.publish(hashes, start // c,
                                 [(k[:, :n].to(dtype), v[:, :n].to(dtype)) for k, v in kv])


class GivenKV:
    """One request's KV from the pool: every layer of `hashes`' chunks, fetched a layer
    ahead of the compute that needs it (each layer's chunks in one round trip)."""

    def __init__(self, pool: SharedPrefix, hashes: list[bytes], stats):
        self.pool = pool
        self.hashes = hashes
        self.n_tokens = len(hashes) * pool.chunk_size
        self.stats = stats
        self.pending: dict[int, object] = {}

    def start(self, layer: int) -> None:
        if layer < self.pool.n_layers and layer not in self.pending:
            self.pending[layer] = self.pool.tier.submit_get(
                [(h, layer) for h in self.hashes], whole=True)

    def kv(self, layer: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of the given tokens at `layer`, each (kv_heads, n_tokens, head_dim)."""
        self.start(layer)
        self.start(layer + 1)
        chunks = self.pool.tier.wait(self.pending.pop(layer))
        if any(c is None for c in chunks):
            raise SharedMiss(f"layer {layer}: {sum(c is None for c in chunks)} of "
                             f"{len(chunks)} shared chunks could not be fetched and checked")
        self.stats.bytes_read[self.pool.tier_name] += sum(nbytes(c) for c in chunks)
        ns = self.pool.namespace
        if ns.dtype == "int4":         # (n, 2, bytes) -> (n, 2, kv_heads, C, head_dim)
            packed = torch.stack(chunks).view(-1, ns.value_shape[-1])
            values = decode_int4_chunks(packed, ns.kv_values).view(len(chunks), 2, *ns.kv_values)
            chunks = list(values.unbind(0))
        both = torch.cat(chunks, dim=2).to(device, dtype)     # (2, kv_heads, n, head_dim)
        return both[0], both[1]

    def close(self) -> None:
        """Wait for fetches nobody will use."""
        for pending in self.pending.values():
            try:
                self.pool.tier.wait(pending)
            except Exception:  # noqa: BLE001 - nobody asked for these chunks
                pass
        self.pending.clear()


def shared_pool(url: str, store, dtype: torch.dtype, *, secret: str | bytes | None = None,
                ttl_s: int | None = None,
                recompute_s: Callable[[int, int], float | None] | None = None) -> SharedPrefix:
    """The pool at `url` for the model (its fingerprint, when the shape has one) and chunk
    size of `store` (KV kept as it is stored on disk, in the store's KV format). `secret`
    (default: the IMPRESS_REMOTE_SECRET environment variable) makes every value carry an HMAC."""
    from ..errors import require
    from .chain import REMOTE

    require("redis", "the remote tier", "redis==8.1.0")
    from .remote import RedisTier

    shape = store.shape
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    namespace = RemoteNamespace(shape.name, shape.n_layers, shape.n_kv_heads, shape.head_dim,
                                kv_dtype_name(getattr(shape, "kv_format", LEGACY_KV_FORMAT)),
                                store.config.chunk_size,
                                fingerprint=str(getattr(shape, "fingerprint", "") or ""))
    tier = RedisTier(url, namespace, name=REMOTE, secret=secret, ttl_s=ttl_s)
    return SharedPrefix(tier, tier.namespace, REMOTE, recompute_s=recompute_s, store=store)
