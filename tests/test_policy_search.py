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
                  row_seconds=(1e-10, 1.5e-10, 3e-10, 1e-9, 4e-9), disk_bytes_per_s=1e9,
                  disk_file_s=1e-4, link_bytes_per_s=1e10, layer_s=(5e-4, 8e-4),
                  contention=0.3, disk_cpu_bytes_per_s=3e9)
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
    assert len(calls) == machine_mod.TRIES
    machine_mod.measure_machine(False, use_cache=False)
    assert len(calls) == 2 * machine_mod.TRIES


def test_the_fastest_of_each_rate_measured_is_kept(monkeypatch):
    """Another program's turn slows some tries of a rate: each rate is its fastest try;
    the disk's, which no program's turn on the cores slows, is its middle one."""
    tries = iter([MACHINE.scaled(disk_bytes_per_s=5e8, layer_s=(1e-3, 9e-4)),
                  MACHINE.scaled(row_seconds=(9e-10, 1e-9, 1e-9, 2e-9, 5e-9), contention=0.9,
                                 disk_bytes_per_s=3e9, disk_file_s=1e-5),
                  MACHINE.scaled(flops_per_s=1e10)])
    monkeypatch.setattr(machine_mod, "TRIES", 3)
    monkeypatch.setattr(machine_mod, "_measure", lambda cuda, dtype: next(tries))
    monkeypatch.setattr(machine_mod, "cpu_share", lambda: 1.0)
    # the disk's middle try (1e9 B/s and its 1e-4 s a file), not its fastest
    assert machine_mod.measure_machine(False, use_cache=False) == MACHINE


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
    monkeypatch.setattr(ps, "measure_machine", lambda cuda=None, dtype=None: MACHINE)
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
    monkeypatch.setattr(ps, "measure_machine", lambda cuda=None, dtype=None: MACHINE)
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


def test_a_product_past_the_measured_rows_costs_the_same_per_row():
    """Past 256 rows (an exact prefill's tile) each row costs what one of the 256 did, not
    a 256-row product plus the rest at another product's rate (a 4096-square fp32
    product's flops_per_s, half what this machine's bf16 kernels reach); between 64 and
    256 rows a product costs what the two measured ones say, not 64 rows' rate scaled."""
    per_row = MACHINE.row_seconds[-1] / 256
    for rows in (256, 544, 2176):
        assert MACHINE.element_seconds(rows) == pytest.approx(per_row * rows, rel=1e-12)
    assert MACHINE.element_seconds(160) == pytest.approx(
        (MACHINE.row_seconds[-2] + MACHINE.row_seconds[-1]) / 2, rel=1e-12)
    assert MACHINE.scaled(flops_per_s=1e9).element_seconds(544) == \
        MACHINE.element_seconds(544)


def test_a_layers_fixed_cost_never_falls_with_the_batch():
    """A batch-1 fixed cost measured above batch 8's (another program's turn in its steps)
    counts as batch 8's: a larger micro-batch never costs less."""
    noisy = MACHINE.scaled(layer_s=(6e-3, 5e-4))
    costs = [noisy.layer_seconds(b) for b in (1, 2, 4, 8, 16)]
    assert costs == sorted(costs) and costs[0] == pytest.approx(5e-4)
    assert MACHINE.layer_seconds(1) == pytest.approx(5e-4)
    assert MACHINE.layer_seconds(8) == pytest.approx(8e-4)


def test_each_weight_format_is_predicted_on_rates_measured_in_its_dtype(opt125):
    """bf16 and 4-bit weights computed in bf16 predicted on bf16's rates, fp32 on fp32's:
    the search asks for each compute dtype's machine once."""
    import torch

    slow = MACHINE.scaled(row_seconds=tuple(10 * x for x in MACHINE.row_seconds))
    asked = []

    def machine_for(dtype):
        asked.append(dtype)
        return slow if dtype == torch.bfloat16 else MACHINE

    from impress_flexgen.models import dtypes
    bf16 = candidates(False, dtypes.BF16, None)
    res = _resources(16.0)
    found = ps.search(opt125, machine_for, res, WORK, formats=bf16 + FP32)
    assert sorted(map(str, asked)) == ["torch.bfloat16", "torch.float32"]
    assert found.format.name == "fp32"      # bf16 at a tenth of the rate loses
    alone = ps.search(opt125, slow, res, WORK, formats=bf16)
    assert ps.search(opt125, machine_for, res, WORK, formats=bf16).prediction == \
        alone.prediction


