"""Compact weight formats kept in the store: int8, int4, and the checkpoints' own FP8 and MXFP4.

A quantized weight is two tensors of the same chunk (or dense file set): its *codes* and its
*scales*. The codes' manifest entry carries a `QuantSpec` (as a dict under `quant`): the scheme,
the weight's logical dtype and shape (what a float checkpoint would hold), and the name of its
scales; the scales' entry names the codes it scales (`{"scales_of": NAME}`). The codes always
hold an out-major matrix W (O, I), the operand of `F.linear(x, W)`; `transposed` says the logical
tensor is W.T (I, O), as in gpt-oss's fused experts.

Schemes (shape legend: O out features, I in features, g group size, G groups per row):

- `int8`: symmetric, one scale per output row. codes int8 (O, I); scales float32 (O,) = amax/127;
  w = code * scale.
- `int4`: groups of g (32-256) along the input, a scale and a zero point per group. Codes are
  packed two per byte in the layout of torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`),
  so the fast path reads them as stored: rows in blocks of 64; for each input column k, 32 bytes,
  byte j holding row j of the block in its low nibble and row 32 + j in its high one; stored
  uint8 (O, I/2). Scales and zero points float32 (I/g, O, 2): w = (code - 8) * scale + zero.
- `fp8`: DeepSeek-V3's e4m3 codes (O, I) with float32 inverse scales per (b0, b1) block, as the
  checkpoint ships them (`X.weight` beside `X.weight_scale_inv`).
- `mxfp4`: gpt-oss's blocks (O, G, 16) uint8, two e2m1 values per byte, low nibble first, 32 per
  group, with e8m0 scales (O, G) uint8; as shipped (`X_blocks` beside `X_scales`), logical (I, O).
- `ggml`: a GGUF file's quantized rows as it stores them (`ggml_type`: Q8_0, Q4_K, Q6_K, ...), uint8
  (O, bytes of a row), each row's blocks carrying their own scales: no scales tensor (`scales` "");
  `transposed` where the logical weight is (I, O) (gpt-oss's experts: rows are outputs all the same).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch

from storage.dequant import dequantize_fp8_blocks, dequantize_mxfp4
from storage.dtypes import torch_dtype
from storage.errors import BadInputError
from storage.formats import GGML_KERNEL_TYPES, INT4_GROUP_SIZES, INT8_MAX, QUANTIZE_ROWS

SCHEMES = ("int8", "int4", "fp8", "mxfp4", "ggml")
INT4_BLOCK_ROWS = 64  # rows per block of the CPU int4 kernel's packed layout
INT4_LEVELS = 15
INT4_OFFSET = 8  # the kernel computes (code - 8) * scale + zero
# the name of a quantized weight's scales, by scheme (mxfp4 codes are `X_blocks`, their scales `X_scales`)
SCALE_SUFFIX = {"int8": "_scale", "int4": "_scale_zero", "fp8": "_scale_inv"}
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"


class QuantShapeError(ValueError):
    """A weight whose shape or dtype the scheme cannot hold (it stays unquantized)."""


@dataclass(kw_only=True, frozen=True)
class QuantSpec:
    """How one weight is stored compactly; kept on its codes' manifest entry."""

    scheme: str
    dtype: str  # the logical (unquantized) dtype, safetensors spelling: F32, BF16
    shape: tuple[int, ...]  # the logical shape
    scales: str  # the name of the scales tensor
    transposed: bool = False  # the logical tensor is codes' (O, I) transposed
    group_size: int | None = None  # int4
    block: tuple[int, int] | None = None  # fp8: (rows, cols) per scale
    # int4 a checkpoint shipped packed another way (`storage.compressed_tensors`): the packing, which
    # export writes back, and the dtype the checkpoint stored the scales in
    packing: str | None = None
    packed_scales: str | None = None
    ggml_type: str | None = None  # ggml: the GGUF type of the rows' blocks

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise BadInputError(f"quantization scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if len(self.shape) != 2:
            raise BadInputError(f"a {self.scheme} weight is 2-D, got shape {list(self.shape)}")
        if self.scheme == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise BadInputError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {self.group_size!r}")
        if self.scheme == "fp8" and (self.block is None or len(self.block) != 2):
            raise BadInputError(f"fp8 needs a block of 2 sizes, got {self.block!r}")
        if self.scheme == "ggml" and (self.ggml_type not in GGML_KERNEL_TYPES or self.scales):
            raise BadInputError(f"a ggml weight needs a type of {', '.join(GGML_KERNEL_TYPES)} and no scales tensor, "
                                f"got {self.ggml_type!r}, scales {self.scales!r}")

    @property
    def out_in(self) -> tuple[int, int]:
        """(O, I) of the out-major matrix the codes hold."""
        a, b = self.shape
        return (b, a) if self.transposed else (a, b)

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None}
        d["shape"] = list(self.shape)
        if self.block is not None:
            d["block"] = list(self.block)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "QuantSpec":
        d = dict(d)
        d["shape"] = tuple(d["shape"])
        if d.get("block") is not None:
            d["block"] = tuple(d["block"])
        return cls(**d)


