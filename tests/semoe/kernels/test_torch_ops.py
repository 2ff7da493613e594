"""semoe's compiled CPU kernels against plain references, on odd shapes too.

The kernels quantize x per block of 32 inputs (`quantize_activations`); the compiled quantization
must give the same codes and scales as torch's, bit for bit, and the products must equal the float64
product of the dequantized x with the dequantized weight. Tolerances: the kernels' block sums are
exact integers, then float32 sums in another order than the reference's, so relative to the output's
scale 1e-5 (float32 has 24 bits; a sum of a few thousand terms loses a few more).
"""

from __future__ import annotations

import ctypes
import json

import pytest
import torch

from helpers.kernels import needs_kernels
from semoe.kernels import torch_ops, loader, variants
from storage.quant import QuantSpec, dequantize, quantize

pytestmark = needs_kernels


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_best_installed_build_this_cpu_runs_is_loaded():
    name, _ = loader.chosen()
    assert torch_ops.isa() in loader.ISAS
    if name != "SEMOE_CPU_KERNELS":  # else a build the environment names (the per-build slow test's)
        builds = loader.installed()
        best = next(v.name for v in variants.runnable(variants.cpu_flags()) if v.name in builds)
        if name != best:  # only where another vector build was timed faster here, quietly (`measured_choice`)
            with open(loader._choice_file()) as f:
                kept = [e for e in json.load(f).values() if e.get("choice") == name]
            assert any(e["seconds"][name] < (1 - loader.MEASURED_MARGIN) * e["seconds"][best] for e in kept)
        assert torch_ops.isa() == name


SHAPES = [(1, 64, 16), (1, 3584, 1024), (3, 1024, 3584), (16, 7, 5), (5, 130, 333), (2, 1, 17)]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The kernels split output rows over torch's thread count: both ways must give the same sums."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("M, O, I", SHAPES)
def test_int8_product_equals_the_dequantized_reference(M, O, I, threads):
    g = torch.Generator().manual_seed(O + I)
    x, w = torch.randn(M, I, generator=g), torch.randn(O, I, generator=g)
    codes, scales = quantize(w, "int8")
    spec = QuantSpec(scheme="int8", dtype="F32", shape=(O, I), scales="s")
    ref = torch_ops.activations_as_seen(x).double().mm(dequantize(codes, scales, spec).double().T).float()
    assert _relative(torch_ops.gemv_i8(x, codes, scales), ref) < 1e-5


@pytest.mark.parametrize("M, O, I, group", [(1, 64, 32, 32), (1, 3584, 1024, 128), (3, 1024, 3584, 128),
                                            (16, 192, 256, 64), (2, 128, 512, 256)])
def test_int4_product_equals_the_dequantized_reference(M, O, I, group, threads):
    g = torch.Generator().manual_seed(O + I + group)
    x, w = torch.randn(M, I, generator=g), torch.randn(O, I, generator=g)
    codes, sz = quantize(w, "int4", group_size=group)
    spec = QuantSpec(scheme="int4", dtype="F32", shape=(O, I), scales="s", group_size=group)
    ref = torch_ops.activations_as_seen(x).double().mm(dequantize(codes, sz, spec).double().T).float()
    assert _relative(torch_ops.gemv_i4(x, codes, sz, group), ref) < 1e-5