def test_throughput_run_measures_the_machine_in_the_dtype_it_searches(tmp_path, capsys,
                                                                       monkeypatch):
    import torch

    asked = []
    monkeypatch.setattr(ps, "measure_machine",
                        lambda cuda=None, dtype=None: asked.append(dtype) or MACHINE)
    rc = run.main(["--model", "opt-tiny", "--dtype", "bf16", "--throughput", "--prompt-ids",
                   "5,6,7", "--max-new-tokens", "2", "--dry-run",
                   "--offload-dir", str(tmp_path / "off")])
    assert rc == 0
    assert asked and set(asked) == {torch.bfloat16}


def test_product_rates_are_measured_through_the_models_product(monkeypatch):
    """A few bf16 rows go by models.base.linear's own kernels: the rates are its."""
    import torch

    from impress_flexgen.models import base

    seen = []
    real = base.linear
    monkeypatch.setattr(base, "linear", lambda x, w, b=None: seen.append(x.shape[0]) or
                        real(x, w, b))
    monkeypatch.setattr(machine_mod, "_SIDE", 64)
    monkeypatch.setattr(machine_mod, "_last_cache_bytes", lambda: 0)
    out = machine_mod._row_seconds("cpu", torch.bfloat16, lambda: None)
    assert len(out) == len(machine_mod.ROWS) and all(x > 0 for x in out)
    assert set(seen) == set(machine_mod.ROWS)


def test_products_are_timed_over_more_than_the_last_cache(monkeypatch):
    """A large model's weights stream from memory at every step: the measured matrices
    together outgrow the CPU's last cache (480 MiB on the machine this was written on)."""
    import torch

    from impress_flexgen.models import base

    seen = set()
    real = base.linear
    monkeypatch.setattr(base, "linear", lambda x, w, b=None: seen.add(w.data_ptr()) or
                        real(x, w, b))
    monkeypatch.setattr(machine_mod, "_SIDE", 64)       # 32 x 128 fp32: 16 KiB a matrix
    monkeypatch.setattr(machine_mod, "_last_cache_bytes", lambda: 256 << 10)
    machine_mod._row_seconds("cpu", torch.float32, lambda: None)
    assert len(seen) * 16 * 1024 >= 512 << 10 > machine_mod._MATRICES * 16 * 1024


def test_the_disk_is_timed_on_files_a_large_models_matrices_fill(monkeypatch, tmp_path):
    """A decode step reads gigabytes in files of tens of MiB (read in two streams): the
    disk's rate comes from files that large, half a GiB a pass, not from 8 MiB bursts."""
    from impress_flexgen.models import direct_read
    from impress_flexgen.planner import transfers

    sizes = []
    monkeypatch.setattr(transfers.np, "save", lambda path, a: sizes.append(a.nbytes) or
                        (tmp_path / "x").write_bytes(b""))
    monkeypatch.setattr(transfers.np.lib.format, "open_memmap",
                        lambda path, mode: np.zeros(0, np.float32))
    monkeypatch.setattr(direct_read, "read_npy", lambda path, dst: 0)
    transfers.disk_rates(tmp_path, False)
    assert max(sizes) >= direct_read.SPLIT and sum(s for s in sizes if s == max(sizes)) \
        >= 512 << 20


