"""`run --quick` on any model: the quick workload, made smaller where a pass is slow.

The quick workload (2 prefixes x 512 tokens, 2 queries each of --query-tokens, then
--max-new-tokens generated) takes seconds on smollm2-135m and hours on OPT-30B held in
4-bit on a 2-core CPU (half a minute per pass over the model). Its cost is predicted from
the prefill curve (each prefix prefilled once, each warm-up and measured query prefilled
over its prefix, each token after a query's first one more one-token pass), and where the
default would run past TARGET_S the first smaller rung of RUNGS that fits is taken (the
smallest when none does). A model whose default fits is served the default, unchanged.
"""
from __future__ import annotations

import dataclasses

TARGET_S = 600.0   # what a quick run aims at: about ten minutes of serving
WARMUP_QUERIES = 1   # per prefix, before the measured ones (workload.WorkloadConfig)


@dataclasses.dataclass(frozen=True)
class QuickWorkload:
    prefixes: int
    prefix_tokens: int
    queries: int          # measured, per prefix
    query_tokens: int
    new_tokens: int

    def describe(self) -> str:
        s = "es" if self.prefixes > 1 else ""
        return (f"{self.prefixes} prefix{s} x {self.prefix_tokens} tokens, {self.queries} "
                f"queries of {self.query_tokens} tokens each, {self.new_tokens} new tokens")


DEFAULT = QuickWorkload(2, 512, 2, 64, 8)
# Smaller and smaller: fewer prefixes first (each costs a long prefill), then shorter ones
# and fewer new tokens (each a pass over the model); every rung still reuses a stored
# prefix for more than one query.
RUNGS = (
    QuickWorkload(1, 512, 2, 64, 4),
    QuickWorkload(1, 256, 2, 32, 4),
    QuickWorkload(1, 128, 2, 32, 2),
    QuickWorkload(1, 64, 2, 16, 2),
    QuickWorkload(1, 32, 2, 8, 2),
)


def predicted_s(w: QuickWorkload, prefill) -> float:
    """Seconds to serve `w` (one policy) by `prefill(n, ctx)`, the prefill curve's seconds
    for n new tokens over ctx earlier ones. A query's prefix is taken as loaded (the plan
    that computes least); reads are left out (a model this slow computes far longer)."""
    per_prefix = prefill(w.prefix_tokens, 0)
    query = prefill(w.query_tokens, w.prefix_tokens)
    step = prefill(1, w.prefix_tokens + w.query_tokens)
    measured = w.queries * (query + (w.new_tokens - 1) * step)
    return w.prefixes * (per_prefix + WARMUP_QUERIES * query + measured)


def choose(prefill, query_tokens: int = DEFAULT.query_tokens,
           new_tokens: int = DEFAULT.new_tokens, target_s: float = TARGET_S
           ) -> tuple[QuickWorkload, str | None]:
    """(the quick workload, why it is smaller than the default: None when it is not).

    query_tokens, new_tokens: what the flags ask for; a rung never asks for more."""
    asked = dataclasses.replace(DEFAULT, query_tokens=query_tokens, new_tokens=new_tokens)
    default_s = predicted_s(asked, prefill)
    if default_s <= target_s:
        return asked, None
    chosen = None
    for rung in RUNGS:
        rung = dataclasses.replace(rung, query_tokens=min(rung.query_tokens, query_tokens),
                                   new_tokens=min(rung.new_tokens, new_tokens))
        chosen = rung
        if predicted_s(rung, prefill) <= target_s:
            break
    why = (f"the default ({asked.describe()}) is predicted at {_minutes(default_s)} on this "
           f"machine; this at {_minutes(predicted_s(chosen, prefill))} (aiming at "
           f"{_minutes(target_s)})")
    return chosen, why


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
