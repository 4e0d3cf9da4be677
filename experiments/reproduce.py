"""The paper's experiments on this runtime: JSON results and figures under one folder.

    python -m experiments.reproduce [--quick] [--out results] [--model smollm2-135m]
                                    [--parts serving,ablation,...] [--rerun-accuracy]
                                    [--dtype bf16] [--placement auto] [--max-ram-gb GB]

Parts (each writes results/<part>.json and results/<part>.png):
  serving      TTFT per policy, mean and P99 with its breakdown (paper Fig. 16), and I/O
               time (Fig. 17), on a workload of reused natural-text prefixes, tiers smaller
               than the pool (GPU 10%, CPU 25% of the pool's KV bytes), cold O_DIRECT reads.
  ablation     AS-like, +ITF, +RO, All (Fig. 18) on the same workload; chunks loaded
               with and without reordering (Fig. 20); GPU hit ratio by tier policy, LRU /
               LFU / score (Fig. 21); impress with non-exclusive and with exclusive tiers.
  sensitivity  impress against retention, chunk size (16-256), threshold (fixed / adaptive
               alpha / none), probe heads, and pool size (prefixes per fixed tier capacity):
               bytes loaded, KL against full KV, TTFT.
  scaling      prefix length 1k -> 8k: bytes read and TTFT per policy, all from disk.
  padded       the paper-faithful workload (short real prefixes left-padded with masked
               pad tokens to ~5k positions) beside the same real prefixes unpadded: bytes
               read and KL per policy; padding makes a retention budget look generous.
  overheads    probe time share of TTFT, probe-copy and metadata space against the KV,
               reorder time (from the serving part).
  peers        transformers (recompute, past_key_values in memory, torch.save/torch.load
               disk cache), FlexGen's own loop and top-k sparsity, and this runtime, on the
               same requests (experiments.peers).
  accuracy     task accuracy per policy and retention (Fig. 15; experiments.accuracy):
               quick mode runs the quick suite; otherwise results/accuracy.json is reused if
               present (it takes long), or made.

All rows of a part are measured side by side in one process; KL is against `full` on the
same requests. Times come from a shared CPU machine: compare rows within a part.
--exclusive-tiers runs every row with exclusive GPU/CPU tiers (default: non-exclusive);
the ablation part runs impress under the other mode too.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from experiments import reproduce_figures as figures
from impress_flexgen.bench.runner import RunConfig, kv_bytes_per_token, run_workload
from impress_flexgen.bench.workload import WorkloadConfig, build_workload
from impress_flexgen.config import dtype_of, runtime_memory_fields
from impress_flexgen.entrypoints.args import (PLACEMENT_HELP, ArgumentParser, add_model_args,
                                              choose_list, placement_arg, write_json)
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.errors import UserError
from impress_flexgen.models import dtypes
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.tiers import TierConfig

PARTS = ("serving", "ablation", "sensitivity", "scaling", "padded", "overheads", "peers",
         "accuracy")


@dataclasses.dataclass(frozen=True)
class Sizes:
    serving: WorkloadConfig
    sensitivity: WorkloadConfig
    scaling_lengths: tuple[int, ...]
    scaling_queries: int
    pool_sizes: tuple[int, ...]
    padded: WorkloadConfig = WorkloadConfig(n_prefixes=3, prefix_tokens=5120, real_tokens=512,
                                            queries_per_prefix=2, mode="padded")


FULL = Sizes(WorkloadConfig(n_prefixes=3, prefix_tokens=2048, queries_per_prefix=3),
             WorkloadConfig(n_prefixes=2, prefix_tokens=1024, queries_per_prefix=2),
             (1024, 2048, 4096, 8128), 2, (2, 4, 8),
             WorkloadConfig(n_prefixes=2, prefix_tokens=4096, real_tokens=512,
                            queries_per_prefix=2, mode="padded"))
QUICK = Sizes(WorkloadConfig(n_prefixes=2, prefix_tokens=512, queries_per_prefix=2),
              WorkloadConfig(n_prefixes=2, prefix_tokens=256, queries_per_prefix=1,
                             query_tokens=32),
              (256, 512), 1, (1, 2),
              WorkloadConfig(n_prefixes=2, prefix_tokens=512, real_tokens=128,
                             queries_per_prefix=1, query_tokens=32, mode="padded"))


def fitted(sizes: Sizes, positions: int, chunk: int = 64) -> tuple[Sizes, list[str]]:
    """The workloads within the model's positions: a prefix, a query and the new token must
    fit (OPT has 2,048, so its longest prefix is 1,920 tokens, whole 64-token chunks, beside a
    64-token query; the scaling part skips the lengths that do not). Returns them and what
    was cut."""
    notes = []

    def fit(name: str, wl: WorkloadConfig) -> WorkloadConfig:
        room = (positions - wl.query_tokens - 1) // chunk * chunk
        if wl.prefix_tokens <= room:
            return wl
        notes.append(f"{name}: prefixes of {room} tokens, not {wl.prefix_tokens} (the model "
                     f"has {positions} positions)")
        return dataclasses.replace(wl, prefix_tokens=room,
                                   real_tokens=min(wl.real_tokens, room // 2))

    return dataclasses.replace(sizes, serving=fit("serving", sizes.serving),
                               sensitivity=fit("sensitivity", sizes.sensitivity),
                               padded=fit("padded", sizes.padded)), notes


# The paper's token selection (Fig. 20): voted tokens scatter over many chunks unless
# reordering packs them; whole-chunk selection loads the same count either way.
PAPER_TOKEN = dict(granularity="token", threshold="adaptive", probe_heads="first:3",
                   probe_format="fp16", chunk_size=64)


def serving_runs() -> list[RunConfig]:
    return [
        RunConfig("full", "full", 1.0),
        RunConfig("recomp", "recomp", 1.0),
        RunConfig("as_like", "as_like", 1.0),
        RunConfig("as_h2o_lru", "as_h2o_lru"),
        RunConfig("as_h2o_lfu", "as_h2o_lfu"),
        RunConfig("impress", "impress"),
        RunConfig("impress-token (paper)", "impress", **PAPER_TOKEN),
    ]


ABLATION_RUNS = [RunConfig("+ITF", "impress:itf"), RunConfig("+ITF+RO", "impress:itf_ro"),
                 RunConfig("+ITF (token)", "impress:itf", **PAPER_TOKEN),
                 RunConfig("+ITF+RO (token)", "impress:itf_ro", **PAPER_TOKEN),
                 RunConfig("impress, LRU tiers", "impress", tier_policy="lru"),
                 RunConfig("impress, LFU tiers", "impress", tier_policy="lfu")]


def sensitivity_runs() -> list[tuple[str, str, RunConfig]]:
    """(knob, value, config): one knob at a time from the default impress configuration."""
    base = RunConfig("impress", "impress")
    out = [("retention", str(r), dataclasses.replace(base, retention=r))
           for r in (0.05, 0.1, 0.25, 0.5)]
    out += [("chunk_size", str(c), dataclasses.replace(base, chunk_size=c))
            for c in (16, 32, 64, 128, 256)]
    out += [("threshold", "none", base)]
    out += [("threshold", f"fixed {t}", dataclasses.replace(base, threshold="fixed",
                                                            threshold_value=t))
            for t in (0.8, 0.85, 0.9)]
    out += [("threshold", f"adaptive {a}", dataclasses.replace(base, threshold="adaptive",
                                                               adaptive_alpha=a))
            for a in (0.3, 0.6, 1.0)]
    out += [("probe_heads", h, dataclasses.replace(base, probe_heads=h))
            for h in ("first:1", "first:3", "group", "all")]
    return [(k, v, dataclasses.replace(r, label=f"{k}={v}")) for k, v, r in out]


def _sizes(tiers: TierConfig) -> dict:
    """The tiers' record as reported: each run's serving policy picks its tier policy, so
    the record's own is left out (it is not what ran)."""
    return {**{k: v for k, v in dataclasses.asdict(tiers).items() if k != "policy"},
            "copies": tiers.copies}


