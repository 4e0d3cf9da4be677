"""sqlite_damage: copies of a store taken during a run get bits flipped (anywhere, or in the
layers index), pages zeroed, the database or WAL truncated, or become a zero-length or
foreign database. Opening one either refuses with UserError (data/ untouched, a foreign
database unchanged) or serves only exact KV; nodes it drops (saying so, unless the WAL
was damaged: SQLite then serves an earlier commit) are detected, and their files must not
stay in data/. A seeded fuzz loop; each iteration replays from (seed, iteration)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sqlite3
from pathlib import Path

import numpy as np

from impress_flexgen.errors import UserError
from impress_flexgen.store import PrefixStore

from ..kv import FORMATS, SHAPE, Prefixes, store_config
from ..readback import check_node, fill_store, is_wrong, stray_files
from ..registry import Context, fault
from ..report import Report, StoreWarnings, error_text

DAMAGE = ("flip_db", "flip_db", "flip_wal", "zero_page", "trunc_db", "trunc_wal", "header",
          "index", "zero_length", "foreign", "garbage")


def hard_state(store: PrefixStore) -> dict:
    """What each node's KV depends on: parent, position, tokens, files, orders, CRCs."""
    return {nid: (n.parent.id if n.parent is not None and n.parent is not store.inspect().state.tree.root
                  else None, n.start, n.tokens.tobytes(),
                  tuple((e.version, os.path.basename(e.path),
                         None if e.mapping is None else np.asarray(e.mapping).tobytes(),
                         np.asarray(e.crcs).tobytes()) for e in n.layers))
            for nid, n in store.inspect().state.tree.nodes.items()}


def copy_store(src: Path, dst: Path) -> None:
    """The database and WAL copied, the (immutable) data files linked."""
    shutil.rmtree(dst, ignore_errors=True)
    (dst / "data").mkdir(parents=True)
    for name in ("store.sqlite", "store.sqlite-wal"):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    for f in (src / "data").iterdir():
        os.link(f, dst / "data" / f.name)


def flip_bits(path: Path, rng, n: int) -> list[int]:
    data = bytearray(path.read_bytes())
    offsets = sorted(int(x) for x in rng.integers(0, len(data), size=n))
    for off in offsets:
        data[off] ^= 1 << int(rng.integers(8))
    path.write_bytes(bytes(data))
    return offsets


