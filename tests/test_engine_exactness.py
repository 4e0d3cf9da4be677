"""The engine keeps exact and approximate KV apart: KV computed while attending to a
selection of a stored prefix is stored flagged, never read by an exact policy and never
shared; requests of different namespaces never share stored prefixes."""
from __future__ import annotations

import torch

from impress_flexgen.engine import Request, assemble, open_store
from impress_flexgen.tiers import TierConfig
from policies import ServingConfig, make_policy
from tests.helpers.ids import prompt_ids as _ids


class _Pool:
    """A shared pool that holds nothing and records what it is asked."""

    class tier:      # noqa: N801 - what Engine.close() calls
        @staticmethod
        def close():
            pass

    def __init__(self):
        self.opened, self.published = [], []

    def open(self, prefix, matched, stats, tenant=""):
        self.opened.append(tenant)
        return None

    def publish(self, prefix, start, kv, tenant=""):
        self.published.append((start, tenant))
        return 0


def test_a_full_policy_never_reads_kv_computed_over_a_selection(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    p, q, query = _ids(1, 64), _ids(2, 64), _ids(3, 5)
    cfg = ServingConfig(retention=0.25)
    impress, full = make_policy("impress", cfg), make_policy("full", cfg)
    assert full.exact_reads and not impress.exact_reads
    store = open_store(tmp_path / "s", rt, cfg, impress, chunk_size=16)
    try:
        sparse = assemble(rt, impress, store, TierConfig()).engine
        dense = assemble(rt, full, store, TierConfig(), cache=store.tiers.cache).engine
        assert sparse.serve(Request(p, query, 1)).stats.exact          # nothing to select
        r2 = sparse.serve(Request(p + q, query, 1))
        assert r2.stats.matched_tokens == 64 and not r2.stats.exact
        assert [n.exact for n in store.inspect().state.tree.path_to(
            store.inspect().state.tree.match_prefix(p + q).nodes[-1])] == [True, False]
        r3 = dense.serve(Request(p + q, query, 3, keep_logits=True))
        assert r3.stats.matched_tokens == 64 and r3.stats.exact       # stopped before it
        assert store.inspect().state.metrics.superseded == 1                          # and replaced it
        assert all(n.exact for n in store.inspect().state.tree.nodes.values())
        assert dense.serve(Request(p + q, query, 1)).stats.matched_tokens == 128
    finally:
        store.close()
    # The same requests on a store that never saw approximate KV.
    clean = open_store(tmp_path / "clean", rt, cfg, full, chunk_size=16)
    try:
        engine = assemble(rt, full, clean, TierConfig()).engine
        engine.serve(Request(p, query, 1))
        ref = engine.serve(Request(p + q, query, 3, keep_logits=True))
    finally:
        clean.close()
    assert r3.tokens == ref.tokens
    assert torch.equal(r3.step_logits[0], ref.step_logits[0])


def test_only_exact_kv_is_published_to_the_shared_pool(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    p, q, query = _ids(4, 64), _ids(5, 64), _ids(6, 5)
    cfg = ServingConfig(retention=0.25)
    impress = make_policy("impress", cfg)
    store = open_store(tmp_path / "s", rt, cfg, impress, chunk_size=16)
    try:
        engine = assemble(rt, impress, store, TierConfig()).engine
        engine.shared = engine.prefix.shared = pool = _Pool()
        assert engine.serve(Request(p, query, 1, namespace="tenant-1")).stats.exact
        assert pool.published == [(0, "tenant-1")] and pool.opened == ["tenant-1"]
        r = engine.serve(Request(p + q, query, 1, namespace="tenant-1"))
        assert not r.stats.exact and r.stats.matched_tokens == 64
        assert pool.published == [(0, "tenant-1")]                  # nothing more
    finally:
        store.close()


def test_namespaces_never_share_stored_prefixes(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    p, query = _ids(7, 64), _ids(8, 5)
    cfg = ServingConfig(retention=1.0)
    full = make_policy("full", cfg)
    store = open_store(tmp_path / "s", rt, cfg, full, chunk_size=16)
    try:
        engine = assemble(rt, full, store, TierConfig()).engine
        first = engine.serve(Request(p, query, 2, namespace="alice"))
        assert engine.serve(Request(p, query, 2, namespace="alice")).stats.matched_tokens == 64
        other = engine.serve(Request(p, query, 2, namespace="bob"))
        assert other.stats.matched_tokens == 0 and other.tokens == first.tokens
        assert engine.serve(Request(p, query, 2)).stats.matched_tokens == 0
    finally:
        store.close()
