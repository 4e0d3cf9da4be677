"""Request files: `run --requests FILE.jsonl --output OUT.jsonl` serves each line through
the store (prefix reuse, also across runs); a bad file is refused before anything is served."""
from __future__ import annotations

import json

import pytest

from impress_flexgen import run
from impress_flexgen.cli import run_main

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
