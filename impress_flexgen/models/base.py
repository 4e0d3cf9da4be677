"""What every model of ours adds to FlexGen's OptLM: weights from our sources, fixes, logits."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from flexgen.pytorch_backend import DeviceType, TorchTensor

from ..errors import UserError


def dense(weight):
    """A weight as a plain tensor holder, decompressing FlexGen's group-quantized weights
    (on the device that holds them: the compute device, once load_weight brought them)."""
    if isinstance(weight, TorchTensor) and weight.device.device_type == DeviceType.COMPRESSED:
        return weight.device.decompress(weight)
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x @ weight.T (+ bias): every product of the models goes through here. F.linear is
    the fastest at every row count a decode batch has (1-16) in float32 once one thread
    owns the CPU team (cpu_threads). A few rows in bf16 on a CPU go by `few_rows_bf16`."""
    if weight.dtype == torch.bfloat16 and x.device.type == "cpu" and weight.dim() == 2 \
            and weight.is_contiguous() and x.numel() <= FEW_ROWS * x.shape[-1]:
        return few_rows_bf16(x, weight, bias)
    return F.linear(x, weight, bias)


# Rows up to which a bf16 product on a CPU goes by few_rows_bf16 (a decode batch's).
FEW_ROWS = 16


def few_rows_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear's values for a few rows of bf16 on a CPU, by the kernels that are fast
    there: one row as a matrix-vector product, several as weight @ x.T (the weight's rows
    contiguous, as they lie). F.linear on a bf16 row goes through a general matrix call
    that costs 25-45 us more per product, as much as the product itself at smollm2's sizes
    (a bf16 decode step was slower than a float32 one). Same values, bit for bit: each
    output is one fp32-accumulated dot product of a row with a weight row. Laid out as
    F.linear's too: the reductions of later operations (RMSNorm) round by layout."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        out = (torch.mv(weight, rows[0]) if bias is None else
               torch.addmv(bias, weight, rows[0]))[None]
    else:
        out = (weight @ rows.t() if bias is None else
               torch.addmm(bias[:, None], weight, rows.t())).t().contiguous()
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fuse_rows(weights: list, compute) -> None:
    """Matrices that multiply the same input (q, k, v; gate, up) made one once at load, rows
    after rows: one product a step instead of several. Only where they live, uncompressed,
    on the device that computes them (elsewhere each step brings them apart anyway); each
    keeps its rows as a view of the whole, so placement, bytes and files are unchanged, and
    the first carries the whole as `.fused`."""
    plain = (DeviceType.CPU, DeviceType.CUDA)
    if any(w.device is not compute or w.device.device_type not in plain for w in weights) \
            or len({w.dtype for w in weights}) != 1:
        return
    whole = torch.cat([w.data for w in weights])
    start = 0
    for w in weights:
        w.data = whole[start:start + w.shape[0]]
        start += w.shape[0]
    weights[0].fused = whole


def fused(weight) -> torch.Tensor | None:
    """The fused matrix `weight` leads (fuse_rows), or None."""
    return getattr(weight, "fused", None)


def pick_next_token(logits: torch.Tensor, do_sample: bool, temperature: float) -> torch.Tensor:
    """(batch, vocab) logits -> (batch, 1) token ids."""
    if do_sample and temperature >= 1e-5:
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, num_samples=1)
    return logits.argmax(dim=1, keepdim=True)


class LogitsRecorder:
    """Keeps each generation step's last-position logits when `log` is a list."""

    log: list | None = None

    def record(self, logits: torch.Tensor) -> None:
        if self.log is not None:
            self.log.append(logits.detach().float().cpu())


