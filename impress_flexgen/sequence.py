"""A request between its prefill and its last token: what decode steps need of it.

The engine's prefill returns a `Sequence`; each decode step (alone or in a batch, see
batch_runner) appends one token to every running sequence, until it is done. Its per-layer
context lives in `LayerKV` buffers sized for the whole generation, so a step writes the new
token's K and V in place instead of concatenating the context again.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from .sampling import Sampler


class LayerKV:
    """One layer's decode context of one request: K and V (KV, capacity, d), the mask
    (KV, capacity) of keys each KV head attends; the first `n` positions are filled."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 extra: int, group: int):
        kv, m, d = keys.shape
        cap = m + extra
        self.k = keys.new_empty(kv, cap, d)
        self.v = values.new_empty(kv, cap, d)
        self.k[:, :m] = keys
        self.v[:, :m] = values
        self.n = m
        mask = mask.to(keys.device)
        # Generated tokens are attended by every head; the prefix mask is fixed after
        # prefill, so which attention mask a step needs is decided once here.
        if bool(mask.all()):
            self.mask = None                     # every key: no mask at all
        else:
            rows = mask[:1] if bool((mask == mask[:1]).all()) else \
                mask.repeat_interleave(group, dim=0)
            self.mask = torch.ones(rows.shape[0], cap, dtype=torch.bool, device=keys.device)
            self.mask[:, :m] = rows
        self.bound = False   # lives in a batch's side-by-side buffers (batch_runner)

    def bind(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
        """Move the context into a batch's buffers: k, v (KV, cap', d) and mask (H, cap')
        with cap' >= this capacity. Positions not yet filled are masked out there (the
        batch attends up to its longest context), so an append also unmasks its position."""
        n = self.n
        k[:, :n] = self.k[:, :n]
        v[:, :n] = self.v[:, :n]
        if self.mask is None:
            mask[:, :n] = True
        else:
            mask[:, :n] = self.mask[:, :n]
        self.k, self.v, self.mask, self.bound = k, v, mask, True

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (KV, 1, d) of the new token."""
        self.k[:, self.n] = k[:, 0]
        self.v[:, self.n] = v[:, 0]
        if self.bound:
            self.mask[:, self.n] = True
        self.n += 1

    def view(self):
        """keys, values (KV, n, d) and the (1, 1 or H, 1, n) attention mask (None: all)."""
        n = self.n
        mask = None if self.mask is None else self.mask[None, :, None, :n]
        return self.k[:, :n], self.v[:, :n], mask

    @property
    def tokens(self) -> int:
        return self.n


@dataclasses.dataclass
class Sequence:
    """A request's decode state. `done` once it generated its last token (max_new_tokens,
    a stop token, or its on_token said stop)."""

    request: object                  # engine.Request
    sampler: Sampler
    stats: object                    # engine.RequestStats
    tokens: list[int]
    step_logits: list[torch.Tensor]  # copies of whole rows, only when the request keeps them
    query_logits: torch.Tensor | None
    position: int                    # position of the next token fed
    kv: list[LayerKV] | None = None  # per layer (None: nothing to decode)
    pages: object | None = None      # a decode-phase policy's page selector
    done: bool = False
    steps: int = 0
    moved: int = 0                   # KV bytes a step attends (see RequestStats)
    decode_s: float = 0.0
    stored: object | None = None     # its new prefix KV being stored (a Future), if any
    started: float = dataclasses.field(default_factory=time.perf_counter)
    # Per generated token (token, log-probability, top k) when the request asks for them,
    # and the scores of a scored prompt: plain numbers, never a view of a step's logits.
    logprobs: list | None = None
    prompt_scores: object = None

    def next_input(self) -> int:
        """The token this step feeds: the last generated, or the forced one."""
        forced = self.request.forced
        return self.tokens[-1] if forced is None else forced[self.steps]

    def accept(self, logits: torch.Tensor) -> int:
        """Take a step's (vocab,) logits: pick, record, and decide whether to go on. The
        row is a view of the whole step's (batch, vocab) logits: kept only as a copy, and
        only when asked for, so that no step's logits outlive the step."""
        req = self.request
        if req.keep_logits:
            self.step_logits.append(logits.clone())
        token = self.sampler.pick(logits)
        self.tokens.append(token)
        self.steps += 1
        if token in self.sampler.stop_token_ids or \
                (req.on_token is not None and req.on_token(token) is False) or \
                len(self.tokens) >= req.max_new_tokens:
            self.done = True
        return token
