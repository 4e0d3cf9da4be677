"""Prefill and decode time of a FlexGen-placed model on random token ids.

    python -m experiments.prefill_decode --model opt-6.7b --prompt-len 2048 --gen-len 32
    python -m experiments.prefill_decode --quick --json out.json      # tiny models, CPU

Each configuration is timed after one untimed warm-up generation, in the same process, so
placements can be compared side by side.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch

from impress_flexgen.entrypoints.args import ArgumentParser, dtype_arg, placement_arg, write_json
from impress_flexgen.models import dtypes
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.models.runtime import Placement, Runtime, RuntimeConfig


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.prefill_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="model name; repeatable "
                   "(default: opt-6.7b with CUDA; opt-mini and llama-tiny without)")
    p.add_argument("--placement", type=placement_arg, action="append",
                   help="repeatable (default: gpu)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="timed generations per configuration")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--offload-dir", metavar="DIR")
    p.add_argument("--quick", action="store_true", help="tiny models, 256-token prompts, 8 tokens")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_len, args.gen_len, args.repeats = 256, 8, 1
    if not args.model:
        args.model = ["opt-6.7b"] if torch.cuda.is_available() and not args.quick \
            else ["opt-mini", "llama-tiny"]
    if min(args.prompt_len, args.gen_len, args.repeats) < 1:
        p.error("--prompt-len, --gen-len and --repeats must be positive")
    return args


def measure(model: str, placement: Placement, args) -> dict:
    cfg = RuntimeConfig(model=model, placement=placement, dtype=dtype_arg(args.dtype),
                        offload_dir=args.offload_dir)
    t0 = time.perf_counter()
    with Runtime(cfg) as rt:
        build_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        vocab = rt.spec.config.vocab_size
        prompt = rng.integers(10, vocab, size=args.prompt_len).tolist()
        rt.generate([prompt], 2)  # warm-up: allocator, kernels, page cache of disk weights
        runs = [rt.generate([prompt], args.gen_len) for _ in range(args.repeats)]
    return {
        "model": model,
        "placement": placement.describe(),
        "dtype": dtypes.name(rt.spec.config.dtype),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "build_s": round(build_s, 3),
        "prefill_s": round(min(r.prefill_s for r in runs), 4),
        "decode_s_per_token": round(min(r.decode_s_per_token for r in runs), 5),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    placements = args.placement or [Placement.parse("gpu")]
    rows = []
    for model in args.model:
        for placement in placements:
            row = measure(model, placement, args)
            rows.append(row)
            print(f"{row['model']:>12} {row['dtype']:>7} {row['placement']}: build "
                  f"{row['build_s']:.1f} s, prefill {row['prompt_len']} tokens "
                  f"{row['prefill_s']:.3f} s, decode {row['decode_s_per_token'] * 1e3:.1f} ms/token")
    write_json(args.json, {"results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.prefill_decode", main))
