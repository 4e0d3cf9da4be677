"""The engine's planner: what each plan would cost on this machine, and the choice.

    planner = Planner(engine.measure_prefill, StoreView(store), policy, n_layers=L,
                      max_positions=P, tier_names=names, machine=key, retention=r)
    # or Planner.for_engine(engine), which reads those off an engine once
    planner.cost()                                   # calibrate once (cached per machine)
    plan = planner.choose("auto", segments, matched, n_new)
    ...serve...
    planner.observe(stats, disk_bytes, disk_busy_s, loaded_chunks)   # learned online

The compute side is a prefill curve measured on this machine and model (cached in
~/.cache/impress_flexgen, or $IMPRESS_FLEXGEN_CACHE), scaled by how much slower the
machine is now than when calibrated (measured over predicted prefill seconds, from every
request whatever its plan: other work slows every plan alike). The I/O side is, per chunk, its
tier's bandwidth (the disk's learned from the reads requests do, never above a configured
read limit) for the chunks the policy is expected to load: every chunk for a policy that
loads everything, else the chunks its last query selected on that (node, layer), else a
learned share of them all; which of those a split leaves to read is reads.py's model. The
policy's scoring is learned as seconds per (new token x stored token). What the model still
misses (joining the loaded pieces, the policy's bookkeeping) is learned as one correction per plan, the ratio of measured to
predicted time to first token, applied to the prediction reported (not to the choice:
see choose()). Every learned figure is a median of the last few requests.

The planner recovers from a calibration that is wrong (taken while the machine was busy, or
a cache from another time): when the measured prefill of FAR_COUNT requests in a row is
more than FAR times off the calibrated curve (beyond what the speed factor absorbs), or
their time to first token is that far off the prediction, the curve is measured again in
the background (one point at a time, between requests) and the cache rewritten. And a plan
not chosen for EXPLORE_AFTER requests is tried once when its prediction is within
EXPLORE_MARGIN of the chosen one's, so that its cost is measured again. Every plan says
why it was chosen (Plan.reason): predicted, explore or forced.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import paths, progress
from ..tiers.chain import DISK, REMOTE
from .costs import (DEFAULT_POINTS, Bandwidth, CostModel, PrefillCurve, calibrate,
                    load_cache, machine_key)
from .estimate import estimate_for
from .reads import StoreView, prefix_costs
from .split import Plan, PrefixCosts, choose_plan, split_compute

# Until a read says otherwise (bytes/s): memory tiers are fast, the disk a modest SSD.
_DEFAULT_BANDWIDTH = {"gpu": 50e9, "cpu": 10e9, DISK: 1e9, REMOTE: 1e9}
_MODES = ("load", "recompute", "both")
# Seconds of prefills a calibration may spend at start-up; its longest points are left out
# past it (on a 2-core CPU every point of smollm2-135m takes two minutes). None: all.
CALIBRATION_BUDGET_S: float | None = 20.0
_MIN_COMPUTE_S = 0.02   # shorter prefills say more about timer noise than machine speed
# Recalibrate when FAR_COUNT requests in a row were more than FAR times off (the speed
# factor absorbs up to 4x), at most once per RECALIBRATE_EVERY requests.
FAR, FAR_COUNT, RECALIBRATE_EVERY = 4.0, 3, 50
# Try a plan again after EXPLORE_AFTER requests without it, if predicted within the margin.
EXPLORE_AFTER, EXPLORE_MARGIN = 20, 0.5

log = logging.getLogger("impress_flexgen.planner")


class _Closing(progress.Stopped):
    """The planner is closing: a recalibration stops between two points."""


def cache_dir() -> Path:
    """Where calibrations are cached: the one cache root (paths.cache_dir)."""
    return paths.cache_dir()


def cache_entry(machine: str, budget_s: float | None) -> tuple[Path, str]:
    """(the calibration cache file, its key) of a planner on `machine` (costs.machine_key)."""
    name = hashlib.sha256(machine.encode()).hexdigest()[:16]
    return cache_dir() / "costs" / f"{name}.json", f"{machine};budget={budget_s}"


def measured_curve(spec, device, dtype) -> PrefillCurve | None:
    """The prefill curve an earlier start calibrated for `spec` on this machine, if cached
    (what a planner built now would use); None: none, or not a measurement."""
    path, key = cache_entry(machine_key(_model_label(spec), device, dtype),
                            CALIBRATION_BUDGET_S)
    return load_cache(path, key)


class _Learned:
    """The median of the last WINDOW observations, the prior counted `prior_weight` times
    until observations push it out: one slow request (a cold cache, other work on the
    machine) cannot swing a plan's estimate, while a lasting change wins in a few."""

    WINDOW = 5

    def __init__(self, prior: float, prior_weight: int = 0):
        self.prior = prior
        self.count = 0
        self._seen: deque[float] = deque([prior] * prior_weight, maxlen=self.WINDOW)

    @property
    def value(self) -> float:
        return float(np.median(self._seen)) if self._seen else self.prior

    def observe(self, x: float) -> None:
        self.count += 1
        self._seen.append(float(x))


