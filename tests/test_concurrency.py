"""Concurrent requests: the store serves bit-exact KV while inserts split nodes, reorders
rewrite layouts, evictions free room and the tiers keep copies; engines serving from
several threads (two engines on one store, or one engine) answer bit for bit as a single
request served alone."""
from __future__ import annotations

import queue
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.crash_test import (C, SHAPE, check_node, expected_bits, files_on_disk,
                                    kv_from_bits, orphans, store_config, tensor_bits)
from impress_flexgen.engine import Request, assemble, open_store
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.store import PrefixStore, StoreFull, StoreWriteFailed
from impress_flexgen.tiers import ChunkCache, ChunkLoad, TierConfig
from policies import ServingConfig, make_policy
from tests.helpers.kv import load_chunks

CHUNK_BYTES = SHAPE.n_kv_heads * C * SHAPE.head_dim * 2
KINDS = {"k": 0, "v": 1}


def host_tiers(gpu_chunks: int, cpu_chunks: int) -> ChunkCache:
    """Both tiers in host memory (the "GPU" tier on the CPU device): same code paths."""
    return ChunkCache(TierConfig(gpu_bytes=gpu_chunks * CHUNK_BYTES,
                                 cpu_bytes=cpu_chunks * CHUNK_BYTES),
                      gpu_device=torch.device("cpu"))


def node_bits(tokens: np.ndarray, node) -> np.ndarray:
    """Expected KV bits of `node`'s positions, for a request whose `tokens` matched it:
    the request's tokens before the node, then the node's own (which may go on past the
    request's)."""
    path = np.concatenate([tokens[:node.start], node.tokens])
    return expected_bits(path)[:, :, :, node.start:]


def chunk_mismatches(entry, want: np.ndarray, chunks: dict, ids) -> int:
    """Chunks (per kind, in `ids` order) whose bits differ from the logical positions the
    entry's mapping says they hold."""
    bad = 0
    for kind, got in chunks.items():
        for cid, chunk in zip(ids, got):
            logical = entry.logical_positions([cid])
            if not np.array_equal(tensor_bits(chunk), want[entry.layer, KINDS[kind]][:, logical]):
                bad += 1
    return bad


