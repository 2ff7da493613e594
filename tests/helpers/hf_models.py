"""Tiny random-weight MoE models built with transformers' own classes and saved with save_pretrained."""

from __future__ import annotations

import json
import pathlib
import warnings

import torch

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def tiny_config(arch: str, **over):
    """A tiny transformers config of one MoE architecture; `over` changes its fields (a larger model:
    hidden_size=64, intermediate sizes 64, for shapes int4's row blocks and groups take)."""
    import transformers

    if arch == "kimi_k25":  # DeepSeek-V3's text model (as its hub config names it, kimi_k2) beside a vision tower
        text = tiny_config("deepseek_v3", **over).to_dict()
        text["model_type"] = "kimi_k2"
        vision = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                      num_hidden_layers=1, hidden_size=16, intermediate_size=32)
        return transformers.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=16,
                                           tie_word_embeddings=False)
    if arch == "mixtral":
        cls, kw = transformers.MixtralConfig, dict(TINY, num_local_experts=4, num_experts_per_tok=2)
    elif arch == "qwen2_moe":
        cls, kw = transformers.Qwen2MoeConfig, dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                                    shared_expert_intermediate_size=40, decoder_sparse_step=1)
    elif arch == "olmoe":
        cls, kw = transformers.OlmoeConfig, dict(TINY, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                                                 eos_token_id=1, bos_token_id=None)
    elif arch == "qwen3_moe":
        cls, kw = transformers.Qwen3MoeConfig, dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                                    head_dim=16, norm_topk_prob=True, decoder_sparse_step=1,
                                                    mlp_only_layers=[0])
    elif arch in ("deepseek_v2", "deepseek_v3"):
        deepseek = dict(TINY, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                        topk_group=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                        routed_scaling_factor=2.5)
        if arch == "deepseek_v2":
            cls, kw = transformers.DeepseekV2Config, dict(deepseek, q_lora_rank=None, topk_method="group_limited_greedy")
        else:
            # YaRN as DeepSeek-V3 ships it (factor 40, mscale 1.0 on both), scaled down to 128 positions
            yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
            cls, kw = transformers.DeepseekV3Config, dict(deepseek, q_lora_rank=24, rope_parameters=yarn)
    elif arch == "glm4_moe":
        cls, kw = transformers.Glm4MoeConfig, dict(TINY, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                                                   moe_intermediate_size=24, n_shared_experts=1,
                                                   first_k_dense_replace=1, n_group=2, topk_group=1, head_dim=16,
                                                   partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                                                   routed_scaling_factor=1.5)
    elif arch == "gpt_oss":
        # gpt-oss's own YaRN (factor 32) and alternating windows, scaled down
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        cls, kw = transformers.GptOssConfig, dict(TINY, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
                                                  head_dim=16, sliding_window=6, rope_parameters=yarn)
    elif arch == "minimax_m2":
        # q/k norms over all heads, half of each head rotating (as rotary_dim 64 of 128), a
        # sigmoid router with a correction bias; heads * head_dim wider than the hidden size, as published
        cls, kw = transformers.MiniMaxM2Config, dict(TINY, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                                     bos_token_id=1, eos_token_id=2,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                                      "partial_rotary_factor": 0.5})
    elif arch == "dots1":
        # DeepSeek-V3's routing (groups, scaling, renormalised) over Qwen3's attention; one dense layer
        cls, kw = transformers.Dots1Config, dict(TINY, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=24, n_shared_experts=2, first_k_dense_replace=1,
                                                 n_group=4, topk_group=2, norm_topk_prob=True, head_dim=16,
                                                 routed_scaling_factor=2.5)
    elif arch == "ernie4_5_moe":
        # interleaved rotary; a dense first layer, then MoE layers with a shared expert; tied embeddings
        cls, kw = transformers.Ernie4_5_MoeConfig, dict(TINY, num_hidden_layers=3, moe_num_experts=4, moe_k=2,
                                                        moe_intermediate_size=24, moe_num_shared_experts=1,
                                                        moe_layer_start_index=1, head_dim=16)
    elif arch == "hunyuan_v1_moe":
        # per-head q/k norms after the rotation; its fixed NTK alpha stretching the rotary base
        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0, "alpha": 1000.0}
        cls, kw = transformers.HunYuanMoEV1Config, dict(TINY, num_experts=4, moe_topk=2, head_dim=16,
                                                        rope_parameters=rope)
    elif arch in ("deepseek_v32", "glm_moe_dsa"):
        # DeepSeek-V3's MLA and routing with the sparse-attention indexer: its top 4 positions of 32 heads,
        # so that prompts longer than 4 read a choice; GLM-5's rotates the indexer over pairs. With 8
        # heads, every head's relu was 0 for a position now and then (a score of exactly 0), and
        # transformers' top-k breaks such ties by chance where semoe takes the earliest position.
        # 32 heads make a tie at the k-th score improbable (1 in 2**32 a position)
        dsa = dict(TINY, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                   kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                   routed_scaling_factor=2.5, index_topk=4, index_n_heads=32, index_head_dim=16)
        cls = transformers.DeepseekV32Config if arch == "deepseek_v32" else transformers.GlmMoeDsaConfig
        kw = dsa
    elif arch == "qwen3_next":
        # Gated DeltaNet on three layers of four (two key heads shared by four value heads), gated full
        # attention rotating a quarter of each head on the fourth, a gated shared expert in every layer
        cls, kw = transformers.Qwen3NextConfig, dict(TINY, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                                     head_dim=16, partial_rotary_factor=0.25, linear_num_key_heads=2,
                                                     linear_num_value_heads=4, linear_key_head_dim=8,
                                                     linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                                     layer_types=["linear_attention"] * 3 + ["full_attention"])
    elif arch == "deepseek_v4":
        # every kind of layer: heavily compressed (one entry per 4 tokens), compressed sparse (an entry every 2
        # tokens from 4, the indexer's top 2), the window of 4 alone; hash routing on the first two; two streams.
        # 16 indexer heads: with fewer, every head's ReLU is 0 for many entries (1 in 16 with 4 heads), whose
        # equal scores any top-k may break either way; a trained model's 64 heads all at 0 does not happen
        rates = {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}
        cls, kw = transformers.DeepseekV4Config, dict(
            TINY, num_hidden_layers=4, head_dim=16, q_lora_rank=24, moe_intermediate_size=24, n_routed_experts=4,
            num_experts_per_tok=2, o_groups=2, o_lora_rank=8, index_n_heads=16, index_head_dim=8, index_topk=2,
            sliding_window=4, compress_rates=rates, hc_mult=2, partial_rotary_factor=0.25,
            layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                         "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"])
    elif arch == "qwen3_5_moe_text":  # Qwen3-Next's text model with the linear layers' projections apart
        kw = {k: v for k, v in tiny_config("qwen3_next").to_dict().items()
              if k in transformers.Qwen3_5MoeTextConfig().to_dict() and k not in ("model_type", "transformers_version")}
        cls, kw = transformers.Qwen3_5MoeTextConfig, dict(kw, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    elif arch == "qwen3_5_moe":  # its text model beside a vision tower
        text = tiny_config("qwen3_5_moe_text", **over).to_dict()
        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=text["hidden_size"],
                      patch_size=2, spatial_merge_size=1, temporal_patch_size=1)
        return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    elif arch == "llama4":  # the text model of a multimodal checkpoint, as Llama-4 Scout and Maverick ship
        text = tiny_config("llama4_text", **over).to_dict()
        vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                      patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)
        return transformers.Llama4Config(text_config=text, vision_config=vision)
    elif arch == "llama4_text":
        # MoE every other layer, a position-free layer every other one (temperature tuned), chunks of 4
        # positions on the rotating ones with their q/k norms, Llama-3's rope scaling; top-1 routing
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        cls, kw = transformers.Llama4TextConfig, dict(TINY, num_hidden_layers=4, intermediate_size=24,
                                                      intermediate_size_mlp=48, head_dim=16, num_local_experts=4,
                                                      num_experts_per_tok=1, interleave_moe_layer_step=2,
                                                      no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=2,
                                                      attn_scale=0.5, rope_parameters=rope)
    else:
        raise ValueError(arch)
    return cls(**{**kw, **over})


