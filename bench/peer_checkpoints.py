"""The checkpoints bench_vs_llamacpp.py measures, each piece made once in WORKDIR: `--arch ARCH`, a 3
GB-class float32 checkpoint of an architecture from transformers' own class (ARCH_SHAPES); `--experts
N`, bench_offload's Mixtral shape with N experts a layer in bfloat16. Beside each: its stores (the
import, int8 and int4) and llama.cpp's conversions by its own converter and llama-quantize.

It imports torch (in the functions that make checkpoints): bench_vs_llamacpp runs it in a process of its
own, so that its own process stays free of torch."""

from __future__ import annotations

import os
import shutil
import sys

# added tokens llama.cpp's converter looks up by name for an architecture (GLM's chat markers)
_GLM_TOKENS = ("[gMASK]", "<sop>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|observation|>")
# Qwen3.5's tokenizer class (which AutoTokenizer picks by the model type) adds <|endoftext|> past the vocabulary
# where the tokenizer lacks it, and llama.cpp's converter then finds an id past vocab_size
ARCH_SPECIAL_TOKENS = {"glm4_moe": _GLM_TOKENS, "glm_moe_dsa": _GLM_TOKENS, "qwen3_5_moe_text": ("<|endoftext|>",)}
# precisions that are a GGUF file both engines read (bench_gguf.py): llama-quantize's type, and semoe's import of
# the same file (store-gguf-TYPE: its quantized experts kept as their blocks)
GGUF_BITS = ("q4_k_m", "q8_0", "q6_k", "q5_k_m", "iq4_xs")
# architectures whose converter reads only a sentencepiece tokenizer.model (`llama_peer.add_sentencepiece`)
SENTENCEPIECE_ARCHS = ("ernie4_5_moe",)


def _tokenizer_and_stores(workdir: str, arch: str | None = None, quantized: tuple[int, ...] = (8, 4)) -> None:
    """WORKDIR's checkpoint given a tokenizer (llama.cpp's converter needs one), and its stores: the
    import and those of `quantized` (int8, int4), each made once."""
    import llama_peer as peer
    from bench_quant import GROUP_SIZE
    from semoe.checkpoints.hf_convert import import_checkpoint
    from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store

    hf, store = os.path.join(workdir, "hf"), os.path.join(workdir, "store")
    peer.add_tokenizer(hf, extra_special=ARCH_SPECIAL_TOKENS.get(arch, ()))
    if not os.path.exists(os.path.join(store, "manifest.json")):
        print("importing it into a store ...", file=sys.stderr)
        import_checkpoint(hf, store)
    for bits in quantized:
        path = os.path.join(workdir, f"store-int{bits}")
        if not os.path.exists(os.path.join(path, "manifest.json")):
            print(f"quantizing to int{bits} ...", file=sys.stderr)
            quantize_store(store, path, QuantizeConfig(bits=bits, group_size=GROUP_SIZE))


def prepare_wide(workdir: str, experts: int) -> None:
    """`--experts N`: bench_offload's model shape with N experts per layer in bfloat16 (so that 25% of
    its int8 and int4 bytes leaves room beside a Python process: on the 8-expert model 25% of int4
    is 0.17 GiB, less than torch alone holds), its stores (the bfloat16 import, int8 and int4) and
    llama.cpp's q8_0 and q4_0 (its converter to bf16, then llama-quantize), each made once."""
    import torch
    import transformers

    import llama_peer as peer
    from bench_offload import SHAPE

    hf = os.path.join(workdir, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        print(f"making a Mixtral-shaped bfloat16 checkpoint with {experts} experts a layer ...", file=sys.stderr)
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)  # built at its size, never at float32 first
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**SHAPE, "num_local_experts": experts}))
        torch.set_default_dtype(torch.float32)
        model.save_pretrained(hf, max_shard_size="1GB")
        del model
    _tokenizer_and_stores(workdir)
    env = peer.ensure_env()
    bf16 = os.path.join(workdir, "llama-bf16.gguf")
    for qtype in ("q8_0", "q4_0"):
        gguf = os.path.join(workdir, f"llama-{qtype}.gguf")
        if not os.path.exists(gguf):
            if not os.path.exists(bf16):
                print("converting it with llama.cpp's converter ...", file=sys.stderr)
                peer.convert(hf, bf16, "bf16", env=env)
            print(f"llama-quantize to {qtype} ...", file=sys.stderr)
            peer.quantize(bf16, gguf, qtype, env=env)
    if os.path.exists(bf16):
        os.remove(bf16)


