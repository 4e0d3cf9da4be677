"""Choosing the next token from a step's logits: greedy, or seeded temperature / nucleus
sampling, per request.

    sampler = Sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=1))
    token = sampler.pick(logits)          # logits: (vocab,) float32

`Sampler(None)` and temperature 0 are greedy (argmax), exactly what the engine did before
sampling existed. A seed makes a request's draws reproducible; without one each request
draws from fresh entropy.
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """One request's token choices; its generator advances with every draw."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params
        self.stop_token_ids = frozenset(params.stop_token_ids) if params else frozenset()
        self._gen = None
        if params is not None and not params.greedy:
            seed = secrets.randbits(63) if params.seed is None else params.seed
            # torch seeds are unsigned 64-bit: fold any Python int into that range.
            self._gen = torch.Generator(device="cpu").manual_seed(seed % (1 << 64))

    def pick(self, logits: torch.Tensor) -> int:
        if self._gen is None:
            return int(logits.argmax())
        p = self.params
        scaled = logits.double().cpu() / p.temperature
        if not bool(torch.isfinite(scaled).all()):
            return int(logits.argmax())   # a temperature so small it is greedy
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            # Keep the smallest head whose mass reaches top_p (the most likely token always).
            keep = (sorted_p.cumsum(0) - sorted_p) < p.top_p
            sorted_p = sorted_p * keep
            choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=self._gen)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self._gen))
