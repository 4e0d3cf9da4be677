"""The probe-cost benchmark in its quick mode, and its baseline decoder."""
from __future__ import annotations

import json

import pytest
import torch

from disk_layout.format import decode_probe, encode_probe
from experiments import bench_probe


def test_bench_probe_quick(tmp_path):
    out = tmp_path / "probe.json"
    assert bench_probe.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["median_ms"]) == {"decode", "decode (numpy)", "product", "exp", "exp2",
                                     "score layer"}
    assert all(ms > 0 for ms in res["median_ms"].values())
    assert res["shape"]["prefix_tokens"] == 256 and res["repeats"] == 10
    assert res["product_gflops"] > 0


def test_baseline_decoder_matches_the_store_s():
    keys = torch.randn(3, 96, 64) * 3
    raw = encode_probe(keys, "int4")
    assert torch.equal(bench_probe.decode_numpy(raw, (3, 96, 64)),
                       decode_probe(raw, "int4", (3, 96, 64)))


def test_bench_probe_refuses_bad_shapes():
    with pytest.raises(SystemExit) as err:
        bench_probe.main(["--quick", "--heads", "10", "--kv-heads", "3"])
    assert err.value.code == 2
