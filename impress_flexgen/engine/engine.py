"""The serving engine: requests in, one step at a time, responses out.

    stack = assemble(runtime, make_policy("impress"), StoreSpec(directory))
    seq = stack.engine.add_request(Request(prefix_ids, query_ids, max_new_tokens=8))
    while not seq.finished:
        stack.engine.step()           # returns the sequences it finished
    response = seq.result()           # or: stack.engine.serve(request), both at once

Three objects and one loop. The scheduler (scheduler.py) decides what a step runs: which
waiting sequences are admitted and in which prefill passes, a scored prompt's next piece,
the decode batch; and its post-processing appends each picked token and finishes sequences.
The runner (runner.py) runs every layer loop: a prefill pass over several sequences' new
tokens, a decode step of the batch. Each sequence (sequence.py) is one record from match to
last token. For each request:
  1. open     its stored prefix: match, shared pool, plan, pinned (prefix.py);
  2. prefill  per layer, with that layer's weights placed by FlexGen's policy: project the
              new tokens' q, k, v; the policy reads the probe keys (read ahead while the
              layer before computed) and decides which chunks to load; load them, in one
              round trip through the tiers, fastest first (CRC-checked; layer_io.py);
              attend over the kept prefix tokens plus themselves; MLP (runner.py, lane.py);
  3. first    token from the last position's logits: streamed now (time to first token);
  4. close    its newly computed prefix KV (whole chunks) stored in the radix tree, then in
              the shared pool, on a writer thread while it decodes (store_writer.py);
  5. decode   one token a step, the batch's weights brought once a layer; its response made
              when it is finished.
A corrupt stored node is quarantined and the request computed again; a chunk the shared
pool lost serves it again without it (`_prefill_alone`).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from policies import ServingPolicy

from ..errors import CorruptNode, UserError
from ..models import dtypes
from ..models.runtime import Runtime
from ..planner.context import ContextKV
from ..planner.planner import Planner
from ..request import Request, RequestStats, Response
from ..store import PrefixStore
from ..tiers import TierConfig
from ..tiers.pool import SharedMiss, shared_pool
from .family import FamilyMath, probe_setup
from .prefix import Prefixes
from .prefix_kv import PrefixKV
from .runner import Runner
from .scheduler import Scheduler, SchedulerConfig, free_memory_bytes
from .scores import TokenScores
from .sequence import ScoredPrompt, Sequence, checked
from .store_writer import StoreWriter

log = logging.getLogger("impress_flexgen.engine")


class Engine:
    def __init__(self, runtime: Runtime, store: PrefixStore | None, policy: ServingPolicy,
                 tiers: TierConfig = TierConfig(),
                 scheduling: SchedulerConfig = SchedulerConfig()):
        """Built by assemble() (assemble.py), which also puts the memory tiers in front of
        the store. `tiers`: the shared pool's settings (remote_url, ...)."""
        if not runtime.policy.sep_layer:
            raise UserError("the serving engine needs FlexGen's sep_layer layout")
        self.rt = runtime
        self.math = math = FamilyMath(runtime.spec)
        self.store = store
        self.policy = policy
        self.config = policy.config
        self.probe_heads, self.probe_kv_heads = probe_setup(runtime.spec, policy.config)
        # FlexGen's weight buffers and the policy's per-layer state belong to one caller at
        # a time: callers on several threads take turns (the store serves several engines at
        # once). The buffers are the model's, so every engine on one runtime takes the
        # runtime's lock (a planner's background recalibration on one engine must not run
        # the model while another engine serves).
        self.lock = runtime.compute_lock
        self.device = runtime.model.layers[0].compute.dev
        self.dtype = dtypes.torch_dtype(runtime.spec.config.dtype)
        if store is not None and policy.reuse and \
                tuple(store.config.probe_heads) != self.probe_kv_heads:
            raise UserError(f"store probe copy holds KV heads {store.config.probe_heads}, "
                            f"the policy probes {self.probe_kv_heads}")
        # Decode steps count the KV they move in fp16 bytes, as the decode-phase policies do.
        self.kv_bytes_per_token_layer = 2 * math.n_kv_head * math.head_dim * 2
        # Loads count stored bytes (the store's KV format).
        self.stored_bytes_per_token_layer = store.shape.kv_bytes_per_token_layer \
            if store is not None else self.kv_bytes_per_token_layer
        self.planner = None      # the cost model's planner, when the plan is auto or both
        # The shared pool (a remote tier behind the disk), when one is configured.
        self.shared = None
        self.shared_fallbacks = 0
        # An exact reader takes nothing from a store (or pool) in a format that loses bits.
        if tiers.remote_url and store is not None and policy.reuse and \
                (store.shape.kv_exact or not policy.exact_reads):
            self.shared = shared_pool(
                tiers.remote_url, store, self.dtype, secret=tiers.remote_secret,
                ttl_s=tiers.remote_ttl, recompute_s=lambda n, ctx: None if self.planner is None
                else self.planner.cost().compute_s(n, ctx))
        self.tier_names = TierConfig().names(remote=self.shared is not None)
        self.spec = runtime.spec
        self.max_positions = runtime.spec.config.max_seq_len
        self.writer = StoreWriter()
        self.prefix = Prefixes(store, policy, self.shared, self.writer, math,
                               self.stored_bytes_per_token_layer, self.tier_names)
        self.runner = Runner(runtime, math, PrefixKV(
            store, policy, math, self.probe_heads, self.probe_kv_heads, self.device, self.dtype,
            self.stored_bytes_per_token_layer), self.device, self.dtype,
            self.kv_bytes_per_token_layer)
        self.scheduler = self._scheduler(scheduling)
        if store is not None and policy.reuse and self.config.plan in ("auto", "both"):
            self.planner = self.prefix.planner = Planner.for_engine(self)

    def _scheduler(self, config: SchedulerConfig) -> Scheduler:
        m = self.math
        elsize = torch.finfo(self.dtype).bits // 8 if self.device.type != "cpu" else 4
        return Scheduler(
            # Only the layers whose decode context stays in the compute device's memory.
            config, kv_bytes_per_token=2 * self.runner.kv_home.held_layers * m.n_kv_head *
            m.head_dim * elsize,
            # float32 logits a query row holds while it is scored (or kept: query_logits)
            logits_bytes_per_row=4 * self.rt.spec.config.vocab_size,
            kv_budget=config.kv_budget_bytes if config.kv_budget_bytes is not None
            else free_memory_bytes(self.device) // 2,
            one_at_a_time=bool(getattr(self.policy, "keeps_layer_state", False)),
            chunk_size=self.store.config.chunk_size if self.store is not None else 0,
            stores_new=self.policy.store_new)

    def schedule_by(self, config: SchedulerConfig) -> None:
        """Batch by `config` from now on (nothing may be queued or running)."""
        if self.scheduler.busy:
            raise RuntimeError("the scheduler has requests in flight")
        arrived = self.scheduler.arrived
        self.scheduler = self._scheduler(config)
        self.scheduler.arrived = arrived

    def close(self) -> None:
        """Stop the planner's recalibration, finish the stores handed to the writer, then
        stop the shared pool's threads (the store and runtime are closed by their owner)."""
        if self.planner is not None:
            self.planner.close()
        self.writer.wait_idle()
        self.runner.kv_home.close()
        if self.shared is not None:
            self.shared.tier.close()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: Request, query_logits: bool = False,
                    choices: list[Request] = ()) -> Sequence:
        """Queue a request (UserError if malformed); its sequence is finished, its response
        or error set, by a later step(). `choices`: the other choices of a scored prompt
        (the same prompt, each its own sampling), which share its prefill."""
        seq = Sequence(checked(request, self.spec), want_query_logits=query_logits)
        if choices or request.prompt_logprobs is not None:
            lead = seq.request
            if lead.prompt_logprobs is None:
                raise UserError("only the choices of a scored prompt share a prefill")
            if lead.prefix:
                raise UserError("a scored prompt is all query: it has no prefix")
            seq.choices = [Sequence(checked(r, self.spec)) for r in choices]
            if any(c.request.query != lead.query or
                   c.request.prompt_logprobs != lead.prompt_logprobs for c in seq.choices):
                raise UserError("the choices of a scored prompt must share its prompt")
            seq.want_query_logits = False
            seq.scoring = ScoredPrompt(list(lead.query), lead.prompt_logprobs,
                                       self.scheduler.config.score_piece_tokens)
        with self.lock:
            self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        """One step: the admitted sequences prefilled (in passes), a scored prompt's next
        piece, one decode step of every running sequence. Returns those it finished."""
        with self.lock:
            batch = self.scheduler.schedule()
            todo = batch.prefill
            while todo:
                group, todo = self.scheduler.next_pass(
                    todo, self._opened(self.scheduler.candidates(todo)))
                self._release(todo)           # opened again for a pass of their own
                self._prefill(group)
            if batch.piece is not None:
                self._score_piece(batch.piece)
            self._decode(self.scheduler.decoding())
        return [self._respond(seq) for seq in self.scheduler.take_finished()]

    def serve(self, request: Request, query_logits: bool = False) -> Response:
        """One request, from radix match to its last token (steps until it is finished;
        sequences of other callers that finish meanwhile are left for their step())."""
        with self.lock:
            seq = self.add_request(request, query_logits)
            others = []
            while not seq.finished:
                others += [s for s in self.step() if s is not seq]
            self.scheduler.give_back(others)
        return seq.result()

    def serve_all(self, requests: list[Request], config: SchedulerConfig | None = None,
                  query_logits: bool = False) -> list:
        """Serve `requests` together (batched as `config` says, if given); their responses
        in order, an exception in place of one that failed."""
        with self.lock:
            if config is not None:
                self.schedule_by(config)
            out: list = [None] * len(requests)
            seqs = {}
            for i, req in enumerate(requests):
                try:
                    seqs[self.add_request(req, query_logits).id] = i
                except UserError as exc:
                    out[i] = exc
            while self.scheduler.busy:
                for seq in self.step():
                    if seq.id in seqs:
                        out[seqs[seq.id]] = seq.error or seq.response
        return out

    # -- prefill -----------------------------------------------------------------------------
    def _opened(self, seqs: list[Sequence]) -> list[Sequence]:
        """`seqs` opened for a pass; one that fails to open is served alone now."""
        opened = []
        for seq in seqs:
            try:
                self.prefix.open(seq, use_shared=self.shared is not None)
                opened.append(seq)
            except Exception as exc:  # noqa: BLE001 - this one alone, the others go on
                log.debug("opening a request for a shared prefill failed: %s", exc)
                self._prefill_alone(seq, opened=False)
        return opened

    def _release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.prefix.release(seq)

    def _prefill(self, group: list[Sequence]) -> None:
        """One pass over `group`; any failure inside a shared pass (corrupt stored KV, a
        chunk the shared pool lost, anything else) serves each of its sequences alone
        instead, with its own recovery; nothing was streamed yet, so nothing twice."""
        if len(group) <= 1:
            for seq in group:
                self._prefill_alone(seq)
            return
        try:
            outs = self.runner.prefill(group)
        except Exception as exc:  # noqa: BLE001 - served alone below
            log.info("shared prefill failed (%s); serving its requests alone", exc)
            self._release(group)
            for seq in group:
                self._prefill_alone(seq, opened=False)
            return
        for seq in group:
            seq.learn = False
        try:
            self._first_tokens(group, outs)
        except Exception as exc:  # noqa: BLE001 - the pass's requests fail, the loop goes on
            self._release(group)
            for seq in group:
                if not seq.finished:
                    self.scheduler.fail(seq, exc)

    def _prefill_alone(self, seq: Sequence, opened: bool = True) -> None:
        """One sequence's prefill in a pass of its own, up to its first token; a corrupt
        stored node is quarantined and the request computed again, a chunk the shared pool
        lost served again with what it still holds whole, then without it."""
        use_shared = self.shared is not None
        for attempt in range(4):
            try:
                if attempt or not opened:
                    self.prefix.open(seq, attempt, use_shared)
                if seq.request.on_token is not None:
                    seq.request.on_token.restart()
                self._first_tokens([seq], self.runner.prefill([seq]), alone=True)
                return
            except CorruptNode as exc:
                # Never serve corrupt KV: take the node out of service and compute again.
                self.scheduler.retract(seq)
                self.prefix.release(seq)
                self.store.quarantine(exc.node, str(exc))
            except SharedMiss as exc:
                self.prefix.release(seq)
                log.warning("shared pool: %s; serving again", exc)
                self.shared_fallbacks += 1
                use_shared = attempt == 0
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self.prefix.release(seq)
                self.scheduler.fail(seq, exc)
                return
        self.scheduler.fail(seq, RuntimeError(
            "store kept failing CRC checks; giving up on this request"))

    def _first_tokens(self, seqs: list[Sequence], outs: list[tuple], alone: bool = False
                      ) -> None:
        """Every sequence's first token goes out before any of them stores its new prefix
        KV or sets up its decode context (the last one's time to first token is the pass,
        not also the others' store writes). `alone`: a corrupt node found setting up the
        decode context is raised (for a retry)."""
        picked = self.runner.first_tokens(seqs, outs)
        for seq in seqs:
            seq.stats.ttft_s = time.perf_counter() - seq.t_start
            self.prefix.learn(seq)
        self.scheduler.postprocess(seqs, picked, first=True)
        for seq, out, first in zip(seqs, outs, picked):
            self._after_first(seq, out, first, alone)

    def _after_first(self, seq: Sequence, out: tuple, first, alone: bool = False) -> None:
        """The query's logits (when asked), the decode context, the store of the new prefix
        KV behind the decode steps (its matched prefix stays pinned until then)."""
        kept, new_kv, _, _ = out
        try:
            if seq.want_query_logits:
                seq.query_logits = self.runner.query_logits(out, first)
            if not seq.finished:
                if self.config.decode_over == "full" and seq.match is not None and \
                        seq.match.segments:
                    kept = self.runner.prefix.full_prefix_context(seq.match.segments, new_kv,
                                                                  seq.stats, seq.request.n_pad)
                self.runner.start_decode(seq, kept)
            self.prefix.close(seq, new_kv)
        except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
            self.prefix.release(seq)
            if alone and isinstance(exc, CorruptNode):
                raise
            if not seq.finished:
                self.scheduler.fail(seq, exc)
            elif seq.error is None:
                seq.error = exc

    def _score_piece(self, seq: Sequence) -> None:
        """The next piece of a scored prompt; after its last, its choices' first tokens."""
        try:
            if seq.stats is None:
                self.prefix.open(seq)     # nothing to match: it has no prefix
            if not self.runner.score_piece(seq, self.scheduler.should_pause):
                return
            seqs = self.scheduler.scored(seq)
            scoring = seq.scoring
            out, scoring.last = scoring.last, None
            scores = TokenScores.cat(scoring.parts, scoring.k)
            scoring.parts = []
            for choice in seqs[1:]:
                choice.stats = dataclasses.replace(
                    seq.stats, bytes_read=dict(seq.stats.bytes_read),
                    jaccard=list(seq.stats.jaccard))
                choice.t_start, choice.disk_before = seq.t_start, seq.disk_before
            for s in seqs:
                s.prompt_scores = scores
            self._first_tokens(seqs, [out] * len(seqs))
        except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
            log.info("scoring a prompt failed: %s", exc)
            self.runner.close_piece(seq)
            self.prefix.release(seq)
            for s in [seq, *seq.choices]:
                if not s.finished:
                    self.scheduler.fail(s, exc)

    # -- decode ------------------------------------------------------------------------------
    def _decode(self, seqs: list[Sequence]) -> None:
        """One decode step; a failure fails the whole batch (the loop goes on)."""
        if not seqs:
            return
        try:
            picked = self.runner.decode(seqs)
        except Exception as exc:  # noqa: BLE001 - the batch fails together
            log.exception("decode step failed")
            for seq in seqs:
                self.scheduler.fail(seq, exc)
            return
        self.scheduler.postprocess(seqs, picked)

    def _respond(self, seq: Sequence) -> Sequence:
        """A finished sequence's response (once): its prefix stored first, its decode
        statistics, its context's memory released."""
        if seq.response is not None or seq.error is not None:
            if seq.error is not None and seq.pages is not None:
                try:
                    seq.pages.close()      # its selector's threads, when it failed mid-way
                except Exception:  # noqa: BLE001 - the error that counts is seq.error
                    log.debug("closing a failed request's pages", exc_info=True)
                seq.pages = None
            return seq
        try:
            if seq.stored is not None:
                seq.stored.result()      # its prefix is stored before it is answered
            stats, steps = seq.stats, seq.steps
            if seq.pages is not None:
                counters = seq.pages.close()
                seq.moved = counters.bytes_moved + sum(
                    kv.n for kv in seq.kv if kv is not None) * \
                    self.kv_bytes_per_token_layer * steps
                stats.decode_select_s = counters.select_s
                stats.index_build_s = counters.build_s
                stats.index_recall = counters.recall
            if steps:
                stats.decode_s_per_token = seq.decode_s / steps
                stats.decode_bytes_per_step = seq.moved / steps
            self.runner.side.forget(seq)
            seq.kv = None     # the context's memory goes now, not with the last reference
            seq.response = Response(seq.tokens, seq.query_logits, seq.step_logits, stats,
                                    seq.logprobs, seq.prompt_scores)
        except Exception as exc:  # noqa: BLE001 - answered with the error
            seq.error = exc
        return seq

    # -- the planner's measure ---------------------------------------------------------------
    def measure_prefill(self, n: int, ctx: int = 0) -> float:
        """Seconds to prefill n tokens over ctx earlier ones (their KV given, no I/O) and
        take the first token: one point of the planner's prefill curve."""
        vocab = self.rt.spec.config.vocab_size
        ids = np.random.default_rng(n * 7919 + ctx).integers(10, vocab, n).tolist()
        seq = Sequence(Request([], ids), stats=RequestStats(), new_ids=ids)
        if ctx:
            seq.given = ContextKV(ctx, self.math.n_kv_head, self.math.head_dim)
        with self.lock:
            t0 = time.perf_counter()
            (_, _, tail, out_w), = self.runner.prefill([seq])
            self.math.logits(out_w, tail[-1:]).cpu()
            return time.perf_counter() - t0
