"""Where a run's stores live: the folder per model identity, the mark that claims it, and
one store per policy layout inside it."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from .errors import UserError
from .store.config import CHUNK_SIZE

STORE_ROOT_MARK = ".impress_flexgen-stores"


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Where a run's stores live and how they behave on this machine. What shapes a store's
    files (chunk size, probe format, layout) belongs to the RunConfig (store_options())."""

    root: str | Path | None = None          # None: <cache>/stores/<model>-<identity>
    disk_capacity_bytes: int | None = None  # None: unlimited
    reorder_interval: int = 50              # queries between background reorders; 0: never
    read_limit_mb_s: float | None = None    # disk read bandwidth cap; None: none

    def root_for(self, model, chunk_size: int | None = None) -> Path:
        """The folder of `model`'s stores (a ModelSpec; a bare name only for callers that
        have no model): the root given, else one per model identity (its label and the
        short form of its fingerprint), so that other weights, another seed or checkpoint,
        or another dtype never open a store of KV they did not compute."""
        from .paths import cache_dir

        if self.root:
            return Path(self.root).expanduser()
        if isinstance(model, str):
            return cache_dir() / "stores" / model
        from .engine import model_shape

        shape = model_shape(model, chunk_size or CHUNK_SIZE)
        label = re.sub(r"[^A-Za-z0-9._-]+", "-", shape.name).strip("-.") or "model"
        return cache_dir() / "stores" / (f"{label}-{shape.short_id}" if shape.short_id
                                         else label)

    def open_options(self) -> dict:
        """open_store keyword arguments (besides the RunConfig's)."""
        return {"disk_capacity_bytes": self.disk_capacity_bytes,
                "reorder_interval": self.reorder_interval,
                "read_limit_mb_s": self.read_limit_mb_s}


def claim_store_root(root: Path) -> None:
    """Refuse a directory that holds something other than our stores; mark ours."""
    try:
        if root.exists() and not root.is_dir():
            raise UserError(f"--store-dir {root} is not a directory")
        if root.is_dir() and any(root.iterdir()) and not (root / STORE_ROOT_MARK).exists():
            raise UserError(f"--store-dir {root} is not empty and was not made by "
                            "impress_flexgen; choose an empty or new directory")
        if not root.exists():
            root.mkdir(mode=0o700, parents=True)     # stores hold prompts: owner only
        (root / STORE_ROOT_MARK).touch()
    except OSError as exc:
        raise UserError(f"cannot use --store-dir {root}: {exc.strerror or exc}") from None


def _store_name(policy: str, args) -> str:
    """Policies that can share a store layout share nothing else: one store each, named by
    what shapes its files (chunk size, probe format) and by whether it is reordered; v2:
    chunks packed when they are not whole pages (stores of the aligned layout stay apart)."""
    layout = "-semantic" if getattr(args, "reorder_by", "importance") == "semantic" else ""
    return f"{policy.replace(':', '-')}-c{args.chunk_size}-{args.probe_format}-v2{layout}"
