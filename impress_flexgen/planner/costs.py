"""The cost model behind the load / recompute / both plan: prefill time and read bandwidth.

Prefill of `n` new tokens over `ctx` earlier ones costs linear work per token plus
attention of each new token over the context and the new tokens:

    t(n, ctx) = a + b*n + c*n*(ctx + n)

n*(ctx + n), not n*(ctx + n/2): the engine's attention is one dense product under a mask
(causal, or which tokens a recomputed front may see), so every (query, key) pair of the
pass is computed, masked or not.

fitted (non-negative least squares) to a few measured points, cached per machine, model,
dtype and device. Read bandwidth is learnt per tier from the reads themselves (EWMA).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import platform
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from numbers import Integral
from pathlib import Path

import numpy as np

log = logging.getLogger("impress_flexgen.planner.costs")

CACHE_VERSION = 3   # 2: the 4,096-token point; 3: dense attention, n * (ctx + n)
# Points measured by default: short and long prefills, with and without earlier context,
# so that a (per call), b (per token) and c (attention) are all pinned down. The longest
# pins c where it dominates: fitted on 2,048 tokens at most, a CPU's 4,096-token prefill
# came out 30% above the curve. Points past a model's positions are left out.
DEFAULT_POINTS: tuple[tuple[int, int], ...] = (
    (16, 0), (64, 0), (256, 0), (1024, 0), (2048, 0), (4096, 0),
    (64, 1024), (64, 4096), (256, 2048),
)


def _features(n: float, ctx: float) -> tuple[float, float, float]:
    return 1.0, float(n), float(n) * (float(ctx) + float(n))


@dataclasses.dataclass(frozen=True)
class PrefillCurve:
    """Seconds to prefill n new tokens over ctx earlier tokens (coefficients >= 0)."""

    a: float   # per call
    b: float   # per token
    c: float   # per (query, key) pair of the attention

    def __post_init__(self):
        for name in ("a", "b", "c"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"prefill coefficient {name} must be finite and >= 0, got {v!r}")

    @property
    def coef(self) -> list[float]:
        return [self.a, self.b, self.c]

    def predict(self, n: int, ctx: int = 0) -> float:
        """Seconds for n new tokens after ctx earlier ones; nothing to prefill costs 0."""
        if n <= 0:
            return 0.0
        f = _features(n, ctx)
        return self.a * f[0] + self.b * f[1] + self.c * f[2]

    def scaled(self, factor: float) -> PrefillCurve:
        """This curve on a machine `factor` times slower (all three terms alike)."""
        return PrefillCurve(self.a * factor, self.b * factor, self.c * factor)

    @classmethod
    def fit(cls, points: Iterable[tuple[int, int, float]]) -> PrefillCurve:
        """Non-negative least squares over [(n, ctx, seconds)], in relative error.

        Relative error (each row weighted by 1/seconds) so the short query prefills the
        planner also predicts are fitted as well as the long ones. With three unknowns the
        exact NNLS solution is found by trying every support: the best least-squares fit
        among those whose coefficients are all >= 0 (a negative one is clamped to 0 and the
        rest refitted).
        """
        rows = [(int(n), int(ctx), float(s)) for n, ctx, s in points]
        if len(rows) < 3:
            raise ValueError(f"need at least 3 measured points to fit, got {len(rows)}")
        for n, ctx, s in rows:
            if n < 1 or ctx < 0 or not (math.isfinite(s) and s > 0):
                raise ValueError(f"bad prefill point (n={n}, ctx={ctx}, seconds={s})")
        x = np.array([_features(n, ctx) for n, ctx, _ in rows])
        y = np.array([s for _, _, s in rows])
        x, y = x / y[:, None], np.ones_like(y)
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        xs = x / scale   # columns of one magnitude: a well-conditioned solve
        best, best_err = np.zeros(3), float(np.sum(y ** 2))
        for k in (1, 2, 3):
            for support in itertools.combinations(range(3), k):
                cols = list(support)
                sol, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
                if np.any(sol < 0):
                    continue
                coef = np.zeros(3)
                coef[cols] = sol
                err = float(np.sum((xs @ coef - y) ** 2))
                if err < best_err - 1e-12 * max(best_err, 1.0):
                    best, best_err = coef, err
        a, b, c = (best / scale).tolist()
        return cls(max(a, 0.0), max(b, 0.0), max(c, 0.0))


def machine_key(model_name: str, device, dtype) -> str:
    """What a calibration depends on: machine, torch, model, dtype, device (and GPU)."""
    import torch

    dev = torch.device(device)
    parts = [
        f"model={model_name}", f"device={dev}", f"dtype={dtype}",
        f"platform={platform.platform()}", f"arch={platform.machine()}",
        f"cpu={_cpu_model()}", f"cpus={os.cpu_count()}", f"threads={torch.get_num_threads()}",
        f"torch={torch.__version__}",
    ]
    if dev.type == "cuda" and torch.cuda.is_available():
        parts.append(f"gpu={torch.cuda.get_device_name(dev)}")
    return ";".join(parts)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# A calibration is a few hundred bytes; anything much larger is not one.
MAX_CACHE_BYTES = 1 << 20
# A plausible curve's 1,024-token prefill: above a microsecond, below an hour.
_PLAUSIBLE_S = (1e-6, 3600.0)
# A cached curve must reproduce its own measured points within this factor (median).
_POINTS_FACTOR = 3.0


def read_small_file(path: Path, limit: int = MAX_CACHE_BYTES) -> bytes:
    """The bytes of `path` if it is a regular file of at most `limit` bytes.

    Opened without blocking (a FIFO or a device in the file's place would stall the
    reader), checked by fstat on the open descriptor (no race with a swap), read to at
    most limit + 1 bytes. FileNotFoundError when absent; ValueError for anything else
    that is not a small regular file."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than {limit}")
        parts, total = [], 0
        while total <= limit:
            part = os.read(fd, limit + 1 - total)
            if not part:
                break
            parts.append(part)
            total += len(part)
        if total > limit:
            raise ValueError(f"more than {limit} bytes")
        return b"".join(parts)
    finally:
        os.close(fd)


