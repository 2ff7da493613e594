"""Asynchronous copies between host and device memory, on their own stream, with events.

The contract is CUDA's, on every device:

- ``copy(src, dst, after=event)`` returns at once; the copy starts once ``event`` (if any) has
  completed and runs concurrently with compute. Copies are not ordered with one another: order
  them with events.
- ``handle.wait()`` orders the caller's compute after that one copy, never after the whole copy
  stream; ``handle.synchronize()`` blocks the host (count it: it stalls the pipeline on a GPU).
- ``record_compute()`` is an event that completes once the compute issued so far has run: pass it
  as ``after`` to a copy that overwrites memory that compute reads (a ring slot being refilled),
  or that reads memory compute writes (an activation being swapped out).
- The source must stay untouched (not overwritten, not returned to a pool) until the copy is
  ``done()``.

On CUDA the stream is a ``torch.cuda.Stream`` and each handle an event. On CPU the host is the
compute stream (compute runs synchronously, so ``record_compute()`` is already complete and
``wait()`` blocks until the copy ran) and the copy stream is a worker thread. `FakeCudaCopyStream`
is the CPU stream a test uses to catch a missing wait: it delays and reorders copies at random,
poisons destinations at issue, checksums sources at issue and again at copy time, models queued
compute with events that complete late, and reports a copy into memory that queued compute may
still read. All three run the same calling code.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import queue
import random
import threading
import time
import zlib
from abc import ABC, abstractmethod
from typing import Callable, Iterator

import torch

from storage.errors import StorageError

logger = logging.getLogger(__name__)


class CopyStreamClosedError(StorageError, RuntimeError):
    """A copy was issued after ``close``."""


class CopyOrderError(StorageError, RuntimeError):
    """A copy broke the stream contract: it wrote memory queued compute may still read, or its
    source changed between issue and copy (a buffer reused too early)."""


class StreamEvent(ABC):
    """A point in a stream's work: complete once everything issued before it has run."""

    @abstractmethod
    def done(self) -> bool:
        """True once complete; never blocks."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until complete (a host synchronisation on a GPU)."""


class _CompleteEvent(StreamEvent):
    """An event for work that has already run (host compute on CPU)."""

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


COMPLETE = _CompleteEvent()


class CopyHandle(StreamEvent):
    """One issued copy; ``tensor`` is its destination, valid for compute after ``wait()``."""

    tensor: torch.Tensor

    @abstractmethod
    def wait(self) -> torch.Tensor:
        """Order the caller's compute after this copy only, and return ``tensor``. On CPU that
        means blocking the calling thread. Raises the copy's exception, if any."""