def other_copies(tiers: TierConfig) -> tuple[RunConfig, TierConfig]:
    """impress on the same tiers under the other mode (exclusive or non-exclusive)."""
    other = dataclasses.replace(tiers, exclusive=not tiers.exclusive)
    return RunConfig(f"impress, {other.copies} tiers", "impress"), other


# -- parts ------------------------------------------------------------------------------
class Reproduction:
    def __init__(self, args, sizes: Sizes):
        self.args, self.sizes = args, sizes
        self.out = Path(args.out)
        self.root = Path(args.store_root) if args.store_root else Path(tempfile.gettempdir())
        self.cache: dict[str, dict] = {}

    def tiers_for(self, rt, wl_config: WorkloadConfig, n_prefixes: int | None = None
                  ) -> TierConfig:
        pool = (n_prefixes or wl_config.n_prefixes) * wl_config.prefix_tokens \
            * kv_bytes_per_token(rt)
        return TierConfig(int(pool * 0.10), int(pool * 0.25), exclusive=self.args.exclusive_tiers)

    def serve_all(self, rt, wl, runs, tiers, label: str) -> list[dict]:
        """One row per run, KL against the first; a run given as (run, tiers) runs on
        those tiers instead."""
        reference: dict = {}
        rows = []
        with tqdm(total=len(runs) * len(wl.queries), desc=label, unit="req") as bar:
            for run in runs:
                run, on = run if isinstance(run, tuple) else (run, tiers)
                row = run_workload(rt, wl, run, on, store_root=self.root,
                                   reference=reference, progress=bar)
                rows.append({**row, "tier_copies": on.copies})
        return rows

    def serving(self, rt) -> dict:
        if "serving" in self.cache:
            return self.cache["serving"]
        cfg = self.sizes.serving
        wl = build_workload(rt.tokenizer, cfg)
        tiers = self.tiers_for(rt, cfg)
        runs = serving_runs() + (ABLATION_RUNS + [other_copies(tiers)]
                                 if "ablation" in self.args.parts else [])
        rows = self.serve_all(rt, wl, runs, tiers, "serving")
        result = {"workload": dataclasses.asdict(cfg), "sources": wl.sources,
                  "tiers": _sizes(tiers), "results": rows}
        self.cache["serving"] = result
        return result

    def part_serving(self, rt) -> dict:
        res = self.serving(rt)
        labels = {r.label for r in serving_runs()}
        out = {**res, "results": [r for r in res["results"] if r["label"] in labels]}
        figures.serving(out, self.out / "serving.png")
        return out

    def part_ablation(self, rt) -> dict:
        res = self.serving(rt)
        by = {r["label"]: r for r in res["results"]}
        ablation = [by["as_like"], by["+ITF"], by["+ITF+RO"], by["impress"]]
        names = ["AS-like", "+ITF", "+ITF+RO", "All (impress)"]
        tiers = [by["impress, LRU tiers"], by["impress, LFU tiers"], by["impress"]]
        # impress on these tiers, then on the same tiers under the other mode.
        copies = [by["impress"]] + [r for r in res["results"]
                                    if r["tier_copies"] != by["impress"]["tier_copies"]]
        out = {"workload": res["workload"], "tiers": res["tiers"],
               "ablation": [_pick(r, name) for r, name in zip(ablation, names)],
               "reorder": {"without": by["+ITF"]["chunks_loaded"],
                           "with": by["+ITF+RO"]["chunks_loaded"],
                           "disk_chunks_without": by["+ITF"]["chunks_read"],
                           "disk_chunks_with": by["+ITF+RO"]["chunks_read"],
                           "token_without": by["+ITF (token)"]["chunks_loaded"],
                           "token_with": by["+ITF+RO (token)"]["chunks_loaded"],
                           "token_bytes_without": by["+ITF (token)"]["bytes_loaded_fraction"],
                           "token_bytes_with": by["+ITF+RO (token)"]["bytes_loaded_fraction"]},
               "gpu_hit_ratio": {name: r["gpu_hit_ratio"] for name, r in
                                 zip(("LRU", "LFU", "score (impress)"), tiers)},
               "cpu_hit_ratio": {name: _cpu_hit(r) for name, r in
                                 zip(("LRU", "LFU", "score (impress)"), tiers)},
               "tier_copies": {r["tier_copies"]: _copies(r) for r in copies}}
        figures.ablation(out, self.out / "ablation.png")
        return out

    def part_sensitivity(self, rt) -> dict:
        cfg = self.sizes.sensitivity
        wl = build_workload(rt.tokenizer, cfg)
        tiers = self.tiers_for(rt, cfg)
        items = sensitivity_runs()
        runs = [RunConfig("full", "full", 1.0)]
        seen: dict[RunConfig, int] = {}
        for _, _, run in items:
            key = dataclasses.replace(run, label="")
            if key not in seen:
                seen[key] = len(runs)
                runs.append(run)
        rows = self.serve_all(rt, wl, runs, tiers, "sensitivity")
        table = []
        for knob, value, run in items:
            r = rows[seen[dataclasses.replace(run, label="")]]
            table.append({"knob": knob, "value": value, **_pick(r, run.label)})
        # Pool size: more prefixes than the (fixed) tiers hold.
        pool = []
        fixed = self.tiers_for(rt, cfg, self.sizes.pool_sizes[0])
        for n in self.sizes.pool_sizes:
            wl_n = build_workload(rt.tokenizer, dataclasses.replace(cfg, n_prefixes=n))
            (r,) = self.serve_all(rt, wl_n, [RunConfig("impress", "impress")], fixed,
                                  f"pool {n}")
            pool.append({"knob": "pool_prefixes", "value": str(n), **_pick(r, f"pool={n}")})
        out = {"workload": dataclasses.asdict(cfg), "tiers": _sizes(tiers),
               "results": table, "pool": pool}
        figures.sensitivity(out, self.out / "sensitivity.png")
        return out

    def part_scaling(self, rt) -> dict:
        runs = [RunConfig("recomp", "recomp", 1.0), RunConfig("full", "full", 1.0),
                RunConfig("as_h2o_lfu", "as_h2o_lfu"), RunConfig("impress", "impress")]
        limit = rt.spec.config.max_seq_len
        rows = []
        for n in self.sizes.scaling_lengths:
            cfg = WorkloadConfig(n_prefixes=1, prefix_tokens=n,
                                 queries_per_prefix=self.sizes.scaling_queries)
            if n + cfg.query_tokens + 1 > limit:
                print(f"scaling: {n} tokens exceed {rt.spec.name}'s {limit} positions; skipped")
                continue
            wl = build_workload(rt.tokenizer, cfg)
            for r in self.serve_all(rt, wl, runs, TierConfig(), f"{n} tokens"):
                rows.append({"prefix_tokens": n, **_pick(r, r["label"]),
                             "bytes_read_total": sum(r["bytes_read"].values())
                             + r["probe_bytes"]})
        out = {"results": rows}
        figures.scaling(out, self.out / "scaling.png")
        return out

    def part_padded(self, rt) -> dict:
        runs = [RunConfig("full", "full", 1.0), RunConfig("as_h2o_lfu", "as_h2o_lfu"),
                RunConfig("impress", "impress"),
                RunConfig("impress-token (paper)", "impress", granularity="token",
                          threshold="adaptive", probe_heads="first:3", probe_format="fp16",
                          chunk_size=64)]
        padded = self.sizes.padded
        natural = dataclasses.replace(padded, mode="natural", prefix_tokens=padded.real_tokens)
        rows = []
        for name, cfg in (("natural", natural), ("padded", padded)):
            wl = build_workload(rt.tokenizer, cfg)
            for r in self.serve_all(rt, wl, runs, self.tiers_for(rt, cfg), name):
                rows.append({"workload": name, "positions": cfg.prefix_tokens,
                             "real_tokens": padded.real_tokens, **_pick(r, r["label"])})
        out = {"workload": dataclasses.asdict(padded), "results": rows}
        figures.padded(out, self.out / "padded.png")
        return out

    def part_overheads(self, rt) -> dict:
        res = self.serving(rt)
        rows = []
        for r in res["results"]:
            if r["policy"] not in ("impress", "as_h2o_lfu", "as_like", "full"):
                continue
            b = r["ttft_breakdown_s"]
            space = r.get("space") or {}
            kv = space.get("kv_bytes") or 0
            rows.append({"label": r["label"], "ttft_mean_s": r["ttft_mean_s"],
                         "probe_s": b["probe_s"], "select_s": b["select_s"],
                         "probe_share_of_ttft": b["probe_s"] / r["ttft_mean_s"],
                         "select_share_of_ttft": b["select_s"] / r["ttft_mean_s"],
                         "probe_space_fraction": space.get("probe_bytes", 0) / kv if kv else None,
                         "metadata_space_fraction": space.get("metadata_bytes", 0) / kv
                         if kv else None, "space": space, "reorder_s": r.get("reorder_s", 0.0),
                         "reorders": r["reorders"]})
        out = {"results": rows}
        figures.overheads(out, self.out / "overheads.png")
        return out

    def part_peers(self, rt) -> dict:
        from experiments import peers

        path = self.out / "peers.json"
        argv = ["--json", str(path), "--model", self.args.model,
                "--sparsity-model", self.args.sparsity_model]
        argv += ["--quick"] if self.args.quick else []
        if self.args.store_root:
            argv += ["--store-root", self.args.store_root]
        peers.main(argv)
        out = json.loads(path.read_text())
        figures.peers(out, self.out / "peers.png")
        return out

    def part_accuracy(self, rt) -> dict:
        from experiments import accuracy

        path, figure = self.out / "accuracy.json", self.out / "accuracy.png"
        if self.args.quick or self.args.rerun_accuracy or not path.exists():
            argv = ["--json", str(path), "--figure", str(figure)]
            accuracy.main(argv + (["--quick"] if self.args.quick else []))     # plots too
            return json.loads(path.read_text())
        out = json.loads(path.read_text())       # reused: redraw its figure
        if out.get("results"):
            accuracy.plot(out["results"], str(figure), out["model"])
        return out


