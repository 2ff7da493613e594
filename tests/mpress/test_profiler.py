"""profile_layers: saved activations with their known sizes, producers and consumers; positive
times; parameter, optimizer-state and output bytes; the parameters' gradients left as they were.

Legend: B rows per micro-batch, I input width, O output width.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpress.profile import LayerProfile, SavedTensor
from mpress.profiler import profile_layers, stage_peak_bytes

B, I, O = 4, 8, 16
F32 = 4


class Square(torch.autograd.Function):
    """A custom Function, to see saves made through `ctx.save_for_backward`."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class SquareLayer(nn.Module):
    def forward(self, x):
        return Square.apply(x)


def linear_relu(i: int, o: int) -> nn.Module:
    return nn.Sequential(nn.Linear(i, o), nn.ReLU())


@pytest.fixture
def profiled() -> list[LayerProfile]:
    torch.manual_seed(0)
    layers = [("first", linear_relu(I, O)), ("second", linear_relu(O, O)), ("square", SquareLayer())]
    return profile_layers(layers, torch.randn(B, I), repeats=3)


def test_linear_relu_saves_its_input_and_the_relu_output(profiled):
    first, second, _ = profiled
    # the first layer's input needs no grad, so the Linear keeps only its input for the weight's
    # gradient (weight.t(), a parameter view, is not an activation); the ReLU keeps its output
    assert first.saved == [
        SavedTensor(name="saved0.mat1", bytes=B * I * F32, producer="input", consumer="AddmmBackward0"),
        SavedTensor(name="saved1.result", bytes=B * O * F32, producer="ReluBackward0", consumer="ReluBackward0"),
    ]
    assert second.saved == [
        SavedTensor(name="saved0.mat1", bytes=B * O * F32, producer="ReluBackward0", consumer="AddmmBackward0"),
        SavedTensor(name="saved1.result", bytes=B * O * F32, producer="ReluBackward0", consumer="ReluBackward0"),
    ]
    assert first.saved_bytes == B * (I + O) * F32


def test_custom_function_saves_are_found(profiled):
    assert profiled[2].saved == [SavedTensor(name="saved0.saved_tensors", bytes=B * O * F32,
                                             producer="ReluBackward0", consumer="SquareBackward")]


def test_param_output_bytes_and_indices(profiled):
    first, second, square = profiled
    # parameters + gradients + 2 Adam moments, float32
    assert first.param_bytes == 4 * (I * O + O) * F32
    assert second.param_bytes == 4 * (O * O + O) * F32
    assert square.param_bytes == 0
    assert [lp.output_bytes for lp in profiled] == [B * O * F32] * 3
    assert [(lp.index, lp.name) for lp in profiled] == [(0, "first"), (1, "second"), (2, "square")]


def test_times_are_positive(profiled):
    for lp in profiled:
        assert lp.forward_s > 0 and lp.backward_s > 0, lp


def test_gradients_are_left_as_they_were():
    layer = linear_relu(I, O)
    layer[0].bias.grad = torch.full((O,), 7.0)
    profile_layers([("l", layer)], torch.randn(B, I), repeats=1)
    assert layer[0].weight.grad is None
    assert torch.equal(layer[0].bias.grad, torch.full((O,), 7.0))


def test_stage_peak_bytes_counts_in_flight_micro_batches(profiled):
    static = sum(lp.param_bytes for lp in profiled)
    saved = sum(lp.saved_bytes for lp in profiled)
    assert stage_peak_bytes(profiled, in_flight=3) == static + 3 * saved
    with pytest.raises(ValueError, match="in_flight=-1"):
        stage_peak_bytes(profiled, in_flight=-1)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="repeats=0"):
        profile_layers([("l", linear_relu(I, O))], torch.randn(B, I), repeats=0)
    with pytest.raises(ValueError, match="does not require grad"):
        profile_layers([("frozen", nn.Identity())], torch.randn(B, I), repeats=1)
