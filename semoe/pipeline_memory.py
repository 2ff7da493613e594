"""MPress in the pipeline trainer: profile every stage's blocks, plan for a per-stage memory budget,
and run each stage's blocks under the plan.

`compact(trainer, stage_memory_bytes)` runs once, before the first step:
  1. each rank profiles its blocks on one micro-batch (mpress.profiler: saved activations, forward
     and backward time, parameter bytes), and throws away the expert gradients that pass produced;
  2. rank 0 gathers the stage profiles, measures the machine (a CPU topology here, NVML on GPUs),
     plans with mpress.planner for `stage_memory_bytes` per stage (parameters, gradients and dense
     optimizer states of the blocks plus their saved activations, and the fixed part outside the
     blocks: the embedding or head with their states, and the logits the loss keeps) and sends the
     plan to every rank;
  3. each rank wraps its blocks in an mpress Executor holding the activations to the budget left
     after its static bytes, with peer memory for D2D swap when the plan uses it, and starts the
     swap-ins of a stage's swapped layers as the stage's backward begins.
The plan changes where activations live, never the arithmetic: losses and gradients are those of
the run without a budget.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from semoe.model import rope_cos_sin
from storage.errors import BadInputError

if TYPE_CHECKING:
    from semoe.pipeline import PipelineTrainer

log = logging.getLogger(__name__)


class _BlockOnHidden(nn.Module):
    """A block as the profiler runs it: hidden (B, T, D) in, hidden out (rotary tables fixed)."""

    def __init__(self, block: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.block, self.cos, self.sin = block, cos, sin

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.block(x_BTD, self.cos, self.sin, None)[0]


def profile_stage(trainer: "PipelineTrainer", repeats: int = 2) -> Any:
    """This rank's StageProfile, measured on one micro-batch of random hidden states."""
    from mpress.profile import StageProfile
    from mpress.profiler import profile_layers

    cfg, c, stage = trainer.cfg, trainer.config, trainer.model
    B, T = cfg.batch_size // cfg.micro_batches, cfg.seq_len
    g = torch.Generator().manual_seed(cfg.seed)
    x_BTD = torch.randn(B, T, c.hidden_size, generator=g).mul_(0.02).to(trainer.device).requires_grad_()
    positions_BT = torch.arange(T, device=trainer.device).expand(B, T)
    cos, sin = rope_cos_sin(positions_BT, c.head_dim, c.rope_theta, x_BTD.dtype)
    blocks = list(stage.layers.items())
    profiled = profile_layers([(f"layer{k}", _BlockOnHidden(b, cos, sin)) for k, b in blocks], x_BTD,
                              repeats=repeats)
    for lp, (k, _) in zip(profiled, blocks):
        lp.index, lp.name = int(k), f"layer{k}"
    trainer.states.discard_grads()  # profiling must not train the experts
    return StageProfile(stage=trainer.rank, layers=profiled, fixed_bytes=_fixed_bytes(trainer, x_BTD.detach()))


