"""The server as vLLM's OpenAI API serves it, through the real `openai` client: prompt
log-probabilities (echo, max_tokens 0), logprobs and top_logprobs, n choices, sampling
fields, unknown fields refused, cached_tokens, include_usage, Retry-After, the extra routes,
exact answers by default."""
from __future__ import annotations

import httpx2
import openai
import pytest
import torch

from impress_flexgen import defaults
from impress_flexgen.config import ServiceConfig
from impress_flexgen.engine import Request, assemble
from impress_flexgen.entrypoints.openai.guard import ServerOptions
from impress_flexgen.entrypoints.openai.server import background_server, parse_args, server_options
from impress_flexgen.sampling import Sampler, SamplingParams
from impress_flexgen.service import Service
from policies import make_policy
from tests.helpers.fixtures import llama_tiny_runtime as runtime  # noqa: F401 - a fixture

MODEL = "llama-tiny"
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife. However little known the feelings or views of "
        "such a man may be on his first entering a neighbourhood, this truth is so well "
        "fixed in the minds of the surrounding families.")


@pytest.fixture(scope="module")
def server(runtime, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    with Service(ServiceConfig(model=MODEL, store_root=root, queue_size=8),
                 runtime=runtime) as service, background_server(service) as url:
        yield url, service


def _api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_echo_logprobs_max_tokens_0_equal_the_reference_log_softmax(server, runtime):
    url, service = server
    done = _api(url).completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1,
                                        max_tokens=0)
    choice = done.choices[0]
    ids = service.frontend.encode(TEXT)
    lp = choice.logprobs
    assert choice.text == TEXT and len(lp.token_logprobs) == len(ids) == len(lp.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert done.usage.completion_tokens == 0 and done.usage.prompt_tokens == len(ids)
    # The reference: the whole prompt computed by an engine with no store.
    engine = assemble(runtime, make_policy("recomp"), None).engine
    ref = engine.serve(Request([], ids, 1), query_logits=True).query_logits
    want = torch.log_softmax(ref.double(), -1)[torch.arange(len(ids) - 1), ids[1:]]
    got = torch.tensor(lp.token_logprobs[1:], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_logprobs_of_generated_tokens_and_chat_top_logprobs(server):
    url, _ = server
    api = _api(url)
    done = api.completions.create(model=MODEL, prompt="Shall I compare thee", max_tokens=4,
                                  temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 == done.usage.completion_tokens
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and value == pytest.approx(max(top.values()), abs=1e-6)
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 3
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_n_choices_and_sampling_fields(server):
    url, _ = server
    api = _api(url)
    two = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=2,
                                 temperature=1.5, seed=3)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.completion_tokens == 10
    greedy = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                    temperature=0).choices[0].text
    # top_k 1 is greedy whatever the temperature (vLLM's meaning).
    topk = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                  temperature=2.0, extra_body={"top_k": 1})
    assert topk.choices[0].text == greedy
    minp = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                  temperature=2.0, extra_body={"min_p": 1.0})
    assert minp.choices[0].text == greedy
    ids = httpx2.post(url + "/tokenize", json={"prompt": greedy}).json()["tokens"]
    cut = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                 temperature=0, extra_body={"stop_token_ids": [ids[1]]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 1
    held = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                  temperature=0, extra_body={"stop_token_ids": [ids[1]],
                                                             "min_tokens": 3})
    assert held.usage.completion_tokens >= 3


def test_min_tokens_holds_back_stop_tokens_and_top_k_narrows():
    logits = torch.zeros(50)
    logits[7] = 10.0                         # the stop token is the likeliest
    sampler = Sampler(SamplingParams(stop_token_ids=(7,), min_tokens=2))
    assert [sampler.pick(logits) for _ in range(3)] == [0, 0, 7]
    logits = torch.randn(200, generator=torch.Generator().manual_seed(1))
    top = set(logits.topk(3).indices.tolist())
    s = Sampler(SamplingParams(temperature=2.0, top_k=3, seed=0))
    assert {s.pick(logits) for _ in range(60)} <= top


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 1, "stream": True}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 17}, "n"),
])
def test_unknown_and_unsupported_fields_are_400_naming_the_field(server, fields, param):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as err:
        _api(url).completions.create(model=MODEL, prompt="Hello", extra_body=fields)
    assert err.value.body["param"] == param and param in err.value.body["message"]


def test_cached_tokens_and_include_usage(server):
    _, service = server
    with background_server(service, options=ServerOptions(prompt_tokens_details=True)) as url:
        _cached_tokens_and_include_usage(url)


