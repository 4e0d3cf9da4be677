"""The main job's built-in workload: long prefixes from public-domain books, each reused by
several queries, served with each policy asked for (--compare), a summary table, and the
agreement with full KV (--check).
"""
from __future__ import annotations

from pathlib import Path

from .args import write_json


def check_workload(spec, args) -> None:
    """A request is a whole prefix plus a query, then --max-new-tokens generated."""
    from ..models.runtime import check_lengths

    check_lengths(spec, args.prefix_tokens + args.query_tokens, args.max_new_tokens,
                  what=f"a request (--prefix-tokens {args.prefix_tokens} + --query-tokens "
                       f"{args.query_tokens})")


def quick_for(rt, args) -> None:
    """--quick on a model whose passes are slow: a smaller workload (quick.py), said in
    one line; the default where it is predicted to fit (on a GPU: always). Predicted by the
    prefill curve an earlier start measured here, else by an estimate from bytes and FLOPs."""
    import torch

    from ..planner.estimate import estimate_for
    from ..planner.planner import measured_curve
    from .quick import choose

    if torch.cuda.is_available():
        return
    dtype = torch.float16 if rt.spec.config.dtype.__name__ == "float16" else torch.float32
    curve, basis = measured_curve(rt.spec, torch.device("cpu"), dtype), "measured here"
    if curve is None:
        curve, basis = estimate_for(rt), "estimated from bytes and FLOPs"
    if curve is None:
        return
    w, why = choose(curve.predict, args.query_tokens, args.max_new_tokens)
    if why is None:
        return
    args.prefixes, args.prefix_tokens, args.queries = w.prefixes, w.prefix_tokens, w.queries
    args.query_tokens, args.max_new_tokens = w.query_tokens, w.new_tokens
    print(f"quick workload: {w.describe()}: {why} (prefill curve {basis})")


def serve_workload(rt, args, root: Path) -> int:
    """Serve the workload with each policy (a store each under `root`), print the summary
    and a sample, write --json."""
    from tqdm import tqdm

    from .. import progress
    from ..bench.runner import kv_bytes_per_token, run_workload
    from ..bench.workload import WorkloadConfig, build_workload
    from ..config import GB, ServiceConfig
    from ..engine import model_shape
    from ..store.root import _store_name
    from ..tiers.remote_url import redact_url

    if args.quick:
        quick_for(rt, args)
    wl = build_workload(rt.tokenizer, WorkloadConfig(
        n_prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
        queries_per_prefix=args.queries, query_tokens=args.query_tokens,
        distribution=args.distribution, mode=args.workload, real_tokens=args.real_tokens))
    kv_format = model_shape(rt.spec, args.chunk_size, args.kv_format).kv_format
    pool = args.prefixes * args.prefix_tokens * kv_bytes_per_token(rt, kv_format)
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
    print(f"tiers: GPU {tiers.gpu_bytes / 2**20:.1f} MiB, CPU {tiers.cpu_bytes / 2**20:.1f} MiB "
          f"({tiers.copies}), disk {disk}; store {root}")
    print(config.plan_line())
    reference = {} if args.check else None
    results, sample = [], {}
    # Requests served, with their rate and the time left (a large model takes minutes
    # per request); IMPRESS_FLEXGEN_PROGRESS=0 silences it.
    with progress.bar(len(names) * len(wl.queries), "requests", unit="req") as bar:
        for name in names:
            config = configs[name]
            store_dir = root / _store_name(name, config.run, kv_format)
            if (store_dir / "store.sqlite").exists():
                tqdm.write(f"{name}: reusing the store left by an earlier run in {store_dir}")

            def keep_sample(qi, p, query, resp, name=name):
                if qi == 0:
                    sample[name] = (p, query, resp.tokens)

            results.append(run_workload(
                rt, wl, config.run, config.tiers, store_dir=store_dir, reference=reference,
                max_new_tokens=args.max_new_tokens, store=config.store, progress=bar,
                on_response=keep_sample, block=(rt.cfg.gpu_batch_size, rt.cfg.num_gpu_batches)
                if args.throughput else None))
    print_summary(results, check=args.check)
    if args.throughput:
        print(f"block schedule: {rt.cfg.gpu_batch_size} x {rt.cfg.num_gpu_batches}; "
              + ", ".join(f"{name} {r['tokens_per_s']:.2f} generated tokens/s"
                          for name, r in zip(names, results)))
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
        "tier_copies": tiers.copies,
        "shared_pool": redact_url(tiers.remote_url) if tiers.remote_url else None,
        "disk_read_limit_mb_s": store.read_limit_mb_s},
        "results": results})
    return 0


def print_summary(results, check: bool) -> None:
    from ..planner import PLAN_KINDS
    from ..tiers import CPU, GPU

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
    rates = [f"{r['label']} {r['decode_s_per_token']:.3f} s ({1 / r['decode_s_per_token']:.2f} "
             "tokens/s)" for r in results if r.get("decode_s_per_token")]
    if rates:
        print(f"decode, per token after the first: {'; '.join(rates)}")
