"""A CPU copy stream whose copies wait for a gate: tests hold copies in flight for certain."""

from __future__ import annotations

import threading

from storage.streams import ThreadCopyStream


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