class FlexGenModel:
    """Mixin for OptLM subclasses. Set `weight_path` before calling OptLM.__init__.

    Fixes two FlexGen 0.1.8 bugs: generation_loop_normal (overlap=False) never waits for
    its asynchronous disk copies, so with disk-resident weights or cache it computes on
    buffers still being filled; and a cache placed on the mixed device never deletes the
    files of its disk segment.
    """

    weight_path: str

    def init_weight(self, j):
        self.layers[j].init_weight(self.weight_home[j], self.weight_path)

    def generation_loop_normal(self):
        from flexgen.timer import timers

        for i in range(self.execute_gen_len):
            timers("generate").start()
            for k in range(self.num_gpu_batches):
                self.update_attention_mask(i, k)
            for j in range(self.num_layers):
                for k in range(self.num_gpu_batches):
                    self.load_weight(i, j, k, overlap=False)
                self.sync()
                for k in range(self.num_gpu_batches):
                    self.load_cache(i, j, k, overlap=False)
                    self.load_hidden(i, j, k)
                    self.sync()
                    self.compute_layer(i, j, k)
                    self.store_hidden(i, j, k)
                    self.store_cache(i, j, k, overlap=False)
                    self.sync()
            timers("generate").stop()
            if self.task.stop and self.stopped.all():
                break

    def delete_cache(self, j, k):
        held = self.cache_home[j][k].pop()
        for x in held or ():
            if x.device is not None and x.device.device_type == DeviceType.MIXED:
                for segment in x.data[0]:
                    if segment is not None:
                        segment.delete()
                x.device = x.data = None
            else:
                x.delete()

    @property
    def output_layer(self):
        return self.layers[-1]

    def __del__(self):
        try:
            self.delete_all_weights()
        except Exception:  # noqa: BLE001 - interpreter teardown; files are in a temp dir
            pass


def allocate_cache(layer, heads: int, head_dim: int, dtype):
    """A layer's K and V cache for FlexGen's current task, in FlexGen's layout (seq, batch *
    heads, head_dim) and in `dtype` (4-bit groups of it with compress_cache), on the device
    its Policy names. A split placement cuts along (batch * heads) in whole multiples of
    `heads`, as FlexGen's mixed device does."""
    policy, task, env = layer.policy, layer.task, layer.env
    shape = (task.prompt_len + task.gen_len - 1, policy.gpu_batch_size * heads, head_dim)
    if policy.cache_gpu_percent == 100:
        device = env.gpu
    elif policy.cache_cpu_percent == 100:
        device = env.cpu
    elif policy.cache_disk_percent == 100:
        device = env.disk
    else:
        n = shape[1]
        gpu = int(n * policy.cache_gpu_percent / 100) // heads * heads
        cpu = (n - gpu if policy.cache_disk_percent == 0 else
               int(n * policy.cache_cpu_percent / 100) // heads * heads)
        lens = [gpu, cpu, n - gpu - cpu]
        return tuple(env.mixed.allocate(shape, dtype, seg_lengths=lens) for _ in range(2))
    if policy.compress_cache:
        return tuple(device.compressed_device.allocate(shape, dtype, policy.comp_cache_config)
                     for _ in range(2))
    return tuple(device.allocate(shape, dtype) for _ in range(2))


def check_compressed_cache(policy) -> None:
    """A compressed cache lives wholly on one device (FlexGen's rule)."""
    whole = (policy.cache_gpu_percent == 100 or policy.cache_cpu_percent == 100
             or policy.cache_gpu_percent + policy.cache_cpu_percent == 0)
    if policy.compress_cache and not whole:
        raise UserError("a compressed KV cache lives wholly on one device (FlexGen's rule): "
                        "give it 100% of the GPU, the CPU or the disk")


def compressed_step(compute, cache: TorchTensor, rows: int) -> torch.Tensor:
    """A decode step's context from a compressed cache: its first `rows` positions (the
    last one free for the new token), decompressed on the compute device."""
    return cache.device.decompress(cache)[:rows]


def compressed_new(compute, context: torch.Tensor, new: torch.Tensor, config) -> TorchTensor:
    """What a decode step stores into a compressed cache: the new positions `new`, or,
    grouped along the sequence, the whole last group of `context` (which ends with them)
    from its start. FlexGen's mha_gen takes the group from `src_s // size * size`, which at
    a group boundary is past the new token: that token was never stored."""
    if config.group_dim == 0:
        start = (context.shape[0] - 1) // config.group_size * config.group_size
        new = context[start:]
    return compute.compressed_device.compress(new, config)


def output_logits(compute, hidden: TorchTensor, norm, w_token) -> torch.Tensor:
    """Logits of the last position only: the others are never needed when generating."""
    x = hidden.data[:, -1:, :]
    return linear(norm(x), dense(w_token).data)[:, -1, :]
