"""Where an expert's tensors lie in its chunk, where they go in compute memory, and the weights on them.

One expert's chunk holds its tensors back to back; a compact weight is two of them (codes and
scales, `storage.quant`). The same three steps serve every holder of experts, so an offloaded model
and a resident one built from the same store compute on the same bytes with the same kernels:

1. `expert_layouts`: each expert's parts (plain tensor, or codes + scales) found once by name;
2. `place`: where each tensor goes in one uint8 buffer of compute memory: plain floating tensors
   in the compute dtype, codes and scales as stored (never widened);
3. `expert_weights`: the `ExpertWeights` as views of such a buffer (or of the chunk itself when
   nothing needs casting).

`PackedExperts` is the resident holder: every expert of a layer in its placed form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from semoe.model.compact_linear import CompactWeight
from semoe.model.config import MoEConfig
from semoe.model.hf_names import layer_prefix, moe_prefix
from semoe.model.experts import ExpertMLP, ExpertWeights, expert_mlp
from storage.dtypes import torch_dtype
from storage.keys import ExpertKey
from storage.manifest import Manifest
from storage.quant import MXFP4_BLOCKS, QuantSpec, has_scales

ALIGN = 64  # bytes between tensors placed in one buffer


@dataclass(frozen=True)
class TensorSlice:
    """Where one tensor lies in a uint8 buffer: byte offset, size, dtype, shape."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def view(self, raw: torch.Tensor) -> torch.Tensor:
        """The tensor, as a view of a uint8 buffer."""
        return raw[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize


@dataclass(frozen=True)
class Part:
    """One tensor of an expert's MLP as computed on: plain (one slice), or compact (codes, scales)."""

    tensors: tuple[TensorSlice, ...]
    spec: QuantSpec | None = None


@dataclass(frozen=True)
class ExpertLayout:
    """An expert's parts in its MLP variant's order, and their tensors in that order, flat."""

    parts: tuple[Part, ...]

    @property
    def tensors(self) -> tuple[TensorSlice, ...]:
        return tuple(t for p in self.parts for t in p.tensors)


def hf_expert_names(config: MoEConfig, layer: int, expert: int) -> tuple[str, ...]:
    """HuggingFace names of one expert's tensors, in its MLP variant's order (for a fused
    checkpoint layout, the names of the (E, ...) tensors that hold every expert of the layer)."""
    mlp = expert_mlp(config)
    prefix = (layer_prefix(config, layer) + f"{moe_prefix(config)}.experts."
              + ("" if mlp.stacked else f"{expert}."))
    return mlp.names(config, prefix)


def chunk_layout_of(manifest: Manifest, config: MoEConfig, layer: int, expert: int, source: str) -> ExpertLayout:
    """The layout of one expert's weight chunk; KeyError names a missing tensor."""
    chunk = manifest.chunk(layer, expert)
    by_name = {e.name: e for e in manifest.chunk_tensors(chunk)}

    def piece(name: str) -> TensorSlice:
        e = by_name[name]
        return TensorSlice(e.offset, e.bytes, torch_dtype(e.dtype), tuple(e.shape))

    parts = []
    for name in hf_expert_names(config, layer, expert):
        codes = name if name in by_name else name + MXFP4_BLOCKS
        entry = by_name.get(codes)
        if entry is None:
            raise KeyError(f"store {source}: expert chunk {chunk.file} lacks {name}")
        if entry.quant is None or "scheme" not in entry.quant:
            parts.append(Part((piece(codes),)))
            continue
        spec = QuantSpec.from_json(entry.quant)
        if not has_scales(spec):  # GGUF's blocks: their scales inside
            parts.append(Part((piece(codes),), spec))
            continue
        if spec.scales not in by_name:
            raise KeyError(f"store {source}: expert chunk {chunk.file} lacks {spec.scales}, the scales of {codes}")
        parts.append(Part((piece(codes), piece(spec.scales)), spec))
    return ExpertLayout(tuple(parts))


def expert_layouts(manifest: Manifest, config: MoEConfig, source: str) -> dict[ExpertKey, ExpertLayout]:
    """Every expert's layout in its weight chunk, found once by name."""
    return {ExpertKey(c.layer, c.expert): chunk_layout_of(manifest, config, c.layer, c.expert, source)
            for c in manifest.chunks if c.kind == "weight"}


def place(layout: ExpertLayout, dtype: torch.dtype) -> tuple[tuple[TensorSlice, ...], int]:
    """Destinations of the layout's tensors (in layout order) in one buffer, plain floating tensors
    cast to `dtype`, and the buffer's size in bytes. Tensors keep their chunk's order, so
    `placed_bytes` gives the same size from the manifest alone."""
    compact = {id(t) for p in layout.parts if p.spec is not None for t in p.tensors}
    tensors = layout.tensors
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].offset)
    spots, total = _placed([(tensors[i].numel, tensors[i].dtype, id(tensors[i]) in compact) for i in order], dtype)
    out: list[TensorSlice | None] = [None] * len(tensors)
    for i, (offset, to) in zip(order, spots):
        out[i] = TensorSlice(offset, tensors[i].numel * to.itemsize, to, tensors[i].shape)
    return tuple(out), total