def damage_db(work: Path, mode: str, rng) -> tuple[str, str]:
    """Damage the copy; returns (description, name of the file damaged)."""
    db, wal = work / "store.sqlite", work / "store.sqlite-wal"
    wal_size = wal.stat().st_size if wal.exists() else 0
    if mode.endswith("_wal") and wal_size <= 32:
        mode = mode[:-4] + "_db"
    target = wal if mode.endswith("_wal") else db
    size = target.stat().st_size if target.exists() else 0
    if mode in ("flip_db", "flip_wal"):
        offsets = flip_bits(target, rng, int(rng.integers(1, 5)))
        return f"{mode}: bits flipped at {offsets} of {size}", target.name
    if mode in ("trunc_db", "trunc_wal"):
        at = int(rng.integers(1 if mode == "trunc_db" else 0, max(2, size)))
        os.truncate(target, at)
        return f"{mode}: cut at {at} of {size}", target.name
    if mode == "zero_page":
        target = wal if wal_size > 32 and rng.random() < 0.5 else db
        size = target.stat().st_size
        at = int(rng.integers(0, max(1, size // 4096))) * 4096
        with open(target, "r+b") as f:
            f.seek(at)
            f.write(bytes(min(4096, size - at)))
        return f"zero_page: {target.name} bytes {at}..{at + 4096}", target.name
    if mode == "index":
        # A byte of the layers table's primary-key index: the index no longer matches the
        # table, which PRAGMA quick_check does not compare.
        with contextlib.closing(sqlite3.connect(db)) as con:
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # the page is in the DB file
            row = con.execute("SELECT rootpage FROM sqlite_master WHERE type = 'index' "
                              "AND tbl_name = 'layers'").fetchone()
            page = con.execute("PRAGMA page_size").fetchone()[0]
        if row is None:
            return damage_db(work, "flip_db", rng)
        data = bytearray(db.read_bytes())
        at = (row[0] - 1) * page
        head = at + (100 if row[0] == 1 else 0)
        content = int.from_bytes(data[head + 5:head + 7], "big") or 65536
        off = at + int(rng.integers(min(content, page - 1), page))
        data[off] ^= 1 << int(rng.integers(8))
        db.write_bytes(bytes(data))
        return f"index: bit flipped at {off} (page {row[0]}, the layers index)", db.name
    if mode == "header":
        offsets = sorted(int(x) for x in rng.integers(0, 100, size=int(rng.integers(1, 4))))
        data = bytearray(db.read_bytes())
        for off in offsets:
            data[off] = int(rng.integers(256))
        db.write_bytes(bytes(data))
        return f"header: bytes {offsets} overwritten", db.name
    if mode == "zero_length":
        os.truncate(db, 0)
        wal.unlink(missing_ok=True)
        return "zero_length: store.sqlite emptied, WAL removed", db.name
    if mode == "foreign":
        db.unlink()
        wal.unlink(missing_ok=True)
        other = sqlite3.connect(db)
        other.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
        other.execute("INSERT INTO notes (text) VALUES ('not a prefix store')")
        other.commit()
        other.close()
        return "foreign: another application's database", db.name
    db.write_bytes(rng.bytes(max(size, 4096)))
    wal.unlink(missing_ok=True)
    return "garbage: store.sqlite overwritten with random bytes", db.name


def file_hash(path: Path) -> str | None:
    return hashlib.sha1(path.read_bytes()).hexdigest() if path.exists() else None


def sqlite_damage(base: Path, iterations: int, seed: int, report: Report) -> dict:
    cls = "sqlite_damage"
    rng = np.random.default_rng([seed, 31])
    res = {"iterations": iterations, "refused": 0, "opened": 0, "dropped_nodes": 0,
           "unreadable_nodes": 0, "wrong_nodes": 0, "errors": 0, "by_mode": {},
           "stray_after_open": 0, "database_changed_on_refusal": 0, "sources": 0}
    sources = []      # (directory, fmt, hard state of its nodes)
    for s, fmt in enumerate(FORMATS):
        prefixes = Prefixes(seed * 1000 + 51 + s)
        live = base / f"sqlfuzz-{fmt}"
        n = 12
        points = set(rng.choice(np.arange(2, n), size=4, replace=False).tolist())
        with PrefixStore(live, SHAPE, store_config(fmt)) as store:
            for p in range(n):
                fill_store(store, prefixes, [p], rng)
                if rng.random() < 0.4:
                    store.reorder_now()
                if rng.random() < 0.3:
                    store.inspect().importance.flush_stats()
                if p in points:
                    if rng.random() < 0.5:
                        store.inspect().accounting.overheads()   # checkpoints: the rows move from the WAL to the DB
                    dst = base / f"sqlfuzz-{fmt}-copy{p}"
                    copy_store(live, dst)
                    sources.append((dst, fmt, hard_state(store)))
    res["sources"] = len(sources)
    work = base / "sqlfuzz-work"
    for it in range(iterations):
        rng = np.random.default_rng([seed, 32, it])   # an iteration replays on its own
        src, fmt, ref = sources[int(rng.integers(len(sources)))]
        copy_store(src, work)
        mode = DAMAGE[int(rng.integers(len(DAMAGE)))]
        what, damaged = damage_db(work, mode, rng)
        row = res["by_mode"].setdefault(mode, {"injected": 0, "detected": 0, "harmless": 0})
        row["injected"] += 1
        names = {f.name for f in (work / "data").iterdir()}
        hashes = [file_hash(work / n) for n in ("store.sqlite", "store.sqlite-wal")]
        verdict, problems = None, []
        with StoreWarnings() as warned:
            try:
                store = PrefixStore(work, SHAPE, store_config(fmt))
            except UserError as exc:
                verdict = "detected"
                res["refused"] += 1
                if {f.name for f in (work / "data").iterdir()} != names:
                    problems.append(f"refused ({exc}) but changed data/")
                if [file_hash(work / n) for n in ("store.sqlite", "store.sqlite-wal")] != hashes:
                    if mode == "foreign":   # not the store's to change, even its journal mode
                        problems.append("refused another application's database but "
                                        "changed it")
                    res["database_changed_on_refusal"] += 1
                    row["database_changed_on_refusal"] = \
                        row.get("database_changed_on_refusal", 0) + 1
                if "\n" in str(exc):
                    problems.append("the refusal is not one line")
            except Exception as exc:  # noqa: BLE001 - must be UserError or open fine
                problems.append(f"opening raised {error_text(exc)}")
                res["errors"] += 1
            else:
                res["opened"] += 1
                try:
                    now = hard_state(store)
                    dropped = set(ref) - set(now)
                    changed = [nid for nid, h in now.items() if ref.get(nid) != h]
                    sample = [nid for nid in now if nid not in changed and rng.random() < 0.1]
                    wrong = unreadable = 0
                    for nid in changed + sample:
                        why = check_node(store, store.inspect().state.tree.nodes[nid])
                        if why is None:
                            continue
                        if why.startswith("error"):
                            problems.append(f"reading node {nid} raised {why[7:]}")
                        elif is_wrong(why):
                            wrong += 1
                            problems.append(f"node {nid}: {why}")
                        else:
                            unreadable += 1
                    stray = stray_files(store)
                    if stray and len(dropped) + len(changed):
                        res["stray_after_open"] += len(stray)
                        problems.append(f"{len(stray)} files of dropped nodes left in data/")
                    res["dropped_nodes"] += len(dropped)
                    res["unreadable_nodes"] += unreadable
                    res["wrong_nodes"] += wrong
                    # A damaged WAL ends the log early: SQLite serves the last commit
                    # before the damage, as after a power loss. Anything else that drops
                    # committed nodes must say so.
                    if dropped and not warned.messages and not damaged.endswith("-wal"):
                        problems.append(f"{len(dropped)} nodes dropped without a warning")
                    if not problems:
                        verdict = "detected" if dropped or unreadable else "harmless"
                    report.count(cls, served_wrong=wrong)
                except Exception as exc:  # noqa: BLE001 - reported
                    problems.append(f"serving raised {error_text(exc)}")
                finally:
                    try:
                        store.close()
                    except Exception as exc:  # noqa: BLE001 - reported
                        problems.append(f"closing raised {error_text(exc)}")
        if problems:
            verdict = None
            report.fail(cls, f"iteration {it} ({src.name}, {what}): {'; '.join(problems)}")
        report.count(cls, injected=1, **({verdict: 1} if verdict else {}))
        if verdict:
            row[verdict] += 1
    shutil.rmtree(work, ignore_errors=True)
    return res


@fault("sqlite_damage", orphans=None)
def run(ctx: Context) -> dict:
    return sqlite_damage(ctx.base, ctx.fuzz, ctx.seed, ctx.report)
