"""Decode on a serving thread, with and without a second thread owning a CPU team.

    python -m experiments.bench_compute_thread [--model smollm2-135m] [--tokens 32]
                                               [--batch 4] [--rounds 3] [--json PATH]

A server computes on its scheduler's thread, not on the main thread. torch gives each thread
that runs a parallel CPU operation a team of its own (impress_flexgen.cpu_threads). Each
round runs two fresh processes in turn, identical but for one thing: in `second_team` the
main thread first serves one short request itself, so it owns a team, as it did when it
loaded the weights with every core; in `one_team` it does nothing of the kind. Both then
decode on a worker thread, as `experiments.bench_decode --batch` does: `--batch` requests
stepped together (their contexts side by side), then one alone.
Reported: the medians of decode tokens/s per setting and their ratio.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading

import numpy as np

from impress_flexgen.entrypoints.args import ArgumentParser, int_range, write_json
from impress_flexgen.entrypoints.process import run_main

MODES = ("one_team", "second_team")


def child(model: str, mode: str, tokens: int, prompt_len: int, batch: int) -> dict:
    from experiments.bench_decode import batched, ours
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    with Runtime(RuntimeConfig(model=model)) as rt:
        vocab = rt.spec.config.vocab_size
        prompt = np.random.default_rng(0).integers(10, vocab, prompt_len).tolist()
        if mode == "second_team":
            ours(rt, prompt[:9], 2)          # the main thread computes: it keeps a team
        out = {}

        def decode() -> None:
            together, _, alone = batched(rt, prompt, tokens, batch)
            out.update(alone_tokens_per_s=alone,
                       batch_tokens_per_s=together["side_by_side"])
        worker = threading.Thread(target=decode, name="serving-thread")
        worker.start()
        worker.join()
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m experiments.bench_compute_thread",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int_range(2, 1024), default=32)
    ap.add_argument("--prompt", type=int_range(2, 2048), default=256)
    ap.add_argument("--batch", type=int_range(1, 64), default=4)
    ap.add_argument("--rounds", type=int_range(1, 10), default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="16 tokens, one round")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.rounds = 16, 1
    if args.child:
        print(json.dumps(child(args.model, args.child, args.tokens, args.prompt, args.batch)))
        return 0
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            cmd = [sys.executable, "-m", "experiments.bench_compute_thread", "--child", mode,
                   "--model", args.model, "--tokens", str(args.tokens), "--prompt",
                   str(args.prompt), "--batch", str(args.batch)]
            got = subprocess.run(cmd, capture_output=True, text=True)
            if got.returncode != 0:
                raise RuntimeError(f"{mode} run failed: {got.stderr.strip()[-2000:]}")
            row = json.loads(got.stdout.strip().splitlines()[-1])
            runs[mode].append(row)
            print(f"round {r}, {mode}: alone {row['alone_tokens_per_s']:.1f} tokens/s, "
                  f"{args.batch} together {row['batch_tokens_per_s']:.1f}", flush=True)
    med = {m: {k: float(np.median([row[k] for row in rows])) for k in rows[0]}
           for m, rows in runs.items()}
    ratio = {k: med["one_team"][k] / med["second_team"][k] for k in med["one_team"]}
    print(f"one team / second team: alone {ratio['alone_tokens_per_s']:.2f}x, "
          f"{args.batch} together {ratio['batch_tokens_per_s']:.2f}x")
    if args.json:
        write_json(args.json, {"model": args.model, "tokens": args.tokens,
                               "prompt": args.prompt, "batch": args.batch, "medians": med,
                               "one_team_over_second_team": ratio, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.bench_compute_thread", main))
