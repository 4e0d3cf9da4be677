"""The prefix KV store: chunked files on disk, a radix tree in SQLite, copy-on-write reorders."""
from ..errors import CorruptNode, StoreFull, StoreWriteFailed
from .config import (CHUNK_SIZE, LAYOUT_VERSION, STORE_FORMAT, ModelShape, StoreConfig,
                     model_fingerprint)
from .entries import LayerEntry, LayerStats, StoreMetrics
from .prefix_store import PrefixStore
from .reorder import ReorderEngine

__all__ = ["CHUNK_SIZE", "LAYOUT_VERSION", "STORE_FORMAT", "CorruptNode", "LayerEntry",
           "LayerStats", "ModelShape", "PrefixStore", "ReorderEngine", "StoreConfig", "StoreFull",
           "StoreMetrics", "StoreWriteFailed", "model_fingerprint"]
