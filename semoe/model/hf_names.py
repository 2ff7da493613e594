"""What a HuggingFace checkpoint's names and model types mean here, without torch.

The model types the store and the models accept (and the aliases that are one of them under another
name), and the HuggingFace name of each of the model's non-expert parameters. Importing this module
(and `semoe.model.config`, `semoe.checkpoints.hf_config`, which build on it) loads no torch, so a process that only
decodes with the compiled kernels (`inference.torch_free.runner`) reads a store's model the same way the model
does.
"""

from __future__ import annotations

import re
from typing import Protocol


class _Arch(Protocol):  # the fields of `semoe.model.config.MoEConfig` the names depend on (it imports this module)
    arch: str
    shared_expert_gate: bool
    weights_prefix: str
    linear_layers: tuple[int, ...] | None
    num_layers: int

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe",
                         "gpt_oss", "minimax_m2", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "llama4_text",
                         "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe_text", "deepseek_v4", "semoe_gpt")
# model types whose checkpoints name a MoE layer `block_sparse_moe` and its experts' products w1/w3/w2
MIXTRAL_NAMES = ("mixtral", "minimax_m2")
W_NAMES = (*MIXTRAL_NAMES, "deepseek_v4")  # and whose experts' products are w1/w3/w2 (DeepSeek-V4's under `ffn`)
SEMOE_MODEL_TYPE = "semoe_gpt"  # a config.json written for a model trained here
# model types that are another one under a new name: (architecture they must declare, the type they are)
ALIASES = {"kimi_k2": ("DeepseekV3ForCausalLM", "deepseek_v3"),
           "hunyuan": ("HunYuanMoEV1ForCausalLM", "hunyuan_v1_moe")}  # Hunyuan-A13B's remote-code config
# multimodal model types whose text model semoe runs: (the text model's config key, the prefix of its
# tensors' names: `text_name`). The rest (a vision tower, a projector) stays in the store as it is, for export.
TEXT_MODELS = {"kimi_k25": ("text_config", "language_model."), "llama4": ("text_config", "language_model."),
               "qwen3_5_moe": ("text_config", "model.language_model.")}


def model_type_of(config: dict) -> str:
    """The supported model type a config stands for (an alias such as kimi_k2 gives the type it is; a
    multimodal one, its text model's)."""
    model_type = str(config.get("model_type", ""))
    if model_type in TEXT_MODELS:
        text = config.get(TEXT_MODELS[model_type][0]) or {}
        return "deepseek_v3" if text.get("model_type") == "kimi_k2" else model_type_of(text)
    alias = ALIASES.get(model_type)
    if alias and alias[0] in (config.get("architectures") or []):
        return alias[1]
    return model_type


def text_config_of(config: dict) -> dict:
    """The config of the model semoe runs: a multimodal checkpoint's text model's, else `config`."""
    wrapped = TEXT_MODELS.get(str(config.get("model_type", "")))
    return dict(config.get(wrapped[0]) or {}) if wrapped else config


def text_name(config: _Arch, name: str) -> str:
    """The checkpoint's name of a causal LM's tensor `name` ("model.layers.3.mlp.gate.weight", "lm_head.weight")
    in the model semoe runs: as it is in a causal LM; in a multimodal one, under the text model's prefix,
    which goes before the whole name (Kimi-K2.5's "language_model.model.layers...") or, where it begins
    with "model.", in place of the body's "model." with the head left at the top (Qwen3.5's
    "model.language_model.layers...", "lm_head.weight")."""
    prefix = config.weights_prefix
    if not prefix.startswith("model."):
        return prefix + name
    return prefix + name.removeprefix("model.") if name.startswith("model.") else name


def moe_prefix(config: _Arch) -> str:
    """The HuggingFace name of a MoE layer's module (and of a dense layer's, Mixtral's aside)."""
    return "block_sparse_moe" if config.arch in MIXTRAL_NAMES else "feed_forward" if config.arch == "llama4_text" \
        else "ffn" if config.arch == "deepseek_v4" else "mlp"


# DeepSeek-V4's names that are not another architecture's, as transformers writes its checkpoints: the model's
# name's tail -> the checkpoint's (the layer's hyper-connections, the shared expert's products, the head)
_V4_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "head.weight", "hc_head.hc_fn": "model.hc_head.hc_fn",
           "hc_head.hc_base": "model.hc_head.hc_base", "hc_head.hc_scale": "model.hc_head.hc_scale"}