def placed_bytes(manifest: Manifest, dtype: torch.dtype) -> int:
    """The largest placed expert, in bytes, from the manifest alone (an entry with `quant` is compact)."""
    best = 1
    for chunk in manifest.chunks:
        if chunk.kind == "weight":
            items = [(e.bytes // torch_dtype(e.dtype).itemsize, torch_dtype(e.dtype), e.quant is not None)
                     for e in manifest.chunk_tensors(chunk)]
            best = max(best, _placed(items, dtype)[1])
    return best


def _placed(items: list[tuple[int, torch.dtype, bool]], dtype: torch.dtype
            ) -> tuple[list[tuple[int, torch.dtype]], int]:
    """(offset, dtype) of each (numel, stored dtype, compact) item packed in order, and the total."""
    out, pos = [], 0
    for numel, stored, compact in items:
        to = dtype if not compact and stored.is_floating_point else stored
        pos = -(-pos // ALIGN) * ALIGN
        out.append((pos, to))
        pos += numel * to.itemsize
    return out, max(pos, 1)


def expert_weights(raw: torch.Tensor, layout: ExpertLayout, tensors: tuple[TensorSlice, ...], mlp: ExpertMLP,
                   kernel: str = "auto") -> ExpertWeights:
    """The expert's weights as views of `raw`, whose tensors lie at `tensors` (the layout's own
    slices for a chunk, or `place`'s for a placed buffer)."""
    it = iter(tensors)
    parts = []
    for part in layout.parts:
        views = [next(it).view(raw) for _ in part.tensors]
        if part.spec is None:
            parts.append(views[0])
        else:  # GGUF's blocks hold their own scales: an empty tensor stands for the others'
            scales = views[1] if len(views) > 1 else views[0][:0]
            parts.append(CompactWeight(views[0], scales, part.spec, kernel))
    return ExpertWeights(tuple(parts), mlp)


def read_dequantized(store, config: MoEConfig, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
    """One expert's tensors in its MLP variant's order, compact ones dequantized to their logical dtype
    (training from a quantized store)."""
    layout = chunk_layout_of(store.manifest, config, layer, expert, store.root)
    raw = store.read_chunk(layer, expert)
    w = expert_weights(raw, layout, layout.tensors, expert_mlp(config))
    return tuple(p.dequantize() if isinstance(p, CompactWeight) else p for p in w.parts)


class PackedExperts:
    """A resident MoE layer whose experts are kept as the store holds them (compact ones compact),
    each in one placed buffer on the device: what an offloaded ring slot holds, for every expert."""

    def __init__(self, config: MoEConfig, buffers: dict[int, torch.Tensor], layouts: dict[int, ExpertLayout],
                 dtype: torch.dtype, kernel: str = "auto") -> None:
        self.mlp = expert_mlp(config)
        self.buffers = buffers
        self.weights = {e: expert_weights(buffers[e], layouts[e], place(layouts[e], dtype)[0], self.mlp, kernel)
                        for e in buffers}

    def expert_nbytes(self, layer: int, expert: int) -> int:
        """Bytes of one expert's placed weights."""
        return self.buffers[expert].numel()

    def stream(self, layer: int, experts: list[int], x_ND: torch.Tensor) -> Iterator[tuple[int, ExpertWeights]]:
        for e in experts:
            yield e, self.weights[e]


def packed_layer(config: MoEConfig, layer: int, raws: dict[int, torch.Tensor], layouts: dict[int, ExpertLayout],
                 *, device: torch.device | str, dtype: torch.dtype, kernel: str = "auto") -> PackedExperts:
    """A `PackedExperts` from the layer's chunks (`raws`, uint8 on the host): each placed as the
    offload ring places it, with the same copy (a cast for plain floating tensors)."""
    buffers = {}
    for e, raw in raws.items():
        dst, nbytes = place(layouts[e], dtype)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for s, d in zip(layouts[e].tensors, dst):
            d.view(buf).copy_(s.view(raw))
        buffers[e] = buf
    return PackedExperts(config, buffers, layouts, dtype, kernel)