# --arch: transformers config fields of a 3 GB-class float32 checkpoint per architecture (vocab, hidden
# size and depth of bench_offload's Mixtral-shaped model; many smaller experts where the architecture
# routes many, as Qwen3-MoE, DeepSeek, GLM-4.5 and gpt-oss do)
_COMMON = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
               max_position_embeddings=4096)
_MANY = dict(num_experts_per_tok=4, moe_intermediate_size=768)
_DEEPSEEK = dict(_COMMON, **_MANY, num_key_value_heads=8, n_routed_experts=32, n_shared_experts=1,
                 first_k_dense_replace=1, intermediate_size=3072, kv_lora_rank=256, qk_rope_head_dim=32,
                 qk_nope_head_dim=64, v_head_dim=64, n_group=4, topk_group=2, routed_scaling_factor=2.5)
_QWEN_NEXT = dict(_COMMON, **_MANY, num_experts=32, head_dim=128, shared_expert_intermediate_size=768,
                  intermediate_size=3072, decoder_sparse_step=1, norm_topk_prob=True, linear_num_key_heads=4,
                  linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
ARCH_SHAPES = {
    "mixtral": ("MixtralConfig", dict(_COMMON, intermediate_size=3584, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_COMMON, **_MANY, num_experts=32, intermediate_size=3072,
                                         shared_expert_intermediate_size=2048, decoder_sparse_step=1)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, **_MANY, num_experts=32, head_dim=128, intermediate_size=3072,
                                         norm_topk_prob=True, decoder_sparse_step=1)),
    "olmoe": ("OlmoeConfig", dict(_COMMON, num_experts_per_tok=4, num_experts=32, intermediate_size=768,
                                  num_key_value_heads=8)),
    # q_lora_rank set as DeepSeek-V2 has it: llama-quantize 0.3.36 refuses V2-Lite's absent one ("key not found
    # in model: deepseek2.attention.q_lora_rank"); semoe's tests cover that form
    "deepseek_v2": ("DeepseekV2Config", dict(_DEEPSEEK, q_lora_rank=512, topk_method="group_limited_greedy")),
    "deepseek_v3": ("DeepseekV3Config", dict(_DEEPSEEK, q_lora_rank=512)),
    # llama.cpp's converter wants GLM's own special tokens ([gMASK], <|user|>, ...): ARCH_SPECIAL_TOKENS
    "glm4_moe": ("Glm4MoeConfig", dict(_COMMON, **_MANY, n_routed_experts=32, n_shared_experts=1,
                                       first_k_dense_replace=1, intermediate_size=3072, head_dim=128,
                                       partial_rotary_factor=0.5, use_qk_norm=True, n_group=1, topk_group=1)),
    "gpt_oss": ("GptOssConfig", dict(_COMMON, num_local_experts=32, num_experts_per_tok=4, intermediate_size=768,
                                     head_dim=64, sliding_window=128)),
    # this year's families, each with its own parts at the same size (MiniMax-M2 with its published
    # rotary_dim beside the factor: llama.cpp's converter reads that one; it and dots1 with the published
    # scoring_func, which transformers' classes leave out and llama.cpp's graph needs to build at all)
    "minimax_m2": ("MiniMaxM2Config", dict(_COMMON, num_local_experts=32, num_experts_per_tok=4, intermediate_size=768,
                                           head_dim=128, bos_token_id=1, eos_token_id=2, rotary_dim=64,
                                           scoring_func="sigmoid",
                                           rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                                          "partial_rotary_factor": 0.5})),
    # as many key-value heads as heads, as published (dots.llm1): llama.cpp's loader takes no fewer
    "dots1": ("Dots1Config", dict(_COMMON, **_MANY, num_key_value_heads=8, n_routed_experts=32, n_shared_experts=1,
                                  first_k_dense_replace=1,
                                  intermediate_size=3072, head_dim=128, n_group=1, topk_group=1, norm_topk_prob=True,
                                  routed_scaling_factor=2.5, scoring_func="sigmoid")),
    # two shared experts as published (ERNIE-4.5-21B-A3B); the dense first layer's width follows them
    # (`shaped_fields`)
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(_COMMON, moe_num_experts=32, moe_k=4, moe_intermediate_size=768,
                                                moe_num_shared_experts=2, moe_layer_start_index=1,
                                                intermediate_size=3072, head_dim=128)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(_COMMON, num_experts=32, moe_topk=4, moe_intermediate_size=768,
                                                  intermediate_size=768, head_dim=128)),
    # MoE every other layer (the dense ones twice as wide), no rope on every fourth, chunks of 8192
    "llama4_text": ("Llama4TextConfig", dict(_COMMON, num_local_experts=32, num_experts_per_tok=1,
                                             intermediate_size=1536, intermediate_size_mlp=3072, head_dim=128,
                                             interleave_moe_layer_step=2, attention_chunk_size=8192)),
    # DeepSeek sparse attention: the indexer's top 2048 of 64 heads of 128, as published (with the published
    # config's scoring_func, which transformers' class leaves out and llama.cpp's loader requires)
    "deepseek_v32": ("DeepseekV32Config", dict(_DEEPSEEK, q_lora_rank=512, index_topk=2048, index_n_heads=64,
                                               index_head_dim=128, scoring_func="sigmoid")),
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(_DEEPSEEK, q_lora_rank=512, index_topk=2048, index_n_heads=32,
                                            index_head_dim=128, scoring_func="sigmoid")),
    # Gated DeltaNet on three layers of four (value heads twice the key heads, as published), gated full
    # attention rotating a quarter of each head on the fourth, a gated shared expert in every layer; Qwen3.5's
    # text model the same with its linear projections apart
    "qwen3_next": ("Qwen3NextConfig", dict(_QWEN_NEXT)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(_QWEN_NEXT)),
    # DeepSeek-V4-Flash's parts at the size of the others: the release's rotary dims (64 of each head), window
    # (128), compression rates (4, 128), indexer top-k (512) and key dims (128), four streams (llama.cpp's
    # graph takes no other count), three hash-routed layers, HCA on the first two then CSA and HCA alternating
    # (transformers' defaults); the experts MXFP4-exact (`peer_v4`)
    "deepseek_v4": ("DeepseekV4Config", dict(_COMMON, **_MANY, num_key_value_heads=1, n_routed_experts=32,
                                             n_shared_experts=1, head_dim=256, partial_rotary_factor=0.25,
                                             q_lora_rank=512, o_groups=4, o_lora_rank=512, index_n_heads=16,
                                             index_head_dim=128, index_topk=512, sliding_window=128,
                                             hc_mult=4, routed_scaling_factor=1.5,
                                             compress_rates={"compressed_sparse_attention": 4,
                                                             "heavily_compressed_attention": 128})),
}


