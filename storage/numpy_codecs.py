"""The store's weight codes in numpy, without torch: bfloat16 widened, FP8 (e4m3) with block scales
dequantized as the engine dequantizes it, int8 quantized and dequantized with `storage.quant`'s
arithmetic. The
torch-free runner (`inference.torch_free.runner`) reads its weights through these; tests compare each with the
torch version bit for bit."""

from __future__ import annotations

import numpy as np

from storage.formats import INT8_MAX


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bits (uint16): the top half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def quantize_int8_rows(w_OI: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes (O, I) and float32 scales (O,) of float32 rows: `storage.quant`'s int8 scheme, the
    same float32 operations in the same order (tests compare the bits with it)."""
    scale = np.maximum(-w_OI.min(axis=1), w_OI.max(axis=1)) / np.float32(INT8_MAX)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    codes = np.clip(np.rint(w_OI / scale[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return codes, scale


def float_rows(raw: np.ndarray, dtype: str) -> np.ndarray:
    """float32 rows of a float tensor's raw bytes (uint8, last axis the row's bytes)."""
    return raw.view(np.float32) if dtype == "F32" else bf16_to_f32(raw.view(np.uint16))


def _e4m3_values() -> np.ndarray:
    """float32 values of the 256 FP8 (e4m3) codes: sign, 4 exponent bits (bias 7), 3 mantissa bits,
    exponent 0 subnormal (the NaN codes 0x7F and 0xFF, which no weight holds, read as 480)."""
    c = np.arange(256)
    e, m = (c >> 3) & 15, (c & 7).astype(np.float64)
    v = np.where(e > 0, np.ldexp(1.0 + m / 8.0, e - 7), np.ldexp(m / 8.0, -6))
    return np.where(c & 0x80, -v, v).astype(np.float32)


E4M3 = _e4m3_values()  # code -> value


def fp8_bf16_rows(codes: np.ndarray, scales: np.ndarray, r0: int, block: tuple[int, int]) -> np.ndarray:
    """bfloat16 bits (uint16) of FP8 rows r0.. (codes uint8 (n, I)) times their blocks' inverse scales
    (float32 (ceil(O/b0), ceil(I/b1))): each element one float32 product rounded once to bfloat16 (to
    nearest even), as `storage.dequant.dequantize_fp8_blocks` makes an FP8 checkpoint's dense weights
    and the engine holds them."""
    n, I = codes.shape
    b0, b1 = block
    s = scales[(r0 + np.arange(n)) // b0][:, np.arange(I) // b1]
    return f32_to_bf16((E4M3[codes] * s).astype(np.float32))


def f32_to_bf16(w: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) of float32 values, rounded to nearest even, as torch's conversion."""
    u = w.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def int8_rows(codes: np.ndarray, scales: np.ndarray, dtype: str) -> np.ndarray:
    """float32 rows of int8 codes (n, I) and their float32 scales (n,), as `storage.quant` dequantizes
    them to the logical dtype (one float32 product, rounded once to bfloat16 where that is BF16)."""
    w = codes.astype(np.float32) * scales[:, None]
    return bf16_to_f32(f32_to_bf16(w)) if dtype == "BF16" else w
