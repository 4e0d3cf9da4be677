"""Where a sequence's decode context lives: FlexGen's cache percentages, by layer.

    home = KVHome(flex_policy, n_layers, device, root, overlap=True)
    home.where(layer)                       # "gpu", "cpu" or "disk"
    kv = home.context(seq_file, layer, keys, values, mask, extra, group)
    home.start(seqs, layer)                 # the disk layer's reads begin (read ahead)
    out = home.attend(kv, q, k_new, v_new, work, gqa, stats)

The percentages split the layers: the first cache_gpu % of them keep their context on the
compute device (the plain LayerKV of sequence.py, exactly as without a split), the next
cache_cpu % in CPU memory, the rest in a file per sequence. By layer rather than by head:
a GQA model has few KV heads (3 for SmolLM2-135M), too few to split finely, while a layer
is the unit the runner already reads ahead by, and a layer's context wholly in one place is
attended in one call, as it is on the compute device.

A CPU context on a CUDA machine (HostKV) is attended on the CPU with FlexGen's
cpu_cache_compute (the query goes there, the output comes back), else copied to the GPU for
the step. A disk context (DiskKV) keeps only its mask and length in memory: a token's K and
V are written to its file as they are appended, and each step reads the layer back, the
read of layer i + 1 started while layer i computes. A read is a pread into a fresh buffer
with room for the step's new token, which the step attends over and then drops; the bytes
read and the time waited for them count in the request's stats and in /metrics.
"""
from __future__ import annotations

import concurrent.futures
import os
import time
import uuid
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from .attention import attend_context, attend_one
from .sequence import LayerKV, decode_mask


def layer_homes(cache_gpu: float, cache_cpu: float, n_layers: int) -> list[str]:
    """Each layer's home: the first cache_gpu % of the layers "gpu", the next cache_cpu %
    "cpu", the rest "disk" (rounded down as FlexGen rounds its head split; without a disk
    share the CPU takes what the GPU leaves)."""
    gpu = int(n_layers * cache_gpu / 100 + 1e-9)
    cpu = n_layers - gpu if cache_gpu + cache_cpu >= 100 else \
        int(n_layers * cache_cpu / 100 + 1e-9)
    return ["gpu"] * gpu + ["cpu"] * cpu + ["disk"] * (n_layers - gpu - cpu)


class SeqFile:
    """One sequence's disk-homed layers in one file: region r holds disk layer r's K then V,
    each (KV, cap, d) head by head, so that a head's positions 0..n are one run: a step
    reads a layer back as 2 * KV runs straight into the (2, KV, n, d) it attends over (a
    token-major record would need a transpose, and attention over a transposed view is
    several times slower). Removed when the sequence's context is dropped (or at the latest
    with the offload directory)."""

    def __init__(self, root: Path, regions: int, cap: int, heads: int, head_dim: int,
                 elsize: int):
        self.path = root / f"{uuid.uuid4().hex}.kv"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.cap, self.heads, self.row = cap, heads, head_dim * elsize
        self.record = 2 * heads * self.row          # a token's K and V, in bytes
        os.ftruncate(self.fd, regions * cap * self.record)
        self._gone = weakref.finalize(self, _remove, self.fd, self.path)

    def _run(self, region: int, part: int, at: int) -> int:
        """Offset of position `at` of run `part` (K heads, then V heads) of a region."""
        return ((region * 2 * self.heads + part) * self.cap + at) * self.row

    def write(self, region: int, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Positions at..at + t of a region from keys and values (KV, t, d) on the CPU."""
        for i, data in enumerate((keys, values)):
            raw = data.contiguous().view(torch.uint8).numpy()
            for h, run in enumerate(raw.reshape(self.heads, -1)):
                view, offset = memoryview(run), self._run(region, i * self.heads + h, at)
                while view:
                    done = os.pwrite(self.fd, view, offset)
                    view, offset = view[done:], offset + done

    def read(self, region: int, into: torch.Tensor) -> None:
        """The region's first n positions into `into` (2, KV, n, d) on the CPU (a view of
        a larger buffer: each (i, h) row contiguous)."""
        for part in range(2 * self.heads):
            view = memoryview(into[part // self.heads, part % self.heads].view(
                torch.uint8).numpy()).cast("B")
            offset = self._run(region, part, 0)
            while view:
                done = os.preadv(self.fd, [view], offset)
                if done <= 0:
                    raise OSError(f"decode context file {self.path} ended early")
                view, offset = view[done:], offset + done

    def close(self) -> None:
        self._gone()


def _remove(fd: int, path: Path) -> None:
    os.close(fd)
    path.unlink(missing_ok=True)


class DiskKV:
    """One layer's decode context in its sequence's file; `n` positions filled."""

    bound = False

    def __init__(self, file: SeqFile, region: int, keys, values, mask, extra: int, group: int,
                 device):
        kv, m, d = keys.shape
        self.file, self.region, self.device = file, region, device
        self.shape, self.dtype = (2, kv, d), keys.dtype
        self.mask = decode_mask(mask.to(device), m + extra, group)
        self.n = 0
        self.pending: concurrent.futures.Future | None = None
        self._write(keys, values)

    def _write(self, keys, values) -> None:
        """Append K, V (KV, t, d) to the file."""
        self.file.write(self.region, self.n, keys.to("cpu"), values.to("cpu"))
        self.n += keys.shape[1]

    def read(self) -> tuple[torch.Tensor, int]:
        """The context read back, (2, KV, n + 1, d) on the CPU with its last position free
        for the step's token, and the bytes read."""
        buf = torch.empty((2, self.shape[1], self.n + 1, self.shape[2]), dtype=self.dtype,
                          pin_memory=self.device.type == "cuda")
        self.file.read(self.region, buf[:, :, :self.n])
        return buf, self.n * self.file.record

    def start(self, pool) -> None:
        if self.pending is None:
            self.pending = pool.submit(self.read)

    def take(self, k_new, v_new, stats) -> torch.Tensor:
        """The context read back with the new token (KV, 1, d) appended (to the file too):
        (2, KV, n, d) on the compute device."""
        t0 = time.perf_counter()
        buf, nbytes = self.pending.result() if self.pending is not None else self.read()
        self.pending = None
        if buf.shape[2] != self.n + 1:       # read ahead for a step that failed: stale
            buf, nbytes = self.read()
        stats.kv_disk_wait_s += time.perf_counter() - t0
        stats.kv_disk_bytes += nbytes
        buf[0, :, self.n], buf[1, :, self.n] = k_new[:, 0], v_new[:, 0]
        self._write(k_new, v_new)
        return buf.to(self.device, non_blocking=True)

    def attend(self, q, k_new, v_new, work, gqa: bool, stats) -> torch.Tensor:
        """As attend_context: the new token appended (to the file), q over the context."""
        buf = self.take(k_new, v_new, stats)
        mask = None if self.mask is None else self.mask[None, :, None, :self.n]
        return attend_one(q, buf[0], buf[1], mask, work, gqa)


