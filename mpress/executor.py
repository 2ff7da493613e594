"""Applies a Plan to one pipeline stage at run time: each layer's saved activations are kept,
recomputed, swapped to host memory, or striped over peer devices (D2D), as its Decision says.

`Executor.wrap(layer, module)` returns a module that runs `module` under saved-tensor hooks. The
pack hook turns every saved activation into a `SavedRecord` in the executor's table and hands
autograd a ticket; the unpack hook turns the ticket back into the tensor; the ticket dying (autograd
freeing the saved tensor after the layer's backward, or the graph being dropped) frees the record.
Parameters (and views of them) are held all step anyway and pass through untouched; tensors under
`min_swap_bytes` are kept rather than swapped.

Where bytes go. host: one buffer from a HostBufferPool (pinned when the device is a GPU) sized
from the plan (`host_pool_bytes_for`). d2d: the tensor's bytes are cut into stripes in proportion
to the Decision's `Stripe.bytes`, each written into the segment of the peer rank that runs on
`Stripe.device` (the stage s with `plan.device_of(s) == Stripe.device`; PeerMemory ranks are
pipeline stages, so with the identity mapping the device index is the rank); every rank's segment
is sized from the plan too (`peer_capacity_bytes_for`).

Copies. Both directions run on one storage CopyStream with CUDA's contract on every device: a
swap-out waits for the compute that wrote the tensor (`after=record_compute()`), a swap-in for
the compute that may still read the memory it fills, and compute waits for a swap-in's copies
(`wait()`) before it reads the tensor. Nothing in the forward or backward blocks the host unless
the budget or the swap space runs short. A host buffer or a peer stripe goes back to its pool only
once the copies that read or write it have finished (`done()`); until then it is set aside and
freed by a later, non-blocking pass. A tensor asked back before its swap-out finished is still on
the device and is used as it is.

Model data. `stash(layer, tensor)` moves one optimizer-state tensor of a layer the plan's
model-data decision moves off the device into host memory or peers' segments, by the same
copies and records as a swapped activation; `fetch` starts bringing it back, `take` hands it
back as a device tensor (still counted: give it to `stash` again after the step), `host_view`
exposes states in host memory to a step on the host, and `peek` reads a copy on the host without
bringing it back (for checkpoints).
`mpress.model_data.ModelDataRunner` runs a stage's optimizer step with them.

Streamed weights. A layer whose model-data decision has `weights="host"` keeps its weights in host
memory: after its first forward they are copied there and the parameters' device storage is
freed (resized to nothing, so autograd's references to them stay valid). Each forward brings
them in (and starts bringing in the next streamed layer's) and frees them after; a backward
brings them in when the first gradient reaches the layer's outputs, and once the layer's
backward is over (the next layer's backward starts, or the backward pass ends) its gradients
are copied out and added up in host memory (the first micro-batch's copied, the others added,
as autograd adds them) and the weights are freed again. `host_weight` / `host_grad` give the
host copies to the optimizer's step on the host, which updates the weights in place;
`restore_weights` (and `close`) puts every weight back on the device.

Accounting. The executor counts the bytes of saved activations resident on this device: kept
tensors, swapped ones until their swap-out completes and again from their swap-in until they are
freed, and for a recomputed layer only its checkpoint inputs. Each saved tensor counts once per
layer that saves it, as the profile counts it, so the figure is the plan's model of memory (an
upper bound where layers share a tensor), plus the optimizer states of model-data layers while
they are on the device, plus streamed weights while they are on the device and their gradients
from the backward that makes them until their copy out has finished. An increase past
`budget_bytes` first waits for swap-outs and gradient copies in flight, then raises
BudgetExceededError naming the stage and layer.
"""

from __future__ import annotations

import collections
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

from mpress.peer_memory import ALIGNMENT as PEER_ALIGNMENT
from mpress.peer_memory import PeerMemory, PeerMemoryFullError
from mpress.profile import LayerProfile, PipelineProfile, Plan
from mpress.profiler import ModelDataTensors
from mpress.schedule import in_flight_peak
from storage.pool import (
    HostBuffer,
    HostBufferPool,
    HostBufferPoolConfig,
    OversizeRequestError,
    PoolExhaustedError,
    round_up,
)
from storage.streams import CopyHandle, CopyStream, make_copy_stream, normalize_device

logger = logging.getLogger(__name__)

MIN_SWAP_BYTES = 4096
HOST_ALIGNMENT = 4096  # bytes; every host buffer is rounded up to this
# Pools and segments hold what the profile says the plan swaps, plus a quarter: an MoE layer's
# saved tensors change size with the routing of each micro-batch.
SLACK_FRACTION = 4


class BudgetExceededError(RuntimeError):
    """Saved activations would exceed the stage's memory budget."""


class SwapSpaceError(RuntimeError):
    """The host pool or a peer's segment has no room for a swapped tensor, or a plan needs more
    host memory than allowed."""


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


