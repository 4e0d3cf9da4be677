"""The shared pool's client lives in tiers/pool.py; kept importable from here."""
from ..tiers.pool import (  # noqa: F401 - re-exported
    FALLBACK_TOKENS_PER_S,
    PROBE_EVERY_S,
    SECRET_ENV,
    GivenKV,
    SharedMiss,
    SharedPrefix,
    chunk_hashes,
    shared_pool,
)
