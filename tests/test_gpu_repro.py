"""experiments.gpu_repro on a CPU (quick mode) and the replayed-selection policy."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from experiments import gpu_repro
from impress_flexgen.entrypoints.process import run_main
from policies import LayerContext, Segment, ServingConfig, make_policy
from policies.base import ProbeKeys
from policies.replay import (Replay, Trace, load_trace, map_positions, request_entry,
                             save_trace, source_layer)


# -- the mapping -------------------------------------------------------------------------
def test_layer_mapping_is_proportional():
    assert [source_layer(l, 8, 4) for l in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [source_layer(l, 4, 30) for l in range(4)] == [0, 7, 15, 22]
    assert [source_layer(l, 48, 30) for l in (0, 47)] == [0, 29]
    assert source_layer(3, 3, 3) == 2


def test_position_mapping_is_proportional():
    src = np.zeros(200, bool)
    src[50:100] = True
    longer = map_positions(src, 400)          # each source position covers two targets
    assert np.array_equal(np.flatnonzero(longer), np.arange(100, 200))
    shorter = map_positions(src, 100)         # two source positions per target: averaged
    assert np.array_equal(np.flatnonzero(shorter), np.arange(25, 50))
    half = np.zeros(4, bool)
    half[1] = True
    assert np.allclose(map_positions(half, 2), [0.5, 0.0])
    assert np.allclose(map_positions(src, 200), src)


def _trace(n_layers=4, n=200, requests=2) -> Trace:
    """Request r, layer j selects source positions [50 * ((j + r) % 4), ... + 50)."""
    reqs = []
    for r in range(requests):
        layers = []
        for j in range(n_layers):
            sel = np.zeros(n, bool)
            a = 50 * ((j + r) % 4)
            sel[a:a + 50] = True
            layers.append(sel)
        reqs.append(request_entry(layers, phase="query", index=r, prefix=0))
    return Trace({"model": "test", "layers": n_layers, "workload": {}}, reqs)


def _context(layer: int, n: int, n_layers: int, chunk: int, config: ServingConfig
             ) -> LayerContext:
    layout = SimpleNamespace(n_tokens=n, chunk_size=chunk, n_chunks=math.ceil(n / chunk))
    entry = SimpleNamespace(layout=layout, mapping=None)
    node = SimpleNamespace(start=0, layers=[entry] * n_layers)
    gen = torch.Generator().manual_seed(layer)

    probe = ProbeKeys(torch.randn(2, n, 8, generator=gen))
    return LayerContext(layer, torch.randn(2, 3, 8, generator=gen),
                        torch.randn(2, 3, 8, generator=gen), [Segment(node, n, entry)], config,
                        (0, 1), (0, 1), probe, lambda *a: [])


def test_replay_selects_mapped_chunks_within_budget():
    cfg = ServingConfig(retention=0.25)
    policy = Replay(cfg, _trace())
    n, chunk, n_layers = 400, 16, 8
    k = cfg.budget(n)
    for request in range(2):
        for layer in range(n_layers):
            plan = policy.plan_layer(_context(layer, n, n_layers, chunk, cfg))
            chunks = plan.chunks_k[0]
            assert np.array_equal(chunks, plan.chunks_v[0])
            taken = len(chunks) * chunk
            assert k <= taken < k + chunk                     # impress's chunk budget
            assert 0 in chunks and n // chunk - 1 in chunks    # sink and most recent chunk
            src = source_layer(layer, n_layers, 4)
            a = 2 * 50 * ((src + request) % 4)                 # mapped onto 400 positions
            wanted = set(range(a // chunk, (a + 100 - 1) // chunk + 1))
            others = set(chunks.tolist()) - {0, n // chunk - 1}
            assert others and others <= wanted, (request, layer, sorted(others), a)
            assert plan.selected[0].sum() == taken
            assert plan.scores[0].shape == (n,)
    assert policy.request == 1
    # The probe copy is read (ahead, by the engine) on every layer.
    assert all(policy.probes_layer(layer) for layer in range(n_layers))


def test_replay_is_built_from_a_trace_file(tmp_path):
    path = tmp_path / "trace.json"
    save_trace(_trace(), path)
    assert load_trace(path).selected(1, 0).sum() == 50
    policy = make_policy(f"replay:{path}", ServingConfig())
    assert isinstance(policy, Replay) and policy.describe()["trace_layers"] == 4
    with pytest.raises(ValueError):
        make_policy("replay", ServingConfig())
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError):
        make_policy(f"replay:{tmp_path / 'bad.json'}", ServingConfig())


# -- the experiment ----------------------------------------------------------------------
@pytest.mark.slow
def test_quick_cpu_run_writes_both_modes_and_all_policies(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--quick", "--models", "opt-tiny", "--prefix-tokens", "128", "--query-tokens", "16",
            "--trace-model", "llama-tiny", "--out", str(out)]
    assert gpu_repro.main(argv) == 0
    res = json.loads((out / "gpu_repro.json").read_text())
    assert set(res["modes"]) == {"random", "replayed"}
    assert res["modes"]["random"] == "random-weight selection"
    modes = res["models"]["opt-tiny"]["modes"]
    assert set(modes) == set(res["modes"].values())
    for label, rows in modes.items():
        assert set(rows) == {"recomp", "as_like", "as_h2o_lfu", "impress"}, label
        for row in rows.values():
            for key in ("ttft_mean_s", "ttft_p99_s", "io_time_s", "bytes_loaded_fraction",
                        "gpu_hit_ratio", "fallback_rate"):
                assert row[key] is not None and row[key] >= 0
    replayed = modes[res["modes"]["replayed"]]
    assert replayed["impress"]["policy"] == "replay"
    assert replayed["recomp"]["shared_from"] == "random-weight selection"
    assert modes["random-weight selection"]["impress"]["policy"] == "impress"
    assert res["models"]["opt-tiny"]["trace_order_matches"] is True
    assert res["skipped"] == [] and res["machine"]["device"]
    assert (out / "selection_trace.json").exists()
    assert not (out / "stores").exists()
    printed = capsys.readouterr().out
    assert "replayed llama-tiny selection" in printed and "as_h2o_lfu" in printed

    # A recorded trace is reused, and a budget of (almost) nothing skips rows, listed.
    trace = out / "selection_trace.json"
    out2 = tmp_path / "again"
    assert gpu_repro.main(["--quick", "--prefix-tokens", "128", "--query-tokens", "16",
                           "--trace", str(trace), "--modes", "replayed", "--out", str(out2),
                           "--budget-s", "0.001"]) == 0
    res2 = json.loads((out2 / "gpu_repro.json").read_text())
    assert res2["trace"]["model"] == "llama-tiny"
    assert len(res2["skipped"]) == 4 and (out2 / "selection_trace.json").exists()


def test_random_weight_opt_gets_positions_for_long_prefixes(tmp_path):
    out = tmp_path / "long"
    assert gpu_repro.main(["--quick", "--modes", "random", "--prefixes", "1", "--queries", "1",
                           "--warmup", "0", "--prefix-tokens", "1100", "--query-tokens", "16",
                           "--out", str(out)]) == 0
    entry = json.loads((out / "gpu_repro.json").read_text())["models"]["opt-tiny"]
    assert entry["max_seq_len_overridden"] and entry["max_seq_len"] >= 1100 + 16
    assert set(entry["modes"]["random-weight selection"]) == {"recomp", "as_like",
                                                              "as_h2o_lfu", "impress"}


def test_record_trace_only(tmp_path):
    out = tmp_path / "t"
    assert gpu_repro.main(["--record-trace-only", "--prefix-tokens", "64", "--query-tokens",
                           "16", "--prefixes", "1", "--queries", "1", "--trace-model",
                           "llama-tiny", "--out", str(out)]) == 0
    trace = load_trace(out / "selection_trace.json")
    assert trace.n_layers == 2 and trace.meta["model"] == "llama-tiny"
    assert [r["phase"] for r in trace.requests] == ["warmup", "query"]
    assert not (out / "gpu_repro.json").exists()


@pytest.mark.parametrize("argv", [["--retention", "0"], ["--models", "opt-nope"],
                                  ["--modes", "random,bogus"], ["--prefix-tokens", "8"],
                                  ["--budget-s", "-1"], ["--trace", "x", "--record-trace-only"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_repro.main(["--quick", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_missing_trace_is_one_line_and_exit_2(tmp_path, capsys):
    argv = ["--quick", "--trace", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")]
    assert run_main(gpu_repro.PROG, gpu_repro.main, argv) == 2
    assert "none.json" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for CPU-only machines")
def test_full_run_without_gpu_exits_2(tmp_path, capsys):
    assert gpu_repro.main(["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1


# -- the budget, the pool cap and the placement -------------------------------------------
def test_a_pool_over_the_cap_serves_fewer_prefixes_of_the_same_length():
    from impress_flexgen.bench.workload import WorkloadConfig

    wcfg = WorkloadConfig(n_prefixes=2, prefix_tokens=5120)
    kv30 = 2 * 48 * 7168 * 2                       # OPT-30B: 1.31 MiB of fp16 KV per token
    assert gpu_repro.model_workload(wcfg, kv30, None) is wcfg
    capped = gpu_repro.model_workload(wcfg, kv30, 8.0)
    assert (capped.n_prefixes, capped.prefix_tokens) == (1, 5120)
    assert gpu_repro.model_workload(wcfg, 2 * 40 * 5120 * 2, 8.0) is wcfg   # OPT-13B: 7.8 GiB
    assert gpu_repro.model_workload(wcfg, kv30, 0.001).n_prefixes == 1      # never none


def test_a_rows_estimate_scales_by_the_larger_of_its_bytes_and_its_compute():
    budget = gpu_repro.Budget(100.0)
    assert budget.estimate("x", (1, 1)) == 0.0 and budget.fits("x", (10**9, 10**9))
    budget.record("x", 10.0, (100, 1000))
    assert budget.estimate("x", (200, 1000)) == 20.0      # I/O bound: twice the KV
    assert budget.estimate("x", (150, 3000)) == 30.0      # compute bound: 3x weights x tokens
    assert not budget.fits("x", (1000, 1000))


def test_weights_that_do_not_fit_beside_the_reserve_go_partly_to_cpu_memory(monkeypatch):
    spec = gpu_repro.resolve("opt-30b", None, 0, np.float16)    # CUDA's default dtype
    weights = gpu_repro.weight_bytes(spec)
    assert 55 < weights / 2**30 < 57
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for free_gib, want in ((80, "gpu"), (40, "split"), (4, "cpu")):
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda f=free_gib: (f * 2**30, 80 * 2**30))
        placement, why = gpu_repro.choose_placement(spec, 8 * 2**30)
        p = placement
        if want == "gpu":
            assert p.w_gpu == 100 and why.startswith("gpu"), why
            continue
        room = 0.9 * free_gib * 2**30 - 8 * 2**30
        assert p.w_gpu == max(0, int(100 * room / weights)), why
        assert p.w_gpu + p.w_cpu == 100 and p.cache_gpu == 100
        assert "on the GPU, the rest in CPU memory" in why
