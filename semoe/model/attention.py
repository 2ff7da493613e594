"""Attention variants with a KV cache, and rotary embeddings.

- `Attention`: grouped-query attention with optional q/k norm (over all heads, or per head before or
  after the rotation), qkv clipping, biases, partial rotary dims, a sliding window, and attention
  sinks (gpt-oss: a learnt per-head logit in each softmax's denominator).
- `LatentAttention`: DeepSeek's multi-head latent attention. K and V come from a small latent per
  position (`kv_lora_rank`) plus one shared rotary key (`qk_rope_head_dim`); the cache holds those
  two, not the per-head K and V.

Rotary embeddings are plain RoPE or YaRN, rotating halves or interleaved pairs (DeepSeek, ERNIE).

Shape legend: B batch, T tokens in this call, S cached + new positions, D hidden size, H query
heads, G key/value heads, Dh head dim, R rotary dims, L latent (kv_lora_rank), Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from semoe.kernels import torch_ops
from semoe.model import rope
from semoe.model.rope import softmax_scale
from semoe.model.compact_linear import CompactLinear, Linear, stacked_float_rows, stacked_rows
from semoe.model.compressed_state import CompressedBuffers
from semoe.model.config import LATENT_NORM_EPS, MoEConfig
from semoe.model.linear_attention import DeltaNetState


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementations. `plus_one`: the
    weight is stored zero-centred and scales by 1 + w (Qwen3-Next's), as its checkpoints hold it."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() + 1 if self.plus_one else self.weight
        if x.dtype == torch.float32 and w.dtype == torch.float32:
            # a decoding step on CPU pays for each op it dispatches: semoe's kernel for a step's rows
            # (no gradient), else torch's fused norm, the formula's bits in one op instead of seven
            if torch_ops.takes(x) and x.is_contiguous() and torch_ops.no_grad_wanted(x, w):
                return torch_ops.rms_norm(x, w, self.eps)
            return F.rms_norm(x, w.shape, w, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:  # as the published model: the product in float32, then its dtype
            return (x32 * w).to(x.dtype)
        return self.weight * x32.to(x.dtype)


# -- rotary embeddings --------------------------------------------------------------------------


def rope_inv_freq(config: MoEConfig, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (R/2,) of the rotary dims, made on `device`, and the scale of cos and sin
    (plain RoPE or YaRN: `semoe.model.rope`, which the torch-free runner computes them with too)."""
    inv, scale = rope.inv_freq(config)
    return torch.from_numpy(inv).to(device), scale


# rope_inv_freq's results by what they depend on (rotary dims, base, scaling, device): a decoding
# step would otherwise rebuild the same frequencies, four small ops, for each token
_INV_FREQ: dict[tuple, tuple[torch.Tensor, float]] = {}


