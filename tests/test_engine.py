"""The serving engine: reuse must equal generation without a store; selection must select."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from impress_flexgen.bench.texts import PROMPTS
from impress_flexgen.engine import Request, assemble, open_store
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.tiers import TierConfig
from policies import POLICY_NAMES, ServingConfig, make_policy
from tests.helpers.ids import prompt_ids as _ids

ROOT = Path(__file__).resolve().parents[1]
ALL_POLICIES = [p for p in POLICY_NAMES if p != "impress"] + ["impress:itf", "impress:itf_ro",
                                                                "impress:all"]


def _serve_twice(rt, policy_name, prefix, query, store_dir, new_tokens=5, retention=1.0,
                 **serving):
    cfg = ServingConfig(retention=retention, **serving)
    policy = make_policy(policy_name, cfg)
    store = open_store(store_dir, rt, cfg, policy, chunk_size=16)
    try:
        engine = assemble(rt, policy, store, TierConfig(64 << 10, 256 << 10)).engine
        cold = engine.serve(Request(prefix, query, new_tokens, keep_logits=True))
        warm = engine.serve(Request(prefix, query, new_tokens, keep_logits=True))
        return cold, warm, store
    finally:
        store.close()


@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_retention_one_equals_generation_without_store(tiny_runtimes, tmp_path, model, policy):
    rt = tiny_runtimes[model]
    prefix, query = _ids(1, 100), _ids(2, 9)
    ref = rt.generate([prefix + query], 5, record_logits=True)
    cold, warm, _ = _serve_twice(rt, policy, prefix, query, tmp_path / "s")
    assert cold.tokens == ref.new_ids[0] and warm.tokens == ref.new_ids[0]
    tol = 0.05 if model == "opt-tiny" else 1e-2  # fp16 compute / fp16 stored KV
    for resp in (cold, warm):
        diff = (torch.stack(resp.step_logits) - ref.logits[0]).abs().max()
        assert diff < tol, (policy, float(diff))
    if policy != "recomp":
        assert warm.stats.matched_tokens == 96  # whole 16-token chunks of the 100-token prefix
        assert warm.stats.computed_tokens == 4 + 9
        assert cold.stats.matched_tokens == 0


def test_partial_match_splits_and_positions_follow(tiny_runtimes, tmp_path):
    """A second prefix sharing the first chunks reuses them; positions continue after R."""
    rt = tiny_runtimes["llama-tiny"]
    a = _ids(3, 80)
    b = a[:40] + _ids(4, 50)  # shares two whole chunks (32 tokens) and then diverges
    query = _ids(5, 6)
    cfg = ServingConfig(retention=1.0)
    policy = make_policy("full", cfg)
    store = open_store(tmp_path / "s", rt, cfg, policy, chunk_size=16)
    try:
        engine = assemble(rt, policy, store).engine
        engine.serve(Request(a, query, 3))
        resp = engine.serve(Request(b, query, 3))
        assert resp.stats.matched_tokens == 32
        assert store.inspect().state.metrics.splits == 1
        assert resp.tokens == rt.generate([b + query], 3).new_ids[0]
        again = engine.serve(Request(b, query, 3))
        assert again.stats.matched_tokens == 80 and again.tokens == resp.tokens
    finally:
        store.close()


def test_selection_reads_less_and_feeds_the_store(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    prefix, query = _ids(6, 256), _ids(7, 16)
    full_cold, full, _ = _serve_twice(rt, "full", prefix, query, tmp_path / "f", retention=0.25)
    _, chunk, store = _serve_twice(rt, "impress", prefix, query, tmp_path / "c", retention=0.25,
                                   threshold="none")
    _, token, _ = _serve_twice(rt, "impress", prefix, query, tmp_path / "t", retention=0.25,
                               threshold="none", granularity="token")
    full_bytes = full.stats.kv_bytes_loaded
    assert full_bytes == full.stats.bytes_read["disk"] > 0
    # 25% of chunks (+ sink, recent). Bytes: llama-tiny's 1 KiB chunks are packed and read
    # as whole 4 KiB pages, so a selection saves chunks but not necessarily pages here.
    assert chunk.stats.chunks_loaded < 0.5 * full.stats.chunks_loaded
    assert chunk.stats.kv_bytes_loaded <= full_bytes
    assert token.stats.chunks_loaded > chunk.stats.chunks_loaded  # scattered tokens
    assert chunk.stats.probe_bytes > 0 and chunk.stats.layers_fallback == 0
    assert chunk.stats.bytes_needed < full.stats.bytes_needed
    assert full_cold.stats.matched_tokens == 0
    # The selection was recorded (and persisted): importance accumulated, chunk ratios set.
    cfg = ServingConfig(retention=0.25, threshold="none")
    reopened = open_store(tmp_path / "c", rt, cfg, make_policy("impress", cfg), chunk_size=16)
    try:
        stats = list(reopened.inspect().state.stats.values())
        assert all(s.importance.sum() > 0 for s in stats)
        assert all(0 < (s.ratio > 0).sum() < len(s.ratio) for s in stats)
    finally:
        reopened.close()


def test_fixed_threshold_can_fall_back(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    prefix, query = _ids(8, 256), _ids(9, 16)
    _, warm, _ = _serve_twice(rt, "impress", prefix, query, tmp_path / "s", retention=0.25,
                              threshold="fixed", threshold_value=1.01)
    assert warm.stats.layers_fallback == warm.stats.layers == 2
    full_cold, full, _ = _serve_twice(rt, "full", prefix, query, tmp_path / "f", retention=0.25)
    assert warm.stats.kv_bytes_loaded == full.stats.kv_bytes_loaded


def _serve_after_corrupting(rt, tmp_path, caplog, policy_name, cfg, prefix, query, layer,
                            offset, garbage):
    """Serve once (stores the prefix), overwrite `garbage` at `offset` of `layer`'s file,
    serve again and once more: (reference tokens, the corrupted serve, the third serve)."""
    ref = rt.generate([prefix + query], 3).new_ids[0]
    policy = make_policy(policy_name, cfg)
    store = open_store(tmp_path / "s", rt, cfg, policy, chunk_size=16)
    try:
        engine = assemble(rt, policy, store).engine
        engine.serve(Request(prefix, query, 3))
        (node,) = store.inspect().state.tree.nodes.values()
        entry = store.entry(node, layer)
        with open(entry.path, "r+b") as f:
            f.seek(offset(entry))
            f.write(garbage)
        with caplog.at_level("WARNING"):
            resp = engine.serve(Request(prefix, query, 3))
        healed = engine.serve(Request(prefix, query, 3))  # re-inserted by the recompute
        return ref, resp, healed
    finally:
        store.close()


def test_corrupt_chunk_is_recomputed_not_served(tiny_runtimes, tmp_path, caplog):
    rt = tiny_runtimes["llama-tiny"]
    ref, resp, healed = _serve_after_corrupting(
        rt, tmp_path, caplog, "full", ServingConfig(retention=1.0), _ids(10, 64), _ids(11, 5),
        layer=1, offset=lambda e: e.layout.chunk_offset("k", 1) + 3, garbage=b"\xff\xff")
    assert resp.tokens == ref
    assert resp.stats.recovered_from_corruption == 1 and resp.stats.matched_tokens == 0
    assert "quarantined" in caplog.text
    assert healed.stats.matched_tokens == 64 and healed.tokens == ref


def test_decode_over_full_prefix_is_an_option(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    prefix, query = _ids(12, 128), _ids(13, 8)
    _, kept, _ = _serve_twice(rt, "impress", prefix, query, tmp_path / "k", retention=0.25,
                              threshold="none", new_tokens=6)
    _, full, _ = _serve_twice(rt, "impress", prefix, query, tmp_path / "f", retention=0.25,
                              threshold="none", new_tokens=6, decode_over="full")
    assert kept.tokens[0] == full.tokens[0]  # the same sparse prefill
    assert torch.equal(kept.step_logits[0], full.step_logits[0])
    # From the second token on, the full prefix is attended again: closer to exact decoding.
    def error_of_second_step(resp):
        ref = rt.generate([prefix + query + resp.tokens[:1]], 1, record_logits=True)
        return (resp.step_logits[1] - ref.logits[0][0]).abs().max()

    assert error_of_second_step(full) < error_of_second_step(kept)


@pytest.mark.slow
def test_reuse_after_reopen_in_a_new_process(tmp_path):
    script = textwrap.dedent(f"""
        import sys, json
        sys.path.insert(0, {str(ROOT)!r})
        import numpy as np
        from impress_flexgen.models.runtime import Runtime, RuntimeConfig
        from impress_flexgen.engine import Request, assemble, open_store
        from policies import ServingConfig, make_policy
        ids = np.random.default_rng(14).integers(10, 40000, 120).tolist()
        with Runtime(RuntimeConfig(model="llama-tiny")) as rt:
            cfg = ServingConfig(retention=0.5, threshold="none")
            policy = make_policy("impress", cfg)
            store = open_store({str(tmp_path / 's')!r}, rt, cfg, policy, chunk_size=16)
            r = assemble(rt, policy, store).engine.serve(Request(ids[:100], ids[100:], 4))
            store.close()
        print(json.dumps({{"tokens": r.tokens, "matched": r.stats.matched_tokens}}))
    """)
    runs = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        runs.append(__import__("json").loads(out.stdout.strip().splitlines()[-1]))
    assert [r["matched"] for r in runs] == [0, 96, 96]
    assert runs[1]["tokens"] == runs[2]["tokens"]


@pytest.mark.slow
def test_smollm2_retention_one_matches_generation(tmp_path):
    """Real weights, natural text: every policy at r = 1 reproduces plain generation."""
    with Runtime(RuntimeConfig(model="smollm2-135m", offload_dir=str(tmp_path / "off"))) as rt:
        ids = rt.tokenizer.encode(" ".join(PROMPTS))
        prefix, query = ids[:128], rt.tokenizer.encode(" And so it was that")
        ref = rt.generate([prefix + query], 4).new_ids[0]
        for name in ALL_POLICIES:
            cold, warm, _ = _serve_twice(rt, name, prefix, query, tmp_path / name, new_tokens=4)
            assert cold.tokens == ref and warm.tokens == ref, name


@pytest.mark.parametrize("policy", ["full", "impress"])
def test_padded_prefix_equals_the_real_prefix_alone(tiny_runtimes, tmp_path, policy):
    """Masked left padding (the paper-faithful workload): with RoPE, a padded prefix gives
    the same logits as its real tokens alone, cold and warm, and selection never picks pads."""
    rt = tiny_runtimes["llama-tiny"]
    real, query, n_pad = _ids(3, 80), _ids(4, 7), 96
    ref = rt.generate([real + query], 4, record_logits=True)
    cfg = ServingConfig(retention=1.0 if policy == "full" else 0.5)
    pol = make_policy(policy, cfg)
    store = open_store(tmp_path / "s", rt, cfg, pol, chunk_size=16)
    try:
        engine = assemble(rt, pol, store, TierConfig()).engine
        padded = [0] * n_pad + real
        for _ in range(2):      # cold, then warm (pads and text both from the store)
            resp = engine.serve(Request(padded, query, 4, n_pad=n_pad, keep_logits=True))
            if policy == "full":
                assert resp.tokens == ref.new_ids[0]
                diff = (torch.stack(resp.step_logits) - ref.logits[0]).abs().max()
                assert diff < 1e-2, diff
            assert torch.isfinite(torch.stack(resp.step_logits)).all()
        # Attended bytes never include pads: at most the real tokens' KV (as stored).
        per_token = store.shape.kv_bytes_per_token_layer
        assert resp.stats.bytes_needed <= len(real) * per_token * rt.spec.config.num_hidden_layers
    finally:
        store.close()
    with pytest.raises(Exception, match="n_pad"):
        assemble(rt, make_policy("recomp", cfg), None).engine.serve(Request([0, 0], [1], 1, n_pad=2))


def test_corrupt_prefetched_probe_is_recomputed_not_served(tiny_runtimes, tmp_path, caplog):
    """The last layer's probe keys are read ahead, while the layer before computes: a CRC
    failure there still takes the node out of service and the request is recomputed."""
    rt = tiny_runtimes["llama-tiny"]
    ref, resp, healed = _serve_after_corrupting(
        rt, tmp_path, caplog, "impress", ServingConfig(retention=0.25, threshold="none"),
        _ids(14, 128), _ids(15, 6), layer=rt.spec.config.num_hidden_layers - 1,
        offset=lambda e: 5, garbage=b"\x00\xff\x00")
    assert resp.tokens == ref
    assert resp.stats.recovered_from_corruption == 1 and resp.stats.matched_tokens == 0
    assert "quarantined" in caplog.text
    assert healed.stats.matched_tokens == 128 and healed.stats.probe_bytes > 0


def test_prefetching_the_last_selection_changes_reads_not_results(tiny_runtimes, tmp_path):
    """With prefetch on, the chunks the last query selected are read a layer ahead; the
    answer is the same, and a repeated query needs no disk read after its selection."""
    rt = tiny_runtimes["llama-tiny"]
    prefix, query = _ids(8, 256), _ids(9, 16)
    runs = {}
    for prefetch in (False, True):
        cfg = ServingConfig(retention=0.25, prefetch=prefetch)
        policy = make_policy("impress", cfg)
        assert policy.prefetch_last_selection == prefetch
        store = open_store(tmp_path / str(prefetch), rt, cfg, policy, chunk_size=16)
        try:
            engine = assemble(rt, policy, store, TierConfig()).engine
            engine.serve(Request(prefix, query, 1))    # computes and stores the prefix
            engine.serve(Request(prefix, query, 1))    # the first selection: no guess yet
            late = []           # K/V disk reads submitted after the policy chose
            real = store.tiers.submit

            def submit(*a, **k):
                load = real(*a, **k)
                late.append(load.disk is not None)
                return load
            store.tiers.submit = submit
            second = engine.serve(Request(prefix, query, 4))
            runs[prefetch] = (second, late)
        finally:
            store.close()
    (plain, plain_late), (ahead, ahead_late) = runs[False], runs[True]
    assert ahead.tokens == plain.tokens
    assert ahead.stats.chunks_loaded == plain.stats.chunks_loaded
    assert ahead.stats.bytes_read["disk"] == plain.stats.bytes_read["disk"]  # same guess
    assert len(plain_late) == len(ahead_late) > 0               # one load per layer
    assert all(plain_late) and not any(ahead_late)


def test_probing_every_other_layer_reads_half_the_probes(tiny_runtimes, tmp_path):
    """probe_every=2: odd layers reuse the even layer's scores and read no probe copy."""
    rt = tiny_runtimes["llama-tiny"]
    prefix, query = _ids(10, 256), _ids(11, 16)
    got = {}
    for every in (1, 2):
        _, warm, _ = _serve_twice(rt, "impress", prefix, query, tmp_path / str(every),
                                  retention=0.25, probe_every=every)
        got[every] = warm.stats
    layers = got[1].layers
    assert layers % 2 == 0 and got[1].probe_bytes > 0
    assert got[2].probe_bytes * 2 == got[1].probe_bytes
    assert got[2].chunks_loaded > 0 and got[2].layers_fallback == 0
