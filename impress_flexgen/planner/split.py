"""Load, recompute or both: the plan for a request's matched prefix of n chunks.

After Cake ("Compute Or Load KV Cache? Why Not Both?", 2024): "both" recomputes chunks
[0, m) with normal prefill while the I/O path loads what the policy needs of chunks
[m, n), m chosen where the two finish together. Layer l+1 is read while layer l computes,
so compute and I/O overlap except for one layer's worth of the shorter:

    overlap(c, io) = max(c, io) + min(c, io) / L

With C the prefill curve, T tokens per chunk and q new tokens, for a split m:

    compute(m) = C(m*T, 0) + C(q, m*T + kept[m]) - a + select
    io(m)      = IO[m] + probe
    both(m)    = overlap(compute(m), io(m)),   recompute = C(n*T + q, 0)

IO[m]: seconds of the chunk reads left when the first m chunks are recomputed, kept[m]:
prefix tokens past the front the new tokens attend to (what the policy keeps of them),
select and probe: the policy's scoring and probe reads, paid once whatever part loads (it
scores the whole stored prefix). The front is recomputed in the same pass as the new
tokens but attends over its own keys only (a product of its own, m*T by m*T), while the
new tokens attend over the kept tokens, the front and themselves: one pass, so the curve's
per-call term a is paid once.
both(0) is load and both(n) is recompute, so the three are one curve over m in [0, n]; the
plan takes its minimum (the least recomputed on a tie, and an interior split only when it
wins by BOTH_MARGIN).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from numbers import Integral

from .costs import CostModel

PLANS = ("auto", "load", "recompute", "both")
PLAN_KINDS = PLANS[1:]          # what a request's plan turns out to be (auto chooses)
BOTH_MARGIN = 0.03


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to do with the matched prefix, and what each candidate was predicted to cost."""

    mode: str            # "load" | "recompute" | "both"
    split_chunks: int    # m: chunks recomputed from the front (0: load, n: recompute)
    predicted_s: float   # predicted seconds of the chosen plan
    predicted: dict      # {"recompute": s, "load": s, "both": s (best interior m)}
    # Why this plan: "predicted" (the cheapest), "explore" (tried again to measure it),
    # "forced" (the plan was configured), "no-match" (nothing stored to plan over).
    reason: str = "predicted"


