"""profile_layers: saved activations with their known sizes, producers and consumers; positive
times; parameter, optimizer-state and output bytes; the parameters' gradients left as they were;
timed backwards that add into gradients, as a step's later micro-batches do.
measure_runtime: on a fake clock that only the layers and the executor's swaps advance, the
layers' times and what swapping each one adds, exactly.

Legend: B rows per micro-batch, I input width, O output width.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpress.profiler
from mpress.swap_core import State
from mpress.profile import LayerProfile, SavedTensor
from mpress.profiler import measure_runtime, profile_layers, stage_peak_bytes
from mpress.swap_core import SwapCore

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
    # recomputed, a layer keeps its input to replay the forward: the example, then the outputs
    assert [lp.replay_bytes for lp in profiled] == [B * I * F32, B * O * F32, B * O * F32]
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


class GradSeen(nn.Module):
    """A Linear that records, at each backward, whether its weight already held a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(I, O)
        self.seen: list[bool] = []

    def forward(self, x):
        y = self.linear(x)
        y.register_hook(lambda g: self.seen.append(self.linear.weight.grad is not None))
        return y


def test_timed_backwards_add_into_gradients():
    """Micro-batches 2..M of a step add into the gradients the first left; a micro-batch of few
    tokens spends much of its backward on that, so every timed backward after the warm-up does."""
    layer = GradSeen()
    profile_layers([("l", layer)], torch.randn(B, I), repeats=3)
    # the recording forward has no backward; warm-up allocates; three timed steps accumulate
    assert layer.seen == [False, True, True, True]
    assert layer.linear.weight.grad is None  # and the caller's (none) is back


class Clock:
    """A perf_counter that only the layers and the executor's swaps move."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Tick(torch.autograd.Function):
    """Identity that takes `fwd` seconds forward and `bwd` backward on the clock."""

    @staticmethod
    def forward(ctx, x, clock, fwd, bwd):
        clock.now += fwd
        ctx.clock, ctx.bwd = clock, bwd
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.now += ctx.bwd
        return grad, None, None, None


class TickLayer(nn.Module):
    """A Linear (saves its input, W x W float32: swapped, being over the executor's minimum) and a
    ReLU (saves its output), taking fixed time on the clock."""

    def __init__(self, clock: Clock, fwd: float, bwd: float) -> None:
        super().__init__()
        self.linear, self.clock, self.fwd, self.bwd = nn.Linear(W, W), clock, fwd, bwd

    def forward(self, x):
        return torch.relu(self.linear(Tick.apply(x, self.clock, self.fwd, self.bwd)))


W = 64  # 64 x 64 float32 = 16 KiB per saved tensor


def test_measure_runtime_times_each_layer_and_what_its_swap_adds(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(mpress.profiler, "time", clock)
    OUT_S, IN_S = 1e-3, 3e-3  # per swapped tensor: its swap-out (in the forward), its swap-in
    swap_out, swap_in = SwapCore._swap_out, SwapCore.swap_in  # the executor's swap machinery

    def slow_out(self, record, t):
        clock.now += OUT_S
        return swap_out(self, record, t)

    def slow_in(self, record):
        if record.state in (State.OUT, State.SWAPPING_OUT):  # the once it is brought back
            clock.now += IN_S
        return swap_in(self, record)

    monkeypatch.setattr(SwapCore, "_swap_out", slow_out)
    monkeypatch.setattr(SwapCore, "swap_in", slow_in)
    torch.manual_seed(0)
    layers = [(f"l{i}", TickLayer(clock, fwd=0.01 * (i + 1), bwd=0.1 * (i + 1))) for i in range(3)]
    x = torch.randn(W, W, requires_grad=True)
    profiled = profile_layers(layers, x, repeats=2)
    measure_runtime(layers, x, profiled, repeats=2)
    for i, lp in enumerate(profiled):
        assert lp.forward_s == pytest.approx(0.01 * (i + 1), abs=1e-12), lp
        assert lp.backward_s == pytest.approx(0.1 * (i + 1), abs=1e-12), lp
        swapped = sum(1 for t in lp.saved if t.bytes >= 4096)
        assert swapped == 2, lp.saved  # the Linear's input, the ReLU's output
        # each layer's own swap-ins, though the runtime starts them all as the backward starts
        assert lp.swap_forward_s == pytest.approx(swapped * OUT_S, abs=1e-12), lp
        assert lp.swap_backward_s == pytest.approx(swapped * IN_S, abs=1e-12), lp
    assert all(p.grad is None for _, m in layers for p in m.parameters())


def test_measure_runtime_refuses_no_repeats(profiled):
    with pytest.raises(ValueError, match="repeats=0"):
        measure_runtime([("first", linear_relu(I, O))], torch.randn(B, I), profiled[:1], repeats=0)


def test_under_autocast_weight_copies_are_model_data_and_input_casts_are_activations():
    """bf16 autocast saves its cached bf16 copy of each Linear weight (held once for the region,
    whatever the forwards): counted with the layer's parameters, not as an activation. The bf16
    cast of the layer's input is an activation like any other."""
    torch.manual_seed(0)
    layer = linear_relu(I, O)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (lp,) = profile_layers([("l", layer)], torch.randn(B, I, requires_grad=True), repeats=1)
    weights = sum(p.numel() * p.element_size() for p in layer.parameters())
    assert lp.param_bytes == 4 * weights + O * I * 2  # weight, grad, two moments; the weight's bf16 copy
    assert [(t.bytes, t.producer) for t in lp.saved] == [
        (B * I * 2, "ToCopyBackward0"),  # the input, cast to bf16
        (B * O * 2, "ReluBackward0"),
    ]
