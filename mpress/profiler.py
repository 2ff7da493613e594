"""Measures the layers of one stage: what each saves for backward, and how long its forward and
backward take. The result is the `LayerProfile` list the planner and the simulator read.

Saved tensors are found with `torch.autograd.graph.saved_tensors_hooks`: the pack hook sees every
tensor autograd saves. Parameters (and views of them, such as the `weight.t()` a Linear saves)
are held all step anyway, so they are recognised by their storage and left out. A tensor's
producer is the autograd node that made it (its `grad_fn`), or "input" for a leaf. Its consumer
is the backward node that saved it: after the forward, the layer's autograd graph is walked and
each node's `_saved_*` attributes (or `saved_tensors`, for custom Functions) are read, which runs
the unpack hook on the very object the pack hook returned (a tensor no node is found for gets
the layer's name as its consumer).

Every time is the fastest of a few runs after a warm-up: other work on the machine only ever adds
time, and the planner models the machine doing nothing else.

Backward time per layer comes from tensor hooks on the boundaries between layers: the hook on a
layer's output fires when its backward can start, the hook on its input when the next layer down
can start. The first layer's backward ends when `backward()` returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from mpress.executor import Executor
from mpress.space import host_pool_bytes_for
from mpress.model_tensors import ModelDataTensors
from mpress.profile import Decision, LayerProfile, PipelineProfile, Plan, SavedTensor, StageProfile


def producer_of(tensor: torch.Tensor) -> str:
    """The autograd node that made `tensor`, or "input" for a leaf."""
    return tensor.grad_fn.name() if tensor.grad_fn is not None else "input"


def stage_peak_bytes(layers: list[LayerProfile], *, in_flight: int = 1) -> int:
    """Parameters, gradients and optimizer states of the stage, plus every layer's saved tensors
    for `in_flight` micro-batches (a 1F1B stage s of S holds S - s; GPipe holds all)."""
    if in_flight < 0:
        raise ValueError(f"stage_peak_bytes: in_flight={in_flight} must be >= 0")
    return sum(layer.param_bytes + in_flight * layer.saved_bytes for layer in layers)


@dataclass
class _Saved:
    """A saved tensor seen by the pack hook, until its consumer is known."""

    tensor: torch.Tensor
    producer: str
    consumer: str = ""
    attr: str = ""


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _tensor_bytes(values: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))


def _sync(tensors: tuple) -> None:
    """Wait for the compute stream of the tensors' GPUs (not the copy streams: a copy in flight is
    not the layer's time; the simulator models copies on their own lanes)."""
    for device in {t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


@dataclass
class _Probe:
    """The graph node (and attribute) being read while consumers are looked up."""

    node: object = None
    attr: str = ""


def _find_consumers(outputs: tuple, inputs: tuple, probe: _Probe) -> None:
    """Walk the layer's graph from its outputs down to its inputs, reading every saved tensor so
    that the unpack hook can name the node that saved it."""
    # nodes are told apart by id, and an id is unique among live objects only: every node compared
    # is held until the walk ends (a dropped one's id, reused, hid another node's saved tensors)
    stops = [t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    stop = {id(n) for n in stops}
    todo = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: dict[int, object] = {}
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        attrs = [a for a in dir(node) if a.startswith("_saved_")]
        if hasattr(type(node), "saved_tensors"):  # a custom autograd.Function
            attrs.append("saved_tensors")
        for attr in attrs:
            probe.node, probe.attr = node, attr.removeprefix("_saved_")
            try:
                getattr(node, attr)
            except RuntimeError:  # freed already, or not readable outside backward
                pass
        todo.extend(fn for fn, _ in node.next_functions)
    probe.node = None


def _record_saved(name: str, module: nn.Module, inputs: tuple) -> tuple[tuple, list[SavedTensor], int]:
    """Run `module` once, returning its outputs, the activations it saved and the bytes of the
    weight casts it saved (`is_weight_cast`)."""
    model_data = ModelDataTensors(module)
    seen: list[_Saved] = []
    casts: dict[int, int] = {}  # storage address -> bytes
    probe = _Probe()

    def pack(t: torch.Tensor):
        kind = model_data.kind(t)
        if kind == "cast":
            casts[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        if kind is not None:
            return t
        seen.append(_Saved(t.detach(), producer_of(t)))  # no history: no cycle through grad_fn
        return seen[-1]

    def unpack(x):
        if not isinstance(x, _Saved):
            return x
        if probe.node is not None and not x.consumer:
            x.consumer, x.attr = probe.node.name(), probe.attr
        return x.tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        outputs = _as_tuple(module(*inputs))
    _find_consumers(outputs, inputs, probe)
    saved = [SavedTensor(name=f"saved{k}" + (f".{s.attr}" if s.attr else ""),
                         bytes=s.tensor.numel() * s.tensor.element_size(), producer=s.producer,
                         consumer=s.consumer or name)
             for k, s in enumerate(seen)]
    return outputs, saved, sum(casts.values())


def _timed_step(layers: list[tuple[str, nn.Module]], x: torch.Tensor,
                before_backward=None) -> tuple[list[float], list[float]]:
    """One forward and backward through all layers: per-layer forward and backward seconds.
    `before_backward()` runs as the backward starts (where a runtime starts its swap-ins)."""
    n = len(layers)
    forward_s = []
    boundary_t = [0.0] * (n + 1)  # boundary i: the input of layer i (n: the last output)
    inputs: tuple = (x,)
    for i, (_, module) in enumerate(layers):
        _sync(inputs)
        start = time.perf_counter()
        outputs = _as_tuple(module(*inputs))
        _sync(outputs)
        forward_s.append(time.perf_counter() - start)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                def stamp(grad, i=i + 1):
                    _sync((grad,))
                    boundary_t[i] = max(boundary_t[i], time.perf_counter())
                t.register_hook(stamp)
        inputs = outputs
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise ValueError("profile_layers: the last layer's output does not require grad")
    _sync(inputs)
    boundary_t[n] = time.perf_counter()
    if before_backward is not None:
        before_backward()
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
    _sync(inputs)
    boundary_t[0] = time.perf_counter()
    # A layer whose output needed no grad has no backward: its boundary inherits the time above.
    for i in range(n - 1, 0, -1):
        boundary_t[i] = boundary_t[i] or boundary_t[i + 1]
    backward_s = [max(boundary_t[i] - boundary_t[i + 1], 0.0) for i in range(1, n)]
    backward_s.insert(0, max(boundary_t[0] - boundary_t[1], 0.0))
    return forward_s, backward_s


def best_seconds(run, tensors: list[torch.Tensor], *, repeats: int = 2) -> float:
    """Fewest seconds of `run()` over `repeats` calls after one warm-up, the device of `tensors`
    synchronised around each call."""
    times = []
    for _ in range(1 + repeats):
        _sync(tensors)
        t0 = time.perf_counter()
        run()
        _sync(tensors)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def step_seconds(module: nn.Module, device: torch.device | str, *, repeats: int = 2) -> float:
    """Seconds of an AdamW step (the fastest of `repeats`) over copies of `module`'s parameters on
    `device` (the optimizer step's share of the layer: memory-bound, so copies time it as well as
    the real ones, and the real moments are left alone)."""
    params = [nn.Parameter(p.detach().to(device).clone()) for p in module.parameters() if p.requires_grad]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, foreach=False)
    return best_seconds(opt.step, params, repeats=repeats)  # the warm-up creates the moments


def profile_layers(layers: list[tuple[str, nn.Module]], example_input: torch.Tensor, *,
                   repeats: int = 3, optimizer_states: int = 2) -> list[LayerProfile]:
    """Profile `layers` run in sequence on `example_input` (one micro-batch): saved activations,
    input and output sizes, the fastest forward / backward seconds over `repeats` steps, and the bytes of
    parameters + gradients + `optimizer_states` states per parameter (2 for Adam), all in the
    parameter's dtype, plus the weight casts autocast keeps (run it under the autocast training
    uses). Gradients the parameters held before are restored afterwards.

    The timed backwards add into gradients an earlier micro-batch left, as every micro-batch of a
    step but the first does: where a micro-batch has few tokens, that read-modify-write of every
    gradient is a large part of the backward."""
    if repeats < 1:
        raise ValueError(f"profile_layers: repeats={repeats} must be >= 1")
    if not layers:
        raise ValueError("profile_layers: no layers given")
    params = [p for _, m in layers for p in m.parameters()]
    grads_before = [p.grad for p in params]
    try:
        recorded = []
        inputs: tuple = (example_input,)
        for name, module in layers:
            input_bytes = _tensor_bytes(inputs)
            inputs, saved, cast_bytes = _record_saved(name, module, inputs)
            recorded.append((saved, _tensor_bytes(inputs), cast_bytes, input_bytes))
        del inputs
        for p in params:
            p.grad = None  # the caller's are left alone; the warm-up allocates the ones timed steps add to
        times = [_timed_step(layers, example_input) for _ in range(1 + repeats)]
        del times[0]  # the warm-up
    finally:
        for p, g in zip(params, grads_before):
            p.grad = g
    out = []
    for i, ((name, module), (saved, output_bytes, cast_bytes, input_bytes)) in enumerate(zip(layers, recorded)):
        weights = sum(p.numel() * p.element_size() for p in module.parameters())
        out.append(LayerProfile(
            index=i, name=name,
            forward_s=min(fwd[i] for fwd, _ in times),
            backward_s=min(bwd[i] for _, bwd in times),
            saved=saved, output_bytes=output_bytes, replay_bytes=input_bytes,
            param_bytes=weights * (2 + optimizer_states) + cast_bytes,
            state_bytes=weights * optimizer_states, update_bytes=weights * 2,
            state_tensors=sum(1 for _ in module.parameters()) * optimizer_states,
            step_s=step_seconds(module, example_input.device) if optimizer_states else 0.0,
            host_step_s=step_seconds(module, "cpu") if optimizer_states else 0.0))
    return out


def measure_runtime(layers: list[tuple[str, nn.Module]], example_input: torch.Tensor,
                    profiled: list[LayerProfile], *, repeats: int = 3) -> None:
    """Re-time `profiled` (from `profile_layers` on the same layers) as the mpress runtime runs
    them: under an Executor that keeps every saved tensor (its bookkeeping per tensor then counts
    in `forward_s` / `backward_s`) and under one that swaps every layer's to host memory, a step of
    each in turn, the swap-ins started as the backward starts (as the pipeline runtime does); a
    layer's `swap_forward_s` / `swap_backward_s` are the differences of the fastest, never below 0.
    The swap-ins land before the backward starts, so no wait for a copy counts (the simulator
    models those); on a GPU what is left is the runtime's work per tensor; on a CPU, whose cores
    also do the copies, the swap-outs' share of the cores during the forward as well."""
    if repeats < 1:
        raise ValueError(f"measure_runtime: repeats={repeats} must be >= 1")
    device = example_input.device
    n = len(layers)
    swap_all = Plan(decisions=[Decision(stage=0, layer=i, technique="host") for i in range(n)])
    one = PipelineProfile(stages=[StageProfile(stage=0, layers=[
        LayerProfile(index=i, name=lp.name, forward_s=0.0, backward_s=0.0, saved=lp.saved)
        for i, lp in enumerate(profiled)])], micro_batches=1, schedule="gpipe")
    params = [p for _, m in layers for p in m.parameters()]
    grads_before = [p.grad for p in params]
    spent = [0.0] * n  # seconds each layer's prefetch took, this step

    def prefetch_all() -> None:  # every layer's swap-ins, as the runtime starts them with the backward
        for i in reversed(range(n)):
            start = time.perf_counter()
            swap.prefetch(i)
            spent[i] = time.perf_counter() - start
        # and lets them land, untimed: waiting for a copy is the simulator's to model (a pipeline
        # hides it behind other work), not a cost of the layer
        swap.synchronize()

    with Executor(Plan(), 0, device=device) as keep, \
            Executor(swap_all, 0, device=device, host_pool_bytes=host_pool_bytes_for(one, swap_all, 0)) as swap:
        keep_run = [(name, keep.wrap(i, m)) for i, (name, m) in enumerate(layers)]
        swap_run = [(name, swap.wrap(i, m)) for i, (name, m) in enumerate(layers)]
        kept: list[tuple[list[float], list[float]]] = []
        swapped: list[tuple[list[float], list[float]]] = []
        try:
            for p in params:
                p.grad = None
            for r in range(1 + repeats):  # the first of each is a warm-up
                k = _timed_step(keep_run, example_input)
                fwd, bwd = _timed_step(swap_run, example_input, prefetch_all)
                swap.synchronize()
                # the prefetches ran before the last layer's backward was stamped: each layer's
                # goes to its own backward
                bwd = [b + x for b, x in zip(bwd, spent)]
                if r:
                    kept.append(k)
                    swapped.append((fwd, bwd))
        finally:
            for p, g in zip(params, grads_before):
                p.grad = g
    for i, lp in enumerate(profiled):
        lp.forward_s = min(f[i] for f, _ in kept)
        lp.backward_s = min(b[i] for _, b in kept)
        lp.swap_forward_s = max(min(f[i] for f, _ in swapped) - lp.forward_s, 0.0)
        lp.swap_backward_s = max(min(b[i] for _, b in swapped) - lp.backward_s, 0.0)
