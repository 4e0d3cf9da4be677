"""What FlexGen's 4-bit weights and KV cache cost in fidelity, on a model with real weights.

    python -m experiments.compression_fidelity [--model smollm2-135m] [--quick] [--json PATH]

Passages of public-domain text are served through the engine (no store: every token
computed) teacher-forced, so every position of every configuration sees the same context:
the prompt's positions come from the prefill pass, the forced continuation from decode
steps over the decode context. Each configuration (fp32, 4-bit weights, 4-bit KV cache,
both; FlexGen's groups unless given) is compared with fp32 at every position: KL(fp32 ||
it), greedy top-1 agreement, and the perplexity of the passage under each. Rows are
measured side by side in one run; the CPU model is in the JSON.
"""
from __future__ import annotations

import dataclasses
import math
import platform
import sys
import time

import numpy as np
import torch

from impress_flexgen.bench.corpus import list_texts, passages
from impress_flexgen.engine import Request, assemble
from impress_flexgen.entrypoints.args import ArgumentParser, int_range, write_json
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.models.quant import Groups
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from policies import ServingConfig, make_policy

CONFIGS = {
    "fp32": {},
    "int4 weights": {"compress_weight": True},
    "int4 kv": {"compress_cache": True},
    "int4 weights + kv": {"compress_weight": True, "compress_cache": True},
}


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.compression_fidelity",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--passages", type=int_range(1), default=8)
    p.add_argument("--prompt-tokens", type=int_range(8), default=256)
    p.add_argument("--forced-tokens", type=int_range(2), default=64,
                   help="continuation tokens fed by decode steps")
    p.add_argument("--weight-groups", default="64,0", help="SIZE,AXIS (FlexGen's 64,0)")
    p.add_argument("--cache-groups", default="64,2", help="SIZE,AXIS (FlexGen's 64,2)")
    p.add_argument("--quick", action="store_true", help="3 passages, 128 + 32 tokens")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.passages, args.prompt_tokens, args.forced_tokens = 3, 128, 32
    args.groups = {}
    for flag in ("weight_groups", "cache_groups"):
        size, _, dim = getattr(args, flag).partition(",")
        args.groups[flag] = Groups(int(size), int(dim))
    return args


def _token_windows(tokenizer, n: int, length: int) -> list[list[int]]:
    texts = list_texts()
    out = []
    for i in range(n):
        text = passages(texts[i % len(texts)], length * 8, 1, seed=i)[0]
        ids = tokenizer.encode(text)
        if len(ids) >= length:
            out.append(ids[:length])
    return out


def _logits(rt, windows, prompt: int) -> tuple[list[torch.Tensor], dict]:
    """Per window, (positions, vocab) log-probabilities: the prompt's from the prefill
    pass, then one per forced decode step; and the mean prefill and per-token decode
    seconds."""
    policy = make_policy("recomp", ServingConfig())
    engine = assemble(rt, policy, None).engine
    out, ttft, decode = [], [], []
    try:
        for ids in windows:
            forced = ids[prompt:]
            resp = engine.serve(Request([], ids[:prompt], len(forced) + 1, forced=forced,
                                        keep_logits=True), query_logits=True)
            rows = torch.cat([resp.query_logits, torch.stack(resp.step_logits[:-1])])
            out.append(torch.log_softmax(rows.float(), -1))
            ttft.append(resp.stats.ttft_s)
            decode.append(resp.stats.decode_s_per_token)
    finally:
        engine.close()
    return out, {"prefill_s": float(np.mean(ttft)), "decode_s_per_token": float(np.mean(decode))}


def _compare(ref: list[torch.Tensor], got: list[torch.Tensor], windows, prompt: int) -> dict:
    """KL(fp32 || it) over all positions and over the decode steps alone (where the KV
    cache is read), top-1 agreement, and perplexity of the passages under each."""
    kl, kl_decode, top1, nll, nll_ref = [], [], [], [], []
    for r, g, ids in zip(ref, got, windows):
        per_position = (r.exp() * (r - g)).sum(-1)
        kl.append(float(per_position.mean()))
        kl_decode.append(float(per_position[prompt:].mean()))
        top1.append(float((r.argmax(-1) == g.argmax(-1)).float().mean()))
        target = torch.tensor(ids[1:])
        nll.append(float(-g[torch.arange(len(target)), target].mean()))
        nll_ref.append(float(-r[torch.arange(len(target)), target].mean()))
    return {"kl_vs_fp32": float(np.mean(kl)), "kl_decode_vs_fp32": float(np.mean(kl_decode)),
            "top1_vs_fp32": float(np.mean(top1)),
            "perplexity": math.exp(float(np.mean(nll))),
            "perplexity_fp32": math.exp(float(np.mean(nll_ref)))}


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    args = parse_args(argv)
    rows, ref, windows = [], None, None
    for name, flags in CONFIGS.items():
        cfg = RuntimeConfig(model=args.model, weight_groups=args.groups["weight_groups"],
                            cache_groups=args.groups["cache_groups"], **flags)
        t0 = time.perf_counter()
        with Runtime(cfg) as rt:
            if windows is None:
                windows = _token_windows(rt.tokenizer, args.passages,
                                         args.prompt_tokens + args.forced_tokens)
            got, times = _logits(rt, windows, args.prompt_tokens)
            weights = sum(rt.plan.weights.values())
        row = {"config": name, "weights_bytes": weights,
               "weight_groups": dataclasses.asdict(args.groups["weight_groups"])
               if flags.get("compress_weight") else None,
               "cache_groups": dataclasses.asdict(args.groups["cache_groups"])
               if flags.get("compress_cache") else None,
               "seconds": round(time.perf_counter() - t0, 1), **times}
        if ref is None:
            ref = got
        row.update(_compare(ref, got, windows, args.prompt_tokens))
        rows.append(row)
        print(f"{name:<20} weights {weights / 2**20:7.1f} MiB  KL {row['kl_vs_fp32']:.4f} "
              f"(decode steps {row['kl_decode_vs_fp32']:.4f})  "
              f"top-1 {row['top1_vs_fp32']:.3f}  ppl {row['perplexity']:.2f} "
              f"(fp32 {row['perplexity_fp32']:.2f})  prefill {row['prefill_s']:.2f} s  "
              f"decode {row['decode_s_per_token'] * 1e3:.0f} ms/token", flush=True)
    write_json(args.json, {"model": args.model, "cpu": _cpu(), "passages": len(windows),
                           "prompt_tokens": args.prompt_tokens,
                           "forced_tokens": args.forced_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.compression_fidelity", main))
