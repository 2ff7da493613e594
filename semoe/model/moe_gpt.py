"""The MoE GPT: a decoder-only transformer whose feed-forward layers are mixtures of experts.

Single-device and plain PyTorch. The architectures it runs differ in small config-driven pieces,
each in one place: the attention variant and rotary embeddings (`semoe.model.attention`), the router
variant (pure functions in `semoe.model.routing`, picked by `Router`), and the expert MLP variant
(`semoe.model.experts`). Parallelism, offload and memory compaction are applied from outside through two
seams: each MoE layer reaches its expert weights through an `ExpertProvider` (resident parameters
by default; the offload engine and the SSD-backed trainer bring their own), and activations can be
redirected with saved-tensor hooks.

Shape legend: B batch, T tokens in this call, D hidden size, E experts, K experts per token,
V vocabulary, N tokens flattened (B*T).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from semoe.model.attention import KVCache, RMSNorm, make_attention, rope_tables
from semoe.model.compact_linear import Linear, linear
from semoe.model.config import MoEConfig
from semoe.model.linear_attention import GatedDeltaNet
from semoe.model.compressed_attention import CompressedAttention
from semoe.model.compressed_state import CompressedBuffers
from semoe.model.experts import ExpertProvider, ExpertWeights, ResidentExperts, clamped_silu_glu, swiglu
from semoe.model.hyper_connections import HyperConnection, HyperHead
from semoe.model.routing import (Routing, capacity_keep_mask, dispatch_order, expert_capacity, gather_rows,
                                 load_balancing_loss, route_grouped, route_hashed, route_topk, route_topk_sigmoid,
                                 route_topk_softmax, router_z_loss)

__all__ = ["MoEGPT", "MoEFeedForward", "Router", "DenseFFN", "Block", "ModelOutput", "RouterStats", "KVCache",
           "RMSNorm", "ExpertProvider", "ExpertWeights", "ResidentExperts", "rope_tables", "swiglu"]


class DenseFFN(nn.Module):
    """A SwiGLU feed-forward layer (dense layers and shared experts); with `limit`, DeepSeek-V4's clamped one."""

    def __init__(self, dim: int, hidden: int, limit: float | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.limit is not None:
            return self.down_proj(clamped_silu_glu(self.gate_proj(x), self.up_proj(x), self.limit))
        return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


# -- routing ------------------------------------------------------------------------------------


class Router(nn.Module):
    """A MoE layer's router: its parameters, and the routing function `config.router` names."""

    def __init__(self, config: MoEConfig, layer: int = 0) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(config.num_experts)) if config.router_bias else None
        # DeepSeek-V4's first layers choose each token's experts by its id, from a frozen table
        self.hashed = config.hash_layers is not None and layer in config.hash_layers
        if self.hashed:
            self.tid2eid = nn.Parameter(torch.zeros(config.vocab_size, config.top_k, dtype=torch.long),
                                        requires_grad=False)
            self.ids: torch.Tensor | None = None  # the token ids of the model's call under way (`MoEGPT._blocks`)
        elif config.score_correction_bias:
            # DeepSeek-V3 adjusts it from expert loads, not by gradient: a frozen parameter here. ERNIE's
            # checkpoints hold it as one row of a (groups, experts) table, with one group.
            shape = (1, config.num_experts) if config.arch == "ernie4_5_moe" else (config.num_experts,)
            self.e_score_correction_bias = nn.Parameter(torch.zeros(shape), requires_grad=False)

    def forward(self, x_ND: torch.Tensor, ids_N: torch.Tensor | None = None) -> Routing:
        """The routing of rows `x_ND`; `ids_N`, their token ids, for a layer that routes by them."""
        c = self.config
        if self.hashed:
            ids_N = self.ids if ids_N is None else ids_N  # the model's call's, for a guess of this layer's experts
            if ids_N is None or ids_N.numel() != x_ND.shape[0]:
                raise ValueError("a hash-routed MoE layer needs the tokens' ids")
            logits = nn.functional.linear(x_ND.float(), self.weight.float())
            return route_hashed(logits, self.tid2eid[ids_N.reshape(-1)], scores=c.router_scores,
                                normalize=c.norm_topk_prob, scale=c.routed_scaling_factor)
        # `linear`: a decoding step's rows on semoe's CPU kernel, torch's product otherwise
        if c.router == "softmax_topk":
            return route_topk(linear(x_ND, self.weight), c.top_k, normalize=c.norm_topk_prob)
        if c.router == "topk_softmax":
            return route_topk_softmax(linear(x_ND, self.weight, self.bias), c.top_k)
        if c.router == "topk_sigmoid_input":
            return route_topk_sigmoid(linear(x_ND, self.weight), c.top_k)
        # DeepSeek computes these logits in float32 whatever the model's dtype
        logits = nn.functional.linear(x_ND.float(), self.weight.float())
        return route_grouped(logits, c.top_k, scores=c.router_scores,
                             correction_bias_E=self.e_score_correction_bias if c.score_correction_bias else None,
                             n_group=c.n_group, topk_group=c.topk_group, group_score=c.group_score,
                             normalize=c.norm_topk_prob, scale=c.routed_scaling_factor)


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
        self.router = Router(config, layer)
        self.scales_input = config.router == "topk_sigmoid_input"  # the weights scale the experts' input
        self.experts: ExpertProvider = ResidentExperts(config)
        if config.shared_expert_size:
            limit = config.swiglu_limit if config.expert_mlp == "limited_swiglu" else None
            self.shared = DenseFFN(config.hidden_size, config.shared_expert_size, limit)
            if config.shared_expert_gate:
                self.shared_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def use_experts(self, provider: ExpertProvider) -> None:
        """Take expert weights from `provider` from now on (offload engines, SSD-backed training)."""
        if "experts" in self._modules:
            del self._modules["experts"]
        if isinstance(provider, nn.Module):
            self.add_module("experts", provider)
        else:
            object.__setattr__(self, "experts", provider)

    def route(self, x_ND: torch.Tensor, ids_N: torch.Tensor | None = None) -> Routing:
        """Routing of flattened tokens (the same function the offload engine uses to predict); `ids_N`
        their token ids, which a hash-routed layer needs."""
        return self.router(x_ND, ids_N)

    def route_and_keep(self, x_ND: torch.Tensor, ids_N: torch.Tensor | None = None
                       ) -> tuple[Routing, torch.Tensor]:
        """Routing and, in training with a capacity factor, which (token, choice) pairs are kept."""
        c = self.config
        r = self.route(x_ND, ids_N)
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
        out_ND = self.combine_shared(x_ND, y_NKD.sum(dim=1))
        if self.training:
            aux, z = load_balancing_loss(r.probs_TE, r.ids_TK, c.num_experts), router_z_loss(r.logits_TE)
        else:  # inference needs the routing, not the losses
            aux = z = x_ND.new_zeros((), dtype=torch.float32)
        return out_ND, RouterStats(aux_loss=aux, z_loss=z, ids_NK=r.ids_TK, dropped=(~keep_NK).sum())

    def combine_shared(self, x_ND: torch.Tensor, out_ND: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum plus the shared expert's output, where the layer has one."""
        c = self.config
        if c.shared_expert_size:
            shared_ND = self.shared(x_ND)
            out_ND = out_ND + (torch.sigmoid(self.shared_gate(x_ND)) * shared_ND if c.shared_expert_gate else shared_ND)
        return out_ND

    def _one_token(self, x_1D: torch.Tensor, r: Routing) -> tuple[torch.Tensor, RouterStats]:
        """A decoding step's single row in inference: its top-k experts straight from the routing,
        without the dispatch of many rows (a dozen small ops a layer, a large share of a token's time
        on CPU); the same products and weights as `forward`'s, summed over choices in the same order,
        so the same bits."""
        ids = r.ids_TK[0].tolist()  # the layer's one host sync, as dispatch_order's
        weights_K = r.weights_TK[0].to(x_1D.dtype)
        rows: list[torch.Tensor | None] = [None] * len(ids)
        run = getattr(self.experts, "run", None)
        if run is not None:  # a provider that computes its experts itself (hybrid decode)
            choices = {e: [k for k, i in enumerate(ids) if i == e] for e in sorted(set(ids))}
            outs = run(self.layer, [(e, torch.cat([x_1D * weights_K[ch] for ch in chs]) if self.scales_input
                                     else x_1D) for e, chs in choices.items()], x_1D)
            for e, chs in choices.items():
                for j, ch in enumerate(chs):
                    rows[ch] = outs[e][j:j + 1] if self.scales_input else outs[e] * weights_K[ch]
        else:
            for e, w in self.experts.stream(self.layer, sorted(set(ids)), x_1D):
                y = None if self.scales_input else w.apply(x_1D)
                for ch in (k for k, i in enumerate(ids) if i == e):
                    rows[ch] = w.apply(x_1D * weights_K[ch]) if self.scales_input else y * weights_K[ch]
        # the sum over choices in choice order: forward's sum of one row's choices for one or two (and,
        # as torch sums, for more at the hidden sizes of real models); DecodePlan's combine repeats it
        out_1D = rows[0]
        for row in rows[1:]:
            out_1D = out_1D + row
        zero = x_1D.new_zeros((), dtype=torch.float32)  # inference needs the routing, not the losses
        return self.combine_shared(x_1D, out_1D), RouterStats(aux_loss=zero, z_loss=zero, ids_NK=r.ids_TK)

    def forward(self, x_BTD: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, RouterStats]:
        """The layer on x's rows; `ids`, their token ids (any shape of B T elements), for hash routing."""
        c = self.config
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        if x_ND.shape[0] == 1 and not self.training:
            out_ND, stats = self._one_token(x_ND, self.route(x_ND, ids))
            return out_ND.view(B, T, D), stats
        r, keep_NK = self.route_and_keep(x_ND, ids)
        token_idx, choice_idx, counts_E = dispatch_order(r.ids_TK, keep_NK, c.num_experts)
        # The host needs the counts to slice each expert's rows: with dispatch_order's nonzero, the
        # layer's only host syncs (both data-dependent sizes).
        counts = counts_E.tolist()
        # Each (token, choice) gets its own row and the rows are summed over choices at the end, so
        # the result does not depend on the order in which the provider hands out experts. The rows
        # are gathered once, split into each expert's (views), and the outputs put back once: in
        # training each of those has one backward op for the layer, not one over all N rows per expert.
        x_RD = gather_rows(x_ND, token_idx, choice_idx, c.top_k)
        w_R1 = r.weights_TK[token_idx, choice_idx, None].to(x_ND.dtype)
        if self.scales_input:  # Llama-4: each row into its expert times its weight, the output as it is
            x_RD = x_RD * w_R1
        rows = x_RD.split(counts)
        y_parts: dict[int, torch.Tensor] = {}
        run = getattr(self.experts, "run", None)
        if run is not None:  # a provider that computes its experts itself (hybrid decode)
            y_parts = run(self.layer, [(e, rows[e]) for e, n in enumerate(counts) if n], x_ND)
        else:
            for e, w in self.experts.stream(self.layer, [e for e, n in enumerate(counts) if n], x_ND):
                y_parts[e] = w.apply(rows[e])
        y_RD = torch.cat([y_parts[e] for e, n in enumerate(counts) if n]) if y_parts else x_RD
        if not self.scales_input:
            y_RD = y_RD * w_R1
        y_NKD = x_ND.new_zeros(x_ND.shape[0], c.top_k, D).index_put((token_idx, choice_idx), y_RD)
        out_ND, stats = self.combine(x_ND, y_NKD, r, keep_NK)
        return out_ND.view(B, T, D), stats


# -- the model ----------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a dense or MoE feed-forward layer. With `hc_mult` > 1
    (DeepSeek-V4) the residual is that many streams, and a hyper-connection around each of the two
    (`hc_attn`, `hc_ffn`) collapses them into its input and spreads its output back."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_plus_one)
        # a token mixer that keeps a state of its own per sequence (in the cache's `states`), not positions:
        # Gated DeltaNet (Qwen3-Next), DeepSeek-V4's window and compressed entries
        self.linear = c.is_linear(layer)
        self.stateful = self.linear or c.attention == "compressed"
        if self.linear:
            self.attn = GatedDeltaNet(c.hidden_size, c.linear_key_heads, c.linear_value_heads, c.linear_key_dim,
                                      c.linear_value_dim, c.linear_conv_kernel, c.rms_norm_eps, c.linear_layout)
        elif c.attention == "compressed":
            self.attn = CompressedAttention(c, layer)
        else:
            self.attn = make_attention(c, layer)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_plus_one)
        self.ffn: nn.Module = (MoEFeedForward(config, layer) if config.is_moe_layer(layer)
                               else DenseFFN(config.hidden_size, config.ffn_size))
        if c.hc_mult > 1:
            self.hc_attn, self.hc_ffn = (HyperConnection(c.hidden_size, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps,
                                                         c.rms_norm_eps) for _ in range(2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | list[KVCache] | None, counts: list[int] | None = None,
                ids: torch.Tensor | None = None) -> tuple[torch.Tensor, RouterStats | None]:
        """x (B, T, D), or (B, T, streams, D) with hyper-connections. With `counts`, x's rows are the packed
        tokens of the sequences whose caches `cache` lists (`MoEGPT.forward_packed`); `ids` are the rows'
        token ids (a hash-routed MoE layer's input)."""
        hc = getattr(self, "hc_attn", None) is not None
        post, comb, h = self.hc_attn(x) if hc else (None, None, x)
        h = self.attn_norm(h)
        y = self._mix_stateful(h, cache, counts) if self.stateful else self.attn(h, cos, sin, cache, counts)
        x = HyperConnection.merge(post, comb, y, x) if hc else x + y
        post, comb, h = self.hc_ffn(x) if hc else (None, None, x)
        h = self.ffn_norm(h)
        stats = None
        if isinstance(self.ffn, MoEFeedForward):  # (the token ids only where they route: a parallel layer takes x)
            y, stats = self.ffn(h, ids) if self.ffn.router.hashed else self.ffn(h)
        else:
            y = self.ffn(h)
        return (HyperConnection.merge(post, comb, y, x) if hc else x + y), stats

    def _mix_stateful(self, x_BTD: torch.Tensor, cache: KVCache | list[KVCache] | None, counts: list[int] | None
                      ) -> torch.Tensor:
        """The stateful token mixer over this call's rows, each sequence's from the state its cache holds
        (a sequence's start without one), which the call's last row's state then replaces."""
        if cache is None:
            return self._mix(x_BTD, None, 0)[0]
        if counts is None:
            cache = [cache]
            counts = [x_BTD.shape[1]]
        outs, s = [], 0
        for c, n in zip(cache, counts):
            if c.states is None:
                raise ValueError(f"layer {self.layer}: a KV cache without per-layer states (made for another model)")
            held = c.states[self.layer]
            if isinstance(held, CompressedBuffers):  # the kernels' layout: read and written as a CompressedState
                y, state = self._mix(x_BTD[:, s:s + n], held.to_state(c.length) if c.length else None, c.length)
                held.store(state, c.length, c.length + n)
            else:
                y, c.states[self.layer] = self._mix(x_BTD[:, s:s + n], held if c.length else None, c.length)
            outs.append(y)
            s += n
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _mix(self, x_BTD: torch.Tensor, state, start: int):
        return self.attn(x_BTD, state) if self.linear else self.attn(x_BTD, state, start)


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
        if config.index_topk is not None and config.attention == "mla":  # a layer without an indexer reads the
            # nearest one's before it
            for i, block in enumerate(self.layers):
                if not config.indexes(i):
                    chooser = self.layers[max(j for j in range(i) if config.indexes(j))].attn
                    object.__setattr__(block.attn, "chooser", chooser)  # a reference, not a submodule
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_plus_one)
        if config.hc_mult > 1:  # the last layer's streams collapsed into one before the norm
            self.hc_head = HyperHead(config.hidden_size, config.hc_mult, config.hc_eps, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
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

    def forward_packed(self, ids_N: torch.Tensor, caches: list[KVCache], counts: list[int],
                       rows: list[int] | None = None) -> ModelOutput:
        """The tokens of several sequences in one tensor, without padding: sequence i's `counts[i]`
        tokens continue after `caches[i].length` (each cache of batch 1, its own positions). The dense
        layers and each MoE layer take all rows at once (a layer reads the union of the rows'
        experts once), attention takes each sequence against its own cache; every cache advances by
        its count. Logits (1, len(rows), V) of `rows` only (default: all), the rows sampled from.
        It goes through the module call, so forward hooks see it (the decode profile, traces)."""
        return self(ids_N, caches, counts=counts, rows=rows)

    def _packed(self, ids_N: torch.Tensor, caches: list[KVCache], counts: list[int],
                rows: list[int] | None) -> ModelOutput:
        """`forward_packed`'s work, reached through `forward`."""
        N = ids_N.shape[0]
        if len(caches) != len(counts) or sum(counts) != N or any(n < 1 for n in counts):
            raise ValueError(f"{len(caches)} caches and counts {counts} do not pack {N} tokens")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a sequence appears twice in one packed batch")
        for c, n in zip(caches, counts):
            if c.k[0].shape[0] != 1 or c.length + n > min(c.capacity, self.config.max_position):
                raise ValueError(f"a cache of batch {c.k[0].shape[0]} holding {c.length} of {c.capacity} positions "
                                 f"cannot take {n} more (batch 1, at most max_position {self.config.max_position})")
        device = ids_N.device
        spans = [torch.arange(c.length, c.length + n, device=device) for c, n in zip(caches, counts)]
        positions_1N = (spans[0] if len(spans) == 1 else torch.cat(spans))[None]
        x_1ND = self.embed(ids_N[None])
        cos, sin = self._rope(positions_1N, x_1ND.dtype)
        x_1ND, router = self._blocks(x_1ND, cos, sin, caches, counts, ids_N)
        for c, n in zip(caches, counts):
            c.length += n
        if rows is not None:  # a run of rows is a slice: no index tensor to build (and copy to a GPU)
            run = rows and rows == list(range(rows[0], rows[0] + len(rows)))
            x_1ND = x_1ND[:, rows[0]:rows[0] + len(rows)] if run else x_1ND[:, rows]
        return self._output(self.lm_head(self.norm(x_1ND)), router)

    def forward(self, ids_BT: torch.Tensor, cache: KVCache | list[KVCache] | None = None, *,
                counts: list[int] | None = None, rows: list[int] | None = None) -> ModelOutput:
        """Logits of every position; with a cache, `ids_BT` continues after `cache.length` positions.
        With `counts`, the packed tokens (N,) of the sequences whose caches `cache` lists
        (`forward_packed`)."""
        if counts is not None:
            return self._packed(ids_BT, cache, counts, rows)
        B, T = ids_BT.shape
        start = cache.length if cache is not None else 0
        if start + T > self.config.max_position:
            raise ValueError(f"sequence of {start + T} positions exceeds max_position {self.config.max_position}")
        x_BTD = self.embed(ids_BT)
        positions_BT = torch.arange(start, start + T, device=ids_BT.device).expand(B, T)
        cos, sin = self._rope(positions_BT, x_BTD.dtype)
        x_BTD, router = self._blocks(x_BTD, cos, sin, cache, None, ids_BT)
        if cache is not None:
            cache.length = start + T
        return self._output(self.lm_head(self.norm(x_BTD)), router)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The blocks' rotary tables; none where every layer rotates by its own (DeepSeek-V4's two bases)."""
        if self.config.attention == "compressed":
            return None, None
        return rope_tables(self.config, positions, dtype)

    def _blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, counts: list[int] | None,
                ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, RouterStats]]:
        """Every block in order (over `hc_mult` copies of the embedding as the streams, collapsed after the
        last, where the model has hyper-connections), and each MoE layer's router stats."""
        router: dict[int, RouterStats] = {}
        hc = self.config.hc_mult > 1
        if hc:
            x = x[..., None, :].expand(*x.shape[:-1], self.config.hc_mult, x.shape[-1]).contiguous()
        if self.config.hash_layers is not None:  # where the offload engine guesses a hash-routed layer's experts
            for ffn in self.moe_layers():
                if ffn.router.hashed:
                    ffn.router.ids = ids
        for block in self.layers:
            x, stats = block(x, cos, sin, cache, counts, ids)
            if stats is not None:
                router[block.layer] = stats
        return (self.hc_head(x) if hc else x), router

    def _output(self, logits: torch.Tensor, router: dict[int, RouterStats]) -> ModelOutput:
        zero = logits.new_zeros(())
        if not self.training:  # every layer's losses are zero in inference: no sums to make
            return ModelOutput(logits=logits, aux_loss=zero, z_loss=zero, router=router)
        n = max(len(router), 1)
        aux = sum((s.aux_loss for s in router.values()), zero) / n
        z = sum((s.z_loss for s in router.values()), zero) / n
        return ModelOutput(logits=logits, aux_loss=aux, z_loss=z, router=router)