def implausible(curve: PrefillCurve, points=None) -> str | None:
    """Why `curve` cannot be this machine's prefill time (None: it can).

    A curve without per-token work predicts a 4k-token prefill to cost what one token
    does (every plan would recompute); one far outside any machine's speed, or far from
    the points it was fitted to, was not measured here (or was edited)."""
    if curve.b <= 0 and curve.c <= 0:
        return "no per-token cost"
    lo, hi = _PLAUSIBLE_S
    t = curve.predict(1024, 0)
    if not lo <= t <= hi:
        return f"a 1,024-token prefill predicted at {t:.3g} s"
    if points:
        ratios = []
        for point in points:
            n, ctx, seconds = point
            if n >= 1 and ctx >= 0 and seconds > 0:
                ratios.append(curve.predict(int(n), int(ctx)) / float(seconds))
        if ratios:
            r = float(np.median(ratios))
            if not 1 / _POINTS_FACTOR <= r <= _POINTS_FACTOR:
                return f"{r:.3g}x the points it was fitted to"
    return None


def _points(doc) -> list[tuple[int, int, float]]:
    raw = doc.get("points", [])
    if not isinstance(raw, list):
        raise ValueError("points is not a list")
    out = []
    for p in raw:
        if not (isinstance(p, list) and len(p) == 3 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in p)):
            raise ValueError("a point is not [n, ctx, seconds]")
        out.append((int(p[0]), int(p[1]), float(p[2])))
    return out


