"""Names of tensor element types as the store writes them, and their torch and zarr equivalents."""

from __future__ import annotations

import torch

from storage.errors import BadInputError
from storage.formats import CAST_CHOICES

# name in the manifest and in safetensors headers -> torch dtype
_SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_TORCH_TO_SAFETENSORS = {v: k for k, v in _SAFETENSORS_TO_TORCH.items()}

# torch dtype -> zarr v3 data_type as tensorstore spells it (bfloat16 and float8 are extensions)
_TORCH_TO_ZARR: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}



def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors/manifest dtype name such as "BF16"."""
    try:
        return _SAFETENSORS_TO_TORCH[name]
    except KeyError:
        raise BadInputError(
            f"unsupported dtype {name!r}; supported: {', '.join(_SAFETENSORS_TO_TORCH)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors/manifest name of a torch dtype."""
    try:
        return _TORCH_TO_SAFETENSORS[dtype]
    except KeyError:
        raise BadInputError(f"unsupported dtype {dtype}") from None


def zarr_dtype(dtype: torch.dtype) -> str:
    """The zarr v3 data_type name that tensorstore uses for a torch dtype."""
    return _TORCH_TO_ZARR[dtype]


def cast_dtype(choice: str) -> torch.dtype | None:
    """The torch dtype for a --dtype choice, or None for "keep"."""
    if choice not in CAST_CHOICES:
        raise BadInputError(f"--dtype must be one of {', '.join(CAST_CHOICES)}, got {choice!r}")
    return None if choice == "keep" else getattr(torch, choice)
