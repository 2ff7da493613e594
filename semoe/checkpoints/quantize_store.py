"""`semoe store quantize`: a store's weights made compact in a new store.

Routed experts' 2-D float weights take int8 or int4. The dense linear weights that decoding on CPU
computes in int8 beside compact experts (attention, lm_head, dense and shared feed-forwards:
`semoe.model.compact_linear.dense_linear_names`) are stored int8 too, with the quantizer the loader would
apply to their float rows, so the store holds what decoding holds (`dense="float"` copies them as
they are). Routers, norms, the token embedding, latent attention's kv_b and biases are copied as
they are. A weight whose shape the scheme cannot hold stays as it is and is listed. The layout a weight is applied in comes from the model
(`ExpertMLP.in_out`), so gpt-oss's (in, out) experts get one scale per output column as well.
A quantized store is for inference: export dequantizes it (lossy) and training dequantizes it.

`--kquant` (`QuantizeConfig.kquant`) is semoe's own 4-bit instead: GGUF's blocks (`storage.kquants`), fitted by
semoe's search and, with `--calibrate`, weighed by an importance matrix (`semoe.evaluation.calibrate`). Experts
take Q4_K; the dense linear weights, the lm_head and the token embedding start there too and step up
`KQUANT_LADDER` within `target_bits` a weight (`kquant_mix`). (In, out) experts (gpt-oss's) are cut into
rows of outputs all the same, as llama.cpp's converter lays them out. The kernels compute on the blocks as
stored, and `store export --format gguf` writes them as they are.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from semoe.checkpoints.hf_config import store_model_config
from semoe.model.compact_linear import dense_linear_names
from semoe.model.experts import expert_mlp
from semoe.model.hf_names import hf_name
from semoe.model.moe_gpt import MoEGPT
from storage.dtypes import dtype_name, torch_dtype
from storage.durable import undo_create
from storage.errors import BadInputError
from storage import kquants
from storage.formats import INT4_DEFAULT_GROUP, INT4_GROUP_SIZES, KQUANT_TARGET_BITS, QUANTIZE_ROWS
from storage.quant import QuantShapeError, QuantSpec, check_fits, quantize, quantize_blocks, scales_name
from storage.store import ExpertTensor, Store, iter_expert_chunks

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


# semoe's 4-bit mix (`--kquant`): every weight it types starts at Q4_K, and steps up these rungs in order while
# the whole stays within `target_bits` a weight (Q4_K_M averages some 4.9 on MoE models). The order is by KL
# bought per byte, measured kind by kind (docs/store.md, "semoe's own 4-bit"): experts hold most of a MoE
# model's bytes but each token reads only a few of them, while every token passes the dense weights, the
# lm_head and its embedding row.
KQUANT_KINDS = ("expert", "dense", "lm_head", "embedding")
KQUANT_LADDER = (("dense", "Q6_K"), ("embedding", "Q6_K"), ("lm_head", "Q6_K"), ("dense", "Q8_0"),
                 ("embedding", "Q8_0"), ("lm_head", "Q8_0"))


def kquant_mix(weights: dict[str, int], target_bits: float = KQUANT_TARGET_BITS) -> dict[str, str]:
    """The GGUF type of each kind of weight, given the weights of each kind (`KQUANT_KINDS`)."""
    mix = {k: "Q4_K" for k in weights}
    budget = target_bits * sum(weights.values())

    def bits(m: dict[str, str]) -> float:
        return sum(kquants.bits_per_weight(m[k]) * n for k, n in weights.items())

    for kind, t in KQUANT_LADDER:
        if kind in mix and kquants.bits_per_weight(t) > kquants.bits_per_weight(mix[kind]):
            trial = {**mix, kind: t}
            if bits(trial) <= budget:
                mix = trial
    return mix


@dataclass(kw_only=True)
class QuantizeConfig:
    """Which compact scheme experts get."""

    bits: int  # 8: int8 (per output row); 4: int4 (groups along the input)
    group_size: int = INT4_DEFAULT_GROUP  # int4 only
    dense: str = "int8"  # the dense linear weights: int8 (per output row), or float as they are
    # semoe's 4-bit in GGUF's blocks (`storage.kquants`): experts, dense weights and the embedding typed by
    # `kquant_mix`, fitted with `importance` where calibration text gave one
    kquant: bool = False
    importance: object | None = None  # semoe.evaluation.calibrate.Importance
    target_bits: float = KQUANT_TARGET_BITS  # kquant: bits a weight the mix stays within
    mix: dict[str, str] | None = None  # kquant: the type of each kind, instead of `kquant_mix`'s

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise BadInputError(f"--bits must be 8 or 4, got {self.bits}")
        if self.kquant and (self.bits != 4 or self.dense != "int8"):
            raise BadInputError("--kquant is a 4-bit mix of its own: it takes --bits 4 and types the dense weights "
                                "itself (leave --dense at its default)")
        if self.kquant and not 4.5 <= self.target_bits <= 8.5:
            raise BadInputError(f"--target-bits must be between 4.5 (every weight Q4_K) and 8.5 (Q8_0), "
                                f"got {self.target_bits}")
        if self.importance is not None and not self.kquant:
            raise BadInputError("--calibrate weighs the fit of --kquant's blocks; add --kquant")
        if self.dense not in ("int8", "float"):
            raise BadInputError(f"--dense must be int8 or float, got {self.dense}")
        if self.bits == 4 and self.group_size not in INT4_GROUP_SIZES:
            raise BadInputError(f"--group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                                f"got {self.group_size}")

    @property
    def scheme(self) -> str:
        return "ggml" if self.kquant else "int8" if self.bits == 8 else "int4"

    @property
    def name(self) -> str:
        """As recorded in the store: int8, int4-g128, or k4 (k4-imatrix when calibrated)."""
        if self.kquant:
            return "k4-imatrix" if self.importance is not None else "k4"
        return "int8" if self.bits == 8 else f"int4-g{self.group_size}"


@dataclass(kw_only=True)
class QuantizeReport:
    """What `quantize_store` did."""

    scheme: str
    quantized: int = 0  # expert weights made compact
    dense_quantized: int = 0  # dense weights made int8
    dense_bytes_before: int = 0  # bytes of those dense weights as they were
    dense_bytes_after: int = 0  # and as int8 codes and scales
    bytes_before: int = 0  # expert chunk bytes of the source
    bytes_after: int = 0
    kept: dict[str, str] = field(default_factory=dict)  # weight name -> why it stays as it is

    def to_json(self) -> dict:
        return {"scheme": self.scheme, "quantized": self.quantized, "expert_bytes_before": self.bytes_before,
                "expert_bytes_after": self.bytes_after, "dense_quantized": self.dense_quantized,
                "dense_bytes_before": self.dense_bytes_before, "dense_bytes_after": self.dense_bytes_after,
                "kept": self.kept}


def _ggml(t: torch.Tensor, name: str, ggml_type: str, importance: torch.Tensor | None, kept: dict[str, str],
          transposed: bool = False) -> tuple[torch.Tensor, dict] | None:
    """An (O, I) float weight as GGUF blocks of `ggml_type` fitted by `storage.kquants` (codes, quant), or
    None where its rows do not cut into whole blocks (listed in `kept`). `transposed`: `t` is the (I, O)
    weight of an (in, out) expert (gpt-oss, Llama-4), made out-major rows all the same."""
    logical = tuple(t.shape)
    if transposed:
        t = t.T.contiguous()
    if not kquants.fits(ggml_type, tuple(t.shape)) and kquants.fits("Q8_0", tuple(t.shape)):
        ggml_type = "Q8_0"  # rows that do not cut into super-blocks of 256: blocks of 32
    if not kquants.fits(ggml_type, tuple(t.shape)):
        kept[name] = (f"{ggml_type} takes rows of a multiple of {kquants.BLOCK_WEIGHTS[ggml_type]} weights, "
                      f"shape {list(logical)}")
        return None
    if importance is not None and importance.shape != (t.shape[1],):
        raise BadInputError(f"{name}: calibration gave {list(importance.shape)} column importances for a weight "
                            f"of shape {list(t.shape)}")
    codes = kquants.quantize_rows(t, ggml_type, importance)
    spec = QuantSpec(scheme="ggml", dtype=dtype_name(t.dtype), shape=logical, scales="", ggml_type=ggml_type,
                     transposed=transposed)
    return codes, spec.to_json()


def quantize_expert(tensors: dict[str, torch.Tensor], stacked: dict[str, bool], cfg: QuantizeConfig, *,
                    in_out: bool, kept: dict[str, str],
                    importance: Callable[[str], torch.Tensor | None] | None = None,
                    ggml_type: str = "Q4_K") -> list[ExpertTensor]:
    """One expert's tensors with its 2-D float weights made compact (codes, then scales); the
    weights that do not fit go to `kept` with the reason. `--kquant`: the weights as blocks of
    `ggml_type`, fitted with `importance(name)`, a weight's column importances (None: unweighted)."""
    out = []
    for name, t in tensors.items():
        q = None
        if t.dim() == 2 and t.dtype.is_floating_point and cfg.kquant:
            got = _ggml(t, name, ggml_type, importance(name) if importance else None, kept, in_out)
            if got is not None:
                out.append(ExpertTensor(name=name, tensor=got[0], stacked=stacked[name], quant=got[1]))
                continue
        elif t.dim() == 2 and t.dtype.is_floating_point:
            try:
                check_fits(tuple(t.shape), t.dtype, cfg.scheme, cfg.group_size, in_out)
                q = quantize(t, cfg.scheme, group_size=cfg.group_size, transposed=in_out)
            except QuantShapeError as e:
                kept[name] = str(e)
        if q is None:
            out.append(ExpertTensor(name=name, tensor=t, stacked=stacked[name]))
            continue
        codes, scales = q
        spec = QuantSpec(scheme=cfg.scheme, dtype=dtype_name(t.dtype), shape=tuple(t.shape),
                         scales=scales_name(name, cfg.scheme), transposed=in_out,
                         group_size=cfg.group_size if cfg.bits == 4 else None)
        out.append(ExpertTensor(name=name, tensor=codes, stacked=stacked[name], quant=spec.to_json()))
        out.append(ExpertTensor(name=spec.scales, tensor=scales, stacked=stacked[name],
                                quant={"scales_of": name}))
    return out


