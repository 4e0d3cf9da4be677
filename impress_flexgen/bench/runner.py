"""Running a workload with one configuration, and summarising what happened.

    row = run_workload(runtime, workload, RunConfig("impress", "impress"), TierConfig())

Used by the main job (`python -m impress_flexgen.run`) and by the experiments, so that a
row of a benchmark and a run of the product are measured the same way.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..config import RunConfig, StoreOptions
from ..engine import Engine, Request, model_shape
from ..engine.scheduler import SchedulerConfig
from ..engine.assemble import StoreSpec, assemble, make_serving_policy, start_engine
from ..errors import UserError
from ..models.runtime import Runtime
from ..planner import PLAN_KINDS
from ..store import scratch
from ..tiers import GPU, REMOTE, TierConfig
from .workload import Workload

log = logging.getLogger("impress_flexgen.bench.runner")



def kv_bytes_per_token(runtime: Runtime, kv_format: str | None = None) -> int:
    """Stored bytes of one token's K and V over all layers, in `kv_format` (None: the
    compute dtype's, the default store format)."""
    shape = model_shape(runtime.spec, kv_format=kv_format)
    return shape.n_layers * shape.kv_bytes_per_token_layer


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q), both (positions, vocab) logits."""
    logp = torch.log_softmax(p_logits.double(), -1)
    logq = torch.log_softmax(q_logits.double(), -1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


@dataclasses.dataclass
class Prepared:
    """An engine over a store holding the workload's prefixes, warm-up queries served."""

    engine: Engine
    policy: object
    store: object | None
    reorder_s: float = 0.0


@contextlib.contextmanager
def prepared(runtime: Runtime, workload: Workload, run: RunConfig, tiers: TierConfig, *,
             store_dir: Path | None = None, store_root: Path | None = None,
             store: StoreOptions | None = None) -> Iterator[Prepared]:
    """Each prefix is first served once (computed and inserted, unless already stored),
    then its warm-up queries run (their importance feeds the store). Without `store`
    (benchmarks), policies with reordering reorder once after the warm-up (a benchmark sees
    a settled layout); with it (the main job), the store reorders in the background every
    store.reorder_interval queries, and holds to its capacity and read limit. `store_dir`
    keeps the store (reused by the next run); without it a temporary store under
    `store_root` is removed at the end."""
    policy = make_serving_policy(run.policy, run.serving(), run.tier_policy)
    tmp = None
    if store_dir is None:
        root = Path(store_root) if store_root is not None else Path(tempfile.gettempdir())
        try:
            tmp = scratch.make(root, "store")
        except OSError as exc:
            raise UserError(f"cannot make a temporary store in {root}: "
                            f"{exc.strerror or exc}") from None
    stack = None
    try:
        options = {"reorder_interval": 10**9} if store is None else {
            **store.open_options(), "reorder_interval": store.reorder_interval or 10**9}
        stack = assemble(runtime, policy,
                         StoreSpec(store_dir or tmp, **{**options, **run.store_options()}),
                         tiers)
        engine, opened = stack.engine, stack.store
        ready = Prepared(engine, policy, opened)
        for warning in start_engine(engine):
            log.warning("%s", warning)
        for p, prefix in enumerate(workload.prefixes):
            engine.serve(Request(prefix, [prefix[-1]], 1, n_pad=workload.pad_of(p)))
        for p, query in workload.warmup:
            engine.serve(Request(workload.prefixes[p], query, 1, n_pad=workload.pad_of(p)))
        if opened is not None:
            if policy.reorder and store is None:
                t0 = time.perf_counter()
                opened.reorder_now()
                ready.reorder_s = time.perf_counter() - t0
            opened.tiers.cache.reset_metrics()
        yield ready
    finally:
        try:
            if stack is not None:
                stack.close()
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def serve_block(engine, reqs: list[Request], block: tuple[int, int]) -> list:
    """`reqs` served together under the block schedule: blocks of gpu_batch_size x
    num_gpu_batches sequences, computed in micro-batches of gpu_batch_size (Runner)."""
    size, n = block
    engine.runner.micro_batch = size
    try:
        out = engine.serve_all(reqs, SchedulerConfig(
            max_batch_size=size * n,
            max_batch_tokens=max(8192, sum(len(r.query) + 1 for r in reqs))),
            query_logits=True)
    finally:
        engine.runner.micro_batch = None
    for resp in out:
        if isinstance(resp, Exception):
            raise resp
    return out


