"""The docs and results/ agree: every measurement file is cited, every relative link resolves.

A figure in the docs names the JSON it came from, and a file in results/ that no doc cites is a
measurement nobody can find; a link to a moved or deleted page or file is caught here too.
"""
import re
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "results").is_dir() and (p / "docs").is_dir())
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def doc_text(doc: Path) -> str:
    return FENCE.sub("", doc.read_text(encoding="utf-8"))


def anchors(doc: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, -N for repeats."""
    seen: dict[str, int] = {}
    ids = set()
    for line in doc_text(doc).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def relative_links(doc: Path):
    for target in LINK.findall(doc_text(doc)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        yield target, (doc.parent / path).resolve() if path else doc, anchor


def test_every_results_file_is_cited():
    texts = [d.read_text(encoding="utf-8") for d in DOCS]
    files = [f.relative_to(ROOT / "results").as_posix() for f in (ROOT / "results").rglob("*") if f.is_file()]
    uncited = sorted(f for f in files if not any(f in t for t in texts))
    assert not uncited, f"results/ files cited by no doc (cite them where their figure is discussed, or delete them): {uncited}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    for target, path, anchor in relative_links(doc):
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links: {broken}"
