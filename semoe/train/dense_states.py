"""Where the dense half of a data-parallel run lives: its parameters, their gradients' reduction
and their AdamW moments, in one of three modes (`--dense-states`):

    replicated  every rank holds every dense parameter, gradient and moment; gradients are
                averaged with bucketed all-reduces overlapped with backward
    zero1       as replicated, but each rank keeps (and steps) the moments of its share of the
                parameters only and broadcasts its updated share (ZeRO stage 1, torch's
                ZeroRedundancyOptimizer); the same numbers as replicated
    fsdp        parameters, gradients and moments are all sharded across the ranks (PyTorch's
                FSDP2, `fully_shard` per block and at the root). A block's parameters are
                all-gathered just before it runs and freed after it, one block ahead: block i+1's
                gather is issued when block i starts, in forward, and block i-1's when block i
                starts its backward, while the sparse experts are prefetched from the store by
                their own backend. Gradients are reduce-scattered; each rank steps AdamW on its
                shard. Per-rank dense memory is about 1/N of replicated.

All three give the same numbers up to float32 reduction order (a test pins it on 2 ranks), and
their checkpoints are one format: full dense tensors in the store and a full (unsharded) optimizer
state keyed by parameter position, so a run may resume in another mode.

The sharding rule is FSDP2's (dim 0 in `torch.chunk` pieces); `_shard_like` and `full_tensor`
are the only places that translate between a full tensor and this rank's piece.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from semoe.train.expert_states import sum_of_squares
from semoe.train.fused_comm import GradBucketReducer, fused_all_reduce
from semoe.train.config import DENSE_STATES

# what runs before --dense-states saved as `dense_optimizer`
LEGACY_DENSE_OPTIMIZER = {"sharded": "zero1", "replicated": "replicated"}


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t` (`t` itself when it is not sharded)."""
    return t.to_local() if _is_dtensor(t) else t


def _shard_like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`full` (whole on every rank) as a tensor sharded like the sharded parameter `p`: each rank
    keeps its own piece, with no communication."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(device=p.device, dtype=p.dtype), p.device_mesh, p.placements,
                             src_data_rank=None)


