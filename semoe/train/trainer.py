"""Training the MoE GPT with SE-MoE's hierarchical states, on one rank or many.

A run lives in one directory:

    RUN/store     a semoe store: the model (config.json, dense weights, expert chunks of kinds
                  weight, adam_m, adam_v) plus the trainer's state (trainer.json, optimizer.pt);
                  every checkpoint is one atomic commit of it, and `semoe generate --model
                  RUN/store` serves it directly
    RUN/data      token shards built from `--data` (or the embedded corpus)
    RUN/spill     expert gradients that did not fit the host budget (transient)

Each step: every rank takes its slice of the global batch (split further into micro-batches),
runs forward and backward (experts dispatched to their owner ranks with all-to-all; dense
gradients averaged in buckets while backward runs, or reduce-scattered block by block under
`--dense-states fsdp`, see `semoe.train.dense_states`), checks the loss, clips by the global gradient
norm, steps AdamW on the dense parameters and streams the expert optimizer step through the
expert-state backend. Checkpoints commit everything (dense weights and optimizer, expert states,
data position, per-expert Adam step counts, RNG) in one store version; resuming continues bit-
exactly where that version left off. Batches are a pure function of (seed, step), so no data
position needs more than the step number.

Precision: weights, gradients and optimizer states are float32 everywhere. On CUDA the forward
runs under bf16 autocast with TF32 matmuls by default (`TrainConfig.precision`); on CPU it is
float32 throughout.

Reproducibility: on CPU a run is a pure function of its settings, the expert-state modes (ssd,
cpu, device) give bit-identical numbers, and a resumed run ends bit-identical to an uninterrupted
one. On CUDA a resumed run repeats its steps only as far as the kernels are deterministic: the
backward of token gathers (`x_ND[tok]`) accumulates with atomics, so gradients vary in the last
bits from run to run unless `torch.use_deterministic_algorithms(True)` is set; and `--expert-states
device` steps expert AdamW on the GPU while `cpu` and `ssd` step it on the CPU, whose kernels round
differently, so the modes agree within float32 rounding, not bit for bit.

Host syncs per step: one read of the losses and the gradient norm (`_finish_step`), and per MoE
layer the routing's data-dependent sizes (see `semoe.model.moe_gpt`); everything else stays queued.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from semoe.model.attention import Attention
from semoe.checkpoints.model_io import _dense_params, hf_config
from semoe.model.hf_names import hf_name
from semoe.train.collectives import Collectives, object_group
from semoe.model.config import MoEConfig
from semoe.train.data import BatchSampler, prepare_data
from semoe.train.dense_states import DenseStates, assign_full_, full_tensor, shard_dense
from semoe.model.expert_layout import read_dequantized
from semoe.train.expert_parallel import local_expert_ids, shard_experts
from semoe.train.expert_states import (STATE_KINDS, AdamWConfig, ChunkFormat, ExpertStates, ResidentExpertStates,
                                       TrainingExperts, init_expert)
from semoe.model.moe_gpt import MoEGPT, Router
from semoe.model.attention import RMSNorm
from semoe.train.run_store import OPTIMIZER_FILE, TRAINER_FILE, RunStore
from semoe.train.ssd_states import SSDExpertStates, SSDStatesConfig
from semoe.checkpoints.tokenizer import ByteTokenizer
from semoe.train.config import (Precision, StepLog, TrainConfig, TrainingError, json_line, progress_line,
                                training_precision)
from storage.process_memory import peak_rss_bytes
from storage.errors import BadInputError
from storage.store import Store, StoreWriter, chunk_meta

log = logging.getLogger(__name__)

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# -- building the model ---------------------------------------------------------------------


@torch.no_grad()
def init_dense(model: MoEGPT, seed: int) -> None:
    """Initialise every dense parameter from one seeded generator, in module order (experts are
    initialised per expert by `init_expert`, so neither depends on the other)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, Router)):
            assign_full_(m.weight, torch.empty(m.weight.shape).normal_(0.0, 0.02, generator=g))
            if getattr(m, "bias", None) is not None:
                assign_full_(m.bias, torch.zeros(m.bias.shape))
        elif isinstance(m, RMSNorm):
            assign_full_(m.weight, torch.ones(m.weight.shape))
        elif isinstance(m, Attention) and m.config.attention_sinks:
            assign_full_(m.sinks, torch.zeros(m.sinks.shape))


