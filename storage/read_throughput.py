"""Side-by-side read throughput of a store: the hot path vs a plain read vs tensorstore, one run.

Used by `semoe store bench` and `bench/bench_store.py`. Each pass reads every expert chunk of one
kind; with `cold`, the files are dropped from the page cache before every pass.
"""

from __future__ import annotations

import collections
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from storage import zarr_arrays
from storage.chunk_io import ALIGN, ChunkReader, ChunkReaderConfig, ReadMode, ReadRequest, drop_from_page_cache
from storage.host_buffers import aligned_empty
from storage.layout import array_of_chunk
from storage.store import Store, iter_expert_chunks


@dataclass(kw_only=True)
class BenchResult:
    """GB/s of each reader over the same bytes (medians of `repeats` passes).

    ratio = hot path / the faster plain read: `raw_gbps`, one buffered sequential read per file (the
    kernel's readahead), or, cold, `raw_direct_gbps`, O_DIRECT reads of 1 MiB one after another
    (`dd iflag=direct bs=1M`). Which of the two a disk favours varies (readahead windows, the host's
    cache under a VM), so the hot path is held to the better. The passes take turns in a rotating
    order, so that a disk whose rate drifts during the run does not favour one reader.

    Every reader lands the bytes in the same memory: the hot path's `inflight` chunk buffers, taken
    in turn, as prefetching fills cache slots that are never in the CPU's cache. `dd` reads into
    one 1 MiB buffer that stays in it, and on a virtual disk, where the host copies into the guest's
    memory, that alone reads faster (on one VM, 1.52 against 1.18 GB/s for the same files into eight
    rotating buffers, the faster in 6 runs of 6). `raw_direct_one_buffer_gbps` is that pattern, cold,
    reported for comparison with `dd` and not part of the ratio.
    The hot path checks every tensor's crc32c, so `tensorstore_gbps` times tensorstore's read
    plus the same check (the same guarantee), and `tensorstore_unchecked_gbps` its read alone.
    """

    store_gbps: float
    raw_gbps: float
    raw_direct_gbps: float | None
    raw_direct_one_buffer_gbps: float | None
    ratio: float
    tensorstore_gbps: float | None
    vs_tensorstore: float | None
    tensorstore_unchecked_gbps: float | None
    vs_tensorstore_unchecked: float | None
    bytes: int
    files: int
    cold: bool
    mode: str  # ReadMode's value, as the JSON report gives it
    verified: bool
    repeats: int

    def to_json(self) -> dict:
        return asdict(self)


DIRECT_IO = 1 << 20  # bytes a read of the O_DIRECT plain pass, as dd's bs=1M


