"""One typed config for every MoE GPT semoe runs, and builders from HuggingFace `config.json`.

The same `MoEConfig` describes a model trained here from scratch (`gpt_moe`) and the HuggingFace
architectures semoe loads (Mixtral, Qwen2-MoE, OLMoE). Fields that only some architectures use
have neutral defaults (no shared expert, no q/k norm, no attention bias).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("gpt_moe", "mixtral", "qwen2_moe", "olmoe")
QK_NORMS = ("none", "full")  # "full": RMSNorm over all heads' q (and k) before splitting (OLMoE)


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
    shared_expert_size: int = 0  # 0: no shared expert; Qwen2-MoE adds one with a sigmoid gate
    # which layers are MoE; the rest use a dense feed-forward layer
    moe_layers: tuple[int, ...] | None = None  # None: every layer
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position: int = 4096
    attention_bias: bool = False  # bias on q, k, v projections (Qwen2-MoE)
    qk_norm: str = "none"
    clip_qkv: float | None = None
    tie_embeddings: bool = False
    # training-only routing behaviour
    capacity_factor: float | None = None  # None: no token dropping
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    # token ids the tokenizer defines, carried for generation
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the source config, kept for export

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size",
                     "moe_ffn_size", "num_experts", "top_k", "max_position"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}) "
                                 "unless head_dim is given")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide by num_kv_heads ({self.num_kv_heads})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.shared_expert_size < 0:
            raise ValueError(f"shared_expert_size must be >= 0, got {self.shared_expert_size}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")
        if self.moe_layers is not None:
            self.moe_layers = tuple(sorted(set(int(i) for i in self.moe_layers)))
            bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"moe_layers has layers {bad} outside 0..{self.num_layers - 1}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer` has a MoE feed-forward block (else a dense one)."""
        return self.moe_layers is None or layer in self.moe_layers

    @property
    def moe_layer_ids(self) -> list[int]:
        """The MoE layers, in order."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def replace(self, **changes: Any) -> "MoEConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def num_parameters(self) -> dict[str, int]:
        """Parameter counts: dense (everything outside experts) and experts."""
        h, d = self.hidden_size, self.head_dim or 0
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        expert = 3 * h * self.moe_ffn_size
        moe = len(self.moe_layer_ids)
        dense_ffn = (self.num_layers - moe) * 3 * h * self.ffn_size
        shared = moe * (3 * h * self.shared_expert_size + (h if self.shared_expert_size else 0))
        router = moe * self.num_experts * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        dense = self.num_layers * (attn + 2 * h) + dense_ffn + shared + router + emb + h
        return {"dense": dense, "experts": moe * self.num_experts * expert}


def _rope_theta(cfg: dict, default: float) -> float:
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"config.json: rope_type {rope.get('rope_type')!r} is not supported (only default RoPE)")
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in ("default", None):
        raise ValueError("config.json: rope_scaling is not supported (only default RoPE)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", default)))


def _need(cfg: dict, key: str) -> Any:
    if key not in cfg:
        raise ValueError(f"config.json: field {key!r} is missing")
    return cfg[key]


def from_hf_config(cfg: dict) -> MoEConfig:
    """Build a MoEConfig from a HuggingFace config.json (Mixtral, Qwen2-MoE, OLMoE)."""
    model_type = cfg.get("model_type")
    common = dict(
        vocab_size=_need(cfg, "vocab_size"), hidden_size=_need(cfg, "hidden_size"),
        num_layers=_need(cfg, "num_hidden_layers"), num_heads=_need(cfg, "num_attention_heads"),
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"], head_dim=cfg.get("head_dim"),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"), top_k=_need(cfg, "num_experts_per_tok"), extra=dict(cfg),
    )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
    if model_type == "mixtral":
        if cfg.get("sliding_window"):
            raise ValueError("config.json: sliding_window attention is not supported")
        return MoEConfig(arch="mixtral", **common, ffn_size=_need(cfg, "intermediate_size"),
                         moe_ffn_size=cfg["intermediate_size"], num_experts=_need(cfg, "num_local_experts"),
                         norm_topk_prob=True, rope_theta=_rope_theta(cfg, 1e6))
    if model_type == "qwen2_moe":
        if cfg.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window is not supported")
        n = common["num_layers"]
        step = cfg.get("decoder_sparse_step", 1)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        moe = tuple(i for i in range(n) if i not in dense_only and _need(cfg, "num_experts") > 0
                    and (i + 1) % step == 0)
        return MoEConfig(arch="qwen2_moe", **common, ffn_size=_need(cfg, "intermediate_size"),
                         moe_ffn_size=_need(cfg, "moe_intermediate_size"), num_experts=cfg["num_experts"],
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                         shared_expert_size=cfg.get("shared_expert_intermediate_size", 0),
                         moe_layers=moe, attention_bias=bool(cfg.get("qkv_bias", True)),
                         rope_theta=_rope_theta(cfg, 1e6))
    if model_type == "olmoe":
        if cfg.get("attention_bias"):
            raise ValueError("config.json: attention_bias is not supported for olmoe")
        return MoEConfig(arch="olmoe", **common, ffn_size=_need(cfg, "intermediate_size"),
                         moe_ffn_size=cfg["intermediate_size"], num_experts=_need(cfg, "num_experts"),
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), qk_norm="full",
                         clip_qkv=cfg.get("clip_qkv"), rope_theta=_rope_theta(cfg, 10000.0))
    raise ValueError(f"config.json: model_type {model_type!r} is not supported; supported: mixtral, qwen2_moe, olmoe")


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
