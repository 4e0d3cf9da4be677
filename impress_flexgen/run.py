"""impress_flexgen's main job: generate with a model placed by FlexGen across GPU, CPU and disk.

    python -m impress_flexgen.run                      # smollm2-135m, built-in prompts
    python -m impress_flexgen.run --model opt-30b --placement 20,80,0,100,100,0
    python -m impress_flexgen.run --model-path ~/ckpt/opt-1.3b --model opt-1.3b --prompt "Hi"
"""
from __future__ import annotations

import sys
import time

from .cli import ArgumentParser, add_model_args, dtype_arg, placement_arg, run_main, write_json
from .errors import UserError
from .runtime import Placement, Runtime, RuntimeConfig
from .texts import PROMPTS


def parse_args(argv):
    p = ArgumentParser(prog="python -m impress_flexgen.run",
                       description="Generate text with a FlexGen-placed OPT or Llama model.")
    add_model_args(p, default_model="smollm2-135m")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="prompt text; repeatable (default: built-in public-domain passages)")
    src.add_argument("--prompt-ids", action="append", metavar="IDS",
                     help="prompt as comma-separated token ids; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--placement", type=placement_arg, default=None,
                   help="gpu, cpu, disk, mixed, or six comma-separated percentages "
                        "W_GPU,W_CPU,CACHE_GPU,CACHE_CPU,ACT_GPU,ACT_CPU "
                        "(default: gpu, i.e. everything on the compute device; without CUDA "
                        "that is a separate CPU memory pool)")
    p.add_argument("--no-overlap", action="store_true",
                   help="run FlexGen's sequential loop instead of overlapping I/O and compute")
    p.add_argument("--compress-weight", action="store_true",
                   help="FlexGen's 4-bit group-quantized weights")
    p.add_argument("--json", metavar="PATH", help="write prompts, outputs and timings as JSON")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    return args


def _prompt_ids(args, tokenizer) -> list[list[int]]:
    if args.prompt_ids:
        try:
            return [[int(x) for x in s.split(",") if x.strip()] for s in args.prompt_ids]
        except ValueError:
            raise UserError("--prompt-ids takes comma-separated integers") from None
    return [tokenizer.encode(t) for t in (args.prompt or PROMPTS)]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    placement = args.placement or Placement.parse("gpu")
    cfg = RuntimeConfig(model=args.model, model_path=args.model_path, placement=placement,
                        offload_dir=args.offload_dir, seed=args.seed, dtype=dtype_arg(args.dtype),
                        overlap=not args.no_overlap, compress_weight=args.compress_weight)
    t0 = time.perf_counter()
    with Runtime(cfg) as rt:
        tokenizer = None if args.prompt_ids else rt.tokenizer
        prompts = _prompt_ids(args, tokenizer)
        device = "cuda" if torch.cuda.is_available() else "cpu only"
        weights = "random (seed %d)" % rt.spec.seed if rt.spec.random_weights else rt.spec.weight_path
        print(f"model {rt.spec.name} ({rt.spec.family}, {rt.spec.config.dtype.__name__}, {device}); "
              f"weights: {weights}")
        print(f"placement: {placement.describe()}; built in {rt.load_s:.1f} s")
        if tokenizer is not None:
            print(f"tokenizer: {tokenizer.source}")
        records = []
        for ids in prompts:
            gen = rt.generate([ids], args.max_new_tokens)
            text = tokenizer.decode(gen.new_ids[0]) if tokenizer else None
            shown = text if text is not None else ",".join(map(str, gen.new_ids[0]))
            prompt_text = tokenizer.decode(ids) if tokenizer else ",".join(map(str, ids))
            print(f"\n--- {len(ids)} prompt tokens: {prompt_text[:80]!r}...")
            print(f"+++ {shown}")
            print(f"    prefill {gen.prefill_s:.3f} s, decode {gen.decode_s_per_token * 1e3:.1f} "
                  f"ms/token")
            records.append({"prompt_ids": ids, "new_ids": gen.new_ids[0], "text": text,
                            "prefill_s": gen.prefill_s,
                            "decode_s_per_token": gen.decode_s_per_token})
    write_json(args.json, {"model": cfg.model, "placement": placement.describe(),
                           "results": records, "total_s": time.perf_counter() - t0})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m impress_flexgen.run", main))