def overlapping_prefixes(seed: int, n: int) -> list[np.ndarray]:
    """`n` prefixes over 3 stems of 6 chunks: each takes 1-6 leading chunks of one stem and
    adds 1-3 chunks of its own (and a partial chunk), so later inserts split earlier nodes."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 1 << 20, 6 * C) for _ in range(3)]
    out = []
    for p in range(n):
        shared = stems[p % 3][:int(rng.integers(1, 7)) * C]
        own = rng.integers(0, 1 << 20, int(rng.integers(1, 4)) * C + int(rng.integers(0, C)))
        out.append(np.concatenate([shared, own]).astype(np.int32))
    return out


# ---------------------------------------------------------------------------------------
# 1. The store, bit exact, under concurrent requests, splits, reorders and evictions

class StoreLoad:
    """Worker threads serving overlapping prefixes like requests do; counts every chunk
    check and collects every failure."""

    def __init__(self, store: PrefixStore, prefixes, seed: int):
        self.store, self.prefixes, self.seed = store, prefixes, seed
        self.lock = threading.Lock()
        self.checked = self.mismatches = self.full = self.gave_up = 0
        self.errors: list[str] = []
        self.done = threading.Event()

    def count(self, **kw) -> None:
        with self.lock:
            for name, n in kw.items():
                setattr(self, name, getattr(self, name) + n)

    def request(self, tokens: np.ndarray, rng) -> None:
        store = self.store
        match = store.match_prefix(tokens)
        try:
            for node, used in match.segments:
                want = node_bits(tokens, node)
                for layer in range(SHAPE.n_layers):
                    entry = store.entry(node, layer)
                    ids = entry.physical_chunks_of(np.arange(used)).tolist()
                    ratios = rng.random(len(ids)).tolist()
                    chunks, _ = load_chunks(store, entry, {"k": ids, "v": ids}, node,
                                            {"k": ratios, "v": ratios})
                    self.count(checked=2 * len(ids),
                               mismatches=chunk_mismatches(entry, want, chunks, ids))
                    # Random importance: every reorder finds a new layout to write.
                    scores = rng.random(node.n_tokens).astype(np.float32)
                    store.record_selection(entry, scores, scores > 0.7, ids)
            aligned = len(tokens) // C * C
            if match.length < aligned:
                kv = kv_from_bits(expected_bits(tokens[:aligned]), match.length)
                try:
                    store.insert(tokens, match.length, kv)
                except StoreFull:
                    self.count(full=1)        # every leaf in use: the request goes on
                except StoreWriteFailed:
                    self.count(gave_up=1)     # the tree kept changing meanwhile
        finally:
            store.release(match)

    def worker(self, w: int, n_requests: int) -> None:
        rng = np.random.default_rng([self.seed, w])
        try:
            for _ in range(n_requests):
                self.request(self.prefixes[int(rng.integers(len(self.prefixes)))], rng)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            with self.lock:
                self.errors.append(f"worker {w}: {type(exc).__name__}: {exc}")

    def reorderer(self) -> None:
        rng = random.Random(self.seed)
        try:
            while not self.done.is_set():
                with self.store.inspect().state.lock:
                    nodes = list(self.store.inspect().state.tree.nodes.values())
                if rng.random() < 0.2:
                    self.store.reorder_now()
                elif nodes:
                    self.store.inspect().reorderer.reorder_node(rng.choice(nodes))
        except Exception as exc:  # noqa: BLE001 - reported by the test
            with self.lock:
                self.errors.append(f"reorderer: {type(exc).__name__}: {exc}")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt,eviction", [("int4", "score"), ("fp16", "lru")])
def test_store_serves_exact_kv_under_concurrent_requests(tmp_path, fmt, eviction):
    prefixes = overlapping_prefixes(11, 24)
    probe = PrefixStore(tmp_path / "size", SHAPE, store_config(fmt))
    per_chunk = SHAPE.n_layers * probe.inspect().state.layout(C).file_bytes
    probe.close()
    # Room for about 24 chunks of the ~100 the prefixes hold: evictions all along.
    cfg = store_config(fmt, disk_capacity_bytes=24 * per_chunk, reorder_interval=9,
                       eviction=eviction)
    cache = host_tiers(gpu_chunks=12, cpu_chunks=40)
    store = PrefixStore(tmp_path / "s", SHAPE, cfg, memory=cache)
    load = StoreLoad(store, prefixes, seed=5)
    try:
        workers = [threading.Thread(target=load.worker, args=(w, 40)) for w in range(5)]
        reorderer = threading.Thread(target=load.reorderer)
        for t in workers + [reorderer]:
            t.start()
        for t in workers:
            t.join()
        load.done.set()
        reorderer.join()
        m = store.inspect().state.metrics
        tiers = cache.metrics
        with store.inspect().state.reorder_lock:      # no background reorder writing a file right now
            # Nothing holds a node any more: every retired or uncommitted file is gone.
            left = orphans(store)
    finally:
        store.close()
    assert load.errors == []
    assert load.mismatches == 0, f"{load.mismatches} of {load.checked} chunks were wrong"
    assert left == []
    assert load.checked > 2000
    assert m.splits > 0 and m.evictions > 0 and m.reorders > 0 and m.inserts > 20, m
    assert tiers["gpu"]["hits"] > 0 and tiers["cpu"]["hits"] > 0, tiers

    with PrefixStore(tmp_path / "s", SHAPE, store_config(fmt)) as again:
        assert len(again.inspect().state.tree) > 0
        wrong = {n.id: check_node(again, n) for n in again.inspect().state.tree.nodes.values()}
        assert {nid: why for nid, why in wrong.items() if why} == {}
        assert orphans(again) == []
    names, tmps = files_on_disk(tmp_path / "s")
    assert tmps == [] and not [n for n in names if n.endswith(".tmp")]


@pytest.mark.timeout(60)
def test_a_matched_prefix_stays_stored_when_another_insert_splits_it(tmp_path):
    """A request holds node N; another insert splits N; evictions run. N's halves are still
    the request's matched prefix: they stay until it releases, and its insert of what
    follows attaches under them."""
    rng = np.random.default_rng(4)
    p = rng.integers(0, 1 << 20, 4 * C).astype(np.int32)
    longer = np.concatenate([p, rng.integers(0, 1 << 20, 2 * C)]).astype(np.int32)
    q = np.concatenate([p[:C], rng.integers(0, 1 << 20, 2 * C)]).astype(np.int32)
    with PrefixStore(tmp_path / "s", SHAPE, store_config("fp16")) as store:
        store.insert(p, 0, kv_from_bits(expected_bits(p)))
        a = store.match_prefix(longer)
        assert a.length == 4 * C
        b = store.match_prefix(q)
        store.insert(q, b.length, kv_from_bits(expected_bits(q), b.length))
        store.release(b)
        assert store.inspect().state.metrics.splits == 1
        while store.inspect().removal.evict_leaf() is not None:     # q's own node only
            pass
        try:
            path = store.insert(longer, a.length, kv_from_bits(expected_bits(longer), a.length))
        finally:
            store.release(a)
        assert sum(n.n_tokens for n in path) == len(longer)
        assert all(check_node(store, n) is None for n in path)
        assert store.inspect().removal.evict_leaf() is not None     # released: evictable again


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tier", ["gpu", "cpu"])
def test_late_admit_after_a_split_never_serves_old_kv(tmp_path, tier):
    """The interleaving that served wrong KV: A starts a tier load of node N, B's insert
    splits N, A's read lands (its admit must be refused), N's halves are evicted and a new
    prefix is stored (under new ids): loads of it return its own KV from every tier."""
    cache = host_tiers(64 if tier == "gpu" else 0, 64 if tier == "cpu" else 0)
    store = PrefixStore(tmp_path / "s", SHAPE, store_config("fp16"), memory=cache)
    rng = np.random.default_rng(3)
    p = rng.integers(0, 1 << 20, 4 * C).astype(np.int32)
    q = np.concatenate([p[:2 * C], rng.integers(0, 1 << 20, 2 * C)]).astype(np.int32)
    r = rng.integers(0, 1 << 20, 4 * C).astype(np.int32)
    ids = list(range(4))
    try:
        (n,) = store.insert(p, 0, kv_from_bits(expected_bits(p)))
        a = store.match_prefix(p)
        entry = store.entry(n, 1)
        pending = store.tiers.submit(ChunkLoad(entry, {"k": ids, "v": ids}, node=n))

        b = store.match_prefix(q)
        assert b.length == 2 * C
        store.insert(q, b.length, kv_from_bits(expected_bits(q), b.length))
        store.release(b)
        assert not n.live and store.inspect().state.metrics.splits == 1
        seen_ids = {n.id} | set(store.inspect().state.tree.nodes)

        chunks, served = store.tiers.wait(pending)
        # The old file is still there for A (it holds N): the bytes are P's.
        assert chunk_mismatches(entry, node_bits(p, n), chunks, ids) == 0, "old file misread"
        assert served["disk_chunks"] == 8
        assert not [k for k in cache.resident_keys(tier) if k[0] == n.id], \
            "a read finishing after the split re-admitted the split node's chunks"
        store.release(a)

        while store.inspect().removal.evict_leaf() is not None:
            pass
        assert len(store.inspect().state.tree) == 0
        path = store.insert(r, 0, kv_from_bits(expected_bits(r)))
        assert not {m.id for m in path} & seen_ids, "a node id was handed out again"
        (node,) = path
        want = node_bits(r, node)
        for attempt in ("disk", tier):
            match = store.match_prefix(r)
            try:
                e = store.entry(node, 1)
                got, served = load_chunks(store, e, {"k": ids, "v": ids}, node)
            finally:
                store.release(match)
            wrong = chunk_mismatches(e, want, got, ids)
            assert wrong == 0, f"{wrong} wrong chunks served ({served})"
            assert served[attempt] > 0, (attempt, served)
    finally:
        store.close()


# ---------------------------------------------------------------------------------------
# 2-3. Engines serving from several threads, bit for bit against one request alone

MODELS = ("opt-tiny", "llama-tiny")
ENGINE_C = 16                               # the engine stores' chunk size
ENGINE_TIERS = TierConfig(gpu_bytes=16 << 10, cpu_bytes=48 << 10)   # small: tiers evict


@pytest.fixture(scope="module")
def runtime_pairs(tmp_path_factory):
    """Two runtimes of each tiny model (same seed: the same weights), closed after the
    module (FlexGen's disk threads would keep the process alive)."""
    off = tmp_path_factory.mktemp("off")
    made: list[Runtime] = []
    try:
        for model in MODELS:
            for _ in range(2):
                made.append(Runtime(RuntimeConfig(model=model, offload_dir=str(off))))
        yield {model: tuple(made[2 * i:2 * i + 2]) for i, model in enumerate(MODELS)}
    finally:
        for rt in made:
            rt.close()


def serving_config(policy: str) -> ServingConfig:
    return ServingConfig(retention=0.25 if policy == "impress" else 1.0)


def engine_store(directory, rt, policy: str):
    cfg = serving_config(policy)
    pol = make_policy(policy, cfg)
    # No reorder: it changes the physical order of tokens and with it the order of the
    # floating-point sums (the store-level test above covers reorders).
    store = open_store(directory, rt, cfg, pol, chunk_size=ENGINE_C, reorder_interval=0)
    return store, pol


def engine_workload(seed: int):
    """3 base prefixes of different lengths sharing leading chunks (so warming them up
    splits), and 12 requests over them: the base itself (twice, once with masked leading
    pads), the base extended by new tokens (an insert below it) and the base cut inside its
    last node and continued (an insert that splits it). Every request's new tokens are its
    own, so what a request matches is the stored bases alone, whatever runs beside it."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(10, 40000, n).tolist()

    c = ENGINE_C
    stem = ids(3 * c)
    bases = [stem + ids(2 * c + 5), stem[:2 * c] + ids(4 * c + 9), stem + ids(5 * c + 3)]
    cut = [4 * c, 4 * c, 6 * c]          # inside each base's last node once all are stored
    requests = []
    for base, at in zip(bases, cut):
        requests += [Request(base, ids(int(rng.integers(8, 17))), 4, keep_logits=True),
                     Request(base, ids(int(rng.integers(8, 17))), 4, n_pad=4,
                             keep_logits=True),
                     Request(base + ids(c + 7), ids(int(rng.integers(8, 17))), 4,
                             keep_logits=True),
                     Request(base[:at] + ids(2 * c + 3), ids(int(rng.integers(8, 17))), 4,
                             keep_logits=True)]
    return bases, requests


class Prepared:
    """A store with the bases warmed up (kept as a template to copy) and every request's
    reference answer: served alone, on its own copy of that store."""

    def __init__(self, root: Path, rt: Runtime, policy: str):
        self.root, self.policy = root, policy
        self.bases, self.requests = engine_workload(21)
        self.template = root / "warm"
        store, pol = engine_store(self.template, rt, policy)
        try:
            engine = assemble(rt, pol, store, ENGINE_TIERS).engine
            for i, base in enumerate(self.bases):
                engine.serve(Request(base, [11 + i, 12 + i, 13 + i], 1))
            assert store.inspect().state.metrics.splits == 2
        finally:
            store.close()
        self.refs = [self.serve_alone(rt, i) for i in range(len(self.requests))]
        assert all(r.stats.matched_tokens > 0 for r in self.refs)     # warm requests

    def copy(self, name: str) -> Path:
        dest = self.root / name
        shutil.copytree(self.template, dest)
        return dest

    def serve_alone(self, rt: Runtime, i: int):
        store, pol = engine_store(self.copy(f"ref-{i}"), rt, self.policy)
        try:
            return assemble(rt, pol, store, ENGINE_TIERS).engine.serve(self.requests[i])
        finally:
            store.close()


@pytest.fixture(scope="module")
def prepared(runtime_pairs, tmp_path_factory):
    made: dict = {}

    def get(model: str, policy: str) -> Prepared:
        if (model, policy) not in made:
            root = tmp_path_factory.mktemp(f"{model}-{policy}")
            made[model, policy] = Prepared(root, runtime_pairs[model][0], policy)
        return made[model, policy]
    return get


def serve_from_threads(engines, requests, order, threads_per_engine: int):
    """Serve requests[order...] from `threads_per_engine` threads per engine, pulling from
    one queue; {index: response}, and the errors."""
    todo: queue.Queue = queue.Queue()
    for i in order:
        todo.put(i)
    got, errors, lock = {}, [], threading.Lock()
    start = threading.Barrier(len(engines) * threads_per_engine)

    def run(engine):
        start.wait()
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                resp = engine.serve(requests[i])
            except Exception as exc:  # noqa: BLE001 - reported by the test
                with lock:
                    errors.append(f"request {i}: {type(exc).__name__}: {exc}")
                continue
            with lock:
                got[i] = resp

    threads = [threading.Thread(target=run, args=(e,)) for e in engines
               for _ in range(threads_per_engine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got, errors


def assert_same_answers(got: dict, refs: list) -> None:
    assert sorted(got) == list(range(len(refs)))
    for i, ref in enumerate(refs):
        resp = got[i]
        assert resp.stats.matched_tokens == ref.stats.matched_tokens, i
        assert resp.tokens == ref.tokens, i
        assert len(resp.step_logits) == len(ref.step_logits)
        for step, (a, b) in enumerate(zip(resp.step_logits, ref.step_logits)):
            assert torch.equal(a, b), f"request {i} step {step}: max diff {(a - b).abs().max()}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["full", "impress"])
@pytest.mark.parametrize("model", MODELS)
def test_two_engines_on_one_store_answer_as_one_request_alone(runtime_pairs, prepared, model,
                                                             policy):
    prep = prepared(model, policy)
    rt1, rt2 = runtime_pairs[model]
    store, pol1 = engine_store(prep.copy("together"), rt1, policy)
    try:
        first = assemble(rt1, pol1, store, ENGINE_TIERS).engine
        second = assemble(rt2, make_policy(policy, serving_config(policy)), store, cache=store.tiers.cache).engine
        assert second.store.tiers.cache is first.store.tiers.cache
        order = np.random.default_rng(7).permutation(len(prep.requests)).tolist()
        got, errors = serve_from_threads([first, second], prep.requests, order, 3)
        m = store.inspect().state.metrics
        tiers = store.tiers.cache.metrics
    finally:
        store.close()
    assert errors == []
    assert_same_answers(got, prep.refs)
    assert m.inserts == 6 and m.splits == 3, m      # 3 extensions, 3 cuts (and their splits)
    assert tiers["gpu"]["hits"] + tiers["cpu"]["hits"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", MODELS)
def test_one_engine_from_several_threads_answers_as_serial_calls(runtime_pairs, prepared,
                                                                 model):
    prep = prepared(model, "impress")
    rt = runtime_pairs[model][0]
    order = np.random.default_rng(8).permutation(len(prep.requests)).tolist()
    answers = {}
    for how in ("serial", "threads"):
        store, pol = engine_store(prep.copy(how), rt, "impress")
        try:
            engine = assemble(rt, pol, store, ENGINE_TIERS).engine
            if how == "serial":
                got = {i: engine.serve(prep.requests[i]) for i in order}
            else:
                got, errors = serve_from_threads([engine], prep.requests, order, 4)
                assert errors == []
        finally:
            store.close()
        answers[how] = got
    serial = [answers["serial"][i] for i in range(len(prep.requests))]
    assert_same_answers(answers["threads"], serial)
    assert_same_answers(answers["serial"], prep.refs)
