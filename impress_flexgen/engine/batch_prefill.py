"""One prefill pass over several requests: the weights of each layer are used once for all.

Requests admitted in the same step are prefilled together: their new tokens are laid side by
side, (1, N, hidden) with N the sum of their new tokens, and each layer's projections and
MLP run once over all of them. Between the projections and the output projection each
request goes its own way, exactly as served alone: its policy plans its prefix KV from its
own probe keys, its own chunks are loaded through the tiers (its own read-ahead, match and
pins), and its queries attend over its own prefix plus its own new tokens (causal).
A request served alone is a pass with one request: the same code.

Every request's first token goes out when the pass ends, before any of them stores its new
prefix KV or sets up its decode context, so the last one's time to first token is the pass
and not also the others' store writes.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch
from flexgen.pytorch_backend import TorchTensor

from ..errors import UserError
from ..request import RequestStats
from .canonical import LaneRows, attend_lane, plan_rows
from .readahead import ReadAhead

log = logging.getLogger("impress_flexgen.batch_prefill")


@dataclasses.dataclass
class PassInput:
    """What a prefill pass needs of one request (see Engine._prefill)."""

    new_ids: list[int]
    matched: int
    segments_nodes: list
    stats: object                 # its RequestStats
    n_hidden: int = 1             # final hidden states kept (1, or the query's for its logits)
    n_pad: int = 0
    front_ids: tuple | list = ()
    given: object = None          # KV after the matched prefix from the shared pool
    # Rows at positions below this go by canonical tiles (canonical.py; an exact policy's
    # request: its prefix's last chunk boundary); 0: the request's rows as they come.
    canonical_end: int = 0


@dataclasses.dataclass
class PrefillJob:
    """A request between its radix match and its decode context (Engine._open ... _to_decode)."""

    req: object
    want_query_logits: bool
    stats: object
    t_start: float
    disk_before: tuple | None
    match: object
    use_store: bool
    use_shared: bool
    segments_nodes: list = dataclasses.field(default_factory=list)
    matched: int = 0
    given: object = None
    n_given: int = 0
    new_ids: list = dataclasses.field(default_factory=list)
    front: int = 0
    canonical_end: int = 0
    learn: bool = True            # feed the planner its TTFT (not when it shared a pass)
    # after the first token:
    sampler: object = None
    first: int = -1
    logits: torch.Tensor | None = None
    first_scores: list | None = None   # the first token's (token, lp, top k), if asked
    going: bool = False

    def pass_input(self) -> PassInput:
        return PassInput(self.new_ids, self.matched, self.segments_nodes, self.stats,
                         n_hidden=len(self.req.query) if self.want_query_logits else 1,
                         n_pad=self.req.n_pad, front_ids=self.req.prefix[:self.front],
                         given=self.given, canonical_end=self.canonical_end)

    def release(self, e) -> None:
        """Unpin its matched prefix (once)."""
        if self.match is not None:
            match, self.match = self.match, None
            e.store.release(match)


class _Lane:
    """One request's part of a pass: its tokens' slice, positions, read-ahead and context."""

    def __init__(self, r, inp: PassInput, shared_probes: dict | None = None):
        self.inp = inp
        self.front = len(inp.front_ids)
        start = inp.matched + (inp.given.n_tokens if inp.given is not None else 0)
        self.total = start + len(inp.new_ids)
        positions = torch.arange(start, self.total, device=r.device)
        if self.front:
            positions = torch.cat([torch.arange(self.front, device=r.device), positions])
        self.positions = positions[None]
        self.ahead = ReadAhead(r.store, r.policy, r.math.n_layers, inp.segments_nodes,
                               inp.stats, front=self.front, shared_probes=shared_probes,
                               device=r.prefix.select_device)
        self.ahead.start(0)
        if inp.given is not None:
            inp.given.start(0)
        self.kept, self.new_kv = [], []
        self.lo = self.hi = 0
        self.rows: LaneRows | None = None     # its canonical calls (plan_rows)

    def close(self) -> None:
        self.ahead.close()
        if self.inp.given is not None:
            self.inp.given.close()


def _shared_time(lanes, field: str, seconds: float) -> None:
    """Time spent once for the whole pass counts in every request's stats."""
    for lane in lanes:
        setattr(lane.inp.stats, field, getattr(lane.inp.stats, field) + seconds)


