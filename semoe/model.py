"""The MoE GPT: a decoder-only transformer whose feed-forward layers are mixtures of experts.

Single-device and plain PyTorch. Parallelism, offload and memory compaction are applied from
outside through two seams: each MoE layer reaches its expert weights through an `ExpertProvider`
(resident parameters by default; the offload engine and the SSD-backed trainer bring their own),
and activations can be redirected with saved-tensor hooks.

Shape legend: B batch, T tokens in this call, S cached + new positions, D hidden size,
H query heads, G key/value heads, Dh head dim, E experts, K experts per token, F expert FFN size,
V vocabulary, N tokens flattened (B*T).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from semoe.config import MoEConfig
from semoe.gating import Routing, capacity_keep_mask, dispatch_order, expert_capacity, load_balancing_loss, \
    route_topk, router_z_loss

# -- small pieces -------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementations."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary embeddings, (B, T, Dh), for integer positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions_BT.device)
                                / head_dim))
    freqs_BTd = positions_BT.float()[..., None] * inv_freq
    emb = torch.cat((freqs_BTd, freqs_BTd), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BHTDh: torch.Tensor, cos_BTDh: torch.Tensor, sin_BTDh: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + Dh/2) of each head by the position's angle."""
    cos, sin = cos_BTDh[:, None], sin_BTDh[:, None]
    half = x_BHTDh.shape[-1] // 2
    rotated = torch.cat((-x_BHTDh[..., half:], x_BHTDh[..., :half]), dim=-1)
    return x_BHTDh * cos + rotated * sin


def swiglu(x_ND: torch.Tensor, w_gate_FD: torch.Tensor, w_up_FD: torch.Tensor, w_down_DF: torch.Tensor
           ) -> torch.Tensor:
    """The SwiGLU feed-forward every expert and dense layer uses: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x_ND, w_gate_FD)) * F.linear(x_ND, w_up_FD), w_down_DF)


class DenseFFN(nn.Module):
    """A SwiGLU feed-forward layer (dense layers and shared experts)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


# -- attention with a KV cache ------------------------------------------------------------------


