"""Check our runtime against Hugging Face transformers, token for token.

    python -m impress_flexgen.verify --model smollm2-135m [--json out.json]

Greedy generation of each built-in prompt through our FlexGen runtime, once per placement
(default: the automatic placement, then weights and KV cache on disk), and through
transformers on the same weights. Exit status 0 only if every generated token matches.
"""
from __future__ import annotations

import sys

from ..bench.texts import PROMPTS
from ..config import runtime_memory_fields
from ..models import dtypes
from ..models.runtime import (AUTO, Placement, Runtime, RuntimeConfig, check_lengths, make_plan,
                              resolve_spec)
from .args import (PLACEMENT_HELP, ArgumentParser, add_model_args, dtype_arg, int_range,
                   placement_arg, write_json)
from .process import run_main


def parse_args(argv):
    p = ArgumentParser(prog="python -m impress_flexgen.verify", description=__doc__.split("\n\n")[0])
    add_model_args(p, default_model=None, compression=False)
    p.add_argument("--placement", type=placement_arg, action="append",
                   help=PLACEMENT_HELP + "; repeatable (default: auto, then disk)")
    p.add_argument("--prompts", type=int_range(1, len(PROMPTS)), default=len(PROMPTS),
                   help=f"how many built-in prompts (1-{len(PROMPTS)}, default all)")
    p.add_argument("--new-tokens", type=int_range(1), default=32,
                   help="tokens generated per prompt")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    return p.parse_args(argv)


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
    placements = args.placement or [AUTO, Placement.parse("disk")]
    base = RuntimeConfig(model=args.model, model_path=args.model_path, seed=args.seed,
                         dtype=dtype_arg(args.dtype), offload_dir=args.offload_dir,
                         **runtime_memory_fields(args))

    # Lengths are checked before any model is built.
    from ..models.tokenizer import load_tokenizer

    spec = resolve_spec(base, check_placement=False)
    for placement in placements:  # each refused now if it cannot fit, not after the first ran
        make_plan(spec, RuntimeConfig(**{**base.__dict__, "placement": placement}))
    tokenizer = load_tokenizer(spec)
    prompts = [tokenizer.encode(t) for t in PROMPTS[: args.prompts]]
    for i, ids in enumerate(prompts):
        check_lengths(spec, len(ids), args.new_tokens, what=f"built-in prompt {i + 1}")

    ours = []  # per placement: (the placement used, its Generations)
    for placement in placements:
        with Runtime(RuntimeConfig(**{**base.__dict__, "placement": placement}), spec=spec,
                     tokenizer=tokenizer) as rt:
            used = rt.placement.describe() + (" (auto)" if placement is AUTO else "")
            ours.append((used, [rt.generate([p], args.new_tokens, record_logits=True)
                                for p in prompts]))

    from ..models.reference import greedy, load_reference, reference_dtype

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
        per_placement.append({"placement": placement, "match": ok})

    result = {
        "model": spec.name,
        "match": matched == compared,
        "tokens_compared": compared,
        "tokens_matched": matched,
        "max_abs_logit_diff": round(max_diff, 6),
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "runtime_dtype": dtypes.name(spec.config.dtype),
        "reference": f"transformers, {str(reference_dtype(spec)).removeprefix('torch.')}",
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