def _weights(r, j: int, lanes):
    probe = RequestStats()
    out = r.weights(j, probe)
    _shared_time(lanes, "weights_s", probe.weights_s)
    return out


def prefill_pass(r, inputs: list[PassInput]) -> list[tuple]:
    """Run all layers over every request's new tokens. Per request: its per-layer decode
    context, its per-layer (K, V) of positions matched.. (given, then new), the final hidden
    states of its last `n_hidden` positions, and the output weights that make logits.
    `r`: the engine's LayerRunner (its weights, embedding, MLP, attention, prefix KV)."""
    steps = prefill_steps(r, inputs)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def prefill_steps(r, inputs: list[PassInput]):
    """prefill_pass a layer at a time: a generator that yields after each layer and
    returns what prefill_pass does. Nothing of the model's is held between layers (each
    layer's weights are brought and used within it), so another pass may run while one
    waits there (engine.scoring); closing it part-way ends its reads."""
    lanes = []
    # Requests that matched the same node read its probe keys once (a burst on one
    # system prompt reads them once, not once per request).
    shared_probes = {} if len(inputs) > 1 else None
    try:
        for inp in inputs:
            lanes.append(_Lane(r, inp, shared_probes))
        parts = []
        for lane in lanes:
            inp = lane.inp
            hidden = r.embed(inp.new_ids, lane.total, inp.stats)
            if lane.front:
                head = r.embed(list(inp.front_ids), lane.front, inp.stats)
                hidden.val = TorchTensor.create_from_torch(
                    torch.cat([head.val.data, hidden.val.data], dim=1), r.compute)
            lane.lo = sum(p.shape[1] for p in parts)
            parts.append(hidden.val.data)
            lane.hi = lane.lo + hidden.val.data.shape[1]
        if len(parts) > 1:
            hidden.val = TorchTensor.create_from_torch(torch.cat(parts, dim=1), r.compute)
        groups, rows = plan_rows([(lane.lo, lane.positions[0], lane.inp.canonical_end)
                                  for lane in lanes], lanes[-1].hi, r.device)
        for lane, lane_rows in zip(lanes, rows):
            lane.rows = lane_rows
        for group in groups:
            group.rope = r.math.rope(group.positions, hidden.val.data.dtype)
        for layer in range(r.math.n_layers):
            # The next layer's probe keys, and the chunks it is expected to load, are read
            # while this layer computes.
            for lane in lanes:
                lane.ahead.start(layer + 1)
                if lane.inp.given is not None:
                    lane.inp.given.start(layer + 1)
            _layer(r, layer, hidden, groups, lanes)
            yield layer
    finally:
        for lane in lanes:
            lane.close()
    out_w = _weights(r, len(r.model.layers) - 1, lanes)
    data = hidden.val.data
    out = []
    for lane in lanes:
        lane.inp.stats.layers = r.math.n_layers
        out.append((lane.kept, lane.new_kv, data[0, lane.hi - lane.inp.n_hidden:lane.hi],
                    out_w))
    return out


def _qkv(r, weights, x, groups):
    """q, k, v of every row, one call per group (canonical.py)."""
    if len(groups) == 1 and groups[0].index is None:
        return r.math.qkv(weights, x, groups[0].positions, groups[0].rope)
    out = None
    for g in groups:
        parts = r.math.qkv(weights, g.gather(x, 1), g.positions, g.rope)
        if out is None:
            out = [p.new_empty(*p.shape[:2], x.shape[1], p.shape[3]) for p in parts]
        for whole, part in zip(out, parts):
            g.scatter(whole, part, 2)
    return out


def _out(r, weights, attn, x, groups):
    """The output projection and residual of every row, one call per group."""
    if len(groups) == 1 and groups[0].index is None:
        return r.math.out(weights, attn, x)
    out = torch.empty_like(x)
    for g in groups:
        g.scatter(out, r.math.out(weights, g.gather(attn, 2), g.gather(x, 1)), 1)
    return out


