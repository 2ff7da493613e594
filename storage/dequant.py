"""Quantized checkpoint tensors read back as plain floating-point ones: FP8 block-scale, MXFP4, and
compressed-tensors' pack-quantized int4 (`storage.compressed_tensors`).

Two more published layouts are understood, both as transformers reads them:

- FP8 block-scale (DeepSeek-V3, `quant_method: fp8`): `X` in float8_e4m3fn, (..., O, I), next to
  `X_scale_inv` in float32, (..., ceil(O/b0), ceil(I/b1)); each (b0, b1) block of `X` is multiplied by
  its scale, the blocks at the bottom and right edges being cut to the tensor's shape.
- MXFP4 (gpt-oss, `quant_method: mxfp4`): `X_blocks` in uint8, (E, R, G, 16), two e2m1 values per byte
  (low nibble first), 32 values per group, and `X_scales`, (E, R, G), an e8m0 exponent biased by 127
  per group; the dequantized `X` is (E, G*32, R), the orientation of gpt-oss's fused expert weights.

Which tensors are quantized is read from the files (a float8 tensor next to its scales, blocks next to
scales), so `modules_to_not_convert` needs no reading: the modules it names are stored unquantized.

Shape legend: O, I out and in features of a linear weight; E experts; R rows of a packed MXFP4 tensor;
G its 32-value groups per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from storage.dtypes import dtype_name, torch_dtype
from storage.errors import BadInputError
from storage.formats import INT4_GROUP_SIZES
from storage.safetensors_io import TensorRef

FP8_SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`, as transformers names it
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
MXFP4_GROUP = 32  # values per e8m0 scale
MXFP4_BIAS = 127
# the 16 e2m1 codes, as transformers.integrations.mxfp4.FP4_VALUES lists them
FP4_E2M1 = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
QUANT_METHODS = ("fp8 (block-scale, e4m3)", "mxfp4", "compressed-tensors (pack-quantized int4)")


@dataclass(kw_only=True, frozen=True)
class QuantScheme:
    """How a checkpoint's `quantization_config` says its weights are stored."""

    method: str  # "fp8", "mxfp4", or "int4-ct" (compressed-tensors' pack-quantized int4)
    block: tuple[int, int] | None = None  # fp8: (rows, cols) covered by one scale
    group: int | None = None  # int4-ct: inputs per scale

    @property
    def name(self) -> str:
        """The format as recorded in a store's model info."""
        if self.method == "fp8":
            return f"fp8-e4m3-block{self.block[0]}x{self.block[1]}"
        if self.method == "int4-ct":
            return f"int4-compressed-tensors-group{self.group}"
        return self.method


def quant_scheme(config: dict, source: str) -> QuantScheme | None:
    """The scheme of `config`'s quantization_config (None when there is none); refuses others in one line."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise BadInputError(f"{source}: quantization_config is not a JSON object")
    method = q.get("quant_method")
    if method == "mxfp4":
        return QuantScheme(method="mxfp4")
    if method == "compressed-tensors":  # Kimi-K2.5's int4 experts
        return _ct_scheme(q, source)
    if method != "fp8":
        raise BadInputError(f"{source}: quantization_config.quant_method={method!r} is not supported; "
                            f"supported: {', '.join(QUANT_METHODS)}")
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # DeepSeek-V3's spelling, MiniMax-M2's
        raise BadInputError(f"{source}: quantization_config.fmt={fmt!r} is not supported; supported: 'e4m3'")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise BadInputError(f"{source}: quantization_config.weight_block_size={block!r} is not supported; "
                            f"fp8 needs block scales, two positive integers such as [128, 128]")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise BadInputError(f"{source}: quantization_config.activation_scheme={scheme!r} is not supported; "
                            f"supported: 'dynamic'")
    return QuantScheme(method="fp8", block=(block[0], block[1]))


def _ct_scheme(q: dict, source: str) -> QuantScheme:
    """compressed-tensors' `pack-quantized` format with weight-only int4 in symmetric groups (Kimi-K2.5's
    experts; `storage.compressed_tensors`); anything else is refused in one line naming the field."""
    fmt = q.get("format")
    if fmt != "pack-quantized":
        raise BadInputError(f"{source}: quantization_config.format={fmt!r} is not supported for compressed-tensors; "
                            "supported: 'pack-quantized'")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise BadInputError(f"{source}: quantization_config.config_groups is missing or empty")
    sizes = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        field = f"quantization_config.config_groups.{name}"
        for key, want in (("num_bits", 4), ("type", "int"), ("symmetric", True), ("strategy", "group"),
                          ("dynamic", False)):
            if w.get(key, want) != want:
                raise BadInputError(f"{source}: {field}.weights.{key}={w.get(key)!r} is not supported; supported: "
                                    f"{want!r} (weight-only int4 in symmetric groups)")
        if w.get("actorder") not in (None, False):
            raise BadInputError(f"{source}: {field}.weights.actorder={w['actorder']!r} is not supported (groups in "
                                "input order only)")
        for key in ("input_activations", "output_activations"):
            if group.get(key) is not None:
                raise BadInputError(f"{source}: {field}.{key} is set; only weight-only quantization is supported")
        if w.get("group_size") not in INT4_GROUP_SIZES:
            raise BadInputError(f"{source}: {field}.weights.group_size={w.get('group_size')!r} is not supported; "
                                f"supported: {', '.join(map(str, INT4_GROUP_SIZES))}")
        sizes.add(w["group_size"])
    if len(sizes) != 1:
        raise BadInputError(f"{source}: quantization_config.config_groups use group sizes {sorted(sizes)}; one size "
                            "for every group is supported")
    return QuantScheme(method="int4-ct", group=sizes.pop())


CT_PER_INT32 = 8  # compressed-tensors' 4-bit codes per int32 word


def unpack_ct_int4(packed_OP: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' int4 codes: uint8 0..15 (O, 8P) of int32 words (O, P), the first code of each
    word in its lowest bits (each the signed value q plus 8)."""
    words = packed_OP.contiguous().view(torch.int32)
    nibbles = [((words >> (4 * i)) & 0xF).to(torch.uint8) for i in range(CT_PER_INT32)]
    return torch.stack(nibbles, dim=-1).reshape(words.shape[0], -1)


