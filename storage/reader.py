"""Reading a store without torch: its committed manifest, side files, tensors' bytes, a dense
tensor's rows in blocks, and the hot path's chunk reads, every byte checked against the manifest's
crc32c. `storage.store.Store` builds on it (typed torch views, writes, maintenance); the torch-free
decoding process (`inference.torch_free.runner`) reads through it directly.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

import numpy as np

from storage.crc_combine import crc32c
from storage.errors import CorruptTensorError, NotAStoreError
from storage.chunk_io import ReadMode, ReadRequest, read_range
from storage.manifest import ChunkEntry, Manifest, TensorEntry

MANIFEST = "manifest.json"


def is_store(path: str) -> bool:
    """Whether `path` is a store (else it is taken for a HuggingFace directory)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def check_crc(entry: TensorEntry, data: np.ndarray, path: str) -> None:
    """Raise CorruptTensorError naming the tensor when its bytes fail the recorded crc32c."""
    if len(data) != entry.bytes:
        raise CorruptTensorError(
            f"tensor {entry.name} ({entry.kind}): {path} holds {len(data)} bytes, expected {entry.bytes}",
            tensor=entry.name, path=path)
    check_crc_value(entry, crc32c(np.ascontiguousarray(data)), path)


def check_crc_value(entry: TensorEntry, got: int, path: str) -> None:
    """Raise CorruptTensorError naming the tensor when `got`, its bytes' crc32c, is not the recorded one."""
    if got != entry.crc32c:
        raise CorruptTensorError(
            f"tensor {entry.name} ({entry.kind}) is corrupt: crc32c {got:08x} != recorded "
            f"{entry.crc32c:08x} in {path}", tensor=entry.name, path=path)


def load_manifest(root: str) -> Manifest:
    """The committed manifest of the store at `root`; NotAStoreError names the directory otherwise."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        raise NotAStoreError(f"{root}: no such directory")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise NotAStoreError(f"{root}: not a semoe store (no {MANIFEST})") from None
    return Manifest.from_json(text, source=path)


class StoreReader:
    """A store opened at one committed version, read as bytes (numpy); later commits stay unseen."""

    def __init__(self, root: str, manifest: Manifest) -> None:
        self.root = os.path.abspath(root)
        self.manifest = manifest
        # called with the bytes of each read of `read_bytes`, `read_chunk_bytes` and `dense_row_bytes`
        # (a loader's progress); not by the hot path's `chunk_request` reads
        self.on_read: Callable[[int], None] | None = None

    @classmethod
    def open(cls, root: str) -> "StoreReader":
        """Open the committed version of an existing store."""
        return cls(root, load_manifest(root))

    @property
    def version(self) -> int:
        """The committed version this handle reads."""
        return self.manifest.version

    def path(self, rel: str) -> str:
        """Absolute path of a store-relative file."""
        return os.path.join(self.root, rel)

    def _read(self, path: str, buf: memoryview, offset: int, nbytes: int, mode: ReadMode) -> None:
        read_range(path, buf, offset, nbytes, mode)
        if self.on_read is not None:
            self.on_read(nbytes)

    # -- reads --------------------------------------------------------------------------------
    def read_bytes(self, name: str, kind: str = "weight", *, stack_index: int | None = None, verify: bool = True,
                   mode: ReadMode = ReadMode.DROP) -> np.ndarray:
        """One tensor's bytes, uint8, read straight from its file into a new array."""
        e = self.manifest.tensor(name, kind, stack_index)
        buf = np.empty(e.bytes, dtype=np.uint8)
        if e.bytes:
            self._read(self.path(e.file), memoryview(buf), e.offset, e.bytes, mode)
        if verify:
            check_crc(e, buf, self.path(e.file))
        return buf

    def dense_row_bytes(self, name: str, rows: int, *, mode: ReadMode = ReadMode.DROP) -> Iterator[np.ndarray]:
        """A 2-d tensor's bytes `rows` rows at a time, uint8 (n, row bytes), a new buffer each (the last
        may be shorter), for a reader that never holds it whole. Its crc32c is checked after the last
        block (CorruptTensorError then, so a caller keeps nothing it built before)."""
        e = self.manifest.tensor(name)
        if len(e.shape) != 2:
            raise ValueError(f"tensor {name} has shape {e.shape}; rows are read from 2-d tensors")
        row_bytes = e.bytes // e.shape[0] if e.shape[0] else 0
        path, crc = self.path(e.file), 0
        for r in range(0, e.shape[0], rows):
            n = min(rows, e.shape[0] - r)
            buf = np.empty((n, row_bytes), dtype=np.uint8)
            self._read(path, memoryview(buf).cast("B"), e.offset + r * row_bytes, n * row_bytes, mode)
            crc = crc32c(buf, crc)  # continued over the blocks
            if r + n == e.shape[0]:
                check_crc_value(e, crc, path)
            yield buf
            del buf  # before the next block is allocated

    def chunk_request(self, chunk: ChunkEntry, buf: memoryview) -> ReadRequest:
        """A hot-path read of a whole chunk file that checksums each tensor as it arrives."""
        return ReadRequest(path=self.path(chunk.file), buf=buf, nbytes=chunk.bytes,
                           checks=[(e.offset, e.bytes) for e in self.manifest.chunk_tensors(chunk)])

    def check_crcs(self, chunk: ChunkEntry, crcs: list[int]) -> None:
        """Compare checksums computed during a `chunk_request` read with the manifest."""
        for e, got in zip(self.manifest.chunk_tensors(chunk), crcs):
            check_crc_value(e, got, self.path(e.file))

    def check_chunk_bytes(self, chunk: ChunkEntry, raw: np.ndarray) -> None:
        """Check every tensor of a chunk whose file's bytes are `raw`; CorruptTensorError names the first bad one."""
        for e in self.manifest.chunk_tensors(chunk):
            check_crc(e, raw[e.offset:e.offset + e.bytes], self.path(e.file))

    def read_chunk_bytes(self, layer: int, expert: int, kind: str = "weight", *, verify: bool = True,
                         mode: ReadMode = ReadMode.DROP) -> np.ndarray:
        """One expert's chunk file, uint8 (one contiguous read), its tensors checked."""
        c = self.manifest.chunk(layer, expert, kind)
        buf = np.empty(c.bytes, dtype=np.uint8)
        self._read(self.path(c.file), memoryview(buf), 0, c.bytes, mode)
        if verify:
            self.check_chunk_bytes(c, buf)
        return buf

    def read_file(self, name: str) -> bytes:
        """A side file's bytes, checked."""
        f = self.manifest.file(name)
        with open(self.path(f.file), "rb") as fh:
            data = fh.read()
        if crc32c(data) != f.crc32c or len(data) != f.bytes:
            raise CorruptTensorError(f"{self.path(f.file)}: side file {name} fails its checksum", path=f.file)
        return data
