"""Decode with the KV cache in memory against the KV cache on the disk (FlexGen's cache
percentages applied to the serving engine's decode context, engine/kv_home.py).

    python -m experiments.bench_kv_home [--model smollm2-135m] [--prefix 1024] [--batch 8]
                                        [--tokens 32] [--quick] [--json F]

A batch of `--batch` requests, each with its own `--prefix`-token prompt (random ids) and
an 8-token query, decoded `--tokens` new tokens together, greedy, with the weights on the
compute device and the KV cache placed `memory` (100,0: FlexGen's "gpu" share; without CUDA
that is RAM) or `disk` (0,0: a file per sequence, each layer's context read back each step,
the next layer's read behind this one's compute). Each row in a process of its own.

Rows: `cache` (memory, disk), `decode_tokens_per_s` (tokens generated after the first, per
second of decode steps), `step_s` (median decode step), `kv_gb` (the decode contexts' K and
V at the last step), `decode_rss_gb` (the largest RSS after a decode step while the
contexts are held, freed heap returned first: what decoding holds), `peak_rss_gb` (prefill included: a prefill pass
holds its layers' K and V in memory wherever they go after it), `kv_disk_bytes` (context
bytes read back from the disk, all requests), `kv_disk_wait_s` (per request, the time its
steps waited for them) and `same_tokens` (the row's tokens equal the first row's); rows
for each cache `--rounds` times in turn, then per cache the medians over rounds.
The disk's reads are of files just written: the page cache serves most of them
(`page_cache`: true), as it would on a server with free RAM; RSS does not count it.
`--quick`: a 256-token prefix, batch 4, 8 new tokens.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from impress_flexgen.entrypoints.args import ArgumentParser, int_range, write_json
from impress_flexgen.entrypoints.process import run_main

QUERY_TOKENS = 8
CACHES = {"memory": "100,0,100,0,100,0", "disk": "100,0,0,0,100,0"}


def _rss_gb() -> float:
    """The RSS now, after handing freed heap back to the system (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def worker(job: dict) -> dict:
    import gc

    import numpy as np
    from policies import ServingConfig, make_policy

    from impress_flexgen.engine import Request, SchedulerConfig, assemble
    from impress_flexgen.models.placement import Placement
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    cfg = RuntimeConfig(model=job["model"], offload_dir=job["dir"],
                        placement=Placement.parse(CACHES[job["cache"]]))
    with Runtime(cfg) as rt:
        engine = assemble(rt, make_policy("full", ServingConfig()), None).engine
        batch = job["batch"]
        engine.schedule_by(SchedulerConfig(max_batch_size=batch, max_batch_tokens=1 << 20))
        rng = np.random.default_rng(0)
        vocab = rt.spec.config.vocab_size
        reqs = [Request(rng.integers(10, vocab, job["prefix"]).tolist(),
                        rng.integers(10, vocab, QUERY_TOKENS).tolist(), job["tokens"])
                for _ in range(batch)]
        seqs = [engine.add_request(r) for r in reqs]
        engine.step()                        # the prefill pass and the first tokens
        made, steps = sum(len(s.tokens) for s in seqs), []
        m = engine.math
        record = 2 * m.n_kv_head * m.head_dim * engine.dtype.itemsize    # a token's K and V
        kv, decode_rss = 0, 0.0
        while not all(s.finished for s in seqs):
            kv = sum(ctx.n for s in seqs if s.kv for ctx in s.kv) * record
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
            if not all(s.finished for s in seqs):      # the contexts are still held
                gc.collect()
                decode_rss = max(decode_rss, _rss_gb())
        stats = [s.result().stats for s in seqs]
        engine.close()
        tokens = [s.result().tokens for s in seqs]
    generated = sum(len(t) for t in tokens) - made
    return {"model": job["model"], "cache": job["cache"], "batch": batch,
            "prefix": job["prefix"], "new_tokens": job["tokens"],
            "decode_tokens_per_s": generated / sum(steps), "step_s": statistics.median(steps),
            "kv_gb": kv / 1e9,
            "decode_rss_gb": decode_rss,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
            "kv_disk_bytes": sum(st.kv_disk_bytes for st in stats),
            "kv_disk_wait_s": statistics.fmean(st.kv_disk_wait_s for st in stats),
            "page_cache": job["cache"] == "disk", "tokens": tokens}


def _child(job: dict, timeout_s: float) -> dict:
    env = {**os.environ, "IMPRESS_FLEXGEN_PROGRESS": "0"}
    out = subprocess.run([sys.executable, "-m", "experiments.bench_kv_home", "--worker",
                          json.dumps(job)], capture_output=True, text=True, timeout=timeout_s,
                         env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{job['cache']}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
        return 0
    ap = ArgumentParser(prog="python -m experiments.bench_kv_home",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix", type=int_range(1), default=1024)
    ap.add_argument("--batch", type=int_range(1), default=8)
    ap.add_argument("--tokens", type=int_range(2), default=32)
    ap.add_argument("--quick", action="store_true",
                    help="a 256-token prefix, batch 4, 8 new tokens")
    ap.add_argument("--rounds", type=int_range(1), default=2,
                    help="each cache measured this many times, in turn (medians reported)")
    ap.add_argument("--timeout", type=int_range(10), default=3600,
                    help="seconds for each row's process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.prefix, args.batch, args.tokens = 256, 4, 8
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_kv_home-") as tmp:
        for round_ in range(args.rounds):      # in turn: a busy spell hits both caches
            for cache in CACHES:
                job = {"model": args.model, "cache": cache, "prefix": args.prefix,
                       "batch": args.batch, "tokens": args.tokens,
                       "dir": tempfile.mkdtemp(dir=tmp)}
                rows.append({"round": round_, **_child(job, args.timeout)})
    ref = rows[0]["tokens"]
    for row in rows:
        row["same_tokens"] = row.pop("tokens") == ref
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                          for k, v in row.items()}), flush=True)
    summary = {cache: {key: statistics.median(r[key] for r in rows if r["cache"] == cache)
                       for key in ("decode_tokens_per_s", "step_s", "decode_rss_gb",
                                   "peak_rss_gb", "kv_gb")} for cache in CACHES}
    print(json.dumps({"median_of_rounds": summary}), flush=True)
    write_json(args.json, {"rows": rows, "median_of_rounds": summary})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("bench_kv_home", main))
