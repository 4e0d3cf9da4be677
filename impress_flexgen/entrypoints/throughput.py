"""--throughput with --placement auto: the policy search chooses the placement, the batch
sizes and the compression (planner/policy_search.py); after the run, how far the measured
throughput fell from its prediction.

    cfg, found = searched_config(cfg, prompt_len, gen_len, max_block)
    ... generate ...
    report = prediction_error(found, block, decode_s_per_token)
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import UserError


def searched_config(cfg, prompt_len: int, gen_len: int, max_block: int | None = None):
    """(cfg with the searched policy, the SearchResult); (cfg, None) where the search does
    not apply (an explicit placement: latency work keeps the choice asked for)."""
    from ..models.placement import AutoPlacement, machine_resources
    from ..models.runtime import resolve_spec
    from ..paths import offload_dir
    from ..planner.policy_search import Workload, measure_machine, model_shape, search

    if not isinstance(cfg.placement, AutoPlacement):
        return cfg, None
    cfg = dataclasses.replace(cfg, work_tokens=prompt_len + gen_len)
    spec = resolve_spec(cfg, check_placement=False)
    root = Path(cfg.offload_dir).expanduser() if cfg.offload_dir else offload_dir()
    limits = machine_resources(root, cfg.max_ram_bytes, cfg.max_disk_bytes)
    formats = _formats(cfg, spec, limits.cuda)
    # Each format's policies predicted on rates measured in its compute dtype (cached).
    found = search(model_shape(spec), lambda dtype: measure_machine(limits.cuda, dtype), limits,
                   Workload(prompt_len, gen_len), formats=formats,
                   reserve=(cfg.gpu_reserve_bytes, cfg.cpu_reserve_bytes),
                   compress_cache=True if cfg.compress_cache else None, max_block=max_block)
    if found is None:
        return cfg, None     # nothing fits: auto's own plan refuses, naming what would
    p, fmt = found.policy, found.format
    return dataclasses.replace(
        cfg, placement=p.placement, gpu_batch_size=p.gpu_batch_size,
        num_gpu_batches=p.num_gpu_batches, compress_weight=fmt.compress, dtype=fmt.dtype,
        weight_groups=fmt.groups or cfg.weight_groups, compress_cache=p.compress_cache,
        work_tokens=prompt_len + gen_len, searched=found.describe()), found


def _formats(cfg, spec, cuda: bool):
    from ..models.placement import formats_for

    formats = formats_for(spec, cfg, cuda, True)
    if not formats:
        raise UserError("no weight format to search over for this model and device")
    return formats


def prediction_error(found, block: int, decode_s_per_token: float) -> dict | None:
    """The search's prediction against the run: decode tokens/s of a block, measured and
    predicted, and the error (measured / predicted - 1)."""
    from ..planner.policy_search import error

    if found is None or decode_s_per_token <= 0:
        return None
    measured = block / decode_s_per_token
    predicted = found.prediction.decode_tokens_per_s
    return {"policy": found.policy.describe(), "format": found.format.name,
            "predicted_decode_tokens_per_s": predicted,
            "measured_decode_tokens_per_s": measured,
            "error": error(predicted, measured)}
