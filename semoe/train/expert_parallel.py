"""Expert parallelism: each rank of a process group holds a contiguous block of every MoE layer's experts.

GShard / SE-MoE style. Each rank routes its own tokens with the replicated router, sends every kept
(token, choice) row to the rank that owns the chosen expert with one `all_to_all`, runs its local
experts on the rows it received, and sends the results back with the reverse `all_to_all`; the
combine step (routing weight times expert output, summed over choices) then runs exactly as in
the single-device `MoEFeedForward`. The model code stays single-device: `shard_experts` swaps each
MoE layer for an `ExpertParallelMoE` from outside, and nothing else in the model changes.

Capacity is per rank, as in GShard: in training with a capacity factor each rank computes the
capacity from its own token count and drops its own overflowing assignments, so an expert receives
at most W times that capacity in all. A rank's output therefore equals the single-device layer
applied to that rank's tokens alone.

Parameters outside the experts (router, shared expert) stay replicated and their gradients are
each rank's own contribution: reducing them across ranks, as data parallelism does, is the
caller's business. Every rank must run forward and backward of every layer, since each one takes
part in the collectives; the backward graph is built to be the same on every rank (see
`_run_local_experts`), so `loss.backward()` issues the same collectives in the same order everywhere.

Shape legend: B batch, T tokens per sequence, N tokens on this rank (B*T), D hidden size,
E experts, K experts per token, W ranks, L experts per rank (E/W), F expert FFN size,
R rows this rank sends (kept assignments), M rows this rank receives.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from semoe.model.routing import dispatch_order, gather_rows
from semoe.model.experts import ExpertProvider, ResidentExperts
from semoe.model.moe_gpt import MoEFeedForward, MoEGPT, RouterStats

__all__ = ["ExpertParallelMoE", "all_to_all_rows", "expert_major_order", "local_expert_ids", "shard_experts"]


def local_expert_ids(num_experts: int, rank: int, world: int) -> range:
    """The experts `rank` owns out of `num_experts` split into `world` contiguous equal blocks."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1} (world {world}), got {rank}")
    if num_experts < 1 or num_experts % world:
        raise ValueError(f"num_experts {num_experts} must be a positive multiple of the expert-parallel "
                         f"world size {world}, so that every rank holds the same number of experts")
    per_rank = num_experts // world
    return range(rank * per_rank, (rank + 1) * per_rank)


