"""The store's crash, corruption and disk-full torture test, run in its quick mode."""
from __future__ import annotations

import json

import pytest

from experiments import crash_test


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
    assert r["iterations"] == 8
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
    assert rc == 0
    assert set(r) >= {"iterations", "committed", "lost", "corruptions_injected",
                      "corruptions_detected", "orphans_after_recovery", "capacity_evictions",
                      "enospc_injected", "enospc_handled", "seconds"}


def test_enospc_before_any_write_is_handled(quick):
    _, r = quick
    for case, n in r["details"]["enospc"]["by_case"].items():
        if case.endswith("before-write"):
            assert n["handled"] == n["injected"] > 0, (case, r["details"]["failures"])


def test_enospc_mid_write_leaves_no_file(quick):
    _, r = quick
    assert r["enospc_handled"] == r["enospc_injected"], r["details"]["failures"]
