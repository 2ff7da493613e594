"""The hot read path: whole chunk files into preallocated buffers with preadv, from a thread pool.

Reads can bypass the page cache (O_DIRECT) or drop what they read from it (fadvise DONTNEED), so
that a CPU-memory budget is real and the kernel's page cache does not act as a second cache.
tensorstore's own reads are kept for import, export and verification; they are several times
slower on this path because they allocate and decode per chunk.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Sequence

import torch

from storage.errors import CorruptTensorError, StorageError

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT needs buffer address, length and file offset aligned to the block size


class ReadMode(str, enum.Enum):
    """How reads treat the page cache."""

    DIRECT = "direct"  # O_DIRECT: never enters the page cache
    DROP = "drop"  # buffered, then fadvise(DONTNEED) on what was read
    CACHED = "cached"  # plain buffered reads; the page cache keeps the data


@dataclass(kw_only=True)
class ChunkReaderConfig:
    """Settings of the hot read path."""

    mode: ReadMode | str = ReadMode.DIRECT
    threads: int = 4  # concurrent preadv calls; NVMe wants a queue depth of several
    piece_bytes: int = 8 << 20  # a larger file is read as pieces of this size in parallel

    def __post_init__(self) -> None:
        try:
            self.mode = ReadMode(self.mode)
        except ValueError:
            raise ValueError(f"mode must be one of {[m.value for m in ReadMode]}, got {self.mode!r}") from None
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.piece_bytes < ALIGN or self.piece_bytes % ALIGN:
            raise ValueError(f"piece_bytes must be a positive multiple of {ALIGN}, got {self.piece_bytes}")


@dataclass(kw_only=True)
class ReadRequest:
    """Read `nbytes` from `path` at `offset` into `buf` (a writable memoryview of at least nbytes)."""

    path: str
    buf: memoryview
    nbytes: int
    offset: int = 0


_direct_ok: dict[int, bool] = {}
_direct_lock = threading.Lock()


def _open(path: str, direct: bool) -> tuple[int, bool]:
    """Open for reading, with O_DIRECT where asked and the file system allows it."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            dev = os.stat(path).st_dev
        except FileNotFoundError:
            raise StorageError(f"{path}: file is missing") from None
        with _direct_lock:
            ok = _direct_ok.get(dev, True)
        if ok:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                with _direct_lock:
                    _direct_ok[dev] = False
                log.warning("%s: file system refuses O_DIRECT; reading buffered and dropping pages", path)
    try:
        return os.open(path, os.O_RDONLY), False
    except FileNotFoundError:
        raise StorageError(f"{path}: file is missing") from None


def _aligned(buf: memoryview, offset: int, nbytes: int) -> bool:
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if not buf.readonly else 0
    return addr % ALIGN == 0 and offset % ALIGN == 0 and nbytes % ALIGN == 0


def _read_range(path: str, buf: memoryview, offset: int, nbytes: int, mode: ReadMode) -> None:
    direct = mode is ReadMode.DIRECT and _aligned(buf, offset, nbytes)
    fd, is_direct = _open(path, direct)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [buf[done:nbytes]], offset + done)
            if n == 0:
                raise CorruptTensorError(
                    f"{path}: file is shorter than recorded ({offset + done} bytes, expected at least "
                    f"{offset + nbytes})", path=path)
            done += n
        if not is_direct and mode is not ReadMode.CACHED:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class ChunkReader:
    """Reads files into caller-owned buffers with a small pool of threads (preadv drops the GIL)."""

    def __init__(self, config: ChunkReaderConfig | None = None) -> None:
        self.config = config or ChunkReaderConfig()
        self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="semoe-read")
        self._bytes_read = 0
        self._lock = threading.Lock()

    @property
    def bytes_read(self) -> int:
        """Total bytes read since construction."""
        return self._bytes_read

    def _pieces(self, req: ReadRequest) -> list[tuple[int, int]]:
        step = self.config.piece_bytes
        return [(s, min(step, req.nbytes - s)) for s in range(0, req.nbytes, step)] or [(0, 0)]

    def submit_many(self, requests: Sequence[ReadRequest]) -> list[Future]:
        """Start every request, each split into pieces; one future per piece, in request order."""
        futures = []
        mode = self.config.mode
        for req in requests:
            if len(req.buf) < req.nbytes:
                raise ValueError(f"{req.path}: buffer of {len(req.buf)} bytes is smaller than {req.nbytes}")
            for start, n in self._pieces(req):
                if n:
                    futures.append(self._pool.submit(
                        _read_range, req.path, req.buf[start:start + n], req.offset + start, n, mode))
        with self._lock:
            self._bytes_read += sum(r.nbytes for r in requests)
        return futures

    def read_many(self, requests: Sequence[ReadRequest]) -> None:
        """Read every request, all in flight together; raises the first error."""
        futures = self.submit_many(requests)
        wait(futures)
        for f in futures:
            f.result()

    def read(self, path: str, buf: memoryview, nbytes: int, offset: int = 0) -> None:
        """Read one range, split into parallel pieces when large."""
        self.read_many([ReadRequest(path=path, buf=buf, nbytes=nbytes, offset=offset)])

    def close(self) -> None:
        """Stop the threads after pending reads finish."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of `nbytes` (rounded up to ALIGN) whose address is ALIGN-aligned, for O_DIRECT."""
    size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    base = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-base.data_ptr()) % ALIGN
    return base[skip:skip + size]  # the view keeps `base` alive


def drop_from_page_cache(path: str) -> None:
    """Ask the kernel to forget the cached pages of a file (clean pages only; needs no root)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
