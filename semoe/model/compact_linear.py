"""Products with compact (quantized) weights: the plain reference and the fast path it checks.

A `CompactWeight` is a weight as the store keeps it (codes and scales, `storage.quant`); the model
computes on it without widening it in memory:

- reference: dequantize to the weight's logical dtype, then the float32 product (what the fast path
  is tested against), with x quantized per block of 32 where the decode kernels below define the
  product so (`quantizes_activations`);
- fast, on CPU, for the few rows of a decoding step: semoe's own kernels (`semoe.kernels.torch_ops`),
  which read the stored codes as they are (int8, int4, and a checkpoint's own MXFP4 blocks) and
  multiply them with x quantized per block of 32 inputs to int8 (as llama.cpp's CPU kernels do),
  summing each block exactly in integers;
- fast, on CPU, for more rows (prefill, evaluation) or where those kernels are not built: torch's
  packed weight-only ops, int8 through `_weight_int8pack_mm`, int4 through
  `_weight_int4pack_mm_for_cpu` where it reads the stored layout (`torch_int4_reads_our_layout`),
  both with bfloat16 activations and scales (their float32 variants run 7x and 35x slower at one
  token);
- fast, elsewhere (CUDA, FP8, MXFP4 beyond a decoding step's rows), and as `kernel="dequantize"`:
  dequantize into a scratch tensor (the allocator's cache
  reuses it) holding the weight as the checkpoint defines it (its logical dtype and layout: a
  dequantized FP8 checkpoint is bfloat16), then the dense product in the compute dtype.

Shape legend: M rows, I in features, O out features.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from semoe.kernels import torch_ops
from storage.dtypes import dtype_name, torch_dtype
from storage.errors import BadInputError
from storage.formats import auto_dense
from storage.quant import (INT4_BLOCK_ROWS, QuantShapeError, QuantSpec, check_fits, dequantize, dequantize_out_in,
                           pack_int4, quantize_blocks)
from storage.formats import INT4_DEFAULT_GROUP, INT4_GROUP_SIZES

# auto: the fast path for the device; dequantize: the one CUDA takes (forced here to test it on CPU);
# reference: dequantize, then a float32 product (of x as the CPU decode kernels see it, where they apply)
KERNELS = ("auto", "dequantize", "reference")
# torch's packed int8 product (`_weight_int8pack_mm`) takes inputs of a multiple of this many features:
# on an AVX-512 CPU, torch 2.13's kernel crashes the process (SIGSEGV) on four or more rows of any other
# width; the others go through the dequantized weight
TORCH_INT8_K = 16


@cache
def torch_int4_reads_our_layout() -> bool:
    """Whether torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) reads the codes as stored here.

    Its packing depends on the instruction set torch dispatches to: the stored layout is the one it
    uses with AVX-512; with AVX2 it packs otherwise, and reading our codes would give wrong products.
    Asked once, of torch's own packing op on a probe of every code."""
    q = (torch.arange(2 * INT4_BLOCK_ROWS * 64, dtype=torch.int32) * 7 % 16).view(2 * INT4_BLOCK_ROWS, 64)
    try:
        theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    except (AttributeError, RuntimeError):  # a torch without the op
        return False
    ours = pack_int4(q)
    return theirs.shape == ours.shape and bool(torch.equal(theirs, ours))


