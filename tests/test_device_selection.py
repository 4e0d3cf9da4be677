"""Selection runs where the layer computes: the queries, the probe keys, ITF's scores and
votes and the H2O baselines' exact attention live on the compute device, and only the plan
comes back to the host, in one copy per layer.

Without a GPU the selection device is pointed at a fake device (tests/helpers/fake_device.py:
host memory that refuses to mix with host tensors, as CUDA does), so every move the
selection path needs is made and checked on any machine; with CUDA the same tests run on the
GPU too. Exact policies must give full attention's tokens whatever the device.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from impress_flexgen.engine import Request, RequestStats, StoreSpec, assemble
from impress_flexgen.engine.family import probe_setup
from impress_flexgen.engine.layer_io import ReadAhead
from impress_flexgen.tiers import ChunkCache, TierConfig
from policies import LayerContext, ServingConfig, make_policy
from policies.base import ProbeKeys
from policies.decode_pages import DecodeConfig
from policies.itf import probe_scores
from tests.helpers.fake_device import FAKE, DeviceMismatch, FakeDevice, OnFake
from tests.helpers.ids import prompt_ids

DEVICES = ["cpu", "fake"] + (["cuda"] if torch.cuda.is_available() else [])
# Selection devices other than the compute device (the host without CUDA, else the GPU).
OTHER = ["fake"] + (["cpu"] if torch.cuda.is_available() else [])
P1, P2, TAIL = prompt_ids(71, 64), prompt_ids(72, 64), prompt_ids(73, 16)
Q1, Q2 = prompt_ids(74, 6), prompt_ids(75, 6)


def _device(where: str) -> torch.device:
    if where == "cuda":
        return torch.device("cuda", torch.cuda.current_device())     # as tensors report it
    return FAKE if where == "fake" else torch.device(where)


def _guard(where: str):
    return FakeDevice() if where == "fake" else contextlib.nullcontext()


def _spy(policy, mode: FakeDevice | None, seen: list) -> None:
    """Record, per planned layer, where the context's tensors and probe keys were and the
    plan; with the fake device, how many copies each plan made back to the host."""
    plan_layer = policy.plan_layer

    def planning(ctx):
        got = {"q": (ctx.q.device, ctx.q.dtype), "k_new": (ctx.k_new.device, ctx.k_new.dtype)}
        if ctx.probe is not None:
            got["probe"] = (ctx.probe.keys.device, ctx.probe.keys.dtype)
        before = mode.to_host if mode is not None else 0
        plan = plan_layer(ctx)
        got["to_host"] = mode.to_host - before if mode is not None else None
        got["plan"] = plan
        seen.append(got)
        return plan

    policy.plan_layer = planning


def _serve(rt, root, name: str, cfg: ServingConfig, where: str, cache_of=None,
           decode: DecodeConfig | None = None, warm: bool = False):
    """Three requests on a fresh store: P1 stored, then P1 + P2 (P1 selected, P2 stored),
    the store reordered, then P1 + P2 + TAIL (two stored nodes, reordered, selected; `warm`:
    served twice, the second time with the tiers holding what the first read).
    Returns the last response and the spy's records of its layers."""
    policy = make_policy(name, cfg, decode=decode)
    seen: list = []
    mode = FakeDevice() if where == "fake" else None
    _spy(policy, mode, seen)
    with mode or contextlib.nullcontext():
        stack = assemble(rt, policy, StoreSpec(root, chunk_size=16, reorder_interval=0),
                         TierConfig(), cache=None if cache_of is None else cache_of(rt))
        try:
            if where != "compute":
                stack.engine.runner.prefix.select_device = _device(where)
            stack.engine.serve(Request(P1, Q1, 1))
            stack.engine.serve(Request(P1 + P2, Q1, 1))
            if stack.store is not None:
                stack.store.reorder_now()
            if warm:
                stack.engine.serve(Request(P1 + P2 + TAIL, Q2, 1))
            seen.clear()
            response = stack.engine.serve(Request(P1 + P2 + TAIL, Q2, 4))
        finally:
            stack.close()
    return response, seen


SELECTIVE = [("impress", ServingConfig(retention=0.5)),
             ("impress", ServingConfig(retention=0.5, granularity="token")),
             ("impress", ServingConfig(retention=0.5, threshold="fixed", threshold_value=0.2,
                                       probe_queries=4, probe_stride=2)),
             ("as_h2o_lfu", ServingConfig(retention=0.5))]
EXACT = [("full", ServingConfig()), ("as_like", ServingConfig()), ("recomp", ServingConfig()),
         ("impress", ServingConfig(retention=1.0)), ("as_h2o_lfu", ServingConfig(retention=1.0)),
         ("quest", ServingConfig(decode_budget=256))]


