"""The `impress-flexgen` command (python -m impress_flexgen) and the installable package."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "impress_flexgen", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_unknown_job_is_one_line_and_status_2():
    r = _run("bogus")
    assert r.returncode == 2
    assert r.stderr.strip() == ("impress-flexgen: unknown job 'bogus'; choose one of: "
                                "run, serve, verify")


def test_no_job_prints_usage_and_status_2():
    r = _run()
    assert r.returncode == 2 and r.stdout.startswith("usage: impress-flexgen")


@pytest.mark.slow
def test_jobs_take_their_modules_flags_and_user_errors():
    r = _run("run", "--model", "no-such-model")
    assert r.returncode == 2
    assert r.stderr.startswith("impress-flexgen run: error: unknown model 'no-such-model'")
    assert "Traceback" not in r.stderr
    r = _run("serve", "--help")
    assert r.returncode == 0 and "--port" in r.stdout


def test_pyproject_installs_the_packages_and_the_command():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["impress-flexgen"] == "impress_flexgen.entrypoints:main"
    deps = {d.split("==")[0] for d in meta["project"]["dependencies"]}
    reqs = {line.split("==")[0] for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line and not line.startswith("#")}
    runtime = reqs - {"pytest", "pytest-timeout", "openai", "httpx2"}
    assert runtime <= deps, f"requirements.txt pins missing from pyproject: {runtime - deps}"
    include = meta["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in ("impress_flexgen", "policies", "disk_layout"):
        assert f"{pkg}*" in include
