"""The GPU check: the CUDA tests, the paper's TTFT rows and the planner's GPU cells within one
wall-clock budget, every result written to --out as soon as it is measured.

    bash scripts/gpu_check.sh [--out DIR]        # installs the kit's wheels, then runs this
    python -m experiments.gpu_check --out DIR --kit gpu-kit [--dry] [--started-at T]

Steps, most important first, each a child process ended when its time is up (SIGTERM, then
SIGKILL): the CUDA tests (at most --tests-s), experiments.gpu_repro (OPT-6.7B, 13B, then 30B
with its pool capped at --max-pool-gib; its own budget skips a row it would not finish before
the planner's reserve), then experiments.planner's GPU cells until the end, --end-s after the
script started. The children write their JSON after every row or cell; this process polls
them and rewrites, in --out:

  gpu_check.json   the machine, each step (command, status, seconds, exit status) and the
                   children's JSON as far as they got
  gpu_check.md     the tables to paste into docs/reproduction.md
  gpu_repro.png, planner_gpu.png   the children's figures, copied as they change

(scripts/gpu_check.sh adds gpu_check.log, everything printed.) The selection trace is the
kit's, recorded on a CPU: never re-recorded here. --dry runs the same steps on a CPU with
tiny models (opt-tiny, llama-tiny and opt-mini stand in for the three OPTs) to prove that
the image and the kit start everything.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from experiments.gpu_check_report import markdown

ROOT = Path(__file__).resolve().parents[1]
PROG = "python -m experiments.gpu_check"
END_S = 525.0            # the check ends 8 min 45 s after the script started (limit: 9 min)
TESTS_S = 60.0
PLANNER_RESERVE_S = 75.0  # kept from gpu_repro's rows for the planner's first cells
START_S = 10.0           # a child's imports before its own budget starts counting
GRACE_S = 10.0           # between SIGTERM and SIGKILL
POLL_S = 2.0
# Tests that run the engine and its tiers on the compute device (CUDA where there is one):
# the first whole, the others without their slow tests (@pytest.mark.slow).
DEVICE_TESTS = "tests/test_device_selection.py"
CUDA_TESTS = (DEVICE_TESTS, "tests/test_engine_exactness.py", "tests/test_engine_requests.py",
              "tests/test_memory_tiers.py", "tests/test_compat.py")


@dataclasses.dataclass(frozen=True)
class Sizes:
    models: str
    prefix_tokens: int
    query_tokens: int
    max_pool_gib: float
    planner_model: str
    planner_prefix_tokens: str
    planner_limits: str


# The paper's setting: 5,120-token prefixes; a pool over 8 GiB of KV (OPT-30B's two
# prefixes, 13.1 GiB) serves one prefix. The planner's cells: docs/reproduction.md.
FULL = Sizes("opt-6.7b,opt-13b,opt-30b", 5120, 64, 8.0, "opt-6.7b", "1024,2048,4096",
             "200,1000,none")
# Every code path of the full run, in seconds on a CPU: the third model's pool (opt-mini,
# 2 x 256 tokens x 2 KiB) is over the cap, so it serves one prefix as OPT-30B does.
DRY = Sizes("opt-tiny,llama-tiny,opt-mini", 256, 16, 0.0007, "opt-tiny", "128,256",
            "200,none")


@dataclasses.dataclass
class Step:
    name: str
    argv: list[str]
    result: Path | None = None       # the JSON the child writes as it goes
    figure: Path | None = None       # and its figure
    status: str = "waiting"
    rc: int | None = None
    started: float | None = None
    seconds: float | None = None
    tail: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> dict:
        out = {"name": self.name, "command": " ".join(self.argv[2:] if self.argv[:2] ==
                                                      [sys.executable, "-m"] else self.argv),
               "status": self.status, "rc": self.rc, "seconds": self.seconds}
        if self.status not in ("done", "waiting", "running"):
            out["last_lines"] = self.tail[-15:]
        return out


class Terminated(Exception):
    """SIGTERM from the script's own time limit."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where the results go")
    p.add_argument("--kit", default=str(ROOT / "gpu-kit"), help="the kit (make gpu-kit)")
    p.add_argument("--work", help="children's outputs and the stores (default: "
                                  "build/gpu_check/run)")
    p.add_argument("--dry", action="store_true", help="tiny models on a CPU")
    p.add_argument("--started-at", type=float, help="epoch seconds the budget counts from "
                                                    "(default: now)")
    p.add_argument("--end-s", type=float, default=END_S,
                   help=f"end this many seconds after --started-at ({END_S:g})")
    p.add_argument("--tests-s", type=float, default=TESTS_S,
                   help=f"at most this long for the CUDA tests ({TESTS_S:g})")
    p.add_argument("--probe", metavar="DIR", help="print the machine as JSON (DIR: where the "
                                                  "stores go) and stop")
    args = p.parse_args(argv)
    if args.started_at is None:
        args.started_at = time.time()
    return args