def test_the_disk_moves_its_bytes_while_other_programs_have_the_cores(opt125):
    """On a loaded machine (a busy thread gets half a core) compute and a file's fixed cost
    take twice as long; the disk's bytes do not."""
    on_disk = Policy(0, 0, 100, 0, 1, 1)
    calm = ps.predict(opt125, on_disk, MACHINE, WORK, overlap=False)
    loaded = ps.predict(opt125, on_disk, MACHINE.scaled(share=0.5), WORK, overlap=False)
    files = sum(len(x.elements) * x.count for x in opt125.layers)
    assert loaded.compute_s == pytest.approx(2 * calm.compute_s, rel=1e-9)
    assert loaded.read_s == pytest.approx(calm.read_s + files * MACHINE.disk_file_s, rel=1e-9)
    in_memory = Policy(0, 100, 100, 0, 1, 1)      # CPU memory: a copy takes a core
    assert ps.predict(opt125, in_memory, MACHINE.scaled(share=0.5), WORK).read_s == \
        pytest.approx(2 * ps.predict(opt125, in_memory, MACHINE, WORK).read_s, rel=1e-9)


def test_a_product_of_fewer_rows_never_costs_more_per_element(monkeypatch):
    """A product of 4 rows timed slower than one of 16 (another program's turn) counts as
    the 16-row one: the measured curve never falls as the rows grow."""
    import torch

    from impress_flexgen.models import base

    slow = {4: 50}          # rows -> spins a product of them waits (another program)
    real = base.linear

    def linear(x, w, b=None):
        for _ in range(slow.get(x.shape[0], 0)):
            sum(range(200))
        return real(x, w, b)
    monkeypatch.setattr(base, "linear", linear)
    monkeypatch.setattr(machine_mod, "_SIDE", 64)
    monkeypatch.setattr(machine_mod, "_last_cache_bytes", lambda: 0)
    out = machine_mod._row_seconds("cpu", torch.float32, lambda: None)
    assert list(out) == sorted(out)


def test_an_exact_prefill_is_predicted_with_its_tiles_padded(opt125):
    """An exact policy computes each prefix's whole chunks by canonical tiles, a pass's such
    rows padded to whole tiles: one 136-token prompt multiplies 256 + 8 rows, not 136, and
    16 of them 8 full tiles + 128 rows; the prediction follows."""
    exact = Workload(136, 8, tiled=128, tile=256)
    assert exact.prefill_rows(1) == 264 and exact.prefill_rows(16) == 2048 + 128
    assert Workload(136, 8).prefill_rows(1) == 136
    alone = Policy(100, 0, 100, 0, 1, 1)
    plain = ps.predict(opt125, alone, MACHINE, Workload(136, 8)).prefill_s
    padded = ps.predict(opt125, alone, MACHINE, exact).prefill_s
    as_264 = ps.predict(opt125, alone, MACHINE, Workload(264, 8)).prefill_s
    assert plain < padded < as_264    # more rows through the products, the same attention
    block = Policy(100, 0, 100, 0, 4, 4)
    assert ps.predict(opt125, block, MACHINE, exact).prefill_s == pytest.approx(
        ps.predict(opt125, block, MACHINE, Workload(136, 8)).prefill_s, rel=0.01)


def test_a_llama_layers_fixed_cost_is_its_own(opt125):
    """A llama model's layers are predicted on the fixed cost measured on llama's layers
    (more small operations than OPT's); OPT's predictions do not change with it."""
    llama = ps.model_shape(resolve_spec(RuntimeConfig(model="llama-tiny", dtype=np.float32),
                                        False))
    alone = Policy(100, 0, 100, 0, 1, 1)
    heavier = MACHINE.scaled(llama_layer_s=(2e-3, 3e-3))
    layers = sum(x.count for x in llama.layers)
    assert ps.predict(llama, alone, heavier, WORK).compute_s == pytest.approx(
        ps.predict(llama, alone, MACHINE, WORK).compute_s + layers * (2e-3 - 5e-4), rel=1e-9)
    assert ps.predict(opt125, alone, heavier, WORK) == ps.predict(opt125, alone, MACHINE, WORK)


