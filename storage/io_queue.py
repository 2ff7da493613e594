"""A priority queue of I/O jobs run by a bounded pool of worker threads.

Reads (``os.preadv``) and copies release the GIL, so a few threads give real I/O parallelism.
Priorities are "lower is more urgent": callers pass a deadline in seconds, or the distance in
layers between the layer being computed and the layer that needs the data. Equal priorities run
in submission order, so a schedule is reproducible.

A job is identified by a key: submitting a key that is already queued or running returns the
existing future instead of reading the same bytes twice. Once a job has finished its key is
forgotten, and submitting it again runs it again (caching finished results is the cache's job).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import math
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from storage.errors import StorageError

logger = logging.getLogger(__name__)


class QueueFullError(StorageError, RuntimeError):
    """``submit`` found ``max_queued`` jobs already waiting. The caller decides whether to drop
    the prefetch or retry later; blocking a scheduler on a speculative read would stall it."""


class QueueClosedError(StorageError, RuntimeError):
    """A job was submitted after ``close``."""


@dataclass(kw_only=True)
class PrefetchQueueConfig:
    """Configuration of a :class:`PrefetchQueue`: ``workers`` threads run jobs concurrently;
    at most ``max_queued`` jobs wait (``None``: unbounded)."""

    workers: int = 4
    max_queued: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"PrefetchQueueConfig.workers={self.workers!r}: must be an int >= 1")
        if self.max_queued is not None and (
            not isinstance(self.max_queued, int) or self.max_queued < 1
        ):
            raise ValueError(
                f"PrefetchQueueConfig.max_queued={self.max_queued!r}: must be None or an int >= 1"
            )


@dataclass(kw_only=True)
class PrefetchStats:
    """Counters of a :class:`PrefetchQueue`. ``completed`` counts jobs that returned, ``failed``
    jobs that raised; ``deduplicated`` submits that returned an existing future."""

    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    deduplicated: int = 0
    max_queue_depth: int = 0


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class _Job:
    key: Hashable
    fn: Callable[[], Any]
    future: Future
    priority: float
    seq: int  # submission order; breaks ties so equal priorities run FIFO
    version: int  # matches the one live heap entry; older entries are stale
    state: _State = _State.QUEUED


class Priority:
    """The one priority scale of every queue here (lower runs first): a read someone waits for,
    a read for the next layer (plus a fraction for its rank among guesses), idle-time warm-up."""

    NOW = 0.0
    NEXT = 1.0
    IDLE = 2.0


def _check_priority(priority: float) -> float:
    if isinstance(priority, bool) or not isinstance(priority, (int, float)) or math.isnan(priority):
        raise ValueError(f"PrefetchQueue: priority={priority!r} must be a number, not NaN")
    return float(priority)


class PrefetchQueue:
    """Runs keyed jobs by priority (lower value first, FIFO among equals) on worker threads,
    deduplicating keys that are queued or running. Each job's result or exception lands in
    the ``concurrent.futures.Future`` returned by :meth:`submit`."""

    def __init__(self, config: PrefetchQueueConfig | None = None) -> None:
        self.config = config or PrefetchQueueConfig()
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # workers wait on it for jobs
        self._idle = threading.Condition(lock)  # `wait_idle` waits on it for the last job to end
        # Heap of (priority, seq, version, job). Reprioritising pushes a new entry and bumps the
        # job's version, so the old entry is skipped when popped instead of searched for.
        self._heap: list[tuple[float, int, int, _Job]] = []
        self._queued: dict[Hashable, _Job] = {}
        self._running: dict[Hashable, _Job] = {}
        self._seq = itertools.count()
        self._version = itertools.count()
        self._stats = PrefetchStats()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"prefetch-{i}", daemon=True)
            for i in range(self.config.workers)
        ]
        for thread in self._workers:
            thread.start()

    @property
    def stats(self) -> PrefetchStats:
        """A snapshot of the counters."""
        with self._cond:
            return PrefetchStats(**vars(self._stats))

    def queued(self) -> int:
        """Jobs waiting for a worker."""
        with self._cond:
            return len(self._queued)

    def running(self) -> int:
        """Jobs a worker is executing now."""
        with self._cond:
            return len(self._running)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; False if `timeout` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._queued and not self._running, timeout)

    def _notify_if_idle(self) -> None:
        """Wake `wait_idle` once nothing is queued or running (caller holds the lock)."""
        if not self._queued and not self._running:
            self._idle.notify_all()

    def submit(self, key: Hashable, fn: Callable[[], Any], *, priority: float) -> Future:
        """Queue ``fn()`` under ``key`` with ``priority`` (lower is more urgent: a deadline in
        seconds or a distance in layers). If ``key`` is queued or running, return its future;
        a queued job is moved up when the new priority is more urgent."""
        priority = _check_priority(priority)
        with self._cond:
            if self._closed:
                raise QueueClosedError(f"PrefetchQueue.submit({key!r}): the queue is closed")
            existing = self._queued.get(key)
            if existing is None:
                existing = self._running.get(key)
            if existing is not None and existing.future.cancelled():
                # Cancelled through the future itself: retire it (its heap entry goes stale)
                # and queue the key anew.
                del self._queued[key]
                existing.state = _State.FINISHED
                self._stats.cancelled += 1
                existing = None
            if existing is not None:
                self._stats.deduplicated += 1
                if existing.state is _State.QUEUED and priority < existing.priority:
                    self._push(existing, priority)
                return existing.future
            limit = self.config.max_queued
            if limit is not None and len(self._queued) >= limit:
                raise QueueFullError(
                    f"PrefetchQueue.submit({key!r}): {len(self._queued)} jobs queued, "
                    f"max_queued={limit}"
                )
            job = _Job(
                key=key, fn=fn, future=Future(), priority=priority, seq=next(self._seq), version=-1
            )
            self._queued[key] = job
            self._push(job, priority)
            self._stats.submitted += 1
            self._stats.max_queue_depth = max(self._stats.max_queue_depth, len(self._queued))
            self._cond.notify()
            return job.future

    def reprioritize(self, key: Hashable, priority: float) -> bool:
        """Set the priority of a queued job, more or less urgent; False if ``key`` is not
        queued (unknown, running or finished)."""
        priority = _check_priority(priority)
        with self._cond:
            job = self._queued.get(key)
            if job is None:
                return False
            self._push(job, priority)
            return True

    def cancel(self, key: Hashable) -> bool:
        """Cancel a queued job and its future; False if ``key`` is not queued (a running job
        cannot be stopped)."""
        with self._cond:
            job = self._queued.pop(key, None)
            if job is None:
                return False
            job.state = _State.FINISHED
            self._stats.cancelled += 1
            self._notify_if_idle()
        # Outside the lock: cancel() runs the future's callbacks, which may call back in here.
        job.future.cancel()
        return True

    def cancel_all(self) -> int:
        """Cancel every queued job; returns how many were cancelled."""
        with self._cond:
            jobs = self._retire_queued()
        for job in jobs:
            job.future.cancel()
        return len(jobs)

    def close(self, wait: bool = True, *, cancel_queued: bool = True) -> None:
        """Stop accepting jobs. Queued jobs are cancelled (they are speculative) unless
        ``cancel_queued=False``, in which case the workers finish them first; running jobs
        always finish. ``wait`` joins the worker threads."""
        with self._cond:
            self._closed = True
            # Under the same lock as closing, so no worker starts a job that is being cancelled.
            jobs = self._retire_queued() if cancel_queued else []
            self._cond.notify_all()
        for job in jobs:
            job.future.cancel()
        if wait:
            for thread in self._workers:
                thread.join()

    def __enter__(self) -> PrefetchQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(wait=True)

    def _retire_queued(self) -> list[_Job]:
        """Remove every queued job and count it cancelled; called with the lock held. The
        caller cancels the futures after releasing the lock."""
        jobs = list(self._queued.values())
        self._queued.clear()
        self._heap.clear()
        for job in jobs:
            job.state = _State.FINISHED
        self._stats.cancelled += len(jobs)
        self._notify_if_idle()
        return jobs

    def _push(self, job: _Job, priority: float) -> None:
        job.priority = priority
        job.version = next(self._version)
        heapq.heappush(self._heap, (priority, job.seq, job.version, job))
        if len(self._heap) > 2 * len(self._queued) + 64:
            # Frequent reprioritising without pops would otherwise grow the heap unboundedly.
            self._heap = [(j.priority, j.seq, j.version, j) for j in self._queued.values()]
            heapq.heapify(self._heap)

    def _pop(self) -> _Job | None:
        """The most urgent live job, or None if none is queued; called with the lock held."""
        while self._heap:
            _, _, version, job = heapq.heappop(self._heap)
            if job.state is _State.QUEUED and job.version == version:
                return job
        return None

    def _work(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            self._run(job)
            # Let go of the job (and through its future, the result) while idling.
            del job

    def _next_job(self) -> _Job | None:
        """Block until a job can run and mark it running; None once closed and drained."""
        with self._cond:
            while True:
                job = self._pop()
                if job is None:
                    if self._closed:
                        return None
                    self._cond.wait()
                    continue
                del self._queued[job.key]
                if job.future.set_running_or_notify_cancel():
                    job.state = _State.RUNNING
                    self._running[job.key] = job
                    return job
                # Cancelled through the future itself while queued.
                job.state = _State.FINISHED
                self._stats.cancelled += 1
                self._notify_if_idle()

    def _run(self, job: _Job) -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = job.fn()
        except BaseException as exc:  # noqa: BLE001 - any failure belongs to the future
            logger.debug("prefetch job %r failed: %r", job.key, exc)
            error = exc
        # Bookkeeping before resolving the future, so whoever wakes on it sees the key gone and
        # the counters updated.
        with self._cond:
            job.state = _State.FINISHED
            del self._running[job.key]
            if error is None:
                self._stats.completed += 1
            else:
                self._stats.failed += 1
            self._notify_if_idle()
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)
