"""What the store's metadata costs per token and layer after reorders, by node length.

    python -m experiments.metadata_size                    # 64 .. 8,192-token nodes
    python -m experiments.metadata_size --quick --json out.json

Writes, for each node length, layer rows as a reorder leaves them (the hot quarter of the
tokens first by a seeded importance, sink and last chunk in place, the rest in positional
order; the importance, per-chunk bitmaps, access counters and ratios flushed) into a real
metadata database, and measures the pages SQLite takes for them (the WAL checkpointed,
free pages not counted) per token and layer; the node's token ids are shared by the
model's layers. Divided by the KV per token and layer of SmolLM2-135M and the OPT shapes,
that is the metadata's share of the KV. Rows of 2-4 KiB take a 4 KiB page each, so the
share is not monotonic in the length.
"""
from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import numpy as np

from disk_layout.metadata import LayerRow, Metadata
from impress_flexgen.entrypoints.args import ArgumentParser, int_range, write_json
from impress_flexgen.entrypoints.process import run_main

# (layers, KV heads, head dim): fp16 K and V.
SHAPES = {"smollm2-135m": (30, 3, 64), "opt-6.7b": (32, 32, 128), "opt-13b": (40, 40, 128),
          "opt-30b": (48, 56, 128)}
LENGTHS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 4096, 8192)
QUICK_LENGTHS = (256, 1024, 2048)
HOT_FRACTION = 0.25         # StoreConfig.reorder_hot_fraction's default


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.metadata_size",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", help="comma-separated node lengths in tokens, multiples of "
                   "the chunk size (default 64..8192; quick 256,1024,2048)")
    p.add_argument("--chunk-size", type=int_range(16, 256), default=16)
    p.add_argument("--rows", type=int_range(30, 100000),
                   help="layer rows per length, in whole nodes of 30 layers (default 600, "
                   "quick 60): enough that shared pages do not weigh")
    p.add_argument("--quick", action="store_true", help="3 lengths, 60 rows each")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.chunk_size % 8:
        p.error("--chunk-size must be a multiple of 8")
    try:
        lengths = [int(x) for x in (args.lengths or "").split(",") if x]
    except ValueError:
        p.error("--lengths must be comma-separated integers")
    args.lengths = lengths or list(QUICK_LENGTHS if args.quick else LENGTHS)
    if any(n < 2 * args.chunk_size or n % args.chunk_size for n in args.lengths):
        p.error("--lengths must be multiples of --chunk-size, at least two chunks")
    args.rows = args.rows or (60 if args.quick else 600)
    return args


def reordered(importance: np.ndarray, c: int) -> np.ndarray:
    """Physical -> logical order as an importance reorder makes it (store/reorder.py)."""
    n = len(importance)
    lo, hi = c, (n - c if n - c >= c else n)
    ranked = np.argsort(-importance[lo:hi], kind="stable")
    hot = ranked[:math.ceil(HOT_FRACTION * (hi - lo) / c) * c]
    hot = hot[importance[lo:hi][hot] > 0]
    cold = np.ones(hi - lo, dtype=bool)
    cold[hot] = False
    return np.concatenate([np.arange(lo), lo + hot, lo + np.flatnonzero(cold),
                           np.arange(hi, n)])


def used_bytes(meta: Metadata) -> int:
    meta.checkpoint()
    db = meta.db
    pages = db.execute("PRAGMA page_count").fetchone()[0] - \
        db.execute("PRAGMA freelist_count").fetchone()[0]
    return pages * db.execute("PRAGMA page_size").fetchone()[0]


def measure_length(n: int, c: int, rows: int, seed: int) -> dict:
    rng = np.random.default_rng([seed, n])
    chunks, nodes = n // c, math.ceil(rows / 30)
    fields = 0
    with tempfile.TemporaryDirectory() as tmp:
        meta = Metadata(str(Path(tmp) / "store.sqlite"))
        try:
            with meta.transaction():
                ids = [meta.add_node(None, 0, rng.integers(0, 50000, n).astype(np.int32))
                       for _ in range(nodes)]
            before = used_bytes(meta)
            for i, nid in enumerate(ids):
                with meta.transaction():
                    for layer in range(30):
                        imp = (rng.gamma(0.3, 1.0, n) * (rng.random(n) < 0.9)).astype(np.float32)
                        row = LayerRow(nid, layer, 2, f"{i * 30 + layer:032x}.kv",
                                       reordered(imp, c),
                                       rng.integers(0, 2**32, 1 + 2 * chunks, dtype=np.uint32),
                                       imp, rng.integers(0, 256, (chunks, c // 8), np.uint8),
                                       rng.integers(0, 100, chunks, np.uint16),
                                       rng.integers(0, 256, chunks, np.uint8))
                        meta.put_layer(row)
            fields = meta.db.execute(
                "SELECT SUM(length(mapping) + length(crcs) + length(importance) + "
                "length(bitmaps) + length(access) + length(ratio)) FROM layers").fetchone()[0]
            layer_bytes = used_bytes(meta) - before
            page = meta.db.execute("PRAGMA page_size").fetchone()[0]
        finally:
            meta.close()
    per = layer_bytes / (n * nodes * 30)
    out = {"tokens": n, "rows": nodes * 30, "page_size": page, "bytes_per_token_layer": per,
           "field_bytes_per_token_layer": fields / (n * nodes * 30), "share_of_kv": {}}
    for name, (layers, heads, dim) in SHAPES.items():
        kv = 2 * heads * dim * 2
        out["share_of_kv"][name] = (per + 4 / layers) / kv     # + the node's int32 token ids
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = [measure_length(n, args.chunk_size, args.rows, 0) for n in args.lengths]
    names = list(SHAPES)
    print(f"{'tokens':>7} {'B/token-layer':>14} " + " ".join(f"{x:>13}" for x in names))
    for r in rows:
        print(f"{r['tokens']:>7} {r['bytes_per_token_layer']:>14.2f} " +
              " ".join(f"{100 * r['share_of_kv'][x]:>12.3f}%" for x in names))
    write_json(args.json, {"quick": args.quick, "chunk_size": args.chunk_size,
                           "hot_fraction": HOT_FRACTION,
                           "kv_bytes_per_token_layer": {k: 4 * h * d for k, (_, h, d)
                                                        in SHAPES.items()},
                           "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.metadata_size", main))