def test_int4_rows_taken_in_pairs_are_each_rows_own_product(threads):
    """Over many rows the int4 kernel splits each column pair's codes into nibbles once for two rows
    of x; every row's sums stay its one-row product's, bit for bit (a prompt's positions agree with
    decoding's steps), the odd last row included."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(5, 256, generator=g), torch.randn(128, 256, generator=g)
    codes, sz = quantize(w, "int4", group_size=64)
    rows = torch.cat([torch_ops.gemv_i4(x[m:m + 1], codes, sz, 64) for m in range(5)])
    assert torch.equal(torch_ops.gemv_i4(x, codes, sz, 64), rows)


@pytest.mark.parametrize("O, I", [(7, 160), (64, 1024), (6, 40)])
def test_int8_rows_taken_in_pairs_are_each_rows_own_product(O, I, threads):
    """Over many rows the int8 kernel takes two rows of x against two weight rows at a time, sharing
    their loads; every row's sums stay its one-row product's, bit for bit: the odd last row of x, an
    odd last weight row (7 = 4 + 3 rows), a last block of 32 inputs past the pairs of blocks (160)
    and one shorter than 32 (40)."""
    g = torch.Generator().manual_seed(O + I)
    x, w = torch.randn(5, I, generator=g), torch.randn(O, I, generator=g)
    codes, scales = quantize(w, "int8")
    rows = torch.cat([torch_ops.gemv_i8(x[m:m + 1], codes, scales) for m in range(5)])
    assert torch.equal(torch_ops.gemv_i8(x, codes, scales), rows)


@pytest.mark.parametrize("M, O, I", [(1, 64, 32), (1, 5760, 2880), (3, 130, 96), (16, 7, 32), (2, 64, 1024),
                                     (5, 33, 160), (40, 64, 288)])  # a prompt's rows, 9 blocks (8 + 1)
def test_mxfp4_product_equals_the_dequantized_reference(M, O, I, threads):
    """gpt-oss's MXFP4 blocks as stored (out-major), every code, exponents around 2^0 and a block of
    exponent 0 and one of 1 (subnormal powers of two in float32): each output within 1e-5 of the float64
    sum of |x| |w| that bounds its rounding."""
    from storage.dequant import dequantize_mxfp4

    g = torch.Generator().manual_seed(O + I)
    x = torch.randn(M, I, generator=g)
    blocks = torch.randint(0, 256, (O, I // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 136, (O, I // 32), dtype=torch.uint8, generator=g)
    scales[0, 0], scales[-1, -1] = 0, 1  # the subnormal powers of two
    w_IO = dequantize_mxfp4(blocks[None], scales[None], torch.float64)[0]
    xq = torch_ops.activations_as_seen(x).double()
    ref, bound = xq.mm(w_IO), xq.abs().mm(w_IO.abs())
    got = torch_ops.gemv_mxfp4(x, blocks, scales).double()
    assert ((got - ref).abs() <= 1e-5 * bound + 1e-300).all()
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("M, I", [(1, 1024), (3, 5), (2, 333), (4, 64)])
def test_the_compiled_activation_quantization_is_torchs_bit_for_bit(M, I):
    g = torch.Generator().manual_seed(M * I)
    x = torch.randn(M, I, generator=g) * torch.logspace(-3, 2, I)  # blocks of very different scales
    x[0, :32] = 0.0  # a block of zeros: scale 0, codes 0
    q, d = torch_ops.quantize_activations(x)
    qc, dc = torch_ops.quantize_activations_compiled(x)
    assert torch.equal(q, qc) and torch.equal(d, dc)
    assert q[0, :32].abs().sum() == 0 and d[0, 0] == 0
    # the quantization itself: within half a step of x, and the block's largest input hits 127
    seen = torch_ops.dequantize_activations(q, d)
    step = torch.repeat_interleave(d, 32, dim=-1)[..., :I]
    assert bool(((seen - x).abs() <= 0.5 * step * (1 + 1e-6) + 1e-30).all())
    assert int(q.abs().max()) == 127


@pytest.mark.parametrize("chunk", [0, 4, 7])
def test_a_prompts_attention_rows_with_values_shorter_than_keys(chunk):
    """attend_rows_head with keys of Dh and values of Dv (latent attention's expanded form: a group a
    head, keys nope + R long, values dv): each row's causal softmax attention against float64's,
    within 1e-5 relative to the largest output (float32 sums over 31 positions); with a chunk, each
    row over its own chunk's positions alone (Llama-4's chunked attention: rows 20..30 cross chunk
    boundaries within a group of rows)."""
    lib, p = torch_ops._lib(), lambda t: ctypes.c_void_p(t.data_ptr())
    P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.attend_rows_head.argtypes = [P, P, P, I, I, I, I, I, I, I, I, I, F, P, P, P, I, ctypes.c_int]
    g = torch.Generator().manual_seed(3)
    H, Dh, Dv, S, pos0, nr = 3, 24, 16, 31, 20, 11
    kc, vc = torch.randn(H, S, Dh, generator=g), torch.randn(H, S, Dv, generator=g)
    qr = torch.randn(nr, H, Dh, generator=g)
    scale = Dh ** -0.5
    got, scratch = torch.zeros(nr, H * Dv), torch.empty(4 * (pos0 + nr))
    for h in range(H):
        lib.attend_rows_head(p(qr), p(kc), p(vc), H, H, Dh, Dv, S, pos0, nr, 0, chunk, scale, None, p(scratch),
                             p(got), h, 0)
    want = torch.zeros(nr, H, Dv, dtype=torch.float64)
    for r in range(nr):
        n = pos0 + r + 1
        t0 = (n - 1) - (n - 1) % chunk if chunk else 0
        w = torch.softmax(torch.einsum("hd,hsd->hs", qr[r].double(), kc[:, t0:n].double()) * scale, -1)
        want[r] = torch.einsum("hs,hsd->hd", w, vc[:, t0:n].double())
    assert _relative(got, want.reshape(nr, H * Dv).float()) < 1e-5


def test_the_indexers_choice_is_the_best_scores_in_position_order():
    """choose_top (DeepSeek sparse attention's top-k): the k best of distinct scores are torch.topk's, in
    position order; all positions where there are no more than k; among equal scores at the k-th the
    earliest; a NaN score the lowest. index_score: the sum over heads of weight * relu(q . k / sqrt(Di)),
    against float64's within 1e-6 relative (float32 dots of 64)."""
    lib = torch_ops._lib()
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.choose_top.argtypes, lib.choose_top.restype = [P, I, I, P, P], I
    lib.index_score.argtypes, lib.index_score.restype = [P, P, I, I, ctypes.c_float, P], ctypes.c_float

    def choose(scores: list[float] | torch.Tensor, k: int) -> list[int]:
        sc = torch.as_tensor(scores, dtype=torch.float32).contiguous()
        idx, scratch = torch.zeros(len(sc), dtype=torch.int32), torch.empty(len(sc))
        n = lib.choose_top(sc.data_ptr(), len(sc), k, idx.data_ptr(), scratch.data_ptr())
        return idx[:n].tolist()

    g = torch.Generator().manual_seed(7)
    for n, k in ((50, 8), (2048, 64), (9, 4)):
        sc = torch.randn(n, generator=g)
        assert choose(sc, k) == sorted(torch.topk(sc, k).indices.tolist())
    assert choose([0.3, -1.0, 2.0], 4) == [0, 1, 2]
    assert choose([1.0, 1.0, 1.0, 0.0, 2.0], 2) == [0, 4]
    assert choose([float("nan"), 0.5, 0.2], 2) == [1, 2]
    assert choose([0.0, 0.0, 0.0], 2) == [0, 1]
    Hi, Di = 4, 64
    iq, iw, key = torch.randn(Hi, Di, generator=g), torch.randn(Hi, generator=g), torch.randn(Di, generator=g)
    got = lib.index_score(iq.data_ptr(), iw.data_ptr(), Hi, Di, Di ** -0.5, key.data_ptr())
    want = (iw.double() * torch.relu(iq.double() @ key.double() / Di ** 0.5)).sum().item()
    scale = (iw.double().abs() * (iq.double() @ key.double()).abs() / Di ** 0.5).sum().item()  # the terms' size
    assert abs(got - want) <= 1e-6 * scale


def test_bad_operands_are_refused():
    with pytest.raises(ValueError, match="x has 3 features, the weight 4"):
        torch_ops.gemv_i8(torch.randn(1, 3), torch.zeros(2, 4, dtype=torch.int8), torch.ones(2))
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        torch_ops.gemv_i8(torch.randn(1, 4), torch.zeros(4, 2, dtype=torch.int8).T, torch.ones(2))


@pytest.mark.parametrize("bits, M, D, F", [(8, 1, 1024, 3584), (8, 3, 70, 130), (8, 16, 33, 5),
                                           (4, 1, 1024, 3584), (4, 5, 128, 192), (4, 2, 192, 64)])
def test_the_fused_swiglu_expert_equals_its_three_products(bits, M, D, F, threads):
    """One call for gate, up, silu and down: the same sums as the three kernel calls with torch's silu
    between them. Tolerance: 1e-6 relative (the kernel's silu is h / (1 + exp(-h)) in float32, as
    torch's; an ulp apart could move one code of the hidden product's quantization)."""
    g = torch.Generator().manual_seed(D + F + bits)
    wg, wu, wd, x = (torch.randn(F, D, generator=g), torch.randn(F, D, generator=g), torch.randn(D, F, generator=g),
                     torch.randn(M, D, generator=g))
    if bits == 8:
        G, U, Dn = (quantize(w, "int8") for w in (wg, wu, wd))
        gi = gd = 0
        h = torch.nn.functional.silu(torch_ops.gemv_i8(x, *G)) * torch_ops.gemv_i8(x, *U)
        want = torch_ops.gemv_i8(h, *Dn)
    else:
        gi, gd = max(s for s in (32, 64, 128) if D % s == 0), max(s for s in (32, 64, 128) if F % s == 0)
        G, U, Dn = quantize(wg, "int4", group_size=gi), quantize(wu, "int4", group_size=gi), \
            quantize(wd, "int4", group_size=gd)
        h = torch.nn.functional.silu(torch_ops.gemv_i4(x, *G, gi)) * torch_ops.gemv_i4(x, *U, gi)
        want = torch_ops.gemv_i4(h, *Dn, gd)
    assert _relative(torch_ops.swiglu(x, bits, G, U, Dn, gi, gd), want) < 1e-6


def test_the_fused_swiglu_refuses_weights_of_different_experts():
    w8 = torch.zeros(8, 4, dtype=torch.int8), torch.ones(8)
    with pytest.raises(ValueError, match="not one expert's weights"):
        torch_ops.swiglu(torch.randn(1, 4), 8, w8, w8, (torch.zeros(4, 7, dtype=torch.int8), torch.ones(4)))


@pytest.mark.parametrize("M, O, I", SHAPES)
def test_float32_product_equals_the_reference(M, O, I, threads):
    g = torch.Generator().manual_seed(O * I + 1)
    x, w = torch.randn(M, I, generator=g), torch.randn(O, I, generator=g)
    ref = x.double().mm(w.double().T).float()
    assert _relative(torch_ops.gemv_f32(x, w), ref) < 1e-5
    with pytest.raises(ValueError, match="takes a float32 weight, got torch.bfloat16"):
        torch_ops.gemv_f32(x, w.bfloat16())


@pytest.mark.parametrize("M, O, I", [(7, 130, 333), (64, 96, 1024)])
def test_float32_batch_rows_are_each_the_row_alone_bit_for_bit(M, O, I, threads):
    """A batch's rows go three at a time (the rest one by one), each output summed in the order of its
    row alone: the same bits, so a sequence's tokens do not depend on its batch's size."""
    g = torch.Generator().manual_seed(M + O + I)
    x, w = torch.randn(M, I, generator=g), torch.randn(O, I, generator=g)
    got = torch_ops.gemv_f32(x, w)
    assert _relative(got, x.double().mm(w.double().T).float()) < 1e-5
    for i in range(M):
        assert torch.equal(got[i], torch_ops.gemv_f32(x[i:i + 1], w)[0]), i


@pytest.mark.parametrize("M, O, I", SHAPES)
def test_bfloat16_product_equals_the_widened_reference(M, O, I, threads):
    g = torch.Generator().manual_seed(O * I)
    x, w = torch.randn(M, I, generator=g), torch.randn(O, I, generator=g).bfloat16()
    ref = x.double().mm(w.double().T).float()
    assert _relative(torch_ops.gemv_bf16(x, w), ref) < 1e-5
    with pytest.raises(ValueError, match="takes a bfloat16 weight, got torch.float32"):
        torch_ops.gemv_bf16(x, w.float())


@pytest.mark.parametrize("M, O, I", SHAPES + [(5, 9, 40), (3, 6, 17)])
def test_bfloat16_product_is_its_float32_widenings_bit_for_bit(M, O, I, threads):
    """A bfloat16 weight gives the bits of the float32 kernel on its widening, on every build: the
    torch-free runner keeps a bfloat16 checkpoint's weights as they are where the engine widens them
    on CPU, and the two give the same logits bit for bit."""
    g = torch.Generator().manual_seed(O * I + 7)
    x, w = torch.randn(M, I, generator=g), torch.randn(O, I, generator=g).bfloat16()
    assert torch.equal(torch_ops.gemv_bf16(x, w), torch_ops.gemv_f32(x, w.float()))


@pytest.mark.parametrize("dtype, kernel, tol", [(torch.bfloat16, "gemv_bf16", 1e-2), (torch.float32, "gemv_f32", 1e-5)])
def test_the_models_linear_takes_the_float_kernels_for_a_decoding_steps_rows_only(monkeypatch, dtype, kernel, tol):
    """`semoe.model.compact_linear.Linear` (attention, lm_head, dense feed-forwards): bfloat16 and float32
    weights on CPU go through the kernels for up to 16 rows (float32: 64) without gradients; training
    and longer prefills keep torch's product. Tolerance 1e-2 where the output is rounded to bfloat16,
    1e-5 in float32."""
    from semoe.model.compact_linear import Linear

    calls = []
    real = getattr(torch_ops, kernel)
    monkeypatch.setattr(torch_ops, kernel, lambda x, w: calls.append(tuple(x.shape)) or real(x, w))
    torch.manual_seed(0)
    lin = Linear(64, 96).to(dtype)
    x = torch.randn(3, 64).to(dtype)
    with torch.no_grad():
        y = lin(x)
        assert calls == [(3, 64)] and y.dtype == dtype
        assert _relative(y.float(), (x.double() @ lin.weight.double().T + lin.bias.double()).float()) < tol
        rows = torch_ops.MAX_F32_ROWS if dtype == torch.float32 else torch_ops.MAX_ROWS
        lin(torch.randn(rows + 1, 64).to(dtype))  # a longer prefill's rows: torch's product
    assert calls == [(3, 64)]
    lin(x.requires_grad_()).sum().backward()  # gradients wanted: torch's product
    assert calls == [(3, 64)] and lin.weight.grad is not None


@pytest.mark.parametrize("heads, kv_heads, window, head_dim, over", [
    (8, 4, None, 16, {}), (4, 4, None, 16, {}), (6, 2, 3, 16, {}), (4, 2, None, 12, {}),
    (4, 2, 3, 16, dict(attention_sinks=True)),  # gpt-oss: sinks and a window
    (4, 2, None, 16, dict(qk_norm="head", rope_dim=8)),  # GLM-4.5: per-head norms, half the dims rotated
])
def test_one_call_decode_attention_equals_the_models_ops(monkeypatch, heads, kv_heads, window, head_dim, over):
    """A decoding step's attention in one kernel call (rotary, cache write, softmax, values) against the
    model's own ops (apply_rope, KVCache.append, attention_mask, attend), step after step: the same
    cache contents and outputs within 1e-5 relative (float32 sums in another order). A sliding window
    past the cached positions, sinks, per-head norms and partial rotary take the kernel too. A head
    of 12 takes the dot product's vector lanes and its tail."""
    from semoe.model.attention import Attention, KVCache, rope_tables
    from semoe.model.config import named_config

    c = named_config("tiny", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, sliding_window=window,
                     **over)
    torch.manual_seed(0)
    attn = Attention(c, 0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name == "sinks" or name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape) * 0.5 + (0 if name == "sinks" else 1))
    caches = [KVCache.empty(c, 1, 8) for _ in range(2)]
    used = []
    real = torch_ops.attend_decode
    monkeypatch.setattr(torch_ops, "attend_decode", lambda *a, **kw: used.append(a[7]) or real(*a, **kw))
    with torch.no_grad():
        for pos in range(6):
            x = torch.randn(1, 1, c.hidden_size)
            cos, sin = rope_tables(c, torch.tensor([[pos]]), torch.float32)
            fast = attn(x, cos, sin, caches[0])
            monkeypatch.setattr(Attention, "_one_call_decode", lambda *a: False)
            slow = attn(x, cos, sin, caches[1])
            monkeypatch.undo()
            monkeypatch.setattr(torch_ops, "attend_decode", lambda *a, **kw: used.append(a[7]) or real(*a, **kw))
            for cache in caches:
                cache.length += 1
            assert _relative(fast, slow) < 1e-5
            for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
                assert _relative(a, b) < 1e-6 if b.abs().max() > 0 else torch.equal(a, b)
    assert used == list(range(6))


