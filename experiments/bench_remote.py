"""Time to first token of a reused prefix from each tier: recompute, local disk, Redis only.

    python -m experiments.bench_remote [--quick] [--json PATH]

One natural-text prefix per length (default ~1k and ~4k tokens; --quick: 1k), several
64-token queries on it, each served every way in one run, the ways interleaved query by
query (so a shared machine's drift falls on all alike):

  recompute     (--no-recompute leaves it out) no store: prefix and query computed from
                scratch;
  local disk    the prefix in the local disk store, policy full (every stored chunk loaded),
                cold reads (the store reads with O_DIRECT; `direct_io` in the output says
                whether the file system allowed it), no GPU or CPU tier. This engine also
                has the pool: serving the prefix first stored it and wrote it through;
  redis only    the prefix ONLY in that shared Redis pool (a redis-server this benchmark
                starts on a free loopback port): each query is served by a fresh engine
                whose local store is empty, so every chunk comes from the pool;
  redis cluster (--no-cluster leaves it out) the same, from a Redis Cluster of three masters
                on loopback (redis+cluster://...): the pool's values copied there byte for
                byte, so it serves the very bytes the local disk holds;
  impress disk  (--no-impress leaves it out) the store's own policy from the local disk:
                whole chunks chosen by the probe on an importance-reordered layout.

For each: median TTFT and its ratio to recompute's (also paired by query in the JSON),
bytes moved per tier per request (RequestStats.bytes_read), and whether the first token
equals recompute's. The Redis row also reports whether its first token and logits equal the
local disk row's: both attend to the same float16 KV bytes, so they agree exactly. (Two
separate prefills of one prefix need not: CPU kernels may differ in the last bit.)
"""
from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import torch

from impress_flexgen.bench.runner import RunConfig, prepared
from impress_flexgen.bench.workload import WorkloadConfig, build_workload
from impress_flexgen.engine import Request, assemble, open_store
from impress_flexgen.engine.assemble import start_engine
from impress_flexgen.entrypoints.args import ArgumentParser, write_json
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.errors import UserError
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.store import scratch
from impress_flexgen.tiers import TierConfig
from impress_flexgen.tiers.remote import RemoteNamespace, chunk_hashes
from policies import ServingConfig, make_policy

