"""The swap machinery under a stage's executor: saved records, whose bytes move between the device
and host buffers or peers' stripes on one copy stream, and the meter of bytes on the device against
the stage's budget.

`SwapCore` owns the records (`table`), the stream, the host pool and the meter; the executor's
saved-tensor hooks and model-data API make records and move them with it, and the streamed weights
(`mpress.streamed_weights`) reserve bytes and take host buffers from it. A part with copies of its
own in flight registers as a `Lander`: the core lands them when it reaps finished copies, drains
for room under the budget, or waits for host buffers. The copies' contract and the accounting are
the executor's module docstring's.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mpress.peer_memory import PeerMemory, PeerMemoryFullError
from mpress.space import SwapSpaceError, split_bytes
from storage.host_buffers import HostBuffer, HostBufferPool, OversizeRequestError, PoolExhaustedError
from storage.streams import CopyHandle, CopyStream

logger = logging.getLogger(__name__)


class BudgetExceededError(RuntimeError):
    """Saved activations would exceed the stage's memory budget."""


class State(enum.Enum):
    """Where a saved activation's bytes are."""

    RESIDENT = "resident"  # on this device: kept, or swapped back in
    SWAPPING_OUT = "swapping_out"  # copy to host / peers in flight, still on the device
    OUT = "out"  # only in host memory or peers' segments
    SWAPPING_IN = "swapping_in"  # copy back in flight, counted on the device


@dataclass(frozen=True)
class Chunk:
    """One stripe of a D2D-swapped tensor: `nbytes` at `offset` of this rank's slice of `peer`."""

    peer: int
    offset: int
    nbytes: int


@dataclass(eq=False)
class SavedRecord:
    """One activation saved by one forward of one layer: its layout and where its bytes are."""

    id: int
    layer: int
    technique: str  # keep, host or d2d (a recomputed layer keeps its inputs)
    shape: torch.Size
    stride: tuple[int, ...]  # dense; the tensor comes back with this layout
    dtype: torch.dtype
    nbytes: int
    state: State = State.RESIDENT
    chunks: list[Chunk] = field(default_factory=list)  # d2d stripes, in byte order
    tensor: torch.Tensor | None = None  # on the device unless OUT
    host: HostBuffer | None = None
    # the last copies that used `host` / `chunks`: the swap-out's, then the swap-in's
    copies: list[CopyHandle] = field(default_factory=list)
    group: list[int] | None = None  # ids saved by the same forward, for prefetch
    stripes: list[tuple[int, int]] | None = None  # d2d (peer rank, weight); None: the layer's activation stripes


@dataclass(eq=False)
class _Space:
    """A host buffer and peer stripes to give back once `copies` have finished."""

    copies: list[CopyHandle]
    host: HostBuffer | None
    chunks: list[Chunk]

    def ready(self) -> bool:
        return all(h.done() for h in self.copies)


@dataclass(kw_only=True)
class ExecutorStats:
    """Totals since the executor was made."""

    host_bytes: int = 0  # swapped out to host memory
    peer_bytes: int = 0  # swapped out to peers
    recomputed: int = 0  # layer forwards replayed in backward
    resident_bytes: int = 0  # saved activations (and model data brought in) on the device now
    peak_bytes: int = 0  # the most resident at any moment
    model_bytes: int = 0  # optimizer-state bytes moved off the device (each time)
    weight_bytes: int = 0  # streamed weights brought to the device and gradients sent out (each time)



def dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """`t`'s strides if it is dense and non-overlapping, else those of a dense copy of it."""
    return torch.empty_like(t, device="meta").stride()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a dense tensor (any dimension order), as a flat uint8 view."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset()).view(torch.uint8)



class _Meter:
    """Resident bytes against an optional budget (bookkeeping only)."""

    def __init__(self, budget_bytes: int | None, stage: int) -> None:
        self.budget_bytes = budget_bytes
        self.stage = stage
        self.resident = 0
        self.peak = 0

    def fits(self, nbytes: int) -> bool:
        return self.budget_bytes is None or self.resident + nbytes <= self.budget_bytes

    def add(self, nbytes: int, layer: int, what: str) -> None:
        if not self.fits(nbytes):
            raise BudgetExceededError(
                f"stage {self.stage}, layer {layer}: {what} of {nbytes} bytes would hold "
                f"{self.resident + nbytes} bytes of activations and model data in use, over "
                f"budget_bytes={self.budget_bytes}")
        self.resident += nbytes
        self.peak = max(self.peak, self.resident)

    def sub(self, nbytes: int) -> None:
        self.resident -= nbytes


def raise_if_failed(handles: list[CopyHandle]) -> None:
    """Raise the error of a finished copy that failed: a CPU stream reports it on the handle (a
    CUDA stream raised it at issue). `wait()` on a finished copy returns at once."""
    for handle in handles:
        handle.wait()


