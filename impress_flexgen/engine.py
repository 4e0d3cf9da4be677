"""The serving engine: one request, from radix match to generated tokens.

    engine = Engine(runtime, store, make_policy("impress"))
    response = engine.serve(Request(prefix_ids, query_ids, max_new_tokens=8))

For each request:
  1. match    the longest stored, chunk-aligned part R of the prefix (locked meanwhile),
              then the chunks after it that the shared pool holds (a remote tier, if any);
              the plan: load R, recompute it, or recompute its front while the rest loads
              (the cost model's choice; `ServingConfig.plan`);
  2. embed    the new tokens (the rest of the prefix, then the query) at positions |R|...;
  3. per layer, with that layer's weights placed by FlexGen's policy:
       project  the new tokens' q, k, v;
       plan     the policy reads probe keys and decides which chunks to load (ITF); the
                probe keys were read in the background while the layer before computed;
       load     those K and V chunks, in one round trip through the tiers, fastest first
                (CRC-checked; store.readahead schedules the reads);
       attend   the new tokens over the kept prefix tokens plus themselves (causal);
       MLP;
  4. logits   of the last position: the first token (time to first token ends here;
              logits of the other query positions, when asked for, come after);
  5. store    the newly computed prefix KV (whole chunks) in the radix tree, then in the
              shared pool (write-through, in the background);
  6. decode   over the kept prefix tokens plus the generated ones (or the full prefix):
              `start` returns a Sequence after 1-5, `step` advances a batch of sequences by
              one token each (batch_runner), `finish` makes the response; `serve` does all
              three for one request, a scheduler interleaves many (scheduler).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from flexgen.pytorch_backend import TorchTensor
from flexgen.utils import ValueHolder

from policies import LayerContext, LayerPlan, Segment, ServingConfig, ServingPolicy
from policies.base import chunks_holding, resolve_probe_heads, tokens_of_chunks

from .errors import UserError
from .models.base import dense
from .models.llama import llama_out, llama_qkv, rms_norm, rope_cos_sin
from .models.opt import opt_out, opt_qkv
from .batch_runner import BatchRunner
from .runtime import Runtime
from .sampling import Sampler
from .sequence import LayerKV, Sequence
from .store import (CHUNK_SIZE, CorruptNode, ModelShape, PrefixStore, StoreConfig,
                    StoreWriteFailed, model_fingerprint)
from .store.readahead import LayerLoader, ReadAhead
from .prefix_plan import ContextKV, PrefixPlanner
from .request import Request, RequestStats, Response
from .store.shared import SharedMiss, shared_pool
from .tiers import ChunkCache, TierConfig

log = logging.getLogger("impress_flexgen.engine")



@dataclasses.dataclass(frozen=True)
class TierSizes:
    gpu_bytes: int = 0
    cpu_bytes: int = 0
    alpha: float = 1.2
    exclusive: bool = True
    verify_hits: bool = False    # CRC-check every tier hit (promotions always are)
    remote_url: str | None = None  # a shared pool (redis://HOST:PORT/DB) behind the disk
    remote_secret: str | None = dataclasses.field(default=None, repr=False)  # values' HMAC key
    remote_ttl: int | None = None  # seconds the pool keeps a chunk (None: until evicted)


class FamilyMath:
    """The per-family pieces of a transformer layer the engine computes itself."""

    def __init__(self, spec):
        c = spec.config
        self.config = c
        self.family = spec.family
        if spec.family == "opt":
            self.n_head, self.n_kv_head = c.n_head, c.n_head
            self.head_dim = c.input_dim // c.n_head
        else:
            self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.n_layers = c.num_hidden_layers

    def rope(self, positions: torch.Tensor, dtype) -> tuple | None:
        """The rotary tables of `positions`, shared by every layer of a pass (None: OPT)."""
        if self.family == "opt":
            return None
        return rope_cos_sin(positions, self.head_dim, self.config.rope_theta, dtype)

    def qkv(self, weights, x, positions, rope=None):
        if self.family == "opt":
            return opt_qkv(self.config, weights, x)
        return llama_qkv(self.config, weights, x, positions, rope)

    def out(self, weights, attn, x):
        if self.family == "opt":
            return opt_out(self.config, weights, attn, x)
        return llama_out(self.config, weights, attn, x)

    def logits(self, weights, hidden: torch.Tensor) -> torch.Tensor:
        """(s, h) last hidden states -> (s, vocab) float32 logits."""
        if self.family == "opt":
            w_ln, b_ln, w_token = weights
            h = F.layer_norm(hidden, (hidden.shape[-1],), w_ln.data, b_ln.data)
        else:
            w_norm, w_token = weights
            h = rms_norm(hidden, w_norm.data, self.config.rms_norm_eps)
        return F.linear(h, w_token.data).float()


def model_shape(spec, chunk_size: int = CHUNK_SIZE) -> ModelShape:
    """The shape and identity of `spec`'s stored KV at `chunk_size`: the fingerprint covers
    the weights' content, the compute and KV dtypes, the chunk size and the layout."""
    m = FamilyMath(spec)
    digest = getattr(spec, "weights_digest", "")
    fingerprint = model_fingerprint(digest, np.dtype(spec.config.dtype).name, chunk_size) \
        if digest else ""
    return ModelShape(spec.name, m.n_layers, m.n_kv_head, m.head_dim, fingerprint)


