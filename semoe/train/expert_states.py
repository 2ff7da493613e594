"""Expert training states (weight, gradient, Adam moments) kept outside the autograd graph.

SE-MoE's hierarchical storage for training: dense parameters stay ordinary `nn.Parameter`s on the
device, while every expert's states live in an `ExpertStates` backend and flow through the model
only while they are used:

    forward    the layer asks for an expert's weights (`fetch`), runs it, keeps its input and
               pre-activations but not the weights
    backward   the same expert is fetched again, its input gradient returned to autograd and its
               weight gradient handed to the backend (`add_grad`)
    step       the backend updates every expert that received a gradient with AdamW, tile by tile

Backends: `ResidentExpertStates` holds everything in memory (`--expert-states device`, or `cpu` to
keep states in host memory and compute on the device); `SSDExpertStates` (in `semoe.train.ssd_states`)
keeps them in the store behind the LFU CPU cache. Both run the same math in the same order, so
on CPU they give bit-identical results. On CUDA, `device` steps AdamW on the GPU while `cpu` and
`ssd` step it on the host: the same arithmetic, rounded by different kernels, so the modes agree
within float32 rounding there.

Precision: states and gradients are float32. Under autocast the expert runs in the autocast dtype
(bf16) and its backward in the dtype its forward used; weight gradients reach the backend as float32.

Experts are updated only when routed to (sparse AdamW, as SE-MoE): an expert without tokens in a
step keeps its weights and moments, and its own step count drives the bias correction.

Shape legend: M rows routed to one expert, D hidden size, F expert FFN size.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from semoe.model.expert_layout import hf_expert_names
from semoe.model.config import MoEConfig
from semoe.model.experts import ExpertMLP, ExpertWeights, SwiGLU, expert_mlp
from storage.errors import StorageError
from storage.manifest import ChunkEntry, TensorEntry
from storage.layout import chunk_layout, expert_array_rel
from storage.store import ExpertTensor, Store, write_expert_chunk

# An expert of the model being trained, (layer, global expert id): its identity across its three
# state kinds (STATE_KINDS), which the tier and the store name as ExpertKey(layer, expert, kind).
Key = tuple[int, int]
STATE_KINDS = ("weight", "adam_m", "adam_v")  # an expert's chunks in a checkpoint


@dataclass(kw_only=True)
class AdamWConfig:
    """Hyper-parameters of the expert optimizer (the learning rate comes per step)."""

    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1


def adamw_(ws: Sequence[torch.Tensor], gs: Sequence[torch.Tensor], ms: Sequence[torch.Tensor],
           vs: Sequence[torch.Tensor], *, step: int, lr: float, cfg: AdamWConfig, clip_coef: float = 1.0) -> None:
    """One AdamW update in place of an expert's tensors (weights `ws`, gradients `gs` scaled by
    `clip_coef` first, moments `ms`, `vs`), all at one step count: torch's fused AdamW kernel
    (`torch.optim.AdamW(fused=True)`), one call and one pass over each tensor where the single-tensor
    form makes seven and a temporary the size of the weight (3.3x faster on a CPU core for an expert
    of 0.4 M parameters). Every expert-state backend steps through it, so they agree bit for bit."""
    if clip_coef != 1.0:
        torch._foreach_mul_(list(gs), clip_coef)
    b1, b2 = cfg.betas
    steps = torch.full((), float(step), dtype=torch.float32, device=ws[0].device)
    torch._fused_adamw_(list(ws), list(gs), list(ms), list(vs), [], [steps] * len(ws), lr=lr, beta1=b1, beta2=b2,
                        weight_decay=cfg.weight_decay, eps=cfg.eps, amsgrad=False, maximize=False)


def sum_of_squares(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squares of every element of `tensors`, a float64 scalar on `device`.

    One fused norm kernel per (device, dtype) group and no host read: reading a norm per tensor
    would make the host wait for the device once per parameter."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (dev, _), ts in groups.items():
        total += squared_norms_sum(torch._foreach_norm(ts), device)
    return total


def squared_norms_sum(norms: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of `norms` (one device and dtype), in float64 on `device`: the
    arithmetic `sum_of_squares` applies to each group's norms, for norms taken ahead of time."""
    sq = torch.stack(list(norms)).double().square().sum()
    return sq if sq.device == torch.device(device) else sq.to(device)