def rope_tables(config: MoEConfig, positions_BT: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (B, T, R) each, for integer positions."""
    key = (config.rope_dim, config.rope_theta, repr(config.rope_scaling), positions_BT.device)
    if key not in _INV_FREQ:
        _INV_FREQ[key] = rope_inv_freq(config, positions_BT.device)
    inv_freq, scale = _INV_FREQ[key]
    freqs_BTr = positions_BT.float()[..., None] * inv_freq
    emb = torch.cat((freqs_BTr, freqs_BTr), dim=-1)
    if scale == 1.0:  # the same values without two products
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """An RMSNorm without weights over the last dim, in float32 (Llama-4's q/k norm)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def apply_rope(x_BHTDh: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, *,
               interleave: bool = False) -> torch.Tensor:
    """Rotate the first R dims of each head, by halves (i, i + R/2) or interleaved pairs (2i, 2i + 1);
    the other dims pass through. Interleaved pairs come out as halves (the same permutation for
    queries and keys, so their dot products are unchanged)."""
    rot = cos_BTR.shape[-1]
    x, rest = (x_BHTDh, None) if rot == x_BHTDh.shape[-1] else (x_BHTDh[..., :rot], x_BHTDh[..., rot:])
    cos, sin = cos_BTR[:, None], sin_BTR[:, None]
    if interleave:
        cos, sin = cos[..., :rot // 2], sin[..., :rot // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        half = rot // 2
        out = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)


# -- the KV cache and masks ---------------------------------------------------------------------


@dataclass
class KVCache:
    """Preallocated cache of every layer, filled up to `length`: keys and values (B, G, S_max, Dh)
    for grouped-query attention; for latent attention the latent (B, 1, S_max, L) in `k` and the
    rotary key (B, 1, S_max, R) in `v`. A linear-attention layer caches no positions (its k and v hold
    no elements) and keeps its fixed-size state in `states[layer]` (None for the other layers), the
    state after exactly `length` tokens; so does a DeepSeek-V4 layer, in `CompressedBuffers`
    (`semoe.model.compressed_attention`)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0
    states: list | None = None  # of DeltaNetState, CompressedBuffers or None

    @classmethod
    def bytes_for(cls, config: MoEConfig, batch: int, max_len: int, dtype: torch.dtype) -> int:
        """Bytes of the cache `empty` allocates."""
        return config.kv_bytes(batch, max_len, torch.empty((), dtype=dtype).element_size())

    @classmethod
    def empty(cls, config: MoEConfig, batch: int, max_len: int, *, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> "KVCache":
        """A cache for `max_len` positions."""
        if max_len > config.max_position:
            raise ValueError(f"max_len {max_len} exceeds the model's max_position {config.max_position}")
        shapes = [config.layer_kv_shapes(i, batch, max_len) for i in range(config.num_layers)]
        states = None
        if config.attention == "compressed":  # in the kernels' layout, which the modules read and write too
            states = [CompressedBuffers.empty(config, i, batch, max_len, device) for i in range(config.num_layers)]
        if config.linear_layers is not None:  # zeros: the state before a sequence's first token
            conv, rec = config.linear_state_shapes(batch)
            states = [DeltaNetState(torch.zeros(conv, device=device, dtype=torch.float32),
                                    torch.zeros(rec, device=device, dtype=torch.float32))
                      if config.is_linear(i) else None for i in range(config.num_layers)]
        return cls(k=[torch.zeros(k, device=device, dtype=dtype) for k, _ in shapes],
                   v=[torch.zeros(v, device=device, dtype=dtype) for _, v in shapes], states=states)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def state_bytes(self) -> int:
        """Bytes of the linear layers' states (fixed, whatever the length)."""
        return sum(s.nbytes() for s in self.states or () if s is not None)

    def grow(self, max_len: int) -> None:
        """Room for `max_len` positions (at least the current capacity): every layer's k and v moved
        into larger tensors, the filled positions copied."""
        if max_len < self.capacity:
            raise ValueError(f"a KV cache of {self.capacity} positions cannot shrink to {max_len}")
        for kv in (self.k, self.v):
            for i, t in enumerate(kv):
                bigger = t.new_zeros(*t.shape[:2], max_len, t.shape[3])
                bigger[:, :, :self.length] = t[:, :, :self.length]
                kv[i] = bigger
        for s in self.states or ():
            if hasattr(s, "grow"):  # DeepSeek-V4's entries
                s.grow(max_len)

    def addresses(self) -> tuple[list[int], list[int]]:
        """The addresses of its layers' k and v (the compiled kernels' view of a batch of one); a Gated
        DeltaNet layer's are those of its state, the convolution's and the delta rule's."""
        ks, vs = [k.data_ptr() for k in self.k], [v.data_ptr() for v in self.v]
        for layer, t in enumerate(self.state_tensors(by_layer=True)):
            if t:
                ks[layer], vs[layer] = (x.data_ptr() for x in t)
        return ks, vs

    def state_tensors(self, by_layer: bool = False) -> list:
        """The tensors of its layers' own states (what the kernels update in place): a Gated DeltaNet
        layer's convolution and delta-rule states, a DeepSeek-V4 layer's fixed state and entries; with
        `by_layer`, a pair or () per layer."""
        pairs = [((s.conv, s.recurrent) if isinstance(s, DeltaNetState) else
                  (s.fixed, s.entries) if s is not None else ()) for s in self.states or ()]
        return pairs if by_layer else [t for p in pairs for t in p]

    def copy_from(self, src: "KVCache", n: int) -> None:
        """Take the first n positions of `src` (a sequence sharing this one's first n tokens): every
        layer's k and v copied; this cache then holds n."""
        if n > min(self.capacity, src.length):
            raise ValueError(f"{n} positions: the source holds {src.length}, this cache {self.capacity}")
        if src.states is not None and n != src.length:  # a recurrent state holds all its tokens at once
            raise ValueError(f"{n} positions: the source's per-layer state is that of its {src.length} "
                             "tokens, not of a prefix")
        for mine, theirs in ((self.k, src.k), (self.v, src.v)):
            for a, b in zip(mine, theirs):
                a[:, :, :n] = b[:, :, :n]
        if src.states is not None:
            self.states = [None if s is None else s.clone() for s in src.states]
            for s in self.states:
                if hasattr(s, "grow"):  # DeepSeek-V4's entries: room for this cache's positions
                    s.grow(self.capacity)
        self.length = n

    def trimmed(self) -> "KVCache":
        """A copy holding exactly the filled positions (`length`), nothing more."""
        cut = lambda t: t[:, :, :self.length].clone()  # noqa: E731
        states = None if self.states is None else [None if s is None else s.clone() for s in self.states]
        return KVCache(k=[cut(t) for t in self.k], v=[cut(t) for t in self.v], length=self.length, states=states)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this call's T positions after `length`; returns the layer's k and v so far."""
        start, T = self.length, k.shape[2]
        if start + T > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot take {start + T}")
        self.k[layer][:, :, start:start + T] = k
        self.v[layer][:, :, start:start + T] = v
        return self.k[layer][:, :, :start + T], self.v[layer][:, :, :start + T]


def attention_mask(T: int, start: int, window: int | None, device: torch.device, chunk: int | None = None
                   ) -> tuple[torch.Tensor | None, bool]:
    """(bool mask (T, start + T) or None, is_causal) for T queries after `start` cached positions.

    Query i (position start + i) sees keys j <= start + i, with a window only start + i - j < window,
    and with a chunk only keys of its own chunk (j // chunk == (start + i) // chunk). A square causal
    mask without either is left to the kernel (`is_causal`), which flash kernels take."""
    S = start + T
    if chunk is not None and chunk < S:
        q_T1 = torch.arange(start, S, device=device)[:, None]
        k_1S = torch.arange(S, device=device)[None, :]
        return (k_1S <= q_T1) & (k_1S // chunk == q_T1 // chunk), False
    if window is None or window >= S:
        if T > 1 and start == 0:
            return None, True
        if T == 1:  # one new token sees every cached position
            return None, False
        return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=start), False
    q_T1 = torch.arange(start, S, device=device)[:, None]
    k_1S = torch.arange(S, device=device)[None, :]
    return (k_1S <= q_T1) & (q_T1 - k_1S < window), False


def grouped_output(x_BTHD: torch.Tensor, o_a_GRI: torch.Tensor, o_b: nn.Linear | torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's grouped output projection: the heads' outputs (B, T, H, Dh) split into G groups of
    H Dh / G, each projected apart to a rank R (`o_a_proj`'s weight viewed (G, R, H Dh / G)), then the G R
    values mixed to the hidden size by `o_b_proj`."""
    B, T = x_BTHD.shape[:2]
    G = o_a_GRI.shape[0]
    groups_BTGI = x_BTHD.reshape(B, T, G, -1)
    low_BTGR = torch.einsum("btgi,gri->btgr", groups_BTGI, o_a_GRI.to(x_BTHD.dtype))
    flat = low_BTGR.reshape(B, T, -1)
    return o_b(flat) if isinstance(o_b, nn.Module) else F.linear(flat, o_b)


def attend(q_BHTD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, mask: torch.Tensor | None,
           causal: bool, *, scale: float | None = None, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention, (B, H, T, Dv). With sinks, each head's softmax denominator also holds
    exp(sink): computed explicitly (no fused kernel takes sinks), in float32 like the reference."""
    H, G = q_BHTD.shape[1], k_BGSD.shape[1]
    if sinks_H is None:
        return F.scaled_dot_product_attention(q_BHTD, k_BGSD, v_BGSD, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=G != H)
    k_BHSD, v_BHSD = k_BGSD.repeat_interleave(H // G, dim=1), v_BGSD.repeat_interleave(H // G, dim=1)
    scale = q_BHTD.shape[-1] ** -0.5 if scale is None else scale
    scores_BHTS = (q_BHTD @ k_BHSD.transpose(-1, -2)).float() * scale
    T, S = scores_BHTS.shape[-2:]
    if causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q_BHTD.device).tril()
    if mask is not None:
        scores_BHTS = scores_BHTS.masked_fill(~mask, float("-inf"))
    sink_BHT1 = sinks_H.float().view(1, H, 1, 1).expand(scores_BHTS.shape[0], H, T, 1)
    logits = torch.cat((scores_BHTS, sink_BHT1), dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return probs.to(v_BHSD.dtype) @ v_BHSD


# -- the variants -------------------------------------------------------------------------------


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings and the options listed in the module docstring."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        c, d = config, config.head_dim
        self.config = config
        self.layer = layer
        self.window, self.chunk, self.rotates = config.window(layer), config.chunk(layer), config.rotates(layer)
        if self.window is not None and self.chunk is not None:
            raise ValueError(f"layer {layer}: a sliding window and chunked attention together are not supported")
        # with the output gate, q_proj gives each head's query and then its gate (as the checkpoints hold it)
        self.gated = c.attn_output_gate
        self.q_proj = Linear(c.hidden_size, c.num_heads * d * (2 if self.gated else 1), bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * d, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * d, bias=c.attention_bias)
        self.o_proj = Linear(c.num_heads * d, c.hidden_size, bias=c.o_proj_bias)
        self.qkv_proj: nn.Module | None = None  # q, k and v as one compact product (`stack_qkv`)
        if c.qk_norm == "full":
            self.q_norm = RMSNorm(c.num_heads * d, c.rms_norm_eps, c.norm_plus_one)
            self.k_norm = RMSNorm(c.num_kv_heads * d, c.rms_norm_eps, c.norm_plus_one)
        elif c.qk_norm in ("head", "head_after_rope"):
            self.q_norm = RMSNorm(d, c.rms_norm_eps, c.norm_plus_one)
            self.k_norm = RMSNorm(d, c.rms_norm_eps, c.norm_plus_one)
        if c.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(c.num_heads))

    def stack_qkv(self) -> None:
        """Once q, k and v are loaded for inference as compact weights of one kind or as plain ones of
        one dtype, compute them as one product: a decoding step then makes one kernel call for the
        three, with the same bits."""
        if self.qkv_proj is not None:
            return
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if all(isinstance(p, CompactLinear) for p in parts):
            stacked = stacked_rows(parts)
        else:
            stacked = stacked_float_rows(parts)
        if stacked is not None:
            self.qkv_proj, self.qkv_sizes = stacked, [p.out_features for p in parts]
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | list[KVCache] | None, counts: list[int] | None = None) -> torch.Tensor:
        return packed_attention(self, x_BTD, cos, sin, cache, counts)

    def project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k and v of every row (the products over all rows at once; `packed_attention`)."""
        c = self.config
        if self.qkv_proj is not None:
            # contiguous as separate products' outputs are (a copy only for several rows), so the
            # norms and kernels after take the same path, with the same bits, as they do for those
            q, k, v = (t.contiguous() for t in self.qkv_proj(x_BTD).split(self.qkv_sizes, dim=-1))
        else:
            q, k, v = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        if self.gated:  # each head's query, then its output gate: the gate goes last, `packed_attention` takes it
            q, gate = q.unflatten(-1, (c.num_heads, 2, c.head_dim)).unbind(-2)
            q, gate = q.flatten(-2), gate.flatten(-2)
        if c.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        return (q, k, v, gate) if self.gated else (q, k, v)

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache: KVCache | None) -> torch.Tensor:
        """One sequence's rows after `project`: per-head norms, rotary, the cache, attention; (B, T, H * Dh)
        for o_proj."""
        c = self.config
        B, T, _ = q.shape
        if c.qk_norm == "head":
            q = self.q_norm(q.view(B, T, c.num_heads, c.head_dim)).view(B, T, -1)
            k = self.k_norm(k.view(B, T, c.num_kv_heads, c.head_dim)).view(B, T, -1)
        sinks = self.sinks if c.attention_sinks else None
        if self._one_call_decode(q, k, v, cos, cache):
            out = torch_ops.attend_decode(q.view(-1), k.view(-1), v.view(-1), cos.view(-1), sin.view(-1),
                                            cache.k[self.layer][0], cache.v[self.layer][0], cache.length,
                                            c.head_dim ** -0.5, window=self.window, sinks_H=sinks)
            return out.view(B, T, -1)
        q_BHTDh = q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k_BGTDh = k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if self.rotates:
            q_BHTDh = apply_rope(q_BHTDh, cos, sin, interleave=c.rope_interleave)
            k_BGTDh = apply_rope(k_BGTDh, cos, sin, interleave=c.rope_interleave)
            if c.qk_norm == "head_after_rope":
                q_BHTDh, k_BGTDh = self.q_norm(q_BHTDh), self.k_norm(k_BGTDh)
            elif c.qk_norm == "unit_after_rope":
                q_BHTDh, k_BGTDh = unit_rms(q_BHTDh, c.rms_norm_eps), unit_rms(k_BGTDh, c.rms_norm_eps)
        start = cache.length if cache is not None else 0
        if c.attn_temperature is not None and not self.rotates:
            attn_scale, floor_scale = c.attn_temperature
            p_T = torch.arange(start, start + T, device=q.device, dtype=torch.float32)
            t_T1 = torch.log1p(torch.floor((p_T + 1.0) / floor_scale)) * attn_scale + 1.0
            q_BHTDh = (q_BHTDh * t_T1[:, None]).to(q.dtype)
        v_BGTDh = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if cache is not None:
            k_BGTDh, v_BGTDh = cache.append(self.layer, k_BGTDh, v_BGTDh)
        mask, causal = attention_mask(T, start, self.window, q.device, self.chunk)
        out_BHTDh = attend(q_BHTDh, k_BGTDh, v_BGTDh, mask, causal, sinks_H=sinks)
        return out_BHTDh.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim)

    def _one_call_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         cache: KVCache | None) -> bool:
        """One token of one sequence on CPU in float32, rotation by halves and no norm after it, room in
        the cache, no gradient: `torch_ops.attend_decode` does the step in one call (partial rotary, a window
        and sinks included)."""
        c = self.config
        sinks = (self.sinks,) if c.attention_sinks else ()
        return (cache is not None and q.shape[0] == 1 and q.shape[1] == 1 and not c.rope_interleave
                and c.qk_norm not in ("head_after_rope", "unit_after_rope") and self.rotates
                and self.chunk is None and c.attn_temperature is None
                and cache.length < cache.capacity
                and all(t.dtype == torch.float32 for t in (q, k, v, cos, cache.k[self.layer], *sinks))
                and all(t.is_contiguous() for t in (q, k, v, cache.k[self.layer], cache.v[self.layer], *sinks))
                and torch_ops.no_grad_wanted(q, k, v, *sinks) and torch_ops.takes(q))