def dense_int8_names(config) -> set[str]:
    """The stored names of the dense weights `semoe.model.compact_linear.compact_dense_linears` makes int8
    on CPU (an lm_head tied to the embedding is the embedding's, which stays float)."""
    with torch.device("meta"):
        model = MoEGPT(config)
    return {hf_name(config, f"{name}.weight") for name in dense_linear_names(model)
            if not (config.tie_embeddings and name == "lm_head")}


def _dense_int8(source: Store, t, report: QuantizeReport) -> list[tuple[str, torch.Tensor, dict]] | None:
    """A float dense weight as int8 codes and scales (name, tensor, quant) to store, quantized as the
    loader would (`quantize_blocks` over float32 rows, read a block at a time), or None where int8
    cannot hold it (it is then listed in the report)."""
    try:
        check_fits(tuple(t.shape), torch_dtype(t.dtype), "int8")
    except QuantShapeError as e:
        report.kept[t.name] = str(e)
        return None
    codes, scales = quantize_blocks(source.read_dense_rows(t.name, QUANTIZE_ROWS), tuple(t.shape), torch.float32,
                                    "int8")
    spec = QuantSpec(scheme="int8", dtype=t.dtype, shape=tuple(t.shape), scales=scales_name(t.name, "int8"))
    report.dense_quantized += 1
    report.dense_bytes_before += t.bytes
    report.dense_bytes_after += codes.numel() + scales.numel() * scales.element_size()
    return [(t.name, codes, spec.to_json()), (spec.scales, scales, {"scales_of": t.name})]


