"""MPress in the pipeline trainer: profile every stage's blocks, plan for a per-stage memory budget,
and run each stage's blocks under the plan.

`compact(trainer, stage_memory_bytes)` runs once, before the first step:
  1. each rank profiles its blocks on one micro-batch (mpress.profiler: saved activations, forward
     and backward time as the executor runs them, what a swap adds to them, parameter bytes), and
     throws away the expert gradients that pass produced;
  2. rank 0 gathers the stage profiles, measures the machine (a CPU topology here, NVML on GPUs,
     each rank's GPU found by its PCI address), plans with mpress.planner for `stage_memory_bytes`
     per stage (parameters, gradients and dense optimizer states of the blocks plus their saved
     activations, and the fixed part outside the blocks: the embedding or head with their states,
     and the logits the loss keeps) and a share of the host's available RAM for host swaps and
     optimizer states moved there, and sends the plan to every rank;
  3. each rank wraps its blocks in an mpress Executor holding the activations to the budget left
     after its static bytes, with a host pool and peer memory sized from the profile when the plan
     swaps (CUDA IPC between GPUs, shared memory between CPU ranks; what peer memory takes on a
     GPU comes off the budget), and starts the swap-ins of a stage's swapped layers as the stage's
     backward begins; where the plan moves a block's optimizer states (model data) off the device,
     the stage's optimizer step runs through mpress's ModelDataRunner.
The plan changes where activations and optimizer states live, never the arithmetic: losses,
gradients and weights are those of the run without a budget.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from mpress.executor import Executor
from mpress.space import (host_pool_bytes_for, host_swap_bytes, model_host_bytes, moved_model_bytes,
                          peer_capacity_bytes_for)
from mpress.model_data import ModelDataRunner
from mpress.model_tensors import ModelDataTensors
from mpress.peer_memory import CudaIpcPeers, PeerMemory, SharedMemoryPeers, SharedMemorySpaceError, peer_memory_class
from mpress.planner import plan as make_plan
from mpress.profile import PipelineProfile, Plan, StageProfile
from mpress.profiler import best_seconds, measure_runtime, profile_layers
from mpress.topology import cuda_pci_address, from_nvml, measure_cpu
from semoe.train.expert_states import AdamWConfig, adamw_
from semoe.model.attention import rope_tables
from storage.process_memory import available_ram_bytes
from storage.errors import BadInputError

log = logging.getLogger(__name__)

HOST_SWAP_SHARE = 2  # host swaps may fill 1/HOST_SWAP_SHARE of the RAM available as training starts


class StagedTrainer(Protocol):
    """What this module reads of the pipeline trainer of one stage (`semoe.train.pipeline.PipelineTrainer`)."""

    cfg: Any  # TrainConfig: batch_size, micro_batches, seq_len, seed
    config: Any  # MoEConfig
    pipeline: Any  # PipelineConfig: schedule
    model: Any  # the stage (StageModule): layers, embed, norm, lm_head, last
    device: torch.device
    precision: Any
    states: Any  # expert states: sample_weights, experts, discard_grads
    opt: torch.optim.Optimizer
    rank: int
    world: int

    def loss(self, logits_BTV: torch.Tensor, tgt_BT: torch.Tensor) -> torch.Tensor: ...


@dataclass(eq=False)
class StageMemory:
    """A stage's blocks under a memory plan, for the trainer to run (`install`): `runs` replaces the
    stage's blocks, `prefetch` starts the swap-ins of its swapped layers (call it as the stage's
    backward begins), `stepper` steps the optimizer where the plan moves optimizer states (None:
    the plain step). `close` ends the executor and the peer memory."""

    executor: Executor
    plan: Plan
    peers: PeerMemory | None
    runs: nn.ModuleDict
    prefetch: Callable[[], None]
    stepper: ModelDataRunner | None
    # what `compact` planned, for the step log: the budget and, per stage, its bytes of parameters,
    # gradients and optimizer states and what the plan moves or streams of them
    planned: dict | None = None

    def close(self) -> None:
        try:
            self.executor.close()
        finally:
            if self.peers is not None:
                self.peers.close()


class _BlockOnHidden(nn.Module):
    """A block as the profiler runs it: hidden (B, T, D) in, hidden out (rotary tables fixed)."""

    def __init__(self, block: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.block, self.cos, self.sin = block, cos, sin

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.block(x_BTD, self.cos, self.sin, None)[0]


def profile_stage(trainer: StagedTrainer, repeats: int = 3) -> Any:
    """This rank's StageProfile, measured on one micro-batch of random hidden states."""
    cfg, c, stage = trainer.cfg, trainer.config, trainer.model
    B, T = cfg.batch_size // cfg.micro_batches, cfg.seq_len
    g = torch.Generator().manual_seed(cfg.seed)
    x_BTD = torch.randn(B, T, c.hidden_size, generator=g).mul_(0.02).to(trainer.device).requires_grad_()
    positions_BT = torch.arange(T, device=trainer.device).expand(B, T)
    cos, sin = rope_tables(c, positions_BT, x_BTD.dtype)
    blocks = list(stage.layers.items())
    layers = [(f"layer{k}", _BlockOnHidden(b, cos, sin)) for k, b in blocks]
    with trainer.precision.autocast(trainer.device.type):  # as the steps run: bf16 sizes, times, weight casts
        profiled = profile_layers(layers, x_BTD, repeats=repeats)
        measure_runtime(layers, x_BTD, profiled, repeats=repeats)  # the executor's own costs
    expert_step_s = _expert_step_seconds(trainer)
    tables = sum(t.numel() * t.element_size() for t in (cos, sin))
    for lp, (k, _) in zip(profiled, blocks):
        lp.index, lp.name = int(k), f"layer{k}"
        lp.replay_bytes += tables  # a recomputed block keeps its rotary tables with its input
        if c.is_moe_layer(int(k)):  # the layer's experts step in the same optimizer phase
            lp.step_s += expert_step_s
    trainer.states.discard_grads()  # profiling must not train the experts
    return StageProfile(stage=trainer.rank, layers=profiled, fixed_bytes=_fixed_bytes(trainer, x_BTD.detach()))


