"""semoe's own fit of GGUF blocks (`storage.kquants`): the blocks it writes decode, by the `gguf` package's own
dequantization, to exactly the numbers chosen; the fit's weighted error is below round-to-nearest on the same
grid (the k-quant starting point) and below an unweighted fit's where columns weigh differently; degenerate rows
(zeros, constants) decode without NaN."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from storage import kquants


def _decode(rows: torch.Tensor, t: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[t]).astype(np.float32))


def test_q4_k_packing_decodes_to_its_parts():
    g = torch.Generator().manual_seed(0)
    n = 6
    d = torch.rand(n, generator=g).to(torch.float16).float()
    dmin = torch.rand(n, generator=g).to(torch.float16).float()
    sc = torch.randint(0, 64, (n, 8), generator=g).float()
    mq = torch.randint(0, 64, (n, 8), generator=g).float()
    L = torch.randint(0, 16, (n, 256), generator=g).float()
    got = _decode(kquants.pack_q4_k(d, dmin, sc, mq, L), "Q4_K").view(n, 8, 32)
    want = (d[:, None] * sc)[..., None] * L.view(n, 8, 32) - (dmin[:, None] * mq)[..., None]
    # the package computes d*sc and dmin*m in float32 first, as ggml does: a rounding apart at most
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_q6_k_packing_decodes_to_its_parts():
    g = torch.Generator().manual_seed(1)
    n = 5
    d = (torch.rand(n, generator=g) - 0.5).to(torch.float16).float()
    sc = torch.randint(-128, 128, (n, 16), generator=g).float()
    L = torch.randint(-32, 32, (n, 256), generator=g).float()
    got = _decode(kquants.pack_q6_k(d, sc, L), "Q6_K").view(n, 16, 16)
    want = (d[:, None] * sc)[..., None] * L.view(n, 16, 16)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _rtn(w: torch.Tensor, t: str) -> torch.Tensor:
    """Round-to-nearest on the type's grid from each block's range: the fit's starting point."""
    n = w.numel() // 256
    x = w.reshape(n, -1).float()
    if t == "Q8_0":
        return kquants._q8_0(w.reshape(-1, 32))
    if t == "Q4_K":
        xs = x.view(n, 8, 32)
        lo = xs.amin(2).clamp(max=0)
        s = (xs.amax(2) - lo) / 15
        d, dmin = kquants._f16(s.amax(1) / 63), kquants._f16((-lo).amax(1) / 63)
        sc, mq = kquants._six_bits(s, d), kquants._six_bits(-lo, dmin)
        L, _ = kquants._q4_k_error(xs, torch.ones_like(xs), d, dmin, sc, mq)
        return kquants.pack_q4_k(d, dmin, sc, mq, L.view(n, 256))
    xs = x.view(n, 16, 16)
    vmax = xs.gather(2, xs.abs().argmax(2, keepdim=True)).squeeze(2)
    s = vmax / -32
    smax = s.gather(1, s.abs().argmax(1, keepdim=True)).squeeze(1)
    d = kquants._f16(smax / -128)
    sc = kquants._eight_bits(s, d)
    L, _ = kquants._q6_k_error(xs, torch.ones_like(xs), d, sc)
    return kquants.pack_q6_k(d, sc, L.view(n, 256))


@pytest.mark.parametrize("t", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("dist", ["normal", "heavy"])
def test_fit_is_below_round_to_nearest(t, dist):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 1024, generator=g) * 0.02
    if dist == "heavy":  # outliers, as trained weights have
        torch.manual_seed(2)  # the distribution draws from the global generator
        w = w * torch.distributions.StudentT(3.0).sample((64, 1024)).clamp(-30, 30) / 2
    rows = kquants.quantize_rows(w, t)
    assert rows.shape == (64, 1024 // kquants.BLOCK_WEIGHTS[t] * kquants.BLOCK_BYTES[t])
    fit = kquants.weighted_error(w, rows, t)
    rtn = kquants.weighted_error(w, _rtn(w, t).view(64, -1), t)
    if t == "Q8_0":  # the same rule as ggml's: equal within the half-float rounding of d
        assert fit <= rtn * 1.001
    else:  # the searches lower the error below the starting point (outliers leave them less to win)
        bound = {"normal": {"Q4_K": 0.85, "Q6_K": 0.9}, "heavy": {"Q4_K": 0.98, "Q6_K": 0.98}}[dist][t]
        assert fit < bound * rtn, (fit, rtn)
    # and the error is the quantization's size: per weight, well under the block's step squared
    assert fit / w.numel() < (w.abs().max().item() / {"Q4_K": 15, "Q6_K": 32, "Q8_0": 127}[t]) ** 2


@pytest.mark.parametrize("t", ["Q4_K", "Q6_K"])
def test_importance_lowers_the_weighted_error(t):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 512, generator=g) * 0.02
    imp = torch.exp(torch.randn(512, generator=g) * 1.5)  # columns a hundredfold apart
    plain = kquants.weighted_error(w, kquants.quantize_rows(w, t), t, imp)
    weighted = kquants.weighted_error(w, kquants.quantize_rows(w, t, imp), t, imp)
    assert weighted < 0.95 * plain, (weighted, plain)


@pytest.mark.parametrize("t", ["Q4_K", "Q6_K", "Q8_0"])
def test_degenerate_rows(t):
    w = torch.zeros(3, 512)
    w[1] = 0.125  # constant
    w[2, ::7] = -3.0  # sparse
    back = _decode(kquants.quantize_rows(w, t), t).view(3, 512)
    assert torch.isfinite(back).all()
    assert torch.equal(back[0], torch.zeros(512))
    # a constant row (Q4_K's minimum or a symmetric scale hold it to a rounding) and a sparse one stay close
    torch.testing.assert_close(back[1:], w[1:], rtol=0, atol=3.0 / {"Q4_K": 15, "Q6_K": 32, "Q8_0": 127}[t])


def test_rows_not_in_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.quantize_rows(torch.zeros(2, 300), "Q4_K")
