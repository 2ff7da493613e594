"""ModelDataRunner in one process: a stage whose plan keeps some layers' AdamW moments in host
memory, stepped on the device or on the host, steps to exactly the numbers of a plain AdamW,
holds only placeholders between steps, and checkpoints the real moments."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpress.executor import Executor
from mpress.model_data import ModelDataRunner
from mpress.profile import ModelDataDecision, Plan


def layers_and_grads(seed: int = 0):
    torch.manual_seed(seed)
    layers = [nn.Linear(64, 64) for _ in range(4)]
    grads = [[torch.randn(64, 64), torch.randn(64)] for _ in range(5 * 4)]
    return layers, grads


def plain_and_planned(step_on: str, steps: int = 5):
    plain_layers, grads = layers_and_grads()
    planned_layers, _ = layers_and_grads()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    plain = torch.optim.AdamW([p for m in plain_layers for p in m.parameters()], **kw)
    opt = torch.optim.AdamW([p for m in planned_layers for p in m.parameters()], **kw)
    plan = Plan(model_data=[ModelDataDecision(stage=0, layer=1, technique="host"),
                            ModelDataDecision(stage=0, layer=3, technique="host", step_on=step_on)])
    executor = Executor(plan, 0, device="cpu", host_pool_bytes=1 << 20)
    runner = ModelDataRunner(executor, opt, {i: list(m.parameters()) for i, m in enumerate(planned_layers)})
    for step in range(steps):
        for models, o, step_fn in ((plain_layers, plain, plain.step), (planned_layers, opt, runner.step)):
            for i, m in enumerate(models):
                for p, g in zip(m.parameters(), grads[(step * 4 + i) % len(grads)]):
                    p.grad = g.clone()
            step_fn()
    return plain_layers, plain, planned_layers, opt, runner, executor


@pytest.mark.parametrize("step_on", ["device", "host"])
def test_moments_in_host_memory_step_to_the_plain_numbers(step_on):
    plain_layers, plain, planned_layers, opt, runner, executor = plain_and_planned(step_on)
    for a, b in zip(plain_layers, planned_layers):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    # between steps the moved layers' moments are away: placeholders in the optimizer
    for i, m in enumerate(planned_layers):
        for p in m.parameters():
            assert (opt.state[p]["exp_avg"].numel() == 0) == (i in (1, 3))
    assert runner.moved_bytes() == 2 * 2 * (64 * 64 + 64) * 4  # two layers x two moments of weight and bias
    # a checkpoint reads them back: the plain optimizer's state, tensor for tensor
    got, want = runner.state_dict(), plain.state_dict()
    for i, st in want["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["state"][i][key], st[key]), (i, key)
    assert opt.state[next(planned_layers[1].parameters())]["exp_avg"].numel() == 0  # still away
    stats = executor.stats()
    # stashed once per step when stepped on the device; a host step updates them where they are
    per_step = runner.moved_bytes() if step_on == "device" else runner.moved_bytes() // 2
    assert stats.model_bytes == runner.moved_bytes() + 4 * per_step and stats.host_bytes == stats.model_bytes
    assert stats.resident_bytes == 0 and stats.peak_bytes > 0  # counted while on the device, not after
    executor.close()


@pytest.mark.parametrize("step_on", ["device", "host"])
def test_a_checkpoint_loads_moved_moments_a_layer_at_a_time_and_steps_on(step_on):
    """A resumed run: the checkpoint's moments of moved layers go where the plan puts them one
    layer at a time (never all on the device at once), and the run then steps to the plain
    optimizer's numbers."""
    plain_layers, plain, _, _, _, executor = plain_and_planned(step_on, steps=3)
    executor.close()
    saved = copy.deepcopy(plain.state_dict())  # as read from a checkpoint: nothing shared with `plain`
    # a fresh stage holding the saved weights, as a resumed trainer does
    resumed_layers, grads = layers_and_grads()
    for a, b in zip(plain_layers, resumed_layers):
        b.load_state_dict(a.state_dict())
    opt = torch.optim.AdamW([p for m in resumed_layers for p in m.parameters()], lr=1e-2, betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.1, foreach=False)
    plan = Plan(model_data=[ModelDataDecision(stage=0, layer=1, technique="host"),
                            ModelDataDecision(stage=0, layer=3, technique="host", step_on=step_on)])
    executor = Executor(plan, 0, device="cpu", host_pool_bytes=1 << 20)
    runner = ModelDataRunner(executor, opt, {i: list(m.parameters()) for i, m in enumerate(resumed_layers)})
    moved = [p for i in (1, 3) for p in resumed_layers[i].parameters()]
    stash = executor.stash
    on_device = watch_moved_on_device(executor, opt, moved)
    runner.load_state_dict(saved)
    one_layer = 2 * (64 * 64 + 64) * 4
    assert on_device and max(on_device) <= one_layer, on_device
    assert runner.moved_bytes() == 2 * one_layer
    for p in moved:
        assert opt.state[p]["exp_avg"].numel() == 0
    executor.stash = stash
    for step in range(3, 5):  # both go on from the checkpoint
        for models, o, step_fn in ((plain_layers, plain, plain.step), (resumed_layers, opt, runner.step)):
            for i, m in enumerate(models):
                for p, g in zip(m.parameters(), grads[(step * 4 + i) % len(grads)]):
                    p.grad = g.clone()
            step_fn()
    for a, b in zip(plain_layers, resumed_layers):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    got, want = runner.state_dict(), plain.state_dict()
    for i, st in want["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["state"][i][key], st[key]), (i, key)
    executor.close()


def watch_moved_on_device(executor, opt, moved) -> list[int]:
    """At each stash: bytes of the moved layers' moments in the optimizer (on the device)."""
    seen: list[int] = []
    stash = executor.stash

    def watching(layer, t, **kw):
        seen.append(sum(opt.state[p][k].numel() * 4 for p in moved if p in opt.state
                        for k in ("exp_avg", "exp_avg_sq")))
        return stash(layer, t, **kw)

    executor.stash = watching
    return seen


@pytest.mark.parametrize("step_on", ["device", "host"])
def test_the_first_step_makes_one_moved_layers_moments_at_a_time(step_on):
    """A fresh run has no moments yet: the first step makes each moved layer's on the device and
    moves them away before the next layer's are made (the plan never holds two there)."""
    planned_layers, grads = layers_and_grads()
    opt = torch.optim.AdamW([p for m in planned_layers for p in m.parameters()], foreach=False)
    plan = Plan(model_data=[ModelDataDecision(stage=0, layer=1, technique="host"),
                            ModelDataDecision(stage=0, layer=3, technique="host", step_on=step_on)])
    with Executor(plan, 0, device="cpu", host_pool_bytes=1 << 20) as executor:
        runner = ModelDataRunner(executor, opt, {i: list(m.parameters()) for i, m in enumerate(planned_layers)})
        seen = watch_moved_on_device(executor, opt, [p for i in (1, 3) for p in planned_layers[i].parameters()])
        for i, m in enumerate(planned_layers):
            for p, g in zip(m.parameters(), grads[i]):
                p.grad = g.clone()
        runner.step()
        one_layer = 2 * (64 * 64 + 64) * 4
        assert len(seen) == 8 and max(seen) == one_layer, seen  # 2 layers x 2 tensors x 2 moments
        assert runner.moved_bytes() == 2 * one_layer


def test_closing_the_executor_gives_back_the_host_space_of_stashed_moments():
    """Stashed moments hold host buffers (pinned on a GPU) until the executor closes; a pool the
    caller owns then has nothing in use, so no page-locked memory outlives the run."""
    from storage.host_buffers import HostBufferPool, HostBufferPoolConfig

    layers, grads = layers_and_grads()
    opt = torch.optim.AdamW([p for m in layers for p in m.parameters()], foreach=False)
    plan = Plan(model_data=[ModelDataDecision(stage=0, layer=i, technique="host") for i in (0, 2)])
    pool = HostBufferPool(HostBufferPoolConfig(capacity_bytes=1 << 20))
    executor = Executor(plan, 0, device="cpu", host_pool=pool)
    runner = ModelDataRunner(executor, opt, {i: list(m.parameters()) for i, m in enumerate(layers)})
    for i, m in enumerate(layers):
        for p, g in zip(m.parameters(), grads[i]):
            p.grad = g.clone()
    runner.step()
    assert pool.in_use_bytes >= runner.moved_bytes() > 0
    rid = runner.out[0][0][2]
    executor.fetch(rid)  # brought back: its host buffer is no longer where the state lives
    with pytest.raises(ValueError, match="not in host memory"):
        executor.host_view(rid)
    executor.close()
    assert pool.in_use_bytes == 0 and executor.table == {}
    pool.close()
