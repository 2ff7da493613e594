"""GGUF blocks made from float weights by semoe's own fit: Q4_K, Q6_K and Q8_0 rows (`store quantize --kquant`).

The blocks are GGUF's, byte for byte (the kernels compute on them, `store export --format gguf` writes them as
they are, llama.cpp reads them); what is semoe's is how the numbers in them are chosen. Each row of an (O, I)
weight is cut into super-blocks of 256 (Q8_0: blocks of 32), and every choice minimises the weighted squared
error sum_l a_l (w_l - w^_l)^2, where a_l is the importance of input column l: the mean square of the
activations it multiplies, from calibration text (`semoe.evaluation.calibrate`), or 1 without it. That is
the expected squared error of the weight's output for independent inputs, the quantity the fit should
lower; llama.cpp's k-quants weigh by the weights' own magnitudes instead (and by the importance times them
with an importance matrix).

- Q4_K (4.5 bits a weight): 8 sub-blocks of 32, each w^ = d sc q - dmin m with q in 0..15 and 6-bit sc,
  m, d and dmin half floats. Each sub-block's scale and minimum are searched over a grid of 31 inverse
  scales around the range's (k-quants try 21 over a narrower one), each followed by the weighted least
  squares for that rounding, then improved by alternating rounding and least squares. The super-block's
  6-bit sub-scales are then fitted jointly: d and dmin by least squares over the whole super-block given
  the codes, the codes rounded again, the sub-scales re-fitted, keeping the best of each round.
- Q6_K (6.5625 bits): 16 sub-blocks of 16, w^ = d sc (q - 32), q in 0..63, signed 8-bit sc; the same
  search (symmetric) and joint refit.
- Q8_0 (8.5 bits): blocks of 32, w^ = d q, q in -127..127; d = max |w| / 127, as ggml does.

Every fit keeps its starting point's error as a bound: each step is kept only where it lowers the error.
"""

from __future__ import annotations

import numpy as np
import torch

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210, "Q8_0": 34}
BLOCK_WEIGHTS = {"Q4_K": QK_K, "Q6_K": QK_K, "Q8_0": 32}
TYPES = tuple(BLOCK_BYTES)
_CHUNK = 1 << 20  # weights fitted at a time (bounds the search's temporaries to some 100 MiB)


def bits_per_weight(ggml_type: str) -> float:
    return 8 * BLOCK_BYTES[ggml_type] / BLOCK_WEIGHTS[ggml_type]


def fits(ggml_type: str, shape: tuple[int, ...]) -> bool:
    """Whether an (O, I) weight's rows cut into whole blocks of the type."""
    return len(shape) == 2 and shape[1] % BLOCK_WEIGHTS[ggml_type] == 0


