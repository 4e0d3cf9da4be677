"""Reading a store back: its files, a node's bits, a prefix served like a request."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch

from disk_layout.format import decode_probe, encode_probe
from impress_flexgen.store import CorruptNode, PrefixStore

from .kv import (C, SHAPE, Prefixes, expected_bits, insert_prefix, kv_from_bits, store_config,
                 tensor_bits)
from .report import error_text


def files_on_disk(store_dir: Path) -> tuple[set[str], list[str]]:
    """Names in data/ other than directories, and every *.tmp anywhere under the store
    directory. (A directory in data/ is not the store's to delete: it is reported apart.)"""
    data = store_dir / "data"
    names = {e.name for e in os.scandir(data) if not e.is_dir(follow_symlinks=False)} \
        if data.is_dir() else set()
    tmps = [str(p.relative_to(store_dir)) for p in store_dir.rglob("*.tmp")]
    return names, tmps


def live_files(store: PrefixStore) -> set[str]:
    return {os.path.basename(e.path) for n in store.inspect().state.tree.nodes.values() for e in n.layers}


def stray_files(store: PrefixStore) -> set[str]:
    """Files in data/ that no live layer entry references, and *.tmp files anywhere."""
    names, tmps = files_on_disk(store.inspect().state.dir)
    return {f"data/{n}" for n in names - live_files(store)} | set(tmps)


def orphans(store: PrefixStore) -> list[str]:
    return sorted(stray_files(store))


def is_wrong(why: str | None) -> bool:
    """check_node's verdict says bits differ (not: unreadable, which the store reports)."""
    return why is not None and not why.startswith(("unreadable", "error"))


def expected_probe(store: PrefixStore, entry, want_k: np.ndarray) -> torch.Tensor:
    """The probe section `entry` should hold, from logical K bits (heads, n, head_dim)."""
    k_phys = torch.from_numpy(np.ascontiguousarray(want_k).view(np.float16))
    if entry.mapping is not None:
        k_phys = k_phys[:, torch.from_numpy(np.asarray(entry.mapping, dtype=np.int64))]
    lay = entry.layout
    return decode_probe(encode_probe(k_phys[list(store.config.probe_heads)], lay.probe_format),
                        lay.probe_format, (lay.n_probe, lay.n_tokens, lay.head_dim))


def check_node(store: PrefixStore, node) -> str | None:
    """Read every layer of `node` (probe copy and K/V); None if bit-exact, else why not:
    "unreadable: ..." (CorruptNode), "error: ..." (any other exception), or how bits differ."""
    try:
        tokens = np.concatenate([n.tokens for n in store.inspect().state.tree.path_to(node)])
        want = expected_bits(tokens)[:, :, :, node.start:node.end]
        for layer in range(SHAPE.n_layers):
            entry = store.entry(node, layer)
            try:
                probe = store.start_probe(entry, node).result()
                k, v = store.inspect().reads.read_layer(entry, node)
            except CorruptNode as exc:
                return f"unreadable: {exc}"
            if not (k.shape == v.shape == want[layer, 0].shape and
                    np.array_equal(tensor_bits(k), want[layer, 0]) and
                    np.array_equal(tensor_bits(v), want[layer, 1])):
                return f"layer {layer} K/V differ from the expected bits"
            want_probe = expected_probe(store, entry, want[layer, 0])
            if probe.shape != want_probe.shape or \
                    not torch.equal(probe.view(torch.int32), want_probe.view(torch.int32)):
                return f"layer {layer} probe copy differs from the expected keys"
    except Exception as exc:  # noqa: BLE001 - reported: the store must say CorruptNode
        return f"error: {error_text(exc)}"
    return None


def read_prefix(store: PrefixStore, match) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A request's read of its matched prefix: probe and K/V of every layer, logical order."""
    out = []
    for layer in range(SHAPE.n_layers):
        ks, vs = [], []
        for node, used in match.segments:
            entry = store.entry(node, layer)
            store.start_probe(entry, node).result()
            k, v = store.inspect().reads.read_layer(entry, node)
            ks.append(k[:, :used])
            vs.append(v[:, :used])
        empty = torch.zeros(SHAPE.n_kv_heads, 0, SHAPE.head_dim, dtype=torch.float16)
        out.append((torch.cat(ks, 1) if ks else empty, torch.cat(vs, 1) if vs else empty))
    return out


def prefix_exact(store: PrefixStore, tokens: np.ndarray) -> bool:
    """The store covers tokens' whole chunk-aligned length and reads it back bit-exact."""
    aligned = len(tokens) // C * C
    match = store.match_prefix(tokens)
    try:
        if match.length != aligned:
            return False
        try:
            got = read_prefix(store, match)
        except Exception:  # noqa: BLE001 - CorruptNode, or an error counted elsewhere
            return False
        want = expected_bits(tokens[:aligned])
        return all(np.array_equal(tensor_bits(k), want[layer, 0]) and
                   np.array_equal(tensor_bits(v), want[layer, 1])
                   for layer, (k, v) in enumerate(got))
    finally:
        store.release(match)


def serve(store: PrefixStore, tokens: np.ndarray, hits: list[int], stats: dict,
          say=None) -> bool:
    """Serve a prefix like a request: read what is stored; on CorruptNode quarantine and
    retry; recompute (regenerate) and insert what is missing. True if it is then exact.
    Any other exception is recorded in stats["errors"] (the store should have said
    CorruptNode) and the prefix is given up."""
    aligned = len(tokens) // C * C
    want = expected_bits(tokens[:aligned])
    for _ in range(SHAPE.n_layers * 4):
        match = store.match_prefix(tokens)
        corrupt = None
        try:
            got = read_prefix(store, match)
            if not all(np.array_equal(tensor_bits(k), want[layer, 0, :, :match.length]) and
                       np.array_equal(tensor_bits(v), want[layer, 1, :, :match.length])
                       for layer, (k, v) in enumerate(got)):
                stats["served_corrupt"] = stats.get("served_corrupt", 0) + 1
                if say:
                    say("WRONG")
            if match.length < aligned:
                stats["recomputed"] = stats.get("recomputed", 0) + 1
                store.insert(tokens, match.length, kv_from_bits(want, match.length))
        except CorruptNode as exc:
            corrupt = exc
        except Exception as exc:  # noqa: BLE001 - recorded, the caller reports it
            stats.setdefault("errors", []).append(error_text(exc))
            store.release(match)
            return False
        store.release(match)
        if corrupt is None:
            return prefix_exact(store, tokens)
        hits.append(corrupt.node.id)
        if say:
            say(f"CORRUPT {corrupt.node.id}")
        try:
            store.quarantine(corrupt.node, str(corrupt))
        except Exception as exc:  # noqa: BLE001 - recorded, the caller reports it
            stats.setdefault("errors", []).append(f"quarantine: {error_text(exc)}")
            return False
        if say:
            say("QUARANTINED")
    return False


def fill_store(store: PrefixStore, prefixes: Prefixes, ids, rng) -> None:
    """Insert prefixes like requests, feed random importance back, reorder now and then."""
    for i, p in enumerate(ids):
        tokens = prefixes.tokens(p)
        path = insert_prefix(store, tokens)
        for node in path:
            for layer in range(SHAPE.n_layers):
                scores = rng.random(node.n_tokens).astype(np.float32)
                store.record_selection(store.entry(node, layer), scores, scores > 0.8, None)
        if i % 4 == 3:
            store.reorder_now()


def disjoint_nodes(store: PrefixStore, rng, n: int) -> list:
    """Up to n nodes of which none lies below another: quarantining one never hides another."""
    chosen: list = []
    for nid in rng.permutation(sorted(store.inspect().state.tree.nodes)).tolist():
        node = store.inspect().state.tree.nodes[nid]
        family = set(store.inspect().state.tree.path_to(node)) | set(store.inspect().state.tree.subtree(node))
        if not any(c in family for c in chosen):
            chosen.append(node)
        if len(chosen) == n:
            break
    return chosen


def prefix_bytes(fmt: str, base: Path, chunks: int) -> int:
    """Bytes one prefix of `chunks` chunks takes in a store."""
    tokens = np.arange(chunks * C, dtype=np.int32)
    with PrefixStore(base, SHAPE, store_config(fmt)) as store:
        store.insert(tokens, 0, kv_from_bits(expected_bits(tokens)))
        n = store.inspect().accounting.disk_bytes()
    shutil.rmtree(base)
    return n
