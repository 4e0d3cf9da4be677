"""Loading chunks through the tiers: memory tiers first, the disk for what they miss
(admitted after), one submit and one wait per layer file."""
from __future__ import annotations

import dataclasses

import torch

from ..tiers import DISK, TierConfig
from .entries import LayerEntry
from .reads import _ChunkRead


@dataclasses.dataclass
class _KVLoad:
    """A load through the tiers in flight (PrefixStore.submit)."""

    entry: LayerEntry
    served: dict
    out: dict = dataclasses.field(default_factory=dict)     # kind -> chunks, asked order
    misses: dict = dataclasses.field(default_factory=dict)  # kind -> [(slot, id, ratio)]
    read: _ChunkRead | None = None



class _TieredLoads:
    """Chunk loads through the tier chain, then the disk (part of PrefixStore)."""

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Where a load may be served from, fastest first: the memory tiers, the disk."""
        if self.cache is None:
            return TierConfig().names(remote=False)
        return (*self.cache.tier_names, DISK)

    def load_chunks(self, entry: LayerEntry, kind: str, chunk_ids, node=None,
                    ratios=None) -> tuple[list[torch.Tensor], dict[str, int]]:
        """Chunks through the tiers, fastest first, then the disk (admitted after).

        Returns the chunks (on the device of the tier that served them, else host memory)
        and bytes served per tier name (tier_names), and "disk_chunks": chunks read.
        """
        chunks, served = self.load_kv_chunks(entry, {kind: chunk_ids}, node,
                                             None if ratios is None else {kind: ratios})
        return chunks[kind], served

    def load_kv_chunks(self, entry: LayerEntry, wanted: dict, node=None, ratios=None
                       ) -> tuple[dict[str, list[torch.Tensor]], dict[str, int]]:
        """load_chunks() for several kinds at once ({"k": ids, "v": ids}, ratios per id of
        each): what the tiers miss is read from disk in one round trip."""
        return self.wait(self.submit(entry, wanted, node, ratios))

    def start_prefetch(self, entry: LayerEntry, wanted: dict, node=None) -> "_ChunkRead":
        """Start reading chunks a load is expected to ask for soon ({"k": ids, "v": ids}),
        except those a tier holds. Tiers see nothing until the load: submit(...,
        ahead=finish_prefetch(...)[0]) then counts hits and misses and admits as if it had
        read the misses itself. Every start must be finished."""
        if self.cache is not None:
            wanted = {kind: [int(i) for i in ids
                             if self.cache.resident(self._key(entry, kind, int(i))) is None]
                      for kind, ids in wanted.items()}
        return self._start_chunks(entry, wanted, node)

    def finish_prefetch(self, read: "_ChunkRead") -> tuple[dict[str, dict[int, torch.Tensor]], int]:
        """Wait for a prefetch: ({kind: {chunk id: chunk}}, bytes read from disk)."""
        chunks, nbytes = self._finish_chunks(read)
        return {kind: dict(zip(read.ids_of[kind].tolist(), chunks[kind]))
                for kind in read.ids_of}, nbytes

    def submit(self, entry: LayerEntry, wanted: dict, node=None, ratios=None,
                        ahead: dict | None = None) -> "_KVLoad":
        """load_kv_chunks() in two halves: this one serves the tier hits and submits the
        disk reads; wait() waits for them (the caller computes meanwhile).
        A miss found in `ahead` (prefetched: {kind: {id: chunk}}) is taken from there, not
        read again (its bytes were counted by the prefetch). Every start must be finished,
        even when the caller gives up on the result."""
        load = _KVLoad(entry, dict.fromkeys(self.tier_names, 0) | {"disk_chunks": 0})
        for kind, chunk_ids in wanted.items():
            ids = [int(i) for i in chunk_ids]
            r = [0.0] * len(ids) if ratios is None else [float(x) for x in ratios[kind]]
            got: list[torch.Tensor] = [None] * len(ids)  # type: ignore[list-item]
            early = (ahead or {}).get(kind, {})
            for j, (i, ratio) in enumerate(zip(ids, r)):
                hit = self.cache.get(self._key(entry, kind, i), ratio) if self.cache else None
                if hit is not None:
                    tier, got[j] = hit
                    load.served[tier] += entry.layout.chunk_bytes
                elif i in early:
                    got[j] = early[i]
                    if self.cache is not None:
                        self.cache.admit(self._key(entry, kind, i), got[j], ratio,
                                         crc=entry.crc(kind, i))
                else:
                    load.misses.setdefault(kind, []).append((j, i, ratio))
            load.out[kind] = got
        if load.misses:
            load.read = self._start_chunks(
                entry, {k: [i for _, i, _ in m] for k, m in load.misses.items()}, node)
        return load

    def wait(self, load: "_KVLoad"
                         ) -> tuple[dict[str, list[torch.Tensor]], dict[str, int]]:
        if load.read is not None:
            fresh, nbytes = self._finish_chunks(load.read)
            load.served[DISK] += nbytes
            load.served["disk_chunks"] = sum(len(m) for m in load.misses.values())
            for kind, misses in load.misses.items():
                for (j, i, ratio), tensor in zip(misses, fresh[kind]):
                    load.out[kind][j] = tensor
                    if self.cache is not None:
                        # The CRC goes with the copy: checked before a promotion serves it.
                        # A node invalidated while this read was in flight is refused.
                        self.cache.admit(self._key(load.entry, kind, i), tensor, ratio,
                                         crc=load.entry.crc(kind, i))
        return load.out, load.served

    @staticmethod
    def _key(entry: LayerEntry, kind: str, index: int) -> tuple:
        return (entry.node_id, entry.layer, entry.version, kind, index)
