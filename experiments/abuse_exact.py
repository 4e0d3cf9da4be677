"""Is an exact answer the same whether its prefix was stored or recomputed, to the last bit?

    python -m experiments.abuse_exact [--quick] [--json out.json]

Also a class of experiments.abuse_test (stored_vs_computed_logprobs, its --quick in CI).

With the default policy (`full`, exact) and the default store format (the compute dtype),
each case serves prompts on a fresh store and compares the log-probabilities (log-softmax
of the logits, every query position and every generated step) of answers that differ only
in what the store held:

same_prompt     a prompt served cold (computed, then stored), then again from the store;
other_query     another query over the stored prefix, against a fresh store's answer;
grown_prefix    a prefix stored in two parts (a conversation's first turn, then the whole),
                against the whole computed at once;
batch           two requests (prefixes sharing nothing) prefilled together, cold, then
                together again from the store (one pass each time: the same batch shape);
lossy_format    a store kept in a format that loses bits (--kv-format fp16 under fp32
                compute, bf16 under fp16) is never read by the exact policy: it matches
                nothing, and the answer is the recomputed one.

A difference is a membership oracle as well as a broken promise: a client comparing the
log-probabilities of a guess with those of a fresh namespace learns whether someone else's
prompt was stored. `--quick`: llama-tiny (random weights); otherwise smollm2-135m on text.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch


def _logprobs(resp) -> list[torch.Tensor]:
    return [torch.log_softmax(x.double(), -1)
            for x in (resp.query_logits, *resp.step_logits)]


def _diff(a, b) -> float:
    """Largest |log-probability difference| of two answers (inf: other tokens)."""
    if a.tokens != b.tokens:
        return float("inf")
    return max(float((x - y).abs().max()) for x, y in zip(_logprobs(a), _logprobs(b)))


def _prompts(rt, quick: bool) -> tuple[list[int], list[int], list[int], list[int]]:
    """A long prefix, two queries, and a second prefix sharing no chunk with the first."""
    if quick:
        ids = np.random.default_rng(7).integers(10, 40000, 350).tolist()
        return ids[:200], ids[200:215], ids[215:230], ids[230:]
    from impress_flexgen.bench.corpus import passages

    first, second = passages("austen_pride_and_prejudice", 1400, 2, seed=3)
    return rt.tokenizer.encode(first)[:300], rt.tokenizer.encode(" The letter said that"), \
        rt.tokenizer.encode(" In the morning she"), rt.tokenizer.encode(second)[:200]


def stored_vs_computed_logprobs(quick: bool, workdir: Path | None = None) -> dict:
    """Run every case (stores and offloaded weights under `workdir`, else a temporary
    folder); {"passed", "max_abs_diff", "cases": {name: {...}}, "model", "kv_format"}, and
    "error" (one line) when it did not pass."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="abuse-exact-") as tmp:
            return stored_vs_computed_logprobs(quick, Path(tmp))
    return _run_cases(quick, Path(workdir))


def _run_cases(quick: bool, tmp: Path) -> dict:
    from impress_flexgen.engine import Engine, Request, assemble, open_store
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig
    from impress_flexgen.tiers import TierConfig
    from policies import ServingConfig, make_policy

    model = "llama-tiny" if quick else "smollm2-135m"
    cases: dict[str, dict] = {}
    with Runtime(RuntimeConfig(model=model, offload_dir=str(tmp / "off"))) as rt:
        prefix, query, other, second = _prompts(rt, quick)
        cfg = ServingConfig()
        full = make_policy("full", cfg)
        opened = []

        def engine(name: str, kv_format: str | None = None) -> Engine:
            fmt = {} if kv_format is None else {"kv_format": kv_format}
            store = open_store(tmp / name, rt, cfg, full, **fmt)
            opened.append(store)
            return assemble(rt, full, store, TierConfig()).engine

        def ask(e: Engine, p, q):
            return e.serve(Request(p, q, 4, forced=q[:3]), query_logits=True)

        try:
            e = engine("main")
            cold, warm = ask(e, prefix, query), ask(e, prefix, query)
            cases["same_prompt"] = {"max_abs_diff": _diff(cold, warm),
                                    "matched_tokens": warm.stats.matched_tokens}
            stored = ask(e, prefix, other)
            fresh = ask(engine("fresh"), prefix, other)
            cases["other_query"] = {"max_abs_diff": _diff(stored, fresh),
                                    "matched_tokens": stored.stats.matched_tokens}
            turns = engine("turns")
            ask(turns, prefix[:len(prefix) // 2 + 5], query)
            grown = ask(turns, prefix, query)
            cases["grown_prefix"] = {"max_abs_diff": _diff(grown, cold),
                                     "matched_tokens": grown.stats.matched_tokens}
            batch_engine = engine("batch")
            pair = [Request(p, q, 4, forced=q[:3]) for p, q in ((prefix, query), (second, other))]

            def together():
                # Admitted in one step: prefilled in one pass, decoded side by side.
                out = batch_engine.serve_all(pair, query_logits=True)
                for r in out:
                    if isinstance(r, Exception):
                        raise r
                return out

            first, again = together(), together()
            cases["batch"] = {"max_abs_diff": max(_diff(a, b) for a, b in zip(first, again)),
                              "matched_tokens": sum(r.stats.matched_tokens for r in again)}
            lossy_format = "fp16" if e.dtype == torch.float32 else "bf16"
            lossy = engine("lossy", kv_format=lossy_format)
            ask(lossy, prefix, query)
            read = ask(lossy, prefix, query)
            cases["lossy_format"] = {"max_abs_diff": _diff(read, cold),
                                     "matched_tokens": read.stats.matched_tokens,
                                     "kv_format": lossy_format}
            kv_format = opened[0].shape.kv_format
        finally:
            for store in opened:
                store.close()
    for name, case in cases.items():
        case["passed"] = case["max_abs_diff"] == 0.0 and (
            case["matched_tokens"] == 0 if name == "lossy_format" else
            case["matched_tokens"] > 0)
    result = {"passed": all(c["passed"] for c in cases.values()),
              "max_abs_diff": max(c["max_abs_diff"] for c in cases.values()),
              "model": model, "kv_format": kv_format, "cases": cases}
    if not result["passed"]:
        result["error"] = "; ".join(
            f"{name}: max |d logprob| {c['max_abs_diff']:.3g}, matched {c['matched_tokens']}"
            for name, c in cases.items() if not c["passed"])
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.abuse_exact",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="llama-tiny instead of smollm2-135m")
    p.add_argument("--json", metavar="PATH", help="write the result here")
    args = p.parse_args(argv)
    result = stored_vs_computed_logprobs(args.quick)
    for name, case in result["cases"].items():
        print(f"{name:<14} {'pass' if case['passed'] else 'FAIL'}  matched "
              f"{case['matched_tokens']:>5}  max |d logprob| {case['max_abs_diff']:.3g}")
    print(f"{result['model']}, store format {result['kv_format']}: "
          f"{'passed' if result['passed'] else 'FAILED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
