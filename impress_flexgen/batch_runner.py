"""One decode step for a batch of sequences: the next token of each.

The weights of every layer are brought to the compute device once per step and used for
the whole batch (with offloaded weights, FlexGen's gain: the weight I/O of a step is shared
by every sequence in it). Projections, the MLP and the logits run on the (B, 1, hidden)
batch. Attention runs over each sequence's own context (its own length and mask): the
contexts of a batch live side by side in one buffer per layer (SideBySide), padded to the
longest and masked, so that one attention call serves them all; a batch with a sequence
whose decode-phase policy picks its own pages attends sequence by sequence.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from flexgen.pytorch_backend import TorchTensor
from flexgen.utils import ValueHolder

from .request import RequestStats
from .scores import step_scores
from .sequence import LayerKV, Sequence


class BatchRunner:
    def __init__(self, engine):
        self.engine = engine
        m = engine.math
        self.group = m.n_head // m.n_kv_head
        # SDPA on a CPU has no half-precision kernel worth using: attend in float32 there.
        self.work = torch.float32 if engine.device.type == "cpu" else None
        self.side = SideBySide()
        self.side_by_side = True    # False: request by request (benchmarks compare the two)

    def step(self, seqs: list[Sequence]) -> list[int]:
        """Feed each sequence its next input; returns the token each one picked. Sequences
        whose request said stop, or that reached their last token, are marked done."""
        e = self.engine
        t0 = time.perf_counter()
        stats = RequestStats()   # weight timings of decode are not part of a request's TTFT
        ids = [s.next_input() for s in seqs]
        pos = [s.position + s.steps for s in seqs]
        hidden = self._embed(ids, pos, stats)
        positions = torch.tensor(pos, device=e.device)[:, None]
        rope = e.math.rope(positions, hidden.val.data.dtype)
        side = self.side if self.side_by_side and self.side.hold(seqs, e.math.n_head) \
            else None
        for layer in range(e.math.n_layers):
            weights = e._weights(1 + 2 * layer, stats)
            x = hidden.val.data
            q, k_new, v_new = e.math.qkv(weights, x, positions, rope)
            if side is not None:
                attn = side.attend(layer, q, k_new, v_new, self.work, self.group > 1)
            else:
                outs = [self._attend(s, layer, q[i:i + 1], k_new[i], v_new[i])
                        for i, s in enumerate(seqs)]
                attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            hidden.val = TorchTensor.create_from_torch(e.math.out(weights, attn, x), e.compute)
            e._mlp(2 + 2 * layer, hidden, stats)
        out_w = e._weights(len(e.model.layers) - 1, stats)
        on_device = e.math.logits(out_w, hidden.val.data[:, -1])
        logits = on_device.cpu()
        elapsed = time.perf_counter() - t0
        picked = []
        for i, s in enumerate(seqs):
            s.decode_s += elapsed
            if s.pages is None:
                s.moved += sum(kv.n for kv in s.kv) * e.kv_bytes_per_token_layer
            picked.append(s.accept(logits[i]))
        # The log-probabilities asked for: one call for every such row of the batch, on the
        # device; each sequence keeps numbers, not the step's (batch, vocab) logits.
        scored = [i for i, s in enumerate(seqs) if s.request.logprobs is not None]
        if scored:
            rows = step_scores(on_device, scored, [picked[i] for i in scored],
                               [seqs[i].request.logprobs for i in scored])
            for i, row in zip(scored, rows):
                seqs[i].logprobs.append(row)
        return picked

    def _embed(self, ids: list[int], pos: list[int], stats) -> ValueHolder:
        """The inputs' embeddings at their own positions. The mask is what FlexGen's input
        layer derives positions from (OPT): row b ends with pos[b] + 1 ones."""
        e = self.engine
        e._weights(0, stats)
        dev = e.device
        total = max(pos) + 1
        need = torch.tensor(pos, device=dev)[:, None] + 1
        mask = torch.arange(total, device=dev)[None] >= total - need
        hidden, held = ValueHolder(), ValueHolder()
        hidden.store(TorchTensor.create_from_torch(
            torch.tensor(ids, dtype=torch.int64, device=dev)[:, None], e.compute))
        held.store(TorchTensor.create_from_torch(mask, e.compute))
        e.model.layers[0].forward(hidden, None, e.model.weight_read_buf[0], held, None, 0, 0)
        return hidden

    def _attend(self, s: Sequence, layer: int, q, k_new, v_new) -> torch.Tensor:
        """q (1, H, 1, d) of one sequence's new token over its context plus itself."""
        e = self.engine
        if s.pages is not None and s.pages.handles(layer):
            keys, values, mask = s.pages.attend_set(layer, q[0, :, 0], k_new, v_new)
            return e._attend(q, keys, values, mask, causal_tail=1)
        kv = s.kv[layer]
        kv.append(k_new, v_new)
        keys, values, mask = kv.view()
        work = self.work or q.dtype
        out = F.scaled_dot_product_attention(
            q.to(work), keys[None].to(work), values[None].to(work), attn_mask=mask,
            enable_gqa=self.group > 1)
        return out.to(q.dtype)