def _pick(r: dict, label: str) -> dict:
    keys = ("ttft_mean_s", "ttft_p99_s", "ttft_breakdown_s", "io_time_s", "bytes_loaded_fraction",
            "bytes_read", "probe_bytes", "kl", "top1_agreement", "fallback_rate",
            "gpu_hit_ratio", "chunks_read", "chunks_loaded", "read_amplification")
    return {"label": label, **{k: r.get(k) for k in keys}}


def _copies(r: dict) -> dict:
    """impress under one tier mode: TTFT, where its bytes came from, how the tiers moved."""
    t = r.get("tiers") or {}
    moves = ("promotions", "demotions", "evictions")
    return {**_pick(r, r["label"]), "cpu_hit_ratio": _cpu_hit(r),
            **{f"gpu_{k}": t.get("gpu", {}).get(k) for k in moves},
            **{k: t.get(k) for k in ("drops", "free_evictions", "duplicate_bytes")}}


def _cpu_hit(r: dict) -> float | None:
    cpu = (r.get("tiers") or {}).get("cpu")
    if not cpu:
        return None
    total = cpu["hits"] + cpu["misses"]
    return cpu["hits"] / total if total else 0.0


# -- command line -----------------------------------------------------------------------
def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.reproduce",
                       description=__doc__.split("\n\n")[0])
    add_model_args(p, default_model="smollm2-135m")
    p.add_argument("--placement", type=placement_arg, default="auto",
                   help=PLACEMENT_HELP + " (default auto)")
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    p.add_argument("--out", default="results", help="output folder (default results/)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--scaling-lengths",
                   help="comma-separated prefix lengths of the scaling part (default "
                        "1024,2048,4096,8128: the longest that leaves smollm2's 8,192 "
                        "positions room for a 64-token query; quick 256,512)")
    p.add_argument("--rerun-accuracy", action="store_true",
                   help="remake results/accuracy.json even if present")
    p.add_argument("--sparsity-model", default="opt-125m",
                   help="OPT shape for FlexGen's top-k sparsity rows of the peers part")
    p.add_argument("--store-root", help="where stores go (default: the temp dir)")
    p.add_argument("--exclusive-tiers", action="store_true",
                   help="at most one memory copy of a chunk in every row (default: "
                        "non-exclusive GPU/CPU tiers, as in the paper)")
    p.add_argument("--json", metavar="PATH", help="also write every part into one JSON file")
    args = p.parse_args(argv)
    args.parts = choose_list(p, "--parts", args.parts, PARTS)
    return args


