"""impress_flexgen's main job: serve a workload of reused prefixes with a policy, report.

    python -m impress_flexgen.run                        # smollm2-135m, built-in workload
    python -m impress_flexgen.run --compare recomp,as_like,impress --check
    python -m impress_flexgen.run --model opt-30b --placement 0,100,0,100,100,0 --quick
    python -m impress_flexgen.run --prompt "It is a truth"   # plain generation, no store

Requests are (prefix, query) pairs cut from public-domain books: a few long prefixes, each
reused by several queries. The prefix KV lives in a store on local disk (reused by the next
run), with GPU and CPU tiers in front of it.
"""
from __future__ import annotations

import sys
from pathlib import Path

from .cli import (ArgumentParser, add_model_args, dtype_arg, placement_arg, run_main,
                  write_json)
from .errors import UserError
from .paths import cache_dir

GB = 1 << 30


def parse_args(argv):
    from policies import POLICY_NAMES

    p = ArgumentParser(prog="python -m impress_flexgen.run",
                       description="Serve reused long prefixes from a multi-tier KV store.")
    add_model_args(p, default_model="smollm2-135m")
    g = p.add_argument_group("serving")
    g.add_argument("--policy", default="impress",
                   help=f"{', '.join(POLICY_NAMES)}; impress:itf / impress:itf_ro / impress:all "
                        "pick an ablation (default impress = impress:all)")
    g.add_argument("--compare", metavar="A,B,...", help="serve the same workload with each policy")
    g.add_argument("--check", action="store_true",
                   help="also serve with full KV and report agreement (KL, top-1) with it")
    g.add_argument("--retention", type=float, default=0.25, help="fraction of prefix kept (0.25)")
    g.add_argument("--granularity", choices=("chunk", "token"), default="chunk",
                   help="select whole chunks (default) or tokens as the paper does")
    g.add_argument("--threshold", choices=("adaptive", "fixed", "none"), default="none",
                   help="probe-head agreement test; a failed layer loads its whole prefix "
                        "(default none: see the README's sensitivity table)")
    g.add_argument("--probe-heads", default="auto",
                   help="auto (all heads on grouped-query models, 0,1,2 otherwise), all, group "
                        "(one per KV group), first:K, random:K, fraction:F, or ids like 0,3,6")
    g.add_argument("--probe-queries", type=int, default=0, metavar="N",
                   help="probe with the last N new tokens' queries (default 0: all; fewer "
                        "costs less and loses accuracy, see the README)")
    g.add_argument("--probe-stride", type=int, default=1, metavar="K",
                   help="of the probing queries, every K-th counting back from the last "
                        "(default 1: all; see the README)")
    g.add_argument("--probe-every", type=int, default=1, metavar="K",
                   help="probe every K-th layer, the others reuse its scores (default 1; "
                        "see the README)")
    g.add_argument("--prefetch", action="store_true",
                   help="impress: read the chunks the last query selected a layer ahead "
                        "(off: on a 2-core CPU it measured slower and read 9%% more)")
    g.add_argument("--threshold-value", type=float, default=0.85, help="for --threshold fixed")
    g.add_argument("--adaptive-alpha", type=float, default=0.6, help="t = j^alpha (adaptive)")
    g.add_argument("--chunk-size", type=int, default=16, help="tokens per chunk, 16-256 (16)")
    g.add_argument("--probe-format", choices=("int4", "fp16"), default="int4")
    g.add_argument("--reorder-interval", type=int, default=50,
                   help="queries between background reorders (policies that reorder)")
    g.add_argument("--reorder-by", choices=("importance", "semantic"), default="importance",
                   help="how a reorder lays a prefix out: by accumulated importance, or in "
                        "chunks of similar keys (IceCache's semantic pages)")
    g.add_argument("--reorder-hot-fraction", type=float, default=0.25,
                   help="share of a prefix's tokens a reorder packs by importance; the rest "
                        "keep their order (0.25; 1 sorts every token)")
    g.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per query")
    t = p.add_argument_group("tiers and placement")
    t.add_argument("--gpu-cache-gb", type=float, default=None,
                   help="GPU tier capacity (default: 10%% of the workload's prefix KV)")
    t.add_argument("--cpu-cache-gb", type=float, default=None,
                   help="CPU tier capacity (default: 25%% of the workload's prefix KV)")
    t.add_argument("--disk-capacity-gb", type=float, default=None,
                   help="store capacity on disk; least valuable prefixes are evicted beyond it")
    t.add_argument("--store-dir", metavar="DIR",
                   help="the prefix store (default: the user cache directory); reused by later runs")
    t.add_argument("--placement", type=placement_arg, default=None,
                   help="FlexGen placement of weights/cache/activations: gpu, cpu, disk, mixed, "
                        "or six comma-separated percentages W_GPU,W_CPU,CACHE_GPU,CACHE_CPU,"
                        "ACT_GPU,ACT_CPU (default gpu: everything on the compute device)")
    w = p.add_argument_group("workload")
    w.add_argument("--prefixes", type=int, default=4, help="distinct shared prefixes (4)")
    w.add_argument("--prefix-tokens", type=int, default=1024, help="tokens per prefix (1024)")
    w.add_argument("--queries", type=int, default=3, help="measured queries per prefix (3)")
    w.add_argument("--query-tokens", type=int, default=64, help="tokens per query (64)")
    w.add_argument("--distribution", choices=("shuffle", "zipf", "normal"), default="shuffle",
                   help="how queries pick prefixes")
    w.add_argument("--workload", choices=("natural", "padded"), default="natural",
                   help="natural long text, or short real prefixes left-padded with masked "
                        "pad tokens to --prefix-tokens positions (the paper's setting)")
    w.add_argument("--real-tokens", type=int, default=512,
                   help="real tokens per prefix in the padded workload (512)")
    w.add_argument("--quick", action="store_true", help="2 prefixes x 512 tokens, 2 queries each")
    gen = p.add_argument_group("plain generation (no store)")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="generate from this text instead of serving the workload; repeatable")
    src.add_argument("--prompt-ids", action="append", metavar="IDS",
                     help="generate from comma-separated token ids; repeatable")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.prefixes, args.prefix_tokens, args.queries = 2, 512, 2
        args.real_tokens = min(args.real_tokens, 128)
    if not 0 < args.retention <= 1:
        p.error("--retention must be in (0, 1]")
    if args.workload == "padded" and not 0 < args.real_tokens < args.prefix_tokens:
        p.error("--real-tokens must be positive and below --prefix-tokens")
    if not 0 < args.reorder_hot_fraction <= 1:
        p.error("--reorder-hot-fraction must be in (0, 1]")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if args.probe_queries < 0:
        p.error("--probe-queries must be 0 (all) or positive")
    if args.probe_stride < 1 or args.probe_every < 1:
        p.error("--probe-stride and --probe-every must be positive")
    for name in ("prefixes", "prefix_tokens", "queries", "query_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("gpu_cache_gb", "cpu_cache_gb", "disk_capacity_gb"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative")
    names = args.compare.split(",") if args.compare else [args.policy]
    for name in names:
        if name.partition(":")[0] not in POLICY_NAMES:
            p.error(f"unknown policy '{name}'; choose from {', '.join(POLICY_NAMES)}")
    args.policies = names
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from .runtime import Placement, Runtime, RuntimeConfig

    placement = args.placement or Placement.parse("gpu")
    cfg = RuntimeConfig(model=args.model, model_path=args.model_path, placement=placement,
                        offload_dir=args.offload_dir, seed=args.seed, dtype=dtype_arg(args.dtype))
    with Runtime(cfg) as rt:
        device = "cuda" if torch.cuda.is_available() else "cpu only"
        weights = f"random (seed {rt.spec.seed})" if rt.spec.random_weights else "real"
        print(f"model {rt.spec.name} ({rt.spec.family}, {rt.spec.config.dtype.__name__}, "
              f"{device}), weights {weights}, built in {rt.load_s:.1f} s")
        print(f"placement: {placement.describe()}")
        if args.prompt or args.prompt_ids:
            return generate(rt, args)
        return serve(rt, args)


