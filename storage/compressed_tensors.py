"""compressed-tensors' pack-quantized int4 (Kimi-K2.5 and Kimi-K2-Thinking as published) in and out of
semoe's own int4.

The format, for each quantized linear weight X.weight (O, I):

- `X.weight_packed` int32 (O, I/8): eight 4-bit codes per int32, the first in the lowest bits, each
  the signed value q in -8..7 stored as q + 8;
- `X.weight_scale` float (O, I/g): one scale per group of g inputs;
- `X.weight_shape` int32 [O, I];
- w = q * scale (symmetric groups along the input).

semoe's int4 (`storage.quant`) computes w = (c - 8) * scale + zero per group: c = the stored nibble,
scale = weight_scale, zero = 0 are the same numbers, so the checkpoint's weights are kept exactly,
repacked into the CPU kernel's layout (`pack_int4`) at import; export packs them back bit for bit.
Reading the checkpoint in place (`dequantize`) gives q * scale in the weight's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from storage.dequant import CT_PER_INT32, DequantizedRef, QuantScheme, unpack_ct_int4
from storage.dtypes import dtype_name, torch_dtype
from storage.errors import BadInputError
from storage.quant import INT4_BLOCK_ROWS, SCALE_SUFFIX, QuantSpec, pack_int4, unpack_int4
from storage.safetensors_io import TensorRef

METHOD = "int4-ct"  # `QuantScheme.method` (`storage.dequant.quant_scheme` reads the config)
PACKING = "compressed-tensors"  # `QuantSpec.packing` of the int4 codes it gives
PACKED, SCALE, SHAPE = "_packed", "_scale", "_shape"  # X.weight -> X.weight_packed, X.weight_scale, X.weight_shape


def pack(codes_OI: torch.Tensor) -> torch.Tensor:
    """The inverse of `storage.dequant.unpack_ct_int4`: int32 words (O, I/8)."""
    c = codes_OI.to(torch.int64).view(codes_OI.shape[0], -1, CT_PER_INT32)
    words = sum(c[..., i] << (4 * i) for i in range(CT_PER_INT32))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits, signed


@dataclass(frozen=True)
class RepackedRef:
    """A pack-quantized weight's codes or scales as semoe's int4 holds them, read from the checkpoint's
    tensors (the fields and reads of a TensorRef): codes uint8 (O, I/2) in the kernel's layout, or
    scales and zero points float32 (I/g, O, 2)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[TensorRef, TensorRef]  # weight_packed, weight_scale
    codes: bool  # the codes, or the scales

    @property
    def path(self) -> str:  # the file (and below, the place in it) of the tensor it stands for
        return self.parts[0 if self.codes else 1].path

    @property
    def start(self) -> int:
        return self.parts[0 if self.codes else 1].start

    @property
    def nbytes(self) -> int:
        return torch_dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64))

    def _tensor(self) -> torch.Tensor:
        packed, scale = self.parts
        if self.codes:
            return pack_int4(unpack_ct_int4(_read(packed)))
        s = _read(scale).to(torch.float32).T  # (G, O)
        return torch.stack([s, torch.zeros_like(s)], dim=-1).contiguous()

    def read(self) -> np.ndarray:
        return self._tensor().reshape(-1).view(torch.uint8).numpy()

    def read_into(self, out: memoryview, *, offset: int = 0, nbytes: int | None = None) -> None:
        n = self.nbytes - offset if nbytes is None else nbytes
        np.frombuffer(out, dtype=np.uint8, count=n)[:] = self.read()[offset:offset + n]


def _read(ref: TensorRef) -> torch.Tensor:
    return torch.from_numpy(ref.read()).view(torch_dtype(ref.dtype)).view(ref.shape)