def build_model(config: MoEConfig, states: ExpertStates, device: torch.device, world: int,
                group: dist.ProcessGroup | None = None, *, dense_states: str = "replicated") -> MoEGPT:
    """A model whose MoE layers take their experts from `states` (no expert parameters at all).
    With several ranks the experts are expert-parallel, and `dense_states="fsdp"` shards the dense
    parameters (see `semoe.train.dense_states`): built on the meta device first, no rank ever
    allocates more than its share. Weights are uninitialised (`init_dense`, `Trainer._load_dense`)."""
    with torch.device("meta"):
        model = MoEGPT(config)
    for block in model.layers:
        ffn = block.ffn
        if hasattr(ffn, "router"):
            ffn.use_experts(TrainingExperts(states, ffn.layer))
    if world > 1:
        shard_experts(model, group, provider=lambda ffn: TrainingExperts(states, ffn.layer, states.experts.start))
    if world > 1 and dense_states == "fsdp":
        if config.tie_embeddings:  # tied before sharding: one parameter, in the root unit
            model.lm_head.weight = model.embed.weight
        shard_dense(model, model.layers, device)
    model = model.to_empty(device=device)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; a host tensor goes to a GPU through pinned memory, so the host does not
    wait for the work already queued there."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def use_precision(precision: Precision) -> None:
    """Apply the process-wide part of a precision: TF32 for float32 matmuls and convolutions."""
    if precision.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


# -- the trainer ----------------------------------------------------------------------------


def _given(source: RunStore | None, root: str | None) -> RunStore | None:
    """`source` where it is the store at `root`, else None (to be opened)."""
    if source is None or root is None:
        return None
    return source if os.path.realpath(source.root) == os.path.realpath(root) else None


