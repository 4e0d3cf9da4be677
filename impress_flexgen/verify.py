"""Check our runtime against Hugging Face transformers, token for token.

    python -m impress_flexgen.verify --model smollm2-135m [--json out.json]

Greedy generation of each built-in prompt through our FlexGen runtime, once per placement
(default: weights and KV cache on CPU, then on disk), and through transformers on the same
weights. Exit status 0 only if every generated token matches.
"""
from __future__ import annotations

import sys

from .cli import ArgumentParser, add_model_args, dtype_arg, placement_arg, run_main, write_json
from .errors import UserError
from .runtime import Placement, Runtime, RuntimeConfig
from .texts import PROMPTS


def parse_args(argv):
    p = ArgumentParser(prog="python -m impress_flexgen.verify", description=__doc__.split("\n\n")[0])
    add_model_args(p, default_model=None)
    p.add_argument("--placement", type=placement_arg, action="append",
                   help="gpu, cpu, disk, mixed, or six comma-separated percentages "
                        "W_GPU,W_CPU,CACHE_GPU,CACHE_CPU,ACT_GPU,ACT_CPU; repeatable "
                        "(default: cpu and disk)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS),
                   help=f"how many built-in prompts (1-{len(PROMPTS)}, default all)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be between 1 and {len(PROMPTS)}")
    if args.new_tokens < 1:
        p.error("--new-tokens must be at least 1")
    return args


def compare(ours: list[int], our_logits, theirs: list[int], their_logits):
    """(matching token count, max |logit diff| over steps that shared the same context)."""
    same = 0
    while same < len(ours) and ours[same] == theirs[same]:
        same += 1
    steps = min(same + 1, len(ours))  # the first differing step still had the same context
    diff = (our_logits[:steps] - their_logits[:steps]).abs().max().item()
    return same, diff


def main(argv=None) -> int:
    args = parse_args(argv)
    placements = args.placement or [Placement.parse("cpu"), Placement.parse("disk")]
    base = RuntimeConfig(model=args.model, model_path=args.model_path, seed=args.seed,
                         dtype=dtype_arg(args.dtype), offload_dir=args.offload_dir)

    ours = []  # per placement: (placement, Generation)
    for placement in placements:
        with Runtime(RuntimeConfig(**{**base.__dict__, "placement": placement})) as rt:
            prompts = [rt.tokenizer.encode(t) for t in PROMPTS[: args.prompts]]
            spec = rt.spec
            ours.append((placement, [rt.generate([p], args.new_tokens, record_logits=True)
                                     for p in prompts]))

    from .reference import greedy, load_reference

    reference = load_reference(spec)
    theirs = [greedy(reference, p, args.new_tokens) for p in prompts]

    compared = matched = 0
    max_diff = 0.0
    per_placement = []
    for placement, gens in ours:
        ok = True
        for gen, (ref_ids, ref_logits) in zip(gens, theirs):
            same, diff = compare(gen.new_ids[0], gen.logits[0], ref_ids, ref_logits)
            compared += len(ref_ids)
            matched += same
            max_diff = max(max_diff, diff)
            ok &= same == len(ref_ids)
        per_placement.append({"placement": placement.describe(), "match": ok})

    result = {
        "model": spec.name,
        "match": matched == compared,
        "tokens_compared": compared,
        "tokens_matched": matched,
        "max_abs_logit_diff": round(max_diff, 6),
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "runtime_dtype": spec.config.dtype.__name__,
        "reference": "transformers, float32",
        "placements": per_placement,
    }
    write_json(args.json, result)
    status = "MATCH" if result["match"] else "MISMATCH"
    print(f"{status}: {spec.name}, {matched}/{compared} tokens equal to transformers over "
          f"{len(prompts)} prompts x {args.new_tokens} tokens x {len(placements)} placements; "
          f"max |logit diff| {max_diff:.4g}")
    for row in per_placement:
        print(f"  {'ok  ' if row['match'] else 'FAIL'} {row['placement']}")
    return 0 if result["match"] else 1


if __name__ == "__main__":
    sys.exit(run_main("python -m impress_flexgen.verify", main))