def _direct_ok(path: str) -> bool:
    """Whether the file system takes O_DIRECT (tmpfs does not)."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def run_bench(store: Store, *, cold: bool = False, repeats: int = 3, kind: str = "weight", threads: int | None = None,
              inflight: int = 8, mode: ReadMode | None = None, verify: bool = True, with_tensorstore: bool = True,
              progress: Callable[[str], None] | None = None) -> BenchResult:
    """Time every reader `repeats` times over all expert chunks of `kind`; report medians. `mode`:
    how the reads treat the page cache (default: direct when `cold`, else cached)."""
    chunks = list(iter_expert_chunks(store.manifest, kind))
    if not chunks:
        raise ValueError(f"{store.root}: store has no expert chunks of kind {kind!r} to read")
    paths = [store.path(c.file) for c in chunks]
    total = sum(c.bytes for c in chunks)
    read_mode = mode or (ReadMode.DIRECT if cold else ReadMode.CACHED)
    biggest = max(c.bytes for c in chunks)
    # whole 1 MiB blocks, so that the O_DIRECT pass's last read of a file is an aligned one
    bufs = [aligned_empty(-(-biggest // DIRECT_IO) * DIRECT_IO, alignment=ALIGN, pin=False)[1]
            for _ in range(inflight)]
    reader = ChunkReader(ChunkReaderConfig(mode=read_mode, threads=threads))

    def prepare() -> None:
        if cold:
            for p in paths:
                drop_from_page_cache(p)

    def hot() -> float:
        """`inflight` chunks read at all times: a chunk's buffer takes the next one as soon as it is
        checked (as prefetching streams them), not after a whole group."""
        prepare()
        t0 = time.perf_counter()
        pending: collections.deque = collections.deque()
        for i, c in enumerate(chunks):
            if len(pending) == inflight:
                settle(*pending.popleft())
            buf = memoryview(bufs[i % inflight].numpy())
            req = store.chunk_request(c, buf) if verify else \
                ReadRequest(path=store.path(c.file), buf=buf, nbytes=c.bytes)
            pending.append((c, req, reader.submit_many([req])[0]))
        while pending:
            settle(*pending.popleft())
        return time.perf_counter() - t0

    def settle(chunk, req: ReadRequest, pieces: list) -> None:
        crcs = reader.settle(req, pieces)
        if verify:
            store.check_crcs(chunk, crcs)

    def raw() -> float:
        prepare()
        t0 = time.perf_counter()
        for i, (p, c) in enumerate(zip(paths, chunks)):
            mv = memoryview(bufs[i % inflight].numpy())
            with open(p, "rb", buffering=0) as f:
                n = 0
                while n < c.bytes:
                    got = f.readinto(mv[n:c.bytes])
                    if not got:
                        break
                    n += got
        return time.perf_counter() - t0

    def raw_direct(one_buffer: bool = False) -> float:
        """`dd iflag=direct bs=1M` of each file: whole blocks, the last one short at the file's end;
        into the hot path's buffers in turn, or all into one 1 MiB buffer as dd does."""
        prepare()
        t0 = time.perf_counter()
        for i, (p, c) in enumerate(zip(paths, chunks)):
            mv = memoryview(bufs[0 if one_buffer else i % inflight].numpy())
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            try:
                n = 0
                while n < c.bytes:
                    got = os.preadv(fd, [mv[0 if one_buffer else n:][:DIRECT_IO]], n)
                    if not got:
                        break
                    n += got
            finally:
                os.close(fd)
        return time.perf_counter() - t0

    direct = cold and _direct_ok(paths[0])

    handles: dict = {}

    def tstore() -> tuple[float, float]:
        """(seconds reading, seconds checking): tensorstore reads, then the same crc32c checks."""
        prepare()
        reading = checking = 0.0
        for c in chunks:
            t0 = time.perf_counter()
            array_path, index = array_of_chunk(store.path(c.file))
            arr = handles.get(array_path) or handles.setdefault(array_path, zarr_arrays.open_array(array_path))
            row = np.asarray(arr[index[0]].read().result())
            t1 = time.perf_counter()
            if verify:
                store.check_chunk(c, torch.from_numpy(row))
            reading += t1 - t0
            checking += time.perf_counter() - t1
        return reading, checking

    times: dict[str, list[float]] = {"hot": [], "raw": [], "raw_direct": [], "one_buffer": [], "ts": [], "ts_read": []}
    passes = [("raw", raw), ("hot", hot)] \
        + ([("raw_direct", raw_direct), ("one_buffer", lambda: raw_direct(True))] if direct else []) \
        + ([("ts", tstore)] if with_tensorstore else [])
    try:
        for r in range(repeats):
            for name, fn in passes[r % len(passes):] + passes[:r % len(passes)]:
                if progress:
                    progress(f"pass {r + 1}/{repeats}: {name}")
                t = fn()
                if name == "ts":
                    times["ts_read"].append(t[0])
                    t = t[0] + t[1]
                times[name].append(t)
    finally:
        reader.close()
    hot = _gbps(total, statistics.median(times["hot"]))
    raw_gbps = _gbps(total, statistics.median(times["raw"]))
    direct_gbps = _gbps(total, statistics.median(times["raw_direct"])) if times["raw_direct"] else None
    one_buffer = _gbps(total, statistics.median(times["one_buffer"])) if times["one_buffer"] else None
    ts_gbps = _gbps(total, statistics.median(times["ts"])) if times["ts"] else None
    ts_read = _gbps(total, statistics.median(times["ts_read"])) if times["ts"] else None

    return BenchResult(store_gbps=hot, raw_gbps=raw_gbps, raw_direct_gbps=direct_gbps,
                       raw_direct_one_buffer_gbps=one_buffer, ratio=hot / max(raw_gbps, direct_gbps or 0.0), tensorstore_gbps=ts_gbps,
                       vs_tensorstore=ts_gbps and hot / ts_gbps, tensorstore_unchecked_gbps=ts_read,
                       vs_tensorstore_unchecked=ts_read and hot / ts_read, bytes=total, files=len(chunks),
                       cold=cold, mode=read_mode.value, verified=verify, repeats=repeats)
