"""The accuracy experiment in its quick mode, on the real smollm2-135m, through the engine."""
from __future__ import annotations

import json

import pytest

from experiments import accuracy

FIELDS = ("policy", "label", "config", "retention", "task", "score", "kl", "top1_agreement",
          "bytes_loaded_fraction", "fallback_rate")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("accuracy")
    path, figure = out / "acc.json", out / "acc.png"
    assert accuracy.main(["--quick", "--json", str(path), "--figure", str(figure)]) == 0
    return json.loads(path.read_text()), figure


def _rows(payload):
    return {(r["label"], r["task"]): r for r in payload["results"]}


def test_quick_json_and_figure(quick):
    payload, figure = quick
    assert payload["model"] == "smollm2-135m"
    rows = payload["results"]
    assert {r["task"] for r in rows} == set(accuracy.TASKS)
    assert {r["label"] for r in rows} == {"full", "impress", "random"}
    for r in rows:
        for field in FIELDS:
            assert field in r, (r["label"], r["task"], field)
        assert 0 <= r["score"] <= 1 and 0 <= r["fallback_rate"] <= 1
        assert r["bytes_loaded_fraction"] > 0
    assert figure.stat().st_size > 10_000 and figure.read_bytes()[:4] == b"\x89PNG"


def test_quick_separates_policies(quick):
    by = _rows(quick[0])
    # Full KV solves the tasks far above chance (25%).
    assert by["full", "recall"]["score"] > 0.5
    assert by["full", "retrieval"]["score"] > 0.5
    assert by["full", "retrieval"]["exact_match"] > 0.5
    # Random chunks at the same budget do clearly worse somewhere.
    gap = max(by["full", t]["score"] - by["random", t]["score"] for t in ("recall", "retrieval"))
    kl_random, kl_impress = by["random", "fidelity"]["kl"], by["impress", "fidelity"]["kl"]
    assert gap >= 0.25 or kl_random > 3 * kl_impress
    # Ours (default RunConfig, chunk mode) stays close to full on natural continuations.
    assert kl_impress <= 0.1
    assert by["impress", "fidelity"]["bytes_loaded_fraction"] < \
        by["full", "fidelity"]["bytes_loaded_fraction"]


def test_seeded_store_equals_cold_serve(quick, tmp_path):
    """Seeding each fresh store with the cold serve's K/V gives what serving cold gives."""
    path = tmp_path / "cold.json"
    assert accuracy.main(["--quick", "--cold-serve", "--tasks", "fidelity", "--only", "impress",
                          "--json", str(path)]) == 0
    cold = _rows(json.loads(path.read_text()))
    seeded = _rows(quick[0])
    for label in ("full", "impress"):
        a, b = cold[label, "fidelity"], seeded[label, "fidelity"]
        for field in ("kl", "top1_agreement", "perplexity", "bytes_loaded_fraction",
                      "fallback_rate"):
            assert a[field] == b[field], (label, field, a[field], b[field])


def test_bad_arguments():
    with pytest.raises(SystemExit) as exc:
        accuracy.main(["--tasks", "nonsense"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        accuracy.main(["--prefix-tokens", "1000"])
    assert exc.value.code == 2
