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

from . import quant
from .sampling import Sampler


def decode_mask(mask: torch.Tensor, cap: int, group: int) -> torch.Tensor | None:
    """The mask a decode context of `cap` positions attends with, from the prefix's (KV, m)
    mask: None when every key is attended. Generated tokens are attended by every head; the
    prefix mask is fixed after prefill, so which mask a step needs is decided once."""
    if bool(mask.all()):
        return None
    rows = mask[:1] if bool((mask == mask[:1]).all()) else mask.repeat_interleave(group, dim=0)
    out = torch.ones(rows.shape[0], cap, dtype=torch.bool, device=mask.device)
    out[:, :mask.shape[1]] = rows
    return out


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
        self.mask = decode_mask(mask.to(keys.device), cap, group)
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


class CompressedKV:
    """A LayerKV whose context is held in FlexGen's 4-bit groups (`--compress-cache`) and
    dequantised for each step's attention, on the device that holds it.

    `groups` are FlexGen's cache groups, whose axes are those of its (seq, batch * heads,
    head_dim) layout: along head_dim (2, its default) or across heads (1) each token is
    compressed alone, as FlexGen does; along the sequence (0) a group is compressed once
    its tokens are all there, and the group not yet complete stays in the compute dtype
    (FlexGen quantises that group again at every step). As in FlexGen, the token a step
    appends is attended as computed and compressed at the next append. Never bound into a
    batch's side-by-side buffers: a batch attends its compressed contexts one by one.
    """

    bound = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 extra: int, group: int, groups):
        kv, m, d = keys.shape
        cap = m + extra
        self.dtype = keys.dtype
        self.size = groups.size
        self.axis = {0: 1, 1: 0, 2: 2}[groups.dim]   # FlexGen's axis in our (KV, seq, d)
        self.per_token = self.axis != 1
        slots = cap if self.per_token else (cap + self.size - 1) // self.size * self.size
        data, scale = quant.packed_shapes((kv, slots, d), self.size, self.axis)
        self.data = [keys.new_empty(data, dtype=torch.uint8) for _ in range(2)]
        self.scale = [keys.new_empty(scale, dtype=torch.float16) for _ in range(2)]
        self.packed = 0                  # positions held compressed; the rest in `tail`
        self.tail = [keys[:, :0], values[:, :0]]
        self.n = 0
        self.mask = decode_mask(mask.to(keys.device), cap, group)
        self._add(keys, values)
        self._settle()

    def _rows(self, first: int, last: int) -> tuple[tuple, tuple]:
        """Indexes of the packed data and of the scales holding positions first..last (the
        scales of groups across heads have their (groups, 2) in front of the positions)."""
        if self.per_token:
            data, scale = slice(first, last), slice(first, last)
        else:
            half = self.size // 2
            data = slice(first // self.size * half, last // self.size * half)
            scale = slice(first // self.size, last // self.size)
        lead = (slice(None),) * (2 if self.axis == 0 else 1)
        return (slice(None), data), lead + (scale,)

    def _add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.tail = [torch.cat([t, x.to(self.dtype)], dim=1) for t, x in zip(self.tail, (k, v))]
        self.n += k.shape[1]

    def _settle(self) -> None:
        """Compress what of the tail can be: every token (per-token groups), or every
        complete group along the sequence."""
        waiting = self.tail[0].shape[1]
        if not self.per_token:
            waiting = waiting // self.size * self.size
        if waiting <= 0:
            return
        data_rows, scale_rows = self._rows(self.packed, self.packed + waiting)
        for i, t in enumerate(self.tail):
            data, scale = quant.compress(t[:, :waiting], self.size, self.axis)
            self.data[i][data_rows] = data
            self.scale[i][scale_rows] = scale
            self.tail[i] = t[:, waiting:]
        self.packed += waiting

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (KV, 1, d) of the new token."""
        self._settle()
        self._add(k, v)

    def view(self):
        """As LayerKV.view: keys, values (KV, n, d) and the mask (None: all)."""
        out = []
        data_rows, scale_rows = self._rows(0, self.packed)
        for data, scale, tail in zip(self.data, self.scale, self.tail):
            if not self.packed:
                out.append(tail)
                continue
            kv, _, d = tail.shape
            held = quant.decompress(data[data_rows], scale[scale_rows],
                                    (kv, self.packed, d), self.size, self.axis, self.dtype)
            out.append(torch.cat([held, tail], dim=1) if tail.shape[1] else held)
        n = self.n
        mask = None if self.mask is None else self.mask[None, :, None, :n]
        return out[0], out[1], mask

    @property
    def tokens(self) -> int:
        return self.n


def decode_context(keys, values, mask, extra: int, group: int, flex_policy):
    """One layer's decode context: a LayerKV, or with FlexGen's compress_cache a
    CompressedKV in its cache groups (the pages of a decode-phase policy keep their own)."""
    if not flex_policy.compress_cache:
        return LayerKV(keys, values, mask, extra, group)
    config = flex_policy.comp_cache_config
    return CompressedKV(keys, values, mask, extra, group,
                        quant.Groups(config.group_size, config.group_dim))


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
