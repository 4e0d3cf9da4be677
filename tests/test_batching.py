"""Continuous batching: each request of a batch answers as the same request served alone.

Eight concurrent mixed requests (stored, partly stored and new prefixes; one cancelled, one
with a stop token, one ending at its deadline, one sampled with a seed) go through the
scheduler together (their prefills in one pass, decode steps batched) and one at a time
through Engine.serve, on two stores in the same state. One of them reuses a new prefix that
another of them stores: it waits for a second pass and loads it, as when served after it.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import torch

from impress_flexgen.engine import Request, assemble, open_store
from impress_flexgen.engine import SchedulerConfig
from impress_flexgen.sampling import SamplingParams
from impress_flexgen.tiers import TierConfig
from policies import POLICY_NAMES, ServingConfig, make_policy

CHUNK = 16
NEW = 6


def prompts():
    rng = np.random.default_rng(7)
    stem = rng.integers(10, 40000, 4 * CHUNK).tolist()
    other = rng.integers(10, 40000, 3 * CHUNK).tolist()
    fresh = [rng.integers(10, 40000, n).tolist() for n in (2 * CHUNK + 5, CHUNK, 40)]
    prefixes = [stem, stem[:2 * CHUNK] + other[:CHUNK + 3], other, fresh[0],
                stem + other[:CHUNK], fresh[1], stem[:CHUNK] + fresh[2], other[:2 * CHUNK]]
    queries = [rng.integers(10, 40000, int(n)).tolist() for n in rng.integers(1, 5, 8)]
    return stem, list(zip(prefixes, queries))


class Stopper:
    """on_token: say stop after `after` tokens (a cancel or a deadline hit mid-generation)."""

    def __init__(self, after: int | None):
        self.after, self.seen = after, []

    def __call__(self, token: int) -> bool:
        self.seen.append(token)
        return self.after is None or len(self.seen) < self.after


def requests(stop_token: int | None):
    stem, pairs = prompts()
    out = []
    for i, (prefix, query) in enumerate(pairs):
        sampling = None
        if i == 2 and stop_token is not None:
            sampling = SamplingParams(stop_token_ids=(stop_token,))
        if i == 5:
            sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
        after = {1: 2, 6: 3}.get(i)        # 1 cancelled, 6 past its deadline
        out.append(Request(prefix, query, NEW + i % 3, sampling=sampling,
                           on_token=Stopper(after), keep_logits=True))
    return stem, out


def serve_both(rt, tmp_path, name, retention, stop_token=None, batch=8):
    """(alone, batched) responses and the streamed tokens of each, over fresh stores."""
    results = []
    for mode in ("alone", "batched"):
        cfg = ServingConfig(retention=retention)
        policy = make_policy(name, cfg)
        store = open_store(tmp_path / f"{name}-{mode}", rt, cfg, policy, chunk_size=CHUNK) \
            if policy.reuse else None
        try:
            engine = assemble(rt, policy, store, TierConfig()).engine
            stem, reqs = requests(stop_token)
            engine.serve(Request(stem, [5], 1))          # the stored prefix
            if mode == "alone":
                resps = [engine.serve(r) for r in reqs]
            else:
                resps = engine.serve_all(reqs, SchedulerConfig(max_batch_size=batch))
            results.append((resps, [r.on_token.seen for r in reqs]))
        finally:
            if store is not None:
                store.close()
    return results


@contextlib.contextmanager
def engine_on_store(rt, path, name="full", retention=None):
    """An engine of policy `name` over a fresh store at `path` (both closed after)."""
    cfg = ServingConfig() if retention is None else ServingConfig(retention=retention)
    policy = make_policy(name, cfg)
    store = open_store(path, rt, cfg, policy, chunk_size=CHUNK)
    try:
        engine = assemble(rt, policy, store, TierConfig()).engine
        yield engine, store
        engine.close()
    finally:
        store.close()


def check_equal(alone, batched):
    worst = 0.0
    for (a, a_seen), (b, b_seen) in [((x, xs), (y, ys)) for x, xs, y, ys in
                                     zip(alone[0], alone[1], batched[0], batched[1])]:
        assert not isinstance(b, Exception), b
        assert b.tokens == a.tokens
        assert b.stats.matched_tokens == a.stats.matched_tokens
        assert b_seen == a_seen
        assert len(b.step_logits) == len(a.step_logits)
        for x, y in zip(a.step_logits, b.step_logits):
            worst = max(worst, float((x - y).abs().max()))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_batched_equals_alone_at_full_retention(tiny_runtimes, tmp_path, name):
    rt = tiny_runtimes["llama-tiny"]
    # The stop token: the third token request 2 produces alone.
    (probe, _), = [serve_both(rt, tmp_path / "probe", "full", 1.0, batch=1)[0]]
    stop = probe[2].tokens[2]
    alone, batched = serve_both(rt, tmp_path, name, 1.0, stop)
    worst = check_equal(alone, batched)
    print(f"{name}: largest logit difference {worst:.3g}")
    assert worst < 1e-4
    assert len(alone[0][1].tokens) == 2                # cancelled after two tokens
    assert len(alone[0][6].tokens) == 3                # its deadline after three
    assert alone[0][2].tokens[-1] == stop              # ended by its stop token


def test_impress_batched_equals_impress_alone(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    alone, batched = serve_both(rt, tmp_path, "impress", 0.25)
    check_equal(alone, batched)
    assert any(r.stats.matched_tokens for r in alone[0])


def test_opt_batched_equals_alone(tiny_runtimes, tmp_path):
    """OPT's positions come from the embedding: each request of a batch keeps its own."""
    rt = tiny_runtimes["opt-tiny"]
    alone, batched = serve_both(rt, tmp_path, "full", 1.0, batch=3)
    check_equal(alone, batched)


