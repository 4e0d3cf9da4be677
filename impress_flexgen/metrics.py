"""The service's Prometheus metrics, in a private registry (GET /metrics).

    metrics = ServiceMetrics(queue, scheduler, engine, store)
    metrics.count("rejected"); metrics.observe(completion.stats, 12, "stop")
    metrics.text()       # the exposition format
    drain = Drain(); drain.busy(); drain.left(); drain.retry_after_s(queued=16)

Histograms of time to first token, engine time to first token, request time, batch size and
time per output token; counters of requests by outcome, prompt tokens by where their KV came
from (store, shared pool, computed), generated tokens, KV bytes read per tier, plans; gauges
read at each scrape (queue, running, waiting, tier hit ratios, store size, fallback ratio,
and the shared pool's state when there is one).
"""
from __future__ import annotations

import collections
import math
import threading
import time

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
OUTCOMES = ("ok", "rejected", "invalid", "cancelled", "timeout", "error")
# The shared pool's counters exported as shared_pool_events{event=...}.
POOL_EVENTS = ("skipped_requests", "corrupt_values", "incomplete_chunks")
DRAIN_WINDOW_S = 30.0     # a 429's Retry-After is measured over the requests ending in it
MAX_RETRY_AFTER_S = 60    # OpenAI's client ignores a longer one, then retries at once


class Drain:
    """How fast the queue drains, measured: the requests that left the service (served,
    failed, cancelled, expired) in the last `window_s` seconds of the worker's busy time. A
    full queue's 429 asks a client to come back when the queue ahead of it will have
    drained at that rate, rather than all at once a second later."""

    def __init__(self, window_s: float = DRAIN_WINDOW_S, clock=time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._left: collections.deque = collections.deque()
        self._busy_since = clock()
        self._lock = threading.Lock()

    def busy(self) -> None:
        """The worker starts after being idle: the rate is measured from now on."""
        with self._lock:
            self._busy_since = self.clock()

    def left(self) -> None:
        """A request left the service."""
        with self._lock:
            self._left.append(self.clock())

    def retry_after_s(self, queued: int) -> int:
        """Whole seconds until `queued` requests have drained at the measured rate, in
        [1, MAX_RETRY_AFTER_S]. Before any request has left, at most one per the busy time
        so far: the wait grows with what was measured, never guessed short."""
        with self._lock:
            now = self.clock()
            since = max(now - self.window_s, self._busy_since)
            while self._left and self._left[0] < since:
                self._left.popleft()
            rate = max(len(self._left), 1) / max(now - since, 1e-3)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(queued / rate)))


def _ratio(counters: dict) -> float:
    """hits / (hits + misses) of a tier's counters (0 before any access)."""
    total = counters.get("hits", 0) + counters.get("misses", 0)
    return counters.get("hits", 0) / total if total else 0.0


class _Counters:
    """Running totals of `source`'s attributes as Prometheus counters: ROWS holds
    (metric name, help, attribute) for each."""

    ROWS: tuple[tuple[str, str, str], ...] = ()

    def __init__(self, source) -> None:
        self.source = source

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for name, doc, attribute in self.ROWS:
            yield CounterMetricFamily(name, doc, value=getattr(self.source, attribute))


class _WeightCounters(_Counters):
    """The runner's layer weights brought to the compute device since start, and the
    time its layers waited for them (engine.weight_stream)."""

    ROWS = (("impress_flexgen_weight_bytes_read", "Layer weight bytes brought to the compute "
             "device (from the disk or the CPU)", "bytes_read"),
            ("impress_flexgen_weight_wait_seconds", "Time the layers waited for their weights "
             "(what compute did not hide)", "wait_s"))


class _KVHomeCounters(_Counters):
    """The decode context read back from the disk since start (engine.kv_home: the cache
    percentages' disk share), and the time decode steps waited for it."""

    ROWS = (("impress_flexgen_decode_kv_disk_bytes_read", "Decode context bytes read back "
             "from the disk", "bytes_read"),
            ("impress_flexgen_decode_kv_disk_wait_seconds", "Time decode steps waited for "
             "their context from the disk", "wait_s"))


