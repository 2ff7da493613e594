"""Gating for MoE layers: top-k routing, expert capacity, token dropping and router losses.

Every function here is a pure function of router logits (or of what `route_topk` derived from
them), so the same code runs on CPU and CUDA tensors and is tested without a model. The MoE layer
composes them: `route_topk` -> `capacity_keep_mask` (training with a capacity factor) ->
`dispatch_order` and `gather_rows` to gather tokens expert by expert; the losses are added by the
training step.

Shape legend:
    T  tokens (batch and sequence flattened)
    E  experts
    K  experts chosen per token (top-k)
    C  capacity: the most (token, choice) assignments one expert accepts
    N  (token, choice) assignments kept after dropping, N <= T * K
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Routing",
    "route_topk",
    "route_topk_softmax",
    "route_grouped",
    "route_topk_sigmoid",
    "expert_capacity",
    "capacity_keep_mask",
    "load_balancing_loss",
    "router_z_loss",
    "dispatch_order",
    "gather_rows",
]


@dataclass(frozen=True)
class Routing:
    """Result of top-k routing for T tokens over E experts.

    `weights_TK` and `probs_TE` are float32 (float64 when the logits are float64, so that
    gradients can be checked numerically); `ids_TK` is int64, best expert first.
    """

    weights_TK: Tensor  # gate weight of each chosen expert
    ids_TK: Tensor  # chosen experts (in decreasing probability from route_topk)
    probs_TE: Tensor  # softmax over all experts
    logits_TE: Tensor  # the router logits, as given


def _router_dtype(dtype: torch.dtype) -> torch.dtype:
    # Softmax in bf16/fp16 loses the ordering of close experts, so routing always runs in at least
    # float32 (as HuggingFace does); float64 is kept for numerical gradient checks.
    return torch.promote_types(dtype, torch.float32)


def _check_logits(logits_TE: Tensor, name: str = "logits_TE") -> None:
    if logits_TE.dim() != 2:
        raise ValueError(f"{name} must be 2-D (tokens, experts), got shape {tuple(logits_TE.shape)}")
    if not logits_TE.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {logits_TE.dtype}")
    if logits_TE.shape[1] < 1:
        raise ValueError(f"{name} must have at least one expert, got shape {tuple(logits_TE.shape)}")


def _check_ids(ids_TK: Tensor, num_experts: int) -> None:
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if ids_TK.dim() != 2:
        raise ValueError(f"ids_TK must be 2-D (tokens, top_k), got shape {tuple(ids_TK.shape)}")
    if ids_TK.shape[1] < 1:
        raise ValueError(f"ids_TK must hold at least one choice per token, got shape {tuple(ids_TK.shape)}")
    if ids_TK.is_floating_point() or ids_TK.is_complex() or ids_TK.dtype == torch.bool:
        raise TypeError(f"ids_TK must be an integer tensor, got {ids_TK.dtype}")
    # Expert ids are not range-checked here: that would cost a device-to-host sync per layer.
    # One-hot encoding below rejects out-of-range ids on CPU.


def route_topk(logits_TE: Tensor, top_k: int, *, normalize: bool) -> Routing:
    """Pick the `top_k` most probable experts per token from router logits.

    Softmax runs in float32, then `torch.topk` of the probabilities; with `normalize` the chosen
    probabilities are rescaled to sum to 1 per token. This reproduces HuggingFace's Mixtral router
    (`normalize=True`) and Qwen2-MoE / OLMoE routers (`normalize=config.norm_topk_prob`) exactly.
    """
    _check_logits(logits_TE)
    num_experts = logits_TE.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    probs_TE = torch.softmax(logits_TE.to(_router_dtype(logits_TE.dtype)), dim=-1)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return Routing(weights_TK=weights_TK, ids_TK=ids_TK, probs_TE=probs_TE, logits_TE=logits_TE)


def _top_logits(logits_TE: Tensor, top_k: int, weigh) -> Routing:
    """The `top_k` largest logits, weighted by `weigh` of them (in at least float32); `probs_TE` (for
    the load-balancing loss) is the softmax over all experts."""
    _check_logits(logits_TE)
    num_experts = logits_TE.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    top_TK, ids_TK = torch.topk(logits_TE, top_k, dim=-1)
    weights_TK = weigh(top_TK.to(_router_dtype(logits_TE.dtype)))
    probs_TE = torch.softmax(logits_TE.to(_router_dtype(logits_TE.dtype)), dim=-1)
    return Routing(weights_TK=weights_TK, ids_TK=ids_TK, probs_TE=probs_TE, logits_TE=logits_TE)


def route_topk_softmax(logits_TE: Tensor, top_k: int) -> Routing:
    """gpt-oss's router: the `top_k` largest logits, then a softmax over those alone. The logits
    already carry the router's bias."""
    return _top_logits(logits_TE, top_k, lambda top_TK: torch.softmax(top_TK, dim=-1))


