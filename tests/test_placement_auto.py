"""Memory-aware placement: the plan's bytes are FlexGen's, auto fits the machine, and a plan
that cannot fit is refused in one line before anything is written."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from impress_flexgen.entrypoints import run
from impress_flexgen.errors import UserError
from impress_flexgen.models import placement as pl
from impress_flexgen.models import runtime
from impress_flexgen.models.placement import AUTO, GiB, Placement, Resources, make_plan
from impress_flexgen.models.quant import Groups
from impress_flexgen.models.runtime import Runtime, RuntimeConfig, resolve_spec
from impress_flexgen.store import scratch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def empty_weights_cache(tmp_path_factory, monkeypatch):
    """Plans count the weights a start must write: weights this machine's cache already
    holds (an earlier start's) would change what fits."""
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path_factory.mktemp("weights-cache")))


def _resources(ram_gib: float, disk_gib: float, gpu_gib: float | None = None,
               root: str = "/nonexistent") -> Resources:
    """A machine with exactly this much usable (nothing kept back)."""
    return Resources(cuda=gpu_gib is not None, gpu_free=int((gpu_gib or 0) * GiB), gpu_keep=0,
                     ram_free=int(ram_gib * GiB), ram_keep=0, disk_free=int(disk_gib * GiB),
                     disk_keep=0, offload_root=root)


def _plan(model: str, res: Resources, placement=AUTO, **cfg):
    """make_plan on `res` (resolve_spec plans on this machine: its choice is left out)."""
    rc = RuntimeConfig(model=model, placement=placement, **cfg)
    spec = dataclasses.replace(resolve_spec(rc, check_placement=False), weight_format=None)
    return make_plan(spec, rc, res)


def _allocated(rt) -> dict[str, int]:
    """Bytes of weights FlexGen actually placed on each device of `rt`."""
    env, out = rt.env, dict.fromkeys(pl.DEVICES, 0)
    names = {id(env.gpu): "gpu", id(env.cpu): "cpu", id(env.disk): "disk"}
    for home in rt.model.weight_home:
        for t in home.val:
            out[names[id(t.device)]] += int(t.bytes)
    return out


@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
@pytest.mark.parametrize("placement", ["gpu", "cpu", "disk", "mixed", "10,30,20,50,100,0"])
def test_planned_weight_bytes_are_what_flexgen_allocates(model, placement, offload_dir):
    with Runtime(RuntimeConfig(model=model, placement=Placement.parse(placement),
                               offload_dir=str(offload_dir))) as rt:
        assert _allocated(rt) == rt.plan.weights
        assert sum(rt.plan.weights.values()) == pl.footprint(rt.spec).weight_bytes


@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
@pytest.mark.parametrize("placement", ["gpu", "disk", "0,0,0,100,100,0"])
def test_planned_cache_bytes_are_what_a_full_length_generation_allocates(
        model, placement, offload_dir):
    with Runtime(RuntimeConfig(model=model, placement=Placement.parse(placement),
                               offload_dir=str(offload_dir))) as rt:
        seen = []
        init_cache = rt.model.init_cache

        def spy(j, k):
            init_cache(j, k)
            held = rt.model.cache_home[j][k].val
            if held:
                seen.append(sum(int(t.bytes) for t in held))

        rt.model.init_cache = spy
        limit = rt.spec.config.max_seq_len
        rt.generate([[5] * (limit - 3)], 3)  # the longest generation the model allows
        assert sum(seen) == sum(rt.plan.cache.values()) == pl.footprint(rt.spec).cache_bytes


def test_auto_keeps_everything_on_the_compute_device_when_it_fits():
    plan = _plan("opt-1.3b", _resources(ram_gib=64, disk_gib=100))
    assert plan.auto and plan.placement == Placement(100, 0, 100, 0, 100, 0)
    assert plan.weights["disk"] == plan.cache["disk"] == 0


def test_auto_offloads_to_disk_what_ram_cannot_hold():
    res = _resources(ram_gib=4, disk_gib=100)
    plan = _plan("opt-1.3b", res)  # 5.3 GiB of float32 weights without CUDA
    p = plan.placement
    assert 0 < p.w_gpu < 100 and p.w_cpu == 0 and plan.weights["disk"] > 0
    assert plan.needs["cpu"] <= res.ram and plan.needs["disk"] <= res.disk
    # As much as fits: one more percent of weights on the compute device would not.
    more = _plan("opt-1.3b", _resources(ram_gib=1000, disk_gib=100),
                 Placement(p.w_gpu + 1, 0, p.cache_gpu, 0, 100, 0))
    assert more.needs["cpu"] > plan.needs["cpu"]


