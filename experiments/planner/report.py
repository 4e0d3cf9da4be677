"""What experiments.planner prints and draws: the measured table, the cost model alone for
OPT-30B on a GPU, and the figure."""
from __future__ import annotations

import dataclasses

from experiments import reproduce_figures as figures
from impress_flexgen.planner import choose
from impress_flexgen.planner.costs import Bandwidth, CostModel, PrefillCurve

from .cells import BETTER, CLOSE, NO_WORSE, PLANNERS, ROWS


def print_measured(cells, summ) -> None:
    print("Measured TTFT (s, mean over queries), disk reads limited; planner = plan auto")
    print(f"{'prefix':>7}{'MB/s':>6}{'recomp':>8}{'full':>8}{'impress':>8}"
          f"{'pl full':>8}{'/best':>6}{'plans':>14}{'err':>5}"
          f"{'pl imp':>8}{'/best':>6}{'plans':>14}{'err':>5}{'KL imp':>8}")
    for c in cells:
        t = c["ttft_mean_s"]
        limit = "none" if c["read_limit_mb_s"] is None else f"{c['read_limit_mb_s']:g}"
        line = (f"{c['prefix_tokens']:>7}{limit:>6}{t['recompute']:>8.3f}{t['load full']:>8.3f}"
                f"{t['load impress']:>8.3f}")
        for label in PLANNERS:
            row, tg = c["rows"][label], c["targets"][label]
            mark = "=" if tg.get("same_plan") and tg["over_best"] > tg["target"] else \
                "" if tg["met"] else "!"
            plans = ",".join(f"{k[0]}{v}" for k, v in sorted(row["plans"].items()))
            if "both" in row["plans"]:
                plans += f" m~{row['split_mean']:.0f}"
            err = row["prediction_abs_error"]
            line += (f"{t[label]:>8.3f}{tg['over_best']:>5.2f}{mark:1}{plans:>14}"
                     f"{_fmt(None if err is None else 100 * err, '.0f'):>5}")
        print(line + f"{c['rows']['planner impress']['kl']:>8.4f}")
    print(f"/best: planner over the best of its baselines (full: recompute, load full; "
          f"impress: load impress); target {NO_WORSE}x, {BETTER}x where recompute and "
          f"the best load are within {CLOSE:g}x ('!': missed; '=': over it with the best "
          f"baseline's own plan every time, the same code: run noise). plans: l(oad), "
          f"r(ecompute), "
          f"b(oth), m: mean chunks recomputed. err: mean |predicted - measured| / measured "
          f"TTFT (%)")
    for label, s in summ.items():
        err = s["mean_abs_prediction_error"]
        print(f"{label}: targets met in {s['targets_met']}/{s['cells']} cells, mean prediction "
              f"error {_fmt(None if err is None else 100 * err, '.1f')}%, "
              f"max KL {s['max_kl']:.2e}, its own time {s['plan_ms_mean']:.1f} ms a request")


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


# -- the cost model alone: OPT-30B on a GPU ----------------------------------------------

@dataclasses.dataclass(frozen=True)
class GpuFigures:
    """Published figures the OPT-30B table is computed from (a model, not a measurement)."""

    n_layers: int = 48
    hidden: int = 7168
    params: float = 30e9
    prefix_tokens: int = 5120
    recompute_s: float = 0.42        # prefill of the 5,120-token prefix
    kv_bytes_per_token: float = 1.38e6
    disk_bytes_s: float = 1.25e9
    cpu_bytes_s: float = 55e9        # pinned CPU->GPU copies
    chunk_tokens: int = 64
    query_tokens: int = 64
    # impress: retention of the chunks, and its int4 probe copy of every head's keys
    # (half of the KV at a quarter of fp16's bits: 1/8 of the KV bytes).
    retention: float = 0.25
    probe_fraction: float = 0.125

    def curve(self) -> PrefillCurve:
        """t(n, ctx) through recompute_s, split between linear work and attention by their
        FLOPs: 2 * params per token, 4 * hidden * layers per (query, key) pair."""
        ratio = 4 * self.hidden * self.n_layers / (2 * self.params)   # c / b
        n = self.prefix_tokens
        b = self.recompute_s / (n + ratio * n * n)
        return PrefillCurve(0.0, b, ratio * b)


