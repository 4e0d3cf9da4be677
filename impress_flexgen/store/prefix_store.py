"""The durable radix store: one object a request talks to, from match to release.

    match = store.match_prefix(tokens, namespace, exact_only)   # longest stored prefix, locked
    for layer in range(n_layers):
        entry = store.entry(node, layer)        # one immutable version of (node, layer)
        probe = store.start_probe(entry, node).result()   # probe heads' keys, physical order
        load = store.tiers.submit(ChunkLoad(entry, {"k": ids, "v": ids}, ratios, node))
        chunks, served = store.tiers.wait(load) # memory tiers, then the disk; CRC-checked
        store.record_selection(entry, ...)      # importance feeds reorder and the tiers
    store.insert(tokens, match.length, kv, namespace, exact)   # the newly computed part
    store.release(match)

`PrefixStore` is a facade: its parts are plain classes over one `StoreState` (state.py),
each in its own file and given the parts it calls: opening and recovery (opening.py), layer
files and quarantine (files.py), disk reads (reads.py), importance feedback (importance.py),
inserts and splits (inserts.py), removal: eviction, quarantine, supersession (eviction.py),
reorders (reorder.py), sizes (accounting.py). Loads go through the tier stack (`tiers`:
tiers/stack.py, with the disk as the last tier: tiers/disk.py). Tools and tests reach the
parts through `inspect()`. Every file-system call goes through disk_layout.io. Writers
fsync data before the metadata transaction that makes it visible; files no committed row
references are removed when the store is opened. A reorder writes a new version of a layer
and switches the metadata in one transaction; readers holding the old entry keep reading
the old file, which is deleted once no request has its node locked.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from disk_layout import io as dio
from disk_layout.format import packed_by_default
from disk_layout.io import DiskReader
from disk_layout.metadata import MetadataError

from ..errors import StoreWriteFailed, UserError
from ..tiers import DiskTier, TierStack
from .accounting import Accounting
from .config import ModelShape, StoreConfig, namespace_key
from .entries import LayerEntry
from .eviction import Removal
from .files import LayerFiles
from .importance import Importance
from .inserts import Inserter
from .opening import StoreOpener
from .radix import PrefixMatch, RadixNode
from .reads import DiskReads, ProbeRead
from .reorder import ReorderEngine, Reorderer
from .state import StoreState


@dataclasses.dataclass(frozen=True)
class StoreParts:
    """A store's parts, for tools, metrics and tests (PrefixStore.inspect)."""

    state: StoreState
    files: LayerFiles
    reads: DiskReads
    removal: Removal
    importance: Importance
    inserter: Inserter
    reorderer: Reorderer
    accounting: Accounting
    reopened: bool              # the directory held a store when opened


