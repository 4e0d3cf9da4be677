"""The layer pieces of a prefill over FlexGen's weight buffers: each layer's weights placed
by FlexGen's policy, the embedding, attention, the MLP. The layer loop itself, for one
request or several together, is batch_prefill.prefill_pass.

    runner = LayerRunner(runtime, math, prefix, device, dtype)
    kept, new_kv, tail, out_w = runner.prefill(new_ids, matched, segments_nodes, stats, 1)
"""
from __future__ import annotations

import torch
from flexgen.pytorch_backend import TorchTensor
from flexgen.utils import ValueHolder

from .batch_prefill import PassInput, prefill_pass
from ..models.base import dense
from ..request import RequestStats
from ..runtime import Runtime
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
        """Run all layers over the new tokens of one request (batch_prefill.prefill_pass,
        which runs several together); returns per-layer decode context, per-layer (K, V)
        of positions matched.. (the given part, then the new tokens), the final hidden
        states of the last `n_hidden` positions and the output weights that turn them into
        logits.

        `front_ids`: the first prefix tokens, recomputed with the new ones instead of
        loaded (the "both" plan): they attend to each other only. `given`: KV of the
        prefix tokens right after the matched ones, from the shared pool (attended in full)."""
        return prefill_pass(self, [PassInput(new_ids, matched, segments_nodes, stats, n_hidden,
                                             n_pad, front_ids, given)])[0]

    # -- layer pieces ---------------------------------------------------------------------
    def attend(self, q, keys, values, mask, causal_tail: int, front: int = 0) -> torch.Tensor:
        """`attention.attend` with this model's head grouping on the compute device."""
        return attend(q, keys, values, mask, causal_tail, front,
                      group=self.math.n_head // self.math.n_kv_head, device=self.device)

    def weights(self, j: int, stats: RequestStats):
        """Bring layer j's weights to the compute device (FlexGen's placement decides from
        where) and return them as plain tensors."""
        with stats.timer("weights_s"):
            layer = self.model.layers[j]
            layer.load_weight(self.model.weight_home[j], self.model.weight_read_buf[j], 0)
            self.model.env.disk.synchronize()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        if j % 2 == 0:
            return None  # embedding (0) and MLP (even) layers consume their buffer in forward()
        return [dense(w) for w, _ in self.model.weight_read_buf[j].pop()]

    def embed(self, ids, total_len: int, stats) -> ValueHolder:
        self.weights(0, stats)
        with stats.timer("compute_s"):
            hidden, mask = ValueHolder(), ValueHolder()
            hidden.store(TorchTensor.create_from_torch(
                torch.tensor([ids], dtype=torch.int64, device=self.device), self.compute))
            mask.store(TorchTensor.create_from_torch(
                torch.ones(1, total_len, dtype=torch.bool, device=self.device), self.compute))
            self.model.layers[0].forward(hidden, None, self.model.weight_read_buf[0], mask,
                                         None, 0, 0)
        return hidden

    def mlp(self, j: int, hidden: ValueHolder, stats) -> None:
        self.weights(j, stats)
        with stats.timer("compute_s"):
            self.model.layers[j].forward(hidden, None, self.model.weight_read_buf[j], None,
                                         None, 0, 0)

    def mlp_rows(self, j: int, hidden: ValueHolder, groups, stats) -> None:
        """The MLP of every row, one call per row group (canonical.RowGroup), with the
        weights brought once."""
        if len(groups) == 1 and groups[0].index is None:
            return self.mlp(j, hidden, stats)
        self.weights(j, stats)
        buf = self.model.weight_read_buf[j]
        held = buf.val
        x = hidden.val.data
        out = torch.empty_like(x)
        with stats.timer("compute_s"):
            for g in groups:
                if buf.val is None:          # the layer's forward takes the weights out
                    buf.store(held)
                part = ValueHolder()
                part.store(TorchTensor.create_from_torch(g.gather(x, 1), self.compute))
                self.model.layers[j].forward(part, None, buf, None, None, 0, 0)
                g.scatter(out, part.val.data, 1)
        hidden.val = TorchTensor.create_from_torch(out, self.compute)