def _fixed_bytes(trainer: "PipelineTrainer", x_BTD: torch.Tensor) -> int:
    """What the stage holds outside its blocks: the embedding's (first stage) or the final norm's
    and LM head's (last stage) parameters, gradients and two AdamW moments, plus, on the last
    stage, the tensors the head and the loss keep for backward, once per micro-batch in flight
    (all of them under GPipe; under 1F1B the last stage finishes each before the next)."""
    stage, cfg = trainer.model, trainer.cfg
    params = [p for m in (stage.embed, stage.norm, stage.lm_head) if m is not None for p in m.parameters()]
    fixed = 4 * sum(p.numel() * p.element_size() for p in params)  # weight, grad, exp_avg, exp_avg_sq
    if stage.last:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return t

        tgt = torch.zeros(x_BTD.shape[:2], dtype=torch.long, device=x_BTD.device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = stage.lm_head(stage.norm(x_BTD.requires_grad_()))
            trainer._loss(logits, tgt)
        in_flight = cfg.micro_batches if trainer.pipeline.schedule == "gpipe" else 1
        fixed += in_flight * sum(seen.values())
    return fixed


def _topology(trainer: "PipelineTrainer", stage_memory_bytes: int) -> Any:
    from mpress.topology import from_nvml, measure_cpu

    if trainer.device.type == "cuda":
        topo = from_nvml()
        return topo.subset(list(range(trainer.world)))
    return measure_cpu(trainer.world, stage_memory_bytes, nbytes=16 * 2**20)


def compact(trainer: "PipelineTrainer", stage_memory_bytes: int) -> Any:
    """Profile, plan and install the plan on every rank; returns the plan."""
    from mpress.planner import plan
    from mpress.profile import PipelineProfile

    cfg, c = trainer.cfg, trainer.config
    mine = profile_stage(trainer)
    gathered = [None] * trainer.world
    dist.all_gather_object(gathered, mine)
    profile = PipelineProfile(stages=sorted(gathered, key=lambda s: s.stage), micro_batches=cfg.micro_batches,
                              schedule=trainer.pipeline.schedule,
                              boundary_bytes=cfg.batch_size // cfg.micro_batches * cfg.seq_len * c.hidden_size * 4)
    box: list[Any] = [None]
    if trainer.rank == 0:
        res = plan(profile, _topology(trainer, stage_memory_bytes), budget_bytes=stage_memory_bytes,
                   search_mapping=False)  # CPU ranks are interchangeable; GPU mapping is the launcher's
        box[0] = (res.plan, res.fits, res.reason, res.sim.step_time_s, res.planning_s,
                  f"semoe-{os.getpid()}-{time.time_ns()}")
    dist.broadcast_object_list(box, src=0)
    the_plan, fits, reason, step_s, planning_s, name = box[0]
    if not fits:
        raise BadInputError(f"--stage-memory {stage_memory_bytes} bytes: no plan fits: {reason}")
    log.info("stage %d: plan %s, simulated step %.3f s, planned in %.3f s", trainer.rank,
             sorted({d.technique for d in the_plan.decisions}), step_s, planning_s)
    static = profile.stages[trainer.rank].static_bytes
    install(trainer, the_plan, activation_budget_bytes=max(1, stage_memory_bytes - static), name=name,
            peer_bytes=stage_memory_bytes)
    return the_plan


def install(trainer: "PipelineTrainer", plan: Any, *, activation_budget_bytes: int | None = None,
            name: str | None = None, peer_bytes: int = 64 * 2**20) -> None:
    """Run this rank's blocks under `plan`: an Executor per stage (holding saved activations to
    `activation_budget_bytes`), peer memory of `peer_bytes` per rank when the plan swaps D2D, and
    the swap-ins of the stage's swapped layers started as its backward begins."""
    from mpress.executor import Executor

    peers = None
    if any(d.technique == "d2d" for d in plan.decisions):
        from mpress.peer_memory import SharedMemoryPeers

        if name is None:
            box = [f"semoe-{os.getpid()}-{time.time_ns()}"]
            dist.broadcast_object_list(box, src=0)
            name = box[0]
        peers = SharedMemoryPeers(trainer.rank, trainer.world, peer_bytes, name)
    executor = Executor(plan, trainer.rank, device=trainer.device, peers=peers,
                        budget_bytes=activation_budget_bytes)
    stage = trainer.model
    stage.runs = nn.ModuleDict({k: executor.wrap(int(k), b) for k, b in stage.layers.items()})
    swapped = [d.layer for d in plan.decisions if d.stage == trainer.rank and d.technique in ("host", "d2d")]
    previous = stage.on_backward

    def on_backward() -> None:  # swap the stage's activations back in as its backward starts
        for layer in reversed(swapped):
            executor.prefetch(layer)
        if previous is not None:
            previous()

    stage.on_backward = on_backward
    trainer.executor, trainer.plan, trainer.peers = executor, plan, peers