def quantize_rows(w_OI: torch.Tensor, ggml_type: str, importance_I: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 (O, bytes of a row): the rows of `w_OI` as blocks of `ggml_type`, fitted with the columns'
    `importance_I` (I,) as the weights of the squared error (None: all 1)."""
    o, i = w_OI.shape
    if not fits(ggml_type, (o, i)):
        raise ValueError(f"{ggml_type} takes rows of a multiple of {BLOCK_WEIGHTS[ggml_type]} weights, got {i}")
    n = BLOCK_WEIGHTS[ggml_type]
    out = torch.empty((o, i // n * BLOCK_BYTES[ggml_type]), dtype=torch.uint8)
    a_I = None
    if importance_I is not None:
        a_I = importance_I.to(torch.float32).clamp(min=0)
        mean = a_I.mean()
        # columns never seen active keep a small weight, so their weights are still fitted
        a_I = a_I + 1e-3 * mean if mean > 0 else torch.ones_like(a_I)
    rows = max(1, _CHUNK // i)
    for r in range(0, o, rows):
        x = w_OI[r:r + rows].to(torch.float32).reshape(-1, n)
        a = None if a_I is None else a_I.view(-1, n).repeat(min(rows, o - r), 1)
        if ggml_type == "Q8_0":
            blocks = _q8_0(x)
        elif ggml_type == "Q4_K":
            blocks = _q4_k(x, torch.ones_like(x) if a is None else a)
        else:
            blocks = _q6_k(x, torch.ones_like(x) if a is None else a)
        out[r:r + rows] = blocks.view(-1, out.shape[1])
    return out


# -- Q8_0 -------------------------------------------------------------------------------------------


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).contiguous().view(torch.uint8).view(-1, 2)


def _f16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = _f16(x.abs().amax(1) / 127)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = (x * inv[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([_half_bytes(d), q.view(torch.uint8)], dim=1)


# -- Q4_K -------------------------------------------------------------------------------------------


def _affine_ls(x, a, L, sw, sx):
    """Per row, the (s, m) minimising sum a (s L + m - x)^2 with m <= 0 (a Q4_K sub-block's minimum is
    subtracted), and that error less the constant sum a x^2."""
    aL = a * L
    sl, sll, slx = aL.sum(1), (aL * L).sum(1), (aL * x).sum(1)
    det = sw * sll - sl * sl
    ok = det > 1e-30 * sw * sll
    s = torch.where(ok, (sw * slx - sl * sx) / torch.where(ok, det, torch.ones_like(det)), torch.zeros_like(det))
    m = torch.where(ok, (sll * sx - sl * slx) / torch.where(ok, det, torch.ones_like(det)), torch.zeros_like(det))
    pos = (m > 0) | ~ok  # the minimum must be at or below 0: then s alone
    s = torch.where(pos, slx / sll.clamp(min=1e-30), s)
    m = torch.where(pos, torch.zeros_like(m), m)
    s = s.clamp(min=0)
    err = s * s * sll + 2 * s * m * sl + m * m * sw - 2 * s * slx - 2 * m * sx
    return s, m, err


def _fit_affine(x: torch.Tensor, a: torch.Tensor, nmax: int, steps: int = 30, refine: int = 2):
    """Per row of x (N, n): scale s >= 0 and minimum m <= 0 with codes L = round((x - m) / s) in
    0..nmax, searched as the module says."""
    lo = x.amin(1).clamp(max=0)
    span = (x.amax(1) - lo).clamp(min=1e-30)
    sw, sx = a.sum(1), (a * x).sum(1)
    best_s, best_m, best_e = None, None, None
    for k in range(steps + 1):
        inv = (nmax - 1.5 + 3.0 * k / steps) / span
        L = ((x - lo[:, None]) * inv[:, None]).round_().clamp_(0, nmax)
        s, m, e = _affine_ls(x, a, L, sw, sx)
        if best_e is None:
            best_s, best_m, best_e = s, m, e
        else:
            better = e < best_e
            best_s, best_m, best_e = (torch.where(better, s, best_s), torch.where(better, m, best_m),
                                      torch.where(better, e, best_e))
    for _ in range(refine):
        L = _codes_affine(x, best_s, best_m, nmax)
        s, m, e = _affine_ls(x, a, L, sw, sx)
        better = e < best_e
        best_s, best_m, best_e = (torch.where(better, s, best_s), torch.where(better, m, best_m),
                                  torch.where(better, e, best_e))
    return best_s, best_m


def _codes_affine(x, s, m, nmax):
    inv = torch.where(s > 0, 1 / s.clamp(min=1e-30), torch.zeros_like(s))
    return ((x - m[:, None]) * inv[:, None]).round_().clamp_(0, nmax)


def _q4_k_error(x, a, d, dmin, sc, mq):
    """Codes and weighted error of super-blocks x (N, 8, 32) for given d, dmin (N,) and 6-bit sc, mq (N, 8)."""
    s = (d[:, None] * sc).reshape(-1)
    m = -(dmin[:, None] * mq).reshape(-1)
    xs = x.reshape(-1, 32)
    L = _codes_affine(xs, s, m, 15)
    r = s[:, None] * L + m[:, None] - xs
    err = (a.reshape(-1, 32) * r * r).sum(1).view(x.shape[0], 8).sum(1)
    return L.view(x.shape), err


def _six_bits(v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    inv = torch.where(step > 0, 1 / step.clamp(min=1e-30), torch.zeros_like(step))
    return (v * inv[:, None]).round_().clamp_(0, 63)


def _q4_k(x_flat: torch.Tensor, a_flat: torch.Tensor) -> torch.Tensor:
    N = x_flat.shape[0]
    x, a = x_flat.view(N, 8, 32), a_flat.view(N, 8, 32)
    s, m = _fit_affine(x.reshape(-1, 32), a.reshape(-1, 32), 15)
    s, mins = s.view(N, 8), (-m).view(N, 8)
    d, dmin = _f16(s.amax(1) / 63), _f16(mins.amax(1) / 63)
    sc, mq = _six_bits(s, d), _six_bits(mins, dmin)
    L, err = _q4_k_error(x, a, d, dmin, sc, mq)
    for _ in range(2):
        # d and dmin by least squares over the super-block, given the codes and sub-scales
        u, v = sc[:, :, None] * L, mq[:, :, None].expand_as(L)
        suu, svv, suv = (a * u * u).sum((1, 2)), (a * v * v).sum((1, 2)), (a * u * v).sum((1, 2))
        sux, svx = (a * u * x).sum((1, 2)), (a * v * x).sum((1, 2))
        det = suu * svv - suv * suv
        ok = det > 1e-30 * suu * svv
        det = torch.where(ok, det, torch.ones_like(det))
        d2 = torch.where(ok, (sux * svv - svx * suv) / det, d).clamp(min=0)
        dmin2 = torch.where(ok, (sux * suv - svx * suu) / det, dmin).clamp(min=0)
        d2, dmin2 = _f16(d2), _f16(dmin2)
        L2, err2 = _q4_k_error(x, a, d2, dmin2, sc, mq)
        better = err2 < err
        d, dmin = torch.where(better, d2, d), torch.where(better, dmin2, dmin)
        L, err = torch.where(better[:, None, None], L2, L), torch.where(better, err2, err)
        # each sub-block's scale and minimum for these codes, on the super-block's 6-bit steps
        sw, sx = a.reshape(-1, 32).sum(1), (a * x).reshape(-1, 32).sum(1)
        s3, m3, _ = _affine_ls(x.reshape(-1, 32), a.reshape(-1, 32), L.reshape(-1, 32), sw, sx)
        sc3, mq3 = _six_bits(s3.view(N, 8), d), _six_bits((-m3).view(N, 8), dmin)
        L3, err3 = _q4_k_error(x, a, d, dmin, sc3, mq3)
        better = err3 < err
        sc, mq = torch.where(better[:, None], sc3, sc), torch.where(better[:, None], mq3, mq)
        L, err = torch.where(better[:, None, None], L3, L), torch.where(better, err3, err)
    return pack_q4_k(d, dmin, sc, mq, L.view(N, QK_K))


def pack_q4_k(d, dmin, sc, mq, L) -> torch.Tensor:
    """Q4_K blocks (N, 144) of half d, dmin (N,), 6-bit sub-scales and minimums (N, 8) and codes (N, 256)."""
    N = d.shape[0]
    sc, mq, L = sc.to(torch.uint8), mq.to(torch.uint8), L.to(torch.uint8)
    scales = torch.empty((N, 12), dtype=torch.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mq[:, :4] | ((mq[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mq[:, 4:] & 15) << 4)
    Lp = L.view(N, 4, 2, 32)
    qs = (Lp[:, :, 0] | (Lp[:, :, 1] << 4)).reshape(N, 128)
    return torch.cat([_half_bytes(d), _half_bytes(dmin), scales, qs], dim=1)


# -- Q6_K -------------------------------------------------------------------------------------------


def _fit_symmetric(x: torch.Tensor, a: torch.Tensor, nmax: int = 32, steps: int = 18, refine: int = 2):
    """Per row of x (N, n): a signed scale s with codes L = round(x / s) in -nmax..nmax-1, by a search of
    inverse scales around -nmax / (the value of largest magnitude), each with the least-squares scale."""
    idx = x.abs().argmax(1, keepdim=True)
    vmax = x.gather(1, idx).squeeze(1)
    vmax = torch.where(vmax != 0, vmax, torch.ones_like(vmax))
    sxx = (a * x * x).sum(1)
    best_s, best_e = None, None

    def keep(L):
        nonlocal best_s, best_e
        aL = a * L
        sll, slx = (aL * L).sum(1), (aL * x).sum(1)
        s = slx / sll.clamp(min=1e-30)
        e = sxx - s * slx
        if best_e is None:
            best_s, best_e = s, e
        else:
            better = e < best_e
            best_s, best_e = torch.where(better, s, best_s), torch.where(better, e, best_e)

    for k in range(steps + 1):
        inv = -(nmax - 0.9 + 1.8 * k / steps) / vmax
        keep((x * inv[:, None]).round_().clamp_(-nmax, nmax - 1))
    for _ in range(refine):
        inv = torch.where(best_s != 0, 1 / torch.where(best_s != 0, best_s, torch.ones_like(best_s)),
                          torch.zeros_like(best_s))
        keep((x * inv[:, None]).round_().clamp_(-nmax, nmax - 1))
    return best_s


def _q6_k_error(x, a, d, sc):
    s = (d[:, None] * sc).reshape(-1)
    xs = x.reshape(-1, 16)
    inv = torch.where(s != 0, 1 / torch.where(s != 0, s, torch.ones_like(s)), torch.zeros_like(s))
    L = (xs * inv[:, None]).round_().clamp_(-32, 31)
    r = s[:, None] * L - xs
    return L.view(x.shape), (a.reshape(-1, 16) * r * r).sum(1).view(x.shape[0], 16).sum(1)


def _eight_bits(v: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    inv = torch.where(d != 0, 1 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    return (v * inv[:, None]).round_().clamp_(-128, 127)


def _q6_k(x_flat: torch.Tensor, a_flat: torch.Tensor) -> torch.Tensor:
    N = x_flat.shape[0]
    x, a = x_flat.view(N, 16, 16), a_flat.view(N, 16, 16)
    s = _fit_symmetric(x.reshape(-1, 16), a.reshape(-1, 16)).view(N, 16)
    smax = s.gather(1, s.abs().argmax(1, keepdim=True)).squeeze(1)
    d = _f16(smax / -128)
    sc = _eight_bits(s, d)
    L, err = _q6_k_error(x, a, d, sc)
    for _ in range(2):
        u = sc[:, :, None] * L
        suu, sux = (a * u * u).sum((1, 2)), (a * u * x).sum((1, 2))
        d2 = _f16(torch.where(suu > 0, sux / suu.clamp(min=1e-30), d))
        L2, err2 = _q6_k_error(x, a, d2, sc)
        better = err2 < err
        d, L, err = torch.where(better, d2, d), torch.where(better[:, None, None], L2, L), torch.where(better, err2, err)
        aL = a * L
        s3 = (aL * x).sum(2) / (aL * L).sum(2).clamp(min=1e-30)
        sc3 = _eight_bits(s3, d)
        L3, err3 = _q6_k_error(x, a, d, sc3)
        better = err3 < err
        sc, L, err = (torch.where(better[:, None], sc3, sc), torch.where(better[:, None, None], L3, L),
                      torch.where(better, err3, err))
    return pack_q6_k(d, sc, L.view(N, QK_K))


def pack_q6_k(d, sc, L) -> torch.Tensor:
    """Q6_K blocks (N, 210) of half d (N,), signed 8-bit sub-scales (N, 16) and codes -32..31 (N, 256)."""
    N = d.shape[0]
    q = (L + 32).to(torch.uint8).view(N, 2, 4, 32)  # (half, quarter, l)
    ql = torch.stack([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
                     dim=2).reshape(N, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql, qh.reshape(N, 64), scales, _half_bytes(d)], dim=1)


def weighted_error(w_OI: torch.Tensor, rows: torch.Tensor, ggml_type: str,
                   importance_I: torch.Tensor | None = None) -> float:
    """sum_l a_l (w - w^)^2 of blocks `rows` of `w_OI` (for the tests and the bench's comparisons)."""
    import gguf

    back = gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[ggml_type]).astype(np.float32)
    r = torch.from_numpy(back).view(w_OI.shape) - w_OI.to(torch.float32)
    a = torch.ones(w_OI.shape[1]) if importance_I is None else importance_I.to(torch.float32)
    return float((r * r * a).sum())
