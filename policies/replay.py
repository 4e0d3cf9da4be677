"""Replayed selection: serve one model with the prefix positions another model selected.

Random-weight models attend almost uniformly, so their ITF selection says nothing about
which prefix tokens matter; only the timing and byte counts of serving them are real. To
time a large random-weight model with a realistic selection, a small model with real
weights (SmolLM2-135M) serves the same workload shape with `impress`, and a `Recorder`
keeps, per request and layer, which logical prefix positions were selected (a *trace*).
`Replay` then serves the large model with those selections:

- Requests. Both sides count the requests that reach per-layer planning (those with a
  stored prefix match) in serving order; request i of the replay uses trace entry i (cyclic
  when the trace is shorter). The driver serves the same workload shape (prefix count,
  warm-up and query order from the same seed) on both sides, so entry i belongs to the
  same prefix and query position; `experiments.gpu_repro` checks that the prefix order
  matches and reports it.
- Layers. Target layer l of L_tgt uses source layer floor(l * L_src / L_tgt).
- Positions. Target position t of an n_tgt-token prefix covers the source interval
  [t * n_src / n_tgt, (t + 1) * n_src / n_tgt) (at least one source position); its score
  is the fraction of that interval the source selected (point sampling when the target is
  longer, averaging when it is shorter).
- Selection. Whole target chunks ranked by summed replayed scores, with the sink chunk and
  the most recent chunk always kept, up to the same budget ceil(r * n) as impress's chunk
  selection (`itf.chunk_selection`: at most one chunk beyond the budget). The replayed
  scores are also fed back to the store, so reordering clusters the replayed important
  tokens into few chunks as it would for impress's own scores.
- Cost. The probe copy is still read and scored (`itf.probe_scores`) exactly as impress
  does, and the result discarded: the replayed row pays impress's probe I/O and scoring
  compute, so its TTFT differs from impress's only through what the selection loads.
- Otherwise it behaves like `impress` (ablation `all`): background importance reordering
  and score-based GPU/CPU tiers. It stands in for the full system's row, so a table can
  put "impress, random-weight selection" beside "impress, replayed selection" with only
  the selection differing. No agreement threshold is applied (the trace already reflects
  the source's own fallbacks, which select every position).

Build it with `make_policy("replay:PATH")`, PATH a trace written by `save_trace`.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

from .base import LayerContext, LayerPlan, ServingConfig, ServingPolicy
from .impress import Impress
from .itf import chunk_selection, probe_scores

TRACE_FORMAT = "impress-selection-trace/1"


# -- traces ----------------------------------------------------------------------------
def encode_bits(selected: np.ndarray) -> str:
    return base64.b64encode(np.packbits(np.asarray(selected, dtype=bool)).tobytes()).decode()


def decode_bits(text: str, n: int) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(text), dtype=np.uint8)
    return np.unpackbits(raw)[:n].astype(bool)


class Trace:
    """Per request, per source layer: a bool per logical prefix position (selected?)."""

    def __init__(self, meta: dict, requests: list[dict]):
        if not requests:
            raise ValueError("a selection trace needs at least one request")
        self.meta = meta
        self.requests = requests
        self.n_layers = int(meta["layers"])
        self._cache: dict[tuple[int, int], np.ndarray] = {}
        for r in requests:
            if len(r["layers"]) != self.n_layers:
                raise ValueError(f"trace request has {len(r['layers'])} layers, "
                                 f"expected {self.n_layers}")

    def __len__(self) -> int:
        return len(self.requests)

    def selected(self, request: int, layer: int) -> np.ndarray:
        key = (request % len(self.requests), layer)
        if key not in self._cache:
            r = self.requests[key[0]]
            self._cache[key] = decode_bits(r["layers"][layer], int(r["n"]))
        return self._cache[key]

    def to_json(self) -> dict:
        return {"format": TRACE_FORMAT, **self.meta, "requests": self.requests}

    @classmethod
    def from_json(cls, payload: dict) -> "Trace":
        if payload.get("format") != TRACE_FORMAT:
            raise ValueError(f"not a selection trace (format {payload.get('format')!r}, "
                             f"expected {TRACE_FORMAT!r})")
        meta = {k: v for k, v in payload.items() if k not in ("format", "requests")}
        return cls(meta, payload["requests"])


def save_trace(trace: Trace, path: str | Path) -> None:
    Path(path).write_text(json.dumps(trace.to_json()) + "\n")


_LOADED: dict[tuple[str, int], Trace] = {}


def load_trace(path: str | Path) -> Trace:
    """A trace file (cached per path and modification time)."""
    p = Path(path).expanduser().resolve()
    try:
        key = (str(p), p.stat().st_mtime_ns)
    except OSError as exc:
        raise ValueError(f"selection trace {path}: {exc.strerror}") from None
    if key not in _LOADED:
        try:
            payload = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"selection trace {path}: cannot read ({exc})") from None
        try:
            _LOADED[key] = Trace.from_json(payload)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"selection trace {path}: malformed ({exc})") from None
    return _LOADED[key]


# -- the mapping -----------------------------------------------------------------------
def source_layer(layer: int, n_target: int, n_source: int) -> int:
    """floor(l * L_src / L_tgt)."""
    return min(n_source - 1, layer * n_source // n_target)


def map_positions(selected: np.ndarray, n_target: int) -> np.ndarray:
    """Per target position, the fraction of its proportional source interval selected."""
    n_source = len(selected)
    csum = np.concatenate([[0.0], np.cumsum(selected, dtype=np.float64)])
    t = np.arange(n_target, dtype=np.int64)
    begin = np.minimum(t * n_source // n_target, n_source - 1)
    end = np.maximum(begin + 1, np.minimum((t + 1) * n_source // n_target, n_source))
    return (csum[end] - csum[begin]) / (end - begin)


# -- policies --------------------------------------------------------------------------
def _target_layers(ctx: LayerContext, fallback: int | None) -> int:
    layers = getattr(ctx.segments[0].node, "layers", None)
    if layers:
        return len(layers)
    if fallback is None:
        raise ValueError("replay cannot tell the model's layer count; set target_layers")
    return fallback


class Replay(ServingPolicy):
    keeps_layer_state = True      # counts requests by their first layer
    name = "replay"
    tier_policy = "score"
    reorder = True
    reads_probe = True

    def __init__(self, config: ServingConfig = ServingConfig(), trace: "Trace | str | None" = None,
                 target_layers: int | None = None):
        super().__init__(config)
        if trace is None or trace == "":
            raise ValueError("replay needs a selection trace: replay:PATH")
        self.trace = load_trace(trace) if isinstance(trace, (str, Path)) else trace
        self.trace_path = str(trace) if isinstance(trace, (str, Path)) else None
        self.target_layers = target_layers
        self.request = -1     # index of the request being served (among planned ones)

    def scores(self, layer: int, n_layers: int, n: int) -> np.ndarray:
        """Replayed per-position scores of this request's target layer."""
        src = source_layer(layer, n_layers, self.trace.n_layers)
        return map_positions(self.trace.selected(self.request, src), n)

    def plan_layer(self, ctx: LayerContext) -> LayerPlan:
        if ctx.layer == 0:
            self.request += 1
        cfg = self.config
        n = ctx.n_prefix
        k = cfg.budget(n)
        probe_scores(ctx)  # impress's probe read and scoring, paid and not used
        scores = self.scores(ctx.layer, _target_layers(ctx, self.target_layers), n)
        if ctx.n_pad:
            scores[: ctx.n_pad] = 0.0
        if k >= n:
            plan = LayerPlan.everything(ctx.segments)
            plan.scores, plan.selected = ctx.split(scores), ctx.split(np.ones(n, bool))
            return plan
        chunks = chunk_selection(ctx, scores, k)
        selected = [seg.in_chunks(ch) for seg, ch in zip(ctx.segments, chunks)]
        return LayerPlan(chunks, chunks, [None] * len(chunks), scores=ctx.split(scores),
                         selected=selected)

    def describe(self) -> dict:
        c = self.config
        return {**super().describe(), "retention": c.retention, "granularity": "chunk",
                "trace": self.trace_path, "trace_model": self.trace.meta.get("model"),
                "trace_layers": self.trace.n_layers, "trace_requests": len(self.trace)}


class Recorder(Impress):
    """impress, keeping per request and layer the logical prefix positions it selected."""

    keeps_layer_state = True      # records by request, from its first layer on

    def __init__(self, config: ServingConfig = ServingConfig(), ablation: str = "all"):
        super().__init__(config, ablation)
        self.records: list[list[np.ndarray]] = []   # per planned request, per layer

    def plan_layer(self, ctx: LayerContext) -> LayerPlan:
        if ctx.layer == 0:
            self.records.append([])
        plan = super().plan_layer(ctx)
        n = ctx.n_prefix
        if plan.selected is not None:
            selected = np.concatenate(plan.selected)[:n].astype(bool)
        else:
            selected = np.ones(n, bool)
        self.records[-1].append(selected)
        return plan


def request_entry(layers: list[np.ndarray], **info) -> dict:
    """One trace request: the recorder's per-layer selections, packed."""
    n = len(layers[0])
    return {**info, "n": n,
            "selected_fraction": [round(float(s.mean()), 4) for s in layers],
            "layers": [encode_bits(s) for s in layers]}

