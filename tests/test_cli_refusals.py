"""Bad command lines and unusable directories: one line on stderr, exit status 2, and nothing
built before the refusal; SIGTERM exits through the normal cleanup."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from impress_flexgen.entrypoints import run, verify
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.store.root import STORE_ROOT_MARK, _store_name

ROOT = Path(__file__).resolve().parents[1]


def _read_only_dir(path: Path) -> Path:
    """A directory of mode 0500; the test is skipped where that does not stop writes (root)."""
    path.mkdir(mode=0o500)
    try:
        (path / "probe").mkdir()
    except PermissionError:
        return path
    (path / "probe").rmdir()
    path.chmod(0o700)
    pytest.skip("this user writes into a read-only directory anyway (root)")


def _main(module, argv, capsys) -> tuple[int, str, str]:
    try:
        rc = run_main("prog", module.main, argv)
    except SystemExit as exc:  # argparse's refusals
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _refused(module, argv, capsys, message: str) -> str:
    rc, out, err = _main(module, argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2, (out, err)
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
    return out


@pytest.fixture
def base(tmp_path):
    """A cheap model with its directories in tmp_path; a flag that is not refused only
    generates one token."""
    return ["--model", "opt-tiny", "--offload-dir", str(tmp_path / "off"),
            "--store-dir", str(tmp_path / "stores")]


@pytest.mark.parametrize("flag, value, message", [
    ("--gpu-cache-gb", "nan", "--gpu-cache-gb must be a finite number"),
    ("--gpu-cache-gb", "inf", "--gpu-cache-gb must be a finite number"),
    ("--gpu-cache-gb", "-1", "--gpu-cache-gb must not be negative"),
    ("--cpu-cache-gb", "nan", "--cpu-cache-gb must be a finite number"),
    ("--cpu-cache-gb", "-inf", "--cpu-cache-gb must be a finite number"),
    ("--disk-capacity-gb", "nan", "--disk-capacity-gb must be a finite number"),
    ("--disk-capacity-gb", "1e400", "--disk-capacity-gb must be a finite number"),
    ("--disk-capacity-gb", "-0.5", "--disk-capacity-gb must not be negative"),
    ("--retention", "nan", "--retention must be a finite number"),
    ("--retention", "0", "--retention must be in (0, 1]"),
    ("--retention", "1.01", "--retention must be in (0, 1]"),
    ("--threshold-value", "nan", "--threshold-value must be a finite number"),
    ("--threshold-value", "-0.1", "--threshold-value must be in [0, 1]"),
    ("--threshold-value", "1.5", "--threshold-value must be in [0, 1]"),
    ("--adaptive-alpha", "nan", "--adaptive-alpha must be a finite number"),
    ("--adaptive-alpha", "0", "--adaptive-alpha must be positive"),
    ("--adaptive-alpha", "-1", "--adaptive-alpha must be positive"),
    ("--reorder-interval", "-5", "--reorder-interval must be 0 or more"),
    ("--reorder-hot-fraction", "nan", "--reorder-hot-fraction must be a finite number"),
    ("--reorder-hot-fraction", "0", "--reorder-hot-fraction must be in (0, 1]"),
    ("--reorder-hot-fraction", "2", "--reorder-hot-fraction must be in (0, 1]"),
    ("--prefixes", "0", "--prefixes must be positive"),
    ("--prefix-tokens", "-3", "--prefix-tokens must be positive"),
    ("--queries", "0", "--queries must be positive"),
    ("--query-tokens", "0", "--query-tokens must be positive"),
    ("--real-tokens", "0", "--real-tokens must be positive"),
    ("--max-new-tokens", "0", "--max-new-tokens must be positive"),
    ("--probe-queries", "-1", "--probe-queries must be 0 or more"),
    ("--probe-stride", "0", "--probe-stride must be positive"),
    ("--probe-every", "0", "--probe-every must be positive"),
    ("--chunk-size", "8", "--chunk-size must be between 16 and 256"),
    ("--chunk-size", "20", "--chunk-size must be a multiple of 8"),
    ("--seed", "-1", "--seed must be 0 or more"),
    ("--prefixes", "many", "invalid int value"),
    ("--retention", "half", "invalid float value"),
])
def test_run_refuses_a_bad_number(flag, value, message, base, tmp_path, capsys):
    # With --prompt-ids the serving flags are otherwise unused: only the check refuses them.
    _refused(run, [*base, "--prompt-ids", "5", f"{flag}={value}"], capsys, message)
    assert not (tmp_path / "off").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--prompts", "0", "--prompts must be between 1"),
    ("--prompts", "999", "--prompts must be between 1"),
    ("--new-tokens", "0", "--new-tokens must be positive"),
    ("--seed", "-2", "--seed must be 0 or more"),
])
def test_verify_refuses_a_bad_number(flag, value, message, tmp_path, capsys):
    _refused(verify, ["--model", "opt-tiny", "--offload-dir", str(tmp_path / "off"),
                      f"{flag}={value}"], capsys, message)


@pytest.mark.parametrize("module, flag, message", [
    ("ttft", "--gpu-cache-fraction", "--gpu-cache-fraction must be a finite number"),
    ("ttft", "--cpu-cache-fraction", "--cpu-cache-fraction must be a finite number"),
    ("selection_sweep", "--retention", "--retention must be a finite number"),
    ("crash_test", "--max-delay", "--max-delay must be a finite number"),
    ("gpu_repro", "--budget-s", "--budget-s must be a finite number"),
])
def test_experiments_refuse_nan(module, flag, message, capsys):
    import importlib

    mod = importlib.import_module(f"experiments.{module}")
    _refused(mod, ["--quick", f"{flag}=nan"], capsys, message)


def test_a_workload_longer_than_the_models_positions_is_refused_before_building(
        base, tmp_path, capsys):
    # opt-tiny has 1024 positions: 1000 prefix + 64 query + 8 new tokens do not fit.
    _refused(run, [*base, "--prefix-tokens", "1000", "--prefixes", "1", "--queries", "1"],
             capsys, "1072 positions, more than opt-tiny's 1024")
    assert not (tmp_path / "off").exists() and not (tmp_path / "stores").exists()


def test_a_padded_workload_counts_its_pad_positions(base, tmp_path, capsys):
    _refused(run, [*base, "--workload", "padded", "--prefix-tokens", "1024", "--real-tokens",
                   "64", "--prefixes", "1", "--queries", "1"], capsys, "more than opt-tiny's 1024")
    assert not (tmp_path / "off").exists()


def test_a_prompt_longer_than_the_models_positions_is_refused_before_building(
        base, tmp_path, capsys):
    ids = ",".join(["5"] * 1000)
    _refused(run, [*base, "--prompt-ids", ids, "--max-new-tokens", "25"], capsys,
             "1000 tokens + 25 new tokens need 1025 positions, more than opt-tiny's 1024")
    assert not (tmp_path / "off").exists()


def test_verify_refuses_too_many_new_tokens_before_building(tmp_path, capsys):
    _refused(verify, ["--model", "opt-tiny", "--offload-dir", str(tmp_path / "off"),
                      "--new-tokens", "5000"], capsys, "more than opt-tiny's 1024")
    assert not (tmp_path / "off").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--prompt", "", "--prompt is empty"),
    ("--prompt-ids", "", "--prompt-ids is empty"),
    ("--prompt-ids", ",", "--prompt-ids is empty"),
])
def test_an_empty_prompt_is_refused_before_building(flag, value, message, base, tmp_path,
                                                    capsys):
    _refused(run, [*base, flag, value], capsys, message)
    assert not (tmp_path / "off").exists()


def test_an_offload_dir_that_is_a_file_is_refused(base, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for off in (blocker, blocker / "below"):
        _refused(run, [*base, "--prompt-ids", "5", "--offload-dir", str(off)], capsys,
                 f"cannot use offload directory {off}")
    assert blocker.read_text() == ""


def test_a_read_only_offload_dir_is_refused(base, tmp_path, capsys):
    off = _read_only_dir(tmp_path / "ro")
    try:
        _refused(run, [*base, "--prompt-ids", "5", "--offload-dir", str(off)], capsys,
                 f"cannot use offload directory {off}")
    finally:
        off.chmod(0o700)


def test_a_store_dir_below_a_file_is_refused_before_building(base, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = blocker / "stores"
    _refused(run, [*base, "--quick", "--store-dir", str(store)], capsys,
             f"cannot use --store-dir {store}")
    assert not (tmp_path / "off").exists()


def test_a_read_only_store_dir_is_refused(base, tmp_path, capsys):
    store = _read_only_dir(tmp_path / "ro")
    try:
        _refused(run, [*base, "--quick", "--store-dir", str(store)], capsys, str(store))
    finally:
        store.chmod(0o700)


def test_a_read_only_existing_store_is_refused(base, tmp_path, capsys):
    """A store left by an earlier run, then made read-only (its marker file stays)."""
    argv = [*base, "--quick", "--max-new-tokens", "1"]
    assert run.main(argv) == 0
    capsys.readouterr()
    stores = tmp_path / "stores"
    paths = [stores, *stores.rglob("*")]
    for path in paths:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        try:
            (stores / "probe").mkdir()
        except PermissionError:
            pass
        else:
            pytest.skip("this user writes into a read-only directory anyway (root)")
        _refused(run, argv, capsys, str(stores))
    finally:
        for path in paths:
            path.chmod(path.stat().st_mode | 0o200)


def _impress_store_name() -> str:
    """The name of the impress store a `--quick` run of opt-tiny opens (its KV format is
    the compute dtype's)."""
    from disk_layout.format import kv_format_of
    from impress_flexgen.models import default_dtype

    return _store_name("impress", run.parse_args(["--quick"]),
                       kv_format_of(default_dtype("opt")))


def test_a_store_that_is_a_file_is_refused(base, tmp_path, capsys):
    """The store root is ours, but the policy's store directory in it is a regular file."""
    stores = tmp_path / "stores"
    stores.mkdir()
    (stores / STORE_ROOT_MARK).touch()
    store = stores / _impress_store_name()
    store.write_text("mine")
    _refused(run, [*base, "--quick", "--max-new-tokens", "1"], capsys, str(store))
    assert store.read_text() == "mine"


def test_a_corrupt_store_database_is_refused_and_kept(base, tmp_path, capsys):
    stores = tmp_path / "stores"
    store = stores / _impress_store_name()
    (store / "data").mkdir(parents=True)
    (stores / STORE_ROOT_MARK).touch()
    junk = np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8).tobytes()
    (store / "store.sqlite").write_bytes(junk)
    (store / "data" / "1-0.kv").write_bytes(b"k" * 4096)
    _refused(run, [*base, "--quick", "--max-new-tokens", "1"], capsys, str(store))
    assert (store / "store.sqlite").read_bytes() == junk
    assert (store / "data" / "1-0.kv").read_bytes() == b"k" * 4096
    assert list((tmp_path / "off").iterdir()) == []  # the runtime was closed


@pytest.mark.slow
def test_sigterm_exits_through_the_cleanup(tmp_path):
    off = tmp_path / "off"
    child = subprocess.Popen(
        [sys.executable, "-m", "impress_flexgen.run", "--model", "opt-tiny", "--prompt-ids", "5",
         "--max-new-tokens", "1000", "--placement", "disk", "--offload-dir", str(off)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (off.is_dir() and any(off.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # into generation
        assert child.poll() is None
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 143, err
    assert err.strip().splitlines() == ["python -m impress_flexgen.run: terminated"]
    assert list(off.iterdir()) == []
