"""Shared command-line plumbing: one-line errors, exit status 2, no tracebacks for users."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (no usage dump) and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def run_main(prog: str, main, argv=None) -> int:
    """Call main(argv); turn UserError into one line and exit status 2."""
    try:
        return main(argv) or 0
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def write_json(path: str | None, payload: dict) -> None:
    if path is None:
        return
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None


def choose_list(p: argparse.ArgumentParser, option: str, text: str, choices) -> list[str]:
    """A comma-separated subset of `choices`, returned in their order; else a usage error."""
    picked = [x for x in text.split(",") if x]
    if not picked or any(x not in choices for x in picked):
        p.error(f"{option}: choose from {', '.join(choices)}")
    return [x for x in choices if x in picked]


def placement_arg(text: str):
    """--placement: a name (gpu, cpu, disk, mixed) or six comma-separated percentages."""
    from .runtime import Placement

    try:
        return Placement.parse(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_args(p: argparse.ArgumentParser, default_model: str | None) -> None:
    from .models import MODEL_NAMES

    p.add_argument("--model", default=default_model, required=default_model is None,
                   metavar="NAME",
                   help=f"model name: {', '.join(MODEL_NAMES)} (with --model-path, any label)")
    p.add_argument("--model-path", metavar="DIR",
                   help="local Hugging Face OPT or Llama checkpoint; converted once to "
                        "FlexGen's per-tensor format and cached")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights (default 0)")
    p.add_argument("--dtype", choices=("fp16", "fp32"),
                   help="Llama compute dtype (default: fp16 on CUDA, fp32 on CPU; OPT is fp16)")
    p.add_argument("--offload-dir", metavar="DIR",
                   help="where FlexGen keeps disk-placed weights and cache "
                        "(default: the user cache directory)")


def dtype_arg(name: str | None):
    import numpy as np

    return {None: None, "fp16": np.float16, "fp32": np.float32}[name]
