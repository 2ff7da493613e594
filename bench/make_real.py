"""Random-weight checkpoints with the exact configs of the MoE models people run offloaded.

    python bench/make_real.py gpt-oss-20b OUT [--layers N] [--seed 0]
    python bench/make_real.py qwen3-30b-a3b OUT --layers 12

Each is a HuggingFace directory as the model ships (config.json, safetensors shards with their index,
generation_config.json) that `semoe store import` and llama.cpp's converter both take, written once:
- gpt-oss-20b: its config as published (24 layers, 32 experts of 2880, top-4, YaRN, sinks, windows of
  128), experts in MXFP4 as shipped (blocks and e8m0 scales), everything else in bfloat16;
- qwen3-30b-a3b: its config as published (48 layers, 128 experts of 768, top-8), all bfloat16;
- qwen3.5-35b-a3b: Qwen3.5-35B-A3B's text model as a causal LM (40 layers, three Gated DeltaNet to one gated
  attention, 256 experts of 512 and a shared one, top-8) and its multi-token-prediction layer (`mtp.*`: a
  gated-attention layer with its MoE, the input norms and projection, the output norm), all bfloat16;
- deepseek-v4-flash: DeepSeek-V4-Flash (43 layers of compressed attention beside a window of 128, 256
  experts of 2048 and a shared one, top-6, hash routing on the first three, four residual streams), all
  bfloat16, named as transformers writes it (llama.cpp's converter reads the release's own names).
A tokenizer of exactly the config's vocabulary is added (`llama_peer.add_tokenizer`: a byte-level BPE
trained on the standard library's sources, topped up with synthetic merges), and the config's special
token ids are set to its own (<unk>, <s>, </s> at 0, 1, 2); every other field is the published one.
`--layers` keeps the first N layers (the config says so); the sizes for each are in --help.

The weights are drawn so that decoding routes as trained models do, spread over the experts: the
token embedding (std 1) stays the larger part of the residual stream, the products writing into it
(attention's o_proj, the experts' down_proj) are scaled by 1/sqrt(2 x layers) as GPT-2 initializes
them, and the routers' logits have a standard deviation of 2. With transformers' own initialization
(std 0.02 everywhere) attention's averages soon outweigh the embedding: tokens look alike to the
routers, and greedy decoding falls into short cycles that route alike (4 layers of qwen3-30b-a3b at
its published width decoded 9 distinct tokens of 96, their top-8 picks at a normalized entropy of
0.84; these weights: 94 and 0.995), which flatters any cache. bench_vs_llamacpp.py reports the routing
entropy of the decoding it times beside each of our results.

Shards are written one tensor at a time (never the whole model in memory) into OUT.partial, renamed
to OUT when complete: an interrupted run leaves no half-written checkpoint behind. The file system
must hold the model's size (checked before anything is written).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

from storage.numpy_codecs import f32_to_bf16  # noqa: E402
from storage.safetensors_io import OutTensor, write_file  # noqa: E402

# the published configs, field for field (from each model's config.json)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
# Qwen3.5-35B-A3B's text model (Gated DeltaNet on three layers of four, gated attention on the fourth, 256
# experts of 512 and a shared one in every layer), as a causal LM: its multimodal release wraps this text model
# beside a vision tower that neither semoe nor llama.cpp's text decoding reads. The shape is that of
# transformers' Qwen3_5MoeTextConfig, whose defaults follow the release.
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 248044, "eos_token_id": 248046, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "layer_types": None, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "moe_intermediate_size": 512,
    "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40,
    "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 248320, "mtp_num_hidden_layers": 1,
}
# DeepSeek-V4-Flash: compressed attention (HCA and CSA layers alternating after three HCA ones) beside a window
# of 128, hash routing on its first three MoE layers, four hyper-connection streams, 256 experts of 2048, top-6.
# The shape is that of transformers' DeepseekV4Config, whose defaults follow the release; the tensors are named
# as transformers writes them and all bfloat16 (the release's own low-precision formats are not reproduced).
_V4_TYPES = ["heavily_compressed_attention"] * 3 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 20
DEEPSEEK_V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "compress_rates": {
        "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}, "compress_rope_theta": 160000.0,
    "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu",
    "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02,
    "layer_types": _V4_TYPES, "max_position_embeddings": 1048576, "mlp_bias": False,
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 40, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6,
    "num_hidden_layers": 43, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8,
    "o_lora_rank": 1024, "partial_rotary_factor": 0.125, "q_lora_rank": 1024, "rms_norm_eps": 1e-06,
    "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
                        "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.125}},
    "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128, "swiglu_limit": 10.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 129280,
}
MODELS = {"gpt-oss-20b": GPT_OSS_20B, "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
          "deepseek-v4-flash": DEEPSEEK_V4_FLASH}
DTYPE_BYTES = {"BF16": 2, "U8": 1, "I64": 8}

SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # the added tokenizer's
ROUTER_LOGIT_STD = 2.0
FP4_RMS = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of a uniformly drawn e2m1 code


@dataclass(frozen=True)
class Planned:
    """One tensor of the checkpoint: name, shape, safetensors dtype and how it is drawn: ("normal", std),
    ("ones",), ("zeros",), ("mxfp4_blocks",), ("mxfp4_scales", std of the values the blocks decode to) or
    ("tid2eid", experts)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    draw: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def config_of(model: str, layers: int | None = None, **overrides) -> dict:
    """The published config of `model`, with its first `layers` layers, the added tokenizer's special
    ids and `overrides` (smaller shapes, for tests)."""
    c = {**MODELS[model], **overrides}
    for k in SPECIAL_IDS:
        if k in c:
            c[k] = SPECIAL_IDS[k]
    if layers is not None:
        if not 1 <= layers <= MODELS[model]["num_hidden_layers"]:
            raise SystemExit(f"--layers: {model} has {MODELS[model]['num_hidden_layers']} layers; got {layers}")
        c["num_hidden_layers"] = layers
        if "max_window_layers" in c:
            c["max_window_layers"] = layers
    if c["model_type"] == "gpt_oss":  # full attention every other layer, as published
        c["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(c["num_hidden_layers"])]
    if c["model_type"] == "deepseek_v4":  # each kept layer's own kinds
        c["layer_types"] = c["layer_types"][:c["num_hidden_layers"]]
        c["mlp_layer_types"] = c["mlp_layer_types"][:c["num_hidden_layers"]]
    if c["model_type"] == "qwen3_5_moe_text":  # full attention every fourth layer, as published
        c["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                            for i in range(c["num_hidden_layers"])]
    return c


def plan(c: dict) -> list[Planned]:
    """Every tensor of config `c`'s checkpoint, named as the model ships."""
    if c["model_type"] == "deepseek_v4":
        return _v4_plan(c)
    H, V, L, E = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c.get("num_local_experts") or c["num_experts"]
    nH, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    std, out_std = c["initializer_range"], c["initializer_range"] / math.sqrt(2 * L)
    out = [Planned("model.embed_tokens.weight", (V, H), "BF16", ("normal", 1.0))]
    bias = c.get("attention_bias", False)
    qwen35 = c["model_type"] == "qwen3_5_moe_text"
    norm = ("zeros",) if qwen35 else ("ones",)  # Qwen3.5 stores its norms zero-centred (used as 1 + w)
    for i in range(L):
        p = f"model.layers.{i}."
        out += [Planned(p + "input_layernorm.weight", (H,), "BF16", norm),
                Planned(p + "post_attention_layernorm.weight", (H,), "BF16", norm)]
        if qwen35:
            out += _qwen35_mixer(c, p, i, std, out_std)
            out += _qwen_moe(c, p, E, std, out_std, shared=True)
            continue
        for name, rows, cols, s in (("q_proj", nH * hd, H, std), ("k_proj", kv * hd, H, std),
                                    ("v_proj", kv * hd, H, std), ("o_proj", H, nH * hd, out_std)):
            out.append(Planned(p + f"self_attn.{name}.weight", (rows, cols), "BF16", ("normal", s)))
            if bias:
                out.append(Planned(p + f"self_attn.{name}.bias", (rows,), "BF16", ("normal", std)))
        router = ("normal", ROUTER_LOGIT_STD / math.sqrt(H))
        if c["model_type"] == "gpt_oss":
            F = c["intermediate_size"]
            out += [Planned(p + "self_attn.sinks", (nH,), "BF16", ("normal", 1.0)),
                    Planned(p + "mlp.router.weight", (E, H), "BF16", router),
                    Planned(p + "mlp.router.bias", (E,), "BF16", ("normal", std))]
            # (E, out, in / 32, 16) blocks of two codes a byte and (E, out, in / 32) scales, as shipped
            for name, o, n, s in (("gate_up_proj", 2 * F, H, std), ("down_proj", H, F, out_std)):
                out += [Planned(p + f"mlp.experts.{name}_blocks", (E, o, n // 32, 16), "U8", ("mxfp4_blocks",)),
                        Planned(p + f"mlp.experts.{name}_scales", (E, o, n // 32), "U8", ("mxfp4_scales", s)),
                        Planned(p + f"mlp.experts.{name}_bias", (E, o), "BF16", ("normal", std))]
        else:
            out += [Planned(p + "self_attn.q_norm.weight", (hd,), "BF16", ("ones",)),
                    Planned(p + "self_attn.k_norm.weight", (hd,), "BF16", ("ones",))]
            out += _qwen_moe(c, p, E, std, out_std, shared=False)
    out += [Planned("model.norm.weight", (H,), "BF16", norm),
            Planned("lm_head.weight", (V, H), "BF16", ("normal", std))]
    if qwen35 and c.get("mtp_num_hidden_layers"):  # its multi-token-prediction layer, named apart as released
        full = {**c, "layer_types": ["full_attention"]}
        out += [Planned(f"mtp.{n}.weight", (H,), "BF16", norm) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                          "norm")]
        out += [Planned("mtp.fc.weight", (H, 2 * H), "BF16", ("normal", 1 / math.sqrt(2 * H))),
                Planned("mtp.layers.0.input_layernorm.weight", (H,), "BF16", norm),
                Planned("mtp.layers.0.post_attention_layernorm.weight", (H,), "BF16", norm)]
        out += _qwen35_mixer(full, "mtp.layers.0.", 0, std, out_std) + _qwen_moe(c, "mtp.layers.0.", E, std, out_std,
                                                                                 shared=True)
    return out


def _qwen_moe(c: dict, p: str, E: int, std: float, out_std: float, shared: bool) -> list[Planned]:
    """A Qwen MoE layer's router and experts (per expert, as released), and Qwen3.5's gated shared expert."""
    H, F = c["hidden_size"], c["moe_intermediate_size"]
    out = [Planned(p + "mlp.gate.weight", (E, H), "BF16", ("normal", ROUTER_LOGIT_STD / math.sqrt(H)))]
    for e in range(E):
        out += [Planned(p + f"mlp.experts.{e}.gate_proj.weight", (F, H), "BF16", ("normal", std)),
                Planned(p + f"mlp.experts.{e}.up_proj.weight", (F, H), "BF16", ("normal", std)),
                Planned(p + f"mlp.experts.{e}.down_proj.weight", (H, F), "BF16", ("normal", out_std))]
    if shared:
        S = c["shared_expert_intermediate_size"]
        out += [Planned(p + "mlp.shared_expert.gate_proj.weight", (S, H), "BF16", ("normal", std)),
                Planned(p + "mlp.shared_expert.up_proj.weight", (S, H), "BF16", ("normal", std)),
                Planned(p + "mlp.shared_expert.down_proj.weight", (H, S), "BF16", ("normal", out_std)),
                Planned(p + "mlp.shared_expert_gate.weight", (1, H), "BF16", ("normal", std))]
    return out


def _qwen35_mixer(c: dict, p: str, i: int, std: float, out_std: float) -> list[Planned]:
    """Qwen3.5's token mixer of layer i: Gated DeltaNet (its projections apart, the causal convolution,
    the decay's parameters, the gated norm), or gated full attention (q_proj gives each head's query and
    gate) with zero-centred q/k norms."""
    H, nH, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    if c["layer_types"][i] == "full_attention":
        return [Planned(p + "self_attn.q_proj.weight", (2 * nH * hd, H), "BF16", ("normal", std)),
                Planned(p + "self_attn.k_proj.weight", (kv * hd, H), "BF16", ("normal", std)),
                Planned(p + "self_attn.v_proj.weight", (kv * hd, H), "BF16", ("normal", std)),
                Planned(p + "self_attn.o_proj.weight", (H, nH * hd), "BF16", ("normal", out_std)),
                Planned(p + "self_attn.q_norm.weight", (hd,), "BF16", ("zeros",)),
                Planned(p + "self_attn.k_norm.weight", (hd,), "BF16", ("zeros",))]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd, K = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    a = p + "linear_attn."
    return [Planned(a + "in_proj_qkv.weight", (2 * kd + vd, H), "BF16", ("normal", std)),
            Planned(a + "in_proj_z.weight", (vd, H), "BF16", ("normal", std)),
            Planned(a + "in_proj_b.weight", (nv, H), "BF16", ("normal", std)),
            Planned(a + "in_proj_a.weight", (nv, H), "BF16", ("normal", std)),
            Planned(a + "conv1d.weight", (2 * kd + vd, 1, K), "BF16", ("normal", 1 / math.sqrt(K))),
            Planned(a + "dt_bias", (nv,), "BF16", ("ones",)),
            # the decay rate exp(A_log) spread around 1 (the released models' span 0.01..16)
            Planned(a + "A_log", (nv,), "BF16", ("normal", 1.0)),
            Planned(a + "norm.weight", (c["linear_value_head_dim"],), "BF16", ("ones",)),
            Planned(a + "out_proj.weight", (H, vd), "BF16", ("normal", out_std))]


def _v4_plan(c: dict) -> list[Planned]:
    """DeepSeek-V4's tensors, named as transformers writes them: each layer's hyper-connections (`hc_attn_*`,
    `hc_ffn_*`), attention (`attn.wq_a` ... `attn.wo_b`, `attn_sink`) with its compressor and, on CSA layers,
    its indexer, the MoE under `ffn` (hash layers' frozen `gate.tid2eid`, the others' `gate.bias`)."""
    H, V, L, E = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["n_routed_experts"]
    nH, hd, Q, G, R = c["num_attention_heads"], c["head_dim"], c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    N, F, K = c["hc_mult"], c["moe_intermediate_size"], c["num_experts_per_tok"]
    std, out_std = c["initializer_range"], c["initializer_range"] / math.sqrt(2 * L)
    bf = lambda name, shape, draw: Planned(name, shape, "BF16", draw)  # noqa: E731
    hc = lambda p: [bf(p + "_fn", ((2 + N) * N, N * H), ("normal", std)), bf(p + "_base", ((2 + N) * N,), ("zeros",)),  # noqa: E731
                    bf(p + "_scale", (3,), ("ones",))]

    def compressor(p: str, dim: int, rate: int, overlap: bool) -> list[Planned]:
        w = 2 * dim if overlap else dim
        return [bf(p + "wkv.weight", (w, H), ("normal", std)), bf(p + "wgate.weight", (w, H), ("normal", std)),
                bf(p + "ape", (rate, w), ("normal", std)), bf(p + "norm.weight", (dim,), ("ones",))]

    out = [bf("model.embed_tokens.weight", (V, H), ("normal", 1.0))]
    rates = c["compress_rates"]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [bf(p + "attn_norm.weight", (H,), ("ones",)), bf(p + "ffn_norm.weight", (H,), ("ones",)),
                *hc(p + "hc_attn"), *hc(p + "hc_ffn")]
        a = p + "attn."
        out += [bf(a + "wq_a.weight", (Q, H), ("normal", std)), bf(a + "q_norm.weight", (Q,), ("ones",)),
                bf(a + "wq_b.weight", (nH * hd, Q), ("normal", std)), bf(a + "wkv.weight", (hd, H), ("normal", std)),
                bf(a + "norm.weight", (hd,), ("ones",)), bf(a + "wo_a.weight", (G * R, nH * hd // G), ("normal", std)),
                bf(a + "wo_b.weight", (H, G * R), ("normal", out_std)), bf(a + "attn_sink", (nH,), ("normal", 1.0))]
        kind = c["layer_types"][i]
        if kind == "heavily_compressed_attention":
            out += compressor(a + "compressor.", hd, rates[kind], False)
        elif kind == "compressed_sparse_attention":
            Di = c["index_head_dim"]
            out += compressor(a + "compressor.", hd, rates[kind], True)
            out += [*compressor(a + "indexer.compressor.", Di, rates[kind], True),
                    bf(a + "indexer.wq_b.weight", (c["index_n_heads"] * Di, Q), ("normal", std)),
                    bf(a + "indexer.weights_proj.weight", (c["index_n_heads"], H), ("normal", std))]
        f = p + "ffn."
        out.append(bf(f + "gate.weight", (E, H), ("normal", ROUTER_LOGIT_STD / math.sqrt(H))))
        if c["mlp_layer_types"][i] == "hash_moe":
            out.append(Planned(f + "gate.tid2eid", (V, K), "I64", ("tid2eid", E)))
        else:
            out.append(bf(f + "gate.bias", (E,), ("zeros",)))
        for e in [*range(E), "shared"]:
            q = f + (f"experts.{e}." if e != "shared" else "shared_experts.")
            out += [bf(q + "w1.weight", (F, H), ("normal", std)), bf(q + "w3.weight", (F, H), ("normal", std)),
                    bf(q + "w2.weight", (H, F), ("normal", out_std))]
    out += [bf("model.norm.weight", (H,), ("ones",)), bf("model.hc_head.hc_fn", (N, N * H), ("normal", std)),
            bf("model.hc_head.hc_base", (N,), ("zeros",)), bf("model.hc_head.hc_scale", (1,), ("ones",)),
            bf("head.weight", (V, H), ("normal", std))]
    return out


def model_bytes(c: dict) -> int:
    return sum(t.nbytes for t in plan(c))


def draw(t: Planned, rng: np.random.Generator, block: int = 1 << 22) -> np.ndarray:
    """The tensor's bytes, drawn in blocks of `block` values (float32 only a block at a time)."""
    n = math.prod(t.shape)
    kind = t.draw[0]
    if kind == "ones":
        return np.full(n, 0x3F80, np.uint16)  # bfloat16 1.0
    if kind == "zeros":
        return np.zeros(n, np.uint16)
    if kind == "tid2eid":  # hash routing's table: distinct experts for each token id, as a trained table holds
        rows, k = t.shape
        return np.argsort(rng.random((rows, t.draw[1])), axis=1)[:, :k].astype(np.int64).reshape(-1)
    if kind == "mxfp4_blocks":  # two uniformly drawn e2m1 codes a byte
        return rng.integers(0, 256, n, dtype=np.uint8)
    if kind == "mxfp4_scales":  # e8m0, biased by 127: the exponent that gives the values this std
        return np.full(n, 127 + round(math.log2(t.draw[1] / FP4_RMS)), np.uint8)
    out = np.empty(n, np.uint16)
    for s in range(0, n, block):
        m = min(block, n - s)
        out[s:s + m] = f32_to_bf16(rng.standard_normal(m, dtype=np.float32) * np.float32(t.draw[1]))
    return out


def write(model: str, out: str, layers: int | None = None, seed: int = 0, shard_bytes: int = 4 << 30,
          overrides: dict | None = None, progress: bool = True) -> str:
    """Write the checkpoint into `out` (which must not exist); returns `out`."""
    import llama_peer as peer
    from tools.progress import byte_bar

    c = config_of(model, layers, **(overrides or {}))
    tensors = plan(c)
    total = sum(t.nbytes for t in tensors)
    if os.path.exists(out):
        raise SystemExit(f"{out}: exists; give a new directory (a checkpoint is written once)")
    parent = os.path.dirname(os.path.abspath(out))
    free = shutil.disk_usage(parent).free
    if free < total + (256 << 20):
        raise SystemExit(f"{out}: {model} with {c['num_hidden_layers']} layers needs {total / 2**30:.1f} GiB; "
                         f"{parent} has {free / 2**30:.1f} GiB free (--layers makes it smaller)")
    shards, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    shards.append(cur)
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        rng = np.random.default_rng(seed)
        weight_map = {}
        bar = byte_bar(total, f"writing {model}") if progress else None
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"

            def data(t: Planned) -> np.ndarray:
                a = draw(t, rng)
                if bar is not None:
                    bar.update(t.nbytes)
                return a

            write_file(os.path.join(tmp, fname), [OutTensor(name=t.name, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes,
                                                            data=lambda t=t: data(t)) for t in shard],
                       metadata={"format": "pt"})
            weight_map.update({t.name: fname for t in shard})
        if bar is not None:
            bar.close()
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({k: c[k] for k in SPECIAL_IDS if k in c}, f, indent=2)
        peer.add_tokenizer(tmp, c["vocab_size"])
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _sizes() -> str:
    lines = []
    for model in MODELS:
        full = config_of(model)
        one = config_of(model, 1)
        per_layer = model_bytes(full) - model_bytes(one)
        per_layer //= full["num_hidden_layers"] - 1
        lines.append(f"  {model}: {model_bytes(full) / 2**30:.1f} GiB with all {full['num_hidden_layers']} layers, "
                     f"{per_layer / 2**30:.2f} GiB a layer beside {(model_bytes(one) - per_layer) / 2**30:.2f} GiB "
                     f"of embedding and head")
    return "sizes (and the disk each needs, checked before writing):\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=_sizes(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("out", help="the checkpoint's directory (must not exist)")
    ap.add_argument("--layers", type=int, help="keep the first N layers (default: all of the published config)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gib", type=float, default=4.0, help="size of a safetensors shard (default 4)")
    args = ap.parse_args(argv)
    path = write(args.model, args.out, args.layers, args.seed, int(args.shard_gib * 2**30))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