def serve(rt, args) -> int:
    from tqdm import tqdm

    from .engine import TierSizes
    from .serving import RunConfig, kv_bytes_per_token, run_workload
    from .workload import WorkloadConfig, build_workload

    wl = build_workload(rt.tokenizer, WorkloadConfig(
        n_prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
        queries_per_prefix=args.queries, query_tokens=args.query_tokens,
        distribution=args.distribution, mode=args.workload, real_tokens=args.real_tokens))
    pool = args.prefixes * args.prefix_tokens * kv_bytes_per_token(rt)
    tiers = TierSizes(
        int(args.gpu_cache_gb * GB) if args.gpu_cache_gb is not None else int(0.10 * pool),
        int(args.cpu_cache_gb * GB) if args.cpu_cache_gb is not None else int(0.25 * pool))
    root = Path(args.store_dir) if args.store_dir else cache_dir() / "stores" / rt.spec.name
    claim_store_root(root)
    print(f"workload: {args.prefixes} prefixes x {args.prefix_tokens} tokens from "
          f"{', '.join(sorted(set(wl.sources)))}; {len(wl.queries)} queries of "
          f"{args.query_tokens} tokens ({args.distribution}); prefix KV {pool / 2**20:.1f} MiB")
    print(f"tiers: GPU {tiers.gpu_bytes / 2**20:.1f} MiB, CPU {tiers.cpu_bytes / 2**20:.1f} MiB, "
          f"disk {'unlimited' if args.disk_capacity_gb is None else f'{args.disk_capacity_gb} GB'}"
          f"; store {root}")
    names = (["full"] if args.check and "full" not in args.policies else []) + args.policies
    reference = {} if args.check else None
    results, sample = [], {}
    with tqdm(total=len(names) * len(wl.queries), desc="requests", unit="req") as bar:
        for name in names:
            run = RunConfig(name, name, args.retention, args.granularity, args.threshold,
                            args.threshold_value, args.adaptive_alpha, args.probe_heads,
                            args.probe_format, args.chunk_size,
                            reorder_hot_fraction=args.reorder_hot_fraction,
                            reorder_by=args.reorder_by, probe_queries=args.probe_queries,
                            probe_stride=args.probe_stride, probe_every=args.probe_every,
                            prefetch=args.prefetch)
            store_dir = root / _store_name(name, args)
            if (store_dir / "store.sqlite").exists():
                tqdm.write(f"{name}: reusing the store left by an earlier run in {store_dir}")

            def keep_sample(qi, p, query, resp, name=name):
                if qi == 0:
                    sample[name] = (p, query, resp.tokens)

            results.append(run_workload(
                rt, wl, run, tiers, store_dir=store_dir, reference=reference,
                max_new_tokens=args.max_new_tokens,
                disk_capacity_bytes=int(args.disk_capacity_gb * GB)
                if args.disk_capacity_gb is not None else None,
                reorder_interval=args.reorder_interval, progress=bar, on_response=keep_sample))
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
        "gpu_tier_bytes": tiers.gpu_bytes, "cpu_tier_bytes": tiers.cpu_bytes},
        "results": results})
    return 0


