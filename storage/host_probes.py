"""What this host offers the storage path: cores, RAM, /dev/shm, pinned memory, O_DIRECT, cold reads.

Used by `semoe env`. Each probe returns a dict of JSON-ready fields: its value, and a `*_reason`
string that is None when the probe succeeded and explains the failure otherwise. No probe raises
on a machine that lacks what it probes (no CUDA, no /proc, a file system refusing O_DIRECT).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import sys
import tempfile
import time
from typing import Iterator, Sequence

import torch

from storage.errors import StorageError
from storage.process_memory import usable_cores
from storage.chunk_io import ALIGN, ChunkReader, ChunkReaderConfig, ReadMode, ReadRequest, drop_from_page_cache
from storage.host_buffers import aligned_empty
from storage.store import Store, iter_expert_chunks

log = logging.getLogger(__name__)

DEFAULT_PROBE_BYTES = 64 << 20  # large enough to cover several reader pieces, small enough to write in a second
SCRATCH_PREFIX = ".semoe-env-"


# --- CPU and memory -----------------------------------------------------------------------------

def cpu_info() -> dict:
    """{"cpu_cores": cores this process may run on, "cpu_count": cores of the machine}."""
    return {"cpu_cores": usable_cores(), "cpu_count": os.cpu_count()}


def shm_info(path: str = "/dev/shm") -> dict:
    """{"shm_path", "shm_total_bytes", "shm_free_bytes", "shm_reason"}: where torch puts tensors
    shared between processes (spawned ranks, data loaders); a small one fails them."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return {"shm_path": path, "shm_total_bytes": None, "shm_free_bytes": None,
                "shm_reason": f"{path}: {e.strerror}"}
    return {"shm_path": path, "shm_total_bytes": st.f_blocks * st.f_frsize,
            "shm_free_bytes": st.f_bavail * st.f_frsize, "shm_reason": None}


def probe_pinned_memory(cuda_available: bool, nbytes: int = 1 << 20) -> dict:
    """{"pinned_memory": True/False, or None when not tried, "pinned_memory_reason"}: allocate
    page-locked host memory, which fast host-to-device copies need."""
    if not cuda_available:
        return {"pinned_memory": None, "pinned_memory_reason": "no CUDA"}
    try:
        ok = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).is_pinned()
    except RuntimeError as e:
        return {"pinned_memory": False, "pinned_memory_reason": str(e).splitlines()[0]}
    return {"pinned_memory": ok, "pinned_memory_reason": None if ok else "the tensor came back unpinned"}


# --- file system ----------------------------------------------------------------------------------

def _unescape_mount(field: str) -> str:
    # /proc/self/mounts writes spaces, tabs, newlines and backslashes in octal (\040)
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_of(path: str, mounts_text: str) -> tuple[str, str] | None:
    """(mount point, file system type) of the mount holding `path`, from /proc/self/mounts text."""
    path = os.path.realpath(path)
    best = None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point, fstype = _unescape_mount(fields[1]), fields[2]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fstype)  # later mounts over the same point hide earlier ones
    return best


def filesystem_info(path: str, mounts_path: str = "/proc/self/mounts") -> dict:
    """{"filesystem", "mount_point"} of `path`; both None where the mount table is unreadable."""
    try:
        with open(mounts_path) as f:
            found = filesystem_of(path, f.read())
    except OSError:
        found = None
    return {"filesystem": found and found[1], "mount_point": found and found[0]}


def probe_o_direct(path: str) -> dict:
    """{"o_direct": bool, "o_direct_reason"}: open the existing file `path` with O_DIRECT and read
    its first ALIGN bytes into a page-aligned buffer, as the store's hot path does."""
    if not hasattr(os, "O_DIRECT"):
        return {"o_direct": False, "o_direct_reason": f"{sys.platform} has no O_DIRECT"}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        why = "the file system refuses O_DIRECT" if e.errno == errno.EINVAL else e.strerror
        return {"o_direct": False, "o_direct_reason": f"{path}: open with O_DIRECT: {why}"}
    try:
        with mmap.mmap(-1, ALIGN) as buf:  # anonymous maps are page aligned
            os.preadv(fd, [buf], 0)
    except OSError as e:
        return {"o_direct": False, "o_direct_reason": f"{path}: aligned {ALIGN}-byte O_DIRECT read: {e.strerror}"}
    finally:
        os.close(fd)
    return {"o_direct": True, "o_direct_reason": None}


