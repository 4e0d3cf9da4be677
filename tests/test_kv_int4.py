"""The int4 store format: 4-bit groups of 32 values with an fp16 scale and minimum, on
disk, in the memory tiers, decoded when loaded; lossy, so inexact and kept apart."""
from __future__ import annotations

import pytest
import torch

from disk_layout import format as fmt
from impress_flexgen.engine import Request, assemble, model_shape, open_store
from impress_flexgen.errors import UserError
from impress_flexgen.store import ModelShape, PrefixStore, StoreConfig
from impress_flexgen.store.root import _store_name
from impress_flexgen.tiers import TierConfig
from policies import ServingConfig, make_policy
from tests.helpers.fixtures import redis_server as server  # noqa: F401 - a fixture
from tests.helpers.ids import prompt_ids as _ids


def _bound(values: torch.Tensor) -> torch.Tensor:
    """Half a code step of each value's group, plus fp16's rounding of scale and minimum."""
    groups = values.reshape(values.shape[0], -1, 32)
    span = groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)
    return (span / 30 * 1.01 + groups.abs().amax(-1, keepdim=True) * 1e-3).expand_as(groups)


def test_int4_chunks_round_trip_within_half_a_step_in_five_sixteenths_of_fp16():
    x = torch.randn(6, 3, 16, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, 0, :32] = 1.5          # a constant group: exact
    packed = fmt.encode_int4_chunks(x)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 3 * 16 * 64 * 5 // 8)
    assert fmt.kv_bytes("int4", 3 * 16 * 64) * 16 == fmt.kv_bytes("fp16", 3 * 16 * 64) * 5
    back = fmt.decode_int4_chunks(packed, (3, 16, 64))
    err = (back - x).reshape(6, -1, 32).abs()
    assert bool((err <= _bound(x)).all())
    assert float(err.max()) > 0 and torch.equal(back[0, 0, 0, :32], x[0, 0, 0, :32])
    # The layout of a file: packed (not whole pages), chunks of that size.
    lay = fmt.LayerFileLayout(64, 16, 3, 64, 1, "int4", True, "int4")
    assert lay.chunk_bytes == 1920 and lay.chunk_shape == (1920,)
    assert fmt.decode_chunks(list(packed.unbind(0)), lay)[2].shape == (3, 16, 64)


def _shape(kv_format):
    return ModelShape("m", 1, 2, 16, "a" * 64, kv_format=kv_format,
                      kv_exact=kv_format == "fp32")


def test_a_store_keeps_int4_bytes_on_disk_and_reads_back_decoded(tmp_path):
    kv = torch.randn(2, 2, 32, 16, generator=torch.Generator().manual_seed(1))
    tokens = _ids(9, 32)
    with PrefixStore(tmp_path / "s", _shape("int4"), StoreConfig(direct_io=False)) as store:
        store.insert(tokens, 0, [(kv[0], kv[1])])
        entry = store.inspect().state.tree.match_prefix(tokens).nodes[0].layers[0]
        assert entry.layout.chunk_bytes == 2 * 16 * 16 * 5 // 8 == 320
        raw = store.inspect().reads.read_chunks(entry, "k", [0, 1])
        assert [tuple(c.shape) for c in raw] == [(320,), (320,)] and raw[0].dtype == torch.uint8
        k, v = store.inspect().reads.read_layer(entry)
        assert k.dtype == torch.float32 and k.shape == kv[0].shape
        for got, want in ((k, kv[0]), (v, kv[1])):
            flat = want.reshape(1, -1)
            assert bool(((got.reshape(1, -1) - flat).reshape(1, -1, 32).abs()
                         <= _bound(flat)).all())
        assert store.inspect().accounting.kv_bytes() == 2 * 2 * 320
        assert store.shape.kv_bytes_per_token_layer == 2 * 2 * 16 * 5 // 8


