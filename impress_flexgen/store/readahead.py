"""The engine's I/O scheduler's old module path (see engine.readahead)."""
from ..engine.readahead import LayerLoader, ReadAhead

__all__ = ["LayerLoader", "ReadAhead"]