def test_admission_waits_for_memory_and_batch_size(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    engine = assemble(rt, make_policy("recomp", ServingConfig()), None, TierConfig()).engine
    _, reqs = requests(None)
    engine.schedule_by(SchedulerConfig(max_batch_size=3))
    sched = engine.scheduler
    done, peak = [], 0
    for r in reqs[:4]:
        engine.add_request(r)
    sched.kv_budget = sum(s.kv_bytes for s in list(sched.waiting)[:2])   # room for two
    while sched.busy:
        done += engine.step()
        peak = max(peak, len(sched.running))
        assert sched.kv_in_use() <= sched.kv_budget
        assert len(sched.running) <= 3
    assert len(done) == 4 and all(s.error is None for s in done)
    assert peak == 2                       # memory, not the batch size, held the third
    # A request larger than the whole budget is still served when it runs alone.
    sched.kv_budget = 1
    seq = engine.add_request(reqs[0])
    while not seq.finished:
        engine.step()
    assert seq.error is None and len(seq.result().tokens) == reqs[0].max_new_tokens


def test_a_failing_request_leaves_the_others(tiny_runtimes):
    rt = tiny_runtimes["llama-tiny"]
    engine = assemble(rt, make_policy("recomp", ServingConfig()), None, TierConfig()).engine
    good = Request([11, 12, 13], [14], 4, keep_logits=True)
    bad = Request([11, 12], [], 4)                   # no query: refused
    out = engine.serve_all([good, bad, good])
    assert isinstance(out[1], Exception)
    assert out[0].tokens == out[2].tokens == engine.serve(good).tokens
    assert torch.equal(out[0].step_logits[-1], out[2].step_logits[-1])


def test_service_batches_concurrent_jobs_as_served_alone(tiny_runtimes, tmp_path):
    """Jobs submitted together to a service with batching answer as with max batch size 1;
    a cancelled job ends alone; /metrics counts batch sizes and time per output token."""
    from prometheus_client.parser import text_string_to_metric_families

    from impress_flexgen.service import Service, ServiceConfig

    rt = tiny_runtimes["llama-tiny"]
    texts = [f"Question {i}: " + "what the text says about it " * (3 + i) for i in range(6)]
    answers = {}
    for size in (1, 4):
        config = ServiceConfig(model="llama-tiny", store_root=tmp_path / str(size),
                               max_batch_size=size, queue_size=8)
        with Service(config, runtime=rt) as service:
            jobs = [service.frontend.build(prompt=t, max_tokens=8, seed=3,
                                           temperature=0.7 if i == 4 else 0)
                    for i, t in enumerate(texts)]
            tickets = [service.submit(j) for j in jobs]
            tickets[2].cancel()
            got = []
            for t in tickets:
                try:
                    got.append(t.future.result(timeout=300).token_ids)
                except Exception as exc:  # noqa: BLE001 - the cancelled one may never start
                    got.append(type(exc).__name__)
            answers[size] = got
            metrics = {s.name: s.value for fam in text_string_to_metric_families(
                service.metrics_text().decode()) for s in fam.samples}
        assert metrics["impress_flexgen_requests_running"] == 0
        assert metrics["impress_flexgen_requests_waiting"] == 0
        assert metrics["impress_flexgen_batch_size_count"] > 0
        assert metrics["impress_flexgen_time_per_output_token_seconds_count"] >= 4
        if size == 4:
            assert metrics["impress_flexgen_batch_size_sum"] > \
                metrics["impress_flexgen_batch_size_count"]      # some steps held several
    keep = [i for i in range(6) if i != 2]
    assert [answers[4][i] for i in keep] == [answers[1][i] for i in keep]


def test_admitted_requests_share_one_prefill_pass(tiny_runtimes, monkeypatch):
    """Requests admitted together are prefilled in one pass: each layer's weights are
    brought once for all of them, and every answer equals the same request alone."""
    rt = tiny_runtimes["llama-tiny"]
    engine = assemble(rt, make_policy("recomp", ServingConfig()), None, TierConfig()).engine
    reqs = [Request(list(range(11, 11 + n)), [7, 8][:1 + n % 2], 1, keep_logits=True)
            for n in (5, 19, 33)]
    alone = [engine.serve(r) for r in reqs]
    loads = []
    real = engine.runner.load_weights
    monkeypatch.setattr(engine.runner, "load_weights",
                        lambda j, st, **kw: loads.append(j) or real(j, st, **kw))
    together = engine.serve_all(reqs, SchedulerConfig(max_batch_size=4))
    assert loads.count(1) == 1                 # the first attention layer's: once, not 3x
    assert loads.count(2) == 1                 # its MLP's
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens
        assert float((a.step_logits[0] - b.step_logits[0]).abs().max()) < 1e-4
    # A pass takes requests up to its token budget; the rest follow in passes of their own.
    loads.clear()
    split = engine.serve_all(reqs, SchedulerConfig(max_batch_size=4, pass_tokens=30))
    assert loads.count(1) == 2                 # 7 + 21 new tokens, then 35 alone
    assert [r.tokens for r in split] == [r.tokens for r in together]


def test_a_failed_pass_serves_its_requests_alone(tiny_runtimes, tmp_path, monkeypatch):
    """Anything failing inside a shared pass (corrupt stored KV, a lost pool chunk, ...)
    serves each of its requests alone, with the engine's own recovery: same answers."""
    from impress_flexgen.engine.runner import Runner

    real = Runner.prefill

    def fails_when_shared(runner, seqs):
        if len(seqs) > 1:
            raise RuntimeError("a chunk failed its check")
        return real(runner, seqs)

    alone, _ = serve_both(tiny_runtimes["llama-tiny"], tmp_path / "a", "full", 1.0)
    monkeypatch.setattr(Runner, "prefill", fails_when_shared)
    _, batched = serve_both(tiny_runtimes["llama-tiny"], tmp_path / "b", "full", 1.0)
    check_equal(alone, batched)


@pytest.mark.parametrize("gather_s", [0.5, 0.0])
def test_an_idle_service_gathers_a_burst_into_one_pass(tiny_runtimes, tmp_path, monkeypatch,
                                                        gather_s):
    """Requests sent at once to an idle service are prefilled in one pass when it waits
    batch_gather_s for the burst; with no wait the first one goes alone (the worker takes it
    as soon as it arrives, held here until the others are queued)."""
    import threading

    from impress_flexgen.engine import Engine
    from impress_flexgen.service import Service, ServiceConfig

    rt = tiny_runtimes["llama-tiny"]
    passes = []
    real = Engine._prefill

    def record(self, group):
        passes.append(len(group))
        return real(self, group)

    monkeypatch.setattr(Engine, "_prefill", record)
    config = ServiceConfig(model="llama-tiny", store_root=tmp_path, max_batch_size=4,
                           queue_size=8, batch_gather_s=gather_s)
    with Service(config, runtime=rt) as service:
        jobs = [service.frontend.build(prompt=f"Burst {i}: " + "a few words " * (2 + i),
                                       max_tokens=2) for i in range(3)]
        admitted = threading.Event()
        real_admit = service._admit

        def admit(ticket):
            real_admit(ticket)
            admitted.set()

        service._admit = admit
        first = service.submit(jobs[0])
        assert admitted.wait(30)         # the worker holds the first request
        time.sleep(0.05)                 # and, without a wait, has started its step
        rest = [service.submit(j) for j in jobs[1:]]
        for t in [first, *rest]:
            t.future.result(timeout=300)
    assert passes[0] == (3 if gather_s else 1), passes


def test_bench_serve_checks_its_prompts_before_running(capsys):
    """The default rows (up to 16 clients x 3 distinct 2,000-character prompts) have their
    passages; a count the books cannot hold is refused at once, not after the rows before."""
    from experiments import bench_serve
    from experiments.batching_load import prompts

    args = bench_serve.parse_args(["--policies", ""])
    assert args.client_counts == [1, 2, 4, 8, 16]
    texts = prompts("distinct", 48, 2000, 160)
    assert len(set(texts)) == 48
    with pytest.raises(SystemExit) as exit_:
        bench_serve.parse_args(["--policies", "", "--batching-clients", "64"])
    assert exit_.value.code == 2 and "distinct prefixes" in capsys.readouterr().err


def test_a_request_decodes_while_its_prefix_is_stored(tiny_runtimes, tmp_path):
    """The store write runs behind the decode steps: tokens stream while it is held up;
    the response comes once the prefix is stored; a request opened meanwhile waits for it
    and matches it, as when stores were written in line."""
    import threading

    with engine_on_store(tiny_runtimes["llama-tiny"], tmp_path / "s") as (engine, store):
        stem, _ = prompts()
        streamed = threading.Event()
        insert, seen = store.insert, []

        def held_insert(*args, **kwargs):
            seen.append(streamed.wait(10))       # tokens went out while this waited
            return insert(*args, **kwargs)

        store.insert = held_insert
        tokens = []

        def on_token(token):
            tokens.append(token)
            if len(tokens) == 3:
                streamed.set()
            return True

        seq = engine.add_request(Request(stem, [5, 6], 6, on_token=on_token))
        while not seq.finished:
            engine.step()
        response = seq.result()
        assert seen == [True] and len(response.tokens) == 6
        assert store.inspect().state.tree.match_prefix(stem).length == len(stem)  # stored before answered
        assert response.stats.store_s > 0

        # A request opened while a store is pending matches what it stores.
        streamed.clear()
        longer = stem + [7] * CHUNK
        first = engine.add_request(Request(longer, [5], 4))
        engine.step()                            # its prefill: its store is pending
        threading.Timer(0.3, streamed.set).start()
        second = engine.serve(Request(longer + [8] * CHUNK, [5], 2))
        assert second.stats.matched_tokens == len(longer)
        while not first.finished:
            engine.step()
        assert len(first.result().tokens) == 4


def test_a_failed_store_leaves_the_request_answered(tiny_runtimes, tmp_path):
    with engine_on_store(tiny_runtimes["llama-tiny"], tmp_path / "s") as (engine, store):
        stem, _ = prompts()
        want = engine.serve(Request(stem, [5, 6], 4)).tokens        # stored in passing

        def broken(*args, **kwargs):
            raise RuntimeError("disk on fire")

        store.insert = broken
        other = stem[:CHUNK] + [9] * (3 * CHUNK)
        got = engine.serve(Request(other, [5, 6], 4))
        assert len(got.tokens) == 4
        assert store.inspect().state.tree.match_prefix(other).length == CHUNK        # not stored
        assert engine.serve(Request(stem, [5, 6], 4)).tokens == want  # nothing left pinned
        assert all(n.lock_count == 0 for n in store.inspect().state.tree.nodes.values())


def test_side_by_side_attention_equals_each_context_alone():
    """Contexts of different lengths and masks, laid out side by side: one attention call
    per layer gives each row what attending its own context gives; after a member leaves,
    the others go on from the same memory."""
    import torch.nn.functional as F

    from impress_flexgen.engine.attention import SideBySide
    from impress_flexgen.engine.sequence import LayerKV, Sequence

    g = torch.Generator().manual_seed(3)
    n_head, n_kv, d, layers = 4, 2, 8, 2

    def seq(m, masked):
        kv = []
        for _ in range(layers):
            mask = torch.rand(n_kv, m, generator=g) > 0.4 if masked else \
                torch.ones(n_kv, m, dtype=torch.bool)
            mask[:, 0] = True
            kv.append(LayerKV(torch.randn(n_kv, m, d, generator=g),
                              torch.randn(n_kv, m, d, generator=g), mask, 5, n_head // n_kv))
        return Sequence(None, kv=kv)

    def alone(kv, q, k, v):
        keys = torch.cat([kv.k[:, :kv.n], k[:, None]], dim=1)
        values = torch.cat([kv.v[:, :kv.n], v[:, None]], dim=1)
        mask = None
        if kv.mask is not None:
            mask = torch.cat([kv.mask[:, :kv.n], torch.ones(kv.mask.shape[0], 1,
                                                            dtype=torch.bool)], dim=1)
            mask = mask[None, :, None]
        return F.scaled_dot_product_attention(q[None], keys[None], values[None],
                                              attn_mask=mask, enable_gqa=True)[0]

    seqs = [seq(7, True), seq(3, False), seq(11, True)]
    side = SideBySide()
    for step in range(4):
        if step == 2:
            side.forget(seqs[1])
            seqs = [seqs[0], seqs[2]]                 # one left the batch
        assert side.hold(seqs, n_head)
        for layer in range(layers):
            q = torch.randn(len(seqs), n_head, 1, d, generator=g)
            k = torch.randn(len(seqs), n_kv, 1, d, generator=g)
            v = torch.randn(len(seqs), n_kv, 1, d, generator=g)
            want = [alone(s.kv[layer], q[b], k[b, :, 0], v[b, :, 0]) for b, s in enumerate(seqs)]
            before = [s.kv[layer].n for s in seqs]
            got = side.attend(layer, q, k, v, torch.float32, True)
            for b, s in enumerate(seqs):
                torch.testing.assert_close(got[b], want[b], rtol=1e-5, atol=1e-6)
                assert s.kv[layer].n == before[b] + 1
    assert not side.hold(seqs[:1], n_head)         # alone: attends its own context


def test_a_pass_reads_a_shared_nodes_probe_keys_once(tiny_runtimes, tmp_path):
    """Requests prefilled together that matched the same stored prefix read its probe
    keys once, and answer as each did alone."""
    with engine_on_store(tiny_runtimes["llama-tiny"], tmp_path / "s", "impress",
                         0.25) as (engine, store):
        stem, _ = prompts()
        engine.serve(Request(stem, [5], 1))
        reqs = [Request(stem, [7 + i, 9, 11], 3) for i in range(3)]
        before = store.inspect().state.metrics.probe_bytes_read
        alone = [engine.serve(r) for r in reqs]
        per_request = (store.inspect().state.metrics.probe_bytes_read - before) / len(reqs)
        assert per_request > 0
        before = store.inspect().state.metrics.probe_bytes_read
        together = engine.serve_all(reqs, SchedulerConfig(max_batch_size=3))
        assert store.inspect().state.metrics.probe_bytes_read - before == per_request
        assert [r.tokens for r in together] == [r.tokens for r in alone]
        assert all(r.stats.matched_tokens == len(stem) for r in together)
