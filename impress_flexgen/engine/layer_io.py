"""A layer's reads: a request's probe keys and expected chunks are read one layer ahead,
while the layer before computes, and each layer's loads are served once however often its
policy asks, through the store's tiers (memory, then the disk).

    ahead = ReadAhead(store, policy, n_layers, segments_nodes, stats, device=where_selected)
    ahead.start(0)
    for layer in range(n_layers):
        ahead.start(layer + 1)              # next layer's reads go out now
        loader = ahead.loader(layer)        # this layer's probe and chunk loads
        probe = loader.read_probe()         # the keys read ahead (policies that probe)
        ...
    ahead.close()                           # every read in flight waited for
"""
from __future__ import annotations

import numpy as np
import torch

from policies import Segment
from policies.base import ProbeKeys, chunks_holding, same_device

from .pass_reads import PassReads


class LayerLoader:
    """One layer's services to its policy: the probe keys and chunk loads through the tiers
    and the disk, each chunk loaded once however often it is asked for (by this request or
    by another of its prefill pass: pass_reads.py), with the counters of the request's
    stats. Chunks read ahead (prefetch) are taken instead of read again."""

    def __init__(self, store, layer: int, segments, ahead: "ReadAhead", stats, reads):
        self.store, self.layer, self.segments = store, layer, segments
        self.ahead, self.stats, self.reads = ahead, stats, reads

    def prefetch(self, wanted: list[tuple[int, dict]]) -> None:
        """Start disk reads of chunks the policy is expected to load: [(segment, {kind:
        ids})]. Tiers are consulted when the policy asks (start_all), as without it."""
        for si, kinds in wanted:
            self.reads.prefetch(self.segments[si], kinds, self.stats)

    def read_probe(self) -> ProbeKeys:
        with self.stats.timer("probe_s", sync=self.ahead.device):
            probe = self.ahead.result(self.layer)
            self.stats.probe_bytes += sum(seg.entry.layout.probe_stride
                                          for seg in self.segments)
        return probe

    def load(self, kind: str, si: int, ids) -> list[torch.Tensor]:
        return self.finish_all(self.start_all([(si, {kind: ids})]))[si][kind]

    def start_all(self, wanted: list[tuple[int, dict]]) -> list:
        """Submit [(segment, {kind: chunk ids})]: tier hits, chunks read ahead and chunks
        the pass has are served now, disk reads go out; finish_all() collects them. The
        layer's reads ahead are finished first (their bytes count as read)."""
        handles = []
        with self.stats.timer("load_s"):
            self.reads.collect(self.segments)
            for si, kinds in wanted:
                handles.append((si, self.reads.start(self.segments[si], kinds, self.stats)))
        return handles

    def finish_all(self, handles) -> dict[int, dict[str, list[torch.Tensor]]]:
        out = {}
        with self.stats.timer("load_s"):
            for si, handle in handles:
                out[si] = self.reads.finish(handle)
        return out


class SharedProbe:
    """One probe section read (a request's own, or shared by the requests of a prefill
    pass that matched its node): CRC-checked, decoded and moved to the device that scores
    it once, by whichever asks first, and the same keys (read only) handed to each; a failed
    read fails each of them alike."""

    def __init__(self, store, entry, node):
        self.store, self.entry = store, entry
        self.read = store.start_probe(entry, node)       # a store.reads.ProbeRead
        self.keys: torch.Tensor | None = None
        self.error: BaseException | None = None

    def finish(self, device: torch.device | None = None) -> torch.Tensor:
        if self.read is not None:
            read, self.read = self.read, None
            try:
                self.keys = read.result()
            except BaseException as exc:
                self.error = exc
        if self.error is not None:
            raise self.error
        if device is not None and not same_device(self.keys.device, device):
            self.keys = self.keys.to(device)     # one copy for every head and request
        return self.keys


