"""What a user would get without this runtime, on the same requests: outside peers.

    python -m experiments.peers [--model smollm2-135m] [--quick] [--json PATH]

One natural-text prefix (default 2048 tokens) reused by several 64-token queries; for each
way of serving, time to first token (TTFT) of every query, median reported:

  hf-recompute     Hugging Face transformers, fp32, prefix + query from scratch;
  hf-memory        transformers reusing the prefix's past_key_values held in memory
                   (a copy per query, so the stored cache is not extended);
  hf-disk          transformers reusing a plain torch.save file of the prefix's KV (fp32,
                   as transformers keeps it), read back with torch.load after the file's
                   pages were dropped from the page cache (cold read);
  flexgen          FlexGen's own generation loop (our placement of the same weights):
                   no prefix reuse, so its TTFT is a full prefill. FlexGen's top-k attention
                   sparsity (Policy.attn_sparsity) acts only in its decode kernel on OPT
                   models, after a dense prefill, so it cannot lower TTFT; the `--sparsity`
                   rows measure that on an OPT shape (random weights, same token ids);
  ours: recomp / full / impress   the engine over a prefix store on local disk, cold
                   O_DIRECT reads, no GPU/CPU tier (everything served from disk);
                   `impress + prefetch` reads the chunks its last query chose a layer
                   ahead; `impress (probe heads group|first:3)` probe with 3 of the 9
                   heads (one per KV head, or the paper's heads 0-2): a third of the
                   scoring, at the accuracy the accuracy suite measures for them (each
                   row has its own store, so its own history).

The fast rows (hf-memory, hf-disk and ours but recomp) are measured in --rounds
interleaved rounds (every query once per way per round, the order of the ways rotating),
so that a shared machine's drift hits them alike; `vs_hf_disk_paired` is the median over
(round, query) of hf-disk's TTFT over the row's on the same query in the same round. The
slow rows (recompute, FlexGen) run each query once.

Every row uses the same torch thread count (--threads, default 2). fp16 matrix products
are slow on CPUs, so both transformers and our runtime compute in fp32 on CPU (the store
holds fp16 K/V; our runtime converts chunks as they load).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from impress_flexgen.bench.runner import (RunConfig, kl_divergence, prepared, run_workload,
                                          summarize)
from impress_flexgen.bench.workload import WorkloadConfig, build_workload
from impress_flexgen.engine import Request
from impress_flexgen.entrypoints.args import ArgumentParser, write_json
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.store import scratch
from impress_flexgen.tiers import TierConfig


def _cache_arg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class HuggingFace:
    """transformers on the prefix: recompute, reuse in memory, reuse from a disk file."""

    @torch.no_grad()
    def __init__(self, spec, prefix, workdir: Path):
        from impress_flexgen.models.reference import load_reference

        self.model = load_reference(spec)
        self.arg = _cache_arg(self.model)
        # Only the last position's logits make the first token (what generate() asks too).
        self.last_only = {"logits_to_keep": 1} if "logits_to_keep" in \
            inspect.signature(self.model.forward).parameters else {}
        self.prefix = prefix
        base = self._forward(prefix)
        self.cache = getattr(base, "cache", None) or base.past_key_values
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in self.cache.layers]
        self.path = workdir / "prefix_kv.pt"
        torch.save(kv, self.path)
        self.file_bytes = self.path.stat().st_size

    def _forward(self, ids, cache=None):
        kw = {self.arg: cache} if cache is not None else {}
        return self.model(input_ids=torch.tensor([ids]), use_cache=True, **kw, **self.last_only)

    @torch.no_grad()
    def recompute(self, query) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        out = self._forward(self.prefix + query)
        return time.perf_counter() - t0, out.logits[0, -1]

    @torch.no_grad()
    def memory(self, query) -> tuple[float, torch.Tensor]:
        private = copy.deepcopy(self.cache)           # copied outside the timed region
        t0 = time.perf_counter()
        out = self._forward(query, private)
        return time.perf_counter() - t0, out.logits[0, -1]

    @torch.no_grad()
    def disk(self, query) -> tuple[float, torch.Tensor]:
        from transformers import DynamicCache

        _drop_page_cache(self.path)
        t0 = time.perf_counter()
        loaded = torch.load(self.path)
        out = self._forward(query, DynamicCache(loaded))
        return time.perf_counter() - t0, out.logits[0, -1]


def _row(label: str, ttfts: list[float], queries, **extra) -> dict:
    return {"label": label, "ttft_median_s": statistics.median(ttfts),
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_s": ttfts, "queries": len(queries),
            **extra}


SPARSITY_NEEDS_CUDA = (
    "FlexGen's top-k sparsity runs only with the KV cache on a CUDA device: its CPU branch "
    "multiplies fp32 queries with fp16 keys and expects the cpu_cache_compute value buffers")


def sparsity_rows(model: str, prefix, queries, sparsities=(1.0, 0.25), gen: int = 8
                  ) -> list[dict]:
    """FlexGen's top-k attention sparsity on an OPT shape: prefill and decode time."""
    if not torch.cuda.is_available():
        return []
    rows = []
    for sparsity in sparsities:
        with Runtime(RuntimeConfig(model=model, attn_sparsity=sparsity)) as rt:
            vocab = rt.spec.config.vocab_size
            fold = [[t % vocab for t in prefix + q] for q in queries]
            runs = [rt.generate([ids], max_new_tokens=gen) for ids in fold]
        rows.append(_row(f"flexgen {model} attn_sparsity={sparsity:g}",
                         [r.prefill_s for r in runs], queries,
                         decode_s_per_token=statistics.median(r.decode_s_per_token
                                                              for r in runs)))
    return rows


