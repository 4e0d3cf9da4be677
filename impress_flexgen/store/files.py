"""The store's layer files on disk: writing them (fsynced before any metadata names them),
deleting retired ones once no request holds them, and the quarantine kept for inspection.
Every file-system call goes through disk_layout.io."""
from __future__ import annotations

import errno
import logging
import uuid
from pathlib import Path

import numpy as np
import torch

from disk_layout import io as dio
from disk_layout.format import (INT4_KV, LayerFileLayout, crc32, encode_probe, probe_supported,
                                section_image)

from ..errors import DiskFull, StoreWriteFailed
from .radix import RadixNode
from .state import StoreState

log = logging.getLogger("impress_flexgen.store")


def new_file_name() -> str:
    return f"{uuid.uuid4().hex}.kv"


class LayerFiles:
    """Writes, deletes and quarantines the files under the store's data/ directory."""

    def __init__(self, state: StoreState) -> None:
        self.state = state

    def write_layer_file(self, path: Path, layout: LayerFileLayout, k_logical: torch.Tensor,
                         v_logical: torch.Tensor, mapping: np.ndarray | None = None
                         ) -> np.ndarray:
        """Write one (node, layer) file in the physical order given by `mapping`, fsynced;
        returns its CRC-32s (probe, K chunks..., V chunks...)."""
        config = self.state.config
        # int4 is encoded from the values as computed (section_image), the others are cast.
        dtype = layout.kv_dtype if layout.kv_format != INT4_KV else k_logical.dtype
        k = k_logical.detach().to(dtype).cpu()
        v = v_logical.detach().to(dtype).cpu()
        if mapping is not None:
            order = torch.from_numpy(np.asarray(mapping, dtype=np.int64))
            k, v = k[:, order], v[:, order]
        k, v = k.contiguous(), v.contiguous()
        probe_heads = list(config.probe_heads)
        if config.probe_format == "int4" and not probe_supported(
                len(probe_heads), layout.n_tokens, layout.head_dim):
            raise ValueError("int4 probe copy needs probe values in groups of 32")
        probe = encode_probe(k[probe_heads], config.probe_format)
        pieces = [(0, probe)]
        crcs = [crc32(probe)]
        for kind, tensor in (("k", k), ("v", v)):
            image, chunk_crcs = section_image(tensor, layout)
            pieces.append((layout.chunk_offset(kind, 0), image))
            crcs += chunk_crcs
        dio.write_durable(str(path), pieces, layout.file_bytes)
        return np.asarray(crcs, dtype=np.uint32)

    def write_files(self, layout: LayerFileLayout, layers, names: list[str]) -> list:
        """Write one file per layer (fsynced); [(name, crcs)]. Names go to `names` as they
        are made, so the caller can remove them if anything fails."""
        data_dir = self.state.data_dir
        out = []
        for k, v in layers:
            name = new_file_name()
            names.append(name)
            try:
                crcs = self.write_layer_file(data_dir / name, layout, k, v)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise DiskFull(f"disk full while writing {data_dir}") from None
                raise StoreWriteFailed(f"cannot write {data_dir}: {exc}") from None
            out.append((name, crcs))
        return out

    def discard(self, names: list[str]) -> None:
        """Remove files written for something that was not committed."""
        for name in names:
            dio.unlink_missing_ok(self.state.data_dir / name)

    def delete_retired(self, node: RadixNode) -> None:
        """Delete the files a node no longer uses (no request holds it now)."""
        for path in node.retired_files:
            self.state.reader.forget(path)
            try:
                dio.unlink(path)        # a symbolic link goes, never its target
            except FileNotFoundError:
                pass
            except OSError as exc:      # e.g. a directory put in its place: left alone
                log.warning("store %s: cannot remove %s: %s", self.state.dir, path, exc)
        node.retired_files.clear()

    def free_bytes(self) -> int | None:
        """Bytes this user may still write on the store's file system; None where the file
        system does not say (statvfs fails or reports no size)."""
        try:
            st = dio.statvfs(self.state.data_dir)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize if st.f_blocks > 0 else None

    # ------------------------------------------------------------------ quarantine
    def quarantine_file(self, path: Path) -> None:
        """Keep a hard link to a store file in quarantine/ (a link, never its target)."""
        qdir = self.state.quarantine_dir
        try:
            dio.make_dir(qdir, 0o700)
            dio.link(path, qdir / path.name)
        except OSError:
            pass      # gone, or a link across file systems: nothing to keep

    def quarantine_files(self) -> list:
        try:
            return [e for e in dio.scandir(self.state.quarantine_dir)
                    if e.is_file(follow_symlinks=False) or e.is_symlink()]
        except FileNotFoundError:
            return []

    def quarantine_bytes(self) -> int:
        return sum(e.stat(follow_symlinks=False).st_size for e in self.quarantine_files())

    def trim_quarantine(self) -> None:
        """Delete the oldest quarantined files beyond StoreConfig.quarantine_bytes."""
        entries = [(e.stat(follow_symlinks=False), e) for e in self.quarantine_files()]
        total = sum(st.st_size for st, _ in entries)
        for st, e in sorted(entries, key=lambda x: x[0].st_ctime):
            if total <= self.state.config.quarantine_bytes:
                break
            dio.unlink(e.path)
            total -= st.st_size
