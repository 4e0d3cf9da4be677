"""FlexGen's group-wise 4-bit compression on a CPU: its bytes and arithmetic (and those of
its GPU branch, run here on CPU tensors), weights and KV cache in FlexGen's own loop at
every placement, and through the serving engine's prefill pass and decode batch."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from impress_flexgen.engine import Request, SchedulerConfig, assemble, open_store
from impress_flexgen.engine.sequence import CompressedKV, LayerKV
from impress_flexgen.models import compat, quant
from impress_flexgen.models.base import compressed_new
from impress_flexgen.models.quant import Groups
from impress_flexgen.models.runtime import Placement, Runtime, RuntimeConfig
from impress_flexgen.tiers import TierConfig
from policies import ServingConfig, make_policy
from tests.helpers.ids import prompt_ids

# The published module copy indexes with lists (torch warns; ours passes tuples).
pytestmark = pytest.mark.filterwarnings("ignore:Using a non-tuple sequence:UserWarning")

PROMPT = prompt_ids(3, 40)
MODELS = ["opt-tiny", "llama-tiny"]
# 4-bit weights (groups of 64) on seeded N(0, 0.02) weights move each matrix by ~9% (RMS):
# a step's logits over the same context stay this close to the uncompressed model's.
WEIGHT_COS, WEIGHT_REL = 0.95, 0.3
CACHE_REL = 0.05          # 4-bit KV (the query's own token exact): per decode step


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Weights made once go to a cache of this module's own."""
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def _published():
    """flexgen/compression.py as published: a second copy of the module, which compat
    has not routed through quant.py."""
    import flexgen

    compat.apply()
    path = Path(flexgen.__file__).parent / "compression.py"
    spec = importlib.util.spec_from_file_location("flexgen_compression_published", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stored(data, scale, shape, dtype, config, device):
    """A compressed TorchTensor as FlexGen's buffers hold it (fp16 scales)."""
    from flexgen.pytorch_backend import TorchDevice, TorchTensor

    cpu = TorchDevice("cpu")
    return TorchTensor(shape, dtype, (TorchTensor.create_from_torch(data, cpu),
                                      TorchTensor.create_from_torch(scale.half(), cpu),
                                      config), device)


def _similar(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(least cosine of the centred rows, largest relative distance of a row)."""
    cos = F.cosine_similarity(a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True), -1)
    rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
    return float(cos.min()), float(rel.max())


def _shared_context(ours: list[int], theirs: list[int]) -> int:
    """Steps whose logits came from the same context: up to the first token that differs
    (a random model's near ties), that step included."""
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    return min(same + 1, len(ours))


def test_flexgens_cpu_decompression_fails_without_a_cache_workspace():
    """The premise: FlexGen's own code cannot read a compressed weight on a CPU."""
    from flexgen.pytorch_backend import TorchDevice

    published = _published()
    dev = published.TorchCompressedDevice(TorchDevice("cpu"))
    config = published.CompressionConfig(4, 64, 0, False)
    with pytest.raises(TypeError, match="NoneType"):
        dev.decompress(dev.compress(torch.randn(128, 64), config))


@pytest.mark.parametrize("shape,size,dim", [((128, 64), 64, 0), ((100, 72), 64, 1),
                                            ((30, 6, 16), 16, 2), ((40, 6, 16), 16, 0)])
def test_the_bytes_and_values_are_flexgens(shape, size, dim):
    from flexgen.pytorch_backend import TorchDevice

    published = _published()
    config = published.CompressionConfig(4, size, dim, False)
    x = torch.randn(shape)
    dev = published.TorchCompressedDevice(TorchDevice("cpu"))
    theirs = dev.compress(x, config)
    data, scale = quant.compress(x, size, dim)
    assert torch.equal(data, theirs.data[0].data)
    assert torch.equal(scale, theirs.data[1].data.half())
    # FlexGen's CPU arithmetic, given the float32 workspace it allocates for a KV cache.
    grouped = list(data.shape)
    grouped[dim:dim + 1] = [data.shape[dim] * 2 // size, size]
    dev.data_decompress_workspace = [torch.empty(grouped) for _ in range(2)]
    want = dev.decompress(_stored(data, scale, shape, torch.float32, config, dev))
    got = quant.decompress(data, scale, shape, size, dim, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert float((got - x).abs().max()) < float((x.amax() - x.amin()) / 15)


def test_the_gpu_branch_keeps_flexgens_shapes_dtypes_and_fp16_arithmetic():
    """What a CUDA machine runs, on CPU tensors: fp16 worked in fp16 exactly as FlexGen's
    GPU branch does (FlexGen's own, given a CUDA base device, runs here too), and fp32
    weights come back fp32 (FlexGen's would be fp16)."""
    from flexgen.pytorch_backend import TorchDevice

    published = _published()
    config = published.CompressionConfig(4, 64, 0, False)
    gpu = published.TorchCompressedDevice(TorchDevice("cuda:0"))
    x = (torch.randn(100, 96) * 0.02).half()
    data, scale = quant.compress(x, 64, 0, on_cuda=True)
    assert data.dtype == torch.uint8 and tuple(data.shape) == (64, 96)
    assert scale.dtype == torch.float16 and tuple(scale.shape) == (2, 2, 96)
    want = gpu.decompress(_stored(data, scale, x.shape, torch.float16, config, gpu))
    got = quant.decompress(data, scale, x.shape, 64, 0, torch.float16, on_cuda=True)
    assert got.dtype == want.dtype == torch.float16 and torch.equal(got, want)
    wide = quant.decompress(data, scale, x.shape, 64, 0, torch.float32, on_cuda=True)
    assert wide.dtype == torch.float32 and tuple(wide.shape) == (100, 96)
    assert float((wide - x.float()).abs().max()) < 0.01


def test_a_decompressed_weight_still_held_is_never_overwritten():
    x, y = torch.randn(128, 64), torch.randn(128, 64)
    (dx, sx), (dy, sy) = quant.compress(x, 64, 0), quant.compress(y, 64, 0)
    a = quant.decompress(dx, sx, x.shape, 64, 0, torch.float32)
    first = a.clone()
    b = quant.decompress(dy, sy, y.shape, 64, 0, torch.float32)
    assert torch.equal(a, first) and not torch.equal(a, b)
    del a
    c = quant.decompress(dy, sy, y.shape, 64, 0, torch.float32)   # a's buffer, free again
    assert torch.equal(c, b)


def test_a_view_of_a_decompressed_weight_keeps_its_buffer_and_a_dropped_one_is_reused():
    x, y = torch.randn(128, 64), torch.randn(128, 64)
    (dx, sx), (dy, sy) = quant.compress(x, 64, 0), quant.compress(y, 64, 0)
    ws = quant.Workspace()
    a = ws.take((128, 64), torch.float32, "cpu")
    a.copy_(x)
    row = a[3]                                    # only a view outlives the tensor
    where = a.data_ptr()
    del a
    b = ws.take((128, 64), torch.float32, "cpu")
    assert b.data_ptr() != where and torch.equal(row, x[3])
    del row, b
    assert ws.take((128, 64), torch.float32, "cpu").data_ptr() == where   # free: reused
    with pytest.raises(ValueError):
        ws.take((4,), torch.float32, "meta")


def test_a_small_tensor_is_worked_on_one_thread_a_large_one_on_all(monkeypatch):
    """A small layer's passes end before a second CPU thread joins; the caller's count is
    restored after either."""
    seen = []
    for name in ("_compress", "_decompress"):
        real = getattr(quant, name)
        monkeypatch.setattr(quant, name, lambda *a, _real=real: (
            seen.append(torch.get_num_threads()), _real(*a))[1])
    monkeypatch.setattr(quant, "ONE_THREAD_BELOW", 64 * 64 * 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (64, 256):       # 4,096 values: one thread; 16,384: every thread
            x = torch.randn(rows, 64)
            data, scale = quant.compress(x, 64, 0)
            got = quant.decompress(data, scale, x.shape, 64, 0, torch.float32)
            assert float((got - x).abs().max()) < 0.5
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1, 2, 2]


def _generate(model, new_tokens=5, **cfg):
    with Runtime(RuntimeConfig(model=model, **cfg)) as rt:
        return rt.generate([PROMPT], new_tokens, record_logits=True)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_4bit_weights_in_flexgens_loop_at_every_placement(model, offload_dir):
    ref = _generate(model, offload_dir=str(offload_dir))
    runs = [_generate(model, placement=Placement.parse(p), compress_weight=True,
                      offload_dir=str(offload_dir)) for p in ("gpu", "cpu", "disk", "mixed")]
    for run in runs[1:]:
        assert run.new_ids == runs[0].new_ids and torch.equal(run.logits[0], runs[0].logits[0])
    cos, rel = _similar(runs[0].logits[0][:1], ref.logits[0][:1])    # the same context
    assert cos > WEIGHT_COS and rel < WEIGHT_REL, (cos, rel)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("groups", [Groups(64, 2), Groups(16, 0)])
def test_4bit_kv_cache_in_flexgens_loop(model, groups, offload_dir):
    ref = _generate(model, 8, offload_dir=str(offload_dir))
    for placement in ("gpu", "disk"):
        run = _generate(model, 8, placement=Placement.parse(placement), compress_cache=True,
                        cache_groups=groups, offload_dir=str(offload_dir))
        steps = _shared_context(run.new_ids[0], ref.new_ids[0])
        assert steps >= 4
        assert torch.equal(run.logits[0][0], ref.logits[0][0])   # prefill: no cache read
        assert _similar(run.logits[0][:steps], ref.logits[0][:steps])[1] < CACHE_REL


def test_grouped_along_the_sequence_a_token_at_a_group_boundary_is_stored():
    """FlexGen's mha_gen stores the group from src_s // size * size: at a boundary that is
    past the new token, which was never stored; compressed_new stores its whole group."""
    from flexgen.compression import CompressionConfig
    from flexgen.pytorch_backend import TorchDevice

    compat.apply()
    context = torch.randn(32, 2, 8)          # (seq, heads, d): the new token is row 31
    stored = compressed_new(TorchDevice("cpu"), context, context[31:],
                            CompressionConfig(4, 16, 0, False))
    assert stored.shape[0] == 16              # rows 16..31: the new token's group
    back = stored.device.decompress(stored)
    assert float((back[-1] - context[31]).abs().max()) < 0.5
    assert context.shape[0] // 16 * 16 == 32  # FlexGen's start: nothing left to store


def _serve(rt, store_dir, requests, batch=False):
    cfg = ServingConfig(retention=1.0)
    policy = make_policy("full", cfg)
    store = open_store(store_dir, rt, cfg, policy, chunk_size=16)
    try:
        engine = assemble(rt, policy, store, TierConfig(64 << 10, 256 << 10)).engine
        if batch:
            return engine.serve_all(requests, SchedulerConfig(max_batch_size=4))
        return [engine.serve(r, query_logits=True) for r in requests]
    finally:
        store.close()


def _requests(forced=None):
    """Two requests whose prefixes share no stored chunk: each is computed in full, as
    FlexGen's loop computes it (a loaded prefix would be the store's KV, not FlexGen's
    4-bit cache)."""
    query = prompt_ids(2, 9)
    return [Request(prompt_ids(1, 100), query, 6, forced=forced, keep_logits=True),
            Request(prompt_ids(5, 50), query, 6, forced=forced, keep_logits=True)]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("flags", [dict(compress_weight=True),
                                   dict(compress_cache=True),
                                   dict(compress_weight=True, compress_cache=True)])
def test_the_engine_equals_flexgens_loop_with_the_same_compression(model, flags, tmp_path):
    """The prefill pass and the decode steps (alone, then in a batch) with 4-bit weights
    and/or a 4-bit decode context give FlexGen's loop's tokens, logits within 1e-4."""
    with Runtime(RuntimeConfig(model=model, placement=Placement.parse("disk"),
                               offload_dir=str(tmp_path / "off"), **flags)) as rt:
        reqs = _requests()
        refs = [rt.generate([r.prefix + r.query], r.max_new_tokens, record_logits=True)
                for r in reqs]
        alone = _serve(rt, tmp_path / "a", reqs)
        batched = _serve(rt, tmp_path / "b", _requests(), batch=True)
    for ref, a, b in zip(refs, alone, batched):
        assert a.tokens == b.tokens == ref.new_ids[0]
        for resp in (a, b):
            assert float((torch.stack(resp.step_logits) - ref.logits[0]).abs().max()) < 1e-4


@pytest.mark.parametrize("model", MODELS)
def test_the_engine_with_4bit_weights_stays_close_to_the_uncompressed_model(model, tmp_path):
    """Teacher-forced, so every step has the same context: the prompt's positions (the
    prefill pass) and the decode steps."""
    forced = prompt_ids(4, 5)
    out = {}
    for compress in (False, True):
        with Runtime(RuntimeConfig(model=model, compress_weight=compress,
                                   offload_dir=str(tmp_path / "off"))) as rt:
            resp = _serve(rt, tmp_path / f"s{compress}", _requests(forced)[:1])[0]
            out[compress] = (resp.query_logits, torch.stack(resp.step_logits))
    for ours, theirs in zip(out[True], out[False]):
        cos, rel = _similar(ours, theirs)
        assert cos > WEIGHT_COS and rel < WEIGHT_REL, (cos, rel)


@pytest.mark.parametrize("groups", [Groups(16, 2), Groups(8, 0), Groups(4, 1)])
def test_a_compressed_decode_context_holds_what_a_plain_one_does(groups):
    torch.manual_seed(0)
    keys, values = torch.randn(2, 21, 16), torch.randn(2, 21, 16)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[:, :3] = False
    plain, packed = LayerKV(keys, values, mask, 12, 2), \
        CompressedKV(keys, values, mask, 12, 2, groups)
    for step in range(12):
        k, v = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
        plain.append(k, v)
        packed.append(k, v)
        pk, pv, pm = plain.view()
        ck, cv, cm = packed.view()
        assert ck.shape == pk.shape and cv.shape == pv.shape and packed.tokens == plain.tokens
        assert torch.equal(cm, pm)
        assert torch.equal(ck[:, -1], pk[:, -1]) and torch.equal(cv[:, -1], pv[:, -1])
        assert float((ck - pk).abs().max()) < 0.6 and float((cv - pv).abs().max()) < 0.6
        assert float((ck - pk).norm() / pk.norm()) < 0.1
    if groups.dim == 2:   # along a head's channels: under a third of float32's bytes
        held = sum(t.numel() * t.element_size() for t in packed.data + packed.scale)
        assert held < (keys.numel() + 12 * 32) * 4 * 2 / 3


def test_4bit_flags_reach_the_runtime_and_bad_groups_are_one_line(tmp_path, capsys):
    from impress_flexgen.entrypoints import run

    argv = ["--model", "opt-tiny", "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-new-tokens", "3", "--offload-dir", str(tmp_path / "off"),
            "--compress-weight", "--compress-cache", "--weight-groups", "32,1",
            "--cache-groups", "16,0", "--placement", "disk"]
    assert run.run_main("run", run.main, argv) == 0
    out = capsys.readouterr().out
    assert "int4 (groups of 32 along axis 1" in out
    for bad, why in ((["--weight-groups", "3"], "even"), (["--cache-groups", "64,3"], "axis"),
                     (["--weight-groups", "a,b"], "SIZE,AXIS")):
        with pytest.raises(SystemExit) as exc:
            run.parse_args(["--model", "opt-tiny", *bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1


def test_a_compressed_cache_split_across_devices_is_refused(offload_dir):
    from impress_flexgen.errors import UserError

    with pytest.raises(UserError, match="wholly on one device"):
        Runtime(RuntimeConfig(model="opt-tiny", placement=Placement.parse("mixed"),
                              compress_cache=True, offload_dir=str(offload_dir)))


def test_the_format_is_part_of_the_stored_kvs_identity():
    """KV computed over 4-bit weights is another model's: never served to the dtype's."""
    from impress_flexgen.engine import model_shape
    from impress_flexgen.models.formats import WeightFormat
    from impress_flexgen.models.runtime import resolve_spec

    cfg = RuntimeConfig(model="opt-tiny")
    spec = resolve_spec(cfg, check_placement=False)
    int4 = WeightFormat("int4", np.float32, Groups(64, 0))
    other = spec.__class__(**{**spec.__dict__, "weight_format": int4})
    assert model_shape(spec).fingerprint != model_shape(other).fingerprint
