"""The workload runner's old module path (see workload_runner)."""
from .engine.assemble import start_engine
from .workload_runner import (PLAN_KINDS, Prepared, RunConfig, kl_divergence,
                              kv_bytes_per_token, prepared, run_workload, store_space,
                              summarize)

__all__ = ["PLAN_KINDS", "Prepared", "RunConfig", "kl_divergence", "kv_bytes_per_token",
           "prepared", "run_workload", "start_engine", "store_space", "summarize"]
