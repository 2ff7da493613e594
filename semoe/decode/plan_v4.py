"""DeepSeek-V4's parts of the one-call step (`semoe.decode.plan.DecodePlan._whole`): a layer's compressed
attention as decode_step.c's `Compressed` (its products, norms, sinks, rotary frequencies, compressors and
indexer), the hyper-connections as `Hyper`, and the grouped output projection's groups of rows, each its own
`Lin` over the weight's own memory where its layout allows."""

from __future__ import annotations

import ctypes

import torch

from semoe.decode.plan_parts import _ptr, _weight
from semoe.decode.support import NotOnFastPath
from semoe.kernels import loader, torch_ops
from semoe.model.compact_linear import CompactWeight, fp8_tile
from semoe.model.compressed_attention import CompressedAttention, Compressor
from semoe.model.hyper_connections import HyperConnection, HyperHead

_Lin = loader.Lin


def row_groups(w, groups: int, held: list) -> ctypes.Array:
    """The kernels' operands of `groups` equal blocks of rows of weight w (O, I) (`loader.row_groups`); int4's
    scales, laid out group-major over all O rows, copied per block. NotOnFastPath where a block does not
    start on the layout's row blocks."""
    lin, parts = _weight(w)
    held.append(parts)
    O, R = lin.O, lin.O // groups
    if lin.kind != loader.W_INT4:
        try:
            out = loader.row_groups(lin, groups)
        except ValueError as e:
            raise NotOnFastPath(f"a grouped output weight: {e}") from None
        held.append(out)
        return out
    if R % 64:
        raise NotOnFastPath(f"an int4 grouped output of {R} rows a group (blocks of 64)")
    out = (_Lin * groups)()
    for g in range(groups):
        scales = parts[1].view(-1, O, 2)[:, g * R:(g + 1) * R].contiguous()
        held.append(scales)
        out[g] = _Lin(lin.kind, R, lin.I, lin.g, lin.w + g * R * lin.I // 2, _ptr(scales), None)
    held.append(out)
    return out


def _vec(t: torch.Tensor, held: list) -> int:
    t = torch_ops._f32(t.detach())
    held.append(t)
    return _ptr(t)


def _lin(module, held: list) -> _Lin:
    lin, parts = _weight(module.weight)
    held.append(parts)
    return lin


def _compressor(comp: Compressor, held: list) -> loader.CompressorC:
    return loader.CompressorC(_lin(comp.wkv, held), _lin(comp.wgate, held), _vec(comp.ape, held),
                              _vec(comp.norm.weight, held), comp.rate, comp.dim, int(comp.overlap))


def compressed(a: CompressedAttention, held: list) -> loader.CompressedC:
    """decode_step.c's `Compressed` of a layer (the caller holds `held` while the Net is used)."""
    c = a.config
    if isinstance(a.wo_a.weight, CompactWeight) and a.wo_a.weight.spec.scheme == "fp8" and not fp8_tile(a.wo_a.weight.spec):
        raise NotOnFastPath(f"layer {a.layer}: an FP8 grouped output with scales the kernel does not take")
    groups = row_groups(a.wo_a.weight, c.o_groups, held)
    v = loader.CompressedC(
        _lin(a.wq_a, held), _lin(a.wq_b, held), _lin(a.wkv, held), _lin(a.wo_b, held), _Lin(), _Lin(),
        ctypes.cast(groups, ctypes.POINTER(_Lin)), _vec(a.q_norm.weight, held), _vec(a.norm.weight, held),
        _vec(a.attn_sink, held), _vec(torch.from_numpy(a.inv_freq), held),
        _vec(torch.from_numpy(a.index_inv_freq), held), c.rms_norm_eps, a.rope_scale, a.index_scale,
        c.sliding_window, len(a.inv_freq), c.o_groups)
    if a.compressor is not None:
        v.comp = _compressor(a.compressor, held)
    if a.indexer is not None:
        ix = a.indexer
        v.icomp = _compressor(ix.compressor, held)
        v.iwq, v.iwp = _lin(ix.wq_b, held), _lin(ix.weights_proj, held)
        v.Hi, v.Di, v.topk = ix.heads, ix.dim, ix.topk
    held.append(v)
    return v


def hyper(h: HyperConnection | HyperHead, held: list) -> loader.HyperC:
    """decode_step.c's `Hyper` of a hyper-connection or of the head's."""
    fn, base, scale = (h.fn, h.base, h.scale) if isinstance(h, HyperConnection) else (h.hc_fn, h.hc_base, h.hc_scale)
    fn = torch_ops._f32(fn.detach())
    held.append(fn)
    return loader.HyperC(_weight(fn)[0], _vec(base, held), _vec(scale, held))


def hash_table(router, held: list) -> int | None:
    """The address of a hash-routed layer's table (vocabulary, top_k) of int64; None for a learned router."""
    if not getattr(router, "hashed", False):
        return None
    t = router.tid2eid.detach().to(torch.int64).contiguous()
    held.append(t)
    return _ptr(t)
