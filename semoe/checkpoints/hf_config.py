"""`MoEConfig` from a HuggingFace `config.json`: one small builder per model type.

Each builder maps the checkpoint's fields onto the config-driven pieces of the model (attention
variant, router variant, expert MLP variant, rotary embedding); a field whose value the model does
not implement is refused with one line naming it, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from semoe.model.config import MoEConfig
from semoe.model.hf_names import SEMOE_MODEL_TYPE, TEXT_MODELS, model_type_of, text_config_of
from storage.errors import BadInputError

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor", "truncate")


def _need(cfg: dict, key: str) -> Any:
    if key not in cfg:
        raise ValueError(f"config.json: field {key!r} is missing")
    return cfg[key]


def _num_experts(cfg: dict) -> int:
    """Routed experts per layer, under whichever name the checkpoint (or transformers' writer) uses."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    raise ValueError("config.json: the number of experts is missing (num_experts, num_local_experts, "
                     "n_routed_experts or moe_num_experts)")


def _rope(cfg: dict, default_theta: float) -> dict[str, Any]:
    """rope_theta and rope_scaling, from `rope_parameters` (transformers 5) or the older top-level
    `rope_theta` / `rope_scaling` fields that published checkpoints carry."""
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    merged = {**legacy, **params}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if merged.get(k) is None]
        if missing:
            raise ValueError(f"config.json: llama3 rope scaling needs {', '.join(missing)}")
        return {"rope_theta": theta, "rope_scaling": {"rope_type": "llama3", **{k: merged[k] for k in keys}}}
    if kind != "yarn":
        raise ValueError(f"config.json: rope type {kind!r} is not supported (default, yarn and llama3 are)")
    if "factor" not in merged or "original_max_position_embeddings" not in merged:
        raise ValueError("config.json: yarn rope scaling needs factor and original_max_position_embeddings")
    return {"rope_theta": theta, "rope_scaling": {"rope_type": "yarn", **{k: merged[k] for k in _YARN_KEYS
                                                                          if merged.get(k) is not None}}}