class _DoneHandle(CopyHandle):
    """A handle for a copy that did not need to happen."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor

    def synchronize(self) -> None:
        pass

    def done(self) -> bool:
        return True


def normalize_device(device: torch.device | str) -> torch.device:
    """``torch.device(device)`` with the current CUDA device filled in for a bare ``"cuda"``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class CopyStream(ABC):
    """Issues copies asynchronously on one device's copy stream; one implementation per kind."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = normalize_device(device)

    def copy_to_device(
        self,
        src: torch.Tensor,
        dst: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        in_place_ok: bool = False,
        after: StreamEvent | None = None,
    ) -> CopyHandle:
        """Copy ``src`` into ``dst`` on this stream's device (or into a new tensor there).

        ``device`` defaults to this stream's device and must equal it when given. With
        ``dst=None`` and ``in_place_ok=True``, a ``src`` already on the device (on CPU: host
        memory is device memory) is returned as is, without copying.
        """
        if device is not None and normalize_device(device) != self.device:
            raise ValueError(
                f"copy_to_device: device={device!s} differs from this stream's device {self.device}"
            )
        if dst is not None and dst.device != self.device:
            raise ValueError(
                f"copy_to_device: dst is on {dst.device}, this stream copies to {self.device}"
            )
        if dst is None and in_place_ok and isinstance(src, torch.Tensor) and src.device == self.device:
            return _DoneHandle(src)
        return self.copy(src, dst, after=after)

    def copy(self, src: torch.Tensor, dst: torch.Tensor | None = None, *, cast: bool = False,
             after: StreamEvent | None = None) -> CopyHandle:
        """Copy ``src`` into ``dst`` (either may be on the host or this device) once ``after`` has
        completed. ``dst=None`` allocates the destination on this stream's device. With
        ``cast=True`` the copy converts ``src``'s dtype to ``dst``'s on the copy stream."""
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"copy: src must be a torch.Tensor, got {type(src).__name__}")
        if dst is not None:
            if dst.shape != src.shape or (dst.dtype != src.dtype and not cast):
                raise ValueError(
                    f"copy: dst {tuple(dst.shape)} {dst.dtype} does not match "
                    f"src {tuple(src.shape)} {src.dtype}"
                )
        return self._issue(src, dst, after)

    def record_compute(self) -> StreamEvent:
        """An event that completes once the compute issued so far by the calling thread has run."""
        return COMPLETE

    @abstractmethod
    def _issue(self, src: torch.Tensor, dst: torch.Tensor | None, after: StreamEvent | None) -> CopyHandle:
        """Start the copy of a validated request."""

    @abstractmethod
    def close(self) -> None:
        """Finish the copies already issued and refuse new ones."""

    def __enter__(self) -> CopyStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ThreadHandle(CopyHandle):
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def wait(self) -> torch.Tensor:
        self._finished.wait()
        if self._error is not None:
            raise self._error
        return self.tensor

    def synchronize(self) -> None:
        self.wait()

    def done(self) -> bool:
        return self._finished.is_set()

    def _run(self, src: torch.Tensor, after: StreamEvent | None) -> None:
        try:
            if after is not None:
                after.synchronize()
            self.tensor.copy_(src)
        except BaseException as exc:  # noqa: BLE001 - the waiter re-raises it
            self._error = exc
        self._finished.set()


class ThreadCopyStream(CopyStream):
    """The CPU copy stream: one worker thread runs the copies (in issue order)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        if self.device.type == "cuda":
            raise ValueError(f"ThreadCopyStream: device={self.device} is CUDA; use CudaCopyStream")
        self._lock = threading.Lock()
        self._closed = False
        self._jobs: queue.SimpleQueue[tuple[_ThreadHandle, torch.Tensor, StreamEvent | None] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._work, name="copy-stream", daemon=True)
        self._thread.start()

    def _issue(self, src: torch.Tensor, dst: torch.Tensor | None, after: StreamEvent | None) -> CopyHandle:
        if dst is None:
            # Allocated here, not in the worker, so the handle's tensor exists immediately.
            dst = torch.empty_like(src, device=self.device)
        handle = _ThreadHandle(dst)
        with self._lock:
            if self._closed:
                raise CopyStreamClosedError("ThreadCopyStream.copy: stream is closed")
            self._jobs.put((handle, src, after))
        return handle

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self._thread.join()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            handle, src, after = job
            handle._run(src, after)
            # An idle worker must not keep the last source buffer (or destination) alive.
            del job, handle, src, after


class _CudaEvent(StreamEvent):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