@dataclass(eq=False)
class _Streamed:
    """A layer whose weights live in host memory between uses (see the module docstring)."""

    layer: int
    params: list[nn.Parameter]
    master: list[HostBuffer] = field(default_factory=list)  # the weights; empty until the first offload
    grads: list[HostBuffer | None] = field(default_factory=list)  # this step's gradient sums
    added: list[bool] = field(default_factory=list)  # a micro-batch's gradient is in grads[i]
    where: str = "device"  # device (before the first offload), out, fetching, in
    copies: list[CopyHandle] = field(default_factory=list)  # the fetch in flight
    pending: int = 0  # in a backward: parameters whose gradient has not been accumulated yet

    @property
    def nbytes(self) -> list[int]:
        return [p.numel() * p.element_size() for p in self.params]


@dataclass(eq=False)
class _GradOut:
    """A streamed layer's gradient on its way to host memory."""

    layer: _Streamed
    index: int
    grad: torch.Tensor  # kept alive until the copy has read it
    staging: HostBuffer
    copy: CopyHandle


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


# -- swap space a plan needs (pure: profile and plan in, bytes out) ------------------------------


def _planned_layer(profile: PipelineProfile, stage: int, layer: int) -> LayerProfile:
    stages = [s for s in profile.stages if s.stage == stage]
    found = [lp for s in stages for lp in s.layers if lp.index == layer]
    if not found:
        raise ValueError(f"the plan swaps layer {layer} of stage {stage}, which the profile does not have")
    return found[0]


def _swapped(layer: LayerProfile, min_swap_bytes: int) -> list[int]:
    """Bytes of each tensor of `layer` the executor swaps (smaller ones are kept)."""
    return [t.bytes for t in layer.saved if t.bytes >= min_swap_bytes]


def _in_flight(profile: PipelineProfile, stage: int) -> int:
    return in_flight_peak(profile.schedule, stage, len(profile.stages), profile.micro_batches)


def host_swap_bytes(profile: PipelineProfile, plan: Plan, stage: int, *,
                    min_swap_bytes: int = MIN_SWAP_BYTES) -> int:
    """Host memory `stage`'s host swaps hold at its peak: each swapped tensor of its host layers,
    rounded to the pool's alignment, once per micro-batch in flight (a buffer is held from the
    forward until the layer's backward)."""
    per_micro_batch = sum(round_up(b, HOST_ALIGNMENT)
                          for d in plan.decisions if d.stage == stage and d.technique == "host"
                          for b in _swapped(_planned_layer(profile, stage, d.layer), min_swap_bytes))
    return _in_flight(profile, stage) * per_micro_batch


def host_pool_bytes_for(profile: PipelineProfile, plan: Plan, stage: int, *, limit_bytes: int | None = None,
                        min_swap_bytes: int = MIN_SWAP_BYTES) -> int:
    """Capacity of `stage`'s host pool: what its host swaps hold at the peak plus slack, at most
    `limit_bytes`. Raises SwapSpaceError when the peak alone exceeds `limit_bytes`."""
    need = host_swap_bytes(profile, plan, stage, min_swap_bytes=min_swap_bytes)
    if limit_bytes is not None and need > limit_bytes:
        layers = sorted(d.layer for d in plan.decisions if d.stage == stage and d.technique == "host")
        raise SwapSpaceError(
            f"stage {stage}: the plan swaps layers {layers} to host memory, {need} bytes at the peak, more "
            f"than the {limit_bytes} bytes of host memory allowed")
    capacity = need + need // SLACK_FRACTION
    return capacity if limit_bytes is None else min(capacity, limit_bytes)


