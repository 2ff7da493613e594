"""The kernels on GGUF's quantized blocks as stored (gemv_ggml.c, `Lin` kind W_GGML) against the `gguf`
package's own dequantization followed by a float64 product.

Weights are random blocks of each type (random codes and sub-scales, half scales of plausible size). The
kernels quantize x per 32 inputs, per 256 for the super-block types (`torch_ops.quantize_activations`,
`activation_block`), and sum each block's products exactly in integers, then in float32. Both bounds are of the terms' scale (the largest of |x| |W|^T), since an output
that cancels out is no more exact than its terms: against x as they see it (`activations_as_seen`) 1e-6
(float32 sums of a few hundred block terms in another order than float64's: 4e-8 at most over 40 seeds of the
small shapes); against x itself 1e-2 (int8 activations, half a step of 1/127 of a block's largest value per
input: 3.1e-3 at most over those seeds). The shapes take each
path: one row (decoding: each row read as a stream), rows in pairs (3), and the tile kernel of the AVX-512 build
(8 or more rows; 48 or more for Q4_K), with partial blocks of rows and an odd last row."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest
import torch

from helpers.gguf_files import random_blocks
from helpers.kernels import needs_kernels
from semoe.kernels import loader, torch_ops

pytestmark = needs_kernels

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")


def _builds() -> dict[str, str]:
    """Every installed build this CPU runs (portable, avx2, avx512-vnni: each its own decoders)."""
    from semoe.kernels import variants

    have = loader.installed()
    return {v.name: have[v.name] for v in variants.runnable(variants.cpu_flags()) if v.name in have}


def ggml_product(name: str, w: np.ndarray, O: int, I: int, x: torch.Tensor, lib=None) -> torch.Tensor:
    import gguf

    lin = loader.Lin(loader.W_GGML, O, I, int(gguf.GGMLQuantizationType[name]), w.ctypes.data, None, None)
    y = torch.empty(x.shape[0], O)
    assert (lib or loader.library()).lin_rows(ctypes.byref(lin), x.data_ptr(), x.shape[0], y.data_ptr(), 2) == 0
    return y


@pytest.mark.parametrize("build", sorted(_builds()))
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("O,I,M", [(37, 512, 1), (64, 256, 3), (5, 768, 9), (37, 512, 16), (6, 256, 49)])
def test_products_on_blocks_equal_the_dequantized_weight_times_x(build, name, O, I, M):
    import gguf

    rng = np.random.default_rng(zlib.crc32(f"{name} {O} {I} {M}".encode()))  # the same blocks in every process
    w = np.ascontiguousarray(random_blocks(name, O, I, rng))
    W = torch.from_numpy(gguf.quants.dequantize(w, gguf.GGMLQuantizationType[name]).astype(np.float64))
    assert W.shape == (O, I)
    x = torch.randn(M, I, generator=torch.Generator().manual_seed(O + I + M))
    y = ggml_product(name, w, O, I, x, loader.load(_builds()[build])).double()
    xs = torch_ops.activations_as_seen(x, torch_ops.activation_block(name)).double()
    # float32's rounding, and int8 activations' error, go with the size of the terms summed, not of their sum:
    # an output that cancels out (rows of 3 blocks, Q4_1's mins) is held to its terms' scale
    assert float((y - xs @ W.T).abs().max() / (xs.abs() @ W.abs().T).max()) < 1e-6
    assert float((y - x.double() @ W.T).abs().max() / (x.double().abs() @ W.abs().T).max()) < 1e-2


@pytest.mark.parametrize("build", sorted(_builds()))
@pytest.mark.parametrize("name", [t for t in TYPES if not t.endswith("_K") and t != "IQ4_XS"])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("I", [64, 96, 160])
def test_rows_of_an_odd_number_of_blocks(build, name, M, I):
    """Rows of 2, 3 and 5 blocks of 32: the kernels that take two or four blocks a step (Q8_0's decoding row,
    and the other blocks of 32 on the AVX-512 build, read as one stream) end on a part of a step, read through
    masks; the same tolerance as above."""
    test_products_on_blocks_equal_the_dequantized_weight_times_x(build, name, 6, I, M)


def test_row_bytes_follow_each_types_blocks():
    import gguf

    lib = loader.library()
    lib.gg_row_bytes.restype = ctypes.c_int64
    lib.gg_row_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    for name in TYPES:
        t = gguf.GGMLQuantizationType[name]
        per, nbytes = gguf.GGML_QUANT_SIZES[t]
        assert lib.gg_row_bytes(int(t), 4 * per) == 4 * nbytes
        assert lib.gg_row_bytes(int(t), 4 * per + 32 * (per > 32)) == (0 if per > 32 else 4 * nbytes)
    assert lib.gg_row_bytes(int(gguf.GGMLQuantizationType.Q2_K), 256) == 0  # not computed here