class ServiceMetrics:
    def __init__(self, queue, scheduler, engine, store) -> None:
        """`queue`: the service's queue (its length is read at each scrape); `scheduler`,
        `engine`, `store` (None: no store): read for the gauges and the pool's counters."""
        from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                                       disable_created_metrics)

        from .planner import PLAN_KINDS
        from .tiers import REMOTE

        self.engine, self.store = engine, store
        self._layers = [0, 0]          # prefix layers served from the store, of them fallen back
        self._fallbacks_seen = 0       # the engine's shared-pool fallbacks already counted
        disable_created_metrics()   # no *_created series: they only repeat the start time
        r = self.registry = CollectorRegistry()
        ns = "impress_flexgen"
        self.m_ttft = Histogram("ttft_seconds", "Arrival to first token, queueing included",
                                namespace=ns, registry=r, buckets=TTFT_BUCKETS)
        self.m_prefill = Histogram("engine_ttft_seconds",
                                   "Engine time to first token (match, load, compute)",
                                   namespace=ns, registry=r, buckets=TTFT_BUCKETS)
        self.m_latency = Histogram("request_seconds", "Arrival to last token", namespace=ns,
                                   registry=r, buckets=TTFT_BUCKETS)
        self.m_queue = Gauge("queue_length", "Requests waiting for the engine", namespace=ns,
                             registry=r)
        self.m_queue.set_function(queue.qsize)
        self.m_running = Gauge("requests_running", "Requests in the engine (prefilled, "
                               "decoding)", namespace=ns, registry=r)
        self.m_running.set_function(lambda: len(scheduler.running))
        self.m_waiting = Gauge("requests_waiting", "Requests waiting: queued, or taken for "
                               "the next step but not yet admitted", namespace=ns, registry=r)
        self.m_waiting.set_function(lambda: queue.qsize() + len(scheduler.waiting))
        self.m_batch = Histogram("batch_size", "Requests in each decode step", namespace=ns,
                                 registry=r, buckets=BATCH_BUCKETS)
        self.m_tpot = Histogram("time_per_output_token_seconds", "Per request, decode time "
                                "per generated token after the first", namespace=ns,
                                registry=r, buckets=TPOT_BUCKETS)
        self.m_requests = Counter("requests", "Requests by outcome", ["outcome"], namespace=ns,
                                  registry=r)
        for outcome in OUTCOMES:
            self.m_requests.labels(outcome)
        self.m_prompt = Counter("prompt_tokens", "Prompt tokens, by whether the store had "
                                "their KV (matched), the shared pool had it (shared), or they "
                                "were computed", ["source"], namespace=ns, registry=r)
        self.m_completion = Counter("completion_tokens", "Generated tokens", namespace=ns,
                                    registry=r)
        self.m_bytes = Counter("kv_bytes_read", "Prefix KV bytes read, by tier", ["tier"],
                               namespace=ns, registry=r)
        self.m_probe = Counter("probe_bytes_read", "Probe-key bytes read", namespace=ns,
                               registry=r)
        self.m_from_pass = Counter("kv_bytes_from_pass", "Prefix KV bytes a request was "
                                   "handed from a read another request of its prefill pass "
                                   "made (not read again; counted in kv_bytes_read once)",
                                   namespace=ns, registry=r)
        for tier in self.engine.tier_names:
            self.m_bytes.labels(tier)
        for source in ("matched", "shared", "computed"):
            self.m_prompt.labels(source)
        self.m_plans = Counter("plans", "Requests with a stored prefix, by how it was served "
                               "(load it, recompute it, or both)", ["plan"], namespace=ns,
                               registry=r)
        for plan in PLAN_KINDS:
            self.m_plans.labels(plan)
        self.m_hit = Gauge("tier_hit_ratio", "Chunk hits / accesses of a tier since start",
                           ["tier"], namespace=ns, registry=r)
        memory = self.store.tiers.cache.tier_names if self.store is not None and \
            self.store.tiers.cache is not None else ()
        for tier in memory:
            self.m_hit.labels(tier).set_function(lambda tier=tier: self._hit_ratio(tier))
        self.m_store = Gauge("store_bytes", "Bytes of the store's files on disk", namespace=ns,
                             registry=r)
        self.m_store.set_function(lambda: self.store.inspect().accounting.disk_bytes() if self.store else 0)
        self.m_nodes = Gauge("store_nodes", "Prefix nodes in the store", namespace=ns,
                             registry=r)
        self.m_nodes.set_function(lambda: len(self.store.inspect().state.tree) if self.store else 0)
        self.m_fallback = Gauge("fallback_ratio", "Layers of stored prefixes that fell back "
                                "to loading the whole prefix, of all such layers",
                                namespace=ns, registry=r)
        self.m_fallback.set_function(lambda: self._layers[1] / self._layers[0]
                                     if self._layers[0] else 0.0)
        if self.engine.shared is not None:
            pool = self.engine.shared.tier
            self.m_hit.labels(REMOTE).set_function(lambda: _ratio(pool.metrics()))
            self.m_down = Gauge("shared_pool_down", "1 while the shared pool does not answer "
                                "(requests are then served locally)", namespace=ns,
                                registry=r)
            self.m_down.set_function(lambda: pool.metrics()["down"])
            self.m_pool_fallbacks = Counter(
                "shared_pool_fallbacks", "Requests served again without the shared pool (a "
                "chunk it had could not be fetched whole)", namespace=ns, registry=r)
            self.m_pool_events = Counter(
                "shared_pool_events", "Shared pool: requests that skipped it as slower than "
                "computing, values refused by their checksum or HMAC, chunks found missing a "
                "layer", ["event"], namespace=ns, registry=r)
            self._pool_seen = dict.fromkeys(POOL_EVENTS, 0)

        stream = getattr(getattr(engine, "runner", None), "weights", None)
        if stream is not None:
            r.register(_WeightCounters(stream))
        home = getattr(getattr(engine, "runner", None), "kv_home", None)
        if home is not None:
            r.register(_KVHomeCounters(home))

    def _hit_ratio(self, tier: str) -> float:
        if self.store is None or self.store.tiers.cache is None:
            return 0.0
        return _ratio(self.store.tiers.cache.metrics[tier])

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def count(self, outcome: str) -> None:
        self.m_requests.labels(outcome).inc()

    def batch(self, size: int) -> None:
        """One decode step of `size` requests."""
        self.m_batch.observe(size)

    def observe(self, stats: dict, n_tokens: int, reason: str, decode_s_per_token=None) -> None:
        """A served request: its stats (Completion.stats), generated tokens, finish reason
        and, when it made more than one token, its decode time per token."""
        if decode_s_per_token is not None:
            self.m_tpot.observe(decode_s_per_token)
        self.count({"cancelled": "cancelled", "timeout": "timeout"}.get(reason, "ok"))
        self.m_ttft.observe(stats["ttft_s"])
        self.m_prefill.observe(stats["engine_ttft_s"])
        self.m_latency.observe(stats["total_s"])
        self.m_prompt.labels("matched").inc(stats["cached_tokens"] - stats["shared_tokens"])
        self.m_prompt.labels("shared").inc(stats["shared_tokens"])
        self.m_prompt.labels("computed").inc(stats["computed_tokens"])
        if stats["plan"] is not None:
            self.m_plans.labels(stats["plan"]).inc()
        if self.engine.shared is not None:
            fallbacks = self.engine.shared_fallbacks
            self.m_pool_fallbacks.inc(fallbacks - self._fallbacks_seen)
            self._fallbacks_seen = fallbacks
            pool = self.engine.shared.tier.metrics()
            for event in POOL_EVENTS:
                self.m_pool_events.labels(event).inc(pool[event] - self._pool_seen[event])
                self._pool_seen[event] = pool[event]
        self.m_completion.inc(n_tokens)
        for tier, n in stats["bytes_read"].items():
            self.m_bytes.labels(tier).inc(n)
        self.m_probe.inc(stats["probe_bytes"])
        self.m_from_pass.inc(stats.get("bytes_from_pass", 0))
        self._layers[0] += stats["layers"]
        self._layers[1] += stats["layers_fallback"]
