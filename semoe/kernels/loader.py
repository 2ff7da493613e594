"""The compiled CPU kernels' library (semoe/kernels/*.c) and the structures its whole-step calls
take, loaded with ctypes and no torch.

`library()` loads the build made at install that runs fastest on this CPU: the best its flags allow
(`semoe.kernels.variants`), unless another vector build it runs was measured faster here (once per
machine, kept in ~/.cache/semoe/kernel-choice.json); or the one SEMOE_CPU_KERNELS names (`off`: none),
checks that `Lin`, `Expert`, `LayerC` and `Net` have the layouts of decode_abi.h's structs as the
library was compiled, and declares every entry point.
`semoe.kernels.torch_ops` and `semoe.decode.plan` call the kernels on torch tensors through these;
`inference.torch_free.runner` calls them on its own buffers, in a process that never imports torch.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from dataclasses import dataclass
from functools import cache

from semoe.kernels import variants

_P, _I, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_INT = ctypes.c_int

class KernelABIError(RuntimeError):
    """The kernels' library and its ctypes mirrors disagree (a struct changed on one side only, or a
    library built from older sources): one line naming the library, the struct and both layouts."""


# decode_abi.h's weight kinds (`Lin.kind`)
W_F32, W_BF16, W_INT8, W_INT4, W_MXFP4, W_F32_IO, W_BF16_IO, W_FP8, W_GGML = 1, 2, 3, 4, 5, 6, 7, 8, 9


class Lin(ctypes.Structure):
    """decode_abi.h's `Lin`: one weight (O, I), its scales and bias."""
    _fields_ = [("kind", _I), ("O", _I), ("I", _I), ("g", _I), ("w", _P), ("s", _P), ("bias", _P)]


class Expert(ctypes.Structure):
    """One expert: SwiGLU's gate and up (F, D) of one kind and group, down (D, F); or, with up.O = 0,
    gpt-oss's clamped one: gate its gate_up (2F, D, gate and up interleaved) with its bias, down with
    its bias."""
    _fields_ = [("gate", Lin), ("up", Lin), ("down", Lin)]


class IndexerC(ctypes.Structure):
    """decode_abi.h's `Indexer`: DeepSeek sparse attention's lightning indexer of a layer."""
    _fields_ = [("wq", Lin), ("wk", Lin), ("wp", Lin), ("k_norm", _P), ("k_bias", _P), ("Hi", _I), ("Di", _I),
                ("interleave", _I)]


class LatentC(ctypes.Structure):
    """decode_abi.h's `Latent`: a layer's latent attention (DeepSeek, Kimi) in its absorbed form, with
    DeepSeek sparse attention's choice of positions where `topk` > 0."""
    _fields_ = [("q_a", Lin), ("q_b", Lin), ("kv_a", Lin), ("q_norm", _P), ("kv_norm", _P), ("eps", _F32),
                ("scale", _F32), ("w_ukT", _P), ("w_uv", _P), ("nope", _I), ("L", _I), ("dv", _I), ("interleave", _I),
                ("index", ctypes.POINTER(IndexerC)), ("topk", _I), ("Di", _I)]


def sparse_attention(latent: LatentC, config, indexer: IndexerC | None) -> None:
    """Set `latent`'s DeepSeek sparse attention from the model's config: its top-k and the indexer's key
    dims after each rotary key, and its own indexer (None: a layer reading another's choice)."""
    if config.index_topk is None:
        return
    latent.topk, latent.Di = config.index_topk, config.index_head_dim
    if indexer is not None:
        latent.index = ctypes.pointer(indexer)


class DeltaNetC(ctypes.Structure):
    """decode_abi.h's `DeltaNet`: a layer's Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE)."""
    _fields_ = [("in_", Lin * 4), ("n_in", _I), ("nk", _I), ("nv", _I), ("dk", _I), ("dv", _I), ("K", _I),
                ("conv", _P), ("dt_bias", _P), ("A_log", _P), ("norm", _P), ("eps", _F32)]


class CompressorC(ctypes.Structure):
    """decode_abi.h's `Compressor`: one of DeepSeek-V4's compressors of a layer."""
    _fields_ = [("wkv", Lin), ("wgate", Lin), ("ape", _P), ("norm", _P), ("m", _I), ("dim", _I), ("overlap", _I)]