# --shape: a shape's names (as bench_vs_llamacpp takes them) -> each architecture's config field; an
# architecture missing from a name's map keeps the common field, None: it has no such field
_EXPERTS = {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts", "minimax_m2": "num_local_experts",
            "llama4_text": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts",
            "olmoe": "num_experts", "hunyuan_v1_moe": "num_experts", "ernie4_5_moe": "moe_num_experts",
            "qwen3_next": "num_experts", "qwen3_5_moe_text": "num_experts"}
_WIDTH = {a: "intermediate_size" for a in ("mixtral", "gpt_oss", "minimax_m2", "olmoe", "llama4_text")}
_LATENT = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")  # latent attention: no head_dim
SHAPE_FIELDS = {
    "hidden": ({}, "hidden_size"), "layers": ({}, "num_hidden_layers"), "heads": ({}, "num_attention_heads"),
    "kv_heads": ({}, "num_key_value_heads"), "head_dim": ({a: None for a in _LATENT}, "head_dim"),
    "experts": (_EXPERTS, "n_routed_experts"),
    "top_k": ({"ernie4_5_moe": "moe_k", "hunyuan_v1_moe": "moe_topk"}, "num_experts_per_tok"),
    "expert_width": (_WIDTH, "moe_intermediate_size"),
    "positions": ({}, "max_position_embeddings"),  # long-context runs (ARCH_SHAPES: 4096)
}


