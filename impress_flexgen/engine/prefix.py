"""A sequence's stored prefix: opened before its prefill, closed after its first token.

    prefixes.open(seq, attempt, use_shared)   # match (pinned), shared pool, plan
    ...                                       # the prefill pass loads what the plan keeps
    prefixes.close(seq, new_kv)               # its new whole chunks stored behind its
                                              # decode steps, then unpinned
    prefixes.release(seq)                     # or unpinned now (a failure, a later pass)

open: the longest stored, chunk-aligned part R of the prefix (locked meanwhile), then the
chunks after it that the shared pool holds (a remote tier, if any); the plan: load R,
recompute it, or recompute its front while the rest loads (the cost model's choice;
`ServingConfig.plan`). close: the newly computed prefix KV (whole chunks) into the radix
tree, then into the shared pool (write-through), on the store writer's thread while the
request decodes (store_writer.py).
"""
from __future__ import annotations

import logging
import time

from ..errors import CorruptNode, StoreWriteFailed
from ..request import RequestStats
from ..store import CHUNK_SIZE

log = logging.getLogger("impress_flexgen.engine")


class Prefixes:
    """Opening and closing the stored prefixes of an engine's sequences. `planner`: the
    cost model's planner, set once the engine has one (plan auto or both)."""

    def __init__(self, store, policy, shared, writer, math, stored_bytes_per_token_layer: int,
                 tier_names: tuple[str, ...]):
        self.store, self.policy, self.shared, self.writer = store, policy, shared, writer
        self.math = math
        self.stored_bytes_per_token_layer = stored_bytes_per_token_layer
        self.tier_names = tier_names
        self.planner = None
        self.shared_unstored = 0    # prefixes not stored: part of them came unauthenticated

    # -- open ------------------------------------------------------------------------------
    def open(self, seq, attempt: int = 0, use_shared: bool = False) -> None:
        """Match, the shared pool, the plan: what a prefill pass needs of the sequence (its
        matched prefix pinned until closed or released). Starts a new attempt: the
        sequence's stats are new."""
        self.release(seq)
        seq.restart()
        # A prefix another request is storing is matched as if it were stored in line.
        self.writer.wait_idle()
        req = seq.request
        seq.stats = stats = RequestStats(prefix_tokens=len(req.prefix),
                                         recovered_from_corruption=attempt,
                                         bytes_read=dict.fromkeys(self.tier_names, 0))
        seq.t_start = time.perf_counter()
        seq.disk_before = self.store.tiers.disk.read_counters() \
            if self.planner is not None else None
        seq.use_store = self.store is not None and self.policy.reuse
        seq.use_shared, seq.learn = use_shared, True
        try:
            if seq.use_store:
                # An exact reader never sees KV computed over a selection of a prefix.
                seq.match = self.store.match_prefix(req.prefix, namespace=req.namespace,
                                                    exact_only=self.policy.exact_reads)
            segments_nodes = seq.match.segments if seq.match else []
            matched = sum(u for _, u in segments_nodes)
            stats.matched_tokens = matched
            stats.match_s = time.perf_counter() - seq.t_start
            # The prefix tokens right after the matched ones may be in the shared pool.
            given = self.shared.open(req.prefix, matched, stats, tenant=req.namespace) \
                if use_shared and seq.use_store else None
            n_given = given.n_tokens if given is not None else 0
            new_ids = list(req.prefix[matched + n_given:]) + list(req.query)
            stats.prefix_bytes = matched * self.stored_bytes_per_token_layer * \
                self.math.n_layers
            # Load the matched prefix, recompute it, or recompute its front while the rest
            # loads: `front` tokens are recomputed.
            front = self._choose_plan(segments_nodes, matched, len(new_ids), stats)
            stats.computed_tokens = len(new_ids) + front
            if front >= matched:
                segments_nodes = []      # nothing left to load
        except BaseException:
            self.release(seq)
            raise
        seq.segments_nodes, seq.matched, seq.given, seq.n_given = \
            segments_nodes, matched, given, n_given
        seq.new_ids, seq.front = new_ids, front
        seq.canonical_end = 0
        if self.policy.exact_reads:     # what a store keeps: canonical calls (attention.py)
            chunk = self.store.config.chunk_size if self.store is not None else CHUNK_SIZE
            seq.canonical_end = len(req.prefix) // chunk * chunk

    def _choose_plan(self, segments_nodes, matched: int, n_new: int, stats) -> int:
        """How many leading prefix tokens to recompute rather than load (0: load all)."""
        mode = self.policy.config.plan
        if not segments_nodes or mode == "load":
            stats.plan, stats.plan_split = "load", 0
            stats.plan_reason = "forced" if segments_nodes else "no-match"
            return 0
        if mode == "recompute":
            stats.plan, stats.plan_split = "recompute", matched // self.store.config.chunk_size
            stats.plan_reason = "forced"
            return matched
        with stats.timer("plan_s"):
            plan = self.planner.choose(mode, segments_nodes, matched, n_new)
        stats.plan, stats.plan_split = plan.mode, plan.split_chunks
        stats.plan_reason = getattr(plan, "reason", "predicted")
        stats.predicted_ttft_s = plan.predicted_s
        return plan.split_chunks * self.store.config.chunk_size

    def learn(self, seq) -> None:
        """Feed the planner what this sequence's reads and time to first token showed
        (a sequence prefilled alone over a matched prefix)."""
        if seq.disk_before is None or not seq.matched or not seq.learn:
            return
        stats = seq.stats
        read, busy = self.store.tiers.disk.read_counters()
        loaded = 2 * self.math.n_layers * (seq.matched // self.store.config.chunk_size -
                                           stats.plan_split)
        self.planner.observe(stats, read - seq.disk_before[0], busy - seq.disk_before[1],
                             loaded)

    # -- close -----------------------------------------------------------------------------
    def release(self, seq) -> None:
        """Unpin its matched prefix now (once)."""
        if seq.match is not None:
            match, seq.match = seq.match, None
            self.store.release(match)

    def close(self, seq, new_kv) -> None:
        """Hand its new prefix KV to the store writer, which stores it while the sequence
        decodes and unpins its matched prefix after (its response waits for it); a policy
        that stores nothing unpins now."""
        if not (seq.use_store and self.policy.store_new):
            self.release(seq)
            return
        match, seq.match = seq.match, None
        seq.stored = self.writer.submit(lambda: self._store(seq, new_kv, match))

    def _store(self, seq, new_kv, match) -> None:
        """On the writer thread: store the new prefix KV, then unpin the matched prefix.
        A failure leaves the prefix unstored; the request itself has its tokens."""
        try:
            with seq.stats.timer("store_s"):
                self._store_new(seq, new_kv)
        except CorruptNode as exc:
            # A node it had to split failed its CRC check: out of service, as on a read.
            self.store.quarantine(exc.node, str(exc))
            log.warning("prefix not stored: %s", exc)
        except Exception as exc:  # noqa: BLE001 - storing is best effort for this request
            log.warning("prefix not stored: %s", exc, exc_info=True)
        finally:
            if match is not None:
                self.store.release(match)

    def _store_new(self, seq, new_kv) -> None:
        """The prefix's new whole chunks into the store, then (exact KV only) the pool."""
        req, stats, matched, n_given = seq.request, seq.stats, seq.matched, seq.n_given
        n_prefix_new = len(req.prefix) - matched
        if n_prefix_new < self.store.config.chunk_size:
            return
        if n_given and not self.shared.keyed:
            # KV from a pool without a secret is unauthenticated (whoever can write to the
            # pool can forge it with a valid CRC): it served this request, but neither it
            # nor what was computed over it becomes local state. The chunks computed here
            # still go to the pool, which gave the rest.
            self.shared_unstored += 1
            if self.shared_unstored == 1:
                log.warning("shared pool without a secret: prefixes read from it are used "
                            "but not stored locally")
        else:
            prefix_kv = [(k[:, :n_prefix_new], v[:, :n_prefix_new]) for k, v in new_kv]
            try:
                self.store.insert(req.prefix, matched, prefix_kv, namespace=req.namespace,
                                  exact=stats.exact)
            except StoreWriteFailed as exc:
                log.warning("prefix not stored: %s", exc)
                return
        if seq.use_shared and stats.exact:
            # Durable here first; then shared (write-through, in the background): the
            # chunks the pool did not give us. Only exact KV is shared: the pool keeps no
            # flag.
            self.shared.publish(req.prefix, matched + n_given,
                                [(k[:, n_given:n_prefix_new], v[:, n_given:n_prefix_new])
                                 for k, v in new_kv], tenant=req.namespace)
