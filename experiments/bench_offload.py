"""An OPT model with its weights on the disk: our runtime (synchronous reads, reads behind
compute, the block schedule) against Hugging Face transformers + accelerate disk offload.

    python -m experiments.bench_offload [--model opt-6.7b] [--dtype bf16] [--quick] [--json F]

Random weights (the same values on both), in `--dtype` (default float32 on a CPU, float16
with CUDA) on both systems; the peer's checkpoint is written a tensor at a time. Ours: 10% of each layer's weights in CPU memory and the rest on the disk
(FlexGen's percentages 0,10), read past the page cache (O_DIRECT, models.direct_read);
accelerate: `device_map="auto"`, `offload_folder`, `max_memory` capped at the same 10% of
the weights, its offloaded files dropped from the page cache before every step (so it reads
the disk too). The workload: `--prompts` requests sharing a `--prefix`-token prefix, each
with its own 8-token query, `--tokens` new tokens each, greedy.

Rows: `system` (ours, accelerate), `dtype`, `mode` (sync: one request, each layer read when
needed; overlap: one request, the next layer read while this one computes; block: every
request in one block of gpu_batch_size x num_gpu_batches sharing each weight load;
stored: the block again, its shared prefix stored by an earlier request (timed apart:
`store_s`) and read from the store's disk once for the pass (the exact policy `full`,
O_DIRECT, no memory tier), only the queries computed; every other row of ours recomputes
the prefix, as the peer does; the peer's sync and block are one request and all of them
batched), prefill / decode / overall generated tokens per second, `step_s` (a decode
step), `read_s` and `compute_s` (a decode step's weight read and its compute, each measured
alone: the same step again with reads not overlapped), `batch`, `peak_rss_gb` (each system in its own process), `first_start_s`
and `next_start_s` (building the model with its weights written, then reused; ours: one
weights cache per model for its rows, made by the first),
`bytes_read` (weight bytes read from the disk while decoding), `page_cache` (whether the
weights could come from the page cache), `output_sha1` (of the generated tokens) and, on a
stored row, `same_output_as_block` (its tokens are the block row's), `predicted_tokens_per_s` and
`predicted_decode_tokens_per_s` (the policy search's prediction for the row's policy, on the
rates measured at the run's start in the rows' dtype and the share of a core a busy thread got
just before and after the row, `share`: other programs' load, which changes over a long
run; null for the peer). `--quick`: opt-125m under the same placement,
and smollm2-135m wholly in memory (what the schedule costs where nothing is offloaded).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

from impress_flexgen.entrypoints.args import ArgumentParser, int_range, write_json
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.errors import UserError

QUERY_TOKENS = 8
MODES = ("sync", "overlap", "block", "stored")
BLOCK_MODES = ("block", "stored")   # every request in one block of micro-batches
SHARD_BYTES = 2 << 30   # the peer's checkpoint shards
CPU_SHARE = 10          # percent of the weights held in memory; the rest on the disk


def _peak_rss_gb() -> float:
    """This process's peak RSS: Linux's VmHWM (its own memory's; getrusage's ru_maxrss
    carries over the parent's peak through fork and exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024 / 1e9
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _prompts(vocab: int, n: int, prefix: int) -> list[tuple[list[int], list[int]]]:
    import numpy as np

    rng = np.random.default_rng(0)
    shared = rng.integers(10, vocab, prefix).tolist()
    return [(shared, rng.integers(10, vocab, QUERY_TOKENS).tolist()) for _ in range(n)]


def _runtime_config(job: dict):
    import numpy as np

    from impress_flexgen.models.placement import Placement
    from impress_flexgen.models.runtime import RuntimeConfig

    disk = job["offload"]
    placement = Placement(0, CPU_SHARE, 100, 0, 100, 0) if disk else Placement.parse("gpu")
    from impress_flexgen.models import dtypes
    return RuntimeConfig(model=job["model"], offload_dir=job["dir"], placement=placement,
                         dtype=dtypes.of_name(job.get("dtype", "fp32")),
                         overlap=job["mode"] != "sync", gpu_batch_size=job["gpu_batch_size"],
                         work_tokens=job["prefix"] + QUERY_TOKENS + job["tokens"]
                         if "prefix" in job else None,
                         num_gpu_batches=job["num_gpu_batches"])


def predicted(job: dict, machine) -> dict:
    """The policy search's prediction for this row's policy on `machine` (the rates
    measured once, before the rows): tokens/s over prefill and decode, and decode alone."""
    from impress_flexgen.engine.attention import TILE
    from impress_flexgen.models.runtime import resolve_spec
    from impress_flexgen.planner.policy_search import Policy, Workload, model_shape, predict
    from impress_flexgen.store import CHUNK_SIZE

    cfg = _runtime_config(job)
    p = cfg.placement
    block = job["mode"] in BLOCK_MODES
    policy = Policy(p.w_gpu, p.w_cpu, p.cache_gpu, p.cache_cpu,
                    job["gpu_batch_size"] if block else job["batch"],
                    job["num_gpu_batches"] if block else 1, act_gpu=p.act_gpu,
                    act_cpu=p.act_cpu)
    # Both policies are exact: recomp computes each prefix's whole chunks by canonical
    # tiles; full reads them from the store (once for the pass) and computes the rest.
    chunks = job["prefix"] // CHUNK_SIZE * CHUNK_SIZE
    work = Workload(job["prefix"] + QUERY_TOKENS, job["tokens"], tile=TILE,
                    **{"stored" if job["mode"] == "stored" else "tiled": chunks})
    guess = predict(model_shape(resolve_spec(cfg, check_placement=False)), policy, machine,
                    work, overlap=cfg.overlap)
    return {"predicted_tokens_per_s": guess.tokens_per_s,
            "predicted_decode_tokens_per_s": guess.decode_tokens_per_s}


def _steps(engine, reqs, micro_batch):
    """Serve `reqs` together, step by step; (prefill s, decode step times, their weight
    waits and disk bytes, generated tokens, tokens made by the prefill, each request's
    tokens)."""
    runner, stream = engine.runner, engine.runner.weights
    runner.micro_batch = micro_batch
    seqs = [engine.add_request(r) for r in reqs]
    t0 = time.perf_counter()
    engine.step()                     # the prefill pass (and the first decode step)
    first = time.perf_counter() - t0
    made = sum(len(s.tokens) for s in seqs)
    steps, waits, reads = [], [], []
    while not all(s.finished for s in seqs):
        w, b, t = stream.wait_s, stream.disk_bytes, time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        waits.append(stream.wait_s - w)
        reads.append(stream.disk_bytes - b)
    runner.micro_batch = None
    return (first, steps, waits, reads, sum(len(s.tokens) for s in seqs), made,
            [list(s.tokens) for s in seqs])


def ours(job: dict) -> dict:
    import numpy as np
    import torch
    from policies import ServingConfig

    from impress_flexgen.engine import Request
    from impress_flexgen.engine.assemble import StoreSpec, assemble, make_serving_policy
    from impress_flexgen.engine.scheduler import SchedulerConfig
    from impress_flexgen.models.runtime import Runtime
    from impress_flexgen.tiers import TierConfig

    cfg = _runtime_config(job)
    starts = []
    for _ in range(2):
        t0 = time.perf_counter()
        rt = Runtime(cfg)
        starts.append(time.perf_counter() - t0)
        if len(starts) == 1:
            rt.close()
    stored = job["mode"] == "stored"
    # The store (stored rows): on the row's disk, no memory tiers in front of it, read past
    # the page cache, so that the pass reads the prefix's KV from the disk.
    store = StoreSpec(Path(job["dir"]) / "store") if stored else None
    with rt, closing(assemble(rt, make_serving_policy("full" if stored else "recomp",
                                                      ServingConfig()),
                              store, TierConfig())) as stack:
        engine = stack.engine
        batch = job["batch"]
        engine.schedule_by(SchedulerConfig(max_batch_size=batch, max_batch_tokens=1 << 20))
        prompts = _prompts(rt.spec.config.vocab_size, batch, job["prefix"])
        store_s = None
        if stored:      # an earlier request stored the shared prefix (timed apart)
            t0 = time.perf_counter()
            engine.serve(Request(prompts[0][0], [7, 8, 9], 1))
            store_s = time.perf_counter() - t0
        reqs = [Request(p, q, job["tokens"]) for p, q in prompts]
        micro = job["gpu_batch_size"] if job["mode"] in BLOCK_MODES else None
        first, steps, waits, reads, generated, made, tokens = _steps(engine, reqs, micro)
        step_s = float(np.median(steps))
        # The same decode steps with reads not overlapped: a step's read and its compute,
        # each alone.
        engine.runner.weights.overlap = False
        alone = _steps(engine, [Request(p, q, 4) for p, q in prompts], micro)
        read_s = float(np.median(alone[2]))
        compute_s = float(np.median(alone[1])) - read_s
        decode_tokens = generated - made
        prompt_tokens = sum(len(p) + len(q) for p, q in prompts)
        return {"system": "ours", "model": job["model"],
                "dtype": job["dtype"], "mode": job["mode"],
                "batch": batch, "gpu_batch_size": job["gpu_batch_size"],
                "num_gpu_batches": job["num_gpu_batches"], "offloaded": job["offload"],
                "prefill_tokens_per_s": prompt_tokens / max(first - step_s, 1e-9),
                "decode_tokens_per_s": decode_tokens / sum(steps),
                "tokens_per_s": generated / (first + sum(steps)),
                "step_s": step_s, "read_s": read_s, "compute_s": compute_s,
                "overlap_ratio": step_s / max(read_s, compute_s, 1e-9),
                "peak_rss_gb": _peak_rss_gb(), "first_start_s": starts[0],
                "next_start_s": starts[1], "bytes_read": int(sum(reads)),
                "page_cache": bool(job["offload"] and torch.cuda.is_available()),
                "output_sha1": hashlib.sha1(json.dumps(tokens).encode()).hexdigest(),
                "store_s": store_s,
                "predicted_tokens_per_s": None, "predicted_decode_tokens_per_s": None}


def prepare_peer(job: dict) -> dict:
    """Our random weights as a transformers checkpoint (the peer's input), made once, a
    tensor at a time into shards (a model larger than memory is never held whole)."""
    from impress_flexgen.models.reference import save_seeded_checkpoint
    from impress_flexgen.models.runtime import resolve_spec

    out = Path(job["hf_dir"])
    if not (out / "config.json").exists():
        save_seeded_checkpoint(resolve_spec(_runtime_config({**job, "mode": "sync"})), out,
                               SHARD_BYTES)
    return {"weight_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors"))}