class PrefixStore:
    """Prefix KV of one model in a directory: chunked layer files under a radix tree whose
    rows live in SQLite, read through a stack of tiers (`tiers`: memory tiers, if given
    one, in front of the disk). `memory`: a tiers.ChunkCache for the memory tiers (the
    serving stack's assemble() gives its own with TierStack.use_memory)."""

    def __init__(self, directory: str | os.PathLike, shape: ModelShape,
                 config: StoreConfig = StoreConfig(), memory=None):
        chunk_bytes = shape.chunk_bytes(config.chunk_size)
        packed = packed_by_default(chunk_bytes) if config.packed is None else config.packed
        if any(h >= shape.n_kv_heads for h in config.probe_heads):
            raise UserError(f"probe heads {config.probe_heads} exceed {shape.n_kv_heads} KV heads")
        self._state = state = StoreState(Path(directory), shape, config, packed)
        files = LayerFiles(state)
        opener = StoreOpener(state, files)
        opener.check_directory()
        state.lock_fd = opener.lock_directory()
        try:
            opener.open_metadata()
        except BaseException as exc:
            if state.meta is not None:
                state.meta.close()
            dio.close_fd(state.lock_fd)
            # UnicodeError: text in the database that is not what any store writes.
            if isinstance(exc, (MetadataError, StoreWriteFailed, UnicodeError)):
                raise UserError(f"store {state.dir}: {exc}; the store was left as it is "
                                "(move it away or choose another --store-dir)") from None
            raise
        reopened = len(state.tree) > 0
        limit = config.read_limit_mb_s * 1e6 if config.read_limit_mb_s else None
        state.reader = DiskReader(config.read_threads, config.direct_io,
                                  rate_limit_bytes_s=limit)
        reads = DiskReads(state)
        self.tiers = TierStack(memory)
        removal = Removal(state, files, self.tiers)
        importance = Importance(state)
        accounting = Accounting(state, importance, files)
        self.tiers.attach_disk(DiskTier(state, reads, removal, accounting.disk_bytes))
        reorderer = Reorderer(state, files, reads, removal, importance, self.tiers)
        self._parts = StoreParts(state, files, reads, removal, importance,
                                 Inserter(state, files, reads, removal), reorderer,
                                 accounting, reopened)
        self._reorder = ReorderEngine(reorderer) if config.reorder_interval > 0 else None

    # ------------------------------------------------------------------ a request's steps
    def match_prefix(self, tokens, namespace: str = "", exact_only: bool = False
                     ) -> PrefixMatch:
        """Longest chunk-aligned stored prefix of `tokens` in `namespace` (a tenant: prefixes
        are never shared across namespaces), locked until release(). `exact_only`: stop
        before the first node whose KV was computed over a selection of its prefix."""
        state = self._state
        with state.lock:
            match = state.tree.match_prefix(tokens, namespace_key(namespace), exact_only)
            state.tree.lock(match)
            now = time.time()
            for node in match.nodes:
                node.hits += 1
                node.last_access = now
            return match

    def entry(self, node: RadixNode, layer: int) -> LayerEntry:
        return node.layers[layer]

    def start_probe(self, entry: LayerEntry, node=None) -> ProbeRead:
        """Start reading the probe heads' keys of every token of the node (on the reader
        threads); result() waits for them: float32, physical order."""
        return self._parts.reads.start_probe(entry, node)

    def chunk_ratios(self, entry: LayerEntry, chunk_ids):
        """Each chunk's important-token ratio (what ranks a copy in the memory tiers)."""
        return self._parts.importance.chunk_ratios(entry, chunk_ids)

    def last_selected_chunks(self, entry: LayerEntry):
        """The chunks the last query selected on this entry (the next one's likely loads)."""
        return self._parts.importance.last_selected_chunks(entry)

    def record_selection(self, entry: LayerEntry, scores, selected, chunks_read=None) -> None:
        self._parts.importance.record_selection(entry, scores, selected, chunks_read)

    def insert(self, tokens, start: int, kv, namespace: str = "", exact: bool = True
               ) -> list[RadixNode]:
        """Store the KV of tokens[start:end] (end: the last whole chunk); see Inserter."""
        return self._parts.inserter.insert(tokens, start, kv, namespace, exact)

    def release(self, match: PrefixMatch) -> None:
        state = self._state
        with state.lock:
            self._parts.removal.unlock(state.tree.unlock(match))
            state.queries += 1
        if self._reorder is not None:
            self._reorder.note_query()

    def quarantine(self, node: RadixNode, reason: str) -> None:
        """Take a corrupt node (and what lies below it) out of service."""
        self._parts.removal.quarantine(node, reason)

    def reorder_now(self) -> int:
        """Reorder every node whose importance changed, in the caller's thread."""
        return self._parts.reorderer.reorder_dirty()

    @property
    def config(self) -> StoreConfig:
        return self._state.config

    @property
    def shape(self) -> ModelShape:
        return self._state.shape

    def inspect(self) -> StoreParts:
        """The parts, for tools, metrics and tests: the tree, the counters, the sizes, the
        reads and removals one at a time."""
        return self._parts

    def close(self) -> None:
        state = self._state
        if state.closed:
            return
        state.closed = True
        if self._reorder is not None:
            self._reorder.stop()
        try:
            self._parts.importance.flush_stats()
        finally:
            state.reader.close()
            state.meta.close()
            dio.close_fd(state.lock_fd)

    def __enter__(self) -> "PrefixStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