def test_a_stored_prefix_is_read_once_for_the_pass_not_computed(opt125):
    """A prefix whose KV the store holds is read, once for the pass whatever the block
    (the pass's sequences share its chunks), and only the rest of each prompt is
    multiplied: 16 x 8 rows in one call."""
    stored = Workload(136, 8, stored=128)
    assert stored.prefill_calls(16) == (128,) and stored.prefill_rows(1) == 8
    in_memory = Policy(100, 0, 100, 0, 4, 4)       # no weight reads: the KV's alone
    computed = ps.predict(opt125, in_memory, MACHINE, Workload(136, 8, tiled=128))
    read = ps.predict(opt125, in_memory, MACHINE, stored, overlap=False)
    assert read.prefill_s < computed.prefill_s
    slower = ps.predict(opt125, in_memory, MACHINE.scaled(disk_bytes_per_s=5e8), stored,
                        overlap=False)
    kv_bytes = 12 * 2 * opt125.kv_width * 128 * opt125.itemsize      # 12 layers, K and V
    assert slower.prefill_s - read.prefill_s == pytest.approx(kv_bytes / 5e8 - kv_bytes / 1e9,
                                                              rel=1e-9)
    assert slower.decode_step_s == read.decode_step_s


def test_a_prefills_element_wise_work_grows_with_its_rows(opt125):
    """A prefill pays PASS_OPS element-wise operations over the hidden width per row and
    layer (norms, residuals, tile copies); a decode step's are in the layer's fixed cost."""
    work, alone = Workload(136, 8), Policy(100, 0, 100, 0, 1, 1)
    none = ps.predict(opt125, alone, MACHINE, work)
    some = ps.predict(opt125, alone, MACHINE.scaled(activation_s=1e-10), work)
    assert some.prefill_s - none.prefill_s == pytest.approx(
        12 * 136 * 768 * ps.PASS_OPS * 1e-10, rel=1e-9)
    assert some.decode_step_s == none.decode_step_s


def test_an_overlapped_step_loses_what_the_reads_copies_take_of_the_cores(opt125):
    """The disk moves its bytes beside the compute: a step whose reads outlast each layer's
    compute and copies is its reads' time, whatever `contention`; the compute loses the
    core time of the reading's copies (times `contention`), so a step never takes more
    than its read and compute one after the other, nor less than the larger of them."""
    alone = Policy(0, 0, 100, 0, 1, 1)
    g = ps.predict(opt125, alone, MACHINE.scaled(contention=1.0), WORK)
    assert g.decode_step_s == pytest.approx(g.read_s, rel=1e-9)
    block = Policy(0, 0, 100, 0, 64, 1)
    free = ps.predict(opt125, block, MACHINE.scaled(disk_cpu_bytes_per_s=0.0), WORK)
    slow = MACHINE.scaled(disk_cpu_bytes_per_s=1e8, contention=1.0)   # copies outlast all
    busy = ps.predict(opt125, block, slow, WORK)
    serial = ps.predict(opt125, block, slow, WORK, overlap=False)
    assert max(free.read_s, free.compute_s) <= free.decode_step_s < busy.decode_step_s
    assert busy.decode_step_s <= serial.decode_step_s == pytest.approx(
        busy.read_s + busy.compute_s, rel=1e-9)


def test_each_sequence_pays_for_handling_its_stored_prefix_in_every_layer(opt125,
                                                                          monkeypatch):
    """Reading a stored prefix costs each sequence of the pass STORED_LAYER_COSTS layer
    fixed costs in every attention layer (matching, the policy's plan, gathering chunks);
    a computed prefix does not pay it."""
    stored, block = Workload(136, 8, stored=128), Policy(100, 0, 100, 0, 4, 4)
    with_cost = ps.predict(opt125, block, MACHINE, stored).prefill_s
    computed = ps.predict(opt125, block, MACHINE, Workload(136, 8, tiled=128)).prefill_s
    monkeypatch.setattr(ps, "STORED_LAYER_COSTS", 0)
    without = ps.predict(opt125, block, MACHINE, stored).prefill_s
    assert with_cost - without == pytest.approx(
        12 * 16 * 3 * MACHINE.layer_seconds(1), rel=1e-9)
    assert ps.predict(opt125, block, MACHINE, Workload(136, 8, tiled=128)).prefill_s == computed
