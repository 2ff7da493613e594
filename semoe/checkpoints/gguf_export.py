"""A store as a GGUF file llama.cpp loads (`semoe store export --format gguf`): the inverse of `gguf_import`.

Tensors are laid out as llama.cpp's converter lays out the HuggingFace checkpoint: names from the `gguf`
package's own `TensorNameMap`, each layer's experts stacked into one tensor a role (`ffn_gate_exps`, ...),
Mixtral's query and key rows permuted into adjacent pairs, DeepSeek's `kv_b_proj` split into `attn_k_b` and
`attn_v_b`, gpt-oss's interleaved `gate_up_proj` split into gate and up. Float tensors keep their dtype (F32,
F16, BF16); experts kept as GGUF blocks (`ggml`) are written back byte for byte; other compact weights
(semoe's int8 and int4, a checkpoint's FP8 or MXFP4) dequantized to their logical dtype. The metadata holds
the config's hyperparameters under llama.cpp's keys, and the tokenizer (a byte-level BPE `tokenizer.json`,
read by the package's `BpeVocab`, with its special tokens and chat template). The file is written beside
its name and renamed into place when complete, one tensor in memory at a time.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from semoe.model.hf_names import model_type_of, text_config_of
from storage.errors import BadInputError

# model_type -> llama.cpp's architecture (the `gguf` package's MODEL_ARCH member, and its name in the file)
ARCHS = {"mixtral": ("LLAMA", "llama"), "qwen2_moe": ("QWEN2MOE", "qwen2moe"), "qwen3_moe": ("QWEN3MOE", "qwen3moe"),
         "olmoe": ("OLMOE", "olmoe"), "deepseek_v2": ("DEEPSEEK2", "deepseek2"), "deepseek_v3": ("DEEPSEEK2", "deepseek2"),
         "glm4_moe": ("GLM4_MOE", "glm4moe"), "gpt_oss": ("GPT_OSS", "gpt-oss")}
_FLOAT_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# tensors written float32 whatever the store's dtype, as llama.cpp's converter writes them (with every 1-D one):
# norms, routers and biases, which llama.cpp's CPU ops take in float32 only
_F32_ALWAYS = ("_norm.weight", "ffn_gate_inp.weight", ".bias")


@dataclass(kw_only=True)
class OutTensor:
    """One tensor of the file: its name, the HuggingFace tensors it is made of, and how (`make` of their
    values, float arrays of the checkpoint's layout; `raw`: stacked as stored, GGUF blocks)."""

    name: str
    sources: list[str]
    make: Callable[..., np.ndarray]
    raw: bool = False


def _layer(hf: str) -> str:
    return re.search(r"layers\.(\d+)\.", hf).group(1)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The converter's permutation of a llama query or key projection: each head's halves into adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def plan(model_type: str, cfg: dict, names: list[str], raw: set[str] = frozenset()) -> list[OutTensor]:
    """The file's tensors made from the HuggingFace tensors `names` of a `model_type` checkpoint; `raw`: the
    tensors kept as GGUF blocks (stacked, or their rows reordered, as they are)."""
    import gguf

    if model_type not in ARCHS:
        raise BadInputError(f"model_type={model_type!r} has no GGUF layout here; exported as GGUF: "
                            f"{', '.join(ARCHS)}")
    arch = getattr(gguf.MODEL_ARCH, ARCHS[model_type][0])
    table = gguf.TensorNameMap(arch, cfg["num_hidden_layers"] + 1)
    out: list[OutTensor] = []
    experts: dict[tuple[str, str], dict[int, str]] = {}

    def mapped(hf: str) -> str:
        base, _, suffix = hf.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = hf, "weight"
        g = table.get_name(base)
        if g is None:
            raise BadInputError(f"tensor {hf} has no GGUF name for {model_type}")
        return f"{g}.{suffix}"

    for hf in names:
        m = re.match(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$", hf)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = hf
        elif model_type == "mixtral" and re.search(r"self_attn\.[qk]_proj\.weight$", hf):
            heads = cfg["num_attention_heads"] if ".q_proj" in hf else cfg["num_key_value_heads"]
            out.append(OutTensor(name=mapped(hf), sources=[hf], make=lambda a, h=heads: _permute(a, h), raw=hf in raw))
        elif model_type.startswith("deepseek") and hf.endswith("kv_b_proj.weight"):
            h, nope, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            i = _layer(hf)
            out.append(OutTensor(name=f"blk.{i}.attn_k_b.weight", sources=[hf],
                                 make=lambda a: a.reshape(h, nope + dv, -1)[:, :nope].swapaxes(1, 2)))
            out.append(OutTensor(name=f"blk.{i}.attn_v_b.weight", sources=[hf],
                                 make=lambda a: a.reshape(h, nope + dv, -1)[:, nope:]))
        elif model_type == "gpt_oss" and ".experts." in hf and hf in raw:  # rows of blocks (E, O, bytes of a row)
            i = _layer(hf)
            if hf.endswith("gate_up_proj"):  # gate j's row and up j's at 2j and 2j + 1
                out.append(OutTensor(name=f"blk.{i}.ffn_gate_exps.weight", sources=[hf], raw=True,
                                     make=lambda a: a[:, 0::2]))
                out.append(OutTensor(name=f"blk.{i}.ffn_up_exps.weight", sources=[hf], raw=True,
                                     make=lambda a: a[:, 1::2]))
            else:
                out.append(OutTensor(name=f"blk.{i}.ffn_down_exps.weight", sources=[hf], raw=True, make=lambda a: a))
        elif model_type == "gpt_oss" and ".experts." in hf:
            i = _layer(hf)
            if hf.endswith("gate_up_proj"):  # (E, D, 2F): gate j and up j at 2j and 2j + 1
                out.append(OutTensor(name=f"blk.{i}.ffn_gate_exps.weight", sources=[hf],
                                     make=lambda a: a[:, :, 0::2].swapaxes(1, 2)))
                out.append(OutTensor(name=f"blk.{i}.ffn_up_exps.weight", sources=[hf],
                                     make=lambda a: a[:, :, 1::2].swapaxes(1, 2)))
            elif hf.endswith("gate_up_proj_bias"):
                out.append(OutTensor(name=f"blk.{i}.ffn_gate_exps.bias", sources=[hf], make=lambda a: a[:, 0::2]))
                out.append(OutTensor(name=f"blk.{i}.ffn_up_exps.bias", sources=[hf], make=lambda a: a[:, 1::2]))
            elif hf.endswith("down_proj"):
                out.append(OutTensor(name=f"blk.{i}.ffn_down_exps.weight", sources=[hf],
                                     make=lambda a: a.swapaxes(1, 2)))
            else:
                out.append(OutTensor(name=f"blk.{i}.ffn_down_exps.bias", sources=[hf], make=lambda a: a))
        elif hf.endswith("gate.e_score_correction_bias"):
            out.append(OutTensor(name=f"blk.{_layer(hf)}.exp_probs_b.bias", sources=[hf], make=lambda a: a))
        elif hf.endswith("self_attn.sinks"):
            out.append(OutTensor(name=f"blk.{_layer(hf)}.attn_sinks.weight", sources=[hf], make=lambda a: a))
        else:
            out.append(OutTensor(name=mapped(hf), sources=[hf], make=lambda a: a, raw=hf in raw))
    for (prefix, role), by_e in experts.items():
        srcs = [by_e[e] for e in sorted(by_e)]
        kept = {s in raw for s in srcs}
        if kept == {True, False}:
            raise BadInputError(f"{prefix}.*.{role}: some experts are GGUF blocks, others not; export takes one kind")
        out.append(OutTensor(name=mapped(f"{prefix}.{role}.weight"), sources=srcs, raw=True in kept,
                             make=lambda *a: np.stack(a)))
    return out


def metadata(w, model_type: str, cfg: dict) -> None:
    """The hyperparameters llama.cpp reads for a `model_type` checkpoint of config `cfg`, into writer `w`."""
    import gguf

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    nextn = cfg.get("num_nextn_predict_layers", 0) if model_type == "glm4_moe" else 0
    w.add_block_count(cfg["num_hidden_layers"] + nextn)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if model_type.startswith("deepseek") else cfg["num_key_value_heads"])
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_vocab_size(cfg["vocab_size"])
    if rope.get("rope_type", rope.get("type")) == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope.get("beta_fast", 32.0))
        w.add_rope_scaling_yarn_beta_slow(rope.get("beta_slow", 1.0))
        if model_type.startswith("deepseek"):
            w.add_rope_scaling_yarn_log_mul(0.1 * rope.get("mscale_all_dim", 0.0))
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
    if model_type.startswith("deepseek") or model_type == "glm4_moe":
        if cfg.get("scoring_func", "sigmoid" if model_type != "deepseek_v2" else "softmax") == "sigmoid":
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        else:
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)


