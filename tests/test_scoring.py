"""Prompt scoring (echo with logprobs) inside the model step, and logits kept only when
asked for: a scored prompt is prefilled in pieces whose scores equal one whole pass, its
n choices share that prefill, a request arriving meanwhile waits about one piece, and no
step's (batch x vocab) logits outlive the step."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import httpx2
import pytest
import torch

from experiments.abuse_scoring import measure_scoring_stall
from impress_flexgen.config import ServiceConfig
from impress_flexgen.engine import Request, SchedulerConfig, assemble
from impress_flexgen.entrypoints.openai.server import background_server
from impress_flexgen.errors import ServiceError
from impress_flexgen.frontend import MAX_SCORED_ENTRIES, Job
from impress_flexgen.sampling import SamplingParams
from impress_flexgen.service import Service
from policies import make_policy
from tests.helpers.fixtures import llama_tiny_runtime as runtime  # noqa: F401 - a fixture

MODEL = "llama-tiny"


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engine(runtime):
    return assemble(runtime, make_policy("recomp"), None).engine


def _pieces_of(runtime, tokens: int):
    """An engine scoring prompts in pieces of `tokens`."""
    return assemble(runtime, make_policy("recomp"), None,
                    scheduling=SchedulerConfig(score_piece_tokens=tokens)).engine


def test_a_prompt_scored_in_pieces_equals_one_whole_pass(runtime):
    engine = _pieces_of(runtime, 64)
    ids = _ids(150, 1)
    ref = engine.serve(Request([], ids, 1), query_logits=True).query_logits
    lp = torch.log_softmax(ref.double(), -1)
    one = engine.add_request(Request([], ids, 3, prompt_logprobs=4),
                             choices=[Request([], ids, 3, prompt_logprobs=4,
                                              sampling=SamplingParams(1.0, seed=5))])
    other, = one.choices
    pieces = 0
    while one.prompt_scores is None:           # a piece a step
        engine.step()
        pieces += 1
        assert one.scoring.done == min(64 * pieces, len(ids))
    assert pieces == 3
    s = one.prompt_scores
    assert s is other.prompt_scores and len(s) == len(ids) - 1 == 149
    assert s.tokens.tolist() == ids[1:]
    want = lp[torch.arange(149), ids[1:]]
    assert float((s.logprobs.double() - want).abs().max()) < 1e-4
    top = lp[:-1].topk(4)
    assert float((s.top_logprobs.double() - top.values).abs().max()) < 1e-4
    assert (s.top_ids == top.indices).float().mean() > 0.99      # ties may swap
    assert one.tokens[0] == int(ref[-1].argmax())                 # greedy from the last row
    assert one.kv[0].k.data_ptr() != other.kv[0].k.data_ptr()    # contexts of their own
    while not (one.finished and other.finished):
        engine.step()
    alone = engine.serve(Request([], ids, 3))
    assert one.result().tokens == alone.tokens
    assert len(other.result().tokens) == 3


def test_a_piece_paused_between_layers_goes_on_unchanged(runtime):
    """A piece stops after any layer for another request's pass and goes on from there:
    the scores are those of a prefill never stopped."""
    engine = _pieces_of(runtime, 64)
    ids = _ids(100, 11)
    straight = engine.serve(Request([], ids, 1, prompt_logprobs=3))
    engine.scheduler.arrived = lambda: True          # a request always waiting
    got = engine.add_request(Request([], ids, 1, prompt_logprobs=3))
    steps, others = 0, []
    while got.prompt_scores is None:
        engine.step()
        steps += 1
        others.append(engine.add_request(Request([5, 6], [7], 2)))   # prefilled in between
    # Each piece stops after each of its layers, and goes on once more to finish.
    assert steps == 2 * (engine.math.n_layers + 1)
    engine.scheduler.arrived = None
    while engine.scheduler.busy:
        engine.step()
    want = engine.serve(Request([5, 6], [7], 2)).tokens
    assert all(o.result().tokens == want for o in others)
    assert torch.equal(got.prompt_scores.logprobs, straight.prompt_scores.logprobs)
    assert torch.equal(got.prompt_scores.top_ids, straight.prompt_scores.top_ids)
    assert got.tokens == straight.tokens


def test_no_step_logits_outlive_their_step(engine, monkeypatch):
    """Every step's (batch, vocab) logits are gone once the step is: nothing is kept
    without logprobs, numbers with them, copies of rows with keep_logits."""
    made = []
    real = engine.math.logits

    def logits(w, hidden):
        out = real(w, hidden)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(engine.math, "logits", logits)
    prompts = [(_ids(20, 2), _ids(3, 3)), (_ids(9, 4), _ids(2, 5)), (_ids(30, 6), _ids(1, 7))]
    plain = engine.serve_all([Request(p, q, 12) for p, q in prompts])
    gc.collect()
    # One product for the pass's first tokens, then one per decode step.
    assert len(made) == 12 and not any(r() is not None for r in made), \
        "a response keeps a step's logits alive"
    assert all(r.step_logits == [] and r.logprobs is None for r in plain)

    made.clear()
    asked = engine.serve_all([Request(p, q, 12, logprobs=3) for p, q in prompts])
    kept = engine.serve_all([Request(p, q, 12, keep_logits=True) for p, q in prompts])
    gc.collect()
    assert not any(r() is not None for r in made)
    for a, k, p in zip(asked, kept, plain):
        assert a.tokens == k.tokens == p.tokens and len(a.logprobs) == len(a.tokens)
        for (token, value, top), row in zip(a.logprobs, k.step_logits):
            assert row.shape == (engine.rt.spec.config.vocab_size,) and row._base is None
            ref = torch.log_softmax(row.double(), -1)
            assert abs(value - float(ref[token])) < 1e-5 and len(top) == 3
            assert [t for t, _ in top] == ref.topk(3).indices.tolist()


def test_a_request_arriving_while_a_prompt_is_scored_waits_one_layer(runtime):
    engine = _pieces_of(runtime, 32)
    sched = engine.scheduler
    arrived = []
    sched.arrived = lambda: bool(arrived)
    ids = _ids(200, 8)
    lead = engine.add_request(
        Request([], ids, 1, prompt_logprobs=2, sampling=SamplingParams(1.0, seed=0)),
        choices=[Request([], ids, 1, prompt_logprobs=2, sampling=SamplingParams(1.0, seed=i))
                 for i in range(1, 4)])
    scoring = lead.scoring
    engine.step()
    assert scoring.done == 32 and sched.room() == 8 - 4
    seen = []

    def short_token(token):
        seen.append((scoring.done, scoring.paused is not None))
        return True

    arrived.append(Request([5, 6], [7], 1, on_token=short_token))
    engine.step()                        # the next piece stops after its first layer
    assert scoring.done == 32 and scoring.paused is not None
    short = engine.add_request(arrived.pop())   # as the service's worker takes it
    engine.step()
    # Answered in that step, while the piece waited between two layers.
    assert short.finished and seen == [(32, True)] and lead.prompt_scores is None
    while sched.busy:
        engine.step()
    scores = [s.result().prompt_scores for s in (lead, *lead.choices)]
    assert all(s is scores[0] for s in scores) and len(scores[0]) == 199


@pytest.fixture(scope="module")
def server(runtime, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    with Service(ServiceConfig(model=MODEL, store_root=root, queue_size=8,
                               score_piece_tokens=32), runtime=runtime) as service, \
            background_server(service) as url:
        yield url, service


def test_choices_of_a_scored_prompt_share_one_prefill(server, monkeypatch):
    url, service = server
    ids = _ids(150, 9)
    pieces = []
    real = service.engine.runner.score_piece
    monkeypatch.setattr(service.engine.runner, "score_piece",
                        lambda seq, *a: pieces.append((seq.id, seq.width)) or real(seq, *a))
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 2,
            "n": 3, "temperature": 1.0, "seed": 4, "ignore_eos": True}
    r = httpx2.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert len(set(pieces)) == 1 and pieces[0][1] == 3    # one prefill for the three choices
    choices = r.json()["choices"]
    lps = [c["logprobs"] for c in choices]
    assert all(len(lp["token_logprobs"]) == len(ids) + 2 for lp in lps)
    assert all(lp["token_logprobs"][:len(ids)] == lps[0]["token_logprobs"][:len(ids)]
               for lp in lps)
    assert lps[0]["token_logprobs"][0] is None and len(lps[0]["top_logprobs"][1]) <= 2
    ref = assemble(service.rt, make_policy("recomp"), None).engine.serve(
        Request([], ids, 1), query_logits=True).query_logits
    want = torch.log_softmax(ref.double(), -1)[torch.arange(len(ids) - 1), ids[1:]]
    got = torch.tensor(lps[0]["token_logprobs"][1:len(ids)], dtype=torch.float64)
    assert float((got - want).abs().max()) < 1e-4


def test_a_scored_answer_too_large_is_a_clear_400(server, monkeypatch):
    url, service = server
    job = Job(_ids(5000), 1, SamplingParams(), logprobs=20, prompt_logprobs=True)
    with pytest.raises(ServiceError) as err:
        service.frontend.check_scored(job, 3)
    assert err.value.status == 400 and "log-probability entries" in str(err.value)
    service.frontend.check_scored(job, 2)   # 4999 x 21 x 2 = 209,958: within the limit
    assert 4999 * 21 * 2 <= MAX_SCORED_ENTRIES < 4999 * 21 * 3
    monkeypatch.setattr("impress_flexgen.frontend.MAX_SCORED_ENTRIES", 1000)
    body = {"model": MODEL, "prompt": _ids(100), "echo": True, "logprobs": 5, "max_tokens": 0,
            "n": 2}
    r = httpx2.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "at most 84 prompt tokens" in r.json()["error"]["message"], r.text
    body["prompt"] = body["prompt"][:84]
    assert httpx2.post(url + "/v1/completions", json=body, timeout=60).status_code == 200


@pytest.mark.slow
def test_a_long_scored_prompt_with_n_4_stalls_no_one(runtime, tmp_path):
    """A 2,000-token prompt scored with n 4 and, meanwhile, 1-token requests one after
    another: each takes at most twice its time alone (both measured here)."""
    with Service(ServiceConfig(model=MODEL, store_root=tmp_path), runtime=runtime) as service, \
            background_server(service) as url:
        got = measure_scoring_stall(url, prompt_tokens=2000, n=4)
    assert got["scored_complete"] and got["during_s"], got
    assert got["passed"], got


def test_a_service_request_of_choices_is_queued_whole(runtime, tmp_path):
    """The choices of one request take one place in the queue: all served, or all 429."""
    with Service(ServiceConfig(model=MODEL, store_root=tmp_path, queue_size=1),
                 runtime=runtime) as service:
        block = threading.Event()
        real = service._admit
        service._admit = lambda tickets: block.wait(30) and real(tickets)
        job = service.frontend.build(prompt="Hello", max_tokens=1)
        first = service.submit_choices([job, job, job])     # taken by the worker
        while service._queue.qsize():
            time.sleep(0.01)
        queued = service.submit_choices([job, job])
        with pytest.raises(ServiceError) as err:
            service.submit_choices([job, job])
        assert err.value.status == 429
        block.set()
        assert all(t.future.result(60).completion_tokens == 1 for t in first + queued)