def _ids(case) -> str:
    name, cfg = case
    return f"{name}-{cfg.granularity}-r{cfg.retention}-{cfg.threshold}"


@pytest.mark.slow
@pytest.mark.parametrize("case", SELECTIVE, ids=_ids)
@pytest.mark.parametrize("where", [d for d in DEVICES if d != "cpu"])
def test_selection_runs_on_its_device_and_chooses_as_on_the_host(tiny_runtimes, tmp_path,
                                                                 where, case):
    rt = tiny_runtimes["llama-tiny"]
    name, cfg = case
    host, host_seen = _serve(rt, tmp_path / "host", name, cfg, "cpu")
    got, seen = _serve(rt, tmp_path / where, name, cfg, where)
    assert len(seen) == len(host_seen) == rt.spec.config.num_hidden_layers
    device = _device(where)
    for rec in seen:
        assert rec["q"] == rec["k_new"] == (device, torch.float32)
        if name == "impress":
            assert rec["probe"] == (device, torch.float32)
        if where == "fake":
            assert rec["to_host"] == 1          # one copy back per layer, nothing else
    for rec in host_seen:
        assert rec["q"][0].type == "cpu"
    assert not got.stats.exact and got.stats.matched_tokens == 128
    plans = [(r["plan"], h["plan"]) for r, h in zip(seen, host_seen)]
    if where == "fake":        # the same arithmetic as on the host: the same everything
        for plan, want in plans:
            _assert_same_plan(plan, want)
        assert got.tokens == host.tokens
        assert all(torch.equal(a, b) for a, b in zip(got.step_logits, host.step_logits))
        assert got.stats.jaccard == host.stats.jaccard
    else:
        # float32 on another device: the same scores to rounding, so the same selection but
        # for a near tie at the budget's edge (one chunk's worth of tokens at most).
        for plan, want in plans:
            for a, b in zip(plan.scores, want.scores):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
            sel, ref = np.concatenate(plan.selected), np.concatenate(want.selected)
            if name == "impress":
                assert sel.sum() == ref.sum()
            assert (sel & ref).sum() >= ref.sum() - 16
    if where == "fake" or all(_same_selection(p, w) for p, w in plans):
        assert got.tokens == host.tokens
        for field in ("chunks_loaded", "bytes_needed", "layers_fallback"):
            assert getattr(got.stats, field) == getattr(host.stats, field), field


def _same_selection(a, b) -> bool:
    """Did two plans choose the same (whatever their scores' last bits)?"""
    same = lambda x, y: all(np.array_equal(i, j) for i, j in zip(x, y))
    return a.fallback == b.fallback and same(a.chunks_k, b.chunks_k) and \
        same(a.chunks_v, b.chunks_v) and same(a.selected or [], b.selected or []) and \
        all((i is None and j is None) or np.array_equal(i, j) for i, j in zip(a.attend, b.attend))


