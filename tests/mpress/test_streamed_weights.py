"""Streamed weights in one process: a stage whose plan keeps some layers' weights, gradients and
AdamW moments in host memory (weights brought in for each forward and backward, gradients summed
on the host, AdamW on the host) trains to exactly the numbers of the plain stage, holds those
layers' weights on the device only while they run, and counts them while they are there."""

from __future__ import annotations


import pytest
import torch
from helpers.gated_stream import HeldUntilSynchronized
from torch import nn

from mpress.executor import Executor
from mpress.model_data import ModelDataRunner
from mpress.profile import Decision, ModelDataDecision, Plan

D, LAYERS, M, STEPS = 32, 4, 3, 4
KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.scale = nn.Parameter(torch.ones(D))  # reached only through an elementwise product

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x * self.scale)))


def blocks() -> list[Block]:
    torch.manual_seed(0)
    return [Block() for _ in range(LAYERS)]


def train(layers: list[nn.Module], params_of: list[list[nn.Parameter]], opt, step, grads, clip: float):
    """GPipe on one stage: M forwards, then M backwards; a global-norm clip; the step."""
    torch.manual_seed(1)
    data = [[torch.randn(8, D) for _ in range(M)] for _ in range(STEPS)]
    losses = []
    for xs in data:
        outs = []
        for x in xs:
            for layer in layers:
                x = layer(x)
            outs.append(x.square().mean() / M)
        for loss in outs:
            loss.backward()
        gs = grads()
        norm = torch.stack([g.norm() for g in gs]).norm()
        if norm > clip:
            for g in gs:
                g.mul_(clip / norm)
        step()
        for ps in params_of:
            for p in ps:
                p.grad = None
        losses.append(sum(o.item() for o in outs))
    return losses


@pytest.mark.parametrize("activations", ["keep", "recompute", "host"])
def test_streamed_layers_train_to_the_plain_numbers(activations):
    plain = blocks()
    plain_opt = torch.optim.AdamW([p for b in plain for p in b.parameters()], **KW)
    want = train(plain, [list(b.parameters()) for b in plain], plain_opt, plain_opt.step,
                 lambda: [p.grad for b in plain for p in b.parameters()], clip=0.5)

    planned = blocks()
    opt = torch.optim.AdamW([p for b in planned for p in b.parameters()], **KW)
    plan = Plan(decisions=[Decision(stage=0, layer=2, technique=activations)] if activations != "keep" else [],
                model_data=[ModelDataDecision(stage=0, layer=i, technique="host", step_on="host", weights="host")
                            for i in (1, 2)])
    executor = Executor(plan, 0, device="cpu", host_pool_bytes=4 << 20, min_swap_bytes=0)
    runs = [executor.wrap(i, b) for i, b in enumerate(planned)]
    runner = ModelDataRunner(executor, opt, {i: list(b.parameters()) for i, b in enumerate(planned)})
    seen = []  # the streamed layers' storage at every forward of layer 3
    runs[3].register_forward_pre_hook(
        lambda *_: seen.append([p.untyped_storage().nbytes() for b in planned[1:3] for p in b.parameters()]))

    def grads():
        held = runner.held_grads()
        return [held.get(id(p), p.grad) for b in planned for p in b.parameters()]

    got = train(runs, [list(b.parameters()) for b in planned], opt, runner.step, grads, clip=0.5)
    assert got == want  # bit for bit: the same losses every step
    # between their uses the streamed layers hold nothing on the device
    assert len(seen) == STEPS * M and all(n == 0 for row in seen for n in row)
    for i, (a, b) in enumerate(zip(plain, planned)):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            w = runner.held_weights().get(id(q), q)
            assert torch.equal(p, w), (i, name)
    sd, plain_sd = runner.state_dict(), plain_opt.state_dict()
    for i, st in plain_sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sd["state"][i][key], st[key]), (i, key)
    stats = executor.stats()
    weights = sum(p.numel() * 4 for b in planned[1:3] for p in b.parameters())
    # per micro-batch each streamed layer's weights came in twice and its gradients went out once
    # (the first forward of all found them on the device already)
    assert stats.weight_bytes == 3 * STEPS * M * weights - weights
    assert stats.resident_bytes == 0
    # the meter counted at most the two streamed layers' weights and one's gradients at once, over
    # what the activations took
    assert stats.peak_bytes > 0
    executor.close()
    # closing put the weights back on the device: the model is whole again
    for a, b in zip(plain, planned):
        for p, q in zip(a.parameters(), b.parameters()):
            assert q.untyped_storage().nbytes() == q.numel() * 4 and torch.equal(p, q)