def test_the_format_is_in_the_meta_the_identity_and_the_name_and_formats_never_mix(tmp_path):
    from impress_flexgen.models import resolve

    with PrefixStore(tmp_path / "s", _shape("int4"), StoreConfig(direct_io=False)) as store:
        assert store.inspect().state.meta.get_meta()["kv_format"] == "int4"
    for other in ("fp16", "fp32"):
        with pytest.raises(UserError, match=f"holds int4 KV, not {other}"):
            PrefixStore(tmp_path / "s", _shape(other), StoreConfig(direct_io=False))
    spec = resolve("llama-tiny", seed=0)
    shapes = {f: model_shape(spec, kv_format=f) for f in ("fp32", "fp16", "bf16", "int4")}
    assert len({s.fingerprint for s in shapes.values()}) == 4
    assert not shapes["int4"].kv_exact
    args = type("A", (), {"chunk_size": 16, "probe_format": "int4"})()
    assert _store_name("impress", args, "int4") != _store_name("impress", args, "fp16")
    with pytest.raises(UserError, match="multiple of 4"):
        ModelShape("m", 1, 2, 6, kv_format="int4")
    # The shared pool keys values by format too: int4 values live under other keys.
    from impress_flexgen.tiers.remote_codec import RemoteNamespace

    pools = {d: RemoteNamespace("m", 1, 2, 16, d, 16) for d in ("float16", "int4")}
    assert pools["float16"].seed() != pools["int4"].seed()
    assert pools["int4"].value_shape == (2, 1, 1, 320)


def _engine(rt, path, policy, kv_format, tiers=TierConfig(), retention=1.0):
    cfg = ServingConfig(retention=retention)
    pol = make_policy(policy, cfg)
    store = open_store(path, rt, cfg, pol, chunk_size=16, kv_format=kv_format)
    return assemble(rt, pol, store, tiers).engine, store


def _kl(p, q):
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("model", ["llama-tiny", "opt-tiny"])
def test_an_int4_store_serves_prefill_and_decode_close_to_an_fp32_store(tiny_runtimes,
                                                                        tmp_path, model):
    """Every chunk loaded (random at retention 1.0, a reader that is not exact)."""
    rt = tiny_runtimes[model]
    prefix, query = _ids(1, 192), _ids(2, 9)
    out = {}
    for kv_format in ("fp32", "int4"):
        engine, store = _engine(rt, tmp_path / kv_format, "random", kv_format)
        try:
            engine.serve(Request(prefix, query, 1))
            out[kv_format] = engine.serve(Request(prefix, query, 4, keep_logits=True),
                                    query_logits=True)
        finally:
            engine.close()
            store.close()
    a, b = out["fp32"], out["int4"]
    assert a.stats.matched_tokens == b.stats.matched_tokens == 192 and not b.stats.exact
    # Layers x (K, V) x 12 chunks, fp32 (whole pages) against int4 (packed: a run of 12
    # chunks is read as the pages it touches; llama-tiny: 12 x 320 bytes, one page).
    fp32, int4 = (model_shape(rt.spec, 16, f) for f in ("fp32", "int4"))
    assert a.stats.bytes_read["disk"] == fp32.n_layers * 2 * 12 * fp32.chunk_bytes(16)
    assert b.stats.bytes_read["disk"] == int4.n_layers * 2 * fmt.align_up(12 * int4.chunk_bytes(16))
    assert b.stats.bytes_read["disk"] * 5 < a.stats.bytes_read["disk"]
    assert not torch.equal(a.query_logits, b.query_logits)          # int4 was read
    assert _kl(a.query_logits, b.query_logits) < 0.05
    assert _kl(torch.stack(a.step_logits), torch.stack(b.step_logits)) < 0.05
    agree = (a.query_logits.argmax(-1) == b.query_logits.argmax(-1)).float().mean()
    assert float(agree) >= 0.75