def _check(packed: TensorRef, scale: TensorRef | None, shape: TensorRef | None, group: int) -> tuple[int, int]:
    """(O, I) of a packed weight, its scales and its shape tensor checked against each other."""
    base = packed.name[:-len(PACKED)]
    if packed.dtype != "I32" or len(packed.shape) != 2:
        raise BadInputError(f"{packed.path}: tensor {packed.name} is {packed.dtype} {list(packed.shape)}; packed "
                            "int4 codes are I32 (out, in / 8)")
    o, i = packed.shape[0], packed.shape[1] * CT_PER_INT32
    if scale is None:
        raise BadInputError(f"{packed.path}: tensor {packed.name} has no {base}{SCALE}")
    if not torch_dtype(scale.dtype).is_floating_point or scale.shape != (o, i // group):
        raise BadInputError(f"{scale.path}: tensor {scale.name} is {scale.dtype} {list(scale.shape)}; the scales of "
                            f"{packed.name} in groups of {group} are floating point {[o, i // group]}")
    if shape is not None:
        got = _read(shape).tolist() if shape.dtype in ("I32", "I64") and shape.shape == (2,) else None
        if got != [o, i]:
            raise BadInputError(f"{shape.path}: tensor {shape.name} says {got}; {packed.name} holds [{o}, {i}]")
    if o % INT4_BLOCK_ROWS:
        raise BadInputError(f"{packed.path}: tensor {packed.name} has {o} rows; semoe's int4 keeps weights in blocks "
                            f"of {INT4_BLOCK_ROWS} rows")
    return o, i


def _packed_weights(tensors: dict[str, TensorRef], group: int
                    ) -> tuple[dict[str, TensorRef], list[tuple[str, TensorRef, TensorRef, int, int]]]:
    """The checkpoint's tensors that are not part of a packed weight, and each packed weight as
    (X.weight, its weight_packed, its weight_scale, O, I), checked."""
    rest, packed = {}, []
    for name, ref in tensors.items():
        base = next((name[:-len(s)] for s in (PACKED, SCALE, SHAPE)
                     if name.endswith(s) and name[:-len(s)] + PACKED in tensors), None)
        if base is None:
            rest[name] = ref
        elif name.endswith(PACKED):
            scale = tensors.get(base + SCALE)
            packed.append((base, ref, scale, *_check(ref, scale, tensors.get(base + SHAPE), group)))
    return rest, packed


def pair(tensors: dict[str, TensorRef], scheme: QuantScheme, dtype: torch.dtype
         ) -> dict[str, TensorRef | DequantizedRef]:
    """The checkpoint's tensors with each packed weight, its scales and shape replaced by one
    DequantizedRef named X.weight (O, I) in `dtype`; the rest as they are."""
    out: dict[str, TensorRef | DequantizedRef]
    out, packed = _packed_weights(tensors, scheme.group)
    for base, ref, scale, o, i in packed:
        out[base] = DequantizedRef(name=base, dtype=dtype_name(dtype), shape=(o, i), parts=(ref, scale), scheme=scheme)
    return out


def kept_compact(tensors: dict[str, TensorRef], scheme: QuantScheme, dtype: torch.dtype
                 ) -> tuple[dict[str, TensorRef | RepackedRef], dict[str, dict]]:
    """The checkpoint's tensors with each packed weight as semoe int4 codes X.weight and scales
    X.weight_scale_zero (`RepackedRef`, in the packed tensors' places in their files), and their manifest
    `quant` entries (the logical dtype `dtype`; `packing` so that export packs them back)."""
    out, packed = _packed_weights(tensors, scheme.group)
    quant: dict[str, dict] = {}
    for base, ref, scale, o, i in packed:
        scales = base + SCALE_SUFFIX["int4"]
        out[base] = RepackedRef(name=base, dtype="U8", shape=(o, i // 2), parts=(ref, scale), codes=True)
        out[scales] = RepackedRef(name=scales, dtype="F32", shape=(i // scheme.group, o, 2), parts=(ref, scale),
                                  codes=False)
        spec = QuantSpec(scheme="int4", dtype=dtype_name(dtype), shape=(o, i), scales=scales,
                         group_size=scheme.group, packing=PACKING, packed_scales=scale.dtype)
        quant[base] = spec.to_json()
        quant[scales] = {"scales_of": base}
    return out, quant


def export(name: str, codes: torch.Tensor, scale_zero: torch.Tensor, spec: QuantSpec
           ) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's three tensors of a weight imported packed: (name, tensor) of X.weight_packed,
    X.weight_scale (in the dtype the checkpoint stored them) and X.weight_shape."""
    if bool(scale_zero[..., 1].any()):
        raise BadInputError(f"tensor {name}: int4 zero points are not all zero; its weights were changed since "
                            "import and are not pack-quantized any more")
    o, i = spec.shape
    scale = scale_zero[..., 0].T.contiguous().to(torch_dtype(spec.packed_scales or "BF16"))
    return [(name + PACKED, pack(unpack_int4(codes))), (name + SCALE, scale),
            (name + SHAPE, torch.tensor([o, i], dtype=torch.int32))]