# -- the machine ------------------------------------------------------------------------
def _o_direct(directory: Path) -> bool:
    """Whether this file system takes O_DIRECT reads and writes (tmpfs and some sandboxes do
    not: the store then reads through the page cache, and disk times are not cold)."""
    import mmap

    if not hasattr(os, "O_DIRECT"):
        return False
    path = directory / f".o_direct_probe.{os.getpid()}"
    buf = mmap.mmap(-1, 1 << 20)          # page-aligned, as O_DIRECT needs
    buf.write(b"\x5a" * (1 << 20))
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.readv(fd, [buf]) == 1 << 20
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        buf.close()
        try:
            path.unlink()
        except OSError:
            pass


def probe(store_dir: Path) -> dict:
    """machine(), in a child process: this one never initialises CUDA (its context would
    hold GPU memory the steps need)."""
    try:
        out = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--out", "-",
                              "--probe", str(store_dir)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        return json.loads(out.stdout)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return {"error": f"the machine probe failed: {exc}"}


def machine(store_dir: Path) -> dict:
    import platform

    import psutil
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "cpu_count": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "ram_bytes": psutil.virtual_memory().total}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, gpu_memory_bytes=props.total_memory,
                    gpu_count=torch.cuda.device_count())
    else:
        info["device"] = "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
        if out.returncode == 0:
            info["nvidia_smi"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    store_dir.mkdir(parents=True, exist_ok=True)
    info.update(store_dir=str(store_dir), disk_free_bytes=shutil.disk_usage(store_dir).free,
                o_direct=_o_direct(store_dir))
    return info


# -- the steps --------------------------------------------------------------------------
def plan(args, work: Path, stores: Path) -> list[Step]:
    py = [sys.executable, "-m"]
    sizes = DRY if args.dry else FULL
    tests = [t for t in CUDA_TESTS if (ROOT / t).exists()]
    others = [t for t in tests if t != DEVICE_TESTS]
    deselect = [arg for t in slow_tests(others) for arg in ("--deselect", t)]
    repro_out = work / "gpu_repro"
    repro = [*py, "experiments.gpu_repro", "--out", str(repro_out), "--models", sizes.models,
             "--prefix-tokens", str(sizes.prefix_tokens), "--query-tokens",
             str(sizes.query_tokens), "--max-pool-gib", f"{sizes.max_pool_gib:g}",
             "--trace", str(Path(args.kit) / "selection_trace.json"),
             "--store-root", str(stores)]
    if args.dry:
        repro.append("--allow-cpu")
    planner = [*py, "experiments.planner", "--model", sizes.planner_model, "--prefix-tokens",
               sizes.planner_prefix_tokens, "--limits", sizes.planner_limits, "--prefixes", "1",
               "--queries", "2", "--json", str(work / "planner_gpu.json"), "--figure",
               str(work / "planner_gpu.png"), "--store-root", str(stores)]
    return [Step("tests", [*py, "pytest", "-q", "-p", "no:cacheprovider", "--junitxml",
                           str(work / "tests.xml"), *deselect, *tests]),
            Step("gpu_repro", repro, repro_out / "gpu_repro.json", repro_out / "gpu_repro.png"),
            Step("planner", planner, work / "planner_gpu.json", work / "planner_gpu.png")]


def slow_tests(paths) -> list[str]:
    """The tests of `paths` (tests/x.py) marked @pytest.mark.slow, read without importing
    them (sorted); a module marked whole (`pytestmark`) gives all its tests."""
    import ast

    found = []
    for path in paths:
        tree = ast.parse((ROOT / path).read_text())
        whole = any(isinstance(n, ast.Assign) and ast.unparse(n.value) == "pytest.mark.slow"
                    and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
                    for n in tree.body)
        found += [f"{path}::{node.name}" for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and
                  node.name.startswith("test") and
                  (whole or "pytest.mark.slow" in map(ast.unparse, node.decorator_list))]
    return sorted(found)


def junit(path: Path) -> dict | None:
    """Counts and failed tests from pytest's --junitxml (None when it did not finish)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] -
            counts["skipped"], "seconds": float(suite.get("time", 0)), "failed": failed}


class Report:
    """gpu_check.json, gpu_check.md and the figures in --out, rewritten as results land."""

    def __init__(self, out: Path, args, steps: list[Step], work: Path):
        self.out, self.args, self.steps, self.work = out, args, steps, work
        self.doc = {"check": {"dry": args.dry, "command": "bash scripts/gpu_check.sh",
                              "started": datetime.datetime.fromtimestamp(
                                  args.started_at, datetime.timezone.utc).isoformat(
                                  timespec="seconds"),
                              "end_s": args.end_s, "kit": kit_summary(Path(args.kit))},
                    "machine": {}, "steps": [], "tests": None, "gpu_repro": None,
                    "planner": None}
        self.seen: dict[Path, float] = {}

    def _load(self, path: Path | None):
        """The child's JSON if it changed since the last look (a half-written one is read
        next time); None otherwise."""
        if path is None or not path.exists():
            return None
        mtime = path.stat().st_mtime
        if self.seen.get(path) == mtime:
            return None
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        self.seen[path] = mtime
        return doc

    def _copy_figure(self, path: Path | None, settled: bool) -> None:
        if path is None or not path.exists():
            return
        mtime = path.stat().st_mtime
        if self.seen.get(path) == mtime or (not settled and time.time() - mtime < 1.0):
            return      # unchanged, or perhaps still being drawn
        self.seen[path] = mtime
        shutil.copyfile(path, self.out / path.name)

    def refresh(self, settled: bool = False) -> None:
        """Read what the children wrote since the last look and rewrite --out. `settled`:
        no child is running (its figure is whole whatever its age)."""
        for step in self.steps:
            doc = self._load(step.result)
            if doc is not None:
                self.doc[step.name] = doc
            self._copy_figure(step.figure, settled)
        self.doc["tests"] = junit(self.work / "tests.xml") or self.doc["tests"]
        self.doc["steps"] = [s.summary() for s in self.steps]
        self.doc["check"]["elapsed_s"] = round(time.time() - self.args.started_at, 1)
        _write(self.out / "gpu_check.json", json.dumps(self.doc, indent=2) + "\n")
        _write(self.out / "gpu_check.md", markdown(self.doc))


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def kit_summary(kit: Path) -> dict:
    files = sorted(p for p in kit.rglob("*") if p.is_file()) if kit.is_dir() else []
    return {"path": str(kit), "bytes": sum(p.stat().st_size for p in files),
            "wheels": sorted(p.name for p in files if p.suffix == ".whl")}


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's process group (its cleanup removes its stores), SIGKILL after
    GRACE_S."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, stop_at: float, report: Report) -> None:
    """Run one child until it exits or `stop_at`, echoing its output and polling its
    results."""
    print(f"\n== {step.name}: {' '.join(step.argv[2:])}", flush=True)
    step.started, step.status = time.time(), "running"
    # Its own process group (not a session: the runner's clean-up still reaches it).
    proc = subprocess.Popen(step.argv, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, process_group=0,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    tail: collections.deque = collections.deque(maxlen=40)

    def echo():
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    stopped = False
    try:
        while True:
            try:
                proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            report.refresh()
            if time.time() >= stop_at:
                print(f"== {step.name}: its time is up: stopping it", flush=True)
                stopped = True
                _stop(proc)
                break
    finally:
        if proc.poll() is None:     # this process was told to stop meanwhile
            stopped = True
            _stop(proc)
        reader.join(timeout=5)
        step.rc, step.tail = proc.returncode, list(tail)
        step.seconds = round(time.time() - step.started, 1)
        step.status = "stopped at its time limit" if stopped else \
            "done" if proc.returncode == 0 else f"failed (exit status {proc.returncode})"
        print(f"== {step.name}: {step.status} after {step.seconds:.0f} s", flush=True)
        report.refresh(settled=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe:
        print(json.dumps(machine(Path(args.probe)), indent=2))
        return 0
    end = args.started_at + args.end_s
    work = Path(args.work) if args.work else ROOT / "build" / "gpu_check" / "run"
    stores = work / "stores"
    out = Path(args.out)
    steps = plan(args, work, stores)
    # An earlier run's results must not pass for this one's: only they are removed.
    figures = [out / s.figure.name for s in steps if s.figure is not None]
    for old in [stores, work / "tests.xml", *figures,
                *(p for s in steps for p in (s.result, s.figure))]:
        if old is not None and old.is_dir():
            shutil.rmtree(old)
        elif old is not None:
            old.unlink(missing_ok=True)
    for d in (out, work, stores):
        d.mkdir(parents=True, exist_ok=True)
    report = Report(out, args, steps, work)

    def terminated(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, terminated)
    try:
        report.doc["machine"] = m = probe(stores)
        report.refresh()
        print(f"{m.get('device')}; torch {m.get('torch')} (CUDA {m.get('cuda')}); "
              f"{m.get('cpu')}; stores on {stores}: "
              f"{m.get('disk_free_bytes', 0) / 2**30:.1f} GiB free, O_DIRECT "
              f"{'yes' if m.get('o_direct') else 'no'}", flush=True)
        tests, repro, planner = steps
        for step, stop_at in ((tests, time.time() + args.tests_s),
                              (repro, end - PLANNER_RESERVE_S), (planner, end)):
            stop_at = min(stop_at, end)
            left = stop_at - time.time()
            if left < 2 * START_S:
                step.status = f"skipped: {max(left, 0):.0f} s left"
                continue
            if step is repro:
                step.argv += ["--budget-s", f"{left - START_S:.0f}"]
            run_step(step, stop_at, report)
    except Terminated:
        print(f"{PROG}: terminated: the results so far are in {out}", file=sys.stderr)
        return 143
    finally:
        for step in steps:
            if step.status == "waiting":
                step.status = "not reached"
        shutil.rmtree(stores, ignore_errors=True)
        report.refresh(settled=True)
        print(f"\n{PROG}: wrote {out / 'gpu_check.md'} and {out / 'gpu_check.json'} "
              f"({time.time() - args.started_at:.0f} s after the start)", flush=True)
    return 0 if passed(report.doc, args.dry) else 1


def passed(doc: dict, dry: bool) -> bool:
    """Every step finished (on the GPU a step may also be stopped at its time limit: its
    finished rows stand) and no test failed."""
    tests = doc.get("tests") or {}
    return not tests.get("failed") and all(
        s["status"] == "done" or (not dry and s["status"].startswith("stopped"))
        for s in doc["steps"])


if __name__ == "__main__":
    sys.exit(main())