def _partial_rotary(cfg: dict, default: float = 1.0) -> float:
    """The share of each head's dims that rotate: `partial_rotary_factor`, or the older `rotary_dim`
    (dims, not a share) that published configs give alone."""
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor is None and cfg.get("rotary_dim"):
        heads = cfg["num_attention_heads"]
        factor = cfg["rotary_dim"] / (cfg.get("head_dim") or cfg["hidden_size"] // heads)
    return float(default if factor is None else factor)


def _common(cfg: dict) -> dict[str, Any]:
    return dict(
        vocab_size=_need(cfg, "vocab_size"), hidden_size=_need(cfg, "hidden_size"),
        num_layers=_need(cfg, "num_hidden_layers"), num_heads=_need(cfg, "num_attention_heads"),
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"), top_k=_need(cfg, "num_experts_per_tok"), extra=dict(cfg),
    )


def _mixtral(cfg: dict) -> MoEConfig:
    if cfg.get("sliding_window"):
        raise ValueError("config.json: sliding_window attention is not supported for mixtral")
    return MoEConfig(arch="mixtral", **_common(cfg), head_dim=cfg.get("head_dim"),
                     ffn_size=_need(cfg, "intermediate_size"), moe_ffn_size=cfg["intermediate_size"],
                     num_experts=_num_experts(cfg), norm_topk_prob=True, **_rope(cfg, 1e6))


def _qwen_moe_layers(cfg: dict) -> tuple[int, ...]:
    step = cfg.get("decoder_sparse_step", 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(cfg["num_hidden_layers"])
                 if i not in dense_only and _num_experts(cfg) > 0 and (i + 1) % step == 0)


def _qwen2_moe(cfg: dict) -> MoEConfig:
    if cfg.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window is not supported for qwen2_moe")
    return MoEConfig(arch="qwen2_moe", **_common(cfg), head_dim=cfg.get("head_dim"),
                     ffn_size=_need(cfg, "intermediate_size"), moe_ffn_size=_need(cfg, "moe_intermediate_size"),
                     num_experts=_num_experts(cfg), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     shared_expert_size=cfg.get("shared_expert_intermediate_size", 0),
                     moe_layers=_qwen_moe_layers(cfg), attention_bias=bool(cfg.get("qkv_bias", True)),
                     **_rope(cfg, 1e6))


def _qwen3_moe(cfg: dict) -> MoEConfig:
    return MoEConfig(arch="qwen3_moe", **_common(cfg), head_dim=cfg.get("head_dim"),
                     ffn_size=_need(cfg, "intermediate_size"), moe_ffn_size=_need(cfg, "moe_intermediate_size"),
                     num_experts=_num_experts(cfg), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     moe_layers=_qwen_moe_layers(cfg), attention_bias=bool(cfg.get("attention_bias", False)),
                     qk_norm="head", sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window")
                     else None, **_rope(cfg, 1e6))


def _layer_types(cfg: dict) -> list[str]:
    """Each layer's token mixer, "linear_attention" or "full_attention": `layer_types`, or every
    `full_attention_interval`-th layer full as older configs say it."""
    n = _need(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"config.json: layer_types must name linear_attention or full_attention for each of the "
                         f"{n} layers, got {types!r}")
    return list(types)


def _qwen3_next(cfg: dict, arch: str = "qwen3_next", layout: str = "qkvz") -> MoEConfig:
    """Qwen3-Next (and Qwen3.5-MoE's text model, `layout` "split"): Gated DeltaNet on three of four layers,
    gated full attention with a partial rotary on the fourth, zero-centred norms, a gated shared expert."""
    types = _layer_types(cfg)
    if cfg.get("attn_output_gate", True) is not True:
        raise ValueError("config.json: attn_output_gate false is not supported (the published models gate)")
    return MoEConfig(arch=arch, **_common(cfg), head_dim=cfg.get("head_dim"),
                     ffn_size=cfg.get("intermediate_size") or _need(cfg, "moe_intermediate_size"),
                     moe_ffn_size=_need(cfg, "moe_intermediate_size"), num_experts=_num_experts(cfg),
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                     shared_expert_size=cfg.get("shared_expert_intermediate_size", 0),
                     moe_layers=_qwen_moe_layers(cfg), attention_bias=bool(cfg.get("attention_bias", False)),
                     qk_norm="head", attn_output_gate=True, norm_plus_one=True,
                     linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                     linear_key_heads=_need(cfg, "linear_num_key_heads"),
                     linear_value_heads=_need(cfg, "linear_num_value_heads"),
                     linear_key_dim=_need(cfg, "linear_key_head_dim"),
                     linear_value_dim=_need(cfg, "linear_value_head_dim"),
                     linear_conv_kernel=cfg.get("linear_conv_kernel_dim", 4), linear_layout=layout,
                     rope_dim=int((cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
                                  * _partial_rotary(cfg, 0.25)), **_rope(cfg, 10000.0))


_V4_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


def _deepseek_v4(cfg: dict) -> MoEConfig:
    """DeepSeek-V4: compressed attention beside a sliding window (`semoe.model.compressed_attention`), hash routing
    on its first MoE layers, hyper-connections, the grouped output projection, clamped SwiGLU experts."""
    n = _need(cfg, "num_hidden_layers")
    types, mlp_types = cfg.get("layer_types") or [], cfg.get("mlp_layer_types") or ["moe"] * n
    if len(types) != n or set(types) - set(_V4_KINDS):
        raise ValueError(f"config.json: layer_types must name one of {', '.join(_V4_KINDS)} for each of the {n} "
                         f"layers, got {types!r}")
    if len(mlp_types) != n or set(mlp_types) - {"moe", "hash_moe"}:
        raise ValueError(f"config.json: mlp_layer_types must be moe or hash_moe for each of the {n} layers")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"config.json: {key} is not supported for deepseek_v4")
    params = cfg.get("rope_parameters") or {}
    main = params.get("main") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    compress = params.get("compress") or {"rope_theta": cfg.get("compress_rope_theta", 160000.0)}
    head_dim = _need(cfg, "head_dim")
    rates = cfg.get("compress_rates") or {}
    main_rope, compress_rope = _rope({"rope_parameters": main}, 10000.0), _rope({"rope_parameters": compress}, 160000.0)
    moe = _need(cfg, "moe_intermediate_size")
    # one key-value head, shared by every query head, whatever num_key_value_heads says (as the published model)
    return MoEConfig(arch="deepseek_v4", **{**_common(cfg), "num_kv_heads": 1}, head_dim=head_dim, ffn_size=moe, moe_ffn_size=moe,
                     num_experts=_num_experts(cfg), norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                     shared_expert_size=cfg.get("n_shared_experts", 1) * moe, shared_expert_gate=False,
                     attention="compressed", layer_kinds=tuple(_V4_KINDS[t] for t in types),
                     compress_rates=(int(rates.get("compressed_sparse_attention", 4)),
                                     int(rates.get("heavily_compressed_attention", 128))),
                     compress_rope_theta=compress_rope["rope_theta"], compress_rope_scaling=compress_rope["rope_scaling"],
                     q_lora_rank=_need(cfg, "q_lora_rank"), sliding_window=_need(cfg, "sliding_window"),
                     o_groups=_need(cfg, "o_groups"), o_lora_rank=_need(cfg, "o_lora_rank"),
                     hc_mult=cfg.get("hc_mult", 1), hc_sinkhorn_iters=cfg.get("hc_sinkhorn_iters", 20),
                     hc_eps=cfg.get("hc_eps", 1e-6), index_topk=cfg.get("index_topk"),
                     index_heads=cfg.get("index_n_heads", 0), index_head_dim=cfg.get("index_head_dim", 0),
                     router="grouped", router_scores=cfg.get("scoring_func", "sqrtsoftplus"),
                     score_correction_bias=True, routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
                     hash_layers=tuple(i for i, t in enumerate(mlp_types) if t == "hash_moe"),
                     expert_mlp="limited_swiglu", swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
                     rope_dim=int(head_dim * float(main.get("partial_rotary_factor",
                                                            cfg.get("partial_rotary_factor", 1.0)))), **main_rope)


def _olmoe(cfg: dict) -> MoEConfig:
    if cfg.get("attention_bias"):
        raise ValueError("config.json: attention_bias is not supported for olmoe")
    return MoEConfig(arch="olmoe", **_common(cfg), head_dim=cfg.get("head_dim"),
                     ffn_size=_need(cfg, "intermediate_size"), moe_ffn_size=cfg["intermediate_size"],
                     num_experts=_num_experts(cfg), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     qk_norm="full", clip_qkv=cfg.get("clip_qkv"), **_rope(cfg, 10000.0))


def _deepseek_routing(cfg: dict, *, v3: bool) -> dict[str, Any]:
    """DeepSeek-style MoE fields (DeepSeek-V2/V3, GLM-4.5): group-limited routing, shared experts
    without a gate, the first `first_k_dense_replace` layers dense."""
    n = cfg["num_hidden_layers"]
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config.json: moe_layer_freq {cfg['moe_layer_freq']} is not supported (only 1)")
    scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
    method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
    methods = {"noaux_tc": ("sigmoid", "top2"), "greedy": ("softmax", "max"), "group_limited_greedy": ("softmax", "max")}
    if method not in methods or methods[method][0] != scoring:
        raise ValueError(f"config.json: topk_method {method!r} with scoring_func {scoring!r} is not supported "
                         "(noaux_tc with sigmoid, greedy or group_limited_greedy with softmax)")
    grouped = method != "greedy"
    shared = cfg.get("n_shared_experts") or 0
    return dict(
        ffn_size=_need(cfg, "intermediate_size"), moe_ffn_size=_need(cfg, "moe_intermediate_size"),
        num_experts=_num_experts(cfg), shared_expert_size=shared * cfg["moe_intermediate_size"],
        shared_expert_gate=False, moe_layers=tuple(range(cfg.get("first_k_dense_replace") or 0, n)),
        router="grouped", router_scores=scoring, score_correction_bias=method == "noaux_tc",
        n_group=(cfg.get("n_group") or 1) if grouped else 1, topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
        group_score=methods[method][1], routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        # transformers' DeepSeek-V2 router never renormalises; published V2 configs say false anyway
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if v3 else False,
    )


def _deepseek(arch: str) -> Callable[[dict], MoEConfig]:
    v3 = arch == "deepseek_v3"

    def build(cfg: dict) -> MoEConfig:
        return MoEConfig(arch=arch, **_common(cfg), **_deepseek_routing(cfg, v3=v3), attention="mla",
                         attention_bias=bool(cfg.get("attention_bias", False)),
                         o_proj_bias=bool(cfg.get("attention_bias", False)), q_lora_rank=cfg.get("q_lora_rank"),
                         kv_lora_rank=_need(cfg, "kv_lora_rank"), qk_nope_head_dim=_need(cfg, "qk_nope_head_dim"),
                         qk_rope_head_dim=_need(cfg, "qk_rope_head_dim"), v_head_dim=_need(cfg, "v_head_dim"),
                         rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
                         **_rope(cfg, 10000.0))
    return build


def _dsa(arch: str) -> Callable[[dict], MoEConfig]:
    """DeepSeek-V3.2 and GLM-5 (`glm_moe_dsa`): DeepSeek-V3's latent attention and routing, with DeepSeek
    sparse attention's indexer in every layer, or (GLM-5) in those `indexer_types` marks full, the
    others reading the choice of the nearest one before them; its rotary over halves (V3.2) or pairs
    (GLM-5). MoE layers after `first_k_dense_replace`, or where `mlp_layer_types` says sparse."""
    v3 = _deepseek("deepseek_v3")

    def build(cfg: dict) -> MoEConfig:
        indexers = cfg.get("indexer_types")
        if indexers is not None and (len(indexers) != cfg["num_hidden_layers"] or set(indexers) - {"full", "shared"}):
            raise ValueError(f"config.json: indexer_types must give each of the {cfg['num_hidden_layers']} layers "
                             "'full' or 'shared'")
        if indexers and indexers[0] != "full":
            raise ValueError("config.json: indexer_types must start with 'full' (a 'shared' layer reads the choice "
                             "of a 'full' one before it)")
        base = v3(cfg)
        types = cfg.get("mlp_layer_types")
        moe = tuple(i for i, t in enumerate(types) if t == "sparse") if types else base.moe_layers
        return base.replace(arch=arch, moe_layers=moe, index_topk=_need(cfg, "index_topk"),
                            index_heads=_need(cfg, "index_n_heads"), index_head_dim=_need(cfg, "index_head_dim"),
                            index_rope_interleave=arch == "glm_moe_dsa", rope_interleave=True,
                            index_layers=tuple(i for i, t in enumerate(indexers) if t == "full") if indexers else None)
    return build


def _glm4_moe(cfg: dict) -> MoEConfig:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return MoEConfig(arch="glm4_moe", **_common(cfg), **_deepseek_routing(cfg, v3=True), head_dim=head_dim,
                     attention_bias=bool(cfg.get("attention_bias", False)),
                     qk_norm="head" if cfg.get("use_qk_norm") else "none",
                     rope_dim=int(head_dim * _partial_rotary(cfg, 0.5)), **_rope(cfg, 10000.0))


def _gpt_oss(cfg: dict) -> MoEConfig:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"config.json: layer_types must list sliding_attention/full_attention for each of {n} "
                         f"layers, got {types!r}")
    bias = bool(cfg.get("attention_bias", True))
    return MoEConfig(arch="gpt_oss", **_common(cfg), head_dim=cfg.get("head_dim"),
                     ffn_size=_need(cfg, "intermediate_size"), moe_ffn_size=cfg["intermediate_size"],
                     num_experts=_num_experts(cfg), router="topk_softmax", router_bias=True,
                     attention_bias=bias, o_proj_bias=bias, attention_sinks=True,
                     sliding_window=cfg.get("sliding_window"),
                     sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
                     expert_mlp="clamped_swiglu", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                     swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), **_rope(cfg, 150000.0))