STORE_ROOT_MARK = ".impress_flexgen-stores"


def claim_store_root(root: Path) -> None:
    """Refuse a directory that holds something other than our stores; mark ours."""
    if root.exists() and not root.is_dir():
        raise UserError(f"--store-dir {root} is a file")
    if root.is_dir() and any(root.iterdir()) and not (root / STORE_ROOT_MARK).exists():
        raise UserError(f"--store-dir {root} is not empty and was not made by impress_flexgen; "
                        "choose an empty or new directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / STORE_ROOT_MARK).touch()
    except OSError as exc:
        raise UserError(f"cannot use --store-dir {root}: {exc.strerror}") from None


def _store_name(policy: str, args) -> str:
    """Policies that can share a store layout share nothing else: one store each, named by
    what shapes its files (chunk size, probe format) and by whether it is reordered; v2:
    chunks packed when they are not whole pages (stores of the aligned layout stay apart)."""
    layout = "-semantic" if getattr(args, "reorder_by", "importance") == "semantic" else ""
    return f"{policy.replace(':', '-')}-c{args.chunk_size}-{args.probe_format}-v2{layout}"


def print_summary(results, check: bool) -> None:
    print()
    head = (f"{'policy':<16}{'TTFT mean':>10}{'P99':>8}  {'match':>6}{'probe':>7}{'select':>7}"
            f"{'load':>7}{'compute':>8}  {'read GPU/CPU/disk MiB':>22}{'GPU hit':>8}{'CPU hit':>8}"
            f"{'fallbk':>7}{'amplif':>7}")
    if check:
        head += f"{'KL':>8}{'top1':>6}"
    print(head)
    for r in results:
        b = r["ttft_breakdown_s"]
        mib = "/".join(f"{r['bytes_read'][t] / 2**20:.1f}" for t in ("gpu", "cpu", "disk"))
        tiers = r["tiers"] or {}
        hit = {t: (tiers[t]["hits"] / max(1, tiers[t]["hits"] + tiers[t]["misses"]))
               if tiers else 0.0 for t in ("gpu", "cpu")}
        line = (f"{r['label']:<16}{r['ttft_mean_s']:>10.3f}{r['ttft_p99_s']:>8.3f}  "
                f"{b['match_s']:>6.3f}{b['probe_s']:>7.3f}{b['select_s']:>7.3f}{b['load_s']:>7.3f}"
                f"{b['compute_s']:>8.3f}  {mib:>22}{hit['gpu']:>8.2f}{hit['cpu']:>8.2f}"
                f"{r['fallback_rate']:>7.2f}{r['read_amplification']:>7.2f}")
        if check:
            kl = "-" if r["kl"] is None else f"{r['kl']:.4f}"
            t1 = "-" if r["top1_agreement"] is None else f"{r['top1_agreement']:.2f}"
            line += f"{kl:>8}{t1:>6}"
        print(line)
    print("(seconds per request; TTFT parts: radix match, probe-key load, selection, KV load "
          "through the tiers, compute)")


def generate(rt, args) -> int:
    records = []
    tokenizer = None if args.prompt_ids else rt.tokenizer
    if args.prompt_ids:
        try:
            prompts = [[int(x) for x in s.split(",") if x.strip()] for s in args.prompt_ids]
        except ValueError:
            raise UserError("--prompt-ids takes comma-separated integers") from None
    else:
        prompts = [tokenizer.encode(t) for t in args.prompt]
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
