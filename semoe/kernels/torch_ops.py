"""The compiled CPU kernels (semoe/kernels/*.c): products of a few rows with int8, int4 and MXFP4
weights (and bfloat16 ones).

Decoding multiplies one row (or a few) by each weight, so its speed is the rate at which weights
stream from memory. torch's float32 product keeps to one core at these sizes, its bfloat16 one
widens at half the bound, and its packed int8/int4 ops want bfloat16 activations and widen slower.
These kernels multiply float32 and bfloat16 weights as they are, and quantize each row of x in
blocks of 32 inputs to int8 codes and a float32 scale (as llama.cpp's CPU kernels do) for the
compact ones, summing each block's products exactly in integers (with AVX-512 VNNI or AVX2, portable
loops elsewhere: `isa()`) and scaling the block sums in float32; all split output rows over torch's
thread count. A decoding step's attention and RMS norms are one call each (`attend_decode`,
`rms_norm`). `quantize_activations` is that
quantization in torch, bit for bit the kernels' own: the reference they are tested against, and the
one `CompactWeight`'s reference kernel computes with.
The library is built at install (setup.py), once per instruction set, and the best build this CPU
runs is loaded with ctypes (`semoe.kernels.loader`); `available()` says whether there is one, and the
callers fall back to torch's ops where there is not. SEMOE_CPU_KERNELS names another build to load
instead (`off`: none).

Shape legend: M rows of x, I in features, O out features, G groups of the int4 input.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch

from semoe.kernels import loader

log = logging.getLogger(__name__)

MAX_ROWS = 16  # rows of x per call (the int4 kernel's stack bound); more rows go to torch's GEMM
# float32 weights: up to 64 rows, three at a time against each block of weight rows; on the AVX2 bench
# CPU that is 90-120 GFLOP/s from 16 to 64 rows, where torch's (MKL) product reached 25-95; past
# 64 rows torch's blocked GEMM is faster
MAX_F32_ROWS = 64
# MXFP4 weights: any number of rows (a prompt's). The kernel ran at 40-70 GMAC/s from 16 to 256 rows on
# the 2-core AVX2 bench CPU, where torch has no MXFP4 product and dequantizing one of gpt-oss-20b's
# 5760 x 2880 experts to float32 alone took 0.35-0.62 s (the time of hundreds of rows through the kernel)
MAX_MXFP4_ROWS = 1 << 30


def max_rows(scheme: str) -> int:
    """The rows of x a compact weight of `scheme` takes through these kernels per call (`takes`)."""
    return MAX_MXFP4_ROWS if scheme == "mxfp4" else MAX_ROWS


def _lib() -> ctypes.CDLL | None:
    lib = loader.library()
    if lib is None:
        _warn_missing()
    return lib


@cache
def _warn_missing() -> None:
    log.warning("semoe's compiled CPU kernels are %s; decoding falls back to torch's slower ops",
                loader.status().removeprefix("off: "))


def available() -> bool:
    """Whether the compiled kernels are loaded."""
    return _lib() is not None


def no_grad_wanted(*tensors: torch.Tensor) -> bool:
    """Whether autograd needs nothing from a product of these (the kernels record no graph)."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def takes(x_MI: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether these kernels compute a product with x: built, x on CPU, and at most `max_rows` rows
    (a decoding step's; more go to torch's GEMM)."""
    return x_MI.device.type == "cpu" and x_MI.numel() // x_MI.shape[-1] <= max_rows and available()


ISAS = loader.ISAS  # the paths the kernels have, by kernels_isa()'s number


def isa() -> str | None:
    """The instruction set the loaded kernels were built for (one of ISAS; None when not built): the
    same integer sums on every path, the float32 additions in another order."""
    return ISAS[_lib().kernels_isa()] if available() else None


ACTIVATION_BLOCK = 32  # inputs per activation scale


def quantize_activations(x_MI: torch.Tensor, block: int = ACTIVATION_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' quantization of x (..., I), in torch: int8 codes (..., I) and float32 scales
    (..., ceil(I / 32)) per block of 32 inputs, d = amax / 127, code = rint(x * (1 / d)). With `block` 256
    (GGUF's super-block types, `activation_block`; I a multiple of it) each 256 inputs share the amax of all of
    them, the scale given for each of their blocks of 32."""
    x = x_MI.to(torch.float32)
    I = x.shape[-1]
    if block != ACTIVATION_BLOCK and I % block:
        block = ACTIVATION_BLOCK  # as the kernels: per 32 where the inputs are not whole blocks of it
    pad = -I % block
    xb = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, block))
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.flatten(-2)[..., :I], d.repeat_interleave(block // ACTIVATION_BLOCK, -1)


def activation_block(ggml_type: str | None = None) -> int:
    """The inputs that share one scale of x in the kernels' products: a GGUF type's block (256 for the
    super-block types Q4_K, Q5_K, Q6_K and IQ4_XS, as ggml's q8_K; gemv_ggml.c's `gg_x_block`), 32 otherwise."""
    return loader.ggml_block(ggml_type)[0] if ggml_type else ACTIVATION_BLOCK


def dequantize_activations(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: codes times their block's scale, float32 (..., I)."""
    I = q.shape[-1]
    xb = torch.nn.functional.pad(q.to(torch.float32), (0, -I % ACTIVATION_BLOCK)).unflatten(-1, (-1, ACTIVATION_BLOCK))
    return (xb * d.unsqueeze(-1)).flatten(-2)[..., :I]


def activations_as_seen(x_MI: torch.Tensor, block: int = ACTIVATION_BLOCK) -> torch.Tensor:
    """x after the kernels' quantization (per `block` inputs: `activation_block`), float32: what a reference
    multiplies to get their result."""
    return dequantize_activations(*quantize_activations(x_MI, block))


def quantize_activations_compiled(x_MI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations` as the compiled kernels compute it (for the test that they agree)."""
    x = x_MI.reshape(-1, x_MI.shape[-1]).to(torch.float32).contiguous()
    M, I = x.shape
    Ip = -(-I // 64) * 64
    q = torch.empty(M, Ip, dtype=torch.int8)
    d = torch.empty(M, Ip // ACTIVATION_BLOCK, dtype=torch.float32)
    _lib().quantize_rows_q8(x.data_ptr(), q.data_ptr(), d.data_ptr(), M, I, Ip)
    nb = -(-I // ACTIVATION_BLOCK)
    return q[:, :I].reshape(*x_MI.shape), d[:, :nb].reshape(*x_MI.shape[:-1], nb)


def _f32(t: torch.Tensor) -> torch.Tensor:
    # decode calls these kernels dozens of times a token: no torch op where none is needed
    return t if t.dtype is torch.float32 and t.is_contiguous() else t.to(torch.float32).contiguous()


def _operands(x_MI: torch.Tensor, w: torch.Tensor, I: int, O: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as contiguous float32 and the float32 output (..., O), after checking the operands."""
    if x_MI.shape[-1] != I:
        raise ValueError(f"x has {x_MI.shape[-1]} features, the weight {I}")
    _cpu_contiguous(x_MI, w)
    return _f32(x_MI), torch.empty((*x_MI.shape[:-1], O), dtype=torch.float32)


def _cpu_contiguous(x_MI: torch.Tensor, *weights: torch.Tensor) -> None:
    if x_MI.device.type != "cpu" or any(w.device.type != "cpu" or not w.is_contiguous() for w in weights):
        raise ValueError("the CPU kernels take contiguous CPU tensors")


def gemv_i8(x_MI: torch.Tensor, codes_OI: torch.Tensor, scale_O: torch.Tensor) -> torch.Tensor:
    """x @ (codes * scale[:, None]).T for int8 codes (O, I) and float32 row scales (O,), with x quantized
    as `quantize_activations` does; float32 (..., O)."""
    O, I = codes_OI.shape
    x, y = _operands(x_MI, codes_OI, I, O)
    _lib().gemv_i8(x.data_ptr(), codes_OI.data_ptr(), _f32(scale_O).data_ptr(), y.data_ptr(), x.numel() // I, O, I,
                   torch.get_num_threads())
    return y


def gemv_i4(x_MI: torch.Tensor, packed_OH: torch.Tensor, scale_zero_GO2: torch.Tensor, group_size: int
            ) -> torch.Tensor:
    """x @ W.T for int4 codes in the CPU kernel's layout (O, I/2) with float32 (scale, zero) per group
    (G, O, 2), with x quantized as `quantize_activations` does; float32 (..., O)."""
    O, I = packed_OH.shape[0], 2 * packed_OH.shape[1]
    x, y = _operands(x_MI, packed_OH, I, O)
    _lib().gemv_i4(x.data_ptr(), packed_OH.data_ptr(), _f32(scale_zero_GO2).data_ptr(), y.data_ptr(), x.numel() // I,
                   O, I, group_size, torch.get_num_threads())
    return y


def gemv_mxfp4(x_MI: torch.Tensor, blocks_OG16: torch.Tensor, scales_OG: torch.Tensor) -> torch.Tensor:
    """x @ W.T for gpt-oss's MXFP4 weight stored out-major: blocks (O, I/32, 16) uint8 (two e2m1
    codes a byte, the even input in the low nibble) and e8m0 exponents (O, I/32) uint8, with x
    quantized as `quantize_activations` does; float32 (..., O)."""
    O, G = blocks_OG16.shape[:2]
    if blocks_OG16.dtype != torch.uint8 or blocks_OG16.shape[2:] != (16,) or tuple(scales_OG.shape) != (O, G) \
            or scales_OG.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks (O, G, 16) and scales (O, G) of uint8, got {list(blocks_OG16.shape)} "
                         f"{blocks_OG16.dtype} and {list(scales_OG.shape)} {scales_OG.dtype}")
    x, y = _operands(x_MI, blocks_OG16, G * ACTIVATION_BLOCK, O)
    _cpu_contiguous(x_MI, scales_OG)
    _lib().gemv_mxfp4(x.data_ptr(), blocks_OG16.data_ptr(), scales_OG.data_ptr(), y.data_ptr(),
                      x.numel() // x.shape[-1], O, x.shape[-1], torch.get_num_threads())
    return y


def gemv_ggml(x_MI: torch.Tensor, rows_OB: torch.Tensor, I: int, ggml_type: str) -> torch.Tensor:
    """x @ W.T for a GGUF file's quantized rows as stored: W (O, I) of ggml type `ggml_type` (Q8_0, Q4_K, ...:
    storage.formats' GGML_KERNEL_TYPES), rows_OB uint8 (O, bytes of a row), with x quantized as
    `quantize_activations` does (per 256 inputs for the super-block types: `activation_block`) and each block's sums
    taken in integers (gemv_ggml.c); float32 (..., O)."""
    O = rows_OB.shape[0]
    t, (per, nbytes) = loader.ggml_type_id(ggml_type), loader.ggml_block(ggml_type)
    if rows_OB.dtype != torch.uint8 or rows_OB.dim() != 2 or I % per or rows_OB.shape[1] != I // per * nbytes:
        raise ValueError(f"{ggml_type} rows (O, {I // per * nbytes}) uint8 for {I} inputs, got "
                         f"{list(rows_OB.shape)} {rows_OB.dtype}")
    x, y = _operands(x_MI, rows_OB, I, O)
    lin = loader.Lin(loader.W_GGML, O, I, t, rows_OB.data_ptr(), None, None)
    if _lib().lin_rows(ctypes.byref(lin), x.data_ptr(), x.numel() // I, y.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"no memory for the quantized activations of {x.numel() // I} rows of {I}")
    return y


def gemv_fp8(x_MI: torch.Tensor, codes_OI: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """x @ W.T for FP8 (e4m3) codes (O, I) with scales per block x block tile (ceil(O/block),
    ceil(I/block)), computed as FP8: each tile's sum of code times x in float32, times its scale; x
    and the result float32 (..., O)."""
    O, I = codes_OI.shape
    if codes_OI.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (-(-O // block), -(-I // block)):
        raise ValueError(f"FP8 codes (O, I) float8_e4m3fn and scales ({-(-O // block)}, {-(-I // block)}), got "
                         f"{codes_OI.dtype} and {list(scales.shape)}")
    x, y = _operands(x_MI, codes_OI, I, O)
    s = _f32(scales)
    _cpu_contiguous(x_MI, s)
    _lib().gemv_fp8(x.data_ptr(), codes_OI.data_ptr(), s.data_ptr(), y.data_ptr(), x.numel() // I, O, I, block,
                    torch.get_num_threads())
    return y


def gemv_bf16(x_MI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """x @ w.T for a bfloat16 weight (O, I), with x and the sums in float32; float32 (..., O). torch's
    own bfloat16 product widens at half the memory bound on CPU (11.5 against 22.7 GB/s for float32)."""
    return _gemv_float(x_MI, w_OI, "bf16", torch.bfloat16)


def gemv_f32(x_MI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """x @ w.T for a float32 weight (O, I); float32 (..., O). torch's own float32 product keeps to one
    core at a decoding step's sizes (12.7 GB/s on one thread, 12.4 on two, on an AVX2 server)."""
    return _gemv_float(x_MI, w_OI, "f32", torch.float32)


def gemv_f32_io(x_MI: torch.Tensor, w_IO: torch.Tensor) -> torch.Tensor:
    """x @ w for a float32 weight laid out (I, O), as gpt-oss's fused experts are; float32 (..., O).
    torch's x @ w keeps to one core at a decoding step's sizes."""
    if w_IO.dtype != torch.float32:
        raise ValueError(f"gemv_f32_io takes a float32 weight, got {w_IO.dtype}")
    I, O = w_IO.shape
    x, y = _operands(x_MI, w_IO, I, O)
    _lib().gemv_f32_io(x.data_ptr(), w_IO.data_ptr(), y.data_ptr(), x.numel() // I, O, I, torch.get_num_threads())
    return y


def _gemv_float(x_MI: torch.Tensor, w_OI: torch.Tensor, short: str, dtype: torch.dtype) -> torch.Tensor:
    if w_OI.dtype != dtype:
        raise ValueError(f"gemv_{short} takes a {str(dtype).removeprefix('torch.')} weight, got {w_OI.dtype}")
    O, I = w_OI.shape
    x, y = _operands(x_MI, w_OI, I, O)
    getattr(_lib(), f"gemv_{short}")(x.data_ptr(), w_OI.data_ptr(), y.data_ptr(), x.numel() // I, O, I,
                                     torch.get_num_threads())
    return y


def swiglu(x_MD: torch.Tensor, bits: int, gate: tuple[torch.Tensor, torch.Tensor | None],
           up: tuple[torch.Tensor, torch.Tensor | None], down: tuple[torch.Tensor, torch.Tensor | None],
           group_in: int = 0, group_down: int = 0) -> torch.Tensor:
    """down(silu(gate x) * up x) for one expert whose three weights are of one kind: (codes, scales)
    of int8 (bits 8) or int4 (bits 4, groups `group_in` over D for gate and up, `group_down` over F
    for down), or (weight, None) of float32 (bits 32) or bfloat16 (bits 16); float32 (..., D). The
    sums of `gemv_i8`/`gemv_i4`/`gemv_f32`/`gemv_bf16` in one call: x and the hidden product are each
    quantized once (integer kinds), and the three products share one parallel region."""
    if bits not in (8, 4, 32, 16):
        raise ValueError(f"bits must be 8, 4, 32 or 16, got {bits}")
    F = gate[0].shape[0]
    D = down[0].shape[0]
    per_code = 2 if bits == 4 else 1
    if up[0].shape != gate[0].shape or (down[0].shape[1] * per_code) != F:
        raise ValueError(f"gate {list(gate[0].shape)}, up {list(up[0].shape)} and down {list(down[0].shape)} "
                         f"are not one expert's weights")
    x, y = _operands(x_MD, gate[0], gate[0].shape[1] * per_code, D)
    _cpu_contiguous(x_MD, up[0], down[0])
    scales = [None if s is None else _f32(s) for s in (gate[1], up[1], down[1])]  # held until the call returns
    sg, su, sd = (None if s is None else s.data_ptr() for s in scales)
    _lib().swiglu_q(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], F, bits, gate[0].data_ptr(), sg,
                    up[0].data_ptr(), su, group_in, down[0].data_ptr(), sd, group_down, y.data_ptr(),
                    torch.get_num_threads())
    return y


CLAMPED_KINDS = {"int8": 8, "int4": 4, "mxfp4": 1}  # clamped_swiglu_q's kind codes of the compact schemes


def clamped_swiglu(x_MD: torch.Tensor, scheme: str, gate_up: tuple[torch.Tensor, torch.Tensor],
                   bias_gu: torch.Tensor, down: tuple[torch.Tensor, torch.Tensor], bias_d: torch.Tensor,
                   group_in: int, group_down: int, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert, down(act(gate_up x + b_gu)) + b_d, in one call for (codes, scales) of int8,
    int4 (groups `group_in`, `group_down`) or MXFP4 (blocks, exponents) stored out-major: gate_up
    (2F outputs, gate and up interleaved), down (D outputs); act as `experts.ClampedSwiGLU`'s
    (min(g, limit), u clamped to +-limit, (u + 1) g sigmoid(alpha g)); float32 (..., D)."""
    kind = CLAMPED_KINDS[scheme]
    D = down[0].shape[0]
    F2 = gate_up[0].shape[0]
    I = x_MD.shape[-1]
    x, y = _operands(x_MD, gate_up[0], I, D)
    _cpu_contiguous(x_MD, down[0], gate_up[1], down[1])
    if F2 % 2 or bias_gu.numel() != F2 or bias_d.numel() != D:
        raise ValueError(f"gate_up of {F2} outputs with a bias of {bias_gu.numel()}, down of {D} with "
                         f"{bias_d.numel()}: not one expert's weights")
    s_gu, s_d = (s if kind == 1 else _f32(s) for s in (gate_up[1], down[1]))  # held until the call returns
    b_gu, b_d = _f32(bias_gu), _f32(bias_d)
    _lib().clamped_swiglu_q(x.data_ptr(), x.numel() // I, I, F2 // 2, kind, gate_up[0].data_ptr(), s_gu.data_ptr(),
                            group_in, b_gu.data_ptr(), down[0].data_ptr(), s_d.data_ptr(), group_down,
                            b_d.data_ptr(), alpha, limit, y.data_ptr(), torch.get_num_threads())
    return y


def attend_decode(q_H: torch.Tensor, k_G: torch.Tensor, v_G: torch.Tensor, cos_R: torch.Tensor, sin_R: torch.Tensor,
                  k_cache_GSD: torch.Tensor, v_cache_GSD: torch.Tensor, pos: int, scale: float, *,
                  window: int | None = None, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """One decoding step of grouped-query attention for one sequence, float32, in one call: the first
    R dims of each head of q (H * Dh) and k (G * Dh) rotated by halves with cos/sin (R, at most Dh),
    k and v written at `pos` of the layer's cache (G, S, Dh), softmax(q k^T * scale) v over
    positions 0..pos, or the last `window` of them; with `sinks_H`, each head's softmax denominator
    also holds exp(sink) (gpt-oss); (H * Dh). The plain reference is the model's own path (rotary,
    `KVCache.append`, `attention_mask`, `attend`)."""
    G, S, Dh = k_cache_GSD.shape
    H = q_H.numel() // Dh
    ops = (q_H, k_G, v_G, cos_R, sin_R, k_cache_GSD, v_cache_GSD) + (() if sinks_H is None else (sinks_H,))
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in ops):
        raise ValueError("attend_decode takes contiguous float32 CPU tensors")
    R = cos_R.numel()
    if q_H.numel() != H * Dh or H % G or k_G.numel() != G * Dh or v_G.numel() != G * Dh or R > Dh or R % 2 \
            or sin_R.numel() != R or v_cache_GSD.shape != k_cache_GSD.shape or not 0 <= pos < S \
            or (sinks_H is not None and sinks_H.numel() != H) or (window is not None and window < 1):
        raise ValueError(f"attend_decode: q {tuple(q_H.shape)}, k {tuple(k_G.shape)}, v {tuple(v_G.shape)}, "
                         f"cos {tuple(cos_R.shape)}, caches {tuple(k_cache_GSD.shape)}, position {pos}, window "
                         f"{window}, sinks {None if sinks_H is None else tuple(sinks_H.shape)}: not one step")
    out = torch.empty(H * Dh, dtype=torch.float32)
    _lib().attend_decode_f32(*(t.data_ptr() for t in ops[:7]), H, G, Dh, R, S, pos, window or 0, scale,
                             None if sinks_H is None else sinks_H.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last dim, float32 CPU tensors (contiguous x), in one
    call; the same values as torch's norm to float32's rounding (the sums in another order)."""
    D = w_D.numel()
    if x.dtype != torch.float32 or w_D.dtype != torch.float32 or not x.is_contiguous() or x.shape[-1] != D:
        raise ValueError(f"rms_norm takes contiguous float32 x (..., {D}) and weight ({D},)")
    y = torch.empty_like(x)
    _lib().rmsnorm_f32(x.data_ptr(), w_D.contiguous().data_ptr(), eps, y.data_ptr(), x.numel() // D, D)
    return y
