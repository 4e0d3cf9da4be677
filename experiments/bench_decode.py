"""Single-stream decode speed: our engine against Hugging Face transformers on the same weights.

    python -m experiments.bench_decode [--model smollm2-135m] [--tokens 64] [--prompt 256]
                                       [--batch 4] [--placement cpu] [--profile] [--json PATH]
    python -m experiments.bench_decode --dtypes fp32,bf16,int4 [--quick] [--json PATH]

`--dtypes` measures decode by weight format, side by side in one run (rounds interleave the
formats): fp32, bf16 (weights, activations and KV), fp16, and int4 (FlexGen's 4-bit weights,
computed in fp32); per format a single stream and a batch of `--batch-size` (4) requests
stepped together, on passages of text, with each row's greedy agreement with fp32 over the
generated tokens. `--profile` then prints where each format's decode step spends its time.

`--batch N` also decodes N such requests stepped together (one batched decode step per token,
see engine/runner.py) against one after another: what batching buys per step, with the weights
where `--placement` puts them (off the compute device, every step moves them); the batch runs
with its contexts side by side (one attention call per layer) and request by request, in
turn, `--rounds` times. `--masked F` has each KV head leave out a fraction F of each
context's prompt tokens, as a per-head selection does (masked contexts cost more per call).

Both decode the same prompt greedily, one token at a time with a KV cache, in one process
(absolute figures on a shared machine are noisy; the ratio is what to read). Also measures a
large memcpy's bandwidth: decoding reads every weight once per token, so
weight bytes / bandwidth is the floor of one step's time.
"""
from __future__ import annotations

import sys
import tempfile
import time

import numpy as np
import torch

from impress_flexgen.entrypoints.args import ArgumentParser, finite_float, int_range, write_json
from impress_flexgen.entrypoints.process import run_main


def memcpy_gb_s(device, mb: int = 512, rounds: int = 5) -> float:
    src = torch.empty(mb * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9   # read + write


def ours(rt, prompt, n_tokens, profile=False):
    from impress_flexgen.bench.runner import RunConfig
    from impress_flexgen.engine import Request, assemble
    from policies import make_policy

    engine = assemble(rt, make_policy("full", RunConfig(label="full", policy="full").serving()), None).engine
    engine.serve(Request(prompt[:-1], prompt[-1:], max_new_tokens=4))   # warm up
    resp = engine.serve(Request(prompt[:-1], prompt[-1:], max_new_tokens=n_tokens))
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                         else [])
        with prof(activities=acts) as p:
            engine.serve(Request(prompt[:-1], prompt[-1:], max_new_tokens=16))
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return resp.tokens, 1.0 / resp.stats.decode_s_per_token