class CompressedC(ctypes.Structure):
    """decode_abi.h's `Compressed`: a layer's DeepSeek-V4 attention."""
    _fields_ = [("wq_a", Lin), ("wq_b", Lin), ("wkv", Lin), ("wo_b", Lin), ("iwq", Lin), ("iwp", Lin),
                ("wo_a", ctypes.POINTER(Lin)), ("q_norm", _P), ("kv_norm", _P), ("sinks", _P), ("inv_freq", _P),
                ("index_inv_freq", _P), ("eps", _F32), ("rope_scale", _F32), ("index_scale", _F32), ("W", _I),
                ("r", _I), ("o_groups", _I), ("Hi", _I), ("Di", _I), ("topk", _I), ("comp", CompressorC),
                ("icomp", CompressorC)]


@functools.cache
def ggml_type_id(name: str) -> int:
    """The ggml type number of a GGUF quantized type (Q4_K: 12): a `Lin` of kind W_GGML's `g`."""
    import gguf

    return int(gguf.GGMLQuantizationType[name])


@functools.cache
def ggml_block(name: str) -> tuple[int, int]:
    """(weights, bytes) of one block of a GGUF quantized type (Q4_K: 256 weights in 144 bytes)."""
    import gguf

    return tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]])


def lin_group(quant: dict) -> int:
    """A `Lin`'s `g` for a compact weight's manifest `quant`: int4's group, FP8's tile side, ggml's type."""
    scheme = quant.get("scheme")
    if scheme == "int4":
        return quant.get("group_size") or 0
    return quant["block"][0] if scheme == "fp8" else ggml_type_id(quant["ggml_type"]) if scheme == "ggml" else 0


