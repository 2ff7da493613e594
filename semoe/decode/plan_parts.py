"""The decoding plan's parts (`semoe.decode.plan.DecodePlan`): one weight's product by the kernels
(`_Product`, its operands `_weight`), a norm (`_Norm`), and a layer's attention step from the normed
row to the output product, grouped-query (`_GQA`) or latent (`_MLA`, with DeepSeek sparse attention's
indexer), with the one-call step's `Latent` of an `_MLA` (`_latent`)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from semoe.kernels import loader, torch_ops
from semoe.model.attention import Attention, KVCache, LatentAttention, RMSNorm, apply_rope, unit_rms
from semoe.model.linear_attention import GatedDeltaNet
from semoe.model.compact_linear import CompactWeight, fp8_tile
from semoe.decode.support import NotOnFastPath

DecodePlan = Any  # semoe.decode.plan.DecodePlan, whose buffers the steps use (it imports this module)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


_KINDS = {torch.float32: loader.W_F32, torch.bfloat16: loader.W_BF16, "int8": loader.W_INT8,
          "int4": loader.W_INT4, "mxfp4": loader.W_MXFP4, "fp8": loader.W_FP8, "ggml": loader.W_GGML}
_IO_KINDS = {torch.float32: loader.W_F32_IO, torch.bfloat16: loader.W_BF16_IO}  # float weights (I, O)
_Lin = loader.Lin


def _weight(w: torch.Tensor | CompactWeight, *, in_out: bool = False) -> tuple[_Lin, tuple[torch.Tensor, ...]]:
    """The kernels' operands of one weight (O, I) as `compact_linear.linear` multiplies one row by it
    on CPU, and the tensors they point into (the caller holds them as long as it uses the operands:
    the plan is built for one generation, over weights that stay where they are). `in_out`: the
    logical weight is (I, O), as gpt-oss's experts (compact codes are out-major all the same; float
    ones are taken in-major as they are)."""
    if isinstance(w, CompactWeight):
        scheme = w.spec.scheme
        if w.kernel != "auto" or w.codes.device.type != "cpu" or scheme not in _KINDS or w.spec.transposed != in_out:
            raise NotOnFastPath(f"a {scheme} weight with the {w.kernel!r} kernel on {w.codes.device}")
        if scheme == "fp8" and not fp8_tile(w.spec):
            raise NotOnFastPath(f"an fp8 weight with scales per {w.spec.block} block: the kernel takes square tiles")
        if scheme == "ggml":  # a GGUF file's rows of blocks, their scales inside
            O, I = w.spec.out_in
            return _Lin(loader.W_GGML, O, I, loader.ggml_type_id(w.spec.ggml_type), _ptr(w.codes), None, None), (w.codes,)
        # kept: the kernel reads them every step (MXFP4's exponents as they are)
        held = (w.codes, w.scales if scheme == "mxfp4" else torch_ops._f32(w.scales))
        O, I = w.codes.shape[0], w.codes.shape[1] * {"int8": 1, "int4": 2, "mxfp4": 32, "fp8": 1}[scheme]
        g = (w.spec.group_size or 0) if scheme == "int4" else fp8_tile(w.spec) if scheme == "fp8" else 0
        return _Lin(_KINDS[scheme], O, I, g, _ptr(held[0]), _ptr(held[1]), None), held
    if isinstance(w, torch.Tensor) and w.dtype in (torch.float32, torch.bfloat16) and w.dim() == 2 \
            and w.device.type == "cpu" and w.is_contiguous():
        if in_out:
            return _Lin(_IO_KINDS[w.dtype], w.shape[1], w.shape[0], 0, _ptr(w), None, None), (w,)
        return _Lin(_KINDS[w.dtype], w.shape[0], w.shape[1], 0, _ptr(w), None, None), (w,)
    raise NotOnFastPath(f"a weight of {type(w).__name__} {getattr(w, 'dtype', '')}")


class _Product:
    """y (O,) = x (I,) @ W.T (+ bias) for one linear module's weight, with the kernel call and
    operands `compact_linear.linear` uses for one row on CPU (`_weight`); a weight the kernels do
    not take (FP8 with non-square blocks, a transposed layout) goes through the module's own call (`lin`
    is then None)."""

    def __init__(self, lib: ctypes.CDLL, module: nn.Module, *, bias: bool = True) -> None:
        self.module = module
        w = module.weight
        self.O = w.shape[0]
        try:
            self.lin, self.held = _weight(w)
        except NotOnFastPath:
            self.lin, self.held = None, ()
            self._call = None
            return
        self.bias = getattr(module, "bias", None) if bias else None
        if self.bias is not None:
            if self.bias.dtype != torch.float32 or not self.bias.is_contiguous():
                raise NotOnFastPath("a bias that is not contiguous float32")
            self.lin.bias = _ptr(self.bias)
        kind, O, I, g, wp, sp = (getattr(self.lin, f) for f in ("kind", "O", "I", "g", "w", "s"))
        if kind == _KINDS["mxfp4"]:
            self._call = lambda x, y, t: lib.gemv_mxfp4(x, wp, sp, y, 1, O, I, t)
        elif kind == _KINDS["int8"]:
            self._call = lambda x, y, t: lib.gemv_i8(x, wp, sp, y, 1, O, I, t)
        elif kind == _KINDS["int4"]:
            self._call = lambda x, y, t: lib.gemv_i4(x, wp, sp, y, 1, O, I, g, t)
        elif kind == _KINDS["fp8"]:
            self._call = lambda x, y, t: lib.gemv_fp8(x, wp, sp, y, 1, O, I, g, t)
        elif kind == _KINDS["ggml"]:  # the bias added below, as the others'
            bare = ctypes.byref(_Lin(kind, O, I, g, wp, None, None))
            self._call = lambda x, y, t: lib.lin_rows(bare, x, 1, y, t)
        else:
            fn = lib.gemv_f32 if kind == _KINDS[torch.float32] else lib.gemv_bf16
            self._call = lambda x, y, t: fn(x, wp, y, 1, O, I, t)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, threads: int, x_ptr: int | None = None,
                 y_ptr: int | None = None) -> None:
        """y = x @ W.T (+ bias): x and y contiguous float32 views of I and O values (`x_ptr`, `y_ptr`
        their addresses where the caller has them)."""
        if self._call is None:
            y.copy_(self.module(x[None])[0])
            return
        self._call(x.data_ptr() if x_ptr is None else x_ptr, y.data_ptr() if y_ptr is None else y_ptr, threads)
        if self.bias is not None:
            y.add_(self.bias)  # the module's y + bias, in place


class _Norm:
    """An `RMSNorm` of one row (or of `rows` rows of its width) by the kernel, in place or not; a zero-centred
    one (`plus_one`) by its weight plus one, made once (its scale in the module's float32)."""

    def __init__(self, lib: ctypes.CDLL, norm: RMSNorm) -> None:
        if norm.weight.dtype != torch.float32:
            raise NotOnFastPath(f"a norm weight of {norm.weight.dtype}")
        w = (norm.weight.detach() + 1).contiguous() if norm.plus_one else norm.weight
        self.weight, self.eps = w, norm.eps
        wp, eps, D = w.data_ptr(), norm.eps, w.numel()
        self.call = lambda x, out, rows=1: lib.rmsnorm_f32(x, wp, eps, out, rows, D)


class _GQA:
    """A grouped-query `Attention` layer's step from the normed row h to the output product's tmp."""

    def __init__(self, plan: "DecodePlan", lib: ctypes.CDLL, a: Attention) -> None:
        c = a.config
        self.lib, self.layer = lib, a.layer
        projs = [a.qkv_proj] if a.qkv_proj is not None else [a.q_proj, a.k_proj, a.v_proj]
        # with the output gate, the products land in plan.qg (each head's query, then its gate; k; v)
        self.gated = a.gated
        out = plan.qg if a.gated else plan.qkv
        self.qkv, start = [], 0
        for p in projs:
            prod = _Product(lib, p)
            if start + prod.O > out.numel():
                raise NotOnFastPath(f"layer {a.layer}: q, k and v of more than {out.numel()} outputs")
            self.qkv.append((prod, out[start:start + prod.O], _ptr(out) + 4 * start))
            start += prod.O
        if start != out.numel():
            raise NotOnFastPath(f"layer {a.layer}: q, k and v of {start} outputs")
        self.qk_norm = c.qk_norm
        weighted = c.qk_norm not in ("none", "unit_after_rope")
        self.norms = (_Norm(lib, a.q_norm), _Norm(lib, a.k_norm)) if weighted else None
        self.clip = c.clip_qkv
        self.window, self.chunk, self.rotates = a.window or 0, a.chunk, a.rotates
        self.sinks = None
        if c.attention_sinks:
            if a.sinks.dtype != torch.float32 or not a.sinks.is_contiguous():
                raise NotOnFastPath(f"layer {a.layer}: attention sinks that are not contiguous float32")
            self.sinks = a.sinks
        self.o_proj = _Product(lib, a.o_proj)
        self.scale = c.head_dim ** -0.5

    def __call__(self, plan: "DecodePlan", cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                 threads: int) -> None:
        c = plan.config
        H, G, Dh = c.num_heads, c.num_kv_heads, c.head_dim
        for prod, y, yp in self.qkv:
            prod(plan.h, y, threads, plan.hp, yp)
        if self.gated:  # each head's query, then its gate: the one-call step's unpacking
            self.lib.gate_unpack(H, G, Dh, plan.qgp, plan.qp, plan.gatep)
        if self.norms is not None and self.qk_norm == "full":  # the module's order: norms, then clipping
            self.norms[0].call(plan.qp, plan.qp)
            self.norms[1].call(plan.kp, plan.kp)
        if self.clip is not None:
            plan.qkv.clamp_(-self.clip, self.clip)
        if self.norms is not None and self.qk_norm == "head":
            self.norms[0].call(plan.qp, plan.qp, H)
            self.norms[1].call(plan.kp, plan.kp, G)
        R = cos.numel()
        if not self.rotates:  # Llama-4's position-free layers: no rotation, q times its temperature
            R = 0
            if c.attn_temperature is not None:  # the module's ops on the same values
                attn_scale, floor_scale = c.attn_temperature
                p = torch.tensor([float(pos)])
                plan.q.mul_(torch.log1p(torch.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0)
        elif c.rope_interleave or self.qk_norm in ("head_after_rope", "unit_after_rope"):
            qk = plan.qkv[:(H + G) * Dh].view(1, H + G, 1, Dh)  # rotated here, as the module does, then normed
            qk.copy_(apply_rope(qk, cos.view(1, 1, R), sin.view(1, 1, R), interleave=c.rope_interleave))
            if self.qk_norm == "head_after_rope":
                self.norms[0].call(plan.qp, plan.qp, H)
                self.norms[1].call(plan.kp, plan.kp, G)
            elif self.qk_norm == "unit_after_rope":
                qk.copy_(unit_rms(qk, c.rms_norm_eps))
            R = 0
        # a chunk as the window that reaches back to its first position, for this one query
        window = pos % self.chunk + 1 if self.chunk else self.window
        self.lib.attend_decode_f32(plan.qp, plan.kp, plan.vp, _ptr(cos), _ptr(sin), _ptr(cache.k[self.layer]),
                                   _ptr(cache.v[self.layer]), H, G, Dh, R, cache.capacity, pos, window,
                                   self.scale, None if self.sinks is None else _ptr(self.sinks), plan.attp, threads)
        if self.gated:
            self.lib.gate_apply(plan.attp, plan.gatep, H * Dh)  # out * sigmoid(gate)
        self.o_proj(plan.att, plan.tmp, threads, plan.attp, plan.tmpp)


class _MLA:
    """A `LatentAttention` layer's step in the absorbed form, over the latent cache the module path
    fills (the normed latent and the rotated rotary key per position): with W_UK and W_UV kv_b's key
    and value halves per head, q's no-rope part is taken into the latent space once (W_UK^T q_nope),
    the scores are that against the cached latents plus the rotary parts' product, and each head's
    values are summed in the latent space and taken out by W_UV. The module path expands K and V for
    every cached position at every step; this reads kv_b once. Every product is a kernel call
    (per-head products: `gemv_f32_heads`; against the cache: `gemv_f32`, `gemv_f32_io`). kv_b's
    halves are kept as float32 (dequantized where the weight is compact): 4 bytes for each of its
    weights, beside the weight."""

    def __init__(self, plan: "DecodePlan", lib: ctypes.CDLL, a: LatentAttention) -> None:
        c = a.config
        self.lib, self.layer, self.config, self.scale = lib, a.layer, c, a.scale
        H, nope, rope, L, dv = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        if c.q_lora_rank is None:
            self.q_a = self.q_a_norm = None
            self.q = _Product(lib, a.q_proj)
        else:
            self.q_a, self.q_a_norm = _Product(lib, a.q_a_proj), _Norm(lib, a.q_a_layernorm)
            self.q = _Product(lib, a.q_b_proj)
            self.qa = torch.empty(c.q_lora_rank)
        self.kv_a, self.kv_norm = _Product(lib, a.kv_a_proj_with_mqa), _Norm(lib, a.kv_a_layernorm)
        self.o_proj = _Product(lib, a.o_proj)
        w = a.kv_b_proj.weight
        w = w.dequantize(torch.float32) if isinstance(w, CompactWeight) else w.detach().to(torch.float32)
        w_HdL = w.reshape(H, nope + dv, L)
        self.w_ukT = w_HdL[:, :nope].transpose(1, 2).contiguous()  # (H, L, nope): q_nope into the latent space
        self.w_uv = w_HdL[:, nope:].contiguous()  # (H, dv, L): a head's latent sum out to its values
        self.qbuf, self.kv = torch.empty(H * (nope + rope)), torch.empty(L + rope)
        self.q_nope, self.q_rot, self.q_lat = torch.empty(H, nope), torch.empty(H, rope), torch.empty(H, L)
        self.o_lat, self.att = torch.empty(H, L), torch.empty(H * dv)
        self.scores = self.rot_scores = torch.empty(0)
        # DeepSeek sparse attention: the layer's indexer (its products by the kernels, its key's norm and
        # its choice by the module's ops), or None where it reads the choice of the last layer with one
        self.indexer = a.indexer if c.index_topk is not None else None
        if self.indexer is not None:
            ix = self.indexer
            self.iq, self.ik, self.iw = (_Product(lib, m) for m in (ix.wq_b, ix.wk, ix.weights_proj))
            self.iq_buf, self.ik_buf = torch.empty(c.index_heads * c.index_head_dim), torch.empty(c.index_head_dim)
            self.iw_buf = torch.empty(c.index_heads)

    def __call__(self, plan: "DecodePlan", cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                 threads: int) -> None:
        c, lib = self.config, self.lib
        H, nope, rope, L, dv = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        if self.q_a is None:
            self.q(plan.h, self.qbuf, threads, plan.hp)
        else:
            self.q_a(plan.h, self.qa, threads, plan.hp)
            qa = _ptr(self.qa)
            self.q_a_norm.call(qa, qa)
            self.q(self.qa, self.qbuf, threads, qa)
        self.kv_a(plan.h, self.kv, threads, plan.hp)
        kvp = _ptr(self.kv)
        self.kv_norm.call(kvp, kvp)
        q_HQ = self.qbuf.view(H, nope + rope)
        cos_11R, sin_11R = cos.view(1, 1, -1), sin.view(1, 1, -1)
        self.q_rot.copy_(apply_rope(q_HQ[None, :, None, nope:], cos_11R, sin_11R, interleave=c.rope_interleave)
                         .view(H, rope))
        k_rot = apply_rope(self.kv[L:].view(1, 1, 1, rope), cos_11R, sin_11R, interleave=c.rope_interleave)
        latents, rots = cache.k[self.layer][0, 0], cache.v[self.layer][0, 0]  # (S, L), (S, R) (+ Di under DSA)
        latents[pos] = self.kv[:L]
        rots[pos, :rope] = k_rot.view(rope)
        S = pos + 1
        if c.index_topk is not None:  # the positions this query reads, gathered in order
            chosen = self._choose(plan, rots, pos, cos_11R, sin_11R, threads)
            latents, rots, S = latents[chosen].contiguous(), rots[chosen, :rope].contiguous(), len(chosen)
        if self.scores.numel() < H * S:  # room for the cache's positions, made as the sequence grows
            self.scores, self.rot_scores = torch.empty(H * cache.capacity), torch.empty(H * cache.capacity)
        scores, rot_scores = self.scores[:H * S].view(H, S), self.rot_scores[:H * S].view(H, S)
        self.q_nope.copy_(q_HQ[:, :nope])
        lib.gemv_f32_heads(_ptr(self.q_nope), _ptr(self.w_ukT), _ptr(self.q_lat), H, L, nope, threads)
        lib.gemv_f32(_ptr(self.q_lat), _ptr(latents), _ptr(scores), H, S, L, threads)
        lib.gemv_f32(_ptr(self.q_rot), _ptr(rots), _ptr(rot_scores), H, S, rope, threads)
        probs = torch.softmax(scores.add_(rot_scores).mul_(self.scale), dim=-1)
        lib.gemv_f32_io(_ptr(probs), _ptr(latents), _ptr(self.o_lat), H, L, S, threads)
        lib.gemv_f32_heads(_ptr(self.o_lat), _ptr(self.w_uv), _ptr(self.att), H, dv, L, threads)
        self.o_proj(self.att, plan.tmp, threads, None, plan.tmpp)

    def _choose(self, plan: "DecodePlan", rots: torch.Tensor, pos: int, cos_11R: torch.Tensor,
                sin_11R: torch.Tensor, threads: int) -> torch.Tensor:
        """DeepSeek sparse attention's positions for the query at pos (their indices, in order): the
        indexer's key written after the rotary key at pos, then its choice among positions 0..pos
        (`Indexer.choose`); a layer without an indexer writes zeros there and reads the choice of the
        last layer with one (`plan.chosen`)."""
        rope, ix = self.config.qk_rope_head_dim, self.indexer
        if ix is None:
            rots[pos, rope:] = 0.0
            return plan.chosen
        self.iq(self.qa, self.iq_buf, threads)
        self.ik(plan.h, self.ik_buf, threads, plan.hp)
        self.iw(plan.h, self.iw_buf, threads, plan.hp)
        rots[pos, rope:] = ix.rotate(ix.k_norm(self.ik_buf).view(1, 1, 1, -1), cos_11R, sin_11R).view(-1)
        keys = rots[:pos + 1, rope:].view(1, 1, pos + 1, -1)
        chosen = ix.choose(self.iq_buf.view(1, 1, -1), self.iw_buf.view(1, 1, -1), keys, cos_11R, sin_11R, pos)
        plan.chosen = chosen[0, 0].nonzero()[:, 0]
        return plan.chosen


def _latent(a: _MLA, layer: int) -> loader.LatentC:
    """decode_step.c's `Latent` of an `_MLA` step: its products, norms and absorbed kv_b halves (the
    caller holds the result, and the `_MLA`, while the Net is used)."""
    c = a.config
    if any(p is not None and p.lin is None for p in (a.q_a, a.q, a.kv_a)):
        raise NotOnFastPath(f"layer {layer}: latent attention weights the one-call step does not take")
    if a.q_a_norm is not None and a.q_a_norm.eps != a.kv_norm.eps:
        raise NotOnFastPath(f"layer {layer}: query and latent norms of different epsilons")
    latent = loader.LatentC(
        a.q_a.lin if a.q_a is not None else _Lin(), a.q.lin, a.kv_a.lin,
        None if a.q_a_norm is None else _ptr(a.q_a_norm.weight), _ptr(a.kv_norm.weight), a.kv_norm.eps, a.scale,
        _ptr(a.w_ukT), _ptr(a.w_uv), c.qk_nope_head_dim, c.kv_lora_rank, c.v_head_dim, int(c.rope_interleave))
    a.index_c = None
    if a.indexer is not None:
        norm = a.indexer.k_norm
        if any(p.lin is None for p in (a.iq, a.ik, a.iw)) or norm.eps != 1e-6 or any(
                t.dtype != torch.float32 or not t.is_contiguous() for t in (norm.weight, norm.bias)):
            raise NotOnFastPath(f"layer {layer}: indexer weights the one-call step does not take")
        a.index_c = loader.IndexerC(a.iq.lin, a.ik.lin, a.iw.lin, _ptr(norm.weight), _ptr(norm.bias), c.index_heads,
                                    c.index_head_dim, int(c.index_rope_interleave))
    loader.sparse_attention(latent, c, a.index_c)
    return latent


class _DeltaNet:
    """A `GatedDeltaNet` layer's step from the normed row h to the output product's tmp: one kernel call
    (deltanet.c's `deltanet_step`, the one-call step's arithmetic) on its products, convolution, delta
    rule and gated norm, the sequence's state (the cache's `states`) updated in place."""

    def __init__(self, plan: "DecodePlan", lib: ctypes.CDLL, a: GatedDeltaNet, layer: int) -> None:
        c = plan.config
        self.lib, self.layer = lib, layer
        names = ("in_proj_qkvz", "in_proj_ba") if a.layout == "qkvz" else \
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        self.ins = [_Product(lib, getattr(a, n), bias=False) for n in names]
        if any(p.lin is None for p in self.ins):
            raise NotOnFastPath(f"layer {layer}: Gated DeltaNet weights the kernels do not take")
        self.o_proj = _Product(lib, a.out_proj)
        if self.o_proj.lin is None:
            raise NotOnFastPath(f"layer {layer}: an output weight the kernels do not take")
        C, K = a.conv1d.weight.shape[0], a.conv1d.weight.shape[-1]
        self.vectors = tuple(torch_ops._f32(t.detach()) for t in (a.conv1d.weight.reshape(C, K), a.dt_bias, a.A_log,
                                                                   a.norm.weight))
        self.c = loader.deltanet(c, [p.lin for p in self.ins], *(_ptr(t) for t in self.vectors))
        self.layer_c = loader.LayerC(o=self.o_proj.lin, dn=ctypes.pointer(self.c))

    def __call__(self, plan: "DecodePlan", cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                 threads: int) -> None:
        st = cache.states[self.layer]
        self.lib.deltanet_step(ctypes.byref(self.layer_c), plan.hp, _ptr(st.conv), _ptr(st.recurrent), pos,
                               plan.tmpp, threads)
