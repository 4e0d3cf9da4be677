"""One sequence's part of a prefill pass: its rows of the pass, its positions, its reads
ahead, and its attention at each layer (its policy's choice of its own stored prefix KV,
loaded, then its new tokens over that plus themselves).

Between the projections and the output projection each sequence of a pass goes its own way,
exactly as served alone: its policy plans its prefix KV from its own probe keys, its
chunks come through the tiers (its own match and pins; a chunk another lane of the pass
read is handed over, not read again: pass_reads.py), and its queries attend over its own
prefix plus its own new tokens (causal). The runner's layer loop (runner.py) runs the rest
of each layer once for all lanes (PrefillPass: the lanes, their rows, their shared reads).
"""
from __future__ import annotations

import time

import torch

from .attention import LaneCalls, LaneRows
from .layer_io import ReadAhead
from .pass_reads import PassReads


class Lane:
    """A sequence's rows [lo, hi) of a pass. `piece`: a scored prompt's piece (lo, hi) of
    its prompt, prefilled over the pieces before it; None: the sequence's new tokens over
    its matched (and given) prefix."""

    def __init__(self, runner, seq, shared_probes: dict | None = None,
                 piece: tuple[int, int] | None = None, reads=None):
        self.seq, self.stats = seq, seq.stats
        if piece is None:
            self.new_ids, self.given, self.n_hidden = seq.new_ids, seq.given, seq.n_hidden
            self.segments, self.n_pad, self.front = seq.segments_nodes, seq.request.n_pad, \
                seq.front
            self.front_ids = seq.request.prefix[:seq.front]
            self.canonical_end = seq.canonical_end
            start = seq.matched + (seq.given.n_tokens if seq.given is not None else 0)
        else:
            lo, hi = piece
            scoring = seq.scoring
            self.new_ids, self.given, self.n_hidden = scoring.ids[lo:hi], scoring.context, hi - lo
            self.segments, self.n_pad, self.front, self.front_ids = [], 0, 0, ()
            self.canonical_end = 0
            start = self.given.n_tokens if self.given is not None else 0
        self.total = start + len(self.new_ids)
        device = runner.device
        positions = torch.arange(start, self.total, device=device)
        if self.front:
            positions = torch.cat([torch.arange(self.front, device=device), positions])
        self.positions = positions[None]
        self.ahead = ReadAhead(runner.store, runner.policy, runner.math.n_layers,
                               self.segments, self.stats, front=self.front,
                               shared_probes=shared_probes, device=runner.prefix.select_device,
                               reads=reads)
        self.ahead.start(0)
        if self.given is not None:
            self.given.start(0)
        self.kept, self.new_kv = [], []
        self.lo = self.hi = 0
        self.rows: LaneRows | None = None     # its canonical calls (attention.plan_rows)

    def read_ahead(self, layer: int) -> None:
        """Start `layer`'s reads (its probe keys, the chunks it is expected to load, the
        given KV), while the layer before computes."""
        self.ahead.start(layer)
        if self.given is not None:
            self.given.start(layer)

    def attend(self, runner, layer: int, q, k_new, v_new, calls: LaneCalls) -> torch.Tensor:
        """Its attention at `layer`: its policy's choice of its stored prefix KV, loaded,
        then its new tokens over that plus themselves. Keeps its decode context and the
        (K, V) to store. Canonical rows go by `calls` (the pass's: filled in by its run)."""
        front, stats, n_pad = self.front, self.stats, self.n_pad
        math, device = runner.math, runner.device
        # The policy plans for the new tokens only; the recomputed front needs no prefix.
        prefix_k, prefix_v, prefix_mask = runner.prefix.layer_kv(
            layer, self.segments, q[:, :, front:], k_new[:, :, front:], self.ahead, stats,
            n_pad, front)
        given_kv = ()
        if self.given is not None:
            t0 = time.perf_counter()
            given_kv = self.given.kv(layer, device, runner.dtype)
            stats.load_s += time.perf_counter() - t0
            prefix_k, prefix_v = [*prefix_k, given_kv[0]], [*prefix_v, given_kv[1]]
            prefix_mask = torch.cat([prefix_mask, torch.ones(
                math.n_kv_head, given_kv[0].shape[1], dtype=torch.bool, device=device)], dim=1)
        t0 = time.perf_counter()
        s = k_new.shape[2]
        new_mask = (self.positions[0] >= n_pad)[None].expand(math.n_kv_head, s)
        if self.rows is not None:
            # Canonical: keys in position order (a recomputed front first), tiles and block.
            keys, values, mask = (torch.cat([new[:, :front], *pre, new[:, front:]], dim=1)
                                  for new, pre in ((k_new[0], prefix_k), (v_new[0], prefix_v),
                                                   (new_mask, [prefix_mask])))
            attn = calls.add(q, keys, values, mask, self.rows)
        else:
            # One pass joins the loaded pieces and converts them to the compute dtype.
            keys = torch.cat([*prefix_k, k_new[0]], dim=1)
            values = torch.cat([*prefix_v, v_new[0]], dim=1)
            mask = torch.cat([prefix_mask, new_mask], dim=1)            # (KV, m + s)
            attn = runner.attend(q, keys, values, mask, causal_tail=s, front=front)
        stats.compute_s += time.perf_counter() - t0
        k_mine, v_mine = k_new[0][:, front:], v_new[0][:, front:]
        if given_kv:
            k_mine = torch.cat([given_kv[0].to(k_mine.dtype), k_mine], dim=1)
            v_mine = torch.cat([given_kv[1].to(v_mine.dtype), v_mine], dim=1)
        self.kept.append([keys, values, mask])
        self.new_kv.append((k_mine, v_mine))
        return attn

    def close(self) -> None:
        """Wait for its reads still in flight (a failed request may quarantine next)."""
        self.ahead.close()
        if self.given is not None:
            self.given.close()


class PrefillPass:
    """A prefill pass in progress: its lanes, the hidden states of all their rows, its row
    groups (canonical tiles), the chunk reads its lanes share (None: each its own), and the
    next layer to run."""

    def __init__(self, lanes: list[Lane], hidden, groups: list, reads: PassReads | None = None):
        self.lanes, self.hidden, self.groups, self.reads = lanes, hidden, groups, reads
        self.layer = 0

    def spent(self, field: str, seconds: float) -> None:
        """Time spent once for the whole pass counts in every sequence's stats."""
        self.spend(self.lanes, field, seconds)

    @staticmethod
    def spend(lanes: list, field: str, seconds: float) -> None:
        """Seconds spent once for all of `lanes` (or sequences) count in each one's stats."""
        for lane in lanes:
            setattr(lane.stats, field, getattr(lane.stats, field) + seconds)

    def drop(self, layer: int) -> None:
        """Every lane attended at `layer`: the chunks read for it are let go."""
        for lane in self.lanes:
            lane.ahead.drop(layer)
        if self.reads is not None:
            self.reads.drop(layer)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        if self.reads is not None:
            self.reads.close()
