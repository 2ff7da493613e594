"""Applies a Plan to one pipeline stage at run time: each layer's saved activations are kept,
recomputed, swapped to host memory, or striped over peer devices (D2D), as its Decision says.

`Executor.wrap(layer, module)` returns a module that runs `module` under saved-tensor hooks. The
pack hook turns every saved activation into a `SavedRecord` in the executor's table and hands
autograd a ticket; the unpack hook turns the ticket back into the tensor; the ticket dying (autograd
freeing the saved tensor after the layer's backward, or the graph being dropped) frees the record.
Parameters (and views of them) are held all step anyway and pass through untouched; tensors under
`min_swap_bytes` are kept rather than swapped.

Where bytes go. host: one buffer from a HostBufferPool (pinned when the device is a GPU), copied
out on a side stream and back on the copy stream. d2d: the tensor's bytes are cut into stripes in
proportion to the Decision's `Stripe.bytes`, each written into the segment of the peer rank that
runs on `Stripe.device` (the stage s with `plan.device_of(s) == Stripe.device`; PeerMemory ranks
are pipeline stages, so with the identity mapping the device index is the rank).

Accounting. The executor counts the bytes of saved activations resident on this device: kept
tensors, swapped ones until their swap-out completes and again from their swap-in until they are
freed, and for a recomputed layer only its checkpoint inputs. Each saved tensor counts once per
layer that saves it, as the profile counts it, so the figure is the plan's model of memory (an
upper bound where layers share a tensor). An increase past `budget_bytes` first waits for
swap-outs in flight, then raises BudgetExceededError naming the stage and layer.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Self

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpress.peer_memory import PeerMemory, PeerMemoryFullError
from mpress.profile import Plan
from mpress.profiler import is_parameter, param_storages
from storage.pool import HostBuffer, HostBufferPool, HostBufferPoolConfig, PoolError
from storage.streams import (
    CopyHandle,
    CopyStream,
    ThreadCopyStream,
    make_copy_stream,
    normalize_device,
)

logger = logging.getLogger(__name__)

MIN_SWAP_BYTES = 4096
HOST_POOL_BYTES = 4 * 2**30  # capacity of the host pool made when none is given; an upper bound only


class BudgetExceededError(RuntimeError):
    """Saved activations would exceed the stage's memory budget."""


class SwapSpaceError(RuntimeError):
    """The host pool or a peer's segment has no room for a swapped tensor."""


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
    tensor: torch.Tensor | None = None  # on the device while RESIDENT or SWAPPING_IN
    host: HostBuffer | None = None
    copies: list[CopyHandle] = field(default_factory=list)  # copies in flight
    group: list[int] | None = None  # ids saved by the same forward, for prefetch


@dataclass(kw_only=True)
class ExecutorStats:
    """Totals since the executor was made."""

    host_bytes: int = 0  # swapped out to host memory
    peer_bytes: int = 0  # swapped out to peers
    recomputed: int = 0  # layer forwards replayed in backward
    resident_bytes: int = 0  # saved activations on the device now
    peak_bytes: int = 0  # the most resident at any moment


def split_bytes(nbytes: int, weights: list[int]) -> list[int]:
    """Cut `nbytes` into pieces proportional to `weights`, each within one byte of its share."""
    total = sum(weights)
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"split_bytes: weights={weights} must be >= 0 with a positive sum")
    cuts = [nbytes * cum // total for cum in itertools.accumulate(weights)]
    return [b - a for a, b in zip([0, *cuts], cuts)]


def stage_on_device(plan: Plan, device: int) -> int | None:
    """The stage (and so the rank) that runs on `device`; with the identity mapping, `device`."""
    if not plan.mapping:
        return device
    return next((stage for stage, d in enumerate(plan.mapping) if d == device), None)


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
                f"{self.resident + nbytes} bytes of saved activations, over "
                f"budget_bytes={self.budget_bytes}")
        self.resident += nbytes
        self.peak = max(self.peak, self.resident)

    def sub(self, nbytes: int) -> None:
        self.resident -= nbytes


class _EventHandle(CopyHandle):
    def __init__(self, tensor: torch.Tensor, event: torch.cuda.Event, device: torch.device) -> None:
        self.tensor = tensor
        self._event = event
        self._device = device

    def wait(self) -> torch.Tensor:
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return self.tensor

    def synchronize(self) -> None:
        self._event.synchronize()

    def done(self) -> bool:
        return self._event.query()


