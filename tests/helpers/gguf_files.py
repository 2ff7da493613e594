"""GGUF files of tiny HuggingFace checkpoints, written here with the `gguf` package as llama.cpp's converter
lays them out (its names from the package's own `TensorNameMap`, experts stacked per layer, Mixtral's query
and key rows permuted, DeepSeek's kv_b split into k_b and v_b, gpt-oss's gate and up separated), and a
byte-level BPE tokenizer whose vocabulary the file carries."""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import torch

from helpers.hf_models import load_safetensors_dir

TOKENIZER_TEXT = ("the cat sat on the mat and the dog ran to the big red house; one two three four five six "
                  "seven eight nine ten. The quick brown fox jumps over the lazy dog! def main(): return 0\n") * 8
SPECIAL = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}assistant:"


def _arch(model_type: str):
    import gguf

    A = gguf.MODEL_ARCH
    return {"mixtral": (A.LLAMA, "llama"), "qwen2_moe": (A.QWEN2MOE, "qwen2moe"), "qwen3_moe": (A.QWEN3MOE, "qwen3moe"),
            "olmoe": (A.OLMOE, "olmoe"), "deepseek_v2": (A.DEEPSEEK2, "deepseek2"),
            "deepseek_v3": (A.DEEPSEEK2, "deepseek2"), "glm4_moe": (A.GLM4_MOE, "glm4moe"),
            "gpt_oss": (A.GPT_OSS, "gpt-oss")}[model_type]


def bpe_tokenizer(vocab_size: int):
    """A byte-level BPE of exactly `vocab_size` tokens (ids 0-2: <unk> <s> </s>), trained on a short text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    assert tok.get_vocab_size() == vocab_size, f"{tok.get_vocab_size()} tokens trained, {vocab_size} wanted"
    return tok


def add_bpe_tokenizer(hf_dir: pathlib.Path, vocab_size: int) -> None:
    """The BPE as the HuggingFace directory's tokenizer (what the GGUF's is compared with)."""
    bpe_tokenizer(vocab_size).save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
         "add_bos_token": False, "chat_template": CHAT_TEMPLATE}))


def _metadata(w, model_type: str, cfg: dict) -> None:
    rope = cfg.get("rope_parameters") or {}
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    nextn = cfg.get("num_nextn_predict_layers", 0) if model_type == "glm4_moe" else 0
    w.add_block_count(cfg["num_hidden_layers"] + nextn)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if model_type.startswith("deepseek") else cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_vocab_size(cfg["vocab_size"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        if model_type.startswith("deepseek"):
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if model_type in ("qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss"):
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    if model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if model_type in ("qwen3_moe", "glm4_moe", "gpt_oss"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if model_type == "gpt_oss":
        w.add_sliding_window(cfg["sliding_window"])
    if model_type.startswith("deepseek") or model_type == "glm4_moe":
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
    if model_type == "glm4_moe":
        w.add_rope_dimension_count(int(head_dim * (cfg.get("partial_rotary_factor") or rope["partial_rotary_factor"])))
        w.add_nextn_predict_layers(nextn)
    if model_type.startswith("deepseek"):
        rd = cfg["qk_rope_head_dim"]
        w.add_rope_dimension_count(rd)
        w.add_kv_lora_rank(cfg["kv_lora_rank"])
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_key_length(cfg["kv_lora_rank"] + rd)
        w.add_value_length(cfg["kv_lora_rank"])
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rd)
        w.add_value_length_mla(cfg["v_head_dim"])


def _tokenizer(w, tok, chat_template: str | None) -> None:
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The converter's permutation of a llama query or key projection (halves into adjacent pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _layer(hf: str) -> str:
    return re.search(r"layers\.(\d+)\.", hf).group(1)


def gguf_tensors(model_type: str, cfg: dict, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """llama.cpp's tensors (names and float32 values) of a HuggingFace state dict."""
    import gguf

    arch, _ = _arch(model_type)
    layers = cfg["num_hidden_layers"]
    names = gguf.TensorNameMap(arch, layers + 1)
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}

    def put(hf: str, a: np.ndarray) -> None:
        base, _, suffix = hf.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = hf, "weight"
        g = names.get_name(base)
        assert g is not None, f"no GGUF name for {hf}"
        out[f"{g}.{suffix}"] = a

    for hf, t in state.items():
        a = t.float().numpy()
        m = re.match(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$", hf)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = a
        elif model_type == "mixtral" and re.search(r"self_attn\.[qk]_proj\.weight$", hf):
            heads = cfg["num_attention_heads"] if ".q_proj" in hf else cfg["num_key_value_heads"]
            put(hf, _permute(a, heads))
        elif model_type == "deepseek_v3" and hf.endswith("kv_b_proj.weight"):
            h, nope, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv = a.reshape(h, nope + dv, -1)
            i = _layer(hf)
            out[f"blk.{i}.attn_k_b.weight"] = np.ascontiguousarray(kv[:, :nope].swapaxes(1, 2))
            out[f"blk.{i}.attn_v_b.weight"] = np.ascontiguousarray(kv[:, nope:])
        elif model_type == "gpt_oss" and ".experts." in hf:
            i = _layer(hf)
            if hf.endswith("gate_up_proj"):
                out[f"blk.{i}.ffn_gate_exps.weight"] = np.ascontiguousarray(a[:, :, 0::2].swapaxes(1, 2))
                out[f"blk.{i}.ffn_up_exps.weight"] = np.ascontiguousarray(a[:, :, 1::2].swapaxes(1, 2))
            elif hf.endswith("gate_up_proj_bias"):
                out[f"blk.{i}.ffn_gate_exps.bias"] = np.ascontiguousarray(a[:, 0::2])
                out[f"blk.{i}.ffn_up_exps.bias"] = np.ascontiguousarray(a[:, 1::2])
            elif hf.endswith("down_proj"):
                out[f"blk.{i}.ffn_down_exps.weight"] = np.ascontiguousarray(a.swapaxes(1, 2))
            else:
                out[f"blk.{i}.ffn_down_exps.bias"] = a
        elif hf.endswith("gate.e_score_correction_bias"):
            out[f"blk.{_layer(hf)}.exp_probs_b.bias"] = a
        elif hf.endswith("self_attn.sinks"):
            i = _layer(hf)
            out[f"blk.{i}.attn_sinks.weight"] = a
        else:
            put(hf, a)
    for (prefix, role), by_e in experts.items():
        put(f"{prefix}.{role}.weight", np.stack([by_e[e] for e in sorted(by_e)]))
    return out


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """`rows` rows of `cols` weights of ggml type `name` as raw blocks (rows, bytes of a row): random codes and
    sub-scales, the half scales such that weights stay under about 0.1, as a model's do (a type the package
    cannot quantize: K-quants, IQ4)."""
    import gguf

    t = gguf.GGMLQuantizationType[name]
    per, nbytes = gguf.GGML_QUANT_SIZES[t]
    b = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)

    def half(at: int, lo: float, hi: float) -> None:
        b[:, :, at:at + 2] = rng.uniform(lo, hi, b.shape[:2]).astype(np.float16)[..., None].view(np.uint8)

    if name == "MXFP4":
        b[:, :, 0] = rng.integers(116, 121, b.shape[:2])  # 2^-11 .. 2^-7 times codes of up to 12
    elif name == "Q6_K":
        half(208, 2e-6, 2e-5)  # times int8 sub-scales and codes of up to 32
    elif name in ("Q4_K", "Q5_K"):
        half(0, 2e-5, 1e-4)  # times 6-bit sub-scales and codes of up to 31
        half(2, 0.0, 5e-5)
    elif name == "IQ4_XS":
        half(0, 5e-6, 2e-5)  # times sub-scales of up to 32 and values of up to 127
    else:
        half(0, 2e-4, 2e-3)
        if name in ("Q4_1", "Q5_1"):
            half(2, -0.02, 0.02)
    return b.reshape(rows, -1)


