"""Exact means bit-identical: an exact policy's answer (tokens and log-probabilities) is the
same whether its prefix was stored or recomputed. The store keeps KV in the compute dtype by
default; a smaller format (`--kv-format`) is inexact and never served to an exact reader."""
from __future__ import annotations

import sqlite3

import numpy as np
import pytest
import torch

from disk_layout.format import kv_format_of
from impress_flexgen.engine import Request, assemble, model_shape, open_store
from impress_flexgen.errors import UserError
from impress_flexgen.models import default_dtype
from impress_flexgen.store import ModelShape, PrefixStore, StoreConfig
from impress_flexgen.tiers import TierConfig
from policies import ServingConfig, make_policy
from tests.helpers.ids import prompt_ids as _ids

# The default store format (the compute dtype: fp32 on a CPU, fp16 with CUDA) and one that
# loses bits under it.
COMPUTE = kv_format_of(default_dtype("llama"))
LOSSY = "fp16" if COMPUTE == "fp32" else "bf16"


def _same(a, b) -> bool:
    """Identical first-token logits of every query position and identical step logits."""
    pairs = [(a.query_logits, b.query_logits), *zip(a.step_logits, b.step_logits)]
    return a.tokens == b.tokens and all(torch.equal(x, y) for x, y in pairs)


def _engine(rt, path, policy="full", plan="load", kv_format=None):
    cfg = ServingConfig(plan=plan)
    pol = make_policy(policy, cfg)
    fmt = {} if kv_format is None else {"kv_format": kv_format}
    store = open_store(path, rt, cfg, pol, chunk_size=16, **fmt) if pol.reuse else None
    return assemble(rt, pol, store, TierConfig()).engine, store


def _request(prefix, query=None):
    return Request(prefix, query or _ids(2, 9), 3, forced=_ids(3, 2))


@pytest.mark.parametrize("model", ["llama-tiny", "opt-tiny"])
def test_stored_and_recomputed_answers_have_identical_logprobs(tiny_runtimes, tmp_path, model):
    rt = tiny_runtimes[model]
    prefix = _ids(1, 200)
    engine, store = _engine(rt, tmp_path / "s")
    try:
        cold = engine.serve(_request(prefix), query_logits=True)
        warm = engine.serve(_request(prefix), query_logits=True)
        assert cold.stats.matched_tokens == 0 and warm.stats.matched_tokens == 192
        assert warm.stats.exact and _same(cold, warm)
        assert store.shape.kv_exact and store.shape.kv_format == COMPUTE
        # Another query over the stored prefix: the answer it gets from a fresh store.
        other = engine.serve(_request(prefix, _ids(4, 7)), query_logits=True)
        assert other.stats.matched_tokens == 192
    finally:
        engine.close()
        store.close()
    fresh, fresh_store = _engine(rt, tmp_path / "fresh")
    try:
        assert _same(other, fresh.serve(_request(prefix, _ids(4, 7)), query_logits=True))
    finally:
        fresh.close()
        fresh_store.close()


@pytest.mark.slow
def test_an_exact_answer_does_not_depend_on_how_its_prefix_was_stored(tiny_runtimes, tmp_path):
    """A prefix stored in two parts (a conversation's turns), recomputed in front of the
    load (plans recompute and both), or never stored (recomp): the same answer."""
    rt = tiny_runtimes["llama-tiny"]
    long = _ids(5, 300)
    ref_engine, ref_store = _engine(rt, tmp_path / "ref")
    ref = ref_engine.serve(_request(long), query_logits=True)
    ref_store.close()
    turns, turns_store = _engine(rt, tmp_path / "turns")
    turns.serve(_request(long[:150]), query_logits=True)
    second = turns.serve(_request(long), query_logits=True)
    turns_store.close()
    assert second.stats.matched_tokens == 144 and _same(ref, second)
    for plan in ("recompute", "both"):
        engine, store = _engine(rt, tmp_path / plan, plan=plan)
        engine.serve(_request(long), query_logits=True)
        again = engine.serve(_request(long), query_logits=True)
        store.close()
        assert again.stats.plan == plan and _same(ref, again), plan
    recomp, _ = _engine(rt, tmp_path / "none", policy="recomp")
    assert _same(ref, recomp.serve(_request(long), query_logits=True))