class Indexer(nn.Module):
    """DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5): for each query, a score of
    every position it sees, sum over its heads h of w_h * relu(q_h . k / sqrt(Di)) / sqrt(Hi), from
    its own small query heads (from the latent query), one key per position (normed, its first R dims
    rotated) and a weight per head; attention then reads the `index_topk` best positions. The scores
    are float32, as the reference computes them (its Hadamard rotation and FP8 rounding aside: the
    rotation keeps dot products, the rounding is the kernel's precision)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        c = config
        self.config = config
        self.wq_b = Linear(c.q_lora_rank, c.index_heads * c.index_head_dim, bias=False)
        self.wk = Linear(c.hidden_size, c.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(c.index_head_dim, eps=1e-6)
        self.weights_proj = Linear(c.hidden_size, c.index_heads, bias=False)

    def project(self, x_BTD: torch.Tensor, q_resid_BTQ: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each row's query heads (B, T, Hi * Di), key (B, T, Di, not rotated yet) and head weights (B, T, Hi)."""
        return self.wq_b(q_resid_BTQ), self.k_norm(self.wk(x_BTD)), self.weights_proj(x_BTD)

    def rotate(self, x_BHTDi: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x_BHTDi, cos, sin, interleave=self.config.index_rope_interleave)

    def choose(self, q_BTX: torch.Tensor, w_BTH: torch.Tensor, k_B1SDi: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, start: int) -> torch.Tensor:
        """Which of the S cached positions (the keys k, rotated) each of the T queries at positions
        start.. reads: (B, T, S) bool, the `index_topk` best scores among those it sees (all it sees
        where they are fewer)."""
        c = self.config
        B, T, _ = q_BTX.shape
        S = k_B1SDi.shape[2]
        q_BHTDi = self.rotate(q_BTX.view(B, T, c.index_heads, c.index_head_dim).transpose(1, 2), cos, sin)
        scores_BHTS = torch.relu((q_BHTDi.float() @ k_B1SDi.float().transpose(-1, -2)) * c.index_head_dim ** -0.5)
        w_BHT1 = (w_BTH.float() * c.index_heads ** -0.5).transpose(1, 2)[..., None]
        index_BTS = (w_BHT1 * scores_BHTS).sum(dim=1)
        seen_TS = torch.arange(S, device=q_BTX.device)[None, :] <= torch.arange(start, start + T,
                                                                                 device=q_BTX.device)[:, None]
        index_BTS = index_BTS.masked_fill(~seen_TS, float("-inf"))
        # the k best, and among scores equal to the k-th the earliest positions (as the fast core's
        # `choose_top`; the reference's top-k leaves ties, as when every head's relu is 0, to chance)
        k = min(c.index_topk, S)
        kth_BT1 = index_BTS.topk(k, dim=-1).values[..., -1:]
        above_BTS, tie_BTS = index_BTS > kth_BT1, index_BTS == kth_BT1
        room_BT1 = k - above_BTS.sum(dim=-1, keepdim=True)
        return (above_BTS | (tie_BTS & (tie_BTS.cumsum(dim=-1) <= room_BT1))) & seen_TS


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention; the cache holds the normed latent and the rotary key
    (and, with DeepSeek sparse attention, the indexer's key after it)."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.config = config
        self.layer = layer
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, c.num_heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(c.q_lora_rank, c.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                            bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = Linear(c.num_heads * c.v_head_dim, c.hidden_size, bias=c.o_proj_bias)
        self.scale = softmax_scale(config)
        self.indexer = Indexer(config) if c.indexes(layer) else None
        # under sparse attention: the choice of positions this layer last made, by sequence (`_read`), and
        # for a layer without an indexer, the layer whose choice it reads (set by the model)
        self.choices: dict[int, torch.Tensor] = {}
        self.chooser: "LatentAttention | None" = None

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | list[KVCache] | None, counts: list[int] | None = None) -> torch.Tensor:
        self.choices = {}  # this step's, by sequence: the layers reading them run before the next step
        return packed_attention(self, x_BTD, cos, sin, cache, counts)

    def project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, the normed latent and the rotary key of every row (`packed_attention`), and with an
        indexer its query heads, key and head weights (`Indexer.project`)."""
        c = self.config
        q_resid = None if c.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x_BTD))
        q = self.q_proj(x_BTD) if q_resid is None else self.q_b_proj(q_resid)
        latent_BTL, k_rot_BTR = self.kv_a_proj_with_mqa(x_BTD).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        index = () if self.indexer is None else self.indexer.project(x_BTD, q_resid)
        return q, self.kv_a_layernorm(latent_BTL), k_rot_BTR, *index

    def attend_cached(self, q: torch.Tensor, latent_BTL: torch.Tensor, k_rot_BTR: torch.Tensor, *rest
                      ) -> torch.Tensor:
        """One sequence's rows after `project` (then cos, sin and the cache, or None): rotary, the
        cache, the indexer's choice of positions, the keys and values from the cached latents,
        attention; (B, T, H * Dv) for o_proj."""
        *index, cos, sin, cache = rest
        c = self.config
        B, T, _ = q.shape
        H, nope, rope = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        q_BHTd = q.view(B, T, H, nope + rope).transpose(1, 2)
        q_rot = apply_rope(q_BHTd[..., nope:], cos, sin, interleave=c.rope_interleave)
        latent_B1TL = latent_BTL[:, None]
        k_rot_B1TR = apply_rope(k_rot_BTR[:, None], cos, sin, interleave=c.rope_interleave)
        if c.index_topk is not None:  # the indexer's key, rotated, is cached after the rotary key (zeros where
            # the layer reads another's choice and has no indexer)
            ik = self.indexer.rotate(index[1][:, None], cos, sin) if index else k_rot_B1TR.new_zeros(B, 1, T,
                                                                                                     c.index_head_dim)
            k_rot_B1TR = torch.cat((k_rot_B1TR, ik), dim=-1)
        start = 0
        if cache is not None:
            start = cache.length
            latent_B1TL, k_rot_B1TR = cache.append(self.layer, latent_B1TL, k_rot_B1TR)
        chosen_BTS = None
        if c.index_topk is not None:
            k_rot_B1TR, k_index_B1SDi = k_rot_B1TR.split([rope, c.index_head_dim], dim=-1)
            key = id(cache)  # one sequence (or one batch) of this forward, as every layer sees it in turn
            if index:
                chosen_BTS = self.choices[key] = self.indexer.choose(index[0], index[2], k_index_B1SDi, cos, sin,
                                                                     start)
            else:  # GLM-5's shared layers: the nearest indexing layer before this one chose
                chosen_BTS = self.chooser.choices[key]
        S = latent_B1TL.shape[2]
        if chosen_BTS is not None and T == 1 and c.index_topk < S:
            # decoding: each sequence's query reads only its chosen rows, gathered (in position order);
            # the others' latents are never expanded, so a step's cost past the indexer does not grow
            # with the context
            # (the query reads every gathered row: no mask)
            sel_BK1 = chosen_BTS[:, 0].nonzero()[:, 1].view(B, -1, 1)
            latent_B1TL = latent_B1TL[:, 0].gather(1, sel_BK1.expand(-1, -1, c.kv_lora_rank))[:, None]
            k_rot_B1TR = k_rot_B1TR[:, 0].gather(1, sel_BK1.expand(-1, -1, rope))[:, None]
            S, chosen_BTS = sel_BK1.shape[1], None
        kv_BHSd = self.kv_b_proj(latent_B1TL[:, 0]).view(B, S, H, nope + c.v_head_dim).transpose(1, 2)
        k_nope_BHSd, v_BHSDv = kv_BHSd.split([nope, c.v_head_dim], dim=-1)
        k_BHSd = torch.cat((k_nope_BHSd, k_rot_B1TR.expand(B, H, S, rope)), dim=-1)
        q_BHTd = torch.cat((q_BHTd[..., :nope], q_rot), dim=-1)
        # the positions the indexer chose (each among those its query sees), else causal ones
        mask, causal = (chosen_BTS[:, None], False) if chosen_BTS is not None else \
            attention_mask(T, S - T, None, q.device)
        out_BHTDv = attend(q_BHTd, k_BHSd, v_BHSDv, mask, causal, scale=self.scale)
        return out_BHTDv.transpose(1, 2).reshape(B, T, H * c.v_head_dim)


def packed_attention(attn: nn.Module, x_1ND: torch.Tensor, cos_1NR: torch.Tensor, sin_1NR: torch.Tensor,
                     caches: KVCache | list[KVCache] | None, counts: list[int] | None) -> torch.Tensor:
    """Either variant's forward. With `counts`, x's rows are the packed tokens of several sequences
    (`MoEGPT.forward_packed`): the projections over all rows at once, then each sequence's rows
    against its own cache in `caches`; without, one batch against one cache (or none)."""
    parts = attn.project(x_1ND)
    gate = None
    if getattr(attn, "gated", False):  # the output gate, per head and dimension, applied before o_proj
        *parts, gate = parts
    if counts is None or len(counts) == 1:
        out = attn.attend_cached(*parts, cos_1NR, sin_1NR, caches if counts is None else caches[0])
    else:
        outs, s = [], 0
        for cache, n in zip(caches, counts):
            outs.append(attn.attend_cached(*(p[:, s:s + n] for p in parts), cos_1NR[:, s:s + n],
                                           sin_1NR[:, s:s + n], cache))
            s += n
        out = torch.cat(outs, dim=1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return attn.o_proj(out)


def make_attention(config: MoEConfig, layer: int) -> nn.Module:
    """The attention variant `config` names, for `layer`."""
    return LatentAttention(config, layer) if config.attention == "mla" else Attention(config, layer)
