"""Choosing the next token from a step's logits: greedy, or seeded temperature / nucleus
sampling, per request.

    sampler = Sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=1))
    token = sampler.pick(logits)          # logits: (vocab,) float32

`Sampler(None)` and temperature 0 are greedy (argmax), exactly what the engine did before
sampling existed. A seed makes a request's draws reproducible; without one each request
draws from fresh entropy. top_k and min_p narrow the candidates before the nucleus cut (as
vLLM does); min_tokens holds back the stop tokens until that many tokens were chosen.
"""
from __future__ import annotations

import dataclasses
import math
import secrets

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0                # nucleus mass kept, in (0, 1]
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()   # a generated stop token ends generation
    top_k: int = 0                    # keep the k most likely tokens; 0: all
    min_p: float = 0.0                # drop tokens below min_p x the most likely one's p
    min_tokens: int = 0               # no stop token before this many tokens

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if not (isinstance(self.top_p, (int, float)) and math.isfinite(self.top_p)
                and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer (got {self.seed!r})")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (got {self.top_k!r})")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (got {self.min_p!r})")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0 (got {self.min_tokens!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """One request's token choices; its generator advances with every draw."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params
        self.stop_token_ids = frozenset(params.stop_token_ids) if params else frozenset()
        self._gen = None
        self.picked = 0
        if params is not None and not params.greedy:
            seed = secrets.randbits(63) if params.seed is None else params.seed
            # torch seeds are unsigned 64-bit: fold any Python int into that range.
            self._gen = torch.Generator(device="cpu").manual_seed(seed % (1 << 64))

    def pick(self, logits: torch.Tensor) -> int:
        self.picked += 1
        p = self.params
        if p is not None and self.picked <= p.min_tokens and self.stop_token_ids:
            logits = logits.clone()
            logits[list(self.stop_token_ids)] = float("-inf")
        if self._gen is None:
            return int(logits.argmax())
        scaled = logits.double().cpu() / p.temperature
        if not bool(torch.isfinite(scaled.max())):
            return int(logits.argmax())   # a temperature so small it is greedy
        if p.top_k and p.top_k < scaled.numel():
            kth = scaled.topk(p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        if p.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            # Keep the smallest head whose mass reaches top_p (the most likely token always).
            keep = (sorted_p.cumsum(0) - sorted_p) < p.top_p
            sorted_p = sorted_p * keep
            choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=self._gen)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self._gen))
