"""Shared fixtures: tiny Hugging Face checkpoints made on the spot, a private offload dir,
tiny random-weight runtimes."""
from __future__ import annotations

import os

import pytest
import torch

# Start-up progress lines come only when a step is slow, which on a busy machine is any
# time: tests that count stderr lines would see them at random (tests/test_progress.py
# turns them back on). Set here so that subprocesses inherit it.
os.environ["IMPRESS_FLEXGEN_PROGRESS"] = "0"


# Real-model, subprocess, benchmark and crash-harness tests carry @pytest.mark.slow (whole
# modules `pytestmark = pytest.mark.slow`, where a module fixture carries the cost): chosen by
# measured duration, 1.5 s and more on the 2-core machine. `pytest -m "not slow"` leaves them
# out for a quick run (CI runs everything); the marker is registered in pyproject.toml.


@pytest.fixture(scope="session")
def tiny_opt_checkpoint(tmp_path_factory):
    """A seeded random OPT saved as a Hugging Face checkpoint (no tokenizer files)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(1234)
    config = OPTConfig(vocab_size=50272, hidden_size=64, num_hidden_layers=2, ffn_dim=256,
                       num_attention_heads=4, max_position_embeddings=512,
                       word_embed_proj_dim=64, do_layer_norm_before=True)
    path = tmp_path_factory.mktemp("hf-opt-tiny")
    OPTForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory):
    """A seeded random grouped-query Llama saved as a Hugging Face checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4321)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=10000.0,
                         tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("hf-llama-tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def offload_dir(tmp_path):
    d = tmp_path / "offload"
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def tiny_runtimes(tmp_path_factory):
    """opt-tiny and llama-tiny runtimes (seeded random weights), closed after the module."""
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    off = tmp_path_factory.mktemp("off")
    rts = {m: Runtime(RuntimeConfig(model=m, offload_dir=str(off))) for m in ("opt-tiny", "llama-tiny")}
    yield rts
    for rt in rts.values():
        rt.close()