def lin_rows(lin: Lin, r0: int, n: int) -> Lin:
    """Rows r0 .. r0 + n of a weight as a `Lin` over the same memory: float, int8, FP8 (r0 and n on its tiles)
    and MXFP4 rows lie in row order. ValueError for int4, whose scales are laid out over all rows (per group of
    inputs), and for FP8 rows off its tiles."""
    k, I = lin.kind, lin.I
    if k in (W_F32, W_BF16):
        return Lin(k, n, I, 0, lin.w + r0 * I * (4 if k == W_F32 else 2), None, None)
    if k == W_INT8:
        return Lin(k, n, I, 0, lin.w + r0 * I, lin.s + r0 * 4, None)
    if k == W_FP8 and r0 % lin.g == 0 and n % lin.g == 0:
        return Lin(k, n, I, lin.g, lin.w + r0 * I, lin.s + r0 // lin.g * -(-I // lin.g) * 4, None)
    if k == W_MXFP4:
        return Lin(k, n, I, 0, lin.w + r0 * I // 2, lin.s + r0 * I // 32, None)
    raise ValueError(f"rows {r0}..{r0 + n} of a weight of kind {k}")


def row_groups(lin: Lin, groups: int) -> ctypes.Array:
    """`groups` equal blocks of a weight's rows (`lin_rows`), as an array of Lin: DeepSeek-V4's grouped output."""
    n = lin.O // groups
    return (Lin * groups)(*(lin_rows(lin, g * n, n) for g in range(groups)))


class HyperC(ctypes.Structure):
    """decode_abi.h's `Hyper`: a hyper-connection's weights (DeepSeek-V4)."""
    _fields_ = [("fn", Lin), ("base", _P), ("scale", _P)]


class LayerC(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("attn_eps", _F32), ("ffn_eps", _F32), ("n_qkv", _I),
                ("window", _I), ("qk_norm", _I), ("q_norm", _P), ("k_norm", _P), ("norope", _I), ("chunk", _I),
                ("temp_scale", _F32), ("temp_floor", _F32), ("qk_eps", _F32), ("clip", _F32),
                ("sinks", _P), ("qkv", Lin * 3), ("o", Lin), ("mla", ctypes.POINTER(LatentC)), ("E", _I), ("router", Lin), ("correction", _P),
                ("experts", ctypes.POINTER(Expert)), ("shared", ctypes.POINTER(Expert)), ("shared_gate", Lin),
                ("dn", ctypes.POINTER(DeltaNetC)), ("gate", _I), ("v4", ctypes.POINTER(CompressedC)),
                ("hc_attn", HyperC), ("hc_ffn", HyperC), ("tid2eid", _P)]


class Net(ctypes.Structure):
    _fields_ = [("L", _I), ("D", _I), ("H", _I), ("G", _I), ("Dh", _I), ("R", _I), ("F", _I), ("E", _I),
                ("top_k", _I), ("norm_topk", _I), ("router", _I), ("sigmoid_scores", _I), ("n_group", _I),
                ("topk_group", _I), ("group_top2", _I), ("kv16", _I), ("rope_pairs", _I), ("halves", _I), ("routed_scale", _F32),
                ("alpha", _F32),
                ("limit", _F32), ("limited", _I), ("hc", _I), ("hc_iters", _I), ("hc_eps", _F32), ("hc_head", HyperC),
                ("scale", _F32), ("norm_eps", _F32), ("norm", _P),
                ("layers", ctypes.POINTER(LayerC)), ("head", Lin)]


@dataclass
class LayerParts:
    """One layer of a `Net`, as either front-end finds it (the torch plan, the torch-free runner):
    addresses of its norms' weights, its products, and its experts (one for a dense layer)."""

    attn_norm: int
    attn_eps: float
    ffn_norm: int
    ffn_eps: float
    qkv: list[Lin]  # q, k and v: one stacked product, or three (none: latent attention, `mla`)
    o: Lin
    window: int  # sliding window (0: none)
    experts: ctypes.Array  # of Expert: the layer's E routed experts, or its one dense SwiGLU
    ffn_width: int  # F, the experts' (or the dense layer's) intermediate size (gpt-oss: half gate_up's outputs)
    router: Lin | None = None  # None: a dense layer
    qk_norm: int = 0  # QK_NORM's value of the config's q/k norm
    q_norm: int | None = None  # the q and k norms' weights
    k_norm: int | None = None
    qk_eps: float = 0.0
    clip: float = 0.0  # > 0: q, k and v clamped to [-clip, clip]
    sinks: int | None = None  # H logits
    correction: int | None = None  # E biases on the grouped router's choice
    shared: ctypes.Array | None = None  # of one Expert: the shared expert
    shared_gate: Lin | None = None  # its sigmoid gate (O = 1), if it has one
    mla: LatentC | None = None  # latent attention in place of q/k/v (kept alive by the caller)
    norope: int = 0  # 1: no rotary on this layer (Llama-4), q times the temperature where temp_floor > 0
    chunk: int = 0  # chunked local attention's chunk (0: none)
    temp_scale: float = 0.0
    temp_floor: float = 0.0
    dn: DeltaNetC | None = None  # Gated DeltaNet in place of attention (kept alive by the caller)
    gate: int = 0  # 1: q's product gives each head's query, then its output gate
    v4: CompressedC | None = None  # DeepSeek-V4's attention in place of q/k/v (kept alive by the caller)
    hc_attn: HyperC | None = None  # the hyper-connections around attention and the feed-forward
    hc_ffn: HyperC | None = None
    tid2eid: int | None = None  # the hash-routed layer's table (vocabulary, top_k) of int64


# decode_abi.h's `Layer.qk_norm` for `semoe.model.config.MoEConfig.qk_norm`, and `Net.router` for its router
QK_NORM = {"none": 0, "full": 1, "head": 2, "head_after_rope": 3, "unit_after_rope": 4}


def layer_parts(config, layer: int, **found) -> LayerParts:
    """Layer `layer`'s `LayerParts` as both front-ends make it: the config decides the norms' epsilon,
    the sliding window or chunk, the q/k norm's kind and epsilon, the clip, whether the layer rotates
    and its temperature; `found` holds what the caller found in its weights (addresses, products,
    experts: the other fields)."""
    gqa = config.attention != "mla"
    norope = gqa and not config.rotates(layer)
    temp = config.attn_temperature if norope and config.attn_temperature is not None else (0.0, 0.0)
    return LayerParts(attn_eps=config.rms_norm_eps, ffn_eps=config.rms_norm_eps,
                      window=(config.window(layer) or 0) if gqa else 0,
                      chunk=(config.chunk(layer) or 0) if gqa else 0,
                      qk_norm=QK_NORM[config.qk_norm] if gqa else 0,
                      qk_eps=config.rms_norm_eps if gqa and config.qk_norm != "none" else 0.0,
                      clip=(config.clip_qkv or 0.0) if gqa else 0.0, norope=int(norope), temp_scale=temp[0],
                      temp_floor=temp[1], **found,
                      gate=int(bool(gqa and config.attn_output_gate and not config.is_linear(layer))))


def deltanet(config, ins: list[Lin], conv: int, dt_bias: int, A_log: int, norm: int) -> DeltaNetC:
    """A layer's `DeltaNetC` as both front-ends make it: its input products (qkvz and ba, or qkv, z, b and
    a, as `config.linear_layout` says), the addresses of its convolution's weight (C, K), dt_bias, A_log
    and its norm's weight, float32; the shapes from the config."""
    c = config
    if len(ins) != (2 if c.linear_layout == "qkvz" else 4):
        raise ValueError(f"{len(ins)} input products for the {c.linear_layout!r} layout")
    d = DeltaNetC(n_in=len(ins), nk=c.linear_key_heads, nv=c.linear_value_heads, dk=c.linear_key_dim,
                  dv=c.linear_value_dim, K=c.linear_conv_kernel, conv=conv, dt_bias=dt_bias, A_log=A_log, norm=norm,
                  eps=c.rms_norm_eps)
    for j, lin in enumerate(ins):
        d.in_[j] = lin
    return d
SCORES = {"sigmoid": 1, "sqrtsoftplus": 2}  # `Net.sigmoid_scores` of a grouped router's scores (else softmax)
ROUTER = {"softmax_topk": 0, "topk_softmax": 1, "grouped": 2, "topk_sigmoid_input": 3}
# prefill.c's and kernels.h's sizes, for what a prompt's pass allocates (`inference.torch_free.sequence_memory`):
# the rows of a block (PREFILL_ROWS), the rows sharing a key's load (ROW_GROUP) and the expanded latent
# attention's default limit a layer (`prefill_expand_limit`)
PREFILL_ROWS, ROW_GROUP, EXPAND_LIMIT = 64, 4, 256 << 20


def build_net(config, layers: list[LayerParts], norm: int, norm_eps: float, head: Lin,
              kv16: bool = False, hc_head: HyperC | None = None) -> tuple[Net, ctypes.Array]:
    """decode_step.c's `Net` of a model (`config`: its `semoe.model.config.ModelConfig`) over these layers,
    and the array of `LayerC` it points into (keep it while the Net is used): the one assembly both
    front-ends share. `kv16`: grouped-query attention's KV caches hold float16; `hc_head`: where the model has
    hyper-connections, the one collapsing its streams before the norm."""
    arr = (LayerC * len(layers))()
    for lp, lc in zip(layers, arr):
        lc.attn_norm, lc.attn_eps, lc.ffn_norm, lc.ffn_eps = lp.attn_norm, lp.attn_eps, lp.ffn_norm, lp.ffn_eps
        lc.n_qkv, lc.window, lc.o = len(lp.qkv), lp.window, lp.o
        lc.qk_norm, lc.q_norm, lc.k_norm, lc.qk_eps = lp.qk_norm, lp.q_norm, lp.k_norm, lp.qk_eps
        lc.clip, lc.sinks, lc.correction = lp.clip, lp.sinks, lp.correction
        lc.norope, lc.chunk, lc.temp_scale, lc.temp_floor = lp.norope, lp.chunk, lp.temp_scale, lp.temp_floor
        if lp.mla is not None:
            lc.mla = ctypes.pointer(lp.mla)
        if lp.dn is not None:
            lc.dn = ctypes.pointer(lp.dn)
        if lp.v4 is not None:
            lc.v4 = ctypes.pointer(lp.v4)
        if lp.hc_attn is not None:
            lc.hc_attn, lc.hc_ffn = lp.hc_attn, lp.hc_ffn
        lc.tid2eid = lp.tid2eid
        lc.gate = lp.gate
        if lp.shared is not None:
            lc.shared = lp.shared
            if lp.shared_gate is not None:
                lc.shared_gate = lp.shared_gate
        for j, lin in enumerate(lp.qkv):
            lc.qkv[j] = lin
        lc.experts = lp.experts
        if lp.router is not None:
            lc.E, lc.router = len(lp.experts), lp.router
    F = max(max(lp.ffn_width, lp.shared[0].gate.O if lp.shared is not None else 0) for lp in layers)
    E, Dh, c = max(lc.E for lc in arr), config.head_dim, config
    net = Net(len(layers), c.hidden_size, c.num_heads, c.num_kv_heads, Dh, c.rope_dim, F, E, max(c.top_k, 1),
              int(bool(c.norm_topk_prob)), ROUTER[c.router], SCORES.get(c.router_scores, 0), c.n_group,
              c.topk_group, int(c.group_score == "top2"), int(kv16), int(c.rope_interleave and c.attention == "gqa"),
              int(c.expert_mlp == "fused_swiglu"), c.routed_scaling_factor, c.swiglu_alpha, c.swiglu_limit,
              int(c.expert_mlp == "limited_swiglu"), c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps,
              hc_head if hc_head is not None else HyperC(), Dh ** -0.5, norm_eps, norm, arr, head)
    return net, arr


# decode_abi.h's struct names -> their mirrors, which `check_layout` compares field by field
STRUCTS = {"Lin": Lin, "Expert": Expert, "Indexer": IndexerC, "Latent": LatentC, "DeltaNet": DeltaNetC,
           "Compressor": CompressorC, "Compressed": CompressedC, "Hyper": HyperC, "Layer": LayerC, "Net": Net}


def check_layout(lib: ctypes.CDLL, path: str, structs: dict[str, type[ctypes.Structure]] = STRUCTS) -> None:
    """KernelABIError unless each struct's size and field offsets in the library (its
    `semoe_abi_layout`) equal its ctypes mirror's."""
    try:
        layout = lib.semoe_abi_layout
    except AttributeError:
        raise KernelABIError(f"{path}: no semoe_abi_layout, built from older sources than semoe/kernels/loader.py: "
                             f"reinstall (pip install -e .) to rebuild the kernels") from None
    layout.argtypes = [ctypes.c_char_p, ctypes.POINTER(_I), _I, ctypes.POINTER(_I)]
    layout.restype = _I
    for name, mirror in structs.items():
        offsets, n = (_I * 64)(), _I()
        size = layout(name.encode(), offsets, 64, ctypes.byref(n))
        got = (size, list(offsets[:n.value]))
        want = (ctypes.sizeof(mirror), [getattr(mirror, f[0]).offset for f in mirror._fields_])
        if got != want:
            raise KernelABIError(f"{path}: struct {name} is {got[0]} bytes with fields at {got[1]} in the library "
                                 f"but {want[0]} bytes with fields at {want[1]} in semoe/kernels/loader.py: change "
                                 f"semoe/kernels/decode_abi.h and the mirror together, then reinstall")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.gemv_i8.argtypes = [_P, _P, _P, _P, _I, _I, _I, _INT]
    lib.gemv_i4.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _INT]
    lib.quantize_rows_q8.argtypes = [_P, _P, _P, _I, _I, _I]
    lib.gemv_bf16.argtypes = [_P, _P, _P, _I, _I, _I, _INT]
    lib.gemv_f32.argtypes = [_P, _P, _P, _I, _I, _I, _INT]
    lib.gemv_f32_io.argtypes = [_P, _P, _P, _I, _I, _I, _INT]
    lib.gemv_f32_heads.argtypes = [_P, _P, _P, _I, _I, _I, _INT]
    lib.rmsnorm_f32.argtypes = [_P, _P, _F32, _P, _I, _I]
    lib.attend_decode_f32.argtypes = [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F32, _P, _P, _INT]
    lib.gemv_mxfp4.argtypes = [_P, _P, _P, _P, _I, _I, _I, _INT]
    lib.gemv_fp8.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _INT]
    lib.swiglu_q.argtypes = [_P, _I, _I, _I, _INT, _P, _P, _P, _P, _I, _P, _P, _I, _P, _INT]
    lib.clamped_swiglu_q.argtypes = [_P, _I, _I, _I, _INT, _P, _P, _I, _P, _P, _P, _I, _P, _F32, _F32, _P, _INT]
    lib.moe_combine_f32.argtypes = [_P, _P, _P, _I, _I]
    lib.decode_step.argtypes = [_P, _P, _P, _P, _I, _I, _P, _P, _P, _INT, _I]
    lib.decode_work.argtypes = [_P, _I]
    lib.decode_work.restype = _P
    lib.decode_work_free.argtypes = [_P]
    lib.decode_attend.argtypes = [_P, _P, _I, _P, _P, _P, _I, _I, _P, _P, _P, _P, _INT, _I]
    lib.decode_ffn.argtypes = [_P, _P, _I, _P, _INT]
    lib.decode_experts.argtypes = [_P, _P, _I, _P, _I, _INT]
    lib.decode_ffn_done.argtypes = [_P, _P, _I, _P, _INT]
    lib.decode_head.argtypes = [_P, _P, _P, _P, _INT]
    lib.prefill_norm.argtypes = [_P, _I, _P, _P, _I]
    lib.prefill_attend.argtypes = [_P, _I, _P, _I, _P, _P, _P, _I, _P, _P, _I, _P, _P, _I, _P, _P, _P, _INT]
    lib.prefill_head.argtypes = [_P, _P, _I, _P, _INT]
    lib.lin_rows.argtypes = [_P, _P, _I, _P, _INT]
    lib.prefill_experts.argtypes = [_P, _I, _P, _P, _I, _P, _P, _P, _I, _INT]
    lib.prefill_finish.argtypes = [_P, _I, _P, _P, _P, _I, _INT]
    lib.deltanet_step.argtypes = [_P, _P, _P, _P, _I, _P, _INT]
    lib.gate_unpack.argtypes = [_I, _I, _I, _P, _P, _P]
    lib.gate_apply.argtypes = [_P, _P, _I]
    lib.prefill_expand_limit.argtypes = [_I]
    lib.prefill_expand_limit.restype = _I
    lib.deltanet_chunk_min.argtypes = [_I]  # set (n > 0) the shortest run of rows the chunked form takes; the old
    lib.deltanet_chunk_min.restype = _I
    for f in (lib.quantize_rows_q8, lib.gemv_bf16, lib.gemv_fp8, lib.gemv_f32, lib.gemv_f32_io, lib.gemv_f32_heads,
              lib.rmsnorm_f32, lib.moe_combine_f32, lib.decode_work_free, lib.prefill_norm, lib.gate_unpack,
              lib.gate_apply):
        f.restype = None
    # these allocate: they return 0, or -1 where memory could not be had, which every call checks
    for f in (lib.gemv_i8, lib.gemv_i4, lib.gemv_mxfp4, lib.swiglu_q, lib.clamped_swiglu_q, lib.attend_decode_f32,
              lib.decode_step, lib.decode_attend, lib.decode_ffn, lib.decode_experts, lib.decode_ffn_done,
              lib.decode_head, lib.prefill_attend, lib.deltanet_step,
              lib.prefill_head, lib.prefill_experts, lib.prefill_finish, lib.lin_rows):
        f.restype = ctypes.c_int
        f.errcheck = _out_of_memory
    lib.decode_work.errcheck = _no_work
    lib.kernels_isa.restype = ctypes.c_int
    return lib


