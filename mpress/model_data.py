"""A pipeline stage's optimizer step under a plan's model-data decisions (`Plan.model_data`).

Between steps, the AdamW moments of every layer the plan moves off the device live where the
plan says (host memory or peers' segments, through the stage's `Executor`); the optimizer holds
an empty placeholder for each, so nothing can step them by accident. A step:

A layer whose weights the executor streams (`weights="host"`) is stepped on the host over its
weights and gradient sums in host memory, which it updates in place: nothing is copied. Its
parameters' `.grad` stay unset; `held_grads` gives their sums (for the gradient norm and
clipping), `held_weights` their weights (for checkpoints).

  1. runs the optimizer on every parameter whose moments stay on the device (kept layers, the
     embedding or head), with the other parameters' gradients set aside;
  2. then, layer by layer in stage order: a moved layer's first step makes its moments on the
     device and they leave at once (never more than one layer's there); later steps bring its
     moments back (the next such layer's are fetched while this one steps), step that layer's
     parameters alone, and stash its moments again; a layer the plan steps on the host
     (`step_on="host"`, moments in host memory) is stepped there instead: its gradients and
     weights come to the host, AdamW updates the weights and the moments in their host buffers
     in place, and the weights go back. (On a GPU the host's AdamW and the device's may round
     differently in the last bit; on a CPU device they are the same code.)

Each call of `optimizer.step()` sees only parameters with a gradient and AdamW updates each
parameter on its own (`foreach=False`), so the numbers are those of one step over all of them.
The executor's meter counts the moments while they are on the device, against the stage's budget.
"""

from __future__ import annotations

import torch
from torch import nn

MOMENTS = ("exp_avg", "exp_avg_sq")


