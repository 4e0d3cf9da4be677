"""Canonical prefill rows: an exact policy's answers never depend on what was stored.

A product's rounding depends on its shape: the same row multiplied in a call of 11 rows and
in one of 539 rows can differ in its last bits (BLAS picks kernels, blocking and thread
splits by shape), and so can attention over the same keys with another number of queries or
keys. An exact policy therefore computes the rows of a prefill pass in two kinds of calls
whose shapes do not depend on how much of the prompt was stored, nor on the pass's other
requests:

- tiles: the whole-chunk prefix rows it computes (those a store keeps: positions below
  `end`, the prefix's last chunk boundary), by tiles of TILE positions aligned at multiples
  of TILE, each padded to TILE rows; a tile's queries attend keys [0, tile end) in position
  order. Its rows come out the same whatever part of the tile was stored before, so stored
  KV is the KV a recomputation makes, bit for bit;
- the block: the rest of the request (the prefix's last partial chunk and the query), one
  call, over the prefix's KV in position order. A request whose prefix is stored runs only
  this block, with the shapes a recomputation of it runs.

The rows of a call do not mix (a product's row depends only on that row and the weights; an
attention row only on its query and the keys it may see, masked keys adding exact zeros), so
padding rows and other requests' rows change nothing. Several requests' blocks share one
call: a batch's answers may differ in the last bits from the same requests alone.

    groups, lanes_tiles = plan_rows(lanes, n_rows, device)
    attn = attend_lane(attend, q, keys, values, mask, tiles, n_block)
"""
from __future__ import annotations

import dataclasses

import torch

# Positions per tile. Each tile is one call of every product: a multiple of every SIMD
# width, and rows enough that BLAS runs its ordinary blocked kernels.
TILE = 64


@dataclasses.dataclass
class RowGroup:
    """Rows of a pass computed by one call of each product. `index`: the pass row each slot
    holds (-1: padding), None for every row of the pass in order; `positions` (1, n)."""

    index: torch.Tensor | None
    positions: torch.Tensor
    rope: object = None

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The group's rows of `x` along `dim`, padding slots zero (a new tensor)."""
        if self.index is None:
            return x
        pad = self.index < 0
        out = x.index_select(dim, self.index.clamp(min=0))
        if bool(pad.any()):
            out.index_fill_(dim, pad.nonzero()[:, 0], 0)
        return out

    def scatter(self, out: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
        """Put the group's rows of `y` (padding left out) at their rows of `out`."""
        if self.index is None:
            return out.copy_(y)
        real = (self.index >= 0).nonzero()[:, 0]
        out.index_copy_(dim, self.index[real], y.index_select(dim, real))
        return out


@dataclasses.dataclass
class LaneRows:
    """One request's rows in a pass: its first rows go by tiles (lane-local rows, their
    slots, the tile's first position), its last `n_block` rows attend as one block."""

    tiles: list[tuple[torch.Tensor, torch.Tensor, int]]
    n_block: int


def plan_rows(lanes: list[tuple[int, torch.Tensor, int]], n_rows: int, device
              ) -> tuple[list[RowGroup], list[LaneRows | None]]:
    """The calls of a pass. `lanes`: per request (first pass row, positions of its rows in
    pass order, `end`: rows at positions below it go by tiles; 0: the request is not
    canonical and its rows join the block as they are)."""
    groups: list[RowGroup] = []
    rows: list[LaneRows | None] = []
    block_index, block_pos = [], []
    for lo, positions, end in lanes:
        n_tiled = int((positions < end).sum()) if end else 0
        if not end:
            rows.append(None)
        else:
            tiled = positions[:n_tiled]
            tiles = []
            for t in torch.unique(tiled // TILE).tolist():
                local = ((tiled // TILE) == t).nonzero()[:, 0]
                slots = tiled[local] - t * TILE
                index = torch.full((TILE,), -1, dtype=torch.long, device=device)
                index[slots] = lo + local
                groups.append(RowGroup(index, torch.arange(
                    t * TILE, (t + 1) * TILE, device=device)[None]))
                tiles.append((local, slots, t * TILE))
            rows.append(LaneRows(tiles, len(positions) - n_tiled))
        block_index.append(torch.arange(lo + n_tiled, lo + len(positions), device=device))
        block_pos.append(positions[n_tiled:])
    index = torch.cat(block_index)
    if len(index) == n_rows:            # nothing tiled: the pass's rows, as they are
        groups.append(RowGroup(None, torch.cat(block_pos)[None]))
    elif len(index):
        groups.append(RowGroup(index, torch.cat(block_pos)[None]))
    return groups, rows


def _upto(x: torch.Tensor, n: int) -> torch.Tensor:
    """x's first n positions (dim 1), zero (False) past its end: a new contiguous tensor
    of exactly n, so a tile's call has the same layout whatever length x has."""
    if x.shape[1] >= n:
        return x[:, :n].contiguous()
    return torch.cat([x, x.new_zeros(x.shape[0], n - x.shape[1], *x.shape[2:])], dim=1)


def attend_lane(attend, q, keys, values, mask, lane: LaneRows) -> torch.Tensor:
    """One request's attention: q (1, H, s, d) of its rows over keys, values (KV, total, d)
    and mask (KV, total), all in position order (its rows are the last of them). `attend`:
    attention.attend with the model's grouping (q, keys, values, mask, causal_tail)."""
    # Every call gets contiguous tensors: the same layout whichever way q was made.
    out = q.new_empty(q.shape)
    for local, slots, t0 in lane.tiles:
        q_tile = q.new_zeros(*q.shape[:2], TILE, q.shape[3])
        q_tile[:, :, slots] = q[:, :, local]
        end = t0 + TILE
        part = attend(q_tile, _upto(keys, end), _upto(values, end), _upto(mask, end), TILE)
        out[:, :, local] = part[:, :, slots]
    if lane.n_block:
        out[:, :, -lane.n_block:] = attend(q[:, :, -lane.n_block:].contiguous(),
                                           keys.contiguous(), values.contiguous(), mask,
                                           lane.n_block)
    return out
