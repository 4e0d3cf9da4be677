"""The policy search's cost model against measured decode throughput.

    python -m experiments.policy_search_check [--quick] [--json PATH] [--cached]

Each row runs one policy through FlexGen's own overlapped loop (Runtime.generate: a block
of gpu_batch_size x num_gpu_batches prompts of --prompt-tokens, --new-tokens each) and
compares its decode tokens/s (the block over its median decode step in four generations)
with planner/policy_search.predict from this machine's rates, measured twice at the start,
the faster of each kept (--cached: the rates an earlier start cached), on the share of a
core a busy thread got just before and after the row (machine.cpu_share: the machine is
shared with other work; the prediction for an idle machine is in the JSON too). Rows: opt-125m
(random weights) in memory, with its weights on disk (batch 1 and a block of 32), half on
disk, its KV cache on disk, 4-bit weights, and the policy the search chooses for fp32 under
a RAM cap (--max-ram-gb); smollm2-135m in memory. Without --quick also opt-1.3b with its
weights on disk. Error is measured / predicted - 1.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import psutil

from impress_flexgen.entrypoints.args import ArgumentParser, finite_float, int_range, write_json
from impress_flexgen.entrypoints.process import run_main

GiB = 1 << 30
RSS_LIMIT = 8 * GiB
ROUNDS = 4      # generations per row; its median decode step is what is compared


def rows_for(quick: bool, opt: str = "opt-125m", llama: str = "smollm2-135m"):
    from impress_flexgen.planner.policy_search import Policy

    rows = [
        ("opt-125m", "in memory, batch 1", Policy(100, 0, 100, 0, 1, 1)),
        ("opt-125m", "in memory, batch 8", Policy(100, 0, 100, 0, 8, 1)),
        ("opt-125m", "weights on disk, batch 1", Policy(0, 0, 100, 0, 1, 1)),
        ("opt-125m", "weights on disk, block 8x4", Policy(0, 0, 100, 0, 8, 4)),
        ("opt-125m", "half the weights on disk, batch 8", Policy(50, 0, 100, 0, 8, 1)),
        ("opt-125m", "KV cache on disk, batch 8", Policy(100, 0, 0, 0, 8, 1)),
        ("opt-125m", "4-bit weights, batch 8", Policy(100, 0, 100, 0, 8, 1, True)),
        ("opt-125m", "searched, fp32 under the RAM cap", None),
        ("smollm2-135m", "in memory, batch 1", Policy(100, 0, 100, 0, 1, 1)),
        ("smollm2-135m", "in memory, batch 4", Policy(100, 0, 100, 0, 4, 1)),
    ]
    if not quick:
        rows.append(("opt-1.3b", "weights on disk, block 8x2", Policy(0, 0, 100, 0, 8, 2)))
    names = {"opt-125m": opt, "smollm2-135m": llama}
    return [(names.get(model, model), label, policy) for model, label, policy in rows]


def measure(cfg, spec, block: int, prompt_tokens: int, new_tokens: int) -> tuple[float, int]:
    """(decode tokens/s of the block: its median decode step over ROUNDS generations, a
    step as the machine's load let it run, as the prediction's share of a core is; peak
    RSS so far)."""
    from flexgen.timer import timers

    from impress_flexgen.models.runtime import Runtime

    prompts = [[5 + (7 * i + j) % 1000 for j in range(prompt_tokens)] for i in range(block)]
    steps = []
    with Runtime(cfg, spec=spec) as rt:
        for _ in range(ROUNDS):
            rt.generate(prompts, new_tokens)
            steps += timers("generate").costs[1:]    # [0] is the prefill
    rss = psutil.Process().memory_info().rss
    if rss > RSS_LIMIT:
        raise RuntimeError(f"RSS {rss / GiB:.1f} GiB is past {RSS_LIMIT / GiB:.0f} GiB")
    return block / float(np.median(steps)), rss


def _searched(spec, machine, workload, ram_bytes):
    from impress_flexgen.models.formats import candidates
    from impress_flexgen.models.placement import machine_resources
    from impress_flexgen.paths import offload_dir
    from impress_flexgen.planner.policy_search import model_shape, search

    limits = machine_resources(offload_dir(), ram_bytes, None)
    fp32 = candidates(False, np.float32, False)
    found = search(model_shape(spec), machine, limits, workload, formats=fp32,
                   compress_cache=False)
    if found is None:
        raise RuntimeError(f"nothing fits {spec.name} under {ram_bytes / GiB:g} GiB of RAM")
    return found.policy


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m experiments.policy_search_check",
                       description="The policy search's predicted against measured decode "
                                   "tokens/s.")
    p.add_argument("--quick", action="store_true", help="opt-125m and smollm2-135m only")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--cached", action="store_true",
                   help="use the machine rates an earlier start cached (default: measure now)")
    p.add_argument("--opt", default="opt-125m", help="the OPT model of the rows (opt-125m)")
    p.add_argument("--llama", default="smollm2-135m",
                   help="the Llama model of the rows (smollm2-135m)")
    p.add_argument("--prompt-tokens", type=int_range(1, 512), default=32)
    p.add_argument("--new-tokens", type=int_range(3, 64), default=8)
    p.add_argument("--max-ram-gb", type=finite_float(0, low_open=True), default=0.8,
                   help="the RAM budget the searched row is planned in (0.8: opt-125m's fp32 "
                        "weights do not all fit beside a block's working memory)")
    args = p.parse_args(argv)

    import dataclasses

    from impress_flexgen.models.runtime import RuntimeConfig, resolve_spec
    from impress_flexgen.planner.machine import cpu_share, faster
    from impress_flexgen.planner.policy_search import (Workload, error, measure_machine,
                                                       model_shape, predict)

    t0 = time.perf_counter()
    machine = measure_machine(False, use_cache=args.cached)
    if not args.cached:     # measured again, the best of the two: the machine is shared
        machine = faster(machine, measure_machine(False, use_cache=False))
    print(f"machine rates ({'cached' if args.cached else 'measured twice'} in "
          f"{time.perf_counter() - t0:.1f} s): {machine}", flush=True)
    workload = Workload(args.prompt_tokens, args.new_tokens)
    out = []
    for model, label, policy in rows_for(args.quick, args.opt, args.llama):
        base = RuntimeConfig(model=model, dtype=np.float32)
        spec = resolve_spec(base, check_placement=False)
        if policy is None:
            policy = _searched(spec, machine, workload, int(args.max_ram_gb * GiB))
        cfg = RuntimeConfig(model=model, dtype=np.float32, placement=policy.placement,
                            gpu_batch_size=policy.gpu_batch_size,
                            num_gpu_batches=policy.num_gpu_batches,
                            compress_weight=policy.compress_weight,
                            compress_cache=policy.compress_cache,
                            work_tokens=args.prompt_tokens + args.new_tokens)
        spec = resolve_spec(cfg)
        before = cpu_share()
        measured, rss = measure(cfg, spec, policy.block, args.prompt_tokens, args.new_tokens)
        share = (before + cpu_share()) / 2     # the machine's load while the row ran
        alone = predict(model_shape(spec), policy, dataclasses.replace(machine, share=1.0),
                        workload)
        predicted = predict(model_shape(spec), policy,
                            dataclasses.replace(machine, share=share), workload)
        err = error(predicted.decode_tokens_per_s, measured)
        row = {"model": model, "row": label, "policy": policy.describe(),
               "predicted_decode_tokens_per_s": predicted.decode_tokens_per_s,
               "measured_decode_tokens_per_s": measured, "error": err, "cpu_share": share,
               "predicted_on_an_idle_machine": alone.decode_tokens_per_s,
               "predicted_read_s": predicted.read_s, "predicted_compute_s": predicted.compute_s,
               "peak_rss_bytes": rss}
        out.append(row)
        print(f"{model:13s} {label:34s} {policy.describe():72s} predicted "
              f"{predicted.decode_tokens_per_s:7.1f} measured {measured:7.1f} tokens/s "
              f"error {err:+.0%} (share of a core {share:.2f})", flush=True)
    worst = max(abs(r["error"]) for r in out)
    print(f"worst error {worst:.0%} over {len(out)} rows")

    write_json(args.json, {"machine": dataclasses.asdict(machine), "rows": out,
                           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                           "worst_error": worst})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.policy_search_check", main))
