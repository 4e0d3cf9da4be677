"""What probing one layer costs on this machine, step by step.

    python -m experiments.bench_probe                       # smollm2-135m shape, 2,048 tokens
    python -m experiments.bench_probe --quick --json out.json

On a CPU, impress's probe is about one full attention score pass per layer; this times
its pieces on random data of one layer's shape (default smollm2-135m: 9 query heads over
3 KV heads of 64 dims, a 64-token query, the prefix's int4 probe copy), all in one process
and interleaved (each repeat runs every step once), so a noisy machine's drift hits them
alike; medians are reported:

  decode       the int4 probe copy -> float32 keys, as the store decodes it
               (disk_layout.format.decode_probe), against `decode (numpy)`, the earlier
               in-place numpy decoder kept here as the baseline (outputs must be equal);
  product      the probe heads' query x key product, with its GFLOP/s;
  exp, exp2    the softmax's exponential over those scores, base e and base 2 (the
               scoring works in base 2: the same softmax);
  score layer  policies.itf.probe_scores, the whole scoring of one layer.
"""
from __future__ import annotations

import statistics
import sys
import time
import types

import numpy as np
import torch

from disk_layout.format import INT4_GROUP, decode_probe, encode_probe
from impress_flexgen.entrypoints.args import ArgumentParser, write_json
from impress_flexgen.entrypoints.process import run_main
from policies.base import ProbeKeys, ServingConfig
from policies.itf import probe_scores


def decode_numpy(buf, shape) -> torch.Tensor:
    """The earlier int4 decoder (numpy, nibbles into the float32 output, then scale and
    shift in place): the baseline the store's decoder is measured against."""
    n_values = int(np.prod(shape))
    packed = np.frombuffer(buf, dtype=np.uint8, count=n_values // 2)
    params = np.frombuffer(buf, dtype=np.float16, offset=n_values // 2,
                           count=(n_values // INT4_GROUP) * 2).reshape(-1, 2).astype(np.float32)
    vals = np.empty((n_values // 2, 2), dtype=np.float32)
    np.bitwise_and(packed, 0x0F, out=vals[:, 0], casting="unsafe")
    np.right_shift(packed, 4, out=vals[:, 1], casting="unsafe")
    groups = vals.reshape(-1, INT4_GROUP)
    groups *= params[:, :1]
    groups += params[:, 1:]
    return torch.from_numpy(vals).view(shape)


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.bench_probe",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--query-tokens", type=int, default=64)
    p.add_argument("--heads", type=int, default=9, help="query heads, all probing (9)")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads in the probe copy (3)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    p.add_argument("--repeats", type=int, help="default 200 (quick: 10)")
    p.add_argument("--quick", action="store_true", help="256-token prefix, 10 repeats")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.prefix_tokens = min(args.prefix_tokens, 256)
    if args.repeats is None:
        args.repeats = 10 if args.quick else 200
    for name in ("prefix_tokens", "query_tokens", "heads", "kv_heads", "head_dim", "threads",
                 "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if (args.kv_heads * args.prefix_tokens * args.head_dim) % INT4_GROUP:
        p.error(f"the probe copy must hold a multiple of {INT4_GROUP} values")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = measure(args)
    finally:
        torch.set_num_threads(threads)
    print(f"{'step':<16}{'ms per layer':>14}")
    for name, ms in result["median_ms"].items():
        print(f"{name:<16}{ms:>14.3f}")
    print(f"product: {result['product_gflops']:.0f} GFLOP/s; exp2 / exp = "
          f"{result['median_ms']['exp2'] / result['median_ms']['exp']:.2f}; decode / "
          f"decode (numpy) = {result['median_ms']['decode'] / result['median_ms']['decode (numpy)']:.2f}")
    write_json(args.json, result)
    return 0


def measure(args) -> dict:
    g = torch.Generator().manual_seed(0)
    H, KV, s, n, d = args.heads, args.kv_heads, args.query_tokens, args.prefix_tokens, \
        args.head_dim
    q = torch.randn(H, s, d, generator=g)
    k_new = torch.randn(KV, s, d, generator=g)
    shape = (KV, n, d)
    raw = encode_probe(torch.randn(*shape, generator=g), "int4")
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)   # as a read lands
    if not torch.equal(decode_probe(buf, "int4", shape), decode_numpy(raw, shape)):
        raise AssertionError("the two int4 decoders disagree")
    keys = decode_probe(buf, "int4", shape)
    ctx = types.SimpleNamespace(probe=ProbeKeys(keys), q=q, k_new=k_new, n_pad=0,
                                probe_heads=tuple(range(H)), probe_kv_heads=tuple(range(KV)),
                                group=H // KV, config=ServingConfig())
    qb = q.reshape(KV, H // KV * s, d)
    scores = torch.bmm(qb, keys.transpose(1, 2))
    out = torch.empty_like(scores)
    steps = {
        "decode": lambda: decode_probe(buf, "int4", shape),
        "decode (numpy)": lambda: decode_numpy(raw, shape),
        "product": lambda: torch.bmm(qb, keys.transpose(1, 2)),
        "exp": lambda: torch.exp(scores, out=out),
        "exp2": lambda: torch.exp2(scores, out=out),
        "score layer": lambda: probe_scores(ctx),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(3):                      # warm-up: allocator, thread pool
        for fn in steps.values():
            fn()
    for _ in range(args.repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    flops = 2 * H * s * n * d
    return {"shape": {"heads": H, "kv_heads": KV, "head_dim": d, "prefix_tokens": n,
                      "query_tokens": s}, "threads": args.threads, "repeats": args.repeats,
            "median_ms": median, "product_gflops": flops / (median["product"] * 1e-3) / 1e9}


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.bench_probe", main))