@dataclasses.dataclass(frozen=True)
class PrefixCosts:
    """What loading each part of a matched prefix would cost (see the module docstring).

    io_after[m] and kept_after[m] for m in 0..n (both 0 at n: nothing is left to load).
    """

    n_chunks: int
    chunk_tokens: int
    query_tokens: int
    io_after: tuple[float, ...]
    kept_after: tuple[float, ...]
    probe_s: float = 0.0
    select_s: float = 0.0

    def __post_init__(self):
        n = self.n_chunks
        if not (isinstance(n, Integral) and n >= 0):
            raise ValueError(f"n_chunks must be an int >= 0, got {n!r}")
        if not (isinstance(self.chunk_tokens, Integral) and self.chunk_tokens >= 1):
            raise ValueError(f"chunk_tokens must be an int >= 1, got {self.chunk_tokens!r}")
        if not (isinstance(self.query_tokens, Integral) and self.query_tokens >= 0):
            raise ValueError(f"query_tokens must be an int >= 0, got {self.query_tokens!r}")
        for name in ("io_after", "kept_after"):
            values = getattr(self, name)
            if len(values) != n + 1:
                raise ValueError(f"{name} has {len(values)} entries for {n} chunks "
                                 f"(needs n + 1)")
            for i, s in enumerate(values):
                if not (math.isfinite(s) and s >= 0):
                    raise ValueError(f"{name}[{i}] must be finite and >= 0, got {s!r}")
        for name in ("probe_s", "select_s"):
            s = getattr(self, name)
            if not (math.isfinite(s) and s >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {s!r}")

    @classmethod
    def uniform(cls, n_chunks: int, chunk_tokens: int, query_tokens: int,
                chunk_io_s: Sequence[float], probe_s: float = 0.0, select_s: float = 0.0,
                kept_fraction: float = 1.0) -> PrefixCosts:
        """Chunk i costs chunk_io_s[i] to load; the policy keeps kept_fraction of the
        tokens past the front."""
        if len(chunk_io_s) != n_chunks:
            raise ValueError(f"chunk_io_s has {len(chunk_io_s)} entries for {n_chunks} chunks")
        for i, s in enumerate(chunk_io_s):
            if not (math.isfinite(s) and s >= 0):
                raise ValueError(f"chunk_io_s[{i}] must be finite and >= 0, got {s!r}")
        if not 0 <= kept_fraction <= 1:
            raise ValueError(f"kept_fraction must be in [0, 1], got {kept_fraction!r}")
        io = [0.0] * (max(n_chunks, 0) + 1)
        for i in range(n_chunks - 1, -1, -1):   # a suffix sum, one addition per chunk
            io[i] = io[i + 1] + float(chunk_io_s[i])
        kept = [kept_fraction * (n_chunks - m) * chunk_tokens for m in range(n_chunks + 1)]
        return cls(n_chunks, chunk_tokens, query_tokens, tuple(io), tuple(kept),
                   float(probe_s), float(select_s))


def overlap(compute_s: float, io_s: float, n_layers: int) -> float:
    """Compute and I/O pipelined layer by layer: the shorter is hidden but one layer."""
    return max(compute_s, io_s) + min(compute_s, io_s) / n_layers


def split_compute(cost: CostModel, prefix: PrefixCosts, m: int) -> float:
    """Prefill seconds of the split m (the prefill curve's part: no I/O, no scoring)."""
    T, q = prefix.chunk_tokens, prefix.query_tokens
    if m >= prefix.n_chunks:
        return cost.compute_s(prefix.n_chunks * T + q, 0)
    front = m * T
    rest = cost.compute_s(q, front + prefix.kept_after[m])
    if front == 0 or q == 0:
        return rest + cost.compute_s(front, 0)
    # Two products in one pass: the per-call term counted once.
    return cost.compute_s(front, 0) + rest - cost.prefill.a


def split_costs(cost: CostModel, prefix: PrefixCosts) -> list[float]:
    """Predicted seconds of the split m, for m in 0..n (0: load, n: recompute)."""
    n = prefix.n_chunks
    out = [overlap(split_compute(cost, prefix, m) + prefix.select_s,
                   prefix.io_after[m] + prefix.probe_s, cost.n_layers) for m in range(n)]
    out.append(split_compute(cost, prefix, n))
    return out


def choose_plan(mode: str, cost: CostModel, prefix: PrefixCosts) -> Plan:
    """The plan for `mode` (one of PLANS) over the matched prefix `prefix` describes.

    Under auto, an interior split must win by BOTH_MARGIN: a smaller predicted gain is
    within the model's error, and the split costs a second embedding pass besides.
    """
    if mode not in PLANS:
        raise ValueError(f"unknown plan {mode!r}: choose one of {', '.join(PLANS)}")
    n = prefix.n_chunks
    if n == 0:
        s = cost.compute_s(prefix.query_tokens, 0)
        return Plan("recompute", 0, s, {"recompute": s, "load": s, "both": s})
    costs = split_costs(cost, prefix)
    load, recompute = costs[0], costs[n]
    best_m, best_both = None, math.inf
    for m in range(1, n):
        if costs[m] < best_both:   # strict: the first minimum, the least recomputed
            best_m, best_both = m, costs[m]
    if best_m is None:   # n == 1: no interior split; both is the better end
        best_both = min(load, recompute)
    predicted = {"recompute": recompute, "load": load, "both": best_both}

    ends = [("load", 0, load), ("recompute", n, recompute)]
    if mode == "load":
        chosen = ends[0]
    elif mode == "recompute":
        chosen = ends[1]
    elif mode == "both" and best_m is not None:
        chosen = ("both", best_m, best_both)
    else:
        # auto (or both without an interior split): the cheapest, least recomputed first.
        chosen = min(ends, key=lambda c: c[2])   # min keeps the first of equals
        if best_m is not None and best_both * (1 + BOTH_MARGIN) < chosen[2]:
            chosen = ("both", best_m, best_both)
    return Plan(chosen[0], chosen[1], chosen[2], predicted)


def choose(mode: str, cost: CostModel, n_chunks: int, chunk_tokens: int, query_tokens: int,
           chunk_io_s: Sequence[float], probe_s: float = 0.0, select_s: float = 0.0,
           kept_fraction: float = 1.0) -> Plan:
    """choose_plan over chunks that each cost chunk_io_s[i] to load (PrefixCosts.uniform):
    their tier's bandwidth and the expected selection fraction applied, 0 for a chunk in
    GPU memory. probe_s: the probe reads, paid whenever any chunk loads."""
    return choose_plan(mode, cost, PrefixCosts.uniform(
        n_chunks, chunk_tokens, query_tokens, chunk_io_s, probe_s, select_s, kept_fraction))
