"""impress_flexgen's main job: serve a workload of reused prefixes with a policy, report.

    python -m impress_flexgen.run                        # smollm2-135m, built-in workload
    python -m impress_flexgen.run --compare recomp,as_like,impress --check
    python -m impress_flexgen.run --model opt-30b --placement 0,100,0,100,100,0 --quick
    python -m impress_flexgen.run --prompt "It is a truth"   # plain generation, no store
    python -m impress_flexgen.run --requests in.jsonl --output out.jsonl   # through the store
    python -m impress_flexgen.run --requests batch.jsonl --output out.jsonl --resume

Requests are (prefix, query) pairs cut from public-domain books: a few long prefixes, each
reused by several queries. The prefix KV lives in a store on local disk (reused by the next
run), with GPU and CPU tiers in front of it. Three modes, one file each: the built-in
workload (workload.py), request files (batch.py), plain generation (generate.py); this file
parses the flags, refuses what it can before the model is built, and picks the mode.
"""
from __future__ import annotations

import dataclasses

import sys

from .. import defaults
from .args import ArgumentParser, add_model_args, add_serving_args, check_serving_args, int_range
from .process import run_main

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
    w.add_argument("--quick", action="store_true", help="2 prefixes x 512 tokens, 2 queries each (smaller on a model "
                        "whose passes are slow: one line says what and why)")
    w.add_argument("--throughput", action="store_true",
                   help="the block schedule, for throughput: the measured queries (or "
                        "--requests) in blocks of --gpu-batch-size x --num-gpu-batches "
                        "sharing each layer's weight load (8 x 8 unless given)")
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
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (placement, weight format, bytes per device, what "
                        "the first start writes and how long making and loading the weights "
                        "takes) and exit without allocating or writing anything (a "
                        "checkpoint not yet converted is converted first)")
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


def _throughput_work(args) -> tuple[int, int, int | None]:
    """(prompt tokens, new tokens, most sequences in a block) the policy search weighs."""
    if args.prompt_token_ids is not None:
        return (max(len(p) for p in args.prompt_token_ids), args.max_new_tokens,
                len(args.prompt_token_ids))
    if args.requests is not None:
        return args.prefix_tokens, args.request_max_tokens or defaults.MAX_TOKENS, None
    return args.prefix_tokens + args.query_tokens, args.max_new_tokens, \
        args.prefixes * args.queries


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from ..config import DEFAULT_TIER_BYTES, ServiceConfig
    from ..engine import model_shape
    from ..models.runtime import Runtime, resolve_spec
    from ..store.root import claim_store_root
    from .batch import open_request_file, serve_requests
    from .generate import check_prompts, generate
    from .workload import check_workload, serve_workload

    # A request file is served with a server's tiers; the built-in workload's default tiers
    # are a share of its prefix KV (serve_workload()): the runtime leaves room for what was sized.
    config = ServiceConfig.from_args(args, timeout_s=float("inf"), default_tiers=(
        DEFAULT_TIER_BYTES if args.requests is not None else (0, 0)))
    cfg = config.runtime_config()
    # Everything that can be refused is refused before the model is built (throughput
    # work's placement once the policy search has chosen it).
    spec = resolve_spec(cfg, check_placement=not args.throughput)
    tokenizer = requests = results = None
    if args.prompt or args.requests:
        from ..models.runtime import load_tokenizer

        tokenizer = load_tokenizer(spec)
    if args.prompt:
        args.prompt_token_ids = [tokenizer.encode(t) for t in args.prompt]
    args.policy_search = None
    if args.throughput:
        from .throughput import searched_config

        cfg, args.policy_search = searched_config(cfg, *_throughput_work(args))
        spec = resolve_spec(cfg)
        # A request file's block is the searched one (the config folds it into its batch).
        config = dataclasses.replace(config, runtime=cfg)
    if args.dry_run:
        from ..models.runtime import dry_run

        print(dry_run(cfg, spec))
        return 0
    store_root = None
    if args.requests is not None:
        requests, results, todo = open_request_file(args, spec, tokenizer)
        if not todo:
            return 0
        claim_store_root(config.store.root_for(model_shape(spec, args.chunk_size,
                                                           args.kv_format)))
    elif args.prompt_token_ids is not None:
        check_prompts(spec, args.prompt_token_ids, args.max_new_tokens)
    else:
        check_workload(spec, args)
        store_root = config.store.root_for(model_shape(spec, args.chunk_size, args.kv_format))
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
        return serve_workload(rt, args, store_root)


if __name__ == "__main__":
    sys.exit(run_main("python -m impress_flexgen.run", main))
