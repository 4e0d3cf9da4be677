"""impress_flexgen's main job: serve a workload of reused prefixes with a policy, report.

    python -m impress_flexgen.run                        # smollm2-135m, built-in workload
    python -m impress_flexgen.run --compare recomp,as_like,impress --check
    python -m impress_flexgen.run --model opt-30b --placement 0,100,0,100,100,0 --quick
    python -m impress_flexgen.run --prompt "It is a truth"   # plain generation, no store
    python -m impress_flexgen.run --requests in.jsonl --output out.jsonl   # through the store
    python -m impress_flexgen.run --requests batch.jsonl --output out.jsonl --resume

Requests are (prefix, query) pairs cut from public-domain books: a few long prefixes, each
reused by several queries. The prefix KV lives in a store on local disk (reused by the next
run), with GPU and CPU tiers in front of it.
"""
from __future__ import annotations

import sys
from pathlib import Path

from . import defaults
from .store_root import STORE_ROOT_MARK, _store_name, claim_store_root  # noqa: F401
from .cli import (ArgumentParser, add_model_args, add_serving_args, check_serving_args,
                  int_range, run_main, write_json)
from .errors import UserError

GB = 1 << 30
WORKLOAD_MAX_NEW_TOKENS = 8     # the paper workload's; request files use defaults.MAX_TOKENS


