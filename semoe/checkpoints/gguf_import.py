"""GGUF files (llama.cpp's) opened as a checkpoint the importer takes (`hf_convert.Checkpoint`).

A GGUF file holds one model: metadata (`general.architecture`, `{arch}.block_count`, ...,
`tokenizer.ggml.*`) and tensors under llama.cpp's names (`blk.N.attn_q.weight`, `blk.N.ffn_gate_exps.weight`
holding every expert of a layer). `open_gguf` reads it through the `gguf` package (memory-mapped, the
file's alignment honoured) and gives what importing the HuggingFace directory it was converted from gives:

- the config.json transformers would write for the model, from the metadata;
- each tensor under its HuggingFace name and layout, undoing the converter's changes: Mixtral's query
  and key rows (llama.cpp's `llama` rotates adjacent pairs, so the converter permuted them), DeepSeek's
  `attn_k_b` + `attn_v_b` back into `kv_b_proj`, gpt-oss's separate gate and up back into its
  interleaved, transposed `gate_up_proj`; experts as one tensor per expert (gpt-oss's fused);
- the tokenizer and chat template, rebuilt from `tokenizer.ggml.*` by transformers' own GGUF tokenizer
  converter and saved as the files `AutoTokenizer` loads.

F32, F16 and BF16 tensors are kept as stored (exact). Quantized matrices of a type the kernels take
(`GGML_KERNEL_TYPES`) are kept as their rows of blocks (scheme `ggml`; the token embedding too; gpt-oss's
experts too, their rows the outputs, gate's and up's interleaved), gpt-oss's MXFP4 experts as the
checkpoint's own MXFP4. The rest (Q2_K, Q3_K, DeepSeek's `k_b`/`v_b`) are decoded by `gguf.quants.dequantize`
and stored widened: bfloat16 by default, float32 with `dtype="float32"` (every tensor widened: the file's
values exactly); one stderr line says what was kept and what decoded.
Multi-token-prediction layers (GLM's `nextn`) are left out, with one line.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from semoe.checkpoints.tokenizer import gguf_tokenizer_files
from storage.dtypes import cast_dtype, dtype_name, torch_dtype
from storage.dequant import whole_slices
from storage.errors import BadInputError
from storage.formats import GGML_KERNEL_TYPES
from storage.gguf_parts import split_parts
from storage.quant import QuantSpec

HF_FILE = "model.safetensors"  # the file name export writes the tensors back to
_PLAIN = {"F32": "F32", "F16": "F16", "BF16": "BF16"}
# the quantized types users' files hold, decoded at import (Q2_K and Q3_K too: widened like the rest)
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
             "MXFP4")
ARCHITECTURES = ("llama (Mixtral)", "qwen2moe", "qwen3moe", "olmoe", "deepseek2", "glm4moe", "gpt-oss")


@dataclass(kw_only=True)
class GGUFRef:
    """One tensor of the HuggingFace layout made from a GGUF file's tensors: a TensorRef's fields and
    reads. `make(i0, i1)` gives slices [i0, i1) of the leading dimension (of a `stacked` tensor, one
    slice an expert's; the whole tensor where it is not) as an array of `dtype`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str  # the GGUF file it comes from
    start: int  # its first source tensor's offset there (the order export writes tensors in)
    make: Callable[[int, int], np.ndarray]
    stacked: bool = False
    hf_file: str = HF_FILE

    @property
    def nbytes(self) -> int:
        return torch_dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64))

    def read_into(self, out: memoryview, *, offset: int = 0, nbytes: int | None = None) -> None:
        n = self.nbytes - offset if nbytes is None else nbytes
        i0, i1 = whole_slices(self.name, self.nbytes, self.shape[0] if self.stacked else 1, offset, n)
        try:
            data = np.ascontiguousarray(self.make(i0, i1))
        except (ValueError, IndexError, OSError) as e:  # a memory map past a truncated file's end, bad blocks
            raise BadInputError(f"{self.path}: tensor {self.name} cannot be read ({e})") from None
        if data.nbytes != n:
            raise BadInputError(f"{self.path}: tensor {self.name} gives {data.nbytes} bytes, {n} expected")
        np.frombuffer(out, dtype=np.uint8, count=n)[:] = data.reshape(-1).view(np.uint8)

    def read(self) -> np.ndarray:
        buf = np.empty(self.nbytes, dtype=np.uint8)
        self.read_into(memoryview(buf))
        return buf


