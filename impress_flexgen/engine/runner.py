"""The layer loop of a prefill over FlexGen's weight buffers: each layer's weights placed
by FlexGen's policy, the new tokens projected, the prefix KV the policy chose loaded and
attended, the MLP; the next layer's reads scheduled while this one computes.

    runner = LayerRunner(runtime, math, prefix, device, dtype)
    kept, new_kv, tail, out_w = runner.prefill(new_ids, matched, segments_nodes, stats, 1)
"""
from __future__ import annotations

import time

import torch
from flexgen.pytorch_backend import TorchTensor
from flexgen.utils import ValueHolder

from ..models.base import dense
from ..request import RequestStats
from ..runtime import Runtime
from ..store.readahead import ReadAhead
from .attention import attend
from .family import FamilyMath
from .prefix_kv import PrefixKV


class LayerRunner:
    def __init__(self, runtime: Runtime, math: FamilyMath, prefix: PrefixKV, device, dtype):
        self.model = runtime.model
        self.compute = self.model.layers[0].compute
        self.math = math
        self.prefix = prefix
        self.store, self.policy = prefix.store, prefix.policy
        self.device, self.dtype = device, dtype

    def prefill(self, new_ids, matched, segments_nodes, stats, n_hidden, n_pad=0,
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
            hidden = self.embed(new_ids, total, stats)
            if front:
                head = self.embed(list(front_ids), front, stats)
                hidden.val = TorchTensor.create_from_torch(
                    torch.cat([head.val.data, hidden.val.data], dim=1), self.compute)
            rope = self.math.rope(positions, hidden.val.data.dtype)
            for layer in range(self.math.n_layers):
                # The next layer's probe keys, and the chunks it is expected to load, are
                # read while this layer computes.
                ahead.start(layer + 1)
                if given is not None:
                    given.start(layer + 1)
                kept_kv, kv = self.layer(layer, hidden, positions, rope, segments_nodes,
                                         ahead, stats, n_pad, front, given)
                kept.append(kept_kv)
                new_kv.append(kv)
        finally:
            ahead.close()
            if given is not None:
                given.close()
        out_w = self.weights(len(layers) - 1, stats)
        stats.layers = self.math.n_layers
        return kept, new_kv, hidden.val.data[0, -n_hidden:], out_w

    def layer(self, layer, hidden, positions, rope, segments_nodes, ahead, stats, n_pad,
              front=0, given=None):
        """One transformer layer over the new tokens: project, plan, load, attend, MLP.
        Returns this layer's decode context [K, V, mask] and the (K, V) of positions
        matched.. (given, then new)."""
        weights = self.weights(1 + 2 * layer, stats)
        t0 = time.perf_counter()
        x = hidden.val.data
        q, k_new, v_new = self.math.qkv(weights, x, positions, rope)
        stats.compute_s += time.perf_counter() - t0

        # The policy plans for the new tokens only; the recomputed front needs no prefix.
        prefix_k, prefix_v, prefix_mask = self.prefix.layer_kv(
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
        attn = self.attend(q, keys, values, mask, causal_tail=s, front=front)
        hidden.val = TorchTensor.create_from_torch(self.math.out(weights, attn, x),
                                                   self.compute)
        stats.compute_s += time.perf_counter() - t0
        self.mlp(2 + 2 * layer, hidden, stats)
        k_mine, v_mine = k_new[0][:, front:], v_new[0][:, front:]
        if given_kv:
            k_mine = torch.cat([given_kv[0].to(k_mine.dtype), k_mine], dim=1)
            v_mine = torch.cat([given_kv[1].to(v_mine.dtype), v_mine], dim=1)
        return [keys, values, mask], (k_mine, v_mine)

    # -- layer pieces ---------------------------------------------------------------------
    def attend(self, q, keys, values, mask, causal_tail: int, front: int = 0) -> torch.Tensor:
        """`attention.attend` with this model's head grouping on the compute device."""
        return attend(q, keys, values, mask, causal_tail, front,
                      group=self.math.n_head // self.math.n_kv_head, device=self.device)

    def weights(self, j: int, stats: RequestStats):
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

    def embed(self, ids, total_len: int, stats) -> ValueHolder:
        self.weights(0, stats)
        t0 = time.perf_counter()
        hidden, mask = ValueHolder(), ValueHolder()
        hidden.store(TorchTensor.create_from_torch(
            torch.tensor([ids], dtype=torch.int64, device=self.device), self.compute))
        mask.store(TorchTensor.create_from_torch(
            torch.ones(1, total_len, dtype=torch.bool, device=self.device), self.compute))
        self.model.layers[0].forward(hidden, None, self.model.weight_read_buf[0], mask, None, 0, 0)
        stats.compute_s += time.perf_counter() - t0
        return hidden

    def mlp(self, j: int, hidden: ValueHolder, stats) -> None:
        self.weights(j, stats)
        t0 = time.perf_counter()
        self.model.layers[j].forward(hidden, None, self.model.weight_read_buf[j], None, None, 0, 0)
        stats.compute_s += time.perf_counter() - t0
