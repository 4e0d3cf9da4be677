"""The store's crash, corruption and disk-full torture test, run in its quick mode."""
from __future__ import annotations

import json

import pytest

from experiments import crash_test

pytestmark = pytest.mark.slow     # every test here runs a model or a harness end to end

NEW_CLASSES = ("power_loss", "torn_write", "io_error", "fsync", "sqlite_full", "sqlite_damage",
               "crash_recovery", "crash_eviction", "crash_quarantine", "tiers")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    out = base / "crash.json"
    rc = crash_test.main(["--quick", "--iterations", "8", "--dir", str(base / "stores"),
                          "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_quick_crash_test_meets_its_targets(quick):
    rc, r = quick
    failures = r["details"]["failures"]
    assert r["details"]["kill_loop"]["iterations"] == 8
    assert r["committed"] > 0
    assert r["lost"] == 0, failures
    assert r["orphans_after_recovery"] == 0, failures
    assert r["corruptions_injected"] >= 8
    assert r["corruptions_detected"] == r["corruptions_injected"], failures
    assert r["details"]["kill_loop"]["writer_errors"] == 0, failures
    assert r["details"]["kill_loop"]["bad_nodes"] == 0, failures
    assert r["details"]["corruption"]["false_detections"] == 0, failures
    assert r["details"]["corruption"]["served_corrupt"] == 0, failures
    assert r["capacity_evictions"] > 0
    assert r["details"]["capacity"]["over_capacity"] == 0, failures
    assert r["enospc_injected"] > 0
    assert rc == 0, failures
    assert set(r) >= {"iterations", "committed", "lost", "corruptions_injected",
                      "corruptions_detected", "orphans_after_recovery", "capacity_evictions",
                      "enospc_injected", "enospc_handled", "seconds", "faults", "served_wrong",
                      "orphans"}


def test_enospc_before_any_write_is_handled(quick):
    _, r = quick
    for case, n in r["details"]["enospc"]["by_case"].items():
        if case.endswith("before-write"):
            assert n["handled"] == n["injected"] > 0, (case, r["details"]["failures"])


def test_enospc_mid_write_leaves_no_file(quick):
    _, r = quick
    assert r["enospc_handled"] == r["enospc_injected"], r["details"]["failures"]


def test_every_fault_class_injects_and_is_accounted_for(quick):
    _, r = quick
    faults = r["faults"]
    assert set(faults) == set(crash_test.PARTS) - {"capacity"}   # capacity: its own totals
    assert set(faults) >= set(NEW_CLASSES) | {"kill", "corruption", "enospc"}
    assert r["iterations"] == sum(f["injected"] for f in faults.values())
    assert r["orphans"] == r["orphans_after_recovery"] == 0
    for cls, f in faults.items():
        assert f["injected"] > 0, cls
        assert f["served_wrong"] == 0, (cls, r["details"]["failures"])
        assert f["lost"] == 0, (cls, r["details"]["failures"])
        assert f["detected"] + f["harmless"] == f["injected"], (cls, r["details"]["failures"])
    assert r["served_wrong"] == sum(f["served_wrong"] for f in faults.values()) == 0


def test_each_fault_class_is_a_registered_module_that_says_what_it_injects():
    from experiments.crash_test import faults
    from experiments.crash_test.registry import FAULTS

    assert tuple(FAULTS) == crash_test.PARTS
    for name, fault in FAULTS.items():
        module = getattr(faults, name)
        assert fault.run.__module__ == module.__name__
        assert module.__doc__.startswith(f"{name}: "), name


def test_faults_patch_the_store_io_modules_and_put_them_back():
    import importlib
    import os

    from experiments.crash_test import patching

    mods = [importlib.import_module(name) for name in patching.STORE_IO]
    assert all(m.os is os for m in mods)
    fake = object()
    with patching.patched_os(fake):
        assert all(m.os is fake for m in mods)
    assert all(m.os is os for m in mods)
    calls = []
    with patching.patched("write_durable", lambda *a: calls.append(a)):
        import disk_layout.io as disk_io
        disk_io.write_durable("x", [], 0)
    assert calls == [("x", [], 0)]
    assert disk_io.write_durable is patching.REAL["write_durable"]


def test_power_loss_restores_fsynced_state_and_tears_the_rest(quick):
    _, r = quick
    p = r["details"]["power_loss"]
    assert p["restored"] > 0 and p["committed"] > 0
    torn = p["files"]
    assert torn.get("deleted", 0) + torn.get("truncated", 0) + torn.get("zeroed", 0) > 0, torn
    assert p["lost"] == p["orphans"] == p["bad_nodes"] == 0, r["details"]["failures"]


def test_crashes_during_recovery_eviction_and_quarantine(quick):
    _, r = quick
    d = r["details"]
    assert d["crash_eviction"]["removals"] > 0            # the store did evict
    assert d["crash_quarantine"]["corruptions_injected"] > 0
    assert d["crash_quarantine"]["corruptions_detected"] == \
        d["crash_quarantine"]["corruptions_injected"], d["failures"]
    for part in ("crash_recovery", "crash_eviction", "crash_quarantine"):
        assert d[part]["writer_errors"] == 0, d["failures"]
        assert d[part]["lost"] == d[part]["orphans"] == d[part]["bad_nodes"] == 0, d["failures"]


def test_damaged_databases_are_refused_or_served_exact(quick):
    _, r = quick
    s = r["details"]["sqlite_damage"]
    assert s["iterations"] == r["faults"]["sqlite_damage"]["injected"] == 60
    assert len(s["by_mode"]) >= 6
    assert s["errors"] == s["wrong_nodes"] == 0, r["details"]["failures"]
    assert s["refused"] > 0 and s["opened"] > 0


def test_io_errors_and_fsync_failures(quick):
    _, r = quick
    io, fs = r["details"]["io_error"], r["details"]["fsync"]
    assert set(io["by_kind"]) == {"eio", "directory", "fifo", "symlink"}
    assert io["eio_reads"] > 0
    assert fs["injected"] > 0
    assert io["detected"] == io["injected"] and io["fifo_releases"] == 0, \
        r["details"]["failures"]
    assert fs["handled"] == fs["injected"] and fs["left_files"] == 0, r["details"]["failures"]


def test_tiers_under_request_threads_serve_exact_chunks(quick):
    _, r = quick
    t = r["details"]["tiers"]
    assert t["chunks"] > 0 and t["requests"] > 0
    assert t["gpu_bytes_served"] > 0 and t["cpu_bytes_served"] > 0
    assert t["splits"] > 0 and t["reorders"] > 0 and t["evictions"] > 0
    assert t["wrong"] == t["errors"] == 0, r["details"]["failures"]


def test_bad_arguments_are_one_line_errors(capsys):
    for argv in (["--only", "bogus"], ["--fuzz", "0"], ["--max-delay", "nan"], ["--strict"]):
        with pytest.raises(SystemExit) as exc:
            crash_test.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error" in err, err