class _Source:
    """The tensors of a GGUF file (or of every part of a split one) and its metadata."""

    def __init__(self, path: str):
        import gguf

        self.path = path
        self.gguf = gguf
        parts = split_parts(path)
        self.fields: dict[str, object] = {}
        self.tensors: dict[str, tuple[object, str]] = {}  # name -> (ReaderTensor, its file)
        for i, part in enumerate(parts):
            try:
                reader = gguf.GGUFReader(part, "r")
            except (ValueError, OSError, IndexError, KeyError) as e:  # bad magic, cut short, a bad field
                raise BadInputError(f"{part}: not a readable GGUF file ({e})") from None
            if i == 0:
                self.fields = {k: f for k, f in reader.fields.items()}
            for t in reader.tensors:
                self.tensors[t.name] = (t, part)
            self._check_sizes(reader, part)
        self.arch = self.value("general.architecture")

    def _check_sizes(self, reader, part: str) -> None:
        size = os.path.getsize(part)
        for t in reader.tensors:
            kind = t.tensor_type.name
            if kind not in _PLAIN and kind not in QUANTIZED:
                raise BadInputError(f"{part}: tensor {t.name} has type {kind}, which is not read here; supported: "
                                    f"{', '.join([*_PLAIN, *QUANTIZED])}")
            if t.data_offset + int(t.n_bytes) > size:
                raise BadInputError(f"{part}: truncated GGUF file (tensor {t.name} ends at byte "
                                    f"{t.data_offset + int(t.n_bytes)} of {size})")

    def value(self, key: str, default=None, *, required: bool = True):
        """Metadata `key`'s value; `default` where it is absent and not `required` (BadInputError otherwise)."""
        f = self.fields.get(key)
        if f is not None:
            return f.contents()
        if default is None and required:
            raise BadInputError(f"{self.path}: metadata key {key} is missing")
        return default

    def arch_value(self, key: str, default=None, *, required: bool = True):
        """`value` of the architecture's own key (`qwen3moe.block_count`)."""
        return self.value(f"{self.arch}.{key}", default, required=required)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def values(self, name: str, i0: int | None = None, i1: int | None = None) -> np.ndarray:
        """Tensor `name` (its leading slices [i0, i1) where given) as float32, or as stored for F16/F32
        (BF16 as its raw uint16 bits)."""
        t, _ = self.tensors[name]
        data = t.data if i0 is None else t.data[i0:i1]
        kind = t.tensor_type.name
        if kind == "F32" or kind == "F16":
            return np.asarray(data)
        if kind == "BF16":
            return np.asarray(data).view(np.uint16)
        return self.gguf.quants.dequantize(np.asarray(data), t.tensor_type)

    def kind(self, name: str) -> str:
        return self.tensors[name][0].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """The numpy shape (GGUF's dimensions reversed: rows first)."""
        t, _ = self.tensors[name]
        return tuple(int(d) for d in reversed(t.shape))

    def offset(self, name: str) -> int:
        return int(self.tensors[name][0].data_offset)


# -- the HuggingFace layout -------------------------------------------------------------------------

_NORMS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "post_attention_norm.weight": "post_attention_layernorm.weight"}
_ATTN = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
         "attn_q_a": "q_a_proj", "attn_q_b": "q_b_proj", "attn_kv_a_mqa": "kv_a_proj_with_mqa",
         "attn_kv_b": "kv_b_proj", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
         "attn_q_a_norm": "q_a_layernorm", "attn_kv_a_norm": "kv_a_layernorm"}
