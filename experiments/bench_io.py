"""Cold read bandwidth of the prefix store against the raw disk, in one run.

    python -m experiments.bench_io                         # OPT-6.7B-shaped KV, ~2 GiB
    python -m experiments.bench_io --shape smollm2         # small KV: 6 KiB chunks
    python -m experiments.bench_io --quick --json out.json # ~256 MiB, seconds

A store of random fp16 KV is built in a fresh directory on local disk (inside --dir,
default the current directory; never use tmpfs: O_DIRECT is refused there and the page
cache would be timed), next to a plain file of the same size as the store's layer files,
both fsynced. Then each measurement is made --repeats times, one pass of each in turn
(so drift in a shared disk's speed falls on all alike), and the median is reported:

- raw:      the plain file, O_DIRECT, 1 MiB blocks, as many reads in flight as the store
            reader has threads: what the disk gives ("raw_run_block": the same in reads
            as large as the store's longest, disk_layout.io.MAX_RUN_BYTES;
            "raw_store_files": the store's own layer files read whole that way, which
            separates the read path's cost from the cost of many files).
- store:    every prefix, layer after layer, all K and V chunks through
            PrefixStore.read_chunks (coalesced, CRC-checked, O_DIRECT); a layer's K and V
            are asked for at once and --inflight-layers layers ahead (an engine prefetches
            layer j+1 while layer j computes); "store_serial": one layer at a time.
- selected: per layer --select (25%) of the tokens: the first and last chunk plus seeded
            random runs of 8-32 tokens (clustered, as attention is), and only the chunks
            holding them. (In --quick the opt-6.7b prefix is 8 chunks long, so the first
            and last chunk are the whole 25%.)

GB/s is 10^9 bytes per second of bytes read from disk, chunk padding included;
"payload" figures count only K/V bytes, "needed" only the selected tokens' K/V bytes.
O_DIRECT keeps this machine's page cache out; a virtual disk's host may still cache,
which is one more reason raw and store are measured the same way, in turn, in one run.
"""
from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import shutil
import statistics
import sys
from pathlib import Path
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import disk_layout.io as disk_io
from impress_flexgen.entrypoints.args import ArgumentParser, write_json
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.errors import UserError
from impress_flexgen.store import ModelShape, PrefixStore, StoreConfig
from impress_flexgen.store import scratch

GB = 1e9
RAW_BLOCK = 1 << 20
TARGET_RATIO = 0.9


@dataclasses.dataclass(frozen=True)
class BenchShape:
    model: ModelShape
    chunk_size: int
    prefixes: int          # default prefix count and length (~2 GiB of KV)
    prefix_len: int
    quick_prefixes: int    # --quick (~256 MiB)
    quick_len: int


SHAPES = {
    # 32 layers x 32 KV heads x 128 x fp16: 512 KiB per token, 512 KiB per 64-token chunk.
    "opt-6.7b": BenchShape(ModelShape("opt-6.7b", 32, 32, 128), 64, 2, 2048, 1, 512),
    # 30 layers x 3 KV heads x 64 x fp16: 22.5 KiB per token; a 16-token chunk is 6 KiB,
    # padded to 8 KiB on disk.
    "smollm2": BenchShape(ModelShape("smollm2-135m", 30, 3, 64), 16, 16, 4096, 8, 1024),
}


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.bench_io",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="opt-6.7b")
    p.add_argument("--chunk-size", type=int, help="tokens per chunk (default: 64 for "
                   "opt-6.7b, 16 for smollm2)")
    p.add_argument("--prefixes", type=int, help="number of stored prefixes")
    p.add_argument("--prefix-len", type=int, help="tokens per prefix")
    p.add_argument("--threads", type=int, default=StoreConfig.read_threads,
                   help="store reader threads = raw reads in flight (default %(default)s)")
    p.add_argument("--inflight-layers", type=int, default=2,
                   help="layers requested ahead while loading (default %(default)s)")
    p.add_argument("--select", type=float, default=0.25,
                   help="token fraction of the selected loads (default %(default)s)")
    p.add_argument("--repeats", type=int, help="timed passes per measurement (default 4, "
                   "quick 2); the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", metavar="DIR", default=".",
                   help="where the temporary store directory is made (default: .)")
    p.add_argument("--keep", action="store_true", help="keep the store directory")
    p.add_argument("--quick", action="store_true", help="~256 MiB store, 2 passes")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    args.chunk_size = args.chunk_size or shape.chunk_size
    if args.prefixes is None:
        args.prefixes = shape.quick_prefixes if args.quick else shape.prefixes
    if args.prefix_len is None:
        args.prefix_len = shape.quick_len if args.quick else shape.prefix_len
    if args.repeats is None:
        args.repeats = 2 if args.quick else 4
    if min(args.prefixes, args.threads, args.inflight_layers, args.repeats) < 1:
        p.error("--prefixes, --threads, --inflight-layers and --repeats must be positive")
    if args.prefix_len < 2 * args.chunk_size or args.prefix_len % args.chunk_size:
        p.error("--prefix-len must be a multiple of the chunk size, at least two chunks")
    if not 0 < args.select <= 1:
        p.error("--select must be in (0, 1]")
    return args


