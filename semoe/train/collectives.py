"""A training run's collectives, each a no-op on one rank. Objects and host numbers go through the
object group (gloo, host memory); device tensors through the default group (NCCL on CUDA), so each
collective's tensors sit where its backend expects them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def object_group() -> dist.ProcessGroup | None:
    """The group for object collectives (pickles in host memory), barriers and host counters: the
    default group when it has a CPU backend (gloo, or `cpu:gloo,cuda:nccl`), else a gloo group over
    the same ranks. Through plain NCCL every pickle would travel as a CUDA tensor, and a gather
    would allocate world x the largest on rank 0's GPU."""
    if "gloo" in dist.get_backend_config():
        return None
    return dist.new_group(backend="gloo")


class Collectives:
    """Rank `rank` of `world`'s collectives; `group`: the object group (`object_group()`, None for
    the default group)."""

    def __init__(self, rank: int, world: int, group: dist.ProcessGroup | None, *, distributed: bool = True) -> None:
        self.rank, self.world, self.group, self.distributed = rank, world, group, distributed

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on rank 0 (an empty list elsewhere)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out or []

    def sum(self, values: list[float]) -> list[float]:
        """Host numbers summed over ranks."""
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def sum_on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor on the trainer's device summed over ranks, in place (no host round trip)."""
        if self.distributed:
            dist.all_reduce(t)
        return t
