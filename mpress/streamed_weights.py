"""Streamed weights: a layer whose model-data decision has `weights="host"` keeps its weights in host
memory between uses, on top of the stage's `SwapCore` (its stream, host buffers, meter and lock).

After the layer's first forward its weights are copied to host memory and the parameters' device
storage freed (resized to nothing, so autograd's references stay valid). Each forward brings them in
(and starts bringing in the next streamed layer's) and frees them after; a backward brings them in
when the first gradient reaches the layer's outputs, and once the layer's backward is over its
gradients are copied out and summed in host memory (a `Lander` of the core's) and the weights freed
again. The executor's module docstring has the whole contract; `Executor` exposes this part's API.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from mpress.swap_core import SwapCore, byte_view, raise_if_failed
from storage.host_buffers import HostBuffer
from storage.streams import CopyHandle


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


class WeightStreamer:
    """The streamed layers of one stage (`layers`: those the plan streams), registered by `register`
    as the executor wraps them."""

    def __init__(self, core: SwapCore, layers: set[int]) -> None:
        self.core = core
        self.layers = layers
        self.streamed: dict[int, _Streamed] = {}  # registered, in stage order
        self._in_backward: list[_Streamed] = []
        self._grads_out: deque[_GradOut] = deque()
        self._task = None  # the backward pass whose end is queued to finish streamed layers
        core.add_lander(self)

    def register(self, layer: int, module: nn.Module) -> None:
        """Stream `module`'s weights as `layer`'s, if the plan says so."""
        if layer not in self.layers:
            return
        params = list({id(p): p for p in module.parameters() if p.requires_grad}.values())
        streamed = _Streamed(layer=layer, params=params)
        self.streamed[layer] = streamed
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _p, st=streamed: self.grad_accumulated(st))

    def busy(self) -> bool:
        return bool(self._grads_out)

    def synchronize(self) -> None:
        """Wait for every gradient copy and weight fetch in flight (a host synchronisation)."""
        self.land(True)
        for st in self.streamed.values():
            for handle in st.copies:
                handle.synchronize()

    def close(self) -> None:
        """Give back every host buffer (the weights must be back on the device: `restore_weights`)."""
        for st in self.streamed.values():
            for buf in (*st.master, *st.grads):
                if buf is not None:
                    buf.release()
            st.master, st.grads, st.added = [], [], []


    def host_weight(self, layer: int, index: int) -> torch.Tensor:
        """The host copy of parameter `index` of streamed `layer` (what its step on the host
        updates in place); the layer must have run a forward."""
        with self.core.lock:
            st = self.streamed[layer]
            if not st.master:
                raise ValueError(f"Executor: stage {self.core.stage}, layer {layer}: its weights are not in host memory yet")
            return self.host_tensor(st.master[index], st.params[index])

    def host_grad(self, layer: int, index: int) -> torch.Tensor | None:
        """This step's gradient of parameter `index` of streamed `layer`, summed in host memory
        (None: no backward gave it one). Call `finish_backward` first."""
        with self.core.lock:
            st = self.streamed[layer]
            if not st.added or not st.added[index]:
                return None
            return self.host_tensor(st.grads[index], st.params[index])

    def clear_grads(self, layer: int) -> None:
        """The step consumed streamed `layer`'s gradients: the next backward starts new sums."""
        with self.core.lock:
            st = self.streamed[layer]
            st.added = [False] * len(st.params)

    def layers_streamed(self) -> list[int]:
        """Layers whose weights are streamed from host memory."""
        return sorted(self.streamed)

    def params(self, layer: int) -> list[nn.Parameter]:
        """Streamed `layer`'s parameters, in the order `host_weight` and `host_grad` index them."""
        return list(self.streamed[layer].params)

    def has_host_weights(self, layer: int) -> bool:
        """Whether streamed `layer`'s weights have a copy in host memory (after its first forward)."""
        with self.core.lock:
            return bool(self.streamed[layer].master)

    def finish_backward(self) -> None:
        """Finish every streamed layer still in a backward and wait for every gradient to be
        summed in host memory (a host synchronisation)."""
        with self.core.lock:
            for st in list(self._in_backward):
                self._backward_done(st)
            self.land(True)

    def restore_weights(self) -> None:
        """Put every streamed layer's weights back on the device, where they stay (the model
        whole again, e.g. when training ends); a later forward streams them again."""
        with self.core.lock:
            self.finish_backward()
            for st in self.streamed.values():
                if st.where == "device":
                    continue
                charged = st.where != "out"  # a fetch in flight or weights in use count on the meter
                if not charged:  # the weights leave the budget's reckoning: they are static again
                    self._weights_fetch(st, charge=False)
                self._weights_ready(st)
                if charged:
                    self.core.meter.sub(sum(st.nbytes))
                st.where = "device"

    # Callers hold the core's lock (the hooks above take it).

    def host_tensor(self, buf: HostBuffer, p: torch.Tensor) -> torch.Tensor:
        return buf.payload[:p.numel() * p.element_size()].view(p.dtype).view(p.shape)

    def _next_streamed(self, layer: int, step: int) -> _Streamed | None:
        order = sorted(self.streamed) if step > 0 else sorted(self.streamed, reverse=True)
        later = [i for i in order if (i - layer) * step > 0]
        return self.streamed[later[0]] if later else None

    def _offload(self, st: _Streamed) -> None:
        """The first time a streamed layer's use ends: its weights to host memory, its device
        storage freed."""
        for i, p in enumerate(st.params):
            n = st.nbytes[i]
            if (p.device != self.core.device or not p.is_contiguous() or p.storage_offset()
                    or p.untyped_storage().nbytes() != n):
                raise ValueError(f"Executor: stage {self.core.stage}, layer {st.layer}: parameter {i} "
                                 f"({tuple(p.shape)} on {p.device}) does not own its storage on {self.core.device}; "
                                 f"streaming weights needs parameters that do")
        if not st.master:
            st.master = [self.core.host_buffer(n, st.layer) for n in st.nbytes]
            st.grads = [self.core.host_buffer(n, st.layer) for n in st.nbytes]
            st.added = [False] * len(st.params)
        after = self.core.stream.record_compute()
        copies = [self.core.stream.copy(byte_view(p.data), m.payload[:n], after=after)
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
            self.core.reserve(sum(st.nbytes), st.layer, "bringing streamed weights in")
        after = self.core.stream.record_compute()  # the storage may be memory queued compute still reads
        st.copies = []
        for p, m, n in zip(st.params, st.master, st.nbytes):
            p.data.untyped_storage().resize_(n)
            st.copies.append(self.core.stream.copy(m.payload[:n], byte_view(p.data), after=after))
            self.core.stats.weight_bytes += n
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
        self.core.meter.sub(sum(st.nbytes))
        st.where = "out"

    def forward_begins(self, layer: int) -> None:
        with self.core.lock:
            st = self.streamed[layer]
            self._weights_ready(st)
            nxt = self._next_streamed(layer, +1)
            if nxt is not None:
                self._weights_fetch(nxt)

    def forward_ends(self, layer: int) -> None:
        with self.core.lock:
            st = self.streamed[layer]
            if st not in self._in_backward:  # a recomputation inside its backward keeps them
                self._weights_release(st)

    def backward_begins(self, layer: int) -> None:
        """The first gradient reached `layer`'s output: its weights come in (the next streamed
        layer's start coming), and the end of this backward pass is watched."""
        with self.core.lock:
            task = torch._C._current_graph_task_id()
            if task != self._task:
                self._task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_pass_ends)
            st = self.streamed[layer]
            if st in self._in_backward:
                return
            if st.where == "device":  # never offloaded: a backward right after its first forward
                self._offload(st)
            self._weights_ready(st)
            self.core.reserve(sum(st.nbytes), layer, "making streamed gradients")
            st.pending = len(st.params)
            self._in_backward.append(st)
            nxt = self._next_streamed(layer, -1)
            if nxt is not None:
                self._weights_fetch(nxt)

    def grad_accumulated(self, st: _Streamed) -> None:
        with self.core.lock:
            if st not in self._in_backward:
                return
            st.pending -= 1
            if st.pending == 0:  # every weight's gradient is in: no node of the layer reads them again
                self._backward_done(st)

    def _backward_pass_ends(self) -> None:
        with self.core.lock:
            self._task = None
            for st in list(self._in_backward):
                self._backward_done(st)

    def _backward_done(self, st: _Streamed) -> None:
        """`st`'s backward is over: its gradients start for host memory, its weights go."""
        unused = 0
        after = self.core.stream.record_compute()
        for i, p in enumerate(st.params):
            g, n = p.grad, st.nbytes[i]
            if g is None:
                unused += n
                continue
            p.grad = None
            if not g.is_contiguous():
                g = g.contiguous()
            staging = self.core.host_buffer(n, st.layer)
            self._grads_out.append(_GradOut(st, i, g, staging,
                                            self.core.stream.copy(byte_view(g), staging.payload[:n], after=after)))
            self.core.stats.weight_bytes += n
        self.core.meter.sub(unused)
        self._in_backward.remove(st)
        self._weights_release(st)

    def land(self, block: bool) -> None:
        """Add the gradients whose copies have landed to their sums in host memory, in the order
        they left (the order autograd would have added them in)."""
        while self._grads_out:
            out = self._grads_out[0]
            if not out.copy.done():
                if not block:
                    return
                out.copy.synchronize()
            self._grads_out.popleft()
            raise_if_failed([out.copy])
            st, i = out.layer, out.index
            p = st.params[i]
            src = self.host_tensor(out.staging, p)
            dst = self.host_tensor(st.grads[i], p)
            if st.added[i]:
                dst.add_(src)
            else:
                dst.copy_(src)
                st.added[i] = True
            out.staging.release()
            self.core.meter.sub(st.nbytes[i])
