"""A hierarchical index over one layer's keys, one tree per KV head, whose leaves are KV pages.

IceCache builds its trees with Prioritized DCI (random projections, sorted projection lists).
This module is a faithful simplification, chosen for what it has to do here (1-4k tokens x 30
layers x 3 KV heads on a CPU, per decode step): a k-means-like tree in the MIPS-transformed
space (policies/mips.py), where Euclidean nearness equals large q.k, so "similar keys share a
page" and "the query's nearest keys" are the same notion.

  * Leaves = physical pages. Tokens are clustered by balanced k-means (capacity <= 16 per
    page; pages start about 3/4 full so inserted tokens can join their nearest page). A page's
    tokens are similar keys from anywhere in the sequence, not consecutive positions.
  * Upper levels: each level holds about 1 in `fanout` nodes of the level below (k-means over
    the child centroids); each child attaches to its nearest node one level up (the k-means
    assignment), as in the paper's tree.
  * Every node keeps its centroid and the radius of a ball around it that holds every key below
    it. A node's score for a transformed query t is t.centroid + radius, an upper bound on
    t.T_K(k) for any key below it (Cauchy-Schwarz, |t| = 1), so a descent that keeps the best
    nodes favours subtrees that *can* hold a top key. DCI's projections would estimate the same
    nearness; at our sizes exact inner products with a few hundred centroids are cheaper than
    maintaining sorted projection lists.
  * Retrieval descends from the top level keeping a field of view of the best nodes per level
    (max(fov_frac * n, fov_min), the paper's rule); at the leaf level `leaf_fov` candidate pages
    (512: every page up to ~6k tokens, 8k tokens per query head beyond) are kept and their
    keys are scored exactly (q.k, raw keys in CPU memory where the index lives) and pages are ranked
    by the attention mass their tokens would get (softmax weights relative to each query head's
    best candidate), summed over the query heads of the KV group, which share the pages. The
    ball bound ranks pages loosely (a wide page scores high whatever its keys), so the leaf
    field of view is much wider than the upper levels': on smollm2-135m at 256 tokens (2k
    context, ~170 pages per head), 48 candidate pages (the fov rule) recall 73% of each head's
    true top-32 keys, 128 recall 80%, every page 82%, and the median step KL to full decoding
    halves only when every page is scored (0.037 / 0.035 / ~0.02), for ~1.5 ms more per layer
    and step on one CPU thread.
  * The descent is vectorised over KV heads and query heads: at each level every node is scored
    and nodes whose parent left the field of view are masked out. That takes the same decisions
    as expanding only the kept nodes' children, and at a few hundred nodes per level one batched
    matrix product is faster in torch than gathering children lists.

Inserts (decode): a token joins its nearest page if that page has a free slot and the token
lies inside the page's ball; otherwise the head's leftover tokens open a new page, attached to
the nearest node one level up. Changed pages are reported so copies on the compute device can be
refreshed. If a new key's norm exceeds the transform's c, c is raised and all centroids and radii
are recomputed from the stored keys (page membership stays; see mips.py).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .mips import MipsTransform


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    page_size: int = 16
    fill: float = 0.75          # initial page fill: room for inserted tokens to join near pages
    fanout: int = 5             # about 1 in `fanout` nodes promoted per level above the pages
    top_nodes: int = 8          # stop adding levels once a level has at most this many nodes
    kmeans_iters: int = 4
    fov_min: int = 30           # field of view per level: max(fov_frac * n, fov_min) nodes
    fov_frac: float = 0.0015
    leaf_fov: int = 512         # candidate pages scored exactly per query head (0: the fov rule)
    head_norm: str = "max"      # page mass per head relative to its best key ("max") or its
                                # share of the head's attention over the candidates ("softmax")


@dataclasses.dataclass
class PagePool:
    """Pages of one layer in CPU memory: (KV, capacity, page_size, d) K and V, slot validity
    and each slot's token position; `count[h]` pages in use by KV head h."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor          # (KV, cap, S) bool
    pos: torch.Tensor            # (KV, cap, S) int64, -1 for empty slots
    count: np.ndarray            # (KV,) pages in use per head

    @classmethod
    def empty(cls, kv: int, cap: int, page: int, d: int, dtype) -> "PagePool":
        cap = max(cap, 1)
        return cls(torch.zeros(kv, cap, page, d, dtype=dtype), torch.zeros(kv, cap, page, d, dtype=dtype),
                   torch.zeros(kv, cap, page, dtype=torch.bool),
                   torch.full((kv, cap, page), -1, dtype=torch.int64), np.zeros(kv, dtype=np.int64))

    @property
    def n_pages(self) -> int:
        return int(self.count.max()) if len(self.count) else 0

    def reserve(self, pages: int) -> None:
        """Room for `pages` pages per head (doubling, so appends stay amortised O(1))."""
        cap = self.k.shape[1]
        if pages <= cap:
            return
        grow = max(pages, 2 * cap) - cap
        pad = lambda t, fill: torch.cat([t, torch.full((t.shape[0], grow) + tuple(t.shape[2:]),
                                                       fill, dtype=t.dtype)], dim=1)
        self.k, self.v = pad(self.k, 0), pad(self.v, 0)
        self.valid, self.pos = pad(self.valid, False), pad(self.pos, -1)

    def page_of_positions(self, n_positions: int) -> torch.Tensor:
        """(KV, n_positions) page holding each token position per head, -1 if none."""
        kv = self.k.shape[0]
        out = torch.full((kv, n_positions), -1, dtype=torch.int64)
        heads, pages, _ = torch.nonzero(self.valid, as_tuple=True)
        out[heads, self.pos[self.valid]] = pages
        return out


