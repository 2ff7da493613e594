"""The compiled CPU kernels' library (semoe/kernels/*.c) and the structures its whole-step calls
take, loaded with ctypes and no torch.

`library()` finds the build made at install (or the one SEMOE_CPU_KERNELS names) and declares every
entry point; `Lin`, `Expert`, `LayerC` and `Net` mirror decode_step.c's structs. `semoe.cpu_kernels`
and `semoe.decode_plan` call the kernels on torch tensors through these; `inference.lean` calls them
on its own buffers, in a process that never imports torch.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import cache

_P, _I, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_INT = ctypes.c_int

# decode_step.c's weight kinds (`Lin.kind`)
W_F32, W_BF16, W_INT8, W_INT4 = 1, 2, 3, 4


class Lin(ctypes.Structure):
    """decode_step.c's `Lin`: one weight (O, I), its scales and bias."""
    _fields_ = [("kind", _I), ("O", _I), ("I", _I), ("g", _I), ("w", _P), ("s", _P), ("bias", _P)]


class Expert(ctypes.Structure):
    """One SwiGLU expert: gate and up (F, D) of one kind and group, down (D, F)."""
    _fields_ = [("gate", Lin), ("up", Lin), ("down", Lin)]


class LayerC(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("attn_eps", _F32), ("ffn_eps", _F32), ("n_qkv", _I),
                ("qkv", Lin * 3), ("o", Lin), ("E", _I), ("router", Lin), ("experts", ctypes.POINTER(Expert))]


class Net(ctypes.Structure):
    _fields_ = [("L", _I), ("D", _I), ("H", _I), ("G", _I), ("Dh", _I), ("F", _I), ("E", _I),
                ("top_k", _I), ("norm_topk", _I), ("scale", _F32), ("norm_eps", _F32), ("norm", _P),
                ("layers", ctypes.POINTER(LayerC)), ("head", Lin)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.gemv_i8.argtypes = [_P, _P, _P, _P, _I, _I, _I, _INT]
    lib.gemv_i4.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _INT]
    lib.quantize_rows_q8.argtypes = [_P, _P, _P, _I, _I, _I]
    lib.gemv_bf16.argtypes = [_P, _P, _P, _I, _I, _I, _INT]
    lib.gemv_f32.argtypes = [_P, _P, _P, _I, _I, _I, _INT]
    lib.rmsnorm_f32.argtypes = [_P, _P, _F32, _P, _I, _I]
    lib.attend_decode_f32.argtypes = [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F32, _P, _INT]
    lib.gemv_mxfp4.argtypes = [_P, _P, _P, _P, _I, _I, _I, _INT]
    lib.swiglu_q.argtypes = [_P, _I, _I, _I, _INT, _P, _P, _P, _P, _I, _P, _P, _I, _P, _INT]
    lib.moe_combine_f32.argtypes = [_P, _P, _P, _I, _I]
    lib.decode_step.argtypes = [_P, _P, _P, _P, _I, _I, _P, _P, _P, _INT]
    lib.decode_work.argtypes = [_P, _I]
    lib.decode_work.restype = _P
    lib.decode_work_free.argtypes = [_P]
    lib.decode_attend.argtypes = [_P, _P, _I, _P, _P, _P, _I, _I, _P, _P, _P, _P, _INT]
    lib.decode_ffn.argtypes = [_P, _P, _I, _P, _INT]
    lib.decode_head.argtypes = [_P, _P, _P, _P, _INT]
    for f in (lib.gemv_i8, lib.gemv_i4, lib.quantize_rows_q8, lib.swiglu_q, lib.gemv_bf16, lib.gemv_f32,
              lib.gemv_mxfp4, lib.attend_decode_f32, lib.rmsnorm_f32, lib.moe_combine_f32, lib.decode_step,
              lib.decode_work_free, lib.decode_attend, lib.decode_ffn, lib.decode_head):
        f.restype = None
    lib.kernels_isa.restype = ctypes.c_int
    return lib


@cache
def library() -> ctypes.CDLL | None:
    """The kernels' library with its entry points declared; None where it was not built."""
    path = os.environ.get("SEMOE_CPU_KERNELS")  # another build of semoe/kernels/*.c (tests load each path's)
    if path:
        return _declare(ctypes.CDLL(path))
    spec = importlib.util.find_spec("semoe._kernels")
    if spec is None or spec.origin is None:
        return None
    return _declare(ctypes.CDLL(spec.origin))
