"""Request files: your own requests served through the store, one JSON object a line (plain
or OpenAI batch lines), a window of them in flight, one result line each in input order.
The output file is replaced only once the run is complete; --resume keeps what it holds.
"""
from __future__ import annotations

import sys

from ..errors import UserError
from .args import write_json


def open_request_file(args, spec, tokenizer):
    """Before the model is built: the output path checked (and, with --resume, the ids
    already in it read), then every line of the request file. (requests, results or None,
    how many requests are left to serve)."""
    from ..frontend import Frontend
    from .request_files import RequestFile
    from .results_file import ResultsFile

    results = None if args.output is None else \
        ResultsFile(args.output, args.requests, resume=args.resume)
    requests = RequestFile(args.requests, Frontend(spec, tokenizer, args.chunk_size),
                           max_tokens=args.request_max_tokens)
    todo = requests.check(results.ids if results is not None else frozenset())
    if results is not None and results.resume:
        results.match(requests.skipped)
        damage = results.describe_damage()
        if damage:
            print(f"python -m impress_flexgen.run: warning: {damage}", file=sys.stderr)
    if not todo:
        if results.damaged:          # nothing to serve, but lines to drop: rewrite it now
            results.start()
            results.commit()
        print(f"all {results.kept} requests of {args.requests} are already in {args.output}; "
              "nothing to serve")
    return requests, results, todo


class _Totals:
    """Running totals of what a request file's run served (memory does not grow with the
    file, but for 8 bytes of TTFT per request)."""

    def __init__(self):
        from array import array

        from ..planner import PLAN_KINDS

        self.served = self.errors = self.matched = self.prompt = self.shared = 0
        self.ttft = array("d")
        self.plans = dict.fromkeys(PLAN_KINDS, 0)

    def add(self, done) -> None:
        from ..tiers import REMOTE

        s = done.stats
        self.served += 1
        self.matched += s["matched_tokens"]
        self.prompt += done.prompt_tokens
        self.shared += s["bytes_read"].get(REMOTE, 0)
        self.ttft.append(s["ttft_s"])
        if s["plan"] in self.plans:
            self.plans[s["plan"]] += 1


def serve_requests(rt, config, args, requests, results, todo: int) -> int:
    """Serve a request file's jobs through the store, a window of them in flight (the
    service's queue: requests run together where the service batches them), and write one
    result line each in input order. The output is replaced only at the end."""
    import collections

    import numpy as np
    from tqdm import tqdm

    from ..errors import ServiceError
    from ..service import Service
    from .request_files import batch_record

    totals = _Totals()
    kept = [] if args.json and results is None else None   # --json holds them without --output
    model = rt.spec.name
    window: collections.deque = collections.deque()        # (entry, ticket or None)
    depth = max(1, config.queue_size)

    def show(entry, done, error) -> None:
        if error is not None:
            tqdm.write(f"--- {entry.id}: error {error.status}: {error.message}")
            return
        s = done.stats
        tqdm.write(f"--- {entry.id}: {done.prompt_tokens} prompt tokens "
                   f"({s['matched_tokens']} from the store, {s['shared_tokens']} from the "
                   f"shared pool; plan {s['plan'] or '-'}), {done.completion_tokens} new "
                   f"({done.finish_reason}), TTFT {s['ttft_s']:.3f} s")
        tqdm.write(f"+++ {done.text}")

    def settle(bar) -> None:
        """The oldest request in flight: wait for it, write its line."""
        entry, ticket = window.popleft()
        done, error = None, entry.error
        if ticket is not None:
            try:
                done = ticket.future.result()
            except ServiceError as exc:
                if not requests.batch:
                    raise UserError(f"request {entry.id} ({requests.path} line {entry.line}): "
                                    f"{exc.message}") from None
                error = exc
        if done is not None:
            totals.add(done)
        else:
            totals.errors += 1
        record = batch_record(entry, model, done, error) if requests.batch else done.record()
        if results is not None:
            results.write(record)
        else:
            show(entry, done, error)
        if kept is not None:
            kept.append(record)
        bar.update(1)

    def submit(service, job, bar):
        while True:
            try:
                return service.submit(job)
            except ServiceError as exc:
                if exc.status != 429 or not window:
                    raise UserError(f"request {job.id or '-'}: {exc.message}") from None
                settle(bar)     # the service holds fewer than the window: wait for one

    ok = False
    try:
        if results is not None:
            results.start()
        # Every line was checked already; a request file waits as long as its requests take.
        with Service(config, runtime=rt, tokenizer=rt.tokenizer) as service:
            for line in service.describe_serving():   # model, placement: above
                print(line)
            for warning in service.warnings:
                print(f"python -m impress_flexgen.run: warning: {warning}", file=sys.stderr)
            # The service's frontend from here on: one tokenizer, used under one lock by
            # this thread (building) and the service's (decoding).
            requests.frontend = service.frontend
            try:
                with tqdm(total=todo, desc="requests", unit="req", disable=None) as bar:
                    for entry in requests.entries(results.ids if results else frozenset()):
                        while len(window) >= depth:
                            settle(bar)
                        ticket = None if entry.job is None else submit(service, entry.job, bar)
                        window.append((entry, ticket))
                    while window:
                        settle(bar)
            finally:
                for _, ticket in window:      # stopped early: the rest is not served
                    if ticket is not None:
                        ticket.cancel()
        ok = True
    finally:
        if results is not None and results.finish(ok) and not ok:
            print(f"kept {results.kept + results.written} results in {args.output}; "
                  "--resume continues from there")
    ttft = totals.ttft
    plans = totals.plans
    print(f"{totals.served} requests: {totals.matched} of {totals.prompt} prompt tokens from "
          "the store, TTFT " + (f"mean {np.mean(ttft):.3f} s, P99 {np.percentile(ttft, 99):.3f} s"
                                if len(ttft) else "-")
          + "; plans " + ", ".join(f"{p} {n}" for p, n in plans.items())
          + f"; {totals.shared / 2**20:.1f} MiB from the shared pool"
          + (f"; {totals.errors} answered with an error" if totals.errors else "")
          + (f"; {results.kept} earlier results kept" if results and results.kept else "")
          + (f"; results in {args.output}" if args.output else ""))
    summary = {"model": model, "policy": args.policy, "plans": plans,
               "shared_bytes": totals.shared, "requests": totals.served,
               "errors": totals.errors}
    summary.update({"results": kept} if kept is not None else {"output": args.output})
    write_json(args.json, summary)
    return 0