def probe_setup(spec, config: ServingConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(probe query heads, KV heads whose keys the store's probe copy holds)."""
    m = FamilyMath(spec)
    try:
        heads = resolve_probe_heads(config.probe_heads, m.n_head, m.n_kv_head, config.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    group = m.n_head // m.n_kv_head
    return tuple(heads), tuple(sorted({h // group for h in heads}))


def open_store(directory: str | Path, runtime: Runtime, config: ServingConfig,
               policy: ServingPolicy, chunk_size: int = CHUNK_SIZE, probe_format: str = "int4",
               disk_capacity_bytes: int | None = None, reorder_interval: int = 50,
               direct_io: bool = True, reorder_hot_fraction: float = 0.25,
               reorder_by: str = "importance", read_limit_mb_s: float | None = None
               ) -> PrefixStore:
    """A store shaped for `runtime`'s model, with the probe copy `config` needs."""
    _, probe_kv = probe_setup(runtime.spec, config)
    store_cfg = StoreConfig(chunk_size=chunk_size, probe_heads=probe_kv, probe_format=probe_format,
                            disk_capacity_bytes=disk_capacity_bytes,
                            reorder_interval=reorder_interval if policy.reorder else 0,
                            direct_io=direct_io, reorder_hot_fraction=reorder_hot_fraction,
                            reorder_by=reorder_by, read_limit_mb_s=read_limit_mb_s)
    return PrefixStore(directory, model_shape(runtime.spec, chunk_size), store_cfg)


class Engine:
    def __init__(self, runtime: Runtime, store: PrefixStore | None, policy: ServingPolicy,
                 tiers: TierSizes = TierSizes(), cache: ChunkCache | None = None):
        """`cache`: tiers to share with another engine on the same store (default: new
        tiers of `tiers`' sizes)."""
        if not runtime.policy.sep_layer:
            raise UserError("the serving engine needs FlexGen's sep_layer layout")
        self.rt = runtime
        self.model = runtime.model
        self.math = FamilyMath(runtime.spec)
        self.store = store
        self.policy = policy
        self.config = policy.config
        self.probe_heads, self.probe_kv_heads = probe_setup(runtime.spec, policy.config)
        # FlexGen's weight buffers and the policy's per-layer state belong to one request at
        # a time: requests from several threads take turns through the layers (the store
        # serves several engines at once).
        self._serving = threading.RLock()
        self.compute = self.model.layers[0].compute
        self.device = self.compute.dev
        self.dtype = torch.float16 if runtime.spec.config.dtype.__name__ == "float16" \
            else torch.float32
        if store is not None and policy.reuse:
            if tuple(store.config.probe_heads) != self.probe_kv_heads:
                raise UserError(f"store probe copy holds KV heads {store.config.probe_heads}, "
                                f"the policy probes {self.probe_kv_heads}")
            store.tiers.use_memory(cache if cache is not None else ChunkCache(
                TierConfig(tiers.gpu_bytes, tiers.cpu_bytes, policy.tier_policy, tiers.alpha,
                           tiers.exclusive, verify_hits=tiers.verify_hits),
                gpu_device=self.device))
        c = self.math
        self.kv_bytes_per_token_layer = 2 * c.n_kv_head * c.head_dim * 2  # K and V, fp16
        self.planner = None      # the cost model's planner, when the plan is auto or both
        # The shared pool (a remote tier behind the disk), when one is configured.
        self.shared = None
        self.shared_fallbacks = 0
        if tiers.remote_url and store is not None and policy.reuse:
            self.shared = shared_pool(
                tiers.remote_url, store, self.dtype, secret=tiers.remote_secret,
                ttl_s=tiers.remote_ttl, recompute_s=lambda n, ctx: None if self.planner is None
                else self.planner.cost().compute_s(n, ctx))
        self.tier_names = TierConfig().names(remote=self.shared is not None)
        self.max_positions = runtime.spec.config.max_seq_len
        if store is not None and policy.reuse and self.config.plan in ("auto", "both"):
            self.planner = PrefixPlanner(self)
        self.runner = BatchRunner(self)

    def close(self) -> None:
        """Stop the shared pool's threads (the store and runtime are closed by their owner)."""
        if self.shared is not None:
            self.shared.tier.close()

    # -- the request ------------------------------------------------------------------------
    def serve(self, request: Request, query_logits: bool = False) -> Response:
        """One request alone, from radix match to its last token."""
        with self._serving:
            seq = self.start(request, query_logits)
            while not seq.done:
                self.step([seq])
            return self.finish(seq)

    def start(self, request: Request, query_logits: bool = False) -> Sequence:
        """The prefill step of a request (match, plan, load, compute, first token, store):
        a sequence for decode steps, `done` when the first token was also the last."""
        if not request.query:
            raise UserError("a request needs at least one query token")
        if request.max_new_tokens < 1:
            raise UserError("max_new_tokens must be at least 1")
        if request.n_pad < 0 or (request.n_pad and request.n_pad >= len(request.prefix)):
            raise UserError("n_pad must leave at least one real prefix token")
        if request.forced is not None and request.max_new_tokens > 1 and \
                len(request.forced) < request.max_new_tokens - 1:
            raise UserError("forced decoding needs max_new_tokens - 1 tokens")
        if request.on_token is not None:
            request = dataclasses.replace(request, on_token=_Relay(request.on_token))
        use_shared = self.shared is not None
        for attempt in range(4):
            try:
                with self._serving:
                    if request.on_token is not None:
                        request.on_token.restart()
                    return self._serve(request, query_logits, recovered=attempt,
                                       use_shared=use_shared)
            except CorruptNode as exc:
                # Never serve corrupt KV: take the node out of service and recompute.
                self.store.quarantine(exc.node, str(exc))
            except SharedMiss as exc:
                # The pool lost a chunk it had (no longer marked held): serve again with what
                # it still holds whole, publishing the rest back; then without it.
                log.warning("shared pool: %s; serving again", exc)
                self.shared_fallbacks += 1
                use_shared = attempt == 0
        raise RuntimeError("store kept failing CRC checks; giving up on this request")

    def step(self, seqs: list[Sequence]) -> None:
        """One decode step: the next token of every sequence (none of them done), with
        each layer's weights used once for all of them."""
        with self._serving:
            self.runner.step(seqs)

    def finish(self, seq: Sequence) -> Response:
        """The response of a sequence (done, or given up by its caller)."""
        stats = seq.stats
        steps = seq.steps
        if seq.pages is not None:
            counters = seq.pages.close()
            seq.moved = counters.bytes_moved + sum(
                kv.n for kv in seq.kv if kv is not None) * self.kv_bytes_per_token_layer * steps
            stats.decode_select_s = counters.select_s
            stats.index_build_s = counters.build_s
            stats.index_recall = counters.recall
        if steps:
            stats.decode_s_per_token = seq.decode_s / steps
            stats.decode_bytes_per_step = seq.moved / steps
        seq.kv = None     # the context's memory goes now, not with the last reference
        return Response(seq.tokens, seq.query_logits, seq.step_logits, stats)

    def _serve(self, req: Request, want_query_logits: bool, recovered: int,
               use_shared: bool = False) -> Sequence:
        stats = RequestStats(prefix_tokens=len(req.prefix), recovered_from_corruption=recovered,
                             bytes_read=dict.fromkeys(self.tier_names, 0))
        n_pad = req.n_pad
        t_start = time.perf_counter()
        disk_before = self.store.reader.counters() if self.planner is not None else None
        match = None
        use_store = self.store is not None and self.policy.reuse
        try:
            # 1. match
            if use_store:
                # An exact reader never sees KV computed over a selection of a prefix.
                match = self.store.match_prefix(req.prefix, namespace=req.namespace,
                                                exact_only=self.policy.exact_reads)
            segments_nodes = match.segments if match else []
            matched = sum(u for _, u in segments_nodes)
            stats.matched_tokens = matched
            stats.match_s = time.perf_counter() - t_start
            # The prefix tokens right after the matched ones may be in the shared pool.
            given = self.shared.open(req.prefix, matched, stats, tenant=req.namespace) \
                if use_shared and use_store else None
            n_given = given.n_tokens if given is not None else 0
            new_ids = list(req.prefix[matched + n_given:]) + list(req.query)
            stats.prefix_bytes = matched * self.kv_bytes_per_token_layer * self.math.n_layers
            # Load the matched prefix, recompute it, or recompute its front while the rest
            # loads: `front` tokens are recomputed.
            front = self._choose_plan(segments_nodes, matched, len(new_ids), stats)
            stats.computed_tokens = len(new_ids) + front
            if front >= matched:
                segments_nodes = []      # nothing left to load

            # 2-4. prefill
            kept, new_kv, tail, out_w = self._prefill(
                new_ids, matched, segments_nodes, stats,
                n_hidden=len(req.query) if want_query_logits else 1, n_pad=n_pad,
                front_ids=req.prefix[:front], given=given)
            t0 = time.perf_counter()
            logits = self.math.logits(out_w, tail[-1:]).cpu()
            stats.compute_s += time.perf_counter() - t0
            sampler = Sampler(req.sampling)
            first = sampler.pick(logits[-1])
            stats.ttft_s = time.perf_counter() - t_start
            if disk_before is not None and matched:
                self._learn(stats, disk_before, matched)
            # The first token goes out now; storing the prefix (5.) follows either way.
            going = first not in sampler.stop_token_ids and \
                (req.on_token is None or req.on_token(first) is not False)
            if want_query_logits and len(tail) > 1:   # for checks, after the first token
                logits = torch.cat([self.math.logits(out_w, tail[:-1]).cpu(), logits])

            # 5. store the new prefix KV
            if use_store and self.policy.store_new:
                t0 = time.perf_counter()
                n_prefix_new = len(req.prefix) - matched
                if n_prefix_new >= self.store.config.chunk_size:
                    try:
                        self.store.insert(req.prefix, matched,
                                          [(k[:, :n_prefix_new], v[:, :n_prefix_new])
                                           for k, v in new_kv],
                                          namespace=req.namespace, exact=stats.exact)
                    except StoreWriteFailed as exc:
                        log.warning("prefix not stored: %s", exc)
                    else:
                        if use_shared and stats.exact:
                            # Durable here first; then shared (write-through, in the
                            # background): the chunks the pool did not give us. Only
                            # exact KV is shared: the pool keeps no flag.
                            self.shared.publish(req.prefix, matched + n_given,
                                                [(k[:, n_given:n_prefix_new],
                                                  v[:, n_given:n_prefix_new])
                                                 for k, v in new_kv], tenant=req.namespace)
                stats.store_s = time.perf_counter() - t0

            # 6. decode: a sequence, stepped by serve() alone or by a scheduler in a batch
            seq = Sequence(req, sampler, stats, [first], [logits[-1]],
                           logits if want_query_logits else None,
                           position=len(req.prefix) + len(req.query))
            if going and req.max_new_tokens > 1:
                if self.config.decode_over == "full" and match is not None and match.segments:
                    kept = self._full_prefix_context(match.segments, new_kv, stats, n_pad)
                t0 = time.perf_counter()
                seq.pages = self.policy.start_decode(kept, self.math.n_head, self.device)
                extra = req.max_new_tokens - 1
                seq.kv = [None if seq.pages is not None and seq.pages.handles(layer) else
                          LayerKV(*kept[layer], extra, self.math.n_head // self.math.n_kv_head)
                          for layer in range(self.math.n_layers)]
                seq.decode_s = time.perf_counter() - t0
            else:
                seq.done = True
            return seq
        finally:
            if match is not None:
                self.store.release(match)

    # -- plan -------------------------------------------------------------------------------
    def _choose_plan(self, segments_nodes, matched: int, n_new: int, stats) -> int:
        """How many leading prefix tokens to recompute rather than load (0: load all)."""
        mode = self.config.plan
        if not segments_nodes or mode == "load":
            stats.plan, stats.plan_split = "load", 0
            stats.plan_reason = "forced" if segments_nodes else "no-match"
            return 0
        if mode == "recompute":
            stats.plan, stats.plan_split = "recompute", matched // self.store.config.chunk_size
            stats.plan_reason = "forced"
            return matched
        plan = self.planner.choose(mode, segments_nodes, matched, n_new)
        stats.plan, stats.plan_split = plan.mode, plan.split_chunks
        stats.plan_reason = getattr(plan, "reason", "predicted")
        stats.predicted_ttft_s = plan.predicted_s
        return plan.split_chunks * self.store.config.chunk_size

    def _learn(self, stats, disk_before, matched: int) -> None:
        """Feed the planner what this request's reads and time to first token showed."""
        read, busy = self.store.reader.counters()
        loaded = 2 * self.math.n_layers * (matched // self.store.config.chunk_size -
                                           stats.plan_split)
        self.planner.observe(stats, read - disk_before[0], busy - disk_before[1], loaded)

    def measure_prefill(self, n: int, ctx: int = 0) -> float:
        """Seconds to prefill n tokens over ctx earlier ones (their KV given, no I/O) and
        take the first token: one point of the planner's prefill curve."""
        vocab = self.rt.spec.config.vocab_size
        ids = np.random.default_rng(n * 7919 + ctx).integers(10, vocab, n).tolist()
        stats = RequestStats()
        given = ContextKV(ctx, self.math.n_kv_head, self.math.head_dim) if ctx else None
        with self._serving:
            t0 = time.perf_counter()
            _, _, tail, out_w = self._prefill(ids, 0, [], stats, n_hidden=1, given=given)
            self.math.logits(out_w, tail[-1:]).cpu()
            return time.perf_counter() - t0

    # -- prefill ----------------------------------------------------------------------------
    def _prefill(self, new_ids, matched, segments_nodes, stats, n_hidden, n_pad=0,
                 front_ids=(), given=None):
        """Run all layers over the new tokens; returns per-layer decode context, per-layer
        (K, V) of positions matched.. (the given part, then the new tokens), the final
        hidden states of the last `n_hidden` positions and the output weights that turn
        them into logits.

        `front_ids`: the first prefix tokens, recomputed with the new ones instead of
        loaded (the "both" plan): they attend to each other only. `given`: KV of the
        prefix tokens right after the matched ones, from the shared pool (attended in full)."""
        layers = self.model.layers
        front = len(front_ids)
        start = matched + (given.n_tokens if given is not None else 0)
        total = start + len(new_ids)
        positions = torch.arange(start, total, device=self.device)
        if front:
            positions = torch.cat([torch.arange(front, device=self.device), positions])
        positions = positions[None]
        ahead = ReadAhead(self.store, self.policy, self.math.n_layers, segments_nodes, stats,
                          front=front)
        ahead.start(0)
        if given is not None:
            given.start(0)
        kept, new_kv = [], []
        try:
            hidden = self._embed(new_ids, total, stats)
            if front:
                head = self._embed(list(front_ids), front, stats)
                hidden.val = TorchTensor.create_from_torch(
                    torch.cat([head.val.data, hidden.val.data], dim=1), self.compute)
            rope = self.math.rope(positions, hidden.val.data.dtype)
            for layer in range(self.math.n_layers):
                # The next layer's probe keys, and the chunks it is expected to load, are
                # read while this layer computes.
                ahead.start(layer + 1)
                if given is not None:
                    given.start(layer + 1)
                kept_kv, kv = self._layer(layer, hidden, positions, rope, segments_nodes,
                                          ahead, stats, n_pad, front, given)
                kept.append(kept_kv)
                new_kv.append(kv)
        finally:
            ahead.close()
            if given is not None:
                given.close()
        out_w = self._weights(len(layers) - 1, stats)
        stats.layers = self.math.n_layers
        return kept, new_kv, hidden.val.data[0, -n_hidden:], out_w

    def _layer(self, layer, hidden, positions, rope, segments_nodes, ahead, stats, n_pad,
               front=0, given=None):
        """One transformer layer over the new tokens: project, plan, load, attend, MLP.
        Returns this layer's decode context [K, V, mask] and the (K, V) of positions
        matched.. (given, then new)."""
        weights = self._weights(1 + 2 * layer, stats)
        t0 = time.perf_counter()
        x = hidden.val.data
        q, k_new, v_new = self.math.qkv(weights, x, positions, rope)
        stats.compute_s += time.perf_counter() - t0

        # The policy plans for the new tokens only; the recomputed front needs no prefix.
        prefix_k, prefix_v, prefix_mask = self._prefix_kv(
            layer, segments_nodes, q[:, :, front:], k_new[:, :, front:], ahead, stats, n_pad,
            front)
        given_kv = ()
        if given is not None:
            t0 = time.perf_counter()
            given_kv = given.kv(layer, self.device, self.dtype)
            stats.load_s += time.perf_counter() - t0
            prefix_k, prefix_v = [*prefix_k, given_kv[0]], [*prefix_v, given_kv[1]]
            prefix_mask = torch.cat([prefix_mask, torch.ones(
                self.math.n_kv_head, given_kv[0].shape[1], dtype=torch.bool,
                device=self.device)], dim=1)
        t0 = time.perf_counter()
        # One pass joins the loaded pieces and converts them to the compute dtype.
        keys = torch.cat([*prefix_k, k_new[0]], dim=1)
        values = torch.cat([*prefix_v, v_new[0]], dim=1)
        s = k_new.shape[2]
        new_mask = (positions[0] >= n_pad)[None].expand(self.math.n_kv_head, s)
        mask = torch.cat([prefix_mask, new_mask], dim=1)            # (KV, m + s)
        attn = self._attend(q, keys, values, mask, causal_tail=s, front=front)
        hidden.val = TorchTensor.create_from_torch(self.math.out(weights, attn, x),
                                                   self.compute)
        stats.compute_s += time.perf_counter() - t0
        self._mlp(2 + 2 * layer, hidden, stats)
        k_mine, v_mine = k_new[0][:, front:], v_new[0][:, front:]
        if given_kv:
            k_mine = torch.cat([given_kv[0].to(k_mine.dtype), k_mine], dim=1)
            v_mine = torch.cat([given_kv[1].to(v_mine.dtype), v_mine], dim=1)
        return [keys, values, mask], (k_mine, v_mine)

    def _prefix_kv(self, layer, segments_nodes, q, k_new, ahead, stats, n_pad, front=0):
        """The policy's choice of this layer's stored prefix KV, loaded: K and V as lists
        of (KV, m_i, d) pieces on the compute device (to be concatenated) and a (KV, m)
        mask of which tokens each KV head attends. Tokens before `front` are recomputed:
        never loaded."""
        if not segments_nodes:
            return [], [], torch.zeros(self.math.n_kv_head, 0, dtype=torch.bool,
                                       device=self.device)
        loader = ahead.loader(layer)
        segments = loader.segments
        ctx = LayerContext(layer, q[0].float().cpu(), k_new[0].float().cpu(), segments,
                           self.config, self.probe_heads, self.probe_kv_heads,
                           loader.read_probe, loader.load, n_pad=n_pad)
        t0 = time.perf_counter()
        io_before = stats.probe_s + stats.load_s
        plan = self.policy.plan_layer(ctx)
        stats.select_s += time.perf_counter() - t0 - (stats.probe_s + stats.load_s - io_before)
        stats.layers_fallback += int(plan.fallback)
        if plan.jaccard is not None:
            stats.jaccard.append(plan.jaccard)
        return self._gather(plan, segments, loader, ahead, stats, n_pad, front)

    def _gather(self, plan: LayerPlan, segments, loader: LayerLoader, ahead, stats, n_pad,
                front=0):
        firsts = [max(0, front - seg.start) for seg in segments]
        chosen = [chunks_holding(seg, np.intersect1d(plan.chunks_k[si], plan.chunks_v[si]),
                                 firsts[si]) for si, seg in enumerate(segments)]
        # Every segment's K and V reads go out together; while they are in flight the next
        # layer's probe keys (read since this layer began) are decoded.
        pending = loader.start_all([(si, {"k": ids, "v": ids})
                                    for si, ids in enumerate(chosen) if len(ids)])
        t0 = time.perf_counter()
        ahead.decode_probe(loader.layer + 1)
        stats.probe_s += time.perf_counter() - t0
        loaded = loader.finish_all(pending)
        ks, vs, masks = [], [], []
        attended = 0
        for si, seg in enumerate(segments):
            ids = chosen[si]
            if firsts[si] < seg.used and not getattr(seg.node, "exact", True):
                stats.exact = False       # loaded KV that was itself computed sparsely
            if len(ids) == 0:
                if stats.exact and not self._covers(seg, firsts[si], n_pad, None, None):
                    stats.exact = False
                continue
            rows, logical = tokens_of_chunks(seg, ids, firsts[si])
            ks += self._rows(loaded[si]["k"], rows)
            vs += self._rows(loaded[si]["v"], rows)
            if plan.attend[si] is None:
                mask = np.ones((self.math.n_kv_head, len(rows)), dtype=bool)
            else:
                mask = np.asarray(plan.attend[si])[:, logical]
            if n_pad:
                mask = mask & (seg.start + logical >= n_pad)[None]
            if stats.exact and not self._covers(seg, firsts[si], n_pad, logical, mask):
                stats.exact = False
            masks.append(mask)
            attended += int(mask.any(axis=0).sum())
            if self.store is not None:
                self.store.record_selection(
                    seg.entry, None if plan.scores is None else plan.scores[si],
                    None if plan.selected is None else plan.selected[si], ids)
        stats.bytes_needed += attended * self.kv_bytes_per_token_layer
        mask = np.concatenate(masks, axis=1) if masks else \
            np.zeros((self.math.n_kv_head, 0), dtype=bool)
        return ks, vs, torch.from_numpy(mask).to(self.device)

    @staticmethod
    def _covers(seg, first: int, n_pad: int, logical, mask) -> bool:
        """Does every KV head attend every (unpadded) prefix token of `seg` from `first` on?
        (Not: the new KV is approximate.)"""
        if first >= seg.used:
            return True
        seen = np.zeros(seg.used, dtype=bool)
        seen[:max(0, min(seg.used, n_pad - seg.start))] = True     # padding: never attended
        if logical is not None:
            seen[logical[mask.all(axis=0)]] = True
        return bool(seen[first:].all())

    def _rows(self, chunks: list[torch.Tensor], rows: np.ndarray) -> list[torch.Tensor]:
        """Loaded chunks, concatenated, keep the rows holding prefix tokens: as pieces on
        the compute device. On a CPU, chunks wholly inside the prefix stay separate: the
        layer's one cat() joins and converts them."""
        whole = len(rows) == sum(c.shape[1] for c in chunks)
        if whole and self.device.type == "cpu" and all(c.device.type == "cpu" for c in chunks):
            return chunks
        joined = torch.cat(chunks, dim=1)
        if not whole:
            joined = joined[:, torch.from_numpy(rows).to(joined.device)]
        return [joined.to(self.device, self.dtype)]

    def _full_prefix_context(self, segments_nodes, new_kv, stats, n_pad):
        """Decode over the whole prefix: reload every chunk (after time to first token)."""
        kept = []
        for layer, (k_new, v_new) in enumerate(new_kv):
            segments = [Segment(n, u, self.store.entry(n, layer)) for n, u in segments_nodes]
            ks, vs = [], []
            for seg in segments:
                ids = seg.all_chunks()
                rows, _ = tokens_of_chunks(seg, ids)
                for kind, out in (("k", ks), ("v", vs)):
                    chunks, _ = self.store.load_chunks(seg.entry, kind, ids, seg.node)
                    out.append(torch.cat(chunks, 1)[:, torch.from_numpy(rows)]
                               .to(self.device, self.dtype))
            keys = torch.cat(ks + [k_new], 1)
            values = torch.cat(vs + [v_new], 1)
            valid = torch.arange(keys.shape[1], device=self.device) >= n_pad
            kept.append([keys, values, valid[None].expand(keys.shape[0], -1).clone()])
        return kept

    # -- layer pieces ---------------------------------------------------------------------
    def _attend(self, q, keys, values, mask, causal_tail: int, front: int = 0) -> torch.Tensor:
        """q (1, H, s, d) over keys/values (KV, m, d); mask (KV, m) says which keys each KV
        head may see; the last `causal_tail` keys are the new tokens themselves (causal).
        The first `front` queries (a recomputed prefix front) see none of the keys before
        the tail: those are prefix tokens after them."""
        s, m = q.shape[2], keys.shape[1]
        if front:
            # The front over its own keys only (the first of the tail), the rest over all:
            # masking the prefix out of the front's rows would still compute them.
            lo = m - causal_tail
            head = self._attend(q[:, :, :front], keys[:, lo:lo + front],
                                values[:, lo:lo + front], mask[:, lo:lo + front], front)
            rest = self._attend(q[:, :, front:], keys, values, mask, causal_tail - front)
            return torch.cat([head, rest], dim=2)
        group = self.math.n_head // self.math.n_kv_head
        # Whole-chunk selection gives every KV head the same keys: one (s, m) mask then
        # serves all heads, instead of a copy per head.
        shared = mask.shape[0] == 1 or bool((mask == mask[:1]).all())
        rows = mask[:1] if shared else mask
        allowed = rows[:, None, :].expand(-1, s, -1).clone()          # (KV or 1, s, m)
        tail = torch.ones(s, causal_tail, dtype=torch.bool, device=self.device).tril(
            diagonal=causal_tail - s)
        allowed[:, :, m - causal_tail:] &= tail
        # A token always sees itself: masked pad tokens would otherwise see nothing (NaN).
        allowed[:, :, m - causal_tail:] |= _diagonal(s, causal_tail, self.device)
        allowed = allowed[None] if shared else \
            allowed.repeat_interleave(group, dim=0)[None]             # (1, H or 1, s, m)
        work = torch.float32 if self.device.type == "cpu" else q.dtype
        out = F.scaled_dot_product_attention(
            q.to(work), keys[None].to(work), values[None].to(work), attn_mask=allowed,
            enable_gqa=group > 1)
        return out.to(q.dtype)

    def _weights(self, j: int, stats: RequestStats):
        """Bring layer j's weights to the compute device (FlexGen's placement decides from
        where) and return them as plain tensors."""
        t0 = time.perf_counter()
        layer = self.model.layers[j]
        layer.load_weight(self.model.weight_home[j], self.model.weight_read_buf[j], 0)
        self.model.env.disk.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stats.weights_s += time.perf_counter() - t0
        if j % 2 == 0:
            return None  # embedding (0) and MLP (even) layers consume their buffer in forward()
        return [dense(w) for w, _ in self.model.weight_read_buf[j].pop()]

    def _embed(self, ids, total_len: int, stats) -> ValueHolder:
        self._weights(0, stats)
        t0 = time.perf_counter()
        hidden, mask = ValueHolder(), ValueHolder()
        hidden.store(TorchTensor.create_from_torch(
            torch.tensor([ids], dtype=torch.int64, device=self.device), self.compute))
        mask.store(TorchTensor.create_from_torch(
            torch.ones(1, total_len, dtype=torch.bool, device=self.device), self.compute))
        self.model.layers[0].forward(hidden, None, self.model.weight_read_buf[0], mask, None, 0, 0)
        stats.compute_s += time.perf_counter() - t0
        return hidden

    def _mlp(self, j: int, hidden: ValueHolder, stats) -> None:
        self._weights(j, stats)
        t0 = time.perf_counter()
        self.model.layers[j].forward(hidden, None, self.model.weight_read_buf[j], None, None, 0, 0)
        stats.compute_s += time.perf_counter() - t0


class _Relay:
    """A request's on_token across the retries of serve(): a retry after corrupt KV was
    found recomputes from the start and produces the same tokens again (greedy, or the same
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


def _diagonal(s: int, tail: int, device) -> torch.Tensor:
    """(s, tail) bool: query i (of the last s tokens) against itself among the last `tail`."""
    out = torch.zeros(s, tail, dtype=torch.bool, device=device)
    idx = torch.arange(s, device=device)
    out[idx, idx + tail - s] = True
    return out