def _kquant_kinds(config, dense_names: set[str]) -> dict[str, str]:
    """Stored name -> its kind in `KQUANT_KINDS`, for the dense weights `--kquant` types."""
    kinds = {n: "dense" for n in dense_names}
    head = hf_name(config, "lm_head.weight")
    if head in kinds:
        kinds[head] = "lm_head"
    # a tied embedding is the lm_head too: the head's type
    kinds[hf_name(config, "embed.weight")] = "lm_head" if config.tie_embeddings else "embedding"
    return kinds


def _kind_weights(m, kinds: dict[str, str]) -> dict[str, int]:
    """Weights of each kind `--kquant` types: the experts' 2-D float weights and the dense ones of `kinds`."""
    out = {"expert": 0}
    for t in m.tensors:
        if t.kind == "weight" and len(t.shape) == 2 and not t.quant and torch_dtype(t.dtype).is_floating_point:
            kind = "expert" if t.group == "expert" else kinds.get(t.name)
            if kind:
                out[kind] = out.get(kind, 0) + t.shape[0] * t.shape[1]
    return out


def _dense_kquant(source: Store, t, ggml_type: str, importance, report: QuantizeReport
                  ) -> list[tuple[str, torch.Tensor, dict]] | None:
    """A float dense weight as GGUF blocks (name, codes, quant), or None where they cannot hold it."""
    if len(t.shape) != 2 or not torch_dtype(t.dtype).is_floating_point:
        return None
    got = _ggml(source.read_tensor(t.name), t.name, ggml_type,
                None if importance is None else importance.dense.get(t.name), report.kept)
    if got is None:
        return None
    report.dense_quantized += 1
    report.dense_bytes_before += t.bytes
    report.dense_bytes_after += got[0].numel()
    return [(t.name, got[0], got[1])]