@dataclass(frozen=True, eq=False)
class CompactWeight:
    """A quantized weight: codes and scales (on the compute device) and how they decode."""

    codes: torch.Tensor
    scales: torch.Tensor
    spec: QuantSpec
    kernel: str = "auto"  # one of KERNELS

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")

    @property
    def shape(self) -> torch.Size:
        """The logical shape."""
        return torch.Size(self.spec.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The logical tensor, in `dtype` (default: the logical dtype)."""
        return dequantize(self.codes, self.scales, self.spec, dtype)

    def fp8_kernel(self, x_MI: torch.Tensor) -> bool:
        """Whether a product with x is semoe's FP8 CPU kernel's (`torch_ops.gemv_fp8`: square tiles of
        scales, a decoding step's few float32 rows on CPU, the kernels built): each tile's sum in float32 times
        its scale, where the dequantized weight would round each element to the logical dtype first
        (the reference kernel then dequantizes to float32, the arithmetic the kernel defines)."""
        return self.spec.scheme == "fp8" and fp8_tile(self.spec) > 0 and x_MI.dtype == torch.float32 \
            and torch_ops.takes(x_MI)

    def quantizes_activations(self, x_MI: torch.Tensor) -> bool:
        """Whether a product with x is defined by semoe's CPU kernels, x quantized per block of 32
        (int8 and int4 weights with a decoding step's few rows, MXFP4 ones with any number, on CPU,
        the kernels built); the reference kernel then computes the same arithmetic plainly."""
        scheme = self.spec.scheme
        return scheme in ("int8", "int4", "mxfp4", "ggml") and torch_ops.takes(x_MI, torch_ops.max_rows(scheme))

    def linear(self, x_MI: torch.Tensor) -> torch.Tensor:
        """x @ W.T for the out-major W (O, I) the codes hold, in x's dtype."""
        if self.kernel == "reference":
            as_dtype = torch.float32 if self.fp8_kernel(x_MI) else torch_dtype(self.spec.dtype)
            w_OI = dequantize_out_in(self.codes, self.scales, self.spec, as_dtype)
            x = x_MI.to(torch.float32)
            if self.quantizes_activations(x_MI):
                # the arithmetic the decode kernels define
                x = torch_ops.activations_as_seen(x, torch_ops.activation_block(self.spec.ggml_type))
            return F.linear(x, w_OI.to(torch.float32)).to(x_MI.dtype)
        packed = self.kernel == "auto" and x_MI.device.type == "cpu"
        if packed and self.quantizes_activations(x_MI):
            if self.spec.scheme == "int8":
                y = torch_ops.gemv_i8(x_MI, self.codes, self.scales)
            elif self.spec.scheme == "mxfp4":  # stored out-major: (O, I/32, 16) blocks
                y = torch_ops.gemv_mxfp4(x_MI, self.codes, self.scales)
            elif self.spec.scheme == "ggml":  # a GGUF file's rows of blocks
                y = torch_ops.gemv_ggml(x_MI, self.codes, self.spec.out_in[1], self.spec.ggml_type)
            else:
                y = torch_ops.gemv_i4(x_MI, self.codes, self.scales, self.spec.group_size)
            return y if y.dtype == x_MI.dtype else y.to(x_MI.dtype)
        if packed and self.fp8_kernel(x_MI):
            return torch_ops.gemv_fp8(x_MI, self.codes, self.scales, fp8_tile(self.spec))
        if packed and self.spec.scheme == "int8" and x_MI.shape[-1] % TORCH_INT8_K == 0:
            x = x_MI.reshape(-1, x_MI.shape[-1]).to(torch.bfloat16)
            y = torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales.to(torch.bfloat16))
            return y.to(x_MI.dtype).view(*x_MI.shape[:-1], -1)
        if packed and self.spec.scheme == "int4" and torch_int4_reads_our_layout():
            x = x_MI.reshape(-1, x_MI.shape[-1]).to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.codes, self.spec.group_size,
                                                           self.scales.to(torch.bfloat16))
            return y.to(x_MI.dtype).view(*x_MI.shape[:-1], -1)
        # the weight as the checkpoint defines it (its logical dtype and layout), then the product a
        # plain weight of it gets (`linear`: the same bits as the checkpoint's dequantized weights)
        w = self.dequantize().to(x_MI.dtype)
        return matmul(x_MI, w) if self.spec.transposed else linear(x_MI, w)


Weight = torch.Tensor | CompactWeight


def fp8_tile(spec: QuantSpec) -> int:
    """The side of an FP8 weight's square tiles of scales (DeepSeek-V3's and Kimi-K2's 128 x 128), which
    the FP8 kernel takes; 0 where its blocks are not square, or it is not FP8 or out-major."""
    if spec.scheme != "fp8" or spec.transposed or spec.block is None or spec.block[0] != spec.block[1]:
        return 0
    return int(spec.block[0])


def swiglu_operands(gate: Weight, up: Weight, down: Weight) -> tuple | None:
    """Where one call of semoe's CPU SwiGLU kernel computes this expert: three int8 or three int4
    weights stored out-major (the `auto` kernel), or three plain float32 or bfloat16 (O, I) weights
    contiguous on CPU. Its operands (bits: 8, 4, 32 or 16; (codes, scales) of gate, up and down, the
    scales None for float weights; gate/up's group, down's group); None elsewhere. The one test the
    model's experts and `DecodePlan` both make."""
    ws = (gate, up, down)
    if all(isinstance(w, torch.Tensor) for w in ws):
        if gate.dtype not in (torch.float32, torch.bfloat16) or any(
                w.dtype != gate.dtype or w.dim() != 2 or w.device.type != "cpu" or not w.is_contiguous() for w in ws):
            return None
        return (32 if gate.dtype == torch.float32 else 16, (gate, None), (up, None), (down, None), 0, 0)
    if not all(isinstance(w, CompactWeight) and w.kernel == "auto" and not w.spec.transposed for w in ws):
        return None
    scheme = gate.spec.scheme
    if scheme not in ("int8", "int4") or up.spec.scheme != scheme or down.spec.scheme != scheme:
        return None
    return (8 if scheme == "int8" else 4, (gate.codes, gate.scales), (up.codes, up.scales), (down.codes, down.scales),
            gate.spec.group_size or 0, down.spec.group_size or 0)


