"""The metadata's rows and their checks: every hard-state row carries a CRC-32 of its
fields, checked with its shape (mapping encoding, permutation, file name) on each read;
soft state comes back only where its importance checksum and its sizes fit."""
from __future__ import annotations

import dataclasses
import re
import struct
import zlib

import numpy as np

from .metadata_codec import (decode_importance, decode_mapping, encode_importance,
                             encode_mapping)

_FILE_NAME = re.compile(r"[0-9a-f]{32}\.kv")
_NAMESPACE = re.compile(r"(?:[0-9a-f]{32})?")


def valid_file_name(name: str) -> bool:
    """True only for names the store gives layer files: 32 lowercase hex digits + ".kv"
    (no separators, no "..", nothing absolute)."""
    return isinstance(name, str) and _FILE_NAME.fullmatch(name) is not None


# -- rows ---------------------------------------------------------------------------------
@dataclasses.dataclass
class NodeRow:
    """One node row. `valid` is False when its checksum or shape is wrong (`problem` says
    why): its tokens then cannot be trusted. Iterates as the 6-tuple
    (id, parent, start, tokens, hits, last_access)."""

    id: int
    parent: int | None
    start: int
    tokens: np.ndarray
    hits: int = 0
    last_access: float = 0.0
    valid: bool = True
    problem: str | None = None
    exact: bool = True
    namespace: str = ""

    def __iter__(self):
        return iter((self.id, self.parent, self.start, self.tokens, self.hits,
                     self.last_access))


@dataclasses.dataclass
class LayerRow:
    node: int
    layer: int
    version: int
    file: str
    mapping: np.ndarray | None
    crcs: np.ndarray
    importance: np.ndarray | None = None
    bitmaps: np.ndarray | None = None
    access: np.ndarray | None = None
    ratio: np.ndarray | None = None
    valid: bool = True            # False: checksum, file name, mapping or crcs are wrong
    problem: str | None = None


def _blob(arr: np.ndarray | None):
    return None if arr is None else arr.tobytes()


def mapping_blob(mapping: np.ndarray | None):
    return None if mapping is None else encode_mapping(mapping)


def importance_blob(importance: np.ndarray | None):
    return None if importance is None else encode_importance(importance)


def _crc_bytes(*parts) -> int | None:
    """CRC32 of a canonical encoding of ints, strings and blobs (None: absent), or None
    when a field has a type no valid row has (a damaged row)."""
    out = []
    for part in parts:
        if isinstance(part, bool):
            return None
        if isinstance(part, int):
            if not -(1 << 63) <= part < (1 << 63):
                return None
            out.append(b"i" + struct.pack("<q", part))
        elif part is None:
            out.append(b"n")
        elif isinstance(part, str):
            data = part.encode("utf-8", "surrogatepass")
            out.append(b"s" + struct.pack("<Q", len(data)) + data)
        elif isinstance(part, (bytes, bytearray, memoryview)):
            data = bytes(part)
            out.append(b"b" + struct.pack("<Q", len(data)) + data)
        else:
            return None
    return zlib.crc32(b"".join(out))


def node_crc(nid, parent, start, tokens, exact=True, namespace="") -> int | None:
    # The flags join the checksum only when set, so rows of schema 2 keep theirs.
    extra = (() if exact is True or exact == 1 else ("inexact",)) + \
        (("namespace", namespace) if namespace else ())
    return _crc_bytes(nid, -1 if parent is None else parent, start, tokens, *extra)


def layer_crc(node, layer, version, file, mapping, crcs) -> int | None:
    return _crc_bytes(node, layer, version, file, b"" if mapping is None else mapping, crcs)


def _check_layer(node, layer, version, file, mapping, crcs, crc, n_tokens: int,
                 n_crcs: int | None) -> str | None:
    """Why the hard state of a layer row cannot be trusted, or None."""
    if crc is None:
        return "no row checksum"
    if not isinstance(crcs, bytes) or (mapping is not None and not isinstance(mapping, bytes)):
        return "damaged blob type"
    if layer_crc(node, layer, version, file, mapping, crcs) != crc:
        return "row checksum mismatch"
    if not isinstance(layer, int) or layer < 0 or not isinstance(version, int) or version < 0:
        return f"bad layer/version ({layer!r}, {version!r})"
    if not valid_file_name(file):
        return f"bad file name {file!r}"
    if mapping is not None:
        problem = decode_mapping(mapping, n_tokens)[1]
        if problem is not None:
            return problem
    if len(crcs) % 4:
        return f"crcs blob of {len(crcs)} bytes"
    if n_crcs is not None and len(crcs) // 4 != n_crcs:
        return f"{len(crcs) // 4} chunk CRCs, expected {n_crcs}"
    return None


def _soft_state(imp, bitmaps, access, ratio, n_tokens: int):
    """(importance f32, bitmaps u8, access u16, ratio u8), all None unless every blob is
    present, the importance decodes (its checksum included) and the lengths agree with
    each other and with n_tokens."""
    blobs = (imp, bitmaps, access, ratio)
    if any(not isinstance(b, bytes) for b in blobs):
        return None, None, None, None
    importance = decode_importance(imp, n_tokens)
    n_chunks = len(access) // 2
    ok = (importance is not None and len(access) % 2 == 0 and n_chunks > 0
          and n_tokens % n_chunks == 0 and (n_tokens // n_chunks) % 8 == 0
          and len(ratio) == n_chunks and len(bitmaps) == n_tokens // 8)
    if not ok:
        return None, None, None, None
    return (importance, np.frombuffer(bitmaps, dtype=np.uint8).copy(),
            np.frombuffer(access, dtype=np.uint16).copy(),
            np.frombuffer(ratio, dtype=np.uint8).copy())