def test_decode_attention_over_a_long_context_splits_heads_over_threads_with_the_same_bits():
    """Past a few hundred positions the kernel splits heads over threads: one thread and two give the
    same bits (each head's sums are its own), and both equal softmax(q k^T * scale) v in torch within
    1e-5 relative (float32 sums in another order)."""
    torch.manual_seed(0)
    H, G, Dh, S, pos = 8, 2, 16, 400, 350
    q, k, v = torch.randn(H * Dh), torch.randn(G * Dh), torch.randn(G * Dh)
    cos, sin = torch.ones(Dh), torch.zeros(Dh)  # no rotation: the reference below needs none
    kc, vc = torch.randn(G, S, Dh), torch.randn(G, S, Dh)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(torch_ops.attend_decode(q, k, v, cos, sin, kc.clone(), vc.clone(), pos, 0.25))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    keys, values = kc[:, :pos + 1].clone(), vc[:, :pos + 1].clone()
    keys[:, pos], values[:, pos] = k.view(G, Dh), v.view(G, Dh)
    group = torch.arange(H) // (H // G)
    ref = torch.softmax(q.view(H, 1, Dh) @ keys[group].transpose(1, 2) * 0.25, -1) @ values[group]
    assert _relative(outs[0], ref.reshape(-1)) < 1e-5