def _out_of_memory(rc: int, fn, args) -> int:
    if rc != 0:
        raise MemoryError(f"semoe's CPU kernels: out of memory for the buffers of {fn.__name__}")
    return rc


def _no_work(work: int | None, fn, args) -> int:
    if not work:
        raise MemoryError("semoe's CPU kernels: out of memory for a decoding step's buffers (decode_work)")
    return work


def load(path: str) -> ctypes.CDLL:
    """The library at `path`, its structs' layouts checked and its entry points declared."""
    lib = ctypes.CDLL(path)
    check_layout(lib, path)
    try:
        return _declare(lib)
    except AttributeError as e:  # an entry point this loader declares is missing: an older build
        raise KernelABIError(f"{path}: {str(e).rsplit(': ', 1)[-1]}, built from older sources than "
                             f"semoe/kernels/loader.py: reinstall (pip install -e .) to rebuild the kernels") from None


def installed() -> dict[str, str]:
    """Variant name -> the path of its library, for every build the install made (on any CPU)."""
    out = {}
    for v in variants.VARIANTS:
        spec = importlib.util.find_spec(f"semoe.kernels.{v.module}")
        if spec is not None and spec.origin is not None:
            out[v.name] = spec.origin
    return out


def choose(flags: frozenset[str], builds: dict[str, str], machine: str | None = None) -> tuple[str, str] | None:
    """(variant, path) of the best build in `builds` that a CPU with these flags (of `machine`, this
    one's by default) runs; None if none."""
    for v in variants.runnable(flags, machine):
        if v.name in builds:
            return v.name, builds[v.name]
    return None


