"""A block of requests that share a stored prefix loads it once: within one prefill pass,
a chunk several sequences need is read through the store once and handed to each, while
every answer stays the one it is without sharing (bit for bit) and as served alone.

Reads are counted where the store reads its files (DiskReads.start_chunks and the store's
own counters), not in the code under test.
"""
from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from impress_flexgen.engine import Request, SchedulerConfig, assemble, open_store
from impress_flexgen.store.reads import DiskReads
from impress_flexgen.tiers import TierConfig
from policies import ServingConfig, make_policy
from tests.helpers.ids import prompt_ids

CHUNK = 16


@contextlib.contextmanager
def engine_on(rt, path, name, retention=1.0, tiers=TierConfig()):
    cfg = ServingConfig(retention=retention)
    policy = make_policy(name, cfg)
    store = open_store(path, rt, cfg, policy, chunk_size=CHUNK)
    try:
        engine = assemble(rt, policy, store, tiers).engine
        yield engine, store
        engine.close()
    finally:
        store.close()


@contextlib.contextmanager
def disk_reads(monkeypatch):
    """Every chunk the store reads from its files: Counter of (node, layer, version, kind,
    chunk)."""
    seen = collections.Counter()
    real = DiskReads.start_chunks

    def spy(self, entry, wanted, node=None):
        for kind, ids in wanted.items():
            seen.update((entry.node_id, entry.layer, entry.version, kind, int(i))
                        for i in ids)
        return real(self, entry, wanted, node)

    monkeypatch.setattr(DiskReads, "start_chunks", spy)
    yield seen
    monkeypatch.setattr(DiskReads, "start_chunks", real)


def block(prefix, n, new=2, seed=100):
    return [Request(prefix, prompt_ids(seed + i, 2 + i % 3), new, keep_logits=True)
            for i in range(n)]


def store_reads(store):
    m = store.inspect().state.metrics
    return m.chunks_read, m.bytes_read, m.corruptions


def serve_block(engine, reqs, share=True):
    engine.runner.share_reads = share
    try:
        return engine.serve_all(reqs, SchedulerConfig(max_batch_size=len(reqs)))
    finally:
        engine.runner.share_reads = True


def same_answers(a, b, exact=True):
    for x, y in zip(a, b):
        assert not isinstance(y, Exception), y
        assert y.tokens == x.tokens
        assert y.stats.matched_tokens == x.stats.matched_tokens
        for lx, ly in zip(x.step_logits, y.step_logits):
            if exact:
                assert torch.equal(lx, ly)
            else:
                torch.testing.assert_close(lx, ly, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["full", "as_like"])
def test_a_block_on_one_stored_prefix_reads_each_chunk_once(tiny_runtimes, tmp_path,
                                                            monkeypatch, name):
    rt = tiny_runtimes["llama-tiny"]
    stem = prompt_ids(1, 4 * CHUNK)
    reqs = block(stem, 8)
    with engine_on(rt, tmp_path / "s", name) as (engine, store):
        engine.serve(Request(stem, [5], 1))                  # the stored prefix
        before = store_reads(store)
        alone = [engine.serve(r) for r in reqs]
        one = (store_reads(store)[0] - before[0]) // len(reqs)   # chunks a request reads
        assert one == 2 * 2 * 4                               # K and V, 2 layers, 4 chunks
        before = store_reads(store)
        unshared = serve_block(engine, reqs, share=False)     # each sequence its own reads
        assert store_reads(store)[0] - before[0] == len(reqs) * one
        before = store_reads(store)
        with disk_reads(monkeypatch) as seen:
            shared = serve_block(engine, reqs)
        chunks, nbytes, _ = (a - b for a, b in zip(store_reads(store), before))
        assert chunks == one and set(seen.values()) == {1}    # every chunk read once
        # Exact policies: bit for bit the answers of the unshared block; as served alone.
        same_answers(unshared, shared)
        same_answers(alone, shared, exact=False)
        # The read counts once, for the request that made it; the rest were handed it.
        assert sum(r.stats.bytes_read["disk"] for r in shared) == nbytes
        assert sum(r.stats.chunks_read for r in shared) == chunks
        for got, own in zip(shared, alone):
            assert got.stats.chunks_loaded + got.stats.chunks_from_pass == \
                own.stats.chunks_loaded
        assert sum(r.stats.chunks_from_pass for r in shared) == (len(reqs) - 1) * one
        assert all(r.stats.bytes_from_pass > 0 for r in shared[1:])
        assert all(r.stats.matched_tokens == len(stem) for r in shared)


def test_per_request_selection_reads_the_union_once(tiny_runtimes, tmp_path, monkeypatch):
    """impress selects per query: the pass reads the union of the selections once, and
    each sequence attends its own selection (the same answers as without sharing)."""
    rt = tiny_runtimes["llama-tiny"]
    stem = prompt_ids(2, 8 * CHUNK)
    reqs = block(stem, 6, seed=300)
    got = {}
    for share in (False, True):
        with engine_on(rt, tmp_path / f"s{share}", "impress", 0.25) as (engine, store):
            engine.serve(Request(stem, [5], 1))
            with disk_reads(monkeypatch) as seen:
                got[share] = serve_block(engine, reqs, share), seen
    (plain, seen_plain), (shared, seen_shared) = got[False], got[True]
    same_answers(plain, shared)
    assert max(seen_plain.values()) > 1                  # without: read by several
    assert set(seen_shared.values()) == {1}              # with: each chunk once
    assert set(seen_shared) == set(seen_plain)           # the union of the selections
    assert [r.stats.jaccard for r in shared] == [r.stats.jaccard for r in plain]
    assert [r.stats.bytes_needed for r in shared] == [r.stats.bytes_needed for r in plain]
    assert sum(r.stats.chunks_from_pass for r in shared) > 0


