"""A layer's stored prefix KV as the policy chooses it: the plan, the reads it names, and
the kept rows and attention mask the layer attends with.

    prefix = PrefixKV(store, policy, math, probe_heads, probe_kv_heads, device, dtype,
                      kv_bytes_per_token_layer)
    keys, values, mask = prefix.layer_kv(layer, segments_nodes, q, k_new, ahead, stats, n_pad)

The policy selects on `select_device`, the compute device unless set otherwise (a check may
point it elsewhere to see that every tensor selection touches is moved there): the queries go
there in float32, the read-ahead moves the probe keys there, and only the plan (chunk ids,
per-token masks and scores) comes back to the host, in one copy per layer.
"""
from __future__ import annotations

import numpy as np
import torch

from policies import LayerContext, LayerPlan, Segment, ServingPolicy
from policies.base import chunks_holding, join_chunks, tokens_of_chunks

from ..store import PrefixStore
from ..tiers import ChunkLoad
from .family import FamilyMath
from .layer_io import LayerLoader


class PrefixKV:
    def __init__(self, store: PrefixStore | None, policy: ServingPolicy, math: FamilyMath,
                 probe_heads: tuple[int, ...], probe_kv_heads: tuple[int, ...], device, dtype,
                 kv_bytes_per_token_layer: int, select_device=None):
        self.store = store
        self.policy = policy
        self.config = policy.config
        self.math = math
        self.probe_heads, self.probe_kv_heads = probe_heads, probe_kv_heads
        self.device, self.dtype = device, dtype
        self.select_device = torch.device(select_device or device)
        self.kv_bytes_per_token_layer = kv_bytes_per_token_layer

    def layer_kv(self, layer, segments_nodes, q, k_new, ahead, stats, n_pad, front=0):
        """The policy's choice of this layer's stored prefix KV, loaded: K and V as lists
        of (KV, m_i, d) pieces on the compute device (to be concatenated) and a (KV, m)
        mask of which tokens each KV head attends. Tokens before `front` are recomputed:
        never loaded."""
        if not segments_nodes:
            return [], [], torch.zeros(self.math.n_kv_head, 0, dtype=torch.bool,
                                       device=self.device)
        loader = ahead.loader(layer)
        segments = loader.segments
        at = self.select_device
        # The probe keys were read ahead (while the layer before computed): the policy is
        # handed them, and waits here only for what is left of that read.
        probe = loader.read_probe() if ahead.probes(layer) else None
        ctx = LayerContext(layer, q[0].to(at, torch.float32), k_new[0].to(at, torch.float32),
                           segments, self.config, self.probe_heads, self.probe_kv_heads,
                           probe, loader.load, n_pad=n_pad, front=front)
        # The policy's probe reads and loads are counted as I/O, not as selection (on a GPU
        # the timer waits for the device: scoring a policy does not use is still paid).
        with stats.timer("select_s", exclude=("probe_s", "load_s"), sync=at):
            plan = self.policy.plan_layer(ctx)
        stats.layers_fallback += int(plan.fallback)
        if plan.jaccard is not None:
            stats.jaccard.append(plan.jaccard)
        return self.gather(plan, segments, loader, ahead, stats, n_pad, front)

    def gather(self, plan: LayerPlan, segments, loader: LayerLoader, ahead, stats, n_pad,
               front=0):
        firsts = [max(0, front - seg.start) for seg in segments]
        chosen = [chunks_holding(seg, np.intersect1d(plan.chunks_k[si], plan.chunks_v[si]),
                                 firsts[si]) for si, seg in enumerate(segments)]
        # Every segment's K and V reads go out together; while they are in flight the next
        # layer's probe keys (read since this layer began) are decoded.
        pending = loader.start_all([(si, {"k": ids, "v": ids})
                                    for si, ids in enumerate(chosen) if len(ids)])
        with stats.timer("probe_s", sync=self.select_device):
            ahead.decode_probe(loader.layer + 1)
        loaded = loader.finish_all(pending)
        ks, vs, masks = [], [], []
        attended = 0
        for si, seg in enumerate(segments):
            ids = chosen[si]
            if firsts[si] < seg.used and not getattr(seg.node, "exact", True):
                stats.exact = False       # loaded KV that was itself computed sparsely
            if len(ids) == 0:
                if stats.exact and not self.covers(seg, firsts[si], n_pad, None, None):
                    stats.exact = False
                continue
            rows, logical = tokens_of_chunks(seg, ids, firsts[si])
            if self.policy.exact_reads and np.any(np.diff(logical) < 0):
                # An exact reader attends in position order, as a recomputation does.
                order = np.argsort(logical, kind="stable")
                rows, logical = rows[order], logical[order]
            ks += self.rows(loaded[si]["k"], rows)
            vs += self.rows(loaded[si]["v"], rows)
            if plan.attend[si] is None:
                mask = np.ones((self.math.n_kv_head, len(rows)), dtype=bool)
            else:
                mask = np.asarray(plan.attend[si])[:, logical]
            if n_pad:
                mask = mask & (seg.start + logical >= n_pad)[None]
            if stats.exact and not self.covers(seg, firsts[si], n_pad, logical, mask):
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
    def covers(seg, first: int, n_pad: int, logical, mask) -> bool:
        """Does every KV head attend every (unpadded) prefix token of `seg` from `first` on?
        (Not: the new KV is approximate.)"""
        if first >= seg.used:
            return True
        seen = np.zeros(seg.used, dtype=bool)
        seen[:max(0, min(seg.used, n_pad - seg.start))] = True     # padding: never attended
        if logical is not None:
            seen[logical[mask.all(axis=0)]] = True
        return bool(seen[first:].all())

    def rows(self, chunks: list[torch.Tensor], rows: np.ndarray) -> list[torch.Tensor]:
        """Loaded chunks, concatenated, keep the rows holding prefix tokens: as pieces on
        the compute device. On a CPU, chunks wholly inside the prefix stay separate: the
        layer's one cat() joins and converts them. On a GPU, the tier's copies are there
        already and the rest come over in one copy."""
        whole = len(rows) == sum(c.shape[1] for c in chunks) and bool(np.all(np.diff(rows) > 0))
        if whole and self.device.type == "cpu" and all(c.device.type == "cpu" for c in chunks):
            return chunks
        joined = join_chunks(chunks, self.device)
        if not whole:
            joined = joined[:, torch.from_numpy(rows).to(self.device)]
        return [joined.to(self.dtype)]

    def full_prefix_context(self, segments_nodes, new_kv, stats, n_pad):
        """Decode over the whole prefix: reload every chunk (after time to first token)."""
        kept = []
        for layer, (k_new, v_new) in enumerate(new_kv):
            segments = [Segment(n, u, self.store.entry(n, layer)) for n, u in segments_nodes]
            ks, vs = [], []
            for seg in segments:
                ids = seg.all_chunks()
                rows, _ = tokens_of_chunks(seg, ids)
                for kind, out in (("k", ks), ("v", vs)):
                    chunks, _ = self.store.tiers.wait(self.store.tiers.submit(
                        ChunkLoad(seg.entry, {kind: ids}, node=seg.node)))
                    chunks = chunks[kind]
                    joined = join_chunks(chunks, self.device)
                    out.append(joined[:, torch.from_numpy(rows).to(self.device)]
                               .to(self.dtype))
            keys = torch.cat(ks + [k_new], 1)
            values = torch.cat(vs + [v_new], 1)
            valid = torch.arange(keys.shape[1], device=self.device) >= n_pad
            kept.append([keys, values, valid[None].expand(keys.shape[0], -1).clone()])
        return kept