@contextlib.contextmanager
def scratch_file(directory: str, nbytes: int) -> Iterator[str]:
    """A new file of `nbytes` in `directory`, written and fsynced; removed on exit whatever happens.

    Its bytes are random (one 1 MiB block repeated) so a compressing file system cannot shortcut
    the read."""
    fd, path = tempfile.mkstemp(prefix=SCRATCH_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            block = os.urandom(min(nbytes, 1 << 20))
            for start in range(0, nbytes, len(block)):
                f.write(block[:nbytes - start])
            f.flush()
            os.fsync(f.fileno())
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _buffers(sizes: Sequence[int]) -> tuple[torch.Tensor, list[memoryview]]:
    """One aligned allocation cut into a buffer per size, each starting on an ALIGN boundary."""
    spans = [-(-n // ALIGN) * ALIGN for n in sizes]
    base, view = aligned_empty(max(sum(spans), ALIGN), alignment=ALIGN, pin=False)
    mv = memoryview(view.numpy())
    offsets = [sum(spans[:i]) for i in range(len(spans))]
    return base, [mv[o:o + s] for o, s in zip(offsets, spans)]


def cold_read(requests: Sequence[ReadRequest], mode: ReadMode) -> tuple[float, list[list[int]]]:
    """(seconds, crcs per request) of reading every request with the store's hot-path reader,
    after dropping the files from the page cache."""
    for path in {r.path for r in requests}:
        drop_from_page_cache(path)
    with ChunkReader(ChunkReaderConfig(mode=mode)) as reader:
        t0 = time.perf_counter()
        crcs = reader.read_many(requests)
        return time.perf_counter() - t0, crcs


def _read_fields(*, gbps: float | None, nbytes: int, files: int, mode: ReadMode, source: str,
                 reason: str | None) -> dict:
    return {"read_gbps": gbps, "read_bytes": nbytes, "read_files": files, "read_mode": mode.value,
            "read_source": source, "read_reason": reason}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def probe_directory(directory: str, nbytes: int = DEFAULT_PROBE_BYTES) -> dict:
    """O_DIRECT and cold-read GB/s of the file system holding `directory`, on a scratch file of
    `nbytes` (rounded up to ALIGN) written there and removed afterwards."""
    nbytes = -(-nbytes // ALIGN) * ALIGN
    out = {"probe_path": os.path.abspath(directory), **filesystem_info(directory)}
    try:
        with scratch_file(directory, nbytes) as path:
            out.update(probe_o_direct(path))
            mode = ReadMode.DIRECT if out["o_direct"] else ReadMode.DROP
            _base, (buf,) = _buffers([nbytes])
            seconds, _ = cold_read([ReadRequest(path=path, buf=buf, nbytes=nbytes)], mode)
    except (OSError, StorageError) as e:
        log.debug("probing %s failed", directory, exc_info=True)
        reason = f"{directory}: scratch file of {nbytes} bytes: {getattr(e, 'strerror', None) or e}"
        out.setdefault("o_direct", False)
        out.setdefault("o_direct_reason", reason)
        return {**out, **_read_fields(gbps=None, nbytes=0, files=0, mode=ReadMode.DROP, source="scratch file",
                                      reason=reason)}
    return {**out, **_read_fields(gbps=_gbps(nbytes, seconds), nbytes=nbytes, files=1, mode=mode,
                                  source="scratch file", reason=None)}


def probe_store(store: Store, nbytes: int = DEFAULT_PROBE_BYTES) -> dict:
    """O_DIRECT and cold-read GB/s on the store's own expert weight chunks, the first ones up to
    `nbytes`, read as the engine reads them (checksums verified). A store without expert chunks
    is probed with a scratch file in its directory."""
    chunks, total = [], 0
    for c in iter_expert_chunks(store.manifest, "weight"):
        if total >= nbytes:
            break
        chunks.append(c)
        total += c.bytes
    if not chunks:
        return probe_directory(store.root, nbytes)
    out = {"probe_path": store.root, **filesystem_info(store.root), **probe_o_direct(store.path(chunks[0].file))}
    mode = ReadMode.DIRECT if out["o_direct"] else ReadMode.DROP
    fields = dict(nbytes=total, files=len(chunks), mode=mode, source="store chunks")
    try:
        _base, bufs = _buffers([c.bytes for c in chunks])
        seconds, crcs = cold_read([store.chunk_request(c, b) for c, b in zip(chunks, bufs)], mode)
        for c, crc in zip(chunks, crcs):
            store.check_crcs(c, crc)
    except (OSError, StorageError) as e:
        log.debug("reading %s failed", store.root, exc_info=True)
        return {**out, **_read_fields(gbps=None, reason=str(e).splitlines()[0], **fields)}
    return {**out, **_read_fields(gbps=_gbps(total, seconds), reason=None, **fields)}
