"""What exactness costs: a cold prefill in canonical calls against the same prefill in one
call, and the bytes of the store's KV formats.

    python -m experiments.bench_exact [--quick] [--threads N] [--json out.json]

An exact policy runs a request's whole-chunk prefix rows through every product in calls of
256 rows and attends them by tiles of 64 positions (engine/attention.py), so that stored KV
is recomputed KV bit for bit. This times a cold prefill of a prefix plus a query both ways,
alternating in one process, wall and CPU time, and checks that the logits agree to rounding.
Where other processes share the cores, every parallel call waits for its threads to be
scheduled, which counts the number of calls more than their work: `--threads 1` shows the
work. The store's bytes per token come from its ModelShape for each format. `--quick`:
llama-tiny, 3 rounds; otherwise smollm2-135m, 1,024 + 64 tokens, 5 rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def measure(quick: bool, threads: int | None = None) -> dict:
    from impress_flexgen.engine import Request, RequestStats, Sequence, assemble, model_shape
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig
    from impress_flexgen.store import CHUNK_SIZE
    from policies import make_policy

    model, n_prefix, n_query, rounds = ("llama-tiny", 512, 64, 3) if quick else \
        ("smollm2-135m", 1024, 64, 5)
    ids = np.random.default_rng(0).integers(10, 40000, n_prefix + n_query).tolist()
    end = n_prefix // CHUNK_SIZE * CHUNK_SIZE
    with tempfile.TemporaryDirectory(prefix="bench-exact-") as tmp, \
            Runtime(RuntimeConfig(model=model, offload_dir=str(Path(tmp) / "off"))) as rt:
        if threads:
            torch.set_num_threads(threads)
        engine = assemble(rt, make_policy("recomp"), None).engine

        def prefill(canonical_end: int):
            stats = RequestStats()
            t0, c0 = time.perf_counter(), time.process_time()
            seq = Sequence(Request([], ids), stats=stats, new_ids=ids,
                           canonical_end=canonical_end)
            (_, _, tail, out_w), = engine.runner.prefill([seq])
            logits = engine.math.logits(out_w, tail[-1:])
            return time.perf_counter() - t0, time.process_time() - c0, logits

        prefill(end)                       # warm-up: weights paged in, rotary table built
        times = {"one_call": [], "tiles": []}
        cpu = {"one_call": [], "tiles": []}
        logits = {}
        for _ in range(rounds):
            for key, at in (("one_call", 0), ("tiles", end)):
                t, c, logits[key] = prefill(at)
                times[key].append(t)
                cpu[key].append(c)
        formats = {f: model_shape(rt.spec, kv_format=f) for f in ("fp32", "fp16", "bf16")}
        compute = model_shape(rt.spec).kv_format
    one_s, tiles_s = (statistics.median(times[k]) for k in ("one_call", "tiles"))
    one_cpu, tiles_cpu = (statistics.median(cpu[k]) for k in ("one_call", "tiles"))
    return {"model": model, "prefix_tokens": n_prefix, "query_tokens": n_query,
            "rounds": rounds, "threads": torch.get_num_threads(), "one_call_s": one_s, "tiles_s": tiles_s,
            "tiles_over_one_call": tiles_s / one_s, "times_s": times,
            "one_call_cpu_s": one_cpu, "tiles_cpu_s": tiles_cpu, "cpu_s": cpu,
            "tiles_over_one_call_cpu": tiles_cpu / one_cpu,
            "logits_max_abs_diff": float((logits["one_call"] - logits["tiles"]).abs().max()),
            "compute_kv_format": compute,
            "kv_bytes_per_token": {f: s.n_layers * s.kv_bytes_per_token_layer
                                   for f, s in formats.items()},
            "kv_exact": {f: s.kv_exact for f, s in formats.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_exact",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="llama-tiny, 3 rounds")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: torch's); 1 shows the work itself where "
                        "other processes share the cores (each parallel call then waits for "
                        "its threads to be scheduled)")
    p.add_argument("--json", metavar="PATH", help="write the result here")
    args = p.parse_args(argv)
    r = measure(args.quick, args.threads)
    print(f"{r['model']}: cold prefill of {r['prefix_tokens']} + {r['query_tokens']} tokens, "
          f"{r['threads']} thread(s), median of {r['rounds']}: one call {r['one_call_s']:.3f} s, canonical tiles "
          f"{r['tiles_s']:.3f} s ({r['tiles_over_one_call']:.2f}x; CPU time "
          f"{r['tiles_over_one_call_cpu']:.2f}x); first-token logits differ by "
          f"{r['logits_max_abs_diff']:.2g} (rounding)")
    print("stored KV per token: " + ", ".join(
        f"{f} {n / 1024:.1f} KiB{' (exact)' if r['kv_exact'][f] else ''}"
        for f, n in r["kv_bytes_per_token"].items()) + f"; compute dtype {r['compute_kv_format']}")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