OURS = (RunConfig("ours: full", "full", 1.0), RunConfig("ours: impress", "impress", 0.25),
        # The chunks the last query chose, read a layer ahead (off by default; measured here).
        RunConfig("ours: impress + prefetch", "impress", 0.25, prefetch=True),
        # Fewer probe heads: cheaper scoring on a CPU, less accurate (the accuracy suite).
        RunConfig("ours: impress (probe heads group)", "impress", 0.25, probe_heads="group"),
        RunConfig("ours: impress (probe heads first:3)", "impress", 0.25, probe_heads="first:3"))


def measure(rt: Runtime, wl, root: Path, workdir: Path, rounds: int) -> tuple[list[dict], dict]:
    """Every row of the comparison but the sparsity ones; see the module's docstring."""
    prefix, queries = wl.prefixes[0], [q for _, q in wl.queries]
    hf = HuggingFace(rt.spec, prefix, workdir)
    times: dict[str, list[float]] = {}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    stats: dict[str, list] = {}

    def record(label, qi, seconds, out, resp=None):
        times.setdefault(label, []).append(seconds)
        logits.setdefault((label, qi), out)
        if resp is not None:
            stats.setdefault(label, []).append(resp.stats)

    def ours(label, engine):
        def serve(qi, query):
            resp = engine.serve(Request(prefix, query, 1), query_logits=True)
            record(label, qi, resp.stats.ttft_s, resp.query_logits, resp)
        return serve

    # The slow ways: each query once (15x slower than reuse, drift does not matter there).
    for qi, query in enumerate(queries):
        record("hf-recompute", qi, *hf.recompute(query))
    times["flexgen (no reuse)"] = [rt.generate([prefix + q], max_new_tokens=1).prefill_s
                                   for q in queries]
    recomp = run_workload(rt, wl, RunConfig("ours: recomp", "recomp", 1.0), TierConfig(),
                          store_root=root, on_response=lambda qi, p, q, resp: times.setdefault(
                              "ours: recomp", []).append(resp.stats.ttft_s))
    with contextlib.ExitStack() as stack:
        ready = {run.label: stack.enter_context(prepared(rt, wl, run, TierConfig(),
                                                         store_root=root)) for run in OURS}
        ways = {"hf-memory": lambda qi, q: record("hf-memory", qi, *hf.memory(q)),
                "hf-disk": lambda qi, q: record("hf-disk", qi, *hf.disk(q)),
                **{label: ours(label, r.engine) for label, r in ready.items()}}
        names = list(ways)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for qi, query in enumerate(queries):
                for name in order:
                    ways[name](qi, query)
        summaries = {run.label: summarize(run, ready[run.label].policy, stats[run.label],
                                          [], [], ready[run.label].store) for run in OURS}
    # The reuse paths must compute what recomputing computes.
    diff = max(float((logits[(m, qi)] - logits[("hf-recompute", qi)]).abs().max())
               for m in ("hf-memory", "hf-disk") for qi in range(len(queries)))
    n = len(queries)
    rows = []
    for label in ("hf-recompute", "hf-memory", "hf-disk", "flexgen (no reuse)"):
        extra = {"file_bytes": hf.file_bytes} if label == "hf-disk" else {}
        rows.append(_row(label, times[label], queries, **extra))
    rows.append(_row("ours: recomp", times["ours: recomp"], queries,
                     ttft_breakdown_s=recomp["ttft_breakdown_s"]))
    full = [logits[("ours: full", qi)] for qi in range(n)]
    for run in OURS:
        got = summaries[run.label]
        kl = [kl_divergence(full[qi], logits[(run.label, qi)]) for qi in range(n)]
        rows.append(_row(run.label, times[run.label], queries, kl=float(np.mean(kl)),
                         bytes_loaded_fraction=got["bytes_loaded_fraction"],
                         ttft_breakdown_s=got["ttft_breakdown_s"]))
    disk = times["hf-disk"]
    for row in rows:
        mine = times.get(row["label"])
        if mine is not None and len(mine) == len(disk):
            row["vs_hf_disk_paired"] = statistics.median(d / m for d, m in zip(disk, mine))
    return rows, {"max_logit_diff_reuse_vs_recompute": diff, "prefix_tokens": len(prefix),
                  "rounds": rounds}


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true", help="1024-token prefix, 2 queries")
    p.add_argument("--prefix-tokens", type=int, help="default 2048 (quick: 1024)")
    p.add_argument("--queries", type=int, help="default 3 (quick: 2)")
    p.add_argument("--query-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, help="interleaved rounds of the fast rows "
                   "(default 5, quick: 1)")
    p.add_argument("--sparsity-model", default="opt-125m",
                   help="OPT shape for FlexGen's attention sparsity rows ('' to skip)")
    p.add_argument("--store-root", help="where stores go (default: the temp dir)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.prefix_tokens is None:
        args.prefix_tokens = 1024 if args.quick else 2048
    if args.queries is None:
        args.queries = 2 if args.quick else 3
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.prefix_tokens < 64 or args.prefix_tokens % 64:
        p.error("--prefix-tokens must be a positive multiple of 64")
    if args.queries < 1 or args.threads < 1 or args.rounds < 1:
        p.error("--queries, --threads and --rounds must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    root = Path(args.store_root) if args.store_root else Path(tempfile.gettempdir())
    try:
        with Runtime(RuntimeConfig(model=args.model)) as rt:
            wl = build_workload(rt.tokenizer, WorkloadConfig(
                n_prefixes=1, prefix_tokens=args.prefix_tokens, queries_per_prefix=args.queries,
                query_tokens=args.query_tokens))
            prefix, queries = wl.prefixes[0], [q for _, q in wl.queries]
            with scratch.directory(root, "peers") as work:
                rows, check = measure(rt, wl, root, Path(work), args.rounds)
        notes = []
        if args.sparsity_model:
            rows += sparsity_rows(args.sparsity_model, prefix, queries)
            if not torch.cuda.is_available():
                notes.append(SPARSITY_NEEDS_CUDA)
                print(f"note: {SPARSITY_NEEDS_CUDA}")
    finally:
        torch.set_num_threads(threads)
    disk = next(r for r in rows if r["label"] == "hf-disk")["ttft_median_s"]
    for r in rows:
        r["vs_hf_disk"] = disk / r["ttft_median_s"]
    print(f"{'how':<36}{'TTFT median s':>14}{'x hf-disk':>10}{'paired':>8}")
    for r in rows:
        paired = f"{r['vs_hf_disk_paired']:>8.2f}" if "vs_hf_disk_paired" in r else ""
        print(f"{r['label']:<36}{r['ttft_median_s']:>14.3f}{r['vs_hf_disk']:>10.2f}{paired}")
    write_json(args.json, {"model": args.model, "threads": args.threads,
                           "prefix_tokens": args.prefix_tokens, "query_tokens": args.query_tokens,
                           "check": check, "notes": notes, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.peers", main))
