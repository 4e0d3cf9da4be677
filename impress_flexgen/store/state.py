"""What the store's parts share: one `StoreState` (directory, shape, settings, the lock, the
radix tree, the metadata, the statistics, the counters, the reader), and the helpers every
part uses on it (the metadata write, a node for an entry, a file layout).

Each part of the store (opening, reads, files, removal, inserts, importance, reorders,
accounting, loads) is a plain class given this state and the parts it calls.
"""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np

from disk_layout.format import LayerFileLayout
from disk_layout.metadata import MetadataError, MetadataFull

from ..errors import StoreFull, StoreWriteFailed
from .config import ModelShape, StoreConfig
from .entries import LayerEntry, LayerStats, StoreMetrics
from .radix import RadixNode, RadixTree


@dataclasses.dataclass(eq=False)
class StoreState:
    """One store's shared state. `lock` guards the tree, the statistics, the metadata
    connection and the metrics; it is held only for bookkeeping: file writes, fsyncs and
    reads happen outside it."""

    dir: Path
    shape: ModelShape
    config: StoreConfig
    packed: bool
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    reorder_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    metrics: StoreMetrics = dataclasses.field(default_factory=StoreMetrics)
    tree: RadixTree | None = None
    stats: dict[tuple[int, int], LayerStats] = dataclasses.field(default_factory=dict)
    queries: int = 0
    reserved: int = 0       # bytes of files being written for inserts not yet committed
    meta: object = None     # disk_layout.metadata.Metadata, once opened
    reader: object = None   # disk_layout.io.DiskReader, once opened
    lock_fd: int = -1
    closed: bool = False

    def __post_init__(self) -> None:
        if self.tree is None:
            self.tree = RadixTree(self.config.chunk_size)

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def quarantine_dir(self) -> Path:
        return self.dir / "quarantine"

    def layout(self, n_tokens: int) -> LayerFileLayout:
        return LayerFileLayout(n_tokens, self.config.chunk_size, self.shape.n_kv_heads,
                               self.shape.head_dim, len(self.config.probe_heads),
                               self.config.probe_format, self.packed, self.shape.kv_format)

    def node_of(self, node, entry: LayerEntry) -> RadixNode:
        """`node`, or for a caller that gave none the entry's node (a stand-in if gone)."""
        if isinstance(node, RadixNode):
            return node
        return self.tree.nodes.get(entry.node_id) or RadixNode(entry.node_id, None, 0,
                                                               np.zeros(0, np.int32))

    def is_current(self, entry: LayerEntry) -> bool:
        """Is `entry` its node's layout now (not one a reorder replaced)? Under the lock."""
        node = self.tree.nodes.get(entry.node_id)
        return node is not None and node.layers[entry.layer] is entry

    def count_corruption(self) -> None:
        with self.lock:
            self.metrics.corruptions += 1


def meta_write(write, what: str):
    """Run a metadata write; a full or failing database becomes StoreFull /
    StoreWriteFailed (the request goes on without storing)."""
    try:
        return write()
    except MetadataFull as exc:
        raise StoreFull(f"metadata database full while {what}: {exc}") from None
    except MetadataError as exc:
        raise StoreWriteFailed(f"metadata write failed while {what}: {exc}") from None
