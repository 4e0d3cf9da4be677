"""Benchmarks run end to end in their quick mode."""
from __future__ import annotations

import json

import pytest

from experiments import prefill_decode


def test_prefill_decode_quick(tmp_path):
    out = tmp_path / "pd.json"
    assert prefill_decode.main(["--quick", "--placement", "gpu", "--placement", "disk",
                                "--offload-dir", str(tmp_path / "off"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 4  # two tiny models x two placements
    assert all(r["prefill_s"] > 0 and r["decode_s_per_token"] > 0 for r in rows)


def test_bench_decode_compares_the_attention_layouts(tmp_path):
    """--batch N decodes the batch with its contexts side by side and request by request,
    in turn, masked as a per-head selection leaves them."""
    from experiments import bench_decode

    out = tmp_path / "bd.json"
    assert bench_decode.main(["--model", "llama-tiny", "--tokens", "8", "--prompt", "32",
                              "--no-hf", "--batch", "3",
                              "--masked", "0.5", "--rounds", "2", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rounds"][-1]
    assert row["batch"] == 3 and row["masked"] == 0.5
    assert row["batched_tokens_per_s"] > 0 and row["per_request_attention_tokens_per_s"] > 0
    assert [len(v) for v in row["batched_runs"].values()] == [2, 2]


@pytest.mark.slow
def test_bench_decode_by_dtype_writes_one_row_per_format_and_batch(tmp_path):
    """--dtypes: fp32 (the yardstick), bf16 and 4-bit weights, each alone and in a batch of
    4, side by side; every row's greedy agreement is with fp32's tokens."""
    from experiments import bench_decode

    out = tmp_path / "bd.json"
    assert bench_decode.main(["--model", "llama-tiny", "--dtypes", "bf16,int4", "--quick",
                              "--tokens", "6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["batch"]) for r in rows] == [
        ("fp32", 1), ("fp32", 4), ("bf16", 1), ("bf16", 4), ("int4", 1), ("int4", 4)]
    assert all(r["tokens_per_s"] > 0 and 0 <= r["agree_fp32"] <= 1 for r in rows)
    assert rows[0]["agree_fp32"] == 1 and rows[0]["vs_fp32_single"] == 1
    weights = {r["dtype"]: r["weights_bytes"] for r in rows}
    assert weights["bf16"] == weights["fp32"] / 2 and weights["int4"] < weights["bf16"] / 2


def test_bench_decode_refuses_an_unknown_format():
    from experiments import bench_decode
    from impress_flexgen.errors import UserError

    with pytest.raises(UserError, match="int8.*fp32, bf16, fp16, int4"):
        bench_decode.main(["--model", "llama-tiny", "--dtypes", "fp32,int8"])


def test_bench_compute_thread_runs_both_settings(tmp_path):
    """Each round runs one fresh process per setting; the JSON has both and their ratio."""
    from experiments import bench_compute_thread

    out = tmp_path / "ct.json"
    assert bench_compute_thread.main(["--model", "llama-tiny", "--tokens", "4", "--prompt",
                                      "16", "--batch", "2", "--rounds", "1",
                                      "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got["runs"]) == {"one_team", "second_team"}
    assert all(len(v) == 1 and v[0]["batch_tokens_per_s"] > 0 for v in got["runs"].values())
    assert got["one_team_over_second_team"]["alone_tokens_per_s"] > 0


@pytest.mark.slow
def test_compression_fidelity_compares_every_format_with_fp32(tmp_path):
    """Four configurations side by side on one model: fp32 matches itself exactly, and
    4-bit weights hold fewer bytes and drift from it."""
    from experiments import compression_fidelity

    out = tmp_path / "cf.json"
    assert compression_fidelity.main(["--model", "llama-tiny", "--passages", "1",
                                      "--prompt-tokens", "16", "--forced-tokens", "4",
                                      "--json", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["fp32", "int4 weights", "int4 kv", "int4 weights + kv"]
    assert rows["fp32"]["kl_vs_fp32"] == 0 and rows["fp32"]["top1_vs_fp32"] == 1
    assert rows["int4 weights"]["weights_bytes"] < rows["fp32"]["weights_bytes"] / 4
    assert rows["int4 weights"]["kl_vs_fp32"] > 0 and rows["int4 kv"]["kl_vs_fp32"] > 0
    assert all(r["decode_s_per_token"] > 0 for r in rows.values())


@pytest.mark.slow
def test_policy_search_check_compares_every_row(tmp_path, monkeypatch):
    """Each policy runs through FlexGen's loop; predicted and measured are both there."""
    from experiments import policy_search_check
    from impress_flexgen.planner import policy_search
    from impress_flexgen.planner.machine import Machine

    machine = Machine(cuda=False, flops_per_s=1e11, bytes_per_s=2e10, unpack_per_s=2e9,
                      row_seconds=(1e-10, 1.5e-10, 3e-10, 1e-9, 4e-9), disk_bytes_per_s=1e9,
                      disk_file_s=1e-4, link_bytes_per_s=1e10, layer_s=(5e-4, 8e-4))

    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(policy_search, "measure_machine", lambda *a, **k: machine)
    out = tmp_path / "ps.json"
    assert policy_search_check.main(["--quick", "--opt", "opt-tiny", "--llama", "llama-tiny",
                                     "--prompt-tokens", "8", "--new-tokens", "3",
                                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 10
    for r in rows:
        assert r["predicted_decode_tokens_per_s"] > 0 and r["measured_decode_tokens_per_s"] > 0
        assert r["error"] == pytest.approx(
            r["measured_decode_tokens_per_s"] / r["predicted_decode_tokens_per_s"] - 1)
