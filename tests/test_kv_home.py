"""The serving engine's decode context placed by FlexGen's cache percentages (engine.kv_home):
the same greedy tokens wherever it lives, alone and in a batch; the disk share in files, read
back and counted; the CPU share of a CUDA machine attended where cpu_cache_compute says."""
from __future__ import annotations

import ctypes
import gc
import os
import types

import numpy as np
import pytest
import torch

from impress_flexgen.engine import Request, SchedulerConfig, assemble
from impress_flexgen.engine.kv_home import DiskKV, HostKV, KVHome, SeqFile, layer_homes
from impress_flexgen.models.placement import Placement
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.request import RequestStats
from policies import ServingConfig, make_policy

SPLITS = [(100, 0), (0, 100), (0, 0), (50, 25)]
NEW = 4


def _policy(gpu, cpu, cpu_compute=False):
    """What KVHome reads of FlexGen's Policy."""
    return types.SimpleNamespace(cache_gpu_percent=gpu, cache_cpu_percent=cpu,
                                 cpu_cache_compute=cpu_compute, compress_cache=False)


def _requests():
    rng = np.random.default_rng(3)
    return [Request(rng.integers(10, 400, 30 + 9 * i).tolist(), [5, 6 + i], NEW,
                    keep_logits=True) for i in range(2)]


def _serve(engine, home, batch: bool):
    engine.runner.kv_home = home
    if batch:
        return engine.serve_all(_requests(), SchedulerConfig(max_batch_size=8))
    return [engine.serve(r) for r in _requests()]


def test_the_percentages_split_the_layers_gpu_then_cpu_then_disk():
    assert layer_homes(100, 0, 4) == ["gpu"] * 4
    assert layer_homes(0, 100, 4) == ["cpu"] * 4
    assert layer_homes(0, 0, 4) == ["disk"] * 4
    assert layer_homes(50, 25, 4) == ["gpu", "gpu", "cpu", "disk"]
    assert layer_homes(30, 70, 3) == ["cpu"] * 3       # no disk share: the CPU takes the rest
    assert layer_homes(30, 40, 10) == ["gpu"] * 3 + ["cpu"] * 4 + ["disk"] * 3


@pytest.fixture(scope="module")
def served_in_place(tiny_runtimes, tmp_path_factory):
    """Per model: an engine, and the requests served alone with every context on the
    compute device (the path without a split)."""
    out = {}
    for model, rt in tiny_runtimes.items():
        engine = assemble(rt, make_policy("full", ServingConfig()), None).engine
        home = KVHome(_policy(100, 0), engine.math.n_layers, engine.device,
                      tmp_path_factory.mktemp("kv"))
        out[model] = engine, _serve(engine, home, False), _serve(engine, home, True)
    return out


def _cases():
    fast = {("opt-tiny", (0, 0)), ("llama-tiny", (50, 25))}
    return [pytest.param(model, split, marks=() if (model, split) in fast
                         else pytest.mark.slow)
            for model in ("opt-tiny", "llama-tiny") for split in SPLITS]


@pytest.mark.parametrize("model,split", _cases())
def test_greedy_tokens_are_the_same_wherever_the_context_lives(served_in_place, tmp_path,
                                                               model, split):
    """Alone: the same tokens and bit-identical logits at every split; in a batch: the
    tokens of each request alone (batched-equals-alone holds with the context on disk), and
    the batch's logits bit-identical to the batch's in memory (disk layers are attended
    side by side too)."""
    engine, ref, ref_batched = served_in_place[model]
    assert all(len(r.tokens) == NEW for r in ref)
    home = KVHome(_policy(*split), engine.math.n_layers, engine.device, tmp_path)
    alone = _serve(engine, home, False)
    batched = _serve(engine, home, True)
    for a, b, r, rb in zip(alone, batched, ref, ref_batched):
        assert a.tokens == b.tokens == r.tokens
        assert all(torch.equal(x, y) for x, y in zip(a.step_logits, r.step_logits))
        assert all(torch.equal(x, y) for x, y in zip(b.step_logits, rb.step_logits))
    disk = home.homes.count("disk")
    assert (home.bytes_read > 0) == (disk > 0)
    assert all((a.stats.kv_disk_bytes > 0) == (disk > 0) for a in alone + batched)
    home.close()