@pytest.mark.parametrize("rows, I, O", [(1, 64, 96), (3, 40, 1536), (16, 128, 35)])
def test_the_in_major_float32_product_equals_torchs_on_any_thread_count(rows, I, O):
    """x @ W for W laid out (I, O) (gpt-oss's fused experts): within 1e-6 relative of the float64 product
    (float32 sums in another order), the same bits on one thread and two (each output sums over the inputs
    in order), odd widths included; `compact_linear.matmul` takes it for a decoding step's rows."""
    from semoe.model.compact_linear import matmul

    torch.manual_seed(0)
    x, w = torch.randn(rows, I), torch.randn(I, O)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(torch_ops.gemv_f32_io(x, w))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert _relative(outs[0], (x.double() @ w.double()).float()) < 1e-6
    with torch.no_grad():
        assert torch.equal(matmul(x, w), torch_ops.gemv_f32_io(x, w))
    with pytest.raises(ValueError, match="float32 weight"):
        torch_ops.gemv_f32_io(x, w.to(torch.bfloat16))


def test_the_per_head_product_equals_torchs():
    """y[h] = W[h] x[h] for H heads (latent attention's absorbed step) in one call: within 1e-6 relative
    of the float64 batched product, odd sizes included."""
    torch.manual_seed(0)
    H, O, I = 5, 37, 70
    x, w = torch.randn(H, I), torch.randn(H, O, I)
    y = torch.empty(H, O)
    torch_ops._lib().gemv_f32_heads(x.data_ptr(), w.data_ptr(), y.data_ptr(), H, O, I, torch.get_num_threads())
    assert _relative(y, torch.bmm(w.double(), x.double()[:, :, None])[:, :, 0].float()) < 1e-6


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_gpt_oss_expert_in_one_call_equals_its_torch_composition(monkeypatch, scheme):
    """gpt-oss's clamped expert (interleaved gate/up with biases, clamped at `limit`) with compact weights in
    one kernel call against the module's own composition of the two products and torch's ops: within 1e-5
    relative (the sigmoid's expf against torch's; values past the clamp included)."""
    import semoe.model.experts
    from semoe.model.compact_linear import CompactWeight
    from semoe.model.experts import ClampedSwiGLU
    from storage.quant import QuantSpec, quantize

    torch.manual_seed(0)
    D, F = 64, 64
    g = 32 if scheme == "int4" else None

    def compact(w_IO):
        codes, scales = quantize(w_IO, scheme, group_size=g, transposed=True)
        return CompactWeight(codes, scales, QuantSpec(scheme=scheme, dtype="F32", shape=tuple(w_IO.shape), scales="",
                                                      transposed=True, group_size=g))

    parts = (compact(torch.randn(D, 2 * F) * 0.5), torch.randn(2 * F), compact(torch.randn(F, D) * 0.1), torch.randn(D))
    mlp = ClampedSwiGLU(alpha=1.702, limit=1.5)  # a low limit: some gates and ups clamped
    x = torch.randn(3, D)
    calls, kernel = [], torch_ops.clamped_swiglu
    monkeypatch.setattr(torch_ops, "clamped_swiglu", lambda *a: calls.append(a[1]) or kernel(*a))
    fused = mlp.apply(x, parts)
    assert calls == [scheme]
    monkeypatch.setattr(semoe.model.experts, "fused_clamped_swiglu", lambda *a: None)
    assert _relative(fused, mlp.apply(x, parts)) < 1e-5