def capacity_assign(d2: np.ndarray, cap: np.ndarray, choices: int = 8) -> np.ndarray:
    """Each row (token) to a column (page) with free capacity, preferring near columns.

    Rounds of proposals: every unassigned token proposes to its r-th nearest page; a page
    accepts its nearest proposers up to its free capacity. Tokens left after `choices` rounds go,
    one by one, to their nearest page that still has room."""
    n, p = d2.shape
    free = cap.astype(np.int64).copy()
    assign = np.full(n, -1, dtype=np.int64)
    m = min(choices, p)
    near = np.argpartition(d2, m - 1, axis=1)[:, :m] if m < p else np.tile(np.arange(p), (n, 1))
    near = np.take_along_axis(near, np.argsort(np.take_along_axis(d2, near, 1), 1), 1)
    for r in range(m):
        todo = np.flatnonzero(assign < 0)
        if todo.size == 0:
            break
        choice = near[todo, r]
        order = np.lexsort((d2[todo, choice], choice))
        tok, col = todo[order], choice[order]
        rank = np.arange(len(col)) - np.searchsorted(col, col, side="left")
        ok = rank < free[col]
        assign[tok[ok]] = col[ok]
        free -= np.bincount(col[ok], minlength=p)
    for t in np.flatnonzero(assign < 0):
        row = np.where(free > 0, d2[t], np.inf)
        j = int(np.argmin(row))
        assign[t] = j
        free[j] -= 1
    return assign


def balanced_kmeans(x: torch.Tensor, n_clusters: int, cap: int, iters: int) -> np.ndarray:
    """(n, D) points -> cluster id per point, at most `cap` per cluster. Initialised from
    contiguous runs of points (neighbouring tokens are often similar), so it is deterministic."""
    n = x.shape[0]
    bounds = np.linspace(0, n, n_clusters + 1).round().astype(np.int64)
    init = np.repeat(np.arange(n_clusters), np.diff(bounds))
    cent = _segment_mean(x, torch.from_numpy(init), n_clusters)
    caps = np.full(n_clusters, cap)
    assign = init
    for _ in range(iters):
        d2 = torch.cdist(x, cent).pow(2).numpy()
        assign = capacity_assign(d2, caps)
        new = _segment_mean(x, torch.from_numpy(assign), n_clusters)
        used = torch.from_numpy(np.bincount(assign, minlength=n_clusters) > 0)
        cent = torch.where(used[:, None], new, cent)
    return assign


def kmeans(x: torch.Tensor, weights: torch.Tensor, k: int, iters: int) -> np.ndarray:
    """Plain weighted k-means (upper levels): nearest centroid, no capacity."""
    n = x.shape[0]
    bounds = np.linspace(0, n, k + 1).round().astype(np.int64)
    assign = torch.from_numpy(np.repeat(np.arange(k), np.diff(bounds)))
    for _ in range(iters):
        cent = _segment_mean(x, assign, k, weights)
        assign = torch.cdist(x, cent).argmin(1)
    return assign.numpy()


