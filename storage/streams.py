"""Copies from host memory to the device, on their own stream, with a handle per copy.

Compute waits on the handle of the item it needs, never on the whole copy stream, so a copy for
layer i+1 overlaps compute of layer i. On CUDA the stream is a ``torch.cuda.Stream`` and each
handle an event; on CPU the "device" is host memory, the stream is one worker thread that runs
the copies in order, and each handle a ``threading.Event``. Both run the same calling code.

A copy reads its source asynchronously: the source (typically a pooled host buffer) must not be
overwritten or returned to its pool before ``handle.synchronize()`` (or ``done()`` is True).
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod

import torch

from storage.errors import StorageError

logger = logging.getLogger(__name__)


class CopyStreamClosedError(StorageError, RuntimeError):
    """A copy was issued after ``close``."""


class CopyHandle(ABC):
    """One issued copy; ``tensor`` is its destination, valid for use after ``wait()``."""

    tensor: torch.Tensor

    @abstractmethod
    def wait(self) -> torch.Tensor:
        """Order the current compute stream after this copy only, and return ``tensor``. On
        CPU that means blocking the calling thread. Raises the copy's exception, if any."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the copy finished, e.g. before reusing the source."""

    @abstractmethod
    def done(self) -> bool:
        """True once the copy has finished (successfully or not); never blocks."""


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
    """Issues host-to-device copies asynchronously; one implementation per kind of device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = normalize_device(device)

    def copy_to_device(
        self,
        src: torch.Tensor,
        dst: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        in_place_ok: bool = False,
    ) -> CopyHandle:
        """Copy ``src`` into ``dst`` (or into a new tensor on the device) asynchronously.

        ``device`` defaults to this stream's device and must equal it when given. With
        ``dst=None`` and ``in_place_ok=True``, a ``src`` already on the device (on CPU: host
        memory is device memory) is returned as is, without copying.
        """
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"copy_to_device: src must be a torch.Tensor, got {type(src).__name__}")
        if device is not None and normalize_device(device) != self.device:
            raise ValueError(
                f"copy_to_device: device={device!s} differs from this stream's device {self.device}"
            )
        if dst is not None:
            if dst.device != self.device:
                raise ValueError(
                    f"copy_to_device: dst is on {dst.device}, this stream copies to {self.device}"
                )
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(
                    f"copy_to_device: dst {tuple(dst.shape)} {dst.dtype} does not match "
                    f"src {tuple(src.shape)} {src.dtype}"
                )
        elif in_place_ok and src.device == self.device:
            return _DoneHandle(src)
        return self._issue(src, dst)

    @abstractmethod
    def _issue(self, src: torch.Tensor, dst: torch.Tensor | None) -> CopyHandle:
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


class ThreadCopyStream(CopyStream):
    """The CPU copy stream: one worker thread runs ``dst.copy_(src)`` in issue order."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        if self.device.type == "cuda":
            raise ValueError(f"ThreadCopyStream: device={self.device} is CUDA; use CudaCopyStream")
        self._lock = threading.Lock()
        self._closed = False
        self._jobs: queue.SimpleQueue[tuple[_ThreadHandle, torch.Tensor] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._work, name="copy-stream", daemon=True)
        self._thread.start()

    def _issue(self, src: torch.Tensor, dst: torch.Tensor | None) -> CopyHandle:
        if dst is None:
            # Allocated here, not in the worker, so the handle's tensor exists immediately.
            dst = torch.empty_like(src, device=self.device)
        handle = _ThreadHandle(dst)
        with self._lock:
            if self._closed:
                raise CopyStreamClosedError("ThreadCopyStream.copy_to_device: stream is closed")
            self._jobs.put((handle, src))
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
            handle, src = job
            try:
                handle.tensor.copy_(src)
            except BaseException as exc:  # noqa: BLE001 - the waiter re-raises it
                handle._error = exc
            handle._finished.set()
            # An idle worker must not keep the last source buffer (or destination) alive.
            del job, handle, src


class _CudaHandle(CopyHandle):
    def __init__(self, tensor: torch.Tensor, event: torch.cuda.Event) -> None:
        self.tensor = tensor
        self._event = event

    def wait(self) -> torch.Tensor:
        torch.cuda.current_stream(self.tensor.device).wait_event(self._event)
        return self.tensor

    def synchronize(self) -> None:
        self._event.synchronize()

    def done(self) -> bool:
        return self._event.query()


class CudaCopyStream(CopyStream):
    """The GPU copy stream: copies run on a dedicated ``torch.cuda.Stream``, one event each.

    The source should be pinned: from pageable memory the copy is synchronous for the host.
    A failed copy raises when issued, since CUDA reports errors at launch.
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

    def _issue(self, src: torch.Tensor, dst: torch.Tensor | None) -> CopyHandle:
        if self._closed:
            raise CopyStreamClosedError("CudaCopyStream.copy_to_device: stream is closed")
        if src.device.type == "cpu" and not src.is_pinned() and not self._warned_unpinned:
            self._warned_unpinned = True
            logger.warning(
                "CudaCopyStream: source tensor %s is not pinned; its copy blocks the host",
                tuple(src.shape),
            )
        compute = torch.cuda.current_stream(self.device)
        if dst is None:
            # Allocated on the compute stream, which is the one that will use it.
            dst = torch.empty_like(src, device=self.device)
        # The copy may overwrite memory that compute work already enqueued still reads (a ring
        # slot being refilled, or a block the allocator just recycled), so it starts after that
        # work. Issue a copy before the compute it should overlap with.
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        # dst's block belongs to the compute stream; without this the caching allocator could
        # hand it out again, once freed, while the copy stream still writes it.
        dst.record_stream(self.stream)
        if src.is_cuda:
            src.record_stream(self.stream)
        return _CudaHandle(dst, event)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.stream.synchronize()


def make_copy_stream(device: torch.device | str) -> CopyStream:
    """A :class:`CudaCopyStream` for a CUDA device, a :class:`ThreadCopyStream` otherwise."""
    device = normalize_device(device)
    if device.type == "cuda":
        return CudaCopyStream(device)
    return ThreadCopyStream(device)
