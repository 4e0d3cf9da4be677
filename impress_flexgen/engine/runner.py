"""The model's layer loops over FlexGen's weight buffers: a prefill pass over the new tokens
of several sequences, and a decode step of a batch. Nothing else runs the layers.

    outs = runner.prefill(seqs)           # per sequence (kept, new_kv, last hidden, out_w)
    firsts = runner.first_tokens(seqs, outs)
    picked = runner.decode(seqs)          # one token per sequence

Each FlexGen layer is brought by `load_weights(j)` (FlexGen's placement decides from where:
GPU, CPU or disk), then computed: the embedding (j = 0), per transformer layer its attention
(odd j) and its MLP (even j), and the output layer that makes logits. Both loops do this in
the same order; a prefill pass and a decode step each bring a layer's weights once for all
their sequences (with offloaded weights, what batching shares).

A prefill pass lays its sequences' new tokens side by side, (1, N, hidden); projections and
MLP run once over all of them, each sequence's attention on its own (lane.py). A pass runs
a layer at a time and may stop between two layers (`pause`: a scored prompt's piece waits
there while another request's pass runs) and go on later. The decode step runs projections,
the MLP and the logits on the (B, 1, hidden) batch and each sequence's attention over its
own context, side by side in one call (attention.SideBySide) or one at a time.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import torch
from flexgen.pytorch_backend import TorchTensor
from flexgen.utils import ValueHolder

from ..models.base import dense
from ..models.runtime import Runtime
from ..request import RequestStats
from ..sampling import Sampler
from .attention import LaneCalls, attend, plan_rows
from .family import FamilyMath
from .kv_home import KVHome
from .lane import Lane, PrefillPass
from .prefix_kv import PrefixKV
from .scores import score_hidden, step_scores
from .sequence import PiecesKV, decode_context
from .pass_reads import PassReads
from .weight_stream import WeightStream
from .block import Sides, again, micro_batches


@dataclasses.dataclass
class Picked:
    """A token the runner picked for a sequence: the token, the copy of its logits row the
    request keeps (keep_logits), its (token, lp, top k) scores (logprobs), and for a first
    token its (1, vocab) logits on the host (query logits are made after it)."""

    token: int
    row: torch.Tensor | None = None
    scores: tuple | None = None
    logits: torch.Tensor | None = None


class Runner:
    def __init__(self, runtime: Runtime, math: FamilyMath, prefix: PrefixKV, device, dtype,
                 kv_bytes_per_token_layer: int):
        self.model = runtime.model
        self.flex_policy = runtime.policy   # FlexGen's: compress_cache decides the context
        self.compute = self.model.layers[0].compute
        self.math = math
        self.prefix = prefix
        self.store, self.policy = prefix.store, prefix.policy
        self.device, self.dtype = device, dtype
        # Decode steps count the KV they move in fp16 bytes (RequestStats).
        self.kv_bytes_per_token_layer = kv_bytes_per_token_layer
        self.group = math.n_head // math.n_kv_head
        # SDPA on a CPU has no half-precision kernel worth using: decode attends in float32.
        self.work = torch.float32 if device.type == "cpu" else None
        self.side = Sides()
        self.side_by_side = True    # False: sequence by sequence (benchmarks compare the two)
        self.share_reads = True     # False: each sequence of a pass reads its own chunks
        self.weights = WeightStream(self.model, device, runtime.cfg.overlap)
        self.kv_home = KVHome.of(runtime, math.n_layers, device)   # decode contexts' homes
        # The block schedule (--throughput): a decode step's sequences computed in
        # micro-batches of this many, layer by layer (FlexGen's zig-zag order), each layer's
        # weights brought once for all of them; None: the whole batch at once.
        self.micro_batch: int | None = None
        # FlexGen's layers hand their buffer back on the policy's last GPU batch (k).
        self.pop_k = self.flex_policy.num_gpu_batches - 1

    # -- the weights of one layer --------------------------------------------------------------
    def load_weights(self, j: int, stats: RequestStats, ahead: int | None = None,
                     rows=None):
        """Bring layer j's weights to the compute device (FlexGen's placement decides from
        where; with overlap, layer `ahead`'s read starts as j is ready: weight_stream) and
        return them as plain tensors (None for the embedding and the MLP layers, whose
        FlexGen forward takes them from its buffer). `rows`: the token ids the embedding
        (j = 0) will embed, so that a token table on the disk is read for them alone."""
        t0 = time.perf_counter()
        self.weights.bring(j, stats, ahead, rows)
        stats.weights_s += time.perf_counter() - t0
        if j % 2 == 0:
            return None
        return [dense(w) for w, _ in self.model.weight_read_buf[j].pop()]

    def _pass_weights(self, lanes: list, j: int, ahead: int | None = None, rows=None):
        """Layer j's weights brought once for every lane of a pass (each counts the load)."""
        timing = RequestStats()
        weights = self.load_weights(j, timing, ahead=ahead, rows=rows)
        for field in ("weights_s", "weight_wait_s", "weight_bytes"):
            PrefillPass.spend(lanes, field, getattr(timing, field))
        return weights

    # -- prefill ---------------------------------------------------------------------------
    def prefill(self, seqs: list) -> list[tuple]:
        """Every layer over the new tokens of `seqs`; per sequence its per-layer decode
        context, its per-layer (K, V) of positions matched.. (given, then new), the final
        hidden states of its last `n_hidden` positions, and the output weights."""
        p = self.start_pass(seqs)
        try:
            self.run_pass(p)
        finally:
            p.close()
        return self.finish_pass(p)

    def start_pass(self, seqs: list, piece: tuple[int, int] | None = None) -> PrefillPass:
        """A pass over `seqs` (or one scored prompt's `piece`), embedded, its reads started."""
        lanes = []
        # Sequences that matched the same node read its probe keys once (a burst on one
        # system prompt reads them once, not once per request).
        shared_probes = {} if len(seqs) > 1 else None
        # And the chunks they load (pass_reads.py): each read once for all of them.
        reads = PassReads(self.store) if len(seqs) > 1 and self.share_reads else None
        try:
            for seq in seqs:
                lanes.append(Lane(self, seq, shared_probes, piece, reads))
            # The input embedding brought once, with every lane's token rows.
            self._pass_weights(lanes, 0, ahead=1, rows=[
                t for lane in lanes for t in (*lane.front_ids, *lane.new_ids)])
            held = self.model.weight_read_buf[0].val
            parts = []
            for lane in lanes:
                hidden = self._embed(lane.new_ids, lane.total, lane.stats, held)
                if lane.front:
                    head = self._embed(list(lane.front_ids), lane.front, lane.stats, held)
                    hidden.val = TorchTensor.create_from_torch(
                        torch.cat([head.val.data, hidden.val.data], dim=1), self.compute)
                lane.lo = sum(part.shape[1] for part in parts)
                parts.append(hidden.val.data)
                lane.hi = lane.lo + hidden.val.data.shape[1]
            if len(parts) > 1:
                hidden.val = TorchTensor.create_from_torch(torch.cat(parts, dim=1), self.compute)
            groups, rows = plan_rows([(lane.lo, lane.positions[0], lane.canonical_end)
                                      for lane in lanes], lanes[-1].hi, self.device)
        except BaseException:
            PrefillPass(lanes, None, [], reads).close()
            raise
        for lane, lane_rows in zip(lanes, rows):
            lane.rows = lane_rows
        for group in groups:
            group.rope = self.math.rope(group.positions, hidden.val.data.dtype)
        return PrefillPass(lanes, hidden, groups, reads)

    def run_pass(self, p: PrefillPass, pause: Callable[[], bool] | None = None) -> bool:
        """Run the pass's layers; False when `pause()`, asked after each layer, stopped it
        there (the next call goes on from the next layer)."""
        for layer in range(p.layer, self.math.n_layers):
            # The next layer's probe keys, and the chunks it is expected to load, are read
            # while this layer computes.
            for lane in p.lanes:
                lane.read_ahead(layer + 1)
            j = 1 + 2 * layer
            self._prefill_attention(p, layer, self._pass_weights(p.lanes, j, ahead=j + 1))
            p.drop(layer)
            self._pass_weights(p.lanes, j + 1, ahead=j + 2)
            self._prefill_mlp(p, 2 + 2 * layer)
            p.layer = layer + 1
            if pause is not None and pause():
                return False
        return True

    def finish_pass(self, p: PrefillPass) -> list[tuple]:
        """Per lane (kept, new_kv, last hidden states, output weights), once run."""
        out_w = self._pass_weights(p.lanes, len(self.model.layers) - 1)
        data = p.hidden.val.data
        out = []
        for lane in p.lanes:
            lane.stats.layers = self.math.n_layers
            out.append((lane.kept, lane.new_kv, data[0, lane.hi - lane.n_hidden:lane.hi],
                        out_w))
        return out

    def _prefill_attention(self, p: PrefillPass, layer: int, weights) -> None:
        """Project every row (together), each lane's attention (its own), then the output
        projection and residual (together); "together" is one call per row group (one,
        unless an exact policy's rows go by canonical tiles)."""
        t0 = time.perf_counter()
        x = p.hidden.val.data
        q, k_new, v_new = self._qkv(weights, x, p.groups)
        p.spent("compute_s", time.perf_counter() - t0)
        calls = LaneCalls(self.attend)      # the lanes' canonical calls, shape by shape
        attn = [lane.attend(self, layer, q[:, :, lane.lo:lane.hi], k_new[:, :, lane.lo:lane.hi],
                            v_new[:, :, lane.lo:lane.hi], calls) for lane in p.lanes]
        t0 = time.perf_counter()
        calls.run()
        attn = attn[0] if len(attn) == 1 else torch.cat(attn, dim=2)
        p.hidden.val = TorchTensor.create_from_torch(self._out(weights, attn, x, p.groups),
                                                     self.compute)
        p.spent("compute_s", time.perf_counter() - t0)

    def _prefill_mlp(self, p: PrefillPass, j: int) -> None:
        """The MLP of every row, one call per row group, over the weights brought once."""
        t0 = time.perf_counter()
        groups = p.groups
        if len(groups) == 1 and groups[0].index is None:
            self._forward(j, p.hidden)
        else:
            buf = self.model.weight_read_buf[j]
            held = buf.val
            x = p.hidden.val.data
            out = torch.empty_like(x)
            for g in groups:
                if buf.val is None:          # the layer's forward takes the weights out
                    buf.store(held)
                part = ValueHolder()
                part.store(TorchTensor.create_from_torch(g.gather(x, 1), self.compute))
                self._forward(j, part)
                g.scatter(out, part.val.data, 1)
            p.hidden.val = TorchTensor.create_from_torch(out, self.compute)
        p.spent("compute_s", time.perf_counter() - t0)

    def _qkv(self, weights, x, groups):
        """q, k, v of every row, one call per group (attention.plan_rows)."""
        if len(groups) == 1 and groups[0].index is None:
            return self.math.qkv(weights, x, groups[0].positions, groups[0].rope)
        out = None
        for g in groups:
            parts = self.math.qkv(weights, g.gather(x, 1), g.positions, g.rope)
            if out is None:
                out = [part.new_empty(*part.shape[:2], x.shape[1], part.shape[3])
                       for part in parts]
            for whole, part in zip(out, parts):
                g.scatter(whole, part, 2)
        return out

    def _out(self, weights, attn, x, groups):
        """The output projection and residual of every row, one call per group."""
        if len(groups) == 1 and groups[0].index is None:
            return self.math.out(weights, attn, x)
        out = torch.empty_like(x)
        for g in groups:
            g.scatter(out, self.math.out(weights, g.gather(attn, 2), g.gather(x, 1)), 1)
        return out

    def attend(self, q, keys, values, mask, causal_tail: int, front: int = 0) -> torch.Tensor:
        """`attention.attend` with this model's head grouping on the compute device."""
        return attend(q, keys, values, mask, causal_tail, front, group=self.group,
                      device=self.device)

    def _embed(self, ids, total_len: int, stats, held) -> ValueHolder:
        """`ids` embedded by layer 0's weights `held` (brought for the pass)."""
        again(self.model.weight_read_buf[0], held)
        with stats.timer("compute_s"):
            hidden, mask = ValueHolder(), ValueHolder()
            hidden.store(TorchTensor.create_from_torch(
                torch.tensor([ids], dtype=torch.int64, device=self.device), self.compute))
            mask.store(TorchTensor.create_from_torch(
                torch.ones(1, total_len, dtype=torch.bool, device=self.device), self.compute))
            self._forward(0, hidden, mask)
        return hidden

    def _forward(self, j: int, hidden: ValueHolder, mask: ValueHolder | None = None) -> None:
        """FlexGen's own forward of layer j (the embedding, an MLP) over its loaded buffer."""
        self.model.layers[j].forward(hidden, None, self.model.weight_read_buf[j], mask, None,
                                     0, self.pop_k)

    # -- tokens from a prefill ---------------------------------------------------------------
    def first_tokens(self, seqs: list, outs: list[tuple]) -> list[Picked]:
        """Each sequence's first token from its last hidden state (its sampler made now: a
        retry picks the same), with its logprobs when asked."""
        # One product of the output layer for the pass's last rows, as a decode step makes
        # its batch's: its weights go through the CPU's caches once, not once per sequence.
        t0 = time.perf_counter()
        on_device = self.math.logits(outs[0][3], torch.cat([tail[-1:] for *_, tail, _ in outs]))
        logits = on_device.cpu()
        PrefillPass.spend(seqs, "compute_s", time.perf_counter() - t0)
        picked = []
        for i, seq in enumerate(seqs):
            req = seq.request
            seq.sampler = Sampler(req.sampling)
            token = seq.sampler.pick(logits[i])
            scores = step_scores(on_device, [i], [token], [req.logprobs])[0] \
                if req.logprobs is not None else None
            row = logits[i].clone() if req.keep_logits else None
            picked.append(Picked(token, row, scores, logits[i:i + 1].clone()))
        return picked

    def query_logits(self, out: tuple, first: Picked) -> torch.Tensor:
        """The logits of every query position (checks): those before the last, then the
        first token's."""
        _, _, tail, out_w = out
        if len(tail) > 1:
            return torch.cat([self.math.logits(out_w, tail[:-1]).cpu(), first.logits])
        return first.logits

    def score_piece(self, seq, pause: Callable[[], bool] | None = None) -> bool:
        """Prefill a scored prompt's next piece (or go on with the one paused) and score its
        rows; True once the whole prompt is in."""
        scoring = seq.scoring
        lo = scoring.done
        hi = lo + scoring.next_piece
        if scoring.paused is None:
            scoring.paused = self.start_pass([seq], piece=(lo, hi))
        p = scoring.paused
        try:
            if not self.run_pass(p, pause):
                return False
        except BaseException:
            self.close_piece(seq)
            raise
        p.close()
        scoring.paused = None
        (kept, new_kv, tail, out_w), = self.finish_pass(p)
        ids = scoring.ids
        # Row i predicts token lo + i + 1; the prompt's last row predicts the first new
        # token (the choices' own), not a prompt token.
        rows = hi - lo if hi < len(ids) else hi - lo - 1
        if rows:
            with seq.stats.timer("compute_s"):
                scoring.parts.append(score_hidden(
                    functools.partial(self.math.logits, out_w), tail[:rows],
                    ids[lo + 1:lo + 1 + rows], scoring.k, scoring.piece))
        scoring.done = hi
        if scoring.finished:
            scoring.context, scoring.last = None, (kept, new_kv, tail[-1:], out_w)
        else:
            scoring.context = PiecesKV(new_kv)
        return scoring.finished

    def close_piece(self, seq) -> None:
        """Give up a scored prompt's piece under way (its reads waited for)."""
        scoring = seq.scoring
        if scoring is not None and scoring.paused is not None:
            scoring.paused.close()
        if scoring is not None:
            scoring.paused = scoring.context = scoring.last = None

    # -- decode ------------------------------------------------------------------------------
    def start_decode(self, seq, kept) -> None:
        """The sequence's decode context: pages of a decode-phase policy, or per layer the
        kept K, V and mask with room for the tokens to come, at the layer's home."""
        t0 = time.perf_counter()
        seq.pages = self.policy.start_decode(kept, self.math.n_head, self.device)
        extra, group = seq.request.max_new_tokens - 1, self.group
        seq.kv = self.kv_home.contexts(
            kept, extra, group, lambda *kv: decode_context(*kv, extra, group, self.flex_policy),
            lambda layer: seq.pages is not None and seq.pages.handles(layer))
        seq.decode_s = time.perf_counter() - t0

    def decode(self, seqs: list) -> list[Picked]:
        """One decode step: feed each sequence its next input and pick its next token, with
        each layer's weights brought once for all of them (in micro-batches: block.py)."""
        t0 = time.perf_counter()
        stats = RequestStats()   # weight timings of decode are not part of a request's TTFT
        parts = micro_batches(seqs, self.micro_batch)
        steps = [self._decode_inputs(part, m) for m, part in enumerate(parts)]
        self.load_weights(0, stats, ahead=1, rows=[s.next_input() for s in seqs])
        self._each(0, [(hidden, mask) for hidden, mask, *_ in steps])
        ropes = [self.math.rope(pos, h.val.data.dtype) for h, _, pos, _ in steps]
        self.kv_home.start(seqs, 0)
        for layer in range(self.math.n_layers):
            self.kv_home.start(seqs, layer + 1)   # disk contexts read while this computes
            j = 1 + 2 * layer
            weights = self.load_weights(j, stats, ahead=j + 1)
            for part, (hidden, _, positions, side), rope in zip(parts, steps, ropes):
                x = hidden.val.data
                q, k_new, v_new = self.math.qkv(weights, x, positions, rope)
                if side is not None and side.holds(layer):
                    attn = side.attend(layer, q, k_new, v_new, self.work, self.group > 1)
                elif not self.side_by_side or (attn := self.kv_home.attend_side(
                        part, layer, q, k_new, v_new, self.work, self.group > 1)) is None:
                    outs = [self._decode_attention(s, layer, q[i:i + 1], k_new[i], v_new[i])
                            for i, s in enumerate(part)]
                    attn = outs[0] if len(outs) == 1 else torch.cat(outs)
                hidden.val = TorchTensor.create_from_torch(self.math.out(weights, attn, x),
                                                           self.compute)
            self.load_weights(j + 1, stats, ahead=j + 2)
            with stats.timer("compute_s"):
                self._each(j + 1, [(hidden, None) for hidden, *_ in steps])
        out_w = self.load_weights(len(self.model.layers) - 1, stats)
        on_device = torch.cat([self.math.logits(out_w, hidden.val.data[:, -1])
                               for hidden, *_ in steps])
        logits = on_device.cpu()
        for s in seqs:
            s.stats.weight_wait_s += stats.weight_wait_s
            s.stats.weight_bytes += stats.weight_bytes
        elapsed = time.perf_counter() - t0
        picked = []
        for i, s in enumerate(seqs):
            s.decode_s += elapsed
            if s.pages is None:
                s.moved += sum(kv.n for kv in s.kv) * self.kv_bytes_per_token_layer
            # The row is a view of the step's (batch, vocab) logits: kept only as a copy,
            # and only when asked for, so that no step's logits outlive the step.
            row = logits[i].clone() if s.request.keep_logits else None
            picked.append(Picked(s.sampler.pick(logits[i]), row))
        # The log-probabilities asked for: one call for every such row of the batch, on the
        # device; each sequence keeps numbers, not the step's (batch, vocab) logits.
        scored = [i for i, s in enumerate(seqs) if s.request.logprobs is not None]
        if scored:
            rows = step_scores(on_device, scored, [picked[i].token for i in scored],
                               [seqs[i].request.logprobs for i in scored])
            for i, row in zip(scored, rows):
                picked[i].scores = row
        return picked

    def _decode_inputs(self, seqs: list, m: int) -> tuple:
        """A micro-batch's inputs: token ids (embedded by layer 0), the mask FlexGen's input
        layer derives positions from (OPT: row b ends with pos[b] + 1 ones), positions
        and its side-by-side layout (None: one sequence at a time)."""
        dev = self.device
        pos = [s.position + s.steps for s in seqs]
        total = max(pos) + 1
        need = torch.tensor(pos, device=dev)[:, None] + 1
        hidden, mask = ValueHolder(), ValueHolder()
        hidden.store(TorchTensor.create_from_torch(torch.tensor(
            [s.next_input() for s in seqs], dtype=torch.int64, device=dev)[:, None],
            self.compute))
        mask.store(TorchTensor.create_from_torch(
            torch.arange(total, device=dev)[None] >= total - need, self.compute))
        side = self.side.at(m)
        side = side if self.side_by_side and side.hold(seqs, self.math.n_head) else None
        return hidden, mask, torch.tensor(pos, device=dev)[:, None], side

    def _each(self, j: int, inputs: list[tuple]) -> None:
        """FlexGen's forward of layer j (the embedding, an MLP) over each micro-batch's
        (hidden, mask), its weights put back in the buffer between calls."""
        buf = self.model.weight_read_buf[j]
        held = buf.val
        for hidden, mask in inputs:
            again(buf, held)
            self._forward(j, hidden, mask)

    def _decode_attention(self, s, layer: int, q, k_new, v_new) -> torch.Tensor:
        """q (1, H, 1, d) of one sequence's new token over its context plus itself."""
        if s.pages is not None and s.pages.handles(layer):
            keys, values, mask = s.pages.attend_set(layer, q[0, :, 0], k_new, v_new)
            return self.attend(q, keys, values, mask, causal_tail=1)
        return self.kv_home.attend(s.kv[layer], q, k_new, v_new, self.work, self.group > 1,
                                   s.stats)
