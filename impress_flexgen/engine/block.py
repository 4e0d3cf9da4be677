"""The block schedule of a decode step (FlexGen's gpu_batch_size x num_gpu_batches): the
step's sequences in micro-batches, computed layer by layer, every micro-batch of a layer
over the weights brought once (FlexGen's zig-zag order: along the batches, then the next
layer). A block shares each weight load among all its sequences, which is what makes an
offloaded model's tokens/s grow with the block; a micro-batch bounds what one layer's
computation holds at a time.

    parts = micro_batches(seqs, size)     # [[seq, ...], ...]
    sides = Sides(); sides.at(m)          # micro-batch m's side-by-side decode contexts
    held = hold(buf); for ...: again(buf, held); forward(...)   # a FlexGen layer, many calls
"""
from __future__ import annotations

from .attention import SideBySide


def micro_batches(seqs: list, size: int | None) -> list[list]:
    """`seqs` in runs of `size` (None: one run of all of them)."""
    if not size or size >= len(seqs):
        return [seqs]
    return [seqs[a:a + size] for a in range(0, len(seqs), size)]


class Sides:
    """One SideBySide layout per micro-batch of the decode step: each keeps its members'
    contexts laid out from step to step while the block's membership holds."""

    def __init__(self) -> None:
        self.layouts: list[SideBySide] = []

    def at(self, m: int) -> SideBySide:
        while len(self.layouts) <= m:
            self.layouts.append(SideBySide())
        return self.layouts[m]

    def forget(self, seq) -> None:
        """A member is done: its micro-batch is laid out again at the next step."""
        for side in self.layouts:
            side.forget(seq)


def again(buf, held) -> None:
    """Put a layer's weights back in its FlexGen buffer for the next micro-batch (FlexGen's
    forward takes them out of it)."""
    if buf.val is None:
        buf.store(held)
