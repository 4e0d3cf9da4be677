"""Load, recompute or both: TTFT of each plan, and of the planner, across disk read limits.

    python -m experiments.planner [--model smollm2-135m] [--quick] [--json PATH] [--figure PNG]

Per prefix length, two stores hold the same workload (one for the full policy, one for
impress, reordered once after its warm-up queries) and are read under each disk read limit
in turn (the store's reads held to that many MB/s, standing in for slower disks). Rows:
recompute (no store), load with every chunk (full), load of the impress selection, and the
planner (plan auto: recompute, load or both per request, by the cost model) over each
store. The measured queries go round the rows one query at a time, so that whatever else
the machine runs slows every row alike; with --repeats, each row's TTFT of a query is the
median of its repeats (on a shared machine the least of a few repeats is itself an
outlier). Recompute reads no disk: it is measured at the first limit and stands at the
others (--recompute-each-limit measures it at each).

The planner is warmed up as a server would be: its prefill curve is calibrated when the run
starts (measured afresh unless --calibration-cache names a directory to reuse), and at each
limit a new planner (a server started on that disk) serves the warm-up queries before the
measured ones, learning the disk's bandwidth, the policy's scoring time and its own error.
KL is against recompute (exact KV). GPU and CPU tiers are empty: every load is from disk.

A second table is the cost model alone (no measurement) for OPT-30B on a GPU, from
published figures: recompute of a 5,120-token prefix 0.42 s, 1.38 MB of KV per token, disk
1.25 GB/s, pinned CPU->GPU copies 55 GB/s.

cells.py: the measured cells and their targets; report.py: the tables, the OPT-30B model
and the figure; main.py: the arguments, the calibration and the run.
"""
from __future__ import annotations

from .cells import (BASELINES, BETTER, CLOSE, NO_WORSE, PLANNERS, ROWS, STORES, _cell, _run,
                    _targets, measure, set_read_limit, summary)
from .main import DEFAULT_LIMITS, DEFAULT_PREFIXES, QUICK_LIMITS, main, merge, parse_args
from .report import GpuFigures, opt30b_table, plot, print_measured, print_opt30b
