"""Plans over a matched prefix: recompute and both give what loading (and no store) give."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from impress_flexgen.engine import Request, assemble, open_store
from impress_flexgen.tiers import TierConfig
from policies import ServingConfig, make_policy
from tests.helpers.ids import prompt_ids as _ids


@dataclasses.dataclass
class _Fixed:
    """A planner that always answers the same split (the cost model is tested apart)."""
    mode: str
    split_chunks: int
    predicted_s: float = 0.0

    def choose(self, mode, segments_nodes, matched, n_new):
        return self

    def observe(self, *args) -> None:
        pass


def _engine(rt, store_dir, policy_name="full", retention=1.0, plan="load"):
    cfg = ServingConfig(retention=retention, plan=plan)
    policy = make_policy(policy_name, cfg)
    store = open_store(store_dir, rt, cfg, policy, chunk_size=16)
    return assemble(rt, policy, store, TierConfig(0, 0)).engine, store


@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
@pytest.mark.parametrize("policy", ["full", "impress"])
def test_recompute_and_both_match_generation(tiny_runtimes, tmp_path, model, policy):
    rt = tiny_runtimes[model]
    prefix, query = _ids(1, 130), _ids(2, 7)
    ref = rt.generate([prefix + query], 4, record_logits=True)
    engine, store = _engine(rt, tmp_path / "s", policy)
    try:
        engine.serve(Request(prefix, query, 4))            # stores 128 tokens
        results = {}
        for mode, split in (("load", 0), ("recompute", 8), ("both", 3), ("both", 7)):
            engine.config = engine.policy.config = dataclasses.replace(engine.config, plan=mode)
            engine.planner = engine.prefix.planner = _Fixed(mode, split)
            results[(mode, split)] = engine.serve(Request(prefix, query, 4, keep_logits=True))
        for (mode, split), resp in results.items():
            assert resp.stats.matched_tokens == 128
            assert resp.stats.plan == mode and resp.stats.plan_split == split
            assert resp.stats.plan_reason == ("forced" if mode in ("load", "recompute")
                                              else "predicted")
            assert resp.stats.computed_tokens == 2 + 7 + 16 * split
        tol = 0.05 if model == "opt-tiny" else 1e-2
        for (mode, split), resp in results.items():
            if mode == "load" and policy == "impress":
                continue          # selection at retention 1.0 is still a selection
            assert resp.tokens == ref.new_ids[0], (mode, split)
            diff = (torch.stack(resp.step_logits) - ref.logits[0]).abs().max()
            assert diff < tol, (mode, split, float(diff))
        # Recompute reads no chunk; both reads only what lies past its front.
        assert results[("recompute", 8)].stats.chunks_loaded == 0
        assert results[("recompute", 8)].stats.probe_bytes == 0
        if policy == "full":
            full = results[("load", 0)].stats.chunks_loaded
            assert results[("both", 3)].stats.chunks_loaded == full * 5 // 8
            assert results[("both", 7)].stats.chunks_loaded == full * 1 // 8
    finally:
        store.close()


def test_both_first_token_equals_recompute_with_kl_near_zero(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    prefix, query = _ids(5, 200), _ids(6, 12)
    engine, store = _engine(rt, tmp_path / "s")
    try:
        engine.serve(Request(prefix, query, 1))
        out = {}
        for mode, split in (("recompute", 12), ("both", 6)):
            engine.config = engine.policy.config = dataclasses.replace(engine.config, plan=mode)
            engine.planner = engine.prefix.planner = _Fixed(mode, split)
            out[mode] = engine.serve(Request(prefix, query, 1), query_logits=True)
        assert out["both"].tokens[0] == out["recompute"].tokens[0]
        p = torch.log_softmax(out["recompute"].query_logits.double(), -1)
        q = torch.log_softmax(out["both"].query_logits.double(), -1)
        kl = float((p.exp() * (p - q)).sum(-1).mean())
        assert kl < 1e-4
    finally:
        store.close()


def test_auto_plan_predicts_and_avoids_a_slow_disk(tiny_runtimes, tmp_path, monkeypatch):
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "cache"))
    rt = tiny_runtimes["llama-tiny"]
    prefix, query = _ids(7, 256), _ids(8, 5)
    ref = rt.generate([prefix + query], 2).new_ids[0]
    cfg = ServingConfig(retention=1.0, plan="auto")
    policy = make_policy("full", cfg)
    # 256 tokens of this model's KV are 64 KiB: at 0.02 MB/s a load takes seconds, while
    # recomputing them takes milliseconds.
    store = open_store(tmp_path / "s", rt, cfg, policy, chunk_size=16, read_limit_mb_s=0.02)
    try:
        engine = assemble(rt, policy, store, TierConfig(0, 0)).engine
        assert engine.planner is not None
        engine.planner.cost()
        assert list((tmp_path / "cache" / "costs").glob("*.json"))   # calibration cached
        first = engine.serve(Request(prefix, query, 2))
        assert first.stats.plan == "load" and first.stats.matched_tokens == 0
        assert first.stats.plan_reason == "no-match"
        warm = engine.serve(Request(prefix, query, 2))
        assert warm.stats.matched_tokens == 256
        assert warm.stats.plan in ("recompute", "both")
        assert warm.stats.as_dict()["plan_reason"] == "predicted"
        assert warm.stats.predicted_ttft_s > 0
        assert 0 < warm.stats.plan_s < warm.stats.ttft_s       # the planner's own time
        assert first.stats.plan_s == 0                         # nothing matched: no plan
        assert warm.tokens == ref
        if warm.stats.plan == "both":
            assert 0 < warm.stats.plan_split < 16
    finally:
        store.close()


def test_experiment_targets_and_live_read_limit(tiny_runtimes, tmp_path):
    from experiments.planner import _targets, set_read_limit

    ttft = {"recompute": 4.0, "load full": 4.5, "load impress": 1.8,
            "planner full": 2.4, "planner impress": 1.9}
    full = _targets(ttft, "planner full")            # recompute and full load within 2x
    assert full["close"] and full["target"] == 0.8 and full["met"]
    assert full["best"] == "recompute" and full["over_best"] == pytest.approx(0.6)
    imp = _targets(ttft, "planner impress")          # impress loads 2.2x faster: not close
    assert not imp["close"] and imp["target"] == 1.05 and not imp["met"]
    assert _targets({**ttft, "planner impress": 1.85}, "planner impress")["met"]
    # Over the target with the best baseline's own plan every time: the same code, met as
    # such; not with another plan, nor where the target is to beat the best (close).
    same = _targets(ttft, "planner impress", {"load": 6})
    assert same["same_plan"] and same["met"] and same["over_best"] > same["target"]
    assert not _targets(ttft, "planner impress", {"load": 5, "both": 1})["met"]
    assert not _targets(ttft, "planner full", {"recompute": 6})["same_plan"]   # close
    # Impress's planner is held to its own ends: load full (not one of its plans) being
    # faster than load impress does not count against it.
    other = {"recompute": 10.0, "load full": 1.0, "load impress": 1.2,
             "planner full": 1.0, "planner impress": 1.1}
    got = _targets(other, "planner impress", {"load": 6})
    assert got["best"] == "load impress" and got["over_best"] < 1 and got["met"]
    assert not _targets({**other, "planner impress": 1.3}, "planner impress", {"both": 6})["met"]

    rt = tiny_runtimes["llama-tiny"]
    engine, store = _engine(rt, tmp_path / "s")
    try:
        assert store.inspect().state.reader.limit is None
        set_read_limit(store, 2.5)
        assert store.inspect().state.reader.limit.rate == 2.5e6 and store.config.read_limit_mb_s == 2.5
        set_read_limit(store, None)
        assert store.inspect().state.reader.limit is None and store.config.read_limit_mb_s is None
    finally:
        store.close()