def init_expert(config: MoEConfig, seed: int, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
    """An expert's initial tensors (SwiGLU: gate (F, D), up (F, D), down (D, F); biases zero), from its
    own seeded generator, so it does not depend on how many ranks share the experts or in which
    order they are built."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + layer * 65_537 + expert) % (1 << 63))
    return tuple(torch.zeros(shape) if len(shape) == 1 else torch.empty(shape).normal_(0.0, 0.02, generator=g)
                 for shape in expert_mlp(config).shapes(config))


class ChunkFormat:
    """How one expert's float32 tensors (its MLP variant's, in order) are packed in a chunk file."""

    def __init__(self, config: MoEConfig) -> None:
        self.config = config
        self.mlp = expert_mlp(config)
        self.shapes = list(self.mlp.shapes(config))
        self.offsets, self.nbytes = chunk_layout([(torch.float32, s) for s in self.shapes])

    def names(self, layer: int, expert: int) -> tuple[str, ...]:
        return hf_expert_names(self.config, layer, expert)

    def views(self, raw: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of the tensors in a chunk's bytes (uint8, at least `nbytes`)."""
        out = []
        for off, shape in zip(self.offsets, self.shapes):
            n = 4 * math.prod(shape)
            out.append(raw[off:off + n].view(torch.float32).view(shape))
        return out

    def pack(self, tensors: list[torch.Tensor]) -> np.ndarray:
        buf = np.zeros(self.nbytes, dtype=np.uint8)
        for view, t in zip(self.views(torch.from_numpy(buf)), tensors):
            view.copy_(t)
        return buf

    def meta(self, layer: int, expert: int) -> list[ExpertTensor]:
        return [ExpertTensor(name=n, tensor=torch.empty(s, device="meta"), stacked=self.mlp.stacked) for n, s in
                zip(self.names(layer, expert), self.shapes)]

    def write(self, root: str, version: int, layer: int, expert: int, kind: str, buf: np.ndarray, *,
              direct: bool = False) -> tuple[list[TensorEntry], ChunkEntry]:
        """Write one chunk file into a staged version (`direct`: past the page cache where it can);
        returns its manifest entries."""
        return write_expert_chunk(root, expert_array_rel(version, layer, kind), version, layer, expert, kind,
                                  self.meta(layer, expert), buf, self.offsets, direct=direct)