def parse_args(argv):
    p = ArgumentParser(prog="python -m impress_flexgen.run",
                       description="Serve reused long prefixes from a multi-tier KV store.")
    add_model_args(p, default_model="smollm2-135m")
    g, _ = add_serving_args(p, "default: 10%% of the workload's prefix KV",
                            "default: 25%% of the workload's prefix KV")
    g.add_argument("--compare", metavar="A,B,...", help="serve the same workload with each policy")
    g.add_argument("--check", action="store_true",
                   help="also serve with full KV and report agreement (KL, top-1) with it")
    g.add_argument("--max-new-tokens", type=int_range(1), default=None,
                   help=f"tokens generated per query (default {WORKLOAD_MAX_NEW_TOKENS}; for a "
                        f"request file: where a request sets no max_tokens, default "
                        f"{defaults.MAX_TOKENS})")
    w = p.add_argument_group("workload")
    w.add_argument("--prefixes", type=int_range(1), default=4, help="distinct shared prefixes (4)")
    w.add_argument("--prefix-tokens", type=int_range(1), default=1024,
                   help="tokens per prefix (1024)")
    w.add_argument("--queries", type=int_range(1), default=3,
                   help="measured queries per prefix (3)")
    w.add_argument("--query-tokens", type=int_range(1), default=64, help="tokens per query (64)")
    w.add_argument("--distribution", choices=("shuffle", "zipf", "normal"), default="shuffle",
                   help="how queries pick prefixes")
    w.add_argument("--workload", choices=("natural", "padded"), default="natural",
                   help="natural long text, or short real prefixes left-padded with masked "
                        "pad tokens to --prefix-tokens positions (the paper's setting)")
    w.add_argument("--real-tokens", type=int_range(1), default=512,
                   help="real tokens per prefix in the padded workload (512)")
    w.add_argument("--quick", action="store_true", help="2 prefixes x 512 tokens, 2 queries each")
    gen = p.add_argument_group("your own prompts (--prompt: plain generation, no store)")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="generate from this text instead of serving the workload; repeatable")
    src.add_argument("--prompt-ids", action="append", metavar="IDS",
                     help="generate from comma-separated token ids; repeatable")
    src.add_argument("--requests", metavar="FILE.jsonl",
                     help="serve your own requests through the store, one JSON object a line: "
                          '{"prompt": TEXT} or {"messages": [{"role", "content"}, ...]} or '
                          '{"prompt_ids": [IDS]}, optionally with max_tokens (default '
                          f"{defaults.MAX_TOKENS}), temperature (default "
                          f"{defaults.TEMPERATURE:g}; 0: greedy), top_p (default "
                          f"{defaults.TOP_P:g}), seed, stop (a string or a list) and id; or "
                          "OpenAI batch lines (custom_id, method, url, body) as vllm run-batch "
                          "reads them")
    gen.add_argument("--output", metavar="OUT.jsonl",
                     help="with --requests: write one JSON line per request here (plain: id, "
                          "text, token_ids, finish_reason, stats; batch: OpenAI's batch output "
                          "lines), in input order; the file is replaced only once the run is "
                          "complete")
    gen.add_argument("--resume", action="store_true",
                     help="with --output: keep the results already in OUT.jsonl and serve "
                          "only the requests whose id is not there yet")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.prefixes, args.prefix_tokens, args.queries = 2, 512, 2
        args.real_tokens = min(args.real_tokens, 128)
    if args.workload == "padded" and not args.real_tokens < args.prefix_tokens:
        p.error("--real-tokens must be below --prefix-tokens")
    if args.prompt is not None and any(text == "" for text in args.prompt):
        p.error("--prompt is empty: give some text")
    args.prompt_token_ids = None
    if args.prompt_ids is not None:
        try:
            args.prompt_token_ids = [[int(x) for x in s.split(",") if x.strip()]
                                     for s in args.prompt_ids]
        except ValueError:
            p.error("--prompt-ids takes comma-separated integers")
        if any(not ids for ids in args.prompt_token_ids):
            p.error("--prompt-ids is empty: give at least one token id")
    if args.output is not None and args.requests is None:
        p.error("--output goes with --requests")
    if args.resume and args.output is None:
        p.error("--resume goes with --output (it continues an earlier --output)")
    # A request file's own default (shared by every entry point) applies where no
    # --max-new-tokens is given; the built-in workload keeps its own.
    args.request_max_tokens = args.max_new_tokens
    if args.max_new_tokens is None:
        args.max_new_tokens = WORKLOAD_MAX_NEW_TOKENS
    if args.requests is not None and (args.compare or args.check):
        p.error("--requests serves with one --policy (no --compare or --check)")
    names = args.compare.split(",") if args.compare else [args.policy]
    check_serving_args(p, args, names)
    args.policies = names
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from .runtime import Runtime, resolve_spec
    from .service import DEFAULT_TIER_BYTES, ServiceConfig

    # A request file is served with a server's tiers; the built-in workload's default tiers
    # are a share of its prefix KV (serve()): the runtime leaves room for what was sized.
    config = ServiceConfig.from_args(args, timeout_s=float("inf"), default_tiers=(
        DEFAULT_TIER_BYTES if args.requests is not None else (0, 0)))
    cfg = config.runtime_config()
    # Everything that can be refused is refused before the model is built.
    spec = resolve_spec(cfg)
    tokenizer = requests = results = None
    if args.prompt or args.requests:
        from .runtime import load_tokenizer

        tokenizer = load_tokenizer(spec)
    if args.prompt:
        args.prompt_token_ids = [tokenizer.encode(t) for t in args.prompt]
    store_root = None
    if args.requests is not None:
        requests, results, todo = open_request_file(args, spec, tokenizer)
        if not todo:
            return 0
        claim_store_root(config.store.root_for(spec, args.chunk_size))
    elif args.prompt_token_ids is not None:
        check_prompts(spec, args.prompt_token_ids, args.max_new_tokens)
    else:
        check_workload(spec, args)
        store_root = config.store.root_for(spec, args.chunk_size)
        claim_store_root(store_root)
    with Runtime(cfg, spec=spec, tokenizer=tokenizer) as rt:
        device = "cuda" if torch.cuda.is_available() else "cpu only"
        weights = f"random (seed {rt.spec.seed})" if rt.spec.random_weights else "real"
        print(f"model {rt.spec.name} ({rt.spec.family}, {rt.spec.config.dtype.__name__}, "
              f"{device}), weights {weights}, built in {rt.load_s:.1f} s")
        print(f"placement: {rt.placement.describe()}")
        if requests is not None:
            return serve_requests(rt, config, args, requests, results, todo)
        if store_root is None:
            return generate(rt, args)
        return serve(rt, args, store_root)