def parse_shape(text: str) -> dict[str, int]:
    """--shape's NAME=N,... (names: SHAPE_FIELDS) as a dict; ValueError naming what is wrong."""
    shape = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in SHAPE_FIELDS:
            raise ValueError(f"--shape: unknown name {name!r} (one of {', '.join(SHAPE_FIELDS)})")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"--shape: {name} needs a positive integer, got {value!r}")
        shape[name] = int(value)
    return shape


def shaped_fields(arch: str, shape: dict[str, int]) -> tuple[str, dict]:
    """ARCH_SHAPES[arch] with `shape`'s values in the architecture's own fields."""
    cls, fields = ARCH_SHAPES[arch]
    fields = dict(fields)
    for name, value in shape.items():
        per_arch, common = SHAPE_FIELDS[name]
        field = per_arch.get(arch, common)
        if field is None:
            raise ValueError(f"--shape: {arch} has no {name} (latent attention's heads are set by its ranks)")
        fields[field] = value
    if arch == "dots1" and "kv_heads" in shape and shape["kv_heads"] != fields["num_attention_heads"]:
        raise ValueError("--shape: dots1 has as many key-value heads as heads (llama.cpp's loader takes no fewer)")
    if arch == "dots1":
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if arch in _LATENT and "heads" in shape and "kv_heads" not in shape:
        # latent attention expands the latent to every head: llama.cpp's converter splits kv_b by the
        # config's key-value heads, which must be the heads
        fields["num_key_value_heads"] = shape["heads"]
    if arch == "minimax_m2":  # llama.cpp's converter reads rotary_dim, transformers the factor: both the same
        fields["rotary_dim"] = int(fields["head_dim"] * fields["rope_parameters"]["partial_rotary_factor"])
    if arch in ("qwen3_next", "qwen3_5_moe_text"):  # full attention every fourth layer, whatever the depth
        fields["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                 for i in range(fields["num_hidden_layers"])]
    if arch == "hunyuan_v1_moe":
        # transformers' experts are `intermediate_size` wide (as its shared expert); llama.cpp's converter
        # reads moe_intermediate_size where the config has it: both the same
        fields["intermediate_size"] = fields["moe_intermediate_size"]
    if arch == "ernie4_5_moe":
        # llama.cpp's converter takes the shared experts' width as intermediate_size / key-value heads
        # (true of the published configs: 12288 / 4 = 2 x 1536), transformers as their count x the
        # experts' width: the dense layer's width is set so that both read the same
        fields["intermediate_size"] = (fields["num_key_value_heads"] * fields["moe_intermediate_size"]
                                       * fields["moe_num_shared_experts"])
    return cls, fields


# what a WORKDIR of --arch holds against the float32 model's bytes: the checkpoint, its import, the int8
# and int4 stores (their dense weights int8), llama.cpp's f32, q8_0 and q4_0 (measured: 10-12 GiB for
# the 2.4-2.9 GiB models), with a margin
WORKDIR_BYTES_PER_MODEL_BYTE = 4.5


def prepare_arch(workdir: str, arch: str, shape: dict[str, int] | None = None,
                 bits: tuple[str, ...] = ("f32", "int8", "int4")) -> None:
    """`--arch`: WORKDIR's float32 checkpoint of `arch` (ARCH_SHAPES, with `shape`'s changes), its stores and
    llama.cpp's f32, q8_0 and q4_0, each made once; only the quantized ones `bits` names (a float32-only
    sweep of shapes makes neither int8 nor int4). A WORKDIR made for another architecture or shape is
    refused."""
    import json

    import torch
    import transformers

    import llama_peer as peer
    import peer_v4

    hf = os.path.join(workdir, "hf")
    made = {"arch": arch, "shape": shape or {}}
    record = os.path.join(workdir, "shape.json")
    if os.path.exists(record):
        with open(record, encoding="utf-8") as f:
            before = json.load(f)
        if before != made:
            raise SystemExit(f"{workdir} holds a checkpoint of {before}, not {made}: give another --workdir")
    if not os.path.exists(os.path.join(hf, "config.json")):
        cls, fields = shaped_fields(arch, shape or {})
        config = getattr(transformers, cls)(**fields)
        with torch.device("meta"):  # its size, before anything is written
            nbytes = 4 * sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        need, free = int(WORKDIR_BYTES_PER_MODEL_BYTE * nbytes), shutil.disk_usage(workdir).free
        if need > free:
            raise SystemExit(f"{workdir}: a {nbytes / 2**30:.2f} GiB {arch} checkpoint, its stores and llama.cpp's "
                             f"files take about {need / 2**30:.1f} GiB; the disk has {free / 2**30:.1f} GiB free")
        with open(record, "w", encoding="utf-8") as f:
            json.dump(made, f)
        print(f"making a {arch} float32 checkpoint of {nbytes / 2**30:.2f} GiB with transformers ...", file=sys.stderr)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        if arch == "deepseek_v4":  # llama.cpp's converter takes its experts as MXFP4 only: values it holds exactly
            peer_v4.round_experts(model)
        model.save_pretrained(hf, max_shard_size="1GB")
        del model
    _tokenizer_and_stores(workdir, arch, tuple(b for b in (8, 4) if f"int{b}" in bits))
    env = peer.ensure_env()
    if arch in SENTENCEPIECE_ARCHS:
        peer.add_sentencepiece(hf, env)
    f32 = os.path.join(workdir, "llama-f32.gguf")
    if not os.path.exists(f32) and arch == "deepseek_v4":
        # the converter reads the release layout and writes MXFP4 experts; llama-quantize takes them to f32
        release, mxfp4 = os.path.join(workdir, "release"), os.path.join(workdir, "llama-mxfp4.gguf")
        if not os.path.exists(mxfp4):
            print("writing the release layout and converting it with llama.cpp's converter ...", file=sys.stderr)
            peer_v4.release_copy(hf, release)
            peer.convert(release, mxfp4, "f32", env=env)
            shutil.rmtree(release)
        print("llama-quantize to f32 ...", file=sys.stderr)
        peer.quantize(mxfp4, f32, "f32", env=env)
    if not os.path.exists(f32):
        print("converting it with llama.cpp's converter ...", file=sys.stderr)
        peer.convert(hf, f32, "f32", env=env)
    for qtype in (q for b, q in (("int8", "q8_0"), ("int4", "q4_0"), *((g, g) for g in GGUF_BITS)) if b in bits):
        gguf = os.path.join(workdir, f"llama-{qtype}.gguf")
        if not os.path.exists(gguf):
            print(f"llama-quantize to {qtype} ...", file=sys.stderr)
            peer.quantize(f32, gguf, qtype, env=env)
    for qtype in (b for b in bits if b in GGUF_BITS):  # semoe's import of that very file
        store = os.path.join(workdir, f"store-gguf-{qtype}")
        if not os.path.exists(os.path.join(store, "manifest.json")):
            from semoe.checkpoints.hf_convert import import_checkpoint

            print(f"importing llama-{qtype}.gguf into a store ...", file=sys.stderr)
            import_checkpoint(os.path.join(workdir, f"llama-{qtype}.gguf"), store)
