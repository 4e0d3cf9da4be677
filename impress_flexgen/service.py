"""The queue and the worker in front of the engine: what the HTTP server and request files
serve through.

    service = Service(ServiceConfig(model="smollm2-135m"))
    job = service.frontend.build(prompt="It is a truth universally acknowledged")
    done = service.complete(job)          # Completion(text, token_ids, finish_reason, stats)
    service.close()

Prefix reuse is automatic: all whole chunks of the prompt but the last token form the
engine's prefix (Job.split), so every full chunk is matched against the persistent radix
store and what was not stored yet is inserted; a shared system prompt or a growing
conversation is reused by the next request, and by the next process opened on the same store.

Requests wait in a bounded queue in front of one worker thread that steps the engine
(continuous batching: engine/scheduler.py). A full queue refuses at once (429); each
request has a deadline and a cancel flag (a client that went away), checked as every token
is produced.
The configuration is config.ServiceConfig; prompts become jobs in frontend.py; the metrics
are metrics.py's.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from typing import Callable

from .config import ServiceConfig
from .models import dtypes
from .errors import ServiceError, UserError
from .frontend import Completion, Frontend, Job, TextStream
from .metrics import Drain, ServiceMetrics

log = logging.getLogger("impress_flexgen.service")


class Ticket:
    """A submitted job: its result (a Future), its cancel flag and its deadline."""

    def __init__(self, job: Job, timeout_s: float, listener: Callable[[str], None] | None):
        self.job = job
        self.arrived = time.monotonic()
        self.deadline = self.arrived + timeout_s
        self.listener = listener
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop at the next token (or skip it, if still queued)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Service:
    """Jobs in (submit, complete), completions out, one worker thread over the engine."""

    def __init__(self, config: ServiceConfig | None = None, runtime=None, tokenizer=None):
        """Builds the runtime (unless one is given: then it stays the caller's to close),
        opens the store, builds the engine (its planner calibrated, its shared pool asked
        once) and starts the worker."""
        from . import cpu_threads
        from .engine.assemble import start_engine

        config = self.config = config if config is not None else ServiceConfig()
        self._owns_runtime = runtime is None
        self.rt = self.store = self.engine = None
        try:
            self._assemble(config, runtime, tokenizer)
            self.model_name = self.rt.spec.name
            self.frontend = Frontend(self.rt.spec, tokenizer or self.rt.tokenizer,
                                     config.run.chunk_size)
            # Before any request: none pays for calibrating, none waits on a dead pool. On
            # a thread that ends with it: the worker is to be the one thread that keeps a
            # CPU team (cpu_threads).
            self.warnings = cpu_threads.on_passing_thread(start_engine, self.engine)
        except BaseException:
            self._close_engine_store_and_runtime()
            raise
        self.created = int(time.time())
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self._lock = threading.Lock()
        self._closing = False
        self._closed = False
        self.scheduler = self.engine.scheduler
        self.scheduler.arrived = lambda: not self._queue.empty()
        self.metrics = ServiceMetrics(self._queue, self.scheduler, self.engine, self.store)
        self.drain = Drain()       # how fast requests leave: a 429's Retry-After
        # The worker thread runs while there is work and ends when idle: an idle service
        # keeps no CPU team that would slow another's products (cpu_threads).
        self._worker: threading.Thread | None = None
        self._tickets: dict[int, tuple] = {}   # sequence id -> (ticket, ended, started)

    def _assemble(self, config: ServiceConfig, runtime, tokenizer) -> None:
        """The policy, the runtime (unless given), the store root claimed, the store and
        the engine with its tiers: self.policy, rt, store_dir, store, engine, each set as
        soon as it is built (so that a failure closes what was). Everything that can be
        refused (an unknown policy or model, a foreign store root) is refused before the
        model is built."""
        from policies import POLICY_NAMES

        from .engine import SchedulerConfig, model_shape
        from .engine.assemble import StoreSpec, assemble, make_serving_policy
        from .models.runtime import Runtime, resolve_spec
        from .store.root import _store_name, claim_store_root

        run = config.run
        if run.policy.partition(":")[0] not in POLICY_NAMES:
            raise UserError(f"unknown policy '{run.policy}'; choose from "
                            f"{', '.join(POLICY_NAMES)}")
        if runtime is None:
            rcfg = config.runtime_config()
            spec = resolve_spec(rcfg)
            shape = model_shape(spec, run.chunk_size, run.kv_format)
            root = config.store.root_for(shape)
            claim_store_root(root)
            runtime = Runtime(rcfg, spec=spec, tokenizer=tokenizer)
        else:
            shape = model_shape(runtime.spec, run.chunk_size, run.kv_format)
            root = config.store.root_for(shape)
            claim_store_root(root)
        self.rt = runtime
        self.policy = make_serving_policy(run.policy, run.serving(), run.tier_policy)
        self.store_dir = root / _store_name(run.policy, run, shape.kv_format) \
            if self.policy.reuse else None
        store_spec = None if self.store_dir is None else StoreSpec(
            self.store_dir, **config.store.open_options(), **run.store_options())
        pieces = {} if config.score_piece_tokens is None else \
            {"score_piece_tokens": config.score_piece_tokens}
        stack = assemble(runtime, self.policy, store_spec, config.tiers,
                         scheduling=SchedulerConfig(config.max_batch_size,
                                                    config.max_batch_tokens, **pieces))
        self.store, self.engine = stack.store, stack.engine
        if config.throughput:        # the block schedule: micro-batches of the runtime's
            self.engine.runner.micro_batch = config.runtime.gpu_batch_size

    def describe(self) -> list[str]:
        """Lines for a user: what is served, from where, how."""
        import torch

        spec = self.rt.spec
        weights = f"random (seed {spec.seed})" if spec.random_weights else "real"
        device = "cuda" if torch.cuda.is_available() else "cpu only"
        return [f"model {spec.name} ({spec.family}, {dtypes.name(spec.config.dtype)}, {device}), "
                f"weights {weights}, {spec.config.max_seq_len} positions",
                f"placement: {self.rt.cfg.placement.describe()}",
                *self.describe_serving(),
                f"queue: {self.config.queue_size} requests, timeout "
                f"{self.config.timeout_s:g} s"]

    def describe_serving(self) -> list[str]:
        """The policy, its store and tiers; the plan mode and the shared pool."""
        if self.store is None:
            return [f"policy {self.policy.name}: no store (prefixes are recomputed)"]
        held = len(self.store.inspect().state.tree)
        tiers = self.config.tiers
        plan = self.config.plan_line()
        if self.engine.shared is None and tiers.remote_url:
            plan += " (not used: this policy reads no store)"
        elif self.engine.shared is not None and self.engine.shared.tier.metrics()["down"]:
            plan += " (not answering: requests are served locally)"
        return [f"policy {self.policy.name}, store {self.store_dir} "
                f"({held} stored prefix nodes{', reused' if held else ''}); tiers GPU "
                f"{tiers.gpu_bytes / 2**20:.0f} MiB, CPU {tiers.cpu_bytes / 2**20:.0f} MiB "
                f"({tiers.copies})",
                plan]

    def metrics_text(self) -> bytes:
        """The metrics in Prometheus' exposition format."""
        return self.metrics.text()

    def count(self, outcome: str) -> None:
        """Count a request by its outcome (one of metrics.OUTCOMES)."""
        self.metrics.count(outcome)

    # -- requests -----------------------------------------------------------------------------
    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, job: Job, listener: Callable[[str], None] | None = None) -> Ticket:
        """Queue a job; `listener` gets the text as it is generated (on the worker thread).
        ServiceError 429 when the queue is full, 503 once closing."""
        return self.submit_choices([job], [listener])[0]

    def submit_choices(self, jobs: list[Job], listeners=None) -> list[Ticket]:
        """Queue the choices of one request (n) as one entry: all of them or none (429).
        Choices that score one prompt share its prefill and its scores."""
        listeners = listeners or [None] * len(jobs)
        tickets = [Ticket(job, self.config.timeout_s, listener)
                   for job, listener in zip(jobs, listeners)]
        with self._lock:
            if self._closing:
                raise ServiceError(503, "the server is shutting down", kind="server_error",
                                   code="shutting_down")
            try:
                self._queue.put_nowait(tickets)
            except queue.Full:
                self.count("rejected")
                queued = self._queue.qsize()
                wait_s = self.drain.retry_after_s(queued)
                raise ServiceError(429, f"server busy: {queued} requests queued; retry in "
                                        f"{wait_s} s", kind="rate_limit_error",
                                   code="rate_limit_exceeded", retry_after_s=wait_s) from None
            # One request leaves the queue's backlog when its last choice is answered.
            left = [len(tickets)]

            def one_done(_):
                left[0] -= 1
                if left[0] == 0:
                    self.drain.left()

            for ticket in tickets:
                ticket.future.add_done_callback(one_done)
            self._start_worker()
        return tickets

    def _start_worker(self) -> None:
        """Start the worker thread unless it runs (with self._lock held)."""
        if self._worker is None or not self._worker.is_alive():
            self.drain.busy()
            self._worker = threading.Thread(target=self._work, name="engine-worker",
                                            daemon=True)
            self._worker.start()

    def complete(self, job: Job) -> Completion:
        """Serve one job and wait for it (ServiceError if it could not be served)."""
        return self.submit(job).future.result()

    def _work(self) -> None:
        """The loop: take queued tickets while the batch has room (those that arrive within
        batch_gather_s of each other once one came to an idle batch), then one engine step
        (admit, prefill, one decode step), answering the requests it finished. Ends when
        nothing runs and nothing is queued; submit() starts it again."""
        sched = self.scheduler
        gather_s = self.config.batch_gather_s
        closing = False
        while True:
            gathering = False
            while not closing and sched.room():
                try:
                    if not sched.busy:          # idle: its burst, or end until submit()
                        with self._lock:
                            try:
                                tickets = self._queue.get_nowait()
                            except queue.Empty:
                                self._worker = None
                                return
                        gathering = gather_s > 0
                    elif gathering:
                        tickets = self._queue.get(timeout=gather_s)
                    else:
                        tickets = self._queue.get_nowait()
                except queue.Empty:
                    break
                if tickets is None:
                    closing = True     # after every queued request: serve them, then stop
                    break
                self._admit(tickets)
            if not sched.busy:
                if closing:
                    return
                continue
            batch_before = sched.steps
            for seq in self.engine.step():
                self._answer(*self._tickets.pop(seq.id), seq.response, seq.error)
            if sched.steps != batch_before:
                self.metrics.batch(sched.last_batch)

    def _admit(self, tickets: list[Ticket]) -> None:
        """Hand a request's choices to the engine (or fail them now: cancelled, expired,
        malformed): a sequence per choice, or one for all the choices of a scored prompt."""
        taken = []
        for ticket in tickets:
            try:
                request, ended = self._request(ticket)
            except ServiceError as exc:
                ticket.future.set_exception(exc)
                continue
            taken.append((ticket, request, ended, time.monotonic()))
        if len(taken) > 1 and taken[0][1].prompt_logprobs is not None:
            groups = [taken]          # one prefill for the choices of a scored prompt
        else:
            groups = [[one] for one in taken]
        for group in groups:
            try:
                lead = self.engine.add_request(group[0][1],
                                               choices=[one[1] for one in group[1:]])
            except Exception as exc:  # noqa: BLE001 - refused here, answered as any failure
                for ticket, _, ended, started in group:
                    self._answer(ticket, ended, started, None, exc)
                continue
            for seq, (ticket, _, ended, started) in zip([lead, *lead.choices], group):
                self._tickets[seq.id] = (ticket, ended, started)

    def _answer(self, ticket: Ticket, ended: dict, started: float, resp, error) -> None:
        """Complete a ticket with its response, or fail it with what went wrong."""
        try:
            if error is not None:
                raise error
            ticket.future.set_result(self._complete(ticket, resp, ended, started))
        except ServiceError as exc:
            ticket.future.set_exception(exc)
        except UserError as exc:
            self.count("invalid")
            ticket.future.set_exception(ServiceError(400, str(exc)))
        except Exception as exc:  # noqa: BLE001 - one request failed; keep serving
            log.error("request failed", exc_info=exc)
            self.count("error")
            ticket.future.set_exception(ServiceError(500, f"internal error: {exc}"))

    def _request(self, ticket: Ticket):
        """The engine request of a ticket, with its streaming, stop strings, cancellation
        and deadline in on_token; ServiceError if cancelled or expired while queued."""
        from .engine import Request

        job = ticket.job
        started = time.monotonic()
        if ticket.cancelled:
            self.count("cancelled")
            raise ServiceError(499, "the request was cancelled", code="cancelled")
        if started > ticket.deadline:
            self.count("timeout")
            raise ServiceError(504, f"the request waited longer than the "
                                    f"{self.config.timeout_s:g} s timeout", code="timeout",
                               kind="timeout_error")
        stream = TextStream(self.frontend.decode, job.stop, ticket.listener, job.min_tokens)
        ended = {"stream": stream}  # why generation ended early, and when the first token came

        def on_token(token: int) -> bool:
            ended.setdefault("first", time.monotonic())
            if job.max_tokens == 0:     # the prompt scored; the one token made is dropped
                return False
            if not stream.push(token):
                ended["reason"] = "stop"
                return False
            if ticket.cancelled:
                ended["reason"] = "cancelled"
                return False
            if time.monotonic() > ticket.deadline:
                ended["reason"] = "timeout"
                return False
            return True

        prefix, query = job.split()
        # max_tokens 0 (echo: the prompt's log-probabilities only) still computes one token,
        # dropped from the completion.
        return Request(prefix, query, max(1, job.max_tokens), sampling=job.sampling,
                       on_token=on_token, namespace=job.namespace, logprobs=job.logprobs,
                       prompt_logprobs=(job.logprobs or 0) if job.prompt_logprobs else None
                       ), ended

    def _complete(self, ticket: Ticket, resp, ended: dict, started: float) -> Completion:
        job = ticket.job
        stream = ended["stream"]
        done = time.monotonic()
        tokens = list(resp.tokens)[:job.max_tokens]
        reason = ended.get("reason") if job.max_tokens else "length"
        if reason is None:
            if tokens and tokens[-1] in job.sampling.stop_token_ids:
                reason = "stop"
            else:
                reason = "length"
        if tokens and tokens[-1] in job.sampling.stop_token_ids:
            tokens.pop()   # the stop token is not part of the completion
        text = stream.finish()
        first = ended.get("first", done)
        st = resp.stats
        stats = {"ttft_s": first - ticket.arrived, "queue_s": started - ticket.arrived,
                 "total_s": done - ticket.arrived, "engine_ttft_s": st.ttft_s,
                 "prefix_tokens": st.prefix_tokens, "matched_tokens": st.matched_tokens,
                 "computed_tokens": st.computed_tokens, "bytes_read": dict(st.bytes_read),
                 "probe_bytes": st.probe_bytes, "layers_fallback": st.layers_fallback,
                 "bytes_from_pass": st.bytes_from_pass,
                 "layers": st.layers if st.matched_tokens else 0,
                 "decode_s_per_token": st.decode_s_per_token,
                 "weight_bytes": st.weight_bytes, "weight_wait_s": st.weight_wait_s,
                 "plan": st.plan if st.matched_tokens else None, "plan_split": st.plan_split,
                 "plan_reason": st.plan_reason if st.matched_tokens else None,
                 "predicted_ttft_s": st.predicted_ttft_s, "shared_tokens": st.shared_tokens,
                 # Prompt tokens whose KV was read (store or shared pool), not computed:
                 # matched tokens a plan recomputed are not among them.
                 "cached_tokens": max(0, len(job.ids) - st.computed_tokens)}
        self.metrics.observe(stats, len(tokens), reason, st.decode_s_per_token
                             if len(resp.tokens) > 1 else None)
        completion = Completion(job.id or f"cmpl-{uuid.uuid4().hex[:24]}", text, tokens,
                                reason, len(job.ids), stats)
        if job.logprobs is not None:
            completion.logprobs = resp.logprobs[:len(tokens)]
        # The prompt's scores as the engine made them (shared by the choices): the caller
        # turns them into text, off this thread.
        completion.prompt_scores = resp.prompt_scores
        return completion

    # -- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Refuse new requests, serve those already queued, then close the store and (if
        this service built it) the runtime."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._closed = True
        self._queue.put(None)     # after every queued request (a full queue has a worker)
        with self._lock:
            self._start_worker()
            worker = self._worker
        worker.join()
        self._close_engine_store_and_runtime()

    def _close_engine_store_and_runtime(self) -> None:
        try:
            if self.engine is not None:
                self.engine.close()       # the shared pool's threads
        finally:
            try:
                if self.store is not None:
                    self.store.close()
            finally:
                if self._owns_runtime and self.rt is not None:
                    self.rt.close()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