# ---------------------------------------------------------------------------------------
# Building

class RandomKV:
    """Random finite fp16 KV (|x| < 2), quickly: every layer is a window at a random
    offset into one pool of random values, so no two layers hold the same bytes."""

    def __init__(self, shape: ModelShape, max_tokens: int, rng: np.random.Generator):
        self.shape, self.rng = shape, rng
        self.per_layer = 2 * shape.n_kv_heads * max_tokens * shape.head_dim
        n = self.per_layer + (16 << 20)
        bits = rng.integers(0, 1 << 63, size=(n + 3) // 4, dtype=np.uint64).view(np.uint16)[:n]
        self.pool = torch.from_numpy(bits & 0xBFFF).view(torch.float16)  # exponent < 16

    def prefix(self, n_tokens: int):
        """Per layer (K, V), each (heads, n_tokens, head_dim) fp16."""
        s = self.shape
        size = 2 * s.n_kv_heads * n_tokens * s.head_dim
        out = []
        for _ in range(s.n_layers):
            off = int(self.rng.integers(0, len(self.pool) - size))
            t = self.pool[off:off + size].view(2, s.n_kv_heads, n_tokens, s.head_dim)
            out.append((t[0], t[1]))
        return out


def write_random_file(path: str, size: int, rng: np.random.Generator) -> None:
    block = rng.integers(0, 1 << 63, size=(64 << 20) // 8, dtype=np.uint64).view(np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < size:
            # Vary each block a little so nothing below us can deduplicate it.
            block[:8] = np.frombuffer(np.int64(done).tobytes(), dtype=np.uint8)
            view = memoryview(block)[:min(len(block), size - done)]
            while view:
                n = os.write(fd, view)
                view, done = view[n:], done + n
        os.fsync(fd)
    finally:
        os.close(fd)


def direct_io_works(directory: str) -> bool:
    probe = os.path.join(directory, "o_direct_probe")
    with open(probe, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        os.close(fd)
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        os.unlink(probe)


# ---------------------------------------------------------------------------------------
# Measurements

def raw_read(paths, threads: int, block: int = RAW_BLOCK) -> tuple[int, float]:
    """Read whole files once, in order, with O_DIRECT in `block`-byte reads, `threads` in
    flight (one shared queue of blocks: reads go in file order)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    fds, jobs = [], []
    try:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError:
                fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            jobs.extend((fd, off) for off in range(0, os.fstat(fd).st_size, block))
        size = sum(os.fstat(fd).st_size for fd in fds)
        totals = [0] * threads
        buffers = [mmap.mmap(-1, block) for _ in range(threads)]
        for b in buffers:  # fault the buffers in before timing, as a reused buffer would be
            b.write(b"\0" * block)
        queue = iter(jobs)  # next() on a list iterator is atomic under the GIL

        def worker(t: int) -> None:
            view = memoryview(buffers[t])
            for fd, off in queue:
                totals[t] += os.preadv(fd, [view], off)
            view.release()

        workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
        for b in buffers:
            b.close()
    finally:
        for fd in fds:
            os.close(fd)
    if sum(totals) != size:
        raise RuntimeError(f"raw read of {len(paths)} files: {sum(totals)} of {size} bytes")
    return size, elapsed


def load(store: PrefixStore, prefixes, plans, inflight: int) -> tuple[int, float]:
    """Load every prefix layer after layer; plans[p][layer] = chunk ids (None: all).

    A layer's K and V are two read_chunks calls made at once (as an engine loading a
    layer asks for both), and up to `inflight` layers are requested ahead of the one
    being consumed, as an engine prefetching the next layers during compute would.
    Returns bytes read from disk and seconds.
    """
    n_layers = store.shape.n_layers
    before = store.inspect().state.reader.bytes_read

    def fetch(entry, node, kind, ids):
        if ids is None:
            ids = range(entry.layout.n_chunks)
        return len(store.inspect().reads.read_chunks(entry, kind, ids, node))

    with ThreadPoolExecutor(max_workers=2 * inflight, thread_name_prefix="bench-layer") as pool:
        t0 = time.perf_counter()
        for p, tokens in enumerate(prefixes):
            match = store.match_prefix(tokens)
            try:
                (node,) = match.nodes
                pending: deque = deque()
                for layer in range(n_layers):
                    entry = store.entry(node, layer)
                    ids = plans[p][layer] if plans else None
                    pending.append([pool.submit(fetch, entry, node, kind, ids) for kind in "kv"])
                    if len(pending) >= inflight:
                        for fut in pending.popleft():
                            fut.result()
                while pending:
                    for fut in pending.popleft():
                        fut.result()
            finally:
                store.release(match)
        elapsed = time.perf_counter() - t0
    return store.inspect().state.reader.bytes_read - before, elapsed


def select_tokens(n: int, c: int, frac: float, rng: np.random.Generator) -> np.ndarray:
    """Logical positions of a clustered selection: first and last chunk, runs of 8-32."""
    sel = np.zeros(n, dtype=bool)
    sel[:c] = True
    sel[n - c:] = True
    target = int(round(frac * n))
    while sel.sum() < target:
        length = min(int(rng.integers(8, 33)), target - int(sel.sum()))
        start = int(rng.integers(0, n - length + 1))
        sel[start:start + length] = True
    return np.flatnonzero(sel)


# ---------------------------------------------------------------------------------------

def median(xs) -> float:
    return float(statistics.median(xs))


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = SHAPES[args.shape]
    shape = bench.model
    parent = os.path.abspath(args.dir)
    if not os.path.isdir(parent):
        raise UserError(f"--dir {args.dir} is not a directory")
    workdir = str(scratch.make(Path(parent), "benchio"))
    try:
        return run(args, bench, shape, workdir)
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def build(store: PrefixStore, shape: ModelShape, prefixes, rng) -> float:
    """Insert every prefix with random KV; returns seconds."""
    threads = torch.get_num_threads()
    # Laying chunks out copies strided fp16; with 2 torch threads on a busy 2-core machine
    # that copy ran ~30x slower than with one.
    torch.set_num_threads(1)
    try:
        source = RandomKV(shape, max(len(t) for t in prefixes), rng)
        t0 = time.perf_counter()
        for tokens in prefixes:
            store.insert(tokens, 0, source.prefix(len(tokens)))
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)


def run(args, bench: BenchShape, shape: ModelShape, workdir: str) -> int:
    direct = direct_io_works(workdir)
    if not direct:
        print(f"warning: {workdir} refuses O_DIRECT (tmpfs?): the page cache is timed, "
              "not the disk", file=sys.stderr)
    rng = np.random.default_rng(args.seed)
    config = StoreConfig(chunk_size=args.chunk_size,
                         probe_heads=tuple(range(min(3, shape.n_kv_heads))),
                         probe_format="int4", reorder_interval=0, read_threads=args.threads)
    prefixes = [p * 1_000_000 + np.arange(args.prefix_len, dtype=np.int32)
                for p in range(args.prefixes)]
    raw_path = os.path.join(workdir, "raw.bin")
    c = args.chunk_size
    with PrefixStore(os.path.join(workdir, "store"), shape, config) as store:
        build_s = build(store, shape, prefixes, rng)
        overheads = store.inspect().accounting.overheads()
        file_bytes = store.inspect().accounting.disk_bytes()
        t0 = time.perf_counter()
        write_random_file(raw_path, file_bytes, rng)
        raw_write_s = time.perf_counter() - t0

        # Selections are drawn before timing, one per (prefix, layer).
        plans, sel_tokens = [], 0
        for tokens in prefixes:
            match = store.match_prefix(tokens)
            (node,) = match.nodes
            lay = store.entry(node, 0).layout
            per_layer = []
            for layer in range(shape.n_layers):
                logical = select_tokens(len(tokens), c, args.select, rng)
                sel_tokens += len(logical)
                per_layer.append(store.entry(node, layer).physical_chunks_of(logical))
            plans.append(per_layer)
            store.release(match)
        token_bytes = 2 * shape.n_kv_heads * shape.head_dim * 2  # K and V of one layer
        full_read = sum(2 * (len(t) // c) * lay.chunk_stride for t in prefixes) * shape.n_layers
        needed = sel_tokens * token_bytes

        # One pass of each per repeat, alternating, so drift in a shared disk's speed
        # falls on all of them alike.
        files = [e.path for n in store.inspect().state.tree.nodes.values() for e in n.layers]
        passes = {
            "raw": lambda: raw_read(raw_path, args.threads),
            "store": lambda: load(store, prefixes, None, args.inflight_layers),
            "raw_run": lambda: raw_read(raw_path, args.threads, disk_io.MAX_RUN_BYTES),
            "raw_files": lambda: raw_read(files, args.threads, disk_io.MAX_RUN_BYTES),
            "store_serial": lambda: load(store, prefixes, None, 1),
            "selected": lambda: load(store, prefixes, plans, args.inflight_layers),
        }
        times: dict[str, list[float]] = {k: [] for k in passes}
        read: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, fn in passes.items():
                read[name], t = fn()
                times[name].append(t)
        if read["store"] != full_read:
            raise RuntimeError(f"store pass read {read['store']} bytes, expected {full_read}")

    gbps = {k: read[k] / median(v) / GB for k, v in times.items()}
    pair_ratios = [(read["store"] / ts) / (read["raw"] / tr)
                   for ts, tr in zip(times["store"], times["raw"])]
    payload_fraction = lay.chunk_bytes / lay.chunk_stride
    sel_med = median(times["selected"])
    result = {
        "statistic": "median",
        "repeats": args.repeats,
        "shape": {"name": shape.name, "n_layers": shape.n_layers,
                  "n_kv_heads": shape.n_kv_heads, "head_dim": shape.head_dim, "dtype": "fp16"},
        "chunk_size": c,
        "chunk_bytes": lay.chunk_bytes,
        "chunk_stride": lay.chunk_stride,
        "prefixes": len(prefixes),
        "prefix_lengths": [len(t) for t in prefixes],
        "total_bytes": file_bytes,
        "kv_bytes": overheads["kv_bytes"],
        "full_read_bytes": full_read,
        "threads": args.threads,
        "inflight_layers": args.inflight_layers,
        "raw_block_bytes": RAW_BLOCK,
        "store_max_run_bytes": disk_io.MAX_RUN_BYTES,
        "crc32": disk_io.CRC32_IMPL,
        "direct_io": direct,
        "metadata_fraction": overheads["metadata_fraction"],
        "probe_fraction": overheads["probe_fraction"],
        "padding_fraction": overheads["padding_fraction"],
        "build_s": round(build_s, 3),
        "raw_write_s": round(raw_write_s, 3),
        "raw_read_GBps": round(gbps["raw"], 4),
        "raw_read_s": [round(t, 4) for t in times["raw"]],
        "raw_run_block_read_GBps": round(gbps["raw_run"], 4),
        "raw_run_block_read_s": [round(t, 4) for t in times["raw_run"]],
        "store_read_GBps": round(gbps["store"], 4),
        "store_payload_GBps": round(gbps["store"] * payload_fraction, 4),
        "store_read_s": [round(t, 4) for t in times["store"]],
        "ratio": round(gbps["store"] / gbps["raw"], 4),
        "ratio_per_repeat": [round(r, 4) for r in pair_ratios],
        "ratio_vs_raw_run_block": round(gbps["store"] / gbps["raw_run"], 4),
        "raw_store_files_GBps": round(gbps["raw_files"], 4),
        "raw_store_files_s": [round(t, 4) for t in times["raw_files"]],
        "ratio_vs_raw_store_files": round(gbps["store"] / gbps["raw_files"], 4),
        "target_ratio": TARGET_RATIO,
        "store_serial_read_GBps": round(gbps["store_serial"], 4),
        "store_serial_read_s": [round(t, 4) for t in times["store_serial"]],
        "serial_ratio": round(gbps["store_serial"] / gbps["raw"], 4),
        "select_fraction": args.select,
        "selected_read_GBps": round(gbps["selected"], 4),
        "selected_read_s": [round(t, 4) for t in times["selected"]],
        "selected_read_bytes": read["selected"],
        "selected_bytes_fraction": round(read["selected"] / full_read, 4),
        "selected_needed_bytes": needed,
        "selected_needed_GBps": round(needed / sel_med / GB, 4),
        "selected_time_fraction": round(sel_med / median(times["store"]), 4),
    }
    print(f"{shape.name}: {len(prefixes)} x {args.prefix_len} tokens, chunk {c} "
          f"({lay.chunk_bytes} B, stride {lay.chunk_stride}), {file_bytes / 2**30:.2f} GiB, "
          f"{args.threads} threads, CRC32 by {disk_io.CRC32_IMPL}, median of {args.repeats}; "
          f"build {build_s:.1f} s")
    print(f"  raw      {gbps['raw']:.2f} GB/s in {RAW_BLOCK >> 10} KiB reads, "
          f"{gbps['raw_run']:.2f} GB/s in {disk_io.MAX_RUN_BYTES >> 10} KiB reads; the "
          f"store's own files {gbps['raw_files']:.2f} GB/s in "
          f"{disk_io.MAX_RUN_BYTES >> 10} KiB reads")
    print(f"  store    {gbps['store']:.2f} GB/s (ratio {result['ratio']:.3f}, target "
          f"{TARGET_RATIO}; per repeat {', '.join(f'{r:.2f}' for r in pair_ratios)}); "
          f"one layer at a time {gbps['store_serial']:.2f} GB/s "
          f"(ratio {result['serial_ratio']:.3f})")
    print(f"  selected {gbps['selected']:.2f} GB/s, {result['selected_bytes_fraction']:.1%} of "
          f"the bytes for {args.select:.0%} of the tokens, needed "
          f"{result['selected_needed_GBps']:.2f} GB/s, {result['selected_time_fraction']:.1%} "
          "of the full load's time")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.bench_io", main))