def _v4_name(param: str) -> str:
    """`hf_name` of a DeepSeek-V4 parameter: the attention's tensors keep their names under `attn.`, the MoE's
    under `ffn.` (its router's correction bias as `gate.bias`)."""
    m = re.match(r"^layers\.(\d+)\.(.+)$", param)
    if not m:
        if param in _V4_TOP:
            return _V4_TOP[param]
        raise KeyError(param)
    rest = m.group(2)
    for pattern, repl in ((r"^hc_(attn|ffn)\.(fn|base|scale)$", r"hc_\1_\2"),
                          (r"^ffn\.router\.e_score_correction_bias$", "ffn.gate.bias"),
                          (r"^ffn\.router\.", "ffn.gate."),
                          (r"^ffn\.shared\.gate_proj\.", "ffn.shared_experts.w1."),
                          (r"^ffn\.shared\.up_proj\.", "ffn.shared_experts.w3."),
                          (r"^ffn\.shared\.down_proj\.", "ffn.shared_experts.w2.")):
        if re.match(pattern, rest):
            return f"model.layers.{m.group(1)}." + re.sub(pattern, repl, rest)
    if rest.startswith(("attn.", "attn_norm.", "ffn_norm.")):
        return f"model.layers.{m.group(1)}.{rest}"
    raise KeyError(param)


def hf_name(config: _Arch, param: str) -> str:
    """The HuggingFace name of a non-expert model parameter."""
    if config.arch == "deepseek_v4":
        return _v4_name(param)
    m = re.match(r"^layers\.(\d+)\.(.+)$", param)
    if not m:
        top = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(param, param)
        return text_name(config, top)
    layer, rest = m.group(1), m.group(2)
    p = layer_prefix(config, int(layer))
    moe = moe_prefix(config)
    router = {"gpt_oss": "router", "llama4_text": "router", "hunyuan_v1_moe": "gate.wg"}.get(config.arch, "gate")
    dense = "feed_forward" if config.arch == "llama4_text" else "mlp"
    shared = {"hunyuan_v1_moe": "shared_mlp", "llama4_text": "shared_expert"}.get(
        config.arch, "shared_experts" if not config.shared_expert_gate else "shared_expert")
    # MiniMax-M2 keeps the router's correction bias on the MoE block, ERNIE in its statistics, not on its gate
    bias_on = {"minimax_m2": moe, "ernie4_5_moe": f"{moe}.moe_statics"}.get(config.arch, f"{moe}.{router}")
    rules = [
        (r"^ffn\.router\.e_score_correction_bias$", f"{bias_on}.e_score_correction_bias"),
        (r"^attn_norm\.", "input_layernorm."), (r"^ffn_norm\.", "post_attention_layernorm."),
        *([(r"^attn\.q_norm\.", "self_attn.query_layernorm."), (r"^attn\.k_norm\.", "self_attn.key_layernorm.")]
          if config.arch == "hunyuan_v1_moe" else []),
        (r"^attn\.", "linear_attn." if config.linear_layers is not None and int(layer) in config.linear_layers
         else "self_attn."), (r"^ffn\.router\.", f"{moe}.{router}."),
        (r"^ffn\.shared_gate\.", "mlp.shared_expert_gate."), (r"^ffn\.shared\.", f"{dense}.{shared}."),
        (r"^ffn\.", f"{dense}."),
    ]
    for pattern, repl in rules:
        if re.match(pattern, rest):
            return p + re.sub(pattern, repl, rest)
    raise KeyError(param)


# model types whose multi-token-prediction module is named apart (`mtp.fc`, `mtp.layers.0.*`), not as a layer
# past the last (`model.layers.N.eh_proj`, `model.layers.N.self_attn.*`: DeepSeek's, GLM's)
MTP_APART = ("qwen3_next", "qwen3_5_moe_text")
MTP_PARTS = ("enorm", "hnorm", "eh_proj", "post_norm")  # its input's two norms, their projection, its output's norm


def layer_prefix(config: _Arch, layer: int) -> str:
    """What the HuggingFace names of layer `layer`'s tensors start with: `model.layers.N.` (inside a
    multimodal checkpoint's text model), or a multi-token-prediction layer's own where it is named apart."""
    if layer >= config.num_layers and config.arch in MTP_APART:
        return f"mtp.layers.{layer - config.num_layers}."
    return text_name(config, f"model.layers.{layer}.")


def mtp_name(config: _Arch, layer: int, part: str) -> str:
    """The HuggingFace name of one of `MTP_PARTS` of multi-token-prediction layer `layer` (num_layers + i):
    DeepSeek's and GLM's `model.layers.N.{enorm,hnorm,eh_proj,shared_head.norm}.weight`, Qwen3-Next's and
    Qwen3.5's `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}.weight` (one such layer)."""
    if part not in MTP_PARTS:
        raise KeyError(part)
    if config.arch in MTP_APART:
        return "mtp." + {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
                         "post_norm": "norm"}[part] + ".weight"
    return layer_prefix(config, layer) + {"post_norm": "shared_head.norm"}.get(part, part) + ".weight"
