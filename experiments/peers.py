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
                   O_DIRECT reads, no GPU/CPU tier (everything served from disk).

Every row uses the same torch thread count (--threads, default 2). fp16 matrix products
are slow on CPUs, so both transformers and our runtime compute in fp32 on CPU (the store
holds fp16 K/V; our runtime converts chunks as they load).
"""
from __future__ import annotations

import copy
import inspect
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from impress_flexgen.cli import ArgumentParser, run_main, write_json
from impress_flexgen.engine import TierSizes
from impress_flexgen.runtime import Runtime, RuntimeConfig
from impress_flexgen.serving import RunConfig, run_workload
from impress_flexgen.workload import WorkloadConfig, build_workload


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


@torch.no_grad()
def hugging_face_rows(spec, prefix, queries, workdir: Path) -> tuple[list[dict], dict]:
    """TTFT of transformers recomputing, reusing in memory and reusing from disk."""
    from transformers import DynamicCache

    from impress_flexgen.reference import load_reference

    model = load_reference(spec)
    arg = _cache_arg(model)
    # Only the last position's logits make the first token (what generate() asks for too).
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in \
        inspect.signature(model.forward).parameters else {}
    n = len(prefix)
    times = {"hf-recompute": [], "hf-memory": [], "hf-disk": []}
    logits = {}

    def forward(ids, cache=None):
        x = torch.tensor([ids])
        kw = {arg: cache} if cache is not None else {}
        return model(input_ids=x, use_cache=True, **kw, **last_only)

    base = forward(prefix)
    cache = getattr(base, "cache", None) or base.past_key_values
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    path = workdir / "prefix_kv.pt"
    torch.save(kv, path)
    file_bytes = path.stat().st_size
    for qi, query in enumerate(queries):
        t0 = time.perf_counter()
        out = forward(prefix + query)
        times["hf-recompute"].append(time.perf_counter() - t0)
        logits[("recompute", qi)] = out.logits[0, -1]

        private = copy.deepcopy(cache)           # copied outside the timed region
        t0 = time.perf_counter()
        out = forward(query, private)
        times["hf-memory"].append(time.perf_counter() - t0)
        logits[("memory", qi)] = out.logits[0, -1]

        _drop_page_cache(path)
        t0 = time.perf_counter()
        loaded = torch.load(path)
        out = forward(query, DynamicCache(loaded))
        times["hf-disk"].append(time.perf_counter() - t0)
        logits[("disk", qi)] = out.logits[0, -1]
    # The reuse paths must compute what recomputing computes.
    diff = max(float((logits[(m, qi)] - logits[("recompute", qi)]).abs().max())
               for m in ("memory", "disk") for qi in range(len(queries)))
    rows = [_row(label, t, queries, **({"file_bytes": file_bytes} if label == "hf-disk" else {}))
            for label, t in times.items()]
    del model
    return rows, {"max_logit_diff_reuse_vs_recompute": diff, "prefix_tokens": n}


def _row(label: str, ttfts: list[float], queries, **extra) -> dict:
    return {"label": label, "ttft_median_s": statistics.median(ttfts),
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_s": ttfts, "queries": len(queries),
            **extra}


def flexgen_rows(rt: Runtime, prefix, queries) -> list[dict]:
    """FlexGen's generation loop over prefix + query (a full prefill each time)."""
    ttfts = [rt.generate([prefix + q], max_new_tokens=1).prefill_s for q in queries]
    return [_row("flexgen (no reuse)", ttfts, queries)]


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


def our_rows(rt: Runtime, wl, root: Path) -> list[dict]:
    rows, reference = [], {}
    for run in (RunConfig("ours: full", "full", 1.0), RunConfig("ours: recomp", "recomp", 1.0),
                RunConfig("ours: impress", "impress", 0.25)):
        ttfts = []
        result = run_workload(rt, wl, run, TierSizes(), store_root=root, reference=reference,
                              on_response=lambda qi, p, q, resp: ttfts.append(resp.stats.ttft_s))
        rows.append(_row(run.label, ttfts, wl.queries, kl=result["kl"],
                         bytes_loaded_fraction=result["bytes_loaded_fraction"],
                         ttft_breakdown_s=result["ttft_breakdown_s"]))
    return rows


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true", help="1024-token prefix, 2 queries")
    p.add_argument("--prefix-tokens", type=int, help="default 2048 (quick: 1024)")
    p.add_argument("--queries", type=int, help="default 3 (quick: 2)")
    p.add_argument("--query-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sparsity-model", default="opt-125m",
                   help="OPT shape for FlexGen's attention sparsity rows ('' to skip)")
    p.add_argument("--store-root", help="where stores go (default: the temp dir)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.prefix_tokens is None:
        args.prefix_tokens = 1024 if args.quick else 2048
    if args.queries is None:
        args.queries = 2 if args.quick else 3
    if args.prefix_tokens < 64 or args.prefix_tokens % 64:
        p.error("--prefix-tokens must be a positive multiple of 64")
    if args.queries < 1 or args.threads < 1:
        p.error("--queries and --threads must be positive")
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
            with tempfile.TemporaryDirectory(dir=root) as work:
                hf, check = hugging_face_rows(rt.spec, prefix, queries, Path(work))
            rows = hf + flexgen_rows(rt, prefix, queries) + our_rows(rt, wl, root)
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
    print(f"{'how':<36}{'TTFT median s':>14}{'x hf-disk':>10}")
    for r in rows:
        print(f"{r['label']:<36}{r['ttft_median_s']:>14.3f}{r['vs_hf_disk']:>10.2f}")
    write_json(args.json, {"model": args.model, "threads": args.threads,
                           "prefix_tokens": args.prefix_tokens, "query_tokens": args.query_tokens,
                           "check": check, "notes": notes, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.peers", main))
