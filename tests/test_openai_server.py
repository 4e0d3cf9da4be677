"""The OpenAI-compatible server, driven by the real `openai` client over loopback: answers,
streaming, errors, prefix reuse through the store, a bounded load test, cancellation,
SIGTERM, and the serving benchmark's quick run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from impress_flexgen.config import RunConfig, ServiceConfig
from impress_flexgen.engine import model_shape, open_store
from impress_flexgen.entrypoints import run
from impress_flexgen.entrypoints.openai.guard import ServerOptions
from impress_flexgen.entrypoints.openai.server import background_server
from impress_flexgen.errors import ServiceError
from impress_flexgen.frontend import TextStream, sampling_params
from impress_flexgen.sampling import Sampler, SamplingParams
from impress_flexgen.service import Service
from policies import make_policy
from tests.helpers.fixtures import llama_tiny_runtime as runtime  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama-tiny"
SYSTEM = ("You are a careful reader of old books. It is a truth universally acknowledged, "
          "that a single man in possession of a good fortune, must be in want of a wife. "
          "However little known the feelings or views of such a man may be on his first "
          "entering a neighbourhood, this truth is so well fixed in the minds of the "
          "surrounding families, that he is considered the rightful property of some one or "
          "other of their daughters. \"My dear Mr. Bennet,\" said his lady to him one day, "
          "\"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that "
          "he had not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and "
          "she told me all about it.\"")


@pytest.fixture(scope="module")
def server(runtime, tmp_path_factory):
    """(base url, service, store root): one server for the tests that leave it running."""
    root = tmp_path_factory.mktemp("stores")
    service = Service(ServiceConfig(model=MODEL, store_root=root, queue_size=8), runtime=runtime)
    try:
        with background_server(service, options=ServerOptions(cache_stats=True)) as url:
            yield url, service, root
    finally:
        service.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(url: str) -> dict:
    """{(name, labels): value} from GET /metrics."""
    text = httpx2.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _metric(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


# -- answers ----------------------------------------------------------------------------------
def test_completion_and_chat_through_the_openai_client(server):
    url, _, _ = server
    api = _client(url)
    assert [m.id for m in api.models.list().data] == [MODEL]
    assert httpx2.get(url + "/health").json() == {"status": "ready", "model": MODEL}
    done = api.completions.create(model=MODEL, prompt="Shall I compare thee to a summer's day?",
                                  max_tokens=5, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert done.usage.completion_tokens == 5 and done.usage.prompt_tokens > 5
    assert done.model_extra["impress_flexgen"]["computed_tokens"] == done.usage.prompt_tokens
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Who wrote Hamlet?"}],
        max_tokens=4, temperature=0.8, top_p=0.9, seed=7)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
    # The same seed draws the same tokens (a prompt shorter than a chunk: nothing stored,
    # so both requests compute the same logits).
    seeded = [api.completions.create(model=MODEL, prompt="Thou art more lovely", max_tokens=6,
                                     temperature=1.2, seed=seed).choices[0].text
              for seed in (7, 7, 8)]
    assert seeded[0] == seeded[1] != seeded[2]


def test_streaming_equals_the_whole_answer(server):
    url, _, _ = server
    api = _client(url)
    prompt = "In the beginning God created the heaven and the earth. And the earth was"
    whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    parts = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                        temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"
    assert [p.choices[0].finish_reason for p in parts[:-1]] == [None] * (len(parts) - 1)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                        temperature=0)
    parts = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                             temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == \
        whole.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == "length"
    # The raw stream is OpenAI's: data lines, ending with [DONE].
    with httpx2.stream("POST", url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_greedy_output_equals_plain_generation(server, tmp_path):
    """The server's greedy answer is what `run --prompt` generates (same model, prompt)."""
    url, service, _ = server
    prompt = "Rough winds do shake the darling buds of May, and summer's lease hath"
    out = tmp_path / "plain.json"
    assert run.main(["--model", MODEL, "--prompt", prompt, "--max-new-tokens", "6",
                     "--json", str(out), "--offload-dir", str(tmp_path / "off")]) == 0
    plain = json.loads(out.read_text())["results"][0]
    done = _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                           temperature=0)
    assert done.choices[0].text == plain["text"]
    job = service.frontend.build(prompt=prompt, max_tokens=6)   # greedy by default
    assert service.complete(job).token_ids == plain["new_ids"]


