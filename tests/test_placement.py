"""FlexGen placements: the same greedy output wherever weights and KV cache live."""
from __future__ import annotations

import pytest

from impress_flexgen.models.runtime import Placement, Runtime, RuntimeConfig

PROMPTS = [[101, 2045, 318, 257, 1332, 286], [464, 2068, 7586]]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
def test_output_is_identical_across_placements_and_loops(model, offload_dir):
    outputs = {}
    for placement in ("gpu", "cpu", "disk", "mixed", "10,30,20,50,100,0"):
        for overlap in (True, False):
            with Runtime(RuntimeConfig(model=model, placement=Placement.parse(placement),
                                       overlap=overlap, offload_dir=str(offload_dir))) as rt:
                outputs[(placement, overlap)] = rt.generate([PROMPTS[0]], 8).new_ids
    reference = outputs[("gpu", True)]
    assert len(reference[0]) == 8
    assert all(out == reference for out in outputs.values()), outputs
    # Closing the runtime removed every offloaded file, mixed-device cache segments included.
    assert list(offload_dir.iterdir()) == []


@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
def test_left_padded_batch_equals_single_prompts(model, offload_dir):
    with Runtime(RuntimeConfig(model=model, gpu_batch_size=2, offload_dir=str(offload_dir))) as rt:
        batched = rt.generate(PROMPTS, 6, record_logits=True)
    with Runtime(RuntimeConfig(model=model, offload_dir=str(offload_dir))) as rt:
        single = [rt.generate([p], 6, record_logits=True) for p in PROMPTS]
    assert batched.new_ids == [s.new_ids[0] for s in single]
    for b_logits, s in zip(batched.logits, single):
        assert (b_logits - s.logits[0]).abs().max() < 0.05


def test_generation_rejects_bad_requests():
    from impress_flexgen.errors import UserError

    with Runtime(RuntimeConfig(model="opt-tiny")) as rt:
        with pytest.raises(UserError, match="outside the vocabulary"):
            rt.generate([[1, 99999999]], 2)
        with pytest.raises(UserError, match="exceed"):
            rt.generate([[5] * 1020], 8)
        with pytest.raises(UserError, match="at least one token"):
            rt.generate([[]], 2)


@pytest.mark.slow
@pytest.mark.parametrize("text", ["0,0,0,0,0,0", "100,0,100,0,0,0", "0,100,0,100,0,0"])
def test_activations_on_disk_are_refused_at_argument_checking(text, tmp_path):
    # FlexGen cannot keep activations on disk: such a placement failed mid-generation.
    import subprocess
    import sys
    from pathlib import Path

    from impress_flexgen.errors import UserError
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    with pytest.raises(UserError, match="activations cannot live on disk"):
        Placement.parse(text)
    with pytest.raises(UserError, match="activations cannot live on disk"):
        Runtime(RuntimeConfig(model="llama-tiny", offload_dir=str(tmp_path),
                              placement=Placement(*map(float, text.split(",")))))
    if text != "0,0,0,0,0,0":
        return   # one command line is enough
    out = subprocess.run([sys.executable, "-m", "impress_flexgen.run", "--model", "llama-tiny",
                          "--placement", text], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "activations cannot live on disk" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 2
