"""Plain generation: your prompts (--prompt, --prompt-ids) through the runtime alone, no
store, no tiers.
"""
from __future__ import annotations

from ..errors import UserError
from .args import write_json


def check_prompts(spec, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Each prompt is non-empty, within the vocabulary, and fits the model's positions."""
    from ..models.runtime import check_lengths

    vocab = spec.config.vocab_size
    for i, ids in enumerate(prompts):
        what = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
        check_lengths(spec, len(ids), max_new_tokens, what=what)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")


def generate(rt, args) -> int:
    records = []
    tokenizer = rt.tokenizer if args.prompt else None
    prompts = args.prompt_token_ids
    # Throughput work: the prompts together, in FlexGen's blocks; else each alone.
    groups = [prompts] if getattr(args, "throughput", False) else [[ids] for ids in prompts]
    steps = []
    for group in groups:
        gen = rt.generate(group, args.max_new_tokens)
        steps.append(gen.decode_s_per_token)
        for ids, new_ids in zip(group, gen.new_ids):
            text = tokenizer.decode(new_ids) if tokenizer else None
            print(f"\n--- {len(ids)} prompt tokens")
            print(f"+++ {text if text is not None else ','.join(map(str, new_ids))}")
            print(f"    prefill {gen.prefill_s:.3f} s, decode "
                  f"{gen.decode_s_per_token * 1e3:.1f} ms/token")
            records.append({"prompt_ids": ids, "new_ids": new_ids, "text": text,
                            "prefill_s": gen.prefill_s,
                            "decode_s_per_token": gen.decode_s_per_token})
    out = {"model": rt.spec.name, "results": records}
    found = getattr(args, "policy_search", None)
    if found is not None:
        from .throughput import prediction_error

        block = rt.policy.gpu_batch_size * rt.policy.num_gpu_batches
        out["policy_search"] = report = prediction_error(found, block, steps[0])
        if report is not None:
            print(f"\npolicy search: measured {report['measured_decode_tokens_per_s']:.3g} "
                  f"decode tokens/s, predicted {report['predicted_decode_tokens_per_s']:.3g} "
                  f"(error {report['error']:+.0%})")
    write_json(args.json, out)
    return 0