def batched(rt, prompt, n_tokens, batch, rounds=1, masked=0.0):
    """Decode tokens/s of `batch` requests stepped together, with their contexts side by
    side (the engine's way) and request by request, in turn for `rounds` rounds (medians),
    and of one alone. `masked`: the fraction of each context's prompt tokens each KV head
    leaves out (seeded), as a policy's per-head selection does; 0 attends everything."""
    from impress_flexgen.bench.runner import RunConfig
    from impress_flexgen.engine import Request, assemble
    from policies import make_policy

    engine = assemble(rt, make_policy("full", RunConfig(label="full", policy="full").serving()), None).engine
    reqs = [Request(prompt[:-1 - i], prompt[-1 - i:], max_new_tokens=n_tokens)
            for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    speed = {"side_by_side": [], "per_request": []}
    start_decode = engine.runner.start_decode

    def start_masked(seq, kept):
        """The context as made, then `masked` of its prompt positions left out per head."""
        start_decode(seq, kept)
        for kv in seq.kv:
            keep = torch.ones(engine.math.n_head, kv.k.shape[1], dtype=torch.bool)
            keep[:, 1:kv.n] = torch.rand(keep.shape[0], kv.n - 1, generator=g) >= masked
            kv.mask = keep

    if masked:
        engine.runner.start_decode = start_masked
    for _ in range(rounds):
        for layout, runs in speed.items():
            engine.runner.side_by_side = layout == "side_by_side"
            seqs = [engine.add_request(r) for r in reqs]
            engine.step()           # their prefill (one pass) and first decode step
            before = sum(s.steps for s in seqs)
            t0 = time.perf_counter()
            while not all(s.finished for s in seqs):
                engine.step()
            runs.append((sum(s.steps for s in seqs) - before) / (time.perf_counter() - t0))
    engine.runner.start_decode = start_decode
    engine.runner.side_by_side = True
    alone = 1.0 / engine.serve(reqs[0]).stats.decode_s_per_token
    return {k: float(np.median(v)) for k, v in speed.items()}, speed, alone


def transformers_generate(model, prompt, n_tokens):
    ids = torch.tensor([prompt], device=model.device)
    kw = dict(max_new_tokens=n_tokens, do_sample=False, min_new_tokens=n_tokens,
              pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
    return out[0, len(prompt):].tolist(), (n_tokens - 1) / max(total - first, 1e-9)


FORMATS = {"fp32": ("fp32", False), "bf16": ("bf16", False), "fp16": ("fp16", False),
           "int4": ("fp32", True)}


def _text_prompts(rt, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens from the corpus' passages (random ids if it has none)."""
    from impress_flexgen.bench.corpus import list_texts, passages

    texts, out = list_texts(), []
    for i in range(4 * n):
        if not texts or len(out) == n:
            break
        ids = rt.tokenizer.encode(passages(texts[i % len(texts)], length * 8, 1, seed=i)[0])
        if len(ids) >= length:
            out.append(ids[:length])
    rng = np.random.default_rng(0)
    while len(out) < n:
        out.append(rng.integers(10, rt.spec.config.vocab_size, length).tolist())
    return out


def _decode_run(engine, prompts, n_tokens) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of `prompts` stepped together (after their prefill and first step),
    and each one's tokens."""
    from impress_flexgen.engine import Request

    seqs = [engine.add_request(Request(p[:-1], p[-1:], max_new_tokens=n_tokens))
            for p in prompts]
    engine.step()
    before = sum(s.steps for s in seqs)
    t0 = time.perf_counter()
    while not all(s.finished for s in seqs):
        engine.step()
    speed = (sum(s.steps for s in seqs) - before) / (time.perf_counter() - t0)
    return speed, [s.result().tokens for s in seqs]


def _agreement(tokens: list[list[int]], ref: list[list[int]]) -> float:
    """The fraction of generated positions whose token is fp32's."""
    pairs = [(a, b) for t, r in zip(tokens, ref) for a, b in zip(t, r)]
    return sum(a == b for a, b in pairs) / max(1, len(pairs))


def _profile(engine, prompt, n_tokens: int, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    from impress_flexgen.engine import Request

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    with prof(activities=acts) as p:
        engine.serve(Request(prompt[:-1], prompt[-1:], max_new_tokens=n_tokens))
    print(f"--- {label}: {n_tokens} tokens, prefill included")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def by_dtype(args) -> dict:
    """Single stream and a batch per format, rounds interleaving the formats."""
    import contextlib

    from impress_flexgen.bench.runner import RunConfig
    from impress_flexgen.engine import assemble
    from impress_flexgen.models import dtypes
    from impress_flexgen.models.placement import Placement
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig
    from policies import make_policy

    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in names if d not in FORMATS]
    if bad or not names:
        from impress_flexgen.errors import UserError
        raise UserError(f"--dtypes: unknown format {bad[0] if bad else '(none)'}; choose "
                        f"from {', '.join(FORMATS)}")
    names = ["fp32"] + [d for d in dict.fromkeys(names) if d != "fp32"]   # the yardstick
    policy = RunConfig(label="full", policy="full").serving()
    sizes = sorted({1, args.batch_size})
    with tempfile.TemporaryDirectory() as off, contextlib.ExitStack() as stack:
        engines, weights = {}, {}
        for name in names:
            flag, compress = FORMATS[name]
            rt = stack.enter_context(Runtime(RuntimeConfig(
                model=args.model, offload_dir=off, dtype=dtypes.of_name(flag),
                compress_weight=compress, placement=Placement.parse(args.placement))))
            engines[name] = assemble(rt, make_policy("full", policy), None).engine
            weights[name] = sum(rt.plan.weights.values())
        prompts = _text_prompts(rt, max(sizes), args.prompt)
        for name, engine in engines.items():          # warm up
            _decode_run(engine, prompts[:1], 4)
            if args.profile:
                _profile(engine, prompts[0], 16, name)
        runs = {(n, b): [] for n in names for b in sizes}
        tokens = {}
        for r in range(args.rounds):
            for name, engine in engines.items():
                for b in sizes:
                    speed, toks = _decode_run(engine, prompts[:b], args.tokens)
                    runs[name, b].append(speed)
                    tokens[name, b] = toks
            print(f"round {r}: " + ", ".join(f"{n} x{b} {v[-1]:.1f}"
                                             for (n, b), v in runs.items()), flush=True)
    base = float(np.median(runs["fp32", 1]))
    rows = []
    for (name, b), speeds in runs.items():
        tps = float(np.median(speeds))
        rows.append({"dtype": name, "batch": b, "tokens_per_s": tps, "runs": speeds,
                     "agree_fp32": _agreement(tokens[name, b], tokens["fp32", b]),
                     "vs_fp32_single": tps / base, "weights_bytes": weights[name]})
    return {"model": args.model, "placement": args.placement, "prompt": args.prompt,
            "tokens": args.tokens, "rounds": args.rounds,
            "torch_threads": torch.get_num_threads(), "rows": rows}


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m experiments.bench_decode",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int_range(2, 4096), default=64)
    ap.add_argument("--prompt", type=int_range(2, 4096), default=256)
    ap.add_argument("--rounds", type=int_range(1, 10), default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--batch", type=int_range(1, 64), default=1)
    ap.add_argument("--placement", default="gpu", help="weights' placement (gpu)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--masked", type=finite_float(0, 0.99), default=0.0,
                    help="with --batch: fraction of each context's prompt tokens each head "
                         "leaves out, as a per-head selection does (0)")
    ap.add_argument("--dtypes", default=None, metavar="LIST",
                    help=f"compare decode by format ({','.join(FORMATS)}), side by side")
    ap.add_argument("--batch-size", type=int_range(2, 64), default=4,
                    help="with --dtypes: the batch measured beside the single stream (4)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="16 tokens after a 64-token prompt, one round")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.prompt, args.rounds = 16, 64, 1
    if args.dtypes is not None:
        result = by_dtype(args)
        for row in result["rows"]:
            print(f"{row['dtype']:<5} batch {row['batch']}: {row['tokens_per_s']:7.1f} "
                  f"tokens/s ({row['vs_fp32_single']:.2f}x fp32 single stream), agreement "
                  f"with fp32 {row['agree_fp32']:.3f}", flush=True)
        if args.json:
            write_json(args.json, result)
        return 0

    from impress_flexgen.models.placement import Placement
    from impress_flexgen.models.reference import load_reference
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    with tempfile.TemporaryDirectory() as off, \
            Runtime(RuntimeConfig(model=args.model, offload_dir=off, dtype=np.float32,
                                  placement=Placement.parse(args.placement))) as rt:
        vocab = rt.spec.config.vocab_size
        prompt = np.random.default_rng(0).integers(10, vocab, args.prompt).tolist()
        device = rt.model.layers[0].compute.dev
        ref = None if args.no_hf else load_reference(rt.spec).to(device)
        weight_bytes = sum(p.numel() * 4 for p in ref.parameters()) if ref is not None else None
        rows = []
        for r in range(args.rounds):
            toks, tps = ours(rt, prompt, args.tokens, args.profile and r == 0)
            row = {"round": r, "ours_tokens_per_s": tps}
            if ref is not None:
                hf_toks, hf_tps = transformers_generate(ref, prompt, args.tokens)
                row["transformers_tokens_per_s"] = hf_tps
                row["same_tokens"] = hf_toks[:len(toks)] == toks
            rows.append(row)
            print(row, flush=True)
        if args.batch > 1:
            together, runs, alone = batched(rt, prompt, args.tokens, args.batch,
                                            args.rounds, args.masked)
            rows.append({"batch": args.batch, "placement": args.placement,
                         "masked": args.masked,
                         "batched_tokens_per_s": together["side_by_side"],
                         "per_request_attention_tokens_per_s": together["per_request"],
                         "batched_runs": runs, "alone_tokens_per_s": alone})
            print(rows[-1], flush=True)
        bw = memcpy_gb_s(device)
        result = {"model": args.model, "device": str(device), "prompt": args.prompt,
                  "tokens": args.tokens, "rounds": rows, "memcpy_gb_s": bw,
                  "torch_threads": torch.get_num_threads()}
        if weight_bytes:
            result["weight_bytes"] = weight_bytes
            result["floor_tokens_per_s"] = bw / 2 * 1e9 / weight_bytes  # reads only
        print({k: v for k, v in result.items() if k != "rounds"})
        if args.json:
            write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.bench_decode", main))