def _expert_step_seconds(trainer: StagedTrainer) -> float:
    """Seconds of one MoE layer's expert AdamW step with every expert of the stage touched, timed
    on scratch copies of one expert's tensors where the states live. 0 where the backend's step
    is bound by its reads and writes (SSD), which the profile does not model."""
    sample = trainer.states.sample_weights()
    if not sample:
        return 0.0
    ws = [t.clone() for t in sample]
    gs, ms, vs = ([f(t) for t in sample] for f in (torch.randn_like, torch.zeros_like, torch.zeros_like))

    def step() -> None:  # as the backends step an expert: one fused call over its tensors
        adamw_(ws, gs, ms, vs, step=1, lr=1e-3, cfg=AdamWConfig())

    return best_seconds(step, ws) * len(trainer.states.experts)


def _fixed_bytes(trainer: StagedTrainer, x_BTD: torch.Tensor) -> int:
    """What the stage holds outside its blocks: the embedding's (first stage) or the final norm's
    and LM head's (last stage) parameters, gradients and two AdamW moments, plus, on the last
    stage, the tensors the head and the loss keep for backward, once per micro-batch in flight
    (all of them under GPipe; under 1F1B the last stage finishes each before the next), and the
    copies of its weights autocast keeps, once."""
    stage, cfg = trainer.model, trainer.cfg
    params = [p for m in (stage.embed, stage.norm, stage.lm_head) if m is not None for p in m.parameters()]
    fixed = 4 * sum(p.numel() * p.element_size() for p in params)  # weight, grad, exp_avg, exp_avg_sq
    if stage.last:
        model_data = ModelDataTensors(stage.norm, stage.lm_head)
        seen: dict[int, int] = {}
        casts: dict[int, int] = {}  # autocast's copies of the head's weights: held once, not per micro-batch

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            kind = model_data.kind(t)  # the weights themselves are counted above
            if kind != "parameter":
                (casts if kind == "cast" else seen)[storage.data_ptr()] = storage.nbytes()
            return t

        tgt = torch.zeros(x_BTD.shape[:2], dtype=torch.long, device=x_BTD.device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                trainer.precision.autocast(x_BTD.device.type):
            logits = stage.lm_head(stage.norm(x_BTD.requires_grad_()))
            trainer.loss(logits, tgt)
        in_flight = cfg.micro_batches if trainer.pipeline.schedule == "gpipe" else 1
        fixed += in_flight * sum(seen.values()) + sum(casts.values())
    return fixed


def gather_profile(trainer: StagedTrainer) -> Any:
    """Every stage's profile, on every rank (collective)."""
    cfg, c = trainer.cfg, trainer.config
    gathered = [None] * trainer.world
    dist.all_gather_object(gathered, profile_stage(trainer))
    return PipelineProfile(stages=sorted(gathered, key=lambda s: s.stage), micro_batches=cfg.micro_batches,
                           schedule=trainer.pipeline.schedule,
                           boundary_bytes=cfg.batch_size // cfg.micro_batches * cfg.seq_len * c.hidden_size * 4)


def host_swap_limit_bytes() -> int:
    """Host memory the plan may fill with swapped activations, all stages together: a share of
    what is available as training starts (the rest: the CPU expert cache, data, the processes)."""
    return available_ram_bytes() // HOST_SWAP_SHARE


def _pci_addresses(trainer: StagedTrainer) -> list | None:
    """Each rank's GPU by PCI address, in rank order (collective on CUDA); None on CPU."""
    if trainer.device.type != "cuda":
        return None
    gathered: list = [None] * trainer.world
    dist.all_gather_object(gathered, cuda_pci_address(trainer.device))
    return gathered


def _topology(trainer: StagedTrainer, stage_memory_bytes: int, pci: list | None) -> Any:
    if pci is not None:  # by PCI address: NVML's numbering is not the ranks' CUDA ordinals
        return from_nvml(pci)
    return measure_cpu(trainer.world, stage_memory_bytes, nbytes=16 * 2**20)


def compact(trainer: StagedTrainer, stage_memory_bytes: int) -> StageMemory:
    """Profile, plan and install the plan on every rank (collective); returns `install`'s stage
    memory."""
    profile = gather_profile(trainer)
    pci = _pci_addresses(trainer)
    box: list[Any] = [None]
    if trainer.rank == 0:
        host_limit = host_swap_limit_bytes()
        res = make_plan(profile, _topology(trainer, stage_memory_bytes, pci), budget_bytes=stage_memory_bytes,
                   search_mapping=False,  # CPU ranks are interchangeable; GPU mapping is the launcher's
                   host_memory_bytes=host_limit)
        box[0] = (res.plan, res.fits, res.reason, res.sim.step_time_s, res.planning_s,
                  f"semoe-{os.getpid()}-{time.time_ns()}", host_limit)
    dist.broadcast_object_list(box, src=0)
    the_plan, fits, reason, step_s, planning_s, name, host_limit = box[0]
    if not fits:
        raise BadInputError(f"--stage-memory {stage_memory_bytes} bytes: no plan fits: {reason}")
    planned = {"budget_bytes": stage_memory_bytes, "stages": []}
    for st in profile.stages:
        states, streamed = moved_model_bytes(profile, the_plan, st.stage)
        planned["stages"].append({"stage": st.stage, "model_data_bytes": st.static_bytes,
                                  "moved_state_bytes": states, "streamed_bytes": streamed})
    log.info("stage %d: plan %s, model data %s, simulated step %.3f s, planned in %.3f s", trainer.rank,
             sorted({d.technique for d in the_plan.decisions}), sorted({d.technique for d in the_plan.model_data}),
             step_s, planning_s)
    mine = planned["stages"][trainer.rank]
    states, streamed = mine["moved_state_bytes"], mine["streamed_bytes"]
    # moved states come back under the budget; streamed weights and gradients are on its meter
    static = mine["model_data_bytes"] - states - streamed
    log.info("stage %d: parameters, gradients and optimizer states take %d bytes, %d of them blocks' optimizer "
             "states; the plan moves %d bytes of optimizer states and streams %d bytes of weights and gradients "
             "off the device", trainer.rank, mine["model_data_bytes"],
             sum(lp.state_bytes for lp in profile.stages[trainer.rank].layers), states, streamed)
    memory = install(trainer, the_plan, profile=profile, activation_budget_bytes=max(1, stage_memory_bytes - static),
                     name=name, host_limit_bytes=host_limit)
    memory.planned = planned
    return memory


def make_peers(trainer: StagedTrainer, capacity_bytes: int, name: str) -> Any:
    """Peer memory of `capacity_bytes` per rank for D2D swap: CUDA IPC between GPUs, shared
    memory between CPU ranks (collective)."""
    if peer_memory_class(trainer.device) is CudaIpcPeers:
        with torch.cuda.device(trainer.device):  # object collectives over NCCL use the current device
            return CudaIpcPeers(trainer.rank, trainer.world, capacity_bytes, device=trainer.device)
    try:
        return SharedMemoryPeers(trainer.rank, trainer.world, capacity_bytes, name)
    except SharedMemorySpaceError as exc:
        raise BadInputError(exc.line("raise --stage-memory (less is then swapped to peers)")) from None


def budget_after_peers(activation_budget_bytes: int | None, peers: Any, stage: int) -> int | None:
    """What is left of a stage's activation budget once its peer memory takes its share of the
    device (a GPU's segment and the CUDA contexts other ranks opened on it to reach it)."""
    if activation_budget_bytes is None or peers is None or not peers.device_bytes:
        return activation_budget_bytes
    left = activation_budget_bytes - peers.device_bytes
    if left <= 0:
        raise BadInputError(
            f"stage {stage}: peer memory for D2D swap takes {peers.device_bytes} bytes of the device (its segment "
            f"and the other ranks' CUDA contexts), more than the {activation_budget_bytes} bytes left for "
            f"activations; raise --stage-memory")
    return left


def install(trainer: StagedTrainer, plan: Plan, *, profile: PipelineProfile | None = None,
            activation_budget_bytes: int | None = None, name: str | None = None,
            host_limit_bytes: int | None = None) -> StageMemory:
    """This rank's blocks under `plan`: an Executor per stage (holding saved activations to
    `activation_budget_bytes`, less what peer memory takes on the device), a host pool and peer
    memory sized from `profile` (gathered here when None and the plan swaps) when the plan swaps,
    the swap-ins of the stage's swapped layers to start as its backward begins, and the optimizer
    step through mpress's ModelDataRunner where the plan moves optimizer states (they leave the
    device here). Raises BadInputError when the plan's host swaps exceed `host_limit_bytes`
    (default: rank 0's `host_swap_limit_bytes`)."""
    swaps = {d.technique for d in (*plan.decisions, *plan.model_data)} & {"host", "d2d"}
    if swaps and profile is None:
        profile = gather_profile(trainer)
    host_pool_bytes = None
    if "host" in swaps:
        if host_limit_bytes is None:
            box: list[Any] = [host_swap_limit_bytes() if trainer.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)  # one figure, so that every rank decides alike
            host_limit_bytes = box[0]
        need = [host_swap_bytes(profile, plan, s) + model_host_bytes(profile, plan, s) for s in range(trainer.world)]
        if sum(need) > host_limit_bytes:
            raise BadInputError(
                f"the plan puts {sum(need)} bytes of activations and optimizer states in host memory at the peak "
                f"(per stage: {need}), more than the {host_limit_bytes} bytes allowed (1/{HOST_SWAP_SHARE} of "
                f"the RAM available)")
        model_bytes = model_host_bytes(profile, plan, trainer.rank)
        host_pool_bytes = model_bytes + (host_pool_bytes_for(profile, plan, trainer.rank,
                                                             limit_bytes=host_limit_bytes - model_bytes)
                                         if host_swap_bytes(profile, plan, trainer.rank) else 0)
    peers = None
    if "d2d" in swaps:
        if name is None:
            box = [f"semoe-{os.getpid()}-{time.time_ns()}"]
            dist.broadcast_object_list(box, src=0)
            name = box[0]
        peers = make_peers(trainer, peer_capacity_bytes_for(profile, plan), name)
    try:
        budget = budget_after_peers(activation_budget_bytes, peers, trainer.rank)
    except BadInputError:
        peers.close()
        raise
    log.info("stage %d: host pool %s bytes, peer segment %s bytes, %s bytes of it on the device", trainer.rank,
             host_pool_bytes, peers.capacity_bytes if peers else 0, peers.device_bytes if peers else 0)
    executor = Executor(plan, trainer.rank, device=trainer.device, peers=peers, budget_bytes=budget,
                        host_pool_bytes=host_pool_bytes)
    stage = trainer.model
    runs = nn.ModuleDict({k: executor.wrap(int(k), b) for k, b in stage.layers.items()})
    swapped = [d.layer for d in plan.decisions if d.stage == trainer.rank and d.technique in ("host", "d2d")]

    def prefetch() -> None:  # swap the stage's activations back in as its backward starts
        for layer in reversed(swapped):
            executor.prefetch(layer)

    stepper = None
    if any(d.stage == trainer.rank and d.technique != "keep" for d in plan.model_data):
        stepper = ModelDataRunner(executor, trainer.opt, {
            int(k): [p for p in b.parameters() if p.requires_grad] for k, b in stage.layers.items()})
        stepper.stash_resident()  # a resumed run's moments leave the device before the first step
    return StageMemory(executor=executor, plan=plan, peers=peers, runs=runs, prefetch=prefetch, stepper=stepper)