class SideBySide:
    """The decode contexts of a batch side by side: per layer K and V (B, KV, cap, d) and
    the mask (B, H, 1, cap) of the keys each head attends, with row b one sequence's
    LayerKV (bound to it, so a step alone or a later batch goes on from the same memory).

    A sequence's context ends at its own length; the positions after it, up to the longest
    in the batch, are masked out, so the one attention call per layer gives each row what
    attending its own context alone gives (to rounding). The buffers are laid out again
    when the batch's members change (a join or a leave), not on every step.
    """

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []       # the members, in row order
        self.layers: list[list] = []   # per layer [K, V, mask, its additive form, lengths,
        #                                longest length]

    def hold(self, seqs: list[Sequence], n_head: int) -> bool:
        """Lay out `seqs` side by side (if not already); False when they cannot be: one
        sequence alone, one whose decode-phase policy attends its own pages, or one whose
        context is compressed (sequence.CompressedKV)."""
        if len(seqs) < 2 or any(s.pages is not None or s.kv is None or
                                any(kv is None or not isinstance(kv, LayerKV) for kv in s.kv)
                                for s in seqs):
            self.seqs, self.layers = [], []
            return False
        if len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs)):
            return True
        self.layers = []
        for j in range(len(seqs[0].kv)):
            ctx = [s.kv[j] for s in seqs]
            n_kv, _, d = ctx[0].k.shape
            cap = max(kv.k.shape[1] for kv in ctx)
            like = ctx[0].k
            keys = like.new_zeros(len(seqs), n_kv, cap, d)
            values = like.new_zeros(len(seqs), n_kv, cap, d)
            mask = torch.zeros(len(seqs), n_head, 1, cap, dtype=torch.bool, device=like.device)
            for b, kv in enumerate(ctx):
                kv.bind(keys[b], values[b], mask[b, :, 0])
            # The same mask as SDPA's additive form, kept beside it: a boolean mask is
            # converted on every call (180 against 112 us per call at 4 rows on a CPU).
            # While the layout holds, only attend() writes the members' masks.
            bias = torch.zeros(mask.shape, dtype=like.dtype, device=like.device)
            bias.masked_fill_(~mask, float("-inf"))
            lengths = torch.tensor([kv.n for kv in ctx], device=like.device)
            self.layers.append([keys, values, mask, bias, lengths, max(kv.n for kv in ctx)])
        self.seqs = list(seqs)
        return True

    def forget(self, seq: Sequence) -> None:
        """A member is done: the buffers go with the batch, not with the next step."""
        if any(s is seq for s in self.seqs):
            self.seqs, self.layers = [], []

    def attend(self, layer: int, q, k_new, v_new, work, gqa: bool) -> torch.Tensor:
        """q (B, H, 1, d), k_new and v_new (B, KV, 1, d): each row's new token over its own
        context plus itself."""
        held = self.layers[layer]
        keys, values, mask, bias, lengths, longest = held
        rows = torch.arange(len(self.seqs), device=keys.device)
        keys[rows, :, lengths] = k_new[:, :, 0]
        values[rows, :, lengths] = v_new[:, :, 0]
        mask[rows, :, 0, lengths] = True
        bias[rows, :, 0, lengths] = 0.0
        lengths += 1
        for s in self.seqs:
            s.kv[layer].n += 1
        end = held[5] = longest + 1          # every row grew by one
        work = work or q.dtype
        out = F.scaled_dot_product_attention(
            q.to(work), keys[:, :, :end].to(work), values[:, :, :end].to(work),
            attn_mask=bias[..., :end].to(work), enable_gqa=gqa)
        return out.to(q.dtype)