def test_the_disk_share_is_in_files_read_back_each_step_and_counted(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    engine = assemble(rt, make_policy("full", ServingConfig()), None).engine
    m = engine.math
    home = KVHome(_policy(0, 0), m.n_layers, engine.device, tmp_path / "kv")
    engine.runner.kv_home = home
    seen = []

    def during(token):
        files = list((tmp_path / "kv").glob("*.kv"))
        seq = engine.scheduler.running[0] if engine.scheduler.running else None
        seen.append((len(files), sum(f.stat().st_size for f in files), seq))
        return True

    prefix, query = list(range(10, 50)), [7, 8]
    resp = engine.serve(Request(prefix, query, NEW, on_token=during))
    record = 2 * m.n_kv_head * m.head_dim * engine.dtype.itemsize    # a token's K and V
    cap = len(prefix) + len(query) + NEW - 1
    assert seen and all(count == 1 and size == m.n_layers * cap * record
                        for count, size, _ in seen[1:])
    # Each step reads every layer's context back: the prompt, then one more each step.
    steps = NEW - 1
    expect = sum(len(prefix) + len(query) + t for t in range(steps)) * m.n_layers * record
    assert resp.stats.kv_disk_bytes == expect == home.bytes_read
    assert not list((tmp_path / "kv").iterdir())        # gone with the sequence
    home.close()


def _rss() -> int:
    """The RSS, after handing freed heap back to the system (glibc keeps it otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_disk_context_is_not_held_in_memory(tmp_path):
    """32 MiB of K and V: in a LayerKV the process holds it, in a DiskKV its file does."""
    kv, m, d = 8, 8192, 64
    size = 2 * kv * m * d * 4

    def grown(make):
        keys, values = torch.randn(kv, m, d), torch.randn(kv, m, d)
        mask = torch.ones(kv, m, dtype=torch.bool)
        before = _rss()
        return make(keys, values, mask), _rss() - before

    from impress_flexgen.engine.sequence import LayerKV

    held, in_memory = grown(lambda k, v, mask: LayerKV(k, v, mask, 4, 1))
    del held
    gc.collect()
    file = SeqFile(tmp_path, 1, m + 4, kv, d, 4)
    ctx, on_disk = grown(lambda k, v, mask: DiskKV(file, 0, k, v, mask, 4, 1,
                                                  torch.device("cpu")))
    assert in_memory > 0.9 * size
    assert on_disk < 0.25 * size
    assert os.path.getsize(file.path) == (m + 4) * 2 * kv * d * 4
    file.close()
    assert not file.path.exists()


@pytest.mark.parametrize("cpu_compute", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_cpu_share_on_another_device_than_compute(served_in_place, tmp_path, cpu_compute):
    """CUDA's branch where there is none: the CPU share held on a device that is not the
    compute device (cpu:0 beside cpu), attended there (cpu_cache_compute) or copied to the
    compute device; the same tokens and logits as the context on the compute device."""
    engine, ref, _ = served_in_place["llama-tiny"]
    n = engine.math.n_layers
    home = KVHome(_policy(0, 100, cpu_compute), n, engine.device, tmp_path,
                  host=torch.device("cpu", 0))
    assert not home.in_place and home.homes == ["cpu"] * n
    alone, batched = _serve(engine, home, False), _serve(engine, home, True)
    for a, b, r in zip(alone, batched, ref):
        assert a.tokens == b.tokens == r.tokens and a.stats.kv_disk_bytes == 0
        assert all(torch.equal(x, y) for x, y in zip(a.step_logits, r.step_logits))


@pytest.mark.parametrize("cpu_compute", [False, True])
def test_a_host_context_attends_as_the_plain_one(cpu_compute):
    """Where a CPU-share context lives, and what its attention gives back (shapes, dtype,
    device of the query's)."""
    keys, values = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    ctx = HostKV(keys, values, torch.ones(2, 5, dtype=torch.bool), 3, 1,
                 torch.device("cpu", 0), cpu_compute)
    assert ctx.inner.k.device.type == "cpu" and ctx.inner.k.shape == (2, 8, 8)
    q, k1, v1 = torch.randn(1, 2, 1, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    out = ctx.attend(q, k1, v1, torch.float32, False, RequestStats())
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert ctx.n == 6
    want = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([keys, k1], 1)[None], torch.cat([values, v1], 1)[None])
    assert torch.allclose(out, want, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cpu_compute", [False, True])
def test_on_cuda_the_cpu_share_is_in_host_memory(tiny_runtimes, tmp_path, cpu_compute):
    rt = tiny_runtimes["llama-tiny"]
    engine = assemble(rt, make_policy("full", ServingConfig()), None).engine
    assert engine.device.type == "cuda"
    n = engine.math.n_layers
    ref = _serve(engine, KVHome(_policy(100, 0), n, engine.device, tmp_path), False)
    home = KVHome(_policy(50, 50, cpu_compute), n, engine.device, tmp_path)
    seqs = []
    engine.runner.kv_home = home
    engine.serve(Request(list(range(10, 40)), [5], 3,
                         on_token=lambda t: seqs.append(engine.scheduler.running[:]) or True))
    held = [kv for batch in seqs for s in batch for kv in s.kv or () if isinstance(kv, HostKV)]
    assert held and all(kv.inner.k.device.type == "cpu" and kv.inner.k.is_pinned()
                        for kv in held)
    for got in (_serve(engine, home, False), _serve(engine, home, True)):
        assert [a.tokens for a in got] == [r.tokens for r in ref]


def test_a_runtime_placement_and_the_flag_reach_the_engine(tmp_path):
    from impress_flexgen.config import ServiceConfig
    from impress_flexgen.entrypoints import run

    args = run.parse_args(["--model", "opt-tiny", "--placement", "100,0,0,0,100,0",
                           "--cpu-cache-compute"])
    cfg = ServiceConfig.from_args(args).runtime
    assert cfg.cpu_cache_compute and cfg.placement.cache_gpu == 0
    assert not ServiceConfig.from_args(run.parse_args(["--model", "opt-tiny"])
                                       ).runtime.cpu_cache_compute
    with Runtime(RuntimeConfig(model="opt-tiny", offload_dir=str(tmp_path),
                               placement=Placement.parse("100,0,0,0,100,0"),
                               cpu_cache_compute=True)) as rt:
        assert rt.policy.cpu_cache_compute
        engine = assemble(rt, make_policy("full", ServingConfig()), None).engine
        home = engine.runner.kv_home
        assert home.homes == ["disk"] * engine.math.n_layers and home.cpu_compute
        assert engine.scheduler.kv_bytes_per_token == 0     # admission: nothing in memory
        resp = engine.serve(Request(list(range(10, 30)), [5], 4))
        assert resp.stats.kv_disk_bytes > 0 and home.bytes_read == resp.stats.kv_disk_bytes
        engine.close()


def test_metrics_count_the_context_read_from_disk(tiny_runtimes, tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from impress_flexgen.metrics import _KVHomeCounters

    rt = tiny_runtimes["opt-tiny"]
    engine = assemble(rt, make_policy("full", ServingConfig()), None).engine
    home = engine.runner.kv_home = KVHome(_policy(0, 0), engine.math.n_layers, engine.device,
                                          tmp_path)
    engine.serve(Request([5, 6, 7], [9], 3))
    registry = CollectorRegistry()
    registry.register(_KVHomeCounters(home))
    got = {s.name: s.value for fam in text_string_to_metric_families(
        generate_latest(registry).decode()) for s in fam.samples}
    assert got["impress_flexgen_decode_kv_disk_bytes_read_total"] == home.bytes_read > 0
    assert got["impress_flexgen_decode_kv_disk_wait_seconds_total"] > 0
    home.close()


@pytest.mark.slow
def test_the_benchmark_writes_a_row_per_cache_and_round(tmp_path):
    import json

    from experiments import bench_kv_home

    out = tmp_path / "kv.json"
    assert bench_kv_home.main(["--model", "llama-tiny", "--prefix", "40", "--batch", "2",
                               "--tokens", "3", "--rounds", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["cache"] for r in rows] == ["memory", "disk"]
    assert all(r["same_tokens"] and r["decode_tokens_per_s"] > 0 for r in rows)
    assert rows[0]["kv_disk_bytes"] == 0 < rows[1]["kv_disk_bytes"]