def test_an_exact_reader_never_gets_int4_kv(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    prefix = _ids(8, 128)
    engine, store = _engine(rt, tmp_path / "s", "full", "int4")
    try:
        first = engine.serve(Request(prefix, _ids(2, 9), 3), query_logits=True)
        again = engine.serve(Request(prefix, _ids(2, 9), 3), query_logits=True)
        assert again.stats.matched_tokens == 0 and again.stats.exact      # recomputed
        assert torch.equal(first.query_logits, again.query_logits)
        assert not any(n.exact for n in store.inspect().state.tree.nodes.values())
    finally:
        engine.close()
        store.close()


def test_a_corrupt_int4_chunk_is_caught_by_its_crc_and_recomputed(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    prefix, query = _ids(10, 64), _ids(11, 5)
    engine, store = _engine(rt, tmp_path / "s", "random", "int4")
    try:
        engine.serve(Request(prefix, query, 3))
        (node,) = store.inspect().state.tree.nodes.values()
        entry = store.entry(node, 1)
        with open(entry.path, "r+b") as f:      # a scale byte of K chunk 1
            f.seek(entry.layout.chunk_offset("k", 1) + entry.layout.chunk_bytes - 3)
            f.write(b"\x7f")
        resp = engine.serve(Request(prefix, query, 3))
        assert resp.stats.recovered_from_corruption == 1 and resp.stats.matched_tokens == 0
        healed = engine.serve(Request(prefix, query, 3))
        assert healed.stats.matched_tokens == 64
    finally:
        engine.close()
        store.close()


def test_the_memory_tiers_hold_int4_bytes_and_count_them(tiny_runtimes, tmp_path):
    rt = tiny_runtimes["llama-tiny"]
    prefix = _ids(3, 128)
    engine, store = _engine(rt, tmp_path / "s", "random", "int4",
                            TierConfig(gpu_bytes=0, cpu_bytes=1 << 20))
    try:
        engine.serve(Request(prefix, _ids(2, 9), 1))
        engine.serve(Request(prefix, _ids(2, 9), 1))         # reads every chunk from disk
        hit = engine.serve(Request(prefix, _ids(2, 9), 1))   # ... and now from the CPU tier
        cache = store.tiers.cache
        cpu = cache.tiers[1]
        chunk = 2 * 16 * 16 * 5 // 8
        n = 2 * 2 * 128 // 16                          # layers x (K, V) x chunks
        assert len(cpu.chunks) == n and cpu.used == n * chunk
        assert all(r.tensor.dtype == torch.uint8 and r.tensor.numel() == chunk
                   for r in cpu.chunks.values())
        assert hit.stats.bytes_read["cpu"] == n * chunk and hit.stats.bytes_read["disk"] == 0
    finally:
        engine.close()
        store.close()


def _pool_engine(rt, path, url):
    cfg = ServingConfig(retention=1.0)
    policy = make_policy("random", cfg)
    store = open_store(path, rt, cfg, policy, chunk_size=16, kv_format="int4")
    engine = assemble(rt, policy, store, TierConfig(0, 0, remote_url=url)).engine
    engine.shared.recompute_s = lambda n, ctx: 1e9      # always worth reading
    return engine, store


def test_the_shared_pool_holds_an_int4_stores_bytes_and_serves_them(tiny_runtimes, tmp_path,
                                                                    server):
    import redis

    rt = tiny_runtimes["llama-tiny"]
    redis.Redis.from_url(server.url).flushdb()
    prefix, query = _ids(4, 128), _ids(5, 6)
    out = {}
    for name in ("a", "b"):       # b's local store is empty: the pool gives it the prefix
        engine, store = _pool_engine(rt, tmp_path / name, server.url)
        try:
            out[name] = engine.serve(Request(prefix, query, 3, keep_logits=True),
                                     query_logits=True)
            assert engine.shared.tier.flush(10)
            written = engine.shared.tier.metrics()["bytes_in"]
        finally:
            engine.close()
            store.close()
        if name == "a":            # 2 layers x 8 chunks, K and V of 320 bytes each
            assert written == 2 * 8 * 2 * 320
    a, b = out["a"], out["b"]
    assert b.stats.shared_tokens == 128 and b.stats.bytes_read["remote"] == 2 * 8 * 2 * 320
    assert _kl(a.query_logits, b.query_logits) < 0.05


def test_the_accuracy_and_ttft_experiments_have_rows_per_store_format():
    from experiments import accuracy, ttft

    runs = accuracy.format_runs(["fp16", "int4"], (0.25,))
    assert [(r.label, r.kv_format) for r in runs] == [
        ("full", None), ("every chunk [fp16]", "fp16"), ("impress [fp16]", "fp16"),
        ("every chunk [int4]", "int4"), ("impress [int4]", "int4")]
    assert [r.kv_format for r in ttft.format_runs(["int4"], 0.25, 16)] == [None, "int4", "int4"]
    for module in (accuracy, ttft):
        assert module.parse_args(["--kv-formats", "int4,fp32"]).kv_formats == ["fp32", "int4"]
        with pytest.raises(SystemExit) as exc:
            module.parse_args(["--kv-formats", "int3"])
        assert exc.value.code == 2
