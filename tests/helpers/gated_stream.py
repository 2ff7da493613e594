"""A CPU copy stream whose copies wait for a gate: tests hold copies in flight for certain."""

from __future__ import annotations

import threading

from storage.streams import ThreadCopyStream, _ThreadHandle


class GatedStream(ThreadCopyStream):
    """A CPU stream each of whose copies waits until `gate` is set: copies still queued, for
    certain (clearing the gate holds the copies issued from then on). A timer opens the gate after
    a minute, so that a wrong wait fails the test instead of hanging it."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self._safety = threading.Timer(60, self.gate.set)
        self._safety.daemon = True
        self._safety.start()
        super().__init__("cpu")

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.gate.wait()
            handle, src, after = job
            handle._run(src, after)
            del job, handle, src, after

    def close(self) -> None:
        self.gate.set()
        self._safety.cancel()
        super().close()


class _HeldHandle(_ThreadHandle):
    """A copy of `HeldUntilSynchronized`: a host synchronisation on it opens the stream's gate."""

    def __init__(self, tensor, stream: "HeldUntilSynchronized") -> None:
        super().__init__(tensor)
        self._stream = stream

    def synchronize(self) -> None:
        self._stream.open("synchronize")
        super().synchronize()


class HeldUntilSynchronized(ThreadCopyStream):
    """A CPU stream that holds copies from the first one `hold_from`'s predicate picks (that copy and,
    the stream being in order, every later one) until a host synchronisation on any copy of the
    stream asks for them: the one way a waiting path can be made to run for certain. `opened_by`
    says what opened the gate ("synchronize", or "timer": the safety timer, after a minute, so that
    a wait that never synchronises fails the test instead of hanging it). `wait()`, compute's wait
    for a copy, does not open it."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.opened_by: str | None = None
        self._pick = None
        self._safety: threading.Timer | None = None
        super().__init__("cpu")

    def hold_from(self, pick) -> None:
        """Hold the first copy with `pick(src, dst)` true, and everything after it."""
        self._pick = pick

    def open(self, by: str) -> None:
        if not self.gate.is_set():
            self.opened_by = by
            self.gate.set()

    def _issue(self, src, dst, after):
        if dst is None:
            dst = src.new_empty(src.shape)
        handle = _HeldHandle(dst, self)
        with self._lock:
            if self._closed:
                raise RuntimeError("HeldUntilSynchronized: stream is closed")
            if self._pick is not None and self._pick(src, dst):
                self._pick = None
                self.gate.clear()
                self._safety = threading.Timer(60, self.open, args=("timer",))
                self._safety.daemon = True
                self._safety.start()
            self._jobs.put((handle, src, after, not self.gate.is_set()))
        return handle

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            handle, src, after, held = job
            if held:
                self.gate.wait()
            handle._run(src, after)
            del job, handle, src, after

    def close(self) -> None:
        self.open("close")
        if self._safety is not None:
            self._safety.cancel()
        super().close()
