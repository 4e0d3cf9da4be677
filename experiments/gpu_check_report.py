"""gpu_check.md: the GPU check's JSON as the tables docs/reproduction.md takes (as far as the
run got: a step stopped midway shows its finished rows)."""
from __future__ import annotations

GiB = 2**30
POLICIES = ("recomp", "as_like", "as_h2o_lfu", "impress")
PLANNER_ROWS = ("recompute", "load full", "load impress", "planner full", "planner impress")


def _f(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.1f} GiB"


def _bytes(n) -> str:
    """GiB from one GiB up, MiB below (a dry run's pools are a few hundred KiB)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


def header(doc: dict) -> list[str]:
    check, m = doc["check"], doc.get("machine") or {}
    device = m.get("device", "?")
    date = (check.get("started") or "")[:10]
    lines = [f"### GPU check: {device}, {date}", ""]
    if check.get("dry"):
        lines += ["**Dry run** on a CPU with tiny models (opt-tiny, llama-tiny, opt-mini stand "
                  "in for OPT-6.7B, 13B, 30B): it shows that everything starts from the image "
                  "and the kit; its times are not the GPU's.", ""]
    kit = check.get("kit") or {}
    lines += [f"`{check.get('command')}`: {_f(check.get('elapsed_s'), '.0f')} s in all; kit "
              f"{kit.get('bytes', 0) / 2**20:.1f} MiB ({', '.join(kit.get('wheels', [])) or 'no wheels'}"
              "; SmolLM2's tokenizer; the selection trace).", ""]
    if m.get("error"):
        lines += [f"Machine: {m['error']}", ""]
    else:
        gpu = m.get("nvidia_smi") or (f"{device}, {_gib(m.get('gpu_memory_bytes'))}"
                                      if m.get("cuda_available") else "none")
        lines += ["| machine | |", "|---|---|", f"| GPU | {gpu} |",
                  f"| software | torch {m.get('torch')}, CUDA {m.get('cuda')}, Python "
                  f"{m.get('python')} |",
                  f"| CPU, memory | {m.get('cpu')} ({m.get('cpu_count')} CPUs), "
                  f"{_gib(m.get('ram_bytes'))} |",
                  f"| store disk | {_gib(m.get('disk_free_bytes'))} free, O_DIRECT "
                  f"{'yes' if m.get('o_direct') else 'no (reads go through the page cache)'} |",
                  ""]
    lines += ["| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {_f(s.get('seconds'), '.0f')} |"
              for s in doc.get("steps", [])]
    return lines + [""]


def tests(doc: dict) -> list[str]:
    t = doc.get("tests")
    step = next((s for s in doc.get("steps", []) if s["name"] == "tests"), None)
    if t is None:
        return [f"CUDA tests: no result ({step['status'] if step else 'not run'}).", ""]
    files = [tok for tok in step["command"].split() if tok.endswith(".py")] if step else []
    line = (f"CUDA tests: {t['passed']} passed, {t['skipped']} skipped, "
            f"{t['failures'] + t['errors']} failed in {t['seconds']:.1f} s "
            f"({', '.join(files)}; slow tests left out, except the device selection's).")
    return [line] + [f"- failed: `{name}`" for name in t.get("failed", [])] + [""]


def repro(doc: dict) -> list[str]:
    res = doc.get("gpu_repro")
    if not res:
        return ["TTFT rows: none yet.", ""]
    w = res.get("workload", {})
    args = res.get("args", {})
    lines = ["#### TTFT by policy (experiments.gpu_repro)", "",
             f"Random-weight OPT, {w.get('prefix_tokens')}-token prefixes, "
             f"{w.get('queries_per_prefix')} measured queries of {w.get('query_tokens')} tokens "
             f"per prefix after {w.get('warmup_queries')} warm-up, retention "
             f"{args.get('retention')}, chunks of {args.get('chunk_size')}; GPU and CPU tiers "
             f"{args.get('gpu_cache_fraction')} and {args.get('cpu_cache_fraction')} of the "
             "pool's KV; disk reads cold. Read: KV bytes loaded (and probe copies) per query.",
             "",
             "| model | prefixes | policy | selection | TTFT mean (s) | TTFT P99 (s) | I/O (s) "
             "| loaded | read | GPU hit | fallback | row (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for model, entry in res.get("models", {}).items():
        mw = entry.get("workload", w)
        shape = f"{mw.get('n_prefixes')} x {mw.get('prefix_tokens')}"
        if entry.get("placement"):
            notes.append(f"- {model}: {entry['placement']}; built in "
                         f"{_f(entry.get('build_s'), '.1f')} s; pool "
                         f"{_bytes(entry.get('pool_kv_bytes') or 0)} of KV ({shape} tokens)")
        for column in POLICIES:
            for mode, rows in entry.get("modes", {}).items():
                r = rows.get(column)
                if r is None or r.get("shared_from"):
                    continue
                selection = mode.replace(" selection", "") if column == "impress" else "-"
                read = (sum((r.get("bytes_read") or {}).values()) + (r.get("probe_bytes") or 0)) \
                    / max(1, r.get("queries") or 1)
                lines.append(
                    f"| {model} | {shape} | {column} | {selection} | {_f(r['ttft_mean_s'])} "
                    f"| {_f(r['ttft_p99_s'])} | {_f(r.get('io_time_s'))} | "
                    f"{100 * (r.get('bytes_loaded_fraction') or 0):.0f}% | {_bytes(read)} | "
                    f"{_f(r.get('gpu_hit_ratio'), '.2f')} | {_f(r.get('fallback_rate'), '.2f')} "
                    f"| {_f(r.get('wall_s'), '.1f')} |")
    lines.append("")
    lines += notes
    for s in res.get("skipped", []):
        lines.append(f"- skipped: {s['model']} {s['policy']} ({s['mode']}): {s['reason']}")
    return lines + [""]


def planner(doc: dict) -> list[str]:
    res = doc.get("planner")
    if not res or not res.get("measured"):
        return ["Planner cells: none yet.", ""]
    w = res.get("workload", {})
    cal = res.get("calibration") or {}
    lines = ["#### Load, recompute or both (experiments.planner)", "",
             f"{res.get('model')}, {w.get('prefixes')} prefix x {w.get('queries_per_prefix')} "
             f"queries per length, disk reads limited to the MB/s shown; TTFT mean (s); plans: "
             f"l(oad), r(ecompute), b(oth). Prefill curve t(n, ctx) = {_f(cal.get('a'), '.3g')} + "
             f"{_f(cal.get('b'), '.3g')} n + {_f(cal.get('c'), '.3g')} n (ctx + n) s."
             f"{'' if res.get('complete') else ' Stopped before the last cell.'}", "",
             "| prefix | MB/s | recompute | load full | load impress | planner full | plans "
             "| planner impress | plans |", "|---|---|---|---|---|---|---|---|---|"]
    for c in res["measured"]:
        t = c["ttft_mean_s"]
        limit = "none" if c["read_limit_mb_s"] is None else f"{c['read_limit_mb_s']:g}"
        plans = {label: ",".join(f"{k[0]}{v}" for k, v in
                                 sorted((c["rows"][label].get("plans") or {}).items()))
                 for label in ("planner full", "planner impress")}
        lines.append(f"| {c['prefix_tokens']} | {limit} | {_f(t['recompute'])} | "
                     f"{_f(t['load full'])} | {_f(t['load impress'])} | "
                     f"{_f(t['planner full'])} | {plans['planner full']} | "
                     f"{_f(t['planner impress'])} | {plans['planner impress']} |")
    return lines + [""]


def markdown(doc: dict) -> str:
    return "\n".join(header(doc) + tests(doc) + repro(doc) + planner(doc))