class _SwapOutStream:
    """Copies off the device (to host or to a peer) without holding up compute: a CUDA side
    stream, or on CPU a copy thread (storage's CopyStream copies only towards its device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device=device)
        else:
            self._thread = ThreadCopyStream(device)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> CopyHandle:
        if self.device.type != "cuda":
            return self._thread.copy_to_device(src, dst)
        # The copy reads what compute wrote; the allocator must not recycle src before it ran.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        src.record_stream(self._stream)
        return _EventHandle(dst, event, self.device)

    def close(self) -> None:
        if self.device.type == "cuda":
            self._stream.synchronize()
        else:
            self._thread.close()


class _Ticket:
    """What autograd holds for a saved activation; its death frees the record."""

    __slots__ = ("__weakref__", "id")

    def __init__(self, record_id: int) -> None:
        self.id = record_id


class Executor:
    """Runs one pipeline stage's layers under a Plan's decisions; see the module docstring.

    `copy_stream` carries swap-ins to `device` (default: storage's stream for the device);
    `host_pool` holds host-swapped tensors (default: a pool of HOST_POOL_BYTES, pinned on GPU).
    """

    def __init__(self, plan: Plan, stage: int, *, device: torch.device | str,
                 peers: PeerMemory | None = None, budget_bytes: int | None = None,
                 copy_stream: CopyStream | None = None, host_pool: HostBufferPool | None = None,
                 min_swap_bytes: int = MIN_SWAP_BYTES) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"Executor: budget_bytes={budget_bytes} must be >= 0 or None")
        if min_swap_bytes < 0:
            raise ValueError(f"Executor: min_swap_bytes={min_swap_bytes} must be >= 0")
        self.plan = plan
        self.stage = stage
        self.device = normalize_device(device)
        self.peers = peers
        self.min_swap_bytes = min_swap_bytes
        self.table: dict[int, SavedRecord] = {}  # live records by id; read-only outside
        self._stripes = {d.layer: self._stripe_peers(d) for d in plan.decisions
                         if d.stage == stage and d.technique == "d2d"}
        self._meter = _Meter(budget_bytes, stage)
        self._stats = ExecutorStats()
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._pending_out: deque[int] = deque()
        self._groups: dict[int, deque[list[int]]] = {}  # layer -> ids per forward, oldest first
        self._owned: list = []
        self._copy_in = self._own(make_copy_stream(self.device)) if copy_stream is None else copy_stream
        self._copy_out = self._own(_SwapOutStream(self.device))
        self._host_pool = host_pool

    def _own(self, closable):
        self._owned.append(closable)
        return closable

    def _stripe_peers(self, decision) -> list[tuple[int, int]]:
        """(peer rank, weight) per stripe of a d2d decision, validated."""
        where = f"Executor: stage {self.stage}, layer {decision.layer} (d2d)"
        if self.peers is None:
            raise ValueError(f"{where} needs peers: pass a PeerMemory")
        if not decision.stripes or sum(s.bytes for s in decision.stripes) <= 0:
            raise ValueError(f"{where} has no stripes with bytes > 0")
        if self.peers.rank != self.stage:
            raise ValueError(f"{where}: peers.rank={self.peers.rank} must be the stage; PeerMemory "
                             f"ranks are pipeline stages")
        out = []
        for stripe in decision.stripes:
            peer = stage_on_device(self.plan, stripe.device)
            if peer is None:
                raise ValueError(f"{where}: no stage runs on stripe device {stripe.device}")
            if peer == self.peers.rank or not 0 <= peer < self.peers.world:
                raise ValueError(f"{where}: stripe device {stripe.device} is rank {peer}, not a "
                                 f"peer of rank {self.peers.rank} in a world of {self.peers.world}")
            if stripe.bytes < 0:
                raise ValueError(f"{where}: stripe bytes={stripe.bytes} must be >= 0")
            out.append((peer, stripe.bytes))
        return out

    # The hooks' public face.

    def wrap(self, layer_index: int, module: nn.Module) -> nn.Module:
        """`module` behind this stage's decision for `layer_index`; same forward signature
        (positional tensors in, a tensor or tuple out). Its parameters sit under `module.`."""
        return PlannedLayer(self, layer_index, module,
                            self.plan.decision(self.stage, layer_index).technique)

    def prefetch(self, layer_index: int) -> int:
        """Start swapping in the saved tensors of the oldest forward of `layer_index` not yet
        prefetched: the next backward of that layer in GPipe and 1F1B order. The runtime calls it
        one layer (or more) ahead of the backward; a tensor not prefetched is swapped in when the
        backward needs it. Returns the bytes whose swap-in started."""
        with self._lock:
            groups = self._groups.get(layer_index)
            while groups and not groups[0]:
                groups.popleft()
            if not groups:
                return 0
            started = 0
            for rid in list(groups.popleft()):
                record = self.table[rid]
                if record.state in (State.SWAPPING_OUT, State.OUT):
                    self._swap_in(record)
                    started += record.nbytes
            return started

    def stats(self) -> ExecutorStats:
        """Bytes swapped to host and peers, recomputed layers, resident and peak bytes."""
        with self._lock:
            self._reap()
            return ExecutorStats(host_bytes=self._stats.host_bytes, peer_bytes=self._stats.peer_bytes,
                                 recomputed=self._stats.recomputed,
                                 resident_bytes=self._meter.resident, peak_bytes=self._meter.peak)

    def synchronize(self) -> None:
        """Wait until every swap-out in flight has finished (its bytes have left the device)."""
        with self._lock:
            self._drain()

    @property
    def peak_bytes(self) -> int:
        """The most bytes of saved activations resident at once so far."""
        return self._meter.peak

    def close(self) -> None:
        """Finish copies in flight and close the streams and pool this executor made."""
        self.synchronize()
        for closable in reversed(self._owned):
            closable.close()
        self._owned.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Hooks.

    def hooks(self, layer_index: int, module: nn.Module, technique: str):
        """The saved-tensor hooks context for one forward of `layer_index`."""
        storages = param_storages(module)
        swap = technique if technique in ("host", "d2d") else None
        group: list[int] = []
        if swap:
            with self._lock:
                groups = self._groups.setdefault(layer_index, deque())
                while groups and not groups[0]:
                    groups.popleft()
                groups.append(group)

        def pack(t: torch.Tensor):
            if is_parameter(t, storages):
                return t
            # An alias without autograd history: holding a saved output with its grad_fn would
            # make a cycle (tensor -> grad_fn -> ticket) that keeps a dropped graph alive.
            t = t.detach()
            nbytes = t.numel() * t.element_size()
            how = swap if swap and nbytes >= self.min_swap_bytes else "keep"
            record = SavedRecord(id=next(self._ids), layer=layer_index, technique=how,
                                 shape=t.shape, stride=dense_stride(t), dtype=t.dtype, nbytes=nbytes)
            with self._lock:
                if how == "keep":
                    self._reserve(nbytes, layer_index, "keeping a saved tensor")
                    record.tensor = t
                else:
                    self._reserve(nbytes, layer_index, f"saving a tensor to swap it to {how}")
                    try:
                        self._swap_out(record, t)
                    except BaseException:
                        self._meter.sub(nbytes)
                        self._free_space(record)
                        raise
                    record.group = group
                    group.append(record.id)
                self.table[record.id] = record
            ticket = _Ticket(record.id)
            weakref.finalize(ticket, self._release, record.id).atexit = False
            return ticket

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def _unpack(self, ticket):
        if not isinstance(ticket, _Ticket):
            return ticket  # a parameter
        with self._lock:
            record = self.table[ticket.id]
            if record.technique != "keep":
                self._swap_in(record)
                for handle in record.copies:
                    handle.wait()
                record.copies = []
                record.state = State.RESIDENT
            return record.tensor

    def _count_recompute(self) -> None:
        with self._lock:
            self._stats.recomputed += 1

    # Data movement; callers hold self._lock.

    def _swap_out(self, record: SavedRecord, t: torch.Tensor) -> None:
        if t.stride() != record.stride:
            t = torch.empty_strided(record.shape, record.stride, dtype=t.dtype, device=t.device).copy_(t)
        src = byte_view(t)
        if record.technique == "host":
            record.host = self._acquire_host(record)
            record.copies = [self._copy_out.copy(src, record.host.payload)]
            self._stats.host_bytes += record.nbytes
        else:
            record.chunks = self._alloc_chunks(record)
            start = 0
            for c in record.chunks:
                view = self.peers.view(c.peer, c.offset, c.nbytes)
                record.copies.append(self._copy_out.copy(src[start:start + c.nbytes], view))
                start += c.nbytes
            self._stats.peer_bytes += record.nbytes
        record.state = State.SWAPPING_OUT
        self._pending_out.append(record.id)

    def _acquire_host(self, record: SavedRecord) -> HostBuffer:
        if self._host_pool is None:
            config = HostBufferPoolConfig(capacity_bytes=HOST_POOL_BYTES, pin=self.device.type == "cuda")
            self._host_pool = self._own(HostBufferPool(config))
        try:
            return self._host_pool.acquire(record.nbytes, timeout=0)
        except PoolError as exc:
            raise SwapSpaceError(f"stage {self.stage}, layer {record.layer}: no host buffer for "
                                 f"{record.nbytes} bytes: {exc}") from exc

    def _alloc_chunks(self, record: SavedRecord) -> list[Chunk]:
        stripes = self._stripes[record.layer]
        chunks: list[Chunk] = []
        try:
            for (peer, _), nbytes in zip(stripes, split_bytes(record.nbytes, [w for _, w in stripes])):
                if nbytes:
                    chunks.append(Chunk(peer, self.peers.alloc(peer, nbytes), nbytes))
        except PeerMemoryFullError as exc:
            for c in chunks:
                self.peers.free(c.peer, c.offset)
            raise SwapSpaceError(f"stage {self.stage}, layer {record.layer}: {exc}") from exc
        return chunks

    def _swap_in(self, record: SavedRecord) -> None:
        if record.state == State.SWAPPING_OUT:
            self._retire(record)
        if record.state != State.OUT:
            return
        self._reserve(record.nbytes, record.layer, "swapping a saved tensor back in")
        out = torch.empty_strided(record.shape, record.stride, dtype=record.dtype, device=self.device)
        dst = byte_view(out)
        if record.technique == "host":
            record.copies = [self._copy_in.copy_to_device(record.host.payload, dst)]
            record.state = State.SWAPPING_IN
        else:
            start = 0
            for c in record.chunks:  # ordered on the current stream on GPU, a memcpy on CPU
                dst[start:start + c.nbytes].copy_(self.peers.view(c.peer, c.offset, c.nbytes))
                start += c.nbytes
            record.state = State.RESIDENT
        record.tensor = out

    # Bookkeeping; callers hold self._lock.

    def _free_space(self, record: SavedRecord) -> None:
        """Give back the host buffer or the peers' blocks a record holds."""
        if record.host is not None:
            record.host.release()
            record.host = None
        for c in record.chunks:
            self.peers.free(c.peer, c.offset)
        record.chunks = []

    def _reserve(self, nbytes: int, layer: int, what: str) -> None:
        self._reap()
        if not self._meter.fits(nbytes):
            self._drain()
        self._meter.add(nbytes, layer, what)

    def _reap(self) -> None:
        """Retire the swap-outs that have finished, oldest first."""
        while self._pending_out:
            record = self.table.get(self._pending_out[0])
            if record is not None and record.state == State.SWAPPING_OUT:
                if not all(h.done() for h in record.copies):
                    return
                self._retire(record)
            self._pending_out.popleft()

    def _retire(self, record: SavedRecord) -> None:
        """A swap-out has finished (or is waited for here): its bytes leave the device."""
        for handle in record.copies:
            handle.synchronize()  # raises a failed copy's error
        record.copies = []
        record.state = State.OUT
        self._meter.sub(record.nbytes)

    def _drain(self) -> None:
        """Wait for every swap-out in flight."""
        for rid in self._pending_out:
            record = self.table.get(rid)
            if record is not None and record.state == State.SWAPPING_OUT:
                for handle in record.copies:
                    handle.synchronize()
        self._reap()

    def _release(self, record_id: int) -> None:
        """Autograd freed a saved tensor: free its record, buffer and stripes."""
        with self._lock:
            record = self.table.pop(record_id, None)
            if record is None:
                return
            try:
                for handle in record.copies:  # a copy may still use the buffer or the stripes
                    handle.synchronize()
            except Exception:
                logger.exception("stage %d, layer %d: a copy of a freed tensor failed",
                                 self.stage, record.layer)
            if record.state != State.OUT:
                self._meter.sub(record.nbytes)
            self._free_space(record)
            if record.group is not None:
                record.group.remove(record_id)


class PlannedLayer(nn.Module):
    """A layer run under its stage's decision (made by `Executor.wrap`)."""

    def __init__(self, executor: Executor, layer_index: int, module: nn.Module, technique: str) -> None:
        super().__init__()
        self.executor = executor
        self.layer_index = layer_index
        self.technique = technique
        self.module = module

    def forward(self, *args):
        with self.executor.hooks(self.layer_index, self.module, self.technique):
            if self.technique != "recompute":
                return self.module(*args)
            first = [True]

            def run(*inputs):
                if first[0]:
                    first[0] = False
                else:
                    self.executor._count_recompute()
                return self.module(*inputs)

            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
