"""verify: our runtime against transformers, token for token."""
from __future__ import annotations

import json

import pytest
import torch

from impress_flexgen.entrypoints import verify
from impress_flexgen.models import reference

pytestmark = pytest.mark.slow     # every test here runs a model or a harness end to end


def _run(argv, tmp_path):
    out = tmp_path / "verify.json"
    rc = verify.main([*argv, "--json", str(out), "--offload-dir", str(tmp_path / "off")])
    return rc, json.loads(out.read_text())


def test_tiny_opt_checkpoint_matches_transformers(tiny_opt_checkpoint, tmp_path):
    rc, result = _run(["--model", "opt-tiny-hf", "--model-path", str(tiny_opt_checkpoint)],
                      tmp_path)
    assert rc == 0, result
    assert result["match"] is True
    assert result["tokens_compared"] == 3 * 32 * 2  # prompts x tokens x (cpu, disk)
    assert set(result) >= {"model", "match", "tokens_compared", "max_abs_logit_diff"}
    assert result["max_abs_logit_diff"] < 0.05  # fp16 runtime against fp32 reference


def test_tiny_llama_checkpoint_matches_transformers(tiny_llama_checkpoint, tmp_path):
    rc, result = _run(["--model", "llama-tiny-hf", "--model-path", str(tiny_llama_checkpoint),
                       "--placement", "mixed", "--new-tokens", "16"], tmp_path)
    assert rc == 0 and result["match"], result
    assert result["max_abs_logit_diff"] < 1e-3  # both fp32


def test_smollm2_real_weights_match_transformers(tmp_path):
    rc, result = _run(["--model", "smollm2-135m"], tmp_path)
    assert rc == 0 and result["match"], result
    assert result["tokens_compared"] == 192
    assert result["max_abs_logit_diff"] < 1e-3


def test_verify_reports_a_mismatch(monkeypatch, tmp_path):
    """verify must fail when the reference differs: perturb the reference's weights."""
    real = reference.load_reference

    def perturbed(spec):
        model = real(spec)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        return model

    monkeypatch.setattr(reference, "load_reference", perturbed)
    rc, result = _run(["--model", "llama-tiny", "--prompts", "1", "--new-tokens", "4",
                       "--placement", "cpu"], tmp_path)
    assert rc == 1
    assert result["match"] is False and result["tokens_matched"] < result["tokens_compared"]


def test_compare_counts_the_matching_prefix():
    a = torch.zeros(4, 5)
    b = a.clone()
    b[2, 0] = 3.0  # differs only after the first mismatch at step 2 (same context up to it)
    assert verify.compare([1, 2, 3, 4], a, [1, 2, 3, 4], a) == (4, 0.0)
    same, diff = verify.compare([1, 2, 9, 4], a, [1, 2, 3, 4], b)
    assert same == 2 and diff == 3.0
