"""One typed config for every MoE GPT semoe runs, and builders from HuggingFace `config.json`.

The same `MoEConfig` describes a model trained here from scratch (`gpt_moe`) and the HuggingFace
architectures semoe loads (Mixtral, Qwen2-MoE, OLMoE). Fields that only some architectures use
have neutral defaults (no shared expert, no q/k norm, no attention bias).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from semoe.model.hf_names import SUPPORTED_MODEL_TYPES

# One list with `store import`: every HuggingFace model type it accepts, plus models trained here.
ARCHITECTURES = ("gpt_moe", *(t for t in SUPPORTED_MODEL_TYPES if t != "semoe_gpt"))
# grouped-query attention; DeepSeek's multi-head latent attention; DeepSeek-V4's one shared key-value head over a
# sliding window, with compressed entries of the sequence on some layers (`semoe.model.compressed_attention`)
ATTENTIONS = ("gqa", "mla", "compressed")
# DeepSeek-V4's layers: the sliding window alone, or with compressed sparse attention (entries of 2m tokens every
# m, an indexer choosing the top-k) or heavily compressed attention (one entry per m' tokens, all read)
COMPRESSED_KINDS = ("sliding", "csa", "hca")
# "full": RMSNorm over all heads' q (and k) before splitting (OLMoE); "head": per head (Qwen3, GLM-4.5);
# "head_after_rope": per head, after the rotation (Hunyuan); "unit_after_rope": per head after the
# rotation, without weights, on the layers that rotate (Llama-4)
QK_NORMS = ("none", "full", "head", "head_after_rope", "unit_after_rope")
# "softmax_topk": softmax, then top-k (Mixtral, Qwen, OLMoE); "topk_softmax": top-k logits, then a
# softmax over them (gpt-oss); "grouped": DeepSeek's group-limited top-k on softmax or sigmoid scores;
# "topk_sigmoid_input": the top-k logits' sigmoids, which scale each chosen expert's input, not its
# output (Llama-4)
ROUTERS = ("softmax_topk", "topk_softmax", "grouped", "topk_sigmoid_input")
ROUTER_SCORES = ("softmax", "sigmoid", "sqrtsoftplus")  # sqrtsoftplus: DeepSeek-V4
GROUP_SCORES = ("max", "top2")  # a group's score: its best expert (V2), or its best two summed (V3)
# "swiglu": down(silu(gate x) * up x); "clamped_swiglu": gpt-oss's, with biases and clamping;
# "fused_swiglu": SwiGLU with gate and up as the halves of one (in, 2 * out) tensor (Llama-4)
# "limited_swiglu": SwiGLU with the gate clamped above and the up clamped both ways at `swiglu_limit` (DeepSeek-V4)
EXPERT_MLPS = ("swiglu", "clamped_swiglu", "fused_swiglu", "limited_swiglu")
# Gated DeltaNet's input projections as Qwen3-Next ("qkvz": grouped per key head) and Qwen3.5 ("split") store them
LINEAR_LAYOUTS = ("qkvz", "split")
# latent attention's query and latent norms take this epsilon whatever the model's `rms_norm_eps`, as the
# reference implementations build them (GLM-5's 1e-5 elsewhere, 1e-6 there)
LATENT_NORM_EPS = 1e-6


@dataclass(kw_only=True)
class MoEConfig:
    """Shape and behaviour of a decoder-only MoE transformer."""

    arch: str = "gpt_moe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # default hidden_size // num_heads
    ffn_size: int  # intermediate size of dense (non-MoE) feed-forward layers
    moe_ffn_size: int  # intermediate size of one expert
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    shared_expert_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = True  # a sigmoid gate on the shared expert (Qwen2-MoE); DeepSeek has none
    # which layers are MoE; the rest use a dense feed-forward layer
    moe_layers: tuple[int, ...] | None = None  # None: every layer
    rms_norm_eps: float = 1e-6
    max_position: int = 4096
    # -- attention
    attention: str = "gqa"
    attention_bias: bool = False  # bias on q, k, v projections (Qwen2-MoE, GLM-4.5, gpt-oss)
    o_proj_bias: bool = False  # bias on the output projection (gpt-oss)
    qk_norm: str = "none"
    clip_qkv: float | None = None
    sliding_window: int | None = None  # a query sees this many positions back, itself included
    sliding_layers: tuple[int, ...] | None = None  # layers with the window; None: all (when set)
    attention_sinks: bool = False  # a learnt per-head logit in every softmax's denominator (gpt-oss)
    # each head's output times the sigmoid of its own projection of the layer's input (`g_proj`), before
    # o_proj (Qwen3-Next's and Qwen3.5's full-attention layers, whose checkpoints interleave it in q_proj)
    attn_output_gate: bool = False
    # Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE) on `linear_layers` (None: none): key and value
    # heads of their own widths, a causal convolution of `linear_conv_kernel` taps; its state per sequence is
    # fixed in size (`linear_state_bytes`), kept beside the KV cache, which those layers do not fill.
    # `linear_layout`: the projections as Qwen3-Next publishes them (q, k, v and z interleaved per key head
    # in `in_proj_qkvz`, b and a in `in_proj_ba`) or as Qwen3.5 does (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
    linear_layers: tuple[int, ...] | None = None
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 4
    linear_layout: str = "qkvz"
    # RMSNorm weights stored zero-centred, each used as 1 + w (Qwen3-Next's layer, final and q/k norms)
    norm_plus_one: bool = False
    # chunked local attention (Llama-4): on `chunked_layers`, a query sees only the positions of its
    # own chunk of `attention_chunk` (positions p with p // chunk equal to its own), itself included
    attention_chunk: int | None = None
    chunked_layers: tuple[int, ...] | None = None  # None: all (when attention_chunk is set)
    # the layers that rotate q and k; None: all (Llama-4's other layers use no position encoding)
    rope_layers: tuple[int, ...] | None = None
    # attention temperature on the layers that do not rotate (Llama-4): each query times
    # log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 at position p; (attn_scale, floor_scale)
    attn_temperature: tuple[float, float] | None = None
    # multi-head latent attention (attention="mla"): the cache holds a kv_lora_rank latent per position
    q_lora_rank: int | None = None  # None: q is one projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention (DSA, over latent attention): a lightning indexer of `index_heads` heads
    # of `index_head_dim` scores the cached positions for each query from its own cache of keys (kept
    # beside the rotary key), and attention reads only the `index_topk` best; None: no indexer
    index_topk: int | None = None
    index_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False  # the indexer rotates pairs (GLM-5) or halves (DeepSeek-V3.2)
    # the layers with an indexer of their own; the others read the positions the nearest such layer
    # before them chose (GLM-5's "shared" layers); None: every layer
    index_layers: tuple[int, ...] | None = None
    # DeepSeek-V4 (attention "compressed"): each layer's kind (COMPRESSED_KINDS), the tokens per compressed entry
    # (csa, hca), the rotary base of the compressed layers (the sliding ones take rope_theta) and its scaling; the
    # output projection in `o_groups` groups of rank `o_lora_rank`; `hc_mult` residual streams mixed by
    # hyper-connections (1: a plain residual); the MoE layers routed by the token's id (`hash_layers`)
    layer_kinds: tuple[str, ...] | None = None
    compress_rates: tuple[int, int] = (4, 128)
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict[str, Any] | None = None
    o_groups: int = 1
    o_lora_rank: int = 0
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hash_layers: tuple[int, ...] | None = None
    # -- rotary embeddings
    rope_theta: float = 10000.0
    rope_dim: int | None = None  # rotated dims of each head (default: all of head_dim; MLA: qk_rope_head_dim)
    rope_interleave: bool = False  # rotate pairs (x0, x1), (x2, x3)... (DeepSeek, ERNIE) instead of halves
    rope_scaling: dict[str, Any] | None = None  # YaRN parameters (rope_type "yarn"); None: plain RoPE
    # -- routing
    router: str = "softmax_topk"
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    router_scores: str = "softmax"  # grouped router: softmax (DeepSeek-V2) or sigmoid (V3, GLM-4.5)
    score_correction_bias: bool = False  # grouped router: a per-expert bias on choice only (V3)
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    routed_scaling_factor: float = 1.0
    # -- experts
    expert_mlp: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_embeddings: bool = False
    # training-only routing behaviour
    capacity_factor: float | None = None  # None: no token dropping
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    # token ids the tokenizer defines, carried for generation
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the source config, kept for export
    # what the checkpoint's tensor names start with: "" for a causal LM, the text model's prefix in a
    # multimodal one (`semoe.model.hf_names.TEXT_MODELS`)
    weights_prefix: str = ""

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size",
                     "moe_ffn_size", "num_experts", "top_k", "max_position"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name, allowed in (("attention", ATTENTIONS), ("qk_norm", QK_NORMS), ("router", ROUTERS),
                              ("router_scores", ROUTER_SCORES), ("group_score", GROUP_SCORES),
                              ("expert_mlp", EXPERT_MLPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"attention 'mla' needs {name} >= 1, got {getattr(self, name)}")
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            self.rope_dim = self.qk_rope_head_dim
        self.compress_rates = tuple(int(r) for r in self.compress_rates)  # (a list, as JSON gives it back)
        if self.attention == "compressed":
            kinds = tuple(self.layer_kinds or ())
            if len(kinds) != self.num_layers or set(kinds) - set(COMPRESSED_KINDS):
                raise ValueError(f"attention 'compressed' needs layer_kinds, one of {COMPRESSED_KINDS} for each of "
                                 f"the {self.num_layers} layers, got {self.layer_kinds!r}")
            self.layer_kinds = kinds
            if self.q_lora_rank is None or self.sliding_window is None or self.o_lora_rank < 1 or \
                    self.num_kv_heads != 1 or (self.num_heads * (self.head_dim or 0)) % self.o_groups:
                raise ValueError("attention 'compressed' needs q_lora_rank, sliding_window, o_lora_rank >= 1, one key-value "
                                 "head and num_heads * head_dim divisible by o_groups")
            if "csa" in kinds and (self.index_topk is None or self.index_heads < 1 or self.index_head_dim < 1):
                raise ValueError("compressed sparse attention layers need index_topk, index_heads and index_head_dim")
        if self.index_topk is not None and self.attention != "compressed":
            if self.attention != "mla" or self.q_lora_rank is None:
                raise ValueError("index_topk (DeepSeek sparse attention) needs attention 'mla' with a q_lora_rank")
            if self.index_topk < 1 or self.index_heads < 1 or self.index_head_dim < self.qk_rope_head_dim:
                raise ValueError(f"index_topk ({self.index_topk}) and index_heads ({self.index_heads}) must be >= 1 "
                                 f"and index_head_dim ({self.index_head_dim}) >= qk_rope_head_dim "
                                 f"({self.qk_rope_head_dim})")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}) "
                                 "unless head_dim is given")
            self.head_dim = self.hidden_size // self.num_heads
        if self.rope_dim is None:
            self.rope_dim = self.head_dim
        if not 2 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even and in 2..head_dim ({self.head_dim}), got {self.rope_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide by num_kv_heads ({self.num_kv_heads})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and "
                             f"topk_group ({self.topk_group}) be in 1..n_group")
        if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(f"topk_group ({self.topk_group}) groups of {self.num_experts // self.n_group} experts "
                             f"cannot hold top_k ({self.top_k}) experts")
        if self.shared_expert_size < 0:
            raise ValueError(f"shared_expert_size must be >= 0, got {self.shared_expert_size}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ("yarn", "llama3"):
            raise ValueError(f"rope_scaling must be YaRN or Llama-3's (rope_type 'yarn' or 'llama3') or None, got "
                             f"{self.rope_scaling!r}")
        if self.attention_chunk is not None and self.attention_chunk < 1:
            raise ValueError(f"attention_chunk must be >= 1 or None, got {self.attention_chunk}")
        if self.attn_temperature is not None:
            self.attn_temperature = tuple(float(v) for v in self.attn_temperature)
            if len(self.attn_temperature) != 2 or self.attn_temperature[1] <= 0:
                raise ValueError(f"attn_temperature must be (attn_scale, floor_scale > 0), got {self.attn_temperature}")
        if self.linear_layers is not None:
            if self.attention != "gqa":
                raise ValueError("linear_layers (Gated DeltaNet) need attention 'gqa' on the other layers")
            for name in ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim",
                         "linear_conv_kernel"):
                if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                    raise ValueError(f"linear_layers need {name} >= 1, got {getattr(self, name)!r}")
            if self.linear_value_heads % self.linear_key_heads:
                raise ValueError(f"linear_value_heads ({self.linear_value_heads}) must be a multiple of "
                                 f"linear_key_heads ({self.linear_key_heads})")
            if self.linear_layout not in LINEAR_LAYOUTS:
                raise ValueError(f"linear_layout must be one of {LINEAR_LAYOUTS}, got {self.linear_layout!r}")
        if self.index_layers is not None and self.index_topk is not None and 0 not in self.index_layers \
                and self.attention == "mla":
            raise ValueError(f"index_layers {self.index_layers} must include layer 0 (a layer without an indexer "
                             "reads the choice of one before it)")
        for name in ("moe_layers", "sliding_layers", "chunked_layers", "rope_layers", "index_layers", "linear_layers",
                     "hash_layers"):
            layers = getattr(self, name)
            if layers is not None:
                layers = tuple(sorted(set(int(i) for i in layers)))
                bad = [i for i in layers if not 0 <= i < self.num_layers]
                if bad:
                    raise ValueError(f"{name} has layers {bad} outside 0..{self.num_layers - 1}")
                setattr(self, name, layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer` has a MoE feed-forward block (else a dense one)."""
        return self.moe_layers is None or layer in self.moe_layers

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention, or None for full causal attention."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    def chunk(self, layer: int) -> int | None:
        """The chunk of `layer`'s chunked local attention, or None."""
        if self.attention_chunk is None or (self.chunked_layers is not None and layer not in self.chunked_layers):
            return None
        return self.attention_chunk

    def indexes(self, layer: int) -> bool:
        """Whether `layer` has DeepSeek sparse attention's indexer of its own."""
        return self.index_topk is not None and self.attention == "mla" and (self.index_layers is None
                                                                            or layer in self.index_layers)

    def kind(self, layer: int) -> str | None:
        """DeepSeek-V4's kind of `layer` (COMPRESSED_KINDS), None for other attentions."""
        return self.layer_kinds[layer] if self.attention == "compressed" else None

    def compressed_layout(self, layer: int) -> tuple[int, int, tuple]:
        """A DeepSeek-V4 layer's state in the kernels' layout (decode_abi.h's `Compressed`): the floats of
        its fixed part (the window's keys, then each compressor's pending tokens and overlap), those of an
        entry's row (its key and, under CSA, the indexer's), and each compressor's (m, dim, overlap), the
        layer's then the indexer's; a row per m positions."""
        kind, Dh, W = self.kind(layer), self.head_dim, self.sliding_window
        comps: list[tuple[int, int, bool]] = []
        if kind != "sliding":
            m = self.compress_rates[0 if kind == "csa" else 1]
            comps.append((m, Dh, kind == "csa"))
            if kind == "csa":
                comps.append((m, self.index_head_dim, True))
        fixed = W * Dh + sum(2 * m * (2 if o else 1) * d + (2 * m * d if o else 0) for m, d, o in comps)
        return fixed, Dh + (self.index_head_dim if kind == "csa" else 0), tuple(comps)

    def compressed_state_bytes(self, batch: int, positions: int, itemsize: int) -> int:
        """Bytes of DeepSeek-V4's per-sequence state for `positions` tokens, every layer, as
        `semoe.model.compressed_attention.CompressedBuffers` holds it: the sliding window's keys, each
        compressor's tokens waiting to fill an entry and CSA's overlap with the last full window, and each
        compressed entry (under CSA with its indexer's key)."""
        if self.attention != "compressed":
            return 0
        total = 0
        for layer in range(self.num_layers):
            fixed, row, comps = self.compressed_layout(layer)
            total += fixed + (positions // comps[0][0] * row if comps else 0)
        return batch * total * itemsize

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` mixes tokens with Gated DeltaNet linear attention (a fixed-size state, no KV cache)."""
        return self.linear_layers is not None and layer in self.linear_layers

    def linear_state_shapes(self, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One Gated DeltaNet layer's state (`semoe.model.linear_attention.DeltaNetState`): the causal
        convolution's last K-1 inputs (B, channels, K-1) and each value head's delta-rule state (B, Hv, Dk, Dv)."""
        channels = 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim
        return ((batch, channels, self.linear_conv_kernel - 1),
                (batch, self.linear_value_heads, self.linear_key_dim, self.linear_value_dim))

    def linear_state_bytes(self, batch: int) -> int:
        """Bytes of every linear layer's state (float32, as the delta rule keeps it), whatever the length."""
        if self.linear_layers is None:
            return 0
        conv, rec = self.linear_state_shapes(batch)
        return len(self.linear_layers) * (math.prod(conv) + math.prod(rec)) * 4

    def rotates(self, layer: int) -> bool:
        """Whether `layer` rotates q and k (every layer but Llama-4's no-position ones)."""
        return self.rope_layers is None or layer in self.rope_layers

    @property
    def moe_layer_ids(self) -> list[int]:
        """The MoE layers, in order."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def replace(self, **changes: Any) -> "MoEConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def layer_kv_shapes(self, layer: int, batch: int, positions: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """`layer`'s KV cache as (k, v) shapes: `kv_shapes`, or for a linear layer or a DeepSeek-V4 one, which keep
        a state of their own instead, shapes of no elements (B, 1, S, 0) that grow, copy and trim with the others."""
        if self.is_linear(layer) or self.attention == "compressed":
            return ((batch, 1, positions, 0),) * 2
        return self.kv_shapes(batch, positions)

    def kv_shapes(self, batch: int, positions: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One layer's KV cache as (k, v) shapes, the one layout every path keeps: keys and values
        (B, G, S, Dh) for grouped-query attention; for latent attention the normed latent (B, 1, S, L)
        in k and the rotated rotary key (B, 1, S, R) in v, followed there by the indexer's rotated key
        (index_head_dim more) under DeepSeek sparse attention, so that whatever keeps, copies, swaps or
        counts a KV cache keeps, copies, swaps and counts the indexer's keys with it."""
        if self.attention == "mla":
            index = self.index_head_dim if self.index_topk is not None else 0
            return (batch, 1, positions, self.kv_lora_rank), (batch, 1, positions, self.qk_rope_head_dim + index)
        return ((batch, self.num_kv_heads, positions, self.head_dim),) * 2

    def kv_bytes(self, batch: int, positions: int, itemsize: int) -> int:
        """Bytes of every layer's KV cache (`layer_kv_shapes`) in elements of `itemsize` bytes, and the
        linear layers' fixed-size states (float32) beside them."""
        if self.attention == "compressed":
            return self.compressed_state_bytes(batch, positions, itemsize)
        k, v = self.kv_shapes(batch, positions)
        attending = self.num_layers - (len(self.linear_layers) if self.linear_layers is not None else 0)
        return attending * (math.prod(k) + math.prod(v)) * itemsize + self.linear_state_bytes(batch)

    def num_parameters(self) -> dict[str, int]:
        """Parameter counts: dense (everything outside experts) and experts (biases and norms left out)."""
        h, d = self.hidden_size, self.head_dim or 0
        if self.attention == "mla":
            q = h * self.num_heads * d if self.q_lora_rank is None else \
                self.q_lora_rank * (h + self.num_heads * d)
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + \
                self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            attn = q + kv + self.num_heads * self.v_head_dim * h
            if self.index_topk is not None:  # the indexer's query, key and head weights
                attn += self.index_heads * self.index_head_dim * self.q_lora_rank + h * (self.index_head_dim
                                                                                      + self.index_heads)
        else:
            attn = h * d * (self.num_heads * (3 if self.attn_output_gate else 2) + self.num_kv_heads * 2)
        mixers = self.num_layers * attn
        if self.linear_layers is not None:  # q, k, v, z and b, a projections, the output projection
            kd, vd = self.linear_key_heads * self.linear_key_dim, self.linear_value_heads * self.linear_value_dim
            linear = h * (2 * kd + 2 * vd + 2 * self.linear_value_heads) + vd * h
            mixers += len(self.linear_layers) * (linear - attn)
        expert = 3 * h * self.moe_ffn_size
        moe = len(self.moe_layer_ids)
        dense_ffn = (self.num_layers - moe) * 3 * h * self.ffn_size
        shared = moe * (3 * h * self.shared_expert_size + (h if self.shared_expert_size and self.shared_expert_gate
                                                            else 0))
        router = moe * self.num_experts * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        dense = mixers + self.num_layers * 2 * h + dense_ffn + shared + router + emb + h
        return {"dense": dense, "experts": moe * self.num_experts * expert}


# Named configs: tiny ones for tests, a small one for training from scratch on this machine.
NAMED: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=259, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=128,
                 moe_ffn_size=64, num_experts=4, top_k=2),
    "gpt-moe-small": dict(vocab_size=259, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_size=768,
                          moe_ffn_size=384, num_experts=8, top_k=2, max_position=1024, capacity_factor=1.25),
}


def named_config(name: str, **overrides: Any) -> MoEConfig:
    """A named config (see NAMED), optionally with fields changed."""
    if name not in NAMED:
        raise ValueError(f"unknown config {name!r}; named configs: {', '.join(NAMED)}")
    return MoEConfig(**{**NAMED[name], **overrides})