@dataclass
class KVCache:
    """Preallocated keys and values of every layer, (B, G, S_max, Dh) each, filled up to `length`."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, config: MoEConfig, batch: int, max_len: int, *, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> "KVCache":
        """A cache for `max_len` positions."""
        if max_len > config.max_position:
            raise ValueError(f"max_len {max_len} exceeds the model's max_position {config.max_position}")
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)
        return cls(k=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)],
                   v=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)])

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings, optional q/k norm and qkv clipping."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        c, d = config, config.head_dim
        self.config = config
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * d, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * d, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * d, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * d, c.hidden_size, bias=False)
        if c.qk_norm == "full":
            self.q_norm = RMSNorm(c.num_heads * d, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.num_kv_heads * d, c.rms_norm_eps)

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                cache: KVCache | None) -> torch.Tensor:
        c = self.config
        B, T, _ = x_BTD.shape
        q, k, v = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        if c.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q_BHTDh = apply_rope(q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
        k_BGTDh = apply_rope(k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
        v_BGTDh = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        start = 0
        if cache is not None:
            start = cache.length
            if start + T > cache.capacity:
                raise ValueError(f"KV cache of {cache.capacity} positions cannot take {start + T}")
            cache.k[layer][:, :, start:start + T] = k_BGTDh
            cache.v[layer][:, :, start:start + T] = v_BGTDh
            k_BGTDh, v_BGTDh = cache.k[layer][:, :, :start + T], cache.v[layer][:, :, :start + T]
        mask, causal = None, False
        if T > 1 and start == 0:  # training and a first prefill: square causal, which flash kernels take
            causal = True
        elif T > 1:  # query i (at position start+i) sees keys 0..start+i; is_causal would align top-left
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x_BTD.device).tril(diagonal=start)
        # T == 1: one new token sees every cached position, no mask needed
        out_BHTDh = F.scaled_dot_product_attention(q_BHTDh, k_BGTDh, v_BGTDh, attn_mask=mask, is_causal=causal,
                                                   enable_gqa=c.num_kv_heads != c.num_heads)
        return self.o_proj(out_BHTDh.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim))


# -- experts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's SwiGLU weights: gate (F, D), up (F, D), down (D, F)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def apply(self, x_MD: torch.Tensor) -> torch.Tensor:
        """The expert on its rows (a trainer's subclass routes gradients to its own state store)."""
        return swiglu(x_MD, self.gate, self.up, self.down)


class ExpertProvider(Protocol):
    """Where a MoE layer's expert weights come from (the seam offload and training plug into)."""

    def stream(self, layer: int, experts: list[int], x_ND: torch.Tensor) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield each of `experts` once, in any order, with its weights; weights are valid until the
        next item is requested. `x_ND` is the layer's routed input, which an offloading provider
        may use to predict and prefetch later layers' experts."""
        ...


class ResidentExperts(nn.Module):
    """All experts of one layer as parameters on the module's device: w_gate/w_up (E, F, D), w_down (E, D, F)."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden))
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, std=0.02)

    def stream(self, layer: int, experts: list[int], x_ND: torch.Tensor) -> Iterator[tuple[int, ExpertWeights]]:
        for e in experts:
            yield e, ExpertWeights(self.w_gate[e], self.w_up[e], self.w_down[e])


@dataclass
class RouterStats:
    """What one MoE layer's router did: losses (scalars) and the routing, for prefetch and tests."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    ids_NK: torch.Tensor
    # (token, choice) pairs over capacity: a device scalar, since reading it would stall every layer
    dropped: torch.Tensor | int = 0


class MoEFeedForward(nn.Module):
    """Router, token dispatch and experts as separate pieces; the experts behind a provider."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        self.config = config
        self.layer = layer
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts: ExpertProvider = ResidentExperts(config.num_experts, config.hidden_size, config.moe_ffn_size)
        if config.shared_expert_size:
            self.shared = DenseFFN(config.hidden_size, config.shared_expert_size)
            self.shared_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def use_experts(self, provider: ExpertProvider) -> None:
        """Take expert weights from `provider` from now on (offload engines, SSD-backed training)."""
        if "experts" in self._modules:
            del self._modules["experts"]
        if isinstance(provider, nn.Module):
            self.add_module("experts", provider)
        else:
            object.__setattr__(self, "experts", provider)

    def route(self, x_ND: torch.Tensor) -> Routing:
        """Top-k routing of flattened tokens (the same function the offload engine uses to predict)."""
        return route_topk(self.router(x_ND), self.config.top_k, normalize=self.config.norm_topk_prob)

    def route_and_keep(self, x_ND: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        """Routing and, in training with a capacity factor, which (token, choice) pairs are kept."""
        c = self.config
        r = self.route(x_ND)
        keep_NK = torch.ones_like(r.ids_TK, dtype=torch.bool)
        if self.training and c.capacity_factor is not None:
            cap = expert_capacity(x_ND.shape[0], c.num_experts, c.top_k, c.capacity_factor)
            keep_NK = capacity_keep_mask(r.ids_TK, c.num_experts, cap)
        return r, keep_NK

    def combine(self, x_ND: torch.Tensor, y_NKD: torch.Tensor, r: Routing, keep_NK: torch.Tensor
                ) -> tuple[torch.Tensor, RouterStats]:
        """Sum the weighted expert rows over choices (a fixed order, whatever order the experts ran
        in), add the shared expert, and the router's losses and stats."""
        c = self.config
        out_ND = y_NKD.sum(dim=1)
        if c.shared_expert_size:
            out_ND = out_ND + torch.sigmoid(self.shared_gate(x_ND)) * self.shared(x_ND)
        if self.training:
            aux, z = load_balancing_loss(r.probs_TE, r.ids_TK, c.num_experts), router_z_loss(r.logits_TE)
        else:  # inference needs the routing, not the losses
            aux = z = x_ND.new_zeros((), dtype=torch.float32)
        return out_ND, RouterStats(aux_loss=aux, z_loss=z, ids_NK=r.ids_TK, dropped=(~keep_NK).sum())

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        c = self.config
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        r, keep_NK = self.route_and_keep(x_ND)
        token_idx, choice_idx, counts_E = dispatch_order(r.ids_TK, keep_NK, c.num_experts)
        # The host needs the counts to slice each expert's rows: with dispatch_order's nonzero, the
        # layer's only host syncs (both data-dependent sizes).
        counts = counts_E.tolist()
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        # Each (token, choice) gets its own row and the rows are summed over choices at the end, so
        # the result does not depend on the order in which the provider hands out experts.
        y_NKD = x_ND.new_zeros(x_ND.shape[0], c.top_k, D)
        for e, w in self.experts.stream(self.layer, [e for e, n in enumerate(counts) if n], x_ND):
            tok, ch = token_idx[starts[e]:starts[e + 1]], choice_idx[starts[e]:starts[e + 1]]
            y = w.apply(x_ND[tok]) * r.weights_TK[tok, ch, None].to(x_ND.dtype)
            y_NKD.index_put_((tok, ch), y)
        out_ND, stats = self.combine(x_ND, y_NKD, r, keep_NK)
        return out_ND.view(B, T, D), stats


# -- the model ----------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a dense or MoE feed-forward layer."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn: nn.Module = (MoEFeedForward(config, layer) if config.is_moe_layer(layer)
                               else DenseFFN(config.hidden_size, config.ffn_size))

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None
                ) -> tuple[torch.Tensor, RouterStats | None]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos, sin, self.layer, cache)
        h = self.ffn_norm(x_BTD)
        if isinstance(self.ffn, MoEFeedForward):
            y, stats = self.ffn(h)
            return x_BTD + y, stats
        return x_BTD + self.ffn(h), None


