"""The compiled CPU kernels (semoe/kernels/gemv.c): products of a few rows with int8 and int4 weights.

Decoding multiplies one row (or a few) by each weight, so its speed is the rate at which weights
stream from memory. For float32 weights torch's own product already runs at the memory bound; its
packed int8/int4 ops want bfloat16 activations and widen slower. These kernels keep float32
activations and sums, widen codes in registers, and split output rows over torch's thread count.
The library is built at install (setup.py, -O3 -march=native) and loaded with ctypes; `available()`
says whether it was, and the callers fall back to torch's ops where it was not.

Shape legend: M rows of x, I in features, O out features, G groups of the int4 input.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from functools import cache

import torch

log = logging.getLogger(__name__)

MAX_ROWS = 16  # rows of x per call (the int4 kernel's stack bound); more rows go to torch's GEMM
_P = ctypes.c_void_p
_I = ctypes.c_int64


@cache
def _lib() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("semoe._kernels")
    if spec is None or spec.origin is None:
        log.warning("semoe's CPU kernels are not built (semoe/_kernels*.so missing): run `pip install -e .` "
                    "(tools/run.sh does); decoding falls back to torch's slower ops")
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.gemv_i8.argtypes = [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
    lib.gemv_i4.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]
    for f in (lib.gemv_i8, lib.gemv_i4):
        f.restype = None
    return lib


def available() -> bool:
    """Whether the compiled kernels are loaded."""
    return _lib() is not None


def _rows(x_MI: torch.Tensor, O: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x_MI.reshape(-1, x_MI.shape[-1]).to(torch.float32).contiguous()
    return x, torch.empty(x.shape[0], O, dtype=torch.float32)


def _check(x_MI: torch.Tensor, w: torch.Tensor, I: int) -> None:
    if x_MI.device.type != "cpu" or w.device.type != "cpu" or not w.is_contiguous():
        raise ValueError("the CPU kernels take contiguous CPU tensors")
    if x_MI.shape[-1] != I:
        raise ValueError(f"x has {x_MI.shape[-1]} features, the weight {I}")


def gemv_i8(x_MI: torch.Tensor, codes_OI: torch.Tensor, scale_O: torch.Tensor) -> torch.Tensor:
    """x @ (codes * scale[:, None]).T for int8 codes (O, I) and float32 row scales (O,); float32 (..., O)."""
    O, I = codes_OI.shape
    _check(x_MI, codes_OI, I)
    scale = scale_O.to(torch.float32).contiguous()
    x, y = _rows(x_MI, O)
    _lib().gemv_i8(x.data_ptr(), codes_OI.data_ptr(), scale.data_ptr(), y.data_ptr(), x.shape[0], O, I,
                   torch.get_num_threads())
    return y.view(*x_MI.shape[:-1], O)


def gemv_i4(x_MI: torch.Tensor, packed_OH: torch.Tensor, scale_zero_GO2: torch.Tensor, group_size: int
            ) -> torch.Tensor:
    """x @ W.T for int4 codes in the CPU kernel's layout (O, I/2) with float32 (scale, zero) per group
    (G, O, 2); float32 (..., O)."""
    O, I = packed_OH.shape[0], 2 * packed_OH.shape[1]
    _check(x_MI, packed_OH, I)
    sz = scale_zero_GO2.to(torch.float32).contiguous()
    x, y = _rows(x_MI, O)
    _lib().gemv_i4(x.data_ptr(), packed_OH.data_ptr(), sz.data_ptr(), y.data_ptr(), x.shape[0], O, I, group_size,
                   torch.get_num_threads())
    return y.view(*x_MI.shape[:-1], O)
