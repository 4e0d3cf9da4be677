"""ReComp: recompute the whole prefix for every request; the store is never touched."""
from __future__ import annotations

from .base import ServingPolicy


class Recomp(ServingPolicy):
    name = "recomp"
    reuse = False
    store_new = False
    exact_reads = True