class _CudaHandle(CopyHandle):
    def __init__(self, tensor: torch.Tensor, event: torch.cuda.Event, stream: torch.cuda.Stream,
                 allocated: bool) -> None:
        self.tensor = tensor
        self.event = event
        self._stream = stream
        self._allocated = allocated

    def wait(self) -> torch.Tensor:
        compute = torch.cuda.current_stream(self._stream.device)
        compute.wait_event(self.event)
        if self._allocated:
            # allocated on the copy stream: freeing it must wait for this stream's use too
            self.tensor.record_stream(compute)
        return self.tensor

    def synchronize(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return self.event.query()


class CudaCopyStream(CopyStream):
    """The GPU copy stream: copies run on a dedicated ``torch.cuda.Stream``, one event each.

    Host memory taking part in a copy should be pinned: from pageable memory the copy blocks the
    host. A failed copy raises when issued, since CUDA reports errors at launch.
    """

    def __init__(self, device: torch.device | str = "cuda") -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"CudaCopyStream: device={device!s} needs CUDA, none is available")
        super().__init__(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaCopyStream: device={self.device} is not a CUDA device")
        self.stream = torch.cuda.Stream(device=self.device)
        self._closed = False
        self._warned_unpinned = False

    def record_compute(self) -> StreamEvent:
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return _CudaEvent(event)

    def _issue(self, src: torch.Tensor, dst: torch.Tensor | None, after: StreamEvent | None) -> CopyHandle:
        if self._closed:
            raise CopyStreamClosedError("CudaCopyStream.copy: stream is closed")
        for t in (src, dst):
            if t is not None and t.device.type == "cpu" and not t.is_pinned() and not self._warned_unpinned:
                self._warned_unpinned = True
                logger.warning("CudaCopyStream: host tensor %s is not pinned; its copy blocks the host",
                               tuple(t.shape))
        if after is not None and not after.done():
            if isinstance(after, (_CudaEvent, _CudaHandle)):
                self.stream.wait_event(after.event)
            else:  # an event of another kind (a host-side one): wait for it on the host
                after.synchronize()
        with torch.cuda.stream(self.stream):
            allocated = dst is None
            if allocated:
                # on the copy stream: the block cannot be one that queued compute still uses
                dst = torch.empty_like(src, device=self.device)
            if dst.dtype != src.dtype and src.device != dst.device:
                # cross-device copies move bytes as they are; cast on the destination's side
                staged = torch.empty_like(src, device=dst.device)
                staged.copy_(src, non_blocking=True)
                dst.copy_(staged)
            else:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # waited on by threads: sleep, do not spin
            event.record(self.stream)
        # memory owned by the compute stream's allocator must not be handed out again, once freed,
        # while this stream still reads or writes it
        for t in (src, dst):
            if t.is_cuda and not (allocated and t is dst):
                t.record_stream(self.stream)
        return _CudaHandle(dst, event, self.stream, allocated)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.stream.synchronize()


# -- a CPU stream with CUDA's hazards, for tests --------------------------------------------------


class _LateEvent(StreamEvent):
    """Fake compute queued on a GPU: complete only at ``due`` (monotonic seconds)."""

    def __init__(self, due: float, syncs: Callable[[], None]) -> None:
        self.due = due
        self._count_sync = syncs

    def done(self) -> bool:
        return time.monotonic() >= self.due

    def synchronize(self) -> None:
        self._count_sync()
        self._sleep_until_done()

    def _sleep_until_done(self) -> None:
        while (left := self.due - time.monotonic()) > 0:
            time.sleep(left)


class _FakeHandle(_ThreadHandle):
    def __init__(self, tensor: torch.Tensor, stream: "FakeCudaCopyStream") -> None:
        super().__init__(tensor)
        self._stream = stream

    def wait(self) -> torch.Tensor:
        out = super().wait()
        self._stream._reading(out)
        return out

    def synchronize(self) -> None:
        self._stream._count_sync()
        super().wait()


def _checksum(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())


def _poison(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.dtype.is_floating_point else (0xA5 if t.dtype == torch.uint8 else -1))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a (contiguous) tensor covers: [start, end)."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class FakeCudaCopyStream(ThreadCopyStream):
    """A CPU copy stream with the hazards of a CUDA one, to expose a missing wait in tests.

    - Copies run late and out of issue order (``workers`` threads, each copy delayed up to
      ``max_delay_s``); destinations are poisoned (NaN) at issue, so compute that reads one before
      ``wait()`` sees garbage.
    - ``record_compute()`` returns an event that completes up to ``compute_lag_s`` later, as
      queued kernels do; a copy into memory that compute was handed (``wait()``) and that no
      completed compute event has covered since is a violation: queued compute may still read it.
    - The source is checksummed at issue and again when the copy runs: a changed source (a pinned
      buffer reused before its copy ran) is a violation.
    - ``host_syncs`` counts ``synchronize()`` calls, ``syncs_by_thread`` by the calling thread's
      name (a copy worker may wait; the thread that issues compute should not).

    Violations are collected in ``violations`` and raised to whoever waits for the copy.
    """

    def __init__(self, device: torch.device | str = "cpu", *, seed: int = 0, max_delay_s: float = 0.004,
                 compute_lag_s: float = 0.01, workers: int = 2) -> None:
        CopyStream.__init__(self, device)
        self._rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.compute_lag_s = compute_lag_s
        self.violations: list[str] = []
        self.host_syncs = 0
        self.syncs_by_thread: collections.Counter[str] = collections.Counter()
        self.copies = 0
        self._cond = threading.Condition()
        self._closed = False
        self._heap: list[tuple[float, int, _FakeHandle, torch.Tensor, StreamEvent | None, int]] = []
        self._order = itertools.count()
        self._last_due = 0.0
        # memory handed to compute -> the event that covers that compute; None: no event recorded yet
        self._readers: dict[tuple[int, int], StreamEvent | None] = {}
        self._workers = [threading.Thread(target=self._work, name=f"fake-copy-{i}", daemon=True)
                         for i in range(workers)]
        for w in self._workers:
            w.start()

    def _count_sync(self) -> None:
        with self._cond:
            self.host_syncs += 1
            self.syncs_by_thread[threading.current_thread().name] += 1

    def record_compute(self) -> StreamEvent:
        with self._cond:
            # one compute stream: its events complete in the order they were recorded
            due = max(self._last_due, time.monotonic() + self._rng.uniform(0, self.compute_lag_s))
            self._last_due = due
            event = _LateEvent(due, self._count_sync)
            for key, ev in self._readers.items():
                if ev is None:
                    self._readers[key] = event
            return event

    def _reading(self, t: torch.Tensor) -> None:
        with self._cond:
            self._readers[_span(t)] = None

    def _issue(self, src: torch.Tensor, dst: torch.Tensor | None, after: StreamEvent | None) -> CopyHandle:
        if dst is None:
            dst = torch.empty_like(src, device=self.device)
            with self._cond:  # fresh memory: readers of what lay here before are not its readers
                start, end = _span(dst)
                for span in [sp for sp in self._readers if sp[0] < end and start < sp[1]]:
                    del self._readers[span]
        _poison(dst)
        handle = _FakeHandle(dst, self)
        with self._cond:
            if self._closed:
                raise CopyStreamClosedError("FakeCudaCopyStream.copy: stream is closed")
            due = time.monotonic() + self._rng.uniform(0, self.max_delay_s)
            heapq.heappush(self._heap, (due, next(self._order), handle, src, after, _checksum(src)))
            self.copies += 1
            self._cond.notify()
        return handle

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if not self._heap:
                    return
                due, _, handle, src, after, crc = heapq.heappop(self._heap)
            if (left := due - time.monotonic()) > 0:
                time.sleep(left)
            if after is not None and isinstance(after, _LateEvent):
                after._sleep_until_done()  # a device-side wait: no host sync
            elif after is not None:
                after.synchronize()
            problem = self._check(handle.tensor, src, crc)
            if problem is not None:
                with self._cond:
                    self.violations.append(problem)
                handle._error = CopyOrderError(problem)
                handle._finished.set()
            else:
                handle._run(src, None)
            del handle, src, after

    def _check(self, dst: torch.Tensor, src: torch.Tensor, crc: int) -> str | None:
        with self._cond:
            start, end = _span(dst)
            for span, reader in list(self._readers.items()):
                if span[0] >= end or start >= span[1]:
                    continue
                if reader is None or not reader.done():
                    return (f"copy into {tuple(dst.shape)} {dst.dtype} while queued compute may still read it "
                            "(the copy did not wait for the memory's last reader)")
                del self._readers[span]
        if _checksum(src) != crc:
            return f"source {tuple(src.shape)} {src.dtype} changed between issue and copy (reused too early)"
        return None

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for w in self._workers:
            w.join()


# -- choosing a stream ------------------------------------------------------------------------------

_factory: Callable[[torch.device], CopyStream] | None = None


def make_copy_stream(device: torch.device | str) -> CopyStream:
    """A :class:`CudaCopyStream` for a CUDA device, a :class:`ThreadCopyStream` otherwise (or what
    `copy_stream_factory` installed)."""
    device = normalize_device(device)
    if _factory is not None and device.type != "cuda":
        return _factory(device)
    if device.type == "cuda":
        return CudaCopyStream(device)
    return ThreadCopyStream(device)


@contextlib.contextmanager
def copy_stream_factory(factory: Callable[[torch.device], CopyStream]) -> Iterator[list[CopyStream]]:
    """Within the block, `make_copy_stream` builds CPU streams with ``factory`` (tests install
    `FakeCudaCopyStream`); yields the list of streams made, to inspect their violations."""
    global _factory
    made: list[CopyStream] = []
    previous = _factory

    def build(device: torch.device) -> CopyStream:
        s = factory(device)
        made.append(s)
        return s

    _factory = build
    try:
        yield made
    finally:
        _factory = previous
