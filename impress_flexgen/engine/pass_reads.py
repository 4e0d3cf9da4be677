"""The chunk reads of one prefill pass, shared by its sequences: a chunk that several of them
need is read through the tiers once and handed to each.

    reads = PassReads(store)                        # a pass's (a sequence alone: its own)
    reads.prefetch(seg, {"k": ids, "v": ids}, stats)    # read ahead what no one asked yet
    handle = reads.start(seg, {"k": ids}, stats)     # tier loads of what the pass lacks
    chunks = reads.finish(handle)                    # {kind: [chunk, ...]}, asked order
    reads.drop(layer)                                # the pass is past that layer
    reads.close()                                    # every read in flight waited for

Sequences that matched the same stored prefix hold the same layer files (node, layer,
version: immutable bytes), so a chunk one of them read is the chunk the next would read.
Its sequences attend one after another within a layer, so with per-request selection
(impress) the first reads its own selection, the next only what its selection adds: the
pass reads the union of their selections once, and each is handed exactly its own. What
each selects (probe heads, scores, retention) is untouched. A chunk handed out is read
only, as a memory tier's copies already are: each sequence's attention concatenates its
chunks into keys and values of its own, and its decode context appends to those.

Counting: a read counts once, in the stats of the sequence that issued it (the first of
the pass to ask for the chunk, or to read it ahead): bytes per tier, chunks_read,
chunks_loaded. A chunk handed to another sequence counts there in chunks_from_pass and
bytes_from_pass (its stored bytes), never as read. The requests' bytes_read add up to the
bytes the pass actually read, and so do /metrics. A read that fails its check (CRC)
raises for every sequence that needs it; the engine then serves each of them alone, and
the quarantined node is recomputed for each.
"""
from __future__ import annotations

import numpy as np
import torch

from ..tiers import DISK, ChunkLoad


class _Load:
    """One tier load of chunks of a layer file, issued by one sequence, waited for once."""

    def __init__(self, pending, missing: dict, stats):
        self.pending, self.missing, self.stats = pending, missing, stats
        self.done = False
        self.error: BaseException | None = None


class _File:
    """What the pass has of one layer file: chunks loaded (and who loaded them), loads in
    flight, reads ahead in flight and landed."""

    def __init__(self, layer: int, chunk_bytes: int):
        self.layer, self.chunk_bytes = layer, chunk_bytes
        self.loaded: dict[tuple[str, int], torch.Tensor] = {}
        self.owner: dict[tuple[str, int], int] = {}       # id() of the issuer's stats
        self.loading: dict[tuple[str, int], _Load] = {}
        self.prefetching: list = []                       # [(Prefetch, stats)]
        self.prefetched: dict[str, dict[int, torch.Tensor]] = {}
        self.asked: set[tuple[str, int]] = set()          # read ahead (or asked to be)
        self.handed: set[tuple[int, str, int]] = set()    # (stats id, kind, chunk) given
        self.error: BaseException | None = None


