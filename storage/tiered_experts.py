"""Experts of a store behind the CPU cache: SSD -> host buffers, fetched on demand or ahead of use.

`TieredExpertStore` composes the pieces and owns none of their logic: the `ExpertCache` decides
what stays resident and what is evicted, the `PrefetchQueue` orders reads by urgency, the
`ChunkReader` moves bytes (checksumming each tensor as it arrives) and the `HostBufferPool` holds
them. A caller gets an `ExpertHandle` whose tensors are views into a pooled host buffer; the
expert stays pinned (never evicted) until the handle is released.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Iterable

import torch

from storage.errors import CacheFullError
from storage.cache import EntryState, ExpertCache, ExpertCacheConfig
from storage.chunk_io import ChunkReader, ChunkReaderConfig, ReadCancelled, ReadMode
from storage.keys import ExpertKey
from storage.manifest import ChunkEntry
from storage.policies import EvictionPolicy
from storage.host_buffers import HostBuffer, HostBufferPool, HostBufferPoolConfig
from storage.process_memory import release_free_heap
from storage.io_queue import PrefetchQueue, PrefetchQueueConfig, Priority
from storage.store import Store

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TieredStoreConfig:
    """Budgets and knobs of the SSD -> CPU tier."""

    cpu_cache_bytes: int
    policy: str = "lfu-aging"
    # LFU counts halve every this many references; None: once per cache-full of references (the
    # capacity in experts), which keeps LFU from pinning yesterday's favourites when routing drifts
    aging_interval: int | None = None
    read_mode: ReadMode = ReadMode.DIRECT  # direct | drop | cached (a string converts)
    io_threads: int | None = None
    prefetch_workers: int = 2  # reads in flight at once, each split over the io threads
    # pinned host buffers: for experts copied to a CUDA device (a CPU run on a GPU host pins nothing)
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.cpu_cache_bytes < 1:
            raise ValueError(f"cpu_cache_bytes must be >= 1, got {self.cpu_cache_bytes}")
        if self.prefetch_workers < 1:
            raise ValueError(f"prefetch_workers must be >= 1, got {self.prefetch_workers}")
        self.read_mode = ReadMode(self.read_mode)


@dataclass(kw_only=True, eq=False)
class ExpertPayload:
    """What a cache entry holds: the host buffer and typed views of the expert's tensors in it.
    Compared and hashed by identity: one object per cached entry, which callers may key on."""

    buffer: HostBuffer
    tensors: dict[str, torch.Tensor]


class ExpertHandle:
    """A pinned expert: use `tensors` until `release()` (or the end of a `with` block)."""

    def __init__(self, owner: "TieredExpertStore", key: ExpertKey, payload: ExpertPayload) -> None:
        self.key = key
        self.payload = payload
        self.tensors = payload.tensors
        self.raw = payload.buffer.payload  # the chunk file's bytes; the tensors are views into it
        self._owner = owner
        self._released = False

    def release(self) -> None:
        """Unpin; the cache may evict the expert afterwards."""
        if not self._released:
            self._released = True
            self._owner.cache.unpin(self.key)

    def __enter__(self) -> "ExpertHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(kw_only=True)
class TierStats:
    """Counters of the SSD -> CPU tier."""

    hits: int
    misses: int
    inflight_hits: int
    hit_rate: float
    evictions: int
    ssd_bytes: int
    ssd_reads: int
    ssd_read_s: float  # summed over reads; reads overlap, so this is not wall time
    prefetch_issued: int
    prefetch_dropped: int  # not issued: the cache was full of pinned experts
    guesses_cancelled: int = 0  # speculative reads abandoned (the guess was wrong)
    guess_wasted_bytes: int = 0  # what they had read by then (included in ssd_bytes)

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Guess:
    """A speculative read in flight: it yields the disk to reads someone waits for until it is
    used (`hurried`) or found wrong (`cancelled`)."""

    hurried: bool = False
    cancelled: bool = False


NEEDED_READ_WAIT_S = 60.0  # longest a needed read waits for reads in flight to make room


class TieredExpertStore:
    """SSD-resident experts served through a byte-bounded CPU cache with prefetch.

    Speculative reads (`get(..., speculative=True)`) run on threads of their own and read only
    while no read that someone waits for is in flight, one I/O step at a time: a guess fills the
    disk's idle time and never delays a needed expert. `hurry` makes a guess that turned out right
    a read like any other; `cancel_guesses` abandons wrong ones after the step in progress.
    """

    def __init__(self, store: Store, config: TieredStoreConfig, *, policy: EvictionPolicy | None = None) -> None:
        """`policy`: an eviction policy its owner drives (`ScheduledPolicy`) instead of `config.policy`."""
        self.store = store
        self.config = config
        chunks = store.manifest.chunks
        biggest = max((c.bytes for c in chunks), default=4096)
        if biggest > config.cpu_cache_bytes:
            raise ValueError(f"cpu_cache_bytes={config.cpu_cache_bytes} cannot hold one expert chunk "
                             f"({biggest} bytes)")
        aging = config.aging_interval or max(8, config.cpu_cache_bytes // biggest)
        self.cache = ExpertCache(ExpertCacheConfig(capacity_bytes=config.cpu_cache_bytes, policy=config.policy,
                                                   aging_interval=aging), policy=policy, on_evict=self._on_evict)
        # The cache bounds the bytes in use; the slack covers size-class fragmentation in the pool.
        self._slack = 2 * biggest
        self.pool = HostBufferPool(HostBufferPoolConfig(capacity_bytes=config.cpu_cache_bytes + self._slack,
                                                        pin=config.pin_memory, slab_bytes=biggest))
        self.reader = ChunkReader(ChunkReaderConfig(mode=config.read_mode, threads=config.io_threads))
        # guesses wait inside their reads for the disk to be idle: on the demand reader's threads
        # they would hold up the very reads they wait for
        self._guess_reader: ChunkReader | None = None
        self.queue = PrefetchQueue(PrefetchQueueConfig(workers=config.prefetch_workers))
        self._lock = threading.Lock()
        self._ssd_bytes = self._ssd_reads = self._issued = self._dropped = 0
        self._ssd_s = 0.0
        self._disk = threading.Condition()  # guards the two below
        self._demand = 0  # reads in flight that someone waits for
        self._guesses: dict[ExpertKey, _Guess] = {}
        self._cancelled = self._wasted = 0

    # -- the data path ------------------------------------------------------------------------
    def _chunk(self, key: ExpertKey) -> ChunkEntry:
        return self.store.manifest.chunk(key.layer, key.expert, key.kind)

    def _load(self, key: ExpertKey, chunk: ChunkEntry, *, guess: bool = False) -> None:
        """Read one chunk (`key`'s, looked up once by the caller) into a pooled buffer and publish it;
        the entry was reserved by the caller.

        A `guess` reads only while the disk is otherwise idle and raises CancelledError when
        `cancel_guesses` abandons it."""
        buf: HostBuffer | None = None
        spec = _Guess() if guess else None
        with self._disk:
            if spec is None:
                self._demand += 1
            else:
                self._guesses[key] = spec
        try:
            buf = self.pool.acquire(chunk.bytes, timeout=60.0)
            t0 = time.perf_counter()
            request = self.store.chunk_request(chunk, buf.memoryview())
            reader = self.reader
            if spec is not None:
                request.gate = lambda: self._gate(spec)
                reader = self._guesses_reader()
            crcs = reader.read_many([request])[0]
            self.store.check_crcs(chunk, crcs)
            with self._lock:
                self._ssd_s += time.perf_counter() - t0
                self._ssd_bytes += chunk.bytes
                self._ssd_reads += 1
        except BaseException as e:
            if buf is not None:
                buf.release()
            if isinstance(e, ReadCancelled):
                with self._lock:
                    self._ssd_bytes += e.nbytes
                    self._wasted += e.nbytes
                    self._cancelled += 1
                e = CancelledError(f"speculative read of {key} cancelled")
            self.cache.fail(key, e)
            raise e from None
        finally:
            with self._disk:
                if spec is None:
                    self._demand -= 1
                    self._disk.notify_all()
                else:
                    self._guesses.pop(key, None)
        self.cache.complete(key, ExpertPayload(buffer=buf, tensors=self.store.chunk_views(chunk, buf.tensor)))

    def _guesses_reader(self) -> ChunkReader:
        with self._disk:
            if self._guess_reader is None:
                self._guess_reader = ChunkReader(ChunkReaderConfig(mode=self.config.read_mode,
                                                                   threads=self.config.io_threads))
            return self._guess_reader

    def _gate(self, spec: _Guess) -> bool:
        """Before each step of a guess's read: wait while needed reads are in flight; False once
        the guess is cancelled."""
        with self._disk:
            while self._demand and not spec.hurried and not spec.cancelled:
                self._disk.wait(0.05)
            return not spec.cancelled

    def hurry(self, key: ExpertKey) -> None:
        """A guess being read is needed now: read it like any other read."""
        with self._disk:
            spec = self._guesses.get(key)
            if spec is not None:
                spec.hurried = True
                self._disk.notify_all()

    def cancel_guesses(self, keys: Iterable[ExpertKey]) -> int:
        """Abandon speculative reads found wrong (not those already hurried); returns how many."""
        n = 0
        with self._disk:
            for key in keys:
                spec = self._guesses.get(key)
                if spec is not None and not spec.hurried and not spec.cancelled:
                    spec.cancelled = True
                    n += 1
            if n:
                self._disk.notify_all()
        return n

    def _on_evict(self, key: ExpertKey, payload: ExpertPayload) -> None:
        payload.buffer.release()

    def _prefetch_job(self, key: ExpertKey, chunk: ChunkEntry) -> None:
        self._load(key, chunk)  # on failure the entry and its pins are gone already
        self.cache.unpin(key)  # the reservation's pin: the expert may now be evicted

    def get(self, key: ExpertKey, *, speculative: bool = False) -> ExpertHandle:
        """The expert's tensors, pinned: from the cache, from a read in flight, or read now.

        `speculative`: a guess, not a use; a new entry is evicted first unless it is used later
        (`record_use`)."""
        chunk = self._chunk(key)
        nbytes = chunk.bytes
        while True:
            try:
                entry, must_load = self.cache.lookup_or_reserve(key, nbytes, probation=speculative)
            except CacheFullError:
                # Reads ahead of use (warm-up, prefetches) may fill the cache with entries still
                # loading: a needed expert waits for them to land, it does not fail.
                if speculative or not self.cache.wait_for_room(nbytes, timeout=NEEDED_READ_WAIT_S):
                    raise
                continue
            if must_load:
                self._load(key, chunk, guess=speculative)
                return ExpertHandle(self, key, self._payload(key))
            if entry.state is EntryState.LOADING and not speculative:
                self.queue.reprioritize(key, Priority.NOW)
                self.hurry(key)
            try:
                entry = self.cache.wait_ready(key)
            except (CancelledError, KeyError):
                continue  # the prefetch was cancelled or failed after we looked: load it ourselves
            return ExpertHandle(self, key, entry.payload)

    def _payload(self, key: ExpertKey) -> ExpertPayload:
        return self.cache.wait_ready(key).payload

    def record_use(self, key: ExpertKey) -> None:
        """The expert is used without a `get`: it was held above this tier, or read as a guess that
        turned out right. The cache's policy must see every use, or it evicts what is in use."""
        self.cache.record_use(key)

    def prefetch(self, keys: Iterable[ExpertKey], *, priority: float = Priority.NEXT,
                 speculative: bool = False) -> list[ExpertKey]:
        """Start reads of experts not yet cached, lower priority first; returns the keys started.

        A hint: when the cache is full of pinned experts the rest are skipped, not waited for.
        """
        started: list[ExpertKey] = []
        for key in keys:
            if key in self.cache:
                continue
            chunk = self._chunk(key)
            try:
                self.cache.reserve(key, chunk.bytes, probation=speculative)
            except CacheFullError:
                with self._lock:
                    self._dropped += 1
                continue
            except ValueError:  # reserved by someone else meanwhile
                continue
            self.queue.submit(key, lambda key=key, chunk=chunk: self._prefetch_job(key, chunk), priority=priority)
            started.append(key)
        with self._lock:
            self._issued += len(started)
        return started

    def drain(self) -> None:
        """Wait until every queued and running read has finished."""
        self.queue.wait_idle()

    def cancel_prefetch(self, keys: Iterable[ExpertKey]) -> int:
        """Drop queued reads that are no longer wanted; returns how many were cancelled."""
        n = 0
        for key in keys:
            if self.queue.cancel(key):
                self.cache.fail(key, CancelledError(f"prefetch of {key} cancelled"))
                n += 1
        return n

    def ready(self, key: ExpertKey) -> bool:
        """Whether the expert is resident and loaded: a `get` now returns without waiting for a read
        (unless it is evicted meanwhile). No hit or miss is counted."""
        return self.cache.ready(key)

    def cached(self, key: ExpertKey) -> bool:
        """Whether the expert is resident or being read (no hit or miss is counted)."""
        return key in self.cache

    # -- reporting and shutdown ---------------------------------------------------------------
    def stats(self) -> TierStats:
        """Counters since construction or `reset_stats`."""
        s = self.cache.stats()
        with self._lock:
            return TierStats(hits=s.hits, misses=s.misses, inflight_hits=s.inflight_hits, hit_rate=s.hit_rate,
                             evictions=s.evictions, ssd_bytes=self._ssd_bytes, ssd_reads=self._ssd_reads,
                             ssd_read_s=self._ssd_s, prefetch_issued=self._issued, prefetch_dropped=self._dropped,
                             guesses_cancelled=self._cancelled, guess_wasted_bytes=self._wasted)

    def shrink(self, cpu_cache_bytes: int) -> int:
        """Lower the CPU cache's budget (memory pressure): evict down to it, and give the buffers
        freed, now or as pinned ones come back, to the system. Returns the bytes evicted now."""
        freed = self.cache.shrink(cpu_cache_bytes)
        self.pool.shrink(cpu_cache_bytes + self._slack)
        release_free_heap()
        return freed

    def grow(self, cpu_cache_bytes: int) -> None:
        """Raise the CPU cache's budget (memory found free)."""
        self.pool.grow(cpu_cache_bytes + self._slack)
        self.cache.grow(cpu_cache_bytes)

    def reset_stats(self) -> None:
        """Zero every counter."""
        self.cache.reset_stats()
        with self._lock:
            self._ssd_bytes = self._ssd_reads = self._issued = self._dropped = 0
            self._cancelled = self._wasted = 0
            self._ssd_s = 0.0

    def close(self) -> None:
        """Finish reads in flight, drop queued ones, stop the threads."""
        self.queue.close(wait=True)
        self.reader.close()
        if self._guess_reader is not None:
            self._guess_reader.close()
        self.cache.clear()  # cached experts give their buffers back; ones still held by a handle stay valid
        self.pool.close()  # free slabs (and their pinned pages) go now, the rest as their handles release

    def __enter__(self) -> "TieredExpertStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

