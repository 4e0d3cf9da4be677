"""Load, recompute or both: the plan for a request's matched prefix.

    split.py    the pure math: what each split m of the prefix costs, and the choice
    costs.py    the cost model: the prefill curve (calibrated, cached) and read bandwidths
    estimate.py the prefill curve predicted from bytes and FLOPs (calibration's budget)
    reads.py    what each split leaves to read, through a narrow view of the store
    planner.py  the planner a server runs: a measuring function and a store view in, plans
                out, learning from every request and recovering from a wrong calibration
    context.py  the stand-in prefix KV the prefill curve is measured over

The math is imported here; the planner (it needs torch and the policies) on first use.
"""
from __future__ import annotations

from .split import (BOTH_MARGIN, PLAN_KINDS, PLANS, Plan, PrefixCosts, choose, choose_plan,
                    overlap, split_compute, split_costs)

__all__ = ["BOTH_MARGIN", "PLAN_KINDS", "PLANS", "Plan", "PrefixCosts", "choose", "choose_plan",
           "overlap", "split_compute", "split_costs", "Planner", "StoreView", "prefix_costs",
           "ContextKV"]

_LAZY = {"Planner": "planner", "StoreView": "reads", "prefix_costs": "reads",
         "ContextKV": "context"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
