"""What a placement plan says: its lines, why auto chose a format, and a refusal that names
every option that would fit. Text only: the numbers come from placement.make_plan.
"""
from __future__ import annotations

import math

GiB = 1 << 30


def size_text(n: int) -> str:
    if n < GiB:
        return f"{n / 2**20:.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.1f} MiB"
    return f"{n / GiB:.2f} GiB" if n < 10 * GiB else f"{n / GiB:.1f} GiB"


def _names(cuda: bool) -> dict:
    return {"gpu": "GPU", "cpu": "CPU RAM", "disk": "disk"} if cuda else \
        {"gpu": "RAM", "cpu": "RAM", "disk": "disk"}


def where(by_dev: dict, cuda: bool) -> str:
    names = _names(cuda)
    merged: dict[str, int] = {}
    for dev, n in by_dev.items():
        if n:
            merged[names[dev]] = merged.get(names[dev], 0) + n
    return " + ".join(f"{size_text(n)} {name}" for name, n in merged.items()) or "nothing"


def describe(plan) -> str:
    """Three lines: the percentages and the format; bytes per device against what is
    usable; where the weights come from (and why this format, when auto chose it)."""
    res = plan.resources
    names = _names(res.cuda)
    devices = ("gpu", "cpu", "disk") if res.cuda else ("cpu", "disk")
    usage = ", ".join(f"{names[d]} {size_text(plan.needs[d])} of {size_text(plan.available[d])}"
                      for d in devices)
    auto = " auto:" if plan.auto else " auto (policy search):" if plan.searched else ""
    head = (f"placement{auto} {plan.placement.describe()}; "
            f"{plan.model} in {plan.format.describe()}")
    if not res.cuda:
        head += " (no CUDA: FlexGen's GPU is this CPU's memory)"
    total = sum(plan.weights.values())
    if plan.weights_source == "cache":
        source = (f"made once into the weights cache: {size_text(plan.weights_write)} written "
                  f"at this start, read back by later ones" if plan.weights_write else
                  "read from the weights cache, made by an earlier start") + \
            f" ({plan.weights_path})"
    elif plan.weights_source == "files":
        source = "read from the model's own files"
    else:
        source = "drawn from the seed at every start" + \
            (" (the weights cache has no room for them)" if not res.cuda else "")
    third = f"weights: {size_text(total)} in {plan.format.name}, {source}"
    if plan.why:
        third += f"; {plan.why}"
    searched = f"\n{plan.searched}" if plan.searched else ""
    return (f"{head}\nmemory plan: weights {where(plan.weights, res.cuda)}, KV cache up to "
            f"{where(plan.cache, res.cuda)}; needed of usable: {usage} "
            f"(offload dir {res.offload_root})\n{third}{searched}")


def why(chosen, options) -> str:
    """Why auto kept `chosen` of the formats that fit (`options`, fastest first)."""
    memory = "GPU and CPU memory" if chosen.resources.cuda else "RAM"
    before = options[:options.index(chosen)]
    passed = [f"{p.format.name} would leave {size_text(p.weights['disk'])} on disk"
              for p in before]
    if not chosen.weights["disk"]:
        reason = f"chose {chosen.format.name}: every weight in {memory}"
    else:
        reason = (f"chose {chosen.format.name}: no format holds every weight in {memory}; "
                  f"it leaves the fewest bytes on disk ({size_text(chosen.weights['disk'])}, "
                  "read at every step)")
    return reason + (f" ({'; '.join(passed)})" if passed else "")


def too_much(spec_name: str, placement, dev: str, need: dict, avail: dict, res) -> str:
    name = {"gpu": "GPU memory", "disk": f"free disk under {res.offload_root}",
            "cpu": "RAM" if res.cuda else "RAM (the compute device without CUDA)"}[dev]
    return (f"placement {placement.describe()} needs {size_text(need[dev])} of {name} for "
            f"{spec_name}, {size_text(avail[dev])} is usable")


def _gib_up(n: int) -> str:
    return f"{math.ceil(n / GiB * 10) / 10:g}"


def option_text(flags: str, plan, note: str = "") -> str:
    """One option that would fit: the flags, the weights' bytes and where they would go."""
    text = (f"{flags} ({size_text(sum(plan.weights.values()))} of weights: "
            f"{where(plan.weights, plan.resources.cuda)}")
    return text + (f"; {note})" if note else ")")


def refusal(spec, res, tried: list, fits: list[str], short: str | None) -> str:
    """The one line that refuses: what the formats tried need against what is usable,
    then every option that would fit (`fits`), else what might. `tried`: (format, its
    footprint); `short`: an explicit placement's shortfall (too_much), if that is it."""
    if short is not None:
        msg = short
    else:
        sizes = ", ".join(f"{size_text(fp.weight_bytes)} in {fmt.name}" for fmt, fp in tried)
        fp = tried[0][1]
        msg = (f"{spec.name} does not fit this machine: its weights are {sizes} and its KV "
               f"cache up to {size_text(fp.cache_bytes)}, against {size_text(res.ram)} of "
               f"usable RAM" + (f", {size_text(res.gpu)} of GPU memory" if res.cuda else "")
               + f" and {size_text(res.disk)} of free disk under {res.offload_root}")
    if fits:
        return f"{msg}; options that would fit: {', '.join(fits)}"
    hints = ["an --offload-dir on a disk with more free space"]
    if not res.cuda:
        hints.append("a GPU")
    hints.append("a smaller model")
    return f"{msg}; no option would fit here: try {', '.join(hints)}"


def cap_flag(name: str, need: int) -> str:
    """--max-ram-gb / --max-disk-gb raised to what a plan needs."""
    return f"--{name} {_gib_up(need)}"
