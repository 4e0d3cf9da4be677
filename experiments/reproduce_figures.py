"""Figures of experiments.reproduce: one function per part, each writes one PNG."""
from __future__ import annotations

from pathlib import Path

from impress_flexgen.errors import UserError

BREAKDOWN = (("compute_s", "compute"), ("weights_s", "weights"), ("probe_s", "probe read"),
             ("select_s", "select"), ("load_s", "KV load"))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path, dpi: int = 110, tight: bool = True) -> None:
    """Write and close a figure (laid out tightly unless the caller laid it out); a path
    that cannot be written is a UserError naming it."""
    plt = _plt()
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if tight:
            fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)


def serving(res: dict, path: Path) -> None:
    plt = _plt()
    rows = res["results"]
    labels = [r["label"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    bottom = [0.0] * len(rows)
    for key, name in BREAKDOWN:
        vals = [r["ttft_breakdown_s"][key] for r in rows]
        a.bar(labels, vals, bottom=bottom, label=name)
        bottom = [x + y for x, y in zip(bottom, vals)]
    a.scatter(labels, [r["ttft_p99_s"] for r in rows], color="k", marker="_", s=300,
              label="P99", zorder=3)
    a.set_ylabel("TTFT (s), mean by part")
    a.set_title("Time to first token (Fig. 16)")
    a.legend(fontsize=7)
    b.bar(labels, [r["io_time_s"] for r in rows], color="C4")
    b.set_ylabel("probe + KV load time per request (s)")
    b.set_title("I/O time (Fig. 17)")
    c.bar(labels, [100 * r["bytes_loaded_fraction"] for r in rows], color="C2")
    c.set_ylabel("% of prefix KV bytes read (all tiers, probes)")
    c.set_title("Bytes loaded")
    for ax in (a, b, c):
        ax.tick_params(axis="x", rotation=35, labelsize=8)
        for t in ax.get_xticklabels():
            t.set_ha("right")
    save(fig, path)


def ablation(res: dict, path: Path) -> None:
    plt = _plt()
    fig, (a, b, c, d) = plt.subplots(1, 4, figsize=(18, 4))
    rows = res["ablation"]
    names = [r["label"] for r in rows]
    a.bar(names, [r["ttft_mean_s"] for r in rows], label="TTFT")
    a.bar(names, [r["io_time_s"] for r in rows], label="of which I/O", alpha=0.8)
    a.set_ylabel("seconds per request")
    a.set_title("Ablation (Fig. 18)")
    a.legend(fontsize=8)
    ro = res["reorder"]
    modes = ["chunk selection", "token selection (paper)"]
    without = [ro["without"], ro.get("token_without", 0)]
    with_ro = [ro["with"], ro.get("token_with", 0)]
    x = range(len(modes))
    b.bar([i - 0.2 for i in x], without, width=0.4, color="C1", label="without reorder")
    b.bar([i + 0.2 for i in x], with_ro, width=0.4, color="C2", label="with reorder")
    b.set_xticks(list(x), modes)
    b.legend(fontsize=8)
    b.set_ylabel("chunks loaded (K and V, all tiers)")
    b.set_title("Chunks loaded (Fig. 20)")
    hits = res["gpu_hit_ratio"]
    c.bar(list(hits), list(hits.values()), color="C3")
    c.set_ylim(0, 1)
    c.set_ylabel("GPU tier hit ratio")
    c.set_title("Tier policy (Fig. 21)")
    # impress with non-exclusive and exclusive tiers: the share of its chunk bytes each tier
    # served, and its TTFT.
    copies = res.get("tier_copies") or {}
    modes = list(copies)
    x = range(len(modes))
    for k, tier in enumerate(("gpu", "cpu", "disk")):
        shares = [(copies[m]["bytes_read"] or {}).get(tier, 0)
                  / max(1, sum((copies[m]["bytes_read"] or {}).values())) for m in modes]
        d.bar([i + 0.25 * (k - 1) for i in x], shares, width=0.25, color=f"C{k + 4}",
              label=f"from {tier}")
    d.set_xticks(list(x), modes)
    d.set_ylim(0, 1)
    d.set_ylabel("share of chunk bytes read")
    d.set_title("Tier copies (impress)")
    if modes:
        d2 = d.twinx()
        d2.plot(list(x), [copies[m]["ttft_mean_s"] for m in modes], "kD", label="TTFT (s)")
        d2.set_ylabel("TTFT (s)")
        d2.set_ylim(0, 1.2 * max(copies[m]["ttft_mean_s"] for m in modes))
        h1, l1 = d.get_legend_handles_labels()
        h2, l2 = d2.get_legend_handles_labels()
        d.legend(h1 + h2, l1 + l2, fontsize=7)
    for ax in (a, b, c, d):
        ax.tick_params(axis="x", labelsize=8)
    save(fig, path)


def sensitivity(res: dict, path: Path) -> None:
    plt = _plt()
    knobs = list(dict.fromkeys(r["knob"] for r in res["results"])) + ["pool_prefixes"]
    fig, axes = plt.subplots(1, len(knobs), figsize=(4 * len(knobs), 4))
    for ax, knob in zip(axes, knobs):
        rows = res["pool"] if knob == "pool_prefixes" else \
            [r for r in res["results"] if r["knob"] == knob]
        xs = [r["value"] for r in rows]
        if knob == "pool_prefixes":
            ax.plot(xs, [r["gpu_hit_ratio"] for r in rows], "o-", color="C3",
                    label="GPU hit ratio")
            ax.set_ylim(0, 1)
            ax2 = ax.twinx()
            ax2.plot(xs, [r["ttft_mean_s"] for r in rows], "s--", color="C0", label="TTFT (s)")
            ax2.set_ylabel("TTFT (s)")
        else:
            ax.plot(xs, [100 * r["bytes_loaded_fraction"] for r in rows], "o-", color="C2",
                    label="% bytes read")
            ax.set_ylabel("% of prefix KV bytes read")
            ax2 = ax.twinx()
            ax2.plot(xs, [r["kl"] or 0 for r in rows], "s--", color="C1", label="KL vs full")
            ax2.set_ylabel("KL(full || policy)")
        ax.set_title(knob)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7)
    save(fig, path)


def scaling(res: dict, path: Path) -> None:
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    labels = list(dict.fromkeys(r["label"] for r in res["results"]))
    for i, label in enumerate(labels):
        rows = [r for r in res["results"] if r["label"] == label]
        xs = [r["prefix_tokens"] for r in rows]
        a.plot(xs, [r["bytes_read_total"] / 2**20 for r in rows], "o-", color=f"C{i}",
               label=label)
        b.plot(xs, [r["ttft_mean_s"] for r in rows], "o-", color=f"C{i}", label=label)
    a.set_ylabel("MiB read per request (all layers)")
    b.set_ylabel("TTFT (s)")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prefix tokens")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    a.set_title("Bytes read grow with the prefix")
    b.set_title("TTFT against prefix length")
    save(fig, path)


def overheads(res: dict, path: Path) -> None:
    plt = _plt()
    rows = res["results"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["label"] for r in rows]
    a.bar(names, [100 * r["probe_share_of_ttft"] for r in rows], label="probe read")
    a.bar(names, [100 * r["select_share_of_ttft"] for r in rows],
          bottom=[100 * r["probe_share_of_ttft"] for r in rows], label="selection")
    a.set_ylabel("% of TTFT")
    a.set_title("Probe and selection time")
    a.legend(fontsize=8)
    imp = [r for r in rows if r["probe_space_fraction"] is not None]
    b.bar([r["label"] + "\nprobe" for r in imp], [100 * r["probe_space_fraction"] for r in imp],
          color="C2")
    b.bar([r["label"] + "\nmetadata" for r in imp],
          [100 * r["metadata_space_fraction"] for r in imp], color="C5")
    b.set_ylabel("% of stored KV bytes")
    b.set_title("Space overhead")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7)
    save(fig, path)