def tokenizer(w, files: dict[str, bytes], vocab_size: int) -> None:
    """The tokenizer of side files `files` (tokenizer.json: a byte-level BPE; tokenizer_config.json, a chat
    template) into writer `w`; BadInputError for another kind of tokenizer."""
    import pathlib

    import gguf

    with tempfile.TemporaryDirectory() as d:
        for name, data in files.items():
            pathlib.Path(d, name).write_bytes(data)
        try:
            vocab = gguf.vocab.BpeVocab(pathlib.Path(d))
        except (FileNotFoundError, KeyError) as e:
            raise BadInputError(f"tokenizer.json: only byte-level BPE tokenizers are exported to GGUF here ({e})") from None
        tokens, types = [], []
        for text, _score, kind in vocab.all_tokens():
            tokens.append(text)
            types.append(kind)
        tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]  # the embedding's rows past the vocabulary
        types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        special = gguf.SpecialVocab(pathlib.Path(d), load_merges=True, n_vocab=len(tokens))
        template = pathlib.Path(d, "chat_template.jinja")
        if special.chat_template is None and template.exists():  # transformers 5 saves it beside the config
            special.chat_template = template.read_text(encoding="utf-8")
        special.add_to_gguf(w)


def _raw(a: np.ndarray, kind: str) -> tuple[np.ndarray, str]:
    """A float array (float32, or bfloat16's bits as uint16) as bytes of the file's type `kind` (F32, F16, BF16)."""
    if kind == "F32":
        a = np.ascontiguousarray(a, dtype=np.float32)
    elif kind == "F16":
        a = np.ascontiguousarray(a, dtype=np.float16)
    else:
        a = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
    return a.view(np.uint8).reshape(*a.shape[:-1], -1), kind


