"""What a training run is given and what it reports: its settings (`TrainConfig`), one line of its
log (`StepLog`), its one-line failure (`TrainingError`), and the sizes and memory figures both
depend on."""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, ContextManager

import torch

from semoe.model.config import MoEConfig
from semoe.train.expert_states import ChunkFormat
from storage.errors import BadInputError, StorageError
from storage.chunk_io import ReadMode

EXPERT_STATES = ("ssd", "cpu", "device")
DENSE_STATES = ("replicated", "zero1", "fsdp")
PRECISIONS = ("auto", "bf16", "fp32")


class TrainingError(StorageError):
    """Training cannot go on (non-finite loss, a damaged store, a full disk); one line, exit code 1."""

    exit_code = 1


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a run needs besides the model config; saved with each checkpoint."""

    out: str
    data: str | None = None
    steps: int = 200
    seed: int = 0
    batch_size: int = 8  # sequences per step, over all ranks
    seq_len: int = 128
    micro_batches: int = 1  # per rank; gradients accumulate over them
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: no clipping
    expert_states: str = "ssd"
    cpu_cache_bytes: int | None = None  # ssd: CPU cache for expert states; None: 25% of their bytes
    grad_budget_bytes: int | None = None  # ssd: expert gradients kept in memory; None: as the cache
    device: str = "cpu"  # cpu, cuda or cuda:N
    # auto: bf16 autocast on CUDA (float32 weights, gradients and optimizer states), float32 on CPU
    precision: str = "auto"
    checkpoint_every: int = 50
    log_json: str | None = None
    read_mode: ReadMode = ReadMode.DIRECT  # how expert states are read: direct | drop | cached
    # with several ranks: replicated (every rank holds all dense states), zero1 (each keeps the
    # AdamW moments of its share of the dense parameters), fsdp (parameters, gradients and
    # moments sharded with FSDP2); see semoe.train.dense_states
    dense_states: str = "zero1"
    verify: bool = True  # check every checksum of the store before resuming
    init_from: str | None = None  # a model store (imported or trained) to start from instead of random weights

    def __post_init__(self) -> None:
        try:
            self.read_mode = ReadMode(self.read_mode)
        except ValueError:
            raise BadInputError(f"--read-mode must be one of {', '.join(m.value for m in ReadMode)}, "
                                f"got {self.read_mode!r}") from None
        if self.expert_states not in EXPERT_STATES:
            raise BadInputError(f"--expert-states must be one of {', '.join(EXPERT_STATES)}, got {self.expert_states!r}")
        for name in ("steps", "batch_size", "seq_len", "micro_batches", "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise BadInputError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if not self.lr > 0:
            raise BadInputError(f"--lr must be > 0, got {self.lr}")
        if self.grad_clip < 0:
            raise BadInputError(f"--grad-clip must be >= 0, got {self.grad_clip}")
        if self.dense_states not in DENSE_STATES:
            raise BadInputError(f"--dense-states must be one of {', '.join(DENSE_STATES)}, got {self.dense_states!r}")
        if self.precision not in PRECISIONS:
            raise BadInputError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        parse_device(self.device)
        self.betas = tuple(self.betas)

    @property
    def store(self) -> str:
        return os.path.join(self.out, "store")

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to `min_lr_ratio * lr` at `steps`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def parse_device(name: str) -> torch.device:
    """`name` as a training device (cpu, cuda or cuda:N); BadInputError naming --device otherwise.
    Whether the GPU exists is checked where the ranks are placed (`tools.train_cmd`)."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise BadInputError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    return dev


@dataclass(frozen=True)
class Precision:
    """How a step computes: `autocast_dtype` None runs float32 throughout; bfloat16 runs matmuls
    and attention in bf16 under autocast while weights, gradients and optimizer states stay
    float32 (the master copy). `tf32` lets the remaining float32 matmuls use TF32 tensor cores."""

    autocast_dtype: torch.dtype | None
    tf32: bool

    def autocast(self, device_type: str) -> ContextManager:
        """The context a forward pass runs in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)


def training_precision(precision: str, device: str) -> Precision:
    """The `Precision` of `--precision` on `device`: auto is bf16 with TF32 on CUDA (an H100 runs
    float32 at a fraction of its bf16 rate) and exact float32 on CPU, whose tests pin bit-identical
    results."""
    cuda = parse_device(device).type == "cuda"
    if precision not in PRECISIONS:
        raise BadInputError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32" or (precision == "auto" and not cuda):
        return Precision(autocast_dtype=None, tf32=False)
    return Precision(autocast_dtype=torch.bfloat16, tf32=cuda)


@dataclass
class StepLog:
    """One line of `--log-json`."""

    step: int
    loss: float
    aux_loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_s: float
    cpu_hit_rate: float | None
    ssd_read_gbps: float
    ssd_write_gbps: float
    peak_rss_bytes: int
    dense_bytes_per_rank: int = 0  # dense parameters, gradients and AdamW moments held, mean over ranks
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


def json_line(entry: StepLog) -> str:
    return json.dumps(entry.to_json(), sort_keys=True)


def progress_line(entry: StepLog, total: int) -> str:
    hit = "-" if entry.cpu_hit_rate is None else f"{entry.cpu_hit_rate:.2f}"
    return (f"step {entry.step}/{total}  loss {entry.loss:.4f}  aux {entry.aux_loss:.4f}  lr {entry.lr:.2e}  "
            f"{entry.tokens_per_s:,.0f} tok/s  cpu hit {hit}  ssd read {entry.ssd_read_gbps:.2f} GB/s  "
            f"write {entry.ssd_write_gbps:.2f} GB/s")


def expert_state_bytes(config: MoEConfig) -> int:
    """Bytes of every expert's weight and both Adam moments as stored (chunk files)."""
    return 3 * ChunkFormat(config).nbytes * config.num_experts * len(config.moe_layer_ids)