class ExpertStates(ABC):
    """The states of the experts this rank owns: `experts` (global ids) of every MoE layer."""

    def __init__(self, config: MoEConfig, experts: range, device: torch.device,
                 layers: list[int] | None = None) -> None:
        self.config = config
        self.layers = list(config.moe_layer_ids if layers is None else layers)  # a pipeline stage has a few
        self.experts = experts
        self.device = device
        self.adam_steps: dict[Key, int] = {}  # updates each expert has had
        self.grad_scale = 1.0  # applied to every gradient handed in (1/world for data-parallel means)
        self._used: dict[int, list[int]] = {}  # layer -> experts fetched in this step's forward
        self._last_used: dict[int, list[int]] = {}  # the same, of the step before
        self._backward_seen: set[int] = set()
        self.version: int | None = None  # the staged store version checkpoint writes go to

    # -- checkpoints: each backend writes and restores its own states --------------------------
    def begin_version(self, version: int) -> None:
        """Write from now on into staged `version` (whose expert arrays the trainer has created)."""
        self.version = version

    @abstractmethod
    def put_initial(self, key: Key, weights: tuple[torch.Tensor, ...]) -> None:
        """A new run's expert weights (moments zero); part of the next checkpoint."""

    def restore(self, store: Store) -> None:
        """Take the expert states of `store`'s committed version (a resumed run); by default the
        backend reads them from the store when they are used."""

    @abstractmethod
    def checkpoint_entries(self) -> tuple[list[TensorEntry], list[ChunkEntry]]:
        """Write what changed since the last checkpoint into the staged version; the entries of
        every chunk written there, for the checkpoint to adopt."""

    # -- the data path the autograd function uses -------------------------------------------
    @abstractmethod
    def fetch(self, layer: int, expert: int) -> "Held":
        """The expert's weights on the compute device, valid until `Held.release()`."""

    @abstractmethod
    def add_grad(self, layer: int, expert: int, grads: tuple[torch.Tensor, ...]) -> None:
        """Accumulate a weight gradient (gate, up, down) for this step."""

    def add_grad_factors(self, layer: int, expert: int, factors: GradFactors) -> None:
        """A SwiGLU expert's weight gradient as its products (backward's call). By default made now,
        into `grad_out`'s memory where the backend offers it, and handed to `add_grad`."""
        out = self.grad_out(layer, expert) if factors.dtype == torch.float32 else None
        self.add_grad(layer, expert, factors.grads(out))

    def grad_out(self, layer: int, expert: int) -> list[torch.Tensor] | None:
        """float32 tensors shaped as the expert's weights for backward to compute its gradient into,
        then handed to `add_grad`; None: backward allocates them."""
        return None

    def prefetch(self, layer: int, experts: list[int], priority: float = 0.0) -> None:
        """A hint: these experts' weights will be fetched soon (lower priority first)."""

    def begin_forward_layer(self, layer: int, experts: list[int]) -> None:
        """Called as a layer's forward starts, with the experts it will run: reads them ahead, in order."""
        self._used[layer] = list(experts)
        self.prefetch(layer, list(experts), 0.0)

    def end_forward_layer(self, layer: int) -> None:
        """Called when a layer's experts have run: the next layer's are read while attention computes,
        those it ran last step (routing changes little from step to step; all of them on the first).
        Reading every expert would read those no token chooses and push out weights backward needs."""
        nxt = [l for l in self.layers if l > layer]
        if nxt:
            self.prefetch(nxt[0], list(self._last_used.get(nxt[0], self.experts)), 1.0)

    def begin_backward_layer(self, layer: int) -> None:
        """Called once per layer as its backward starts: this layer's experts first, then the previous
        layer's (2D prefetch: while this layer computes, the next one in backward order is staged)."""
        if layer in self._backward_seen:
            return
        self._backward_seen.add(layer)
        self.prefetch(layer, self._used.get(layer, []), 0.0)
        prev = [l for l in self.layers if l < layer]
        if prev and prev[-1] in self._used:
            self.prefetch(prev[-1], self._used[prev[-1]], 1.0)

    def end_backward(self) -> None:
        """Called after each backward pass (one per micro-batch)."""
        self._backward_seen.clear()

    # -- the optimizer ------------------------------------------------------------------------
    @abstractmethod
    def touched(self) -> list[Key]:
        """Experts that received a gradient this step, in update order."""

    def _grads(self, key: Key) -> list[torch.Tensor]:
        """This step's (gate, up, down) gradient of a touched expert."""
        raise NotImplementedError

    def grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of every expert gradient of this step (after `grad_scale`), a float64
        scalar on `device`: the caller reads it together with its own numbers, in one host sync."""
        return sum_of_squares([g for key in self.touched() for g in self._grads(key)], self.device)

    def grad_sq_norm(self) -> float:
        """`grad_sq_sum` as a number."""
        return float(self.grad_sq_sum())

    @abstractmethod
    def step(self, lr: float, cfg: AdamWConfig, clip_coef: float = 1.0) -> None:
        """AdamW on every touched expert with gradients times `clip_coef`; clears the gradients."""

    def wait_idle(self) -> None:
        """Wait for background work of the last `step` (an asynchronous backend's updates and writes)."""

    def next_adam_step(self, key: Key) -> int:
        n = self.adam_steps.get(key, 0) + 1
        self.adam_steps[key] = n
        return n

    # -- lifetime -----------------------------------------------------------------------------
    def end_step(self) -> None:
        if self._used:
            self._last_used = dict(self._used)
        self._used.clear()
        self._backward_seen.clear()

    def discard_grads(self) -> None:
        """Forget this step's expert gradients (a profiling pass's, which must not train anything)."""
        self.end_step()

    def sample_weights(self) -> list[torch.Tensor] | None:
        """One expert's weight tensors where this backend steps them in memory, for timing the
        expert optimizer step; None where the step is bound by reads and writes instead."""
        return None

    def stats(self) -> dict:
        """Counters for the step log: cpu_hit_rate, ssd bytes read and written, seconds of I/O."""
        return {}

    def close(self) -> None:
        """Stop background work."""


class Held:
    """Weights on loan from a backend; `release()` gives them back."""

    def __init__(self, *parts: torch.Tensor, release=None) -> None:
        self.parts = parts  # in the expert MLP variant's order
        self._release = release

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None

    def __enter__(self) -> "Held":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class GradFactors:
    """One SwiGLU expert's weight gradient as the products it is made of: (gate, up, down) =
    (dg^T x, du^T x, dy^T h) over its M rows. Where M is small these hold far fewer bytes than the
    gradient itself (M x (2D + 3F) against 3 x D x F floats), so a backend may keep them and make the
    gradient when it steps the expert; made by `grads`, it is the same bits backward would make."""

    x_MD: torch.Tensor
    dg_MF: torch.Tensor
    du_MF: torch.Tensor
    dy_MD: torch.Tensor
    h_MF: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x_MD, self.dg_MF, self.du_MF, self.dy_MD, self.h_MF))

    @property
    def dtype(self) -> torch.dtype:
        return self.dg_MF.dtype

    def grads(self, out: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """The float32 gradient (gate, up, down): into `out` (float32 factors only) or allocated."""
        if out is None:
            return ((self.dg_MF.t() @ self.x_MD).float(), (self.du_MF.t() @ self.x_MD).float(),
                    (self.dy_MD.t() @ self.h_MF).float())
        return (torch.mm(self.dg_MF.t(), self.x_MD, out=out[0]), torch.mm(self.du_MF.t(), self.x_MD, out=out[1]),
                torch.mm(self.dy_MD.t(), self.h_MF, out=out[2]))


class _ExpertFFN(torch.autograd.Function):
    """SwiGLU of one expert whose weights are fetched from the backend in forward and again in
    backward, and whose weight gradient goes to the backend instead of a `.grad`."""

    @staticmethod
    def forward(ctx, x_MD: torch.Tensor, gate_FD: torch.Tensor, up_FD: torch.Tensor, down_DF: torch.Tensor,
                states: ExpertStates, layer: int, expert: int) -> torch.Tensor:
        g_MF, u_MF = F.linear(x_MD, gate_FD), F.linear(x_MD, up_FD)
        ctx.save_for_backward(x_MD, g_MF, u_MF)
        ctx.key = (states, layer, expert)
        return F.linear(F.silu(g_MF) * u_MF, down_DF)

    @staticmethod
    def backward(ctx, dy_MD: torch.Tensor):
        x_MD, g_MF, u_MF = ctx.saved_tensors
        states, layer, expert = ctx.key
        states.begin_backward_layer(layer)
        # Backward runs in the dtype forward computed in (bf16 under autocast, which backward does
        # not see); in float32 every cast below is a no-op.
        dt = g_MF.dtype
        dy_MD, xc_MD = dy_MD.to(dt), x_MD.to(dt)
        a_MF = F.silu(g_MF)
        h_MF = a_MF * u_MF
        with states.fetch(layer, expert) as w:
            gate_FD, up_FD, down_DF = w.parts
            dh_MF = dy_MD @ down_DF.to(dt)
            dg_MF = torch.ops.aten.silu_backward(dh_MF * u_MF, g_MF)  # one fused pass: d silu(g) / dg
            du_MF = dh_MF * a_MF
            dx_MD = dg_MF @ gate_FD.to(dt) + du_MF @ up_FD.to(dt)
        if x_MD.shape[0]:  # an expert run on no rows (expert parallelism keeps graphs alike) learns nothing
            states.add_grad_factors(layer, expert, GradFactors(xc_MD, dg_MF, du_MF, dy_MD, h_MF))
        return dx_MD.to(x_MD.dtype), None, None, None, None, None, None


class _RecomputedExpert(torch.autograd.Function):
    """Any expert MLP variant, its weights fetched again in backward and its forward recomputed
    there under autograd; weight gradients go to the backend. (SwiGLU has the hand-derived
    `_ExpertFFN`, which keeps its pre-activations instead of recomputing; this is its reference.)"""

    @staticmethod
    def forward(ctx, x_MD: torch.Tensor, mlp: ExpertMLP, states: ExpertStates, layer: int, expert: int,
                *parts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_MD)
        ctx.key = (mlp, states, layer, expert)
        return mlp.apply(x_MD, parts)

    @staticmethod
    def backward(ctx, dy_MD: torch.Tensor):
        (x_MD,) = ctx.saved_tensors
        mlp, states, layer, expert = ctx.key
        states.begin_backward_layer(layer)
        with states.fetch(layer, expert) as w, torch.enable_grad():
            x = x_MD.detach().requires_grad_()
            leaves = [p.detach().to(x.dtype).requires_grad_() for p in w.parts]
            grads = torch.autograd.grad(mlp.apply(x, tuple(leaves)), [x, *leaves], dy_MD.to(x.dtype))
        if x_MD.shape[0]:
            states.add_grad(layer, expert, tuple(g.float() for g in grads[1:]))
        return (grads[0].to(x_MD.dtype), None, None, None, None, *(None for _ in leaves))


@dataclass(frozen=True)
class _TrainedExpert(ExpertWeights):
    states: ExpertStates
    layer: int
    expert: int

    def apply(self, x_MD: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return super().apply(x_MD)
        if isinstance(self.mlp, SwiGLU):
            return _ExpertFFN.apply(x_MD, *self.parts, self.states, self.layer, self.expert)
        return _RecomputedExpert.apply(x_MD, self.mlp, self.states, self.layer, self.expert, *self.parts)


class TrainingExperts:
    """The `ExpertProvider` of one MoE layer in training: local expert index -> backend states."""

    def __init__(self, states: ExpertStates, layer: int, first: int = 0) -> None:
        self.states = states
        self.mlp = expert_mlp(states.config)
        self.layer = layer
        self.first = first  # global id of local index 0 (expert parallelism)

    def stream(self, layer: int, experts: list[int], x_ND: torch.Tensor) -> Iterator[tuple[int, ExpertWeights]]:
        ids = [self.first + e for e in experts]
        self.states.begin_forward_layer(layer, ids)
        for e, gid in zip(experts, ids):
            held = self.states.fetch(layer, gid)
            try:
                yield e, _TrainedExpert(held.parts, self.mlp, states=self.states, layer=layer, expert=gid)
            finally:
                held.release()
        self.states.end_forward_layer(layer)


class ResidentExpertStates(ExpertStates):
    """All local experts' states in memory on `storage_device`; computed on `device`."""

    def __init__(self, config: MoEConfig, experts: range, device: torch.device,
                 storage_device: torch.device | None = None, layers: list[int] | None = None, *,
                 root: str | None = None) -> None:
        super().__init__(config, experts, device, layers)
        self.root = root  # the store checkpoints are written to
        self.format = ChunkFormat(config)
        self.storage_device = storage_device or device
        self.w: dict[Key, list[torch.Tensor]] = {}
        self.m: dict[Key, list[torch.Tensor]] = {}
        self.v: dict[Key, list[torch.Tensor]] = {}
        self.g: dict[Key, list[torch.Tensor]] = {}
        self.dirty: set[Key] = set()  # updated since the last checkpoint

    def load(self, key: Key, w: tuple[torch.Tensor, ...], m: tuple[torch.Tensor, ...] | None = None,
             v: tuple[torch.Tensor, ...] | None = None) -> None:
        """Set one expert's states (moments default to zeros)."""
        dev = self.storage_device
        self.w[key] = [t.to(dev, torch.float32, copy=True) for t in w]
        self.m[key] = [t.to(dev, torch.float32, copy=True) for t in m] if m else [torch.zeros_like(t) for t in
                                                                                   self.w[key]]
        self.v[key] = [t.to(dev, torch.float32, copy=True) for t in v] if v else [torch.zeros_like(t) for t in
                                                                                   self.w[key]]

    def fetch(self, layer: int, expert: int) -> Held:
        ws = self.w[(layer, expert)]
        if self.storage_device != self.device:
            ws = [t.to(self.device, non_blocking=True) for t in ws]
        return Held(*ws)

    def add_grad(self, layer: int, expert: int, grads: tuple[torch.Tensor, ...]) -> None:
        key = (layer, expert)
        grads = [g.to(self.storage_device, torch.float32) * self.grad_scale if self.grad_scale != 1.0 else
                 g.to(self.storage_device, torch.float32) for g in grads]
        if key in self.g:
            for acc, g in zip(self.g[key], grads):
                acc.add_(g)
        else:
            self.g[key] = grads

    def touched(self) -> list[Key]:
        return sorted(self.g)

    def discard_grads(self) -> None:
        super().discard_grads()
        self.g.clear()

    def sample_weights(self) -> list[torch.Tensor] | None:
        return next(iter(self.w.values()), None)

    def _grads(self, key: Key) -> list[torch.Tensor]:
        return self.g[key]

    @torch.no_grad()
    def step(self, lr: float, cfg: AdamWConfig, clip_coef: float = 1.0) -> None:
        for key in self.touched():
            self.dirty.add(key)
            adamw_(self.w[key], self.g[key], self.m[key], self.v[key], step=self.next_adam_step(key), lr=lr,
                   cfg=cfg, clip_coef=clip_coef)
        self.g.clear()

    def put_initial(self, key: Key, weights: tuple[torch.Tensor, ...]) -> None:
        self.load(key, weights)
        self.dirty.add(key)

    def restore(self, store: Store) -> None:
        m = store.manifest
        for layer in self.layers:
            for e in self.experts:
                kinds = {kind: [store.read_expert(layer, e, kind)[n] for n in self.format.names(layer, e)]
                         for kind in STATE_KINDS if m.has_chunk(layer, e, kind)}
                if "weight" not in kinds:
                    raise StorageError(f"{store.root}: expert {e} of layer {layer} is missing")
                self.load((layer, e), kinds["weight"], kinds.get("adam_m"), kinds.get("adam_v"))

    def checkpoint_entries(self) -> tuple[list[TensorEntry], list[ChunkEntry]]:
        if self.root is None:
            raise ValueError("ResidentExpertStates was built without a store root: it cannot checkpoint")
        tensors, chunks = [], []
        for key in sorted(self.dirty):
            for kind, ts in self.states_of(key).items():
                if kind != "weight" and self.adam_steps.get(key, 0) == 0:
                    continue  # moments of a never-updated expert are zeros: not written
                entries, chunk = self.format.write(self.root, self.version, key[0], key[1], kind,
                                                   self.format.pack(ts))
                tensors.extend(entries)
                chunks.append(chunk)
        self.dirty.clear()
        return tensors, chunks

    def states_of(self, key: Key) -> dict[str, list[torch.Tensor]]:
        """weight / adam_m / adam_v tensors of one expert (for checkpoints), on the CPU."""
        return {"weight": [t.cpu() for t in self.w[key]], "adam_m": [t.cpu() for t in self.m[key]],
                "adam_v": [t.cpu() for t in self.v[key]]}