def _layer(r, layer, hidden, groups, lanes) -> None:
    """One transformer layer over every request's new tokens: project (together), plan,
    load, attend (each its own), output projection and MLP (together); "together" is one
    call per row group (one, unless an exact policy's rows go by canonical tiles)."""
    weights = _weights(r, 1 + 2 * layer, lanes)
    t0 = time.perf_counter()
    x = hidden.val.data
    q, k_new, v_new = _qkv(r, weights, x, groups)
    _shared_time(lanes, "compute_s", time.perf_counter() - t0)
    attn = [_context(r, layer, lane, q[:, :, lane.lo:lane.hi], k_new[:, :, lane.lo:lane.hi],
                     v_new[:, :, lane.lo:lane.hi]) for lane in lanes]
    t0 = time.perf_counter()
    attn = attn[0] if len(attn) == 1 else torch.cat(attn, dim=2)
    hidden.val = TorchTensor.create_from_torch(_out(r, weights, attn, x, groups), r.compute)
    _shared_time(lanes, "compute_s", time.perf_counter() - t0)
    probe = RequestStats()
    r.mlp_rows(2 + 2 * layer, hidden, groups, probe)
    _shared_time(lanes, "weights_s", probe.weights_s)
    _shared_time(lanes, "compute_s", probe.compute_s)


def _context(r, layer, lane: _Lane, q, k_new, v_new) -> torch.Tensor:
    """One request's attention at `layer`: its policy's choice of its stored prefix KV,
    loaded, then its new tokens over that plus themselves. Keeps its decode context and
    the (K, V) to store."""
    inp, front, stats = lane.inp, lane.front, lane.inp.stats
    # The policy plans for the new tokens only; the recomputed front needs no prefix.
    prefix_k, prefix_v, prefix_mask = r.prefix.layer_kv(
        layer, inp.segments_nodes, q[:, :, front:], k_new[:, :, front:], lane.ahead, stats,
        inp.n_pad, front)
    given_kv = ()
    if inp.given is not None:
        t0 = time.perf_counter()
        given_kv = inp.given.kv(layer, r.device, r.dtype)
        stats.load_s += time.perf_counter() - t0
        prefix_k, prefix_v = [*prefix_k, given_kv[0]], [*prefix_v, given_kv[1]]
        prefix_mask = torch.cat([prefix_mask, torch.ones(
            r.math.n_kv_head, given_kv[0].shape[1], dtype=torch.bool, device=r.device)], dim=1)
    t0 = time.perf_counter()
    s = k_new.shape[2]
    new_mask = (lane.positions[0] >= inp.n_pad)[None].expand(r.math.n_kv_head, s)
    if lane.rows is not None:
        # Canonical: keys in position order (a recomputed front first), tiles and block.
        keys, values, mask = (torch.cat([new[:, :front], *pre, new[:, front:]], dim=1)
                              for new, pre in ((k_new[0], prefix_k), (v_new[0], prefix_v),
                                               (new_mask, [prefix_mask])))
        attn = attend_lane(r.attend, q, keys, values, mask, lane.rows)
    else:
        # One pass joins the loaded pieces and converts them to the compute dtype.
        keys = torch.cat([*prefix_k, k_new[0]], dim=1)
        values = torch.cat([*prefix_v, v_new[0]], dim=1)
        mask = torch.cat([prefix_mask, new_mask], dim=1)            # (KV, m + s)
        attn = r.attend(q, keys, values, mask, causal_tail=s, front=front)
    stats.compute_s += time.perf_counter() - t0
    k_mine, v_mine = k_new[0][:, front:], v_new[0][:, front:]
    if given_kv:
        k_mine = torch.cat([given_kv[0].to(k_mine.dtype), k_mine], dim=1)
        v_mine = torch.cat([given_kv[1].to(v_mine.dtype), v_mine], dim=1)
    lane.kept.append([keys, values, mask])
    lane.new_kv.append((k_mine, v_mine))
    return attn


