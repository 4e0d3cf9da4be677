"""What a conversion of a checkpoint is keyed by: what the checkpoint's files hold.

A conversion in the weights cache is named by the SHA-256 of each source file's content (with
its name within the checkpoint), so identical checkpoints at different paths (the same
package installed in a fresh virtual environment, the same seeded test checkpoint in a new
temporary directory) share one conversion. Hashing a 100 MB file at every start would cost
more than the start itself, so each file's hash is remembered in an index in the cache root
(SOURCE_HASHES.json), keyed by the file's path and identity (size, mtime, ctime, inode,
device): a file whose identity is the one recorded is not read again; a file written in
place (its mtime put back or not) has another ctime, and is hashed again.

The index is rewritten whole (a temporary file, fsynced, renamed into place) by a process
that hashed something; two processes writing at once lose one's additions, and an
unreadable index is taken as empty: either only costs a hash, never a wrong answer.

Conversions keyed by the earlier scheme (their checkpoint's paths) are no longer looked up.
`prune_path_keyed` removes those that nothing can use any more (see there).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path

INDEX = "SOURCE_HASHES.json"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEYED_DIR = re.compile(r".+-[0-9a-f]{16}")
DAY = 86400.0


def file_identity(st: os.stat_result) -> list[int]:
    """What tells that a file is unchanged without reading it: size and mtime can be put
    back after an edit, but a write in place also moves the ctime (which cannot be set
    back) and a replacement brings another inode."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_index(root: Path) -> dict:
    try:
        index = json.loads((root / INDEX).read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _write_index(root: Path, index: dict) -> None:
    """Keep only entries whose file is still there as recorded, and replace the index
    atomically. A failure is ignored: it only costs a hash next time."""
    kept = {}
    for path, entry in index.items():
        try:
            if isinstance(entry, dict) and entry.get("identity") == file_identity(os.stat(path)):
                kept[path] = entry
        except OSError:
            pass
    for left in root.glob(f"{INDEX}.*.tmp"):      # by a process killed while writing
        try:
            if time.time() - left.stat().st_mtime > DAY:
                left.unlink()
        except OSError:
            pass
    tmp = root / f"{INDEX}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(kept, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / INDEX)
    except OSError:
        tmp.unlink(missing_ok=True)


def content_hashes(root: Path, paths: list[Path]) -> list[tuple[list[int], str]]:
    """(identity, SHA-256 of the content) of each file, in order: from the index where the
    file's identity is the one recorded, else read and hashed (and recorded, unless the
    file changed while it was read)."""
    index = _read_index(root)
    out, hashed = [], False
    for p in paths:
        path = str(Path(p).resolve())
        identity = file_identity(os.stat(path))
        known = index.get(path)
        if isinstance(known, dict) and known.get("identity") == identity \
                and _HEX64.fullmatch(str(known.get("sha256"))):
            out.append((identity, known["sha256"]))
            continue
        digest = file_sha256(path)
        out.append((identity, digest))
        if file_identity(os.stat(path)) == identity:
            index[path] = {"identity": identity, "sha256": digest}
            hashed = True
    if hashed:
        _write_index(root, index)
    return out


def prune_path_keyed(root: Path, marker: str) -> list[str]:
    """Remove conversions keyed by their checkpoint's paths (the scheme before content
    keys), where nothing can use them any more: every source path their `marker` file
    records is gone, it was written more than a day ago, and no process this one can see
    has a file of theirs open or mapped. A process of an older version could still use
    one whose sources exist, so those stay. Returns the directories removed."""
    removed, held = [], None
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not (entry.is_dir(follow_symlinks=False) and _KEYED_DIR.fullmatch(entry.name)):
            continue
        done_path = os.path.join(entry.path, marker)
        try:
            written = os.stat(done_path, follow_symlinks=False).st_mtime
            with open(done_path) as f:
                done = json.load(f)
        except (OSError, ValueError):
            continue
        sources = done.get("source_files") if isinstance(done, dict) else None
        if not isinstance(sources, dict) or not sources or "source_content" in done:
            continue
        if time.time() - written < DAY or any(os.path.lexists(p) for p in sources):
            continue
        held = _held_paths() if held is None else held
        prefix = os.path.realpath(entry.path) + "/"
        if held is _UNKNOWN or any(p.startswith(prefix) for p in held):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


_UNKNOWN: list[str] = []


def _held_paths() -> list[str]:
    """The files the processes we can inspect have open or mapped (disk-placed weights are
    read where they lie), or _UNKNOWN without /proc."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return _UNKNOWN
    held = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:     # closed meanwhile
                pass
        try:
            with open(f"/proc/{pid}/maps") as f:
                fields = [line.rstrip("\n").split(None, 5) for line in f]
        except OSError:
            fields = []
        held += [f[5] for f in fields if len(f) == 6]
    return held