def _assert_same_plan(a, b) -> None:
    assert a.fallback == b.fallback and a.jaccard == b.jaccard
    for x, y in zip(a.chunks_k + a.chunks_v, b.chunks_k + b.chunks_v):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a.attend, b.attend):
        assert (x is None) == (y is None)
        if x is not None:
            np.testing.assert_array_equal(x, y)
    for x, y in zip((a.scores or []) + (a.selected or []), (b.scores or []) + (b.selected or [])):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def full_attention(tiny_runtimes, tmp_path_factory):
    """The last request of _serve under the full policy, selecting on the compute device."""
    return _serve(tiny_runtimes["llama-tiny"], tmp_path_factory.mktemp("full"), "full",
                  ServingConfig(), "compute")[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", EXACT, ids=_ids)
@pytest.mark.parametrize("where", OTHER)
def test_exact_policies_give_full_attentions_tokens_on_every_device(tiny_runtimes, tmp_path,
                                                                    full_attention, where,
                                                                    case):
    rt = tiny_runtimes["llama-tiny"]
    name, cfg = case
    full = full_attention
    got, seen = _serve(rt, tmp_path / "run", name, cfg, where,
                       decode=DecodeConfig(dense_layers=0) if name == "quest" else None)
    assert got.stats.exact
    assert got.tokens == full.tokens
    for a, b in zip(got.step_logits, full.step_logits):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    for rec in seen:
        assert rec["q"][0] == _device(where)


@pytest.mark.slow
@pytest.mark.parametrize("name,gpu_bytes", [("as_h2o_lfu", 1 << 20), ("as_like", 6 << 10)])
def test_chunks_from_a_gpu_tier_and_from_the_host_meet_on_the_device(tiny_runtimes, tmp_path,
                                                                     name, gpu_bytes):
    """The H2O baseline scores keys of both origins together; the engine joins them for
    attention. Host and device chunks in one torch.cat would fail on a GPU. (With CUDA the
    GPU tier and the selection are on the GPU; without, both on the fake device.)"""
    rt = tiny_runtimes["llama-tiny"]
    where = "cuda" if torch.cuda.is_available() else "fake"
    cfg = ServingConfig(retention=0.5)
    host, _ = _serve(rt, tmp_path / "host", name, cfg, "cpu", warm=True)
    # The last request's chunks come partly from the GPU tier (all of P1 and P2's with room
    # for them, a few of a node's without), the rest (TAIL's at least) from the disk.
    cache = ChunkCache(TierConfig(gpu_bytes=gpu_bytes, cpu_bytes=0, policy="lfu"),
                       gpu_device=_device(where))
    got, seen = _serve(rt, tmp_path / where, name, cfg, where, cache_of=lambda rt: cache,
                       warm=True)
    assert got.stats.bytes_read["gpu"] > 0 and got.stats.bytes_read["disk"] > 0
    copies = [res.tensor for res in cache.tiers[0].chunks.values()]
    assert copies
    if where == "fake":
        assert all(isinstance(t, OnFake) for t in copies)
    else:
        assert all(t.device == _device(where) for t in copies)
    if where == "fake" or name == "as_like":      # (as_like is exact: no near ties)
        assert got.tokens == host.tokens
    if where == "fake":
        assert all(torch.equal(a, b) for a, b in zip(got.step_logits, host.step_logits))


# -- the scoring and planning functions, straight ---------------------------------------
@pytest.fixture(scope="module")
def stored(tiny_runtimes, tmp_path_factory):
    """A store holding P1 and P2 as two nodes, reordered by impress's feedback."""
    rt = tiny_runtimes["llama-tiny"]
    cfg = ServingConfig(retention=0.5)
    stack = assemble(rt, make_policy("impress", cfg),
                     StoreSpec(tmp_path_factory.mktemp("stored"), chunk_size=16,
                               reorder_interval=0))
    stack.engine.serve(Request(P1, Q1, 1))
    stack.engine.serve(Request(P1 + P2, Q1, 1))
    stack.engine.serve(Request(P1 + P2 + TAIL, Q1, 1))
    assert stack.store.reorder_now() > 0
    yield rt, stack.store
    stack.close()


def _plan(rt, store, policy, where, layers=(0, 1), heads=None, n_pad=0, front=0):
    """The policy's plans of `layers` for fixed random queries, through the engine's
    read-ahead with its device set to `where`; and the mode's host copies per plan."""
    cfg = policy.config
    probe_heads, probe_kv = probe_setup(rt.spec, cfg)
    probe_heads = heads or probe_heads
    match = store.match_prefix(P1 + P2 + TAIL)
    device = _device(where)
    gen = torch.Generator().manual_seed(5)
    out, copies = [], []
    try:
        with _guard(where) as mode:
            ahead = ReadAhead(store, policy, 2, match.segments, RequestStats(), device=device)
            try:
                for layer in layers:
                    q = torch.randn(4, 5, 16, generator=gen)
                    k = torch.randn(2, 5, 16, generator=gen)
                    loader = ahead.loader(layer)
                    q, k = q.to(device), k.to(device)
                    before = mode.to_host if mode else 0
                    moved = mode.to_device if mode else 0
                    probe = loader.read_probe() if ahead.probes(layer) else None
                    ctx = LayerContext(layer, q, k, loader.segments, cfg,
                                       probe_heads, probe_kv, probe, loader.load,
                                       n_pad=n_pad, front=front)
                    out.append(policy.plan_layer(ctx))
                    copies.append((mode.to_host - before, mode.to_device - moved)
                                  if mode else None)
            finally:
                ahead.close()
    finally:
        store.release(match)
    return out, copies


PLANS = [("impress", dict(retention=0.5)),
         ("impress", dict(retention=0.3, granularity="token")),
         ("impress", dict(retention=0.5, threshold="adaptive")),
         ("impress", dict(retention=0.5, probe_every=2)),
         ("as_h2o_lru", dict(retention=0.3)),
         ("random", dict(retention=0.5)),
         ("sink_recent", dict(retention=0.5))]


@pytest.mark.parametrize("front", [0, 16])
@pytest.mark.parametrize("name,options", PLANS, ids=[f"{n}-{i}" for i, (n, _) in
                                                      enumerate(PLANS)])
@pytest.mark.parametrize("where", [d for d in DEVICES if d != "cpu"])
def test_plans_on_the_device_equal_the_hosts(stored, where, name, options, front):
    rt, store = stored
    cfg = ServingConfig(**options)
    want, _ = _plan(rt, store, make_policy(name, cfg), "cpu", n_pad=3, front=front)
    got, copies = _plan(rt, store, make_policy(name, cfg), where, n_pad=3, front=front)
    for plan, ref in zip(got, want):
        if where == "fake":
            _assert_same_plan(plan, ref)
        else:
            for a, b in zip(plan.scores or [], ref.scores or []):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    if where == "fake":
        # One copy back per layer; random and sink_recent touch no tensor at all.
        assert [c[0] for c in copies] == [0 if name in ("random", "sink_recent") else 1] * 2


def test_probe_keys_are_moved_once_per_layer_however_many_heads_probe(stored):
    rt, store = stored
    policy = make_policy("impress", ServingConfig(retention=0.5))
    one, moves_one = _plan(rt, store, policy, "fake", layers=(0,), heads=(0,))
    every, moves_every = _plan(rt, store, policy, "fake", layers=(0,), heads=(0, 1, 2, 3))
    assert moves_one == moves_every
    # q and k_new (made before planning) aside: each of the two nodes' probe keys, the
    # column map of the reordered keys and the padding mask.
    assert moves_one[0] == (1, 4)


@pytest.mark.parametrize("where", DEVICES)
def test_probe_scores_on_the_device_equal_the_hosts(where):
    """Reordered columns, dead columns, padding, a subset of the queries: every mask and
    index the scoring builds is made on the queries' device."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 48, 8, generator=gen)
    column_of = np.random.default_rng(0).permutation(48)[:40]      # 8 dead columns
    q, k_new = torch.randn(4, 6, 8, generator=gen), torch.randn(2, 6, 8, generator=gen)
    cfg = ServingConfig(probe_queries=4, probe_stride=2)

    def ctx_on(device):
        return LayerContext(0, q.to(device), k_new.to(device), [], cfg, (0, 1, 3), (0, 1),
                            ProbeKeys(keys.to(device), column_of), None, n_pad=5)

    want = probe_scores(ctx_on(torch.device("cpu")))
    with _guard(where):
        got = probe_scores(ctx_on(_device(where)))
        assert got.device == _device(where)
        got = got.cpu()
    if where == "cuda":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    else:
        assert torch.equal(got, want)


def test_the_fake_device_catches_what_a_gpu_would():
    with FakeDevice() as dev:
        x = torch.zeros(4, device=dev.device)
        assert isinstance(x, OnFake) and x.device == FAKE
        with pytest.raises(DeviceMismatch):
            x + torch.ones(4)
        with pytest.raises(DeviceMismatch):
            x[torch.tensor([0, 1])]
        with pytest.raises(DeviceMismatch):
            torch.cat([x, torch.ones(4)])
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        assert (x + torch.tensor(1.0)).device == FAKE        # 0-dim host tensors mix
        assert x.cpu().device.type == "cpu" and dev.to_host == 1


# -- decode-phase policies: pages in host memory, attended on the device -----------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["quest", "icecache", "page_random", "page_oracle"])
def test_decode_pages_are_handed_to_the_device_and_chosen_as_on_the_host(name):
    gen = torch.Generator().manual_seed(9)
    n, kv, heads, d = 160, 2, 4, 16
    kept = [[torch.randn(kv, n, d, generator=gen), torch.randn(kv, n, d, generator=gen),
             torch.ones(kv, n, dtype=torch.bool)]]
    steps = [(torch.randn(heads, d, generator=gen), torch.randn(kv, 1, d, generator=gen),
              torch.randn(kv, 1, d, generator=gen)) for _ in range(20)]
    decode = DecodeConfig(dense_layers=0)

    def run(where):
        device = _device(where)
        policy = make_policy(name, ServingConfig(decode_budget=64), decode=decode)
        out = []
        with _guard(where):
            pages = policy.start_decode([[t.to(device) for t in layer] for layer in kept],
                                        heads, device)
            for q, k, v in steps:
                keys, values, mask = pages.attend_set(0, q.to(device), k.to(device),
                                                      v.to(device))
                assert keys.device == values.device == mask.device == device
                out.append([t.cpu() for t in (keys, values, mask)])
            pages.close()
        return out

    want = run("cpu")
    for where in DEVICES[1:]:
        for got, ref in zip(run(where), want):
            for a, b in zip(got, ref):
                assert torch.equal(a, b)
