"""The paper's TTFT comparison on OPT-6.7B/13B/30B, sized for one GPU machine and ~8 minutes.

    python -m experiments.gpu_repro [--out DIR] [--models opt-6.7b,opt-13b,opt-30b]
                                    [--prefix-tokens 5120] [--trace PATH] [--budget-s 420]
                                    [--max-pool-gib 8]
    python -m experiments.gpu_repro --record-trace-only --out DIR     # on a CPU, beforehand
    python -m experiments.gpu_repro --quick [--models opt-tiny] ...   # CPU smoke run

Random-weight OPT models (no checkpoint exists offline) serve a workload of reused
natural-text prefixes (~5k tokens, cut from the offline corpus) with cold O_DIRECT disk
reads, GPU/CPU tiers scaled to the pool (10% / 25% of its KV bytes), and report mean and
P99 time to first token, I/O time, bytes loaded, GPU-tier hit ratio and fallback rate for
recomp, as_like, as_h2o_lfu and impress. Two selection modes:

  random-weight selection     impress's ITF over the random model's own (near-uniform)
                              attention: timing is real, the selection is meaningless.
  replayed smollm2 selection  impress with the selections SmolLM2-135M (real weights) made
                              on the same workload shape, replayed layer- and position-
                              proportionally (policies.replay). recomp, as_like and
                              as_h2o_lfu do not use ITF, so their rows are measured once and
                              shared by both modes (as_h2o_lfu keeps its own per-head top-k).

The trace is recorded with `impress` on SmolLM2 (minutes on a CPU) and saved as
<out>/selection_trace.json; `--trace PATH` reuses one, so the GPU run spends its time on the
OPT models. Rows run most important first (opt-6.7b, then 13b, then 30b; random-weight rows,
then the replayed one); a row whose estimated time would exceed `--budget-s` is skipped and
listed. A row's estimate is the same row's time on the model before, scaled by the larger
of the two ratios that bound it: KV bytes (disk writes and reads) and weight bytes x prefix
tokens (compute). `--max-pool-gib` caps the KV of a model's prefix pool: a model whose pool
would be larger serves fewer prefixes of the same length (at least one), so OPT-30B's
5,120-token prefixes (6.6 GiB each) fit a short run as one prefix. Everything goes under --out: gpu_repro.json, selection_trace.json, gpu_repro.png.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from impress_flexgen.bench.runner import RunConfig, kv_bytes_per_token, run_workload
from impress_flexgen.bench.workload import WorkloadConfig, build_workload
from impress_flexgen.engine import Request, StoreSpec, assemble
from impress_flexgen.entrypoints.args import ArgumentParser, finite_float, write_json
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.errors import UserError
from impress_flexgen.models import MODEL_NAMES, resolve
from impress_flexgen.models.runtime import Placement, Runtime, RuntimeConfig
from impress_flexgen.store import scratch
from impress_flexgen.tiers import TierConfig
from policies.replay import Recorder, Trace, load_trace, request_entry, save_trace

PROG = "python -m experiments.gpu_repro"
MODES = ("random", "replayed")


def mode_labels(modes: list[str], trace_model: str | None) -> dict[str, str]:
    """How the modes are named in the JSON and the table."""
    short = {"smollm2-135m": "smollm2"}.get(trace_model, trace_model)
    names = {"random": "random-weight selection", "replayed": f"replayed {short} selection"}
    return {m: names[m] for m in modes}


POLICIES = ("recomp", "as_like", "as_h2o_lfu", "impress")
SHARED = ("recomp", "as_like", "as_h2o_lfu")   # do not use ITF: one measurement, both modes
TRACE_FILE = "selection_trace.json"


def parse_args(argv):
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/gpu_repro", help="output folder (default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: opt-tiny, 2 prefixes x 256 tokens, 1 query each")
    p.add_argument("--models", help="comma-separated (default opt-6.7b,opt-13b,opt-30b; "
                                    "quick: opt-tiny)")
    p.add_argument("--prefixes", type=int, help="prefix pool size (default 2)")
    p.add_argument("--prefix-tokens", type=int, help="tokens per prefix (default 5120; quick 256)")
    p.add_argument("--queries", type=int, help="measured queries per prefix (default 2; quick 1)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up queries per prefix (default 1)")
    p.add_argument("--query-tokens", type=int, help="tokens per query (default 64; quick 32)")
    p.add_argument("--retention", type=float, default=0.25)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--gpu-cache-fraction", type=float, default=0.1,
                   help="GPU tier capacity as a fraction of the pool's KV bytes")
    p.add_argument("--cpu-cache-fraction", type=float, default=0.25)
    p.add_argument("--modes", default="random,replayed",
                   help="selection modes to run: random, replayed (default both)")
    p.add_argument("--budget-s", type=finite_float(0, low_open=True), default=420.0,
                   help="skip rows that would end after this many seconds (default 420)")
    p.add_argument("--max-pool-gib", type=finite_float(0, low_open=True),
                   help="a model whose prefix pool would hold more KV than this serves fewer "
                        "prefixes (at least one; default: no cap)")
    p.add_argument("--trace", metavar="PATH", help="a selection trace recorded beforehand")
    p.add_argument("--trace-model", default="smollm2-135m",
                   help="real-weight model whose selections are replayed (default %(default)s)")
    p.add_argument("--record-trace-only", action="store_true",
                   help="record <out>/selection_trace.json and stop (runs on a CPU)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run the full-size rows without CUDA (slow)")
    p.add_argument("--store-root", help="where the stores go (default: <out>/stores, removed)")
    p.add_argument("--seed", type=int, default=0, help="workload and random-weight seed")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", metavar="PATH", help="also write the results JSON here")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = dict(models="opt-tiny" if quick else "opt-6.7b,opt-13b,opt-30b",
                    prefixes=2, prefix_tokens=256 if quick else 5120, queries=1 if quick else 2,
                    query_tokens=32 if quick else 64)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODEL_NAMES]
    if not args.models or bad:
        p.error(f"unknown model '{bad[0] if bad else ''}'; choose from {', '.join(MODEL_NAMES)}")
    if args.trace_model not in MODEL_NAMES:
        p.error(f"unknown trace model '{args.trace_model}'")
    if not args.modes or any(m not in MODES for m in args.modes) or \
            len(set(args.modes)) != len(args.modes):
        p.error("--modes takes random and/or replayed")
    if not 0 < args.retention <= 1:
        p.error("--retention must be in (0, 1]")
    if min(args.prefixes, args.queries, args.query_tokens, args.chunk_size) < 1 or args.warmup < 0:
        p.error("--prefixes, --queries, --query-tokens and --chunk-size must be positive")
    if args.prefix_tokens < 2 * args.chunk_size:
        p.error("--prefix-tokens must be at least two chunks")
    for name in ("gpu_cache_fraction", "cpu_cache_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be positive")
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    if args.trace and args.record_trace_only:
        p.error("--trace and --record-trace-only exclude each other")
    return args


# -- machine, models, placement ---------------------------------------------------------
def machine() -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cuda": torch.cuda.is_available(), "torch": torch.__version__,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "device": "cpu"}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    try:
        import psutil

        info["ram_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    return info


def weight_bytes(spec) -> int:
    """fp16 (or the model's dtype) bytes of all weights, from the config's shapes."""
    c = spec.config
    if spec.family == "opt":
        h, f, n = c.input_dim, c.ffn_embed_dim, c.num_hidden_layers
        layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        params = n * layer + c.vocab_size * h + (c.max_seq_len + 2) * h + 2 * h
    else:
        h, n = c.hidden_size, c.num_hidden_layers
        kv = c.n_kv_head * c.head_dim
        layer = 2 * h * h + 2 * h * kv + 3 * h * c.intermediate_size + 2 * h
        params = n * layer + 2 * c.vocab_size * h + h
    return int(params * np.dtype(c.dtype).itemsize)


def choose_placement(spec, reserve_bytes: int) -> tuple[Placement, str]:
    """All weights on the GPU when they fit beside `reserve_bytes` (tiers, activations);
    otherwise the share that fits on the GPU and the rest in CPU memory, streamed layer by
    layer (FlexGen splits each layer's weights by that percentage). Without CUDA the "GPU"
    is a CPU device object, so "gpu" is the fast path there too."""
    if not torch.cuda.is_available():
        return Placement.parse("gpu"), "gpu (no CUDA: the compute device is the CPU)"
    free, _ = torch.cuda.mem_get_info()
    weights = weight_bytes(spec)
    room = 0.9 * free - reserve_bytes        # 10% of the free memory kept for the allocator
    if weights <= room:
        return Placement.parse("gpu"), f"gpu (weights {weights / 2**30:.1f} GiB fit)"
    percent = max(0, min(99, int(100 * room / weights)))
    return (Placement.parse(f"{percent},{100 - percent},100,0,100,0"),
            f"{percent}% of the weights on the GPU, the rest in CPU memory ({weights / 2**30:.1f} "
            f"GiB + {reserve_bytes / 2**30:.1f} GiB reserve exceed 90% of "
            f"{free / 2**30:.1f} GiB free on the GPU)")


def model_workload(wcfg: WorkloadConfig, kv_per_token: int,
                   max_pool_gib: float | None) -> WorkloadConfig:
    """The workload a model serves: `wcfg`, with fewer prefixes (at least one) where its
    pool would hold more than `max_pool_gib` of KV."""
    if max_pool_gib is None:
        return wcfg
    fit = int(max_pool_gib * 2**30 // (wcfg.prefix_tokens * kv_per_token))
    n = max(1, min(wcfg.n_prefixes, fit))
    return wcfg if n == wcfg.n_prefixes else dataclasses.replace(wcfg, n_prefixes=n)


def positions_needed(wcfg: WorkloadConfig) -> int:
    return int(math.ceil((wcfg.prefix_tokens + wcfg.query_tokens + 8) / 64) * 64)


def model_spec(name: str, wcfg: WorkloadConfig, seed: int):
    """The model as it will be built, and the max_seq_len override it needs (or None):
    random-weight models get enough positions for the workload (OPT's learned position
    table has 2048 rows; with random weights a longer one is just as valid)."""
    spec = resolve(name, None, seed)
    need = positions_needed(wcfg)
    if need <= spec.config.max_seq_len:
        return spec, None
    if not spec.random_weights:
        raise UserError(f"{name} has {spec.config.max_seq_len} positions; the workload needs "
                        f"{need} (use a shorter --prefix-tokens)")
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config,
                                                                max_seq_len=need)), need


# -- trace ------------------------------------------------------------------------------
def record_trace(args, wcfg: WorkloadConfig, root: Path, log=print) -> Trace:
    """Serve the workload shape on the trace model with impress, keeping its selections.

    Mirrors run_workload's order (prefix inserts, warm-up, reorder, measured queries), so a
    replay served by run_workload counts the same requests."""
    t_start = time.perf_counter()
    spec = resolve(args.trace_model, None, args.seed)
    limit = spec.config.max_seq_len
    n_src = min(wcfg.prefix_tokens, limit - wcfg.query_tokens - 8)
    n_src -= n_src % args.chunk_size
    if n_src < 2 * args.chunk_size:
        raise UserError(f"{args.trace_model}'s {limit} positions leave no room for a prefix")
    src_cfg = dataclasses.replace(wcfg, prefix_tokens=n_src)
    run = RunConfig("impress", "impress", args.retention, chunk_size=args.chunk_size)
    cfg = run.serving()
    log(f"recording selections on {args.trace_model}: {wcfg.n_prefixes} prefixes x {n_src} "
        f"tokens (target {wcfg.prefix_tokens})")
    with Runtime(RuntimeConfig(model=args.trace_model, seed=args.seed)) as rt:
        wl = build_workload(rt.tokenizer, src_cfg)
        pool = src_cfg.n_prefixes * n_src * kv_bytes_per_token(rt)
        tiers = TierConfig(int(pool * args.gpu_cache_fraction), int(pool * args.cpu_cache_fraction))
        policy = Recorder(cfg)
        tmp = scratch.make(root, "tracestore")
        stack = assemble(rt, policy, StoreSpec(tmp, reorder_interval=10**9,
                                               **run.store_options()), tiers)
        engine, store = stack.engine, stack.store
        requests = []
        try:

            def serve(phase: str, index: int, p: int, query: list[int]) -> None:
                before = len(policy.records)
                engine.serve(Request(wl.prefixes[p], query, 1, n_pad=wl.pad_of(p)))
                if len(policy.records) > before:
                    requests.append(request_entry(policy.records[before], phase=phase,
                                                  index=index, prefix=p))
                del policy.records[before:]

            for p, prefix in enumerate(wl.prefixes):
                serve("insert", p, p, [prefix[-1]])
            for i, (p, query) in enumerate(wl.warmup):
                serve("warmup", i, p, query)
            store.reorder_now()
            for i, (p, query) in enumerate(wl.queries):
                serve("query", i, p, query)
        finally:
            stack.close()
            shutil.rmtree(tmp, ignore_errors=True)
        n_layers = len(requests[0]["layers"]) if requests else 0
        meta = {"model": args.trace_model, "random_weights": rt.spec.random_weights,
                "layers": n_layers, "workload": dataclasses.asdict(src_cfg),
                "target_prefix_tokens": wcfg.prefix_tokens, "sources": wl.sources,
                "retention": args.retention, "chunk_size": args.chunk_size,
                "policy": "impress (chunk selection, reordered layout, score tiers)",
                "positions": "per request and layer, packed bits over logical prefix positions",
                "machine": machine(),
                "recorded_s": round(time.perf_counter() - t_start, 2)}
    return Trace(meta, requests)


def schedule(wl) -> list[int]:
    """Prefix index of each request that reaches per-layer planning, in serving order."""
    return [p for p, _ in wl.warmup] + [p for p, _ in wl.queries]


def trace_summary(trace: Trace, path: Path, wcfg: WorkloadConfig) -> dict:
    src = trace.meta.get("workload", {})
    same = {k: src.get(k) == getattr(wcfg, k)
            for k in ("n_prefixes", "queries_per_prefix", "warmup_queries", "query_tokens",
                      "distribution", "seed", "mode")}
    planned = [r for r in trace.requests if r.get("phase") != "insert"]
    return {"path": str(path), "model": trace.meta.get("model"),
            "random_weights": trace.meta.get("random_weights"), "layers": trace.n_layers,
            "requests": len(trace), "source_prefix_tokens": src.get("prefix_tokens"),
            "target_prefix_tokens": wcfg.prefix_tokens, "workload_shape_matches": same,
            "mean_selected_fraction": float(np.mean([np.mean(r["selected_fraction"])
                                                     for r in planned])) if planned else None,
            "recorded": trace.meta.get("machine", {}).get("date"),
            "recorded_on": trace.meta.get("machine", {}).get("device")}


# -- rows -------------------------------------------------------------------------------
def pick(row: dict, wall_s: float) -> dict:
    keys = ("policy", "label", "queries", "ttft_mean_s", "ttft_p99_s", "ttft_breakdown_s",
            "io_time_s", "store_s", "bytes_loaded_fraction", "bytes_read", "probe_bytes",
            "prefix_bytes_total", "read_amplification", "chunks_read", "chunks_loaded",
            "fallback_rate", "gpu_hit_ratio", "reorder_s", "reorders", "space")
    out = {k: row.get(k) for k in keys}
    out["wall_s"] = round(wall_s, 3)
    return out


def plan_rows(modes: list[str], trace_path: Path | None, retention: float,
              chunk: int) -> list[tuple[str, str, RunConfig]]:
    """(mode, policy column, run) in the order they run. The selection-independent rows
    run once, under the first mode asked for."""
    rows = [(modes[0], "recomp", RunConfig("recomp", "recomp", 1.0, chunk_size=chunk)),
            (modes[0], "as_like", RunConfig("as_like", "as_like", 1.0, chunk_size=chunk)),
            (modes[0], "as_h2o_lfu", RunConfig("as_h2o_lfu", "as_h2o_lfu", retention,
                                               chunk_size=chunk))]
    if "random" in modes:
        rows.append(("random", "impress", RunConfig("impress", "impress", retention,
                                                    chunk_size=chunk)))
    if "replayed" in modes:
        rows.append(("replayed", "impress", RunConfig("impress (replayed)",
                                                      f"replay:{trace_path}", retention,
                                                      chunk_size=chunk)))
    return rows


class Budget:
    """Elapsed time since start, and estimates of a row's time from rows already run."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.t0 = time.perf_counter()
        self.seen: dict[str, tuple[float, tuple]] = {}   # key -> (wall s, sizes)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def estimate(self, key: str, sizes: tuple) -> float:
        """The row's time on the model before, scaled by the largest ratio of the sizes
        that bound it (0 when it has not run yet: a first model's rows always run)."""
        if key not in self.seen:
            return 0.0
        wall, before = self.seen[key]
        return wall * max(now / then for now, then in zip(sizes, before))

    def fits(self, key: str, sizes: tuple) -> bool:
        return self.elapsed() + self.estimate(key, sizes) <= self.seconds

    def record(self, key: str, wall: float, sizes: tuple) -> None:
        self.seen[key] = (wall, sizes)


def row_sizes(spec, wcfg: WorkloadConfig) -> tuple[int, int]:
    """What a row's time grows with: the pool's KV bytes (written once, read per query)
    and weight bytes x prefix tokens (the compute of inserts and recomputes)."""
    tokens = wcfg.n_prefixes * wcfg.prefix_tokens
    return tokens * _kv_per_token(spec), weight_bytes(spec) * tokens


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick and not args.allow_cpu and not args.record_trace_only:
        print(f"{PROG}: the full run needs a CUDA GPU; use --quick for a CPU smoke run, "
              "--record-trace-only to record the trace here, or --allow-cpu", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = Budget(args.budget_s)
    out = Path(args.out)
    own_root = args.store_root is None
    root = Path(args.store_root) if args.store_root else out / "stores"
    try:
        out.mkdir(parents=True, exist_ok=True)
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {exc.filename}: {exc.strerror}") from None
    wcfg = WorkloadConfig(n_prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
                          queries_per_prefix=args.queries, warmup_queries=args.warmup,
                          query_tokens=args.query_tokens, seed=args.seed)
    try:
        return _run(args, list(sys.argv[1:] if argv is None else argv), wcfg, out, root, budget)
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)


def _trace(args, wcfg, out: Path, root: Path) -> tuple[Path, dict]:
    if args.trace:
        try:
            trace = load_trace(args.trace)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        path = Path(args.trace).resolve()
        if path != (out / TRACE_FILE).resolve():
            shutil.copyfile(path, out / TRACE_FILE)   # everything under one folder
        print(f"selection trace: {args.trace} ({trace.meta.get('model')}, "
              f"{len(trace)} requests x {trace.n_layers} layers)")
    else:
        trace = record_trace(args, wcfg, root)
        path = (out / TRACE_FILE).resolve()
        save_trace(trace, path)
        print(f"selection trace: {path} ({len(trace)} requests x {trace.n_layers} layers, "
              f"recorded in {trace.meta['recorded_s']:.1f} s)")
    return path, trace_summary(trace, path, wcfg)


def _run(args, argv, wcfg, out: Path, root: Path, budget: Budget) -> int:
    trace_path = trace_info = None
    if "replayed" in args.modes or args.record_trace_only:
        trace_path, trace_info = _trace(args, wcfg, out, root)
        if args.record_trace_only:
            return 0
    result = {"machine": machine(), "argv": argv, "args": vars(args),
              "workload": dataclasses.asdict(wcfg),
              "modes": mode_labels(args.modes, trace_info["model"] if trace_info else None),
              "policies": list(POLICIES), "trace": trace_info,
              "notes": ["recomp, as_like and as_h2o_lfu do not use ITF: measured once per model "
                        "and shown under every mode (shared_from names where)",
                        "as_h2o_lfu keeps its own per-head top-k over the model's attention",
                        "random weights: KL/accuracy are not measured; times and bytes are",
                        "disk reads are cold (O_DIRECT); every row writes a fresh store"],
              "budget_s": args.budget_s, "models": {}, "skipped": []}
    json_path = out / "gpu_repro.json"
    rows = plan_rows(args.modes, trace_path, args.retention, args.chunk_size)
    for name in args.models:
        entry = {"modes": {label: {} for label in result["modes"].values()}}
        result["models"][name] = entry
        spec, _ = model_spec(name, wcfg, args.seed)
        served = model_workload(wcfg, _kv_per_token(spec), args.max_pool_gib)
        first = f"{rows[0][0]}/{rows[0][1]}"
        need = budget.estimate("build", (weight_bytes(spec),)) + \
            budget.estimate(first, row_sizes(spec, served))
        if budget.elapsed() + need > args.budget_s:
            _skip(result, name, rows, f"would pass --budget-s {args.budget_s:g} before its "
                                      f"first row (elapsed {budget.elapsed():.0f} s, build and "
                                      f"first row estimated {need:.0f} s)")
            continue
        _serve_model(args, name, served, rows, entry, result, root, budget, trace_path,
                     lambda: _write(result, json_path, args.json, out / "gpu_repro.png"))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["elapsed_s"] = round(budget.elapsed(), 2)
    _write(result, json_path, args.json)
    print()
    print_table(result)
    if result["skipped"]:
        print(f"skipped {len(result['skipped'])} rows (listed under 'skipped' in {json_path})")
    _figure(result, out / "gpu_repro.png")
    print(f"wrote {json_path} in {result['elapsed_s']:.1f} s")
    return 0


def _serve_model(args, name, wcfg, rows, entry, result, root, budget, trace_path, save) -> None:
    spec, longer = model_spec(name, wcfg, args.seed)
    kv_tok = _kv_per_token(spec)
    pool = wcfg.n_prefixes * wcfg.prefix_tokens * kv_tok
    # Room beside the weights: the GPU tier, a layer's prefix K/V in flight, slack.
    reserve = int(pool * args.gpu_cache_fraction) + 4 * wcfg.prefix_tokens * kv_tok \
        // max(1, spec.config.num_hidden_layers) + (6 << 30)
    placement, why = choose_placement(spec, reserve)
    print(f"{name}: building ({why}; {spec.config.max_seq_len} positions"
          f"{', extended for the workload' if longer else ''}); {wcfg.n_prefixes} x "
          f"{wcfg.prefix_tokens}-token prefixes, {pool / 2**30:.2f} GiB of KV")
    t0 = time.perf_counter()
    with Runtime(RuntimeConfig(model=name, seed=args.seed, max_seq_len=longer,
                               placement=placement)) as rt:
        budget.record("build", time.perf_counter() - t0, (weight_bytes(rt.spec),))
        sizes = row_sizes(rt.spec, wcfg)
        tiers = TierConfig(int(pool * args.gpu_cache_fraction), int(pool * args.cpu_cache_fraction))
        wl = build_workload(rt.tokenizer, wcfg)
        entry.update(placement=why, placement_percent=dataclasses.asdict(placement),
                     weights_bytes=weight_bytes(rt.spec), max_seq_len=rt.spec.config.max_seq_len,
                     max_seq_len_overridden=longer is not None,
                     build_s=round(time.perf_counter() - t0, 2),
                     kv_bytes_per_token=kv_tok, pool_kv_bytes=pool,
                     workload=dataclasses.asdict(wcfg),
                     gpu_tier_bytes=tiers.gpu_bytes, cpu_tier_bytes=tiers.cpu_bytes,
                     sources=wl.sources)
        if trace_path is not None:
            src = [r["prefix"] for r in load_trace(trace_path).requests
                   if r.get("phase") != "insert"]
            entry["trace_order_matches"] = src == schedule(wl)
            if not entry["trace_order_matches"]:
                print(f"{name}: warning: the trace's request order differs from this workload's")
        for mode, column, run in rows:
            key = f"{mode}/{column}"
            if not budget.fits(key, sizes):
                _skip(result, name, [(mode, column, run)],
                      f"would pass --budget-s {args.budget_s:g} (elapsed "
                      f"{budget.elapsed():.0f} s, estimate {budget.estimate(key, sizes):.0f} s)")
                continue
            free = shutil.disk_usage(root).free
            if run.policy != "recomp" and free < 2.2 * pool:
                _skip(result, name, [(mode, column, run)],
                      f"{free / 2**30:.1f} GiB free under {root}; the store needs "
                      f"~{2.2 * pool / 2**30:.1f} GiB")
                continue
            t_row = time.perf_counter()
            row = pick(run_workload(rt, wl, run, tiers, store_root=root),
                       time.perf_counter() - t_row)
            budget.record(key, row["wall_s"], sizes)
            labels = result["modes"]
            for m in args.modes:
                if m == mode:
                    entry["modes"][labels[m]][column] = row
                elif column in SHARED:
                    entry["modes"][labels[m]][column] = {**row, "shared_from": labels[mode]}
            _print_row(name, labels[mode], column, row)
            result["elapsed_s"] = round(budget.elapsed(), 2)
            save()


def _kv_per_token(spec) -> int:
    from impress_flexgen.engine import model_shape

    s = model_shape(spec)
    return s.n_layers * s.kv_bytes_per_token_layer        # as stored (the compute dtype)


def _skip(result: dict, model: str, rows, reason: str) -> None:
    for mode, column, _ in rows:
        label = result["modes"][mode]
        result["skipped"].append({"model": model, "mode": label, "policy": column,
                                  "reason": reason})
        print(f"{model}: skipped {column} ({label}): {reason}")


def _write(result: dict, path: Path, extra: str | None, figure: Path | None = None) -> None:
    """The results so far (after every row: a run cut short keeps what it finished)."""
    write_json(str(path), result)
    write_json(extra, result)
    if figure is not None:
        _figure(result, figure)


def _print_row(model: str, mode: str, column: str, r: dict) -> None:
    print(f"{model}: {column:<11} {mode:<28} TTFT {r['ttft_mean_s']:.3f} s (P99 "
          f"{r['ttft_p99_s']:.3f}), I/O {r['io_time_s']:.3f} s, loaded "
          f"{100 * r['bytes_loaded_fraction']:.0f}%, row {r['wall_s']:.1f} s")


def print_table(result: dict) -> None:
    head = (f"{'model':<10}{'selection':<28}{'policy':<12}{'TTFT mean':>10}{'P99':>8}"
            f"{'I/O s':>8}{'loaded%':>9}{'gpu hit':>8}{'fallbk':>7}")
    print(head)
    for model, entry in result["models"].items():
        for mode, rows in entry["modes"].items():
            for column in POLICIES:
                r = rows.get(column)
                if r is None:
                    print(f"{model:<10}{mode:<28}{column:<12}{'skipped':>10}")
                    continue
                mark = "*" if r.get("shared_from") else ""
                print(f"{model:<10}{mode:<28}{column + mark:<12}{r['ttft_mean_s']:>10.3f}"
                      f"{r['ttft_p99_s']:>8.3f}{r['io_time_s']:>8.3f}"
                      f"{100 * r['bytes_loaded_fraction']:>8.1f}%{r['gpu_hit_ratio']:>8.2f}"
                      f"{r['fallback_rate']:>7.2f}")
    print("* selection-independent row, measured once and shown under both modes")


def _figure(result: dict, path: Path) -> None:
    """Mean and P99 TTFT per model, policy and mode (optional: needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = [m for m, e in result["models"].items() if any(e["modes"].values())]
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        labels, mean, p99 = [], [], []
        for mode, rows in result["models"][model]["modes"].items():
            for column in POLICIES:
                r = rows.get(column)
                if r is None or r.get("shared_from"):
                    continue
                labels.append(column if column in SHARED else f"{column}\n({mode.split()[0]})")
                mean.append(r["ttft_mean_s"])
                p99.append(r["ttft_p99_s"])
        x = np.arange(len(labels))
        ax.bar(x - 0.2, mean, 0.4, label="mean")
        ax.bar(x + 0.2, p99, 0.4, label="P99")
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(model)
        ax.set_ylabel("TTFT (s)")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['machine']['device']}: TTFT by policy and selection mode")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError:
        pass
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(run_main(PROG, main))
