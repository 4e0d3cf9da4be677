"""Where a run's stores live: the mark that claims the folder (config.StoreOptions names
it, one per model identity), and one store per policy layout inside it."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError

STORE_ROOT_MARK = ".impress_flexgen-stores"


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


def _store_name(policy: str, args, kv_format: str = "fp16") -> str:
    """Policies that can share a store layout share nothing else: one store each, named by
    what shapes its files (chunk size, probe format, KV format: the store's ModelShape's)
    and by whether it is reordered; v2: chunks packed when they are not whole pages (stores
    of the aligned layout stay apart). fp16 KV, the only format before there were others,
    is not named: its stores keep their names."""
    layout = "-semantic" if getattr(args, "reorder_by", "importance") == "semantic" else ""
    kv = "" if kv_format == "fp16" else f"-kv{kv_format}"
    return f"{policy.replace(':', '-')}-c{args.chunk_size}-{args.probe_format}{kv}-v2{layout}"
