"""Reading a layer file: probe sections and chunks, coalesced, CRC-checked, submitted to
the reader threads and waited for (the disk half of every load)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from disk_layout import io as dio
from disk_layout.format import ALIGN, align_up, decode_chunks, decode_probe
from disk_layout.io import ChecksumMismatch

from ..errors import CorruptNode
from .entries import LayerEntry
from .state import StoreState


@dataclasses.dataclass
class ProbeRead:
    """A probe section in flight (DiskReads.start_probe); result() waits for it."""

    entry: LayerEntry
    node: object
    handle: object
    reads: "DiskReads"

    def result(self) -> torch.Tensor:
        """The probe heads' keys, float32, physical order; CorruptNode if a check failed."""
        return self.reads.finish_probe(self)


@dataclasses.dataclass
class _ChunkRead:
    """Chunk reads of one layer file in flight (DiskReads.start_chunks): the ids asked
    for per kind, and, when anything is read, the reads sorted by offset."""

    entry: LayerEntry
    node: object
    ids_of: dict
    kinds: list = dataclasses.field(default_factory=list)   # per chunk read, in asked order
    all_ids: np.ndarray | None = None
    order: np.ndarray | None = None                         # j-th read by offset: its asked index
    assemble: object = None                                 # runs -> chunk tensors
    nbytes: int = 0
    handle: object = None