def opt30b_table(fig: GpuFigures = GpuFigures()) -> list[dict]:
    cost = CostModel(fig.curve(), Bandwidth({"disk": fig.disk_bytes_s, "cpu": fig.cpu_bytes_s}),
                     fig.n_layers)
    n = fig.prefix_tokens // fig.chunk_tokens
    chunk_bytes = fig.chunk_tokens * fig.kv_bytes_per_token
    rows = []
    for tier in ("disk", "cpu"):
        bw = cost.bandwidth.get(tier)
        for selection, fraction, probe in (("full", 1.0, 0.0),
                                           ("impress", fig.retention, fig.probe_fraction)):
            io = [chunk_bytes * fraction / bw] * n
            probe_s = fig.prefix_tokens * fig.kv_bytes_per_token * probe / bw
            args = (cost, n, fig.chunk_tokens, fig.query_tokens, io, probe_s)
            plan = choose("auto", *args, kept_fraction=fraction)
            pred = plan.predicted
            rows.append({"tier": tier, "selection": selection,
                         "recompute_s": pred["recompute"], "load_s": pred["load"],
                         "both_s": pred["both"],
                         "both_split_chunks": choose("both", *args,
                                                     kept_fraction=fraction).split_chunks,
                         "plan": plan.mode, "plan_s": plan.predicted_s,
                         "split_chunks": plan.split_chunks, "chunks": n,
                         "plan_over_best_end": plan.predicted_s / min(pred["recompute"],
                                                                      pred["load"])})
    return rows


def print_opt30b(rows, fig: GpuFigures = GpuFigures()) -> None:
    print(f"\nOPT-30B on a GPU, from the cost model alone (a model, not a measurement): "
          f"{fig.prefix_tokens:,}-token prefix, recompute {fig.recompute_s} s, "
          f"{fig.kv_bytes_per_token / 1e6:.2f} MB KV/token, disk "
          f"{fig.disk_bytes_s / 1e9:g} GB/s, CPU->GPU {fig.cpu_bytes_s / 1e9:g} GB/s")
    print(f"{'KV from':<8}{'selection':<10}{'recomp':>8}{'load':>8}{'both':>8}{'m/n':>9}"
          f"{'plan':>11}{'/best end':>10}")
    for r in rows:
        print(f"{r['tier']:<8}{r['selection']:<10}{r['recompute_s']:>8.3f}{r['load_s']:>8.3f}"
              f"{r['both_s']:>8.3f}{r['both_split_chunks']:>5}/{r['chunks']:<3}"
              f"{r['plan']:>11}{r['plan_over_best_end']:>10.2f}")
    print(f"impress: {fig.retention:g} of the chunks read (spread evenly), plus an int4 probe "
          f"copy of {fig.probe_fraction:g} of the KV bytes; m: chunks recomputed by 'both'")


# -- figure ------------------------------------------------------------------------------

def plot(cells, path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({c["prefix_tokens"] for c in cells})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.6), squeeze=False)
    limited = [c["read_limit_mb_s"] for c in cells if c["read_limit_mb_s"] is not None]
    unlimited_x = 4 * max(limited) if limited else 1.0   # "none" drawn right of the others
    styles = {"recompute": ("k", "--"), "load full": ("C0", "o-"), "load impress": ("C1", "o-"),
              "planner full": ("C0", "s:"), "planner impress": ("C1", "s:")}
    for ax, length in zip(axes[0], lengths):
        these = sorted((c for c in cells if c["prefix_tokens"] == length),
                       key=lambda c: c["read_limit_mb_s"] or unlimited_x)
        xs = [c["read_limit_mb_s"] or unlimited_x for c in these]
        for label in ROWS:
            color, style = styles[label]
            ax.plot(xs, [c["ttft_mean_s"][label] for c in these], style, color=color,
                    label=label, lw=2 if label in PLANNERS else 1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{c['read_limit_mb_s']:g}" if c["read_limit_mb_s"] else "none"
                            for c in these])
        ax.minorticks_off()
        ax.set_xlabel("disk read limit (MB/s)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{length:,}-token prefix", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"TTFT against disk read limit, {model}", fontsize=11)
    figures.save(fig, path, dpi=120)