def fused_swiglu(x_MD: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor | None:
    """down(silu(gate x) * up x) in one call of semoe's CPU kernel where it applies (`swiglu_operands`,
    and a decoding step's few rows on CPU, no gradient wanted); None elsewhere, for the caller to
    compose the three products. Compact weights of the `dequantize` kernel are their float weights
    (`CompactWeight.linear`), here as in each product."""
    if all(isinstance(w, CompactWeight) and w.kernel == "dequantize" for w in (gate, up, down)):
        gate, up, down = (w.dequantize().to(x_MD.dtype) for w in (gate, up, down))
    ops = swiglu_operands(gate, up, down)
    if ops is None or not torch_ops.takes(x_MD) or not torch_ops.no_grad_wanted(
            x_MD, *(w for w in (gate, up, down) if isinstance(w, torch.Tensor))):
        return None
    y = torch_ops.swiglu(x_MD, *ops)
    return y if y.dtype == x_MD.dtype else y.to(x_MD.dtype)


def fused_clamped_swiglu(x_MD: torch.Tensor, parts: tuple, alpha: float, limit: float) -> torch.Tensor | None:
    """gpt-oss's expert (`experts.ClampedSwiGLU`: gate_up and its bias, down and its bias) in one call of
    semoe's CPU kernel where both weights are compact of one scheme the kernels take (int8, int4 or
    MXFP4, the `auto` kernel) and x is a decoding step's few rows on CPU; None elsewhere."""
    gate_up, bias_gu, down, bias_d = parts
    if not all(isinstance(w, CompactWeight) and w.kernel == "auto" and w.spec.transposed for w in (gate_up, down)):
        return None
    scheme = gate_up.spec.scheme
    if scheme not in torch_ops.CLAMPED_KINDS or down.spec.scheme != scheme \
            or not torch_ops.takes(x_MD, torch_ops.max_rows(scheme)):
        return None
    y = torch_ops.clamped_swiglu(x_MD, scheme, (gate_up.codes, gate_up.scales), bias_gu, (down.codes, down.scales),
                                   bias_d, gate_up.spec.group_size or 0, down.spec.group_size or 0, alpha, limit)
    return y if y.dtype == x_MD.dtype else y.to(x_MD.dtype)


def _float_kernel_applies(x_MI: torch.Tensor, w_OI: torch.Tensor) -> bool:
    """A bfloat16 or float32 weight on CPU times a decoding step's few rows, no gradient wanted:
    semoe's kernels (`torch_ops.gemv_bf16`, `gemv_f32`) stream it at the memory bound on all the
    threads; torch's bfloat16 product runs at half of it, its float32 one on one core. Float32 ones
    take a batch's rows too (`torch_ops.MAX_F32_ROWS`)."""
    rows = torch_ops.MAX_F32_ROWS if w_OI.dtype == torch.float32 else torch_ops.MAX_ROWS
    return w_OI.dtype in (torch.bfloat16, torch.float32) and w_OI.device.type == "cpu" and w_OI.dim() == 2 \
        and w_OI.is_contiguous() and torch_ops.no_grad_wanted(x_MI, w_OI) and torch_ops.takes(x_MI, rows)


def linear(x_MI: torch.Tensor, w_OI: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for a plain (O, I) weight or a compact one."""
    if isinstance(w_OI, CompactWeight):
        y = w_OI.linear(x_MI)
    elif _float_kernel_applies(x_MI, w_OI):
        gemv = torch_ops.gemv_bf16 if w_OI.dtype == torch.bfloat16 else torch_ops.gemv_f32
        y = gemv(x_MI, w_OI).to(x_MI.dtype)
    else:
        return F.linear(x_MI, w_OI, bias)
    return y if bias is None else y + bias.to(y.dtype)


class Linear(nn.Linear):
    """`nn.Linear` whose product goes through `linear`: semoe's CPU kernel for a decoding step's rows
    where it applies (bfloat16 and float32 weights), torch's otherwise. The model's dense layers are these."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def matmul(x_MI: torch.Tensor, w_IO: Weight) -> torch.Tensor:
    """x @ w for a plain (I, O) weight or a compact one whose logical layout is (I, O)."""
    if isinstance(w_IO, CompactWeight):
        if not w_IO.spec.transposed:
            raise ValueError(f"a compact weight of logical shape {list(w_IO.shape)} stored out-major cannot be "
                             f"the right operand of x @ w")
        return w_IO.linear(x_MI)
    if w_IO.dtype == torch.float32 and x_MI.dtype == torch.float32 and _float_kernel_applies(x_MI, w_IO) \
            and x_MI.numel() // x_MI.shape[-1] <= torch_ops.MAX_ROWS:
        return torch_ops.gemv_f32_io(x_MI, w_IO)  # a decoding step's rows: all the threads, not one
    return x_MI @ w_IO


# -- dense weights ------------------------------------------------------------------------------

# what `--dense` may ask for: the weights outside the experts as the store holds them, int8 or int4
DENSE_CHOICES = ("auto", "float", "int8", "int4")


class CompactLinear(nn.Module):
    """`nn.Linear`'s forward over a compact weight (and the float bias, when there is one)."""

    def __init__(self, weight: CompactWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.spec.out_in[1]

    @property
    def out_features(self) -> int:
        return self.weight.spec.out_in[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight.linear(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.weight.spec.scheme}"


def stacked_rows(linears: list[CompactLinear]) -> CompactLinear | None:
    """One `CompactLinear` computing the given ones' outputs side by side (their rows stacked: one
    kernel call and one quantization of x instead of one each; every row's arithmetic unchanged, so
    the same bits), or None where their schemes, groups, dtypes, kernels, inputs or biases differ."""
    first = linears[0].weight
    same = {(w.spec.scheme, w.spec.group_size, w.spec.ggml_type, w.spec.dtype, w.kernel, w.shape[1], w.codes.device)
            for w in (lin.weight for lin in linears)}
    biases = [lin.bias for lin in linears]
    if len(same) != 1 or first.spec.scheme not in ("int8", "int4", "ggml") or len({b is None for b in biases}) != 1:
        return None
    codes = torch.cat([lin.weight.codes for lin in linears])  # int4's 64-row blocks stay whole: O is a multiple
    scales = torch.cat([lin.weight.scales for lin in linears], dim=1 if first.spec.scheme == "int4" else 0)
    spec = QuantSpec(scheme=first.spec.scheme, dtype=first.spec.dtype, shape=(codes.shape[0], first.shape[1]),
                     scales="", group_size=first.spec.group_size, ggml_type=first.spec.ggml_type)
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    return CompactLinear(CompactWeight(codes, scales.contiguous(), spec, first.kernel), bias)


def stacked_float_rows(linears: list[nn.Linear]) -> Linear | None:
    """One `Linear` computing the given plain ones' outputs side by side (an inference model's float
    q, k and v: one kernel call a decoding step instead of three; each row's sum is the kernel's
    either way, so the same bits), or None where their dtypes, devices, inputs or biases differ."""
    same = {(lin.weight.dtype, lin.weight.device, lin.in_features, lin.bias is None) for lin in linears}
    if len(same) != 1 or not all(type(lin) is Linear for lin in linears):
        return None
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
    stacked = Linear(1, 1, bias=False, device="meta")  # no weights of its own to make: they are set below
    stacked.in_features, stacked.out_features = linears[0].in_features, weight.shape[0]
    # as the parts: whether autograd wants them picks torch's product or the kernel (`linear`)
    wants = linears[0].weight.requires_grad
    stacked.weight = nn.Parameter(weight, requires_grad=wants)
    stacked.bias = None if bias is None else nn.Parameter(bias, requires_grad=wants)
    return stacked


def stack_projections(model: nn.Module) -> None:
    """Each attention's q, k and v as one product (`Attention.stack_qkv`), once their weights and
    biases are loaded."""
    for mod in model.modules():
        if hasattr(mod, "stack_qkv"):
            mod.stack_qkv()


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and compact weights, as they are held."""
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    return total + sum(m.weight.nbytes for m in module.modules() if isinstance(m, CompactLinear))


def resolve_dense(dense: str, *, device: torch.device | str, expert_schemes: set[str]) -> str:
    """`dense` as asked, or for `auto` what `storage.formats.auto_dense` takes on `device`."""
    if dense not in DENSE_CHOICES:
        raise ValueError(f"dense must be one of {', '.join(DENSE_CHOICES)}, got {dense!r}")
    if dense != "auto":
        return dense
    return auto_dense(expert_schemes, torch.device(device).type == "cpu")


def _fits(shape: tuple[int, ...], dtype: torch.dtype, scheme: str, group_size: int | None) -> bool:
    try:
        check_fits(shape, dtype, scheme, group_size)
    except QuantShapeError:
        return False
    return True


def dense_linear_names(model: nn.Module) -> list[str]:
    """The dense linear layers `compact_dense_linears` makes compact (attention, lm_head, dense and
    shared feed-forwards): every `nn.Linear` but a shared expert's gate, latent attention's kv_b and
    DeepSeek-V4's grouped output projection (`wo_a`, applied per group as a (groups, rank, in) view)."""
    return [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)
            and not name.endswith(("shared_gate", "kv_b_proj", "wo_a"))]


def compact_dense_linears(model: nn.Module, scheme: str = "int8", *, kernel: str = "auto",
                          group_size: int = INT4_DEFAULT_GROUP,
                          weight_rows: Callable[[str], Iterable[torch.Tensor]] | None = None,
                          stored_int8: Callable[[str], tuple[torch.Tensor, torch.Tensor] | None] | None = None,
                          stored_blocks: Callable[[str], tuple[torch.Tensor, QuantSpec] | None] | None = None
                          ) -> None:
    """Replace the model's dense `nn.Linear` layers (attention, lm_head, dense and shared
    feed-forwards) by `CompactLinear`s of `scheme`, quantized here; the routers and the token
    embedding stay as they are (a router's few rows decide which experts run), and so does latent
    attention's kv_b (decoding takes it into the query and the output in the absorbed form,
    `semoe.decode.plan`, which multiplies float rows, not a latent quantized per block). int4 takes groups of
    `group_size` inputs, or the largest smaller group that divides the input features; the lm_head
    and any weight int4 cannot hold (out features not a multiple of 64) take int8: the
    output layer's errors land on every logit directly (llama.cpp's 4-bit files keep it at 6 bits
    or more too). `weight_rows(name)`: the named layer's weight as blocks of its rows, where a loader
    reads it from storage block by block (the layer's own weight is then never filled, and the float
    weights are never in memory whole); the layer's own weight by default. `stored_int8(name)`: the
    named layer's int8 codes and scales where a store holds them so (`semoe store quantize`: what
    this function would make of the float weight), taken as they are where this function would
    make int8, else None. `stored_blocks(name)`: the named layer's rows of GGUF blocks and their spec where
    a store holds them so (imported from a GGUF file), taken as they are whatever `scheme` is, else None."""
    if scheme not in ("int8", "int4"):
        raise ValueError(f"dense weights can be quantized to int8 or int4, not {scheme!r}")
    for name in dense_linear_names(model):
        mod = model.get_submodule(name)
        w = mod.weight.detach()
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        blocks = stored_blocks(name) if stored_blocks is not None else None
        if blocks is not None:
            rows, spec = blocks
            if tuple(spec.shape) != tuple(w.shape):
                raise BadInputError(f"{name}: {spec.ggml_type} rows of shape {list(spec.shape)} stored for a weight of "
                                    f"shape {list(w.shape)}")
            rows = rows.to(w.device)
            setattr(parent, attr, CompactLinear(CompactWeight(rows, rows[:0], spec, kernel), mod.bias))
            continue
        choices = [("int8", None)]
        if scheme == "int4" and name != "lm_head":  # the largest group up to group_size dividing the inputs
            g = max((s for s in INT4_GROUP_SIZES if s <= group_size and w.shape[1] % s == 0), default=group_size)
            choices.insert(0, ("int4", g))
        fitting = [c for c in choices if _fits(tuple(w.shape), w.dtype, *c)]
        if not fitting:
            continue
        this, g = fitting[0]
        held = stored_int8(name) if this == "int8" and stored_int8 is not None else None
        if held is not None:
            codes, scales = held
            if tuple(codes.shape) != tuple(w.shape) or tuple(scales.shape) != (w.shape[0],):
                raise BadInputError(f"{name}: int8 codes {list(codes.shape)} and scales {list(scales.shape)} "
                                    f"stored for a weight of shape {list(w.shape)}")
        else:
            rows = [w] if weight_rows is None else weight_rows(name)
            codes, scales = quantize_blocks(rows, tuple(w.shape), w.dtype, this, group_size=g)
        spec = QuantSpec(scheme=this, dtype=dtype_name(w.dtype), shape=tuple(w.shape), scales="", group_size=g)
        setattr(parent, attr, CompactLinear(CompactWeight(codes.to(w.device), scales.to(w.device), spec, kernel),
                                            mod.bias))