def dequantize_ct_int4(packed_OP: torch.Tensor, scale_OG: torch.Tensor, group: int, dtype: torch.dtype
                       ) -> torch.Tensor:
    """q * scale (O, I) in `dtype`: each product in float32, rounded once."""
    q = unpack_ct_int4(packed_OP).to(torch.float32) - 8
    o, i = q.shape
    return (q.view(o, i // group, group) * scale_OG.to(torch.float32)[..., None]).view(o, i).to(dtype)


def dequantize_fp8_blocks(w_OI: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """(..., O, I) float8 weights times their per-block inverse scales (..., ceil(O/b0), ceil(I/b1)), as `dtype`.

    Each element is one float32 product rounded once to `dtype`, as in transformers' Fp8Dequantize.
    """
    rows, cols = w_OI.shape[-2:]
    b0, b1 = block
    out = w_OI.to(torch.float32)
    # expand the scales over rows only and broadcast them over column blocks: a weight-sized float32
    # copy of the scales would double the peak memory of the largest dense matrices
    s = scale_inv.to(torch.float32).repeat_interleave(b0, dim=-2)[..., :rows, :]  # (..., O, ceil(I/b1))
    full = cols // b1
    out[..., :full * b1].unflatten(-1, (full, b1)).mul_(s[..., :full, None])
    if cols % b1:
        out[..., full * b1:].mul_(s[..., full:])
    return out.to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss packed experts (E, R, G, 16) uint8 with e8m0 scales (E, R, G) -> (E, G*32, R) in `dtype`.

    The operations of transformers' `convert_moe_packed_tensors`: a lookup in `dtype`, then ldexp.
    """
    lut = torch.tensor(FP4_E2M1, dtype=dtype)
    e, r, g, b = blocks.shape
    out = torch.empty(e, r, g, 2 * b, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, (scales.to(torch.int32) - MXFP4_BIAS).unsqueeze(-1), out=out)
    return out.view(e, r, g * 2 * b).transpose(1, 2).contiguous()


def whole_slices(name: str, nbytes: int, lead: int, offset: int, n: int) -> tuple[int, int]:
    """The slices [i0, i1) of a tensor's leading dimension (`lead` of them in its `nbytes`) that bytes
    [offset, offset + n) cover: a tensor made as it is read is read in whole slices only."""
    step = nbytes // lead
    if offset % step or n % step or offset + n > nbytes:
        raise ValueError(f"tensor {name}: a read of a tensor made as it is read covers whole slices of {step} bytes, "
                         f"got bytes {offset}..{offset + n}")
    return offset // step, (offset + n) // step


@dataclass(kw_only=True, frozen=True)
class DequantizedRef:
    """A tensor a checkpoint stores quantized, read as plain `dtype`: the fields and reads of a TensorRef.

    `parts` are the stored (values, scales); reads cover whole slices of the leading dimension of a
    stacked (3-D or more) tensor, or the whole tensor.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[TensorRef, TensorRef]
    scheme: QuantScheme

    @property
    def path(self) -> str:
        return self.parts[0].path

    @property
    def start(self) -> int:
        return self.parts[0].start

    @property
    def nbytes(self) -> int:
        return torch_dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64))

    def read_into(self, out: memoryview, *, offset: int = 0, nbytes: int | None = None) -> None:
        """Dequantize the bytes [offset, offset + nbytes) of the plain tensor into `out`."""
        n = self.nbytes - offset if nbytes is None else nbytes
        lead = self.shape[0] if len(self.shape) >= 3 else 1
        i0, i1 = whole_slices(self.name, self.nbytes, lead, offset, n)
        values, scales = (_read_rows(p, i0, i1, lead) for p in self.parts)
        to = torch_dtype(self.dtype)
        if self.scheme.method == "fp8":
            t = dequantize_fp8_blocks(values, scales, self.scheme.block, to)
        elif self.scheme.method == "int4-ct":
            t = dequantize_ct_int4(values, scales, self.scheme.group, to)
        else:
            t = dequantize_mxfp4(values, scales, to)
        np.frombuffer(out, dtype=np.uint8, count=n)[:] = t.reshape(-1).view(torch.uint8).numpy()

    def read(self) -> np.ndarray:
        """The plain tensor's bytes as a new uint8 array."""
        buf = np.empty(self.nbytes, dtype=np.uint8)
        self.read_into(memoryview(buf))
        return buf


def _read_rows(ref: TensorRef, i0: int, i1: int, lead: int) -> torch.Tensor:
    """Slices [i0, i1) of a stored tensor's leading dimension (the whole tensor when `lead` is 1)."""
    step = ref.nbytes // lead
    buf = np.empty((i1 - i0) * step, dtype=np.uint8)
    ref.read_into(memoryview(buf), offset=i0 * step, nbytes=buf.nbytes)
    shape = ref.shape if lead == 1 else (i1 - i0, *ref.shape[1:])
    return torch.from_numpy(buf).view(torch_dtype(ref.dtype)).view(shape)


def pair_quantized(tensors: dict[str, TensorRef], scheme: QuantScheme,
                   dtype: torch.dtype) -> dict[str, TensorRef | DequantizedRef]:
    """The checkpoint's tensors with each quantized one and its scales replaced by one DequantizedRef,
    named and shaped as the unquantized model has it; other tensors are kept as they are."""
    out: dict[str, TensorRef | DequantizedRef] = {}
    if scheme.method == "fp8":
        for name, ref in tensors.items():
            if name.endswith(FP8_SCALE_SUFFIX):
                base = tensors.get(name[:-len(FP8_SCALE_SUFFIX)])
                if base is None or base.dtype != "F8_E4M3":
                    raise BadInputError(f"{ref.path}: tensor {name} scales no float8 tensor "
                                        f"{name[:-len(FP8_SCALE_SUFFIX)]}")
            elif ref.dtype == "F8_E4M3":
                out[name] = _fp8_ref(ref, tensors.get(name + FP8_SCALE_SUFFIX), scheme, dtype)
            else:
                out[name] = ref
        return out
    for name, ref in tensors.items():
        if name.endswith(MXFP4_SCALES) and name[:-len(MXFP4_SCALES)] + MXFP4_BLOCKS in tensors:
            continue
        if name.endswith(MXFP4_BLOCKS):
            base = name[:-len(MXFP4_BLOCKS)]
            out[base] = _mxfp4_ref(ref, tensors.get(base + MXFP4_SCALES), scheme, dtype)
        else:
            out[name] = ref
    return out


def _fp8_ref(w: TensorRef, s: TensorRef | None, scheme: QuantScheme, dtype: torch.dtype) -> DequantizedRef:
    if s is None:
        raise BadInputError(f"{w.path}: tensor {w.name} is float8 but {w.name}{FP8_SCALE_SUFFIX} is missing")
    if len(w.shape) < 2:
        raise BadInputError(f"{w.path}: tensor {w.name} is float8 with shape {list(w.shape)}; block scales need "
                            f"at least 2 dimensions")
    b0, b1 = scheme.block
    want = (*w.shape[:-2], -(-w.shape[-2] // b0), -(-w.shape[-1] // b1))
    if s.shape != want:
        raise BadInputError(f"{s.path}: tensor {s.name} has shape {list(s.shape)}; {b0}x{b1} blocks of "
                            f"{w.name} {list(w.shape)} need {list(want)}")
    if not torch_dtype(s.dtype).is_floating_point:
        raise BadInputError(f"{s.path}: tensor {s.name} has dtype {s.dtype}; scales must be floating point")
    return DequantizedRef(name=w.name, dtype=dtype_name(dtype), shape=w.shape, parts=(w, s), scheme=scheme)


def _mxfp4_ref(b: TensorRef, s: TensorRef | None, scheme: QuantScheme, dtype: torch.dtype) -> DequantizedRef:
    base = b.name[:-len(MXFP4_BLOCKS)]
    if s is None:
        raise BadInputError(f"{b.path}: tensor {b.name} has no {base}{MXFP4_SCALES}")
    if b.dtype != "U8" or len(b.shape) != 4 or b.shape[-1] != MXFP4_GROUP // 2:
        raise BadInputError(f"{b.path}: tensor {b.name} is {b.dtype} {list(b.shape)}; mxfp4 blocks are U8 "
                            f"(experts, rows, groups, {MXFP4_GROUP // 2})")
    if s.dtype != "U8" or s.shape != b.shape[:-1]:
        raise BadInputError(f"{s.path}: tensor {s.name} is {s.dtype} {list(s.shape)}; the scales of {b.name} "
                            f"are U8 {list(b.shape[:-1])}")
    e, r, g, _ = b.shape
    return DequantizedRef(name=base, dtype=dtype_name(dtype), shape=(e, g * MXFP4_GROUP, r), parts=(b, s),
                          scheme=scheme)
