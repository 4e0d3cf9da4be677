"""The policy search: its cost model (monotone in every bandwidth, reads amortised by the
block) and its choice (within the memory limits by placement's own accounting, everything
in memory when it fits, a larger block when weights are read from disk), the plan line that
says it, and the run that reports the prediction's error."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from impress_flexgen.entrypoints import run
from impress_flexgen.errors import UserError
from impress_flexgen.models.formats import candidates
from impress_flexgen.models.placement import GiB, Resources, make_plan
from impress_flexgen.models.runtime import Runtime, RuntimeConfig, resolve_spec
from impress_flexgen.planner import machine as machine_mod
from impress_flexgen.planner import policy_search as ps
from impress_flexgen.planner.policy_search import Machine, Policy, Workload

# A CPU's rates, round numbers of the order this machine measures.
MACHINE = Machine(cuda=False, flops_per_s=1e11, bytes_per_s=2e10, unpack_per_s=2e9,
                  row_seconds=(1e-10, 1.5e-10, 3e-10, 1e-9), disk_bytes_per_s=1e9,
                  disk_file_s=1e-4, link_bytes_per_s=1e10, layer_s=(5e-4, 8e-4),
                  contention=0.3)
WORK = Workload(64, 16)
FP32 = candidates(False, np.float32, False)


@pytest.fixture(autouse=True)
def empty_weights_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path_factory.mktemp("weights-cache")))


@pytest.fixture(scope="module")
def opt125():
    spec = resolve_spec(RuntimeConfig(model="opt-125m", dtype=np.float32), False)
    return ps.model_shape(spec)


def _resources(ram_gib: float, disk_gib: float = 50.0) -> Resources:
    return Resources(cuda=False, gpu_free=0, gpu_keep=0, ram_free=int(ram_gib * GiB),
                     ram_keep=0, disk_free=int(disk_gib * GiB), disk_keep=0,
                     offload_root="/nonexistent")


@pytest.mark.parametrize("ram_gib", [0.7, 0.9, 1.3, 16.0])
def test_search_never_exceeds_the_memory_limits(opt125, ram_gib):
    res = _resources(ram_gib)
    found = ps.search(opt125, MACHINE, res, WORK)
    assert found is not None
    assert found.needs["cpu"] <= res.ram and found.needs["disk"] <= res.disk
    # placement's own accounting (what a start checks) agrees that it fits
    p, fmt = found.policy, found.format
    cfg = RuntimeConfig(model="opt-125m", placement=p.placement, dtype=fmt.dtype,
                        compress_weight=fmt.compress, gpu_batch_size=p.gpu_batch_size,
                        num_gpu_batches=p.num_gpu_batches, compress_cache=p.compress_cache,
                        work_tokens=WORK.prompt_len + WORK.gen_len)
    spec = dataclasses.replace(opt125.spec, weight_format=None)
    plan = make_plan(spec, cfg, res)
    assert plan.needs["cpu"] <= res.ram


def test_search_finds_nothing_where_nothing_fits(opt125):
    assert ps.search(opt125, MACHINE, _resources(0.2), WORK) is None


def test_search_keeps_everything_in_memory_when_it_fits(opt125):
    found = ps.search(opt125, MACHINE, _resources(16.0), WORK)
    p = found.policy
    assert (p.w_gpu, p.cache_gpu, p.compress_weight) == (100, 100, False)
    assert found.format.name == "fp32"


def test_search_takes_a_larger_block_when_weights_are_read_from_disk(opt125):
    res = _resources(0.8)     # fp32 weights (625 MiB) cannot all stay beside working memory
    found = ps.search(opt125, MACHINE, res, WORK, formats=FP32)
    p = found.policy
    assert p.w_gpu < 100 and p.block >= 8
    alone = ps.predict(opt125, dataclasses.replace(p, gpu_batch_size=1, num_gpu_batches=1),
                       MACHINE, WORK)
    assert found.prediction.decode_tokens_per_s >= 5 * alone.decode_tokens_per_s
    # with room for every weight, the block that pays is smaller: reads no longer need it
    roomy = ps.search(opt125, MACHINE, _resources(1.0), WORK, formats=FP32)
    assert roomy.policy.w_gpu == 100 and roomy.policy.block < p.block


@pytest.mark.parametrize("policy", [Policy(0, 0, 100, 0, 8, 2), Policy(40, 0, 0, 0, 4, 1),
                                    Policy(100, 0, 100, 0, 1, 1, True),
                                    Policy(20, 50, 0, 100, 8, 4)])
@pytest.mark.parametrize("overlap", [True, False])
def test_predict_is_monotone_in_every_bandwidth(opt125, policy, overlap):
    for field in ("disk_bytes_per_s", "link_bytes_per_s", "bytes_per_s", "flops_per_s",
                  "unpack_per_s", "share"):
        last = 0.0
        for rate in ((0.1, 0.3, 0.6, 1.0) if field == "share" else (1e8, 1e9, 1e10, 1e11)):
            m = MACHINE.scaled(**{field: rate})
            pr = ps.predict(opt125, policy, m, WORK, overlap=overlap)
            assert pr.decode_tokens_per_s >= last * (1 - 1e-12), (field, rate)
            last = pr.decode_tokens_per_s
    sync = ps.predict(opt125, policy, MACHINE, WORK, overlap=False)
    over = ps.predict(opt125, policy, MACHINE, WORK, overlap=True)
    assert over.decode_step_s <= sync.decode_step_s
    assert over.decode_step_s >= max(over.read_s, over.compute_s)


def test_disk_reads_are_counted_per_file_and_per_byte(opt125):
    on_disk = Policy(0, 0, 100, 0, 1, 1)
    base = ps.predict(opt125, on_disk, MACHINE, WORK)
    weight_bytes = sum(4 * sum(x.elements) * x.count for x in opt125.layers)
    files = sum(len(x.elements) * x.count for x in opt125.layers)
    # A decode step embeds one token: its row of the token table is read, not the table.
    table = next(x for x in opt125.layers if x.kind == "embed").elements[0] * 4
    row = table / opt125.spec.config.vocab_size + 64 * 1024
    assert base.read_s == pytest.approx((weight_bytes - table + row) / 1e9 + files * 1e-4,
                                        rel=1e-6)
    in_memory = ps.predict(opt125, Policy(), MACHINE, WORK)
    assert in_memory.read_s == 0


def test_machine_rates_are_cached_for_the_next_start(monkeypatch):
    calls = []
    monkeypatch.setattr(machine_mod, "_measure", lambda cuda, dtype: calls.append(1) or MACHINE)
    monkeypatch.setattr(machine_mod, "cpu_share", lambda: 1.0)
    assert machine_mod.measure_machine(False) == MACHINE
    assert machine_mod.measure_machine(False) == MACHINE
    assert len(calls) == 1
    machine_mod.measure_machine(False, use_cache=False)
    assert len(calls) == 2


def test_a_block_of_micro_batches_generates_what_each_prompt_alone_does(offload_dir):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [13, 14, 15, 16], [17, 18]]
    cfg = RuntimeConfig(model="opt-tiny", placement=Policy(0, 0, 100, 0).placement,
                        offload_dir=str(offload_dir))
    with Runtime(dataclasses.replace(cfg, gpu_batch_size=2, num_gpu_batches=2)) as rt:
        block = rt.generate(prompts, 4).new_ids
    with Runtime(cfg) as rt:
        alone = [rt.generate([p], 4).new_ids[0] for p in prompts]
    assert block == alone


def test_throughput_run_prints_the_policy_and_reports_its_error(tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setattr(ps, "measure_machine", lambda cuda=None: MACHINE)
    out = tmp_path / "run.json"
    rc = run.main(["--model", "opt-tiny", "--throughput", "--prompt-ids", "5,6,7",
                   "--prompt-ids", "8,9", "--max-new-tokens", "4", "--json", str(out),
                   "--offload-dir", str(tmp_path / "off")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "placement auto (policy search):" in printed
    line = next(x for x in printed.splitlines() if x.startswith("policy search: weights"))
    assert "batch" in line and "predicted" in line and "tokens/s" in line
    result = json.loads(out.read_text())
    report = result["policy_search"]
    assert report["predicted_decode_tokens_per_s"] > 0
    assert report["measured_decode_tokens_per_s"] > 0
    assert report["error"] == pytest.approx(
        report["measured_decode_tokens_per_s"] / report["predicted_decode_tokens_per_s"] - 1)
    assert [len(r["new_ids"]) for r in result["results"]] == [4, 4]


def test_latency_work_keeps_todays_placement(tmp_path, capsys):
    rc = run.main(["--model", "opt-tiny", "--prompt-ids", "5,6,7", "--max-new-tokens", "2",
                   "--offload-dir", str(tmp_path / "off")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "placement auto:" in printed and "policy search" not in printed


def test_throughput_plans_a_budget_only_the_searched_policy_fits(tmp_path, capsys,
                                                                 monkeypatch):
    """0.8 GiB holds opt-125m's fp32 weights only partly on disk beside a block's short
    work (the latency plan, sized for 2,048-token passes, refuses it): the search's
    policy is planned and printed."""
    monkeypatch.setattr(ps, "measure_machine", lambda cuda=None: MACHINE)
    args = ["--model", "opt-125m", "--max-ram-gb", "0.8", "--dtype", "fp32",
            "--no-compress-weight", "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10",
            "--max-new-tokens", "8", "--dry-run", "--offload-dir", str(tmp_path / "off")]
    assert run.main(args + ["--throughput"]) == 0
    printed = capsys.readouterr().out
    assert "placement auto (policy search):" in printed and "dry run" in printed
    line = next(x for x in printed.splitlines() if x.startswith("policy search: weights"))
    assert "/0/0, cache" not in line.split("weights ", 1)[1][:12]    # some weights on disk
    with pytest.raises(UserError, match="does not fit"):
        run.main(args)
