"""experiments.reproduce and experiments.peers end to end on tiny random-weight models."""
from __future__ import annotations

import json

import pytest
import torch

from experiments import peers, reproduce
from impress_flexgen.models import dtypes

PNG = b"\x89PNG"


@pytest.mark.slow
def test_reproduce_quick_writes_every_part(tmp_path):
    out = tmp_path / "results"
    parts = "serving,ablation,sensitivity,scaling,padded,overheads"
    assert reproduce.main(["--quick", "--model", "llama-tiny", "--out", str(out),
                           "--parts", parts, "--store-root", str(tmp_path)]) == 0
    for part in parts.split(","):
        payload = json.loads((out / f"{part}.json").read_text())
        assert payload["model"] == "llama-tiny"
        assert (out / f"{part}.png").read_bytes()[:4] == PNG
    serving = json.loads((out / "serving.json").read_text())
    by = {r["label"]: r for r in serving["results"]}
    assert {"full", "recomp", "as_like", "impress"} <= set(by)
    assert by["full"]["kl"] == 0 or by["full"]["kl"] is None
    assert by["impress"]["bytes_loaded_fraction"] < by["full"]["bytes_loaded_fraction"]
    assert by["recomp"]["bytes_loaded_fraction"] == 0
    ablation = json.loads((out / "ablation.json").read_text())
    assert [r["label"] for r in ablation["ablation"]] == ["AS-like", "+ITF", "+ITF+RO",
                                                          "All (impress)"]
    assert ablation["reorder"]["without"] > 0 and ablation["reorder"]["with"] > 0
    assert set(ablation["gpu_hit_ratio"]) == {"LRU", "LFU", "score (impress)"}
    # Non-exclusive tiers by default; impress is measured under both modes.
    assert serving["tiers"]["copies"] == "non-exclusive" and not serving["tiers"]["exclusive"]
    copies = ablation["tier_copies"]
    assert set(copies) == {"non-exclusive", "exclusive"}
    assert copies["non-exclusive"]["label"] == "impress"
    assert copies["exclusive"]["duplicate_bytes"] == 0
    assert copies["exclusive"]["free_evictions"] == 0
    sens = json.loads((out / "sensitivity.json").read_text())
    knobs = {r["knob"] for r in sens["results"]}
    assert knobs == {"retention", "chunk_size", "threshold", "probe_heads"}
    ret = sorted((float(r["value"]), r["bytes_loaded_fraction"]) for r in sens["results"]
                 if r["knob"] == "retention")
    assert [b for _, b in ret] == sorted(b for _, b in ret)     # more retention, more bytes
    scaling = json.loads((out / "scaling.json").read_text())
    assert {r["prefix_tokens"] for r in scaling["results"]} == {256, 512}
    padded = json.loads((out / "padded.json").read_text())
    by_mode = {(r["workload"], r["label"]): r for r in padded["results"]}
    # The same real text: padding only adds positions nobody attends to.
    assert by_mode["padded", "full"]["bytes_loaded_fraction"] > 0
    assert by_mode["padded", "impress"]["bytes_loaded_fraction"] < \
        by_mode["natural", "impress"]["bytes_loaded_fraction"]
    over = json.loads((out / "overheads.json").read_text())
    imp = next(r for r in over["results"] if r["label"] == "impress")
    assert 0 < imp["probe_space_fraction"] < 1 and imp["metadata_space_fraction"] > 0


@pytest.mark.slow
def test_peers_quick(tmp_path):
    path = tmp_path / "peers.json"
    assert peers.main(["--quick", "--model", "llama-tiny", "--sparsity-model", "opt-tiny",
                       "--prefix-tokens", "256", "--json", str(path),
                       "--store-root", str(tmp_path)]) == 0
    payload = json.loads(path.read_text())
    labels = [r["label"] for r in payload["results"]]
    for want in ("hf-recompute", "hf-memory", "hf-disk", "ours: impress"):
        assert want in labels
    if torch.cuda.is_available():
        assert any("attn_sparsity=0.25" in x for x in labels)
    else:
        assert payload["notes"] == [peers.SPARSITY_NEEDS_CUDA]
    # Reusing the cache must compute what recomputing computes.
    assert payload["check"]["max_logit_diff_reuse_vs_recompute"] < 1e-3


def test_bad_parts():
    with pytest.raises(SystemExit) as exc:
        reproduce.main(["--parts", "nonsense"])
    assert exc.value.code == 2


def test_model_flags_reach_the_runtime():
    """A larger model at bf16 within a RAM cap: the parts run on what `run` would build
    from the same flags."""
    args = reproduce.parse_args(["--model", "opt-6.7b", "--dtype", "bf16", "--max-ram-gb",
                                 "12", "--placement", "auto", "--seed", "3"])
    cfg = reproduce.runtime_config(args)
    assert cfg.model == "opt-6.7b" and cfg.seed == 3
    assert dtypes.flag(cfg.dtype) == "bf16"
    assert cfg.max_ram_bytes == 12 * 2**30
    assert reproduce.runtime_config(reproduce.parse_args([])).dtype is None


def test_workloads_fit_the_model_positions():
    """OPT has 2,048 positions: the serving part's 2,048-token prefixes plus a query would
    run off its position table, so they are cut to whole chunks that fit."""
    sizes, notes = reproduce.fitted(reproduce.FULL, 2048)
    assert sizes.serving.prefix_tokens == 1920 and sizes.padded.prefix_tokens == 1920
    assert sizes.padded.real_tokens < sizes.padded.prefix_tokens
    assert sizes.sensitivity == reproduce.FULL.sensitivity       # 1,024 tokens fit
    assert any("serving" in n and "1920" in n for n in notes)
    same, none = reproduce.fitted(reproduce.FULL, 8192)
    assert same == reproduce.FULL and none == []