# Parameters that transformers initialises to zeros (or not at all); random here so that a model
# ignoring them cannot pass a parity test.
_PERTURB = {"e_score_correction_bias": 0.05, "sinks": 0.5, "router.bias": 0.5, "_bias": 0.05, ".bias": 0.02}
# and by architecture: Qwen3-Next's zero-centred norms, zeros as made, so that a model that used w, not 1 + w,
# could not pass
_ZERO_CENTRED = {"layernorm.weight": 0.2, "model.norm.weight": 0.2, "language_model.norm.weight": 0.2,
                 "q_norm.weight": 0.2, "k_norm.weight": 0.2}
_PERTURB_ARCH = {"qwen3_next": _ZERO_CENTRED, "qwen3_5_moe": _ZERO_CENTRED,
                 "deepseek_v4": {"sinks": 0.5, "position_bias": 0.3, "_hc.base": 0.3, "hc_base": 0.3}}


def hf_model_class(model_type: str):
    """transformers' class of a whole checkpoint of `model_type`: its causal LM, or the multimodal
    model around the text model semoe runs (Kimi-K2.5), whose logits from token ids are the text model's."""
    import transformers

    if model_type == "kimi_k25":
        return transformers.Kimi_K25ForConditionalGeneration
    if model_type == "llama4":
        return transformers.Llama4ForConditionalGeneration
    if model_type == "qwen3_5_moe":
        return transformers.Qwen3_5MoeForConditionalGeneration
    return transformers.AutoModelForCausalLM


