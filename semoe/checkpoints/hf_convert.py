"""HuggingFace safetensors checkpoints into a store and back, streaming tensor by tensor.

The model-type knowledge (supported types, expert tensor names) lives here, beside the model, not in
`storage/`, which only moves bytes.

Expert tensors are recognised by name: Mixtral (`block_sparse_moe.experts.N.w1|w2|w3`), Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V2/V3 and GLM-4.5 (`mlp.experts.N.*`), and fused 3-D tensors holding every
expert of a layer (gpt-oss's `experts.gate_up_proj`, `experts.down_proj`, ...), which are split into
one slice per expert. Everything else (shared experts included) is dense.

Quantized checkpoints (DeepSeek-V3's FP8 block-scale, gpt-oss's MXFP4) are imported as they ship:
codes and scales byte for byte, the codes' entries carrying a `storage.quant.QuantSpec`, so experts
stay compact from SSD to compute and export gives back the original bytes. Loading such a store
dequantizes its dense weights only. `open_checkpoint(dequantize=True)` reads them as plain tensors
instead (loading a model straight from a checkpoint directory).
Multi-token-prediction layers (DeepSeek-V3/V3.2, GLM-4.5/5: layers past `num_hidden_layers`; Qwen3-Next's
and Qwen3.5's `mtp.*`: `MTP_KEPT`) are kept by default, for drafting (`inference.torch_free.mtp`): their
experts are chunks of layer `num_hidden_layers` + i, their other tensors dense under their own names, and
the manifest's `mtp` records them. `mtp=False` leaves them out, as other model types' (MiniMax-M2's,
DeepSeek-V4's) are (the manifest's `skipped` says so).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from storage import compressed_tensors
from semoe.checkpoints.hf_config import from_hf_config
from semoe.model.hf_names import ALIASES, SUPPORTED_MODEL_TYPES, TEXT_MODELS, model_type_of, text_config_of
from storage.dequant import DequantizedRef, QuantScheme, pair_quantized, quant_scheme
from storage.quant import QuantSpec, dequantize, has_scales
from storage.dtypes import cast_dtype, dtype_name, torch_dtype
from storage.durable import undo_create
from storage.gguf_parts import is_gguf
from storage.errors import BadInputError
from storage.manifest import TensorEntry
from storage.safetensors_io import OutTensor, TensorRef, read_header, write_file
from storage.layout import chunk_layout
from storage.store import ExpertTensor, Store

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_MULTIMODAL_KEYS = ("vision_config", "audio_config", "text_config")
_INDEXER_KEYS = ("index_topk", "index_n_heads", "index_head_dim")  # DeepSeek sparse attention's indexer
_DSA_TYPES = ("deepseek_v32", "glm_moe_dsa", "deepseek_v4")  # the model types that have one
_LAYER_RE = re.compile(r"^(?:.*?\.)?layers\.(\d+)\.")  # the first layers.N of a name
MTP_REASON = "multi-token prediction layers"
# the model types whose multi-token-prediction layers import keeps (their layout known: a decoder layer of the
# model's kind with its input norms and projection); MiniMax-M2's modules and DeepSeek-V4's are left out
MTP_KEPT = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe_text")
_MTP_PREFIX = "mtp."  # where Qwen3-Next and Qwen3.5 keep theirs
_EXPERT_RE = re.compile(r"^.*\.layers\.(\d+)\.(?:block_sparse_moe|mlp|feed_forward|ffn)\.experts\.(\d+)\.(.+)$")
_FUSED_RE = re.compile(r"^.*\.layers\.(\d+)\.(?:block_sparse_moe|mlp|feed_forward|ffn)\.experts\.([A-Za-z0-9_]+)$")
_NUM_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

Progress = Callable[[int], None]
Ref = TensorRef | DequantizedRef  # a tensor as it is read: straight from a file, or dequantized


@dataclass(kw_only=True)
class ExpertPart:
    """One tensor of one expert: a whole per-expert tensor, or slice `expert` of a fused one."""

    ref: Ref
    stacked: bool

    def slice_shape(self) -> tuple[int, ...]:
        return self.ref.shape[1:] if self.stacked else self.ref.shape

    def slice_bytes(self) -> int:
        return self.ref.nbytes // self.ref.shape[0] if self.stacked else self.ref.nbytes


@dataclass(kw_only=True)
class Checkpoint:
    """A checked HuggingFace checkpoint directory: its config, the tensors to import and side files.

    `config` is the config.json to keep: without quantization_config when `dequantized` is set.
    `quant` gives the manifest `quant` entry of each stored codes and scales tensor of a quantized
    checkpoint imported compact.
    """

    path: str
    config: dict
    tensors: dict[str, Ref]
    file_metadata: dict[str, dict[str, str]]
    side_files: list[str]
    dense: list[str] = field(default_factory=list)
    experts: dict[int, dict[int, list[ExpertPart]]] = field(default_factory=dict)  # layer -> expert -> parts
    dequantized: dict | None = None  # {"format", "to", "tensors"} when quantized tensors are read dequantized
    quantization: dict | None = None  # {"format", "tensors", "source"} when they are kept compact
    quant: dict[str, dict] = field(default_factory=dict)
    skipped: dict | None = None  # {"reason", "layers", "tensors", "bytes"} for layers left out
    mtp: dict | None = None  # {"layers", "tensors", "bytes"} of the multi-token-prediction layers kept
    side_data: dict[str, bytes] = field(default_factory=dict)  # side files made here (a GGUF's config, tokenizer)
    source: dict | None = None  # {"format": "gguf", "file", "types"} where it is not a HuggingFace directory

    @property
    def model_type(self) -> str:
        return model_type_of(self.config)


def check_supported(config: dict, source: str) -> None:
    """Refuse, in one line naming `source`, a config whose model the store and the models here cannot hold."""
    if not isinstance(config, dict):
        raise BadInputError(f"{source}: not a JSON object")
    model_type = config.get("model_type")
    archs = [str(a) for a in config.get("architectures") or []]
    why = next((k for k in _MULTIMODAL_KEYS if k in config), None) or next(
        (f"architecture {a}" for a in archs if "ForConditionalGeneration" in a), None)
    if why and model_type not in TEXT_MODELS:  # where semoe knows the text model, it runs that
        raise BadInputError(f"{source}: multimodal checkpoint ({why}) is not supported: multimodal towers are not "
                            f"implemented")
    why = next((f"{k}={config[k]!r}" for k in _INDEXER_KEYS if k in text_config_of(config)), None)
    if why and model_type_of(config) not in _DSA_TYPES:
        raise BadInputError(f"{source}: sparse-attention indexer ({why}) in a {model_type} config is not supported: "
                            f"DeepSeek sparse attention is taken for model types {', '.join(_DSA_TYPES)}")
    if model_type_of(config) not in SUPPORTED_MODEL_TYPES:
        alias = ALIASES.get(model_type)
        hint = f" ({model_type} is supported with architectures {[alias[0]]})" if alias else ""
        raise BadInputError(f"{source}: unknown architecture model_type={model_type!r}{hint}; supported: "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    quant_scheme(_with_quantization(config), source)
    try:  # a config the model cannot be built from is refused before anything is read or written
        from_hf_config(config)
    except ValueError as e:
        raise BadInputError(f"{source}: {str(e).removeprefix('config.json: ')}") from None
    except (KeyError, TypeError) as e:  # a builder's field read as the published configs have it
        raise BadInputError(f"{source}: field {e} is missing or not of the published type") from None


def _with_quantization(config: dict) -> dict:
    """`config` with the quantization_config of its text model where a multimodal checkpoint gives it
    there rather than at the top."""
    if "quantization_config" in config or not isinstance(text_config_of(config).get("quantization_config"), dict):
        return config
    return {**config, "quantization_config": text_config_of(config)["quantization_config"]}


def open_checkpoint(path: str, *, dtype: str = "keep", dequantize: bool = False, mtp: bool = True) -> Checkpoint:
    """Read and check a checkpoint directory's headers; no tensor data is read.

    Quantized tensors are kept as stored, each codes tensor with its spec (logical dtype `dtype`;
    "keep" gives bfloat16); with `dequantize`, read dequantized to that dtype instead. `mtp`: keep the
    multi-token-prediction layers (else they are left out).
    """
    if is_gguf(path):
        return _gguf_checkpoint(path, dtype)
    if not os.path.isdir(path):
        raise BadInputError(f"{path}: not a directory (a HuggingFace checkpoint) or a .gguf file")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise BadInputError(f"{cfg_path}: missing (a HuggingFace checkpoint needs its config.json)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInputError(f"{cfg_path}: not valid JSON ({e})") from None
    check_supported(config, cfg_path)
    files = _weight_files(path)
    tensors: dict[str, TensorRef] = {}
    metadata: dict[str, dict[str, str]] = {}
    for name in files:
        refs, meta = read_header(os.path.join(path, name))
        metadata[name] = meta
        for k, ref in refs.items():
            if k in tensors:
                raise BadInputError(f"{ref.path}: tensor {k} also appears in {tensors[k].path}")
            tensors[k] = ref
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        for k, fname in weight_map.items():
            if k not in tensors or os.path.basename(tensors[k].path) != fname:
                raise BadInputError(f"{os.path.join(path, fname)}: tensor {k} listed in {INDEX_FILE} is missing")
    weights = set(files) | {INDEX_FILE}
    side = sorted(n for n in os.listdir(path)
                  if n not in weights and not n.startswith(".") and os.path.isfile(os.path.join(path, n))
                  and not n.endswith((".bin", ".pt", ".pth", ".safetensors")))
    if model_type_of(config) == "deepseek_v4" and "embed.weight" in tensors:
        raise BadInputError(f"{path}: tensor embed.weight: DeepSeek-V4's release names (embed.weight, layers.N.attn...) "
                            "are not read yet, only those transformers writes (model.embed_tokens.weight, "
                            "model.layers.N.attn...): load it with transformers and save_pretrained a copy")
    mtp = mtp and model_type_of(config) in MTP_KEPT
    tensors, extra = _extra_layers(tensors, text_config_of(config), cfg_path, keep=mtp)
    _say_kept_towers(os.path.abspath(path), tensors, config)
    ck = Checkpoint(path=path, config=config, tensors=tensors, file_metadata=metadata, side_files=side,
                    skipped=None if mtp else extra, mtp=extra if mtp else None)
    scheme = quant_scheme(_with_quantization(config), cfg_path)
    if scheme is not None:
        to = cast_dtype(dtype) or torch.bfloat16
        packed = scheme.method == compressed_tensors.METHOD
        if packed and not dequantize:  # kept as semoe's int4, repacked (the same numbers), each weight checked
            ck.tensors, ck.quant = compressed_tensors.kept_compact(tensors, scheme, to)
        else:  # checks every codes tensor against its scales
            paired = compressed_tensors.pair(tensors, scheme, to) if packed else pair_quantized(tensors, scheme, to)
        if dequantize:
            ck.tensors = paired
            ck.config = {k: v for k, v in config.items() if k != "quantization_config"}
            ck.dequantized = {"format": scheme.name, "to": str(to).removeprefix("torch."),
                              "tensors": sum(isinstance(r, DequantizedRef) for r in ck.tensors.values())}
        else:
            if not packed:
                ck.quant = _quant_entries(paired, scheme, to)
            ck.quantization = {"format": scheme.name, "source": "checkpoint",
                               "tensors": sum("scheme" in q for q in ck.quant.values())}
    classify(ck)
    return ck


def _gguf_checkpoint(path: str, dtype: str) -> Checkpoint:
    """A GGUF file as the checkpoint it was converted from (`gguf_import.open_gguf`)."""
    from semoe.checkpoints.gguf_import import HF_FILE, open_gguf

    g = open_gguf(path, dtype=dtype, check=lambda config: check_supported(config, path))
    ck = Checkpoint(path=path, config=g.config, tensors=g.tensors, file_metadata={HF_FILE: {"format": "pt"}},
                    side_files=[], side_data=g.side_data, skipped=g.skipped, quant=g.quant, source=g.source,
                    quantization={"format": "gguf", "source": "checkpoint", "tensors": sum("scheme" in q for q in g.quant.values())} if g.quant else None)
    classify(ck)
    return ck


def _quant_entries(paired: dict[str, TensorRef | DequantizedRef], scheme: QuantScheme, to: torch.dtype
                   ) -> dict[str, dict]:
    """The manifest `quant` of each codes and scales tensor of a quantized checkpoint kept compact;
    a fused (E, ...) tensor's spec describes one expert's slice."""
    out = {}
    for ref in paired.values():
        if not isinstance(ref, DequantizedRef):
            continue
        codes, scales = ref.parts
        shape = ref.shape[-2:]
        spec = QuantSpec(scheme=scheme.method, dtype=dtype_name(to), shape=shape, scales=scales.name,
                         transposed=scheme.method == "mxfp4", block=scheme.block)
        out[codes.name] = spec.to_json()
        out[scales.name] = {"scales_of": codes.name}
    return out


_TOWERS_SAID: set[str] = set()  # the checkpoints `_say_kept_towers` spoke of (a command opens one more than once)


def _say_kept_towers(path: str, tensors: dict[str, TensorRef], config: dict) -> None:
    """One line on stderr, once a process, where a multimodal checkpoint's tensors outside its text
    model (a vision tower, a projector) stay in the store as they are: semoe runs the text model,
    export writes them back."""
    wrapped = TEXT_MODELS.get(str(config.get("model_type", "")))
    if wrapped is None or path in _TOWERS_SAID:
        return
    _TOWERS_SAID.add(path)
    outside = [n for n in tensors if not n.startswith(wrapped[1]) and n != "lm_head.weight"]  # (Qwen3.5's head)
    if outside:
        depth = wrapped[1].count(".")  # named as deep as the text model's prefix: Qwen3.5's model.visual
        tops = sorted({".".join(n.split(".")[:depth]) for n in outside})
        log.warning("%s: %d tensors outside the text model (%s) are kept in the store as they are; semoe runs "
                    "the text model", config["model_type"], len(outside), ", ".join(tops))


def mtp_count(config: dict) -> int:
    """How many multi-token-prediction layers a (text) config declares: DeepSeek's and GLM's
    `num_nextn_predict_layers`, MiniMax-M2's `num_mtp_modules` where `use_mtp`, Qwen3-Next's and Qwen3.5's
    `mtp_num_hidden_layers`; 0 where none."""
    return int(config.get("num_nextn_predict_layers") or (config.get("num_mtp_modules") if config.get("use_mtp")
                                                          else 0) or config.get("mtp_num_hidden_layers") or 0)


def tensor_layer(name: str, n: int) -> int:
    """The layer a tensor belongs to (-1: none), where the model has `n` layers: the first layers.N of its
    name, or for Qwen3-Next's and Qwen3.5's `mtp.*` (their multi-token-prediction module, named apart) n + its
    own layer (n where it has none)."""
    m = _LAYER_RE.match(name)
    if name.startswith(_MTP_PREFIX):
        return n + (int(m.group(1)) if m else 0)
    return int(m.group(1)) if m else -1


def _extra_layers(tensors: dict[str, TensorRef], config: dict, source: str,
                  keep: bool) -> tuple[dict[str, TensorRef], dict | None]:
    """The multi-token-prediction layers past `num_hidden_layers`: kept (`keep`) or left out, and what
    they hold ({"layers", "tensors", "bytes"}, with "reason" where left out); any other layer past them is
    an error."""
    n = config.get("num_hidden_layers")
    if not isinstance(n, int):
        return tensors, None
    mtp = mtp_count(config)
    kept: dict[str, TensorRef] = {}
    layers: set[int] = set()
    count = nbytes = 0
    for name, ref in tensors.items():
        layer = tensor_layer(name, n)
        if name.startswith(_MTP_PREFIX):
            mtp = max(mtp, layer - n + 1)
        if layer < n:
            kept[name] = ref
            continue
        if layer >= n + mtp:
            raise BadInputError(f"{ref.path}: tensor {name} is in layer {layer}, but {source} has "
                                f"num_hidden_layers={n} and num_nextn_predict_layers={mtp}")
        layers.add(layer)
        count += 1
        nbytes += ref.nbytes
        if keep:
            kept[name] = ref
    if not layers:
        return tensors, None
    what = {"layers": sorted(layers), "tensors": count, "bytes": nbytes}
    if keep:
        log.info("keeping %d tensors of %s %s (drafting)", count, MTP_REASON, sorted(layers))
        return kept, what
    log.info("skipping %d tensors of %s %s", count, MTP_REASON, sorted(layers))
    return kept, {"reason": MTP_REASON, **what}


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise BadInputError(f"{index}: not a valid safetensors index (needs a weight_map)") from None
        return sorted(set(weight_map.values()))
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise BadInputError(f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def classify(ck: Checkpoint) -> None:
    """Sort `ck.tensors` into its experts (layer -> expert -> parts, checked complete) and dense names."""
    experts: dict[int, dict[int, list[ExpertPart]]] = defaultdict(lambda: defaultdict(list))
    text = text_config_of(ck.config)
    n = text.get("num_hidden_layers") if isinstance(text.get("num_hidden_layers"), int) else 0
    for name, ref in ck.tensors.items():
        m = _EXPERT_RE.match(name)
        if m:
            experts[tensor_layer(name, n)][int(m.group(2))].append(ExpertPart(ref=ref, stacked=False))
            continue
        m = _FUSED_RE.match(name)
        if m and len(ref.shape) >= 2:
            for e in range(ref.shape[0]):
                experts[tensor_layer(name, n)][e].append(ExpertPart(ref=ref, stacked=True))
            continue
        ck.dense.append(name)
    want = next((int(text[k]) for k in _NUM_EXPERT_KEYS if isinstance(text.get(k), int)), None)
    for layer, by_expert in experts.items():
        n = max(by_expert) + 1
        if want is not None and n != want:
            raise BadInputError(f"{ck.path}: layer {layer} has {n} experts, config.json says {want}")
        e0 = min(by_expert)
        first = _signature(by_expert[e0])
        for e in range(n):
            if e not in by_expert:
                raise BadInputError(f"{ck.path}: expert {e} of layer {layer} has no tensors")
            have = {_role(p.ref.name) for p in by_expert[e]}
            for p in by_expert[e0]:
                if _role(p.ref.name) not in have:
                    name = p.ref.name.replace(f".experts.{e0}.", f".experts.{e}.")
                    raise BadInputError(f"{ck.path}: tensor {name} is missing (expert {e} of layer {layer})")
            if _signature(by_expert[e]) != first:
                raise BadInputError(f"{ck.path}: expert {e} of layer {layer} has tensors of other shapes or dtypes "
                                    f"than expert {min(by_expert)}")
            by_expert[e].sort(key=lambda p: _role(p.ref.name))
    ck.experts = {layer: dict(sorted(v.items())) for layer, v in sorted(experts.items())}


def _role(name: str) -> str:
    m = _EXPERT_RE.match(name)
    return m.group(3) if m else name.rsplit(".", 1)[-1]


def _signature(parts: list[ExpertPart]) -> list[tuple]:
    return sorted((_role(p.ref.name), p.ref.dtype, p.slice_shape()) for p in parts)


def _cast(data: np.ndarray, ref_dtype: str, shape: tuple[int, ...], to: torch.dtype | None) -> tuple[np.ndarray, str]:
    """Cast floating tensors to `to` (None keeps bytes as they are)."""
    src = torch_dtype(ref_dtype)
    if to is None or not src.is_floating_point or src == to:
        return data, ref_dtype
    t = torch.from_numpy(data).view(src).view(shape).to(to)
    return t.reshape(-1).view(torch.uint8).numpy(), dtype_name(to)


def import_checkpoint(src: str, dst: str, *, dtype: str = "keep", progress: Progress | None = None,
                      mtp: bool = True) -> Store:
    """Import a HuggingFace checkpoint into a new store at `dst` (absent or empty); `mtp`: with its
    multi-token-prediction layers (`open_checkpoint`'s).

    On any failure the target is removed again, so nothing half-written is left behind.
    """
    to = cast_dtype(dtype)
    ck = open_checkpoint(src, dtype=dtype, mtp=mtp)
    created = not os.path.exists(dst)
    store = Store.create(dst)
    try:
        with store.writer() as w:
            for name in ck.side_files:
                if name == "config.json" and ck.dequantized:  # the stored weights are no longer quantized
                    w.put_file(name, (json.dumps(ck.config, indent=2) + "\n").encode())
                    continue
                with open(os.path.join(src, name), "rb") as f:
                    w.put_file(name, f.read())
            for name, data in ck.side_data.items():
                w.put_file(name, data)
            for name in ck.dense:
                ref = ck.tensors[name]
                quant = ck.quant.get(name)
                data, dt = _cast(ref.read(), ref.dtype, ref.shape, None if quant else to)
                t = torch.from_numpy(data).view(torch_dtype(dt)).view(ref.shape)
                w.put_dense(name, t, hf_file=_hf_file(ref), quant=quant)
                if progress:
                    progress(ref.nbytes)
            for layer, by_expert in ck.experts.items():
                for e, parts in by_expert.items():
                    _import_expert(w, layer, e, parts, len(by_expert), to, ck.quant)
                    if progress:
                        progress(sum(p.slice_bytes() for p in parts))
            w.set_model(_model_info(ck))
            w.commit()
    except BaseException:
        undo_create(dst, created)
        raise
    return store


def _import_expert(w, layer: int, e: int, parts: list[ExpertPart], n: int, to: torch.dtype | None,
                   quant: dict[str, dict]) -> None:
    metas = []
    for p in parts:
        src_dt = torch_dtype(p.ref.dtype)
        # codes and scales are kept byte for byte
        dt = to if to is not None and src_dt.is_floating_point and p.ref.name not in quant else src_dt
        metas.append((dt, p.slice_shape()))
    offsets, size = chunk_layout(metas)
    buf = np.zeros(size, dtype=np.uint8)
    tensors = []
    for p, off, (dt, shape) in zip(parts, offsets, metas):
        nbytes = p.slice_bytes()
        start = e * nbytes if p.stacked else 0
        if dt == torch_dtype(p.ref.dtype):  # read straight into the chunk: no extra copy
            p.ref.read_into(memoryview(buf)[off:off + nbytes], offset=start, nbytes=nbytes)
        else:
            raw = np.empty(nbytes, dtype=np.uint8)
            p.ref.read_into(memoryview(raw), offset=start, nbytes=nbytes)
            data, _ = _cast(raw, p.ref.dtype, shape, dt)
            buf[off:off + data.nbytes] = data
        view = torch.from_numpy(buf[off:off + dt.itemsize * int(np.prod(shape, dtype=np.int64))]).view(dt).view(shape)
        tensors.append(ExpertTensor(name=p.ref.name, tensor=view, stacked=p.stacked,
                                    hf_file=_hf_file(p.ref), quant=quant.get(p.ref.name)))
    w.put_expert_chunk(layer, e, tensors, buf, offsets, num_experts=n)


def _hf_file(ref: Ref) -> str:
    """The safetensors file a tensor is written back to: its own, or the one a GGUF's tensors go to."""
    return getattr(ref, "hf_file", None) or os.path.basename(ref.path)


def _model_info(ck: Checkpoint) -> dict:
    order: dict[str, list[str]] = defaultdict(list)
    for name, ref in ck.tensors.items():
        order[_hf_file(ref)].append(name)
    for names in order.values():
        names.sort(key=lambda k: ck.tensors[k].start)
    index_meta = {}
    index = os.path.join(ck.path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            index_meta = json.load(f).get("metadata", {}) or {}
    arch = ck.config.get("architectures") or [None]
    info = {
        "source": "gguf" if ck.source else "huggingface",
        "architecture": arch[0],
        "model_type": ck.model_type,
        "num_layers": ck.config.get("num_hidden_layers"),
        "config": ck.config,
        "hf": {
            "sharded": os.path.isfile(index),
            "index_metadata": index_meta,
            # files left with no tensor (those of skipped layers only) are not written back by export
            "files": {f: {"metadata": ck.file_metadata.get(f, {}), "tensors": order[f]} for f in sorted(order)},
        },
    }
    if ck.dequantized:
        info["dequantized"] = ck.dequantized
    if ck.source:
        info["gguf"] = ck.source
    if ck.quantization:
        info["quantization"] = ck.quantization
    if ck.skipped:
        info["skipped"] = ck.skipped
    if ck.mtp:
        info["mtp"] = ck.mtp
    return info


def export_checkpoint(store: Store, out_dir: str, *, progress: Progress | None = None) -> int:
    """Write the store's weights back as a HuggingFace directory (absent or empty `out_dir`).

    Weights quantized here (int8, int4) are written dequantized to their source dtype, under their
    own names, without their scales: lossy. A checkpoint's own FP8/MXFP4 goes back byte for byte.
    Returns the number of weights dequantized. The files are built in a temporary sibling directory
    and renamed into place at the end.
    """
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise BadInputError(f"{out_dir}: target directory is not empty")
    m = store.manifest
    if not m.has_file("config.json"):
        raise BadInputError(f"{store.root}: store has no config.json to export (not imported from HuggingFace)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        for f in m.files:
            with open(os.path.join(tmp, f.name), "wb") as fh:
                fh.write(store.read_file(f.name))
        by_name: dict[str, list[TensorEntry]] = defaultdict(list)
        # codes whose scales are not written as a tensor of their own: quantized here (dequantized on the
        # way out), or int4 the checkpoint shipped packed (packed back, scales with them)
        folded = {t.name for t in m.tensors if _made_here(t) or (t.quant or {}).get("packing")}
        for t in m.tensors:
            if t.kind == "weight" and (t.quant or {}).get("scales_of") not in folded:
                by_name[t.name].append(t)
        hf = m.model.get("hf", {})
        files = {f: info["tensors"] for f, info in hf.get("files", {}).items()}
        placed = {n for names in files.values() for n in names}
        rest = [n for n in by_name if n not in placed]
        if rest:  # tensors the store gained after import (or a store made here): one more file
            files[f"model-extra-{m.version:08d}.safetensors" if files else "model.safetensors"] = rest
        weight_map = {}
        total = 0
        for fname, names in files.items():
            outs = [o for n in names if n in by_name for o in _out_tensors(store, n, by_name[n], progress)]
            write_file(os.path.join(tmp, fname), outs,
                       hf.get("files", {}).get(fname, {}).get("metadata") or {"format": "pt"})
            total += sum(o.nbytes for o in outs)
            weight_map.update({o.name: fname for o in outs})
        if hf.get("sharded") or len(files) > 1:
            index = {"metadata": {**hf.get("index_metadata", {}), "total_size": total},
                     "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(tmp, INDEX_FILE), "w", encoding="utf-8") as fh:
                json.dump(index, fh, indent=2)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len({t.name for t in m.tensors if _made_here(t)})


def hf_out_tensors(store: Store) -> dict[str, OutTensor]:
    """Each tensor of the HuggingFace checkpoint `export_checkpoint` writes, by name (compact weights made
    here or GGUF's blocks dequantized, a checkpoint's own formats as stored), its data read when asked."""
    m = store.manifest
    by_name: dict[str, list[TensorEntry]] = defaultdict(list)
    folded = {t.name for t in m.tensors if _made_here(t) or (t.quant or {}).get("packing")}
    for t in m.tensors:
        if t.kind == "weight" and (t.quant or {}).get("scales_of") not in folded:
            by_name[t.name].append(t)
    return {name: _out_tensor(store, name, entries, None) for name, entries in by_name.items()}


def _made_here(t: TensorEntry) -> bool:
    """Codes of a weight quantized by `semoe store quantize`, or a GGUF file's blocks: dequantized on the way
    out (not a HuggingFace checkpoint's own format)."""
    return bool(t.quant) and t.quant.get("scheme") in ("int8", "int4", "ggml") and not t.quant.get("packing")


def _out_tensors(store: Store, name: str, entries: list[TensorEntry], progress: Progress | None
                 ) -> list[OutTensor]:
    """What export writes for the store's tensor `name`: itself (dequantized where quantized here), or
    for int4 a checkpoint shipped packed, its packed codes, scales and shape."""
    first = entries[0]
    if not (first.quant or {}).get("packing"):
        return [_out_tensor(store, name, entries, progress)]
    spec = QuantSpec.from_json(first.quant)
    index = first.expert if first.stacked else None
    codes = store.read_tensor(name, "weight", stack_index=index)
    parts = compressed_tensors.export(name, codes, store.read_tensor(spec.scales, "weight", stack_index=index), spec)
    if progress:
        progress(first.bytes)
    return [OutTensor(name=n, dtype=dtype_name(t.dtype), shape=tuple(t.shape), nbytes=t.numel() * t.element_size(),
                      data=lambda t=t: t.contiguous().reshape(-1).view(torch.uint8).numpy()) for n, t in parts]


def _out_tensor(store: Store, name: str, entries: list[TensorEntry], progress: Progress | None) -> OutTensor:
    entries = sorted(entries, key=lambda t: t.expert if t.stacked else 0)
    first = entries[0]
    spec = QuantSpec.from_json(first.quant) if _made_here(first) else None
    dtype = spec.dtype if spec else first.dtype
    shape = spec.shape if spec else tuple(first.shape)
    shape = (len(entries), *shape) if first.stacked else shape
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch_dtype(dtype).itemsize

    def read(t: TensorEntry) -> torch.Tensor:
        index = t.expert if t.stacked else None
        codes = store.read_tensor(name, "weight", stack_index=index)
        if spec is None:
            return codes
        scales = store.read_tensor(spec.scales, "weight", stack_index=index) if has_scales(spec) else codes[:0]
        return dequantize(codes, scales, spec)

    def data() -> np.ndarray:
        parts = [read(t) for t in entries]
        out = torch.stack(parts) if first.stacked else parts[0]
        if progress:
            progress(sum(t.bytes for t in entries))
        return out.contiguous().reshape(-1).view(torch.uint8).numpy()

    return OutTensor(name=name, dtype=dtype, shape=shape, nbytes=nbytes, data=data)