def quantize_store(src: str, dst: str, cfg: QuantizeConfig, *, progress: Progress | None = None) -> QuantizeReport:
    """Write a copy of store `src` at `dst` (absent or empty) with compact experts (and, unless
    `cfg.dense` is float, int8 dense weights). A store whose experts are already in `cfg`'s format
    (one quantized before dense weights were) gets its float dense weights made compact, its experts
    copied as they are.

    On any failure `dst` is removed again (or left empty), so nothing half-written stays behind."""
    source = Store.open(src)
    m = source.manifest
    config = store_model_config(source, src)
    was = (m.model.get("quantization") or {}).get("format", "compact")
    copy_experts = source.is_compact() and was == cfg.name
    if source.is_compact() and not copy_experts:
        raise BadInputError(f"{src}: its experts are already quantized ({was}); quantize a float store")
    mlp = expert_mlp(config)
    in_out = mlp.in_out
    dense_names = dense_int8_names(config) if cfg.dense == "int8" else set()
    kinds = _kquant_kinds(config, dense_names) if cfg.kquant else {}
    parts = mlp.names(config, "")
    mix = cfg.mix or (kquant_mix(_kind_weights(m, kinds), cfg.target_bits) if cfg.kquant else {})
    report = QuantizeReport(scheme=cfg.name)
    created = not os.path.exists(dst)
    out = Store.create(dst)
    try:
        with out.writer() as w:
            for f in m.files:
                w.put_file(f.name, source.read_file(f.name))
            for t in m.dense():
                if t.quant is not None:
                    made = None
                elif t.name in kinds:
                    made = _dense_kquant(source, t, mix[kinds[t.name]], cfg.importance, report)
                elif t.name in dense_names and not cfg.kquant:
                    made = _dense_int8(source, t, report)
                else:
                    made = None
                for name, tensor, quant in made or [(t.name, source.read_tensor(t.name), t.quant)]:
                    w.put_dense(name, tensor, hf_file=t.hf_file, quant=quant)
                if progress:
                    progress(t.bytes)
            layers = m.expert_layers()
            for chunk in iter_expert_chunks(m):
                entries = m.chunk_tensors(chunk)
                views = source.read_expert(chunk.layer, chunk.expert)
                if copy_experts:
                    expert = [ExpertTensor(name=e.name, tensor=views[e.name], stacked=e.stacked, quant=e.quant)
                              for e in entries]
                else:
                    def importance(name: str, chunk=chunk) -> torch.Tensor | None:
                        if cfg.importance is None:
                            return None
                        part = next(i for i, p in enumerate(parts) if name == p or name.endswith("." + p))
                        return cfg.importance.expert(chunk.layer, chunk.expert, part)

                    expert = quantize_expert({e.name: views[e.name] for e in entries},
                                             {e.name: e.stacked for e in entries}, cfg, in_out=in_out,
                                             kept=report.kept, importance=importance, ggml_type=mix.get("expert"))
                hf_files = {e.name: e.hf_file for e in entries}
                for t in expert:
                    t.hf_file = hf_files.get(t.name) or hf_files.get(t.quant.get("scales_of") if t.quant else None)
                w.put_expert(chunk.layer, chunk.expert, expert, num_experts=layers[chunk.layer])
                report.quantized += sum(1 for t in expert if t.quant and "scheme" in t.quant)
                report.bytes_before += chunk.bytes
                report.bytes_after += w.manifest.chunk(chunk.layer, chunk.expert).bytes
                if progress:
                    progress(sum(e.bytes for e in entries))
            quantization = {"format": cfg.name, "source": "semoe store quantize", "tensors": report.quantized,
                            "dense": "k4" if cfg.kquant else cfg.dense, "dense_tensors": report.dense_quantized,
                            "kept": sorted(report.kept)}
            if cfg.kquant:
                quantization["mix"] = mix
                quantization["target_bits"] = cfg.target_bits
                if cfg.importance is not None:
                    quantization["calibration"] = {"tokens": cfg.importance.tokens,
                                                   "experts_unreached": cfg.importance.unreached}
            if copy_experts:
                before = m.model["quantization"]
                quantization.update(tensors=before.get("tensors"), kept=sorted({*before.get("kept", []), *report.kept}))
            w.set_model({**m.model, "quantization": quantization})
            w.commit()
    except BaseException:
        undo_create(dst, created)
        raise
    if report.kept:
        log.warning("%d weights do not fit %s and stay as they are (first: %s: %s)", len(report.kept), cfg.name,
                    *next(iter(report.kept.items())))
    return report