def test_auto_with_cuda_fills_the_gpu_then_cpu_memory_then_disk():
    res = _resources(ram_gib=5 + pl.CUDA_RELAY_BYTES / GiB, disk_gib=100, gpu_gib=12)
    plan = _plan("opt-6.7b", res)
    p = plan.placement
    assert p.w_gpu > 0 and p.w_cpu > 0 and p.w_gpu + p.w_cpu < 100
    assert all(plan.needs[d] <= plan.available[d] for d in pl.DEVICES)
    assert plan.weights["gpu"] > 0 and plan.weights["cpu"] > 0 and plan.weights["disk"] > 0


def test_a_model_that_fits_nowhere_is_refused_with_what_would_work():
    with pytest.raises(UserError) as exc:
        _plan("opt-30b", _resources(ram_gib=20, disk_gib=60))
    msg = str(exc.value)
    assert "opt-30b does not fit this machine" in msg and "\n" not in msg
    if "float32" in msg:  # without CUDA: fp16 would fit, and says so
        assert "--dtype fp16 (" in msg and "would fit" in msg


def test_an_explicit_placement_that_cannot_fit_is_refused_naming_the_device():
    with pytest.raises(UserError, match=r"needs .* of (RAM|GPU memory).* usable"):
        _plan("opt-13b", _resources(ram_gib=8, disk_gib=500), Placement.parse("gpu"))
    with pytest.raises(UserError, match="free disk under /nonexistent"):
        _plan("opt-1.3b", _resources(ram_gib=64, disk_gib=1), Placement.parse("disk"))
    # The same model fits with its weights on disk.
    _plan("opt-13b", _resources(ram_gib=8, disk_gib=500), Placement.parse("disk"))


def test_the_tiers_the_caller_reserves_are_left_free():
    res = _resources(ram_gib=8, disk_gib=100)
    free = _plan("opt-1.3b", res).placement
    reserved = _plan("opt-1.3b", res, cpu_reserve_bytes=3 * GiB).placement
    assert reserved.w_gpu < free.w_gpu


def test_the_plan_is_printed_before_anything_is_allocated(monkeypatch, tmp_path, capsys):
    class Stop(Exception):
        pass

    def no_env(root):
        raise Stop  # the first thing Runtime builds after planning

    monkeypatch.setattr(runtime, "make_env", no_env)
    with pytest.raises(Stop):
        Runtime(RuntimeConfig(model="opt-tiny", placement=AUTO, offload_dir=str(tmp_path)))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("placement auto: weights 100/0/0, cache 100/0/0")
    assert out[1].startswith("memory plan: weights ") and ("RAM" in out[1] or "GPU" in out[1])
    assert list(tmp_path.iterdir()) == []


def test_a_runtime_resolves_auto_and_reports_it(offload_dir, capsys):
    with Runtime(RuntimeConfig(model="opt-tiny", placement=AUTO,
                               offload_dir=str(offload_dir))) as rt:
        assert isinstance(rt.placement, Placement) and rt.cfg.placement == rt.placement
        assert rt.plan.as_dict()["auto"] is True
        assert len(rt.generate([[5, 6, 7]], 2).new_ids[0]) == 2
    assert "memory plan:" in capsys.readouterr().out


def test_the_main_job_refuses_a_model_too_big_before_writing_anything(monkeypatch, tmp_path,
                                                                      capsys):
    store, off = tmp_path / "stores", tmp_path / "off"
    monkeypatch.setattr(pl, "machine_resources",
                        lambda root, *caps: _resources(ram_gib=6, disk_gib=10, root=str(root)))
    rc = run.run_main("run", run.main, ["--model", "opt-30b", "--quick", "--store-dir",
                                        str(store), "--offload-dir", str(off)])
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    assert len(out.err.strip().splitlines()) == 1 and "does not fit" in out.err
    assert not store.exists() and not off.exists()


