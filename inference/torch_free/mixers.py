"""The torch-free runner's token mixers other than grouped-query attention, as the engine's one-call step holds
them: DeepSeek's latent attention (`latent`) and Qwen3-Next's Gated DeltaNet (`deltanet`), each read from the
store by a `inference.torch_free.runner.LeanModel` (which holds what they point into); and a sequence's
per-layer caches (`sequence_caches`): positions for the attention layers, the fixed-size state for the
linear ones (the convolution's last inputs and each value head's delta-rule state, float32, zeros before
the first token). This module imports no torch."""

from __future__ import annotations

import numpy as np

from semoe.kernels import loader
from semoe.model import rope
from semoe.model.config import LATENT_NORM_EPS
from semoe.model.hf_names import hf_name
from storage.numpy_codecs import float_rows

# a linear layer's input products by the config's layout (`semoe.model.linear_attention.GatedDeltaNet`)
INPUTS = {"qkvz": ("in_proj_qkvz", "in_proj_ba"), "split": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}


def latent(model, lay: int, dense: str) -> loader.LatentC:
    """Layer `lay`'s latent attention (`semoe.decode.plan`'s): its products dense as the others, kv_b read
    as float32 and split into its absorbed halves, w_ukT (H, L, nope) and w_uv (H, dv, L)."""
    c, pre = model.config, f"layers.{lay}.attn."
    H, nope, L, dv = c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank, c.v_head_dim
    if c.q_lora_rank is None:
        q_a, q_norm, q_b = loader.Lin(), None, model._linear([pre + "q_proj"], dense, bias=False)
    else:
        q_a, q_norm = model._linear([pre + "q_a_proj"], dense), model._vector(pre + "q_a_layernorm.weight")
        q_b = model._linear([pre + "q_b_proj"], dense, bias=False)
    kv_a, kv_norm = model._linear([pre + "kv_a_proj_with_mqa"], dense), model._vector(pre + "kv_a_layernorm.weight")
    w_HdL = np.concatenate(list(model._rows(hf_name(c, pre + "kv_b_proj.weight")))).reshape(H, nope + dv, L)
    w_ukT, w_uv = np.ascontiguousarray(w_HdL[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(w_HdL[:, nope:])
    m = loader.LatentC(q_a, q_b, kv_a, q_norm, kv_norm, LATENT_NORM_EPS, rope.softmax_scale(c),
                       w_ukT.ctypes.data, w_uv.ctypes.data, nope, L, dv, int(c.rope_interleave))
    ix = None
    if c.indexes(lay):  # DeepSeek sparse attention's indexer: its products dense as the others
        ix = loader.IndexerC(*(model._linear([pre + f"indexer.{p}"], dense, bias=False)
                               for p in ("wq_b", "wk", "weights_proj")),
                             model._vector(pre + "indexer.k_norm.weight"), model._vector(pre + "indexer.k_norm.bias"),
                             c.index_heads, c.index_head_dim, int(c.index_rope_interleave))
    loader.sparse_attention(m, c, ix)
    model.held += [w_ukT, w_uv, m, ix]
    return m


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