def peers(res: dict, path: Path) -> None:
    plt = _plt()
    rows = res["results"]
    fig, ax = plt.subplots(figsize=(10, 4))
    names = [r["label"] for r in rows]
    ax.barh(names, [r["ttft_median_s"] for r in rows],
            color=["C2" if n.startswith("ours") else "C7" for n in names])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s), median, log scale")
    ax.set_title(f"Same requests, other ways ({res['prefix_tokens']}-token prefix, "
                 f"{res['query_tokens']}-token query, {res['threads']} threads)")
    ax.tick_params(axis="y", labelsize=8)
    save(fig, path)


def padded(res: dict, path: Path) -> None:
    plt = _plt()
    rows = res["results"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for j, name in enumerate(("natural", "padded")):
        vals = {r["label"]: r for r in rows if r["workload"] == name}
        xs = [i + (j - 0.5) * width for i in range(len(labels))]
        a.bar(xs, [100 * vals[x]["bytes_loaded_fraction"] for x in labels], width, label=name)
        b.bar(xs, [vals[x]["kl"] or 0 for x in labels], width, label=name)
    for ax in (a, b):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    w = res["workload"]
    a.set_ylabel("% of prefix KV bytes read (pads included)")
    a.set_title(f"{w['real_tokens']} real tokens, padded to {w['prefix_tokens']} positions")
    b.set_ylabel("KL(full || policy)")
    b.set_title("Accuracy against full KV")
    save(fig, path)
