"""What a serving policy sees and decides, one layer at a time.

Before a layer's prefix KV is loaded, the engine hands the policy a LayerContext: the new
tokens' queries and keys, the matched prefix as segments of radix nodes, and services to
read probe keys and chunks. The policy answers with a LayerPlan: which physical chunks of
K and V to load, and which loaded tokens each KV head attends to.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    retention: float = 0.25            # r: fraction of prefix tokens kept
    granularity: str = "chunk"         # "chunk" (whole chunks) or "token" (the paper)
    threshold: str = "none"            # "adaptive" (t = j^alpha), "fixed", or "none"
    threshold_value: float = 0.85      # for "fixed"
    adaptive_alpha: float = 0.6
    probe_heads: str | tuple[int, ...] = "auto"  # see resolve_probe_heads
    probe_queries: int = 0             # probe with the last N new tokens' queries (0: all)
    probe_stride: int = 1              # of those, every k-th (counting back from the last)
    probe_every: int = 1               # probe every k-th layer; the others reuse its scores
    prefetch: bool = False             # impress: read ahead the chunks the last query chose
    decode_over: str = "kept"          # decode over the kept set, or "full" prefix
    decode_budget: int = 256           # tokens attended per layer and step by decode-phase
                                       # page policies (icecache, quest, page_*)
    # How a matched prefix is served (impress_flexgen.planner): "load" it (the policy's
    # selection), "recompute" it, "both" (recompute the front while the rest loads), or
    # "auto": the cheapest of the three by the cost model.
    plan: str = "load"
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.retention <= 1:
            raise ValueError("retention must be in (0, 1]")
        if self.granularity not in ("chunk", "token"):
            raise ValueError("granularity must be chunk or token")
        if self.threshold not in ("adaptive", "fixed", "none"):
            raise ValueError("threshold must be adaptive, fixed or none")
        if self.decode_over not in ("kept", "full"):
            raise ValueError("decode_over must be kept or full")
        if self.probe_queries < 0:
            raise ValueError("probe_queries must be 0 (all) or positive")
        if self.probe_stride < 1 or self.probe_every < 1:
            raise ValueError("probe_stride and probe_every must be positive")
        if self.decode_budget < 32:
            raise ValueError("decode_budget must be at least 32 tokens (two pages)")
        if self.plan not in ("auto", "load", "recompute", "both"):
            raise ValueError("plan must be auto, load, recompute or both")

    def budget(self, n: int) -> int:
        """k = ceil(r * n) tokens of an n-token prefix."""
        return min(n, max(1, math.ceil(self.retention * n)))


def resolve_probe_heads(spec, n_head: int, n_kv_head: int, seed: int = 0) -> tuple[int, ...]:
    """Which query heads probe.

    "auto": every head on grouped-query models (the probe copy must hold every KV head for
    one probe per group anyway, so the other heads of each group probe for free); heads
    0, 1, 2 on multi-head models (the paper). "all"; "group": the first head of each KV
    group; "first:K" / "random:K": K heads, the first or seeded random; "fraction:F": the
    first ceil(F * heads); or explicit ids, "0,3,6" or a tuple.
    """
    if isinstance(spec, (tuple, list)):
        heads = tuple(int(h) for h in spec)
    else:
        kind, _, arg = str(spec).partition(":")
        group = n_head // n_kv_head
        if kind == "auto":
            heads = tuple(range(n_head)) if group > 1 else tuple(range(min(3, n_head)))
        elif kind == "all":
            heads = tuple(range(n_head))
        elif kind == "group":
            heads = tuple(range(0, n_head, group))
        elif kind in ("first", "random", "fraction"):
            count = math.ceil(float(arg) * n_head) if kind == "fraction" else int(arg)
            count = max(1, min(n_head, count))
            heads = tuple(range(count)) if kind != "random" else tuple(sorted(
                np.random.default_rng(seed).choice(n_head, count, replace=False).tolist()))
        else:
            try:
                heads = tuple(int(h) for h in str(spec).split(","))
            except ValueError:
                raise ValueError(f"probe heads '{spec}': use auto, all, group, first:K, "
                                 "random:K, fraction:F or comma-separated ids") from None
    if not heads or any(not 0 <= h < n_head for h in heads):
        raise ValueError(f"probe heads {heads} must lie in 0..{n_head - 1}")
    return heads


@dataclasses.dataclass
class Segment:
    """A matched radix node: its first `used` logical tokens belong to the prefix."""

    node: object          # radix.RadixNode
    used: int
    entry: object         # store.LayerEntry of this layer
    _chunk_of: np.ndarray | None = dataclasses.field(default=None, repr=False)

    @property
    def start(self) -> int:
        return self.node.start

    def logical_to_chunk(self) -> np.ndarray:
        """Physical chunk of each of the first `used` logical tokens (computed once)."""
        if self._chunk_of is None:
            e = self.entry
            phys = np.arange(e.layout.n_tokens) if e.mapping is None else e.physical_of
            self._chunk_of = phys[: self.used] // e.layout.chunk_size
        return self._chunk_of

    def all_chunks(self) -> np.ndarray:
        return np.unique(self.logical_to_chunk())

    def in_chunks(self, chunk_ids: np.ndarray) -> np.ndarray:
        """Per used logical token: does one of the physical chunks `chunk_ids` hold it?"""
        held = np.zeros(self.entry.layout.n_chunks, dtype=bool)
        held[np.asarray(chunk_ids, dtype=np.int64)] = True
        return held[self.logical_to_chunk()]


@dataclasses.dataclass
class ProbeKeys:
    """A layer's probe keys as read: columns in stored (physical) order, segment after
    segment. Scoring runs over the columns as stored and maps the scores back to logical
    positions: a (heads, n) gather of scores instead of a (heads, n, d) gather of keys."""

    keys: torch.Tensor                      # (n_probe_kv, columns, d) float32, where scored
    column_of: np.ndarray | None = None     # logical prefix position -> column; None: same
    _columns: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    def columns(self) -> torch.Tensor:
        """`column_of` as an index on the keys' device (made once)."""
        if self._columns is None:
            self._columns = torch.from_numpy(self.column_of).to(self.keys.device)
        return self._columns

    def dead_columns(self) -> np.ndarray | None:
        """Columns holding no prefix token (past a segment's used tokens), or None."""
        if self.column_of is None or len(self.column_of) == self.keys.shape[1]:
            return None
        dead = np.ones(self.keys.shape[1], dtype=bool)
        dead[self.column_of] = False
        return dead

    def logical(self) -> torch.Tensor:
        """(n_probe_kv, n, d) keys in logical order."""
        if self.column_of is None:
            return self.keys
        return self.keys[:, self.columns()]