def route_topk_sigmoid(logits_TE: Tensor, top_k: int) -> Routing:
    """Llama-4's router: the `top_k` largest logits, each chosen expert weighted by its logit's sigmoid;
    the MoE layer scales the expert's input by it, not its output."""
    return _top_logits(logits_TE, top_k, torch.sigmoid)


SCORES = ("softmax", "sigmoid", "sqrtsoftplus")  # a grouped or hashed router's scores of its logits


def scores_of(x_TE: Tensor, scores: str) -> Tensor:
    """The routers' scores of float32 logits: softmax over experts, sigmoid, or sqrt(softplus) (DeepSeek-V4)."""
    if scores == "softmax":
        return torch.softmax(x_TE, dim=-1)
    if scores == "sigmoid":
        return torch.sigmoid(x_TE)
    return torch.sqrt(F.softplus(x_TE))


def route_hashed(logits_TE: Tensor, ids_TK: Tensor, *, scores: str, normalize: bool, scale: float = 1.0) -> Routing:
    """DeepSeek-V4's hash routing (its first MoE layers): the experts are fixed per token id (`ids_TK`, the
    checkpoint's frozen `tid2eid` table at the tokens' ids); the learned router only weighs them, by their
    scores, renormalised with `normalize`, times `scale`."""
    _check_logits(logits_TE)
    _check_ids(ids_TK, logits_TE.shape[1])
    if scores not in SCORES:
        raise ValueError(f"scores must be one of {', '.join(SCORES)}, got {scores!r}")
    scores_TE = scores_of(logits_TE.to(_router_dtype(logits_TE.dtype)), scores)
    weights_TK = scores_TE.gather(1, ids_TK)
    if normalize:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(weights_TK=weights_TK * scale, ids_TK=ids_TK, probs_TE=scores_TE / scores_TE.sum(-1, keepdim=True),
                   logits_TE=logits_TE)


