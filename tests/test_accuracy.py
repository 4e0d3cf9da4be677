"""The accuracy experiment on the real smollm2-135m, through the engine: quick mode, and decode
mode on one item per task."""
from __future__ import annotations

import json

import pytest
import torch

from experiments import accuracy
from impress_flexgen.bench.runner import RunConfig, kl_divergence
from impress_flexgen.errors import UserError
from impress_flexgen.models.runtime import Runtime, RuntimeConfig

pytestmark = pytest.mark.slow     # every test here runs a model or a harness end to end

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


def test_decode_rows_and_only():
    labels = [d.run.label for d in accuracy.decode_runs()]
    assert labels[0] == accuracy.DECODE_REFERENCE
    assert set(labels[1:]) == {f"{p}@256" for p in ("icecache", "quest", "page_window",
                                                     "page_random")}
    with pytest.raises(UserError, match="icecache@64"):     # a typo runs nothing: say so
        accuracy.main(["--quick", "--only", "icecache@64"])


def test_forced_logits_line_up_with_prefill_rows():
    """Step logits of a teacher-forced response score a candidate as query logits do."""
    gen = torch.Generator().manual_seed(0)
    query, cand, vocab = 5, [3, 1, 4], 7
    prefill = torch.randn(query + len(cand), vocab, generator=gen)
    # Decode mode: row 0 from prefill (the query's last position), then one per forced token.
    steps = [prefill[query - 1 + i] for i in range(len(cand))]

    class Resp:
        step_logits = steps

    forced = accuracy._forced(Resp)
    assert forced.shape == (len(cand), vocab)
    assert accuracy._choice_ll(forced, 1, cand) == pytest.approx(
        accuracy._choice_ll(prefill, query, cand))


def test_decode_mode_on_small_tasks(tmp_path):
    """Decode mode on one item per task: full KV scores the same through decode steps as
    through prefill, and a decode-phase policy is compared with that decode-mode reference."""
    settings = accuracy.Settings(prefix_tokens=512, sources=("austen_emma",),
                                 recall_per_prefix=1, fidelity_per_prefix=1,
                                 warmups_per_prefix=1, retrieval_queries=1,
                                 retrieval_tokens=512)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Runtime(RuntimeConfig(model="smollm2-135m")) as rt:
            tasks = accuracy.build_tasks(rt.tokenizer, settings)
            ctx = accuracy.RunContext(rt, tasks, tmp_path, {}, {})
            prefill = accuracy.evaluate(ctx, RunConfig("full", "full", 1.0), accuracy.TASKS)
            runs = {d.run.label: d for d in accuracy.decode_runs()}
            ref, window = (accuracy.evaluate(ctx, d.run, accuracy.TASKS, decode=True,
                                             budget=d.budget)
                           for d in (runs[accuracy.DECODE_REFERENCE], runs["page_window@256"]))
    finally:
        torch.set_num_threads(threads)
    assert window["fidelity"]["label"] == "page_window@256"
    # The same 64 fidelity positions either way, up to the rounding of decode steps.
    a, b = ctx.reference["prefill", "fidelity", 0], ctx.reference["decode", "fidelity", 0]
    assert a.shape == b.shape and kl_divergence(a, b) < 1e-3
    for task in accuracy.TASKS:
        assert ref[task]["mode"] == "decode" and ref[task]["retention"] is None
        assert ref[task]["kl"] == 0 and ref[task]["bytes_loaded_fraction"] == 1
        assert ref[task]["score"] == prefill[task]["score"]
        assert ref[task].get("correct") == prefill[task].get("correct")
        row = window[task]
        assert row["budget"] == 256 and row["mode"] == "decode"
        assert row["kl"] > 0 and 0 < row["bytes_loaded_fraction"] < 1
    assert ref["fidelity"]["perplexity"] == pytest.approx(prefill["fidelity"]["perplexity"],
                                                          rel=1e-3)
