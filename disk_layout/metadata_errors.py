"""What goes wrong with the metadata database, as MetadataError subclasses with one-line
messages naming the database (sqlite3 errors are translated where they leave)."""
from __future__ import annotations

import sqlite3


class MetadataError(Exception):
    """The metadata database cannot be used; the message is one line naming its path."""


class MetadataFull(MetadataError):
    """SQLite reported SQLITE_FULL: the database or its disk is full."""


class MetadataIOError(MetadataError):
    """SQLite reported an I/O error (SQLITE_IOERR*) on the database or its WAL."""


class MetadataReadOnly(MetadataError):
    """The database (or its directory) cannot be written."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _translate(path: str, exc: sqlite3.Error) -> MetadataError:
    """The MetadataError subclass for a sqlite3 error, its message naming `path`."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = None if code is None else code & 0xFF
    what = _one_line(exc)
    if primary == sqlite3.SQLITE_FULL:
        return MetadataFull(f"{path}: database or disk is full ({what})")
    if primary == sqlite3.SQLITE_IOERR:
        return MetadataIOError(f"{path}: I/O error ({what})")
    if primary == sqlite3.SQLITE_READONLY:
        return MetadataReadOnly(f"{path}: read-only ({what})")
    if primary in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
        return MetadataError(f"{path}: damaged or not a metadata database ({what})")
    return MetadataError(f"{path}: {what}")


def _translatable(exc: BaseException) -> bool:
    # ProgrammingError / InterfaceError are misuse of the API (a bug), not a database state.
    return isinstance(exc, sqlite3.Error) and not isinstance(
        exc, (sqlite3.ProgrammingError, sqlite3.InterfaceError))


class _Guard:
    """Context manager: sqlite3 errors leave as MetadataError subclasses."""

    __slots__ = ("path",)

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and _translatable(exc):
            raise _translate(self.path, exc) from exc
        return False
