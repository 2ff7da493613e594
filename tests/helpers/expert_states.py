"""An expert-state backend for tests of the expert autograd function: fixed weights, recorded gradients."""

from __future__ import annotations

import torch

from semoe.train.expert_states import Held


class RecordingStates:
    """Hands out the same weights for every expert and keeps each gradient it is given; with
    `into`, backward computes the gradients into tensors it hands out (`grad_out`)."""

    def __init__(self, w, into: bool = False):
        self.w, self.grads, self.into, self.outs = w, {}, into, {}

    def grad_out(self, layer, expert):
        if not self.into:
            return None
        self.outs[(layer, expert)] = [torch.full_like(t, float("nan")) for t in self.w]
        return self.outs[(layer, expert)]

    def begin_backward_layer(self, layer):
        pass

    def fetch(self, layer, expert):
        return Held(*self.w)

    def add_grad_factors(self, layer, expert, factors):
        out = self.grad_out(layer, expert) if factors.dtype == torch.float32 else None
        self.add_grad(layer, expert, factors.grads(out))

    def add_grad(self, layer, expert, grads):
        self.grads[(layer, expert)] = grads