def _minimax_m2(cfg: dict) -> MoEConfig:
    """MiniMax-M2: GQA with q/k norms over all heads and partial rotary, a sigmoid router whose
    correction bias only chooses (DeepSeek-V3's with one group), always renormalised; Mixtral's names."""
    for key, want in (("scoring_func", "sigmoid"), ("qk_norm_type", "per_layer"), ("use_qk_norm", True),
                      ("use_routing_bias", True)):
        if cfg.get(key, want) != want:
            raise ValueError(f"config.json: {key} {cfg[key]!r} is not supported for minimax_m2 (only {want!r})")
    if any(t != 1 for t in cfg.get("attn_type_list") or []):
        raise ValueError("config.json: attn_type_list names lightning (linear) attention layers; minimax_m2 is "
                         "supported with full attention in every layer (1)")
    if cfg.get("shared_intermediate_size"):
        raise ValueError("config.json: shared_intermediate_size > 0 (a shared expert) is not supported for minimax_m2")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return MoEConfig(arch="minimax_m2", **_common(cfg), head_dim=head_dim, ffn_size=_need(cfg, "intermediate_size"),
                     moe_ffn_size=cfg["intermediate_size"], num_experts=_num_experts(cfg), qk_norm="full",
                     router="grouped", router_scores="sigmoid", score_correction_bias=True, n_group=1, topk_group=1,
                     group_score="top2", norm_topk_prob=True, routed_scaling_factor=1.0,
                     rope_dim=int(head_dim * _partial_rotary(cfg)), **_rope(cfg, 5e6))