def run_workload(runtime: Runtime, workload: Workload, run: RunConfig, tiers: TierConfig, *,
                 store_dir: Path | None = None, store_root: Path | None = None,
                 reference: dict | None = None, max_new_tokens: int = 1,
                 store: StoreOptions | None = None, progress=None, on_response=None,
                 block: tuple[int, int] | None = None) -> dict:
    """Serve the workload with one configuration (see prepared()); returns a result row.
    `block` (gpu_batch_size, num_gpu_batches): the measured queries are served together
    under the block schedule (serve_block), with the row's tokens_per_s.

    Only the measured queries count. `reference` maps query index -> full-KV query logits
    for KL; an empty dict is filled.
    """
    with prepared(runtime, workload, run, tiers, store_dir=store_dir, store_root=store_root,
                  store=store) as ready:
        rows, kls, top1 = [], [], []
        reqs = [Request(workload.prefixes[p], query, max_new_tokens, n_pad=workload.pad_of(p))
                for p, query in workload.queries]
        generated, t0 = 0, time.perf_counter()
        served = None if block is None else serve_block(ready.engine, reqs, block)
        for qi, (p, query) in enumerate(workload.queries):
            resp = served[qi] if served is not None else \
                ready.engine.serve(reqs[qi], query_logits=True)
            rows.append(resp.stats)
            generated += len(resp.tokens)
            if reference is not None:
                if qi in reference:
                    kls.append(kl_divergence(reference[qi], resp.query_logits))
                    top1.append(float((reference[qi].argmax(-1) ==
                                       resp.query_logits.argmax(-1)).float().mean()))
                else:
                    reference[qi] = resp.query_logits
            if on_response is not None:
                on_response(qi, p, query, resp)
            if progress is not None:
                progress.update(1)
        elapsed = time.perf_counter() - t0
        row = summarize(run, ready.policy, rows, kls, top1, ready.store)
        row["tokens_per_s"] = generated / elapsed
        row["reorder_s"] = ready.reorder_s
        row["shared_fallbacks"] = ready.engine.shared_fallbacks
        if ready.store is not None:
            row["space"] = store_space(ready.store)
        return row


def summarize(run: RunConfig, policy, rows, kls, top1, store) -> dict:
    ttft = np.array([r.ttft_s for r in rows])
    prefix_bytes = sum(r.prefix_bytes for r in rows)
    # Per tier name, fastest first (the shared pool's last, when there is one).
    names = list(rows[0].bytes_read) if rows else list(TierConfig().names(remote=False))
    loaded = {t: int(sum(r.bytes_read.get(t, 0) for r in rows)) for t in names}
    probe = int(sum(r.probe_bytes for r in rows))
    layers = sum(r.layers for r in rows if r.matched_tokens)
    gpu = store.tiers.cache.metrics[GPU] if store is not None else {"hits": 0, "misses": 0}
    parts = store.inspect() if store is not None else None
    planned = [r for r in rows if r.matched_tokens]
    decoded = [r.decode_s_per_token for r in rows if r.decode_s_per_token > 0]
    accesses = gpu["hits"] + gpu["misses"]
    return {
        "policy": policy.name,
        "label": run.label,
        "kv_format": store.shape.kv_format if store is not None else None,
        "config": {**dataclasses.asdict(run), **policy.describe()},
        "queries": len(rows),
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "ttft_breakdown_s": {k: float(np.mean([getattr(r, k) for r in rows]))
                             for k in ("match_s", "weights_s", "probe_s", "select_s", "load_s",
                                       "compute_s")},
        "io_time_s": float(np.mean([r.io_s for r in rows])),
        # Time per generated token after the first (requests that decoded at all).
        "decode_s_per_token": float(np.mean(decoded)) if decoded else None,
        "store_s": float(np.mean([r.store_s for r in rows])),
        "prefix_bytes_total": int(prefix_bytes),
        "bytes_read": loaded,
        "probe_bytes": probe,
        "bytes_read_total": sum(loaded.values()) + probe,    # every tier, and probe keys
        "bytes_loaded_fraction": (sum(loaded.values()) + probe) / prefix_bytes
        if prefix_bytes else 0.0,
        "read_amplification": (sum(loaded.values()) + probe) / max(1, sum(r.bytes_needed
                                                                           for r in rows)),
        "chunks_read": int(sum(r.chunks_read for r in rows)),
        "chunks_loaded": int(sum(r.chunks_loaded for r in rows)),
        "fallback_rate": sum(r.layers_fallback for r in rows) / layers if layers else 0.0,
        "gpu_hit_ratio": gpu["hits"] / accesses if accesses else 0.0,
        "kl": float(np.mean(kls)) if kls else None,
        "kl_median": float(np.median(kls)) if kls else None,
        "top1_agreement": float(np.mean(top1)) if top1 else None,
        "tiers": None if store is None else {
            **store.tiers.cache.metrics, "duplicate_bytes": store.tiers.cache.duplicate_bytes()},
        "store_metrics": dataclasses.asdict(parts.state.metrics) if store is not None else None,
        "matched_tokens_mean": float(np.mean([r.matched_tokens for r in rows])),
        # How the queries with a stored prefix were served, and what the pool gave.
        "plans": {p: sum(r.plan == p for r in planned) for p in PLAN_KINDS},
        "predicted_ttft_mean_s": float(np.mean([r.predicted_ttft_s for r in planned]))
        if planned else 0.0,
        "shared_tokens_mean": float(np.mean([r.shared_tokens for r in rows])),
        "shared_bytes": loaded.get(REMOTE, 0),
        "reorders": parts.state.metrics.reorders if store is not None else 0,
    }



def store_space(store) -> dict:
    """Bytes on disk: K/V chunks (padding included), probe copies, metadata database."""
    kv = probe = 0
    for node in store.inspect().state.tree.nodes.values():
        for entry in node.layers:
            probe += entry.layout.probe_stride
            kv += 2 * entry.layout.section_bytes
    meta = sum(f.stat().st_size for f in store.inspect().state.dir.glob("store.sqlite*"))
    return {"kv_bytes": kv, "probe_bytes": probe, "metadata_bytes": meta}
