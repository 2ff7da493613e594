"""`semoe store quantize`: a store's weights made compact in a new store.

Routed experts' 2-D float weights take int8 or int4. The dense linear weights that decoding on CPU
computes in int8 beside compact experts (attention, lm_head, dense and shared feed-forwards:
`semoe.model.compact_linear.dense_linear_names`) are stored int8 too, with the quantizer the loader would
apply to their float rows, so the store holds what decoding holds (`dense="float"` copies them as
they are). Routers, norms, the token embedding, latent attention's kv_b and biases are copied as
they are. A weight whose shape the scheme cannot hold stays as it is and is listed. The layout a weight is applied in comes from the model
(`ExpertMLP.in_out`), so gpt-oss's (in, out) experts get one scale per output column as well.
A quantized store is for inference: export dequantizes it (lossy) and training dequantizes it.
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
from storage.formats import INT4_DEFAULT_GROUP, INT4_GROUP_SIZES, QUANTIZE_ROWS
from storage.quant import QuantShapeError, QuantSpec, check_fits, quantize, quantize_blocks, scales_name
from storage.store import ExpertTensor, Store, iter_expert_chunks

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


@dataclass(kw_only=True)
class QuantizeConfig:
    """Which compact scheme experts get."""

    bits: int  # 8: int8 (per output row); 4: int4 (groups along the input)
    group_size: int = INT4_DEFAULT_GROUP  # int4 only
    dense: str = "int8"  # the dense linear weights: int8 (per output row), or float as they are

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise BadInputError(f"--bits must be 8 or 4, got {self.bits}")
        if self.dense not in ("int8", "float"):
            raise BadInputError(f"--dense must be int8 or float, got {self.dense}")
        if self.bits == 4 and self.group_size not in INT4_GROUP_SIZES:
            raise BadInputError(f"--group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                                f"got {self.group_size}")

    @property
    def scheme(self) -> str:
        return "int8" if self.bits == 8 else "int4"

    @property
    def name(self) -> str:
        """As recorded in the store: int8, or int4-g128."""
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


def quantize_expert(tensors: dict[str, torch.Tensor], stacked: dict[str, bool], cfg: QuantizeConfig, *,
                    in_out: bool, kept: dict[str, str]) -> list[ExpertTensor]:
    """One expert's tensors with its 2-D float weights made compact (codes, then scales); the
    weights that do not fit go to `kept` with the reason."""
    out = []
    for name, t in tensors.items():
        q = None
        if t.dim() == 2 and t.dtype.is_floating_point:
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
    in_out = expert_mlp(config).in_out
    dense_names = dense_int8_names(config) if cfg.dense == "int8" else set()
    report = QuantizeReport(scheme=cfg.name)
    created = not os.path.exists(dst)
    out = Store.create(dst)
    try:
        with out.writer() as w:
            for f in m.files:
                w.put_file(f.name, source.read_file(f.name))
            for t in m.dense():
                parts = _dense_int8(source, t, report) if t.name in dense_names and t.quant is None else None
                for name, tensor, quant in parts or [(t.name, source.read_tensor(t.name), t.quant)]:
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
                    expert = quantize_expert({e.name: views[e.name] for e in entries},
                                             {e.name: e.stacked for e in entries}, cfg, in_out=in_out,
                                             kept=report.kept)
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
                            "dense": cfg.dense, "dense_tensors": report.dense_quantized, "kept": sorted(report.kept)}
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