def test_requests_on_different_prefixes_each_get_theirs(tiny_runtimes, tmp_path, monkeypatch):
    rt = tiny_runtimes["llama-tiny"]
    a, b = prompt_ids(3, 3 * CHUNK), prompt_ids(4, 2 * CHUNK)
    reqs = [*block(a, 3, seed=400), *block(b, 2, seed=500), *block(prompt_ids(5, CHUNK - 4), 1)]
    with engine_on(rt, tmp_path / "s", "full") as (engine, store):
        engine.serve(Request(a, [5], 1))
        engine.serve(Request(b, [5], 1))
        alone = [engine.serve(r) for r in reqs]
        unshared = serve_block(engine, reqs, share=False)
        with disk_reads(monkeypatch) as seen:
            shared = serve_block(engine, reqs)
    same_answers(unshared, shared)
    same_answers(alone, shared, exact=False)
    assert [r.stats.matched_tokens for r in shared] == [len(a)] * 3 + [len(b)] * 2 + [0]
    assert set(seen.values()) == {1}
    assert len(seen) == 2 * 2 * (3 + 2)                  # both prefixes, each once


def test_a_corrupt_chunk_in_the_shared_read_is_recomputed_for_each(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    stem = prompt_ids(6, 4 * CHUNK)
    reqs = block(stem, 6, new=3, seed=600)
    want = [rt.generate([r.prefix + r.query], 3).new_ids[0] for r in reqs]
    with engine_on(rt, tmp_path / "s", "full") as (engine, store):
        engine.serve(Request(stem, [5], 1))
        (node,) = store.inspect().state.tree.nodes.values()
        entry = store.entry(node, 1)
        with open(entry.path, "r+b") as f:
            f.seek(entry.layout.chunk_offset("k", 1) + 3)
            f.write(b"\xff\xff")
        got = serve_block(engine, reqs)
        # Found by the pass's one read of it, then by the first request served alone
        # again, which takes the node out of service; each then computes the prefix.
        assert store_reads(store)[2] == 2
        assert store.inspect().state.metrics.quarantined_nodes == 1
    assert got[0].stats.recovered_from_corruption == 1
    assert got[0].stats.computed_tokens == len(stem) + len(reqs[0].query)
    for r, tokens in zip(got, want):       # the rest load what the first stored again
        assert not isinstance(r, Exception), r
        assert r.tokens == tokens


def test_metrics_count_a_shared_read_once(tiny_runtimes, tmp_path):
    """A burst on one stored prefix through the service: kv_bytes_read grows by one
    request's read, and the others' chunks show in kv_bytes_from_pass."""
    from prometheus_client.parser import text_string_to_metric_families

    from impress_flexgen.config import RunConfig
    from impress_flexgen.service import Service, ServiceConfig

    def metrics(service):
        return {(s.name, s.labels.get("tier")): s.value for fam in text_string_to_metric_families(
            service.metrics_text().decode()) for s in fam.samples}

    def read(m):
        return sum(v for (name, _), v in m.items() if name == "impress_flexgen_kv_bytes_read_total")

    stem = prompt_ids(7, 4 * CHUNK)
    config = ServiceConfig(model="llama-tiny", store_root=tmp_path, max_batch_size=4,
                           batch_gather_s=0.5, run=RunConfig("full", "full", chunk_size=CHUNK))
    with Service(config, runtime=tiny_runtimes["llama-tiny"]) as service:
        service.complete(service.frontend.build(prompt_ids=stem + [7], max_tokens=1))
        before = metrics(service)
        one = service.complete(service.frontend.build(prompt_ids=stem + [8], max_tokens=1))
        alone = read(metrics(service)) - read(before)
        assert alone == sum(one.stats["bytes_read"].values()) > 0
        before = metrics(service)
        tickets = [service.submit(service.frontend.build(prompt_ids=stem + [9 + i],
                                                         max_tokens=1)) for i in range(4)]
        done = [t.future.result(timeout=300) for t in tickets]
        after = metrics(service)
    assert all(c.stats["matched_tokens"] == len(stem) for c in done)
    assert read(after) - read(before) == alone                  # read once for the four
    handed = after[("impress_flexgen_kv_bytes_from_pass_total", None)] - \
        before[("impress_flexgen_kv_bytes_from_pass_total", None)]
    assert handed == sum(c.stats["bytes_from_pass"] for c in done) > 0


@pytest.mark.slow
def test_the_block_experiment_compares_both_modes(tmp_path):
    import json

    from experiments import shared_prefix_block

    out = tmp_path / "spb.json"
    assert shared_prefix_block.main(["--model", "llama-tiny", "--rounds", "1", "--requests", "4",
                                     "--prefix-tokens", "64", "--json", str(out)]) == 0
    rows = {(r["policy"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(p, m) for p in ("full", "impress") for m in shared_prefix_block.MODES}
    assert all(r["same_answers_as_other_mode"] and r["direct_io"] for r in rows.values())
    full = rows[("full", "per_request")]["chunks_read"]
    assert rows[("full", "shared")]["chunks_read"] * 4 == full
    assert rows[("impress", "shared")]["chunks_read"] < rows[("impress", "per_request")][
        "chunks_read"]
