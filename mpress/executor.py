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

The executor is a composition: the pure sizing of swap space (`mpress.space`), the records and
their moves (`mpress.swap_core.SwapCore`), the streamed weights on top of them
(`mpress.streamed_weights.WeightStreamer`) and the wrapped layer (`mpress.planned_layer`), which
takes calls rather than the executor. The names callers import from here stay importable here.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from typing import Self

import torch
from torch import nn

from mpress.model_tensors import ModelDataTensors
from mpress.peer_memory import PeerMemory
from mpress.planned_layer import LayerCalls, PlannedLayer
from mpress.profile import Plan
from mpress.space import HOST_ALIGNMENT, MIN_SWAP_BYTES, stage_on_device
from mpress.streamed_weights import WeightStreamer
from mpress.swap_core import ExecutorStats, SavedRecord, State, SwapCore, byte_view, dense_stride
from storage.host_buffers import HostBufferPool, HostBufferPoolConfig
from storage.streams import CopyStream, make_copy_stream, normalize_device

logger = logging.getLogger(__name__)


class _Ticket:
    """What autograd holds for a saved activation; its death frees the record."""

    __slots__ = ("__weakref__", "id")

    def __init__(self, record_id: int) -> None:
        self.id = record_id


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
        stripes = {d.layer: self._stripe_peers(d) for d in plan.decisions
                   if d.stage == stage and d.technique == "d2d"}
        self._model = {d.layer: d for d in plan.model_data if d.stage == stage and d.technique != "keep"}
        self._model_stripes = {layer: self._stripe_peers(d) for layer, d in self._model.items()
                               if d.technique == "d2d"}
        host_layers = sorted({d.layer for d in plan.decisions if d.stage == stage and d.technique == "host"} |
                             {layer for layer, d in self._model.items() if d.technique == "host"})
        if host_layers and host_pool is None and host_pool_bytes is None:
            raise ValueError(f"Executor: stage {stage} swaps layers {host_layers} to host memory: pass "
                             f"host_pool_bytes (see host_pool_bytes_for) or host_pool")
        self._groups: dict[int, deque[list[int]]] = {}  # layer -> ids per forward, oldest first
        self._owned: list = []
        stream = self._own(make_copy_stream(self.device)) if copy_stream is None else copy_stream
        if host_layers and host_pool is None:
            # One buffer per slab: capacity is then exactly the buffers' aligned bytes, and a slab
            # of one size class never strands room another size class needs.
            config = HostBufferPoolConfig(capacity_bytes=max(host_pool_bytes, HOST_ALIGNMENT),
                                          pin=self.device.type == "cuda", alignment=HOST_ALIGNMENT,
                                          slab_bytes=HOST_ALIGNMENT)
            host_pool = self._own(HostBufferPool(config))
        self._core = SwapCore(stage, self.device, stream=stream, peers=peers, host_pool=host_pool,
                              budget_bytes=budget_bytes, stripes=stripes)
        self.table = self._core.table  # live records by id; read-only outside
        self._lock = self._core.lock
        self._weights = WeightStreamer(self._core, {layer for layer, d in self._model.items() if d.weights == "host"})

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
        technique = self.plan.decision(self.stage, layer_index).technique
        self._weights.register(layer_index, module)
        calls = LayerCalls(hooks=lambda: self.hooks(layer_index, module, technique), recomputed=self._count_recompute)
        if layer_index in self._weights.streamed:
            w = self._weights
            calls = LayerCalls(hooks=calls.hooks, recomputed=calls.recomputed,
                               forward_begins=lambda: w.forward_begins(layer_index),
                               forward_ends=lambda: w.forward_ends(layer_index),
                               backward_begins=lambda: w.backward_begins(layer_index))
        return PlannedLayer(layer_index, module, technique, calls)

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
                    self._core.swap_in(record)
                    started += record.nbytes
            return started

    def stats(self) -> ExecutorStats:
        """Bytes swapped to host and peers, recomputed layers, resident and peak bytes."""
        with self._lock:
            self._core.reap()
            return ExecutorStats(host_bytes=self._core.stats.host_bytes, peer_bytes=self._core.stats.peer_bytes,
                                 recomputed=self._core.stats.recomputed,
                                 resident_bytes=self._core.meter.resident, peak_bytes=self._core.meter.peak,
                                 model_bytes=self._core.stats.model_bytes, weight_bytes=self._core.stats.weight_bytes)

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
        record = SavedRecord(id=self._core.new_id(), layer=layer, technique=decision.technique, shape=t.shape,
                             stride=dense_stride(t), dtype=t.dtype, nbytes=nbytes,
                             stripes=self._model_stripes.get(layer))
        with self._lock:
            if not counted:
                self._core.reserve(nbytes, layer, "holding optimizer states")
            self._core.swap_out_counted(record, t)
            self._core.stats.model_bytes += nbytes
            self.table[record.id] = record
        return record.id

    def fetch(self, record_id: int) -> None:
        """Start bringing stashed model data back to the device (counted from now on)."""
        with self._lock:
            self._core.swap_in(self.table[record_id])

    def take(self, record_id: int) -> torch.Tensor:
        """Stashed model data as a tensor on the device, once its copies have landed (fetched
        here if `fetch` was not called). The record and its swap space are freed; the bytes stay
        counted until the tensor is stashed again (`counted=True`)."""
        with self._lock:
            record = self.table[record_id]
            self._core.swap_in(record)
            self._core.wait_in(record)
            tensor = record.tensor
            del self.table[record_id]
            record.tensor = None
            self._core.free_space(record)
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
                self._core.retire(record)
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

    # Streamed weights (`mpress.streamed_weights`).

    def host_weight(self, layer: int, index: int) -> torch.Tensor:
        """The host copy of parameter `index` of streamed `layer` (what its step on the host
        updates in place); the layer must have run a forward."""
        return self._weights.host_weight(layer, index)

    def host_grad(self, layer: int, index: int) -> torch.Tensor | None:
        """This step's gradient of parameter `index` of streamed `layer`, summed in host memory
        (None: no backward gave it one). Call `finish_backward` first."""
        return self._weights.host_grad(layer, index)

    def clear_grads(self, layer: int) -> None:
        """The step consumed streamed `layer`'s gradients: the next backward starts new sums."""
        self._weights.clear_grads(layer)

    def streamed_layers(self) -> list[int]:
        """Layers whose weights this executor streams from host memory."""
        return self._weights.layers_streamed()

    def streamed_params(self, layer: int) -> list[nn.Parameter]:
        """Streamed `layer`'s parameters, in the order `host_weight` and `host_grad` index them."""
        return self._weights.params(layer)

    def has_host_weights(self, layer: int) -> bool:
        """Whether streamed `layer`'s weights have a copy in host memory (after its first forward)."""
        return self._weights.has_host_weights(layer)

    def finish_backward(self) -> None:
        """Finish every streamed layer still in a backward and wait for every gradient to be
        summed in host memory (a host synchronisation)."""
        self._weights.finish_backward()

    def restore_weights(self) -> None:
        """Put every streamed layer's weights back on the device, where they stay (the model
        whole again, e.g. when training ends); a later forward streams them again."""
        self._weights.restore_weights()

    def synchronize(self) -> None:
        """Wait until every copy in flight has finished: swap-outs have left the device, swap-ins
        have landed, and the space of freed tensors is back in its pool (a host synchronisation)."""
        with self._lock:
            self._core.drain()
            self._core.settle()
            for record in self.table.values():
                if record.state == State.SWAPPING_IN:
                    for handle in record.copies:
                        handle.synchronize()
            self._weights.synchronize()

    @property
    def peak_bytes(self) -> int:
        """The most bytes of saved activations resident at once so far."""
        return self._core.meter.peak

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
                self._core.free_space(record)
            self.table.clear()
            self._weights.close()
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
            record = SavedRecord(id=self._core.new_id(), layer=layer_index, technique=how,
                                 shape=t.shape, stride=dense_stride(t), dtype=t.dtype, nbytes=nbytes)
            with self._lock:
                if how == "keep":
                    self._core.reserve(nbytes, layer_index, "keeping a saved tensor")
                    record.tensor = t
                else:
                    self._core.reserve(nbytes, layer_index, f"saving a tensor to swap it to {how}")
                    self._core.swap_out_counted(record, t)
                    record.group = group
                    group.append(record.id)
                self.table[record.id] = record
            ticket = _Ticket(record.id)
            weakref.finalize(ticket, self._core.release, record.id).atexit = False
            return ticket

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def _unpack(self, ticket):
        if not isinstance(ticket, _Ticket):
            return ticket  # a parameter
        with self._lock:
            record = self.table[ticket.id]
            if record.technique != "keep":
                self._core.swap_in(record)
                self._core.wait_in(record)
            return record.tensor

    def _count_recompute(self) -> None:
        with self._lock:
            self._core.stats.recomputed += 1
