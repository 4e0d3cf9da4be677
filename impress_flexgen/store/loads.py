"""Loading chunks of a stored layer through the tier stack: the memory tiers first, the
disk tier for what they miss (admitted after), one disk read per layer file."""
from __future__ import annotations

import dataclasses

import torch

from ..tiers.stack import StackLoad, TierStack
from .entries import LayerEntry
from .state import chunk_key


@dataclasses.dataclass
class KVLoad:
    """A load in flight (PrefixStore.submit): the kinds asked, with their chunk counts."""

    entry: LayerEntry
    counts: dict            # kind -> number of chunks asked, in asked order
    stack: StackLoad

    @property
    def read(self):
        """The disk tier's read in flight; None when the memory tiers and the chunks read
        ahead served everything."""
        return self.stack.disk


@dataclasses.dataclass
class Prefetch:
    """A read ahead in flight (PrefixStore.start_prefetch)."""

    kinds: list
    pending: object         # TierStack.prefetch's: (keys read, the disk tier's read)

    def ids(self, kind: str) -> list[int]:
        """The chunks of `kind` being read (those no memory tier holds)."""
        return [key[4] for key in self.pending[0] if key[3] == kind]


class Loads:
    """Chunk loads of one layer file, as {kind: chunk ids}, through the TierStack."""

    def __init__(self, tiers: TierStack) -> None:
        self.tiers = tiers

    def submit(self, entry: LayerEntry, wanted: dict, node=None, ratios=None,
               ahead: dict | None = None) -> KVLoad:
        """Serve the tier hits and submit the disk reads; wait() waits for them (the caller
        computes meanwhile). A miss found in `ahead` (prefetched: {kind: {id: chunk}}) is
        taken from there, not read again (its bytes were counted by the prefetch). Every
        submit must be waited for, even when the caller gives up on the result."""
        keys, rates, early, counts = [], [], [], {}
        for kind, chunk_ids in wanted.items():
            ids = [int(i) for i in chunk_ids]
            r = [0.0] * len(ids) if ratios is None else [float(x) for x in ratios[kind]]
            got = (ahead or {}).get(kind, {})
            counts[kind] = len(ids)
            keys += [chunk_key(entry, kind, i) for i in ids]
            rates += r
            early += [got.get(i) for i in ids]
        load = self.tiers.submit(keys, rates, (node, entry),
                                 lambda j: entry.crc(keys[j][3], keys[j][4]),
                                 entry.layout.chunk_bytes, early if ahead else None)
        return KVLoad(entry, counts, load)

    def wait(self, load: KVLoad) -> tuple[dict[str, list[torch.Tensor]], dict[str, int]]:
        chunks, served = self.tiers.wait(load.stack)
        out, at = {}, 0
        for kind, n in load.counts.items():
            out[kind] = chunks[at:at + n]
            at += n
        return out, served

    def start_prefetch(self, entry: LayerEntry, wanted: dict, node=None) -> Prefetch:
        """Start reading chunks a load is expected to ask for soon ({"k": ids, "v": ids}),
        except those a memory tier holds. Tiers see nothing until the load: submit(...,
        ahead=finish_prefetch(...)[0]) then counts hits and misses and admits as if it had
        read the misses itself. Every start must be finished."""
        keys = [chunk_key(entry, kind, int(i)) for kind, ids in wanted.items() for i in ids]
        return Prefetch(list(wanted), self.tiers.prefetch(keys, (node, entry)))

    def finish_prefetch(self, read: Prefetch
                        ) -> tuple[dict[str, dict[int, torch.Tensor]], int]:
        """Wait for a prefetch: ({kind: {chunk id: chunk}}, bytes read from disk)."""
        keys, chunks, nbytes = self.tiers.finish_prefetch(read.pending)
        out: dict[str, dict[int, torch.Tensor]] = {kind: {} for kind in read.kinds}
        for key, chunk in zip(keys, chunks):
            out[key[3]][key[4]] = chunk
        return out, nbytes
