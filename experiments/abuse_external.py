"""The abuse classes checked in modules of their own (experiments.abuse_test's notes give
the function each must define), imported when they run.
"""
from __future__ import annotations

import importlib
import json
import tempfile
from pathlib import Path

# class: (module, function)
EXTERNAL = {"scoring_stall": ("experiments.abuse_scoring", "scoring_stall"),
            "logits_memory": ("experiments.abuse_scoring", "logits_memory"),
            "unauthenticated_pool": ("experiments.abuse_store", "unauthenticated_pool"),
            "fingerprint_edit": ("experiments.abuse_store", "fingerprint_edit"),
            "stored_vs_computed_logprobs": ("experiments.abuse_exact",
                                            "stored_vs_computed_logprobs")}


class NotAvailable(Exception):
    """A class whose module or function is missing."""


def run_external(name: str, quick: bool) -> tuple[str | None, dict]:
    """One round of a class checked in a module of its own: an error line or None, and
    the function's dict."""
    module, function = EXTERNAL[name]
    try:
        check = getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise NotAvailable(f"not available: no module {module}") from None
    except AttributeError:
        raise NotAvailable(f"not available: {module} has no {function}()") from None
    with tempfile.TemporaryDirectory(prefix=f"abuse-{name}-") as tmp:
        result = check(quick=quick, workdir=Path(tmp))
    if not isinstance(result, dict) or not isinstance(result.get("passed"), bool):
        return f"{function}() returned {type(result).__name__}, not a dict with passed", {}
    if result["passed"]:
        return None, result
    return str(result.get("error") or json.dumps(result, default=str))[:300], result