@torch.no_grad()
def assign_full_(p: torch.Tensor, full: torch.Tensor) -> None:
    """Set parameter `p` to the full tensor `full` (given whole on every rank)."""
    if _is_dtensor(p):
        p.to_local().copy_(_shard_like(full, p).to_local())
    else:
        p.copy_(full)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t`: a sharded tensor is all-gathered (a collective: every rank calls it, in
    the same order)."""
    return t.full_tensor() if _is_dtensor(t) else t


def shard_dense(model: nn.Module, blocks: Iterable[nn.Module], device: torch.device) -> None:
    """Apply FSDP2 to `model`: one unit per block of `blocks`, the rest (embedding, final norm,
    head) in the root unit; each block's gather prefetches the next one's in forward and the
    previous one's in backward. Call it on the meta-device model, before `to_empty`, so no rank
    ever holds the full dense weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = list(blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in (*blocks, model):
        # sum, then divide by the world size: the replicated all-reduce's arithmetic, so the two
        # modes' gradients are the same numbers (NCCL's AVG would round differently)
        unit.set_force_sum_reduction_for_comms(True)
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])


class DenseStates:
    """The dense parameters `params` of this rank's model, the reduction of their gradients over
    the ranks and their AdamW optimizer `opt`, in mode `mode` (see the module docstring)."""

    def __init__(self, mode: str, params: list[nn.Parameter], world: int, *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, overlap: bool) -> None:
        if mode not in DENSE_STATES:
            raise ValueError(f"dense states must be one of {', '.join(DENSE_STATES)}, got {mode!r}")
        self.mode, self.params, self.world = mode, params, world
        self.sharded = mode == "fsdp" and world > 1
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        if mode == "zero1" and world > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                                                      **kw)
        else:
            self.opt = torch.optim.AdamW(params, **kw)
        # replicated gradients: all-reduced in buckets while backward runs (one micro-batch), else
        # after the last micro-batch; FSDP reduce-scatters them itself
        self.reducer = (GradBucketReducer(params) if world > 1 and not self.sharded and overlap else None)
        # what runs the optimizer step (default `opt.step`); a pipeline stage whose plan moves
        # optimizer states off the device puts mpress's ModelDataRunner here
        self.stepper: Any = None

    # -- the step ---------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def finish_backward(self) -> None:
        """After the last micro-batch's backward: every rank's gradients hold the average over
        the ranks (replicated, zero1) or its shard of it (fsdp, done by FSDP already)."""
        if self.world == 1 or self.sharded:
            return
        if self.reducer is not None:
            self.reducer.finish()
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        fused_all_reduce([p.grad for p in self.params])  # averages over ranks

    def grads(self) -> list[torch.Tensor]:
        """This rank's dense gradients in parameter order, those the stepper holds elsewhere
        (streamed weights' gradients, summed in host memory) included."""
        held = self.stepper.held_grads() if self.stepper is not None else {}
        out = [held.get(id(p), p.grad) for p in self.params]
        return [local(g) for g in out if g is not None]

    def grad_sq(self, device: torch.device) -> torch.Tensor:
        """This rank's part of the dense gradients' sum of squares: all of it when the gradients
        are replicated, its shard's when they are sharded (then the ranks' parts add up; see
        `sq_is_partial`)."""
        return sum_of_squares(self.grads(), device)

    @property
    def sq_is_partial(self) -> bool:
        return self.sharded

    def clip_(self, coef: float) -> None:
        for g in self.grads():
            g.mul_(coef)

    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.stepper is not None:
            self.stepper.step()
        else:
            self.opt.step()

    # -- checkpoints ------------------------------------------------------------------------
    def full_state(self, keep: bool) -> dict | None:
        """The optimizer state in the checkpoint format (full tensors, keyed by position in
        `params`), returned where `keep` (rank 0) and None elsewhere. A collective: every rank
        calls it."""
        if hasattr(self.opt, "consolidate_state_dict"):  # zero1: rank 0 collects every rank's moments
            self.opt.consolidate_state_dict(to=0)
            return self.opt.state_dict() if keep else None
        sd = self.opt.state_dict()
        if not self.sharded:
            return sd if keep else None
        state: dict[int, dict[str, Any]] = {}
        for i in sorted(sd["state"]):  # every rank in the same order
            state[i] = {k: (full_tensor(v).cpu() if _is_dtensor(v) else v) for k, v in sorted(sd["state"][i].items())}
        return {"state": state, "param_groups": sd["param_groups"]} if keep else None

    def load_full_state(self, sd: dict) -> None:
        """Load a checkpoint's optimizer state (as `full_state` made it, in any mode)."""
        if self.sharded:
            state = {}
            for i, st in sd["state"].items():
                p = self.params[int(i)]
                state[i] = {k: _like_param(v, p) for k, v in st.items()}
            sd = {"state": state, "param_groups": sd["param_groups"]}
        self.opt.load_state_dict(sd)

    # -- memory -----------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        """Bytes of dense parameters, gradients and AdamW moments held by this rank now."""
        def size(ts: Iterable[torch.Tensor]) -> int:
            return sum(local(t).numel() * local(t).element_size() for t in ts)

        opt = getattr(self.opt, "optim", self.opt)  # zero1: the local optimizer of this rank's share
        moments = [v for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
        out = {"params": size(self.params), "grads": size(p.grad for p in self.params if p.grad is not None),
               "moments": size(moments)}
        out["total"] = sum(out.values())
        return out


def _like_param(v: Any, p: torch.Tensor) -> Any:
    """A saved full moment as this rank's piece of it, sharded like `p` (scalars such as the step
    count stay as they are)."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0 or tuple(v.shape) != tuple(p.shape) or not _is_dtensor(p):
        return v
    return _shard_like(v, p)