def _model_label(spec) -> str:
    """The model as its prefill cost knows it: 4-bit weights cost a dequantisation more."""
    fmt = getattr(spec, "weight_format", None)
    return spec.name if fmt is None or not fmt.compress else f"{spec.name}:{fmt.label}"


class Planner:
    """measure(n, ctx) -> seconds of one prefill (the curve's points); store: what the plans
    read (StoreView); policy: the serving policy (what it loads); machine: what the
    calibration depends on (costs.machine_key), naming its cache."""

    def __init__(self, measure: Callable[[int, int], float], store: StoreView, policy, *,
                 n_layers: int, max_positions: int, tier_names, machine: str,
                 retention: float = 1.0, points=DEFAULT_POINTS,
                 prior: Callable[[], PrefillCurve | None] | None = None):
        self.measure = measure
        self.prior = prior     # an estimate of the curve, for calibration's budget
        self.store = store
        self.policy = policy
        self.n_layers = n_layers
        self.machine = machine
        self.points = [(n, ctx) for n, ctx in points if n + ctx <= max_positions]
        defaults = {name: _DEFAULT_BANDWIDTH.get(name, 1e9) for name in tier_names}
        self.bandwidth = Bandwidth(defaults)
        # Share of a node's chunks loaded where no last selection is known.
        self.load_fraction = _Learned(1.0 if policy.loads_everything else
                                      min(1.0, 1.5 * retention))
        self.select_rate = _Learned(0.0)   # seconds per (new token x stored token)
        self.correction = {m: _Learned(1.0, prior_weight=2) for m in _MODES}
        # The machine now against the machine calibrated: measured over predicted prefill
        # seconds, whatever the plan (other work on the machine slows every plan alike).
        self.speed = _Learned(1.0, prior_weight=2)
        self._chosen = None
        # Start-up time the calibration may take (None: measure every point).
        self.budget_s: float | None = CALIBRATION_BUDGET_S
        self._cost: CostModel | None = None
        self._lock = threading.Lock()
        # Recovery: requests planned, when each plan was last chosen (auto), how many
        # requests in a row were far off, the background recalibration and its count.
        self.requests = 0
        self._last_chosen = dict.fromkeys(_MODES, 0)
        self._far = 0
        self._calm_until = 0
        self._generation = 0
        self._recalibration: threading.Thread | None = None
        self._closing = threading.Event()   # close(): a recalibration stops at its next point
        self.recalibrations = 0
        self.explored = 0

    @classmethod
    def for_engine(cls, engine, points=DEFAULT_POINTS) -> Planner:
        """The planner of an engine: its prefill as the measuring function, its store."""
        return cls(engine.measure_prefill, StoreView(engine.store), engine.policy,
                   n_layers=engine.math.n_layers, max_positions=engine.max_positions,
                   tier_names=engine.tier_names, retention=engine.config.retention,
                   machine=machine_key(_model_label(engine.rt.spec), engine.device,
                                       engine.dtype),
                   points=points, prior=lambda: estimate_for(engine.rt))

    # -- the cost model -----------------------------------------------------------------
    def cost(self) -> CostModel:
        """The cost model, calibrated on first use (a few short prefills, or the cache)."""
        with self._lock:
            if self._cost is None:
                self._cost = CostModel(self._calibrate(use_cache=True), self.bandwidth,
                                       self.n_layers)
            return self._cost

    def _calibrate(self, use_cache: bool):
        path, key = cache_entry(self.machine, self.budget_s)
        return calibrate(self._measure, self.points, path, key=key, budget_s=self.budget_s, use_cache=use_cache,
                         announce=progress.step, prior=self.prior, say=progress.say)

    def recalibrate(self, wait: bool = False) -> None:
        """Measure the prefill curve again in the background (the engine's requests go on:
        each point takes the engine between two of them) and rewrite the cache; what was
        learned against the old curve starts over. One at a time; wait: join it."""
        with self._lock:
            if self._recalibration is None or not self._recalibration.is_alive():
                self._recalibration = threading.Thread(
                    target=self._recalibrate, name="planner-recalibration", daemon=True)
                self._recalibration.start()
            thread = self._recalibration
        if wait:
            thread.join()

    def _measure(self, n: int, ctx: int = 0) -> float:
        if self._closing.is_set():
            raise _Closing()
        return self.measure(n, ctx)

    def close(self) -> None:
        """Stop a recalibration under way (after the point it is measuring) and wait for
        it: its thread runs prefills on the engine, which must not outlive the engine (a
        thread still inside the model when the process exits aborts it)."""
        self._closing.set()
        thread = self._recalibration
        if thread is not None:
            thread.join()

    def wait_recalibration(self, timeout: float | None = None) -> bool:
        """Wait for a recalibration under way; True when none is (any more)."""
        thread = self._recalibration
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _recalibrate(self) -> None:
        try:
            curve = self._calibrate(use_cache=False)
        except _Closing:
            log.debug("planner recalibration stopped: the engine is closing")
            return
        except Exception as exc:   # a closed engine, a failed prefill: keep the old curve
            log.warning("planner recalibration failed (%s): keeping the current curve", exc)
            return
        with self._lock:
            self._cost = CostModel(curve, self.bandwidth, self.n_layers)
            self.speed = _Learned(1.0, prior_weight=2)
            self.correction = {m: _Learned(1.0, prior_weight=2) for m in _MODES}
            self._generation += 1
            self._far = 0
            self.recalibrations += 1
        log.info("planner recalibrated: prefill curve %s", curve)

    def disk_bandwidth(self) -> float:
        """The disk's learned bandwidth, never above the store's read limit (a known
        ceiling: reads that pass on saved-up credit would otherwise seem faster)."""
        bw = self.bandwidth.get(DISK)
        limit = self.store.read_limit
        return min(bw, limit) if limit is not None else bw

    # -- the choice ---------------------------------------------------------------------
    def choose(self, mode: str, segments_nodes, matched: int, n_new: int) -> Plan:
        """The plan for `mode` (auto: the cheapest predicted); observe() learns from it.

        The choice is made on the model with what every plan shares (machine speed,
        bandwidth, scoring rate); each plan's own correction only sharpens the prediction
        reported. A plan's correction is learned only while it is chosen, and a plan
        tends to be chosen when its prediction happens to be low: letting corrections
        steer the choice would favour whichever plan has been measured least."""
        cost = self.cost()
        now = CostModel(cost.prefill.scaled(self.speed.value), cost.bandwidth, cost.n_layers)
        prefix = self.prefix_costs(segments_nodes, matched, n_new)
        plan = choose_plan(mode, now, prefix)
        reason = "predicted" if mode == "auto" else "forced"
        self.requests += 1
        if mode == "auto":
            tried = self._explore(plan, now, prefix)
            if tried is not None:
                plan, reason = tried, "explore"
                self.explored += 1
            self._last_chosen[plan.mode] = self.requests
        # What observe() compares the request with: this plan's prefill (on the curve as
        # calibrated) and its prediction before the plan's correction. One engine serves
        # one request at a time, so the next observe() is this request's.
        self._chosen = (plan.mode, plan.split_chunks,
                        split_compute(cost, prefix, plan.split_chunks), plan.predicted_s,
                        self._generation)
        f = {m: c.value for m, c in self.correction.items()}
        return Plan(plan.mode, plan.split_chunks, plan.predicted_s * f[plan.mode],
                    {k: v * f[k] for k, v in plan.predicted.items()}, reason)

    def _explore(self, plan: Plan, now: CostModel, prefix: PrefixCosts) -> Plan | None:
        """Another plan, not chosen for EXPLORE_AFTER requests and predicted within
        EXPLORE_MARGIN of `plan`: tried once, so that a cost the model has wrong is seen."""
        for mode in _MODES:
            if mode == plan.mode or self.requests - self._last_chosen[mode] < EXPLORE_AFTER:
                continue
            other = choose_plan(mode, now, prefix)
            if other.mode != mode:     # both without an interior split
                continue
            if other.predicted_s <= plan.predicted_s * (1 + EXPLORE_MARGIN):
                return other
            self._last_chosen[mode] = self.requests   # too dear now: ask again later
        return None

    def prefix_costs(self, segments_nodes, matched: int, n_new: int) -> PrefixCosts:
        """What loading each part of the matched prefix would cost (reads.prefix_costs)."""
        disk_bw = self.disk_bandwidth()
        # Asked once: with no memory tier to hold them, every chunk is read from the disk.
        memory = self.store.memory_tiers_on()

        def seconds_of(entry, ids):
            per_chunk = 2 * entry.layout.chunk_bytes      # K and V
            if not memory:
                return np.full(len(ids), per_chunk / disk_bw)
            return np.array([per_chunk / self._bandwidth_of(tier, disk_bw)
                             for tier in self.store.tiers_of(entry, ids)])

        return prefix_costs(self.store, self.policy, self.n_layers, segments_nodes, matched,
                            n_new, seconds_of, self.load_fraction.value,
                            self.select_rate.value, disk_bw)

    def _bandwidth_of(self, tier: str | None, disk_bw: float) -> float:
        return disk_bw if tier is None or tier == DISK else self.bandwidth.get(tier)

    # -- learning -----------------------------------------------------------------------
    def observe(self, stats, disk_bytes: int, disk_busy_s: float, loaded_chunks: int) -> None:
        """After a request: the disk's delivered bandwidth, the share of the prefix's
        chunks the policy loaded, its scoring time, and how far off the prediction was.
        loaded_chunks: the K and V chunks the plan left to load (0: it recomputed all)."""
        self.bandwidth.observe(DISK, disk_bytes, disk_busy_s)
        T = self.store.chunk_size
        if loaded_chunks and stats.plan in ("load", "both"):
            self.load_fraction.observe(min(1.0, stats.chunks_loaded / loaded_chunks))
            n_new = stats.computed_tokens - stats.plan_split * T
            scored = n_new * stats.matched_tokens
            if scored > 0 and stats.select_s >= 0:
                self.select_rate.observe(stats.select_s / scored)
        chosen, self._chosen = self._chosen, None
        if chosen is None or chosen[:2] != (stats.plan, stats.plan_split):
            return       # not the plan this planner chose (a retry, another caller)
        _, _, compute, raw, generation = chosen
        if generation != self._generation:
            return       # predicted on a curve since replaced
        far = False
        if compute > _MIN_COMPUTE_S and stats.compute_s > 0:
            ratio = stats.compute_s / compute
            far = not 1 / FAR <= ratio <= FAR
            self.speed.observe(float(np.clip(ratio, 0.25, 4.0)))
        if raw > 0 and stats.ttft_s > 0:
            ratio = stats.ttft_s / raw
            # Milliseconds say more about per-request overheads than about the curve.
            far = far or (max(raw, stats.ttft_s) > _MIN_COMPUTE_S and
                          not 1 / FAR <= ratio <= FAR)
            self.correction[stats.plan].observe(float(np.clip(ratio, 0.5, 2.0)))
        self._far = self._far + 1 if far else 0
        if self._far >= FAR_COUNT and self.requests >= self._calm_until:
            # The curve is off beyond what the speed factor absorbs: measure it again.
            self._far = 0
            self._calm_until = self.requests + RECALIBRATE_EVERY
            log.warning("planner predictions %d requests in a row more than %gx off: "
                        "recalibrating in the background", FAR_COUNT, FAR)
            self.recalibrate()

    def snapshot(self) -> dict:
        """What the planner has learned so far (for reports)."""
        return {"disk_bandwidth_bytes_s": self.disk_bandwidth(),
                "load_fraction": self.load_fraction.value,
                "select_s_per_token_pair": self.select_rate.value,
                "speed": self.speed.value,
                "correction": {m: c.value for m, c in self.correction.items()},
                "observed": {m: c.count for m, c in self.correction.items()},
                "recalibrations": self.recalibrations, "explored": self.explored}