class Lander(Protocol):
    """A part whose copies the core waits for alongside its own (the streamed weights' gradients)."""

    def busy(self) -> bool:
        """Whether copies of its are in flight or landed and not yet taken in."""
        ...

    def land(self, block: bool) -> None:
        """Take in its copies that have finished (with `block`, all of them, waiting)."""
        ...


class SwapCore:
    """Records and their moves for one stage (see the module docstring). `stripes`: the (peer rank,
    weight) stripes of each d2d layer's activations; `lock` guards everything here and is the
    executor's."""

    def __init__(self, stage: int, device: torch.device, *, stream: CopyStream, peers: PeerMemory | None,
                 host_pool: HostBufferPool | None, budget_bytes: int | None,
                 stripes: dict[int, list[tuple[int, int]]]) -> None:
        self.stage = stage
        self.device = device
        self.stream = stream
        self.peers = peers
        self.host_pool = host_pool
        self.stripes = stripes
        self.meter = _Meter(budget_bytes, stage)
        self.stats = ExecutorStats()
        self.lock = threading.RLock()
        self.table: dict[int, SavedRecord] = {}  # live records by id
        self._ids = itertools.count()
        self._pending_out: deque[int] = deque()
        self._unfreed: list[_Space] = []  # space of freed records whose copies still run
        self._landers: list[Lander] = []

    def new_id(self) -> int:
        return next(self._ids)

    def add_lander(self, lander: Lander) -> None:
        self._landers.append(lander)

    def _landing(self) -> bool:
        return any(lander.busy() for lander in self._landers)

    def _land(self, block: bool) -> None:
        for lander in self._landers:
            if lander.busy():
                lander.land(block)

    def wait_in(self, record: SavedRecord) -> None:
        """A swapped-in record's tensor usable by compute: its copies waited for (on the stream)."""
        if record.state == State.SWAPPING_IN:
            for handle in record.copies:  # compute reads the tensor after its copies only
                handle.wait()
            record.state = State.RESIDENT

    # Data movement; callers hold self.lock.

    def _swap_out(self, record: SavedRecord, t: torch.Tensor) -> None:
        if t.stride() != record.stride:
            t = torch.empty_strided(record.shape, record.stride, dtype=t.dtype, device=t.device).copy_(t)
        src = byte_view(t)
        if record.technique == "host":
            record.host = self.host_buffer(record.nbytes, record.layer)
        else:
            record.chunks = self._alloc_chunks(record)
        after = self.stream.record_compute()  # the copy reads what queued compute writes
        if record.technique == "host":
            record.copies = [self.stream.copy(src, record.host.payload, after=after)]
            self.stats.host_bytes += record.nbytes
        else:
            start = 0
            for c in record.chunks:
                view = self.peers.view(c.peer, c.offset, c.nbytes)
                record.copies.append(self.stream.copy(src[start:start + c.nbytes], view, after=after))
                start += c.nbytes
            self.stats.peer_bytes += record.nbytes
        record.tensor = t  # kept until the swap-out finishes: asked back before that, it is used as is
        record.state = State.SWAPPING_OUT
        self._pending_out.append(record.id)

    def swap_out_counted(self, record: SavedRecord, t: torch.Tensor) -> None:
        """`_swap_out` of a tensor whose bytes are on the meter; on failure they come off it and
        whatever space was taken is given back."""
        try:
            self._swap_out(record, t)
        except BaseException:
            self.meter.sub(record.nbytes)
            self.free_space(record)
            raise

    def host_buffer(self, nbytes: int, layer: int) -> HostBuffer:
        buf = self._try_acquire(nbytes, layer)
        if buf is None and (self._unfreed or self._landing()):
            self.settle()  # buffers of freed tensors whose copies still run: wait for them
            self._land(True)  # and staged gradients
            buf = self._try_acquire(nbytes, layer)
        if buf is None:
            raise SwapSpaceError(
                f"stage {self.stage}, layer {layer}: no host buffer for {nbytes} bytes in a "
                f"pool of {self.host_pool.capacity_bytes} bytes ({self.host_pool.in_use_bytes} in use): "
                f"the profile the pool was sized from underestimated the plan's host swaps")
        return buf

    def _try_acquire(self, nbytes: int, layer: int) -> HostBuffer | None:
        try:
            return self.host_pool.acquire(nbytes, timeout=0)
        except PoolExhaustedError:
            return None
        except OversizeRequestError as exc:
            raise SwapSpaceError(f"stage {self.stage}, layer {layer}: {exc}") from exc

    def _alloc_chunks(self, record: SavedRecord) -> list[Chunk]:
        chunks = self._try_alloc_chunks(record)
        if isinstance(chunks, str) and self._unfreed:
            self.settle()  # stripes of freed tensors whose copies still run: wait for them
            chunks = self._try_alloc_chunks(record)
        if isinstance(chunks, str):
            raise SwapSpaceError(f"stage {self.stage}, layer {record.layer}: {chunks}")
        return chunks

    def _try_alloc_chunks(self, record: SavedRecord) -> list[Chunk] | str:
        """The record's stripes, or why the first that did not fit failed (nothing held then).
        A message, not the exception: a caller's frame holding an exception raised below it is a
        reference cycle that would keep a failed forward's graph alive until garbage collection."""
        stripes = record.stripes if record.stripes is not None else self.stripes[record.layer]
        chunks: list[Chunk] = []
        try:
            for (peer, _), nbytes in zip(stripes, split_bytes(record.nbytes, [w for _, w in stripes])):
                if nbytes:
                    chunks.append(Chunk(peer, self.peers.alloc(peer, nbytes), nbytes))
        except PeerMemoryFullError as exc:
            for c in chunks:
                self.peers.free(c.peer, c.offset)
            return str(exc)
        return chunks

    def swap_in(self, record: SavedRecord) -> None:
        if record.state == State.SWAPPING_OUT:
            # Still on the device: keep it, and free its swap space once the copy out is done.
            self.free_space(record)
            record.state = State.RESIDENT
            return
        if record.state != State.OUT:
            return
        raise_if_failed(record.copies)  # the swap-out's: its bytes are what comes back
        self.reserve(record.nbytes, record.layer, "swapping a saved tensor back in")
        out = torch.empty_strided(record.shape, record.stride, dtype=record.dtype, device=self.device)
        dst = byte_view(out)
        # `out` may reuse memory freed while queued compute still reads it
        after = self.stream.record_compute()
        if record.technique == "host":
            record.copies = [self.stream.copy(record.host.payload, dst, after=after)]
        else:
            record.copies, start = [], 0
            for c in record.chunks:
                view = self.peers.view(c.peer, c.offset, c.nbytes)
                record.copies.append(self.stream.copy(view, dst[start:start + c.nbytes], after=after))
                start += c.nbytes
        record.state = State.SWAPPING_IN
        record.tensor = out

    # Bookkeeping; callers hold self.lock.

    def free_space(self, record: SavedRecord) -> None:
        """Give back the host buffer and the peers' blocks a record holds, at once if no copy
        still uses them, else once those copies have finished (see `_reap`)."""
        space = _Space(record.copies, record.host, record.chunks)
        record.copies, record.host, record.chunks = [], None, []
        if space.host is None and not space.chunks:
            return
        if space.ready():
            self._give_back(space)
        else:
            self._unfreed.append(space)

    def _give_back(self, space: _Space) -> None:
        if space.host is not None:
            space.host.release()
        for c in space.chunks:
            self.peers.free(c.peer, c.offset)

    def reserve(self, nbytes: int, layer: int, what: str) -> None:
        self.reap()
        if not self.meter.fits(nbytes):
            self.drain()
        self.meter.add(nbytes, layer, what)

    def reap(self) -> None:
        """Without blocking: retire the swap-outs that have finished, oldest first, give
        back the space whose copies have finished and add up the gradients that have landed."""
        if self._landing():
            self._land(False)
        while self._pending_out:
            record = self.table.get(self._pending_out[0])
            if record is not None and record.state == State.SWAPPING_OUT:
                if not all(h.done() for h in record.copies):
                    break
                self.retire(record)
            self._pending_out.popleft()
        if self._unfreed:
            waiting = []
            for space in self._unfreed:
                if space.ready():
                    self._give_back(space)
                else:
                    waiting.append(space)
            self._unfreed = waiting

    def retire(self, record: SavedRecord) -> None:
        """A swap-out has finished: its bytes leave the device. Its handles stay with the record,
        to raise a failed copy's error at the swap-in."""
        record.state = State.OUT
        record.tensor = None
        self.meter.sub(record.nbytes)

    def drain(self) -> None:
        """Wait for every swap-out and gradient copy in flight (a host synchronisation)."""
        for rid in self._pending_out:
            record = self.table.get(rid)
            if record is not None and record.state == State.SWAPPING_OUT:
                for handle in record.copies:
                    handle.synchronize()  # raises a failed copy's error
        self._land(True)
        self.reap()

    def settle(self) -> None:
        """Wait for the copies of freed tensors and give their space back (a host synchronisation)."""
        for space in self._unfreed:
            for handle in space.copies:
                try:
                    handle.synchronize()
                except Exception:  # the tensor is gone; its space is free all the same
                    logger.exception("stage %d: a copy of a freed tensor failed", self.stage)
            self._give_back(space)
        self._unfreed = []

    def release(self, record_id: int) -> None:
        """Autograd freed a saved tensor: free its record, buffer and stripes."""
        with self.lock:
            record = self.table.pop(record_id, None)
            if record is None:
                return
            if record.state != State.OUT:
                self.meter.sub(record.nbytes)
            record.tensor = None
            self.free_space(record)
            if record.group is not None and record_id in record.group:
                record.group.remove(record_id)
