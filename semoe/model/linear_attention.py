"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5-MoE: its state and its two forms.

A Gated DeltaNet head keeps a fixed-size state S (Dk x Dv) instead of a growing KV cache. Each token t,
with its key k_t (unit length), value v_t, query q_t (unit length, scaled by 1/sqrt(Dk)), decay
g_t = exp(a_t) (a_t <= 0, the log-decay) and write strength beta_t in (0, 1):

    S    <- g_t S
    d_t   = beta_t (v_t - S^T k_t)          (the delta rule: write what the state misses)
    S    <- S + k_t d_t^T
    o_t   = S^T q_t

`delta_rule_recurrent` runs it token by token (decoding: one state update per layer and token).
`delta_rule_chunked` runs a prompt in chunks of C tokens with matrix products. Within a chunk starting
from state S0, with b_t = exp(a_1 + ... + a_t) and r_ts = b_t / b_s (s <= t):

    d_t = beta_t (v_t - b_t S0^T k_t - sum_{s<t} r_ts (k_t . k_s) d_s)

so the chunk's D (C x Dv) solves the lower unitriangular system

    (I + diag(beta) L) D = diag(beta) (V - diag(b) K S0),    L_ts = r_ts (k_t . k_s) for s < t,

and then O = diag(b) Q S0 + M D with M_ts = r_ts (q_t . k_s) for s <= t, and the state the next chunk
starts from is b_C S0 + K^T diag(b_C / b) D. Ratios are taken as exp of differences of cumulative
log-decays (never above 1). Both forms compute in float32 or wider, as the state must.

The short causal convolution before the projections (`causal_conv`) keeps the last K-1 inputs as its
state; a prompt and the tokens after it give the same outputs as the whole sequence at once.

Shapes: B batch, H heads (value heads; keys and queries repeated to them by the caller), T tokens,
Dk and Dv the key and value head dimensions, C channels of the convolution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from semoe.model.compact_linear import Linear