def _dots1(cfg: dict) -> MoEConfig:
    """dots.llm1: DeepSeek-V3's routing and FFN (transformers hard-wires sigmoid with a correction bias)
    over Qwen3's attention (q/k norms per head), windows only where `layer_types` says."""
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"config.json: scoring_func {cfg['scoring_func']!r} is not supported for dots1 (only sigmoid)")
    n = cfg["num_hidden_layers"]
    window, after = cfg.get("sliding_window"), cfg.get("max_window_layers", n)
    types = cfg.get("layer_types") or ["sliding_attention" if window is not None and i >= after else "full_attention"
                                       for i in range(n)]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    bias = bool(cfg.get("attention_bias", False))
    return MoEConfig(arch="dots1", **_common(cfg), **_deepseek_routing(cfg, v3=True),
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                     qk_norm="head", attention_bias=bias, o_proj_bias=bias,
                     sliding_window=window if sliding else None, sliding_layers=sliding if sliding else None,
                     **_rope(cfg, 10000.0))


def _ernie4_5_moe(cfg: dict) -> MoEConfig:
    """ERNIE-4.5-MoE: GQA rotating interleaved pairs; a softmax router whose correction bias only
    chooses (DeepSeek-V3's with softmax scores and one group), renormalised; shared experts without a
    gate; MoE layers from `moe_layer_start_index` to `moe_layer_end_index`, every `moe_layer_interval`."""
    if cfg.get("use_bias"):
        raise ValueError("config.json: use_bias true (biases on every product) is not supported for ernie4_5_moe")
    n = _need(cfg, "num_hidden_layers")
    start, end, every = (cfg.get(k, d) for k, d in (("moe_layer_start_index", 1), ("moe_layer_end_index", -1),
                                                    ("moe_layer_interval", 1)))
    if not all(isinstance(v, int) for v in (start, end, every)) or every < 1:
        raise ValueError(f"config.json: moe_layer_start_index/end_index/interval ({start}, {end}, {every}) must be "
                         "integers, the interval >= 1 (a list per modality is a vision-language model's)")
    end = n - 1 if end == -1 else end
    moe = tuple(i for i in range(n) if (i + 1) % every == 0 and start <= i <= end)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    shared = cfg.get("moe_num_shared_experts", 0) * _need(cfg, "moe_intermediate_size")
    common = _common({"num_experts_per_tok": cfg.get("moe_k"), "tie_word_embeddings": True, **cfg})
    return MoEConfig(arch="ernie4_5_moe", **common, head_dim=head_dim, ffn_size=_need(cfg, "intermediate_size"),
                     moe_ffn_size=cfg["moe_intermediate_size"], num_experts=_num_experts(cfg), moe_layers=moe,
                     shared_expert_size=shared, shared_expert_gate=False, router="grouped", router_scores="softmax",
                     score_correction_bias=True, n_group=1, topk_group=1, norm_topk_prob=True,
                     rope_interleave=True, **_rope(cfg, 10000.0))


