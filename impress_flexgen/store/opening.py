"""Opening a store: its directory, its lock, its metadata, and recovery from what a crash
or damage left behind."""
from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading

import numpy as np

from disk_layout import io as dio
from disk_layout.format import LEGACY_KV_FORMAT
from disk_layout.metadata import SCHEMA_VERSION, LayerRow, Metadata, valid_file_name

from ..errors import UserError
from .config import STORE_FORMAT
from .entries import LayerEntry, LayerStats
from .files import LayerFiles
from .radix import RadixNode
from .state import StoreState, meta_write

log = logging.getLogger("impress_flexgen.store")


def _owner_only(path, mode: int) -> None:
    """Take group and other permissions off a store path we own (stores made before they
    were private included); one we do not own, or that is gone, is left as it is."""
    try:
        st = dio.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid == os.getuid() and st.st_mode & 0o077 and not stat.S_ISLNK(st.st_mode):
        dio.chmod(path, mode)


def _lstat(path) -> os.stat_result | None:
    try:
        return dio.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _is_link(path) -> bool:
    st = _lstat(path)
    return st is not None and stat.S_ISLNK(st.st_mode)


def _is_dir(path) -> bool:
    """A directory, following a symbolic link (as Path.is_dir)."""
    try:
        return stat.S_ISDIR(dio.stat_path(path).st_mode)
    except OSError:
        return False


def _exists(path) -> bool:
    return _lstat(path) is not None


