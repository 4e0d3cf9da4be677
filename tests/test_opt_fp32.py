"""OPT without CUDA computes in float32 through FlexGen's layers, and still matches
transformers (more tightly than fp16 did)."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from impress_flexgen.entrypoints import verify
from impress_flexgen.errors import UserError
from impress_flexgen.models import compat
from impress_flexgen.models.runtime import Placement, Runtime, RuntimeConfig

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
PROMPT = [101, 2045, 318, 257, 1332, 286]


def _layer_outputs(rt) -> list[torch.dtype]:
    """Record the dtype of every layer's output hidden states during generation."""
    seen = []
    compute_layer = rt.model.compute_layer

    def spy(i, j, k):
        compute_layer(i, j, k)
        if j < rt.model.num_layers - 1:  # the last layer's output is token ids
            seen.append(rt.model.hidden[i][j][k].val.data.dtype)

    rt.model.compute_layer = spy
    return seen


@no_cuda
@pytest.mark.parametrize("placement", ["gpu", "mixed", "disk"])
def test_opt_on_cpu_computes_in_float32(placement, offload_dir):
    with Runtime(RuntimeConfig(model="opt-tiny", placement=Placement.parse(placement),
                               offload_dir=str(offload_dir))) as rt:
        assert rt.spec.config.dtype == np.float32
        assert {t.dtype for home in rt.model.weight_home for t in home.val} == {torch.float32}
        seen = _layer_outputs(rt)
        gen = rt.generate([PROMPT], 4, record_logits=True)  # prefill and three decode steps
        assert len(gen.new_ids[0]) == 4
        assert seen and set(seen) == {torch.float32}
        assert len(seen) == 4 * (rt.model.num_layers - 1)


@no_cuda
def test_fp16_is_still_flexgens_published_path(offload_dir):
    with Runtime(RuntimeConfig(model="opt-tiny", dtype=np.float16,
                               placement=Placement.parse("mixed"),
                               offload_dir=str(offload_dir))) as rt:
        seen = _layer_outputs(rt)
        gen = rt.generate([PROMPT], 4)
    assert len(gen.new_ids[0]) == 4 and set(seen) == {torch.float16}


def test_fp32_refuses_what_flexgen_computes_only_in_fp16():
    with pytest.raises(UserError, match="need fp16"):
        Runtime(RuntimeConfig(model="opt-tiny", dtype=np.float32, attn_sparsity=0.5))


@no_cuda
def test_the_attention_shim_touches_only_mha_gen_on_its_own_thread():
    compat.apply()
    x = torch.ones(3)
    assert x.half().dtype == torch.float16  # outside mha_gen: torch as usual
    with pytest.raises((AssertionError, RuntimeError)):
        x.cuda()  # CPU-only torch still refuses outside FlexGen's attention
    seen = {}
    compat._in_attention.dtype = torch.float32  # this thread is "inside mha_gen"
    try:
        assert x.half().dtype == torch.float32 and x.cuda() is x

        def other():
            seen["dtype"] = x.half().dtype

        t = threading.Thread(target=other)
        t.start()
        t.join()
    finally:
        compat._in_attention.dtype = None
    assert seen["dtype"] == torch.float16


def _verify(argv, tmp_path):
    out = tmp_path / "verify.json"
    rc = verify.main([*argv, "--json", str(out), "--offload-dir", str(tmp_path / "off")])
    return rc, json.loads(out.read_text())


@pytest.mark.slow
def test_verify_opt_tiny_matches_transformers_by_default(tmp_path):
    rc, result = _verify(["--model", "opt-tiny", "--prompts", "2", "--new-tokens", "12"], tmp_path)
    assert rc == 0 and result["match"], result
    assert [row["placement"].endswith("(auto)") for row in result["placements"]] == [True, False]
    if not torch.cuda.is_available():
        assert result["runtime_dtype"] == "float32"
        assert result["max_abs_logit_diff"] < 1e-4  # fp16 was ~1e-3


@pytest.mark.slow
def test_an_fp16_checkpoint_on_disk_is_cast_to_the_compute_dtype(tiny_opt_checkpoint, tmp_path):
    rc, result = _verify(["--model", "opt-tiny-hf", "--model-path", str(tiny_opt_checkpoint),
                          "--placement", "disk", "--placement", "mixed", "--prompts", "1",
                          "--new-tokens", "12"], tmp_path)
    assert rc == 0 and result["match"], result
    if not torch.cuda.is_available():
        # The conversion keeps the checkpoint at fp16, the reference has it in fp32: that
        # rounding is the difference left.
        assert result["max_abs_logit_diff"] < 2e-3
    with Runtime(RuntimeConfig(model="opt-tiny-hf", model_path=str(tiny_opt_checkpoint),
                               placement=Placement.parse("disk"),
                               offload_dir=str(tmp_path / "off"))) as rt:
        files = [t for home in rt.model.weight_home for t in home.val]
        dtypes = {np.load(t.data, mmap_mode="r").dtype for t in files}
    assert dtypes == {np.dtype(rt.spec.config.dtype)}  # what the tensors say they hold


def test_random_weights_drawn_in_place_are_the_same_values():
    from impress_flexgen.models.weights import generator_device, random_tensor

    for name, shape in (("p/layers.0.fc1.weight", (48, 32)), ("p/layers.0.fc1.bias", (48,)),
                        ("p/layers.0.final_layer_norm.weight", (32,))):
        fresh = random_tensor(name, shape, 7, 0.02, torch.float32)
        out = torch.full(shape, float("nan"), device=generator_device())
        assert random_tensor(name, shape, 7, 0.02, torch.float32, out=out) is out
        assert torch.equal(out, fresh)