class Trainer:
    """One rank of a training run (rank 0 of 1 when not distributed)."""

    def __init__(self, cfg: TrainConfig, model_config: MoEConfig | None = None, *,
                 on_step: Callable[[StepLog], None] | None = None, source: RunStore | None = None) -> None:
        """`source`: a store this process has open already (the command line's): the run's own when
        resuming, the `--init-from` store of a new run; used, not opened again, where it is that store."""
        self.cfg = cfg
        self.on_step = on_step
        self._join()
        self._place(cfg)
        self.writer: StoreWriter | None = None
        self.version: int | None = None
        # the run's store, opened once on this rank (a new run's once it is created, in _make_states)
        self.run_store: RunStore | None = None
        self.source: Store | None = None  # the --init-from store of a new run
        resuming = RunStore.exists(cfg.store)
        if resuming:
            self.config, self.trainer_state = self._open_existing(model_config, _given(source, cfg.store))
        else:
            self.config, self.trainer_state = self._new_run_config(model_config, _given(source, cfg.init_from)), None
        self._check_layout()
        self.experts = self._owned_experts()
        self._prepare_data()  # bad data is found before anything is written
        self.comm.barrier()  # rank 0 has checked the store before any rank opens it
        self.states = self._make_states()
        self.adam = AdamWConfig(betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        if resuming:
            self._build()
            self._load_checkpoint()
            self.last_checkpoint = self.step
        else:
            self._start_fresh(self._build_fresh)

    # -- what a subclass (one pipeline stage) changes ----------------------------------------
    def _join(self) -> None:
        """This process's rank and the world size (one rank without torch.distributed)."""
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1

    def _check_layout(self) -> None:
        """Refuse a run whose batch the ranks cannot share."""
        if self.cfg.batch_size % (self.world * self.cfg.micro_batches):
            raise BadInputError(f"--batch-size {self.cfg.batch_size} must divide by ranks x micro-batches "
                                f"({self.world} x {self.cfg.micro_batches})")

    def _owned_experts(self) -> range:
        """The global ids of the experts whose states this rank keeps (expert parallelism)."""
        return local_expert_ids(self.config.num_experts, self.rank, self.world)

    def _build(self) -> None:
        """The model (experts behind the states), its dense parameters and their optimizer."""
        self.states.grad_scale = 1.0 / self.world
        self.model = build_model(self.config, self.states, self.device, self.world,
                                 dense_states=self.cfg.dense_states).train()
        self._make_dense_states(self.cfg.dense_states, self.world)

    def _make_dense_states(self, mode: str, world: int) -> None:
        """`self.dense_states` in `mode` over the model's trainable dense parameters, shared by
        `world` ranks (1: this rank's own); `self.dense` and `self.opt` are its parameters and
        optimizer."""
        cfg = self.cfg
        self.dense_states = DenseStates(mode, [p for _, p in _dense_params(self.model) if p.requires_grad], world,
                                        lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                        overlap=cfg.micro_batches == 1)
        self.dense, self.opt = self.dense_states.params, self.dense_states.opt

    def _build_fresh(self) -> None:
        """A new run's model, with its first dense weights (seeded, or the --init-from store's)."""
        self._build()
        if self.cfg.init_from is None:
            init_dense(self.model, self.cfg.seed)
        else:
            self._load_dense(self.source, self.cfg.init_from)

    def _place(self, cfg: TrainConfig) -> None:
        """The device, precision and collectives of this rank (before any collective)."""
        self.device = torch.device(cfg.device)
        self.precision = training_precision(cfg.precision, cfg.device)
        use_precision(self.precision)
        self.comm = Collectives(self.rank, self.world, object_group() if self.distributed else None,
                                distributed=self.distributed)

    def _start_fresh(self, init_dense_states: Callable[[], None]) -> None:
        """A new run: initialise, commit checkpoint 0, open the next version. On failure nothing was
        committed, so no half-made store is left behind."""
        self.step = self.last_checkpoint = 0
        try:
            init_dense_states()
            self._init_experts()
        except BaseException:
            self.abort()
            if self.rank == 0:
                shutil.rmtree(self.cfg.store, ignore_errors=True)
            raise
        self._open_version()

    def _new_run_config(self, model_config: MoEConfig | None, source: RunStore | None = None) -> MoEConfig:
        """A new run's model: the `--init-from` store's (kept open as `self.source`; `source` where the
        caller has it open), else the one given."""
        cfg = self.cfg
        if cfg.init_from is None:
            if model_config is None:
                raise BadInputError("a new run needs a model config")
            return model_config
        source = source or RunStore.open(cfg.init_from)
        self.source = source.store
        config = source.model_config(f"--init-from {cfg.init_from}")
        if self.source.is_compact() and self.rank == 0:
            fmt = (self.source.manifest.model.get("quantization") or {}).get("format", "compact")
            log.warning("--init-from %s: its experts are quantized (%s), a store for inference; training starts "
                        "from them dequantized to float32", cfg.init_from, fmt)
        return config

    # -- setting up -------------------------------------------------------------------------
    RUN_FILE = TRAINER_FILE  # the side file that makes a store a run of this trainer

    def _open_existing(self, model_config: MoEConfig | None, run_store: RunStore | None = None
                       ) -> tuple[MoEConfig, dict]:
        """The model config and run file of the run being resumed (its store open as `run_store`,
        or opened here), after checking the store."""
        self.run_store = run_store or RunStore.open(self.cfg.store)
        self.run_store.check_resumable(self.RUN_FILE)
        if self.rank == 0 and self.cfg.verify:
            problems = self.run_store.store.verify()
            if problems:
                raise TrainingError(f"{self.cfg.store}: store is damaged, refusing to train: {problems[0]} "
                                    f"({len(problems)} problem(s); `semoe store verify` lists them)")
        config = self.run_store.model_config()
        if model_config is not None and hf_config(model_config) != hf_config(config):
            raise BadInputError(f"{self.cfg.store}: the run's model config differs from the one given; "
                                "drop the model flags to resume")
        return config, self.run_store.state(self.RUN_FILE)

    def _make_states(self, layers: list[int] | None = None) -> ExpertStates:
        """The expert-state backend of this rank's experts of `layers` (default: every MoE layer);
        a new run's store is created here, after the budget is checked."""
        cfg = self.cfg
        layers = self.config.moe_layer_ids if layers is None else layers
        if cfg.expert_states == "ssd":
            total = 3 * ChunkFormat(self.config).nbytes * len(self.experts) * len(layers)
            least = SSDExpertStates.min_cache_bytes(self.config)
            cache = cfg.cpu_cache_bytes if cfg.cpu_cache_bytes is not None else max(least, total // 4)
            if cache < least:
                raise BadInputError(f"--cpu-cache {cache} bytes is too small for expert states of "
                                    f"{ChunkFormat(self.config).nbytes} bytes each; give at least {least} bytes")
        if self.run_store is None:  # a new run: rank 0 creates its store, the others open it
            created = RunStore.create(cfg.store) if self.rank == 0 else None
            self.comm.barrier()
            self.run_store = created or RunStore.open(cfg.store)
        if cfg.expert_states == "ssd":
            settings = SSDStatesConfig(cpu_cache_bytes=cache, grad_budget_bytes=cfg.grad_budget_bytes,
                                       spill_dir=os.path.join(cfg.out, "spill", f"rank{self.rank}"),
                                       read_mode=cfg.read_mode)
            return SSDExpertStates(self.config, self.experts, self.device, store=self.run_store.store,
                                   settings=settings, layers=layers)
        storage = torch.device("cpu") if cfg.expert_states == "cpu" else self.device
        return ResidentExpertStates(self.config, self.experts, self.device, storage, layers=layers, root=cfg.store)

    def _tokenizer(self):
        """The model's own tokenizer (kept in the store) or, for models trained here, the byte tokenizer."""
        from semoe.checkpoints.model_io import load_model_tokenizer

        source = self.run_store.store if self.run_store is not None else self.source
        tok = load_model_tokenizer(source, self.config) if source is not None else None
        if tok is None:
            tok = ByteTokenizer()
            if self.config.vocab_size < tok.vocab_size:
                raise BadInputError(f"the model has no tokenizer.json and the byte tokenizer needs vocab_size >= "
                                    f"{tok.vocab_size}, the model has {self.config.vocab_size}")
        return tok

    def _prepare_data(self) -> None:
        tok = self._tokenizer()
        data_dir = os.path.join(self.cfg.out, "data")
        if self.rank == 0:
            prepare_data(self.cfg.data, data_dir, tok, seed=self.cfg.seed)
        self.comm.barrier()
        self.train_set, self.val_set = prepare_data(self.cfg.data, data_dir, tok, seed=self.cfg.seed)
        self.sampler = BatchSampler(self.train_set, self.cfg.batch_size, self.cfg.seq_len, seed=self.cfg.seed)

    def _open_version(self) -> None:
        """Rank 0 opens the next store transaction; every rank writes its expert chunks into it."""
        if self.rank == 0:
            self.writer = self.run_store.writer()
            fmt = ChunkFormat(self.config)
            for layer in self.config.moe_layer_ids:
                for kind in STATE_KINDS:
                    self.writer.expert_array(layer, kind, num_experts=self.config.num_experts,
                                             chunk_bytes=fmt.nbytes,
                                             layout=chunk_meta(fmt.meta(layer, 0), fmt.offsets))
            version = self.writer.version
        else:
            version = None
        self.version = self.comm.broadcast(version)
        self.states.begin_version(self.version)

    def _init_experts(self) -> None:
        """Fresh experts: each rank initialises (and, for ssd, writes) its own; then checkpoint 0."""
        self._open_version()
        for layer in self.states.layers:
            for e in self.experts:
                self.states.put_initial((layer, e), self._initial_expert(layer, e))
        self.checkpoint()

    @torch.no_grad()
    def _load_dense(self, store: Store, source: str) -> None:
        for name, p in _dense_params(self.model):
            key = hf_name(self.config, name)
            if not store.manifest.has_tensor(key):
                raise BadInputError(f"{source}: tensor {key} is missing")
            t = store.read_dense(key)
            if tuple(t.shape) != tuple(p.shape):
                raise BadInputError(f"{source}: tensor {key} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            assign_full_(p, t)

    def _initial_expert(self, layer: int, e: int) -> tuple[torch.Tensor, ...]:
        if self.cfg.init_from is None:
            return init_expert(self.config, self.cfg.seed, layer, e)
        if not self.source.manifest.has_chunk(layer, e):
            raise BadInputError(f"{self.cfg.init_from}: expert {e} of layer {layer} is missing")
        if self.source.is_compact():
            return tuple(t.float() for t in read_dequantized(self.source, self.config, layer, e))
        ts = self.source.read_expert(layer, e)
        return tuple(ts[n].float() for n in ChunkFormat(self.config).names(layer, e))

    def _load_checkpoint(self) -> None:
        store = self.run_store.store
        st = self.trainer_state
        self.step = int(st["step"])
        self._load_dense(store, self.cfg.store)
        opt_state, rng = self._saved_optimizer(store)
        self._load_dense_optimizer(opt_state)
        torch.set_rng_state(rng)
        self.states.adam_steps = {(l, e): n for l, e, n in st["adam_steps"]
                                  if e in self.experts and l in self.states.layers}
        self.states.restore(store)
        self._open_version()

    def _load_dense_optimizer(self, opt_state: dict) -> None:
        """Load the dense optimizer state a checkpoint holds (the pipeline defers it until its
        plan says where each layer's moments live)."""
        self.dense_states.load_full_state(opt_state)

    def _saved_optimizer(self, store: Store) -> tuple[dict, torch.Tensor]:
        """(dense optimizer state, RNG state) of this rank in the last checkpoint.

        Loaded to the CPU: `torch.set_rng_state` takes a CPU ByteTensor only, and AdamW keeps its
        step counters on the CPU (on the GPU each read of one would be a host sync);
        `load_state_dict` moves the moments to their parameters' device itself."""
        blob = torch.load(io.BytesIO(store.read_file(OPTIMIZER_FILE)), map_location="cpu", weights_only=False)
        return blob["dense_optimizer"], blob["rng"]

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint(self) -> int:
        """Commit the model, optimizers and position as one store version; returns it."""
        self.states.wait_idle()
        dense, opt_state = self._dense_tensors(), self._optimizer_state()  # collectives: on every rank
        written = self.states.checkpoint_entries()
        steps = [[l, e, n] for (l, e), n in sorted(self.states.adam_steps.items())]
        parts = self.comm.gather((written, steps))
        version = None
        if self.rank == 0:
            try:
                version = self._commit(parts, dense, opt_state)
            except (OSError, ValueError, RuntimeError) as e:
                if isinstance(e, OSError) and e.strerror:
                    detail = f"{e.filename + ': ' if e.filename else ''}{e.strerror}"
                else:
                    detail = (str(e).splitlines() or [type(e).__name__])[0]
                raise TrainingError(f"checkpoint of step {self.step} failed ({detail}); nothing of it was kept "
                                    f"and the last checkpoint (step {getattr(self, 'last_checkpoint', 0)}) in "
                                    f"{self.cfg.store} is intact") from e
        version = self.comm.broadcast(version)
        if self.rank == 0:
            self.run_store.gc(keep=1)
        self.comm.barrier()
        return version

    def _commit(self, parts: list, dense: list[tuple[str, torch.Tensor]], opt_state: dict | None) -> int:
        w = self.writer
        for (tensors, chunks), _ in parts:
            w.adopt(tensors, chunks)
        c = self.config
        w.put_file("config.json", json.dumps(hf_config(c), indent=2).encode())
        source = getattr(self, "source", None)
        if source is not None and not w.manifest.has_file("tokenizer.json"):  # keep the model's tokenizer
            for f in source.manifest.files:
                if f.name != "config.json":
                    w.put_file(f.name, source.read_file(f.name))
        for name, t in dense:
            w.put_dense(name, t)
        steps = sorted(x for _, s in parts for x in s)
        for name, data in self._run_files(steps, opt_state).items():
            w.put_file(name, data)
        w.set_model({"source": "semoe-train", "architecture": hf_config(c)["architectures"][0],
                     "model_type": c.arch, "num_layers": c.num_layers, "config": hf_config(c)})
        version = w.commit()
        self.writer = None
        log.info("checkpoint: step %d is store version %d", self.step, version)
        return version

    def _dense_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(store name, full tensor) of every dense parameter a checkpoint holds, on rank 0 (empty
        elsewhere). A collective: sharded parameters are gathered one at a time."""
        out = []
        for name, p in _dense_params(self.model):
            t = full_tensor(p.detach())
            if self.rank == 0:
                out.append((hf_name(self.config, name), t.cpu()))
        return out

    def _optimizer_state(self) -> dict | None:
        """The dense optimizer's state in the checkpoint format, on rank 0 (a collective)."""
        return self.dense_states.full_state(keep=self.rank == 0)

    def _run_files(self, adam_steps: list[list[int]], opt_state: dict | None) -> dict[str, bytes]:
        """The side files that let a run resume: dense optimizer and RNG, step, settings, Adam counts."""
        buf = io.BytesIO()
        torch.save({"dense_optimizer": opt_state, "rng": torch.get_rng_state()}, buf)
        train_cfg = {k: v for k, v in asdict(self.cfg).items() if k not in ("out", "log_json")}
        return {OPTIMIZER_FILE: buf.getvalue(),
                TRAINER_FILE: json.dumps({"step": self.step, "world": self.world, "train_config": train_cfg,
                                          "adam_steps": adam_steps}, indent=1).encode()}

    def abort(self) -> None:
        """Drop what was staged since the last checkpoint (which stays intact)."""
        try:
            self.states.close()  # background writes finish before their folder goes
        finally:
            if self.writer is not None:
                self.writer.abort()
                self.writer = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.abort()  # the empty transaction opened after the last checkpoint
            self.writer = None
        self.states.close()

    # -- the loop -----------------------------------------------------------------------------
    def _rank_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, tgt = self.sampler.batch(self.step)
        per = self.cfg.batch_size // self.world
        lo = self.rank * per
        return to_device(ids[lo:lo + per], self.device), to_device(tgt[lo:lo + per], self.device)

    def train_step(self) -> StepLog:
        cfg, c = self.cfg, self.config
        t0 = time.perf_counter()
        before = self.states.stats()
        lr = cfg.lr_at(self.step)
        self.dense_states.zero_grad()
        ids, tgt = self._rank_batch()
        # Loss sums stay on the device (float64, as exact as summing Python floats) until the one
        # host read of the step.
        ce_sum = aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb_ids, mb_tgt in zip(ids.chunk(cfg.micro_batches), tgt.chunk(cfg.micro_batches)):
            with self.precision.autocast(self.device.type):
                out = self.model(mb_ids)
            ce = F.cross_entropy(out.logits.reshape(-1, c.vocab_size).float(), mb_tgt.reshape(-1))
            loss = ce + c.aux_loss_coef * out.aux_loss + c.z_loss_coef * out.z_loss
            (loss / cfg.micro_batches).backward()
            self.states.end_backward()
            ce_sum = ce_sum + ce.detach()
            aux_sum = aux_sum + out.aux_loss.detach()
        self.dense_states.finish_backward()
        # Losses and the experts' squares add up over ranks; so do the dense gradients' squares
        # when each rank holds a shard of them, while replicated ones (already averaged) count once.
        dense_sq = self.dense_states.grad_sq(self.device)
        partial = self.dense_states.sq_is_partial
        sq = self.states.grad_sq_sum() + dense_sq if partial else self.states.grad_sq_sum()
        summed = self.comm.sum_on_device(torch.stack([ce_sum, aux_sum, sq]))
        n = cfg.micro_batches * self.world
        ce_mean, aux_mean, grad_sq = torch.stack([summed[0] / n, summed[1] / n,
                                                  summed[2] if partial else summed[2] + dense_sq]).tolist()
        return self._finish_step(t0, before, lr, ce_mean, aux_mean, grad_sq)

    def _finish_step(self, t0: float, before: dict, lr: float, ce_mean: float, aux_mean: float, grad_sq: float,
                     extra: dict | None = None) -> StepLog:
        """After backward: check the loss, clip by the global norm, step both optimizers, log."""
        cfg = self.cfg
        if not math.isfinite(ce_mean) or not math.isfinite(aux_mean):
            raise TrainingError(f"step {self.step + 1}: loss is {ce_mean} (aux {aux_mean}); stopping. The last "
                                f"checkpoint in {cfg.store} is intact; lower --lr or check the data")
        grad_norm = math.sqrt(grad_sq)
        coef = 1.0
        if cfg.grad_clip > 0 and grad_norm > cfg.grad_clip:
            coef = cfg.grad_clip / (grad_norm + 1e-6)
            self.dense_states.clip_(coef)
        self.dense_states.step(lr)
        self.states.step(lr, self.adam, coef)
        self.states.end_step()
        self.step += 1
        dt = time.perf_counter() - t0
        after = self.states.stats()
        # what the SSD bytes were: Adam moments read, gradients spilled and read back (the rest of the
        # reads are expert weights, of the writes the three states)
        parts = ("moment_read_bytes", "spill_read_bytes", "spill_written_bytes")
        read, written, hits, misses, rss, dense_bytes, *split = self.comm.sum([
            after.get("ssd_read_bytes", 0) - before.get("ssd_read_bytes", 0),
            after.get("ssd_written_bytes", 0) - before.get("ssd_written_bytes", 0),
            after.get("cpu_hits", 0) - before.get("cpu_hits", 0),
            after.get("cpu_misses", 0) - before.get("cpu_misses", 0), float(peak_rss_bytes()),
            float(self.dense_states.nbytes()["total"]), *(after.get(k, 0) - before.get(k, 0) for k in parts)])
        hit_rate = hits / (hits + misses) if hits + misses else None
        if any(k in after for k in parts):
            extra = {**dict(zip(parts, (int(x) for x in split))), **(extra or {})}
        return StepLog(step=self.step, loss=ce_mean, aux_loss=aux_mean, lr=lr, grad_norm=grad_norm,
                       tokens_per_s=cfg.batch_size * cfg.seq_len / dt, step_s=dt, cpu_hit_rate=hit_rate,
                       ssd_read_gbps=read / dt / 1e9, ssd_write_gbps=written / dt / 1e9, peak_rss_bytes=int(rss),
                       dense_bytes_per_rank=int(dense_bytes / self.world), extra=extra or {})

    @torch.no_grad()
    def evaluate(self, batches: int = 4) -> float:
        """Mean cross-entropy on validation windows (fixed: the same every call)."""
        if self.val_set.num_tokens < self.cfg.seq_len + 1:
            return float("nan")
        sampler = BatchSampler(self.val_set, self.cfg.batch_size, self.cfg.seq_len, seed=self.cfg.seed + 1)
        self.model.eval()
        try:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for i in range(batches):
                ids, tgt = sampler.batch(i)
                per = self.cfg.batch_size // self.world
                ids, tgt = ids[self.rank * per:(self.rank + 1) * per], tgt[self.rank * per:(self.rank + 1) * per]
                with self.precision.autocast(self.device.type):
                    logits = self.model(to_device(ids, self.device)).logits
                total = total + F.cross_entropy(logits.reshape(-1, self.config.vocab_size).float(),
                                                to_device(tgt, self.device).reshape(-1))
            return self.comm.sum_on_device(total).item() / (batches * self.world)
        finally:
            self.model.train()

    def run(self) -> list[StepLog]:
        """Train up to `cfg.steps`, checkpointing every `checkpoint_every` steps and at the end."""
        logs: list[StepLog] = []
        try:
            while self.step < self.cfg.steps:
                entry = self.train_step()
                logs.append(entry)
                if self.on_step is not None:
                    self.on_step(entry)
                if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                    self.checkpoint()
                    self.last_checkpoint = self.step
                    if self.step < self.cfg.steps:
                        self._open_version()
        except BaseException as e:
            try:
                self.abort()
            except BaseException:
                log.debug("cleanup after a failed step failed too", exc_info=True)
            if isinstance(e, OSError) and e.errno in _NO_SPACE:
                raise TrainingError(f"{e.filename or self.cfg.store}: {e.strerror} while writing step {self.step}; "
                                    f"stopped. The last checkpoint (step {self.last_checkpoint}) in {self.cfg.store} "
                                    f"is intact; free space and run again with --resume") from e
            raise
        self.close()
        return logs


def run_rank(cfg: TrainConfig, model_config: MoEConfig | None, *, quiet: bool = False,
             factory: Callable[..., Trainer] | None = None, source: RunStore | None = None) -> list[StepLog]:
    """One rank's whole run with logging: the JSON log and the progress line from rank 0.
    `factory(cfg, model_config, on_step=...)` builds the trainer (default: `Trainer`, handed
    `source`, the store the command line has open)."""
    log_file = None
    trainer: Trainer | None = None

    def on_step(entry: StepLog) -> None:
        if trainer is None or trainer.rank != 0:
            return
        if log_file is not None:
            log_file.write(json_line(entry) + "\n")
            log_file.flush()
        if not quiet:
            print(progress_line(entry, cfg.steps), file=sys.stderr, flush=True)

    if factory is None:
        trainer = Trainer(cfg, model_config, on_step=on_step, source=source)
    else:
        trainer = factory(cfg, model_config, on_step=on_step)
    if trainer.rank == 0 and cfg.log_json:
        log_file = open(cfg.log_json, "a", encoding="utf-8")
    try:
        return trainer.run()
    finally:
        if log_file is not None:
            log_file.close()