class PassReads:
    def __init__(self, store):
        self.store = store
        self.files: dict[tuple, _File] = {}

    def _file(self, entry) -> _File:
        key = (entry.node_id, entry.layer, entry.version)
        got = self.files.get(key)
        if got is None:
            got = self.files[key] = _File(entry.layer, entry.layout.chunk_bytes)
        return got

    # -- reads ahead -------------------------------------------------------------------------
    def prefetch(self, seg, kinds: dict, stats) -> None:
        """Start reading chunks of `seg`'s file expected to be asked for, except those the
        pass has read or is reading ahead already."""
        f = self._file(seg.entry)
        new = {kind: [int(i) for i in ids if (kind, int(i)) not in f.asked]
               for kind, ids in kinds.items()}
        new = {kind: ids for kind, ids in new.items() if ids}
        if not new:
            return
        read = self.store.tiers.prefetch(ChunkLoad(seg.entry, new, node=seg.node))
        f.prefetching.append((read, stats))
        f.asked.update((kind, i) for kind, ids in new.items() for i in ids)

    def collect(self, segments) -> None:
        """Finish the reads ahead of these segments' files; their bytes count as read, in
        their issuers' stats, whether or not anyone uses them."""
        for seg in segments:
            self._collect(self._file(seg.entry))

    def _collect(self, f: _File) -> None:
        if f.error is not None:
            raise f.error
        pending, f.prefetching = f.prefetching, []
        for n, (read, stats) in enumerate(pending):
            try:
                chunks, nbytes = self.store.tiers.finish_prefetch(read)
            except BaseException as exc:
                f.error = exc
                self._drain_prefetch(pending[n + 1:])
                raise
            for kind, got in chunks.items():
                f.prefetched.setdefault(kind, {}).update(got)
            stats.bytes_read[DISK] += nbytes
            stats.chunks_read += sum(len(c) for c in chunks.values())

    # -- loads -------------------------------------------------------------------------------
    def start(self, seg, kinds: dict, stats) -> tuple:
        """Ask for chunks of `seg`'s file: what the pass holds (or is loading) is taken from
        it, the rest goes to the tiers (chunks read ahead in place of a disk read)."""
        f = self._file(seg.entry)
        self._collect(f)
        asked = {kind: [int(i) for i in np.asarray(ids, dtype=np.int64)]
                 for kind, ids in kinds.items()}
        missing = {kind: [i for i in ids if (kind, i) not in f.loaded and
                          (kind, i) not in f.loading] for kind, ids in asked.items()}
        missing = {kind: ids for kind, ids in missing.items() if ids}
        load = None
        if missing:
            ratios = {kind: self.store.chunk_ratios(seg.entry, ids)
                      for kind, ids in missing.items()}
            pending = self.store.tiers.submit(ChunkLoad(seg.entry, missing, ratios, seg.node),
                                              ahead=f.prefetched or None)
            load = _Load(pending, missing, stats)
            for kind, ids in missing.items():
                for i in ids:
                    f.loading[(kind, i)] = load
        return f, asked, load, stats

    def finish(self, handle: tuple) -> dict[str, list[torch.Tensor]]:
        """The chunks asked for by start(), in asked order."""
        f, asked, load, stats = handle
        if load is not None:
            self._wait(f, load)
        me = id(stats)
        for kind, ids in asked.items():
            for i in ids:
                key = (kind, i)
                if key not in f.loaded:          # another sequence's load, still in flight
                    self._wait(f, f.loading[key])
                if f.owner[key] != me and (me, kind, i) not in f.handed:
                    f.handed.add((me, kind, i))
                    stats.chunks_from_pass += 1
                    stats.bytes_from_pass += f.chunk_bytes
        return {kind: [f.loaded[(kind, i)] for i in ids] for kind, ids in asked.items()}

    def _wait(self, f: _File, load: _Load) -> None:
        if load.done:
            if load.error is not None:
                raise load.error
            return
        load.done = True
        try:
            chunks, served = self.store.tiers.wait(load.pending)
        except BaseException as exc:
            load.error = exc
            raise
        stats = load.stats
        for kind, ids in load.missing.items():
            for i, t in zip(ids, chunks[kind]):
                f.loaded[(kind, i)] = t
                f.owner[(kind, i)] = id(stats)
                f.loading.pop((kind, i), None)
        for tier in self.store.tiers.names:
            stats.bytes_read[tier] += served[tier]
        stats.chunks_read += served["disk_chunks"]
        stats.chunks_loaded += sum(len(ids) for ids in load.missing.values())

    # -- the end of a layer, of the pass ---------------------------------------------------------
    def drop(self, layer: int) -> None:
        """The pass is past `layer`: its reads are waited for and its chunks let go (each
        sequence's keys and values are its own copies)."""
        for key in [k for k, f in self.files.items() if f.layer == layer]:
            self._close(self.files.pop(key))

    def close(self) -> None:
        """Wait for every read in flight (a failed request may quarantine its files next)."""
        files, self.files = list(self.files.values()), {}
        for f in files:
            self._close(f)

    def _close(self, f: _File) -> None:
        self._drain_prefetch(f.prefetching)
        f.prefetching = []
        for load in set(f.loading.values()):
            if not load.done:
                load.done = True
                try:
                    self.store.tiers.wait(load.pending)
                except Exception:  # noqa: BLE001 - nobody asked for these chunks any more
                    pass
        f.loading.clear()

    def _drain_prefetch(self, pending) -> None:
        for read, _ in pending:
            try:
                self.store.tiers.finish_prefetch(read)
            except Exception:  # noqa: BLE001 - nobody asked for these chunks
                pass
