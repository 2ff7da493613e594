"""One decoding step of one sequence on CPU as a short run of kernel calls.

A decoding step through the model's modules (`MoEGPT.forward_packed` with one token) dispatches a
few hundred module calls and small torch ops of a few microseconds each: on a 2-core CPU, a quarter
of an int8 token's time (5.4 of 21 ms, 8 layers). `DecodePlan` takes the same step with the same
kernels on buffers made once: per layer a norm, the q/k/v product, one attention call, the output
product, a norm, the router's product and its softmax and top-k (torch's ops, as the router's), the
routed experts from the layer's provider (resident or offloaded), and their weighted sum added to
the residual stream in one call. Each value comes from the arithmetic the module path uses, in the
same order, so tokens and log-probs are the same bits (tests compare them).

Where every layer's weights are in memory (resident experts, all of them, and weights the kernels
take), the whole step is one call instead (`decode_step`, semoe/kernels/decode_step.c): the same
kernels inside one parallel region, the router's softmax and top-k in C, so that no Python runs
between them. Its router softmax and its SiLU of float experts use C's expf where the step above
uses torch's ops, so its logits agree with the modules' to float32 rounding rather than to the bit.
Offloaded experts arrive during the step, from the ring, so a model with offloaded experts takes
the kernel-by-kernel step.

It covers the common decoder: attention without per-head or full q/k norms, clipping, sinks or a
window in reach, rotary over whole heads; softmax-top-k routers over SwiGLU experts without a
shared expert, or dense SwiGLU layers; float32 activations on CPU with the kernels built; weights
plain float32/bfloat16 or int8/int4. `DecodePlan.build` gives None for any other model, and a step
the plan cannot take (hooks on a module, as the decode profile and routing traces add, a window
reached, a full cache) goes through the modules.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from semoe import cpu_kernels, kernel_abi
from semoe.attention import Attention, KVCache, RMSNorm, rope_tables
from semoe.compact_linear import CompactWeight, swiglu_operands
from semoe.expert_layout import PackedExperts
from semoe.experts import ExpertWeights, ResidentExperts, SwiGLU
from semoe.model import DenseFFN, MoEFeedForward, MoEGPT


class NotPlanned(Exception):
    """The model has a part the plan does not take (the message says which)."""


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


_KINDS = {torch.float32: kernel_abi.W_F32, torch.bfloat16: kernel_abi.W_BF16, "int8": kernel_abi.W_INT8,
          "int4": kernel_abi.W_INT4}
_Lin, _Expert, _LayerC, _Net = kernel_abi.Lin, kernel_abi.Expert, kernel_abi.LayerC, kernel_abi.Net


def _weight(w: torch.Tensor | CompactWeight) -> tuple[_Lin, tuple[torch.Tensor, ...]]:
    """The kernels' operands of one weight (O, I) as `compact_linear.linear` multiplies one row by it
    on CPU, and the tensors they point into (the caller holds them as long as it uses the operands:
    the plan is built for one generation, over weights that stay where they are)."""
    if isinstance(w, CompactWeight):
        scheme = w.spec.scheme
        if w.kernel != "auto" or w.codes.device.type != "cpu" or scheme not in ("int8", "int4") or w.spec.transposed:
            raise NotPlanned(f"a {scheme} weight with the {w.kernel!r} kernel on {w.codes.device}")
        held = (w.codes, cpu_kernels._f32(w.scales))  # kept: the kernel reads them every step
        O, I = w.codes.shape[0], w.codes.shape[1] * (2 if scheme == "int4" else 1)
        g = (w.spec.group_size or 0) if scheme == "int4" else 0
        return _Lin(_KINDS[scheme], O, I, g, _ptr(held[0]), _ptr(held[1]), None), held
    if isinstance(w, torch.Tensor) and w.dtype in (torch.float32, torch.bfloat16) and w.dim() == 2 \
            and w.device.type == "cpu" and w.is_contiguous():
        return _Lin(_KINDS[w.dtype], w.shape[0], w.shape[1], 0, _ptr(w), None, None), (w,)
    raise NotPlanned(f"a weight of {type(w).__name__} {getattr(w, 'dtype', '')}")


class _Product:
    """y (O,) = x (I,) @ W.T (+ bias) for one linear module's weight, with the kernel call and
    operands `compact_linear.linear` uses for one row on CPU (`_weight`)."""

    def __init__(self, lib: ctypes.CDLL, module: nn.Module, *, bias: bool = True) -> None:
        self.lin, self.held = _weight(module.weight)
        self.bias = getattr(module, "bias", None) if bias else None
        if self.bias is not None:
            if self.bias.dtype != torch.float32 or not self.bias.is_contiguous():
                raise NotPlanned("a bias that is not contiguous float32")
            self.lin.bias = _ptr(self.bias)
        kind, O, I, g, wp, sp = (getattr(self.lin, f) for f in ("kind", "O", "I", "g", "w", "s"))
        self.O = O
        if kind == _KINDS["int8"]:
            self._call = lambda x, y, t: lib.gemv_i8(x, wp, sp, y, 1, O, I, t)
        elif kind == _KINDS["int4"]:
            self._call = lambda x, y, t: lib.gemv_i4(x, wp, sp, y, 1, O, I, g, t)
        else:
            fn = lib.gemv_f32 if kind == _KINDS[torch.float32] else lib.gemv_bf16
            self._call = lambda x, y, t: fn(x, wp, y, 1, O, I, t)

    def __call__(self, x: int, y: torch.Tensor, threads: int, y_ptr: int | None = None) -> None:
        """y = x @ W.T (+ bias): x the address of I float32 values, y a contiguous float32 view of O
        values (`y_ptr` its address where the caller has it)."""
        self._call(x, y.data_ptr() if y_ptr is None else y_ptr, threads)
        if self.bias is not None:
            y.add_(self.bias)  # the module's y + bias, in place


class _Norm:
    """An `RMSNorm` of one row by the kernel."""

    def __init__(self, lib: ctypes.CDLL, norm: RMSNorm) -> None:
        self.weight, self.eps = norm.weight, norm.eps
        wp, eps = norm.weight.data_ptr(), norm.eps
        self.call = lambda x, out, D: lib.rmsnorm_f32(x, wp, eps, out, 1, D)


@dataclass
class _Layer:
    attn_norm: _Norm
    qkv: list[tuple[_Product, torch.Tensor, int]]  # products, their part of the q|k|v buffer and its address
    o_proj: _Product
    ffn_norm: _Norm
    ffn: nn.Module
    router: _Product | None  # MoE layers
    window: int | None


class DecodePlan:
    """A model's decoding step for one sequence (`step`), built once per generation; `whole=False`
    keeps to the kernel-by-kernel step even where the one-call step applies (`net` is then None)."""

    def __init__(self, model: MoEGPT, *, whole: bool = True) -> None:
        lib = cpu_kernels._lib()
        c = self.config = model.config
        self.model = model
        if lib is None:
            raise NotPlanned(f"semoe's compiled CPU kernels are {kernel_abi.status()}")
        if model.embed.weight.device.type != "cpu" or model.embed.weight.dtype != torch.float32:
            raise NotPlanned("activations are not float32 on CPU")
        if c.qk_norm != "none" or c.clip_qkv is not None or c.attention_sinks or c.rope_interleave \
                or c.rope_dim != c.head_dim:
            raise NotPlanned("the attention variant (q/k norms, clipping, sinks or partial/interleaved rotary)")
        self.lib = lib
        D, H, G, Dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        # the step's buffers, made once, and their addresses, taken once (a step takes a few hundred)
        self.qkv = torch.empty(H * Dh + 2 * G * Dh)
        self.q, self.k, self.v = self.qkv.split([H * Dh, G * Dh, G * Dh])
        self.layers: list[_Layer] = []
        for block in model.layers:
            a = block.attn
            if type(a) is not Attention:
                raise NotPlanned(f"layer {block.layer}: {type(a).__name__}")
            projs = [a.qkv_proj] if a.qkv_proj is not None else [a.q_proj, a.k_proj, a.v_proj]
            qkv, start = [], 0
            for p in projs:
                prod = _Product(lib, p)
                if start + prod.O > self.qkv.numel():
                    raise NotPlanned(f"layer {block.layer}: q, k and v of more than {self.qkv.numel()} outputs")
                qkv.append((prod, self.qkv[start:start + prod.O], _ptr(self.qkv) + 4 * start))
                start += prod.O
            if start != self.qkv.numel():
                raise NotPlanned(f"layer {block.layer}: q, k and v of {start} outputs")
            router = None
            if isinstance(block.ffn, MoEFeedForward):
                if c.router != "softmax_topk" or c.shared_expert_size or c.expert_mlp == "clamped_swiglu":
                    raise NotPlanned(f"layer {block.layer}: the {c.router} router or its experts' kind")
                router = _Product(lib, block.ffn.router, bias=False)  # the softmax-top-k router takes none
            elif not isinstance(block.ffn, DenseFFN):
                raise NotPlanned(f"layer {block.layer}: {type(block.ffn).__name__}")
            self.layers.append(_Layer(_Norm(lib, block.attn_norm), qkv, _Product(lib, a.o_proj),
                                      _Norm(lib, block.ffn_norm), block.ffn, router, a.window))
        self.lm_head = _Product(lib, model.lm_head)
        self.norm = _Norm(lib, model.norm)
        self.modules = list(model.modules())
        self.x, self.h, self.tmp = torch.empty(D), torch.empty(D), torch.empty(D)
        self.att = torch.empty(H * Dh)
        self.logits_E = torch.empty(1, c.num_experts) if c.num_experts else None
        self.ys = [torch.empty(D) for _ in range(max(c.top_k, 1))]
        ptr = _ptr
        self.qp, self.kp, self.vp, self.attp = ptr(self.q), ptr(self.k), ptr(self.v), ptr(self.att)
        self.xp, self.hp, self.tmpp = ptr(self.x), ptr(self.h), ptr(self.tmp)
        self.logits_Ep = None if self.logits_E is None else ptr(self.logits_E)
        self.ysp = [ptr(y) for y in self.ys]
        self.scale = c.head_dim ** -0.5
        # the SwiGLU kernel's operands per expert weights object (resident experts give the same object
        # every step): id -> (weak reference, arguments, what they point into)
        self._expert_args: dict[int, tuple[weakref.ref, tuple | None, tuple]] = {}
        # the whole step in one call (`decode_step`), where every layer's weights are in memory
        self.net: _Net | None = None
        if whole:
            try:
                self.net, self._net_held = self._whole(model)
            except NotPlanned:
                pass

    def _whole(self, model: MoEGPT) -> tuple[_Net, list]:
        """decode_step.c's `Net` of the model, and what its pointers point into; NotPlanned where a
        layer's experts are not all in memory (offloaded ones arrive during the step), or its weights
        are of a kind the call does not take."""
        c, held = self.config, []

        def expert(parts: tuple) -> _Expert:
            (gate, g_held), (up, u_held), (down, d_held) = (_weight(p) for p in parts)
            if (gate.kind, gate.g, gate.O, gate.I) != (up.kind, up.g, up.O, up.I):
                raise NotPlanned("gate and up of different kinds")  # they share x's quantization
            held.extend((g_held, u_held, d_held))
            return _Expert(gate, up, down)

        layers = (_LayerC * len(self.layers))()
        F = E = 0
        for lay, block, lc in zip(self.layers, model.layers, layers):
            if len(lay.qkv) > 3:
                raise NotPlanned("q/k/v in more than three products")
            lc.attn_norm, lc.attn_eps = _ptr(lay.attn_norm.weight), lay.attn_norm.eps
            lc.ffn_norm, lc.ffn_eps = _ptr(lay.ffn_norm.weight), lay.ffn_norm.eps
            lc.n_qkv = len(lay.qkv)
            for j, (prod, _, _) in enumerate(lay.qkv):
                lc.qkv[j] = prod.lin
            lc.o = lay.o_proj.lin
            ffn = block.ffn
            if lay.router is None:  # a dense layer: DenseFFN (the plan takes no other)
                experts = [expert(tuple(m.weight for m in (ffn.gate_proj, ffn.up_proj, ffn.down_proj)))]
                if any(m.bias is not None for m in (ffn.gate_proj, ffn.up_proj, ffn.down_proj)):
                    raise NotPlanned("a dense feed-forward layer with biases")
            else:
                provider = ffn.experts
                if isinstance(provider, ResidentExperts) and isinstance(provider.mlp, SwiGLU):
                    ws = [w for _, w in provider.stream(ffn.layer, list(range(c.num_experts)), self.h[None])]
                elif isinstance(provider, PackedExperts) and isinstance(provider.mlp, SwiGLU) \
                        and set(provider.weights) == set(range(c.num_experts)):
                    ws = [provider.weights[e] for e in range(c.num_experts)]
                else:
                    raise NotPlanned(f"layer {block.layer}: experts not all in memory")
                experts = [expert(w.parts) for w in ws]
                lc.E, lc.router = c.num_experts, lay.router.lin
            array = (_Expert * len(experts))(*experts)
            held.append(array)
            lc.experts = array
            F, E = max(F, experts[0].gate.O), max(E, lc.E)
        H, G, Dh = c.num_heads, c.num_kv_heads, c.head_dim
        net = _Net(len(self.layers), c.hidden_size, H, G, Dh, F, E, max(c.top_k, 1), int(bool(c.norm_topk_prob)),
                   self.scale, self.norm.eps, _ptr(self.norm.weight), layers, self.lm_head.lin)
        return net, [layers, *held]

    @classmethod
    def build(cls, model: MoEGPT, *, whole: bool = True) -> DecodePlan | None:
        """The plan of `model`'s decoding step, or None where it has a part the plan does not take
        (`whole` as the constructor's)."""
        try:
            return cls(model, whole=whole)
        except NotPlanned:
            return None

    def takes(self, cache: KVCache) -> bool:
        """Whether the next step of the sequence in `cache` can go through the plan: no hooks anywhere
        (they expect the module calls), inference, and the cache's next position within its capacity
        and out of every layer's window."""
        n = cache.length
        if self.model.training or cache.k[0].shape[0] != 1 \
                or n + 1 > min(cache.capacity, self.config.max_position):
            return False
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (*cache.k, *cache.v)):
            return False
        if any(lay.window is not None and lay.window <= n for lay in self.layers):
            return False
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    @torch.no_grad()
    def step(self, token: int, cache: KVCache) -> torch.Tensor:
        """Logits (1, V) after `token`, the sequence's next position; the cache advances by one."""
        c, lib = self.config, self.lib
        threads = torch.get_num_threads()
        pos = cache.length
        D, x, xp, hp = c.hidden_size, self.x, self.xp, self.hp
        x.copy_(self.model.embed(torch.tensor([[token]])).reshape(-1))
        cos, sin = rope_tables(c, torch.arange(pos, pos + 1)[None], x.dtype)
        cosp, sinp = _ptr(cos), _ptr(sin)
        if self.net is not None:
            logits = torch.empty(1, self.lm_head.O)
            caches = [(ctypes.c_void_p * len(self.layers))(*(_ptr(t) for t in kv)) for kv in (cache.k, cache.v)]
            lib.decode_step(ctypes.byref(self.net), xp, *caches, cache.capacity, pos, cosp, sinp, _ptr(logits),
                            threads)
            cache.length = pos + 1
            return logits
        for i, lay in enumerate(self.layers):
            lay.attn_norm.call(xp, hp, D)
            for prod, y, yp in lay.qkv:
                prod(hp, y, threads, yp)
            lib.attend_decode_f32(self.qp, self.kp, self.vp, cosp, sinp, _ptr(cache.k[i]), _ptr(cache.v[i]),
                                  c.num_heads, c.num_kv_heads, c.head_dim, cache.capacity, pos, self.scale, self.attp,
                                  threads)
            lay.o_proj(self.attp, self.tmp, threads, self.tmpp)
            x.add_(self.tmp)
            lay.ffn_norm.call(xp, hp, D)
            if lay.router is None:
                x.add_(lay.ffn(self.h[None])[0])  # a dense layer: the module's own call
            else:
                self._experts(lay, threads)
        cache.length = pos + 1
        self.norm.call(xp, hp, D)
        logits = torch.empty(1, self.lm_head.O)
        self.lm_head(hp, logits, threads)
        return logits

    def _swiglu_args(self, w: ExpertWeights) -> tuple | None:
        """The SwiGLU kernel's arguments for an expert's weights (after x, before y), or None where
        the kernel does not take them (`swiglu_operands`, the model's own test)."""
        hit = self._expert_args.get(id(w))
        if hit is not None and hit[0]() is w:
            return hit[1]
        ops = swiglu_operands(*w.parts)
        held: tuple = ()
        args = None
        if ops is not None:
            bits, (gc, gs), (uc, us), (dc, ds), g_in, g_down = ops
            sg, su, sd = held = tuple(cpu_kernels._f32(t) for t in (gs, us, ds))  # held as long as the entry
            args = (gc.shape[0], bits, _ptr(gc), _ptr(sg), _ptr(uc), _ptr(su), g_in, _ptr(dc), _ptr(sd), g_down)
        key = id(w)
        self._expert_args[key] = (weakref.ref(w, lambda _, k=key, d=self._expert_args: d.pop(k, None)), args, held)
        return args

    def _experts(self, lay: _Layer, threads: int) -> None:
        """The MoE layer of `MoEFeedForward._one_token` on h, its sum added to x."""
        c, D = self.config, self.config.hidden_size
        lay.router(self.hp, self.logits_E[0], threads, self.logits_Ep)
        probs = torch.softmax(self.logits_E, dim=-1)  # route_topk's ops on the same logits
        weights, ids_t = torch.topk(probs, c.top_k, dim=-1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        ids = ids_t[0].tolist()
        experts = sorted(set(ids))
        outs: dict[int, int] = {}  # expert -> the address of its output
        kept = []
        h_1D = self.h[None]
        for j, (e, w) in enumerate(lay.ffn.experts.stream(lay.ffn.layer, experts, h_1D)):
            # the module path's own choice (`fused_swiglu`): one kernel call, here into a buffer of
            # the plan's and without the wrapper's checks, where it applies; else the expert's products
            args = self._swiglu_args(w)
            if args is None:
                kept.append(w.apply(h_1D).reshape(-1).contiguous())
                outs[e] = _ptr(kept[-1])
                continue
            self.lib.swiglu_q(self.hp, 1, D, *args, self.ysp[j], threads)
            outs[e] = self.ysp[j]
        ys = (ctypes.c_void_p * len(ids))(*(outs[e] for e in ids))
        self.lib.moe_combine_f32(self.xp, ys, _ptr(weights), len(ids), D)
