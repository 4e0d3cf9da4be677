"""Continuous batching: requests join a running batch between decode steps and leave when done.

    sched = Scheduler(engine, SchedulerConfig(max_batch_size=8))
    sched.add(Work(request, on_done))
    while sched.busy:
        sched.step()

Each step first admits waiting requests and prefills them together in one pass
(batch_prefill): every layer's projections and MLP run once over all their new tokens,
while each request keeps everything a request served alone does (its radix match, plan,
per-layer selection by its policy, tier and pool reads, pins, its own causal attention).
The pass gives each its first token; they then join the decode batch. A request that
would reuse a new prefix another admitted request is about to store waits for a second
pass, after that one, and loads it; so does one past the pass's token budget
(SchedulerConfig.pass_tokens). Then one decode step advances every running request
by one token, with the weights of each layer used once for the whole batch
(batch_runner). A request leaves the batch when it is done: its last token, a stop token,
or its on_token said stop (cancellation, deadline, stop string); the others go on
undisturbed.

Admission is bounded by the batch size, by a per-step token budget (decode tokens of the
running requests plus the prompt tokens prefilled in that step; one request is always
admitted into an empty step, so a long prompt is never starved) and by memory: the decode
context a request may grow to (prompt plus new tokens, every layer's K and V) must fit the
KV budget beside the running requests' own, or it waits.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Callable

import torch

from .engine.batch_prefill import start_together
from .errors import UserError

log = logging.getLogger("impress_flexgen.scheduler")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 8          # requests decoded together
    max_batch_tokens: int = 8192     # tokens per step: decode tokens + prefilled prompts
    kv_budget_bytes: int | None = None  # decode contexts of running requests (None: half
    #                                     the compute device's free memory at start)
    pass_tokens: int | None = None    # new tokens prefilled in one pass (None: max_batch_tokens)

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise UserError("--max-batch-size must be at least 1")
        if self.max_batch_tokens < 1:
            raise UserError("--max-batch-tokens must be at least 1")


@dataclasses.dataclass
class Work:
    """A request for the scheduler; `on_done(response, error)` is called once, with one
    of them None, on the scheduler's thread."""

    request: object                                      # engine.Request
    on_done: Callable[[object, BaseException | None], None]
    query_logits: bool = False
    seq: object = None                                   # its Sequence once prefilled
    kv_bytes: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prefix) + len(self.request.query)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class Scheduler:
    def __init__(self, engine, config: SchedulerConfig = SchedulerConfig()):
        self.engine = engine
        self.config = config
        self.waiting: collections.deque[Work] = collections.deque()
        self.running: list[Work] = []
        m = engine.math
        elsize = torch.finfo(engine.dtype).bits // 8 if engine.device.type != "cpu" else 4
        self.kv_bytes_per_token = 2 * m.n_layers * m.n_kv_head * m.head_dim * elsize
        self.kv_budget = config.kv_budget_bytes if config.kv_budget_bytes is not None \
            else free_memory_bytes(engine.device) // 2
        # Sharing a pass saves its fixed per-layer costs but makes every request in it wait
        # for all of its tokens. Side by side on a quiet 2-core CPU (bench_serve --quick),
        # a pass bounded only by the step's token budget beat one of 256 tokens in
        # throughput and P99 TTFT with shared and with distinct prefixes.
        self.pass_tokens = config.pass_tokens if config.pass_tokens is not None else \
            config.max_batch_tokens
        self.last_batch = 0            # requests in the last decode step
        self.steps = 0

    # -- queues ------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def room(self) -> int:
        """How many more requests may wait to be admitted (keeps the caller's queue, not
        this one, holding the backlog)."""
        return max(0, self.config.max_batch_size - len(self.running) - len(self.waiting))

    def add(self, work: Work) -> None:
        work.kv_bytes = (work.prompt_tokens + work.request.max_new_tokens) * \
            self.kv_bytes_per_token
        self.waiting.append(work)

    def kv_in_use(self) -> int:
        return sum(w.kv_bytes for w in self.running)

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Admit what fits (prefilled together in one pass), then one decode step for all
        running requests."""
        budget = self.config.max_batch_tokens - len(self.running)
        admitted: list[Work] = []
        while self.waiting and len(self.running) + len(admitted) < self.config.max_batch_size:
            work = self.waiting[0]
            in_use = self.kv_in_use() + sum(w.kv_bytes for w in admitted)
            if (self.running or admitted) and work.kv_bytes + in_use > self.kv_budget:
                break            # waits for memory; a lone request is served as before
            if admitted and work.prompt_tokens > budget:
                break            # the step's token budget is spent: the next step takes it
            self.waiting.popleft()
            budget -= work.prompt_tokens
            admitted.append(work)
        if admitted:
            self._prefill(admitted)
        batch = [w for w in self.running if not w.seq.done]
        if batch:
            self.last_batch = len(batch)
            self.steps += 1
            try:
                self.engine.step([w.seq for w in batch])
            except Exception as exc:  # noqa: BLE001 - the batch fails together, the loop goes on
                log.exception("decode step failed")
                for w in batch:
                    self._end(w, None, exc)
                return
        for w in [w for w in self.running if w.seq.done]:
            self._finish(w)

    def _prefill(self, works: list[Work]) -> None:
        """Prefill the admitted requests in one pass (batch_prefill); a request that failed
        is answered now, the others join the running batch."""
        got = start_together(self.engine, [(w.request, w.query_logits) for w in works],
                             self.pass_tokens)
        for work, seq in zip(works, got):
            if isinstance(seq, BaseException):
                work.on_done(None, seq)
                continue
            work.seq = seq
            self.running.append(work)

    def _finish(self, work: Work) -> None:
        try:
            response = self.engine.finish(work.seq)
        except Exception as exc:  # noqa: BLE001
            self._end(work, None, exc)
            return
        self._end(work, response, None)

    def _end(self, work: Work, response, error) -> None:
        if work in self.running:
            self.running.remove(work)
        if response is None and work.seq is not None and work.seq.pages is not None:
            try:
                work.seq.pages.close()      # its selector's threads, when it failed mid-way
            except Exception:  # noqa: BLE001 - already failing; the error that counts is `error`
                log.debug("closing a failed request's pages", exc_info=True)
        work.seq = None
        work.on_done(response, error)

    def drain(self) -> None:
        """Serve everything waiting and running to the end."""
        while self.busy:
            self.step()


def serve_all(engine, requests, config: SchedulerConfig = SchedulerConfig(),
              query_logits: bool = False) -> list:
    """Serve `requests` together through a scheduler; their responses in order (an
    exception in place of a response that failed)."""
    out: list = [None] * len(requests)
    sched = Scheduler(engine, config)
    for i, req in enumerate(requests):
        def done(resp, err, i=i):
            out[i] = resp if err is None else err
        sched.add(Work(req, done, query_logits))
    t0 = time.perf_counter()
    sched.drain()
    log.debug("served %d requests in %.2f s", len(requests), time.perf_counter() - t0)
    return out