@dataclasses.dataclass
class LayerContext:
    """Selection runs on the device the queries are on (the compute device): the probe keys
    and any keys a policy loads are moved there, and only its results come back to the host,
    in one transfer (`to_host`)."""

    layer: int
    q: torch.Tensor                 # (H, s, d) float32 queries of the new tokens
    k_new: torch.Tensor             # (KV, s, d) float32 keys of the new tokens, same device
    segments: list[Segment]
    config: ServingConfig
    probe_heads: tuple[int, ...]    # query heads that probe
    probe_kv_heads: tuple[int, ...] # KV heads held by the probe copy, in its order
    probe: ProbeKeys | None         # this layer's probe keys, read ahead (policies that probe)
    load: Callable[[str, int, np.ndarray], list[torch.Tensor]]  # kind, segment, chunk ids
    n_pad: int = 0                  # leading prefix tokens nobody attends to (padding)
    # Leading prefix tokens recomputed in this pass (the "both" plan): the new tokens attend
    # all of them, so a policy that keeps_front counts them as kept and selects among the rest.
    front: int = 0

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def n_prefix(self) -> int:
        return sum(s.used for s in self.segments)

    @property
    def group(self) -> int:
        return self.q.shape[0] // self.k_new.shape[0]

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """A per-prefix-token array -> one array per segment."""
        bounds = np.cumsum([0] + [s.used for s in self.segments])
        return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@dataclasses.dataclass
class LayerPlan:
    chunks_k: list[np.ndarray]             # per segment: physical chunk ids of K to load
    chunks_v: list[np.ndarray]             # per segment: physical chunk ids of V to load
    attend: list[np.ndarray | None]        # per segment: (KV, used) bool, None: every loaded token
    fallback: bool = False                 # ITF fell back to loading the whole layer
    jaccard: float | None = None
    scores: list[np.ndarray] | None = None     # per segment, per logical token: importance
    selected: list[np.ndarray] | None = None   # per segment, per logical token: kept?

    @classmethod
    def everything(cls, segments: list[Segment]) -> "LayerPlan":
        chunks = [s.all_chunks() for s in segments]
        return cls(chunks, chunks, [None] * len(segments))


