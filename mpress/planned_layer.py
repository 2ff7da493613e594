"""A layer run under its stage's decision: the module that `Executor.wrap` returns.

It knows nothing of the executor: it takes the calls it makes (`LayerCalls`), the saved-tensor
hooks of one forward, a count of recomputed forwards and, for a layer whose weights are streamed
from host memory, the three moments the weights move (its forward begins and ends, and the first
gradient reaches its outputs)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class LayerCalls:
    hooks: Callable[[], AbstractContextManager]  # the saved-tensor hooks for one forward
    recomputed: Callable[[], None]  # a forward replayed in backward
    # streamed weights only: bring them in, let them go, bring them in for the backward
    forward_begins: Callable[[], None] | None = None
    forward_ends: Callable[[], None] | None = None
    backward_begins: Callable[[], None] | None = None


def _grad_outputs(out) -> list[torch.Tensor]:
    """The tensors among a layer's outputs (a tensor or a tuple of them) that carry gradients."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


class PlannedLayer(nn.Module):
    """`module` run as `technique` (keep, recompute, host or d2d) says, through `calls`."""

    def __init__(self, layer_index: int, module: nn.Module, technique: str, calls: LayerCalls) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.technique = technique
        self.module = module
        self.calls = calls

    def forward(self, *args):
        calls = self.calls
        if calls.forward_begins is None:
            return self._run(*args)
        calls.forward_begins()
        try:
            out = self._run(*args)
        finally:
            calls.forward_ends()
        tensors = _grad_outputs(out)
        if tensors:  # the layer's weights come back when the first gradient reaches its outputs
            begins = calls.backward_begins
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: begins(), mode="any")
        return out

    def _run(self, *args):
        with self.calls.hooks():
            if self.technique != "recompute":
                return self.module(*args)
            first = [True]

            def run(*inputs):
                if first[0]:
                    first[0] = False
                else:
                    self.calls.recomputed()
                return self.module(*inputs)

            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
