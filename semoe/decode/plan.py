"""One decoding step of one sequence on CPU as a short run of kernel calls, for every architecture.

A decoding step through the model's modules (`MoEGPT.forward_packed` with one token) dispatches a
few hundred module calls and small torch ops of a few microseconds each: on a 2-core CPU, a quarter
of an int8 token's time (5.4 of 21 ms, 8 layers). `DecodePlan` takes the same step with the same
kernels on buffers made once. Per layer:

- attention: a norm; the q/k/v products; for grouped-query attention the variant's q/k norms (over
  all heads or per head) and clipping, then one attention call (`attend_decode_f32`: rotary over
  all or the first R dims, a sliding window, sinks); for DeepSeek's latent attention (MLA) the
  absorbed form over the latent cache (q's no-rope part taken into the latent space by kv_b's key
  half, scores against the cached latents and rotary keys, values summed in the latent space and
  taken out by kv_b's value half: no per-head K or V is made); then the output product;
- feed-forward: a norm; a dense layer's own call, or the router (softmax top-k by the kernel and
  torch's softmax and top-k; the others by the module's routing function), the routed experts from
  the layer's provider (resident or offloaded; int8/int4 SwiGLU experts in one kernel call, other
  kinds, gpt-oss's clamped MXFP4 ones among them, by the expert's own apply), their weighted sum,
  and the shared expert where there is one.

Where the module path makes the same calls, each value is the same arithmetic in the same order, so
tokens and log-probs are the same bits (tests compare them); where it computes attention with torch
(per-head norms of many heads, latent attention), the logits agree to float32 rounding.

Where every layer's weights are in memory and the kernels take them (`one_call_refusal` says what
else it needs; FP8 weights with square tiles of scales, as DeepSeek-V3 and Kimi-K2 ship them, are
computed as FP8), the whole step is one call instead (`decode_step`,
semoe/kernels/decode_step.c): the same kernels inside one parallel region, q/k norms, clipping,
sinks, windows, latent attention in the same absorbed form, every router, shared experts and
gpt-oss's clamped experts (float, int8, int4 or MXFP4) included, so that no Python runs between them. Its routers' softmax and sigmoid and its
activations of float experts use C's expf where the step above uses torch's ops, so its logits
agree with the modules' to float32 rounding rather than to the bit. Offloaded experts arrive during
the step, from the ring, so a model with offloaded experts takes the kernel-by-kernel step.

It needs float32 activations on CPU and the compiled kernels. `DecodePlan.build` gives None where
a model has a part it does not take (`NotOnFastPath` names it), and a step the plan cannot take (hooks
on a module, as the decode profile and routing traces add, a full cache) goes through the modules.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from semoe.kernels import torch_ops, loader
from semoe.model.attention import Attention, KVCache, LatentAttention, rope_tables
from semoe.model.compact_linear import swiglu_operands
from semoe.decode import prompt_pass
from semoe.decode.plan_parts import _GQA, _MLA, _DeltaNet, _Norm, _Product, _latent, _ptr, _weight
from semoe.decode import plan_v4
from semoe.decode.support import NotOnFastPath, one_call_refusal, plan_refusal, step_refusal
from semoe.model.expert_layout import PackedExperts
from semoe.model.linear_attention import GatedDeltaNet
from semoe.model.compressed_attention import CompressedAttention
from semoe.model.experts import ClampedSwiGLU, ExpertWeights, FusedSwiGLU, LimitedSwiGLU, ResidentExperts, SwiGLU
from semoe.model.moe_gpt import DenseFFN, MoEFeedForward, MoEGPT

_Lin, _Expert, _Net = loader.Lin, loader.Expert, loader.Net


@dataclass
class _Layer:
    attn_norm: _Norm
    attn: _GQA | _MLA
    ffn_norm: _Norm
    ffn: nn.Module
    router: _Product | None  # softmax-top-k MoE layers: the router's product by the kernel
    shared: bool  # a MoE layer with a shared expert


class DecodePlan:
    """A model's decoding step for one sequence (`step`), built once per generation; `whole=False`
    keeps to the kernel-by-kernel step even where the one-call step applies (`net` is then None)."""

    def __init__(self, model: MoEGPT, *, whole: bool = True) -> None:
        lib = torch_ops._lib()
        c = self.config = model.config
        self.model = model
        if lib is None:
            raise NotOnFastPath(f"semoe's compiled CPU kernels are {loader.status()}")
        if model.embed.weight.device.type != "cpu" or model.embed.weight.dtype != torch.float32:
            raise NotOnFastPath("activations are not float32 on CPU")
        why = plan_refusal(c)
        if why is not None:
            raise NotOnFastPath(f"the decoding plan does not take {why}")
        self.lib = lib
        D, H, G, Dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        # the step's buffers, made once, and their addresses, taken once (a step takes a few hundred)
        self.qkv = torch.empty(H * Dh + 2 * G * Dh)
        self.q, self.k, self.v = self.qkv.split([H * Dh, G * Dh, G * Dh])
        # x: the residual, or with hyper-connections its streams (`decode_step`'s x)
        self.x, self.h, self.tmp, self.routed = torch.empty(D * c.hc_mult), torch.empty(D), torch.empty(D), torch.empty(D)
        self.att = torch.empty(H * Dh)
        # a gated attention layer's products (each head's query then its gate, k, v) and its gate
        self.qg, self.gate = torch.empty((2 * H + 2 * G) * Dh), torch.empty(H * Dh)
        ptr = _ptr
        self.qgp, self.gatep = ptr(self.qg), ptr(self.gate)
        self.qp, self.kp, self.vp, self.attp = ptr(self.q), ptr(self.k), ptr(self.v), ptr(self.att)
        self.xp, self.hp, self.tmpp, self.routedp = ptr(self.x), ptr(self.h), ptr(self.tmp), ptr(self.routed)
        self.chosen = torch.empty(0, dtype=torch.long)  # DeepSeek sparse attention's last choice in a step
        self.layers: list[_Layer] = []
        for block in model.layers:
            a = block.attn
            if type(a) is Attention:
                attn = _GQA(self, lib, a)
            elif type(a) is LatentAttention:
                attn = _MLA(self, lib, a)
            elif type(a) is GatedDeltaNet:
                attn = _DeltaNet(self, lib, a, block.layer)
            elif type(a) is CompressedAttention:
                attn = a  # the one-call step's alone (`step_refusal`): its `Compressed` made in `_whole`
            else:
                raise NotOnFastPath(f"layer {block.layer}: {type(a).__name__}")
            router, ffn = None, block.ffn
            if isinstance(ffn, MoEFeedForward):
                if c.router == "softmax_topk":
                    router = _Product(lib, ffn.router, bias=False)  # the softmax-top-k router takes none
                    if router.lin is None:
                        raise NotOnFastPath(f"layer {block.layer}: a router weight the kernels do not take")
            elif not isinstance(ffn, DenseFFN):
                raise NotOnFastPath(f"layer {block.layer}: {type(ffn).__name__}")
            self.layers.append(_Layer(_Norm(lib, block.attn_norm), attn, _Norm(lib, block.ffn_norm), ffn, router,
                                      isinstance(ffn, MoEFeedForward) and bool(c.shared_expert_size)))
        self._moe = frozenset(i for i, lay in enumerate(self.layers) if not isinstance(lay.ffn, DenseFFN))
        self.lm_head = _Product(lib, model.lm_head)
        self.norm = _Norm(lib, model.norm)
        self.modules = list(model.modules())
        self.logits_E = torch.empty(1, c.num_experts) if c.num_experts else None
        self.ys = [torch.empty(D) for _ in range(max(c.top_k, 1))]
        self.logits_Ep = None if self.logits_E is None else ptr(self.logits_E)
        self.ysp = [ptr(y) for y in self.ys]
        # the SwiGLU kernel's operands per expert weights object (resident experts give the same object
        # every step): id -> (weak reference, arguments, what they point into)
        self._expert_args: dict[int, tuple[weakref.ref, tuple | None, tuple]] = {}
        # the whole step in one call (`decode_step`), where every layer's weights are in memory
        self.net: _Net | None = None
        self.whole_refusal = "not asked for"  # why `net` is None, in a phrase
        if whole:
            try:
                self.net, self._net_held = self._whole(model)
            except NotOnFastPath as e:
                self.whole_refusal = str(e)
        if self.net is None and step_refusal(c) is not None:
            raise NotOnFastPath(f"the decoding plan does not take {step_refusal(c)} ({self.whole_refusal})")

    def _whole(self, model: MoEGPT) -> tuple[_Net, list]:
        """decode_step.c's `Net` of the model, and what its pointers point into; NotOnFastPath where a
        layer's experts are not all in memory (offloaded ones arrive during the step), or its weights
        are of a kind the call does not take."""
        c, held = self.config, []
        why = one_call_refusal(c)
        if why is not None:
            raise NotOnFastPath(f"the one-call step does not take {why}")

        def expert(parts: tuple) -> _Expert:
            (gate, g_held), (up, u_held), (down, d_held) = (_weight(p) for p in parts)
            if (gate.kind, gate.g, gate.O, gate.I) != (up.kind, up.g, up.O, up.I):
                raise NotOnFastPath("gate and up of different kinds")  # they share x's quantization
            held.extend((g_held, u_held, d_held))
            return _Expert(gate, up, down)

        def gate_up(parts: tuple) -> _Expert:
            """gate_up and down (I, O) as one Expert with up.O = 0: gpt-oss's (gate_up, its bias, down, its
            bias), gate and up interleaved; Llama-4's (gate_up, down), its halves (`Net.halves`)."""
            clamped = len(parts) == 4
            biases = tuple(torch_ops._f32(b) for b in parts[1::2]) if clamped else ()
            (gu, gu_held), (down, d_held) = (_weight(p, in_out=True) for p in parts[::2 if clamped else 1])
            if biases:
                gu.bias, down.bias = (_ptr(b) for b in biases)
            held.extend((gu_held, d_held, biases))
            return _Expert(gu, _Lin(), down)

        if self.lm_head.lin is None:
            raise NotOnFastPath("an output weight the kernels do not take")
        parts = []
        for lay, block in zip(self.layers, model.layers):
            attn = lay.attn
            v4 = {}
            if isinstance(attn, CompressedAttention):  # its grouped output is inside `Compressed`
                v4 = dict(v4=plan_v4.compressed(attn, held), hc_attn=plan_v4.hyper(block.hc_attn, held),
                          hc_ffn=plan_v4.hyper(block.hc_ffn, held),
                          tid2eid=plan_v4.hash_table(getattr(block.ffn, "router", None), held))
            elif attn.o_proj.lin is None:
                raise NotOnFastPath(f"layer {block.layer}: an output weight the one-call step does not take")
            if v4:
                attn_parts = dict(qkv=[])
            elif isinstance(attn, _MLA):
                attn_parts = dict(qkv=[], mla=_latent(attn, block.layer))
                held.append(attn_parts["mla"])
            elif isinstance(attn, _DeltaNet):
                attn_parts = dict(qkv=[], dn=attn.c)
            else:
                if len(attn.qkv) > 3 or any(prod.lin is None for prod, _, _ in attn.qkv):
                    raise NotOnFastPath(f"layer {block.layer}: q/k/v weights the one-call step does not take")
                attn_parts = dict(
                    qkv=[prod.lin for prod, _, _ in attn.qkv],
                    q_norm=None if attn.norms is None else _ptr(attn.norms[0].weight),
                    k_norm=None if attn.norms is None else _ptr(attn.norms[1].weight),
                    sinks=None if attn.sinks is None else _ptr(attn.sinks))
            ffn = block.ffn
            if isinstance(ffn, DenseFFN):  # a dense layer (the plan takes no other kind)
                experts = [expert(tuple(m.weight for m in (ffn.gate_proj, ffn.up_proj, ffn.down_proj)))]
                if any(m.bias is not None for m in (ffn.gate_proj, ffn.up_proj, ffn.down_proj)):
                    raise NotOnFastPath("a dense feed-forward layer with biases")
            else:
                provider = ffn.experts
                mlp = getattr(provider, "mlp", None)
                kinds = (SwiGLU, ClampedSwiGLU, FusedSwiGLU, LimitedSwiGLU)
                if isinstance(provider, ResidentExperts) and isinstance(mlp, kinds):
                    ws = [w for _, w in provider.stream(ffn.layer, list(range(c.num_experts)), self.h[None])]
                elif isinstance(provider, PackedExperts) and isinstance(mlp, kinds) \
                        and set(provider.weights) == set(range(c.num_experts)):
                    ws = [provider.weights[e] for e in range(c.num_experts)]
                else:
                    raise NotOnFastPath(f"layer {block.layer}: experts not all in memory (offloaded ones arrive "
                                        "during the step)")
                make = gate_up if isinstance(mlp, (ClampedSwiGLU, FusedSwiGLU)) else expert
                experts = [make(w.parts) for w in ws]
                router = lay.router or _Product(self.lib, ffn.router, bias=c.router_bias)
                if router.lin is None:
                    raise NotOnFastPath(f"layer {block.layer}: a router weight the kernels do not take")
                held.append(router)
            array = (_Expert * len(experts))(*experts)
            held.append(array)
            shared = shared_gate = correction = None
            if lay.shared:
                sh = ffn.shared
                shared = (_Expert * 1)(expert(tuple(m.weight for m in (sh.gate_proj, sh.up_proj, sh.down_proj))))
                held.append(shared)
                if c.shared_expert_gate:
                    gate = _Product(self.lib, ffn.shared_gate, bias=False)
                    if gate.lin is None:
                        raise NotOnFastPath(f"layer {block.layer}: a shared expert's gate the kernels do not take")
                    shared_gate = gate.lin
                    held.append(gate)
            if not isinstance(ffn, DenseFFN) and c.score_correction_bias and not ffn.router.hashed:
                bias = ffn.router.e_score_correction_bias
                if bias.dtype != torch.float32 or not bias.is_contiguous():
                    raise NotOnFastPath(f"layer {block.layer}: a router correction that is not contiguous float32")
                correction = _ptr(bias)
            parts.append(loader.layer_parts(
                c, block.layer, attn_norm=_ptr(lay.attn_norm.weight), ffn_norm=_ptr(lay.ffn_norm.weight),
                o=_Lin() if v4 else attn.o_proj.lin, experts=array,
                ffn_width=experts[0].gate.O // (1 if experts[0].up.O else 2),
                router=None if isinstance(ffn, DenseFFN) else router.lin, correction=correction, shared=shared,
                shared_gate=shared_gate, **attn_parts, **v4))
        head = plan_v4.hyper(model.hc_head, held) if c.hc_mult > 1 else None
        net, layers = loader.build_net(c, parts, _ptr(self.norm.weight), self.norm.eps, self.lm_head.lin,
                                       hc_head=head)
        return net, [layers, *held]

    @classmethod
    def build(cls, model: MoEGPT, *, whole: bool = True) -> DecodePlan | None:
        """The plan of `model`'s decoding step, or None where it has a part the plan does not take
        (`whole` as the constructor's)."""
        try:
            return cls(model, whole=whole)
        except NotOnFastPath:
            return None

    def takes(self, cache: KVCache, positions: int = 1) -> bool:
        """Whether the next step of the sequence in `cache` (or its next `positions`, a prompt) can go
        through the plan: no hooks anywhere (they expect the module calls), inference, and the cache's
        next positions within its capacity."""
        n = cache.length
        if self.model.training or cache.k[0].shape[0] != 1 \
                or n + positions > min(cache.capacity, self.config.max_position):
            return False
        held = (*cache.k, *cache.v, *cache.state_tensors())
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in held):
            return False
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    @torch.no_grad()
    def prefill(self, tokens: list[int], cache: KVCache) -> torch.Tensor | None:
        """Logits (1, V) after the prompt `tokens` at the cache's next positions (the cache advances by
        them), by the torch-free runner's prompt pass (`semoe.decode.prompt_pass`: layer after layer, each
        chosen expert once over all the positions that chose it, the products over many rows at once,
        with every expert in memory); None, the cache untouched, where the one-call step does not apply
        (`net` is None) or `takes` refuses the positions: the caller's modules run the prompt then."""
        if not tokens:
            return None
        return self.batch(tokens, [cache], [len(tokens)], [len(tokens) - 1])

    @torch.no_grad()
    def batch(self, ids: list[int], caches: list[KVCache], counts: list[int], rows: list[int]
              ) -> torch.Tensor | None:
        """One step of several sequences at once, as `MoEGPT.forward_packed` takes them (sequence i's
        `counts[i]` tokens of `ids` at its cache's next positions; each cache advances by them): the
        logits (len(rows), V) of `rows`. The prompt pass over all their rows (`semoe.decode.prompt_pass`):
        the products over every row at once, each row's attention over its own sequence, each chosen
        expert once over the rows that chose it, the head over `rows` at once. A row's arithmetic is
        the same whichever rows share its step. None, nothing touched, where the one-call step does not
        apply (`net` is None) or `takes` refuses a cache: the caller's modules run the step then."""
        if self.net is None or not ids or not all(self.takes(k, n) for k, n in zip(caches, counts)):
            return None
        c, lib, net = self.config, self.lib, ctypes.byref(self.net)
        threads = torch.get_num_threads()
        starts = [k.length for k in caches]
        x = self.model.embed(torch.tensor([ids]))[0]
        if c.hc_mult > 1:  # room for the streams, each row's embedding first
            x = torch.cat((x, x.new_zeros(len(ids), (c.hc_mult - 1) * c.hidden_size)), dim=1)
        x = x.contiguous()
        pos = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, counts)])
        cos, sin = (t[0].contiguous() for t in rope_tables(c, pos[None], x.dtype))
        logits = torch.empty(len(rows), self.lm_head.O)
        prompt_pass.packed(lib, net, [k.addresses() for k in caches], [k.capacity for k in caches], starts, counts,
                           x.numpy(), cos.numpy(), sin.numpy(), rows, logits.numpy(), threads=threads, top_k=c.top_k,
                           moe=self._moe, index_topk=c.index_topk or 0, tokens=ids, streams=c.hc_mult)
        for k, p, n in zip(caches, starts, counts):
            k.length = p + n
        return logits

    @torch.no_grad()
    def step(self, token: int, cache: KVCache) -> torch.Tensor:
        """Logits (1, V) after `token`, the sequence's next position; the cache advances by one."""
        c, lib = self.config, self.lib
        threads = torch.get_num_threads()
        pos = cache.length
        x, xp, hp = self.x, self.xp, self.hp
        x[:c.hidden_size].copy_(self.model.embed(torch.tensor([[token]])).reshape(-1))
        cos, sin = rope_tables(c, torch.arange(pos, pos + 1)[None], x.dtype)
        if self.net is not None:
            logits = torch.empty(1, self.lm_head.O)
            caches = [(ctypes.c_void_p * len(self.layers))(*a) for a in cache.addresses()]
            lib.decode_step(ctypes.byref(self.net), xp, *caches, cache.capacity, pos, _ptr(cos), _ptr(sin),
                            _ptr(logits), threads, token)
            cache.length = pos + 1
            return logits
        for lay in self.layers:
            lay.attn_norm.call(xp, hp)
            lay.attn(self, cache, pos, cos, sin, threads)
            x.add_(self.tmp)
            lay.ffn_norm.call(xp, hp)
            if isinstance(lay.ffn, DenseFFN):
                x.add_(lay.ffn(self.h[None])[0])  # a dense layer: the module's own call
            else:
                self._experts(lay, threads)
        cache.length = pos + 1
        self.norm.call(xp, hp)
        logits = torch.empty(1, self.lm_head.O)
        self.lm_head(self.h, logits[0], threads, hp)
        return logits

    def _swiglu_args(self, w: ExpertWeights) -> tuple | None:
        """The SwiGLU kernel's arguments for an expert's weights (after x, before y), or None where
        the kernel does not take them (`swiglu_operands`, the model's own test)."""
        hit = self._expert_args.get(id(w))
        if hit is not None and hit[0]() is w:
            return hit[1]
        ops = swiglu_operands(*w.parts) if isinstance(w.mlp, SwiGLU) else None
        held: tuple = ()
        args = None
        if ops is not None:
            bits, (gc, gs), (uc, us), (dc, ds), g_in, g_down = ops
            # held as long as the entry (float weights have no scales)
            held = tuple(None if t is None else torch_ops._f32(t) for t in (gs, us, ds))
            sg, su, sd = (None if t is None else _ptr(t) for t in held)
            args = (gc.shape[0], bits, _ptr(gc), sg, _ptr(uc), su, g_in, _ptr(dc), sd, g_down)
        key = id(w)
        self._expert_args[key] = (weakref.ref(w, lambda _, k=key, d=self._expert_args: d.pop(k, None)), args, held)
        return args

    def _experts(self, lay: _Layer, threads: int) -> None:
        """The MoE layer of `MoEFeedForward._one_token` on h, its sum (and the shared expert's) added to x."""
        c, D, ffn = self.config, self.config.hidden_size, lay.ffn
        h_1D = self.h[None]
        if lay.router is not None:
            lay.router(self.h, self.logits_E[0], threads, self.hp, self.logits_Ep)
            probs = torch.softmax(self.logits_E, dim=-1)  # route_topk's ops on the same logits
            weights, ids_t = torch.topk(probs, c.top_k, dim=-1)
            if c.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:  # the module's own routing function (grouped, biased, top-k then softmax)
            r = ffn.route(h_1D)
            weights, ids_t = r.weights_TK.to(torch.float32).contiguous(), r.ids_TK
        ids = ids_t[0].tolist()
        experts = sorted(set(ids))
        outs: dict[int, int] = {}  # expert -> the address of its output
        outs_K: list[int] = [0] * len(ids)  # choice -> the address of its output, where the input is scaled
        kept = []
        for j, (e, w) in enumerate(ffn.experts.stream(ffn.layer, experts, h_1D)):
            if ffn.scales_input:  # Llama-4: each choice's expert on the input times its weight (`_one_token`)
                for k in (k for k, i in enumerate(ids) if i == e):
                    kept.append(w.apply(h_1D * weights[0, k].to(h_1D.dtype)).reshape(-1).to(torch.float32)
                                .contiguous())
                    outs_K[k] = _ptr(kept[-1])
                continue
            # the module path's own choice (`fused_swiglu`): one kernel call, here into a buffer of
            # the plan's and without the wrapper's checks, where it applies; else the expert's apply
            args = self._swiglu_args(w)
            if args is None:
                kept.append(w.apply(h_1D).reshape(-1).to(torch.float32).contiguous())
                outs[e] = _ptr(kept[-1])
                continue
            self.lib.swiglu_q(self.hp, 1, D, *args, self.ysp[j], threads)
            outs[e] = self.ysp[j]
        if ffn.scales_input:  # the outputs summed as they are
            weights = torch.ones_like(weights)
        else:
            outs_K = [outs[e] for e in ids]
        ys = (ctypes.c_void_p * len(ids))(*outs_K)
        if not lay.shared:
            self.lib.moe_combine_f32(self.xp, ys, _ptr(weights), len(ids), D)
            return
        # the module's order: the routed sum, plus the shared expert, then into the residual stream
        self.routed.zero_()
        self.lib.moe_combine_f32(self.routedp, ys, _ptr(weights), len(ids), D)
        self.x.add_(ffn.combine_shared(h_1D, self.routed[None])[0])