def export_gguf(store, out_path: str, *, progress: Callable[[int], None] | None = None) -> int:
    """Write store `store` as the GGUF file `out_path` (absent); the number of tensors written."""
    import gguf

    from semoe.checkpoints.hf_convert import hf_out_tensors
    from storage.dtypes import torch_dtype
    from storage.quant import QuantSpec

    if os.path.exists(out_path):
        raise BadInputError(f"{out_path}: exists; export writes a new file")
    m = store.manifest
    config = m.model.get("config") or {}
    cfg, model_type = text_config_of(config), model_type_of(config)
    native = sorted({t.quant["scheme"] for t in m.tensors if (t.quant or {}).get("scheme") in ("fp8", "mxfp4")})
    if native:
        raise BadInputError(f"{store.root}: its {', '.join(native)} weights (as the checkpoint shipped them) are not "
                            "exported to GGUF yet; export the HuggingFace checkpoint and convert it with llama.cpp")
    outs = hf_out_tensors(store)
    raw = {n for n, t in ((t.name, t) for t in m.tensors) if (t.quant or {}).get("scheme") == "ggml"}
    mtp = (m.model.get("mtp") or {}).get("layers") or []
    names = [n for n in outs if not any(f"layers.{i}." in n for i in mtp)]
    tensors = plan(model_type, cfg, names, raw)

    def values(name: str) -> np.ndarray:  # float32 (bfloat16's bits widened), as the checkpoint's tensor
        o = outs[name]
        t = torch.from_numpy(o.data().copy()).view(torch_dtype(o.dtype)).view(o.shape)
        return t.float().numpy()

    quant = {t.name: t.quant for t in m.tensors if t.quant}

    def kind(o: OutTensor) -> str:  # the file's type of the tensor
        if o.raw:
            return QuantSpec.from_json(quant[o.sources[0]]).ggml_type
        if len(outs[o.sources[0]].shape) <= 1 or o.name.endswith(_F32_ALWAYS):
            return "F32"  # as llama.cpp's converter writes them: its CPU ops take no half-precision norms
        return _FLOAT_TYPES.get(torch_dtype(outs[o.sources[0]].dtype), "F32")

    stacks = {}  # a fused tensor's slices (gpt-oss's experts), by name: their entries in expert order
    for t in m.tensors:
        if t.stacked and t.name in raw:
            stacks.setdefault(t.name, []).append(t)

    def raw_shape(n: str) -> tuple[int, ...]:
        return (len(stacks[n]), *stacks[n][0].shape) if n in stacks else tuple(m.tensor(n).shape)

    def raw_rows(n: str) -> np.ndarray:
        if n not in stacks:
            return store.read_tensor(n).numpy()
        return np.stack([store.read_tensor(n, stack_index=t.expert).numpy()
                         for t in sorted(stacks[n], key=lambda t: t.expert)])

    def made(o: OutTensor) -> np.ndarray:
        if o.raw:  # rows of blocks: stacked, or their rows reordered, as they are
            return np.ascontiguousarray(o.make(*(raw_rows(n) for n in o.sources)))
        return _raw(o.make(*(values(n) for n in o.sources)), kind(o))[0]

    def byte_shape(o: OutTensor) -> tuple[int, ...]:  # from the sources' shapes alone: nothing read
        if o.raw:
            return o.make(*(np.broadcast_to(np.uint8(0), raw_shape(n)) for n in o.sources)).shape
        shape = o.make(*(np.broadcast_to(np.float32(0), tuple(outs[n].shape)) for n in o.sources)).shape
        return (*shape[:-1], shape[-1] * (4 if kind(o) == "F32" else 2))

    part = f"{out_path}.part"
    w = gguf.GGUFWriter(part, ARCHS[model_type][1])
    try:
        w.add_name(os.path.basename(os.path.normpath(store.root)))
        metadata(w, model_type, cfg)
        tokenizer(w, {f.name: store.read_file(f.name) for f in m.files}, cfg["vocab_size"])
        for o in tensors:  # the header first: each tensor's shape from its sources' shapes
            shape = byte_shape(o)
            w.add_tensor_info(o.name, shape, np.dtype(np.uint8), int(np.prod(shape, dtype=np.int64)),
                              raw_dtype=gguf.GGMLQuantizationType[kind(o)])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for o in tensors:  # then the data, one tensor in memory at a time
            data = made(o)
            w.write_tensor_data(data)
            if progress:
                progress(data.nbytes)
        w.close()
        os.replace(part, out_path)
    except BaseException:
        w.close()
        if os.path.exists(part):
            os.remove(part)
        raise
    return len(tensors)