class HostKV:
    """One layer's decode context in CPU memory while the compute device is another: with
    cpu_cache_compute attended on the CPU (FlexGen's choice: the query moves, not the
    context), else copied to the compute device for the step."""

    bound = False

    def __init__(self, keys, values, mask, extra: int, group: int, host, cpu_compute: bool):
        self.inner = LayerKV(keys.to(host), values.to(host), mask.to(host), extra, group)
        self.host, self.cpu_compute = host, cpu_compute
        if host.type == "cpu" and torch.cuda.is_available():
            self.inner.k, self.inner.v = self.inner.k.pin_memory(), self.inner.v.pin_memory()

    @property
    def n(self) -> int:
        return self.inner.n

    def attend(self, q, k_new, v_new, work, gqa: bool, stats) -> torch.Tensor:
        host = self.host
        if self.cpu_compute:
            out = attend_context(self.inner, q.to(host), k_new.to(host), v_new.to(host),
                                 torch.float32 if host.type == "cpu" else None, gqa)
            return out.to(q.device, q.dtype)
        self.inner.append(k_new.to(host), v_new.to(host))
        keys, values, mask = self.inner.view()
        dev = q.device
        return attend_one(q, keys.to(dev, non_blocking=True), values.to(dev, non_blocking=True),
                       None if mask is None else mask.to(dev), work, gqa)