def write_gguf(hf_dir: pathlib.Path, out: pathlib.Path, *, qtype: str = "F32", split: int = 0) -> pathlib.Path:
    """`hf_dir` (a tiny checkpoint with `add_bpe_tokenizer`'s tokenizer) as a GGUF file at `out`: matrices of
    two or more dimensions whose rows fit `qtype`'s blocks in `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1, MXFP4: what the package quantizes; K-quants and IQ4: random blocks of the type, `random_blocks`,
    not the weights), the rest float32; `split` > 0: that many tensors a file, written as
    NAME-0000k-of-0000N.gguf beside `out` (the first's path is returned)."""
    import gguf
    from tokenizers import Tokenizer

    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    _, arch_name = _arch(model_type)
    tensors = gguf_tensors(model_type, cfg, load_safetensors_dir(hf_dir))
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    items = sorted(tensors.items())
    chunks = [items[i:i + split] for i in range(0, len(items), split)] if split else [items]
    paths = [out] if not split else [out.with_name(f"{out.stem}-{k + 1:05d}-of-{len(chunks):05d}.gguf")
                                     for k in range(len(chunks))]
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    template = json.loads((hf_dir / "tokenizer_config.json").read_text()).get("chat_template")
    rng = np.random.default_rng(0)
    for k, (path, chunk) in enumerate(zip(paths, chunks)):
        w = gguf.GGUFWriter(str(path), arch_name)
        if k == 0:
            w.add_name("tiny " + model_type)
            _metadata(w, model_type, cfg)
            _tokenizer(w, tok, template)
        if split:
            w.add_uint16("split.no", k)
            w.add_uint16("split.count", len(chunks))
            w.add_int32("split.tensors.count", len(items))
        for name, a in chunk:
            if a.ndim >= 2 and qtype != "F32" and a.shape[-1] % block == 0 and "ffn_gate_inp" not in name:
                if qtype.endswith("_K") or qtype.startswith("IQ"):
                    if "_exps" not in name:  # only the experts: random blocks elsewhere would swamp the model
                        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
                        continue
                    rows = random_blocks(qtype, int(np.prod(a.shape[:-1])), a.shape[-1], rng)
                    q = rows.reshape(*a.shape[:-1], rows.shape[-1])
                else:
                    q = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), kind)
                w.add_tensor(name, q, raw_dtype=kind)
            else:
                w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return paths[0]


def dequantized_state(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32, by the package's own dequantization (the reference)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32) for t in r.tensors}