class DiskReads:
    """Disk reads of stored layer files, on the store's reader threads."""

    def __init__(self, state: StoreState) -> None:
        self.state = state

    def read_probe(self, entry: LayerEntry, node=None) -> torch.Tensor:
        """The probe heads' keys for every token of the node, float32, physical order."""
        return self.finish_probe(self.start_probe(entry, node))

    def start_probe(self, entry: LayerEntry, node=None) -> ProbeRead:
        """Start reading the probe section (on the reader threads); finish_probe() waits,
        checks and decodes it. Lets a caller read the next layer's probe while it computes."""
        lay = entry.layout
        handle = self._submit(entry, node, [(0, lay.probe_stride)],
                              [(lay.probe_bytes, int(entry.crcs[0]))])
        return ProbeRead(entry, node, handle, self)

    def finish_probe(self, pending: ProbeRead) -> torch.Tensor:
        entry, lay = pending.entry, pending.entry.layout
        (run,) = self._wait(entry, pending.node, pending.handle,
                            lambda _: f"probe keys of layer {entry.layer}: CRC mismatch")
        with self.state.lock:
            self.state.metrics.probe_bytes_read += lay.probe_stride
        return decode_probe(run.data[:lay.probe_bytes], lay.probe_format,
                            (lay.n_probe, lay.n_tokens, lay.head_dim))

    def _submit(self, entry: LayerEntry, node, extents, checks):
        """Start reads of `entry`'s file; any failure to open it raises CorruptNode."""
        try:
            return self.state.reader.submit(entry.path, extents, checks)
        except OSError as exc:
            self.state.count_corruption()
            raise CorruptNode(self.state.node_of(node, entry), f"{entry.path}: {exc}") from None

    def _wait(self, entry: LayerEntry, node, handle, describe):
        """The runs of a _submit(), read and CRC-checked; a mismatch (described by
        describe(extent index)) or any read error (short, EIO, ...) raises CorruptNode."""
        try:
            return self.state.reader.wait(handle)
        except ChecksumMismatch as exc:
            self.state.count_corruption()
            raise CorruptNode(self.state.node_of(node, entry), describe(exc.index)) from None
        except OSError as exc:
            self.state.count_corruption()
            raise CorruptNode(self.state.node_of(node, entry), f"{entry.path}: {exc}") from None

    def read_chunks(self, entry: LayerEntry, kind: str, chunk_ids, node=None) -> list[torch.Tensor]:
        """Physical chunks from disk (coalesced, CRC-checked): (heads, C, head_dim) each, in
        the store's KV format (int4: each chunk's packed bytes; decode_chunks decodes).

        The tensors are views of the buffers the reads landed in (no copy): writable, and
        each keeps its run of adjacent chunks in memory while it lives (the tiers copy).
        """
        return self.read_chunks_counted(entry, kind, chunk_ids, node)[0]

    def read_chunks_counted(self, entry: LayerEntry, kind: str, chunk_ids, node=None
                     ) -> tuple[list[torch.Tensor], int]:
        """read_chunks() and the bytes read from disk for them (padding included)."""
        chunks, nbytes = self.finish_chunks(self.start_chunks(entry, {kind: chunk_ids}, node))
        return chunks[kind], nbytes

    def start_chunks(self, entry: LayerEntry, wanted: dict, node=None) -> "_ChunkRead":
        """Submit reads of chunks of several kinds ({"k": ids, "v": ids}) of one layer file,
        all in flight together (one round trip to the disk, not one per kind);
        finish_chunks() waits for them."""
        lay = entry.layout
        ids_of = {kind: np.asarray([int(i) for i in chunk_ids], dtype=np.int64)
                  for kind, chunk_ids in wanted.items()}
        for ids in ids_of.values():
            if len(ids) and (ids.min() < 0 or ids.max() >= lay.n_chunks):
                raise IndexError(f"chunk ids outside 0..{lay.n_chunks - 1}")
        read = _ChunkRead(entry, node, ids_of)
        if not any(len(ids) for ids in ids_of.values()):
            return read
        read.kinds = [kind for kind, ids in ids_of.items() for _ in ids]
        read.all_ids = np.concatenate(list(ids_of.values()))
        offs = np.concatenate([lay.chunk_offset(k, 0) + ids * lay.chunk_stride
                               for k, ids in ids_of.items()])
        crcs = np.concatenate([entry.chunk_crcs(k, ids) for k, ids in ids_of.items()])
        read.order = np.argsort(offs, kind="stable")
        plan = self._plan_packed if lay.packed else self._plan_aligned
        extents, checks, read.assemble, read.nbytes = plan(entry, offs[read.order],
                                                           crcs[read.order])
        read.handle = self._submit(entry, node, extents, checks)
        return read

    def finish_chunks(self, read: "_ChunkRead") -> tuple[dict[str, list[torch.Tensor]], int]:
        if read.handle is None:
            return {kind: [] for kind in read.ids_of}, 0

        def describe(j: int) -> str:
            i = int(read.order[j])
            return (f"layer {read.entry.layer} {read.kinds[i].upper()} chunk "
                    f"{int(read.all_ids[i])}: CRC mismatch")

        runs = self._wait(read.entry, read.node, read.handle, describe)
        unsorted: list[torch.Tensor] = [None] * len(read.order)  # type: ignore[list-item]
        for i, chunk in zip(read.order.tolist(), read.assemble(runs)):
            unsorted[i] = chunk
        out, at = {}, 0
        for kind, ids in read.ids_of.items():
            out[kind] = unsorted[at:at + len(ids)]
            at += len(ids)
        with self.state.lock:
            self.state.metrics.chunks_read += len(read.all_ids)
            self.state.metrics.bytes_read += read.nbytes
        return out, read.nbytes

    def _plan_aligned(self, entry: LayerEntry, offs, crcs):
        """Page-aligned layout: every chunk is whole pages, runs of them are single reads.
        offs: sorted chunk offsets. Returns (extents, checks, assemble(runs), bytes)."""
        lay = entry.layout
        stride = lay.chunk_stride
        shape = lay.chunk_shape

        def assemble(runs) -> list[torch.Tensor]:
            chunks: list[torch.Tensor] = []
            for run in runs:
                m = len(run.members)
                payload = run.data.view(m, stride)[:, :lay.chunk_bytes].view(lay.kv_dtype)
                chunks.extend(payload.view(m, *shape).unbind(0))
            return chunks

        return dio.Extents(offs, stride, lay.chunk_bytes, crcs), None, assemble, len(offs) * stride

    def _plan_packed(self, entry: LayerEntry, offs, crcs):
        """Packed layout: each run of adjacent chunks is read as the pages it touches.
        offs: sorted chunk offsets. Returns (extents, checks, assemble(runs), bytes)."""
        lay = entry.layout
        size = lay.chunk_bytes
        breaks = np.flatnonzero(offs[1:] != offs[:-1] + size) + 1
        bounds = [0, *breaks.tolist(), len(offs)]
        per_run = max(1, dio.MAX_RUN_BYTES // size)
        groups, extents = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            for g0 in range(a, b, per_run):
                g1 = min(g0 + per_run, b)
                # A run may share its first page with the previous run (chunks smaller
                # than a page): that page is read twice, in separate buffers.
                lo = int(offs[g0]) // ALIGN * ALIGN
                hi = align_up(int(offs[g1 - 1]) + size)
                groups.append((g0, g1))
                extents.append((lo, hi - lo))
        # CRCs are checked by the reader threads as each run lands.
        checks = [[(int(offs[j]) - lo, size, int(crcs[j]), j) for j in range(g0, g1)]
                  for (g0, g1), (lo, _) in zip(groups, extents)]
        shape = lay.chunk_shape

        def assemble(runs) -> list[torch.Tensor]:
            chunks: list[torch.Tensor] = []
            for run in runs:
                for i in run.members:
                    # One view per group of adjacent chunks (slices of the run's buffer, so
                    # the buffer pool sees them), split into chunks.
                    g0, g1 = groups[i]
                    start = int(offs[g0]) - run.offset
                    span = run.data[start:start + (g1 - g0) * size]
                    chunks.extend(span.view(lay.kv_dtype).view(g1 - g0, *shape).unbind(0))
            return chunks

        return extents, checks, assemble, sum(length for _, length in extents)

    def read_layer(self, entry: LayerEntry, node=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole K and V of a (node, layer) in logical order: (heads, n_tokens, head_dim),
        in the store's KV format (int4: decoded to float32)."""
        ids = range(entry.layout.n_chunks)
        k = torch.cat(decode_chunks(self.read_chunks(entry, "k", ids, node), entry.layout), 1)
        v = torch.cat(decode_chunks(self.read_chunks(entry, "v", ids, node), entry.layout), 1)
        if entry.mapping is not None:
            to_physical = torch.from_numpy(entry.physical_of)
            k, v = k[:, to_physical], v[:, to_physical]
        return k, v
