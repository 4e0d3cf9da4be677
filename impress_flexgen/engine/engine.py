"""The serving engine: one request, from radix match to generated tokens.

    engine = Engine(runtime, store, make_policy("impress"))
    response = engine.serve(Request(prefix_ids, query_ids, max_new_tokens=8))

For each request:
  1. match    the longest stored, chunk-aligned part R of the prefix (locked meanwhile),
              then the chunks after it that the shared pool holds (a remote tier, if any);
              the plan: load R, recompute it, or recompute its front while the rest loads
              (the cost model's choice; `ServingConfig.plan`);
  2. embed    the new tokens (the rest of the prefix, then the query) at positions |R|...;
  3. per layer, with that layer's weights placed by FlexGen's policy:
       project  the new tokens' q, k, v;
       plan     the policy reads probe keys and decides which chunks to load (ITF); the
                probe keys were read in the background while the layer before computed;
       load     those K and V chunks, in one round trip through the tiers, fastest first
                (CRC-checked; the read-ahead (readahead.py) schedules the reads);
       attend   the new tokens over the kept prefix tokens plus themselves (causal);
       MLP;
  4. logits   of the last position: the first token (time to first token ends here;
              logits of the other query positions, when asked for, come after; a scored
              prompt is prefilled and scored in pieces instead, scoring.py);
  5. store    the newly computed prefix KV (whole chunks) in the radix tree, then in the
              shared pool (write-through); on a writer thread while the request decodes
              (store_writer);
  6. decode   over the kept prefix tokens plus the generated ones (or the full prefix):
              `start` returns a Sequence after 1-5, `step` advances a batch of sequences by
              one token each (batch_runner), `finish` makes the response; `serve` does all
              three for one request, a scheduler interleaves many (scheduler).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import numpy as np
import torch

from policies import ServingPolicy

from .batch_prefill import PrefillJob, prefill_pass
from ..batch_runner import BatchRunner
from ..errors import UserError
from ..planner.context import ContextKV
from ..planner.planner import Planner
from ..request import Request, RequestStats, Response
from ..runtime import Runtime
from ..sampling import Sampler
from ..scores import step_scores
from ..sequence import Sequence, decode_context
from ..store import CHUNK_SIZE, CorruptNode, PrefixStore, StoreWriteFailed
from ..store.shared import SharedMiss, shared_pool
from ..tiers import ChunkCache, TierConfig
from .family import FamilyMath, probe_setup
from .prefix_kv import PrefixKV
from .runner import LayerRunner
from .scoring import PIECE_TOKENS, ScoredPrefill
from .store_writer import StoreWriter

log = logging.getLogger("impress_flexgen.engine")


# The tiers' record under its old name (sizes, shared pool): one record, tiers.TierConfig.
TierSizes = TierConfig


class Engine:
    def __init__(self, runtime: Runtime, store: PrefixStore | None, policy: ServingPolicy,
                 tiers: TierSizes = TierSizes(), cache: ChunkCache | None = None):
        """`cache`: tiers to share with another engine on the same store (default: new
        tiers of `tiers`' sizes)."""
        if not runtime.policy.sep_layer:
            raise UserError("the serving engine needs FlexGen's sep_layer layout")
        self.rt = runtime
        self.model = runtime.model
        self.math = FamilyMath(runtime.spec)
        self.store = store
        self.policy = policy
        self.config = policy.config
        self.probe_heads, self.probe_kv_heads = probe_setup(runtime.spec, policy.config)
        # FlexGen's weight buffers and the policy's per-layer state belong to one request at
        # a time: requests from several threads take turns through the layers (the store
        # serves several engines at once). The buffers are the model's, so every engine on
        # one runtime takes the runtime's lock (a planner's background recalibration on one
        # engine must not run the model while another engine serves).
        self._serving = runtime.compute_lock
        self.compute = self.model.layers[0].compute
        self.device = self.compute.dev
        self.dtype = torch.float16 if runtime.spec.config.dtype.__name__ == "float16" \
            else torch.float32
        if store is not None and policy.reuse:
            if tuple(store.config.probe_heads) != self.probe_kv_heads:
                raise UserError(f"store probe copy holds KV heads {store.config.probe_heads}, "
                                f"the policy probes {self.probe_kv_heads}")
            store.tiers.use_memory(cache if cache is not None else ChunkCache(
                TierConfig(tiers.gpu_bytes, tiers.cpu_bytes, policy.tier_policy, tiers.alpha,
                           tiers.exclusive, verify_hits=tiers.verify_hits),
                gpu_device=self.device))
        c = self.math
        # Decode steps count the KV they move in fp16 bytes, as the decode-phase policies do.
        self.kv_bytes_per_token_layer = 2 * c.n_kv_head * c.head_dim * 2
        # Loads count stored bytes (the store's KV format).
        self.stored_bytes_per_token_layer = store.shape.kv_bytes_per_token_layer \
            if store is not None else self.kv_bytes_per_token_layer
        # The stored prefix KV a layer attends, and the prefill's loop over the layers.
        self.prefix = PrefixKV(store, policy, c, self.probe_heads, self.probe_kv_heads,
                               self.device, self.dtype, self.stored_bytes_per_token_layer)
        self.layers = LayerRunner(runtime, c, self.prefix, self.device, self.dtype)
        self.planner = None      # the cost model's planner, when the plan is auto or both
        # The shared pool (a remote tier behind the disk), when one is configured.
        self.shared = None
        self.shared_fallbacks = 0
        self.shared_unstored = 0    # prefixes not stored: part of them came unauthenticated
        # An exact reader takes nothing from a store (or pool) in a format that loses bits.
        if tiers.remote_url and store is not None and policy.reuse and \
                (store.shape.kv_exact or not policy.exact_reads):
            self.shared = shared_pool(
                tiers.remote_url, store, self.dtype, secret=tiers.remote_secret,
                ttl_s=tiers.remote_ttl, recompute_s=lambda n, ctx: None if self.planner is None
                else self.planner.cost().compute_s(n, ctx))
        self.tier_names = TierConfig().names(remote=self.shared is not None)
        self.max_positions = runtime.spec.config.max_seq_len
        if store is not None and policy.reuse and self.config.plan in ("auto", "both"):
            self.planner = Planner.for_engine(self)
        self.runner = BatchRunner(self)     # the decode steps of a batch
        self.writer = StoreWriter()         # 5. stores, behind the decode steps

    def close(self) -> None:
        """Stop the planner's recalibration, finish the stores handed to the writer, then
        stop the shared pool's threads (the store and runtime are closed by their owner)."""
        if self.planner is not None:
            self.planner.close()
        self.writer.wait_idle()
        if self.shared is not None:
            self.shared.tier.close()

    # -- the request ------------------------------------------------------------------------
    def serve(self, request: Request, query_logits: bool = False) -> Response:
        """One request alone, from radix match to its last token."""
        with self._serving:
            seq = self.start(request, query_logits)
            while not seq.done:
                self.step([seq])
            return self.finish(seq)

    def start(self, request: Request, query_logits: bool = False) -> Sequence:
        """The prefill step of a request (match, plan, load, compute, first token, store):
        a sequence for decode steps, `done` when the first token was also the last."""
        request = self._checked(request)
        if request.prompt_logprobs is not None:      # every piece of it now
            return self.open_scoring([request]).run()[0]
        use_shared = self.shared is not None
        for attempt in range(4):
            try:
                with self._serving:
                    if request.on_token is not None:
                        request.on_token.restart()
                    return self._serve(request, query_logits, recovered=attempt,
                                       use_shared=use_shared)
            except CorruptNode as exc:
                # Never serve corrupt KV: take the node out of service and recompute.
                self.store.quarantine(exc.node, str(exc))
            except SharedMiss as exc:
                # The pool lost a chunk it had (no longer marked held): serve again with what
                # it still holds whole, publishing the rest back; then without it.
                log.warning("shared pool: %s; serving again", exc)
                self.shared_fallbacks += 1
                use_shared = attempt == 0
        raise RuntimeError("store kept failing CRC checks; giving up on this request")

    def open_scoring(self, requests: list[Request],
                     piece_tokens: int = PIECE_TOKENS) -> ScoredPrefill:
        """The prefill of a scored prompt, to be advanced a piece at a time; `requests`:
        the choices that share it (the same query, each its own sampling)."""
        return ScoredPrefill(self, [self._checked(r) for r in requests], piece_tokens)

    def _checked(self, request: Request) -> Request:
        """The request, refused (UserError) if malformed; its on_token relayed across retries."""
        if not request.query:
            raise UserError("a request needs at least one query token")
        if request.max_new_tokens < 1:
            raise UserError("max_new_tokens must be at least 1")
        if request.n_pad < 0 or (request.n_pad and request.n_pad >= len(request.prefix)):
            raise UserError("n_pad must leave at least one real prefix token")
        if request.forced is not None and request.max_new_tokens > 1 and \
                len(request.forced) < request.max_new_tokens - 1:
            raise UserError("forced decoding needs max_new_tokens - 1 tokens")
        if request.on_token is not None:
            request = dataclasses.replace(request, on_token=_Relay(request.on_token))
        return request

    def step(self, seqs: list[Sequence]) -> None:
        """One decode step: the next token of every sequence (none of them done), with
        each layer's weights used once for all of them."""
        with self._serving:
            self.runner.step(seqs)

    def finish(self, seq: Sequence) -> Response:
        """The response of a sequence (done, or given up by its caller)."""
        if seq.stored is not None:
            seq.stored.result()      # its prefix is stored before it is answered
        stats = seq.stats
        steps = seq.steps
        if seq.pages is not None:
            counters = seq.pages.close()
            seq.moved = counters.bytes_moved + sum(
                kv.n for kv in seq.kv if kv is not None) * self.kv_bytes_per_token_layer * steps
            stats.decode_select_s = counters.select_s
            stats.index_build_s = counters.build_s
            stats.index_recall = counters.recall
        if steps:
            stats.decode_s_per_token = seq.decode_s / steps
            stats.decode_bytes_per_step = seq.moved / steps
        self.runner.side.forget(seq)
        seq.kv = None     # the context's memory goes now, not with the last reference
        return Response(seq.tokens, seq.query_logits, seq.step_logits, stats, seq.logprobs,
                        seq.prompt_scores)

    def _serve(self, req: Request, want_query_logits: bool, recovered: int,
               use_shared: bool = False) -> Sequence:
        job = self._open(req, want_query_logits, recovered, use_shared)
        try:
            # 2-4. prefill
            kept, new_kv, tail, out_w = prefill_pass(self.layers, [job.pass_input()])[0]
            self._first_token(job, tail, out_w)
            return self._to_decode(job, kept, new_kv)
        finally:
            job.release(self)

    def _open(self, req: Request, want_query_logits: bool, recovered: int,
              use_shared: bool = False) -> PrefillJob:
        """1. match, and the plan: what a prefill pass needs of the request (its matched
        prefix pinned until the job is released)."""
        # A prefix another request is storing is matched as if it were stored in line.
        self.writer.wait_idle()
        stats = RequestStats(prefix_tokens=len(req.prefix), recovered_from_corruption=recovered,
                             bytes_read=dict.fromkeys(self.tier_names, 0))
        use_store = self.store is not None and self.policy.reuse
        job = PrefillJob(req, want_query_logits, stats, time.perf_counter(),
                         self.store.reader.counters() if self.planner is not None else None,
                         None, use_store, use_shared)
        try:
            if use_store:
                # An exact reader never sees KV computed over a selection of a prefix.
                job.match = self.store.match_prefix(req.prefix, namespace=req.namespace,
                                                    exact_only=self.policy.exact_reads)
            segments_nodes = job.match.segments if job.match else []
            matched = sum(u for _, u in segments_nodes)
            stats.matched_tokens = matched
            stats.match_s = time.perf_counter() - job.t_start
            # The prefix tokens right after the matched ones may be in the shared pool.
            given = self.shared.open(req.prefix, matched, stats, tenant=req.namespace) \
                if use_shared and use_store else None
            n_given = given.n_tokens if given is not None else 0
            new_ids = list(req.prefix[matched + n_given:]) + list(req.query)
            stats.prefix_bytes = matched * self.stored_bytes_per_token_layer * \
                self.math.n_layers
            # Load the matched prefix, recompute it, or recompute its front while the rest
            # loads: `front` tokens are recomputed.
            front = self._choose_plan(segments_nodes, matched, len(new_ids), stats)
            stats.computed_tokens = len(new_ids) + front
            if front >= matched:
                segments_nodes = []      # nothing left to load
        except BaseException:
            job.release(self)
            raise
        job.segments_nodes, job.matched, job.given, job.n_given = \
            segments_nodes, matched, given, n_given
        job.new_ids, job.front = new_ids, front
        if self.policy.exact_reads:     # what a store keeps: canonical calls (canonical.py)
            chunk = self.store.config.chunk_size if self.store is not None else CHUNK_SIZE
            job.canonical_end = len(req.prefix) // chunk * chunk
        return job

    def _first_token(self, job: PrefillJob, tail, out_w) -> None:
        """4. the first token from the last hidden state; streamed now."""
        req, stats = job.req, job.stats
        with stats.timer("compute_s"):
            on_device = self.math.logits(out_w, tail[-1:])
            logits = on_device.cpu()
        sampler = Sampler(req.sampling)
        first = sampler.pick(logits[-1])
        if req.logprobs is not None:
            job.first_scores = step_scores(on_device, [0], [first], [req.logprobs])
        stats.ttft_s = time.perf_counter() - job.t_start
        if job.disk_before is not None and job.matched and job.learn:
            self._learn(stats, job.disk_before, job.matched)
        # The first token goes out now; storing the prefix (5.) follows either way.
        job.going = first not in sampler.stop_token_ids and \
            (req.on_token is None or req.on_token(first) is not False)
        if job.want_query_logits and len(tail) > 1:   # for checks, after the first token
            logits = torch.cat([self.math.logits(out_w, tail[:-1]).cpu(), logits])
        job.sampler, job.first, job.logits = sampler, first, logits

    def _to_decode(self, job: PrefillJob, kept, new_kv) -> Sequence:
        """6. the request's decode context; 5. its new prefix KV handed to the store writer,
        which stores it while the request decodes (its matched prefix stays pinned until
        then; `finish` waits for it)."""
        req, stats = job.req, job.stats
        # 6. decode: a sequence, stepped by serve() alone or by a scheduler in a batch
        logits = job.logits
        seq = Sequence(req, job.sampler, stats, [job.first],
                       [logits[-1].clone()] if req.keep_logits else [],
                       logits if job.want_query_logits else None,
                       position=len(req.prefix) + len(req.query), logprobs=job.first_scores)
        if job.going and req.max_new_tokens > 1:
            if self.config.decode_over == "full" and job.match is not None and \
                    job.match.segments:
                kept = self.prefix.full_prefix_context(job.match.segments, new_kv, stats,
                                                       req.n_pad)
            self._start_decode(seq, kept)
        else:
            seq.done = True
        if job.use_store and self.policy.store_new:
            match, job.match = job.match, None
            seq.stored = self.writer.submit(lambda: self._store_job(job, new_kv, match))
        return seq

    def _store_job(self, job: PrefillJob, new_kv, match) -> None:
        """5. on the writer thread: store the new prefix KV, then unpin the matched prefix.
        A failure leaves the prefix unstored; the request itself has its tokens."""
        try:
            with job.stats.timer("store_s"):
                self._store_new(job.req, job.matched, job.n_given, new_kv, job.stats,
                                job.use_shared)
        except CorruptNode as exc:
            # A node it had to split failed its CRC check: out of service, as on a read.
            self.store.quarantine(exc.node, str(exc))
            log.warning("prefix not stored: %s", exc)
        except Exception as exc:  # noqa: BLE001 - storing is best effort for this request
            log.warning("prefix not stored: %s", exc, exc_info=True)
        finally:
            if match is not None:
                self.store.release(match)

    def _store_new(self, req: Request, matched: int, n_given: int, new_kv, stats,
                   use_shared: bool) -> None:
        """The prefix's new whole chunks into the store, then (exact KV only) the pool."""
        n_prefix_new = len(req.prefix) - matched
        if n_prefix_new < self.store.config.chunk_size:
            return
        if n_given and not self.shared.keyed:
            # KV from a pool without a secret is unauthenticated (whoever can write to the
            # pool can forge it with a valid CRC): it served this request, but neither it
            # nor what was computed over it becomes local state. The chunks computed here
            # still go to the pool, which gave the rest.
            self.shared_unstored += 1
            if self.shared_unstored == 1:
                log.warning("shared pool without a secret: prefixes read from it are used "
                            "but not stored locally")
        else:
            prefix_kv = [(k[:, :n_prefix_new], v[:, :n_prefix_new]) for k, v in new_kv]
            try:
                self.store.insert(req.prefix, matched, prefix_kv, namespace=req.namespace,
                                  exact=stats.exact)
            except StoreWriteFailed as exc:
                log.warning("prefix not stored: %s", exc)
                return
        if use_shared and stats.exact:
            # Durable here first; then shared (write-through, in the background): the
            # chunks the pool did not give us. Only exact KV is shared: the pool keeps no
            # flag.
            self.shared.publish(req.prefix, matched + n_given,
                                [(k[:, n_given:n_prefix_new], v[:, n_given:n_prefix_new])
                                 for k, v in new_kv], tenant=req.namespace)

    def _start_decode(self, seq: Sequence, kept) -> None:
        """The sequence's decode context: pages of a decode-phase policy, or per layer the
        kept K, V and mask with room for the tokens to come."""
        t0 = time.perf_counter()
        seq.pages = self.policy.start_decode(kept, self.math.n_head, self.device)
        extra = seq.request.max_new_tokens - 1
        group = self.math.n_head // self.math.n_kv_head
        seq.kv = [None if seq.pages is not None and seq.pages.handles(layer) else
                  decode_context(*kept[layer], extra, group, self.rt.policy)
                  for layer in range(self.math.n_layers)]
        seq.decode_s = time.perf_counter() - t0

    # -- plan -------------------------------------------------------------------------------
    def _choose_plan(self, segments_nodes, matched: int, n_new: int, stats) -> int:
        """How many leading prefix tokens to recompute rather than load (0: load all)."""
        mode = self.config.plan
        if not segments_nodes or mode == "load":
            stats.plan, stats.plan_split = "load", 0
            stats.plan_reason = "forced" if segments_nodes else "no-match"
            return 0
        if mode == "recompute":
            stats.plan, stats.plan_split = "recompute", matched // self.store.config.chunk_size
            stats.plan_reason = "forced"
            return matched
        with stats.timer("plan_s"):
            plan = self.planner.choose(mode, segments_nodes, matched, n_new)
        stats.plan, stats.plan_split = plan.mode, plan.split_chunks
        stats.plan_reason = getattr(plan, "reason", "predicted")
        stats.predicted_ttft_s = plan.predicted_s
        return plan.split_chunks * self.store.config.chunk_size

    def _learn(self, stats, disk_before, matched: int) -> None:
        """Feed the planner what this request's reads and time to first token showed."""
        read, busy = self.store.reader.counters()
        loaded = 2 * self.math.n_layers * (matched // self.store.config.chunk_size -
                                           stats.plan_split)
        self.planner.observe(stats, read - disk_before[0], busy - disk_before[1], loaded)

    def measure_prefill(self, n: int, ctx: int = 0) -> float:
        """Seconds to prefill n tokens over ctx earlier ones (their KV given, no I/O) and
        take the first token: one point of the planner's prefill curve."""
        vocab = self.rt.spec.config.vocab_size
        ids = np.random.default_rng(n * 7919 + ctx).integers(10, vocab, n).tolist()
        stats = RequestStats()
        given = ContextKV(ctx, self.math.n_kv_head, self.math.head_dim) if ctx else None
        with self._serving:
            t0 = time.perf_counter()
            _, _, tail, out_w = self.layers.prefill(ids, 0, [], stats, n_hidden=1, given=given)
            self.math.logits(out_w, tail[-1:]).cpu()
            return time.perf_counter() - t0

    # -- the batch runner's layer pieces (decode steps share them with prefill) ------
    def _weights(self, j: int, stats: RequestStats):
        return self.layers.weights(j, stats)

    def _mlp(self, j: int, hidden, stats) -> None:
        self.layers.mlp(j, hidden, stats)

    def _attend(self, q, keys, values, mask, causal_tail: int, front: int = 0) -> torch.Tensor:
        return self.layers.attend(q, keys, values, mask, causal_tail, front)


class _Relay:
    """A request's on_token across the retries of serve(): a retry after corrupt KV was
    found recomputes from the start and produces the same tokens again (greedy, or the same
    seed); only those past what the caller already has are passed on."""

    def __init__(self, on_token: Callable[[int], bool]):
        self.on_token = on_token
        self.sent = 0      # tokens passed on, over all attempts
        self.at = 0        # tokens produced in this attempt

    def restart(self) -> None:
        self.at = 0

    def __call__(self, token: int) -> bool:
        self.at += 1
        if self.at <= self.sent:
            return True
        self.sent = self.at
        return self.on_token(token)

