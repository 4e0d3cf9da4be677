"""The command line's shared pieces: a parser whose errors are one line and exit status 2,
checked argument types, and the flags every job shares (the model, the policy and its store,
the tiers and the placement).

    p = ArgumentParser(prog="python -m impress_flexgen.run")
    add_model_args(p, default_model="smollm2-135m")
    add_serving_args(p, "default 256 MiB", "default 1 GiB")
    args = p.parse_args(argv); check_serving_args(p, args, [args.policy])
    config = ServiceConfig.from_args(args)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
from pathlib import Path

from ..errors import UserError, require

_TYPE_ERROR = re.compile(r"^argument ([^:]+): (must .*)$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (no usage dump) and exit 2."""

    def error(self, message: str):
        # "argument --x: must be ..." (from the checked types below) reads "--x must be ...".
        message = _TYPE_ERROR.sub(r"\1 \2", " ".join(message.split()))
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _bound(value: float) -> str:
    return f"{value:g}"


def finite_float(low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite float within [low, high] (an end open when asked; None:
    unbounded). nan and inf are refused; the message names the flag."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            if high is None and low == 0:
                need = "must be positive" if low_open else "must not be negative"
            elif high is None:
                need = f"must be {'above' if low_open else 'at least'} {_bound(low)}"
            elif low is None:
                need = f"must be {'below' if high_open else 'at most'} {_bound(high)}"
            else:
                need = (f"must be in {'(' if low_open else '['}{_bound(low)}, "
                        f"{_bound(high)}{')' if high_open else ']'}")
            raise argparse.ArgumentTypeError(f"{need} (got {text})")
        return value

    parse.__name__ = "float"
    return parse


def int_range(low: int | None = None, high: int | None = None):
    """An argparse type: an integer in [low, high] (None: unbounded); the message names the
    flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            if high is not None and low is not None:
                need = f"must be between {low} and {high}"
            elif high is not None:
                need = f"must be at most {high}"
            elif low == 0:
                need = "must be 0 or more"
            elif low == 1:
                need = "must be positive (at least 1)"
            else:
                need = f"must be at least {low}"
            raise argparse.ArgumentTypeError(f"{need} (got {text})")
        return value

    parse.__name__ = "int"
    return parse


def write_json(path: str | None, payload: dict) -> None:
    if path is None:
        return
    out = Path(path)
    text = json.dumps(payload, indent=2) + "\n"
    # A file is written beside, then renamed: a reader (or a run killed meanwhile) sees the
    # previous file or the new one, never half of one. Anything else (/dev/stdout, a link)
    # is written in place.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        if out.is_symlink() or (out.exists() and not out.is_file()):
            out.write_text(text)
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise UserError(f"cannot write {path}: {exc.strerror}") from None


def choose_list(p: argparse.ArgumentParser, option: str, text: str, choices) -> list[str]:
    """A comma-separated subset of `choices`, returned in their order; else a usage error."""
    picked = [x for x in text.split(",") if x]
    if not picked or any(x not in choices for x in picked):
        p.error(f"{option}: choose from {', '.join(choices)}")
    return [x for x in choices if x in picked]


PLACEMENT_HELP = (
    "where FlexGen keeps weights and KV cache: auto (the compute device first, then CPU "
    "memory, then the offload directory's disk, from what is free; the plan is printed before "
    "anything is allocated), gpu (everything on the compute device), cpu, disk, mixed "
    "(30/40/30%% on GPU/CPU/disk), or six percentages W_GPU,W_CPU,CACHE_GPU,CACHE_CPU,ACT_GPU,"
    "ACT_CPU (the rest on disk); a placement that cannot fit is refused before anything is "
    "allocated; auto with --throughput: a policy search picks the percentages, the batch sizes "
    "and compression for the most tokens/s from rates measured at start-up")


def placement_arg(text: str):
    """--placement: auto, a name (gpu, cpu, disk, mixed) or six comma-separated percentages."""
    from ..models.placement import Placement

    try:
        return Placement.parse(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def remote_url_arg(text: str) -> str:
    """--remote-tier: a Redis url (redis://HOST:PORT/DB, rediss://..., unix://PATH, or a
    cluster's redis+cluster://HOST:PORT,...), checked here by the remote tier's own rules, so
    that a bad one is a usage error."""
    from ..tiers.remote_url import validate_url

    try:
        validate_url(text)
        require("redis", "the remote tier", "redis==8.1.0")
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("remote tier: ")) from None
    return text


def add_serving_args(p: argparse.ArgumentParser, gpu_cache_default: str,
                     cpu_cache_default: str, default_policy: tuple[str, str] | None = None):
    """The flags that choose a policy and shape its store, tiers and placement, shared by
    the main job and the server; returns the two argument groups (serving, tiers).
    `default_policy`: (name, why) when not impress."""
    from policies import POLICY_NAMES

    from ..planner import PLANS
    from ..store.config import CHUNK_SIZE

    g = p.add_argument_group("serving")
    policy_help = f"{', '.join(POLICY_NAMES)}; impress:itf / impress:itf_ro / impress:all " \
        "pick an ablation"
    if default_policy is None:
        g.add_argument("--policy", default="impress",
                       help=policy_help + " (default impress = impress:all)")
    else:
        g.add_argument("--policy", default=default_policy[0],
                       help=f"{policy_help}; default {default_policy[0]} ({default_policy[1]})")
    g.add_argument("--retention", type=finite_float(0, 1, low_open=True), default=0.25,
                   help="fraction of prefix kept, in (0, 1] (0.25)")
    g.add_argument("--granularity", choices=("chunk", "token"), default="chunk",
                   help="select whole chunks (default) or tokens as the paper does")
    g.add_argument("--threshold", choices=("adaptive", "fixed", "none"), default="none",
                   help="probe-head agreement test; a failed layer loads its whole prefix "
                        "(default none: no test)")
    g.add_argument("--probe-heads", default="auto",
                   help="auto (all heads on grouped-query models, 0,1,2 otherwise), all, group "
                        "(one per KV group), first:K, random:K, fraction:F, or ids like 0,3,6")
    g.add_argument("--probe-queries", type=int_range(0), default=0, metavar="N",
                   help="probe with the last N new tokens' queries (default 0: all; fewer "
                        "costs less and selects less accurately)")
    g.add_argument("--probe-stride", type=int_range(1), default=1, metavar="K",
                   help="of the probing queries, every K-th counting back from the last "
                        "(default 1: all)")
    g.add_argument("--probe-every", type=int_range(1), default=1, metavar="K",
                   help="probe every K-th layer, the others reuse its scores (default 1)")
    g.add_argument("--prefetch", action="store_true",
                   help="impress: read the chunks the last query selected on a layer one "
                        "layer ahead (reads more; pays where reads are slow and cores idle)")
    g.add_argument("--threshold-value", type=finite_float(0, 1), default=0.85,
                   help="for --threshold fixed, in [0, 1] (0.85)")
    g.add_argument("--adaptive-alpha", type=finite_float(0, low_open=True), default=0.6,
                   help="t = j^alpha (adaptive), positive (0.6)")
    g.add_argument("--plan", choices=PLANS, default="auto",
                   help="how a stored prefix is served: load it (the policy's selection), "
                        "recompute it, both (recompute its front while the rest loads), or "
                        "auto: per request, the cheapest of the three by a cost model "
                        "calibrated at start-up (default auto)")
    g.add_argument("--chunk-size", type=int_range(16, 256), default=CHUNK_SIZE,
                   help=f"tokens per chunk, a multiple of 8 in 16-256 ({CHUNK_SIZE})")
    g.add_argument("--probe-format", choices=("int4", "fp16"), default="int4")
    g.add_argument("--kv-format", choices=("fp32", "fp16", "bf16", "int4"), default=None,
                   help="how the store keeps prefix K and V (default: the compute dtype, so "
                        "that a stored prefix gives the answer a recomputed one does); a "
                        "smaller format is inexact: exact policies (full) recompute what it "
                        "holds; int4: 4-bit groups of 32 with an fp16 scale and minimum "
                        "(5/16 of fp16's bytes)")
    g.add_argument("--reorder-interval", type=int_range(0), default=50,
                   help="queries between background reorders (policies that reorder; "
                        "0: never)")
    g.add_argument("--reorder-by", choices=("importance", "semantic"), default="importance",
                   help="how a reorder lays a prefix out: by accumulated importance, or in "
                        "chunks of similar keys (IceCache's semantic pages)")
    g.add_argument("--reorder-hot-fraction", type=finite_float(0, 1, low_open=True),
                   default=0.25,
                   help="share of a prefix's tokens a reorder packs by importance; the rest "
                        "keep their order (0.25; 1 sorts every token)")
    t = p.add_argument_group("tiers and placement")
    t.add_argument("--gpu-cache-gb", type=finite_float(0), default=None,
                   help=f"GPU tier capacity ({gpu_cache_default})")
    t.add_argument("--cpu-cache-gb", type=finite_float(0), default=None,
                   help=f"CPU tier capacity ({cpu_cache_default})")
    t.add_argument("--exclusive-tiers", action="store_true",
                   help="keep at most one memory copy of a chunk (GPU or CPU): more distinct "
                        "chunks fit, every promotion and demotion copies; default: "
                        "non-exclusive tiers, a chunk may sit in both and a GPU eviction of "
                        "one the CPU still holds costs nothing")
    t.add_argument("--verify-tier-hits", action="store_true",
                   help="check the CRC of every GPU and CPU tier hit, not only of copies "
                        "promoted to the GPU tier (slower; for debugging)")
    t.add_argument("--disk-capacity-gb", type=finite_float(0), default=None,
                   help="store capacity on disk; least valuable prefixes are evicted beyond it")
    t.add_argument("--disk-read-limit", type=finite_float(0, low_open=True), default=None,
                   metavar="MB/s",
                   help="hold the store's disk reads to this bandwidth (default: no limit)")
    t.add_argument("--remote-tier", type=remote_url_arg, default=None,
                   metavar="redis://HOST:PORT/DB",
                   help="a shared pool of prefix KV on Redis/Valkey behind the disk, shared "
                        "by every server pointed at it; one that does not answer is a warning "
                        "and requests are served locally; redis+cluster://HOST:PORT,HOST:PORT "
                        "for a Redis or Valkey cluster (default: none)")
    t.add_argument("--remote-secret", default=None, metavar="SECRET",
                   help="a secret shared by every server of the pool: values then carry an "
                        "HMAC-SHA256 and a value written without it is refused (default: the "
                        "IMPRESS_REMOTE_SECRET environment variable; none: a CRC-32, and "
                        "what the pool gives is used but never stored locally)")
    t.add_argument("--remote-insecure", action="store_true",
                   help="use a --remote-tier on another machine without a --remote-secret "
                        "(refused otherwise: anyone able to write to it could change answers)")
    t.add_argument("--remote-ttl", type=int_range(1), default=None, metavar="SECONDS",
                   help="the pool forgets a chunk this long after writing it (default: kept "
                        "until Redis evicts it)")
    t.add_argument("--store-dir", metavar="DIR",
                   help="the prefix store (default: the user cache directory); reused by "
                        "later runs")
    t.add_argument("--placement", type=placement_arg, default="auto",
                   help=PLACEMENT_HELP + " (default auto)")
    g.add_argument("--max-batch-size", type=int_range(1), default=8, metavar="N",
                   help="requests decoded together; new ones join between steps (8)")
    g.add_argument("--max-batch-tokens", type=int_range(1), default=8192, metavar="N",
                   help="tokens per step: one per running request plus the prompts "
                        "prefilled in it; a lone prompt is always taken (8192)")
    g.add_argument("--score-piece-tokens", type=int_range(1), default=None, metavar="N",
                   help="a scored prompt (echo with logprobs) is prefilled this many tokens "
                        "per step, so that other requests wait for a piece, not the whole "
                        "prompt (32)")
    g.add_argument("--batch-gather-ms", type=finite_float(0, 10000), default=None, metavar="MS",
                   help="an idle server waits this long after a request for others "
                        "arriving with it, so that a burst is prefilled in one pass "
                        "(10; 0: never wait)")
    return g, t


def check_serving_args(p: argparse.ArgumentParser, args, policies: list[str]) -> None:
    """What add_serving_args' types cannot check alone; a usage error otherwise."""
    from policies import POLICY_NAMES

    if args.chunk_size % 8:
        p.error(f"--chunk-size must be a multiple of 8 (got {args.chunk_size})")
    for name in policies:
        if name.partition(":")[0] not in POLICY_NAMES:
            p.error(f"unknown policy '{name}'; choose from {', '.join(POLICY_NAMES)}")


def add_model_args(p: argparse.ArgumentParser, default_model: str | None,
                   compression: bool = True) -> None:
    """--model and its kin; `compression` False leaves out FlexGen's 4-bit flags (for a
    program that compares with an uncompressed reference)."""
    from ..models import MODEL_NAMES

    p.add_argument("--model", default=default_model, required=default_model is None,
                   metavar="NAME",
                   help=f"model name: {', '.join(MODEL_NAMES)} (with --model-path, any label)")
    p.add_argument("--model-path", metavar="DIR",
                   help="local Hugging Face OPT or Llama checkpoint; converted once to "
                        "FlexGen's per-tensor format and cached")
    p.add_argument("--seed", type=int_range(0), default=0,
                   help="seed of random weights (default 0)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                   help="dtype of weights, activations and KV (default: fp16 with CUDA, fp32 "
                        "without; bf16 computes faster on a CPU, fp16 far slower)")
    p.add_argument("--offload-dir", metavar="DIR",
                   help="where FlexGen keeps disk-placed weights and cache "
                        "(default: the user cache directory)")
    c = p.add_argument_group("weights and memory")
    if compression:
        _add_compression_args(c)
    c.add_argument("--gpu-batch-size", type=int_range(1), default=None, metavar="N",
                   help="FlexGen's micro-batch: sequences computed together per layer under "
                        "the block schedule (--throughput), and per batch of --prompt (1; "
                        "--throughput: 8)")
    c.add_argument("--num-gpu-batches", type=int_range(1), default=None, metavar="N",
                   help="FlexGen's micro-batches per block: a block of --gpu-batch-size x N "
                        "sequences shares each layer's weight load (1; --throughput: 8)")
    c.add_argument("--cpu-cache-compute", action="store_true", default=None,
                   help="attention over the KV cache's CPU share computed on the CPU, as "
                        "FlexGen's cpu_cache_compute (default: copied to the GPU per layer); "
                        "the cache's shares are --placement's CACHE_GPU and CACHE_CPU")
    c.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="read the next layer's weights while this one computes (default); "
                        "--no-overlap reads each layer when it is needed (to compare)")
    c.add_argument("--max-ram-gb", type=finite_float(0, low_open=True), default=None,
                   metavar="GB",
                   help="RAM the model may use (weights, cache, working memory, tiers); "
                        "default: what is available less 10%% of RAM (at least 4 GiB)")
    c.add_argument("--max-disk-gb", type=finite_float(0, low_open=True), default=None,
                   metavar="GB",
                   help="disk the model may use (the weights cache it writes, offloaded "
                        "weights and cache); default: what is free less 5%% of the file "
                        "system (at least 4 GiB)")


def _add_compression_args(c) -> None:
    c.add_argument("--compress-weight", action=argparse.BooleanOptionalAction, default=None,
                   help="hold weights in FlexGen's group-wise 4-bit format, dequantised per "
                        "layer on the compute device just before use (capacity, not speed); "
                        "default: --placement auto decides (4-bit when the dtype does not "
                        "fit), an explicit placement keeps the dtype")
    c.add_argument("--compress-cache", action="store_true",
                   help="hold the KV cache in FlexGen's group-wise 4-bit format: FlexGen's "
                        "cache (--prompt) and the serving engine's decode context")
    c.add_argument("--weight-groups", type=groups_arg(2, "--weight-groups"), default="64,0",
                   metavar="SIZE[,AXIS]",
                   help="4-bit weight groups: SIZE values along AXIS of a (out, in) matrix "
                        "share a minimum and a scale (FlexGen's 64,0)")
    c.add_argument("--cache-groups", type=groups_arg(3, "--cache-groups"), default="64,2",
                   metavar="SIZE[,AXIS]",
                   help="4-bit KV groups, AXIS of FlexGen's (seq, batch*heads, head_dim) "
                        "layout: 2 along a head's channels (FlexGen's 64,2), 0 along the "
                        "sequence")


def groups_arg(ndim: int, flag: str):
    """--weight-groups / --cache-groups: SIZE or SIZE,AXIS as quant.Groups."""
    def parse(text: str):
        from ..models.quant import Groups

        parts = text.split(",")
        try:
            size = int(parts[0])
            dim = int(parts[1]) if len(parts) > 1 else (0 if ndim == 2 else 2)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be SIZE or SIZE,AXIS (got {text!r})") \
                from None
        if len(parts) > 2:
            raise argparse.ArgumentTypeError(f"must be SIZE or SIZE,AXIS (got {text!r})")
        try:
            return Groups(size, dim).check(ndim, flag)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None

    parse.__name__ = "groups"
    return parse


def dtype_arg(name: str | None):
    """--dtype's value as a config's dtype (the configuration's one mapping, config.dtype_of)."""
    from ..config import dtype_of

    return dtype_of(name)