RECOMPUTE, DISK, REDIS, IMPRESS = "recompute", "local disk", "redis only", "impress disk"
CLUSTER = "redis cluster"
TIER_NAMES = ("gpu", "cpu", "disk", "remote")


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.bench_remote",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true", help="one 1024-token prefix, 3 queries")
    p.add_argument("--prefix-tokens", help="comma-separated prefix lengths (default 1024,4096; "
                   "quick: 1024)")
    p.add_argument("--queries", type=int, help="measured queries per prefix (default 3)")
    p.add_argument("--query-tokens", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--retention", type=float, default=0.25, help="impress row's retention")
    p.add_argument("--no-impress", action="store_true", help="leave the impress row out")
    p.add_argument("--no-cluster", action="store_true", help="leave the cluster row out")
    p.add_argument("--no-recompute", action="store_true",
                   help="leave the recompute row out (long prefixes on a busy machine)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (every row alike)")
    p.add_argument("--store-root", help="where stores go (default: the temp dir)")
    p.add_argument("--offload-dir", help="FlexGen's offload dir (default: the cache's)")
    p.add_argument("--redis-server", help="redis-server binary (default: found on PATH)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    text = args.prefix_tokens or ("1024" if args.quick else "1024,4096")
    try:
        args.prefix_tokens = [int(x) for x in text.split(",") if x]
    except ValueError:
        p.error("--prefix-tokens: comma-separated whole numbers")
    if args.queries is None:
        args.queries = 3
    if not args.prefix_tokens or any(n < args.chunk_size for n in args.prefix_tokens):
        p.error(f"--prefix-tokens: each length must be at least one chunk ({args.chunk_size})")
    if min(args.queries, args.query_tokens, args.threads) < 1:
        p.error("--queries, --query-tokens and --threads must be positive")
    if not 0 < args.retention <= 1:
        p.error("--retention must be in (0, 1]")
    return args


@contextlib.contextmanager
def redis_cluster(binary: str | None):
    """A private 3-master Redis Cluster on loopback ports, stopped after."""
    from tests.redis_cluster import RedisCluster

    try:
        cluster = RedisCluster(3, server=binary).start()
    except RuntimeError as exc:
        raise UserError(f"cannot start a Redis Cluster: {exc}") from None
    try:
        yield cluster
    finally:
        cluster.close()


def copy_pool(url: str, cluster_url: str) -> int:
    """Every pool key of the server at `url` into the cluster, completion markers last."""
    from impress_flexgen.tiers.remote import RedisTier

    ns = RemoteNamespace("copy", 1, 1, 1, "float16", 16)
    target = RedisTier(cluster_url, ns)
    try:
        client = target._client
        with redis.Redis.from_url(url) as source:
            keys = sorted(source.scan_iter(match=b"ifkv:*", count=1000),
                          key=lambda k: k.endswith(b":done"))
            for i in range(0, len(keys), 256):
                batch = keys[i:i + 256]
                pipe = client.pipeline(transaction=False)
                for k, v in zip(batch, source.mget(batch)):
                    if v is not None:
                        pipe.set(k, v)
                pipe.execute()
        return len(keys)
    finally:
        target.close()


@contextlib.contextmanager
def redis_server(binary: str | None):
    """A private redis-server on a free loopback port (no persistence), stopped after."""
    from tests.redis_server import MISSING, RedisServer, find_redis_server

    binary = binary or find_redis_server()
    if binary is None or not os.access(binary, os.X_OK):
        raise UserError(MISSING if binary is None else f"{binary} is not an executable")
    server = RedisServer(binary)
    try:
        server.start()
    except RuntimeError as exc:
        server.close()
        raise UserError(f"cannot start redis-server: {exc}") from None
    try:
        yield server
    finally:
        server.close()


class Ways:
    """The engines of one prefix, each able to serve a query and say what it did."""

    def __init__(self, rt: Runtime, wl, args, url: str, root: Path, stack: contextlib.ExitStack,
                 cluster_url: str | None = None):
        self.rt, self.wl, self.args, self.url, self.root = rt, wl, args, url, root
        self.cluster_url = cluster_url
        self.prefix = wl.prefixes[0]
        cs = args.chunk_size
        self.recompute = None
        if not args.no_recompute:
            recomp = make_policy("recomp", ServingConfig(retention=1.0))
            self.recompute = assemble(rt, recomp, None, TierConfig()).engine
            for _, query in wl.warmup:   # as prepared() warms the others: no cold first call
                self.recompute.serve(Request(self.prefix, query, 1))
        self.full_run = RunConfig(DISK, "full", 1.0, chunk_size=cs)
        # The local disk engine is also the writer: serving the prefix first stored it and
        # wrote it through to the pool, so the pool holds the very bytes its disk holds.
        # With the whole prefix matched locally it never asks the pool afterwards.
        self.disk = stack.enter_context(prepared(rt, wl, self.full_run,
                                                 TierConfig(remote_url=url), store_root=root))
        stack.callback(self.disk.engine.close)
        pool = self.disk.engine.shared
        if not pool.tier.flush(30):
            raise UserError("the Redis pool did not take the prefix within 30 s")
        want = len(self.prefix) // cs
        held = pool.tier.batch_exists_chunks(chunk_hashes(pool.namespace, self.prefix))
        if held != want:
            raise UserError(f"the Redis pool holds {held} of the prefix's {want} chunks "
                            f"(writer: {pool.tier.metrics()})")
        self.writer_metrics = pool.tier.metrics()
        if cluster_url is not None:
            copy_pool(url, cluster_url)
        self.direct_io = self.disk.store.inspect().state.reader.direct
        self.impress = None
        if not args.no_impress:
            self.impress = stack.enter_context(prepared(
                rt, wl, RunConfig(IMPRESS, "impress:all", args.retention, granularity="chunk",
                                  threshold="none", probe_heads="auto", probe_format="int4",
                                  chunk_size=cs), TierConfig(), store_root=root))

    def names(self) -> list[str]:
        return ([RECOMPUTE] if self.recompute else []) + [DISK, REDIS] + \
            ([CLUSTER] if self.cluster_url else []) + ([IMPRESS] if self.impress else [])

    def serve(self, name: str, query: list[int]):
        req = Request(self.prefix, query, 1, keep_logits=True)
        if name == RECOMPUTE:
            return self.recompute.serve(req)
        if name == DISK:
            return self.disk.engine.serve(req)
        if name == IMPRESS:
            return self.impress.engine.serve(req)
        return self._from_pool_only(req, self.cluster_url if name == CLUSTER else self.url)

    def _from_pool_only(self, req: Request, url: str):
        """A fresh engine over an empty local store and the pool: every chunk from Redis.
        Started as a server starts it (its first command to the pool, which opens the
        connection or maps a cluster's slots, before any request) and warmed, as the other
        ways' engines are, by a request too short to store or share anything."""
        with scratch.directory(self.root, "reader") as work:
            cfg = self.full_run.serving()
            policy = make_policy("full", cfg)
            store = open_store(Path(work) / "store", self.rt, cfg, policy,
                               **self.full_run.store_options())
            engine = assemble(self.rt, policy, store, TierConfig(remote_url=url)).engine
            # This way measures reads from the pool: never skipped by the budget (on a
            # busy machine one slow round trip can make a tiny model's compute look cheaper).
            engine.shared.recompute_s = lambda n, ctx: float("inf")
            try:
                start_engine(engine)
                short = list(req.query[:self.args.chunk_size - 1])
                engine.serve(Request(short, list(req.query), 1))
                resp = engine.serve(req)
            finally:
                engine.close()
                store.close()
        if resp.stats.matched_tokens or not resp.stats.shared_tokens:
            raise RuntimeError(f"the redis-only engine matched {resp.stats.matched_tokens} "
                               f"tokens locally and {resp.stats.shared_tokens} from the pool")
        return resp


def measure_prefix(rt: Runtime, n_tokens: int, args, url: str, root: Path,
                   cluster=None) -> list[dict]:
    wl = build_workload(rt.tokenizer, WorkloadConfig(
        n_prefixes=1, prefix_tokens=n_tokens, queries_per_prefix=args.queries,
        query_tokens=args.query_tokens))
    queries = [q for _, q in wl.queries]
    # Longer prefixes start with the shorter ones' tokens: each length starts with an
    # empty pool, so its writer computes and writes every chunk itself.
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    if cluster is not None:
        cluster.flush()
    seen: dict[str, list] = {}
    with contextlib.ExitStack() as stack:
        ways = Ways(rt, wl, args, url, root, stack,
                    cluster.url if cluster is not None else None)
        names = ways.names()
        for qi, query in enumerate(queries):
            # Rotate the order per query: no way always runs first (cold) or last.
            for name in names[qi % len(names):] + names[:qi % len(names)]:
                seen.setdefault(name, [None] * len(queries))[qi] = ways.serve(name, query)
        extra = {"direct_io": ways.direct_io, "writer_pool_metrics": ways.writer_metrics}
    return summarize(len(wl.prefixes[0]), seen, extra)


def summarize(n_tokens: int, seen: dict[str, list], extra: dict) -> list[dict]:
    base = seen.get(RECOMPUTE)
    base_ttft = [r.stats.ttft_s for r in base] if base else None
    rows = []
    for name, resps in seen.items():
        ttft = [r.stats.ttft_s for r in resps]
        moved = {t: statistics.fmean(r.stats.bytes_read.get(t, 0) for r in resps)
                 for t in TIER_NAMES}
        row = {
            "prefix_tokens": n_tokens, "way": name, "queries": len(resps),
            "ttft_median_s": statistics.median(ttft), "ttft_mean_s": statistics.fmean(ttft),
            "ttft_s": ttft,
            "ttft_vs_recompute": statistics.median(ttft) / statistics.median(base_ttft)
            if base else None,
            # Paired by query: the median of each query's TTFT over recompute's on it.
            "ttft_vs_recompute_paired": statistics.median(t / b for t, b in zip(ttft, base_ttft))
            if base else None,
            "bytes_read_per_request": moved,
            "matched_tokens": statistics.fmean(r.stats.matched_tokens for r in resps),
            "shared_tokens": statistics.fmean(r.stats.shared_tokens for r in resps),
            "computed_tokens": statistics.fmean(r.stats.computed_tokens for r in resps),
            "ttft_breakdown_s": {k: statistics.fmean(getattr(r.stats, k) for r in resps)
                                 for k in ("match_s", "weights_s", "probe_s", "select_s",
                                           "load_s", "compute_s")},
            "first_tokens": [r.tokens[0] for r in resps],
            "first_token_equals_recompute": all(r.tokens[0] == b.tokens[0]
                                                for r, b in zip(resps, base)) if base else None,
            "max_logit_diff_vs_recompute": max(
                float((r.step_logits[0] - b.step_logits[0]).abs().max())
                for r, b in zip(resps, base)) if base else None,
        }
        if name in (REDIS, CLUSTER) and DISK in seen:
            disk = seen[DISK]
            row["first_token_equals_local_disk"] = all(r.tokens[0] == d.tokens[0]
                                                       for r, d in zip(resps, disk))
            row["max_logit_diff_vs_local_disk"] = max(
                float((r.step_logits[0] - d.step_logits[0]).abs().max())
                for r, d in zip(resps, disk))
            disk_ttft = [d.stats.ttft_s for d in disk]
            row["ttft_vs_local_disk"] = statistics.median(ttft) / statistics.median(disk_ttft)
            row["ttft_vs_local_disk_paired"] = statistics.median(
                t / d for t, d in zip(ttft, disk_ttft))
        if name in (DISK, IMPRESS):
            row["direct_io"] = extra["direct_io"]
        if name in (REDIS, CLUSTER):
            row["writer_pool_metrics"] = extra["writer_pool_metrics"]
        rows.append(row)
    return rows


def environment(args, rt: Runtime, server, root: Path) -> dict:
    try:
        version = subprocess.run([server.binary, "--version"], capture_output=True, text=True,
                                 timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        version = None
    return {
        "model": args.model, "device": str(rt.model.layers[0].compute.dev),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
        "redis_server": version, "store_root": str(root), "store_fs": _fs_type(root),
        "chunk_size": args.chunk_size, "query_tokens": args.query_tokens,
        "queries": args.queries, "retention_impress": args.retention,
    }


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _fs_type(path: Path) -> str | None:
    """The file system type holding `path` (from /proc/mounts; None elsewhere)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = max((m for m in mounts if len(m) > 2 and (real + "/").startswith(
        m[1].rstrip("/") + "/")), key=lambda m: len(m[1]), default=None)
    return best[2] if best else None


def base_known(row: dict) -> bool:
    return row["ttft_vs_recompute"] is not None


def print_table(rows: list[dict]) -> None:
    print(f"{'prefix':>7} {'way':<14}{'TTFT med s':>11}{'/recomp':>9}{'/disk':>7}{'disk MB':>9}"
          f"{'remote MB':>10}{'pool tok':>9}  first token = recompute")
    for r in rows:
        mb = r["bytes_read_per_request"]
        same = {True: "yes", False: "NO", None: "-"}[r["first_token_equals_recompute"]]
        if "first_token_equals_local_disk" in r:
            same += f" (= local disk: {'yes' if r['first_token_equals_local_disk'] else 'NO'}," \
                    f" logits diff {r['max_logit_diff_vs_local_disk']:.1e})"
        vs_disk = f"{r['ttft_vs_local_disk']:>7.2f}" if "ttft_vs_local_disk" in r else " " * 7
        vs_recomp = f"{r['ttft_vs_recompute']:>9.3f}" if base_known(r) else " " * 9
        print(f"{r['prefix_tokens']:>7} {r['way']:<14}{r['ttft_median_s']:>11.3f}"
              f"{vs_recomp}{vs_disk}{mb['disk'] / 1e6:>9.2f}{mb['remote'] / 1e6:>10.2f}"
              f"{r['shared_tokens']:>9.0f}  {same}")


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    root = Path(args.store_root) if args.store_root else Path(tempfile.gettempdir())
    rows: list[dict] = []
    t0 = time.perf_counter()
    load0 = _load()
    try:
        with redis_server(args.redis_server) as server, \
                (contextlib.nullcontext() if args.no_cluster
                 else redis_cluster(args.redis_server)) as cluster, \
                Runtime(RuntimeConfig(model=args.model, offload_dir=args.offload_dir)) as rt:
            for n in args.prefix_tokens:
                rows += measure_prefix(rt, n, args, server.url, root, cluster)
            env = environment(args, rt, server, root)
    finally:
        torch.set_num_threads(threads)
    env["wall_s"] = time.perf_counter() - t0
    # Other work on the machine slows every row; the 1-minute load average says how busy it was.
    env["load_average_start_end"] = [load0, _load()]
    print_table(rows)
    write_json(args.json, {"environment": env, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.bench_remote", main))
