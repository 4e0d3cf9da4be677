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

A scored prompt (prompt log-probabilities: echo with logprobs) is prefilled a piece at a
time instead (engine.scoring), one piece per step after the step's pass; a piece stops
between two layers when a request arrives (`arrived`, the owner's queue), so that request
waits about one layer, not the whole prompt, and the piece goes on in the next step after
that request's pass. The choices of one request (n) are one Work that shares that prefill,
each then decoding on its own. A request that is done after its first token is answered
right after its pass, before the step goes on.

Admission is bounded by the batch size (a Work counts its choices), by a per-step token
budget (decode tokens of the running requests plus the prompt tokens prefilled in that
step, a scored prompt's piece among them; one request is always admitted into an empty
step, so a long prompt is never starved) and by memory: the decode context a request may
grow to (prompt plus new tokens, every layer's K and V, for each choice) and the logits it
holds (one piece's rows of a scored prompt; every query row where all of them are kept)
must fit the budget beside the running requests' own, or it waits.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Callable

import torch

from .engine.batch_prefill import start_together
from .engine.scoring import PIECE_TOKENS
from .errors import UserError

log = logging.getLogger("impress_flexgen.scheduler")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 8          # requests decoded together
    max_batch_tokens: int = 8192     # tokens per step: decode tokens + prefilled prompts
    kv_budget_bytes: int | None = None  # decode contexts of running requests (None: half
    #                                     the compute device's free memory at start)
    pass_tokens: int | None = None    # new tokens prefilled in one pass (None: max_batch_tokens)
    score_piece_tokens: int = PIECE_TOKENS  # a scored prompt's tokens prefilled per step

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise UserError("--max-batch-size must be at least 1")
        if self.max_batch_tokens < 1:
            raise UserError("--max-batch-tokens must be at least 1")
        if self.score_piece_tokens < 1:
            raise UserError("--score-piece-tokens must be at least 1")


@dataclasses.dataclass
class Work:
    """A request for the scheduler; `on_done(response, error)` is called once, with one
    of them None, on the scheduler's thread."""

    request: object                                      # engine.Request
    on_done: Callable[[object, BaseException | None], None]
    query_logits: bool = False
    seq: object = None                                   # its Sequence once prefilled
    kv_bytes: int = 0
    # The other choices of a scored prompt (the same query): they share its prefill and
    # its scores, then each decodes as a Work of its own.
    choices: list = dataclasses.field(default_factory=list)
    scoring: object = None        # its engine.scoring.ScoredPrefill while in pieces

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prefix) + len(self.request.query)

    @property
    def width(self) -> int:
        """Decode slots it takes: one per choice."""
        return 1 + len(self.choices)

    @property
    def scores_prompt(self) -> bool:
        return self.request.prompt_logprobs is not None


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
        self.scoring: list[Work] = []    # scored prompts being prefilled, oldest first
        m = engine.math
        # float32 logits a query row holds while it is scored (or kept, with query_logits)
        self.logits_bytes_per_row = 4 * engine.rt.spec.config.vocab_size
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
        # Whether a request arrived that waits for this thread (the owner's queue): a
        # scored prompt's piece then stops between two layers, and the step ends.
        self.arrived: Callable[[], bool] | None = None
        self.last_batch = 0            # requests in the last decode step
        self.steps = 0

    # -- queues ------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.scoring)

    def _slots(self) -> int:
        """Decode slots taken or promised: running, being scored, admitted next."""
        return len(self.running) + sum(w.width for w in self.scoring)

    def room(self) -> int:
        """How many more requests may wait to be admitted (keeps the caller's queue, not
        this one, holding the backlog)."""
        return max(0, self.config.max_batch_size - self._slots() -
                   sum(w.width for w in self.waiting))

    def add(self, work: Work) -> None:
        context = (work.prompt_tokens + work.request.max_new_tokens) * self.kv_bytes_per_token
        rows = 0
        if work.scores_prompt:
            rows = min(self.config.score_piece_tokens, len(work.request.query))
        elif work.query_logits:
            rows = len(work.request.query)
        work.kv_bytes = context * work.width + rows * self.logits_bytes_per_row
        self.waiting.append(work)

    def kv_in_use(self) -> int:
        return sum(w.kv_bytes for w in self.running) + sum(w.kv_bytes for w in self.scoring)

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Admit what fits (prefilled together in one pass), one piece of the oldest scored
        prompt, then one decode step for all running requests."""
        budget = self.config.max_batch_tokens - len(self.running) - (
            self.scoring[0].scoring.next_piece if self.scoring else 0)
        admitted: list[Work] = []
        while self.waiting:
            work = self.waiting[0]
            taken = self._slots() + sum(w.width for w in admitted)
            others = bool(self.running or self.scoring or admitted)
            if others and taken + work.width > self.config.max_batch_size:
                break            # a lone request (or request of n choices) is still taken
            in_use = self.kv_in_use() + sum(w.kv_bytes for w in admitted)
            if others and work.kv_bytes + in_use > self.kv_budget:
                break            # waits for memory; a lone request is served as before
            tokens = min(self.config.score_piece_tokens, work.prompt_tokens) \
                if work.scores_prompt else work.prompt_tokens
            if admitted and tokens > budget:
                break            # the step's token budget is spent: the next step takes it
            self.waiting.popleft()
            budget -= tokens
            if work.scores_prompt:
                self._open_scoring(work)
            else:
                admitted.append(work)
        if admitted:
            self._prefill(admitted)
        self._score_piece()
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
        # Done at its first token: answered now, not after the rest of the step.
        for work in works:
            if work.seq is not None and work.seq.done:
                self._finish(work)

    def _open_scoring(self, work: Work) -> None:
        """Start a scored prompt's prefill (its first piece runs in this step)."""
        try:
            work.scoring = self.engine.open_scoring(
                [work.request] + [c.request for c in work.choices],
                self.config.score_piece_tokens)
        except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
            for w in [work, *work.choices]:
                w.on_done(None, exc)
            return
        self.scoring.append(work)

    def _score_piece(self) -> None:
        """One piece of the oldest scored prompt; after its last, its choices run."""
        if not self.scoring:
            return
        work = self.scoring[0]
        try:
            if not work.scoring.advance(self._pause):
                return
            seqs = work.scoring.sequences()
        except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
            log.info("scoring a prompt failed: %s", exc)
            self.scoring.pop(0)
            work.scoring.close()
            for w in [work, *work.choices]:
                w.on_done(None, exc)
            return
        self.scoring.pop(0)
        works = [work, *work.choices]
        each = (work.prompt_tokens + work.request.max_new_tokens) * self.kv_bytes_per_token
        for w, seq in zip(works, seqs):
            w.seq, w.kv_bytes, w.scoring = seq, each, None
            self.running.append(w)
        for w in works:
            if w.seq.done:
                self._finish(w)

    def _pause(self) -> bool:
        """Stop a piece between layers: a request arrived, and there is room to take it."""
        return self.arrived is not None and self.room() > 0 and self.arrived()

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