def keeps_layer_state(policy) -> bool:
    """Does the policy carry state from one layer of a request to the next (its layers
    must then not interleave with another request's)?"""
    return bool(getattr(policy, "keeps_layer_state", False))


def start_together(e, items: list[tuple], pass_tokens: int | None = None) -> list:
    """Prefill (request, query_logits) pairs together; per pair its Sequence, or the
    exception that ended it. A request that would match more of the store once another of
    them has stored its prefix (a new prefix they share) waits for a pass after that one's,
    and then loads what the other computed, as when served one after the other. A pass
    takes requests while their new tokens total at most `pass_tokens` (one always; None:
    no limit); the rest follow in passes of their own. Any failure
    inside a pass (corrupt stored KV, a chunk the shared pool lost, anything else) serves
    each of its requests alone instead, with the engine's own recovery; nothing was
    streamed yet, so nothing is sent twice."""
    out: list = [None] * len(items)
    if len(items) == 1 or keeps_layer_state(e.policy):
        for i, (req, ql) in enumerate(items):
            out[i] = _alone(e, req, ql)
        return out
    todo = []
    for i, (req, ql) in enumerate(items):
        if req.prompt_logprobs is not None:     # prefilled in pieces of its own (scoring)
            out[i] = _alone(e, req, ql)
            continue
        try:
            todo.append((i, e._checked(req), ql))
        except UserError as exc:
            out[i] = exc
    with e._serving:
        while todo:
            todo = _one_pass(e, items, todo, out, pass_tokens)
    return out


def _one_pass(e, items, todo, out, pass_tokens: int | None = None) -> list:
    """Open, prefill together, stream first tokens, store and set up decode; returns the
    requests left for a later pass."""
    jobs = []
    for i, req, ql in todo:
        try:
            jobs.append((i, req, ql, e._open(req, ql, 0, use_shared=e.shared is not None)))
        except Exception as exc:  # noqa: BLE001 - this one alone, the others go on
            log.debug("opening a request for a shared prefill failed: %s", exc)
            out[i] = _alone(e, *items[i])
    group, later, tokens = [], [], 0
    for entry in jobs:
        job = entry[3]
        n = len(job.new_ids) + job.front
        if group and (any(_would_gain(e, a[3], job) for a in group) or
                      (pass_tokens is not None and tokens + n > pass_tokens)):
            later.append(entry)
        else:
            group.append(entry)
            tokens += n
    for *_, job in later:
        job.release(e)
    later = [(i, req, ql) for i, req, ql, _ in later]
    if len(group) == 1:
        i, _, _, job = group[0]
        job.release(e)
        out[i] = _alone(e, *items[i])
        return later
    try:
        results = prefill_pass(e.layers, [job.pass_input() for *_, job in group])
    except Exception as exc:  # noqa: BLE001 - served alone below
        log.info("shared prefill failed (%s); serving its requests alone", exc)
        for *_, job in group:
            job.release(e)
        for i, *_ in group:
            out[i] = _alone(e, *items[i])
        return later
    for (i, *_, job), res in zip(group, results):
        job.learn = False
        try:
            e._first_token(job, *res[2:])
        except Exception as exc:  # noqa: BLE001
            out[i] = exc
            job.release(e)
    for (i, *_, job), res in zip(group, results):
        if out[i] is not None:
            continue
        try:
            out[i] = e._to_decode(job, res[0], res[1])
        except Exception as exc:  # noqa: BLE001
            out[i] = exc
        finally:
            job.release(e)
    return later


def _would_gain(e, a: PrefillJob, b: PrefillJob) -> bool:
    """Would `b` match more stored prefix once `a` has stored its own?"""
    if not (a.use_store and b.use_store and e.policy.store_new) or \
            a.req.namespace != b.req.namespace:
        return False
    pa, pb = a.req.prefix, b.req.prefix
    n = min(len(pa), len(pb))
    common = 0
    while common < n and pa[common] == pb[common]:
        common += 1
    chunk = e.store.config.chunk_size
    return common // chunk * chunk > b.matched + b.n_given


def _alone(e, req, query_logits):
    try:
        return e.start(req, query_logits)
    except Exception as exc:  # noqa: BLE001 - handed to its caller
        return exc