@pytest.mark.parametrize("Dh, window, chunk, sinks", [(16, 0, 0, False), (16, 5, 0, True), (12, 0, 0, True),
                                                      (24, 7, 0, False), (16, 0, 4, False), (12, 0, 3, True)])
def test_a_prompts_attention_rows_are_the_decoding_heads(Dh, window, chunk, sinks):
    """attend_rows_head (a prompt's rows, four sharing each key and value; scores two rows by four
    positions at once where Dh is a multiple of 8, the plain loops otherwise) against attend_head,
    a decoding step's, for each row and head, with a window, a chunk (rows of one group in different
    chunks) and attention sinks: the same bits."""
    lib, p = torch_ops._lib(), lambda t: ctypes.c_void_p(t.data_ptr())
    P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.attend_rows_head.argtypes = [P, P, P, I, I, I, I, I, I, I, I, I, F, P, P, P, I, ctypes.c_int]
    lib.attend_head.argtypes = [P, P, P, I, I, I, I, I, I, F, P, P, P, I, ctypes.c_int]
    g = torch.Generator().manual_seed(Dh + window)
    H, G, S, pos0, nr = 4, 2, 40, 9, 11  # 11 rows: two groups of four and a group of three
    kc, vc = torch.randn(G, S, Dh, generator=g), torch.randn(G, S, Dh, generator=g)
    qr = torch.randn(nr, H, Dh, generator=g)
    sk = torch.randn(H, generator=g) if sinks else None
    scale = Dh ** -0.5
    got = torch.zeros(nr, H * Dh)
    scratch = torch.empty(4 * (pos0 + nr))
    for h in range(H):
        lib.attend_rows_head(p(qr), p(kc), p(vc), H, G, Dh, Dh, S, pos0, nr, window, chunk, scale,
                             p(sk) if sinks else None, p(scratch), p(got), h, 0)
    for r in range(nr):
        n = pos0 + r + 1
        t0 = (n - 1) - (n - 1) % chunk if chunk else n - window if 0 < window < n else 0
        want, ph = torch.zeros(H * Dh), torch.empty(H * n)
        for h in range(H):
            lib.attend_head(p(qr[r]), p(kc), p(vc), H, G, Dh, S, t0, n, scale, p(sk) if sinks else None, p(ph),
                            p(want), h, 0)
        assert torch.equal(got[r], want), r


