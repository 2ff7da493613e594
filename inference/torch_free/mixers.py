"""The torch-free runner's token mixers other than grouped-query attention, as the engine's one-call step holds
them: DeepSeek's latent attention (`latent`), Qwen3-Next's Gated DeltaNet (`deltanet`) and DeepSeek-V4's
compressed attention with its hyper-connections and hash table (`compressed`, `hyper`), each read from the
store by a `inference.torch_free.runner.LeanModel` (which holds what they point into); and a sequence's
per-layer caches (`sequence_caches`): positions for the attention layers, the fixed-size state for the
linear ones (the convolution's last inputs and each value head's delta-rule state, float32, zeros before
the first token), DeepSeek-V4's window, pending tokens and entries. This module imports no torch."""

from __future__ import annotations

import ctypes

import numpy as np

from semoe.kernels import loader
from semoe.model import rope
from semoe.model.config import LATENT_NORM_EPS
from semoe.model.hf_names import hf_name
from storage.errors import BadInputError
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


def _floats(model, name: str) -> np.ndarray:
    """A float tensor of any shape from the store as float32, held by `model`; its rows read in turn."""
    t = model._tensor(name)
    a = np.ascontiguousarray(np.concatenate(list(model._rows(name))), dtype=np.float32).reshape(t.shape)
    model.held.append(a)
    return a


def _compressor(model, pre: str, rate: int, dim: int, overlap: bool, dense: str) -> loader.CompressorC:
    c = model.config
    return loader.CompressorC(model._linear([pre + "wkv"], dense, bias=False),
                              model._linear([pre + "wgate"], dense, bias=False),
                              _floats(model, hf_name(c, pre + "ape")).ctypes.data,
                              model._vector(pre + "norm.weight"), rate, dim, int(overlap))


def compressed(model, lay: int, dense: str) -> dict:
    """Layer `lay`'s DeepSeek-V4 parts as `loader.layer_parts` takes them: its attention (`Compressed`: the
    products dense as the others, the grouped output's groups of rows over its own memory), the
    hyper-connections around its two blocks, and its hash table where its router is hashed."""
    c, pre = model.config, f"layers.{lay}.attn."
    kind = c.kind(lay)
    # the grouped output as the engine holds it: int8 where stored so, else float (the modules multiply its
    # groups' rows as stored)
    wo_dense = dense if model._stored_int8(hf_name(c, pre + "wo_a.weight")) else "float"
    groups = loader.row_groups(model._linear([pre + "wo_a"], wo_dense, bias=False), c.o_groups)
    inv, scale = rope.inv_freq(_Spec(c, kind != "sliding"))
    index_inv, index_scale = rope.inv_freq(_Spec(c, True))
    model.held += [groups, inv, index_inv]
    v = loader.CompressedC(
        model._linear([pre + "wq_a"], dense, bias=False), model._linear([pre + "wq_b"], dense, bias=False),
        model._linear([pre + "wkv"], dense, bias=False), model._linear([pre + "wo_b"], dense, bias=False),
        loader.Lin(), loader.Lin(), ctypes.cast(groups, ctypes.POINTER(loader.Lin)),
        model._vector(pre + "q_norm.weight"), model._vector(pre + "norm.weight"), model._vector(pre + "attn_sink"),
        inv.ctypes.data, index_inv.ctypes.data, c.rms_norm_eps, scale, index_scale, c.sliding_window,
        len(inv), c.o_groups)
    if kind != "sliding":
        m = c.compress_rates[0 if kind == "csa" else 1]
        v.comp = _compressor(model, pre + "compressor.", m, c.head_dim, kind == "csa", dense)
    if kind == "csa":
        v.icomp = _compressor(model, pre + "indexer.compressor.", c.compress_rates[0], c.index_head_dim, True, dense)
        v.iwq = model._linear([pre + "indexer.wq_b"], dense, bias=False)
        v.iwp = model._linear([pre + "indexer.weights_proj"], dense, bias=False)
        v.Hi, v.Di, v.topk = c.index_heads, c.index_head_dim, c.index_topk
    model.held.append(v)
    table = None
    if c.hash_layers is not None and lay in c.hash_layers:
        name = hf_name(c, f"layers.{lay}.ffn.router.tid2eid")
        t = model._tensor(name)
        if t.dtype != "I64":
            raise BadInputError(f"{model.store.root}: {name} is {t.dtype}; a hash table is I64")
        ids = np.ascontiguousarray(model.store.read_bytes(name).view(np.int64).reshape(t.shape))
        model.held.append(ids)
        table = ids.ctypes.data
    return dict(v4=v, hc_attn=hyper(model, f"layers.{lay}.hc_attn."), hc_ffn=hyper(model, f"layers.{lay}.hc_ffn."),
                tid2eid=table)


class _Spec:
    """The rotary spec (`semoe.model.rope.inv_freq`'s) of DeepSeek-V4's sliding or compressed layers."""

    def __init__(self, c, compressed: bool) -> None:
        self.rope_dim = c.rope_dim
        self.rope_theta = c.compress_rope_theta if compressed else c.rope_theta
        self.rope_scaling = c.compress_rope_scaling if compressed else c.rope_scaling


def hyper(model, pre: str) -> loader.HyperC:
    """The hyper-connection under `pre` (a layer's "layers.N.hc_attn.", or the head's "hc_head.hc_"): its
    product float32, its base and scale."""
    fn = model._linear([], "float", bias=False, name=hf_name(model.config, pre + "fn"))
    return loader.HyperC(fn, model._vector(pre + "base"), model._vector(pre + "scale"))


def sequence_caches(c, capacity: int, kv: type) -> list[tuple[np.ndarray, np.ndarray]]:
    """A sequence's (k, v) a layer: (G, S, Dh) of `kv` values (latent attention: (S, L) and (S, R),
    float32), a linear layer's state (its convolution's (C, K-1) and the delta rule's (Hv, Dk, Dv)), or a
    DeepSeek-V4 layer's fixed state and entries (`MoEConfig.compressed_layout`), float32."""
    (_, *k), (_, *v) = c.kv_shapes(1, capacity)
    out = []
    for lay in range(c.num_layers):
        if c.attention == "compressed":
            fixed, row, comps = c.compressed_layout(lay)
            rows = capacity // comps[0][0] if comps else 0
            out.append((np.zeros(fixed, np.float32), np.zeros((max(rows, 1), row), np.float32)))
        elif c.is_linear(lay):
            (_, *conv), (_, *rec) = c.linear_state_shapes(1)
            out.append((np.zeros(conv, np.float32), np.zeros(rec, np.float32)))
        elif c.attention == "mla":  # the head axis of one dropped
            out.append((np.zeros(k[1:], np.float32), np.zeros(v[1:], np.float32)))
        else:
            out.append((np.zeros(k, kv), np.zeros(v, kv)))
    return out