def load_hf_model(path, **kw):
    """transformers' model of the checkpoint directory `path` (`hf_model_class`), `kw` to from_pretrained."""
    with open(pathlib.Path(path) / "config.json", encoding="utf-8") as f:
        model_type = json.load(f)["model_type"]
    return hf_model_class(model_type).from_pretrained(str(path), **kw)


def make_hf_checkpoint(arch: str, path: pathlib.Path, *, dtype: str = "float32", max_shard_size: str = "5GB",
                       seed: int = 0, **over) -> pathlib.Path:
    """Save a tiny random model of `arch` with save_pretrained (`over` as `tiny_config`'s); returns the
    directory."""
    import transformers

    cfg = tiny_config(arch, **over)
    torch.manual_seed(seed)
    cls = hf_model_class(cfg.model_type)
    model = cls.from_config(cfg) if cls is transformers.AutoModelForCausalLM else cls(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):  # hash routing's table: distinct experts per token
                t.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:t.shape[1]]
                                     for _ in range(t.shape[0])]))
                continue
            std = next((v for k, v in {**_PERTURB, **_PERTURB_ARCH.get(arch, {})}.items() if name.endswith(k)), None)
            if std is not None:
                t.copy_(torch.randn(t.shape, generator=g) * std)
    with warnings.catch_warnings():  # Llama-4's complex rotary buffer, which is not saved
        warnings.filterwarnings("ignore", message="Casting complex values to real")
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    if arch == "kimi_k25":
        _rename_tensors(path, "language_model.model.blocks.", "language_model.model.layers.")
    return path


def _rename_tensors(path: pathlib.Path, old: str, new: str) -> None:
    """Tensors whose names start with `old` renamed to start with `new`, in every file and the index.
    transformers 5.25 saves Kimi-K2.5's text layers as `blocks` (its vision tower's rename, reversed,
    reaches them too); the published checkpoint names them `layers`, as DeepSeek-V3 does, and
    transformers loads that."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    def renamed(name: str) -> str:
        return new + name[len(old):] if name.startswith(old) else name

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            metadata, tensors = f.metadata(), {renamed(k): f.get_tensor(k) for k in f.keys()}
        save_file(tensors, str(file), metadata=metadata)
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {renamed(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


def load_safetensors_dir(path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in a directory, read by the safetensors library."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def add_word_tokenizer(path, *, chat_template: str | None = None) -> None:
    """A word-level tokenizer.json covering all 96 ids, with <s> and </s> as special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ("the cat sat on a mat and dog ran to big red blue one two three four five six seven user "
             "assistant system").split()
    words += [f"w{i}" for i in range(96 - 3 - len(words))]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
