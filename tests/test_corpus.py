"""The offline public-domain corpus in data/texts/ and its loader (no downloads, no torch)."""
from __future__ import annotations

import re
import string

import pytest

from impress_flexgen.bench import corpus
from impress_flexgen.errors import UserError

NAMES = corpus.list_texts()
ALLOWED = set(string.ascii_letters + string.digits + string.punctuation + " \n")


def test_corpus_is_present():
    assert corpus.TEXTS_DIR.is_dir()
    assert len(NAMES) >= 5, NAMES
    assert (corpus.TEXTS_DIR / "SOURCES.md").is_file()
    sources = (corpus.TEXTS_DIR / "SOURCES.md").read_text(encoding="utf-8")
    for name in NAMES:
        assert f"## {name}.txt" in sources, f"{name} has no SOURCES.md entry"
    assert sources.count("public domain") >= len(NAMES)
    total = sum((corpus.TEXTS_DIR / f"{n}.txt").stat().st_size for n in NAMES)
    assert 300_000 <= total <= 600_000, total


@pytest.mark.parametrize("name", NAMES)
def test_text_is_clean(name):
    text = corpus.load_text(name)
    assert len(text.encode("utf-8")) > 30_000
    odd = set(text) - ALLOWED
    assert not odd, f"unexpected characters {sorted(odd)!r}"
    letters = sum(ch.isalpha() for ch in text)
    assert letters / len(text) > 0.7
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", text), "control characters"
    for bad in ("\\x", "<", ">", "[Illustration", "Gutenberg", "_", "***", "\r"):
        assert bad not in text, f"leftover markup {bad!r}"
    assert text.endswith("\n") and not text.endswith("\n\n")
    assert "\n\n\n" not in text
    assert all(line == line.strip() for line in text.split("\n")), "stray whitespace"
    paragraphs = text.split("\n\n")
    assert len(paragraphs) >= 40
    assert all(p.strip() for p in paragraphs)


def test_known_openings():
    assert corpus.load_text("austen_pride_and_prejudice").find(
        "It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.") > 0
    assert "In the beginning God created the heaven and the earth.\n" in corpus.load_text(
        "kjv_genesis")
    assert "Of Mans First Disobedience, and the Fruit\n" in corpus.load_text(
        "milton_paradise_lost")
    assert "Ber.\nWho's there?" in corpus.load_text("shakespeare_hamlet")


@pytest.mark.parametrize("name", NAMES)
def test_passages_deterministic_and_disjoint(name):
    text = corpus.load_text(name)
    got = corpus.passages(name, n_chars=1500, count=8, seed=3)
    assert got == corpus.passages(name, n_chars=1500, count=8, seed=3)
    assert len(got) == 8
    spans = []
    for p in got:
        assert 750 <= len(p) <= 1500
        start = text.find(p)
        assert start >= 0
        assert start == 0 or text[start - 2:start] == "\n\n", "not at a paragraph start"
        spans.append((start, start + len(p)))
    assert spans == sorted(spans)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "overlapping passages"


def test_passages_depend_on_seed():
    name = "austen_emma"
    a = corpus.passages(name, 1000, 5, seed=0)
    b = corpus.passages(name, 1000, 5, seed=1)
    assert a != b
    assert corpus.passages(name, 1000, 0, seed=0) == []


def test_passages_too_many_or_bad_args():
    with pytest.raises(UserError, match="non-overlapping"):
        corpus.passages("kjv_genesis", n_chars=20_000, count=50, seed=0)
    with pytest.raises(UserError):
        corpus.passages("kjv_genesis", n_chars=0, count=1, seed=0)
    with pytest.raises(UserError):
        corpus.passages("kjv_genesis", n_chars=100, count=-1, seed=0)


@pytest.mark.parametrize("name", ["no_such_text", "../pyproject", "SOURCES", ""])
def test_missing_text_raises_user_error(name):
    with pytest.raises(UserError, match="no text named"):
        corpus.load_text(name)
    with pytest.raises(UserError):
        corpus.passages(name, 100, 1, seed=0)


def test_corpus_module_uses_only_the_standard_library():
    import ast
    import sys

    tree = ast.parse(open(corpus.__file__, encoding="utf-8").read())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module.split(".")[0])
    modules -= {"impress_flexgen", "__future__"}
    assert modules <= set(sys.stdlib_module_names), modules
