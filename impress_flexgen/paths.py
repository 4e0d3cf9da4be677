"""Where impress_flexgen keeps converted weights, tokenizers and stores by default."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$IMPRESS_FLEXGEN_CACHE, else $XDG_CACHE_HOME/impress_flexgen, else ~/.cache/impress_flexgen."""
    env = os.environ.get("IMPRESS_FLEXGEN_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "impress_flexgen"


def weights_dir() -> Path:
    return cache_dir() / "weights"


def offload_dir() -> Path:
    return cache_dir() / "offload"
