"""Pipeline-parallel training of the MoE GPT: one rank per stage, micro-batches in GPipe or 1F1B order.

The model is cut into contiguous runs of blocks (`split_stages`); stage 0 also holds the embedding
and the last stage the final norm and LM head. Each rank builds only its stage (`StageModule`) and
an expert-state backend holding only its stage's MoE layers (all experts of those layers), and
`torch.distributed.pipelining` moves activations forward and their gradients back.

Router losses: a stage's load-balancing and z losses cannot travel through the pipeline API,
which carries one activation. Each stage therefore ties its router loss to its output with an
identity whose backward also starts the router loss's backward, with gradient 1 / micro_batches
(Megatron's aux-loss auto-scaler): the router sees exactly the gradient of the non-pipelined
`(ce + aux_coef * aux + z_coef * z) / micro_batches`.

Gradient scaling: the last stage's loss is `ce / micro_batches` and the schedule does not rescale
afterwards (`scale_grads=False`). Expert gradients bypass `.grad` (they go to the expert-state
backend), so the schedule's own rescaling of `.grad` would miss them; scaling the loss instead
puts dense, expert and router gradients on the same path as the single-rank trainer's.

The store: every rank shares RUN/store as in `Trainer`. Rank 0 holds the transaction; each rank
writes its experts' chunk files into the staged version; at a checkpoint the other ranks' chunk
entries and their stages' dense tensors are gathered to rank 0, which writes the dense tensors and
commits. Besides the model and the experts' Adam moments, a checkpoint holds `pipeline.json`
(step, stages, schedule, settings, per-expert Adam step counts) and `pipeline_optimizer.pt` (each
stage's dense AdamW state and RNG state), so a run resumes with the same number of stages, bit
for bit (on CUDA, as far as the kernels are deterministic: see `semoe.train.trainer`). The gathering
runs on the trainer's object group (gloo, host memory), never through NCCL.

Shape legend: B batch (of one micro-batch), T tokens, D hidden size, V vocabulary.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mpress.swap_core import ExecutorStats
from semoe.checkpoints.model_io import _dense_params
from semoe.model.hf_names import hf_name
from semoe.model.config import MoEConfig
from semoe.train.expert_states import ExpertStates, sum_of_squares
from semoe.model.moe_gpt import MoEGPT
from semoe.model.attention import rope_tables
from semoe.train.pipeline_memory import StageMemory, compact, install
from semoe.train.run_store import PIPELINE_FILE, PIPELINE_OPTIMIZER_FILE, RunStore
from semoe.train.trainer import Trainer, build_model, init_dense, run_rank, to_device
from semoe.train.config import StepLog, TrainConfig
from storage.errors import BadInputError
from storage.store import Store

log = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b")
EXECUTOR_STATS = tuple(f.name for f in fields(ExecutorStats))  # per stage in the step log's `memory`


@dataclass(kw_only=True)
class PipelineConfig:
    """How the pipeline runs: its schedule and, optionally, an mpress plan of per-layer memory
    techniques (recompute, host swap, device-to-device swap)."""

    schedule: str = "1f1b"
    plan: Any = None  # an mpress Plan; None: blocks run as they are
    stage_memory_bytes: int | None = None  # plan (profile, mpress planner) for this budget per stage

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise BadInputError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")


def check_pipeline(config: MoEConfig, stages: int, cfg: TrainConfig, pipeline: PipelineConfig) -> None:
    """Raise BadInputError, naming the flag, when this model and run cannot be pipelined this way."""
    split_stages(config, stages)
    if config.tie_embeddings:
        raise BadInputError("--pipeline needs untied embeddings (the embedding and the LM head live on "
                            "different stages); this model ties them")
    if cfg.dense_states == "fsdp":
        raise BadInputError("--dense-states fsdp shards dense states over data-parallel ranks; with --pipeline "
                            "each stage owns its blocks' dense states alone: drop --dense-states")
    M = cfg.micro_batches
    if cfg.batch_size % M:
        raise BadInputError(f"--batch-size {cfg.batch_size} must divide by --micro-batches {M}")
    if pipeline.schedule == "1f1b" and M < stages:
        raise BadInputError(f"--schedule 1f1b needs --micro-batches >= the {stages} stages, got {M}")


def split_stages(config: MoEConfig, stages: int) -> list[range]:
    """Contiguous block ranges, one per stage; earlier stages take the extra blocks."""
    n = config.num_layers
    if not isinstance(stages, int) or not 1 <= stages <= n:
        raise BadInputError(f"--pipeline must be in 1..{n} (the model's layers), got {stages!r}")
    base, extra = divmod(n, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


# -- router losses across stages ------------------------------------------------------------


class RouterLossMeter:
    """Sums of the router losses a stage's forwards produced since the last `take` (for the log).

    The pipeline API returns nothing but the activation from a stage, so the stage reports its
    router losses here, a sink its owner hands it."""

    def __init__(self) -> None:
        self._aux: list[torch.Tensor] = []
        self._z: list[torch.Tensor] = []

    def add(self, aux: torch.Tensor, z: torch.Tensor) -> None:
        self._aux.append(aux.detach())
        self._z.append(z.detach())

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of aux losses, sum of z losses) recorded since the last call, float64 scalars
        left on their device (0.0 on the CPU when none were recorded); clears them."""
        zero = torch.zeros((), dtype=torch.float64)
        aux = torch.stack(self._aux).double().sum() if self._aux else zero
        z = torch.stack(self._z).double().sum() if self._z else zero
        self._aux, self._z = [], []
        return aux, z


