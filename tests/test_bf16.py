"""bf16 compute end to end: weights, activations and KV in bf16 on any device, for both
families, through FlexGen's generation loop, the serving engine and its store, the weights
cache, and `verify` against transformers computing in bf16 too."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from impress_flexgen.config import dtype_of
from impress_flexgen.engine import Request, assemble, open_store
from impress_flexgen.entrypoints import verify
from impress_flexgen.models import dtypes
from impress_flexgen.models.runtime import Placement, Runtime, RuntimeConfig
from impress_flexgen.models.weights import random_tensor
from impress_flexgen.tiers import TierConfig
from policies import ServingConfig, make_policy
from tests.helpers.ids import prompt_ids
from tests.test_batching import check_equal, serve_both

BF16 = dtype_of("bf16")


@pytest.fixture(scope="module")
def bf16_runtimes(tmp_path_factory):
    off = tmp_path_factory.mktemp("off")
    rts = {m: Runtime(RuntimeConfig(model=m, offload_dir=str(off), dtype=BF16))
           for m in ("opt-tiny", "llama-tiny")}
    yield rts
    for rt in rts.values():
        rt.close()


def test_bf16_words_go_through_numpy_and_files_bit_for_bit(tmp_path):
    t = torch.randn(5, 7).to(torch.bfloat16)
    np.save(tmp_path / "w", dtypes.to_numpy(t))
    back = dtypes.from_numpy(np.load(tmp_path / "w.npy"))
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16),
                                                        t.view(torch.int16))
    assert (tmp_path / "w.npy").stat().st_size < 5 * 7 * 2 + 200      # 2 bytes a value
    assert dtypes.name(BF16) == "bfloat16" and dtypes.flag(BF16) == "bf16"
    assert dtypes.itemsize(BF16) == 2


@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
def test_bf16_generation_computes_in_bf16_near_fp32(model, bf16_runtimes, tiny_runtimes):
    rt = bf16_runtimes[model]
    prompt = prompt_ids(3, 12)
    layer = rt.model.layers[1]
    assert {w.dtype for w in rt.model.weight_home[1].val} == {torch.bfloat16}
    assert layer.compute is not None
    ours = rt.generate([prompt], 4, record_logits=True)
    ref = tiny_runtimes[model].generate([prompt], 4, record_logits=True)
    # Seeded random weights: bf16 rounds them and every activation, and stays close.
    assert (ours.logits[0][0] - ref.logits[0][0]).abs().max() < 0.05
    assert not torch.equal(ours.logits[0][0], ref.logits[0][0])


@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
def test_bf16_engine_stores_bf16_kv_and_serves_it_back_exactly(model, bf16_runtimes,
                                                               tmp_path):
    rt = bf16_runtimes[model]
    cfg = ServingConfig()
    policy = make_policy("full", cfg)
    store = open_store(tmp_path / "s", rt, cfg, policy, chunk_size=16)
    try:
        assert store.shape.kv_format == "bf16" and store.shape.kv_exact
        engine = assemble(rt, policy, store, TierConfig()).engine
        assert engine.dtype == torch.bfloat16
        prefix, query = prompt_ids(1, 48), prompt_ids(2, 3)
        first = engine.serve(Request(prefix, query, 5, keep_logits=True))
        again = engine.serve(Request(prefix, query, 5, keep_logits=True))
    finally:
        store.close()
    assert first.stats.matched_tokens == 0 and again.stats.matched_tokens == 48
    assert again.tokens == first.tokens and len(first.tokens) == 5
    for a, b in zip(first.step_logits, again.step_logits):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
def test_bf16_batched_equals_alone(model, bf16_runtimes, tmp_path):
    alone, batched = serve_both(bf16_runtimes[model], tmp_path, "full", 1.0, batch=4)
    check_equal(alone, batched)


def test_bf16_weights_are_made_once_as_bf16_words(tmp_path, monkeypatch):
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "cache"))
    outs = []
    for start in range(2):
        with Runtime(RuntimeConfig(model="llama-tiny", dtype=BF16, offload_dir=str(tmp_path),
                                   placement=Placement.parse("disk"))) as rt:
            assert rt.plan.weights_source == "cache" and rt.plan.dtype == "bfloat16"
            assert (rt.plan.weights_write > 0) == (start == 0)
            outs.append(rt.generate([prompt_ids(4, 6)], 3, record_logits=True))
            path = rt.spec.weight_path
    name = "layers.0.self_attn.q_proj.weight"
    stored = np.load(f"{path}/{name}")
    assert stored.dtype == dtypes.BF16
    want = random_tensor(name, stored.shape, 0, 0.02, torch.bfloat16).cpu()
    assert torch.equal(dtypes.from_numpy(stored).view(torch.int16), want.view(torch.int16))
    assert outs[0].new_ids == outs[1].new_ids
    assert torch.equal(outs[0].logits[0], outs[1].logits[0])


@pytest.mark.slow
def test_verify_in_bf16_against_transformers_in_bf16(tiny_llama_checkpoint, tmp_path):
    out = tmp_path / "verify.json"
    rc = verify.main(["--model", "llama-tiny-hf", "--model-path", str(tiny_llama_checkpoint),
                      "--dtype", "bf16", "--placement", "gpu", "--prompts", "2",
                      "--new-tokens", "8", "--json", str(out), "--offload-dir",
                      str(tmp_path / "off")])
    result = json.loads(out.read_text())
    assert rc == 0 and result["match"], result
    assert result["runtime_dtype"] == "bfloat16" and result["reference"].endswith("bfloat16")
    assert result["max_abs_logit_diff"] < 0.05      # measured: 0, bit for bit