class StoreOpener:
    """Checks, locks, opens and recovers a store directory into its state."""

    def __init__(self, state: StoreState, files: LayerFiles) -> None:
        self.state = state
        self.files = files
        self.dir = state.dir
        self.data_dir = state.data_dir
        self.quarantine_dir = state.quarantine_dir
        self.config = state.config
        self.shape = state.shape

    def open_metadata(self) -> None:
        self._refuse_lost_metadata()
        db = self.dir / "store.sqlite"
        try:
            # Made 0600 before SQLite opens it (its journal files take the same mode).
            dio.close_fd(dio.open_fd(db, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
            for path in (db, self.dir / "store.sqlite-wal", self.dir / "store.sqlite-shm"):
                _owner_only(path, 0o600)
        except OSError as exc:
            raise UserError(f"cannot open {db}: {exc.strerror or exc}") from None
        self.state.meta = Metadata(str(db))
        self._init_meta()
        self._recover()

    def check_directory(self) -> None:
        if _is_link(self.dir) or (_exists(self.dir) and not _is_dir(self.dir)):
            raise UserError(f"store directory {self.dir} is not a directory")
        if _is_dir(self.dir) and dio.scandir(self.dir) and \
                not _exists(self.dir / "store.sqlite"):
            raise UserError(f"{self.dir} is not empty and holds no impress_flexgen store; "
                            "choose another --store-dir")
        for path in (self.data_dir, self.quarantine_dir):
            if _is_link(path) or (_exists(path) and not _is_dir(path)):
                raise UserError(f"{path} is not a directory; the store was left as it is")
        try:
            # Owner only: the database holds prompts' token ids, the files their KV.
            dio.make_dir(self.dir, 0o700, parents=True)
            dio.make_dir(self.data_dir, 0o700)
            for path in (self.dir, self.data_dir):
                _owner_only(path, 0o700)
            # Root ignores permission bits: only a real write proves the directory writable.
            probe = self.dir / f".write-test-{os.getpid()}-{threading.get_ident()}"
            fd = dio.open_fd(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            dio.close_fd(fd)
            dio.unlink(probe)
        except OSError as exc:
            raise UserError(f"cannot write the store directory {self.dir}: "
                            f"{exc.strerror or exc}") from None

    def lock_directory(self) -> int:
        try:
            fd = dio.open_fd(self.dir / "store.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW,
                             0o600)
        except OSError as exc:
            raise UserError(f"cannot open {self.dir / 'store.lock'}: "
                            f"{exc.strerror or exc}") from None
        try:
            dio.lock_exclusive(fd)
        except BlockingIOError:
            dio.close_fd(fd)
            raise UserError(f"store {self.dir} is in use by another process") from None
        return fd

    def _data_entries(self) -> list[str]:
        return [e.name for e in dio.scandir(self.data_dir)]

    def _refuse_lost_metadata(self) -> None:
        """A missing or empty database beside data files is damage, not a new store:
        opening it as new would delete every file recovery finds unreferenced."""
        db = self.dir / "store.sqlite"
        if _is_link(db):
            raise UserError(f"store {self.dir}: store.sqlite is a symbolic link; refused")
        if (not _exists(db) or dio.lstat(db).st_size == 0) and self._data_entries():
            raise UserError(f"store {self.dir}: store.sqlite is missing or empty but data/ "
                            "holds files; the store was left as it is (move it away or "
                            "choose another --store-dir)")

    def _init_meta(self) -> None:
        model = dataclasses.asdict(self.shape)
        fingerprint = model.pop("fingerprint")
        # The KV format is recorded on its own (every file of the store holds it); whether
        # it is exact follows from the compute dtype, which the fingerprint covers.
        kv_format = model.pop("kv_format")
        model.pop("kv_exact")
        want = {"format": STORE_FORMAT, "schema": SCHEMA_VERSION, "model": model,
                "fingerprint": fingerprint, "chunk_size": self.config.chunk_size,
                "probe_heads": list(self.config.probe_heads),
                "probe_format": self.config.probe_format, "packed": self.state.packed,
                "kv_format": kv_format}
        have = self.state.meta.get_meta()
        if self.state.meta.is_empty():
            if self._data_entries():
                raise UserError(f"store {self.dir}: its database holds nothing but data/ "
                                "holds files; the store was left as it is (move it away or "
                                "choose another --store-dir)")
            meta_write(lambda: self.state.meta.set_meta(want), "initialising the store")
            return
        if have.get("format") != STORE_FORMAT:
            raise UserError(f"{self.dir} holds a database that is not an impress_flexgen store")
        have.setdefault("packed", False)      # stores from before the packed layout
        for key in ("schema", "model", "chunk_size", "probe_heads", "probe_format", "packed"):
            if have.get(key) != want[key]:
                raise UserError(f"store {self.dir} was made with {key}={have.get(key)}, "
                                f"not {want[key]}; use another --store-dir")
        have.setdefault("kv_format", LEGACY_KV_FORMAT)   # ... and before other KV formats
        if have["kv_format"] != kv_format:
            raise UserError(f"store {self.dir} holds {have['kv_format']} KV, not {kv_format}; "
                            f"open it with --kv-format {have['kv_format']} or choose another "
                            "--store-dir")
        self._check_identity(have.get("fingerprint", ""), fingerprint)

    def _check_identity(self, have: str, want: str) -> None:
        """The same name and shape are not the same model: KV is served only to the
        weights (and dtypes, chunk size, layout) that computed it."""
        if have == want:
            return
        if not have:
            raise UserError(f"store {self.dir} was made before stores recorded which weights "
                            "computed their KV, so its KV cannot be trusted for this model; "
                            "delete it or use another --store-dir")
        if not want:
            raise UserError(f"store {self.dir} belongs to the model {have[:12]}, not to an "
                            "unidentified one; use another --store-dir")
        raise UserError(f"store {self.dir} holds KV of another model, weights or dtype, "
                        f"or KV computed by an older version (identity {have[:12]}, this "
                        f"model is {want[:12]}); use another --store-dir")

    def _recover(self) -> None:
        """Load the tree from committed rows that pass their checks; take nodes that fail
        them (and the prefixes below them) out of the store; delete files no committed row
        references."""
        c = self.config.chunk_size
        rows_of: dict[int, tuple] = {}
        bad: dict[int, str] = {}
        children: dict[int | None, list[int]] = {}
        for row in self.state.meta.nodes():
            nid, parent, start, tokens = row.id, row.parent, row.start, row.tokens
            children.setdefault(parent, []).append(nid)
            if not row.valid:
                bad[nid] = row.problem or "row checksum mismatch"
                continue
            if len(tokens) == 0 or len(tokens) % c or start < 0 or start % c:
                bad[nid] = f"{len(tokens)} tokens at {start}: not whole chunks"
                continue
            layout = self.state.layout(len(tokens))
            layers = self.state.meta.layers(nid, len(tokens), n_crcs=1 + 2 * layout.n_chunks)
            problems = [r.problem or "invalid row" for r in layers if not r.valid]
            if [r.layer for r in layers] != list(range(self.shape.n_layers)):
                problems.append(f"{len(layers)} layer rows for {self.shape.n_layers} layers")
            if problems:
                bad[nid] = problems[0]
                continue
            rows_of[nid] = (row, layers)
        # Attach parents before children (a child's id may be older than its parent's:
        # splits re-parent). A node whose parent is missing or bad, or whose start does not
        # continue its parent's tokens, is unreachable: it goes too.
        attached: set[int] = set()
        frontier: list[int | None] = [None]
        while frontier:
            parent_id = frontier.pop()
            parent = self.state.tree.nodes.get(parent_id) if parent_id is not None else None
            for nid in children.get(parent_id, []):
                if nid not in rows_of:
                    continue
                row, layers = rows_of[nid]
                expect = parent.end if parent is not None else 0
                if row.start != expect:
                    bad[nid] = f"starts at {row.start}, its parent ends at {expect}"
                    continue
                if parent is not None and row.namespace != parent.namespace:
                    bad[nid] = "its namespace is not its parent's"
                    continue
                # Exact only below an exact parent: KV over inexact KV is inexact; and only
                # in a format that gives back the computed values.
                node = RadixNode(nid, parent, row.start, row.tokens.copy(), hits=row.hits,
                                 last_access=row.last_access,
                                 exact=row.exact and (parent is None or parent.exact)
                                 and self.shape.kv_exact,
                                 namespace=row.namespace)
                node.layers = [self._entry(r, len(row.tokens)) for r in layers]
                try:
                    self.state.tree.attach(node)
                except ValueError:
                    bad[nid] = "a sibling starts with the same chunk"
                    continue
                for r in layers:
                    self.state.stats[(nid, r.layer)] = self._stats_from_row(r, len(row.tokens))
                attached.add(nid)
                frontier.append(nid)
        dropped = [nid for nid, _ in rows_of.items() if nid not in attached] + list(bad)
        if dropped:
            self._drop_rows(dropped, bad)
        referenced = self.state.meta.referenced_files()
        removed = 0
        for entry in dio.scandir(self.data_dir):
            if entry.name in referenced:
                continue
            if entry.is_dir(follow_symlinks=False):
                log.warning("store %s: leaving unexpected directory %s alone", self.dir,
                            entry.path)
                continue
            dio.unlink(entry.path)      # a link goes, never what it points to
            removed += 1
        if removed:
            log.info("removed %d uncommitted files from %s", removed, self.data_dir)

    def _drop_rows(self, node_ids: list[int], why: dict[int, str]) -> None:
        """Delete the rows of nodes recovery cannot serve; keep their files for inspection."""
        names = []
        for nid in node_ids:
            names += [r.file for r in self.state.meta.layers(nid, 0, n_crcs=None)
                      if valid_file_name(r.file)]
        for nid in node_ids:
            if nid in why:
                log.warning("store %s: node %d not served (%s): its prefix will be recomputed",
                            self.dir, nid, why[nid])
        self.state.metrics.invalid_rows += len(why)
        self.state.metrics.quarantined_nodes += len(node_ids)

        def delete():
            with self.state.meta.transaction():
                for nid in node_ids:
                    self.state.meta.delete_node(nid)
        meta_write(delete, "dropping damaged rows")
        for name in names:
            self.files.quarantine_file(self.data_dir / name)
        self.files.trim_quarantine()

    def _entry(self, row: LayerRow, n_tokens: int) -> LayerEntry:
        return LayerEntry(row.node, row.layer, row.version, str(self.data_dir / row.file),
                          self.state.layout(n_tokens), row.mapping, row.crcs)

    def _stats_from_row(self, row: LayerRow, n_tokens: int) -> LayerStats:
        """Soft state from a row; any piece of the wrong size starts fresh (it is a hint)."""
        stats = LayerStats.fresh(n_tokens, self.config.chunk_size)
        sizes = ((row.importance, stats.importance), (row.bitmaps, stats.bitmaps),
                 (row.access, stats.access), (row.ratio, stats.ratio))
        if all(have is not None and have.size == want.size for have, want in sizes) and \
                np.isfinite(row.importance).all():
            stats.importance[:] = row.importance
            stats.bitmaps[:] = row.bitmaps.reshape(stats.bitmaps.shape)
            stats.access[:] = row.access
            stats.ratio[:] = row.ratio
        return stats