def scales_name(name: str, scheme: str) -> str:
    """The stored name of a weight's scales."""
    if scheme == "mxfp4":
        return name.removesuffix(MXFP4_BLOCKS) + MXFP4_SCALES
    return name + SCALE_SUFFIX[scheme]


# -- int8 / int4: quantize ---------------------------------------------------------------------


def check_fits(shape: tuple[int, ...], dtype: torch.dtype, scheme: str, group_size: int | None = None,
               transposed: bool = False) -> None:
    """Raise QuantShapeError saying why a weight of this shape and dtype cannot be stored as `scheme`."""
    if scheme not in ("int8", "int4"):
        raise BadInputError(f"only int8 and int4 are made here, got {scheme!r}")
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise QuantShapeError(f"dtype {dtype} is not a float weight")
    if len(shape) != 2:
        raise QuantShapeError(f"shape {list(shape)} is not 2-D")
    o, i = (shape[1], shape[0]) if transposed else shape
    if scheme == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise BadInputError(f"--group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                                f"got {group_size}")
        if i % group_size:
            raise QuantShapeError(f"{i} input features are not a multiple of the group size {group_size}")
        if o % INT4_BLOCK_ROWS:
            raise QuantShapeError(f"{o} output features are not a multiple of {INT4_BLOCK_ROWS} "
                                  f"(the int4 kernel's row block)")


def quantize(w: torch.Tensor, scheme: str, *, group_size: int | None = None, transposed: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a float weight, laid out as the module docstring says; `transposed`: `w`
    is (I, O). Rounds to nearest; computed in float32."""
    check_fits(tuple(w.shape), w.dtype, scheme, group_size, transposed)
    w_OI = w.T if transposed else w
    return quantize_blocks([w_OI], tuple(w_OI.shape), w.dtype, scheme, group_size=group_size)


def quantize_blocks(blocks: Iterable[torch.Tensor], shape: tuple[int, int], dtype: torch.dtype, scheme: str, *,
                    group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` of an (O, I) weight given as consecutive blocks of its rows (each a multiple of
    `INT4_BLOCK_ROWS` rows but the last, of any float dtype, converted to `dtype` first), so that a
    loader never holds the float weight whole; the same bits as `quantize` of the whole. Each block
    is quantized `QUANTIZE_ROWS` rows at a time (each row's codes depend on that row alone) into
    codes and scales allocated once."""
    check_fits(tuple(shape), dtype, scheme, group_size)
    codes = scales = None
    rows, scale_dim = 0, 0 if scheme == "int8" else 1  # int4's scales are (groups, O, 2)
    for block in blocks:
        n = block.shape[0]
        if block.dim() != 2 or block.shape[1] != shape[1] or rows + n > shape[0]:
            raise BadInputError(f"a block of shape {list(block.shape)} after {rows} rows does not continue a "
                                f"weight of shape {list(shape)}")
        if scheme == "int4" and n % INT4_BLOCK_ROWS and rows + n != shape[0]:
            raise BadInputError(f"a block of {n} rows: int4 takes multiples of {INT4_BLOCK_ROWS}")
        block = block.to(dtype)
        for r in range(0, n, QUANTIZE_ROWS):
            c, s = _quantize_rows(block[r:r + QUANTIZE_ROWS], scheme, group_size)
            if codes is None:
                codes = c.new_empty((shape[0], *c.shape[1:]))
                scales = s.new_empty((*s.shape[:scale_dim], shape[0], *s.shape[scale_dim + 1:]))
            codes[rows + r:rows + r + c.shape[0]] = c
            scales.narrow(scale_dim, rows + r, c.shape[0]).copy_(s)
            del c, s
        rows += n
        del block
    if rows != shape[0] or codes is None:
        raise BadInputError(f"blocks of {rows} rows in all, expected {shape[0]} (more than none)")
    return codes, scales




def _quantize_rows(w: torch.Tensor, scheme: str, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    w_OI = w.to(torch.float32)
    if scheme == "int8":
        lo_O, hi_O = torch.aminmax(w_OI, dim=1)  # max |w| without an |w| copy of the rows
        scale_O = torch.maximum(-lo_O, hi_O) / INT8_MAX
        scale_O = torch.where(scale_O > 0, scale_O, torch.ones_like(scale_O))
        codes = (w_OI / scale_O[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return codes.contiguous(), scale_O.contiguous()
    o, i = w_OI.shape
    g_OGg = w_OI.view(o, i // group_size, group_size)
    lo, hi = g_OGg.amin(dim=2), g_OGg.amax(dim=2)
    scale_OG = (hi - lo) / INT4_LEVELS
    scale_OG = torch.where(scale_OG > 0, scale_OG, torch.ones_like(scale_OG))
    q_OI = (g_OGg - lo[..., None]).div_(scale_OG[..., None]).round_().clamp_(0, INT4_LEVELS)
    q_OI = q_OI.view(o, i).to(torch.uint8)
    zero_OG = lo + INT4_OFFSET * scale_OG  # code 0 decodes to the group's minimum
    scale_zero_GO2 = torch.stack([scale_OG.T, zero_OG.T], dim=-1).contiguous()
    return pack_int4(q_OI), scale_zero_GO2


def pack_int4(q_OI: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (O, I) packed into the CPU kernel's layout, uint8 (O, I/2)."""
    o, i = q_OI.shape
    b = q_OI.to(torch.uint8).view(o // INT4_BLOCK_ROWS, 2, INT4_BLOCK_ROWS // 2, i)  # (blocks, half, 32, I)
    packed = b[:, 0] | (b[:, 1] << 4)  # (blocks, 32, I)
    return packed.transpose(1, 2).contiguous().view(o, i // 2)  # (blocks, I, 32) as stored


def unpack_int4(packed_OH: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 codes 0..15 (O, I)."""
    o, h = packed_OH.shape
    i = 2 * h
    p = packed_OH.reshape(o // INT4_BLOCK_ROWS, i, INT4_BLOCK_ROWS // 2).transpose(1, 2)  # (blocks, 32, I)
    return torch.stack([p & 0x0F, p >> 4], dim=1).reshape(o, i)


# -- every scheme: dequantize (the reference) ----------------------------------------------------


def dequantize_out_in(codes: torch.Tensor, scales: torch.Tensor, spec: QuantSpec,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The out-major matrix (O, I) the codes stand for, computed in float32 and rounded once to `dtype`."""
    o, i = spec.out_in
    if spec.scheme == "int8":
        w = codes.to(torch.float32) * scales.to(torch.float32)[:, None]
    elif spec.scheme == "int4":
        g = spec.group_size
        q = unpack_int4(codes).to(torch.float32).view(o, i // g, g)
        sz = scales.to(torch.float32)  # (G, O, 2)
        w = ((q - INT4_OFFSET) * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]).view(o, i)
    elif spec.scheme == "fp8":
        return dequantize_fp8_blocks(codes, scales, spec.block, dtype)
    elif spec.scheme == "ggml":
        w = dequantize_ggml(codes, spec.ggml_type).view(o, i)
    else:  # mxfp4: (O, G, 16) blocks -> (I, O) as gpt-oss lays out its experts
        return dequantize_mxfp4(codes.unsqueeze(0), scales.unsqueeze(0), torch.float32)[0].T.to(dtype)
    return w.to(dtype)


def dequantize_ggml(rows: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """GGUF blocks (..., bytes of a row) as float32 (..., weights of a row), by the `gguf` package's own
    dequantization (the reference the kernels are tested against)."""
    import gguf

    out = gguf.quants.dequantize(rows.contiguous().cpu().numpy(), gguf.GGMLQuantizationType[ggml_type])
    return torch.from_numpy(out.astype("float32", copy=False)).to(rows.device)


def has_scales(spec: QuantSpec | dict) -> bool:
    """Whether a compact weight has a scales tensor beside its codes (every scheme but ggml's)."""
    return bool(spec.scales if isinstance(spec, QuantSpec) else spec.get("scales"))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, spec: QuantSpec,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """The logical tensor (spec.shape), in `dtype` (default: the logical dtype)."""
    dt = torch_dtype(spec.dtype) if dtype is None else dtype
    if spec.scheme == "mxfp4":  # decodes straight into the logical (I, O) layout
        return dequantize_mxfp4(codes.unsqueeze(0), scales.unsqueeze(0), torch.float32)[0].to(dt)
    w = dequantize_out_in(codes, scales, spec, dt)
    return (w.T if spec.transposed else w).contiguous()
