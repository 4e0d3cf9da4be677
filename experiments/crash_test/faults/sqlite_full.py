"""sqlite_full: SQLite's page limit reached during an insert: StoreFull, no file left; the
insert works once the limit is lifted."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from impress_flexgen.store import PrefixStore, StoreFull

from ..kv import SHAPE, Prefixes, store_config
from ..patching import metadata_connection
from ..readback import fill_store, insert_prefix, orphans, prefix_exact, stray_files
from ..registry import Context, fault
from ..report import Report, StoreWarnings, error_text


def sqlite_full(base: Path, n_inject: int, seed: int, report: Report) -> dict:
    """The metadata database cannot grow (PRAGMA max_page_count at its size): the insert
    that needs a new page must raise StoreFull and leave no file; then it works."""
    cls = "sqlite_full"
    rng = np.random.default_rng([seed, 8])
    prefixes = Prefixes(seed * 1000 + 87)
    res = {"injected": 0, "handled": 0, "raised": {}, "left_files": 0, "inserts_fitted": 0}
    sdir = base / "sqlite-full"
    with StoreWarnings(), PrefixStore(sdir, SHAPE, store_config("int4")) as store:
        db = metadata_connection(store)
        if db is None:
            report.fail(cls, "the store's metadata has no SQLite connection to limit; not run")
            return res
        done: list[np.ndarray] = []
        fill_store(store, prefixes, range(3), rng)
        done += [prefixes.tokens(p) for p in range(3)]
        p = 3
        limit = db.execute("PRAGMA max_page_count").fetchone()[0]
        for j in range(n_inject):
            stray_before = stray_files(store)
            how, tokens = None, None
            db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
            try:
                for _ in range(60):
                    tokens, p = prefixes.tokens(p), p + 1
                    try:
                        insert_prefix(store, tokens)
                    except StoreFull:
                        how = "StoreFull"
                    except Exception as exc:  # noqa: BLE001 - reported
                        how = error_text(exc)
                    if how:
                        break
                    res["inserts_fitted"] += 1   # fitted in free pages
                    done.append(tokens)
                    stray_before = stray_files(store)
            finally:
                db.execute(f"PRAGMA max_page_count = {limit}")
            if how is None:
                continue
            res["injected"] += 1
            res["raised"][how.split(":")[0]] = res["raised"].get(how.split(":")[0], 0) + 1
            problems = []
            if how != "StoreFull":
                problems.append(f"insert raised {how}, not StoreFull")
            stray = stray_files(store) - stray_before
            if stray:
                res["left_files"] += len(stray)
                problems.append(f"files left behind: {sorted(stray)}")
            if not all(prefix_exact(store, t) for t in done):
                problems.append("an earlier prefix no longer reads back bit-exact")
            try:
                insert_prefix(store, tokens)
                done.append(tokens)
                if not prefix_exact(store, tokens):
                    problems.append("not bit-exact after the retry")
            except Exception as exc:  # noqa: BLE001 - reported
                problems.append(f"the retry raised {error_text(exc)}")
            if problems:
                report.fail(cls, f"injection {j}: {'; '.join(problems)}")
            else:
                res["handled"] += 1
    try:
        with PrefixStore(sdir, SHAPE, store_config("int4")) as store:
            res["orphans_after_reopen"] = len(orphans(store))
            lost = sum(not prefix_exact(store, t) for t in done)
    except Exception as exc:  # noqa: BLE001 - reported
        report.fail(cls, f"reopening raised {error_text(exc)}")
        res["orphans_after_reopen"], lost = 0, len(done)
    if res["orphans_after_reopen"]:
        report.fail(cls, f"{res['orphans_after_reopen']} orphans after reopen")
    if lost:
        report.fail(cls, f"{lost} prefixes not exact after reopen")
    report.count(cls, injected=res["injected"], detected=res["handled"], lost=lost)
    return res


@fault("sqlite_full", orphans="orphans_after_reopen")
def run(ctx: Context) -> dict:
    return sqlite_full(ctx.base, 3 if ctx.quick else 8, ctx.seed, ctx.report)