class ModelDataRunner:
    """Steps `optimizer` for one stage; `layers` maps each layer index of the stage to its
    parameters (the optimizer's own objects)."""

    def __init__(self, executor, optimizer: torch.optim.Optimizer, layers: dict[int, list[nn.Parameter]]) -> None:
        self.executor, self.opt = executor, optimizer
        plan, stage = executor.plan, executor.stage
        self.moved = [layer for layer in sorted(layers) if plan.model_decision(stage, layer).technique != "keep"]
        self.layers = layers
        self.out: dict[int, list[tuple[nn.Parameter, str, int]]] = {}  # layer -> (param, moment, record id)
        self.on_host = {layer for layer in self.moved if plan.model_decision(stage, layer).step_on == "host"}
        # layers whose weights the executor streams: param id -> (layer, its index there)
        self._streamed = {id(p): (layer, i) for layer in executor.streamed_layers()
                          for i, p in enumerate(executor.streamed_params(layer))}
        self._slot = {id(p): (group, i) for group in optimizer.param_groups for i, p in enumerate(group["params"])}
        owned = set(self._slot)
        for layer in self.moved:
            missing = [i for i, p in enumerate(layers[layer]) if id(p) not in owned]
            if missing:
                raise ValueError(f"stage {stage}, layer {layer}: parameters {missing} are not the optimizer's")

    def _stash(self, layer: int, counted: bool = False) -> None:
        entries = []
        for p in self.layers[layer]:
            state = self.opt.state.get(p, {})
            for key in MOMENTS:
                if key in state:
                    t = state[key]
                    entries.append((p, key, self.executor.stash(layer, t, counted=counted)))
                    state[key] = torch.empty(0, dtype=t.dtype, device=t.device)
        if entries:
            self.out[layer] = entries

    def stash_resident(self) -> None:
        """Move the moments of moved layers that are on the device (a resumed run's, or a
        layer's first step) to where the plan puts them."""
        for layer in self.moved:
            if layer not in self.out:
                self._stash(layer)

    def load_state_dict(self, sd: dict) -> None:
        """Load an optimizer state dict (a checkpoint's, on the host): moved layers' moments go
        where the plan puts them one layer at a time, so that at most one layer's are on the
        device at once; the rest load as `Optimizer.load_state_dict` loads them. Before the
        first step only: moments already moved would be lost."""
        if self.out:
            raise ValueError("ModelDataRunner.load_state_dict: moments are already moved; load before the first step")
        params = [p for group in self.opt.param_groups for p in group["params"]]
        layer_of = {id(p): layer for layer in self.moved for p in self.layers[layer]}
        owner = {i: layer_of[id(p)] for i, p in enumerate(params) if id(p) in layer_of}
        held: dict[int, dict] = {}
        state = {}
        for i, st in sd["state"].items():
            if int(i) in owner and any(k in st for k in MOMENTS):
                held[int(i)] = st
                st = {k: (torch.empty(0, dtype=v.dtype) if k in MOMENTS else v) for k, v in st.items()}
            state[i] = st
        self.opt.load_state_dict({**sd, "state": state})
        for layer in self.moved:
            for i in sorted(i for i, owned in owner.items() if owned == layer and i in held):
                p = params[i]
                for key in MOMENTS:  # as load_state_dict casts a floating parameter's state
                    if key in held[i]:
                        self.opt.state[p][key] = held[i][key].to(device=p.device, dtype=p.dtype)
            self._stash(layer)

    def held_grads(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its gradient, summed in host memory, for the streamed layers'
        parameters that have one this step (their `.grad` is unset)."""
        self.executor.finish_backward()
        out = {}
        for pid, (layer, i) in self._streamed.items():
            g = self.executor.host_grad(layer, i)
            if g is not None:
                out[pid] = g
        return out

    def held_weights(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its weights in host memory, for the streamed layers' parameters
        (their device storage is freed between uses: read these instead)."""
        layers = set(self.executor.streamed_layers())
        return {pid: self.executor.host_weight(layer, i) for pid, (layer, i) in self._streamed.items()
                if layer in layers and self.executor.has_host_weights(layer)}

    def step(self) -> None:
        """One optimizer step of every parameter with a gradient (see the module docstring)."""
        self.executor.finish_backward()
        params = [p for group in self.opt.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        off = {id(p) for layer in self.moved for p in self.layers[layer]}
        try:
            for p in params:
                if id(p) in off:
                    p.grad = None
            self.opt.step()  # everything on the device
            keep = {id(p): g for p, g in zip(params, grads)}
            for p in params:
                p.grad = None
            on_device = [layer for layer in self.moved if layer in self.out and layer not in self.on_host]
            if on_device:
                self._fetch(on_device[0])
            for layer in self.moved:
                if layer not in self.out:  # its first step makes its moments here: they leave at once
                    if self.streamed_layer(layer):
                        self._host_step(layer, keep)  # made on the host
                    else:
                        self._step_alone(layer, keep)
                    self._stash(layer)
                    continue
                if layer in self.on_host:
                    self._host_step(layer, keep)
                    continue
                j = on_device.index(layer)
                if j + 1 < len(on_device):
                    self._fetch(on_device[j + 1])  # comes in while this layer steps
                entries = self.out.pop(layer)
                for p, key, rid in entries:
                    self.opt.state[p][key] = self.executor.take(rid)
                self._step_alone(layer, keep)
                self._stash(layer, counted=True)
        finally:
            for p, g in zip(params, grads):
                p.grad = g
        self.stash_resident()

    def _step_alone(self, layer: int, grads: dict[int, torch.Tensor | None]) -> None:
        """The optimizer's step of one layer's parameters only (every other gradient is unset)."""
        for p in self.layers[layer]:
            p.grad = grads[id(p)]
        self.opt.step()
        for p in self.layers[layer]:
            p.grad = None

    def _host_step(self, layer: int, grads: dict[int, torch.Tensor | None]) -> None:
        """AdamW on the host for one layer whose moments are in host memory: each parameter's
        stand-in on the host (its own tensor when the device is the CPU) takes its place in the
        optimizer for one step, with the moments' host buffers as its state."""
        rids = {(id(p), key): rid for p, key, rid in self.out.get(layer, [])}
        for p in self.layers[layer]:
            streamed = self._streamed.get(id(p))
            if streamed is not None:  # weights and gradient sums in host memory already
                g = self.executor.host_grad(*streamed)
                w = self.executor.host_weight(*streamed) if g is not None else None
            else:
                g = grads[id(p)]
                w = p.detach().to("cpu") if g is not None else None
            first = (id(p), MOMENTS[0]) not in rids  # a streamed layer's first step makes its moments here
            if g is None or (first and streamed is None):
                continue
            shadow = nn.Parameter(w)
            shadow.grad = g.to("cpu")
            group, i = self._slot[id(p)]
            self.opt.state[shadow] = self.opt.state.pop(p, {}) if first else {
                "step": self.opt.state[p]["step"], **{key: self.executor.host_view(rids[(id(p), key)]) for key in MOMENTS}}
            group["params"][i] = shadow
            try:
                self.opt.step()  # only the stand-in has a gradient
            finally:
                group["params"][i] = p
                state = self.opt.state.pop(shadow)
                if first:
                    self.opt.state[p] = state  # moments on the host, stashed by the caller
            if streamed is None:
                with torch.no_grad():
                    p.copy_(w)  # the updated weights back (on a CPU device, `w` is `p` itself)
        if self.streamed_layer(layer):
            self.executor.clear_grads(layer)

    def streamed_layer(self, layer: int) -> bool:
        return any(owner == layer for owner, _ in self._streamed.values())

    def _fetch(self, layer: int) -> None:
        for _, _, rid in self.out.get(layer, []):
            self.executor.fetch(rid)

    def state_dict(self) -> dict:
        """The optimizer's state dict with every moved moment read back to the host (a copy)."""
        sd = self.opt.state_dict()
        index = {id(p): i for i, p in enumerate(p for group in self.opt.param_groups for p in group["params"])}
        for entries in self.out.values():
            for p, key, rid in entries:  # a new dict: the packed state shares the live ones
                i = index[id(p)]
                sd["state"][i] = {**sd["state"][i], key: self.executor.peek(rid)}
        return sd

    def moved_bytes(self) -> int:
        """Bytes of moments off the device now."""
        return sum(p.numel() * p.element_size() for entries in self.out.values() for p, _, _ in entries)