def _per_layer(cfg: dict, key: str) -> Any:
    """A field published as one value or as a list of one value per layer (Hunyuan's), as one value."""
    v = cfg.get(key)
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise ValueError(f"config.json: {key} differs between layers ({v}); it must be the same in every layer")
        return v[0]
    return v


def _hunyuan_rope(cfg: dict) -> dict[str, Any]:
    """Hunyuan's rotary: plain, or its fixed NTK alpha (published as rope type "dynamic" with an
    `alpha`), which only stretches the base to theta * alpha ** (d / (d - 2))."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    alpha = params.get("alpha")
    if not alpha:
        return _rope(cfg, 10000.0)
    if params.get("factor") not in (None, 1.0):
        raise ValueError(f"config.json: rope alpha {alpha} with factor {params['factor']} is not supported for "
                         "hunyuan_v1_moe (the factor must be 1.0)")
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return {"rope_theta": theta * float(alpha) ** (d / (d - 2)), "rope_scaling": None}


def _hunyuan_v1_moe(cfg: dict) -> MoEConfig:
    """Hunyuan-MoE: GQA with per-head q/k norms after the rotation; a softmax top-k router; a shared
    expert as wide as the routed ones, without a gate, in every layer."""
    for key, want in (("use_cla", False), ("use_qk_norm", True), ("use_mixed_mlp_moe", True)):
        if cfg.get(key, want) != want:
            raise ValueError(f"config.json: {key} {cfg[key]!r} is not supported for hunyuan_v1_moe (only {want!r})")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("config.json: attention_bias or mlp_bias true is not supported for hunyuan_v1_moe")
    top_k, experts = _per_layer(cfg, "moe_topk"), _per_layer(cfg, "num_experts")
    if _per_layer(cfg, "num_shared_expert") not in (None, 1):
        raise ValueError(f"config.json: num_shared_expert {cfg['num_shared_expert']} is not supported for "
                         "hunyuan_v1_moe (one shared expert, as wide as a routed one)")
    common = _common({**cfg, "num_experts_per_tok": top_k})
    ffn = _need(cfg, "intermediate_size")
    return MoEConfig(arch="hunyuan_v1_moe", **common, head_dim=cfg.get("head_dim") or cfg.get("attention_head_dim"),
                     ffn_size=ffn, moe_ffn_size=ffn, num_experts=_num_experts({"num_experts": experts}),
                     shared_expert_size=ffn, shared_expert_gate=False, qk_norm="head_after_rope",
                     norm_topk_prob=True, **_hunyuan_rope(cfg))


def _llama4_text(cfg: dict) -> MoEConfig:
    """Llama-4's text model: rotary over interleaved pairs, with chunked local attention and q/k norms
    without weights, on the layers `no_rope_layers` marks 1; full attention without position encoding,
    under a temperature, on the rest; MoE every `interleave_moe_layer_step` layers (or `moe_layers`),
    top-k of the router's logits whose sigmoids scale the experts' input, an ungated shared expert,
    and the experts' gate and up as halves of one (in, out) tensor."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported for llama4_text (only silu)")
    n = _need(cfg, "num_hidden_layers")
    interval = cfg.get("no_rope_layer_interval", 4)
    rotates = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    chunk = cfg.get("attention_chunk_size")
    types = cfg.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in rotates]
    if len(rotates) != n or len(types) != n or set(types) - {"chunked_attention", "full_attention"}:
        raise ValueError(f"config.json: no_rope_layers and layer_types must give each of the {n} layers "
                         "chunked_attention or full_attention")
    chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention")
    step = cfg.get("interleave_moe_layer_step", 1)
    moe = cfg.get("moe_layers")
    moe = tuple(moe) if moe is not None else tuple(range(step - 1, n, step))
    bias = bool(cfg.get("attention_bias", False))
    moe_ffn = _need(cfg, "intermediate_size")
    temperature = (float(cfg.get("attn_scale", 0.1)), float(cfg.get("floor_scale", 8192))) \
        if cfg.get("attn_temperature_tuning", True) else None
    return MoEConfig(arch="llama4_text", **_common(cfg), head_dim=cfg.get("head_dim"),
                     ffn_size=cfg.get("intermediate_size_mlp", moe_ffn), moe_ffn_size=moe_ffn,
                     num_experts=_num_experts(cfg), moe_layers=moe, shared_expert_size=moe_ffn,
                     shared_expert_gate=False, router="topk_sigmoid_input", expert_mlp="fused_swiglu",
                     attention_bias=bias, o_proj_bias=bias, rope_interleave=True,
                     rope_layers=tuple(i for i, r in enumerate(rotates) if r),
                     attention_chunk=chunk if chunked else None, chunked_layers=chunked or None,
                     qk_norm="unit_after_rope" if cfg.get("use_qk_norm", True) else "none",
                     attn_temperature=temperature, **_rope(cfg, 500000.0))