# a vector build measured faster than the best one the CPU's flags allow replaces it only by this much,
# so that timing noise never flips the choice between two builds that run alike
MEASURED_MARGIN = 0.05
# a measurement whose rounds had less than this share of the cores (another heavy job running) is not
# trusted: that process takes the best build by flags, nothing is kept, and the next process measures again
QUIET_SHARE = 0.8
# the workload `measure` times: decoding's products, float32, int8 and int4 codes (groups of 32), one
# row through an (O, I) weight larger than a core's L2, as a decoding step streams its weights
_WORK_O, _WORK_I, _WORK_G = 1024, 4096, 32


def measure(paths: list[str], rounds: int = 25) -> tuple[list[float], float]:
    """Seconds each library in `paths` takes for one pass of the workload (float32, int8 and int4
    products of one row), on every core this process may use: the fastest of `rounds` rounds, each
    running every library in turn, so that what else the machine does falls on all of them alike.
    Also the share of those cores the rounds had: CPU time over wall time times the cores (near 1 on
    an idle machine; well under it while other work takes cores)."""
    import time

    libs = [load(p) for p in paths]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    O, I, g = _WORK_O, _WORK_I, _WORK_G
    x, y = (ctypes.c_float * I)(), (ctypes.c_float * O)()
    w32, w8, w4 = (ctypes.c_float * (O * I))(), (ctypes.c_int8 * (O * I))(), (ctypes.c_uint8 * (O * I // 2))()
    s8, s4 = (ctypes.c_float * O)(), (ctypes.c_float * (2 * O * (I // g)))()
    for buf in (x, w32, w8, w4, s8, s4):  # written, so that every page is memory of its own (a zeroed
        ctypes.memset(buf, 0x3C, ctypes.sizeof(buf))  # one maps the one zero page); floats of 0.0115
    ptr = ctypes.addressof

    def once(lib) -> float:
        start = time.perf_counter()
        lib.gemv_f32(ptr(x), ptr(w32), ptr(y), 1, O, I, threads)
        lib.gemv_i8(ptr(x), ptr(w8), ptr(s8), ptr(y), 1, O, I, threads)
        lib.gemv_i4(ptr(x), ptr(w4), ptr(s4), ptr(y), 1, O, I, g, threads)
        return time.perf_counter() - start

    for lib in libs:  # warm-up: the weights into the page tables, the threads started
        once(lib)
    best = [float("inf")] * len(libs)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        for i, lib in enumerate(libs):
            best[i] = min(best[i], once(lib))
    share = (time.process_time() - cpu) / max((time.perf_counter() - wall) * threads, 1e-9)
    return best, share


def _choice_file() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "semoe", "kernel-choice.json")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def measured_choice(candidates: list[tuple[str, str]], flags: frozenset[str]) -> tuple[str, str]:
    """Of the vector builds this CPU runs (`candidates`, best by flags first), the one that runs the
    decoding workload fastest here: measured once per machine and set of builds, the result kept in
    ~/.cache/semoe/kernel-choice.json (`XDG_CACHE_HOME`), read back by every later process. Where the
    file cannot be written, each process measures for itself; where other work took the cores while
    measuring (`QUIET_SHARE`), the process takes the best build by flags and keeps nothing."""
    import hashlib
    import json
    import tempfile

    def stamp(path: str) -> list:
        st = os.stat(path)
        return [os.path.basename(path), st.st_size, int(st.st_mtime)]

    key = hashlib.sha256(json.dumps([_cpu_name(), sorted(flags), [(n, stamp(p)) for n, p in candidates]]
                                    ).encode()).hexdigest()[:16]
    file = _choice_file()
    try:
        with open(file, encoding="utf-8") as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    entry = known.get(key) if isinstance(known, dict) else None
    names = dict(candidates)
    if isinstance(entry, dict) and entry.get("choice") in names:
        return entry["choice"], names[entry["choice"]]
    loadable = []
    for name, path in candidates:
        try:
            load(path)
            loadable.append((name, path))
        except (OSError, KernelABIError):
            continue  # a build that does not load is not chosen; loading the choice says why
    timings, share = measure([p for _, p in loadable]) if loadable else ([], 1.0)
    seconds = dict(zip((n for n, _ in loadable), timings))
    first = candidates[0][0]
    pick = first
    if first in seconds:
        faster = min(seconds, key=seconds.get)
        if seconds[faster] < (1 - MEASURED_MARGIN) * seconds[first]:
            pick = faster
    if share < QUIET_SHARE:  # timed while other work took the cores: not to be trusted, nor kept
        return first, names[first]
    known = known if isinstance(known, dict) else {}
    known[key] = {"cpu": _cpu_name(), "choice": pick, "seconds": {n: round(t, 6) for n, t in seconds.items()},
                  "cpu_share": round(share, 3)}
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), prefix=".kernel-choice-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, file)
    except OSError:
        pass
    return pick, names[pick]


@cache
def chosen() -> tuple[str, str] | None:
    """(variant, path) of the library `library()` loads: SEMOE_CPU_KERNELS's (another build of
    semoe/kernels/*.c, as the tests load each variant's; `off` for none), or the installed build this
    CPU runs fastest: the best its flags allow, unless another vector build it runs was measured
    faster here (`measured_choice`; the portable build is the fallback, never measured); None where
    there is none."""
    path = os.environ.get("SEMOE_CPU_KERNELS")
    if path == "off":
        return None
    if path:
        return "SEMOE_CPU_KERNELS", path
    flags, builds = variants.cpu_flags(), installed()
    vector = [(v.name, builds[v.name]) for v in variants.runnable(flags) if v.name in builds and v.cpu_flags]
    if len(vector) > 1:
        return measured_choice(vector, flags)
    return choose(flags, builds)


@cache
def library() -> ctypes.CDLL | None:
    """The kernels' library with its layouts checked and entry points declared; None where no build
    this CPU runs is installed (the callers then take torch's ops)."""
    pick = chosen()
    if pick is None:
        return None
    name, path = pick
    lib = load(path)
    took = ISAS[lib.kernels_isa()]
    if name in variants.BY_NAME and took != name:  # CFLAGS at install can add vector flags
        raise KernelABIError(f"{path}: installed as the {name} kernels but built for {took} (flags from the "
                             f"environment at install, such as CFLAGS?): reinstall without them")
    return lib


def status() -> str:
    """One line on the kernels in use, for `semoe env` and the install: the variant and library, or
    why there are none."""
    pick = chosen()
    if pick is not None:
        best = choose(variants.cpu_flags(), installed())
        why = f", measured faster here than {best[0]}" if best is not None and best[0] != pick[0] and \
            pick[0] in variants.BY_NAME else ""
        return f"{ISAS[library().kernels_isa()]} ({os.path.basename(pick[1])}{why})"
    if os.environ.get("SEMOE_CPU_KERNELS") == "off":
        return "off (SEMOE_CPU_KERNELS=off)"
    builds = installed()
    if builds:
        return f"off: this CPU runs none of the installed builds ({', '.join(builds)})"
    return "off: not built at install (no C compiler with OpenMP)"


ISAS = ("portable", "avx2", "avx512-vnni")  # the paths a library's code takes, by its kernels_isa()
