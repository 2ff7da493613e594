"""Experts: the MLP variants an expert can be, its weights, and where a layer's weights come from.

An expert's tensors keep the layout its checkpoint gives them (the store holds that layout, the
offload ring copies it as it is, the model computes on it), so one `ExpertMLP` per variant names
the tensors, gives their shapes and applies them:

- `SwiGLU`: gate (F, D), up (F, D), down (D, F): down(silu(gate x) * up x). Mixtral, Qwen, OLMoE,
  DeepSeek, GLM-4.5.
- `FusedSwiGLU`: Llama-4's, gate_up (D, 2F) with gate and up its halves, down (F, D), both (in, out).
- `ClampedSwiGLU`: gpt-oss's fused layout, gate_up (D, 2F) with gate and up interleaved column by
  column, its bias (2F), down (F, D) and its bias (D); gate clamped above and up on both sides at
  `limit`, then (up + 1) * gate * sigmoid(alpha * gate).

Shape legend: M rows routed to one expert, D hidden size, F expert FFN size, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from semoe.model.hf_names import W_NAMES
from semoe.model.compact_linear import Weight, fused_clamped_swiglu, fused_swiglu, linear, matmul
from semoe.model.config import MoEConfig


def swiglu(x_ND: torch.Tensor, w_gate_FD: Weight, w_up_FD: Weight, w_down_DF: Weight) -> torch.Tensor:
    """The SwiGLU feed-forward of dense layers and most experts: down(silu(gate x) * up x); each
    weight plain or compact (compact ones in one kernel call where it applies: `fused_swiglu`)."""
    fused = fused_swiglu(x_ND, w_gate_FD, w_up_FD, w_down_DF)
    if fused is not None:
        return fused
    return linear(F.silu(linear(x_ND, w_gate_FD)) * linear(x_ND, w_up_FD), w_down_DF)


def clamped_silu_glu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's experts' and shared expert's activation: SiLU of the gate clamped above at `limit`,
    times the up clamped to [-limit, limit] (unlike gpt-oss's, no sigmoid slope and no +1)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ExpertMLP:
    """One expert MLP variant: its tensors' checkpoint names and shapes, and how they are applied."""

    def names(self, config: MoEConfig, prefix: str) -> tuple[str, ...]:
        """Checkpoint names of one expert's tensors; `prefix` ends with `experts.` or `experts.<e>.`."""
        raise NotImplementedError

    def shapes(self, config: MoEConfig) -> tuple[tuple[int, ...], ...]:
        """Shapes of one expert's tensors, in `names` order."""
        raise NotImplementedError

    def apply(self, x_MD: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The expert on its rows."""
        raise NotImplementedError

    # per-expert tensors (`experts.<e>.<name>`) or slices of fused ones (`experts.<name>`)
    stacked = False
    # 2-D weights laid out (in, out) and applied as x @ w (else (out, in), applied as F.linear)
    in_out = False


class SwiGLU(ExpertMLP):
    """gate (F, D), up (F, D), down (D, F), named `w1`, `w3`, `w2` in Mixtral and `*_proj` elsewhere."""

    def names(self, config: MoEConfig, prefix: str) -> tuple[str, ...]:
        parts = ("w1", "w3", "w2") if config.arch in W_NAMES else ("gate_proj", "up_proj", "down_proj")
        return tuple(f"{prefix}{p}.weight" for p in parts)

    def shapes(self, config: MoEConfig) -> tuple[tuple[int, ...], ...]:
        D, Fh = config.hidden_size, config.moe_ffn_size
        return (Fh, D), (Fh, D), (D, Fh)

    def apply(self, x_MD: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return swiglu(x_MD, *parts)


@dataclass(frozen=True)
class LimitedSwiGLU(ExpertMLP):
    """DeepSeek-V4's experts: SwiGLU's tensors (`w1`, `w3`, `w2`), the gate clamped above and the up both ways
    at `limit` (`clamped_silu_glu`). Not a `SwiGLU`: the paths that compute SwiGLU in one kernel call skip it."""

    limit: float

    def names(self, config: MoEConfig, prefix: str) -> tuple[str, ...]:
        return SwiGLU().names(config, prefix)

    def shapes(self, config: MoEConfig) -> tuple[tuple[int, ...], ...]:
        return SwiGLU().shapes(config)

    def apply(self, x_MD: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        gate_FD, up_FD, down_DF = parts
        return linear(clamped_silu_glu(linear(x_MD, gate_FD), linear(x_MD, up_FD), self.limit), down_DF)


@dataclass(frozen=True)
class ClampedSwiGLU(ExpertMLP):
    """gpt-oss's experts: fused, interleaved gate/up with biases, clamped at `limit`."""

    alpha: float
    limit: float
    stacked = True
    in_out = True

    def names(self, config: MoEConfig, prefix: str) -> tuple[str, ...]:
        return tuple(prefix + n for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))

    def shapes(self, config: MoEConfig) -> tuple[tuple[int, ...], ...]:
        D, Fh = config.hidden_size, config.moe_ffn_size
        return (D, 2 * Fh), (2 * Fh,), (Fh, D), (D,)

    def apply(self, x_MD: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        fused = fused_clamped_swiglu(x_MD, parts, self.alpha, self.limit)  # compact weights: one kernel call
        if fused is not None:
            return fused
        gate_up_D2F, bias_2F, down_FD, bias_D = parts
        gu_M2F = matmul(x_MD, gate_up_D2F) + bias_2F
        gate_MF = gu_M2F[..., ::2].clamp(max=self.limit)
        up_MF = gu_M2F[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return matmul((up_MF + 1) * gate_MF * torch.sigmoid(gate_MF * self.alpha), down_FD) + bias_D


class FusedSwiGLU(ExpertMLP):
    """Llama-4's experts: SwiGLU with gate and up the two halves of one gate_up (D, 2F), down (F, D),
    both (in, out) and fused over the experts."""

    stacked = True
    in_out = True

    def names(self, config: MoEConfig, prefix: str) -> tuple[str, ...]:
        return prefix + "gate_up_proj", prefix + "down_proj"

    def shapes(self, config: MoEConfig) -> tuple[tuple[int, ...], ...]:
        D, Fh = config.hidden_size, config.moe_ffn_size
        return (D, 2 * Fh), (Fh, D)

    def apply(self, x_MD: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        gate_up_D2F, down_FD = parts
        gate_MF, up_MF = matmul(x_MD, gate_up_D2F).chunk(2, dim=-1)
        return matmul(F.silu(gate_MF) * up_MF, down_FD)


def expert_mlp(config: MoEConfig) -> ExpertMLP:
    """The expert MLP variant of `config`."""
    if config.expert_mlp == "clamped_swiglu":
        return ClampedSwiGLU(alpha=config.swiglu_alpha, limit=config.swiglu_limit)
    if config.expert_mlp == "fused_swiglu":
        return FusedSwiGLU()
    if config.expert_mlp == "limited_swiglu":
        return LimitedSwiGLU(limit=config.swiglu_limit)
    return SwiGLU()


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's tensors (in `mlp`'s layout) and the variant that applies them."""

    parts: tuple[torch.Tensor, ...]
    mlp: ExpertMLP

    def apply(self, x_MD: torch.Tensor) -> torch.Tensor:
        """The expert on its rows (a trainer's subclass routes gradients to its own state store)."""
        return self.mlp.apply(x_MD, self.parts)


class ExpertProvider(Protocol):
    """Where a MoE layer's expert weights come from (the seam offload and training plug into)."""

    def stream(self, layer: int, experts: list[int], x_ND: torch.Tensor) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield each of `experts` once, in any order, with its weights; weights are valid until the
        next item is requested. `x_ND` is the layer's routed input, which an offloading provider
        may use to predict and prefetch later layers' experts.

        A provider may also compute its experts itself: `run(layer, [(expert, its rows), ...], x_ND)`
        returning {expert: its output rows}, which the MoE layer then calls instead (hybrid decode,
        `inference.offload.hybrid`, splits them between the device and the CPU)."""
        ...


class ResidentExperts(nn.Module):
    """All experts of one layer as parameters on the module's device, one (E, ...) tensor per part.

    SwiGLU: w_gate/w_up (E, F, D), w_down (E, D, F); gpt-oss: w_gate_up (E, D, 2F), b_gate_up
    (E, 2F), w_down (E, F, D), b_down (E, D); Llama-4: w_gate_up (E, D, 2F), w_down (E, F, D)."""

    PARAMS = {SwiGLU: ("w_gate", "w_up", "w_down"), LimitedSwiGLU: ("w_gate", "w_up", "w_down"), ClampedSwiGLU: ("w_gate_up", "b_gate_up", "w_down", "b_down"),
              FusedSwiGLU: ("w_gate_up", "w_down")}

    def __init__(self, config: MoEConfig, num_experts: int | None = None) -> None:
        super().__init__()
        self.mlp = expert_mlp(config)
        n = config.num_experts if num_experts is None else num_experts
        self.param_names = self.PARAMS[type(self.mlp)]
        for name, shape in zip(self.param_names, self.mlp.shapes(config)):
            w = nn.Parameter(torch.empty(n, *shape))
            # biases start at zero; weights as every linear layer of the model
            nn.init.zeros_(w) if name.startswith("b_") else nn.init.normal_(w, std=0.02)
            self.register_parameter(name, w)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The (E, ...) parameters, in the variant's part order."""
        return tuple(getattr(self, n) for n in self.param_names)

    def expert_nbytes(self, layer: int, expert: int) -> int:
        """Bytes of one expert's weights."""
        return sum(p[expert].numel() * p.element_size() for p in self.tensors())

    def stream(self, layer: int, experts: list[int], x_ND: torch.Tensor) -> Iterator[tuple[int, ExpertWeights]]:
        params = self.tensors()
        for e in experts:
            yield e, ExpertWeights(tuple(p[e] for p in params), self.mlp)
