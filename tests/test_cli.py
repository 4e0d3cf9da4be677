"""Command lines: complete --help, bad input as one line and exit status 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from impress_flexgen.entrypoints import run

ROOT = Path(__file__).resolve().parents[1]


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-17"], "unknown model 'gpt-17'"),
    (["--bogus"], "unrecognized arguments"),
    (["--placement", "50,60,0,0,100,0"], "at most 100%"),
    (["--placement", "nowhere"], "unknown placement"),
    (["--placement", "1,2,3"], "six percentages"),
    (["--model-path", "/no/such/dir"], "no such directory"),
    (["--max-new-tokens", "0"], "at least 1"),
    (["--max-new-tokens", "many"], "invalid int value"),
    (["--model", "opt-tiny", "--prompt-ids", "1,x"], "comma-separated integers"),
    (["--model", "opt-tiny", "--prompt-ids", "1,99999999"], "outside the vocabulary"),
    (["--model", "opt-tiny", "--dtype", "fp8"], "invalid choice"),
    (["--policy", "magic"], "unknown policy"),
    (["--compare", "full,nope"], "unknown policy"),
    (["--retention", "0"], "retention"),
    (["--granularity", "word"], "invalid choice"),
    (["--prefixes", "0"], "at least 1"),
    (["--gpu-cache-gb", "-1"], "must not be negative"),
    (["--probe-queries", "-2"], "--probe-queries must be 0"),
    (["--probe-stride", "0"], "must be positive"),
    (["--probe-every", "0"], "must be positive"),
])
def test_run_bad_input_is_one_line_exit_2(args, message):
    r = _cli("impress_flexgen.run", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_verify_bad_input_is_one_line_exit_2(tmp_path):
    for args in (["--prompts", "0", "--model", "opt-tiny"], [], ["--model-path", str(tmp_path),
                                                                 "--model", "x"]):
        r = _cli("impress_flexgen.verify", *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_help_lists_every_option():
    r = _cli("impress_flexgen.run", "--help")
    assert r.returncode == 0
    for flag in ("--model", "--model-path", "--prompt", "--prompt-ids", "--max-new-tokens",
                 "--placement", "--offload-dir", "--seed", "--dtype", "--json", "--policy",
                 "--compare", "--check", "--retention", "--granularity", "--threshold",
                 "--chunk-size", "--reorder-interval", "--gpu-cache-gb", "--cpu-cache-gb",
                 "--disk-capacity-gb", "--store-dir", "--prefixes", "--prefix-tokens",
                 "--queries", "--query-tokens", "--distribution", "--quick"):
        assert flag in r.stdout


def test_run_generates_and_writes_json(tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = run.main(["--model", "llama-tiny", "--prompt-ids", "5,6,7", "--prompt-ids", "8,9",
                   "--max-new-tokens", "4", "--placement", "disk", "--json", str(out),
                   "--offload-dir", str(tmp_path / "off")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [len(r["new_ids"]) for r in result["results"]] == [4, 4]
    assert all(r["prefill_s"] > 0 for r in result["results"])
    assert "prefill" in capsys.readouterr().out


@pytest.mark.slow
def test_run_unwritable_json_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = _cli("impress_flexgen.run", "--model", "opt-tiny", "--prompt-ids", "5,6",
             "--max-new-tokens", "1", "--json", str(blocker / "x.json"))
    assert r.returncode == 2 and "cannot write" in r.stderr


@pytest.mark.slow
def test_main_job_serves_compares_and_reuses_its_store(tmp_path, capsys):
    store = tmp_path / "stores"
    out = tmp_path / "serve.json"
    argv = ["--model", "llama-tiny", "--quick", "--compare", "as_like,impress", "--check",
            "--store-dir", str(store), "--json", str(out), "--max-new-tokens", "2",
            "--offload-dir", str(tmp_path / "off")]
    assert run.main(argv) == 0
    first = json.loads(out.read_text())
    labels = [r["label"] for r in first["results"]]
    assert labels == ["full", "as_like", "impress"]
    for r in first["results"]:
        assert r["queries"] == 4 and r["ttft_mean_s"] > 0 and r["prefix_bytes_total"] > 0
        assert r["decode_s_per_token"] > 0      # 2 tokens: one decode step each
    assert first["results"][1]["kl"] is not None
    printed = capsys.readouterr().out
    assert "decode, per token after the first: full " in printed and "tokens/s" in printed
    assert run.main(argv) == 0
    assert "reusing the store left by an earlier run" in capsys.readouterr().out


@pytest.mark.slow
def test_main_job_refuses_a_foreign_store_dir(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("...")
    r = _cli("impress_flexgen.run", "--model", "llama-tiny", "--quick", "--store-dir", str(foreign))
    assert r.returncode == 2 and "not made by impress_flexgen" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