def _load_cache(path: Path, key: str) -> PrefillCurve | None:
    """The cached curve for `key`, or None when absent, for another key, unreadable,
    malformed or implausible (the last three with a warning: measured again)."""
    try:
        doc = json.loads(read_small_file(path).decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION \
                or doc.get("key") != key:
            return None
        coef = doc["coef"]
        if not (isinstance(coef, list) and len(coef) == 3 and
                not any(isinstance(v, bool) for v in coef)):
            raise ValueError("coef is not a list of 3 numbers")
        curve = PrefillCurve(*coef)
        why = implausible(curve, _points(doc))
        if why is not None:
            raise ValueError(f"implausible coefficients {coef}: {why}")
        return curve
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        # RecursionError: deeply nested JSON. UnicodeDecodeError is a ValueError.
        log.warning("ignoring prefill calibration cache %s (%s): measuring again", path,
                    str(exc)[:200])
        return None


load_cache = _load_cache


def _write_cache(path: Path, key: str, points, curve: PrefillCurve) -> None:
    """Atomically (a new temporary file, fsynced, then os.replace): a reader sees the old
    file or the whole new one. A cache that cannot be written is only a warning."""
    doc = {"version": CACHE_VERSION, "key": key,
           "points": [[n, ctx, s] for n, ctx, s in points], "coef": curve.coef}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc, indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not write prefill calibration cache %s: %s", path, exc)
        try:
            tmp.unlink()
        except OSError:
            pass


def calibrate(measure: Callable[[int, int], float],
              points: Sequence[tuple[int, int]] = DEFAULT_POINTS,
              cache_path: Path | None = None, key: str = "", repeats: int = 2,
              budget_s: float | None = None, use_cache: bool = True,
              announce=None, prior: Callable[[], PrefillCurve | None] | None = None,
              say: Callable[[str], None] | None = None) -> PrefillCurve:
    """Fit a PrefillCurve to measure(n, ctx) -> seconds at each point (min of `repeats`).

    With cache_path, a cache written for the same `key` (see machine_key) is used without
    measuring (unless use_cache is False: measured again and rewritten, as when the
    planner finds the cached curve far off); a missing, foreign, corrupt or implausible
    one is measured again and rewritten.
    budget_s: points are measured cheapest first, and a point whose predicted cost would
    take the calibration past `budget_s` seconds is left out (a slow machine starts in
    seconds, with a curve fitted on shorter prefills). None: every point. Until three
    points are in, the prediction is `prior`'s (an estimate from bytes and FLOPs, see
    estimate.py), scaled by what the points measured so far took against it; without a
    prior (or one that returns None) the first three are measured whatever they cost.
    When fewer than three fit the budget (one point is a pass over a model far larger than the machine's memory), the
    curve is the prior so scaled, said so, and not cached (estimated again next start).
    announce: a context manager factory (progress.step) wrapped round the measuring, which
    a cache hit skips and an estimate needs not; say: where an estimate is said (default:
    a logged warning).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if cache_path is not None:
        cache_path = Path(cache_path)
    if cache_path is not None and use_cache:
        cached = _load_cache(cache_path, key)
        if cached is not None:
            return cached
    guess = prior() if prior is not None and budget_s is not None else None
    first = min(points, key=lambda p: sum(_features(*p)))
    if guess is not None and guess.predict(*first) > budget_s:
        announce = None     # nothing will be measured: no "calibrating..." line
    budget = "" if budget_s is None else f", at most {budget_s:g} s"
    with (announce(f"calibrating the prefill cost curve ({len(points)} points{budget}; "
                   "cached for the next start)") if announce is not None
          else contextlib.nullcontext()):
        measured = _measure_points(measure, points, repeats, budget_s, guess)
    if len(measured) < 3 and guess is not None:
        curve = guess.scaled(_prior_factor(guess, measured))
        (say or log.warning)(
            f"prefill cost curve estimated from bytes and FLOPs, not measured: a "
            f"{first[0]}-token prefill is predicted at {curve.predict(*first):.0f} s, past the "
            f"{budget_s:g} s calibration budget ({len(measured)} point(s) measured); the "
            "planner corrects it from the requests served")
        return curve
    curve = PrefillCurve.fit(measured)
    if cache_path is not None:
        _write_cache(cache_path, key, measured, curve)
    return curve


def _prior_factor(guess: PrefillCurve, measured) -> float:
    """Measured over predicted, the median over the points measured (1: none)."""
    ratios = [s / guess.predict(n, ctx) for n, ctx, s in measured if guess.predict(n, ctx) > 0]
    return float(np.median(ratios)) if ratios else 1.0


def _measure_points(measure, points, repeats: int, budget_s: float | None,
                    guess: PrefillCurve | None) -> list[tuple[int, int, float]]:
    measured = []
    spent = 0.0
    order = points if budget_s is None else sorted(points, key=lambda p: sum(_features(*p)))
    for n, ctx in order:
        if budget_s is not None and len(measured) >= 3:
            predicted = PrefillCurve.fit(measured).predict(int(n), int(ctx)) * repeats
            if spent + predicted > budget_s:
                continue
        elif guess is not None:
            # One run at least must fit: the prior says what the first would cost.
            predicted = guess.predict(int(n), int(ctx)) * _prior_factor(guess, measured)
            if spent + predicted > budget_s:
                continue
        # The min: noise (other work, page faults) only ever adds time. A point that
        # alone outlasts the budget (a model far larger than the machine) is not
        # measured again.
        runs = [float(measure(int(n), int(ctx)))]
        while len(runs) < repeats and (budget_s is None or spent + sum(runs) < budget_s):
            runs.append(float(measure(int(n), int(ctx))))
        spent += sum(runs)
        measured.append((int(n), int(ctx), min(runs)))
    return measured


class Bandwidth:
    """Read bandwidth (bytes/s) per tier: an EWMA of observed reads over a default.

    The first observation of a tier replaces its default (a measurement beats a guess);
    later ones move the estimate by ALPHA. Reads under MIN_BYTES say more about per-call
    overhead than bandwidth and are ignored, as are non-positive durations.
    """

    ALPHA = 0.3
    MIN_BYTES = 64 << 10

    def __init__(self, defaults: dict[str, float]):
        for tier, bw in defaults.items():
            if not (isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0):
                raise ValueError(f"default bandwidth of tier {tier!r} must be > 0 bytes/s, "
                                 f"got {bw!r}")
        self._defaults = dict(defaults)
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes < self.MIN_BYTES or not (math.isfinite(seconds) and seconds > 0):
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._seen.get(tier)
            self._seen[tier] = rate if old is None else old + self.ALPHA * (rate - old)

    def get(self, tier: str) -> float:
        with self._lock:
            if tier in self._seen:
                return self._seen[tier]
            if tier in self._defaults:
                return self._defaults[tier]
        raise KeyError(f"no bandwidth known for tier {tier!r} "
                       f"(known: {', '.join(sorted(self._defaults)) or 'none'})")

    def snapshot(self) -> dict[str, float]:
        """Current estimate of every tier (defaults where nothing was observed)."""
        with self._lock:
            return {**self._defaults, **self._seen}


@dataclasses.dataclass
class CostModel:
    """Predicted seconds of prefill compute and of tier reads, for the planner."""

    prefill: PrefillCurve
    bandwidth: Bandwidth
    n_layers: int

    def __post_init__(self):
        if not (isinstance(self.n_layers, Integral) and self.n_layers >= 1):
            raise ValueError(f"n_layers must be an int >= 1, got {self.n_layers!r}")
        self.n_layers = int(self.n_layers)

    def compute_s(self, n_new: int, ctx: int = 0) -> float:
        return self.prefill.predict(n_new, ctx)

    def io_s(self, bytes_by_tier: dict[str, int]) -> float:
        """Seconds to read these bytes from each tier, one tier after another."""
        return sum(n / self.bandwidth.get(tier) for tier, n in bytes_by_tier.items() if n)