_FFN = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_MIXTRAL_EXPERT = {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"}
_EXPERT = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


class _Layout:
    """What `open_gguf` builds: the HF tensors as refs, in the files' order."""

    def __init__(self, src: _Source, to: str | None):
        self.src = src
        self.to = to  # the dtype every tensor is cast to, quantized ones widened to (None: keep)
        self.refs: dict[str, GGUFRef] = {}
        self.used: set[str] = set()
        self.quant: dict[str, dict] = {}  # the manifest `quant` of expert rows kept as GGUF's blocks
        self.widened: set[str] = set()  # the quantized types decoded into floats

    def out_dtype(self, names: list[str]) -> str:
        kinds = {self.src.kind(n) for n in names}
        if len(kinds) == 1 and next(iter(kinds)) in _PLAIN and self.to is None:
            return _PLAIN[next(iter(kinds))]
        return self.to or "BF16"

    def add(self, hf: str, names: list[str], shape: tuple[int, ...], fn: Callable[..., np.ndarray],
            stacked: bool = False) -> None:
        """HF tensor `hf` of `shape` from GGUF tensors `names`, by fn(*arrays) (each array the tensor's
        float values, or its slices [i0, i1) where `stacked`)."""
        src, dt = self.src, self.out_dtype(names)
        for n in names:
            self.used.add(n)
            if src.kind(n) not in _PLAIN:
                self.widened.add(src.kind(n))

        def make(i0: int, i1: int) -> np.ndarray:
            arrays = [src.values(n, i0, i1) if stacked else src.values(n) for n in names]
            if dt in ("F32", "F16") or any(a.dtype != np.uint16 for a in arrays):
                arrays = [_floats(a, src.kind(n)) for a, n in zip(arrays, names)]
            return _as(fn(*arrays), dt)

        self.refs[hf] = GGUFRef(name=hf, dtype=dt, shape=tuple(shape), path=src.path, start=src.offset(names[0]),
                                make=make, stacked=stacked)

    def same(self, hf: str, name: str, shape: tuple[int, ...] | None = None,
             rows: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """HF tensor `hf` as GGUF tensor `name` (of `shape` where given); a quantized matrix of a type the
        kernels take kept as its blocks, its rows reordered by `rows` where given (else it is decoded, and
        `rows` applied to its values)."""
        want = shape or self.src.shape(name)
        if self._keep(hf, name, want, rows):
            return
        self.add(hf, [name], want, (lambda a: rows(a.reshape(want))) if rows else (lambda a: a.reshape(want)))

    def _keep(self, hf: str, name: str, shape: tuple[int, ...], rows=None) -> bool:
        """Keep a quantized matrix as its rows of blocks (the token embedding too: its rows are decoded as they
        are looked up, `StoredEmbedding`, or once where a resident model loads it)."""
        kind = self.src.kind(name)
        if self.to is not None or kind not in GGML_KERNEL_TYPES or len(shape) != 2:
            return False
        src = self.src
        self.used.add(name)
        self.quant[hf] = QuantSpec(scheme="ggml", ggml_type=kind, dtype="F32", shape=shape, scales="").to_json()
        data = src.tensors[name][0].data

        def make(i0: int, i1: int) -> np.ndarray:
            a = np.asarray(data).reshape(shape[0], -1)
            return rows(a) if rows else a

        self.refs[hf] = GGUFRef(name=hf, dtype="U8", shape=(shape[0], int(np.asarray(data).shape[-1])), path=src.path,
                                start=src.offset(name), make=make)
        return True

    def experts(self, prefix: str, name: str, role: str) -> None:
        """Per-expert tensors `prefix.{e}.{role}.weight` from the stacked GGUF `name` (E, O, I)."""
        e_count, *rest = self.src.shape(name)
        for e in range(e_count):
            self._expert(f"{prefix}.{e}.{role}.weight", name, e, tuple(rest))

    def _expert(self, hf: str, name: str, e: int, shape: tuple[int, ...]) -> None:
        src, dt = self.src, self.out_dtype([name])
        self.used.add(name)
        kind = src.kind(name)
        if self.to is None and kind in GGML_KERNEL_TYPES:  # the rows as stored: the kernels compute on them
            rows = np.asarray(src.tensors[name][0].data[e])
            self.quant[hf] = QuantSpec(scheme="ggml", ggml_type=kind, dtype="F32", shape=shape, scales="").to_json()
            self.refs[hf] = GGUFRef(name=hf, dtype="U8", shape=rows.shape, path=src.path, start=src.offset(name),
                                    make=lambda i0, i1: np.asarray(src.tensors[name][0].data[e]))
            return
        if kind not in _PLAIN:
            self.widened.add(kind)

        def make(i0: int, i1: int) -> np.ndarray:
            a = src.values(name, e, e + 1)
            a = a if dt == "BF16" and a.dtype == np.uint16 else _floats(a, src.kind(name))
            return _as(a.reshape(shape), dt)

        self.refs[hf] = GGUFRef(name=hf, dtype=dt, shape=shape, path=src.path, start=src.offset(name), make=make)


def _floats(a: np.ndarray, kind: str) -> np.ndarray:
    """float32 values of an array `_Source.values` gave (BF16's raw bits widened)."""
    if kind == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def _as(a: np.ndarray, dt: str) -> np.ndarray:
    """`a` (float values, or BF16 bits already) in dtype `dt` (safetensors spelling)."""
    if dt == "BF16":
        if a.dtype == np.uint16:
            return a
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16).view(torch.uint16).numpy()
    return a.astype(np.float32 if dt == "F32" else np.float16, copy=False)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo the converter's permutation of a query or key projection's rows (llama.cpp's `llama` rotates
    adjacent pairs, HuggingFace's halves)."""
    rows, *rest = w.shape
    return w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# -- config.json from the metadata --------------------------------------------------------------------

_TYPES = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
          "glm4moe": "glm4_moe", "gpt-oss": "gpt_oss"}  # deepseek2: V2 or V3 by its router


def _config(src: _Source) -> tuple[dict, int]:
    """The HuggingFace config of the file's model, and its layer count (MTP layers not counted)."""
    import transformers

    arch, v = src.arch, src.arch_value
    if arch not in (*_TYPES, "deepseek2"):
        raise BadInputError(f"{src.path}: general.architecture={arch!r} is not supported; supported: "
                            f"{', '.join(ARCHITECTURES)}")
    if arch == "llama" and not v("expert_count", 0, required=False):
        raise BadInputError(f"{src.path}: a llama file without experts (llama.expert_count) is a dense model; "
                            "semoe runs MoE models")
    tokens = src.value("tokenizer.ggml.tokens", [], required=False)
    heads = int(v("attention.head_count"))
    hidden = int(v("embedding_length"))
    nextn = int(v("nextn_predict_layers", 0, required=False))
    layers = int(v("block_count")) - nextn
    kw = dict(vocab_size=int(v("vocab_size", 0, required=False) or len(tokens) or src.shape("token_embd.weight")[0]),
              hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=int(v("attention.head_count_kv", heads, required=False)),
              max_position_embeddings=int(v("context_length")),
              rms_norm_eps=_f32(v("attention.layer_norm_rms_epsilon")),
              tie_word_embeddings=not src.has("output.weight"),
              bos_token_id=src.value("tokenizer.ggml.bos_token_id", None, required=False),
              eos_token_id=src.value("tokenizer.ggml.eos_token_id", None, required=False))
    rope = {"rope_type": "default", "rope_theta": _f32(v("rope.freq_base", 10000.0, required=False))}
    if v("rope.scaling.type", None, required=False) == "yarn":
        rope.update(rope_type="yarn", factor=_f32(v("rope.scaling.factor")),
                    original_max_position_embeddings=int(v("rope.scaling.original_context_length")),
                    beta_fast=_f32(v("rope.scaling.yarn_beta_fast", 32.0, required=False)),
                    beta_slow=_f32(v("rope.scaling.yarn_beta_slow", 1.0, required=False)))
        if arch == "gpt-oss":  # as gpt-oss ships its YaRN: the correction range not rounded to whole dims
            rope["truncate"] = False
    elif v("rope.scaling.type", None, required=False) not in (None, "none"):
        raise BadInputError(f"{src.path}: metadata {arch}.rope.scaling.type="
                            f"{v('rope.scaling.type')!r} is not read here (only yarn)")
    experts, used = int(v("expert_count")), int(v("expert_used_count"))
    head_dim = int(v("attention.key_length", hidden // heads, required=False))
    ffn, expert_ffn = int(v("feed_forward_length")), int(v("expert_feed_forward_length", 0, required=False))
    if arch == "llama":
        cfg = transformers.MixtralConfig(**kw, intermediate_size=ffn, num_local_experts=experts,
                                         num_experts_per_tok=used, head_dim=head_dim, rope_parameters=rope)
    elif arch == "qwen2moe":
        cfg = transformers.Qwen2MoeConfig(**kw, intermediate_size=ffn, moe_intermediate_size=expert_ffn,
                                          shared_expert_intermediate_size=int(v("expert_shared_feed_forward_length")),
                                          num_experts=experts, num_experts_per_tok=used, decoder_sparse_step=1,
                                          mlp_only_layers=[], norm_topk_prob=False, rope_parameters=rope,
                                          qkv_bias=src.has("blk.0.attn_q.bias"))
    elif arch == "qwen3moe":
        cfg = transformers.Qwen3MoeConfig(**kw, intermediate_size=ffn, moe_intermediate_size=expert_ffn,
                                          num_experts=experts, num_experts_per_tok=used, head_dim=head_dim,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                          rope_parameters=rope)
    elif arch == "olmoe":
        cfg = transformers.OlmoeConfig(**kw, intermediate_size=ffn, num_experts=experts, num_experts_per_tok=used,
                                       norm_topk_prob=False, rope_parameters=rope)
    elif arch == "gpt-oss":
        cfg = transformers.GptOssConfig(**kw, intermediate_size=expert_ffn, num_local_experts=experts,
                                        num_experts_per_tok=used, head_dim=head_dim,
                                        sliding_window=int(v("attention.sliding_window")), rope_parameters=rope)
    else:  # deepseek2 and glm4moe: DeepSeek's router, shared experts and leading dense layers
        moe = dict(n_routed_experts=experts, num_experts_per_tok=used, moe_intermediate_size=expert_ffn,
                   n_shared_experts=int(v("expert_shared_count", 0, required=False)),
                   first_k_dense_replace=int(v("leading_dense_block_count", 0, required=False)),
                   n_group=int(v("expert_group_count", 1, required=False)),
                   topk_group=int(v("expert_group_used_count", 1, required=False)),
                   routed_scaling_factor=_f32(v("expert_weights_scale", 1.0, required=False)),
                   norm_topk_prob=bool(v("expert_weights_norm", False, required=False)), intermediate_size=ffn)
        rope_dim = int(v("rope.dimension_count"))
        if arch == "glm4moe":
            cfg = transformers.Glm4MoeConfig(**kw, **moe, head_dim=head_dim, partial_rotary_factor=rope_dim / head_dim,
                                             use_qk_norm=src.has("blk.0.attn_q_norm.weight"),
                                             attention_bias=src.has("blk.0.attn_q.bias"), rope_parameters=rope,
                                             num_nextn_predict_layers=nextn)
        else:
            q_lora = v("attention.q_lora_rank", 0, required=False) or None
            mla = dict(kv_lora_rank=int(v("attention.kv_lora_rank")), q_lora_rank=q_lora and int(q_lora),
                       qk_rope_head_dim=rope_dim,
                       qk_nope_head_dim=int(v("attention.key_length_mla", head_dim, required=False)) - rope_dim,
                       v_head_dim=int(v("attention.value_length_mla", 0, required=False)
                                      or v("attention.value_length")))
            kw["num_key_value_heads"] = heads  # MLA: the file's 1 is the latent's single head
            if rope["rope_type"] == "yarn":  # the file keeps 0.1 * mscale_all_dim; DeepSeek ships mscale equal
                m = _f32(float(v("rope.scaling.yarn_log_multiplier", 0.0, required=False)) / 0.1)
                rope.update(mscale=m, mscale_all_dim=m)
            v3 = src.has("blk.%d.exp_probs_b.bias" % moe["first_k_dense_replace"])
            if v3:
                cfg = transformers.DeepseekV3Config(**kw, **moe, **mla, rope_parameters=rope)
            else:
                method = "group_limited_greedy" if moe["n_group"] > 1 else "greedy"
                cfg = transformers.DeepseekV2Config(**kw, **moe, **mla, rope_parameters=rope, topk_method=method)
    out = {"architectures": [type(cfg).__name__.replace("Config", "ForCausalLM")], **cfg.to_diff_dict()}
    out.pop("transformers_version", None)
    return out, layers


def _f32(x) -> float:
    """A float the file keeps as float32, as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


# -- tensors ------------------------------------------------------------------------------------------


def _tensors(src: _Source, config: dict, layers: int, to: str | None) -> _Layout:
    out = _Layout(src, to)
    arch = src.arch
    out.same("model.embed_tokens.weight", "token_embd.weight")
    out.same("model.norm.weight", "output_norm.weight")
    if src.has("output.weight"):
        out.same("lm_head.weight", "output.weight")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    moe = "block_sparse_moe" if arch == "llama" else "mlp"
    shared = "shared_expert" if arch == "qwen2moe" else "shared_experts"
    for i in range(layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        names = sorted(n.removeprefix(b) for n in src.tensors if n.startswith(b))
        for n in names:
            stem, _, suffix = n.rpartition(".")
            g = b + n
            if n in _NORMS:
                out.same(h + _NORMS[n], g)
            elif stem in _ATTN:
                shape = src.shape(g)
                if arch == "llama" and stem in ("attn_q", "attn_k"):
                    count = heads if stem == "attn_q" else kv_heads
                    out.same(h + f"self_attn.{_ATTN[stem]}.{suffix}", g, rows=lambda a, c=count: _unpermute(a, c))
                else:
                    out.same(h + f"self_attn.{_ATTN[stem]}.{suffix}", g)
            elif stem == "attn_sinks":
                out.same(h + "self_attn.sinks", g)
            elif stem in ("attn_k_b", "attn_v_b"):
                if stem == "attn_k_b":
                    _kv_b(out, g, b + "attn_v_b.weight", h + "self_attn.kv_b_proj.weight")
            elif stem == "ffn_gate_inp":
                router = "mlp.router" if arch == "gpt-oss" else f"{moe}.gate"
                out.same(h + f"{router}.{suffix}", g)
            elif stem == "exp_probs_b":
                out.same(h + f"{moe}.gate.e_score_correction_bias", g)
            elif stem in _FFN:
                out.same(h + f"mlp.{_FFN[stem]}.{suffix}", g)
            elif stem.endswith("_shexp"):
                if stem == "ffn_gate_inp_shexp":
                    out.same(h + "mlp.shared_expert_gate.weight", g, (1, config["hidden_size"]))
                else:
                    out.same(h + f"mlp.{shared}.{_FFN[stem.removesuffix('_shexp')]}.{suffix}", g)
            elif stem in _EXPERT and arch == "gpt-oss":
                if stem == "ffn_gate_exps":
                    _gpt_oss_experts(out, b, h, suffix)
                elif stem == "ffn_down_exps":
                    _gpt_oss_down(out, g, h, suffix)
            elif stem in _EXPERT and suffix == "weight":
                role = (_MIXTRAL_EXPERT if arch == "llama" else _EXPERT)[stem]
                out.experts(h + f"{moe}.experts", g, role)
            else:
                raise BadInputError(f"{src.path}: tensor {g} is not one a {arch} model has here")
    left = [n for n in src.tensors if n not in out.used and not _past(n, layers)]
    if left:
        raise BadInputError(f"{src.path}: tensor {left[0]} is not one a {arch} model has here")
    return out


def _past(name: str, layers: int) -> bool:
    m = re.match(r"^blk\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= layers


def _kv_b(out: _Layout, k_b: str, v_b: str, hf: str) -> None:
    """DeepSeek's kv_b_proj (H (nope + v), L) from the converter's k_b (H, L, nope) and v_b (H, v, L)."""
    heads, lat, nope = out.src.shape(k_b)
    dv = out.src.shape(v_b)[1]
    out.add(hf, [k_b, v_b], (heads * (nope + dv), lat),
            lambda k, v: np.concatenate([k.swapaxes(1, 2), v], axis=1).reshape(heads * (nope + dv), lat))


def _fp4_blocks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF's MXFP4 rows (..., G 17-byte blocks: an e8m0 exponent, then element j in the low nibble of byte j
    and element j + 16 in its high one) as gpt-oss's checkpoint holds them: blocks (..., G, 16), element 2i in
    the low nibble of byte i and 2i + 1 in its high one, and the exponents (..., G). The same codes and scales."""
    b = rows.reshape(*rows.shape[:-1], -1, 17)
    q = b[..., 1:]
    vals = np.concatenate([q & 0x0F, q >> 4], axis=-1)  # (..., G, 32) e2m1 codes in order
    return (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8), np.ascontiguousarray(b[..., 0])


def _expert_rows(out: _Layout, parts: list[str]) -> tuple[int, int, int, Callable[[int, int], np.ndarray]]:
    """gpt-oss's stacked GGUF experts `parts` (gate and up, or down alone), marked used: E, O (gate's and up's
    together), I, and rows(i0, i1), experts [i0, i1) as (experts, O, bytes of a row), gate's and up's rows
    interleaved as the checkpoint's `gate_up_proj` interleaves its outputs."""
    src = out.src
    E, O, I = src.shape(parts[0])
    O *= len(parts)
    for n in parts:
        out.used.add(n)

    def rows(i0: int, i1: int) -> np.ndarray:
        r = [np.asarray(src.tensors[n][0].data[i0:i1]) for n in parts]
        return r[0] if len(r) == 1 else np.stack(r, axis=2).reshape(i1 - i0, O, -1)

    return E, O, I, rows


def _gpt_oss_mxfp4(out: _Layout, h: str, name: str, parts: list[str]) -> None:
    """gpt-oss's experts kept as MXFP4 (semoe's `mxfp4`, as the checkpoint ships them) from GGUF's MXFP4 rows:
    `name`_blocks and `name`_scales, (E, O, G, 16) and (E, O, G), gate_up's rows interleaving gate and up."""
    src = out.src
    E, O, I, rows = _expert_rows(out, parts)

    blocks, scales = f"{h}mlp.experts.{name}_blocks", f"{h}mlp.experts.{name}_scales"
    out.refs[blocks] = GGUFRef(name=blocks, dtype="U8", shape=(E, O, I // 32, 16), path=src.path,
                               start=src.offset(parts[0]), make=lambda i0, i1: _fp4_blocks(rows(i0, i1))[0], stacked=True)
    out.refs[scales] = GGUFRef(name=scales, dtype="U8", shape=(E, O, I // 32), path=src.path,
                               start=src.offset(parts[0]) + 1, make=lambda i0, i1: _fp4_blocks(rows(i0, i1))[1],
                               stacked=True)
    out.quant[blocks] = QuantSpec(scheme="mxfp4", dtype="BF16", shape=(I, O), scales=scales, transposed=True).to_json()
    out.quant[scales] = {"scales_of": blocks}


def _gpt_oss_rows(out: _Layout, h: str, name: str, parts: list[str]) -> bool:
    """gpt-oss's experts of one type the kernels take kept as their rows of blocks (scheme `ggml`, the logical
    (I, O) weight transposed: rows are outputs): `name` (E, O, bytes of a row), gate_up's rows interleaving
    gate and up as the checkpoint's outputs do; False (nothing done) where the parts' types differ or the
    import widens."""
    src = out.src
    kinds = {src.kind(n) for n in parts}
    if out.to is not None or len(kinds) != 1 or next(iter(kinds)) not in GGML_KERNEL_TYPES:
        return False
    E, O, I, rows = _expert_rows(out, parts)

    hf = f"{h}mlp.experts.{name}"
    width = int(np.asarray(src.tensors[parts[0]][0].data[:1]).shape[-1])
    out.refs[hf] = GGUFRef(name=hf, dtype="U8", shape=(E, O, width), path=src.path, start=src.offset(parts[0]),
                           make=rows, stacked=True)
    out.quant[hf] = QuantSpec(scheme="ggml", ggml_type=next(iter(kinds)), dtype="F32", shape=(I, O), scales="",
                              transposed=True).to_json()
    return True


def _gpt_oss_experts(out: _Layout, b: str, h: str, suffix: str) -> None:
    """gpt-oss's gate_up_proj (E, D, 2F) (its bias (E, 2F)): gate j and up j at 2j and 2j + 1."""
    gate, up = b + f"ffn_gate_exps.{suffix}", b + f"ffn_up_exps.{suffix}"
    shape = out.src.shape(gate)  # (E, F, D), or (E, F) for the bias
    if suffix == "weight" and out.to is None and {out.src.kind(gate), out.src.kind(up)} == {"MXFP4"}:
        _gpt_oss_mxfp4(out, h, "gate_up_proj", [gate, up])
        return
    if suffix == "weight" and _gpt_oss_rows(out, h, "gate_up_proj", [gate, up]):
        return

    def fuse(g: np.ndarray, u: np.ndarray) -> np.ndarray:
        both = np.stack([g, u], axis=2).reshape(g.shape[0], 2 * g.shape[1], *g.shape[2:])  # (E, 2F, ...)
        return both.swapaxes(1, 2) if both.ndim == 3 else both

    want = (shape[0], shape[2], 2 * shape[1]) if len(shape) == 3 else (shape[0], 2 * shape[1])
    name = "gate_up_proj" if suffix == "weight" else "gate_up_proj_bias"
    out.add(h + f"mlp.experts.{name}", [gate, up], want, fuse, stacked=True)


def _gpt_oss_down(out: _Layout, g: str, h: str, suffix: str) -> None:
    shape = out.src.shape(g)  # (E, D, F), or (E, D) for the bias
    if suffix == "weight" and out.to is None and out.src.kind(g) == "MXFP4":
        _gpt_oss_mxfp4(out, h, "down_proj", [g])
        return
    if suffix == "weight" and _gpt_oss_rows(out, h, "down_proj", [g]):
        return
    if suffix == "weight":
        out.add(h + "mlp.experts.down_proj", [g], (shape[0], shape[2], shape[1]), lambda a: a.swapaxes(1, 2),
                stacked=True)
    else:
        out.add(h + "mlp.experts.down_proj_bias", [g], shape, lambda a: a, stacked=True)


# -- the checkpoint ------------------------------------------------------------------------------------


_SAID: set[tuple[str, str]] = set()  # (file, what) `open_gguf` spoke of: a command opens a file more than once


def _say_once(path: str, what: str) -> bool:
    key = (os.path.abspath(path), what)
    if key in _SAID:
        return False
    _SAID.add(key)
    return True


@dataclass(kw_only=True)
class GGUFModel:
    """What a GGUF file gives the importer (`hf_convert.open_checkpoint` makes its Checkpoint of it)."""

    config: dict
    tensors: dict[str, GGUFRef]
    side_data: dict[str, bytes]  # config.json and the tokenizer files
    quant: dict[str, dict]  # the manifest `quant` of the expert rows kept as blocks
    skipped: dict | None  # layers left out
    source: dict  # {"format": "gguf", "file", "types"}


def open_gguf(path: str, *, dtype: str = "keep", check: Callable[[dict], None] | None = None) -> GGUFModel:
    """The GGUF file at `path` (or the split file it is a part of) as a HuggingFace checkpoint: the config,
    the tensors under their HuggingFace names, the tokenizer files; nothing is read but headers and metadata.
    `dtype`: "keep" keeps F32/F16/BF16 tensors as they are and quantized experts as their blocks, and
    widens other quantized tensors to bfloat16; float32/bfloat16/float16 cast every tensor to it. `check`
    sees the config before the tensors are laid out."""
    src = _Source(path)
    config, layers = _config(src)
    if check is not None:
        check(config)
    to = cast_dtype(dtype)
    layout = _tensors(src, config, layers, dtype_name(to) if to is not None else None)
    refs = layout.refs
    kept = sorted({q.get("ggml_type") or "MXFP4" for q in layout.quant.values() if "scheme" in q})
    wide = sorted(layout.widened)
    if (kept or wide) and _say_once(path, "decoded"):
        said = [f"{', '.join(kept)} weights kept as their blocks (the kernels compute on them)"] if kept else []
        if wide:
            said.append(f"{', '.join(wide)} tensors {'also ' if kept else ''}decoded and stored as "
                        f"{dtype_name(to) if to is not None else 'BF16'}")
        print(f"semoe: {os.path.basename(path)}: {'; '.join(said)}", file=sys.stderr)
    extra = sorted({int(m.group(1)) for n in src.tensors if (m := re.match(r"^blk\.(\d+)\.", n))
                    and int(m.group(1)) >= layers})
    skipped = None
    if extra:
        names = [n for n in src.tensors if _past(n, layers)]
        skipped = {"reason": "multi-token prediction layers (not read from GGUF yet)", "layers": extra,
                   "tensors": len(names), "bytes": sum(int(src.tensors[n][0].n_bytes) for n in names)}
        if _say_once(path, "mtp"):
            print(f"semoe: {os.path.basename(path)}: multi-token prediction layer(s) {extra} left out "
                  "(not read from GGUF files yet)", file=sys.stderr)
    side = {"config.json": (json.dumps(config, indent=2) + "\n").encode(), **gguf_tokenizer_files(path)}
    return GGUFModel(config=config, tensors=refs, side_data=side, quant=layout.quant, skipped=skipped,
                     source={"format": "gguf", "file": os.path.basename(path),
                             "types": sorted({src.kind(n) for n in src.tensors})})
