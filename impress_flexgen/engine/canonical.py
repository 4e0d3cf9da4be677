"""Canonical prefill rows: an exact policy's answers never depend on what was stored.

A call's rounding depends on its shape: the same row multiplied in a call of 11 rows and in
one of 539 can differ in its last bits (BLAS picks kernels, blocking and thread splits by
shape), and the attention kernel rounds a query row differently with another number of
queries or keys. An exact policy therefore runs the rows of a prefill pass in calls whose
shapes do not depend on how much of the prompt was stored, nor on the pass's other requests:

- the whole-chunk prefix rows it computes (those a store keeps: positions below `end`, the
  prefix's last chunk boundary) go through every product in calls of exactly TILE rows (the
  pass's such rows one after the other, the last call padded), and attend by tiles of TILE
  positions aligned at multiples of TILE: a tile's queries (padded to TILE) over keys
  [0, tile end) in position order. A row comes out the same whatever else shares its calls,
  so stored KV is the KV a recomputation makes, bit for bit, however the prefix got stored;
- the rest of a request (the prefix's last partial chunk and the query) is never stored: its
  rows go through each product in one call with every other request's such rows (the block),
  and attend in one call over the prefix's KV in position order. A request whose prefix is
  stored runs only this, with the shapes a recomputation of it runs.

The rows of a call do not mix (a product's row depends only on that row and the weights; an
attention row only on its query and the keys it may see, masked keys adding exact zeros).
Several requests' blocks share calls: a batch's answers may differ in the last bits from the
same requests alone.

    groups, lanes = plan_rows([(first_row, positions, end), ...], n_rows, device)
    attn = attend_lane(attend, q, keys, values, mask, lanes[i])
"""
from __future__ import annotations

import dataclasses

import torch

# Rows per call of a product and positions per attention tile: a multiple of every SIMD
# width, rows enough that BLAS runs its blocked kernels, few calls per layer.
TILE = 256


@dataclasses.dataclass
class RowGroup:
    """Rows of a pass computed by one call of each product. `index`: the pass row each slot
    holds (-1: padding), None for every row of the pass in order; `positions` (1, n)."""

    index: torch.Tensor | None
    positions: torch.Tensor
    rope: object = None
    run: tuple[int, int] | None = None       # the slots are pass rows [a, b), no padding

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The group's rows of `x` along `dim`, padding slots zero."""
        if self.index is None:
            return x
        if self.run is not None:
            return x.narrow(dim, self.run[0], self.run[1] - self.run[0])
        pad = self.index < 0
        out = x.index_select(dim, self.index.clamp(min=0))
        if bool(pad.any()):
            out.index_fill_(dim, pad.nonzero()[:, 0], 0)
        return out

    def scatter(self, out: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
        """Put the group's rows of `y` (padding left out) at their rows of `out`."""
        if self.index is None:
            return out.copy_(y)
        if self.run is not None:
            out.narrow(dim, self.run[0], self.run[1] - self.run[0]).copy_(y)
            return out
        real = (self.index >= 0).nonzero()[:, 0]
        out.index_copy_(dim, self.index[real], y.index_select(dim, real))
        return out


def _group(index: torch.Tensor, positions: torch.Tensor, size: int) -> RowGroup:
    """Rows `index` at `positions` as one call of `size` rows (padded at the end)."""
    n = len(index)
    run = (int(index[0]), int(index[0]) + n) if n == size and \
        bool((index[1:] - index[:-1] == 1).all()) else None
    if n < size:
        index = torch.cat([index, index.new_full((size - n,), -1)])
        positions = torch.cat([positions, positions.new_zeros(size - n)])
    return RowGroup(index, positions[None], run=run)


@dataclasses.dataclass
class LaneRows:
    """One request's rows in a pass for its attention: its first rows by tiles (lane-local
    rows, their slots in the tile, the tile's first position), its last `n_block` rows as
    one block."""

    tiles: list[tuple[torch.Tensor, torch.Tensor, int]]
    n_block: int


def plan_rows(lanes: list[tuple[int, torch.Tensor, int]], n_rows: int, device
              ) -> tuple[list[RowGroup], list[LaneRows | None]]:
    """The calls of a pass. `lanes`: per request (its first pass row, the positions of its
    rows in pass order, `end`: its rows at positions below go by tiles; 0: none do, and the
    request's attention is its own affair)."""
    tiled_index, tiled_pos, block_index, block_pos = [], [], [], []
    rows: list[LaneRows | None] = []
    for lo, positions, end in lanes:
        n_tiled = int((positions < end).sum()) if end else 0
        tiled = positions[:n_tiled]
        tiled_index.append(torch.arange(lo, lo + n_tiled, device=device))
        tiled_pos.append(tiled)
        block_index.append(torch.arange(lo + n_tiled, lo + len(positions), device=device))
        block_pos.append(positions[n_tiled:])
        tiles = []
        for t in torch.unique(tiled // TILE).tolist():
            local = ((tiled // TILE) == t).nonzero()[:, 0]
            tiles.append((local, tiled[local] - t * TILE, t * TILE))
        rows.append(LaneRows(tiles, len(positions) - n_tiled) if end else None)
    groups = []
    index, pos = torch.cat(tiled_index), torch.cat(tiled_pos)
    for i in range(0, len(index), TILE):
        groups.append(_group(index[i:i + TILE], pos[i:i + TILE], TILE))
    index, pos = torch.cat(block_index), torch.cat(block_pos)
    if len(index) == n_rows:            # nothing tiled: the pass's rows, as they are
        groups.append(RowGroup(None, pos[None]))
    elif len(index):
        groups.append(_group(index, pos, len(index)))
    return groups, rows


def _upto(x: torch.Tensor, n: int) -> torch.Tensor:
    """x's first n positions (dim 1), zero (False) past its end."""
    if x.shape[1] >= n:
        return x[:, :n]
    return torch.cat([x, x.new_zeros(x.shape[0], n - x.shape[1], *x.shape[2:])], dim=1)


def attend_lane(attend, q, keys, values, mask, lane: LaneRows) -> torch.Tensor:
    """One request's attention: q (1, H, s, d) of its rows over keys, values (KV, total, d)
    and mask (KV, total), all in position order (its rows are the last of them). `attend`:
    attention.attend with the model's grouping (q, keys, values, mask, causal_tail)."""
    out = q.new_empty(q.shape)
    for local, slots, t0 in lane.tiles:
        whole = len(local) == TILE      # a whole tile: its rows, in order
        if whole:
            first = int(local[0])
            q_tile = q[:, :, first:first + TILE].contiguous()
        else:
            q_tile = q.new_zeros(*q.shape[:2], TILE, q.shape[3])
            q_tile[:, :, slots] = q[:, :, local]
        end = t0 + TILE
        part = attend(q_tile, _upto(keys, end), _upto(values, end), _upto(mask, end), TILE)
        if whole:
            out[:, :, first:first + TILE] = part
        else:
            out[:, :, local] = part[:, :, slots]
    if lane.n_block:
        out[:, :, -lane.n_block:] = attend(q[:, :, -lane.n_block:].contiguous(), keys,
                                           values, mask, lane.n_block)
    return out