def test_planning_sweeps_what_dead_runs_left_in_the_offload_dir(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"flexgen-{scratch.host_key()}-{dead.pid}-1-0123abcd"
    stale.mkdir()
    (stale / "w").write_bytes(b"0" * 4096)
    res = pl.machine_resources(tmp_path)
    assert not stale.exists() and res.disk_free > 0 and res.ram_free > 0


def test_auto_is_a_placement_name():
    assert Placement.parse("auto") is AUTO and AUTO.describe() == "auto"
    with pytest.raises(UserError, match="use auto, gpu"):
        Placement.parse("everywhere")
    with pytest.raises(UserError, match="finite"):
        Placement.parse("nan,0,100,0,100,0")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_opt_30b_starts_and_answers_within_seconds(tmp_path):
    """As a user types it, on whatever machine runs the tests: the plan (or a one-line
    refusal) comes before any weight is made; killed then, nothing stays behind."""
    off = tmp_path / "off"
    env = {**os.environ, "IMPRESS_FLEXGEN_CACHE": str(tmp_path / "cache")}
    child = subprocess.Popen(
        [sys.executable, "-m", "impress_flexgen.run", "--model", "opt-30b", "--quick",
         "--max-new-tokens", "1", "--offload-dir", str(off), "--store-dir", str(tmp_path / "s")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = child.stdout.readline()
        if first:  # it fits here: the plan came first
            assert first.startswith("placement auto:"), first
            assert child.stdout.readline().startswith("memory plan:")
        else:
            assert child.wait(timeout=60) == 2
            err = child.stderr.read()
            assert len(err.strip().splitlines()) == 1 and "does not fit" in err, err
    finally:
        child.kill()
        child.wait()
    if off.exists():
        pl.machine_resources(off)  # the next start sweeps the killed run's directory
        assert list(off.iterdir()) == []


# ---------------------------------------------------------------------------------------
# Weight formats: auto weighs fp32 (fp16 with CUDA) and 4-bit, within --max-ram-gb

def _auto(model: str, res: Resources, **cfg):
    """The plan of `--placement auto` with the weight format left open (the CLI's)."""
    return _plan(model, res, AUTO, compress_weight=None, **cfg)


def test_auto_keeps_the_dtype_while_every_weight_fits_in_memory():
    plan = _auto("opt-1.3b", _resources(ram_gib=64, disk_gib=100))
    assert not plan.format.compress and plan.weights["disk"] == 0
    assert "every weight in" in plan.describe()


def test_auto_holds_4bit_weights_in_memory_when_the_dtype_would_need_disk():
    plan = _auto("opt-6.7b", _resources(ram_gib=14, disk_gib=60))
    assert plan.format.compress and plan.format.groups == Groups(64, 0)
    assert plan.weights["disk"] == 0 and plan.placement.w_gpu + plan.placement.w_cpu == 100
    text = plan.describe()
    assert "chose int4: every weight in" in text and "would leave" in text and "on disk" in text


def test_auto_leaves_the_fewest_bytes_on_disk_when_nothing_fits_memory():
    res = _resources(ram_gib=14, disk_gib=200)
    plan = _auto("opt-30b", res)
    assert plan.format.compress and 0 < plan.weights["disk"]
    fp32 = _plan("opt-30b", res, AUTO, compress_weight=False)
    assert plan.weights["disk"] < fp32.weights["disk"]
    assert plan.needs["cpu"] <= res.ram and plan.needs["disk"] <= res.disk
    assert "the fewest bytes on disk" in plan.describe()


def test_the_formats_auto_weighs_are_a_list_a_new_dtype_joins(monkeypatch):
    """A format put first in the device's list is chosen first whenever it fits (bf16
    joins this way; fp16 stands in for it here)."""
    from impress_flexgen.models import formats

    cpu = (("fp16", np.float16, False),) + formats.AUTO_FORMATS["cpu"]
    monkeypatch.setitem(formats.AUTO_FORMATS, "cpu", cpu)
    monkeypatch.setattr(pl, "machine_resources", lambda *a: _resources(64, 100))
    plan = _auto("opt-1.3b", _resources(ram_gib=64, disk_gib=100))
    assert plan.format.name == "fp16" and plan.dtype == "float16"
    spec = resolve_spec(RuntimeConfig(model="opt-1.3b", placement=AUTO, compress_weight=None))
    assert spec.config.dtype == np.float16 and spec.weight_format.name == "fp16"


def test_max_ram_gb_caps_what_auto_uses(monkeypatch):
    free = _auto("opt-1.3b", _resources(ram_gib=64, disk_gib=100))
    capped = _auto("opt-1.3b", pl.Resources(**{**_resources(64, 100).__dict__,
                                                "ram_cap": 4 * GiB}))
    assert capped.needs["cpu"] <= 4 * GiB < free.needs["cpu"]
    assert capped.format.compress or capped.weights["disk"] > 0


def test_a_refusal_names_every_option_that_would_fit():
    """fp32 pinned (--no-compress-weight) on a machine that holds it only in 4 bits, or
    with a larger --max-ram-gb."""
    res = pl.Resources(**{**_resources(ram_gib=40, disk_gib=8).__dict__, "ram_cap": 4 * GiB})
    with pytest.raises(UserError) as exc:
        _plan("opt-6.7b", res, AUTO, compress_weight=False)
    msg = str(exc.value)
    assert "\n" not in msg and "opt-6.7b does not fit this machine" in msg
    options = msg.split("options that would fit: ")[1]
    assert "--dtype fp32 --compress-weight (" in options
    assert "--max-ram-gb " in options
    with pytest.raises(UserError) as exc:
        _plan("opt-30b", _resources(ram_gib=8, disk_gib=10), AUTO, compress_weight=None)
    assert "no option would fit here" in str(exc.value)


def test_an_explicit_placement_that_cannot_fit_names_auto_and_other_formats():
    with pytest.raises(UserError) as exc:
        _plan("opt-6.7b", _resources(ram_gib=14, disk_gib=60), Placement.parse("gpu"))
    msg = str(exc.value)
    assert "needs" in msg and "--placement auto (" in msg and "--compress-weight (" in msg


def test_by_default_a_few_gib_of_ram_and_disk_stay_free(tmp_path):
    res = pl.machine_resources(tmp_path)
    assert res.ram_keep >= 4 * GiB and res.disk_keep >= 4 * GiB
    assert res.ram == max(0, res.ram_free - res.ram_keep)
    capped = pl.machine_resources(tmp_path, max_ram=GiB, max_disk=2 * GiB)
    assert capped.ram == min(GiB, capped.ram_free) and capped.disk == min(2 * GiB,
                                                                         capped.disk_free)


@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny"])
@pytest.mark.parametrize("placement", ["gpu", "disk", "mixed"])
def test_planned_4bit_weight_bytes_are_what_flexgen_allocates(model, placement, offload_dir,
                                                              tmp_path, monkeypatch):
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "cache"))
    from flexgen.pytorch_backend import DeviceType

    with Runtime(RuntimeConfig(model=model, placement=Placement.parse(placement),
                               compress_weight=True, offload_dir=str(offload_dir))) as rt:
        env, got = rt.env, dict.fromkeys(pl.DEVICES, 0)
        names = {id(env.gpu): "gpu", id(env.cpu): "cpu", id(env.disk): "disk"}
        for home in rt.model.weight_home:
            for t in home.val:
                parts = t.data[:2] if t.device.device_type == DeviceType.COMPRESSED else [t]
                for part in parts:
                    got[names[id(part.device)]] += int(np.prod(part.shape)) * \
                        np.dtype(str(part.dtype).removeprefix("torch.")).itemsize
        assert got == rt.plan.weights


def test_dry_run_prints_the_plan_and_allocates_nothing(monkeypatch, tmp_path, capsys):
    cache, store, off = tmp_path / "cache", tmp_path / "stores", tmp_path / "off"
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(cache))
    monkeypatch.setattr(pl, "machine_resources",
                        lambda root, *caps: _resources(ram_gib=16, disk_gib=40, root=str(root)))

    def never(*args, **kwargs):
        raise AssertionError("a dry run built a runtime")

    monkeypatch.setattr(runtime.Runtime, "__init__", never)
    rc = run.run_main("run", run.main, ["--model", "opt-30b", "--quick", "--dry-run",
                                        "--store-dir", str(store), "--offload-dir", str(off)])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("placement auto:") and "opt-30b in int4" in lines[0]
    assert lines[1].startswith("memory plan:")
    assert "made once into the weights cache" in lines[2]
    assert lines[3].startswith("first start: writes ") and "GiB of weights" in lines[3]
    assert "about " in lines[3] or "unknown" in lines[3]
    assert lines[4] == "dry run: nothing was allocated or written"
    assert not cache.exists() and not store.exists() and not off.exists()