def route_grouped(logits_TE: Tensor, top_k: int, *, scores: str, correction_bias_E: Tensor | None = None,
                  n_group: int = 1, topk_group: int = 1, group_score: str = "max", normalize: bool,
                  scale: float = 1.0) -> Routing:
    """DeepSeek's group-limited top-k (also GLM-4.5's; with one group, plain top-k).

    Scores are the softmax (DeepSeek-V2), the sigmoid (V3) or sqrt(softplus) (V4, `scores_of`) of the
    float32 logits. Experts are
    chosen on `scores + correction_bias_E` (V3's load-balancing bias, which never enters the
    weights), among the `topk_group` best of `n_group` equal groups: a group's score is its best
    expert's (`"max"`) or its best two summed (`"top2"`). The weights are the chosen experts'
    scores, renormalised with `normalize`, times `scale` (`routed_scaling_factor`). Ties go as
    `torch.topk` breaks them, as in the reference implementations. `probs_TE` is the scores
    normalised to sum to 1 per token.
    """
    _check_logits(logits_TE)
    num_tokens, num_experts = logits_TE.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group ({n_group}) must divide the {num_experts} experts and topk_group ({topk_group}) "
                         "be in 1..n_group")
    if scores not in SCORES or group_score not in ("max", "top2"):
        raise ValueError(f"scores must be one of {', '.join(SCORES)} and group_score max or top2, got {scores!r}, "
                         f"{group_score!r}")
    x_TE = logits_TE.to(_router_dtype(logits_TE.dtype))
    scores_TE = scores_of(x_TE, scores)
    choice_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E.to(x_TE.dtype)
    if n_group > 1:
        grouped_TGe = choice_TE.view(num_tokens, n_group, num_experts // n_group)
        group_TG = (grouped_TGe.max(dim=-1).values if group_score == "max"
                    else grouped_TGe.topk(min(2, grouped_TGe.shape[-1]), dim=-1)[0].sum(dim=-1))
        group_idx_TK = torch.topk(group_TG, k=topk_group, dim=-1, sorted=False)[1]
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, group_idx_TK, True)
        keep_TE = keep_TG.unsqueeze(-1).expand_as(grouped_TGe).reshape(num_tokens, num_experts)
        # softmax scores are >= 0, so 0 ranks masked experts last as -inf does for biased sigmoid ones
        choice_TE = choice_TE.masked_fill(~keep_TE, 0.0 if correction_bias_E is None else float("-inf"))
    ids_TK = torch.topk(choice_TE, k=top_k, dim=-1, sorted=False)[1]
    weights_TK = scores_TE.gather(1, ids_TK)
    if normalize:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    weights_TK = weights_TK * scale
    probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    return Routing(weights_TK=weights_TK, ids_TK=ids_TK, probs_TE=probs_TE, logits_TE=logits_TE)


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Most (token, choice) assignments one expert accepts: `ceil(factor * T * K / E)`, at least 1.

    This is the GShard / Switch Transformer rule: a factor of 1.0 gives each expert exactly its
    share under perfectly balanced routing. The floor of 1 keeps an expert usable for tiny batches
    (e.g. one decoding token over many experts). The product is taken in floating point, as the
    reference implementations do, so a factor such as 1.1 may round up one more slot.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    if not capacity_factor > 0 or math.isinf(capacity_factor):
        raise ValueError(f"capacity_factor must be a finite number > 0, got {capacity_factor}")
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def capacity_keep_mask(ids_TK: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Which (token, choice) assignments fit within each expert's `capacity`, as a bool `keep_TK`.

    Priority follows GShard: every token's first choice in token order, then every second choice
    in token order, and so on; an expert keeps the first `capacity` assignments it receives.
    """
    _check_ids(ids_TK, num_experts)
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    num_tokens, top_k = ids_TK.shape
    # Choice-major order puts all first choices ahead of any second choice, so one cumulative
    # count over that order is each assignment's position in its expert's queue.
    onehot_KTE = F.one_hot(ids_TK.t().long(), num_experts)
    position_KTE = onehot_KTE.reshape(top_k * num_tokens, num_experts).cumsum(dim=0).reshape_as(onehot_KTE) - 1
    position_KT = position_KTE.gather(-1, ids_TK.t().long().unsqueeze(-1)).squeeze(-1)
    return (position_KT < capacity).t().contiguous()


def load_balancing_loss(probs_TE: Tensor, ids_TK: Tensor, num_experts: int) -> Tensor:
    """Switch / GShard auxiliary load-balancing loss `E * sum_e f_e * P_e`, a scalar.

    `f_e` is the fraction of all T * K routed assignments (every choice, counted before capacity
    dropping) that went to expert e, so `sum_e f_e = 1`; `P_e` is the mean router probability of e
    over tokens. Perfectly uniform routing gives 1.0 for any K; total collapse onto one expert
    gives up to E. HuggingFace's `load_balancing_loss_func` divides counts by T instead of T * K,
    so for one layer without an attention mask it equals `top_k` times this loss. Gradients flow
    through `P_e` only, since `f_e` counts discrete choices.
    """
    _check_logits(probs_TE, "probs_TE")
    _check_ids(ids_TK, num_experts)
    if probs_TE.shape[1] != num_experts:
        raise ValueError(f"probs_TE has {probs_TE.shape[1]} experts but num_experts is {num_experts}")
    if probs_TE.shape[0] != ids_TK.shape[0]:
        raise ValueError(
            f"probs_TE has {probs_TE.shape[0]} tokens but ids_TK has {ids_TK.shape[0]}"
        )
    if probs_TE.shape[0] == 0:
        raise ValueError("load_balancing_loss needs at least one token, got 0")
    flat_ids = ids_TK.reshape(-1).long()
    # Integer counts via scatter_add are exact and deterministic on every device, and unlike
    # bincount need no device-to-host sync to size the output.
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_TK.device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids)
    )
    dtype = _router_dtype(probs_TE.dtype)
    fraction_E = counts_E.to(dtype) / flat_ids.numel()
    mean_prob_E = probs_TE.to(dtype).mean(dim=0)
    return num_experts * torch.sum(fraction_E * mean_prob_E)


def router_z_loss(logits_TE: Tensor) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of `logsumexp(logits)^2`, in float32, a scalar.

    It keeps router logits small, which keeps the float32 softmax well conditioned.
    """
    _check_logits(logits_TE)
    if logits_TE.shape[0] == 0:
        raise ValueError("router_z_loss needs at least one token, got 0")
    lse_T = torch.logsumexp(logits_TE.to(_router_dtype(logits_TE.dtype)), dim=-1)
    return torch.mean(lse_T.square())


def dispatch_order(ids_TK: Tensor, keep_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Kept assignments grouped by expert: `(token_idx_N, choice_idx_N, counts_E)`, all int64.

    Assignments are sorted by expert id, stably, so within one expert they stay in token order
    (then choice order); `counts_E[e]` is how many rows expert e receives, so an MoE layer can
    `x_TD[token_idx_N].split(counts_E.tolist())`. The number of kept assignments is data dependent,
    so this synchronises with the device once.
    """
    _check_ids(ids_TK, num_experts)
    if keep_TK.shape != ids_TK.shape:
        raise ValueError(
            f"keep_TK has shape {tuple(keep_TK.shape)} but ids_TK has shape {tuple(ids_TK.shape)}"
        )
    if keep_TK.dtype != torch.bool:
        raise TypeError(f"keep_TK must be a bool tensor, got {keep_TK.dtype}")
    top_k = ids_TK.shape[1]
    kept_flat_N = keep_TK.reshape(-1).nonzero().squeeze(-1)
    kept_ids_N = ids_TK.reshape(-1).long()[kept_flat_N]
    by_expert_N = torch.argsort(kept_ids_N, stable=True)
    flat_N = kept_flat_N[by_expert_N]
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_TK.device).scatter_add_(
        0, kept_ids_N, torch.ones_like(kept_ids_N)
    )
    return flat_N // top_k, flat_N % top_k, counts_E


class _GatherRows(torch.autograd.Function):
    """`x_ND[token_idx_R]`, whose backward puts each row's gradient in its own (token, choice) slot
    and sums over choices. Autograd's backward of the gather is an accumulating index_put, which
    runs on one thread on CPU and uses atomics on CUDA; each (token, choice) pair is unique, so a
    plain put and a sum over K give the same gradient, summed in choice order."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, token_idx_R: Tensor, choice_idx_R: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(token_idx_R, choice_idx_R)
        ctx.top_k, ctx.rows = top_k, x_ND.shape[0]
        return x_ND[token_idx_R]

    @staticmethod
    def backward(ctx, grad_RD: Tensor):
        token_idx_R, choice_idx_R = ctx.saved_tensors
        slots_NKD = grad_RD.new_zeros(ctx.rows, ctx.top_k, *grad_RD.shape[1:])
        slots_NKD.index_put_((token_idx_R, choice_idx_R), grad_RD)
        return slots_NKD.sum(1) if ctx.top_k > 1 else slots_NKD.squeeze(1), None, None, None


def gather_rows(x_ND: Tensor, token_idx_R: Tensor, choice_idx_R: Tensor, top_k: int) -> Tensor:
    """Row r is `x_ND[token_idx_R[r]]`; the (token, choice) pairs must be unique, as
    `dispatch_order` gives them (a permutation is the case top_k = 1, choices all 0)."""
    return _GatherRows.apply(x_ND, token_idx_R, choice_idx_R, top_k)