@pytest.mark.parametrize("Dh, window, sinks", [(16, 0, False), (12, 5, True), (24, 0, True)])
def test_a_float16_kv_cache_holds_float16s_rounding_and_is_read_as_its_values(Dh, window, sinks):
    """A float16 KV cache (the runner's --kv-cache f16): attend_rotate writes torch's float16 rounding
    (to nearest even) of the key and value it writes into a float32 cache; attend_head and
    attend_rows_head over it give the bits they give over a float32 cache of the same values (every
    float16 widens to float32 exactly): the loads convert, the arithmetic is the float32 cache's.
    Dh 12 takes the tails, 16 and 24 the vector loads."""
    lib, p = torch_ops._lib(), lambda t: ctypes.c_void_p(t.data_ptr())
    P, I, F, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.attend_rotate.argtypes = [P, P, P, P, P, P, P, I, I, I, I, I, I, P, C]
    lib.attend_head.argtypes = [P, P, P, I, I, I, I, I, I, F, P, P, P, I, C]
    lib.attend_rows_head.argtypes = [P, P, P, I, I, I, I, I, I, I, I, I, F, P, P, P, I, C]
    g = torch.Generator().manual_seed(Dh)
    H, G, S, R, pos = 4, 2, 40, 8, 6
    q, k, v = torch.randn(H, Dh, generator=g), torch.randn(G, Dh, generator=g), torch.randn(G, Dh, generator=g)
    cos, sin = torch.randn(R, generator=g), torch.randn(R, generator=g)
    caches = {h16: (torch.zeros(G, S, Dh, dtype=dt), torch.zeros(G, S, Dh, dtype=dt))
              for h16, dt in ((0, torch.float32), (1, torch.float16))}
    for h16, (kc, vc) in caches.items():
        qr = torch.empty(H, Dh)
        lib.attend_rotate(p(q), p(k), p(v), p(cos), p(sin), p(kc), p(vc), H, G, Dh, R, S, pos, p(qr), h16)
    (k32, v32), (k16, v16) = caches[0], caches[1]
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half()) and bool(k32[:, pos].abs().sum() > 0)
    k16, v16 = torch.randn(G, S, Dh, generator=g).half(), torch.randn(G, S, Dh, generator=g).half()
    sk = torch.randn(H, generator=g) if sinks else None
    pos0, nr, scale = 9, 11, Dh ** -0.5
    qr = torch.randn(nr, H, Dh, generator=g)
    got = {}
    for h16, (kc, vc) in ((0, (k16.float(), v16.float())), (1, (k16, v16))):
        rows, scratch = torch.zeros(nr, H * Dh), torch.empty(4 * (pos0 + nr))
        for h in range(H):
            lib.attend_rows_head(p(qr), p(kc), p(vc), H, G, Dh, Dh, S, pos0, nr, window, 0, scale,
                                 p(sk) if sinks else None, p(scratch), p(rows), h, h16)
        n = pos0 + nr
        head, ph = torch.zeros(H * Dh), torch.empty(H * n)
        for h in range(H):
            lib.attend_head(p(qr[-1]), p(kc), p(vc), H, G, Dh, S, n - window if 0 < window < n else 0, n, scale,
                            p(sk) if sinks else None, p(ph), p(head), h, h16)
        got[h16] = rows, head
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert torch.equal(got[1][0][-1], got[1][1])  # the last row is the decoding head's


def test_the_row_counts_the_runners_sizing_takes_are_the_kernels():
    """`loader.PREFILL_ROWS` and `ROW_GROUP` (what `inference.torch_free.sequence_memory.sequence_bytes`
    counts a prompt's buffers by) are the kernels' own #defines."""
    import pathlib
    import re

    src = pathlib.Path(loader.__file__).parent
    text = (src / "prefill.c").read_text() + (src / "kernels.h").read_text()
    for name in ("PREFILL_ROWS", "ROW_GROUP"):
        assert int(re.search(rf"#define {name} (\d+)", text).group(1)) == getattr(loader, name), name
