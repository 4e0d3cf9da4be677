"""Decode-phase page selection: what icecache, quest and the page baselines share.

After prefill the engine hands a decode policy the whole context (`kept[layer] = [K, V, mask]`).
For every layer past the first `dense_layers` this module keeps

  * the sink (first pages) and the recent window (last pages) on the compute device: they are
    attended at every step and the window is where new tokens land;
  * everything in between as pages of at most 16 tokens in CPU memory (off the compute device
    when there is one), organised by a `PageSelector`: semantic pages under an index (icecache)
    or position-ordered pages (quest, random, window-only);

and, at each decode step, asks the selector for the best pages under the token budget, gathers
the ones not already on the device into one contiguous buffer, copies it in one transfer and
hands the engine [sink | selected pages | window] with a mask of the valid slots (pages can be
partly filled). Attention over that set is exact attention with s_ij = 0 for unselected tokens.

When the window grows past its pages, its oldest 16 tokens go to CPU memory and are inserted
into the selector's structure; changed pages are dropped from the device copy so they are
fetched again. Options: layer reuse (one selection shared by `reuse_layers` consecutive layers:
the followers take, in their own pages, the pages holding most of the tokens the leader chose,
since semantic pages differ per layer) and prefetch (see `PagedDecode._prefetch`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import torch

from .page_index import IndexConfig, PagePool, top_ids


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    page_size: int = 16
    sink_pages: int = 1          # always attended, stay on the compute device
    window_pages: int = 3        # recent tokens, on the compute device; new tokens land here
    dense_layers: int = 2        # the first layers attend over the whole context
    reuse_layers: int = 1        # 3: one selection serves 3 consecutive layers (IceCache(r))
    prefetch: bool = False       # select the next layer's pages in a thread during this layer
    recall_k: int = 0            # > 0: measure recall of the true top-k keys (evaluation only)
    seed: int = 0
    index: IndexConfig = IndexConfig()

    def __post_init__(self):
        if self.page_size != self.index.page_size:
            raise ValueError("page_size must equal the index's page size")
        if self.reuse_layers < 1 or self.dense_layers < 0:
            raise ValueError("reuse_layers must be >= 1 and dense_layers >= 0")


@dataclasses.dataclass(frozen=True)
class BudgetSplit:
    sink_pages: int
    window_pages: int
    retrieved_pages: int


def split_budget(budget_tokens: int, cfg: DecodeConfig, window_only: bool = False) -> BudgetSplit:
    """Pages of the budget: 1 sink + 3 window + the rest retrieved (256 tokens: 1 + 3 + 12).
    Small budgets cap sink and window at a quarter of the pages each so that something is still
    retrieved (128: 1 + 2 + 5, 64: 1 + 1 + 2). One sink page holds the first tokens, where the
    attention sinks are; recent tokens are worth more than a second sink page (smollm2-135m, 256
    tokens: mean step KL to full decoding 0.032 with 2 + 2, 0.024 with 1 + 3). `window_only`
    gives the retrieved pages to the window instead (the StreamingLLM-like baseline)."""
    pages = max(2, budget_tokens // cfg.page_size)
    sink = min(cfg.sink_pages, pages // 4)
    window = max(1, min(cfg.window_pages, pages // 4))
    if window_only:
        return BudgetSplit(sink, pages - sink, 0)
    return BudgetSplit(sink, window, pages - sink - window)


def fit_tokens(pool: PagePool, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """Ranked page ids (KV, m) -> the leading pages whose valid tokens fit `tokens`, per
    head, kept pages first, -1 padded to the widest head."""
    heads = torch.arange(ids.shape[0])[:, None]
    sizes = pool.valid[heads, ids.clamp_min(0)].sum(-1).masked_fill(ids < 0, 0)
    keep = (sizes.cumsum(1) <= tokens) & (ids >= 0)
    order = torch.argsort((~keep).int(), dim=1, stable=True)
    ids = torch.gather(ids.masked_fill(~keep, -1), 1, order)
    return ids[:, : max(int(keep.sum(1).max()), 1)]


class PageSelector:
    """Organises one layer's middle tokens into pages (`build`, `insert`) and picks pages for
    a query (`select`). The structure it returns from `build` has a `.pool` (PagePool)."""

    name = "pages"

    def __init__(self, config: DecodeConfig):
        self.config = config

    def build(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        raise NotImplementedError

    def insert(self, struct, keys, values, positions) -> list[tuple[int, int]]:
        """New tokens into the structure; returns the (KV head, page) pairs that changed.
        Position-ordered pages append; an index overrides this."""
        return struct.append(keys, values, positions)

    def select(self, struct, q: torch.Tensor, n_pages: int, layer: int, step: int) -> torch.Tensor:
        """q (H, d) -> (KV, n_pages) page ids, -1 padded."""
        raise NotImplementedError


class PositionalPages:
    """Position-ordered pages of 16 tokens (every KV head the same), for quest and baselines."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 page_size: int):
        kv, n, d = keys.shape
        self.page_size = page_size
        self.pool = PagePool.empty(kv, max(4, -(-n // page_size)), page_size, d, keys.dtype)
        self.append(keys, values, positions)

    def append(self, keys, values, positions) -> list[tuple[int, int]]:
        """New pages from consecutive tokens; returns the (head, page) pairs created."""
        kv, n, _ = keys.shape
        s = self.page_size
        first = self.pool.n_pages
        pages = -(-n // s)
        self.pool.reserve(first + pages)
        idx = torch.arange(n)
        page, slot = first + idx // s, idx % s
        self.pool.k[:, page, slot] = keys.detach().cpu()
        self.pool.v[:, page, slot] = values.detach().cpu()
        self.pool.pos[:, page, slot] = positions.cpu()
        self.pool.valid[:, page, slot] = True
        self.pool.count[:] = first + pages
        return [(h, p) for h in range(kv) for p in range(first, first + pages)]


@dataclasses.dataclass
class DecodeCounters:
    steps: int = 0
    bytes_moved: int = 0          # K + V bytes of pages copied to the compute device
    select_s: float = 0.0         # page selection on the critical path (index search, scoring)
    build_s: float = 0.0          # building the per-layer structures after prefill
    recall_hits: int = 0
    recall_total: int = 0

    @property
    def recall(self) -> float | None:
        return self.recall_hits / self.recall_total if self.recall_total else None


@dataclasses.dataclass
class LayerPages:
    sink_k: torch.Tensor          # (KV, s, d) on the compute device
    sink_v: torch.Tensor
    win_k: torch.Tensor           # (KV, w, d) on the compute device
    win_v: torch.Tensor
    win_pos: torch.Tensor         # (w,) positions in the context
    struct: object                # the selector's structure; .pool holds the pages (CPU)
    next_pos: int
    res_ids: torch.Tensor | None = None      # pages on the device from the last step (KV, r)
    res_k: torch.Tensor | None = None
    res_v: torch.Tensor | None = None
    chosen_pos: torch.Tensor | None = None   # positions of the chosen pages' tokens (KV, m)
    last_q: torch.Tensor | None = None       # this layer's query at the previous step
    future: concurrent.futures.Future | None = None


class PagedDecode:
    """One request's decode state; the engine calls `attend_set` for the layers it `handles`."""

    def __init__(self, selector: PageSelector, config: DecodeConfig, budget_tokens: int,
                 kept, n_head: int, device, window_only: bool = False):
        self.selector, self.config = selector, config
        self.split = split_budget(budget_tokens, config, window_only)
        self.device = device
        self.n_head = n_head
        self.counters = DecodeCounters()
        self.step = 0
        self._pool_executor = None
        s = config.page_size
        t0 = time.perf_counter()
        self.layers: list[LayerPages | None] = []
        for layer, (keys, values, mask) in enumerate(kept):
            if layer < config.dense_layers:
                self.layers.append(None)
                continue
            positions = torch.arange(keys.shape[1])
            keep = mask.all(0)     # tokens some KV head may not attend are not carried over
            if not bool(keep.all()):
                keys, values, positions = keys[:, keep], values[:, keep], positions[keep.cpu()]
            n = keys.shape[1]
            n_sink = min(self.split.sink_pages * s, n)
            n_win = min(self.split.window_pages * s, n - n_sink)
            mid = slice(n_sink, n - n_win)
            struct = selector.build(keys[:, mid], values[:, mid], positions[mid])
            self.layers.append(LayerPages(
                keys[:, :n_sink].to(device), values[:, :n_sink].to(device),
                keys[:, n - n_win:].to(device), values[:, n - n_win:].to(device),
                positions[n - n_win:], struct, int(kept[layer][0].shape[1])))
        self.counters.build_s = time.perf_counter() - t0

    def handles(self, layer: int) -> bool:
        return self.layers[layer] is not None

    def _leader(self, layer: int) -> int:
        first = self.config.dense_layers
        return layer - (layer - first) % self.config.reuse_layers

    # -- one layer of one step ---------------------------------------------------------------
    def attend_set(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor):
        """q (H, d) of the new token, its k, v (KV, 1, d) -> keys, values (KV, m, d) and mask
        (KV, m) to attend; the new token is the last key."""
        lp = self.layers[layer]
        prefetched = lp.future.result() if lp.future is not None else None
        lp.future = None
        lp.win_k = torch.cat([lp.win_k, k_new], 1)
        lp.win_v = torch.cat([lp.win_v, v_new], 1)
        lp.win_pos = torch.cat([lp.win_pos, torch.tensor([lp.next_pos])])
        lp.next_pos += 1
        s = self.config.page_size
        if lp.win_k.shape[1] > self.split.window_pages * s:
            # The oldest window page leaves the device for CPU memory and the selector.
            changed = self.selector.insert(lp.struct, lp.win_k[:, :s], lp.win_v[:, :s],
                                           lp.win_pos[:s])
            lp.win_k, lp.win_v, lp.win_pos = lp.win_k[:, s:], lp.win_v[:, s:], lp.win_pos[s:]
            self._invalidate(lp, changed)
            prefetched = None                   # chosen before the new page existed
        t0 = time.perf_counter()
        ids = self._choose(layer, lp, q, prefetched)
        self.counters.select_s += time.perf_counter() - t0
        pk, pv, pvalid = self._fetch(lp, ids)
        kv = lp.win_k.shape[0]
        ones = lambda m: torch.ones(kv, m, dtype=torch.bool, device=self.device)
        keys = torch.cat([lp.sink_k, pk.flatten(1, 2).to(lp.win_k.dtype), lp.win_k], 1)
        values = torch.cat([lp.sink_v, pv.flatten(1, 2).to(lp.win_v.dtype), lp.win_v], 1)
        mask = torch.cat([ones(lp.sink_k.shape[1]), pvalid.flatten(1), ones(lp.win_k.shape[1])], 1)
        return keys, values, mask

    def _last_sparse(self) -> int:
        return max(i for i, x in enumerate(self.layers) if x is not None)

    def _choose(self, layer: int, lp: LayerPages, q: torch.Tensor, prefetched) -> torch.Tensor:
        r = self.split.retrieved_pages
        pool = lp.struct.pool
        kv = pool.k.shape[0]
        if r == 0 or pool.n_pages == 0:
            ids = torch.zeros(kv, 0, dtype=torch.int64)
        elif self._leader(layer) != layer:
            ids = self._follow(lp, self.layers[self._leader(layer)].chosen_pos, r)
        elif r >= pool.n_pages:
            # The budget covers every page: no search (and exactly full attention).
            ids = torch.arange(pool.n_pages).repeat(kv, 1)
            ids = ids.masked_fill(~pool.valid[:, : pool.n_pages].any(-1), -1)
        else:
            # Ask for twice the pages (semantic pages are partly filled) and keep the best
            # ones while their tokens fit the retrieved part of the token budget.
            ids = prefetched if prefetched is not None else \
                self.selector.select(lp.struct, q, 2 * r, layer, self.step)
            ids = fit_tokens(pool, ids, r * self.config.page_size)
        if self._leader(layer) == layer:
            heads = torch.arange(kv)[:, None]
            pos = pool.pos[heads, ids.clamp_min(0)].flatten(1)
            lp.chosen_pos = pos.masked_fill((ids < 0).repeat_interleave(pool.pos.shape[2], 1), -1)
            lp.last_q = q.detach()
            if self.config.recall_k and ids.shape[1]:
                self._recall(lp, q, ids)
            if self.config.prefetch:
                self._prefetch(layer + self.config.reuse_layers)
        if layer == self._last_sparse():
            self.step += 1
        return ids

    def _follow(self, lp: LayerPages, leader_pos: torch.Tensor, r: int) -> torch.Tensor:
        """Layer reuse: this layer's pages ranked by how many of the leader's tokens they hold."""
        pool = lp.struct.pool
        n_pos = int(max(int(pool.pos.max()), int(leader_pos.max()))) + 1
        page_of = pool.page_of_positions(n_pos)
        pages = torch.gather(page_of, 1, leader_pos.clamp_min(0))
        pages = pages.masked_fill(leader_pos < 0, -1)
        counts = torch.zeros(pool.k.shape[0], pool.n_pages + 1).scatter_add_(
            1, pages + 1, torch.ones_like(pages, dtype=torch.float))[:, 1:]
        return top_ids(counts.masked_fill(counts == 0, -float("inf")), r)

    def _prefetch(self, target: int) -> None:
        """Choose `target`'s pages while this layer computes. The target's query is not known
        yet; we predict it with the target layer's own query from the previous step (queries of
        one layer move slowly from token to token, and unlike IceCache's predictor, which runs
        the next layer's q projection on this layer's hidden state, it needs no weights of a
        layer whose weights FlexGen may not have loaded yet). The choice is used as is, except
        when the target's window rolls over this step (then it is redone)."""
        if target >= len(self.layers) or self.layers[target] is None:
            return
        tp = self.layers[target]
        pool = tp.struct.pool
        r = self.split.retrieved_pages
        if tp.last_q is None or r >= pool.n_pages or tp.future is not None:
            return
        if self._pool_executor is None:
            # On this thread alone: a CPU team of its own would slow the decode step's
            # products (impress_flexgen.cpu_threads).
            self._pool_executor = concurrent.futures.ThreadPoolExecutor(
                1, "page-prefetch", initializer=torch.set_num_threads, initargs=(1,))
        tp.future = self._pool_executor.submit(self.selector.select, tp.struct, tp.last_q,
                                               2 * r, target, self.step)

    # -- moving pages ----------------------------------------------------------------------
    def _invalidate(self, lp: LayerPages, changed) -> None:
        if lp.res_ids is None or not changed:
            return
        for h, p in changed:
            lp.res_ids[h][lp.res_ids[h] == p] = -1

    def _fetch(self, lp: LayerPages, ids: torch.Tensor):
        """The chosen pages on the compute device, (KV, r, S, d) K and V and (KV, r, S) valid.
        Pages already there from the last step are reused; the rest are gathered from CPU
        memory into one contiguous buffer and copied in one transfer."""
        pool = lp.struct.pool
        kv, r = ids.shape
        _, _, s, d = pool.k.shape
        out_k = torch.zeros(kv, r, s, d, dtype=pool.k.dtype, device=self.device)
        out_v = torch.zeros_like(out_k)
        need = ids >= 0
        hit = torch.zeros_like(need)
        heads = torch.arange(kv)[:, None].expand(kv, r)
        if lp.res_ids is not None and lp.res_ids.numel() and r:
            eq = (ids[:, :, None] == lp.res_ids[:, None, :]) & need[:, :, None]
            hit = eq.any(-1)
            src = eq.int().argmax(-1)
            h_hit, src_hit = heads[hit].to(self.device), src[hit].to(self.device)
            hit_d = hit.to(self.device)
            out_k[hit_d] = lp.res_k[h_hit, src_hit]
            out_v[hit_d] = lp.res_v[h_hit, src_hit]
        miss = need & ~hit
        if bool(miss.any()):
            h_idx, r_idx = torch.nonzero(miss, as_tuple=True)
            p_idx = ids[h_idx, r_idx]
            buf = torch.stack([pool.k[h_idx, p_idx], pool.v[h_idx, p_idx]])   # (2, M, S, d)
            if self.device.type == "cuda":
                buf = buf.pin_memory().to(self.device, non_blocking=True)
            self.counters.bytes_moved += buf.numel() * 2   # fp16 bytes, as the runtime counts KV
            dst = miss.to(self.device)
            out_k[dst], out_v[dst] = buf[0].to(self.device), buf[1].to(self.device)
        valid = (pool.valid[heads, ids.clamp_min(0)] & need[..., None]).to(self.device)
        lp.res_ids, lp.res_k, lp.res_v = ids.clone(), out_k, out_v
        return out_k, out_v, valid

    # -- evaluation ------------------------------------------------------------------------
    def _recall(self, lp: LayerPages, q: torch.Tensor, ids: torch.Tensor) -> None:
        """Of each query head's true top-k keys among the paged tokens (exact q.k), the
        fraction that lies in the chosen pages."""
        pool = lp.struct.pool
        kv, n = pool.k.shape[0], pool.n_pages
        group = q.shape[0] // kv
        qf = q.detach().float().cpu().view(kv, group, -1)
        scores = torch.einsum("kgd,knsd->kgns", qf, pool.k[:, :n].float())
        scores = scores.masked_fill(~pool.valid[:, None, :n], -float("inf")).flatten(2)
        k = min(self.config.recall_k, scores.shape[-1])
        top = scores.topk(k, dim=-1)
        page = top.indices // pool.k.shape[2]
        found = (page[..., None] == ids[:, None, None, :]).any(-1)
        real = torch.isfinite(top.values)
        self.counters.recall_hits += int((found & real).sum())
        self.counters.recall_total += int(real.sum())

    def close(self) -> DecodeCounters:
        self.counters.steps = self.step
        if self._pool_executor is not None:
            self._pool_executor.shutdown(wait=True)
            self._pool_executor = None
        return self.counters


class PagedDecodePolicyMixin:
    """For ServingPolicy subclasses: `start_decode` builds a PagedDecode from the prefill's
    context with `make_selector()`; budget from ServingConfig.decode_budget."""

    window_only = False

    def __init__(self, config, decode: DecodeConfig | None = None):
        super().__init__(config)
        self.decode = decode or DecodeConfig()

    def make_selector(self) -> PageSelector:
        raise NotImplementedError

    def start_decode(self, kept, n_head: int, device) -> PagedDecode:
        return PagedDecode(self.make_selector(), self.decode, self.config.decode_budget, kept,
                           n_head, device, self.window_only)

    def describe(self) -> dict:
        d = super().describe()
        d.update(decode_budget=self.config.decode_budget,
                 **{k: v for k, v in dataclasses.asdict(self.decode).items() if k != "index"})
        return d