def expert_major_order(counts_WL: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Indices that regroup received rows from source-rank-major to local-expert-major order.

    Rows arrive as one block per source rank, each block sorted by local expert (`counts_WL[w, l]`
    rows from rank w for expert l); indexing with the result puts all of expert 0's rows first
    (source rank 0's, then rank 1's, ...), then expert 1's, and so on. `rows`, the total of
    `counts_WL` when the caller knows it, spares the device a host sync to size the result.
    """
    if counts_WL.dim() != 2:
        raise ValueError(f"counts_WL must be 2-D (ranks, local experts), got shape {tuple(counts_WL.shape)}")
    W, L = counts_WL.shape
    segment_M = torch.arange(W * L, device=counts_WL.device).repeat_interleave(counts_WL.reshape(-1),
                                                                               output_size=rows)
    # Segment w*L + l sorts by expert first, then by source rank; stability keeps the row order inside it.
    key_M = (segment_M % L) * W + segment_M // L
    return torch.argsort(key_M, stable=True)


class _AllToAllRows(torch.autograd.Function):
    """`all_to_all_single` over rows whose backward is the reverse exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out_MD = x_RD.new_empty((sum(recv_splits), *x_RD.shape[1:]))
        dist.all_to_all_single(out_MD, x_RD.contiguous(), recv_splits, send_splits, group=group)
        return out_MD

    @staticmethod
    def backward(ctx, grad_MD: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad_RD = _AllToAllRows.apply(grad_MD.contiguous(), ctx.recv_splits, ctx.send_splits, ctx.group)
        return grad_RD, None, None, None


def all_to_all_rows(x_RD: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Send `send_splits[w]` consecutive rows of `x_RD` to rank w and receive `recv_splits[w]` from it.

    Differentiable on every backend. `torch.distributed.nn.functional.all_to_all_single` does the
    same but is deprecated in favour of functional collectives, which are not what gloo runs here.
    """
    if x_RD.shape[0] != sum(send_splits):
        raise ValueError(f"x_RD has {x_RD.shape[0]} rows but send_splits {send_splits} "
                         f"add up to {sum(send_splits)}")
    return _AllToAllRows.apply(x_RD, list(send_splits), list(recv_splits), group)


class ExpertParallelMoE(MoEFeedForward):
    """A `MoEFeedForward` whose experts are split across the ranks of `group`, tokens moved by all-to-all.

    Built from a full single-device layer: it reuses that layer's router and shared expert (the same
    modules, replicated on every rank) and copies the slice of experts this rank owns into
    its own `ResidentExperts` (L, ...) parameters. A provider installed later
    with `use_experts` (or passed as `experts`, leaving the layer's resident experts untouched, as a
    trainer with its own expert states does) is asked for local indices 0..L-1. It subclasses `MoEFeedForward` so that the
    model's blocks and `MoEGPT.moe_layers` treat it as the layer it replaces.
    """

    def __init__(self, moe: MoEFeedForward, group: dist.ProcessGroup | None = None, *,
                 experts: ExpertProvider | None = None) -> None:
        if isinstance(moe, ExpertParallelMoE):
            raise TypeError(f"layer {moe.layer} is already expert-parallel")
        if not isinstance(moe, MoEFeedForward):
            raise TypeError(f"ExpertParallelMoE wraps a MoEFeedForward, got {type(moe).__name__}")
        source = moe.experts
        if experts is None and not isinstance(source, ResidentExperts):
            raise TypeError(f"layer {moe.layer}: ExpertParallelMoE slices resident expert weights, but the "
                            f"layer's experts come from a {type(source).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE needs torch.distributed to be initialised "
                               "(init_process_group) before the layer is built")
        # MoEFeedForward.__init__ would allocate and initialise all E experts only to drop them.
        nn.Module.__init__(self)
        self.config = moe.config
        self.layer = moe.layer
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.expert_ids = local_expert_ids(moe.config.num_experts, self.rank, self.world)
        self.router, self.scales_input = moe.router, moe.scales_input
        if moe.config.shared_expert_size:
            self.shared = moe.shared
            if moe.config.shared_expert_gate:
                self.shared_gate = moe.shared_gate
        self.train(moe.training)
        if experts is not None:  # the caller's provider serves local indices 0..L-1
            self.use_experts(experts)
            return
        lo, hi = self.expert_ids.start, self.expert_ids.stop
        # Built on the meta device so that initialising weights that are overwritten at once costs no
        # memory and draws no random numbers (which would shift the caller's RNG stream).
        with torch.device("meta"):
            local = ResidentExperts(moe.config, len(self.expert_ids))
        for name in local.param_names:
            full = getattr(source, name)
            setattr(local, name, nn.Parameter(full.detach()[lo:hi].clone(), requires_grad=full.requires_grad))
        self.experts = local

    def extra_repr(self) -> str:
        return (f"layer={self.layer}, experts={self.expert_ids.start}..{self.expert_ids.stop - 1} "
                f"of {self.config.num_experts}, rank={self.rank}/{self.world}")

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        """This rank's tokens in, their outputs and router stats out, as from `MoEFeedForward`."""
        c = self.config
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        # Per-rank capacity (GShard): computed from, and applied to, this rank's tokens only.
        r, keep_NK = self.route_and_keep(x_ND)
        # Rows come out sorted by expert, and each rank owns a contiguous block of experts, so the
        # rows bound for one rank are already contiguous and in the order its experts expect.
        token_idx_R, choice_idx_R, counts_E = dispatch_order(r.ids_TK, keep_NK, c.num_experts)
        counts_WL = self._exchange_counts(counts_E)
        # The splits and each expert's rows are sizes the host needs: read in one go, this and
        # dispatch_order's nonzero are the layer's only host syncs.
        W, L = counts_WL.shape
        host = torch.cat([counts_E, counts_WL.reshape(-1)]).tolist()
        sent_E, received_WL = host[:W * L], [host[W * L + w * L:W * L + (w + 1) * L] for w in range(W)]
        send_splits = [sum(sent_E[w * L:(w + 1) * L]) for w in range(W)]
        recv_splits = [sum(row) for row in received_WL]
        per_expert = [sum(row[l] for row in received_WL) for l in range(L)]
        x_RD = gather_rows(x_ND, token_idx_R, choice_idx_R, c.top_k)
        w_R1 = r.weights_TK[token_idx_R, choice_idx_R, None].to(x_ND.dtype)
        if self.scales_input:  # as MoEFeedForward: the weights scale the rows into the experts (Llama-4)
            x_RD = x_RD * w_R1
        x_MD = all_to_all_rows(x_RD, send_splits, recv_splits, self.group)
        y_MD = self._run_local_experts(x_MD, counts_WL, per_expert)
        y_RD = all_to_all_rows(y_MD, recv_splits, send_splits, self.group)
        # One row per (token, choice), summed over choices by the same code as MoEFeedForward, so
        # the result matches the single-device layer.
        if not self.scales_input:
            y_RD = y_RD * w_R1
        y_NKD = x_ND.new_zeros(x_ND.shape[0], c.top_k, D).index_put((token_idx_R, choice_idx_R), y_RD)
        out_ND, stats = self.combine(x_ND, y_NKD, r, keep_NK)
        return out_ND.view(B, T, D), stats

    def _exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """(W, L): row w is how many rows rank w sends to each of this rank's experts."""
        counts_WL = torch.empty_like(counts_E)
        # Equal splits of L counts each: rank w gets the counts of the block of experts it owns.
        dist.all_to_all_single(counts_WL, counts_E.contiguous(), group=self.group)
        return counts_WL.view(self.world, -1)

    def _run_local_experts(self, x_MD: torch.Tensor, counts_WL: torch.Tensor, per_expert: list[int]
                           ) -> torch.Tensor:
        """Each local expert on its received rows (`per_expert[l]` of them, the column sums of
        `counts_WL`); the result keeps the rows' arrival order."""
        order_M = expert_major_order(counts_WL, rows=x_MD.shape[0])
        x_by_expert_MD = x_MD[order_M]
        starts = [0]
        for n in per_expert:
            starts.append(starts[-1] + n)
        # A rank that receives no rows still runs one expert on the empty batch: its backward graph
        # then holds the same two all-to-alls as every other rank's, whichever parameters or inputs
        # require gradients, so no rank skips a collective the others wait in.
        active = [e for e, n in enumerate(per_expert) if n] or [0]
        y_by_expert: dict[int, torch.Tensor] = {}
        for e, w in self.experts.stream(self.layer, active, x_by_expert_MD):
            y_by_expert[e] = w.apply(x_by_expert_MD[starts[e]:starts[e + 1]])
        y_by_expert_MD = torch.cat([y_by_expert[e] for e in active])
        return y_by_expert_MD[torch.argsort(order_M)]


def shard_experts(model: MoEGPT, group: dist.ProcessGroup | None = None, *,
                  provider: Callable[[MoEFeedForward], ExpertProvider] | None = None) -> None:
    """Replace every MoE layer of `model` in place by its expert-parallel version over `group`.

    Without `provider`, each rank keeps its slice of the layer's resident experts: expert
    parameters are new tensors afterwards, so build the optimizer after sharding. With it, the
    layer asks `provider(layer)` for this rank's experts (local indices 0..L-1), as a trainer with
    its own expert states does. The router, shared experts and all dense parameters are the same
    objects as before.
    """
    for block in model.layers:
        if isinstance(block.ffn, MoEFeedForward):
            block.ffn = ExpertParallelMoE(block.ffn, group,
                                          experts=provider(block.ffn) if provider is not None else None)
