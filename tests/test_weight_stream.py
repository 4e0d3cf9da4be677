"""Layer weights read behind compute (engine.weight_stream), past the page cache
(models.direct_read), and the block schedule (engine.block): the same answers as the
synchronous path and as each request alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from policies import ServingConfig

from impress_flexgen.bench.runner import serve_block
from impress_flexgen.engine import Request
from impress_flexgen.engine.assemble import assemble, make_serving_policy
from impress_flexgen.models import direct_read
from impress_flexgen.models.direct_read import read_npy, read_rows, row_runs, whole
from impress_flexgen.models.placement import Placement
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.request import RequestStats
from impress_flexgen.tiers import TierConfig


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory):
    """opt-tiny with every weight on the disk, read ahead (True) and not (False)."""
    off = tmp_path_factory.mktemp("off")
    rts = {overlap: Runtime(RuntimeConfig(model="opt-tiny", offload_dir=str(off),
                                          placement=Placement.parse("disk"), overlap=overlap))
           for overlap in (True, False)}
    yield rts
    for rt in rts.values():
        rt.close()


def _engine(rt):
    return assemble(rt, make_serving_policy("recomp", ServingConfig()), None,
                    TierConfig()).engine


def _requests():
    return [Request(list(range(11, 11 + n)), [7, 8], 3, keep_logits=True) for n in (5, 19)]


def test_overlap_gives_the_synchronous_answers_and_counts_the_reads(on_disk):
    got = {}
    for overlap, rt in on_disk.items():
        engine = _engine(rt)
        got[overlap] = engine.serve_all(_requests())
        assert engine.runner.weights.disk_bytes > 0          # the weights came from the disk
    for a, b in zip(got[True], got[False]):
        assert a.tokens == b.tokens
        for x, y in zip(a.step_logits, b.step_logits):
            assert torch.equal(x, y)
        assert a.stats.weight_bytes == b.stats.weight_bytes > 0
        assert a.stats.weight_wait_s > 0 and b.stats.weight_wait_s > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_next_layers_weights_are_read_while_this_one_computes(on_disk, overlap):
    engine = _engine(on_disk[overlap])
    runner, bufs = engine.runner, engine.runner.model.weight_read_buf
    seen = []
    real = runner._forward

    def forward(j, hidden, mask=None):
        seen.append(bufs[j + 1].val is not None)       # the next layer already under way
        real(j, hidden, mask)

    runner._forward = forward
    engine.serve(Request([5, 6, 7, 8], [9], 3))
    assert len(seen) > 4 and all(seen) if overlap else not any(seen)
    assert all(buf.val is None for buf in bufs)       # nothing left behind in a buffer


def test_a_paused_pass_leaves_its_read_ahead_to_whoever_needs_that_layer(on_disk):
    runner = _engine(on_disk[True]).runner
    stats = RequestStats()
    runner.weights.bring(1, stats, ahead=2)
    before = runner.weights.bytes_read
    assert runner.model.weight_read_buf[2].val is not None
    runner.load_weights(2, stats)                 # used as it is, not read twice
    assert runner.weights.bytes_read == before
    runner.model.weight_read_buf[1].pop()
    runner.model.weight_read_buf[2].pop()


def test_direct_read_gives_the_files_array(tmp_path):
    a = np.random.default_rng(0).standard_normal(9 * 2**20 // 4 + 1234).astype(np.float32)
    path = str(tmp_path / "w.npy")
    np.save(path, a)
    out = torch.empty(a.shape, dtype=torch.float32)
    assert read_npy(path, out) == a.nbytes
    assert np.array_equal(out.numpy(), a)
    assert whole(None, (3, 4)) and whole((slice(0, 3), slice(None)), (3, 4))
    assert not whole((slice(1, 3), slice(None)), (3, 4))


def test_a_large_file_is_read_in_spans_at_once_and_rows_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_read, "SPLIT", 64 << 10)      # two readers from 64 KiB
    monkeypatch.setattr(direct_read, "PIECE", 16 << 10)
    a = np.random.default_rng(1).standard_normal((300, 1001)).astype(np.float32)
    path = str(tmp_path / "t.npy")
    np.save(path, a)
    out = torch.zeros(a.shape, dtype=torch.float32)
    assert read_npy(path, out) == a.nbytes
    assert np.array_equal(out.numpy(), a)
    rows = [0, 7, 8, 150, 299]
    part = torch.zeros(a.shape, dtype=torch.float32)
    assert read_rows(path, part, rows + [8]) == 5 * 1001 * 4     # each row once
    assert np.array_equal(part.numpy()[rows], a[rows])
    assert not part[1:7].any()                                    # nothing else written
    assert row_runs(range(0, 300, 3), 300, 1001 * 4) is None      # cheaper: the whole table
    assert row_runs([300], 300, 8) is None


def test_a_token_table_on_the_disk_is_read_for_the_tokens_embedded(on_disk, tiny_runtimes):
    engine = _engine(on_disk[True])
    stream = engine.runner.weights
    table = stream.token_table
    assert table is not None
    token_bytes = table.shape[0] * table.shape[1] * 4
    rest = stream.moved[0][0] - token_bytes             # the position table, read whole
    reqs = [Request(list(range(11, 11 + n)), [7, 8], 3, keep_logits=True) for n in (5, 19)]
    seen, real = [], stream._issue
    stream._issue = lambda j, rows=None: (real(j, rows), j == 0 and seen.append(
        stream.brought[0]))
    try:
        got = serve_block(engine, reqs, (2, 1))
    finally:
        stream._issue = real
    # Every load of the embedding read a few rows, not the table.
    assert seen and all(0 < b - rest < token_bytes / 100 for b in seen)
    ref = _engine(tiny_runtimes["opt-tiny"])             # every weight in memory
    for a, b in zip(got, serve_block(ref, reqs, (2, 1))):
        assert a.tokens == b.tokens
        for x, y in zip(a.step_logits, b.step_logits):
            assert torch.equal(x, y)
    # A buffer holding other rows is read again, one holding these is used as it is.
    stats = RequestStats()
    stream.bring(0, stats, rows=[3, 4])
    before = stream.bytes_read
    stream.bring(0, stats, rows=[4])
    assert stream.bytes_read == before
    stream.bring(0, stats, rows=[5])
    assert stream.bytes_read > before and stream.rows_held[0] == {5}
    engine.runner.model.weight_read_buf[0].pop()


def test_a_pass_reads_each_offloaded_weight_once_for_all_its_requests(on_disk):
    """A prefill pass of several requests reads each layer's weights from the disk once
    (the input embedding's with every request's token rows) and makes their first tokens
    in one product of the output layer; each answer is the request's alone."""
    from impress_flexgen.engine.scheduler import SchedulerConfig

    engine = _engine(on_disk[True])
    runner, stream = engine.runner, engine.runner.weights
    reqs = [Request(list(range(11 + n, 11 + 2 * n)), [7, 8], 1, keep_logits=True)
            for n in (5, 19, 9)]
    alone = [engine.serve(r) for r in reqs]
    read, products = [], []
    real, logits = stream._issue, runner.math.logits

    def issue(j, rows=None):
        before = stream.bytes_read
        real(j, rows)
        if stream.bytes_read > before:
            read.append(j)

    stream._issue = issue
    runner.math.logits = lambda w, h: products.append(len(h)) or logits(w, h)
    try:
        together = engine.serve_all(reqs, SchedulerConfig(max_batch_size=4))
    finally:
        stream._issue, runner.math.logits = real, logits
    assert sorted(read) == list(range(stream.n))      # every layer once, the embedding too
    assert products == [3]                            # one output-layer product, 3 rows
    assert stream.rows_held[0] >= {t for r in reqs for t in r.prefix + r.query}
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens
        assert float((a.step_logits[0] - b.step_logits[0]).abs().max()) < 1e-4