def test_a_shared_prefix_is_read_from_the_store(server):
    url, _, _ = server
    api = _client(url)
    before = _metrics(url)
    first = api.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "Who is the single man?"}],
        max_tokens=2, temperature=0)
    second = api.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "And the daughters?"}],
        max_tokens=2, temperature=0)
    assert first.model_extra["impress_flexgen"]["matched_tokens"] == 0
    matched = second.model_extra["impress_flexgen"]["matched_tokens"]
    assert matched >= 64 and matched % 16 == 0      # whole chunks of the system prompt
    after = _metrics(url)
    grew = (_metric(after, "impress_flexgen_prompt_tokens_total", source="matched") -
            _metric(before, "impress_flexgen_prompt_tokens_total", source="matched"))
    assert grew == matched
    read = sum(_metric(after, "impress_flexgen_kv_bytes_read_total", tier=t) -
               _metric(before, "impress_flexgen_kv_bytes_read_total", tier=t)
               for t in ("gpu", "cpu", "disk"))
    assert read > 0
    assert _metric(after, "impress_flexgen_store_bytes") > 0
    assert _metric(after, "impress_flexgen_ttft_seconds_count") >= 2


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, status, param", [
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "word " * 2100}, 400, "prompt"),
    ({"prompt": "Hello there", "max_tokens": 2047}, 400, "max_tokens"),
    ({"prompt": "Hello there", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "Hello there", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "Hello there", "top_p": 0}, 400, "top_p"),
    ({"prompt": "Hello there", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "Hello there", "n": 17}, 400, "n"),
    ({"prompt": "Hello there", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": [1, 999999]}, 400, "prompt"),
    ({"prompt": ["one", "two"]}, 400, "prompt"),
    ({"prompt": "Hello there", "model": "gpt-17"}, 404, "model"),
])
def test_bad_requests_get_openai_errors(server, fields, status, param):
    url, _, _ = server
    body = {"model": MODEL, "max_tokens": 2, **fields}
    model = body.pop("model")
    with pytest.raises(openai.APIStatusError) as err:
        _client(url).completions.create(model=model, **body)
    assert err.value.status_code == status
    error = err.value.body
    assert error["param"] == param and error["message"] and error["type"]


def test_malformed_bodies_get_400_not_500(server):
    url, _, _ = server
    before = _metric(_metrics(url), "impress_flexgen_requests_total", outcome="invalid")
    cases = [b"{not json", b"", b"[1, 2]", b'{"prompt": "no model"}',
             b'{"model": "llama-tiny", "prompt": "x y", "max_tokens": "many"}',
             b'{"model": "llama-tiny", "prompt": "x y", "temperature": NaN}']
    for body in cases:
        r = httpx2.post(url + "/v1/completions", content=body,
                        headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx2.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx2.post(url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    assert httpx2.get(url + "/v1/nothing").status_code == 404
    after = _metric(_metrics(url), "impress_flexgen_requests_total", outcome="invalid")
    assert after - before == len(cases) + 2


def test_a_model_without_chat_template_refuses_chat(server):
    _, service, _ = server
    hf = service.frontend.tokenizer.hf
    saved, hf.chat_template = hf.chat_template, None
    try:
        with pytest.raises(ServiceError) as err:
            service.frontend.build(messages=[{"role": "user", "content": "hi"}])
    finally:
        hf.chat_template = saved
    assert err.value.status == 400 and "no chat template" in err.value.message


# -- text, sampling -----------------------------------------------------------------------------
def test_stop_strings_end_and_trim_the_text_and_are_never_streamed():
    pieces = {1: "Hello", 2: " wor", 3: "ld", 4: "! The", 5: " end"}
    sent = []
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), ("world!",), sent.append)
    assert stream.push(1) and stream.push(2) and stream.push(3)
    assert "".join(sent) == "Hello "              # "world" could begin the stop string
    assert not stream.push(4)
    assert stream.finish() == "Hello " and "".join(sent) == "Hello "
    plain = TextStream(lambda ids: "".join(pieces[i] for i in ids), ("zz",), sent.clear())
    for i in (1, 2, 3):
        plain.push(i)
    assert plain.finish() == "Hello world"


