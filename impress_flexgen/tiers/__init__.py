"""Where chunk KV lives: the tier interface, the memory tiers and their chain, the disk tier
over a store's layer files (disk.py), the stack of tiers a load asks (stack.py), the remote
tier.

The remote tier (RedisTier, RemoteNamespace) is imported on first use, so that importing
this package does not need the redis client.
"""
from .base import ChunkKey, ChunkLoad, Tier, chunk_key, nbytes, payload_crc
from .chain import CPU, DISK, GPU, REMOTE, ChunkCache, TierConfig, TierSpec
from .disk import DiskTier
from .memory import MemoryTier
from .memory_chain import MemoryChain
from .stack import TierStack

__all__ = ["CPU", "DISK", "GPU", "REMOTE", "ChunkCache", "ChunkKey", "ChunkLoad", "DiskTier",
           "MemoryChain", "MemoryTier", "Tier", "TierConfig", "TierSpec", "TierStack",
           "chunk_key", "nbytes", "payload_crc"]

_REMOTE_NAMES = ("RedisTier", "RemoteNamespace")


def __getattr__(name: str):
    if name in _REMOTE_NAMES:
        from . import remote

        return getattr(remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_REMOTE_NAMES])