class ServingPolicy:
    """Base class: a policy is a name, a few switches, plan_layer() and, for decode-phase
    policies, start_decode()."""

    name = "base"
    reuse = True              # match and load stored prefix KV (False: recompute it)
    store_new = True          # insert newly computed prefix KV into the store
    tier_policy = "lru"       # "lru", "lfu" or "score" for the GPU/CPU tiers
    reorder = False           # background importance reordering of the store
    reads_probe = False       # plan_layer reads the probe copy (the engine prefetches it)
    loads_everything = False  # plan_layer always loads every chunk (the engine reads ahead)
    prefetch_last_selection = False  # the engine reads ahead what the last query selected
    # Every prefill attends to the whole prefix it was given (nothing selected): such a
    # policy matches only stored KV that was computed exactly, and its own is exact.
    exact_reads = False
    # plan_layer counts a recomputed front (LayerContext.front) as kept and spends only the
    # rest of its budget on loaded chunks (False: it selects as if nothing were recomputed;
    # the engine then skips the chosen chunks holding front tokens only).
    keeps_front = False
    # plan_layer carries state from one layer of a request to the next: a prefill pass
    # then serves one request at a time (its layers never interleave with another's).
    keeps_layer_state = False

    def __init__(self, config: ServingConfig = ServingConfig()):
        self.config = config

    def plan_layer(self, ctx: LayerContext) -> LayerPlan:
        return LayerPlan.everything(ctx.segments)

    def probes_layer(self, layer: int) -> bool:
        """Does plan_layer read the probe copy on this layer (the engine reads it ahead)?"""
        return self.reads_probe

    def start_decode(self, kept, n_head: int, device):
        """A decode-phase selector built from the prefill's context (`kept[layer] = [K, V,
        mask]`), or None: decode attends over the whole kept context (prefix policies)."""
        return None

    def describe(self) -> dict:
        return {"policy": self.name, "tier_policy": self.tier_policy, "reorder": self.reorder}


def to_host(*tensors: torch.Tensor | None) -> list[np.ndarray | None]:
    """Selection results (bool, integer or float tensors of any shape; None passes through)
    as host arrays of their own dtypes, in one copy from the device: one synchronisation per
    layer, not one per result. On the host they are handed over as they are."""
    real = [t for t in tensors if t is not None]
    if all(t.device.type == "cpu" for t in real):
        return [None if t is None else t.numpy() for t in tensors]
    # float64 holds every float32, bool and index value exactly.
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in real]).cpu().numpy()
    out, at = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        part = flat[at:at + t.numel()].reshape(tuple(t.shape))
        out.append(part.astype(str(t.dtype).removeprefix("torch.")))
        at += t.numel()
    return out


def same_device(a: torch.device, b: torch.device) -> bool:
    """Is a the device b (an index left out means the current one: "cuda" is "cuda:0")?"""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def join_chunks(chunks: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Loaded chunks (KV, c_i, d), concatenated along tokens on `device`. A GPU tier's copies
    are there already; those in host memory (CPU tier, disk) go over in one copy."""
    host = [i for i, c in enumerate(chunks) if not same_device(c.device, device)]
    if host:
        moved = torch.cat([chunks[i] for i in host], dim=1).to(device)
        if len(host) == len(chunks):
            return moved
        chunks = list(chunks)
        for i, part in zip(host, moved.split([chunks[i].shape[1] for i in host], dim=1)):
            chunks[i] = part
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)


def tokens_of_chunks(seg: Segment, chunk_ids: np.ndarray, first: int = 0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """For chunks concatenated in `chunk_ids` order: which rows hold prefix tokens (logical
    position in [first, used)), and those tokens' logical positions."""
    logical = seg.entry.logical_positions(np.asarray(chunk_ids, dtype=np.int64))
    rows = np.flatnonzero((logical < seg.used) & (logical >= first))
    return rows, logical[rows]


def chunks_holding(seg: Segment, chunk_ids: np.ndarray, first: int) -> np.ndarray:
    """Those of `chunk_ids` that hold a prefix token at logical position >= first (the
    tokens before it are recomputed, not loaded)."""
    ids = np.asarray(chunk_ids, dtype=np.int64)
    if first <= 0 or len(ids) == 0:
        return ids
    if first >= seg.used:
        return ids[:0]
    return ids[np.isin(ids, np.unique(seg.logical_to_chunk()[first:]))]
