"""A request from its radix match to its last token: one record the scheduler queues, the
prefix opener fills, the runner computes over and the scheduler's post-processing extends.

    seq = Sequence(request)            # waiting
    ... prefix.open(seq)               # matched, planned, pinned (one attempt at its prefill)
    ... runner.prefill([seq, ...])     # its new tokens through every layer
    ... scheduler.postprocess(...)     # its first token appended: running, or finished
    ... runner.decode([seq, ...])      # one token per step, appended the same way
    seq.response (or seq.error)        # once finished

Its per-layer decode context lives in `LayerKV` buffers sized for the whole generation, so
a step writes the new token's K and V in place instead of concatenating the context again.
A scored prompt (prompt log-probabilities) is prefilled a piece at a time: its `scoring`
holds the pieces so far (`ScoredPrompt`), and its choices (n) share that prefill.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import Callable

import torch

from ..errors import UserError
from ..models import quant
from ..models.runtime import check_lengths
from ..request import Request, RequestStats, Response

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"        # added, not admitted yet
    ADMITTED = "admitted"      # admitted in this step: prefilled in one of its passes
    SCORING = "scoring"        # a scored prompt, prefilled a piece per step
    RUNNING = "running"        # its first token out: decoding
    FINISHED = "finished"      # its response (or error) is made


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
        self.bound = False   # lives in a batch's side-by-side buffers (attention.py)

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
class ScoredPrompt:
    """A scored prompt's prefill so far: `done` tokens prefilled in pieces of `piece`, their
    scores (`parts`), the pieces' K and V for the next one (`context`), the piece paused
    between two layers (`paused`: the runner's pass), and after the last piece its
    (kept, new_kv, last row, output weights)."""

    ids: list[int]
    k: int                        # top log-probabilities asked per token
    piece: int                    # tokens per piece
    done: int = 0
    parts: list = dataclasses.field(default_factory=list)
    context: object = None
    paused: object = None
    last: tuple | None = None

    @property
    def finished(self) -> bool:
        return self.done == len(self.ids)

    @property
    def next_piece(self) -> int:
        """Tokens the next piece prefills."""
        return min(self.piece, len(self.ids) - self.done)


class PiecesKV:
    """The K and V of a scored prompt's pieces already prefilled, per layer (KV, n, d) on the
    compute device, given to the next piece as a prefix it attends in full (as the shared
    pool's KV is given)."""

    def __init__(self, layers: list):
        self.layers = layers
        self.n_tokens = int(layers[0][0].shape[1])

    def start(self, layer: int) -> None:
        pass

    def kv(self, layer: int, device, dtype):
        return self.layers[layer]

    def close(self) -> None:
        pass


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's state. Everything an attempt at its prefill sets is set again by the
    next attempt (a retry after corrupt KV starts over from the match)."""

    request: Request
    want_query_logits: bool = False
    # The other choices of a scored prompt (the same query): they share its prefill and its
    # scores, then each decodes as a sequence of its own.
    choices: list = dataclasses.field(default_factory=list)
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    kv_bytes: int = 0              # decode context and logits admission holds for it
    order: int = 0                 # its place in the decode batch (admission order)
    scoring: ScoredPrompt | None = None

    # -- one attempt at its prefill (prefix.open) -----------------------------------------
    stats: RequestStats | None = None
    t_start: float = 0.0
    disk_before: tuple | None = None   # the disk's counters at the match (the planner learns)
    match: object = None               # its pinned radix match, until stored or released
    use_store: bool = False
    use_shared: bool = False
    segments_nodes: list = dataclasses.field(default_factory=list)
    matched: int = 0
    given: object = None               # KV after the match: the shared pool's
    n_given: int = 0
    new_ids: list = dataclasses.field(default_factory=list)
    front: int = 0                     # leading prefix tokens recomputed instead of loaded
    # Rows at positions below this go by canonical tiles (attention.py; an exact policy's
    # request: its prefix's last chunk boundary); 0: its rows as they come.
    canonical_end: int = 0
    learn: bool = True                 # feed the planner its TTFT (not when it shared a pass)

    # -- tokens (the scheduler's post-processing appends them) -----------------------------
    sampler: object = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    step_logits: list = dataclasses.field(default_factory=list)   # copies, with keep_logits
    query_logits: torch.Tensor | None = None
    logprobs: list | None = None       # per token (token, lp, top k): with logprobs
    prompt_scores: object = None       # a scored prompt's scores (shared by its choices)
    steps: int = 0                     # decode steps taken

    # -- decode ----------------------------------------------------------------------------
    kv: list[LayerKV] | None = None    # per layer (None: a decode-phase policy's pages)
    pages: object | None = None        # a decode-phase policy's page selector
    moved: int = 0                     # KV bytes the steps attend (see RequestStats)
    decode_s: float = 0.0
    stored: object | None = None       # its new prefix KV being stored (a Future)

    # -- outcome -----------------------------------------------------------------------------
    response: Response | None = None
    error: BaseException | None = None
    started: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prefix) + len(self.request.query)

    @property
    def position(self) -> int:
        """Position of the first generated token fed back."""
        return self.prompt_tokens

    @property
    def width(self) -> int:
        """Decode slots it takes: one per choice."""
        return 1 + len(self.choices)

    @property
    def scores_prompt(self) -> bool:
        return self.request.prompt_logprobs is not None

    @property
    def n_hidden(self) -> int:
        """Final hidden states its prefill keeps: the query's (for its logits), or the last."""
        return len(self.request.query) if self.want_query_logits else 1

    def restart(self) -> None:
        """A new attempt at its prefill: nothing of the last one's tokens or context."""
        self.sampler, self.tokens, self.step_logits = None, [], []
        self.query_logits, self.logprobs, self.steps = None, None, 0
        self.kv = self.pages = self.stored = None
        self.moved, self.decode_s = 0, 0.0

    def next_input(self) -> int:
        """The token this step feeds: the last generated, or the forced one."""
        forced = self.request.forced
        return self.tokens[-1] if forced is None else forced[self.steps]

    def result(self) -> Response:
        """The response, or the error that ended it."""
        if self.error is not None:
            raise self.error
        return self.response


def checked(request: Request, spec=None) -> Request:
    """The request, refused (UserError) if malformed or longer than the positions of the
    model `spec` (runtime.check_lengths); its on_token relayed across retries."""
    if not request.query:
        raise UserError("a request needs at least one query token")
    if request.max_new_tokens < 1:
        raise UserError("max_new_tokens must be at least 1")
    if spec is not None:
        check_lengths(spec, len(request.prefix) + len(request.query), request.max_new_tokens,
                      "a request")
    if request.n_pad < 0 or (request.n_pad and request.n_pad >= len(request.prefix)):
        raise UserError("n_pad must leave at least one real prefix token")
    if request.forced is not None and request.max_new_tokens > 1 and \
            len(request.forced) < request.max_new_tokens - 1:
        raise UserError("forced decoding needs max_new_tokens - 1 tokens")
    if request.on_token is not None:
        request = dataclasses.replace(request, on_token=Relay(request.on_token))
    return request


class Relay:
    """A request's on_token across the retries of its prefill: a retry after corrupt KV was
    found computes from the start and produces the same tokens again (greedy, or the same
    seed); only those past what the caller already has are passed on."""

    def __init__(self, on_token: Callable[[int], bool]):
        self.on_token = on_token
        self.sent = 0      # tokens passed on, over all attempts
        self.at = 0        # tokens produced in this attempt

    def restart(self) -> None:
        self.at = 0

    def __call__(self, token: int) -> bool:
        self.at += 1
        if self.at <= self.sent:
            return True
        self.sent = self.at
        return self.on_token(token)