class ReadAhead:
    """Starts a layer's reads one layer ahead, on the store's reader threads.

    The probe keys of layer l+1 do not depend on layer l's result, so their read hides
    behind layer l's compute; only the wait that is left shows as probe time. A policy
    that loads every chunk (`loads_everything`: full) has its next layer's K and V read
    ahead the same way; one that predicts its selection (`prefetch_last_selection`:
    impress) has the chunks the last query selected on that (node, layer) read ahead, and
    only what the new selection adds is read after it. Decoding stays on the calling thread
    (a second thread doing tensor work would fight the compute threads for the cores). A
    read that fails (CRC, missing file) raises when its layer asks for it, as a direct read
    would.
    """

    def __init__(self, store, policy, n_layers: int, segments_nodes, stats, front: int = 0,
                 shared_probes: dict | None = None, device: torch.device | None = None,
                 reads: PassReads | None = None):
        """`stats`: the request's counters (probe_s, load_s, probe_bytes, bytes_read per
        tier, chunks_read, chunks_loaded) that the reads add to. `front`: prefix tokens the
        request recomputes instead of loading (no chunk of theirs alone is read ahead).
        `shared_probes`: the probe reads of the requests prefilled in the same pass, by
        layer file (a node's probe keys are read once for all of them). `device`: where
        the policy scores (the probe keys are moved there as they are decoded; None: they
        stay in host memory). `reads`: the chunk reads of its prefill pass, shared by the
        requests in it (None: its own)."""
        self.front = front
        self.device = device
        self.shared_probes = shared_probes
        self.store = store
        self.n_layers = n_layers
        self.segments_nodes = segments_nodes
        self.stats = stats
        stored = bool(segments_nodes) and store is not None
        self.policy = policy
        self.probes_on = stored and policy.reads_probe
        self.whole_layers = stored and policy.loads_everything
        self.last_selection = stored and policy.prefetch_last_selection
        self.pending: dict[int, list] = {}
        self.ready: dict[int, ProbeKeys | BaseException] = {}
        self.loaders: dict[int, LayerLoader] = {}
        self.own_reads = reads is None
        self.reads = PassReads(store) if reads is None else reads

    def loader(self, layer: int) -> "LayerLoader":
        """The loader of `layer` (with its reads ahead, if any)."""
        got = self.loaders.pop(layer, None)
        if got is None:
            segments = [Segment(node, used, self.store.entry(node, layer))
                        for node, used in self.segments_nodes]
            got = LayerLoader(self.store, layer, segments, self, self.stats, self.reads)
        return got

    def start(self, layer: int) -> None:
        if layer >= self.n_layers:
            return
        if self.probes_on and self.policy.probes_layer(layer) and layer not in self.pending:
            reads = []
            # Alone, a request's reads are its own; in a pass, requests share them by file.
            shared = self.shared_probes if self.shared_probes is not None else {}
            try:
                for node, _ in self.segments_nodes:
                    entry = self.store.entry(node, layer)
                    if entry.path not in shared:
                        shared[entry.path] = SharedProbe(self.store, entry, node)
                    reads.append(shared[entry.path])
            except BaseException:
                self._drain(reads)   # the request fails (a missing file): nothing in flight
                raise
            self.pending[layer] = reads
        if (self.whole_layers or self.last_selection) and layer not in self.loaders:
            loader = self.loaders[layer] = self.loader(layer)
            if self.whole_layers:
                likely = [seg.all_chunks() for seg in loader.segments]
            else:
                likely = [self.store.last_selected_chunks(seg.entry) for seg in loader.segments]
            likely = [chunks_holding(seg, ids, self.front - seg.start)
                      for seg, ids in zip(loader.segments, likely)]
            loader.prefetch([(si, {"k": ids, "v": ids})
                             for si, ids in enumerate(likely) if len(ids)])

    def drop(self, layer: int) -> None:
        """The request is past `layer`: its own chunk reads of it are let go."""
        if self.own_reads:
            self.reads.drop(layer)

    def decode_probe(self, layer: int) -> None:
        """Finish and decode `layer`'s probe now (the caller is waiting on other reads);
        result() hands it over, or raises what reading it raised."""
        if layer not in self.pending:
            return
        try:
            self.ready[layer] = self._finish(layer)
        except Exception as exc:  # noqa: BLE001 - raised by result(), if it is asked for
            self.ready[layer] = exc

    def probes(self, layer: int) -> bool:
        """Does the policy read the probe keys of `layer` (read ahead for it)?"""
        return self.probes_on and self.policy.probes_layer(layer)

    def result(self, layer: int) -> ProbeKeys:
        """The probe keys of `layer` (stored order, with their logical positions)."""
        if not self.probes_on:
            raise RuntimeError("the policy reads no probe")
        if layer in self.ready:
            got = self.ready.pop(layer)
            if isinstance(got, BaseException):
                raise got
            return got
        return self._finish(layer)

    def _finish(self, layer: int) -> ProbeKeys:
        self.start(layer)
        reads = self.pending.pop(layer)
        parts, columns, width = [], [], 0   # columns: logical position -> column
        try:
            for (_, used), pending in zip(self.segments_nodes, reads):
                entry = pending.entry
                probe = pending.finish(self.device)
                # Keys stay in stored order (scoring maps its scores back); only an
                # unreordered node can drop its unused tail by slicing.
                if entry.mapping is None:
                    probe = probe[:, :used]
                    columns.append(np.arange(width, width + used))
                else:
                    columns.append(entry.physical_of[:used] + width)
                parts.append(probe)
                width += probe.shape[1]
        except BaseException:
            self._drain(reads[len(parts) + 1:])
            raise
        keys = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        reordered = any(pending.entry.mapping is not None for pending in reads)
        return ProbeKeys(keys, np.concatenate(columns) if reordered else None)

    def _drain(self, reads) -> None:
        for pending in reads:
            try:
                pending.finish()
            except Exception:  # noqa: BLE001 - nobody asked for this read
                pass

    def close(self) -> None:
        """Wait for reads still in flight: a failed request may quarantine their files next."""
        for reads in self.pending.values():
            self._drain(reads)
        if self.own_reads:
            self.reads.close()
        self.pending.clear()
        self.ready.clear()
        self.loaders.clear()
