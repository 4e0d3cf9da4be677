"""Scratch directories that a killed process does not leave behind for good.

A scratch directory's name records its owner: a machine key, the owner's pid and the
owner's start time, e.g. `flexgen-1a2b3c4d-4242-918273-9f86d081`. A later process that makes
a scratch directory in the same root first sweeps it: a directory whose owner is gone (no
such pid, a zombie, or that pid now belongs to a process started at another time) is
removed. Nothing else is ever touched: only entries directly inside the root whose name
matches the pattern exactly, made under this machine key, owned by this user, and that are
real directories (never a symbolic link, never followed).

The machine key is the running kernel's boot id (random per boot, so two hosts of one name,
or cloned from one image, never share it; else /etc/machine-id, else the host name) and the
pid namespace. A directory left by a process killed before a reboot is therefore never
judged again: it stays for the operator, rather than risk another machine's live one.

    with scratch.directory(root, "store") as path:   # removed at the end
        ...
    path = scratch.make(root, "flexgen")             # the caller removes it
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import zlib
from pathlib import Path
from typing import Iterator

import psutil

NAME_RE = re.compile(r"^(?P<label>[a-z]+)-(?P<host>[0-9a-f]{8})-(?P<pid>[1-9][0-9]{0,9})-"
                     r"(?P<start>[0-9]{1,20})-[0-9a-f]{8}$")
_LABEL_RE = re.compile(r"^[a-z]+$")


_MACHINE_IDS = ("/proc/sys/kernel/random/boot_id", "/etc/machine-id",
                "/var/lib/dbus/machine-id")


def _machine_id() -> str:
    """The boot id, else the machine id, else the host name (see the module docstring)."""
    for path in _MACHINE_IDS:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            text = Path(path).read_text(encoding="ascii").strip()
            # An empty or all-zero id (an image not yet given one) identifies nothing.
            if text.strip("0-"):
                return f"{path}={text}"
    return f"host={socket.gethostname()}"


def host_key() -> str:
    """Pids mean something only in one boot of one machine and in one pid namespace: a
    directory made elsewhere (a shared home over NFS, another container) is never judged
    here."""
    ns = 0
    with contextlib.suppress(OSError):
        ns = os.stat("/proc/self/ns/pid").st_ino
    return f"{zlib.crc32(f'{_machine_id()}:{ns}'.encode()):08x}"


def _mine(st: os.stat_result) -> bool:
    """Made by this user (another user's directory is theirs to sweep)."""
    getuid = getattr(os, "getuid", None)
    return getuid is None or st.st_uid == getuid()


def start_time(pid: int) -> int | None:
    """An integer fixed for the life of process `pid`; None if there is no live such process.

    Raises PermissionError when the process exists but cannot be inspected. On Linux this is
    the start in clock ticks since boot from /proc (psutil's create_time adds the boot time,
    which moves with clock adjustments); elsewhere psutil's create_time in milliseconds."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        if sys.platform.startswith("linux"):
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
            return int(fields[19])  # field 22, starttime; fields[0] is field 3
        return round(proc.create_time() * 1000)
    except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
        return None
    except psutil.AccessDenied:
        raise PermissionError(errno.EACCES, "cannot inspect process", str(pid)) from None


def _owner_alive(pid: int, start: int) -> bool:
    try:
        return start_time(pid) == start
    except (PermissionError, OSError, ValueError, IndexError):
        return True  # cannot tell: keep it


def sweep_stale(root: Path) -> list[Path]:
    """Remove the scratch directories in `root` whose owner process is gone; return them."""
    root = Path(root)
    mine = host_key()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        m = NAME_RE.match(entry.name)
        if m is None or m["host"] != mine:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or not _mine(st):
            continue
        if _owner_alive(int(m["pid"]), int(m["start"])):
            continue
        path = root / entry.name
        # rmtree refuses a symbolic link and does not follow links inside the tree.
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def make(root: Path, label: str, mode: int = 0o700) -> Path:
    """Sweep `root`, then create (with `mode`, less the umask) and return a new scratch
    directory in it owned by this process. OSError if `root` is not a directory or cannot
    be written."""
    if not _LABEL_RE.match(label):
        raise ValueError(f"scratch label must be lowercase letters: {label!r}")
    root = Path(root)
    if os.path.lexists(root) and not root.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(root))
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale(root)
    pid = os.getpid()
    start = start_time(pid)
    assert start is not None
    prefix = f"{label}-{host_key()}-{pid}-{start}-"
    for _ in range(100):
        path = root / (prefix + secrets.token_hex(4))
        try:
            path.mkdir(mode=mode)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free scratch directory name", str(root))


@contextlib.contextmanager
def directory(root: Path, label: str) -> Iterator[Path]:
    """make(root, label), removed when the block ends (however it ends)."""
    path = make(root, label)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
