"""A request to the engine, its statistics and its response: what a caller hands in and
gets back, apart from the engine that serves it (its sequence carries them from step to
step)."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np
import torch

from .sampling import SamplingParams
from .tiers import TierConfig


@dataclasses.dataclass
class Request:
    prefix: list[int]
    query: list[int]
    max_new_tokens: int = 1
    # Teacher forcing: decode step i feeds forced[i] instead of the previous argmax, so
    # step_logits[i] is the distribution of forced[i] under every policy alike (KL and
    # perplexity over long generations). `tokens` stay the model's argmax predictions.
    forced: list[int] | None = None
    # Leading pad tokens of the prefix (the paper-faithful padded workload): they take
    # positions and are stored like any token, but no token attends to them.
    n_pad: int = 0
    # How tokens are chosen (None: greedy argmax) and which tokens end generation.
    sampling: SamplingParams | None = None
    # Called with each new token as it is produced (the first included, a stop token not);
    # returning False ends generation there (stop strings, a client gone, a deadline).
    on_token: Callable[[int], bool] | None = None
    # Whose cache this request reads and fills: requests of different namespaces never
    # share stored prefix KV (the server derives it from the API key and cache_salt; ""
    # is the default, shared namespace).
    namespace: str = ""
    # What the response keeps of each step's logits, nothing unless asked: `logprobs` k,
    # the picked token's log-probability and the k likeliest (a few numbers a step);
    # `keep_logits`, a copy of every step's whole (vocab,) row (checks and experiments).
    logprobs: int | None = None
    keep_logits: bool = False
    # Score the query (the whole prompt, no prefix): each of its tokens after the first
    # under the row before it, with the k likeliest. Prefilled in pieces, whose logits
    # are the only ones held at a time (engine.runner.score_piece).
    prompt_logprobs: int | None = None


@dataclasses.dataclass
class RequestStats:
    ttft_s: float = 0.0
    match_s: float = 0.0
    weights_s: float = 0.0       # bringing weights before the first token (prefill)
    # Layer weights brought to the compute device for this request, prefill and decode
    # (a pass or a step shared by several requests counts in each), and the time its
    # layers waited for them (all of a read without overlap, what compute did not hide with).
    weight_bytes: int = 0
    weight_wait_s: float = 0.0
    probe_s: float = 0.0
    select_s: float = 0.0
    load_s: float = 0.0
    compute_s: float = 0.0
    store_s: float = 0.0
    decode_s_per_token: float = 0.0
    prefix_tokens: int = 0
    matched_tokens: int = 0
    computed_tokens: int = 0
    bytes_read: dict = dataclasses.field(   # per tier name, fastest first
        default_factory=lambda: dict.fromkeys(TierConfig().names(remote=False), 0))
    probe_bytes: int = 0
    chunks_read: int = 0         # from disk
    chunks_loaded: int = 0       # from any tier (K and V counted separately)
    # Chunks (and their stored bytes) handed over from a read another request of the same
    # prefill pass made: read once for the pass, counted as read by that request only.
    chunks_from_pass: int = 0
    bytes_from_pass: int = 0
    bytes_needed: int = 0        # KV bytes of the prefix tokens actually attended
    prefix_bytes: int = 0        # KV bytes of the whole matched prefix
    layers: int = 0
    layers_fallback: int = 0
    jaccard: list = dataclasses.field(default_factory=list)
    recovered_from_corruption: int = 0
    # The plan (load, recompute or both), the chunks it recomputed from the front, and the
    # time to first token the cost model predicted for it (0: no prediction made).
    plan: str = "load"
    plan_split: int = 0
    predicted_ttft_s: float = 0.0
    plan_s: float = 0.0              # the planner's own time choosing the plan
    # Why: "predicted", "explore" (tried again to measure it), "forced" (configured) or
    # "no-match" (nothing stored to plan over).
    plan_reason: str = "no-match"
    shared_tokens: int = 0       # prefix tokens whose KV came from the shared pool
    # The new KV is what full attention over the whole prefix gives: False when a layer
    # attended to a selection of the stored prefix, or loaded KV that was itself such.
    # Inexact KV is stored flagged (exact readers never match it), never shared.
    exact: bool = True
    # Decode. Bytes per step: K + V of the pages a decode-phase policy copied to the compute
    # device; for the other policies, the whole attended context (what a cache kept off the
    # device would have to move each step).
    decode_bytes_per_step: float = 0.0
    decode_select_s: float = 0.0     # decode-phase page selection, all steps
    index_build_s: float = 0.0       # building the decode-phase pages and index after prefill
    index_recall: float | None = None  # when measured (DecodeConfig.recall_k)

    @property
    def io_s(self) -> float:
        return self.probe_s + self.load_s

    @property
    def kv_bytes_loaded(self) -> int:
        return sum(self.bytes_read.values())

    def timer(self, name: str, exclude: tuple[str, ...] = (), sync=None) -> "_Timer":
        """`with stats.timer("load_s"):` adds the block's seconds to the stat `name` (also
        when it raises), less what the block added meanwhile to the stats in `exclude`
        (time already counted there). `sync`: the device the block queues work on; a CUDA
        device is waited for when the clock starts and before it stops (kernels run
        asynchronously: work queued before the block is not its own, its own is done only
        then)."""
        return _Timer(self, name, exclude,
                      sync if sync is not None and sync.type == "cuda" else None)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["jaccard"] = float(np.mean(self.jaccard)) if self.jaccard else None
        d["io_s"] = self.io_s
        return d


class _Timer:
    __slots__ = ("stats", "name", "exclude", "sync", "t0", "before")

    def __init__(self, stats: RequestStats, name: str, exclude: tuple[str, ...], sync=None):
        self.stats, self.name, self.exclude, self.sync = stats, name, exclude, sync

    def __enter__(self) -> "_Timer":
        if self.sync is not None:
            torch.cuda.synchronize(self.sync)
        self.before = sum(getattr(self.stats, e) for e in self.exclude)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.sync is not None:
            torch.cuda.synchronize(self.sync)
        elapsed = time.perf_counter() - self.t0
        if self.exclude:
            elapsed -= sum(getattr(self.stats, e) for e in self.exclude) - self.before
        setattr(self.stats, self.name, getattr(self.stats, self.name) + elapsed)


@dataclasses.dataclass
class Response:
    tokens: list[int]
    query_logits: torch.Tensor | None   # (len(query), vocab) float32: teacher-forced query
    step_logits: list[torch.Tensor]     # per generated token, (vocab,): with keep_logits
    stats: RequestStats
    logprobs: list | None = None        # per generated token (token, lp, top k): logprobs
    prompt_scores: object = None        # scores.TokenScores of the query: prompt_logprobs