BUILDERS: dict[str, Callable[[dict], MoEConfig]] = {
    "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe,
    "deepseek_v2": _deepseek("deepseek_v2"), "deepseek_v3": _deepseek("deepseek_v3"), "glm4_moe": _glm4_moe,
    "gpt_oss": _gpt_oss, "minimax_m2": _minimax_m2, "dots1": _dots1, "ernie4_5_moe": _ernie4_5_moe,
    "hunyuan_v1_moe": _hunyuan_v1_moe, "llama4_text": _llama4_text, "deepseek_v32": _dsa("deepseek_v32"),
    "glm_moe_dsa": _dsa("glm_moe_dsa"), "qwen3_next": _qwen3_next,
    "qwen3_5_moe_text": lambda cfg: _qwen3_next(cfg, "qwen3_5_moe_text", "split"), "deepseek_v4": _deepseek_v4,
}


def from_hf_config(cfg: dict) -> MoEConfig:
    """Build a MoEConfig from a HuggingFace config.json of a supported model type."""
    model_type = model_type_of(cfg)  # an alias (Kimi K2's kimi_k2) builds the architecture it shares
    if model_type not in BUILDERS:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; supported: {', '.join(BUILDERS)}")
    text = text_config_of(cfg)  # a multimodal checkpoint's text model (Kimi-K2.5's DeepSeek-V3)
    if model_type != "gpt_oss" and text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {text.get('hidden_act')!r} is not supported (only silu)")
    config = BUILDERS[model_type](text)
    wrapped = TEXT_MODELS.get(str(cfg.get("model_type", "")))
    if wrapped is None:
        return config
    # the whole config is kept for export; the head is tied as the multimodal model ties it
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return config.replace(weights_prefix=wrapped[1], extra=dict(cfg), tie_embeddings=tied)


def config_from_json(cfg: dict) -> MoEConfig:
    """MoEConfig of a config.json written by transformers or by `hf_config`."""
    if cfg.get("model_type") == SEMOE_MODEL_TYPE:
        return MoEConfig(**cfg["semoe"])
    return from_hf_config(cfg)


def store_model_config(store, what: str | None = None) -> MoEConfig:
    """The model config a store keeps (its config.json side file), from a `storage.reader.StoreReader`
    or a `storage.store.Store`: the one reader of it. BadInputError naming `what` (default: the
    store's path) where the store holds no model."""
    if not store.manifest.has_file("config.json"):
        raise BadInputError(f"{what or store.root}: the store holds no model (no config.json)")
    return config_from_json(json.loads(store.read_file("config.json")))
