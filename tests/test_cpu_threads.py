"""One thread computes with every core; the runtime's helper threads use one (cpu_threads)."""
from __future__ import annotations

import threading

import torch

from impress_flexgen import cpu_threads


def _on_thread(fn):
    box = []
    th = threading.Thread(target=lambda: box.append(fn()))
    th.start()
    th.join()
    return box[0]


def _restore(n: int) -> None:
    # torch's process-wide count (a fresh thread's start) back to what the tests began with.
    _on_thread(lambda: torch.set_num_threads(n))


def test_compute_lock_gives_its_holder_the_compute_count(monkeypatch):
    """A helper's count of one is what the next fresh thread starts with; holding an
    engine's ComputeLock sets the holder's count back to COMPUTE_THREADS."""
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "COMPUTE_THREADS", 3)
    lock = cpu_threads.ComputeLock()
    try:
        assert _on_thread(lambda: (cpu_threads.helper_thread(), torch.get_num_threads())[1]) == 1
        assert _on_thread(torch.get_num_threads) == 1       # inherited from the helper

        def computing():
            with lock:
                with lock:                                  # reentrant
                    return torch.get_num_threads()
        assert _on_thread(computing) == 3
    finally:
        _restore(before)


def test_single_threaded_restores_the_callers_count():
    n = torch.get_num_threads()
    with cpu_threads.single_threaded():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == n


def test_runtime_loads_the_weights_single_threaded(monkeypatch):
    """The main thread that loads the weights starts no CPU team of its own."""
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    seen = []
    build = Runtime._build

    def spy(self):
        seen.append(torch.get_num_threads())
        return build(self)

    monkeypatch.setattr(Runtime, "_build", spy)
    n = torch.get_num_threads()
    with Runtime(RuntimeConfig(model="llama-tiny")):
        pass
    # Where a GPU computes, the host-side copies of a load keep every core.
    assert seen == [n if torch.cuda.is_available() else 1] and torch.get_num_threads() == n


def test_helper_threads_run_torch_alone(tmp_path):
    """The store writer and the disk readers run torch on themselves alone."""
    from disk_layout.reader import DiskReader
    from impress_flexgen.engine.store_writer import StoreWriter

    before = torch.get_num_threads()
    try:
        writer = StoreWriter()
        assert writer.submit(torch.get_num_threads).result(timeout=30) == 1
        writer.wait_idle()
        reader = DiskReader(threads=2)
        try:
            assert reader.pool.submit(torch.get_num_threads).result(timeout=30) == 1
        finally:
            reader.close()
    finally:
        _restore(before)


def test_on_passing_thread_returns_and_raises_on_the_caller():
    main = threading.current_thread()
    assert cpu_threads.on_passing_thread(lambda a: (a, threading.current_thread() is main),
                                         7) == (7, False)

    def fails():
        raise ValueError("from the passing thread")
    try:
        cpu_threads.on_passing_thread(fails)
    except ValueError as exc:
        assert "passing thread" in str(exc)
    else:
        raise AssertionError("the exception was not raised on the caller")


def test_service_starts_its_engine_off_the_callers_thread(tmp_path, monkeypatch):
    """Calibrating at start-up computes; it runs on a thread that ends, so the caller's
    thread keeps no CPU team beside the worker's."""
    import importlib

    building = importlib.import_module("impress_flexgen.engine.assemble")
    from impress_flexgen.service import Service, ServiceConfig

    seen = []
    start = building.start_engine

    def spy(engine):
        seen.append(threading.current_thread() is threading.main_thread())
        return start(engine)

    monkeypatch.setattr(building, "start_engine", spy)
    with Service(ServiceConfig(model="llama-tiny", store_root=tmp_path)):
        pass
    assert seen == [False]


def test_an_idle_service_keeps_no_scheduler_thread(tmp_path):
    """The scheduler's thread (and with it its CPU team) ends when nothing runs or waits,
    and the next request starts it again; closing an idle service still works."""
    import time

    from impress_flexgen.service import Service, ServiceConfig

    def workers():
        return [t for t in threading.enumerate() if t.name == "engine-worker"]

    def idle_within(seconds: float = 30.0) -> bool:
        deadline = time.monotonic() + seconds
        while workers():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    with Service(ServiceConfig(model="llama-tiny", store_root=tmp_path)) as service:
        assert not workers()
        for _ in range(2):
            done = service.complete(service.frontend.build(prompt="a b c d e f", max_tokens=3))
            assert done.completion_tokens == 3
            assert idle_within()
