"""Request files: `run --requests FILE.jsonl --output OUT.jsonl` serves each line through
the store (prefix reuse, also across runs); a bad file is refused before anything is served."""
from __future__ import annotations

import json
import tracemalloc

import pytest

from impress_flexgen import defaults
from impress_flexgen.entrypoints import run
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.entrypoints.request_files import RequestFile

MODEL = "llama-tiny"
BOOK = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife. However little known the feelings or views of such "
        "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
        "minds of the surrounding families, that he is considered the rightful property of some "
        "one or other of their daughters.")


def _write(path, items) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items))


def _run(tmp_path, requests, *extra) -> list[dict]:
    out = tmp_path / "out.jsonl"
    assert run.main(["--model", MODEL, "--requests", str(requests), "--output", str(out),
                     "--store-dir", str(tmp_path / "stores"),
                     "--offload-dir", str(tmp_path / "off"), *extra]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_a_request_file_is_served_in_order_through_the_store(tmp_path, capsys):
    requests = tmp_path / "in.jsonl"
    _write(requests, [
        {"id": "book", "prompt": BOOK + " Mr. Bennet said", "max_tokens": 3},
        {"messages": [{"role": "user", "content": "Name a novel."}], "temperature": 0.7,
         "seed": 1, "max_tokens": 2},
        "",                                               # blank lines are skipped
        {"prompt_ids": [17, 18, 19, 20, 21], "id": 7, "temperature": 0},
        {"id": "again", "prompt": BOOK + " Mrs. Bennet replied"},
    ])
    lines = _run(tmp_path, requests, "--max-new-tokens", "4")
    assert [x["id"] for x in lines] == ["book", "2", "7", "again"]
    assert [x["completion_tokens"] for x in lines] == [3, 2, 4, 4]   # default: --max-new-tokens
    for x in lines:
        assert x["finish_reason"] == "length" and len(x["token_ids"]) == x["completion_tokens"]
        assert isinstance(x["text"], str) and x["stats"]["ttft_s"] > 0
    assert lines[2]["prompt_tokens"] == 5
    assert lines[0]["stats"]["matched_tokens"] == 0
    # The last request shares the book's whole chunks with the first one: read, not computed.
    assert lines[3]["stats"]["matched_tokens"] >= 64
    out = capsys.readouterr().out
    assert "4 requests" in out and "from the store" in out
    # A second run (a new store open, as a new process would) reuses what the first stored.
    again = _run(tmp_path, requests, "--max-new-tokens", "4")
    assert again[0]["stats"]["matched_tokens"] >= 64
    assert again[2]["token_ids"] == lines[2]["token_ids"]   # greedy, nothing stored: same


def test_without_output_the_answers_are_printed(tmp_path, capsys):
    requests = tmp_path / "in.jsonl"
    _write(requests, [{"prompt": "In the beginning God created", "max_tokens": 2}])
    assert run.main(["--model", MODEL, "--requests", str(requests),
                     "--store-dir", str(tmp_path / "stores"),
                     "--offload-dir", str(tmp_path / "off")]) == 0
    out = capsys.readouterr().out
    assert "--- 1:" in out and "+++ " in out and "1 requests" in out


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "fine words"}', "{not json"], "line 2: not valid JSON"),
    (['["a list"]'], "line 1: a request is a JSON object"),
    (['{"prompt": "fine words"}', '{"prompt": "x", "colour": "red"}'],
     "line 2: unknown field 'colour'"),
    (['{"prompt": ""}'], "line 1: the prompt is empty"),
    (['{"prompt": "a b c", "temperature": -1}'], "line 1: temperature"),
    (['{"prompt": "a b c", "top_p": 2}'], "line 1: top_p"),
    (['{"prompt": "a b c", "max_tokens": 0}'], "line 1: max_tokens"),
    (['{"prompt": "a b c", "prompt_ids": [1, 2]}'], "line 1: give exactly one"),
    (['{"prompt_ids": [1, 99999999]}'], "outside the vocabulary"),
    (['{"prompt": "' + "word " * 2100 + '"}'], "line 1: the prompt has"),
    ([""], "holds no requests"),
    (['{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}',
      '{"prompt": "x"}'], "line 2: every line of a batch file needs a custom_id"),
    (['{"prompt": "x"}', '{"custom_id": "a"}'], "line 2: a batch line (custom_id) in a file"),
    (['{"custom_id": 5, "body": {}}'], "line 1: custom_id must be a non-empty string"),
    (['{"prompt": "x"}', '[' * 100000], "line 2: JSON nested too deeply"),
    (['{"id": "a", "prompt": "x"}', '{"prompt": "y"}', '{"id": "a", "prompt": "z"}'],
     "line 3: id 'a' is also the id of line 1"),
    (['{"id": 2, "prompt": "x"}', '{"prompt": "y"}'],
     "line 2: id '2' (its number among the requests"),
    (['{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}'] * 2,
     "line 2: id 'a' is also the id of line 1"),
])
def test_a_bad_request_file_is_refused_before_serving(tmp_path, capsys, lines, message):
    requests = tmp_path / "in.jsonl"
    _write(requests, lines)
    out = tmp_path / "out.jsonl"
    rc = run_main("python -m impress_flexgen.run", run.main,
                  ["--model", MODEL, "--requests", str(requests), "--output", str(out),
                   "--store-dir", str(tmp_path / "stores")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists() and not (tmp_path / "stores").exists()   # nothing served


def test_request_file_flags_are_checked(tmp_path, capsys):
    for argv, message in ((["--output", "x.jsonl"], "--output goes with --requests"),
                          (["--requests", "a.jsonl", "--compare", "full,impress"], "one --policy"),
                          (["--requests", "a.jsonl", "--prompt", "hi"], "not allowed with")):
        with pytest.raises(SystemExit) as exit_:
            run.main(["--model", MODEL, *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    assert run_main("python -m impress_flexgen.run", run.main,
                    ["--model", MODEL, "--requests", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.fixture(scope="module")
def frontend():
    from impress_flexgen.frontend import Frontend
    from impress_flexgen.models.runtime import RuntimeConfig, resolve_spec
    from impress_flexgen.models.tokenizer import load_tokenizer

    spec = resolve_spec(RuntimeConfig(model=MODEL))
    return Frontend(spec, load_tokenizer(spec))


def test_request_files_use_the_defaults_of_every_entry_point(tmp_path, frontend):
    from impress_flexgen.entrypoints.request_files import read_requests

    assert (defaults.MAX_TOKENS, defaults.TEMPERATURE, defaults.TOP_P) == (256, 1.0, 1.0)
    requests = tmp_path / "in.jsonl"
    _write(requests, [{"prompt_ids": [17, 18, 19]}, {"prompt_ids": [5] * 2000},
                      {"prompt_ids": [17], "temperature": 0, "max_tokens": 3}])
    short, long, greedy = read_requests(requests, frontend)
    assert short.max_tokens == defaults.MAX_TOKENS
    assert (short.sampling.temperature, short.sampling.top_p) == (1.0, 1.0)
    assert long.max_tokens == frontend.max_positions - 2000   # what the positions leave
    assert greedy.sampling.temperature == 0 and greedy.max_tokens == 3


@pytest.mark.slow
def test_a_request_file_is_read_as_a_stream(tmp_path, frontend):
    """Memory does not grow with the file: each Job is built when it is reached."""
    def peak(n: int) -> int:
        path = tmp_path / f"in{n}.jsonl"
        line = json.dumps({"prompt_ids": list(range(100, 164)), "max_tokens": 1}) + "\n"
        path.write_text(line * n)
        requests = RequestFile(path, frontend)
        tracemalloc.start()
        try:
            assert requests.check() == n
            assert sum(1 for _ in requests.entries()) == n
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(200), peak(6000)
    assert large < small + (128 << 10), (small, large)   # a list of Jobs: several MB


def test_requests_are_submitted_ahead_and_written_in_order(tmp_path, monkeypatch):
    """A window of jobs is in the service at once (so that a batching service serves them
    together); the results still come out in the file's order."""
    from impress_flexgen.service import Service

    submit, tickets, in_flight = Service.submit, [], []

    def spy(self, job, listener=None):
        ticket = submit(self, job, listener)
        tickets.append(ticket)
        in_flight.append(sum(not t.future.done() for t in tickets))
        return ticket

    monkeypatch.setattr(Service, "submit", spy)
    requests = tmp_path / "in.jsonl"
    _write(requests, [{"id": f"q{i}", "prompt_ids": [17 + i, 18, 19], "max_tokens": 2,
                       "temperature": 0} for i in range(20)])
    lines = _run(tmp_path, requests)
    assert [x["id"] for x in lines] == [f"q{i}" for i in range(20)]
    assert 1 < max(in_flight) <= 16    # the service's queue bounds the window


@pytest.mark.slow
def test_openai_batch_lines_are_served_as_vllm_run_batch_does(tmp_path):
    def line(cid, body, url="/v1/completions", method="POST"):
        return {"custom_id": cid, "method": method, "url": url, "body": body}

    chat = [{"role": "user", "content": "Name a novel."}]
    requests = tmp_path / "batch.jsonl"
    _write(requests, [
        line("c1", {"model": MODEL, "prompt": BOOK, "max_tokens": 3, "temperature": 0}),
        line("c2", {"model": MODEL, "messages": chat, "max_completion_tokens": 2, "n": 1,
                    "stream": False, "logprobs": False}, url="/v1/chat/completions"),
        line("c3", {"model": MODEL, "input": "x"}, url="/v1/embeddings"),
        line("c4", {"prompt": "a b", "max_tokens": 0}),
        line("c5", {"model": "gpt-4o-mini", "prompt": "a b"}),
        line("c6", {"prompt": "a b", "logprobs": 2}),
        line("c7", {"prompt": [17, 18, 19], "max_tokens": 2}),
        line("c8", {"prompt": "a b"}, method="GET"),
        line("c9", {"prompt": "a b", "colour": "red"}),
    ])
    out = {x["custom_id"]: x for x in _run(tmp_path, requests)}
    assert list(out) == [f"c{i}" for i in range(1, 10)]
    for x in out.values():
        assert set(x) == {"id", "custom_id", "response", "error"}
        assert x["id"].startswith("batch_req_") and x["response"]["request_id"]
    ok = {cid: out[cid]["response"] for cid in ("c1", "c2", "c7")}
    for cid, response in ok.items():
        assert response["status_code"] == 200 and out[cid]["error"] is None
    c1, c2, c7 = (ok[c]["body"] for c in ("c1", "c2", "c7"))
    assert c1["object"] == "text_completion" and isinstance(c1["choices"][0]["text"], str)
    assert c1["usage"]["completion_tokens"] == 3 and c1["model"] == MODEL
    assert c2["object"] == "chat.completion" and c2["usage"]["completion_tokens"] == 2
    assert c2["choices"][0]["message"]["role"] == "assistant"
    assert c7["usage"]["prompt_tokens"] == 3
    errors = {"c3": (400, "/v1/embeddings"), "c4": (400, "max_tokens"),
              "c5": (404, "gpt-4o-mini"), "c6": (400, "logprobs is not supported"),
              "c8": (400, "method must be POST"), "c9": (400, "unknown field 'colour'")}
    for cid, (status, words) in errors.items():
        x = out[cid]
        assert x["response"]["status_code"] == status, x
        assert words in x["error"]["message"], x
        assert x["response"]["body"]["error"]["message"] == x["error"]["message"]
    assert out["c5"]["error"]["code"] == "model_not_found"