def runtime_config(args) -> RuntimeConfig:
    """The model the parts run on, as `run` builds it from the same flags (a larger model
    at --dtype bf16, weights placed by --placement within --max-ram-gb)."""
    return RuntimeConfig(model=args.model, model_path=args.model_path, seed=args.seed,
                         placement=args.placement, offload_dir=args.offload_dir,
                         dtype=dtype_of(args.dtype), **runtime_memory_fields(args))


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {out}: {exc.strerror}") from None
    sizes = QUICK if args.quick else FULL
    if args.scaling_lengths:
        try:
            lengths = tuple(int(x) for x in args.scaling_lengths.split(","))
        except ValueError:
            raise UserError("--scaling-lengths: comma-separated integers") from None
        sizes = dataclasses.replace(sizes, scaling_lengths=lengths)
    with Runtime(runtime_config(args)) as rt:
        sizes, notes = fitted(sizes, rt.spec.config.max_seq_len)
        for note in notes:
            print(f"{args.model}: {note}", flush=True)
        rep = Reproduction(args, sizes)
        about = {"model": args.model, "quick": args.quick,
                 "dtype": dtypes.flag(rt.cfg.dtype), "plan": rt.plan.describe()}
        everything = {**about, "parts": {}}
        for part in args.parts:
            t0 = time.perf_counter()
            result = getattr(rep, f"part_{part}")(rt)
            result = {**about, "elapsed_s": time.perf_counter() - t0, **result}
            if part not in ("peers", "accuracy"):      # those write their own JSON
                write_json(str(out / f"{part}.json"), result)
            everything["parts"][part] = result
            print(f"{part}: {out / (part + '.json')}, {out / (part + '.png')} "
                  f"({result['elapsed_s']:.0f} s)")
    if args.json:
        write_json(args.json, everything)
    return 0

if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.reproduce", main))