def delta_rule_recurrent(q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor, a_BHT: torch.Tensor,
                         beta_BHT: torch.Tensor, state_BHKV: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token: (outputs (B, H, T, Dv), the state after the last token).
    `a`: log-decays; q and k as the rule takes them (unit length, q scaled)."""
    B, H, T, Dk = k_BHTK.shape
    S = _initial_state(state_BHKV, B, H, Dk, v_BHTV)
    out = v_BHTV.new_empty(v_BHTV.shape, dtype=S.dtype)
    for t in range(T):
        k, v = k_BHTK[:, :, t].to(S.dtype), v_BHTV[:, :, t].to(S.dtype)
        S = S * a_BHT[:, :, t].to(S.dtype).exp()[..., None, None]
        d = (v - torch.einsum("bhkv,bhk->bhv", S, k)) * beta_BHT[:, :, t].to(S.dtype)[..., None]
        S = S + k[..., :, None] * d[..., None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", S, q_BHTK[:, :, t].to(S.dtype))
    return out, S


def delta_rule_chunked(q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor, a_BHT: torch.Tensor,
                       beta_BHT: torch.Tensor, state_BHKV: torch.Tensor | None = None, chunk: int = 64
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a prompt in chunks of `chunk` tokens (the module docstring's algebra):
    the same outputs and final state as `delta_rule_recurrent`, to rounding."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    B, H, T, Dk = k_BHTK.shape
    S = _initial_state(state_BHKV, B, H, Dk, v_BHTV)
    dt = S.dtype
    out = v_BHTV.new_empty(v_BHTV.shape, dtype=dt)
    for lo in range(0, T, chunk):
        hi = min(lo + chunk, T)
        q, k, v = (x[:, :, lo:hi].to(dt) for x in (q_BHTK, k_BHTK, v_BHTV))
        beta = beta_BHT[:, :, lo:hi].to(dt)
        g = a_BHT[:, :, lo:hi].to(dt).cumsum(-1)  # log b_t
        C = hi - lo
        # r_ts = exp(g_t - g_s) on and below the diagonal (never above 1), 0 above it
        below = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        r = torch.exp((g[..., :, None] - g[..., None, :]).masked_fill(~below, float("-inf")))
        L = r * (k @ k.transpose(-1, -2)) * (~torch.eye(C, dtype=torch.bool, device=q.device))  # strictly lower
        lhs = torch.eye(C, dtype=dt, device=q.device) + beta[..., :, None] * L
        b = g.exp()[..., None]  # (B, H, C, 1)
        rhs = beta[..., None] * (v - b * (k @ S))
        D = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
        M = r * (q @ k.transpose(-1, -2))
        out[:, :, lo:hi] = b * (q @ S) + M @ D
        to_end = torch.exp(g[..., -1:] - g)[..., None]  # b_C / b_s
        S = g[..., -1].exp()[..., None, None] * S + k.transpose(-1, -2) @ (to_end * D)
    return out, S


def _initial_state(state: torch.Tensor | None, B: int, H: int, Dk: int, v: torch.Tensor) -> torch.Tensor:
    """The state to start from: `state` (in at least float32), or zeros."""
    dt = torch.promote_types(v.dtype, torch.float32)
    if state is None:
        return torch.zeros(B, H, Dk, v.shape[-1], dtype=dt, device=v.device)
    if state.shape != (B, H, Dk, v.shape[-1]):
        raise ValueError(f"state of shape {tuple(state.shape)}, expected {(B, H, Dk, v.shape[-1])}")
    return state.to(torch.promote_types(state.dtype, dt))


def causal_conv(x_BCT: torch.Tensor, weight_CK: torch.Tensor, state_BCk: torch.Tensor | None = None,
                bias_C: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution of kernel K over T steps after `state` (the K-1 inputs before them;
    zeros at a sequence's start), SiLU applied: (outputs (B, C, T), the new state, the last K-1 inputs)."""
    B, C, T = x_BCT.shape
    K = weight_CK.shape[-1]
    if state_BCk is None:
        state_BCk = x_BCT.new_zeros(B, C, K - 1)
    elif state_BCk.shape != (B, C, K - 1):
        raise ValueError(f"conv state of shape {tuple(state_BCk.shape)}, expected {(B, C, K - 1)}")
    seq = torch.cat([state_BCk.to(x_BCT.dtype), x_BCT], dim=-1)
    y = F.conv1d(seq, weight_CK.to(x_BCT.dtype)[:, None, :], bias_C, groups=C)
    return F.silu(y), seq[:, :, seq.shape[-1] - (K - 1):].clone()


def l2_unit(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x over its last dimension's length (with `eps` under the root, as the published models' kernels)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# -- the layer --------------------------------------------------------------------------------------


@dataclass
class DeltaNetState:
    """One Gated DeltaNet layer's state for a batch: the convolution's last K-1 inputs (B, C, K-1) and each
    value head's delta-rule state (B, Hv, Dk, Dv), float32. Its size does not grow with the sequence."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    def clone(self) -> "DeltaNetState":
        return DeltaNetState(self.conv.clone(), self.recurrent.clone())

    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet token mixer as Qwen3-Next and Qwen3.5-MoE publish it (their tensors' names):
    projections to q, k, v and the output gate z, and to the write strength b and decay input a (layout
    "qkvz": Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, laid out per key-head group; "split": Qwen3.5's
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); the short causal convolution over q, k and v;
    the delta rule per value head (keys and queries shared by `num_v // num_k` value heads), with the
    decay exp(-exp(A_log) softplus(a + dt_bias)); an RMS norm of each head's output gated by SiLU(z);
    `out_proj`. A prompt runs in chunks, a decoding token one state update."""

    def __init__(self, hidden: int, num_k: int, num_v: int, dk: int, dv: int, conv_kernel: int, eps: float,
                 layout: str = "qkvz") -> None:
        super().__init__()
        if num_v % num_k:
            raise ValueError(f"value heads ({num_v}) must be a multiple of key heads ({num_k})")
        self.num_k, self.num_v, self.dk, self.dv, self.eps, self.layout = num_k, num_v, dk, dv, eps, layout
        self.conv_dim = 2 * num_k * dk + num_v * dv
        if layout == "qkvz":
            self.in_proj_qkvz = Linear(hidden, 2 * num_k * dk + 2 * num_v * dv, bias=False)
            self.in_proj_ba = Linear(hidden, 2 * num_v, bias=False)
        elif layout == "split":
            self.in_proj_qkv = Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = Linear(hidden, num_v * dv, bias=False)
            self.in_proj_b = Linear(hidden, num_v, bias=False)
            self.in_proj_a = Linear(hidden, num_v, bias=False)
        else:
            raise ValueError(f"layout must be 'qkvz' or 'split', got {layout!r}")
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v))
        self.A_log = nn.Parameter(torch.zeros(num_v))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(dv))
        self.out_proj = Linear(num_v * dv, hidden, bias=False)

    def empty_state(self, batch: int, device: torch.device | str = "cpu") -> DeltaNetState:
        """The state before a sequence's first token: zeros."""
        return DeltaNetState(torch.zeros(batch, self.conv_dim, self.conv1d.kernel_size[0] - 1, device=device),
                             torch.zeros(batch, self.num_v, self.dk, self.dv, device=device))

    def _split(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k (B, T, num_k, dk), v and z (B, T, num_v, dv), b and a (B, T, num_v): the projections laid
        out per key-head group, as the published checkpoints store them."""
        B, T, _ = x_BTD.shape
        if self.layout == "split":
            q, k, v = self.in_proj_qkv(x_BTD).split([self.num_k * self.dk] * 2 + [self.num_v * self.dv], dim=-1)
            return (q.view(B, T, self.num_k, self.dk), k.view(B, T, self.num_k, self.dk),
                    v.view(B, T, self.num_v, self.dv), self.in_proj_z(x_BTD).view(B, T, self.num_v, self.dv),
                    self.in_proj_b(x_BTD), self.in_proj_a(x_BTD))
        per = self.num_v // self.num_k
        qkvz = self.in_proj_qkvz(x_BTD).view(B, T, self.num_k, 2 * self.dk + 2 * per * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
        b, a = self.in_proj_ba(x_BTD).view(B, T, self.num_k, 2 * per).split([per, per], dim=-1)
        return (q, k, v.reshape(B, T, self.num_v, self.dv), z.reshape(B, T, self.num_v, self.dv),
                b.reshape(B, T, self.num_v), a.reshape(B, T, self.num_v))

    def forward(self, x_BTD: torch.Tensor, state: DeltaNetState | None = None, chunk: int = 64
                ) -> tuple[torch.Tensor, DeltaNetState]:
        """The layer's output (B, T, hidden) for T tokens after `state` (None: a sequence's start), and
        the state after them."""
        B, T, _ = x_BTD.shape
        q, k, v, z, b, a = self._split(x_BTD)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1).transpose(1, 2)
        conv, conv_state = causal_conv(mixed, self.conv1d.weight[:, 0], None if state is None else state.conv)
        q, k, v = conv.transpose(1, 2).split([self.num_k * self.dk, self.num_k * self.dk, self.num_v * self.dv], -1)
        per = self.num_v // self.num_k
        heads = lambda t, d: t.reshape(B, T, -1, d).transpose(1, 2)  # noqa: E731
        q = l2_unit(heads(q, self.dk).float()).repeat_interleave(per, dim=1) / self.dk ** 0.5
        k = l2_unit(heads(k, self.dk).float()).repeat_interleave(per, dim=1)
        v = heads(v, self.dv)
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (B, T, num_v)
        rule = delta_rule_recurrent if T == 1 and state is not None else \
            lambda *args: delta_rule_chunked(*args, chunk=chunk)
        o, S = rule(q, k, v, log_decay.transpose(1, 2), b.float().sigmoid().transpose(1, 2),
                    None if state is None else state.recurrent)
        o = o.transpose(1, 2)  # (B, T, num_v, dv), float32
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = (self.norm.weight * o.to(x_BTD.dtype)).float() * F.silu(z.float())
        return self.out_proj(o.to(x_BTD.dtype).reshape(B, T, -1)), DeltaNetState(conv_state, S)