class KVHome:
    """The runner's decode contexts placed by FlexGen's cache percentages. `host`: the
    device of the CPU share (CPU memory; when it is the compute device itself, a CPU share
    is a plain LayerKV, as on a machine without CUDA). `root`: where the disk share's files
    go (a directory of FlexGen's offload scratch, removed with it)."""

    def __init__(self, flex_policy, n_layers: int, device, root: Path | None,
                 overlap: bool = True, host=None):
        self.homes = layer_homes(flex_policy.cache_gpu_percent, flex_policy.cache_cpu_percent,
                                 n_layers)
        self.device = torch.device(device)
        self.host = torch.device(host or "cpu")
        self.cpu_compute = bool(flex_policy.cpu_cache_compute)
        self.compressed = bool(flex_policy.compress_cache)
        self.disk_layers = [j for j, h in enumerate(self.homes) if h == "disk"]
        self.root = root
        self.overlap = overlap
        self.pool = None
        # Since start: decode context bytes read from the disk, seconds waited for them.
        self.bytes_read, self.wait_s = 0, 0.0

    @classmethod
    def of(cls, runtime, n_layers: int, device) -> "KVHome":
        """A runtime's: its policy's percentages, its files in FlexGen's offload scratch."""
        return cls(runtime.policy, n_layers, device,
                   Path(runtime.env.disk.path) / "decode_kv", runtime.cfg.overlap)

    def where(self, layer: int) -> str:
        return self.homes[layer]

    @property
    def in_place(self) -> bool:
        """Every context on the compute device: the runner's path without a split."""
        return self.compressed or all(self.plain(h) for h in self.homes)

    @property
    def held_layers(self) -> int:
        """Layers whose contexts take the compute device's memory (admission counts them)."""
        return len(self.homes) if self.in_place else sum(map(self.plain, self.homes))

    def plain(self, home: str) -> bool:
        return home == "gpu" or (home == "cpu" and self.host == self.device)

    def file(self, n_layers_disk: int, cap: int, keys) -> SeqFile | None:
        """A sequence's file for its disk-homed layers (None: it has none)."""
        if not self.disk_layers:
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        return SeqFile(self.root, n_layers_disk, cap, keys.shape[0], keys.shape[2],
                       keys.element_size())

    def contexts(self, kept: list, extra: int, group: int, make_plain, skip) -> list:
        """Per layer the decode context of kept (K, V, mask) at its home; `make_plain`
        makes a compute-device context (decode_context), `skip(layer)` says a layer needs
        none (a decode-phase policy's pages)."""
        if self.in_place:
            return [None if skip(j) else make_plain(*kept[j]) for j in range(len(kept))]
        disk = [j for j in self.disk_layers if not skip(j)]
        file = self.file(len(disk), kept[disk[0]][0].shape[1] + extra, kept[disk[0]][0]) \
            if disk else None
        out = []
        for j, home in enumerate(self.homes):
            if skip(j):
                out.append(None)
            elif self.plain(home):
                out.append(make_plain(*kept[j]))
            elif home == "cpu":
                out.append(HostKV(*kept[j], extra, group, self.host, self.cpu_compute))
            else:
                out.append(DiskKV(file, disk.index(j), *kept[j], extra, group, self.device))
        return out

    def start(self, seqs: list, layer: int) -> None:
        """Begin reading `layer`'s disk contexts of `seqs` (with overlap; else each is read
        when attended)."""
        if not self.overlap or layer >= len(self.homes) or self.homes[layer] != "disk":
            return
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(4, "kv-home")
        for s in seqs:
            kv = s.kv[layer] if s.kv is not None else None
            if isinstance(kv, DiskKV):
                kv.start(self.pool)

    def attend_side(self, seqs: list, layer: int, q, k_new, v_new, work, gqa: bool):
        """A micro-batch's layer whose contexts are all on disk, attended side by side as
        attention.SideBySide does (one call, each row padded to the longest and masked), so
        that a batch computes the same wherever its contexts live; None when they are not
        all on disk (or one sequence alone). q (B, H, 1, d), k_new and v_new (B, KV, 1, d)."""
        kvs = [s.kv[layer] if s.pages is None and s.kv is not None else None for s in seqs]
        if len(kvs) < 2 or not all(isinstance(kv, DiskKV) for kv in kvs):
            return None
        before = [(s.stats.kv_disk_bytes, s.stats.kv_disk_wait_s) for s in seqs]
        bufs = [kv.take(k_new[b], v_new[b], s.stats) for b, (kv, s) in enumerate(zip(kvs, seqs))]
        for s, (nbytes, wait) in zip(seqs, before):
            self.bytes_read += s.stats.kv_disk_bytes - nbytes
            self.wait_s += s.stats.kv_disk_wait_s - wait
        end, like = max(kv.n for kv in kvs), bufs[0]
        keys = like.new_zeros(len(kvs), like.shape[1], end, like.shape[3])
        values = torch.zeros_like(keys)
        bias = like.new_full((len(kvs), q.shape[1], 1, end), float("-inf"))
        for b, (kv, buf) in enumerate(zip(kvs, bufs)):
            keys[b, :, :kv.n], values[b, :, :kv.n] = buf[0], buf[1]
            allowed = torch.ones(1, kv.n, dtype=torch.bool, device=like.device) \
                if kv.mask is None else kv.mask[:, :kv.n]
            bias[b, :, 0, :kv.n] = torch.zeros((), dtype=like.dtype, device=like.device) \
                .masked_fill(~allowed, float("-inf"))
        work = work or q.dtype
        out = F.scaled_dot_product_attention(q.to(work), keys.to(work), values.to(work),
                                             attn_mask=bias.to(work), enable_gqa=gqa)
        return out.to(q.dtype)

    def attend(self, kv, q, k_new, v_new, work, gqa: bool, stats) -> torch.Tensor:
        """q (1, H, 1, d) of one sequence's new token over its context at any home."""
        if not isinstance(kv, (DiskKV, HostKV)):
            return attend_context(kv, q, k_new, v_new, work, gqa)
        bytes0, wait0 = stats.kv_disk_bytes, stats.kv_disk_wait_s
        out = kv.attend(q, k_new, v_new, work, gqa, stats)
        self.bytes_read += stats.kv_disk_bytes - bytes0
        self.wait_s += stats.kv_disk_wait_s - wait0
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