def test_a_parameter_sharing_its_storage_cannot_be_streamed():
    layer = nn.Linear(4, 4)
    flat = torch.zeros(4 * 4 + 4)
    layer.weight = nn.Parameter(flat[:16].view(4, 4))
    plan = Plan(model_data=[ModelDataDecision(stage=0, layer=0, technique="host", step_on="host", weights="host")])
    executor = Executor(plan, 0, device="cpu", host_pool_bytes=1 << 20)
    run = executor.wrap(0, layer)
    with pytest.raises(ValueError, match="layer 0: parameter 0 .* does not own its storage"):
        run(torch.randn(2, 4))
    executor.close()


def test_weights_live_on_the_host_only_for_a_layer_stepped_there():
    with pytest.raises(ValueError, match="weights live in host memory only for a layer stepped on the host"):
        ModelDataDecision(stage=0, layer=0, technique="host", weights="host")


def test_putting_weights_back_is_outside_the_activation_budget():
    """After their first forward the streamed layers' weights live in host memory; putting them
    back for good (as closing does when training ends or fails) makes them static again, so it
    must not be refused by a budget that only bounds activations and weights in use. Budget 0 and
    a forward without autograd: nothing else is ever counted."""
    layers = blocks()
    want = [p.detach().clone() for b in layers for p in b.parameters()]
    plan = Plan(model_data=[ModelDataDecision(stage=0, layer=i, technique="host", step_on="host", weights="host")
                            for i in range(LAYERS)])
    executor = Executor(plan, 0, device="cpu", host_pool_bytes=4 << 20, budget_bytes=0)
    runs = [executor.wrap(i, b) for i, b in enumerate(layers)]
    with torch.no_grad():
        x = torch.randn(8, D)
        for run in runs:
            x = run(x)
    assert all(p.untyped_storage().nbytes() == 0 for b in layers for p in b.parameters())
    executor.restore_weights()
    assert executor.stats().resident_bytes == 0
    got = [p for b in layers for p in b.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    executor.close()


def test_over_the_budget_gradients_on_their_way_out_are_waited_for():
    """Layers 1-3 stream. As layer 2's backward fetches layer 1's weights, the stage holds layer
    2's weights and gradients, layer 1's weights and layer 3's gradients, still on their way to
    host memory: four layers' worth (w each), where the planner counts three. With a budget of
    the forward's activations plus 3 w and layer 3's gradient copies held back (the stream holds
    them, and everything behind them, until a host synchronisation asks for one), the executor
    waits for them to land instead of refusing, and the gradients summed on the host are the
    plain backward's."""
    plain = blocks()
    x = torch.randn(8, D)
    h = x
    for b in plain:
        h = b(h)
    h.square().mean().backward()

    plan = Plan(model_data=[ModelDataDecision(stage=0, layer=i, technique="host", step_on="host", weights="host")
                            for i in (1, 2, 3)])
    stream = HeldUntilSynchronized()
    layers: list[nn.Module] = []

    def forward(budget_bytes: int | None):
        layers[:] = blocks()
        executor = Executor(plan, 0, device="cpu", host_pool_bytes=4 << 20, copy_stream=stream,
                            budget_bytes=budget_bytes)
        runs = [executor.wrap(i, b) for i, b in enumerate(layers)]
        with torch.no_grad():  # the first forward finds the weights on the device and sends them out
            h = x
            for run in runs:
                h = run(h)
        h = x
        for run in runs:
            h = run(h)
        return executor, h

    w = sum(p.numel() * 4 for p in plain[1].parameters())
    probe, _ = forward(None)
    acts = probe.stats().resident_bytes  # the weights went out again after their forwards
    probe.close()
    executor, h = forward(acts + 3 * w)

    def gradient_out(src, dst) -> bool:  # in backward the only copies are weights in and gradients out
        return dst.untyped_storage().data_ptr() not in {p.untyped_storage().data_ptr() for b in layers
                                                        for p in b.parameters()}

    stream.hold_from(gradient_out)  # layer 3's gradients are the backward's first to leave
    h.square().mean().backward()
    # the budget made the backward itself synchronise on the held gradients (compute's wait for a
    # weight copy behind them would have left the gate to the safety timer)
    assert stream.opened_by == "synchronize"
    executor.finish_backward()
    assert executor.stats().peak_bytes <= acts + 3 * w
    for i in (1, 2, 3):
        for k, p in enumerate(plain[i].parameters()):
            assert torch.equal(executor.host_grad(i, k), p.grad), (i, k)
    executor.close()
    stream.close()