class _AttachLoss(torch.autograd.Function):
    """Returns `x` unchanged; in backward passes x's gradient through and gives `loss` the
    gradient `scale`, so the loss is trained as if added to the final loss times `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(loss, ctx.scale), None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """`x`, carrying `loss` into backward with gradient `scale` (Megatron's aux-loss auto-scaler)."""
    return _AttachLoss.apply(x, loss, scale)


# -- one stage ------------------------------------------------------------------------------

Wrap = Callable[[int, nn.Module], nn.Module]  # (global layer index, block) -> the module to run


class StageModule(nn.Module):
    """The blocks `layers` of a model, with the embedding on stage 0 and the final norm and LM head on
    the last stage; forward(ids or hidden) -> hidden (B, T, D), or logits (B, T, V) on the last stage.

    Parameter names are the model's own (`layers.3.attn.q_proj.weight`), so the store's tensor names
    do not depend on the split. `wrap` (an mpress executor) replaces how each block runs, not
    what it holds."""

    def __init__(self, model: MoEGPT, layers: range, *, first: bool, last: bool, loss_scale: float = 1.0,
                 meter: RouterLossMeter | None = None, wrap: Wrap | None = None,
                 on_backward: Callable[[], None] | None = None) -> None:
        super().__init__()
        if model.config.tie_embeddings:
            raise BadInputError("pipeline parallelism needs untied embeddings (the embedding and the LM head "
                                "live on different stages); this model ties them")
        self.config = model.config
        self.first, self.last = first, last
        self.loss_scale = loss_scale  # gradient of this stage's router loss: 1 / micro_batches
        self.meter = meter
        self.on_backward = on_backward
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.runs = nn.ModuleDict({k: wrap(int(k), b) for k, b in self.layers.items()}) if wrap else self.layers
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        x_BTD = self.embed(x) if self.first else x
        B, T, _ = x_BTD.shape
        positions_BT = torch.arange(T, device=x_BTD.device).expand(B, T)
        cos, sin = rope_tables(c, positions_BT, x_BTD.dtype)
        aux, z = [], []
        for block in self.runs.values():
            x_BTD, stats = block(x_BTD, cos, sin, None)
            if stats is not None:
                aux.append(stats.aux_loss)
                z.append(stats.z_loss)
        # float32 logits whatever autocast did: the schedule checks them against the declared output
        out = self.lm_head(self.norm(x_BTD)).float() if self.last else x_BTD
        if aux and self.training and torch.is_grad_enabled():
            # This stage's share of the model's mean-over-MoE-layers losses, summed as MoEGPT sums them.
            n = len(c.moe_layer_ids)
            zero = out.new_zeros(())
            aux_mean, z_mean = sum(aux, zero) / n, sum(z, zero) / n
            if self.meter is not None:
                self.meter.add(aux_mean, z_mean)
            out = attach_loss(out, c.aux_loss_coef * aux_mean + c.z_loss_coef * z_mean, self.loss_scale)
        if self.on_backward is not None and out.requires_grad:
            out.register_hook(self._backward_starts)
        return out

    def _backward_starts(self, grad: torch.Tensor) -> torch.Tensor:
        self.on_backward()
        return grad


# -- the trainer ----------------------------------------------------------------------------


class PipelineTrainer(Trainer):
    """One stage of a pipeline-parallel run (rank r runs stage r of world-size stages).

    Reuses `Trainer`'s data, store transactions, checkpoint gathering and loop; replaces how the
    model is built (one stage), how expert states are made (the stage's MoE layers), the step
    (a pipeline schedule) and what a checkpoint commits (every stage's dense tensors, optimizer
    and RNG states)."""

    RUN_FILE = PIPELINE_FILE

    def __init__(self, cfg: TrainConfig, model_config: MoEConfig | None = None,
                 pipeline: PipelineConfig | None = None, *,
                 executor_factory: Callable[[Any, int, torch.device], Any] | None = None,
                 on_step: Callable[[StepLog], None] | None = None) -> None:
        self.pipeline = pipeline or PipelineConfig()
        self.executor_factory = executor_factory
        self.meter = RouterLossMeter()
        self._stage_dense: list = []  # at a checkpoint, on rank 0: every stage's dense tensors
        resuming = RunStore.exists(cfg.store)
        self._resumed_optimizer: dict | None = None
        super().__init__(cfg, model_config, on_step=on_step)
        self.schedule = self._make_schedule()
        self.memory: StageMemory | None = None  # the stage's blocks under a memory plan
        try:
            if self.pipeline.plan is not None and executor_factory is None:
                self._use_memory(install(self, self.pipeline.plan))
            elif self.pipeline.stage_memory_bytes is not None:
                self._use_memory(compact(self, self.pipeline.stage_memory_bytes))
            self._load_deferred_optimizer()
        except BaseException:  # a new run: leave no store that blocks the next try; a resumed one keeps it
            self.abort()
            if self.rank == 0 and not resuming:
                shutil.rmtree(cfg.store, ignore_errors=True)
            raise

    @property
    def executor(self) -> Any:
        """The stage's mpress executor under a memory plan (its stats, peak); None without one."""
        memory = getattr(self, "memory", None)
        return memory.executor if memory is not None else None

    def _use_memory(self, memory: StageMemory) -> None:
        """Run the stage's blocks as `memory` (a plan's executor) does: its wrapped blocks, its swap-ins
        started as the stage's backward begins, and its optimizer step where it moves optimizer states."""
        self.memory = memory
        stage = self.model
        stage.runs = memory.runs
        previous = stage.on_backward

        def on_backward() -> None:
            memory.prefetch()
            if previous is not None:
                previous()

        stage.on_backward = on_backward
        if memory.stepper is not None:
            self.dense_states.stepper = memory.stepper

    def _planned(self) -> bool:
        """Whether __init__ installs a memory plan (its two branches)."""
        return ((self.pipeline.plan is not None and self.executor_factory is None)
                or self.pipeline.stage_memory_bytes is not None)

    def _load_dense_optimizer(self, opt_state: dict) -> None:
        """Under a memory plan the moments wait on the host until the plan is installed: the
        profile runs without them, and moments the plan moves off the device go there a layer
        at a time (ModelDataRunner.load_state_dict), never all on the device at once."""
        if self._planned():
            self._resumed_optimizer = opt_state
        else:
            super()._load_dense_optimizer(opt_state)

    def _load_deferred_optimizer(self) -> None:
        sd, self._resumed_optimizer = self._resumed_optimizer, None
        if sd is None:
            return
        stepper = self.dense_states.stepper
        if stepper is not None:
            stepper.load_state_dict(sd)
        else:
            self.dense_states.load_full_state(sd)

    def _build_stage(self, executor_factory: Callable[[Any, int, torch.device], Any] | None) -> StageModule:
        """This rank's stage. The whole model's dense part is built and initialised as the single-rank
        trainer does it (one generator, in module order), so every stage starts from the same numbers;
        the stage keeps its part, the rest is dropped."""
        self.model = build_model(self.config, self.states, torch.device("cpu"), world=1).train()
        if self.trainer_state is not None:  # resuming: the last checkpoint's weights
            self._load_dense(self.run_store.store, self.cfg.store)
        elif self.cfg.init_from is None:
            init_dense(self.model, self.cfg.seed)
        else:
            self._load_dense(self.source, self.cfg.init_from)  # fills self.model
        wrap = None
        if self.pipeline.plan is not None and executor_factory is not None:  # else installed after the schedule
            wrap = executor_factory(self.pipeline.plan, self.rank, self.device).wrap
        stage = StageModule(self.model, self.layers, first=self.first, last=self.last,
                            loss_scale=1.0 / self.cfg.micro_batches, meter=self.meter, wrap=wrap,
                            on_backward=self.states.end_backward)
        return stage.to(self.device).train()

    def _make_schedule(self) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        cfg, c, M = self.cfg, self.config, self.cfg.micro_batches
        # Shapes are given up front: without them the stage would infer them by running forward and
        # backward on empty tensors, which would hand garbage gradients to the expert states.
        mb, T = cfg.batch_size // M, cfg.seq_len
        inp = (torch.empty(mb, T, dtype=torch.long, device=self.device) if self.first else
               torch.empty(mb, T, c.hidden_size, device=self.device, requires_grad=True))
        out = torch.empty(mb, T, c.vocab_size if self.last else c.hidden_size, device=self.device,
                          requires_grad=True)
        stage = PipelineStage(self.model, self.rank, self.world, self.device, input_args=inp, output_args=out)
        schedule = ScheduleGPipe if self.pipeline.schedule == "gpipe" else Schedule1F1B
        # The loss is ce / M and the schedule leaves .grad alone: see the module docstring.
        return schedule(stage, n_microbatches=M, loss_fn=self.loss, scale_grads=False)

    def loss(self, logits_BTV: torch.Tensor, tgt_BT: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss as the schedule takes it: its cross-entropy / micro_batches."""
        ce = F.cross_entropy(logits_BTV.reshape(-1, self.config.vocab_size).float(), tgt_BT.reshape(-1))
        return ce / self.cfg.micro_batches

    # -- setting up: what differs from Trainer ----------------------------------------------
    def _join(self) -> None:
        if not dist.is_initialized():
            raise BadInputError("pipeline training runs one process per stage: start it with "
                                "`semoe train --pipeline N` (torch.distributed is not initialised)")
        self.distributed = True
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _check_layout(self) -> None:
        check_pipeline(self.config, self.world, self.cfg, self.pipeline)
        self.stages = split_stages(self.config, self.world)
        if self.trainer_state is not None and \
                self.trainer_state["stages"] != [[r.start, r.stop] for r in self.stages]:
            raise BadInputError(f"{self.cfg.store}: the run was trained with --pipeline "
                                f"{len(self.trainer_state['stages'])}; resume it with that many stages")
        self.layers = self.stages[self.rank]
        self.first, self.last = self.rank == 0, self.rank == self.world - 1

    def _owned_experts(self) -> range:
        return range(self.config.num_experts)  # a stage owns every expert of its layers

    def _build(self) -> None:
        # the optimizer too: checkpoint 0 of a new run saves its state
        self.model = self._build_stage(self.executor_factory)
        self._make_dense_states("replicated", world=1)  # each stage has parameters of its own

    def _build_fresh(self) -> None:
        self._build()  # the stage is initialised (or loaded from --init-from) while it is built

    def _make_states(self, layers: list[int] | None = None) -> ExpertStates:
        return super()._make_states([l for l in self.layers if self.config.is_moe_layer(l)])

    def _load_dense(self, store: Store, source: str) -> None:
        if isinstance(self.model, StageModule):  # the stage's weights are loaded while it is built
            return
        super()._load_dense(store, source)

    def _saved_optimizer(self, store: Store) -> tuple[dict, torch.Tensor]:
        # to the CPU, as Trainer._saved_optimizer explains
        blob = torch.load(io.BytesIO(store.read_file(PIPELINE_OPTIMIZER_FILE)), map_location="cpu",
                          weights_only=False)
        return blob["stages"][self.rank], blob["rng"][self.rank]

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint(self) -> int:
        """Commit every stage's dense tensors, optimizer and RNG states and experts as one store
        version; returns it."""
        stepper = self.dense_states.stepper  # moments off the device (and streamed weights) are read where they are
        held = stepper.held_weights() if stepper is not None else {}
        dense = [(hf_name(self.config, name), held[id(p)].clone() if id(p) in held else p.detach().cpu())
                 for name, p in _dense_params(self.model)]
        opt = _to_cpu(stepper.state_dict() if stepper is not None else self.opt.state_dict())
        self._stage_dense = self.comm.gather((dense, opt, torch.get_rng_state()))
        try:
            return super().checkpoint()
        finally:
            self._stage_dense = []

    def _dense_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [t for stage_dense, _, _ in self._stage_dense for t in stage_dense]

    def _optimizer_state(self) -> None:
        return None  # every stage's, gathered by `checkpoint`

    def _run_files(self, adam_steps: list[list[int]], opt_state: None) -> dict[str, bytes]:
        train_cfg = {k: v for k, v in asdict(self.cfg).items() if k not in ("out", "log_json")}
        buf = io.BytesIO()
        torch.save({"stages": [opt for _, opt, _ in self._stage_dense],
                    "rng": [rng for _, _, rng in self._stage_dense]}, buf)
        return {PIPELINE_OPTIMIZER_FILE: buf.getvalue(), PIPELINE_FILE: json.dumps({
            "step": self.step, "stages": [[r.start, r.stop] for r in self.stages], "schedule": self.pipeline.schedule,
            "train_config": train_cfg, "adam_steps": adam_steps}, indent=1).encode()}

    # -- the step -----------------------------------------------------------------------------
    def train_step(self) -> StepLog:
        cfg, M = self.cfg, self.cfg.micro_batches
        t0 = time.perf_counter()
        before = self.states.stats()
        lr = cfg.lr_at(self.step)
        for p in self.dense:
            p.grad = None
        ids, tgt = self.sampler.batch(self.step)
        losses: list[torch.Tensor] = []
        args = (to_device(ids, self.device),) if self.first else ()
        with self.precision.autocast(self.device.type):
            self.schedule.step(*args, target=to_device(tgt, self.device) if self.last else None,
                               losses=losses if self.last else None, return_outputs=False)
        # Every number stays on the device until the one host read of the step.
        dev = self.device
        ce_sum = (torch.stack([x.detach() for x in losses]).double().sum() if losses else
                  torch.zeros((), dtype=torch.float64, device=dev))
        aux_sum, z_sum = self.meter.take()
        sq = (sum_of_squares(self.dense_states.grads(), dev)  # each stage its own
              + self.states.grad_sq_sum())
        # ce is ce / M already; each stage's router losses and squares are its own: all add up over
        # stages. Under a memory plan each stage's executor counters ride along in a slot of its own.
        numbers = torch.stack([ce_sum, to_device(aux_sum, dev), to_device(z_sum, dev), sq])
        if self.memory is not None:
            slots = torch.zeros(self.world, len(EXECUTOR_STATS), dtype=torch.float64, device=dev)
            st = self.memory.executor.stats()
            slots[self.rank] = torch.tensor([float(getattr(st, f)) for f in EXECUTOR_STATS], dtype=torch.float64)
            numbers = torch.cat([numbers, slots.flatten()])
        summed = self.comm.sum_on_device(numbers).tolist()
        ce_mean, aux_sum, z_sum, sq = summed[:4]
        extra = {"z_loss": z_sum / M, "stages": self.world, "schedule": self.pipeline.schedule}
        if self.memory is not None:
            extra["memory"] = self._memory_log(summed[4:])
        return self._finish_step(t0, before, lr, ce_mean, aux_sum / M, sq, extra=extra)

    def _memory_log(self, stats: list[float]) -> dict:
        """The step log's `memory`: the plan's techniques, and per stage what `compact` planned (its
        parameter, gradient and optimizer-state bytes, those moved or streamed) beside its executor's
        counters since the start (`mpress.swap_core.ExecutorStats`: peak and resident activation
        bytes, bytes swapped, layers recomputed)."""
        n = len(EXECUTOR_STATS)
        planned, plan = self.memory.planned or {}, self.memory.plan
        out = {"plan": sorted({d.technique for d in plan.decisions}),
               "model_data": sorted({d.technique for d in plan.model_data}),
               "budget_bytes": planned.get("budget_bytes"), "stages": []}
        for stage in range(self.world):
            row = dict(planned["stages"][stage]) if planned else {"stage": stage}
            row.update({f: int(v) for f, v in zip(EXECUTOR_STATS, stats[stage * n:(stage + 1) * n])})
            out["stages"].append(row)
        return out

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._close_memory()

    def abort(self) -> None:
        try:
            super().abort()
        finally:
            self._close_memory()

    def _close_memory(self) -> None:
        memory, self.memory = getattr(self, "memory", None), None
        if memory is not None:
            memory.close()

    def evaluate(self, batches: int = 4) -> float:
        raise NotImplementedError("evaluation is not run through the pipeline")


def _to_cpu(obj: Any) -> Any:
    """A state dict with every tensor on the CPU (to gather it to rank 0 and save it)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def run_pipeline_rank(cfg: TrainConfig, model_config: MoEConfig | None, pipeline: PipelineConfig, *,
                      quiet: bool = False) -> list[StepLog]:
    """One stage's whole run with logging: the JSON log and the progress line from rank 0."""
    return run_rank(cfg, model_config, quiet=quiet,
                    factory=lambda c, m, on_step: PipelineTrainer(c, m, pipeline, on_step=on_step))
