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
    for ids in prompts:
        gen = rt.generate([ids], args.max_new_tokens)
        text = tokenizer.decode(gen.new_ids[0]) if tokenizer else None
        print(f"\n--- {len(ids)} prompt tokens")
        print(f"+++ {text if text is not None else ','.join(map(str, gen.new_ids[0]))}")
        print(f"    prefill {gen.prefill_s:.3f} s, decode {gen.decode_s_per_token * 1e3:.1f} ms/token")
        records.append({"prompt_ids": ids, "new_ids": gen.new_ids[0], "text": text,
                        "prefill_s": gen.prefill_s, "decode_s_per_token": gen.decode_s_per_token})
    write_json(args.json, {"model": rt.spec.name, "results": records})
    return 0