def test_a_batch_gets_the_same_answers_from_stored_and_recomputed_prefixes(tiny_runtimes,
                                                                           tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    engine, store = _engine(rt, tmp_path / "s")

    def batch():
        seqs = [engine.add_request(_request(_ids(6, 230)), query_logits=True),
                engine.add_request(_request(_ids(7, 180)), query_logits=True)]
        while not all(seq.finished for seq in seqs):
            engine.step()
        return [seq.result() for seq in seqs]

    try:
        cold, warm = batch(), batch()
    finally:
        store.close()
    assert [r.stats.matched_tokens for r in warm] == [224, 176]
    assert all(_same(a, b) for a, b in zip(cold, warm))


def test_a_smaller_kv_format_is_inexact_and_never_served_to_an_exact_reader(tiny_runtimes,
                                                                          tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    prefix = _ids(8, 128)
    full, store = _engine(rt, tmp_path / "full16", kv_format=LOSSY)
    try:
        assert store.shape.kv_format == LOSSY and not store.shape.kv_exact
        first = full.serve(_request(prefix), query_logits=True)
        again = full.serve(_request(prefix), query_logits=True)
        assert again.stats.matched_tokens == 0 and _same(first, again)   # recomputed
        assert not any(n.exact for n in store.inspect().state.tree.nodes.values())
    finally:
        store.close()
    impress, store = _engine(rt, tmp_path / "impress16", policy="impress", kv_format=LOSSY)
    try:
        impress.serve(_request(prefix))
        read = impress.serve(_request(prefix))
        assert read.stats.matched_tokens == 128 and not read.stats.exact
        # Stored and read in 2-byte values.
        assert read.stats.prefix_bytes == 128 * 2 * 2 * 16 * 2 * 2
    finally:
        store.close()


def test_the_default_format_is_the_compute_dtype_and_is_part_of_the_identity():
    from impress_flexgen.models import resolve

    fp32 = resolve("llama-tiny", seed=0, dtype=np.float32)
    fp16 = resolve("llama-tiny", seed=0, dtype=np.float16)
    assert (model_shape(fp32).kv_format, model_shape(fp16).kv_format) == ("fp32", "fp16")
    assert model_shape(fp32).kv_exact and model_shape(fp16).kv_exact
    assert model_shape(fp16, kv_format="fp32").kv_exact      # fp32 holds fp16 values
    assert not model_shape(fp32, kv_format="bf16").kv_exact
    prints = {model_shape(fp32, kv_format=f).fingerprint for f in ("fp32", "fp16", "bf16")}
    assert len(prints) == 3
    with pytest.raises(UserError, match="unknown KV format"):
        model_shape(fp32, kv_format="int3")


def _old_fp16_store(path):
    """A store as made before stores recorded their KV format (fp16, no meta key)."""
    PrefixStore(path, ModelShape("m", 2, 2, 16, "a" * 64), StoreConfig(direct_io=False)).close()
    db = sqlite3.connect(path / "store.sqlite")
    db.execute("DELETE FROM meta WHERE key = 'kv_format'")
    db.commit()
    db.close()


def test_a_store_of_another_kv_format_is_refused_in_one_line(tmp_path):
    _old_fp16_store(tmp_path / "s")
    fp32 = ModelShape("m", 2, 2, 16, "a" * 64, kv_format="fp32")
    with pytest.raises(UserError, match="holds fp16 KV, not fp32; open it with --kv-format "
                                        "fp16") as err:
        PrefixStore(tmp_path / "s", fp32, StoreConfig(direct_io=False))
    assert "\n" not in str(err.value)
    # Opened in its own format it is reused (inexact for a compute dtype it does not hold).
    fp16 = ModelShape("m", 2, 2, 16, "a" * 64, kv_format="fp16", kv_exact=False)
    PrefixStore(tmp_path / "s", fp16, StoreConfig(direct_io=False)).close()


def test_stored_chunks_keep_the_format_and_read_back_bit_exact(tmp_path):
    kv = torch.randn(2, 2, 32, 16, generator=torch.Generator().manual_seed(0))
    tokens = _ids(9, 32)
    for fmt, dtype in (("fp32", torch.float32), ("fp16", torch.float16),
                       ("bf16", torch.bfloat16)):
        shape = ModelShape("m", 1, 2, 16, "a" * 64, kv_format=fmt)
        with PrefixStore(tmp_path / fmt, shape, StoreConfig(direct_io=False)) as store:
            store.insert(tokens, 0, [(kv[0], kv[1])])
            entry = store.inspect().state.tree.match_prefix(tokens).nodes[0].layers[0]
            assert entry.layout.chunk_bytes == 2 * 16 * 16 * dtype.itemsize
            k, v = store.inspect().reads.read_layer(entry)
            assert k.dtype == dtype and torch.equal(k, kv[0].to(dtype))
            assert torch.equal(v, kv[1].to(dtype))
            assert store.inspect().accounting.kv_bytes() == 2 * 32 * 2 * 16 * dtype.itemsize


@pytest.mark.slow
def test_smollm2_stored_and_recomputed_answers_have_identical_logprobs(tmp_path):
    """Real widths, where a product's rounding depends on its row count: a prefix stored
    whole or in two parts, and recomputed, give one answer to the last bit."""
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    with Runtime(RuntimeConfig(model="smollm2-135m", offload_dir=str(tmp_path / "off"))) as rt:
        long = _ids(10, 300)
        engine, store = _engine(rt, tmp_path / "s")
        try:
            engine.serve(_request(long[:150]), query_logits=True)     # the first turn
            cold = engine.serve(_request(long), query_logits=True)   # computes 144..288
            warm = engine.serve(_request(long), query_logits=True)
        finally:
            store.close()
        recomp, _ = _engine(rt, tmp_path / "none", policy="recomp")
        ref = recomp.serve(_request(long), query_logits=True)
    assert (cold.stats.matched_tokens, warm.stats.matched_tokens) == (144, 288)
    assert _same(ref, cold) and _same(ref, warm)


def test_canonical_rows_come_out_the_same_however_a_prompt_was_split():
    """Rows computed by tiles: the same bits whichever rows were already there, for a
    product at real widths and for attention."""
    from impress_flexgen.engine.attention import TILE, attend_lane, plan_rows
    from impress_flexgen.engine.attention import attend

    gen = torch.Generator().manual_seed(0)
    n, kv, heads, d = 300, 3, 9, 64
    x = torch.randn(1, n, 1536, generator=gen)
    w = torch.randn(576, 1536, generator=gen)
    q = torch.randn(1, heads, n, d, generator=gen)
    keys, values = torch.randn(kv, n, d, generator=gen), torch.randn(kv, n, d, generator=gen)
    mask = torch.ones(kv, n, dtype=torch.bool)

    def att(*args):
        return attend(*args, group=heads // kv, device=torch.device("cpu"))

    def rows_from(start: int):
        """Rows start..n computed as a request whose first `start` positions are stored."""
        positions = torch.arange(start, n)
        groups, (lane,) = plan_rows([(0, positions, 288)], n - start, torch.device("cpu"))
        assert lane.n_block == 12 and all(len(g.positions[0]) == TILE for g in groups[:-1])
        out = torch.empty(1, n - start, 576)
        for g in groups:
            g.scatter(out, torch.nn.functional.linear(g.gather(x[:, start:], 1), w), 1)
        return out, attend_lane(att, q[:, :, start:], keys, values, mask, lane)

    whole_x, whole_a = rows_from(0)
    for start in (16, 144, 272, 288):
        part_x, part_a = rows_from(start)
        assert torch.equal(part_x, whole_x[:, start:]) and torch.equal(part_a,
                                                                      whole_a[:, :, start:])
    plain = att(q, keys, values, mask, n)
    assert torch.allclose(whole_a, plain, atol=1e-5)


def test_a_passs_attention_calls_of_one_shape_go_together_each_as_alone(monkeypatch):
    """The canonical attention calls of several requests (tiles and blocks) made as batched
    calls, shape by shape: each request's rows are the bits it gets alone, whatever the
    others' shapes, with or without a per-head mask, with grouped heads."""
    from impress_flexgen.engine import attention
    from impress_flexgen.engine.attention import LaneCalls, attend, attend_lane, plan_rows

    gen = torch.Generator().manual_seed(1)
    kv, heads, d = 2, 6, 16
    cpu = torch.device("cpu")

    def att(*args):
        return attend(*args, group=heads // kv, device=cpu)

    lanes = []
    # (prompt length, rows already there, tiled end, a head that sees fewer keys)
    for n, start, end, narrow in ((300, 0, 288, False), (300, 16, 288, False),
                                  (150, 0, 144, False), (300, 0, 288, True), (40, 0, 0, False)):
        q = torch.randn(1, heads, n - start, d, generator=gen)
        keys, values = torch.randn(kv, n, d, generator=gen), torch.randn(kv, n, d, generator=gen)
        mask = torch.ones(kv, n, dtype=torch.bool)
        if narrow:
            mask[1, 5:9] = False
        _, (rows,) = plan_rows([(0, torch.arange(start, n), end)], n - start, cpu)
        rows = rows or attention.LaneRows([], n - start)
        lanes.append((q, keys, values, mask, rows))
    alone = [attend_lane(att, *lane) for lane in lanes]
    made = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: made.append(q.shape[0]) or real(q, *a, **kw))
    calls = LaneCalls(att)
    outs = [calls.add(*lane) for lane in lanes]
    calls.run()
    for a, b in zip(alone, outs):
        assert torch.equal(a, b)
    # Tiles of 64 positions ending at 64, 128 and 192 (shared mask: 3 requests), at 256 and
    # 320 (2), the per-head mask's 5 tiles (1 each); the blocks of 12 rows over 300 keys
    # (2 + 1), of 6 over 150, of 40 over 40.
    assert sorted(made) == [1] * 8 + [2] * 3 + [3] * 3


def test_a_groups_rows_copied_by_stretches_are_its_rows_by_index():
    """A canonical group whose rows lie in a few stretches of the pass (requests' tiled rows
    between their query rows) gathers and scatters them stretch by stretch: the values the
    index gives, padding zero."""
    from impress_flexgen.engine.attention import RowGroup, plan_rows

    cpu = torch.device("cpu")
    lanes, lo = [], 0
    for n in (136, 300, 70, 136):            # tiled up to the last 64-multiple, then a block
        lanes.append((lo, torch.arange(n), n - n % 64 or 64))
        lo += n
    groups, _ = plan_rows(lanes, lo, cpu)
    assert any(g.runs is not None and len(g.runs) > 1 for g in groups)
    gen = torch.Generator().manual_seed(2)
    for dim, shape in ((1, (1, lo, 8)), (2, (1, 3, lo, 4))):
        x = torch.randn(*shape, generator=gen)
        for g in groups:
            by_index = RowGroup(g.index, g.positions)
            assert torch.equal(g.gather(x, dim), by_index.gather(x, dim))
            y = torch.randn(*g.gather(x, dim).shape, generator=gen)
            assert torch.equal(g.scatter(x.clone(), y, dim), by_index.scatter(x.clone(), y, dim))


def test_the_kv_format_flag_reaches_the_store_and_warns_an_exact_server(tiny_runtimes,
                                                                       tmp_path):
    from impress_flexgen.config import ServiceConfig
    from impress_flexgen.entrypoints.openai import server as serve
    from impress_flexgen.service import Service

    def service(*flags):
        args = serve.parse_args(["--model", "llama-tiny", "--plan", "load", "--store-dir",
                                 str(tmp_path / "stores"), *flags])
        return Service(ServiceConfig.from_args(args), runtime=tiny_runtimes["llama-tiny"])

    named = {"fp16": "full-c16-int4-v2",                 # the name fp16 stores had
             "fp32": "full-c16-int4-kvfp32-v2", "bf16": "full-c16-int4-kvbf16-v2"}
    with service() as exact:                          # the default: the compute dtype
        assert exact.store.shape.kv_format == COMPUTE and exact.warnings == []
        assert exact.store_dir.name == named[COMPUTE]
    with service("--kv-format", LOSSY) as lossy:
        assert lossy.store.shape.kv_format == LOSSY and not lossy.store.shape.kv_exact
        assert lossy.store_dir.name == named[LOSSY]
        assert any("recomputed" in w and "--kv-format" in w for w in lossy.warnings)
    with pytest.raises(SystemExit) as refused:
        serve.parse_args(["--kv-format", "int3"])
    assert refused.value.code == 2


@pytest.mark.slow
def test_the_stored_vs_computed_harness_passes_quick():
    from experiments.abuse_exact import stored_vs_computed_logprobs

    result = stored_vs_computed_logprobs(quick=True)
    assert result["passed"] and result["max_abs_diff"] == 0.0, result
    assert set(result["cases"]) == {"same_prompt", "other_query", "grown_prefix", "batch",
                                    "lossy_format"}
    assert result["cases"]["lossy_format"]["matched_tokens"] == 0


@pytest.mark.slow
def test_bench_exact_quick_times_both_ways_and_sizes_every_format(tmp_path):
    from experiments.bench_exact import main

    assert main(["--quick", "--json", str(tmp_path / "r.json")]) == 0
    r = __import__("json").loads((tmp_path / "r.json").read_text())
    assert r["one_call_s"] > 0 and r["tiles_s"] > 0 and r["logits_max_abs_diff"] < 1e-4
    assert r["kv_bytes_per_token"]["fp32"] == 2 * r["kv_bytes_per_token"]["fp16"]
    assert r["kv_exact"]["fp32"] and r["kv_exact"][r["compute_kv_format"]]
    assert not r["kv_exact"]["bf16"]