@dataclass
class ModelOutput:
    """Logits and the summed router losses of one forward pass (never stored on the module)."""

    logits: torch.Tensor  # (B, T, V)
    aux_loss: torch.Tensor  # mean over MoE layers of the load-balancing loss
    z_loss: torch.Tensor  # mean over MoE layers of the router z-loss
    router: dict[int, RouterStats] = field(default_factory=dict)  # per MoE layer


class MoEGPT(nn.Module):
    """A decoder-only MoE transformer; `forward(ids)` for training, with a KVCache for generation."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def moe_layers(self) -> list[MoEFeedForward]:
        """The MoE feed-forward modules, in layer order."""
        return [b.ffn for b in self.layers if isinstance(b.ffn, MoEFeedForward)]

    def forward(self, ids_BT: torch.Tensor, cache: KVCache | None = None) -> ModelOutput:
        """Logits of every position; with a cache, `ids_BT` continues after `cache.length` positions."""
        B, T = ids_BT.shape
        start = cache.length if cache is not None else 0
        if start + T > self.config.max_position:
            raise ValueError(f"sequence of {start + T} positions exceeds max_position {self.config.max_position}")
        x_BTD = self.embed(ids_BT)
        positions_BT = torch.arange(start, start + T, device=ids_BT.device).expand(B, T)
        cos, sin = rope_cos_sin(positions_BT, self.config.head_dim, self.config.rope_theta, x_BTD.dtype)
        router: dict[int, RouterStats] = {}
        for block in self.layers:
            x_BTD, stats = block(x_BTD, cos, sin, cache)
            if stats is not None:
                router[block.layer] = stats
        if cache is not None:
            cache.length = start + T
        logits = self.lm_head(self.norm(x_BTD))
        zero = logits.new_zeros(())
        n = max(len(router), 1)
        aux = sum((s.aux_loss for s in router.values()), zero) / n
        z = sum((s.z_loss for s in router.values()), zero) / n
        return ModelOutput(logits=logits, aux_loss=aux, z_loss=z, router=router)
