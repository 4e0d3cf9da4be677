"""Continuous batching: which sequences a step prefills, scores and decodes, and what their
tokens do to them. The scheduler decides and keeps the queues; it never runs the model.

    sched.add(seq)                          # waiting
    batch = sched.schedule()                # admitted now (batch.prefill), a scored piece
    group, later = sched.next_pass(todo, opened)   # the admitted ones, one pass at a time
    sched.postprocess(seqs, picked, first)  # tokens appended: running, or finished
    sched.take_finished()                   # what the step ends

Each step admits waiting sequences and prefills them together in one pass: every layer's
projections and MLP run once over all their new tokens, while each keeps everything a
request served alone does (its radix match, plan, per-layer selection by its policy, tier
and pool reads, pins, its own causal attention). A sequence that would reuse a new prefix
another admitted one is about to store waits for a second pass, after that one, and loads
it; so does one past the pass's token budget (SchedulerConfig.pass_tokens); a policy that
keeps state from one layer of a request to the next prefills one sequence per pass. Then
one decode step advances every running sequence by one token. A sequence leaves the batch
when it is finished: its last token, a stop token, or its on_token said stop (cancellation,
deadline, stop string); the others go on undisturbed.

A scored prompt (prompt log-probabilities: echo with logprobs) is prefilled a piece at a
time instead, one piece per step after the step's passes; a piece stops between two layers
when a request arrives (`arrived`, the owner's queue, and there is room for it), so that
request waits about one layer, not the whole prompt, and the piece goes on in the next step
after that request's pass. The choices of one request (n) share that prefill, each then
decoding on its own.

Admission is bounded by the batch size (a scored prompt counts its choices), by a per-step
token budget (decode tokens of the running sequences plus the prompt tokens prefilled in
that step, a scored prompt's piece among them; one sequence is always admitted into an
empty step, so a long prompt is never starved) and by memory: the decode context a sequence
may grow to (prompt plus new tokens, every layer's K and V, for each choice) and the logits
it holds (one piece's rows of a scored prompt; every query row where all of them are kept)
must fit the budget beside the running sequences' own, or it waits.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import torch

from ..errors import UserError
from .sequence import Sequence, Status

# A scored prompt's tokens per piece (two store chunks): what a request arriving meanwhile
# waits for. On the 2-core CPU a 32-token piece of smollm2-135m computes about 10 GFLOP,
# less than a short request's time alone; where every pass streams offloaded weights, or on
# a GPU, more tokens per piece (--score-piece-tokens) cost fewer passes.
PIECE_TOKENS = 32


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


@dataclasses.dataclass
class Batch:
    """What a step runs before its decode step: the sequences admitted (prefilled in one
    pass or more), and the scored prompt whose next piece runs."""

    prefill: list[Sequence]
    piece: Sequence | None


class Scheduler:
    def __init__(self, config: SchedulerConfig, *, kv_bytes_per_token: int,
                 logits_bytes_per_row: int, kv_budget: int, one_at_a_time: bool,
                 chunk_size: int, stores_new: bool):
        """`kv_bytes_per_token`: one token's K and V over every layer; `logits_bytes_per_row`:
        a float32 row of logits; `one_at_a_time`: the policy keeps state from one layer of
        a request to the next (its layers must not interleave with another's);
        `chunk_size`, `stores_new`: what the store keeps of a prefill (the "would gain"
        rule)."""
        self.config = config
        self.kv_bytes_per_token = kv_bytes_per_token
        self.logits_bytes_per_row = logits_bytes_per_row
        self.kv_budget = kv_budget
        self.one_at_a_time = one_at_a_time
        self.chunk_size, self.stores_new = chunk_size, stores_new
        # Sharing a pass saves its fixed per-layer costs but makes every request in it wait
        # for all of its tokens. Side by side on a quiet 2-core CPU (bench_serve --quick),
        # a pass bounded only by the step's token budget beat one of 256 tokens in
        # throughput and P99 TTFT with shared and with distinct prefixes.
        self.pass_tokens = config.pass_tokens if config.pass_tokens is not None else \
            config.max_batch_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.joining: list[Sequence] = []    # first token out this step: decode next
        self.scoring: list[Sequence] = []    # scored prompts being prefilled, oldest first
        self.finished: list[Sequence] = []
        # Whether a request arrived that waits for this thread (the owner's queue): a
        # scored prompt's piece then stops between two layers, and the step ends.
        self.arrived: Callable[[], bool] | None = None
        self.last_batch = 0            # sequences in the last decode step
        self.steps = 0
        self._order = 0

    # -- queues ------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.joining or self.scoring)

    def _slots(self) -> int:
        """Decode slots taken or promised: running, being scored, admitted next."""
        return len(self.running) + len(self.joining) + sum(s.width for s in self.scoring)

    def room(self) -> int:
        """How many more requests may wait to be admitted (keeps the caller's queue, not
        this one, holding the backlog)."""
        return max(0, self.config.max_batch_size - self._slots() -
                   sum(s.width for s in self.waiting))

    def add(self, seq: Sequence) -> None:
        context = (seq.prompt_tokens + seq.request.max_new_tokens) * self.kv_bytes_per_token
        rows = 0
        if seq.scores_prompt:
            rows = min(self.config.score_piece_tokens, len(seq.request.query))
        elif seq.want_query_logits:
            rows = len(seq.request.query)
        seq.kv_bytes = context * seq.width + rows * self.logits_bytes_per_row
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def kv_in_use(self) -> int:
        return sum(s.kv_bytes for s in (*self.running, *self.joining, *self.scoring))

    # -- the decision --------------------------------------------------------------------------
    def schedule(self) -> Batch:
        """Admit what fits (to be prefilled together), and pick the oldest scored prompt's
        next piece."""
        budget = self.config.max_batch_tokens - len(self.running) - (
            self.scoring[0].scoring.next_piece if self.scoring else 0)
        admitted: list[Sequence] = []
        while self.waiting:
            seq = self.waiting[0]
            taken = self._slots() + sum(s.width for s in admitted)
            others = bool(self.running or self.scoring or admitted)
            if others and taken + seq.width > self.config.max_batch_size:
                break            # a lone request (or request of n choices) is still taken
            in_use = self.kv_in_use() + sum(s.kv_bytes for s in admitted)
            if others and seq.kv_bytes + in_use > self.kv_budget:
                break            # waits for memory; a lone request is served as before
            tokens = min(self.config.score_piece_tokens, seq.prompt_tokens) \
                if seq.scores_prompt else seq.prompt_tokens
            if admitted and tokens > budget:
                break            # the step's token budget is spent: the next step takes it
            self.waiting.popleft()
            budget -= tokens
            if seq.scores_prompt:
                seq.status = Status.SCORING
                self.scoring.append(seq)
            else:
                seq.status = Status.ADMITTED
                seq.order = self._next_order()
                admitted.append(seq)
        return Batch(admitted, self.scoring[0] if self.scoring else None)

    def candidates(self, todo: list[Sequence]) -> list[Sequence]:
        """The admitted sequences the next pass is chosen from (to be opened for it)."""
        return todo[:1] if self.one_at_a_time else todo

    def next_pass(self, todo: list[Sequence], opened: list[Sequence]
                  ) -> tuple[list[Sequence], list[Sequence]]:
        """The next pass, from the opened candidates (matched and planned): in order while
        their new tokens total at most pass_tokens (one always), except one that would match
        more once another of the pass has stored its prefix. And the admitted sequences left
        for later passes (to be opened again then)."""
        group: list[Sequence] = []
        tokens = 0
        for seq in opened:
            n = len(seq.new_ids) + seq.front
            if group and (any(self._would_gain(a, seq) for a in group) or
                          tokens + n > self.pass_tokens):
                continue
            group.append(seq)
            tokens += n
        later = [s for s in todo if s.status is Status.ADMITTED and s not in group]
        return group, later

    def _would_gain(self, a: Sequence, b: Sequence) -> bool:
        """Would `b` match more stored prefix once `a` has stored its own?"""
        if not (a.use_store and b.use_store and self.stores_new) or \
                a.request.namespace != b.request.namespace:
            return False
        pa, pb = a.request.prefix, b.request.prefix
        n = min(len(pa), len(pb))
        common = 0
        while common < n and pa[common] == pb[common]:
            common += 1
        return common // self.chunk_size * self.chunk_size > b.matched + b.n_given

    def decoding(self) -> list[Sequence]:
        """The sequences of this step's decode step: the running ones, then those whose
        first token came in this step (in the order they were admitted)."""
        self.running += sorted(self.joining, key=lambda s: s.order)
        self.joining = []
        if self.running:
            self.last_batch = len(self.running)
            self.steps += 1
        return list(self.running)

    def should_pause(self) -> bool:
        """Stop a scored piece between layers: a request arrived, and there is room for it."""
        return self.arrived is not None and self.room() > 0 and self.arrived()

    # -- post-processing -------------------------------------------------------------------------
    def scored(self, seq: Sequence) -> list[Sequence]:
        """A scored prompt's last piece is in: it and its choices take a decode slot each
        (their first tokens next). Returns them."""
        self.scoring.remove(seq)
        seqs = [seq, *seq.choices]
        each = (seq.prompt_tokens + seq.request.max_new_tokens) * self.kv_bytes_per_token
        for s in seqs:
            s.kv_bytes = each
            s.order = self._next_order()
        return seqs

    def postprocess(self, seqs: list[Sequence], picked: list, first: bool = False) -> None:
        """Append each sequence's picked token; a sequence is finished by its last token,
        a stop token, or its request's on_token saying stop. `first`: the tokens of a
        prefill (the sequences join the decode batch unless finished)."""
        for seq, pick in zip(seqs, picked):
            req = seq.request
            if pick.row is not None:
                seq.step_logits.append(pick.row)
            if pick.scores is not None:
                if seq.logprobs is None:
                    seq.logprobs = []
                seq.logprobs.append(pick.scores)
            token = pick.token
            seq.tokens.append(token)
            if not first:
                seq.steps += 1
            if token in seq.sampler.stop_token_ids or \
                    (req.on_token is not None and req.on_token(token) is False) or \
                    len(seq.tokens) >= req.max_new_tokens:
                self._finish(seq)
            elif first:
                seq.status = Status.RUNNING
                self.joining.append(seq)

    def retract(self, seq: Sequence) -> None:
        """A sequence whose prefill is tried again (its stored prefix turned out corrupt
        after its first token): admitted again, its tokens to come again."""
        for queue in (self.running, self.joining, self.finished):
            if seq in queue:
                queue.remove(seq)
        seq.status = Status.ADMITTED

    def fail(self, seq: Sequence, error: BaseException) -> None:
        """The sequence ends with `error` (it is answered with it)."""
        seq.error = error
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        for queue in (self.running, self.joining, self.scoring):
            if seq in queue:
                queue.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.finished.append(seq)

    def take_finished(self) -> list[Sequence]:
        """The sequences finished since the last call."""
        done, self.finished = self.finished, []
        return done

    def give_back(self, seqs: list[Sequence]) -> None:
        """Finished sequences taken by someone they are not for: the next take has them."""
        self.finished = seqs + self.finished

    def _next_order(self) -> int:
        self._order += 1
        return self._order
