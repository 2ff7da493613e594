"""The compact formats as plain data: round trips, the int4 layout the CPU kernel reads, specs, refusals."""

from __future__ import annotations

import re

import pytest
import torch

from storage.errors import BadInputError
from storage.formats import INT4_GROUP_SIZES
from storage.quant import (QuantShapeError, QuantSpec, check_fits, dequantize, pack_int4, quantize, scales_name,
                           unpack_int4)


def max_step(codes: torch.Tensor, scales: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per element of the out-major matrix, one quantization step (the round trip is within half of it)."""
    o, i = spec.out_in
    if spec.scheme == "int8":
        return scales.to(torch.float32)[:, None].expand(o, i)
    if spec.scheme == "int4":
        return scales.to(torch.float32)[..., 0].T.repeat_interleave(spec.group_size, dim=1)
    raise ValueError(f"no step for {spec.scheme}")


def spec_for(w: torch.Tensor, scheme: str, g: int | None, transposed: bool = False) -> QuantSpec:
    return QuantSpec(scheme=scheme, dtype="F32", shape=tuple(w.shape), scales="s", group_size=g, transposed=transposed)


@pytest.mark.parametrize("scheme, g", [("int8", None)] + [("int4", g) for g in INT4_GROUP_SIZES])
@pytest.mark.parametrize("transposed", [False, True])
def test_round_trip_is_within_half_a_step_plus_the_scales_rounding(scheme, g, transposed):
    torch.manual_seed(0)
    w = torch.randn(256, 512) * torch.logspace(-2, 1, 512)  # columns of very different magnitudes
    codes, scales = quantize(w, scheme, group_size=g, transposed=transposed)
    spec = spec_for(w, scheme, g, transposed)
    back = dequantize(codes, scales, spec)
    assert back.shape == w.shape and back.dtype == torch.float32
    step = max_step(codes, scales, spec)  # (O, I)
    err = (back - w).abs()
    err_OI = err.T if transposed else err
    # half a step, plus float32 rounding of the scale and zero-point arithmetic (a few ulps of the weight)
    bound = 0.5 * step + 4 * torch.finfo(torch.float32).eps * (w.T if transposed else w).abs() + 1e-7
    assert (err_OI <= bound).all(), float((err_OI / bound).max())
    # and the rounding is to nearest: on average a quarter step, not a half (a floor would give a half)
    assert float((err_OI / step).mean()) < 0.3


def test_int8_is_symmetric_with_one_scale_per_output_row():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [-127.0, 3.0, 1.0]])
    codes, scales = quantize(w, "int8")
    assert codes.dtype == torch.int8 and scales.shape == (3,)
    assert torch.equal(codes[0], torch.tensor([64, -127, 32], dtype=torch.int8))  # 2/127 per step
    assert scales[1] == 1.0 and torch.equal(codes[1], torch.zeros(3, dtype=torch.int8))  # an all-zero row
    assert scales[2] == 1.0 and codes[2, 0] == -127


def test_int4_codes_decode_each_groups_minimum_and_maximum_exactly_up_to_rounding():
    torch.manual_seed(1)
    w = torch.randn(64, 64)
    codes, sz = quantize(w, "int4", group_size=32)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 32) and sz.shape == (2, 64, 2)
    q = unpack_int4(codes).view(64, 2, 32)
    assert int(q.min()) == 0 and int(q.max()) == 15
    # every group uses both ends of the range: code 0 at its minimum, 15 at its maximum
    assert (q.amin(dim=2) == 0).all() and (q.amax(dim=2) == 15).all()


def test_the_int4_layout_is_the_cpu_kernels_own():
    """Pinned against torch's packing op where torch packs for AVX-512 (the stored codes are then what
    `_weight_int4pack_mm_for_cpu` reads); elsewhere (AVX2) torch packs otherwise, and the probe the
    fast path asks says so."""
    from semoe.model.compact_linear import torch_int4_reads_our_layout

    q = torch.randint(0, 16, (192, 256), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    packed = pack_int4(q.to(torch.uint8))
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert (theirs.shape == packed.shape and torch.equal(packed, theirs)) == torch_int4_reads_our_layout()
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))
    # the layout in words: in row block 0, column 0, byte j holds row j (low nibble) and row 32 + j (high)
    assert [int(b) for b in packed.view(-1)[:3]] == [int(q[j, 0]) | int(q[32 + j, 0]) << 4 for j in range(3)]
    assert int(packed.view(-1)[32]) == int(q[0, 1]) | int(q[32, 1]) << 4


def test_the_cpu_int4_kernel_computes_the_reference_dequantization():
    from semoe.model.compact_linear import torch_int4_reads_our_layout

    if not torch_int4_reads_our_layout():
        pytest.skip("torch packs int4 otherwise on this CPU (AVX2 kernels): the fast path does not use its kernel")
    torch.manual_seed(3)
    w, x = torch.randn(128, 256), torch.randn(5, 256)
    codes, sz = quantize(w, "int4", group_size=64)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, 64, sz)
    want = x @ dequantize(codes, sz, spec_for(w, "int4", 64)).T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # float32 sums in another order


@pytest.mark.parametrize("shape, scheme, g, transposed, why", [
    ((64, 100), "int4", 32, False, "100 input features are not a multiple of the group size 32"),
    ((48, 128), "int4", 128, False, "48 output features are not a multiple of 64"),
    ((128, 48), "int4", 32, True, "48 output features are not a multiple of 64"),
    ((64,), "int8", None, False, "shape [64] is not 2-D"),
])
def test_weights_the_scheme_cannot_hold_are_named_with_the_reason(shape, scheme, g, transposed, why):
    with pytest.raises(QuantShapeError, match=re.escape(why)):
        check_fits(shape, torch.float32, scheme, g, transposed)


def test_bad_group_sizes_and_schemes_are_refused():
    with pytest.raises(BadInputError, match="--group-size must be one of 32, 64, 128, 256, got 100"):
        check_fits((64, 200), torch.float32, "int4", 100)
    with pytest.raises(BadInputError, match="quantization scheme must be one of"):
        QuantSpec(scheme="int3", dtype="F32", shape=(2, 2), scales="s")
    with pytest.raises(QuantShapeError, match="not a float weight"):
        check_fits((64, 64), torch.int8, "int8")


def test_spec_json_round_trip_and_scale_names():
    spec = QuantSpec(scheme="fp8", dtype="BF16", shape=(7, 9), scales="w_scale_inv", block=(128, 128))
    assert QuantSpec.from_json(spec.to_json()) == spec
    assert spec.to_json() == {"scheme": "fp8", "dtype": "BF16", "shape": [7, 9], "scales": "w_scale_inv",
                              "transposed": False, "block": [128, 128]}
    assert scales_name("a.weight", "int8") == "a.weight_scale"
    assert scales_name("a.weight", "int4") == "a.weight_scale_zero"
    assert scales_name("experts.down_proj_blocks", "mxfp4") == "experts.down_proj_scales"


@pytest.mark.parametrize("scheme, group, transposed", [("int8", None, False), ("int8", None, True),
                                                       ("int4", 64, False), ("int4", 32, True)])
def test_quantizing_rows_at_a_time_gives_the_whole_matrixs_codes(monkeypatch, scheme, group, transposed):
    """Large weights are quantized QUANTIZE_ROWS rows at a time to bound the float32 temporaries:
    every row's codes depend on that row alone, so the result must be bit for bit the whole one's."""
    import storage.quant as q

    torch.manual_seed(5)
    w = torch.randn(64, 448) if transposed else torch.randn(448, 64)  # 448 rows: 3.5 chunks of 128
    whole = q.quantize(w, scheme, group_size=group, transposed=transposed)
    monkeypatch.setattr(q, "QUANTIZE_ROWS", 128)
    chunked = q.quantize(w, scheme, group_size=group, transposed=transposed)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int4", 32)])
def test_quantizing_a_weight_given_in_blocks_of_rows_gives_the_whole_ones_codes(monkeypatch, scheme, group):
    """A loader quantizes a stored weight as it reads it, a block of rows at a time, converting each
    block to the model's dtype first: the codes must be the whole weight's, bit for bit."""
    import storage.quant as q

    torch.manual_seed(6)
    w = torch.randn(448, 64).to(torch.bfloat16)
    whole = q.quantize(w.to(torch.float32), scheme, group_size=group)
    monkeypatch.setattr(q, "QUANTIZE_ROWS", 128)  # blocks of 192 rows, each quantized 128 rows at a time
    got = q.quantize_blocks(iter(w.split(192)), (448, 64), torch.float32, scheme, group_size=group)
    assert torch.equal(whole[0], got[0]) and torch.equal(whole[1], got[1])
    with pytest.raises(BadInputError, match=r"blocks of 384 rows in all, expected 448"):
        q.quantize_blocks(iter(w[:384].split(192)), (448, 64), torch.float32, scheme, group_size=group)
    with pytest.raises(BadInputError, match=r"a block of shape \[448, 32\] after 0 rows does not continue"):
        q.quantize_blocks([w[:, :32]], (448, 64), torch.float32, scheme, group_size=group)
