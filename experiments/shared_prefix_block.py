"""A block of requests on one stored prefix: its chunks read once for the block, or once per
request, side by side in one run.

    python -m experiments.shared_prefix_block [--model smollm2-135m] [--requests 16]
                                              [--prefix-tokens 1024] [--policies full,impress]
                                              [--disk-read-limit MB/s] [--quick] [--json PATH]

A passage of a public-domain book (about `--prefix-tokens` tokens) is stored by a first
request; then `--requests` requests, each that passage and a question of its own, arrive
together and are prefilled in one pass (the engine's block: every layer's weights brought
once for all of them). Per policy (`full`: every chunk; impress: each request's own
selection), on a fresh store of its own, the pass runs with its sequences' chunk reads
shared (each chunk read once, handed to every sequence that needs it) and with each
sequence reading its own (Runner.share_reads off: the engine before sharing), in
alternation, `--rounds` times. The store reads with O_DIRECT (no page cache) and no memory
tier is configured, so every load is a disk read; reordering is off so that every round
sees the same layout. Reported per row: the bytes the store read from disk for the pass
(chunks and probe keys), the chunks read, the pass's wall time (prefill up to the first
tokens; median over rounds), and whether every request's first token and logits equal those
of the other mode. `--disk-read-limit` caps the store's reads (a slower disk than this one).
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from impress_flexgen.entrypoints.args import (ArgumentParser, choose_list, finite_float,
                                              int_range, write_json)
from impress_flexgen.entrypoints.process import run_main

MODES = ("per_request", "shared")


def prompts(rt, n: int, prefix_tokens: int, query_tokens: int, chunk: int):
    """(prefix ids: whole chunks, one passage; per request a question of its own)."""
    from impress_flexgen.bench.corpus import passages

    text = passages("austen_pride_and_prejudice", prefix_tokens * 8, 1, seed=0)[0]
    prefix = rt.tokenizer.encode(text)[:prefix_tokens // chunk * chunk]
    if len(prefix) < prefix_tokens // chunk * chunk:
        raise RuntimeError(f"the passage has only {len(prefix)} tokens")
    asks = passages("austen_emma", 200, n, seed=1)
    queries = [rt.tokenizer.encode("\n\nQuestion: " + q)[:query_tokens] for q in asks]
    return prefix, queries


def run_policy(rt, name: str, retention: float, prefix, queries, chunk: int, rounds: int,
               root: Path, read_limit: float | None = None) -> list[dict]:
    from impress_flexgen.engine import Request, SchedulerConfig, assemble, open_store
    from impress_flexgen.tiers import TierConfig
    from policies import ServingConfig, make_policy

    cfg = ServingConfig(retention=retention)
    policy = make_policy(name, cfg)
    store = open_store(root / name, rt, cfg, policy, chunk_size=chunk, reorder_interval=0,
                       read_limit_mb_s=read_limit)
    rows = {mode: [] for mode in MODES}
    answers = {}
    try:
        engine = assemble(rt, policy, store, TierConfig()).engine
        engine.serve(Request(prefix, [queries[0][0]], 1))          # stores the passage
        n = len(queries)
        sched = SchedulerConfig(max_batch_size=n, max_batch_tokens=n * (len(prefix) + 64))
        real = engine.runner.prefill
        spent = []

        def timed(seqs):
            t0 = time.perf_counter()
            out = real(seqs)
            spent.append((len(seqs), time.perf_counter() - t0))
            return out

        engine.runner.prefill = timed
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                engine.runner.share_reads = mode == "shared"
                m0 = store.inspect().state.metrics
                before = (m0.bytes_read, m0.probe_bytes_read, m0.chunks_read)
                spent.clear()
                reqs = [Request(prefix, q, 1, keep_logits=True) for q in queries]
                got = engine.serve_all(reqs, sched)
                bad = [g for g in got if isinstance(g, Exception)]
                if bad:
                    raise bad[0]
                if [k for k, _ in spent] != [n]:
                    raise RuntimeError(f"the block was not one pass: {spent}")
                m = store.inspect().state.metrics
                rows[mode].append({
                    "disk_bytes": m.bytes_read - before[0],
                    "probe_bytes": m.probe_bytes_read - before[1],
                    "chunks_read": m.chunks_read - before[2],
                    "pass_s": spent[0][1],
                    "load_s": sum(g.stats.load_s for g in got),
                    "matched_tokens": min(g.stats.matched_tokens for g in got),
                    "chunks_from_pass": sum(g.stats.chunks_from_pass for g in got),
                    "bytes_read_in_stats": sum(g.stats.bytes_read["disk"] for g in got)})
                answers.setdefault(mode, [(g.tokens, g.step_logits[0]) for g in got])
        engine.close()
    finally:
        store.close()
    same = all(a[0] == b[0] and torch.equal(a[1], b[1])
               for a, b in zip(answers["per_request"], answers["shared"]))
    out = []
    for mode in MODES:
        runs = rows[mode]
        row = {"policy": name, "mode": mode, "requests": len(queries),
               "direct_io": store.config.direct_io,
               "prefix_tokens": len(prefix), "rounds": runs,
               "pass_s": float(np.median([x["pass_s"] for x in runs])),
               "same_answers_as_other_mode": same}
        for key in ("disk_bytes", "probe_bytes", "chunks_read", "matched_tokens",
                    "chunks_from_pass", "bytes_read_in_stats"):
            row[key] = int(np.median([x[key] for x in runs]))
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m experiments.shared_prefix_block",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int_range(2, 64), default=16)
    ap.add_argument("--prefix-tokens", type=int_range(16, 8192), default=1024)
    ap.add_argument("--query-tokens", type=int_range(1, 256), default=24)
    ap.add_argument("--chunk-size", type=int_range(1, 1024), default=16)
    ap.add_argument("--retention", type=float, default=0.25, help="impress's (0.25)")
    ap.add_argument("--rounds", type=int_range(1, 10), default=3)
    ap.add_argument("--policies", default="full,impress", help="full, impress or both")
    ap.add_argument("--disk-read-limit", type=finite_float(0, low_open=True), default=None,
                    help="cap the store's reads at this many MB/s (default: none)")
    ap.add_argument("--quick", action="store_true", help="8 requests, 512 tokens, one round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.policies = choose_list(ap, "--policies", args.policies, ("full", "impress"))
    if args.quick:
        args.requests, args.prefix_tokens, args.rounds = 8, 512, 1
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    results = []
    with Runtime(RuntimeConfig(model=args.model)) as rt, \
            tempfile.TemporaryDirectory(prefix="shared-block-") as tmp:
        prefix, queries = prompts(rt, args.requests, args.prefix_tokens, args.query_tokens,
                                  args.chunk_size)
        for name in args.policies:
            retention = 1.0 if name == "full" else args.retention
            for row in run_policy(rt, name, retention, prefix, queries, args.chunk_size,
                                  args.rounds, Path(tmp), args.disk_read_limit):
                results.append(row)
                print(f"{row['policy']:8s} {row['mode']:12s} {row['requests']} requests x "
                      f"{row['prefix_tokens']} stored tokens: read "
                      f"{row['disk_bytes'] / 2**20:7.2f} MiB chunks + "
                      f"{row['probe_bytes'] / 2**20:.2f} MiB probe keys "
                      f"({row['chunks_read']} chunks), pass {row['pass_s']:.3f} s, "
                      f"same answers: {row['same_answers_as_other_mode']}", flush=True)
    write_json(args.json, {"model": args.model, "requests": args.requests,
                           "prefix_tokens": args.prefix_tokens,
                           "chunk_size": args.chunk_size, "retention": args.retention,
                           "query_tokens": args.query_tokens,
                           "disk_read_limit_mb_s": args.disk_read_limit,
                           "memory_tiers": False, "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.shared_prefix_block", main))
