"""A decode step's few-row bf16 products on a CPU: fast kernels, F.linear's values."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from impress_flexgen.models import base

SHAPES = [(960, 576), (576, 1536), (64, 64), (100, 37)]


@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_bf16_rows_equal_f_linear_bit_for_bit(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        bias = (torch.randn(n, generator=g) * 0.05).bfloat16() if with_bias else None
        for shape in ((1, rows, k), (rows, 1, k), (rows, k)):
            x = torch.randn(*shape, generator=g).bfloat16()
            got = base.linear(x, w, bias)
            want = F.linear(x, w, bias)
            # The layout too: later reductions (RMSNorm) round by it.
            assert got.shape == want.shape and got.stride() == want.stride()
            assert torch.equal(got, want), (n, k, shape)


def test_few_bf16_rows_skip_f_linear(monkeypatch):
    """One row goes by a matrix-vector product and a few by weight @ x.T: F.linear's
    general call costs as much again as the product at a small model's sizes."""
    calls = []
    real = F.linear
    monkeypatch.setattr(base.F, "linear", lambda *a, **k: calls.append(a) or real(*a, **k))
    w = torch.randn(96, 64).bfloat16()
    for rows in (1, 4, base.FEW_ROWS):
        base.linear(torch.randn(1, rows, 64).bfloat16(), w)
    assert calls == []
    # Many rows (a prefill), float32, and a weight that is a transposed view keep F.linear.
    base.linear(torch.randn(1, base.FEW_ROWS + 1, 64).bfloat16(), w)
    base.linear(torch.randn(1, 1, 64), w.float())
    base.linear(torch.randn(1, 1, 96).bfloat16(), w.t())
    assert len(calls) == 3


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 5), (torch.float32, 256),
                                        (torch.bfloat16, 3)])
def test_opts_mlp_goes_by_linear_with_flexgens_values(monkeypatch, dtype, rows):
    """OPT's MLP layer computes FlexGen's MLP by models.base.linear (a few bf16 rows by its
    fast kernels): float32 values bit for bit, bf16 to rounding."""
    import types

    from flexgen.pytorch_backend import TorchDevice, TorchTensor
    from flexgen.utils import ValueHolder

    from impress_flexgen.models.opt import OptMLP

    g = torch.Generator().manual_seed(rows)
    h, f = 64, 256
    cpu = TorchDevice("cpu")
    raw = [torch.randn(f, h, generator=g) * 0.05, torch.randn(f, generator=g) * 0.05,
           torch.randn(h, f, generator=g) * 0.05, torch.randn(h, generator=g) * 0.05,
           1 + torch.randn(h, generator=g) * 0.05, torch.randn(h, generator=g) * 0.05]
    weights = [TorchTensor.create_from_torch(w.to(dtype), cpu) for w in raw]
    x = torch.randn(1, rows, h, generator=g).to(dtype)
    want = cpu.mlp(TorchTensor.create_from_torch(x.clone(), cpu), *weights,
                   [False] * 7).data

    layer = OptMLP.__new__(OptMLP)
    layer.policy, layer.compute = types.SimpleNamespace(num_gpu_batches=1), cpu
    buf, hidden = ValueHolder(), ValueHolder()
    buf.store(tuple((w, False) for w in weights))
    hidden.store(TorchTensor.create_from_torch(x.clone(), cpu))
    calls = []
    real = F.linear
    monkeypatch.setattr(base.F, "linear", lambda *a, **k: calls.append(a) or real(*a, **k))
    layer.forward(hidden, None, buf, None, None, 0, 0)
    got = hidden.val.data
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        assert calls == [] and torch.allclose(got.float(), want.float(), atol=2e-2)
