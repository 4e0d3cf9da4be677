"""What the store must never take from others, end to end; experiments.abuse_test counts
these as classes beside its hostile clients. Each function returns {"passed": bool, ...}
with what it measured.

unauthenticated_pool  a loopback redis-server as the shared pool, no secret. A writer
                      stores and publishes a prefix; then every value of it is replaced by
                      KV that is wrong (zeros, or noise) under a valid CRC, as anyone able
                      to write to Redis can. A reader with an empty store serves the prompt
                      from the pool (its answer may change: it trusted the pool) but keeps
                      nothing of it in its own store, so the same store without the pool
                      answers as a fresh one. The reader's start-up warns; a pool on another
                      machine without a secret is refused in one line, exit status 2.
                      {"passed": False, "skipped": ...} where there is no redis-server.
fingerprint_edit      a Hugging Face checkpoint (a seeded tiny Llama) served through
                      --model-path's conversion; a run stores a prefix. (a) A converted weight
                      file is negated in place and its mtime put back: the next build converts
                      again, and a request answers as on a fresh store. (b) The checkpoint
                      itself is edited so, mtime put back: converted again, the weights digest
                      (which keys stored KV) changes, the store folder follows it, and nothing
                      stored with the old weights is matched.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

MODEL = "llama-tiny"
CHUNK = 16
K_PROJ = "layers.0.self_attn.k_proj.weight"     # a converted file: K of the first layer

# stored_vs_computed_logprobs: the check that stored and computed prefixes give identical
# log-probabilities lives beside these two.


def _prompt(seed: int, n: int, vocab: int = 40000) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab, n).tolist()


def _engine(rt, store_dir, url=None, secret=None):
    from impress_flexgen.engine import assemble, open_store
    from impress_flexgen.tiers import TierConfig
    from policies import ServingConfig, make_policy

    cfg = ServingConfig(retention=1.0)
    policy = make_policy("full", cfg)
    store = open_store(store_dir, rt, cfg, policy, chunk_size=CHUNK)
    engine = assemble(rt, policy, store, TierConfig(0, 0, remote_url=url, remote_secret=secret)).engine
    if engine.shared is not None:     # always worth reading: this is about what it holds
        engine.shared.recompute_s = lambda n, ctx: 1e9
    return engine, store


def _serve(rt, store_dir, prefix, query, url=None):
    """(tokens, stats, the query's last logits) of one request."""
    from impress_flexgen.engine import Request

    engine, store = _engine(rt, store_dir, url)
    try:
        resp = engine.serve(Request(prefix, query, 4), query_logits=True)
        if engine.shared is not None:
            engine.shared.tier.flush(10)
        return resp.tokens, resp.stats, resp.query_logits[-1].float()
    finally:
        engine.close()
        store.close()


def _gap(a, b) -> float:
    """Largest difference of two logit vectors: rounding (KV stored in fp16) stays far below
    LOGIT_GAP, KV of other weights far above."""
    return float((a - b).abs().max())


LOGIT_GAP = 0.05


@contextlib.contextmanager
def _env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _refused_in_one_line(argv) -> tuple[int, list[str]]:
    from impress_flexgen.entrypoints import run
    from impress_flexgen.entrypoints.process import run_main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = run_main("python -m impress_flexgen.run", run.main, argv)
        except SystemExit as exc:
            rc = exc.code
    return rc, [line for line in err.getvalue().strip().splitlines()
                if not line.startswith(("usage:", " "))]


# -- unauthenticated_pool --------------------------------------------------------------------
def _forge(url: str, namespace, prefix, how: str, seed: int) -> int:
    """Replace every value of `prefix`'s chunks with wrong KV under a valid CRC (no secret
    is needed to make one). The values replaced."""
    import redis
    import torch

    from impress_flexgen.tiers.remote import chunk_hashes, encode_value, layer_key

    client = redis.Redis.from_url(url)
    g = torch.Generator().manual_seed(seed)
    n = 0
    for h in chunk_hashes(namespace, prefix):
        for layer in range(namespace.n_layers):
            payload = torch.zeros(namespace.value_shape, dtype=namespace.torch_dtype) \
                if how == "zeros" else \
                torch.randn(namespace.value_shape, generator=g).to(namespace.torch_dtype)
            client.set(layer_key(h, layer), encode_value(payload, namespace, h, layer))
            n += 1
    client.close()
    return n


def unauthenticated_pool(quick: bool, workdir=None) -> dict:
    """One forgery quick (zeros), three otherwise (zeros, noise, zeros over other prompts)."""
    from impress_flexgen.engine import Request, start_engine
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig
    from tests.redis_server import RedisServer, find_redis_server

    binary = find_redis_server()
    if binary is None:
        return {"passed": False, "skipped": "redis-server not found"}
    forgeries = ("zeros",) if quick else ("zeros", "noise", "zeros")
    rounds, problems = [], []
    with tempfile.TemporaryDirectory(prefix="abuse-pool-", dir=workdir) as tmp, \
            _env("IMPRESS_REMOTE_SECRET", None), RedisServer(binary) as server:
        tmp = Path(tmp)
        rt = Runtime(RuntimeConfig(model=MODEL, offload_dir=str(tmp / "off")))
        try:
            for i, how in enumerate(forgeries):
                prefix, query = _prompt(700 + i, 8 * CHUNK + 5), _prompt(800 + i, 6)
                truth, _, _ = _serve(rt, tmp / f"fresh-{i}", prefix, query)
                # A writer computes, stores and publishes; someone rewrites what it published.
                writer, wstore = _engine(rt, tmp / f"writer-{i}", server.url)
                try:
                    writer.serve(Request(prefix, query, 4))
                    writer.shared.tier.flush(10)
                    namespace = writer.shared.namespace_for("")
                finally:
                    writer.close()
                    wstore.close()
                forged = _forge(server.url, namespace, prefix, how, seed=i)
                reader_dir = tmp / f"reader-{i}"
                reader, rstore = _engine(rt, reader_dir, server.url)
                try:
                    warned = any("has no secret" in w for w in start_engine(reader))
                    resp = reader.serve(Request(prefix, query, 4))
                    reader.shared.tier.flush(10)
                    kept = len(rstore.inspect().state.tree)
                finally:
                    reader.close()
                    rstore.close()
                # The same store without the pool: a fresh store's answer, nothing matched.
                after, stats, _ = _serve(rt, reader_dir, prefix, query)
                row = {"forgery": how, "values_forged": forged,
                       "shared_tokens": resp.stats.shared_tokens,
                       "answer_changed_by_the_pool": resp.tokens != truth,
                       "nodes_stored_by_the_reader": kept, "warned_at_start": warned,
                       "matched_after": stats.matched_tokens, "answer_after_is_fresh":
                       after == truth}
                rounds.append(row)
                if resp.stats.shared_tokens == 0:
                    problems.append(f"{how}: the reader did not read the pool (nothing tested)")
                if kept or stats.matched_tokens or after != truth:
                    problems.append(f"{how}: pool KV became local state ({kept} nodes, "
                                    f"{stats.matched_tokens} tokens matched afterwards)")
                if not warned:
                    problems.append(f"{how}: no warning about the pool's missing secret")
        finally:
            rt.close()
        rc, err = _refused_in_one_line(
            ["--model", MODEL, "--remote-tier", "redis://10.0.0.7:6379/0", "--prompt", "hi",
             "--store-dir", str(tmp / "refused")])
    remote_refused = rc == 2 and len(err) == 1 and "--remote-insecure" in err[0]
    if not remote_refused:
        problems.append(f"a pool on another machine without a secret: exit {rc}, {err[:2]}")
    return {"passed": not problems, "rounds": rounds, "remote_without_secret_refused":
            remote_refused, "problems": problems}


# -- fingerprint_edit -----------------------------------------------------------------------
def _checkpoint(path: Path) -> Path:
    """A seeded tiny Llama saved as a Hugging Face checkpoint (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4321)
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=10000.0,
                         tie_word_embeddings=False, initializer_range=0.25)
    # Weights larger than a fresh model's (0.02): attention then depends on K, so KV of
    # other weights shows in the logits, not only in the digest.
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def _keeping_mtime(path: Path, edit) -> None:
    """Run edit(path) (a write in place: same size, same inode), then put the mtime back;
    only the ctime (which nobody can set) tells."""
    st = os.stat(path)
    time.sleep(0.05)                  # the ctime moves with the clock tick: let one pass
    edit(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _negate_npy(path: Path) -> None:
    data = np.load(path, mmap_mode="r+")
    data[...] = -data
    data.flush()
    del data


def _negate_safetensors(path: Path, name: str) -> None:
    """Flip the sign of every float of tensor `name` in place (its high bytes)."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        entry = header[name]
        begin, end = entry["data_offsets"]
        width = {"F32": 4, "F16": 2, "BF16": 2}[entry["dtype"]]
        f.seek(8 + size + begin)
        raw = bytearray(f.read(end - begin))
        raw[width - 1::width] = bytes(b ^ 0x80 for b in raw[width - 1::width])
        f.seek(8 + size + begin)
        f.write(raw)


def _build(ckpt: Path, off: Path):
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    return Runtime(RuntimeConfig(model_path=str(ckpt), offload_dir=str(off)))


def _store_root(rt) -> Path:
    from impress_flexgen.config import StoreOptions
    from impress_flexgen.engine import model_shape

    return StoreOptions().root_for(model_shape(rt.spec, CHUNK))


def fingerprint_edit(quick: bool, workdir=None) -> dict:
    """Both edits, quick or not: each is one conversion and a few requests of a tiny model."""
    prefix, query = _prompt(900, 12 * CHUNK + 3, 1024), _prompt(901, 5, 1024)
    problems: list[str] = []
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="abuse-weights-", dir=workdir) as tmp:
        tmp = Path(tmp)
        with _env("IMPRESS_FLEXGEN_CACHE", str(tmp / "cache")):
            ckpt = _checkpoint(tmp / "tiny-llama")
            rt = _build(ckpt, tmp / "off")
            try:
                converted = Path(rt.spec.weight_path)
                digest0, root0 = rt.spec.weights_digest, _store_root(rt)
                _serve(rt, root0, prefix, query)            # stores the prefix
            finally:
                rt.close()
            # (a) a converted file negated in place, its mtime put back
            victim = converted / K_PROJ
            before = victim.read_bytes()
            k_proj = np.load(victim)
            _keeping_mtime(victim, _negate_npy)
            rt = _build(ckpt, tmp / "off")
            try:
                again, stats, logits = _serve(rt, _store_root(rt), prefix, query)
                fresh, _, fresh_logits = _serve(rt, tmp / "fresh-a", prefix, query)
                out["converted_edit"] = {
                    "converted_again": victim.read_bytes() == before,
                    "digest_unchanged": rt.spec.weights_digest == digest0,
                    "matched_tokens": stats.matched_tokens, "answer_as_fresh": again == fresh,
                    "logit_gap_to_fresh": _gap(logits, fresh_logits)}
            finally:
                rt.close()
            a = out["converted_edit"]
            if not (a["converted_again"] and a["answer_as_fresh"]
                    and a["logit_gap_to_fresh"] < LOGIT_GAP):
                problems.append(f"a converted file edited with its mtime put back: {a}")
            # (b) the checkpoint itself negated in place (one tensor), its mtime put back
            served_k = np.load(victim)
            _keeping_mtime(ckpt / "model.safetensors", lambda p: _negate_safetensors(
                p, "model.layers.0.self_attn.k_proj.weight"))
            rt = _build(ckpt, tmp / "off")
            try:
                root1 = _store_root(rt)
                again, stats, logits = _serve(rt, root1, prefix, query)
                fresh, _, fresh_logits = _serve(rt, tmp / "fresh-b", prefix, query)
                now_k = np.load(Path(rt.spec.weight_path) / K_PROJ)
                out["checkpoint_edit"] = {
                    "digest_changed": rt.spec.weights_digest != digest0,
                    "store_folder_changed": root1 != root0,
                    "matched_tokens": stats.matched_tokens, "answer_as_fresh": again == fresh,
                    "logit_gap_to_fresh": _gap(logits, fresh_logits),
                    "converted_again": not np.array_equal(now_k, served_k)
                    and np.array_equal(now_k, -k_proj)}
            finally:
                rt.close()
            b = out["checkpoint_edit"]
            if not (b["digest_changed"] and b["store_folder_changed"] and b["answer_as_fresh"]
                    and b["matched_tokens"] == 0 and b["converted_again"]
                    and b["logit_gap_to_fresh"] < LOGIT_GAP):
                problems.append(f"a checkpoint edited with its mtime put back: {b}")
    return {"passed": not problems, **out, "problems": problems}