def check_prompts(spec, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Each prompt is non-empty, within the vocabulary, and fits the model's positions."""
    from .runtime import check_lengths

    vocab = spec.config.vocab_size
    for i, ids in enumerate(prompts):
        what = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
        check_lengths(spec, len(ids), max_new_tokens, what=what)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")


def check_workload(spec, args) -> None:
    """A request is a whole prefix plus a query, then --max-new-tokens generated."""
    from .runtime import check_lengths

    check_lengths(spec, args.prefix_tokens + args.query_tokens, args.max_new_tokens,
                  what=f"a request (--prefix-tokens {args.prefix_tokens} + --query-tokens "
                       f"{args.query_tokens})")


def serve(rt, args, root: Path) -> int:
    from tqdm import tqdm

    from .service import ServiceConfig, redact_url
    from .serving import kv_bytes_per_token, run_workload
    from .workload import WorkloadConfig, build_workload

    wl = build_workload(rt.tokenizer, WorkloadConfig(
        n_prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
        queries_per_prefix=args.queries, query_tokens=args.query_tokens,
        distribution=args.distribution, mode=args.workload, real_tokens=args.real_tokens))
    pool = args.prefixes * args.prefix_tokens * kv_bytes_per_token(rt)
    names = (["full"] if args.check and "full" not in args.policies else []) + args.policies
    # One configuration per policy, from the same flags; tiers not sized: 10% and 25% of
    # the workload's prefix KV.
    configs = {name: ServiceConfig.from_args(args, policy=name,
                                             default_tiers=(int(0.10 * pool), int(0.25 * pool)))
               for name in names}
    config = configs[names[-1]]
    tiers, store = config.tiers, config.store
    print(f"workload: {args.prefixes} prefixes x {args.prefix_tokens} tokens from "
          f"{', '.join(sorted(set(wl.sources)))}; {len(wl.queries)} queries of "
          f"{args.query_tokens} tokens ({args.distribution}); prefix KV {pool / 2**20:.1f} MiB")
    disk = "unlimited" if store.disk_capacity_bytes is None else \
        f"{store.disk_capacity_bytes / GB:g} GB"
    print(f"tiers: GPU {tiers.gpu_bytes / 2**20:.1f} MiB, CPU {tiers.cpu_bytes / 2**20:.1f} MiB, "
          f"disk {disk}; store {root}")
    print(config.plan_line())
    reference = {} if args.check else None
    results, sample = [], {}
    # disable=None: no progress bar when stderr is not a terminal (logs, pipes).
    with tqdm(total=len(names) * len(wl.queries), desc="requests", unit="req",
              disable=None) as bar:
        for name in names:
            config = configs[name]
            store_dir = root / _store_name(name, config.run)
            if (store_dir / "store.sqlite").exists():
                tqdm.write(f"{name}: reusing the store left by an earlier run in {store_dir}")

            def keep_sample(qi, p, query, resp, name=name):
                if qi == 0:
                    sample[name] = (p, query, resp.tokens)

            results.append(run_workload(
                rt, wl, config.run, config.tiers, store_dir=store_dir, reference=reference,
                max_new_tokens=args.max_new_tokens, store=config.store, progress=bar,
                on_response=keep_sample))
    print_summary(results, check=args.check)
    if sample:
        name = args.policies[-1]
        p, query, tokens = sample.get(name, next(iter(sample.values())))
        tok = rt.tokenizer
        print(f"\nsample ({name}): ...{tok.decode(wl.prefixes[p][-24:])!r} + "
              f"{tok.decode(query[:24])!r}... -> {tok.decode(tokens)!r}")
    write_json(args.json, {"model": rt.spec.name, "workload": {
        "prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens,
        "queries": len(wl.queries), "query_tokens": args.query_tokens,
        "distribution": args.distribution, "sources": wl.sources, "pool_kv_bytes": pool,
        "gpu_tier_bytes": tiers.gpu_bytes, "cpu_tier_bytes": tiers.cpu_bytes,
        "shared_pool": redact_url(tiers.remote_url) if tiers.remote_url else None,
        "disk_read_limit_mb_s": store.read_limit_mb_s},
        "results": results})
    return 0




def print_summary(results, check: bool) -> None:
    from .serving import PLAN_KINDS
    from .tiers import CPU, GPU

    names = list(results[0]["bytes_read"]) if results else []
    read = f"read {'/'.join(names)} MiB"
    width = max(22, len(read))
    plans = "/".join(PLAN_KINDS)
    print()
    head = (f"{'policy':<16}{'TTFT mean':>10}{'P99':>8}  {'match':>6}{'probe':>7}{'select':>7}"
            f"{'load':>7}{'compute':>8}  {read:>{width}}{'GPU hit':>8}{'CPU hit':>8}"
            f"{'fallbk':>7}{'amplif':>7}  {plans:>{len(plans)}}")
    if check:
        head += f"{'KL':>8}{'top1':>6}"
    print(head)
    for r in results:
        b = r["ttft_breakdown_s"]
        mib = "/".join(f"{r['bytes_read'].get(t, 0) / 2**20:.1f}" for t in names)
        tiers = r["tiers"] or {}
        hit = {t: (tiers[t]["hits"] / max(1, tiers[t]["hits"] + tiers[t]["misses"]))
               if tiers else 0.0 for t in (GPU, CPU)}
        counts = "/".join(str(r["plans"][p]) for p in PLAN_KINDS)
        line = (f"{r['label']:<16}{r['ttft_mean_s']:>10.3f}{r['ttft_p99_s']:>8.3f}  "
                f"{b['match_s']:>6.3f}{b['probe_s']:>7.3f}{b['select_s']:>7.3f}{b['load_s']:>7.3f}"
                f"{b['compute_s']:>8.3f}  {mib:>{width}}{hit[GPU]:>8.2f}{hit[CPU]:>8.2f}"
                f"{r['fallback_rate']:>7.2f}{r['read_amplification']:>7.2f}  "
                f"{counts:>{len(plans)}}")
        if check:
            kl = "-" if r["kl"] is None else f"{r['kl']:.4f}"
            t1 = "-" if r["top1_agreement"] is None else f"{r['top1_agreement']:.2f}"
            line += f"{kl:>8}{t1:>6}"
        print(line)
    print("(seconds per request; TTFT parts: radix match, probe-key load, selection, KV load "
          f"through the tiers, compute; {plans}: how the queries with a stored prefix were "
          "served)")


def open_request_file(args, spec, tokenizer):
    """Before the model is built: the output path checked (and, with --resume, the ids
    already in it read), then every line of the request file. (requests, results or None,
    how many requests are left to serve)."""
    from .request_files import RequestFile
    from .results_file import ResultsFile
    from .service import Frontend

    results = None if args.output is None else \
        ResultsFile(args.output, args.requests, resume=args.resume)
    requests = RequestFile(args.requests, Frontend(spec, tokenizer, args.chunk_size),
                           max_tokens=args.request_max_tokens)
    todo = requests.check(results.ids if results is not None else frozenset())
    if not todo:
        print(f"all {results.kept} requests of {args.requests} are already in {args.output}; "
              "nothing to serve")
    return requests, results, todo


class _Totals:
    """Running totals of what a request file's run served (memory does not grow with the
    file, but for 8 bytes of TTFT per request)."""

    def __init__(self):
        from array import array

        from .serving import PLAN_KINDS

        self.served = self.errors = self.matched = self.prompt = self.shared = 0
        self.ttft = array("d")
        self.plans = dict.fromkeys(PLAN_KINDS, 0)

    def add(self, done) -> None:
        from .tiers import REMOTE

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

    from .request_files import batch_record
    from .service import Service, ServiceError

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


def generate(rt, args) -> int:
    records = []
    tokenizer = rt.tokenizer if args.prompt else None
    prompts = args.prompt_token_ids
    for ids in prompts:
        gen = rt.generate([ids], args.max_new_tokens)
        text = tokenizer.decode(gen.new_ids[0]) if tokenizer else None
        print(f"\n--- {len(ids)} prompt tokens")
        print(f"+++ {text if text is not None else ','.join(map(str, gen.new_ids[0]))}")
        print(f"    prefill {gen.prefill_s:.3f} s, decode {gen.decode_s_per_token * 1e3:.1f} ms/token")
        records.append({"prompt_ids": ids, "new_ids": gen.new_ids[0], "text": text,
                        "prefill_s": gen.prefill_s, "decode_s_per_token": gen.decode_s_per_token})
    write_json(args.json, {"model": rt.spec.name, "results": records})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m impress_flexgen.run", main))