def test_block_schedule_gives_each_requests_own_answer(tiny_runtimes):
    rt = tiny_runtimes["llama-tiny"]
    engine = _engine(rt)
    reqs = [Request(list(range(11, 11 + n)), [7, 8][:1 + n % 2], 3, keep_logits=True)
            for n in (5, 19, 8, 12)]
    alone = [engine.serve(r) for r in reqs]
    rows, real = [], engine.runner.math.qkv
    engine.runner.math.qkv = lambda w, x, *a: rows.append(x.shape[0]) or real(w, x, *a)
    try:
        together = serve_block(engine, reqs, (2, 2))
    finally:
        engine.runner.math.qkv = real
    assert max(rows) == 2          # decode steps of up to 4 in micro-batches of 2
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens
        for x, y in zip(a.step_logits, b.step_logits):
            assert float((x - y).abs().max()) < 1e-4


def test_throughput_flags_make_the_block():
    from impress_flexgen.config import ServiceConfig
    from impress_flexgen.entrypoints.run import parse_args

    assert ServiceConfig(throughput=True).max_batch_size == 64          # 8 x 8 by default
    args = parse_args(["--model", "opt-tiny", "--throughput", "--gpu-batch-size", "2",
                       "--num-gpu-batches", "3", "--no-overlap"])
    config = ServiceConfig.from_args(args)
    r = config.runtime
    assert (r.gpu_batch_size, r.num_gpu_batches, r.overlap) == (2, 3, False)
    assert config.throughput and config.max_batch_size == 6 and config.queue_size >= 6
    plain = ServiceConfig.from_args(parse_args(["--model", "opt-tiny"]))
    assert not plain.throughput and plain.max_batch_size == 8 and plain.runtime.overlap


def test_metrics_count_the_weights_read_and_waited_for(on_disk):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from impress_flexgen.metrics import _WeightCounters

    engine = _engine(on_disk[True])
    engine.serve(Request([5, 6, 7], [9], 2))
    registry = CollectorRegistry()
    registry.register(_WeightCounters(engine.runner.weights))
    got = {s.name: s.value for fam in text_string_to_metric_families(
        generate_latest(registry).decode()) for s in fam.samples}
    assert got["impress_flexgen_weight_bytes_read_total"] == engine.runner.weights.bytes_read > 0
    assert got["impress_flexgen_weight_wait_seconds_total"] > 0