def test_sampling_is_greedy_at_zero_and_reproducible_with_a_seed():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    assert Sampler(None).pick(logits) == best
    assert Sampler(SamplingParams(temperature=0.0, seed=1)).pick(logits) == best
    assert Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=1)).pick(logits) == best
    draw = [Sampler(SamplingParams(temperature=1.5, seed=11)).pick(logits) for _ in range(2)]
    assert draw[0] == draw[1]
    many = Sampler(SamplingParams(temperature=1.5, seed=11))
    assert len({many.pick(logits) for _ in range(50)}) > 5   # it does sample
    nucleus = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=2))
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True)
    head = set(order[:int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    assert {nucleus.pick(logits) for _ in range(100)} <= head
    for bad in ({"temperature": float("nan")}, {"top_p": 0.0}, {"seed": 1.5}):
        with pytest.raises(ServiceError):
            sampling_params(**bad)


def test_a_stop_string_ends_generation_early(server):
    url, service, _ = server
    api = _client(url)
    prompt = "And God said, let there be light: and there was light."
    free = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    cut = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                 stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.usage.completion_tokens < 8


# -- queueing, cancellation, timeouts -----------------------------------------------------------
def test_a_client_that_goes_away_cancels_its_request(server):
    url, _, _ = server
    before = _metrics(url)
    with httpx2.stream("POST", url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500,
            "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break                          # one token arrived; hang up
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = _metrics(url)
        if _metric(after, "impress_flexgen_requests_total", outcome="cancelled") > \
                _metric(before, "impress_flexgen_requests_total", outcome="cancelled"):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the request was not cancelled")
    generated = (_metric(after, "impress_flexgen_completion_tokens_total") -
                 _metric(before, "impress_flexgen_completion_tokens_total"))
    assert generated < 1500
    # Without streaming too: a client that stops waiting cancels its request.
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(url + "/v1/completions", timeout=0.5, json={
            "model": MODEL, "prompt": "Twice upon a time", "max_tokens": 1500,
            "temperature": 0})
    deadline = time.monotonic() + 20
    while _metric(_metrics(url), "impress_flexgen_requests_total", outcome="cancelled") < \
            _metric(after, "impress_flexgen_requests_total", outcome="cancelled") + 1:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.1)


def test_a_request_past_its_deadline_ends_with_timeout(runtime, tmp_path):
    config = ServiceConfig(model=MODEL, store_root=tmp_path, timeout_s=0.3,
                           run=RunConfig("recomp", "recomp"))
    with Service(config, runtime=runtime) as service:
        long = service.submit(service.frontend.build(prompt="Long ago and far away",
                                                     max_tokens=1900))
        queued = service.submit(service.frontend.build(prompt="Never mind this", max_tokens=3))
        queued.cancel()                 # while the long one runs: it is skipped
        done = long.future.result(timeout=60)
        assert done.finish_reason == "timeout" and 1 <= done.completion_tokens < 1900
        with pytest.raises(ServiceError) as err:
            queued.future.result(timeout=30)
        assert err.value.status == 499


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_load_every_request_answered_or_rejected_and_the_store_reopens(runtime, tmp_path):
    """200 requests from 16 concurrent clients against a 4-deep queue: each gets an answer
    or a 429, none is lost or hangs; then the store reopens and reads back every prefix."""
    root = tmp_path / "stores"
    config = ServiceConfig(model=MODEL, store_root=root, queue_size=4)
    rng = np.random.default_rng(5)
    prompts = [SYSTEM + f" Question {i}: " + " ".join(
        rng.choice(["why", "how", "when", "who", "where"], 6 + i % 20)) for i in range(40)]
    outcomes: list = []
    lock = threading.Lock()
    with Service(config, runtime=runtime) as service, background_server(service) as url:
        before = _metrics(url)

        def client(k: int) -> None:
            api = _client(url)
            for n in range(k, 200, 16):
                try:
                    r = api.completions.create(model=MODEL, prompt=prompts[n % len(prompts)],
                                               max_tokens=2, temperature=0, timeout=60)
                    got = ("ok", r.usage.completion_tokens)
                except openai.RateLimitError as exc:
                    got = ("429", exc.body["message"])
                except Exception as exc:  # noqa: BLE001 - recorded, then asserted on
                    got = ("failed", repr(exc))
                with lock:
                    outcomes.append(got)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in threads), "a client hung"
        elapsed = time.monotonic() - t0
        after = _metrics(url)
        store_dir = service.store_dir
        run_cfg = service.config.run
    kinds = [k for k, _ in outcomes]
    assert len(outcomes) == 200 and set(kinds) <= {"ok", "429"}, \
        [o for o in outcomes if o[0] == "failed"][:3]
    assert kinds.count("ok") > 0 and kinds.count("429") > 0, elapsed
    assert all(v == 2 for k, v in outcomes if k == "ok")
    assert all("server busy" in v for k, v in outcomes if k == "429")
    delta = {o: _metric(after, "impress_flexgen_requests_total", outcome=o) -
             _metric(before, "impress_flexgen_requests_total", outcome=o)
             for o in ("ok", "rejected")}
    assert delta == {"ok": kinds.count("ok"), "rejected": kinds.count("429")}
    # Reopened after a clean close: every stored node reads back, CRCs checked.
    shape = model_shape(runtime.spec)
    with open_store(store_dir, runtime, run_cfg.serving(),
                    make_policy(run_cfg.policy, run_cfg.serving()),
                    **run_cfg.store_options()) as store:
        assert len(store.inspect().state.tree) > 0
        tok = runtime.tokenizer
        for p in prompts:
            match = store.match_prefix(tok.encode(p))
            try:
                assert match.length >= 96          # at least the shared system prompt
                for node in match.nodes:
                    for layer in range(shape.n_layers):
                        k, v = store.inspect().reads.read_layer(store.entry(node, layer), node)
                        assert torch.isfinite(k.float()).all() and torch.isfinite(v.float()).all()
            finally:
                store.release(match)


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_the_next_server_reuses_the_store(
        runtime, tmp_path):
    root = tmp_path / "stores"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "impress_flexgen.serve", "--model", MODEL, "--port", "0",
         "--store-dir", str(root), "--offload-dir", str(tmp_path / "off"),
         "--log-level", "warning"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("serving "):
                url = line.split(" on ")[1].split("/v1")[0]
        assert url, proc.stderr.read() if proc.poll() is not None else "no serving line"
        prompt = SYSTEM + " What happened next?"
        with httpx2.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)     # mid-answer
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-2][len("data: "):])
        last = json.loads(rest[-3][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length" and final["choices"] == []
        assert final["usage"]["completion_tokens"] == 400 and first
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # A new server process on the same store reads the prefix the old one stored.
    with Service(ServiceConfig(model=MODEL, store_root=root), runtime=runtime) as service:
        done = service.complete(service.frontend.build(prompt=prompt, max_tokens=1))
        assert done.stats["matched_tokens"] >= 96


def test_serve_cli_refuses_bad_input_in_one_line(capsys):
    from impress_flexgen.entrypoints.openai import server as serve
    from impress_flexgen.entrypoints.process import run_main

    for args, message in ((["--port", "70000"], "between 0 and 65535"),
                          (["--queue-size", "0"], "at least 1"),
                          (["--policy", "magic"], "unknown policy"),
                          (["--timeout-s", "nan"], "finite")):
        with pytest.raises(SystemExit) as exit_:
            serve.main([*args, "--port", "0"] if args[0] != "--port" else args)
        assert exit_.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, lines)
    for args, message in ((["--model", "gpt-17"], "unknown model"),
                          (["--host", "256.1.1.1"], "cannot listen")):
        assert run_main("python -m impress_flexgen.serve", serve.main,
                        [*args, "--port", "0"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, lines)


# -- the benchmark ------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_serve_quick_compares_three_policies(tmp_path, capsys):
    from experiments import bench_serve

    out = tmp_path / "bench.json"
    assert bench_serve.main(["--quick", "--model", MODEL, "--json", str(out),
                             "--store-root", str(tmp_path)]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"impress", "full", "recomp"}
    for r in rows.values():
        assert r["requests"] == 4 and r["ttft_mean_s"] > 0 and r["requests_per_s"] > 0
    assert rows["recomp"]["matched_fraction"] == 0
    assert rows["impress"]["matched_fraction"] > 0 and rows["full"]["matched_fraction"] > 0
    assert "TTFT mean" in capsys.readouterr().out
    assert not list(tmp_path.glob("benchserve-*"))      # temporary stores removed
    batching = json.loads(out.read_text())["batching"]
    assert {(r["clients"], r["max_batch_size"]) for r in batching} == \
        {(1, 8), (4, 8), (1, 1), (4, 1)}
    assert all(r["output_tokens_per_s"] > 0 and r["ttft_p99_s"] > 0 and "tpot_mean_s" in r
               for r in batching)