def _cached_tokens_and_include_usage(url):
    api = _api(url)
    messages = [{"role": "system", "content": TEXT}, {"role": "user", "content": "Why?"}]
    api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                        temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    parts = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                             temperature=0, stream=True))
    assert all(p.usage is None for p in parts)
    parts = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == 2
    assert all(p.usage is None for p in parts[:-1])
    assert parts[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_routes_models_tokenize_detokenize_version_retry_after(server):
    url, service = server
    api = _api(url)
    assert api.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-17")
    tok = httpx2.post(url + "/tokenize", json={"model": MODEL, "prompt": TEXT}).json()
    assert tok["tokens"] == service.frontend.encode(TEXT) and tok["count"] == len(tok["tokens"])
    back = httpx2.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back == {"prompt": TEXT}
    assert httpx2.get(url + "/version").json()["version"]
    assert httpx2.post(url + "/tokenize", json={"prompt": 3}).status_code == 400
    from impress_flexgen.errors import ServiceError

    submit = service.submit_choices

    def full(*a, **kw):
        raise ServiceError(429, "server busy", kind="rate_limit_error")

    service.submit_choices = full
    try:
        r = httpx2.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    finally:
        service.submit_choices = submit
    assert r.status_code == 429 and r.headers["retry-after"] == "1"


def test_retry_after_is_the_time_the_queue_takes_to_drain_at_the_measured_rate(server):
    """A full queue's 429 says when its requests will have left at the rate requests left
    lately: 8 queued, 4 left in the 8 s the worker has been busy: 16 s (not 1 s)."""
    import threading

    from impress_flexgen.metrics import MAX_RETRY_AFTER_S, Drain

    url, service = server
    now = [1000.0]
    measured = Drain(clock=lambda: now[0])
    release, stepping = threading.Event(), threading.Event()
    step = service.engine.step

    def held_step():            # the worker holds its batch: nothing leaves meanwhile
        stepping.set()
        release.wait(30)
        return step()

    drain, service.drain = service.drain, measured
    service.engine.step = held_step
    tickets = []
    try:
        tickets.append(service.submit(service.frontend.build(prompt="Hi", max_tokens=1)))
        assert stepping.wait(30)
        tickets += [service.submit(service.frontend.build(prompt="Hi", max_tokens=1))
                    for _ in range(service.config.queue_size)]
        measured.busy()                     # at 1000 s
        for t in (1001.0, 1002.0, 1003.0, 1004.0):
            now[0] = t
            measured.left()
        now[0] = 1008.0
        r = httpx2.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        now[0] = 1009.0
        measured.busy()                     # a fresh start: nothing measured yet, 0 s busy
        first = measured.retry_after_s(8)
        now[0] = 1100.0                     # busy 91 s, nothing left: at most 1 per 30 s
        stalled = measured.retry_after_s(8)
    finally:
        service.engine.step = step
        release.set()
        for t in tickets:
            t.future.result(60)
        service.drain = drain
    assert r.status_code == 429 and r.headers["retry-after"] == "16"
    assert "16 s" in r.json()["error"]["message"]
    assert first == 1 and stalled == MAX_RETRY_AFTER_S


def test_exact_by_default_stored_prefix_changes_no_greedy_output(runtime, tmp_path):
    args = parse_args(["--model", MODEL])
    assert args.policy == "full"
    assert (defaults.MAX_TOKENS, defaults.TEMPERATURE, defaults.TOP_P) == (256, 1.0, 1.0)
    config = ServiceConfig.from_args(args, queue_size=4)
    config = ServiceConfig(runtime=config.runtime, run=config.run, tiers=config.tiers,
                           store_root=tmp_path, queue_size=4)
    messages = [{"role": "system", "content": TEXT + " " + TEXT},
                {"role": "user", "content": "Tell me more."}]
    options = server_options(parse_args(["--enable-prompt-tokens-details"]))
    with Service(config, runtime=runtime) as service, \
            background_server(service, options=options) as url:
        api = _api(url)
        before = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                             temperature=0)
        after = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                            temperature=0)
    assert before.usage.prompt_tokens_details.cached_tokens == 0
    assert after.usage.prompt_tokens_details.cached_tokens > 0
    assert after.choices[0].message.content == before.choices[0].message.content
    assert after.usage.completion_tokens == 12


def test_lm_eval_local_completions_request_shapes(server, runtime):
    """What lm-evaluation-harness's local-completions sends (token ids, batch of one) and how
    it reads the answer: the continuation's log-likelihood and whether it is greedy."""
    url, service = server
    context = service.frontend.encode(TEXT)
    continuation = service.frontend.encode(" and so it was")
    payload = {"model": MODEL, "prompt": [context + continuation], "temperature": 0,
               "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    out = httpx2.post(url + "/v1/completions", json=payload, timeout=60).json()
    choice = sorted(out["choices"], key=lambda c: c["index"])[0]
    lps = choice["logprobs"]["token_logprobs"][len(context):-1]
    tops = choice["logprobs"]["top_logprobs"][len(context):-1]
    assert len(lps) == len(continuation)
    assert len(choice["logprobs"]["token_logprobs"]) == len(context + continuation) + 1
    greedy = all(lp == max(top.values()) for lp, top in zip(lps, tops))
    ids = context + continuation
    engine = assemble(runtime, make_policy("recomp"), None).engine
    ref = torch.log_softmax(engine.serve(Request([], ids, 1), query_logits=True)
                            .query_logits.double(), -1)
    rows = torch.arange(len(context) - 1, len(ids) - 1)
    want = ref[rows, torch.tensor(continuation)]
    assert sum(lps) == pytest.approx(float(want.sum()), abs=1e-3)
    assert greedy == bool((ref[rows].argmax(-1) == torch.tensor(continuation)).all())
    gen = {"model": MODEL, "prompt": [context], "max_tokens": 4, "temperature": 0,
           "stop": ["\n\n", "<|endoftext|>"], "seed": 1234}
    out = httpx2.post(url + "/v1/completions", json=gen, timeout=60).json()
    assert isinstance(out["choices"][0]["text"], str)


def test_metrics_count_matched_tokens_only_when_loaded(runtime, tmp_path):
    from impress_flexgen.bench.runner import RunConfig

    config = ServiceConfig(model=MODEL, store_root=tmp_path,
                           run=RunConfig("full", "full", plan="recompute"))
    prompt = list(range(300, 300 + 64)) + [5]
    with Service(config, runtime=runtime) as service, background_server(service) as url:
        for _ in range(2):
            done = service.complete(service.frontend.build(prompt_ids=prompt, max_tokens=1))
        text = httpx2.get(url + "/metrics", timeout=10).text
    assert done.stats["matched_tokens"] == 64 and done.stats["cached_tokens"] == 0
    assert 'impress_flexgen_prompt_tokens_total{source="matched"} 0.0' in text
    assert 'impress_flexgen_prompt_tokens_total{source="computed"} 130.0' in text