def model_host_bytes(profile: PipelineProfile, plan: Plan, stage: int) -> int:
    """Host memory the model data `plan` puts in host memory for `stage` take all step, each
    tensor rounded to the pool's alignment: optimizer states; for streamed layers their weights
    and gradient sums, and room for two layers' gradients on their way out (a layer has at most
    as many parameters as state tensors)."""
    total = staging = 0
    for d in plan.model_data:
        if d.stage != stage or d.technique != "host":
            continue
        lp = _planned_layer(profile, stage, d.layer)
        total += round_up(lp.state_bytes, HOST_ALIGNMENT) + lp.state_tensors * HOST_ALIGNMENT
        if d.weights == "host":
            half = round_up(lp.update_bytes // 2, HOST_ALIGNMENT) + lp.state_tensors * HOST_ALIGNMENT
            total += 2 * half
            staging = max(staging, half)
    return total + 2 * staging


def moved_model_bytes(profile: PipelineProfile, plan: Plan, stage: int) -> tuple[int, int]:
    """Bytes of `stage`'s model data `plan` takes off its device between uses: (optimizer states,
    streamed weights and gradients). The executor's budget meter counts streamed weights and
    gradients while they are on the device; the rest of the stage's `static_bytes` stays there."""
    states = streamed = 0
    for d in plan.model_data:
        if d.stage != stage or d.technique == "keep":
            continue
        lp = _planned_layer(profile, stage, d.layer)
        states += lp.state_bytes
        streamed += lp.update_bytes if d.weights == "host" else 0
    return states, streamed


def peer_capacity_bytes_for(profile: PipelineProfile, plan: Plan, *, min_swap_bytes: int = MIN_SWAP_BYTES) -> int:
    """`capacity_bytes` every rank's PeerMemory needs for `plan` (0: no D2D swap). A segment has one
    equal slice per writer, so each slice must hold the most any stage writes into any one peer at
    its peak (every micro-batch in flight, plus the optimizer states it keeps there all step),
    stripes rounded to the peer alignment, plus slack."""
    most = 0
    for st in profile.stages:
        s = st.stage
        model: collections.Counter[int] = collections.Counter()
        for d in plan.model_data:
            if d.stage != s or d.technique != "d2d":
                continue
            lp = _planned_layer(profile, s, d.layer)
            peers = [stage_on_device(plan, x.device) for x in d.stripes]
            if None in peers or not d.stripes:
                raise ValueError(f"stage {s}, layer {d.layer} (model-data d2d): stripes {d.stripes} name a "
                                 f"device no stage runs on")
            for peer, piece in zip(peers, split_bytes(lp.state_bytes, [x.bytes for x in d.stripes])):
                model[peer] += piece + max(lp.state_tensors, 1) * PEER_ALIGNMENT
        per_peer: collections.Counter[int] = collections.Counter()
        for d in plan.decisions:
            if d.stage != s or d.technique != "d2d":
                continue
            peers = [stage_on_device(plan, x.device) for x in d.stripes]
            if None in peers or not d.stripes:
                raise ValueError(f"stage {s}, layer {d.layer} (d2d): stripes {d.stripes} name a device "
                                 f"no stage runs on")
            weights = [x.bytes for x in d.stripes]
            for nbytes in _swapped(_planned_layer(profile, s, d.layer), min_swap_bytes):
                for peer, piece in zip(peers, split_bytes(nbytes, weights)):
                    if piece:
                        per_peer[peer] += round_up(piece, PEER_ALIGNMENT)
        most = max(most, max((_in_flight(profile, s) * per_peer[p] + model[p] for p in per_peer.keys() | model.keys()),
                             default=0))
    if not most:
        return 0
    return len(profile.stages) * round_up(most + most // SLACK_FRACTION, PEER_ALIGNMENT)


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


class _Ticket:
    """What autograd holds for a saved activation; its death frees the record."""

    __slots__ = ("__weakref__", "id")

    def __init__(self, record_id: int) -> None:
        self.id = record_id


def _raise_if_failed(handles: list[CopyHandle]) -> None:
    """Raise the error of a finished copy that failed: a CPU stream reports it on the handle (a
    CUDA stream raised it at issue). `wait()` on a finished copy returns at once."""
    for handle in handles:
        handle.wait()


class Executor:
    """Runs one pipeline stage's layers under a Plan's decisions; see the module docstring.

    `copy_stream` carries swaps in both directions (default: storage's stream for the device).
    A stage with host swaps needs `host_pool`, or `host_pool_bytes` (`host_pool_bytes_for`) for
    the pool it makes (pinned on GPU); a stage with D2D swaps needs `peers`.
    """

    def __init__(self, plan: Plan, stage: int, *, device: torch.device | str,
                 peers: PeerMemory | None = None, budget_bytes: int | None = None,
                 copy_stream: CopyStream | None = None, host_pool: HostBufferPool | None = None,
                 host_pool_bytes: int | None = None, min_swap_bytes: int = MIN_SWAP_BYTES) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"Executor: budget_bytes={budget_bytes} must be >= 0 or None")
        if min_swap_bytes < 0:
            raise ValueError(f"Executor: min_swap_bytes={min_swap_bytes} must be >= 0")
        if host_pool_bytes is not None and host_pool_bytes < 0:
            raise ValueError(f"Executor: host_pool_bytes={host_pool_bytes} must be >= 0 or None")
        self.plan = plan
        self.stage = stage
        self.device = normalize_device(device)
        self.peers = peers
        self.min_swap_bytes = min_swap_bytes
        self.table: dict[int, SavedRecord] = {}  # live records by id; read-only outside
        self._stripes = {d.layer: self._stripe_peers(d) for d in plan.decisions
                         if d.stage == stage and d.technique == "d2d"}
        self._model = {d.layer: d for d in plan.model_data if d.stage == stage and d.technique != "keep"}
        self._model_stripes = {layer: self._stripe_peers(d) for layer, d in self._model.items()
                               if d.technique == "d2d"}
        host_layers = sorted({d.layer for d in plan.decisions if d.stage == stage and d.technique == "host"} |
                             {layer for layer, d in self._model.items() if d.technique == "host"})
        if host_layers and host_pool is None and host_pool_bytes is None:
            raise ValueError(f"Executor: stage {stage} swaps layers {host_layers} to host memory: pass "
                             f"host_pool_bytes (see host_pool_bytes_for) or host_pool")
        self._meter = _Meter(budget_bytes, stage)
        self._stats = ExecutorStats()
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._pending_out: deque[int] = deque()
        self._groups: dict[int, deque[list[int]]] = {}  # layer -> ids per forward, oldest first
        self._unfreed: list[_Space] = []  # space of freed records whose copies still run
        self._owned: list = []
        self._stream = self._own(make_copy_stream(self.device)) if copy_stream is None else copy_stream
        if host_layers and host_pool is None:
            # One buffer per slab: capacity is then exactly the buffers' aligned bytes, and a slab
            # of one size class never strands room another size class needs.
            config = HostBufferPoolConfig(capacity_bytes=max(host_pool_bytes, HOST_ALIGNMENT),
                                          pin=self.device.type == "cuda", alignment=HOST_ALIGNMENT,
                                          slab_bytes=HOST_ALIGNMENT)
            host_pool = self._own(HostBufferPool(config))
        self._host_pool = host_pool
        # streamed weights: layers registered by `wrap`, in stage order
        self._streams = {layer for layer, d in self._model.items() if d.weights == "host"}
        self._streamed: dict[int, _Streamed] = {}
        self._in_backward: list[_Streamed] = []
        self._grads_out: deque[_GradOut] = deque()
        self._task = None  # the backward pass whose end is queued to finish streamed layers

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
        if layer_index in self._streams:
            params = list({id(p): p for p in module.parameters() if p.requires_grad}.values())
            streamed = _Streamed(layer=layer_index, params=params)
            self._streamed[layer_index] = streamed
            for p in params:
                p.register_post_accumulate_grad_hook(lambda _p, st=streamed: self._grad_accumulated(st))
        return PlannedLayer(self, layer_index, module,
                            self.plan.decision(self.stage, layer_index).technique)

    def prefetch(self, layer_index: int) -> int:
        """Bring back the saved tensors of the oldest forward of `layer_index` not yet
        prefetched: the next backward of that layer in GPipe and 1F1B order. The runtime calls it
        one layer (or more) ahead of the backward; a tensor not prefetched is swapped in when the
        backward needs it. Returns the bytes brought back (swap-ins started, and tensors whose
        swap-out had not finished, kept on the device)."""
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
                                 resident_bytes=self._meter.resident, peak_bytes=self._meter.peak,
                                 model_bytes=self._stats.model_bytes, weight_bytes=self._stats.weight_bytes)

    # Model data (optimizer states) off the device between steps.

    def stash(self, layer: int, t: torch.Tensor, *, counted: bool = False) -> int:
        """Move `t`, model data of `layer`, where the plan's model-data decision puts it (host
        memory or peers); returns its id. `t` stays counted on the device until its copy out has
        finished; `counted`: its bytes are on the meter already (a tensor `take` gave back)."""
        decision = self._model.get(layer)
        if decision is None:
            raise ValueError(f"Executor: stage {self.stage}, layer {layer}: the plan keeps its model data")
        t = t.detach()
        nbytes = t.numel() * t.element_size()
        record = SavedRecord(id=next(self._ids), layer=layer, technique=decision.technique, shape=t.shape,
                             stride=dense_stride(t), dtype=t.dtype, nbytes=nbytes,
                             stripes=self._model_stripes.get(layer))
        with self._lock:
            if not counted:
                self._reserve(nbytes, layer, "holding optimizer states")
            self._swap_out_counted(record, t)
            self._stats.model_bytes += nbytes
            self.table[record.id] = record
        return record.id

    def fetch(self, record_id: int) -> None:
        """Start bringing stashed model data back to the device (counted from now on)."""
        with self._lock:
            self._swap_in(self.table[record_id])

    def take(self, record_id: int) -> torch.Tensor:
        """Stashed model data as a tensor on the device, once its copies have landed (fetched
        here if `fetch` was not called). The record and its swap space are freed; the bytes stay
        counted until the tensor is stashed again (`counted=True`)."""
        with self._lock:
            record = self.table[record_id]
            self._swap_in(record)
            if record.state == State.SWAPPING_IN:
                for handle in record.copies:
                    handle.wait()
                record.state = State.RESIDENT
            tensor = record.tensor
            del self.table[record_id]
            record.tensor = None
            self._free_space(record)
            return tensor

    def host_view(self, record_id: int) -> torch.Tensor:
        """Model data stashed in host memory, as a tensor over its host buffer (waits for its
        copy out): the optimizer's step on the host updates it in place, where it stays."""
        with self._lock:
            record = self.table[record_id]
            if record.technique != "host" or record.host is None or record.state not in (State.SWAPPING_OUT,
                                                                                          State.OUT):
                raise ValueError(f"Executor: stage {self.stage}, layer {record.layer}: record {record_id} is not "
                                 f"in host memory")
            for handle in record.copies:
                handle.synchronize()
            if record.state == State.SWAPPING_OUT:  # the host buffer is now the only copy
                self._retire(record)
            flat = record.host.payload[:record.nbytes].view(record.dtype)
            return flat.as_strided(record.shape, record.stride)

    def peek(self, record_id: int) -> torch.Tensor:
        """A copy on the host (CPU) of stashed model data, read where it is stashed, without
        bringing it back (waits for its copy out)."""
        with self._lock:
            record = self.table[record_id]
            if record.state not in (State.SWAPPING_OUT, State.OUT):
                raise ValueError(f"Executor: stage {self.stage}: record {record_id} was fetched back; take it")
            for handle in record.copies:
                handle.synchronize()
            if record.technique == "host":
                raw = record.host.payload[:record.nbytes].cpu().clone()
            else:
                raw = torch.cat([self.peers.view(c.peer, c.offset, c.nbytes).cpu() for c in record.chunks])
            out = torch.empty_strided(record.shape, record.stride, dtype=record.dtype)
            byte_view(out).copy_(raw)
            return out

    # Streamed weights (see the module docstring).

    def host_weight(self, layer: int, index: int) -> torch.Tensor:
        """The host copy of parameter `index` of streamed `layer` (what its step on the host
        updates in place); the layer must have run a forward."""
        with self._lock:
            st = self._streamed[layer]
            if not st.master:
                raise ValueError(f"Executor: stage {self.stage}, layer {layer}: its weights are not in host memory yet")
            return self._host_tensor(st.master[index], st.params[index])

    def host_grad(self, layer: int, index: int) -> torch.Tensor | None:
        """This step's gradient of parameter `index` of streamed `layer`, summed in host memory
        (None: no backward gave it one). Call `finish_backward` first."""
        with self._lock:
            st = self._streamed[layer]
            if not st.added or not st.added[index]:
                return None
            return self._host_tensor(st.grads[index], st.params[index])

    def clear_grads(self, layer: int) -> None:
        """The step consumed streamed `layer`'s gradients: the next backward starts new sums."""
        with self._lock:
            st = self._streamed[layer]
            st.added = [False] * len(st.params)

    def streamed_layers(self) -> list[int]:
        """Layers whose weights this executor streams from host memory."""
        return sorted(self._streamed)

    def streamed_params(self, layer: int) -> list[nn.Parameter]:
        """Streamed `layer`'s parameters, in the order `host_weight` and `host_grad` index them."""
        return list(self._streamed[layer].params)

    def has_host_weights(self, layer: int) -> bool:
        """Whether streamed `layer`'s weights have a copy in host memory (after its first forward)."""
        with self._lock:
            return bool(self._streamed[layer].master)

    def finish_backward(self) -> None:
        """Finish every streamed layer still in a backward and wait for every gradient to be
        summed in host memory (a host synchronisation)."""
        with self._lock:
            for st in list(self._in_backward):
                self._backward_done(st)
            self._land_grads(block=True)

    def restore_weights(self) -> None:
        """Put every streamed layer's weights back on the device, where they stay (the model
        whole again, e.g. when training ends); a later forward streams them again."""
        with self._lock:
            self.finish_backward()
            for st in self._streamed.values():
                if st.where == "device":
                    continue
                charged = st.where != "out"  # a fetch in flight or weights in use count on the meter
                if not charged:  # the weights leave the budget's reckoning: they are static again
                    self._weights_fetch(st, charge=False)
                self._weights_ready(st)
                if charged:
                    self._meter.sub(sum(st.nbytes))
                st.where = "device"

    def synchronize(self) -> None:
        """Wait until every copy in flight has finished: swap-outs have left the device, swap-ins
        have landed, and the space of freed tensors is back in its pool (a host synchronisation)."""
        with self._lock:
            self._drain()
            self._settle()
            for record in self.table.values():
                if record.state == State.SWAPPING_IN:
                    for handle in record.copies:
                        handle.synchronize()
            self._land_grads(block=True)
            for st in self._streamed.values():
                for handle in st.copies:
                    handle.synchronize()

    @property
    def peak_bytes(self) -> int:
        """The most bytes of saved activations resident at once so far."""
        return self._meter.peak

    def close(self) -> None:
        """Finish copies in flight, give back the space every record still holds (stashed model
        data included) and close the stream and pool this executor made."""
        try:
            self.restore_weights()
        except Exception:  # a failed run's close must not hide its error; the weights are lost
            logger.exception("stage %d: streamed weights could not be put back on the device", self.stage)
        self.synchronize()
        with self._lock:
            for record in self.table.values():
                self._free_space(record)
            self.table.clear()
            for st in self._streamed.values():
                for buf in (*st.master, *st.grads):
                    if buf is not None:
                        buf.release()
                st.master, st.grads, st.added = [], [], []
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
        model_data = ModelDataTensors(module)
        swap = technique if technique in ("host", "d2d") else None
        group: list[int] = []
        if swap:
            with self._lock:
                groups = self._groups.setdefault(layer_index, deque())
                while groups and not groups[0]:
                    groups.popleft()
                groups.append(group)

        def pack(t: torch.Tensor):
            if model_data.kind(t) is not None:  # parameters and autocast's weight copies: held anyway
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
                    self._swap_out_counted(record, t)
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
                if record.state == State.SWAPPING_IN:
                    for handle in record.copies:  # compute reads the tensor after its copies only
                        handle.wait()
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
        else:
            record.chunks = self._alloc_chunks(record)
        after = self._stream.record_compute()  # the copy reads what queued compute writes
        if record.technique == "host":
            record.copies = [self._stream.copy(src, record.host.payload, after=after)]
            self._stats.host_bytes += record.nbytes
        else:
            start = 0
            for c in record.chunks:
                view = self.peers.view(c.peer, c.offset, c.nbytes)
                record.copies.append(self._stream.copy(src[start:start + c.nbytes], view, after=after))
                start += c.nbytes
            self._stats.peer_bytes += record.nbytes
        record.tensor = t  # kept until the swap-out finishes: asked back before that, it is used as is
        record.state = State.SWAPPING_OUT
        self._pending_out.append(record.id)

    def _swap_out_counted(self, record: SavedRecord, t: torch.Tensor) -> None:
        """`_swap_out` of a tensor whose bytes are on the meter; on failure they come off it and
        whatever space was taken is given back."""
        try:
            self._swap_out(record, t)
        except BaseException:
            self._meter.sub(record.nbytes)
            self._free_space(record)
            raise

    def _acquire_host(self, record: SavedRecord) -> HostBuffer:
        return self._host_buffer(record.nbytes, record.layer)

    def _host_buffer(self, nbytes: int, layer: int) -> HostBuffer:
        buf = self._try_acquire(nbytes, layer)
        if buf is None and (self._unfreed or self._grads_out):
            self._settle()  # buffers of freed tensors whose copies still run: wait for them
            self._land_grads(block=True)  # and staged gradients
            buf = self._try_acquire(nbytes, layer)
        if buf is None:
            raise SwapSpaceError(
                f"stage {self.stage}, layer {layer}: no host buffer for {nbytes} bytes in a "
                f"pool of {self._host_pool.capacity_bytes} bytes ({self._host_pool.in_use_bytes} in use): "
                f"the profile the pool was sized from underestimated the plan's host swaps")
        return buf

    def _try_acquire(self, nbytes: int, layer: int) -> HostBuffer | None:
        try:
            return self._host_pool.acquire(nbytes, timeout=0)
        except PoolExhaustedError:
            return None
        except OversizeRequestError as exc:
            raise SwapSpaceError(f"stage {self.stage}, layer {layer}: {exc}") from exc

    def _alloc_chunks(self, record: SavedRecord) -> list[Chunk]:
        chunks = self._try_alloc_chunks(record)
        if isinstance(chunks, str) and self._unfreed:
            self._settle()  # stripes of freed tensors whose copies still run: wait for them
            chunks = self._try_alloc_chunks(record)
        if isinstance(chunks, str):
            raise SwapSpaceError(f"stage {self.stage}, layer {record.layer}: {chunks}")
        return chunks

    def _try_alloc_chunks(self, record: SavedRecord) -> list[Chunk] | str:
        """The record's stripes, or why the first that did not fit failed (nothing held then).
        A message, not the exception: a caller's frame holding an exception raised below it is a
        reference cycle that would keep a failed forward's graph alive until garbage collection."""
        stripes = record.stripes if record.stripes is not None else self._stripes[record.layer]
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

    def _swap_in(self, record: SavedRecord) -> None:
        if record.state == State.SWAPPING_OUT:
            # Still on the device: keep it, and free its swap space once the copy out is done.
            self._free_space(record)
            record.state = State.RESIDENT
            return
        if record.state != State.OUT:
            return
        _raise_if_failed(record.copies)  # the swap-out's: its bytes are what comes back
        self._reserve(record.nbytes, record.layer, "swapping a saved tensor back in")
        out = torch.empty_strided(record.shape, record.stride, dtype=record.dtype, device=self.device)
        dst = byte_view(out)
        # `out` may reuse memory freed while queued compute still reads it
        after = self._stream.record_compute()
        if record.technique == "host":
            record.copies = [self._stream.copy(record.host.payload, dst, after=after)]
        else:
            record.copies, start = [], 0
            for c in record.chunks:
                view = self.peers.view(c.peer, c.offset, c.nbytes)
                record.copies.append(self._stream.copy(view, dst[start:start + c.nbytes], after=after))
                start += c.nbytes
        record.state = State.SWAPPING_IN
        record.tensor = out

    # Bookkeeping; callers hold self._lock.

    def _free_space(self, record: SavedRecord) -> None:
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

    def _reserve(self, nbytes: int, layer: int, what: str) -> None:
        self._reap()
        if not self._meter.fits(nbytes):
            self._drain()
        self._meter.add(nbytes, layer, what)

    def _reap(self) -> None:
        """Without blocking: retire the swap-outs that have finished, oldest first, give
        back the space whose copies have finished and add up the gradients that have landed."""
        if self._grads_out:
            self._land_grads(block=False)
        while self._pending_out:
            record = self.table.get(self._pending_out[0])
            if record is not None and record.state == State.SWAPPING_OUT:
                if not all(h.done() for h in record.copies):
                    break
                self._retire(record)
            self._pending_out.popleft()
        if self._unfreed:
            waiting = []
            for space in self._unfreed:
                if space.ready():
                    self._give_back(space)
                else:
                    waiting.append(space)
            self._unfreed = waiting

    def _retire(self, record: SavedRecord) -> None:
        """A swap-out has finished: its bytes leave the device. Its handles stay with the record,
        to raise a failed copy's error at the swap-in."""
        record.state = State.OUT
        record.tensor = None
        self._meter.sub(record.nbytes)

    def _drain(self) -> None:
        """Wait for every swap-out and gradient copy in flight (a host synchronisation)."""
        for rid in self._pending_out:
            record = self.table.get(rid)
            if record is not None and record.state == State.SWAPPING_OUT:
                for handle in record.copies:
                    handle.synchronize()  # raises a failed copy's error
        self._land_grads(block=True)
        self._reap()

    def _settle(self) -> None:
        """Wait for the copies of freed tensors and give their space back (a host synchronisation)."""
        for space in self._unfreed:
            for handle in space.copies:
                try:
                    handle.synchronize()
                except Exception:  # the tensor is gone; its space is free all the same
                    logger.exception("stage %d: a copy of a freed tensor failed", self.stage)
            self._give_back(space)
        self._unfreed = []

    def _release(self, record_id: int) -> None:
        """Autograd freed a saved tensor: free its record, buffer and stripes."""
        with self._lock:
            record = self.table.pop(record_id, None)
            if record is None:
                return
            if record.state != State.OUT:
                self._meter.sub(record.nbytes)
            record.tensor = None
            self._free_space(record)
            if record.group is not None and record_id in record.group:
                record.group.remove(record_id)


    # Streamed weights; callers hold self._lock (hooks take it).

    def _host_tensor(self, buf: HostBuffer, p: torch.Tensor) -> torch.Tensor:
        return buf.payload[:p.numel() * p.element_size()].view(p.dtype).view(p.shape)

    def _next_streamed(self, layer: int, step: int) -> _Streamed | None:
        order = sorted(self._streamed) if step > 0 else sorted(self._streamed, reverse=True)
        later = [i for i in order if (i - layer) * step > 0]
        return self._streamed[later[0]] if later else None

    def _offload(self, st: _Streamed) -> None:
        """The first time a streamed layer's use ends: its weights to host memory, its device
        storage freed."""
        for i, p in enumerate(st.params):
            n = st.nbytes[i]
            if (p.device != self.device or not p.is_contiguous() or p.storage_offset()
                    or p.untyped_storage().nbytes() != n):
                raise ValueError(f"Executor: stage {self.stage}, layer {st.layer}: parameter {i} "
                                 f"({tuple(p.shape)} on {p.device}) does not own its storage on {self.device}; "
                                 f"streaming weights needs parameters that do")
        if not st.master:
            st.master = [self._host_buffer(n, st.layer) for n in st.nbytes]
            st.grads = [self._host_buffer(n, st.layer) for n in st.nbytes]
            st.added = [False] * len(st.params)
        after = self._stream.record_compute()
        copies = [self._stream.copy(byte_view(p.data), m.payload[:n], after=after)
                  for p, m, n in zip(st.params, st.master, st.nbytes)]
        for h in copies:
            h.synchronize()  # once per layer: its storage goes only after the copy has read it
        for p in st.params:
            p.data.untyped_storage().resize_(0)
        st.where = "out"

    def _weights_fetch(self, st: _Streamed, *, charge: bool = True) -> None:
        if st.where != "out":
            return
        if charge:
            self._reserve(sum(st.nbytes), st.layer, "bringing streamed weights in")
        after = self._stream.record_compute()  # the storage may be memory queued compute still reads
        st.copies = []
        for p, m, n in zip(st.params, st.master, st.nbytes):
            p.data.untyped_storage().resize_(n)
            st.copies.append(self._stream.copy(m.payload[:n], byte_view(p.data), after=after))
            self._stats.weight_bytes += n
        st.where = "fetching"

    def _weights_ready(self, st: _Streamed) -> None:
        self._weights_fetch(st)
        if st.where == "fetching":
            for h in st.copies:
                h.wait()  # compute reads the weights after their copies only
            st.copies = []
            st.where = "in"

    def _weights_release(self, st: _Streamed) -> None:
        if st.where == "device":
            self._offload(st)
            return
        if st.where == "out":
            return
        for h in st.copies:  # fetched and never used: its copy still writes the storage
            h.synchronize()
        st.copies = []
        for p in st.params:
            p.data.untyped_storage().resize_(0)
        self._meter.sub(sum(st.nbytes))
        st.where = "out"

    def _forward_begins(self, layer: int) -> None:
        with self._lock:
            st = self._streamed[layer]
            self._weights_ready(st)
            nxt = self._next_streamed(layer, +1)
            if nxt is not None:
                self._weights_fetch(nxt)

    def _forward_ends(self, layer: int) -> None:
        with self._lock:
            st = self._streamed[layer]
            if st not in self._in_backward:  # a recomputation inside its backward keeps them
                self._weights_release(st)

    def _backward_begins(self, layer: int) -> None:
        """The first gradient reached `layer`'s output: its weights come in (the next streamed
        layer's start coming), and the end of this backward pass is watched."""
        with self._lock:
            task = torch._C._current_graph_task_id()
            if task != self._task:
                self._task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_pass_ends)
            st = self._streamed[layer]
            if st in self._in_backward:
                return
            if st.where == "device":  # never offloaded: a backward right after its first forward
                self._offload(st)
            self._weights_ready(st)
            self._reserve(sum(st.nbytes), layer, "making streamed gradients")
            st.pending = len(st.params)
            self._in_backward.append(st)
            nxt = self._next_streamed(layer, -1)
            if nxt is not None:
                self._weights_fetch(nxt)

    def _grad_accumulated(self, st: _Streamed) -> None:
        with self._lock:
            if st not in self._in_backward:
                return
            st.pending -= 1
            if st.pending == 0:  # every weight's gradient is in: no node of the layer reads them again
                self._backward_done(st)

    def _backward_pass_ends(self) -> None:
        with self._lock:
            self._task = None
            for st in list(self._in_backward):
                self._backward_done(st)

    def _backward_done(self, st: _Streamed) -> None:
        """`st`'s backward is over: its gradients start for host memory, its weights go."""
        unused = 0
        after = self._stream.record_compute()
        for i, p in enumerate(st.params):
            g, n = p.grad, st.nbytes[i]
            if g is None:
                unused += n
                continue
            p.grad = None
            if not g.is_contiguous():
                g = g.contiguous()
            staging = self._host_buffer(n, st.layer)
            self._grads_out.append(_GradOut(st, i, g, staging,
                                            self._stream.copy(byte_view(g), staging.payload[:n], after=after)))
            self._stats.weight_bytes += n
        self._meter.sub(unused)
        self._in_backward.remove(st)
        self._weights_release(st)

    def _land_grads(self, block: bool) -> None:
        """Add the gradients whose copies have landed to their sums in host memory, in the order
        they left (the order autograd would have added them in)."""
        while self._grads_out:
            out = self._grads_out[0]
            if not out.copy.done():
                if not block:
                    return
                out.copy.synchronize()
            self._grads_out.popleft()
            _raise_if_failed([out.copy])
            st, i = out.layer, out.index
            p = st.params[i]
            src = self._host_tensor(out.staging, p)
            dst = self._host_tensor(st.grads[i], p)
            if st.added[i]:
                dst.add_(src)
            else:
                dst.copy_(src)
                st.added[i] = True
            out.staging.release()
            self._meter.sub(st.nbytes[i])


def _grad_outputs(out) -> list[torch.Tensor]:
    """The tensors among a layer's outputs (a tensor or a tuple of them) that carry gradients."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


class PlannedLayer(nn.Module):
    """A layer run under its stage's decision (made by `Executor.wrap`)."""

    def __init__(self, executor: Executor, layer_index: int, module: nn.Module, technique: str) -> None:
        super().__init__()
        self.executor = executor
        self.layer_index = layer_index
        self.technique = technique
        self.module = module

    def forward(self, *args):
        ex, layer = self.executor, self.layer_index
        if layer not in ex._streamed:
            return self._run(*args)
        ex._forward_begins(layer)
        try:
            out = self._run(*args)
        finally:
            ex._forward_ends(layer)
        tensors = _grad_outputs(out)
        if tensors:  # the layer's weights come back when the first gradient reaches its outputs
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: ex._backward_begins(layer), mode="any")
        return out

    def _run(self, *args):
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