def _disk_read_bytes() -> int | None:
    """The bytes this process has had read from the disk (Linux), else None."""
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])
    except (OSError, StopIteration, ValueError):
        return None


class _DropPageCache:
    """A logits processor that drops the pages of the files the peer reads its offloaded
    weights from before every next step, so that it reads them from the disk, as ours does.
    accelerate offloads a safetensors checkpoint's weights where they are (its offload
    folder stays empty): the checkpoint's files are dropped too."""

    def __init__(self, *folders: Path):
        self.files = [p for folder in folders for p in folder.rglob("*") if p.is_file()]

    def __call__(self, input_ids, scores):
        for path in self.files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return scores


def accelerate(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from impress_flexgen.models import dtypes

    cuda = torch.cuda.is_available()
    dtype = dtypes.torch_dtype(dtypes.of_name(job["dtype"]))
    cap = int(job["weight_bytes"] * CPU_SHARE / 100)
    memory = {0: cap, "cpu": cap} if cuda else {"cpu": cap}
    starts = []
    for i in range(2):
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            job["hf_dir"], device_map="auto", max_memory=memory, dtype=dtype,
            offload_folder=str(Path(job["dir"]) / "accelerate"))
        starts.append(time.perf_counter() - t0)
        if i == 0:
            del model
    placed = set(map(str, model.hf_device_map.values()))
    batch = job["batch"]
    prompts = _prompts(model.config.vocab_size, batch, job["prefix"])
    ids = torch.tensor([p + q for p, q in prompts], device="cuda" if cuda else "cpu")
    drop = LogitsProcessorList([_DropPageCache(Path(job["dir"]) / "accelerate",
                                               Path(job["hf_dir"]))])
    kw = dict(do_sample=False, pad_token_id=1, logits_processor=drop)
    with torch.no_grad():
        drop[0](None, None)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        first = time.perf_counter() - t0
        drop[0](None, None)
        read, t0 = _disk_read_bytes(), time.perf_counter()
        model.generate(ids, max_new_tokens=job["tokens"], min_new_tokens=job["tokens"], **kw)
        total = time.perf_counter() - t0
        read = None if read is None else _disk_read_bytes() - read
    steps = max(job["tokens"] - 1, 1)
    step_s = max(total - first, 1e-9) / steps
    return {"system": "accelerate", "model": job["model"], "dtype": job["dtype"],
            "mode": job["mode"], "batch": batch, "offloaded": "disk" in placed,
            "prefill_tokens_per_s": ids.numel() / first,
            "decode_tokens_per_s": batch / step_s,
            "tokens_per_s": batch * job["tokens"] / total,
            "step_s": step_s, "read_s": None, "compute_s": None,
            "peak_rss_gb": _peak_rss_gb(), "first_start_s": starts[0],
            "next_start_s": starts[1], "bytes_read": read, "page_cache": False,
            "predicted_tokens_per_s": None, "predicted_decode_tokens_per_s": None}


