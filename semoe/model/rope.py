"""Rotary frequencies, plain RoPE, YaRN or Llama-3's scaling, computed once for the model's modules
(`semoe.model.attention`) and the torch-free runner (`inference.torch_free.runner`) alike: numpy,
float32, no torch.

YaRN (Peng et al. 2023) as transformers computes it: the low-frequency dims interpolated by the
scaling factor, the high-frequency ones kept, a linear ramp between, and cos and sin scaled by an
attention factor (mscale)."""

from __future__ import annotations

import math

import numpy as np


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def inv_freq(config) -> tuple[np.ndarray, float]:
    """Inverse frequencies (R/2,) float32 of the rotary dims of config `c` (a `semoe.model.config.MoEConfig`:
    `rope_dim`, `rope_theta`, `rope_scaling`), and the scale of cos and sin."""
    dim, base = config.rope_dim, config.rope_theta
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    s = config.rope_scaling
    if s is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    if s.get("rope_type") == "llama3":
        return _llama3(s, (np.float32(1.0) / pos_freqs).astype(np.float32)), 1.0
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = np.float32(1) - ramp
    inv = (np.float32(1.0) / (np.float32(factor) * pos_freqs)) * (np.float32(1) - extrapolation) \
        + (np.float32(1.0) / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention_factor)


def _llama3(s: dict, inv: np.ndarray) -> np.ndarray:
    """Llama-3's (and Llama-4's) scaling of plain frequencies: wavelengths past the original context
    over `low_freq_factor` divided by `factor`, those under it over `high_freq_factor` kept, a
    linear blend between, as transformers computes it (float32)."""
    factor, low, high = (np.float32(s[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    original = np.float32(s["original_max_position_embeddings"])
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > original / low, inv / factor, inv).astype(np.float32)
    smooth = (original / wavelen - low) / (high - low)
    blended = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def cos_sin(pos: int, inv_freq_r: np.ndarray, scale: float, cos_R: np.ndarray, sin_R: np.ndarray) -> None:
    """The rotary tables of position `pos` into `cos_R` and `sin_R` (float32, rope_dim each), from
    `inv_freq`'s frequencies and scale: the same float32 operations as the torch model's
    `semoe.model.attention.rope_tables`, which keeps its own for tensors on the device (numpy's cos
    and sin may differ from torch's in the last bit)."""
    f = np.float32(pos) * inv_freq_r
    both = np.concatenate((f, f))
    np.cos(both, out=cos_R)
    np.sin(both, out=sin_R)
    if scale != 1.0:  # YaRN's attention factor
        cos_R *= np.float32(scale)
        sin_R *= np.float32(scale)


def softmax_scale(config) -> float:
    """Attention's softmax scale: 1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2 in
    latent attention."""
    scale = config.head_dim ** -0.5
    s = config.rope_scaling
    if config.attention == "mla" and s and s.get("mscale_all_dim"):
        m = _mscale(float(s["factor"]), float(s["mscale_all_dim"]))
        scale *= m * m
    return scale
