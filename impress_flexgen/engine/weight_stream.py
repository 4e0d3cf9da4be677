"""Each layer's weights brought to the compute device for the runner's layer loops, the next
layer's read while this one computes (FlexGen's generation_loop_overlap_*).

    stream.bring(j, stats, ahead=j + 1)   # layer j ready in its buffer; j + 1 being read

A layer's weights go into its own FlexGen buffer (weight_read_buf[j]), so layer j + 1's
copy never writes what layer j computes with: that is the double buffer. The copies are
FlexGen's own: from the disk through its copy threads (models.direct_read: past the page
cache), from the CPU to a GPU on its weight stream. `bring` waits for every copy queued
(FlexGen 0.1.8's plain loop never does, models.base), and only then queues the next
layer's, so a layer is never computed on a buffer still being filled. A buffer already
full (read ahead, by a pass that paused there) is used as it is, never read twice.

With `overlap` off every layer is read when it is needed, and nothing ahead: today's
synchronous path, kept to compare. Both give the same weights, so the same outputs.

The input embedding (layer 0) is brought with the token ids it will embed: where its token
table is on the disk and is read into CPU memory, only those rows are read
(models.direct_read.want_rows); a buffer holding other rows is read again.
"""
from __future__ import annotations

import contextlib
import time

import torch
from flexgen.pytorch_backend import DeviceType

from ..models import direct_read


def _moved(t, compute) -> tuple[int, int]:
    """(bytes a load of weight `t` copies to the compute device, of them from the disk)."""
    dev = t.device
    if dev.device_type == DeviceType.COMPRESSED:
        parts = [_moved(part, compute) for part in t.data[:2]]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    if dev is compute:
        return 0, 0
    n = int(torch.Size(t.shape).numel()) * torch.empty((), dtype=t.dtype).element_size()
    return n, n if dev.device_type == DeviceType.DISK else 0


def _flat(held):
    for x in held:
        if hasattr(x, "val"):          # a ValueHolder (FlexGen's layers without sep_layer)
            yield from _flat(x.val)
        else:
            yield x


class WeightStream:
    def __init__(self, model, device: torch.device, overlap: bool = True):
        self.model, self.overlap = model, overlap
        self.cuda = device.type == "cuda"
        self.n = len(model.layers)
        self.moved = []
        for j in range(self.n):
            compute = model.layers[j].compute
            sizes = [_moved(t, compute) for t in _flat(model.weight_home[j].val)]
            self.moved.append((sum(s[0] for s in sizes), sum(s[1] for s in sizes)))
        # Since start: bytes brought, of them from the disk, and seconds waited for them.
        self.bytes_read = self.disk_bytes = 0
        self.wait_s = 0.0
        # Per layer: the bytes its buffer's load brought, and the rows of a token table
        # read alone (None: whole).
        self.brought = [m[0] for m in self.moved]
        self.rows_held: list[frozenset | None] = [None] * self.n
        self.token_table = self._token_table()

    def _token_table(self):
        """The input embedding's token table where its loads can read rows alone (on the
        disk, loaded into CPU memory, uncompressed, by our copy worker: with CUDA FlexGen's
        own worker copies whole tensors), else None."""
        home = next(_flat(self.model.weight_home[0].val), None)
        dst = getattr(self.model.layers[0], "weight_load_dst", None)
        if (self.cuda or home is None or len(home.shape) != 2 or dst is None
                or home.device.device_type != DeviceType.DISK
                or dst.device_type != DeviceType.CPU):
            return None
        return home

    @property
    def step_bytes(self) -> int:
        """Bytes one pass over every layer brings to the compute device."""
        return sum(m[0] for m in self.moved)

    def _issue(self, j: int, rows=None) -> None:
        """Queue layer j's copies into its buffer (unless it holds them already); `rows`:
        the token ids layer 0 will embed (None: all of them)."""
        buf = self.model.weight_read_buf[j]
        held = self.rows_held[j]
        if buf.val is not None:
            if held is None or (rows is not None and held.issuperset(rows)):
                return
            buf.clear()                       # a read of other rows: read again
        moved, disk = self.moved[j]
        table = self.token_table if j == 0 and rows is not None else None
        runs = None
        if table is not None:
            row_bytes = int(torch.Size(table.shape[1:]).numel()) * \
                torch.empty((), dtype=table.dtype).element_size()
            runs = direct_read.row_runs(rows, table.shape[0], row_bytes)
        if runs is not None:
            direct_read.want_rows(table, rows)
            saved = table.shape[0] * row_bytes - direct_read.rows_bytes(runs, row_bytes)
            moved, disk = moved - saved, disk - saved
        self.rows_held[j] = frozenset(int(r) for r in rows) if runs is not None else None
        stream = getattr(self.model, "load_weight_stream", None) if self.cuda else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.model.layers[j].load_weight(self.model.weight_home[j], buf, 0)
        self.brought[j] = moved
        self.bytes_read += moved
        self.disk_bytes += disk

    def bring(self, j: int, stats, ahead: int | None = None, rows=None) -> None:
        """Layer j's weights in its buffer, every copy done; with overlap, layer `ahead`'s
        copies queued after. The wait counts in `stats` (weight_wait_s) with layer j's bytes
        (weight_bytes: read now or ahead, the same with overlap or not). `rows`: the token
        ids the input embedding (j = 0) will embed."""
        t0 = time.perf_counter()
        self._issue(j, rows)
        self.model.env.disk.synchronize()
        if self.cuda:
            torch.cuda.synchronize()
        waited = time.perf_counter() - t0
        if self.overlap and ahead is not None and ahead < self.n:
            self._issue(ahead)
        self.wait_s += waited
        stats.weight_wait_s += waited
        stats.weight_bytes += self.brought[j]
