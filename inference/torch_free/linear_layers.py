"""The torch-free runner's Gated DeltaNet layers (Qwen3-Next, Qwen3.5-MoE): each one's `DeltaNetC` from the
store, and a sequence's per-layer caches, positions for the attention layers and the fixed-size state for
the linear ones (the convolution's last inputs and each value head's delta-rule state, float32, zeros
before the first token). This module imports no torch."""

from __future__ import annotations

import numpy as np

from semoe.kernels import loader
from semoe.model.hf_names import hf_name
from storage.numpy_codecs import float_rows

# a linear layer's input products by the config's layout (`semoe.model.linear_attention.GatedDeltaNet`)
INPUTS = {"qkvz": ("in_proj_qkvz", "in_proj_ba"), "split": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}


def deltanet(model, lay: int, dense: str) -> loader.DeltaNetC:
    """Layer `lay`'s Gated DeltaNet as the engine's one-call step holds it: its input products dense as the
    others, its convolution's weight (C, K), dt_bias, A_log and norm as float32 (held by `model`)."""
    c, pre = model.config, f"layers.{lay}.attn."
    ins = [model._linear([pre + n], dense, bias=False) for n in INPUTS[c.linear_layout]]
    name = hf_name(c, pre + "conv1d.weight")
    t = model._tensor(name)
    conv = np.ascontiguousarray(float_rows(model.store.read_bytes(name), t.dtype), dtype=np.float32)
    conv = conv.reshape(t.shape[0], t.shape[-1])
    model.held.append(conv)
    d = loader.deltanet(c, ins, conv.ctypes.data, model._vector(pre + "dt_bias"), model._vector(pre + "A_log"),
                        model._vector(pre + "norm.weight"))
    model.held.append(d)
    return d


def sequence_caches(c, capacity: int, kv: type) -> list[tuple[np.ndarray, np.ndarray]]:
    """A sequence's (k, v) a layer: (G, S, Dh) of `kv` values (latent attention: (S, L) and (S, R),
    float32), or a linear layer's state (its convolution's (C, K-1) and the delta rule's (Hv, Dk, Dv))."""
    (_, *k), (_, *v) = c.kv_shapes(1, capacity)
    out = []
    for lay in range(c.num_layers):
        if c.is_linear(lay):
            (_, *conv), (_, *rec) = c.linear_state_shapes(1)
            out.append((np.zeros(conv, np.float32), np.zeros(rec, np.float32)))
        elif c.attention == "mla":  # the head axis of one dropped
            out.append((np.zeros(k[1:], np.float32), np.zeros(v[1:], np.float32)))
        else:
            out.append((np.zeros(k, kv), np.zeros(v, kv)))
    return out
