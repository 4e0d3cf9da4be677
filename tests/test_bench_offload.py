"""experiments.bench_offload on a tiny OPT: every row's fields, ours and the peer's, and the
stored prefix's row generating what the block computed."""
from __future__ import annotations

import json

import pytest
import torch

FIELDS = {"system", "dtype", "mode", "prefill_tokens_per_s", "decode_tokens_per_s",
          "tokens_per_s", "step_s", "read_s", "compute_s", "batch", "peak_rss_gb",
          "first_start_s", "next_start_s", "bytes_read", "predicted_tokens_per_s",
          "page_cache"}


@pytest.mark.slow
def test_rows_of_every_system_and_mode(tmp_path):
    from experiments import bench_offload

    out = tmp_path / "offload.json"
    assert bench_offload.main(["--model", "opt-tiny", "--prefix", "16", "--tokens", "3",
                               "--gpu-batch-size", "2", "--num-gpu-batches", "2",
                               "--timeout", "600", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["mode"], r["batch"]) for r in rows] == [
        ("ours", "sync", 1), ("ours", "overlap", 1), ("accelerate", "sync", 1),
        ("ours", "block", 4), ("accelerate", "block", 4), ("ours", "stored", 4)]
    for row in rows:
        assert FIELDS <= set(row)
        assert row["tokens_per_s"] > 0 and row["peak_rss_gb"] > 0
        assert (row["predicted_tokens_per_s"] is None) == (row["system"] == "accelerate")
    for row in (r for r in rows if r["system"] == "ours"):
        assert row["bytes_read"] > 0 and row["read_s"] > 0 and row["compute_s"] > 0
        assert row["page_cache"] is torch.cuda.is_available()   # O_DIRECT on a CPU
    assert rows[2]["offloaded"] is True            # the peer did offload to its disk folder
    # the block again with its shared prefix read from the store: the same tokens
    assert rows[5]["same_output_as_block"] is True


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_peers_checkpoint_holds_our_weights(tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    from experiments import bench_offload
    from impress_flexgen.models.reference import load_reference
    from impress_flexgen.models.runtime import resolve_spec

    job = {"model": "opt-tiny", "offload": True, "mode": "sync", "dtype": dtype,
           "gpu_batch_size": 1, "num_gpu_batches": 1, "dir": str(tmp_path / "off"),
           "hf_dir": str(tmp_path / "hf")}
    (tmp_path / "off").mkdir()
    made = bench_offload.prepare_peer(job)
    assert made["weight_bytes"] > 0
    ref = load_reference(resolve_spec(bench_offload._runtime_config(job))).state_dict()
    got = AutoModelForCausalLM.from_pretrained(job["hf_dir"], dtype=ref[
        "model.decoder.embed_tokens.weight"].dtype).state_dict()
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(got[name], t), name
