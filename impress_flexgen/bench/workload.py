"""Workloads: a pool of long shared prefixes and a stream of queries that reuse them.

Natural-text mode cuts prefixes from public-domain books; each query is a later passage of
the same book, so what a query needs from its prefix is decided by real text. Padded mode
(the paper's setting, as far as its prompt lengths tell) takes a short real prefix
(`real_tokens`) and left-pads it with masked pad tokens to `prefix_tokens` positions: the
pads are stored and counted in the prefix bytes, but nothing attends to them. Reuse follows
a distribution over the pool: `shuffle` (every prefix gets the same number of queries, in
random order), `zipf` (a few prefixes are hot) or `normal` (popularity peaks mid-pool).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    n_prefixes: int = 4
    prefix_tokens: int = 2048
    queries_per_prefix: int = 5        # measured queries (mean per prefix for zipf/normal)
    warmup_queries: int = 1            # per prefix, before measuring (importance, reorder)
    query_tokens: int = 64
    distribution: str = "shuffle"      # shuffle | zipf | normal
    zipf_s: float = 1.1
    seed: int = 0
    mode: str = "natural"              # natural | padded
    real_tokens: int = 512             # padded mode: real text tokens per prefix

    def __post_init__(self):
        if self.distribution not in ("shuffle", "zipf", "normal"):
            raise ValueError("distribution must be shuffle, zipf or normal")
        if self.mode not in ("natural", "padded"):
            raise ValueError("workload mode must be natural or padded")
        if self.mode == "padded" and not 0 < self.real_tokens < self.prefix_tokens:
            raise ValueError("padded mode needs 0 < real tokens < prefix tokens")
        if min(self.n_prefixes, self.prefix_tokens, self.query_tokens) < 1:
            raise ValueError("workload sizes must be positive")


@dataclasses.dataclass
class Workload:
    config: WorkloadConfig
    prefixes: list[list[int]]
    warmup: list[tuple[int, list[int]]]     # (prefix index, query ids)
    queries: list[tuple[int, list[int]]]
    sources: list[str]
    n_pad: list[int] = dataclasses.field(default_factory=list)   # per prefix (padded mode)

    def pad_of(self, p: int) -> int:
        return self.n_pad[p] if self.n_pad else 0


def _token_stream(tokenizer, name: str, text: str) -> list[int]:
    return tokenizer.encode(text)


def build_workload(tokenizer, config: WorkloadConfig, texts: dict[str, str] | None = None,
                   pad_id: int = 0) -> Workload:
    """Cut prefixes and queries from `texts` (default: the offline corpus)."""
    if config.mode == "padded":
        real = build_workload(tokenizer, dataclasses.replace(
            config, mode="natural", prefix_tokens=config.real_tokens), texts)
        n_pad = config.prefix_tokens - config.real_tokens
        real.config = config
        real.prefixes = [[pad_id] * n_pad + p for p in real.prefixes]
        real.n_pad = [n_pad] * len(real.prefixes)
        return real
    if texts is None:
        texts = default_texts()
    rng = np.random.default_rng(config.seed)
    names = sorted(texts)
    need = config.prefix_tokens + (config.queries_per_prefix * 3 + config.warmup_queries + 2) \
        * config.query_tokens
    prefixes, pools, sources = [], [], []
    for i in range(config.n_prefixes):
        name = names[i % len(names)]
        ids = _token_stream(tokenizer, name, texts[name])
        # Different prefixes from the same book start at different places.
        room = max(0, len(ids) - need)
        start = int(rng.integers(0, room + 1)) if i >= len(names) else 0
        chunk = ids[start:start + need]
        if len(chunk) < config.prefix_tokens + 2 * config.query_tokens:
            chunk = (chunk * (need // max(1, len(chunk)) + 1))[:need]
        prefixes.append(chunk[:config.prefix_tokens])
        rest = chunk[config.prefix_tokens:]
        pools.append([rest[j:j + config.query_tokens]
                      for j in range(0, len(rest) - config.query_tokens + 1, config.query_tokens)])
        sources.append(name)
    warmup = [(p, pools[p][w % len(pools[p])]) for p in range(config.n_prefixes)
              for w in range(config.warmup_queries)]
    order = _reuse_order(config, rng)
    used = {p: config.warmup_queries for p in range(config.n_prefixes)}
    queries = []
    for p in order:
        queries.append((p, pools[p][used[p] % len(pools[p])]))
        used[p] += 1
    return Workload(config, prefixes, warmup, queries, sources)


def _reuse_order(config: WorkloadConfig, rng: np.random.Generator) -> list[int]:
    n, total = config.n_prefixes, config.n_prefixes * config.queries_per_prefix
    if config.distribution == "shuffle":
        order = np.repeat(np.arange(n), config.queries_per_prefix)
        rng.shuffle(order)
        return order.tolist()
    if config.distribution == "zipf":
        weights = 1.0 / np.arange(1, n + 1) ** config.zipf_s
    else:
        x = np.arange(n)
        weights = np.exp(-0.5 * ((x - (n - 1) / 2) / max(1.0, n / 4)) ** 2)
    return rng.choice(n, size=total, p=weights / weights.sum()).tolist()


def default_texts() -> dict[str, str]:
    """The offline corpus when present, else the built-in passages."""
    try:
        from .corpus import list_texts, load_text

        names = list_texts()
        if names:
            return {n: load_text(n) for n in names}
    except ImportError:
        pass
    from .texts import PROMPTS

    return {f"builtin{i}": p * 40 for i, p in enumerate(PROMPTS)}
