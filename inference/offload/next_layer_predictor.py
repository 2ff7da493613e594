"""Which experts the next MoE layer will use, guessed while the current one runs.

The ring (`inference.offload.expert_ring`) reads and stages what this predicts; what it predicts is this module's
alone: the next MoE layer's router applied to the current layer's input (the hidden state changes
little from one layer to the next), or, where a benchmark installs one, a `RoutingReplay` of an
earlier run of the same request (a perfect predictor: the ceiling of any other).
"""

from __future__ import annotations

import torch

from inference.offload.ring_bookkeeping import RoutingReplay
from semoe.model.moe_gpt import MoEGPT

__all__ = ["NextLayerPredictor"]


class NextLayerPredictor:
    """One per offloaded model: the next MoE layer of each, and the routers to guess with."""

    def __init__(self, model: MoEGPT) -> None:
        layers = model.config.moe_layer_ids
        self.next_layer = dict(zip(layers, layers[1:]))
        self.routers = {f.layer: f for f in model.moe_layers()}
        self.num_experts = model.config.num_experts
        self.replay: RoutingReplay | None = None  # benchmarks: predict from a recorded run

    @property
    def known(self) -> bool:
        """Whether predictions are the request's recorded routing (a replay), not guesses."""
        return self.replay is not None and not self.replay.recording

    def seen(self, layer: int, experts: list[int]) -> None:
        """A layer visit starts with these experts (a replay records or follows it)."""
        if self.replay is not None:
            self.replay.seen(layer, experts)

    def predict(self, layer: int, x_ND: torch.Tensor) -> tuple[int, list[int]] | None:
        """(the next MoE layer after `layer`, its predicted experts, most picked first; with a long
        prompt their union may exceed the ring), or None after the last MoE layer. `x_ND`: the
        current layer's input. The one host read of a prediction: the layer's own dispatch has just
        synchronised, so it waits only for the router's small matmul."""
        nxt = self.next_layer.get(layer)
        if nxt is None:
            return None
        if self.known:
            return nxt, self.replay.upcoming(nxt)
        with torch.no_grad():
            r = self.routers[nxt].route(x_ND)
        counts = torch.bincount(r.ids_TK.flatten(), minlength=self.num_experts).tolist()
        return nxt, sorted((e for e, n in enumerate(counts) if n), key=lambda e: -counts[e])
