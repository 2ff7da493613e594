"""The routing recorder: one record per forward call and MoE layer, the union of the call's experts."""

from __future__ import annotations

import pytest
import torch

from semoe.model.config import named_config
from semoe.decode.loop import SamplingConfig
from semoe.decode.generate import generate
from semoe.model.moe_gpt import MoEGPT
from semoe.evaluation.routing_trace import RoutingTraceRecorder, routing_record, routing_trace
from storage.cache_sim import read_trace


@pytest.fixture
def model() -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(named_config("tiny", num_layers=3, moe_layers=(0, 2), num_experts=8)).eval()


def test_routing_record_is_the_sorted_union():
    assert routing_record(3, torch.tensor([[5, 1], [1, 7], [5, 2]])) == {"layer": 3, "experts": [1, 2, 5, 7]}


def test_one_record_per_forward_and_moe_layer_in_layer_order(model, tmp_path):
    path = tmp_path / "t.jsonl"
    ids_BT = torch.randint(0, 259, (2, 9))
    with torch.no_grad():
        want = model(ids_BT).router
        with RoutingTraceRecorder(model, path) as rec:
            model(ids_BT)
            model(ids_BT[:, :1])
    assert rec.records == 4
    trace = read_trace(path)
    # the first call's records hold both sequences' experts: the whole batch is one forward
    assert trace[:2] == [(layer, sorted(set(want[layer].ids_NK.flatten().tolist()))) for layer in (0, 2)]
    assert [layer for layer, _ in trace] == [0, 2, 0, 2]
    model(ids_BT)  # closed: the hooks are gone
    assert len(read_trace(path)) == 4


def test_generation_appends_and_nothing_is_recorded_without_a_path(model, tmp_path):
    path = tmp_path / "t.jsonl"
    for runs in (1, 2):
        with routing_trace(model, path):
            res = generate(model, [1, 2, 3], SamplingConfig(max_new_tokens=4))
        assert len(read_trace(path)) == runs * len(res.tokens) * 2  # one forward per token chosen, 2 MoE layers
    with routing_trace(model, None) as rec:
        assert rec is None
    assert not model.layers[0].ffn._forward_hooks and not model._forward_hooks