WORKERS = {"ours": ours, "accelerate": accelerate, "prepare": prepare_peer}


def _child(kind: str, job: dict, timeout_s: float) -> dict:
    """One measurement in a process of its own (its own peak RSS)."""
    # A weights cache per model, shared by its rows (a large model's weights are written
    # once): the first row's first start makes the weights, every other start reuses them.
    env = {**os.environ, "IMPRESS_FLEXGEN_PROGRESS": "0", "IMPRESS_FLEXGEN_CACHE": job["cache"]}
    out = subprocess.run([sys.executable, "-m", "experiments.bench_offload", "--worker", kind,
                          json.dumps(job)], capture_output=True, text=True, timeout=timeout_s,
                         env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} {job.get('mode')}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan(args) -> list[tuple[str, dict]]:
    """(worker, job) per row, in the order measured: each of the peer's rows right after
    ours at the same batch, so that a machine whose load changes meets both alike."""
    size, n = args.gpu_batch_size, args.num_gpu_batches
    block = size * n
    rows = []
    for model, offload in args.models:
        base = {"model": model, "offload": offload, "prefix": args.prefix, "dtype": args.dtype,
                "tokens": args.tokens, "gpu_batch_size": 1, "num_gpu_batches": 1}
        peer = offload and not args.no_peer
        rows += [("ours", {**base, "mode": "sync", "batch": 1}),
                 ("ours", {**base, "mode": "overlap", "batch": 1})]
        rows += [("accelerate", {**base, "mode": "sync", "batch": 1})] if peer else []
        rows += [("ours", {**base, "mode": "block", "batch": block, "gpu_batch_size": size,
                           "num_gpu_batches": n})]
        rows += [("accelerate", {**base, "mode": "block", "batch": block})] if peer else []
        rows += [("ours", {**base, "mode": "stored", "batch": block, "gpu_batch_size": size,
                           "num_gpu_batches": n})]
    return [(kind, job) for kind, job in rows if job["mode"] in args.modes]


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(WORKERS[sys.argv[2]](json.loads(sys.argv[3]))))
        return 0
    ap = ArgumentParser(prog="python -m experiments.bench_offload",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-6.7b")
    ap.add_argument("--quick", action="store_true",
                    help="opt-125m offloaded and smollm2-135m in memory, 4 x 4 block, "
                         "128-token prefix, 8 new tokens")
    ap.add_argument("--prefix", type=int_range(1), default=1024)
    ap.add_argument("--tokens", type=int_range(2), default=32)
    ap.add_argument("--gpu-batch-size", type=int_range(1), default=8)
    ap.add_argument("--num-gpu-batches", type=int_range(1), default=8)
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                    help="both systems' weights and compute (default: fp16 with CUDA, "
                         "else fp32)")
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    ap.add_argument("--cached-rates", action="store_true",
                    help="predict from the rates an earlier start measured, if any, instead "
                         "of measuring them now")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="the rows' modes to measure (comma-separated; default all)")
    ap.add_argument("--timeout", type=int_range(10), default=3600,
                    help="seconds for each row's process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.modes = set(args.modes.split(","))
    if not args.modes <= set(MODES):
        raise UserError(f"--modes: {', '.join(MODES)}, not {sorted(args.modes)}")
    if args.dtype is None:
        import torch
        args.dtype = "fp16" if torch.cuda.is_available() else "fp32"
    args.models = [(args.model, True)]
    if args.quick:
        args.models = [("opt-125m", True), ("smollm2-135m", False)]
        args.prefix, args.tokens, args.gpu_batch_size, args.num_gpu_batches = 128, 8, 4, 4
    from impress_flexgen.planner.machine import cpu_share, measure_machine

    # The policy search's rates in the rows' dtype, measured now, before the rows (about
    # half a minute; a cached measurement may be from another hour of a disk whose rate
    # wanders), and cached for the next start.
    from impress_flexgen.models import dtypes
    machine = measure_machine(dtype=dtypes.torch_dtype(dtypes.of_name(args.dtype)),
                              use_cache=args.cached_rates)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_offload-") as tmp:
        hf, first_starts = {}, {}
        for kind, job in plan(args):
            job = {**job, "dir": tempfile.mkdtemp(dir=tmp),
                   "cache": str(Path(tmp) / f"cache-{job['model']}-{job['dtype']}")}
            if kind == "accelerate":
                key = job["model"]
                if key not in hf:
                    hf[key] = {"hf_dir": str(Path(tmp) / f"hf-{key}")}
                    hf[key].update(_child("prepare", {**job, **hf[key]}, args.timeout))
                job.update(hf[key])
            before = cpu_share()
            row = _child(kind, job, args.timeout)
            if kind == "ours":
                share = (before + cpu_share()) / 2
                row.update(predicted(job, dataclasses.replace(machine, share=share)),
                           share=share)
                # The start that made the weights is the first row's; later rows' first
                # start found them made.
                made = first_starts.setdefault(job["cache"], row["first_start_s"])
                row["first_start_s"] = made
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    # The stored prefix's KV is bit-equal to its recomputation (an exact policy): the
    # stored row's tokens are the block's.
    ours = {(r["model"], r["mode"]): r for r in rows if r["system"] == "ours"}
    for (model, mode), row in ours.items():
        if mode == "stored" and (model, "block") in ours:
            block = ours[model, "block"]
            row["same_output_as_block"] = row["output_sha1"] == block["output_sha1"]
    result = {"model": args.model if not args.quick else "quick", "dtype": args.dtype,
              "prefix": args.prefix,
              "tokens": args.tokens, "rows": rows}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.bench_offload", main))