def _segment_mean(x, seg, k, weights=None):
    w = torch.ones(x.shape[0]) if weights is None else weights.float()
    sums = torch.zeros(k, x.shape[1]).index_add_(0, seg, x * w[:, None])
    tot = torch.zeros(k).index_add_(0, seg, w)
    return sums / tot.clamp_min(1e-12)[:, None]


@dataclasses.dataclass
class Level:
    """One level of nodes for all KV heads: centroid, ball radius, parent one level up."""

    mu: torch.Tensor        # (KV, N, D)
    rad: torch.Tensor       # (KV, N); -inf for unused nodes
    parent: torch.Tensor    # (KV, N) int64 into the level above, -1 for none


class PageIndex:
    """The per-layer index: `pool` holds the pages, `levels[0]` describes them, higher levels
    group them. All KV heads are kept in the same tensors (padded), so searches batch."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 config: IndexConfig = IndexConfig()):
        """keys, values (KV, n, d) of the tokens to index (any device); positions (n,)."""
        cfg = self.config = config
        kv, n, d = keys.shape
        s = cfg.page_size
        keys_f = keys.detach().float().cpu()
        self.transform = MipsTransform.fit(keys_f)
        n_pages = math.ceil(n / max(1, int(s * cfg.fill))) if n else 0
        self.pool = PagePool.empty(kv, max(n_pages, 4), s, d, keys.dtype)
        self.tk = torch.zeros(kv, self.pool.k.shape[1], s, d + 1)     # transformed keys
        if n:
            x = self.transform.keys(keys_f)
            keys_c, values_c = keys.detach().cpu(), values.detach().cpu()
            pos = positions.cpu()
            for h in range(kv):
                assign = torch.from_numpy(balanced_kmeans(x[h], n_pages, s, cfg.kmeans_iters))
                # Slots within a page in position order (any order would do; this one is stable).
                order = torch.from_numpy(np.lexsort((pos.numpy(), assign.numpy())))
                a_sorted = assign[order]
                slot = torch.arange(n) - torch.searchsorted(a_sorted, a_sorted)
                self.pool.k[h, a_sorted, slot] = keys_c[h, order]
                self.pool.v[h, a_sorted, slot] = values_c[h, order]
                self.pool.pos[h, a_sorted, slot] = pos[order]
                self.pool.valid[h, a_sorted, slot] = True
                self.tk[h, a_sorted, slot] = x[h, order]
            self.pool.count[:] = n_pages
        self.levels: list[Level] = []
        self._rebuild_levels()

    # -- structure ------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return int(self.pool.valid.sum())

    def _page_balls(self, heads=None, pages=None):
        """Centroid and radius of pages (all, or the listed (head, page) pairs)."""
        if heads is None:
            tk, valid = self.tk, self.pool.valid
        else:
            tk, valid = self.tk[heads, pages], self.pool.valid[heads, pages]
        w = valid.float()
        cnt = w.sum(-1)
        mu = (tk * w[..., None]).sum(-2) / cnt.clamp_min(1)[..., None]
        dist = (tk - mu[..., None, :]).norm(dim=-1).masked_fill(~valid, -math.inf)
        rad = dist.amax(-1).masked_fill(cnt == 0, -math.inf)
        return mu, rad

    def _rebuild_levels(self) -> None:
        """Page balls, then levels above them by weighted k-means of child centroids."""
        cfg = self.config
        mu, rad = self._page_balls()
        kv, cap = rad.shape
        self.levels = [Level(mu, rad, torch.full((kv, cap), -1, dtype=torch.int64))]
        n_nodes = self.pool.n_pages
        while n_nodes > cfg.top_nodes:
            below = self.levels[-1]
            k = math.ceil(n_nodes / cfg.fanout)
            weights = self.pool.valid.sum(-1).float() if len(self.levels) == 1 else self._counts
            up_mu = torch.zeros(kv, k, mu.shape[-1])
            up_rad = torch.full((kv, k), -math.inf)
            counts = torch.zeros(kv, k)
            for h in range(kv):
                live = torch.nonzero(torch.isfinite(below.rad[h, :n_nodes])).flatten()
                if len(live) == 0:
                    continue
                kk = min(k, len(live))
                assign = torch.from_numpy(kmeans(below.mu[h, live], weights[h, live], kk,
                                                 cfg.kmeans_iters))
                cent = _segment_mean(below.mu[h, live], assign, kk, weights[h, live])
                below.parent[h, live] = assign
                up_mu[h, :kk] = cent
                reach = (below.mu[h, live] - cent[assign]).norm(dim=-1) + below.rad[h, live]
                up_rad[h, :kk] = torch.full((kk,), -math.inf).scatter_reduce(
                    0, assign, reach, "amax")
                counts[h, :kk] = torch.zeros(kk).index_add_(0, assign, weights[h, live])
            self._counts = counts
            self.levels.append(Level(up_mu, up_rad, torch.full((kv, k), -1, dtype=torch.int64)))
            n_nodes = k

    def _grow(self, pages: int) -> None:
        old = self.pool.k.shape[1]
        self.pool.reserve(pages)
        grow = self.pool.k.shape[1] - old
        if grow:
            kv = self.tk.shape[0]
            self.tk = torch.cat([self.tk, torch.zeros(kv, grow, *self.tk.shape[2:])], 1)
            lv = self.levels[0]
            lv.mu = torch.cat([lv.mu, torch.zeros(kv, grow, lv.mu.shape[-1])], 1)
            lv.rad = torch.cat([lv.rad, torch.full((kv, grow), -math.inf)], 1)
            lv.parent = torch.cat([lv.parent, torch.full((kv, grow), -1, dtype=torch.int64)], 1)

    # -- inserts --------------------------------------------------------------------------
    def insert(self, keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor) -> list[tuple[int, int]]:
        """Add tokens (KV, t, d) at `positions` (t,); returns the (head, page) pairs changed."""
        keys_f = keys.detach().float().cpu()
        if self.transform.needs_refit(keys_f):
            stored = self.pool.k[self.pool.valid].float()
            self.transform = MipsTransform.fit(torch.cat([stored, keys_f.reshape(-1, keys.shape[-1])]))
            self.tk[self.pool.valid] = self.transform.keys(stored)
            self.tk[~self.pool.valid] = 0
            refit = True
        else:
            refit = False
        x = self.transform.keys(keys_f)
        keys_c, values_c, pos = keys.detach().cpu(), values.detach().cpu(), positions.cpu()
        s = self.config.page_size
        changed: list[tuple[int, int]] = []
        lv = self.levels[0]
        for h in range(keys.shape[0]):
            n_p = int(self.pool.count[h])
            free = s - self.pool.valid[h, :n_p].sum(-1) if n_p else torch.zeros(0, dtype=torch.int64)
            leftover = []
            if n_p:
                dist = torch.cdist(x[h], lv.mu[h, :n_p])                      # (t, P)
                inside = dist <= lv.rad[h, :n_p][None]
            for j in range(x.shape[1]):
                if n_p:
                    row = dist[j].masked_fill(~inside[j] | (free <= 0), math.inf)
                    p = int(row.argmin())
                    if math.isfinite(float(row[p])):
                        slot = int((~self.pool.valid[h, p]).nonzero()[0])
                        self._put(h, p, slot, keys_c[h, j], values_c[h, j], pos[j], x[h, j])
                        free[p] -= 1
                        changed.append((h, p))
                        continue
                leftover.append(j)
            if leftover:
                p = int(self.pool.count[h])
                self._grow(p + 1)
                for slot, j in enumerate(leftover):
                    self._put(h, p, slot, keys_c[h, j], values_c[h, j], pos[j], x[h, j])
                self.pool.count[h] = p + 1
                changed.append((h, p))
        changed = sorted(set(changed))
        if refit:
            self._rebuild_levels()
            return changed
        if changed:
            heads = torch.tensor([c[0] for c in changed])
            pages = torch.tensor([c[1] for c in changed])
            mu, rad = self._page_balls(heads, pages)
            lv.mu[heads, pages], lv.rad[heads, pages] = mu, rad
            self._attach(heads, pages)
        return changed

    def _put(self, h, p, slot, k, v, pos, x) -> None:
        self.pool.k[h, p, slot], self.pool.v[h, p, slot] = k, v
        self.pool.pos[h, p, slot], self.pool.valid[h, p, slot] = pos, True
        self.tk[h, p, slot] = x

    def _attach(self, heads: torch.Tensor, pages: torch.Tensor) -> None:
        """Changed pages: a new page attaches to its nearest node one level up; every ancestor's
        ball grows to keep holding the page's ball."""
        if len(self.levels) < 2:
            return
        lv0, lv1 = self.levels[0], self.levels[1]
        for h, p in zip(heads.tolist(), pages.tolist()):
            if lv0.parent[h, p] < 0:
                d = (lv1.mu[h] - lv0.mu[h, p]).norm(dim=-1).masked_fill(
                    ~torch.isfinite(lv1.rad[h]), math.inf)
                lv0.parent[h, p] = int(d.argmin())
            child_mu, child_rad, node = lv0.mu[h, p], lv0.rad[h, p], p
            for lvl in range(1, len(self.levels)):
                up = self.levels[lvl]
                par = int(self.levels[lvl - 1].parent[h, node])
                reach = (up.mu[h, par] - child_mu).norm() + child_rad
                up.rad[h, par] = torch.maximum(up.rad[h, par], reach)
                child_mu, child_rad, node = up.mu[h, par], up.rad[h, par], par

    # -- retrieval -------------------------------------------------------------------------
    def field_of_view(self) -> int:
        return max(int(self.config.fov_frac * self.n_tokens), self.config.fov_min)

    def search(self, q: torch.Tensor, n_pages: int) -> torch.Tensor:
        """Query heads q (H, d) -> the best `n_pages` pages per KV head, (KV, n_pages) int64
        page ids, -1 where a head has fewer pages."""
        kv = self.pool.k.shape[0]
        group = q.shape[0] // kv
        qf = q.detach().float().cpu().view(kv, group, -1)
        t = MipsTransform.queries(qf)                                        # (KV, G, D)
        fov = self.field_of_view()
        keep = None
        for i in range(len(self.levels) - 1, -1, -1):
            lv = self.levels[i]
            width = self.pool.n_pages if i == 0 else lv.mu.shape[1]
            score = torch.einsum("kgd,knd->kgn", t, lv.mu[:, :width]) + lv.rad[:, None, :width]
            if keep is not None:
                par = lv.parent[:, :width]
                allowed = torch.gather(keep, 2, par.clamp_min(0)[:, None].expand(-1, group, -1))
                allowed |= (par < 0)[:, None]           # pages inserted before any level existed
                score = score.masked_fill(~allowed, -math.inf)
            f = max(fov, 2 * n_pages) if i == 0 else fov
            if i == 0 and self.config.leaf_fov:
                f = max(self.config.leaf_fov, n_pages)
            top = score.topk(min(f, width), dim=-1)
            keep = torch.zeros_like(score, dtype=torch.bool).scatter_(2, top.indices,
                                                                      torch.isfinite(top.values))
        return top_ids(self.page_mass(qf, top.indices, torch.isfinite(top.values)), n_pages)

    def page_mass(self, qf: torch.Tensor, cand: torch.Tensor, cand_ok: torch.Tensor):
        """Exact scores of candidate pages' keys -> (KV, P) page worth, -inf for pages no head
        proposed. qf (KV, G, d); cand, cand_ok (KV, G, F) candidate pages per query head."""
        kv = cand.shape[0]
        heads = torch.arange(kv)[:, None, None]
        kc = self.pool.k[heads, cand].float()                                # (KV, G, F, S, d)
        exact = torch.einsum("kgd,kgfsd->kgfs", qf, kc) * qf.shape[-1] ** -0.5
        exact = exact.masked_fill(~(self.pool.valid[heads, cand] & cand_ok[..., None]), -math.inf)
        # A page's worth: the attention mass its tokens would get, relative to the head's best
        # candidate (or normalised over the head's candidates), summed over the query heads of
        # the group (they share the pages).
        flat = exact.flatten(2)
        ref = flat.logsumexp(-1) if self.config.head_norm == "softmax" else flat.amax(-1)
        mass = torch.exp(exact - ref[..., None, None]).nan_to_num(0.0).sum(-1)  # (KV, G, F)
        # Pages the descent returned but did not reach (fewer reachable than asked) rank last.
        return torch.full((kv, max(self.pool.n_pages, 1)), -math.inf).scatter_reduce(
            1, cand.reshape(kv, -1), mass.reshape(kv, -1), "sum", include_self=False)


def top_ids(page_score: torch.Tensor, n: int) -> torch.Tensor:
    """(KV, P) scores -> (KV, n) ids of the best finite scores, -1 padded."""
    kv, p = page_score.shape
    k = min(n, p)
    top = page_score.topk(k, dim=-1)
    ids = top.indices.masked_fill(~torch.isfinite(top.values), -1)
    if k < n:
        ids = torch.cat([ids, torch.full((kv, n - k), -1, dtype=torch.int64)], 1)
    return ids
