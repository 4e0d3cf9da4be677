"""The one way to build policy + store + tiers + engine, and the request stats' timer."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from impress_flexgen.engine import Request, RequestStats, StoreSpec, assemble, open_store
from impress_flexgen.errors import UserError
from impress_flexgen.tiers import TierConfig
from policies import ServingConfig, make_policy


def test_assemble_serves_as_the_stack_built_by_hand(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    prefix = np.random.default_rng(5).integers(10, 40000, 48).tolist()
    cfg = ServingConfig(retention=0.5)
    stack = assemble(rt, make_policy("impress", cfg), StoreSpec(tmp_path / "a", chunk_size=16),
                     TierConfig(0, 1 << 20))
    try:
        assert stack.engine.store is stack.store and stack.store is not None
        assert stack.store.config.chunk_size == 16 and stack.store.tiers.cache is not None
        got = [stack.engine.serve(Request(prefix, [7, 8], 3)) for _ in range(2)]
    finally:
        stack.close()
    assert stack.store.inspect().state.closed
    policy = make_policy("impress", cfg)
    store = open_store(tmp_path / "b", rt, cfg, policy, chunk_size=16)
    try:
        engine = assemble(rt, policy, store, TierConfig(0, 1 << 20)).engine
        want = [engine.serve(Request(prefix, [7, 8], 3)) for _ in range(2)]
    finally:
        store.close()
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert got[1].stats.matched_tokens == want[1].stats.matched_tokens == 48


def test_a_policy_that_reuses_nothing_opens_no_store(tiny_runtimes, tmp_path):
    stack = assemble(tiny_runtimes["opt-tiny"], make_policy("recomp"), StoreSpec(tmp_path / "s"))
    stack.close()
    assert stack.store is None and stack.engine.store is None
    assert not (tmp_path / "s").exists()


def test_a_store_that_cannot_be_opened_is_refused_naming_it(tiny_runtimes, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(UserError, match="store directory .*file/store: Not a directory"):
        assemble(tiny_runtimes["opt-tiny"], make_policy("full"),
                 StoreSpec(tmp_path / "file" / "store"))


def test_the_store_is_closed_when_the_engine_cannot_be_built(tiny_runtimes, tmp_path,
                                                            monkeypatch):
    assemble_module = sys.modules["impress_flexgen.engine.assemble"]   # (the package's
    opened = []                                                         # name: the function)
    real_open = assemble_module._open

    def recording_open(*args):
        opened.append(real_open(*args))
        return opened[-1]

    def failing_engine(*args):
        raise UserError("no engine")

    monkeypatch.setattr(assemble_module, "_open", recording_open)
    monkeypatch.setattr(assemble_module, "Engine", failing_engine)
    with pytest.raises(UserError, match="no engine"):
        assemble(tiny_runtimes["opt-tiny"], make_policy("full"), StoreSpec(tmp_path / "s"))
    assert opened and opened[0].inspect().state.closed


def test_the_timer_adds_the_block_less_the_excluded_stats(monkeypatch):
    import impress_flexgen.request as request

    clock = iter([10.0, 13.0, 20.0, 20.5, 30.0, 31.0])

    class Clock:
        perf_counter = staticmethod(lambda: next(clock))

    monkeypatch.setattr(request, "time", Clock)
    stats = RequestStats(select_s=1.0)
    with stats.timer("select_s", exclude=("probe_s", "load_s")):
        stats.probe_s += 0.5          # I/O inside the block is not selection time
        stats.load_s += 1.0
    assert stats.select_s == 1.0 + 3.0 - 1.5
    with stats.timer("load_s"):
        pass
    assert stats.load_s == 1.5
    with pytest.raises(ValueError):  # a block that raises still counts its time
        with stats.timer("compute_s"):
            raise ValueError
    assert stats.compute_s == 1.0


def test_engines_on_one_runtime_take_turns_through_its_model(tiny_runtimes):
    """FlexGen's weight buffers are the model's: a prefill on one engine (a planner's
    background recalibration) waits while another engine of the same runtime serves."""
    import threading

    rt = tiny_runtimes["opt-tiny"]
    first = assemble(rt, make_policy("recomp", ServingConfig()), None, TierConfig()).engine
    second = assemble(rt, make_policy("recomp", ServingConfig()), None, TierConfig()).engine
    done = threading.Event()
    with second.lock:                                      # a request under way there
        thread = threading.Thread(target=lambda: (first.measure_prefill(8), done.set()))
        thread.start()
        assert not done.wait(0.3)                          # the recalibration waits its turn
    thread.join(10)
    assert done.is_set()


def test_a_request_past_the_model_positions_is_refused_before_it_runs(tiny_runtimes):
    """A library caller gets the model's limit, not an index error from deep in a layer
    (opt-tiny has 1,024 positions: its position table ends there)."""
    rt = tiny_runtimes["opt-tiny"]
    engine = assemble(rt, make_policy("recomp"), None).engine
    limit = rt.spec.config.max_seq_len
    with pytest.raises(UserError, match=f"need {limit + 1} positions, more than "
                                        f"{rt.spec.name}'s {limit}"):
        engine.serve(Request(list(range(10, limit + 8)), [7], 2))   # limit - 1 + 2 new
    fits = engine.serve(Request(list(range(10, limit + 7)), [7], 2))    # exactly the limit
    assert len(fits.tokens) == 2
