"""NextLayerPredictor: the next MoE layer's router on this layer's input, or a replayed record."""

from __future__ import annotations

import torch

from inference.offload.next_layer_predictor import NextLayerPredictor
from inference.offload.ring_bookkeeping import RoutingReplay
from semoe.model.config import named_config
from semoe.model.moe_gpt import MoEGPT


def _model() -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(named_config("tiny", num_layers=3, num_experts=8, top_k=2)).eval()


def test_the_next_layers_router_picks_most_used_first_and_the_last_layer_predicts_nothing():
    model = _model()
    layers = model.config.moe_layer_ids
    assert len(layers) >= 2
    p = NextLayerPredictor(model)
    x = torch.randn(5, model.config.hidden_size)  # five tokens: a prompt's union of experts
    nxt, picked = p.predict(layers[0], x)
    assert nxt == layers[1]
    ids = model.moe_layers()[1].route(x).ids_TK  # the reference: the next layer's own routing
    counts = torch.bincount(ids.flatten(), minlength=model.config.num_experts)
    assert set(picked) == set(ids.flatten().tolist())
    assert [counts[e].item() for e in picked] == sorted((counts[e].item() for e in picked), reverse=True)
    assert p.predict(layers[-1], x) is None and not p.known


def test_a_replay_predicts_the_recorded_visits_until_the_routing_differs():
    model = _model()
    a, b = model.config.moe_layer_ids[:2]
    p = NextLayerPredictor(model)
    p.replay = RoutingReplay([(a, [1, 2]), (b, [3, 4]), (a, [5, 6])])
    assert p.known
    x = torch.randn(1, model.config.hidden_size)
    p.seen(a, [1, 2])
    assert p.predict(a, x) == (b, [3, 4])
    p.seen(b, [3, 7])  # not the record: no more predictions from it
    assert p.replay.diverged and p.predict(a, x) == (b, [])
