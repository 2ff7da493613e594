"""The analytic profile: Korthikanti et al.'s activation sizes, flops, parameters, the stage split
and the schedule pressure it implies, against hand-computed numbers."""

from __future__ import annotations

import pytest

from mpress.analytic import analytic_profile, layer_flops, layer_params, layer_saved, split_layers
from mpress.profile import PipelineProfile
from mpress.schedule import in_flight_peak

FLOPS = 100e12
# a GPT-2-medium-like model: h=1024, a=16, s=512, b=2, V=50304
SHAPE = dict(layers=24, hidden=1024, heads=16, seq=512, micro_batch=2, micro_batches=8, vocab=50304,
             stages=4, flops=FLOPS)


def blocks(profile: PipelineProfile):
    """The transformer layers (neither embedding nor head) of every stage."""
    return [[lp for lp in st.layers if lp.name.startswith("layer")] for st in profile.stages]


def test_saved_bytes_match_korthikanti_for_fp16():
    # s*b*h*(34 + 5*a*s/h) = 512*2*1024 * (34 + 5*16*512/1024) = 1048576 * 74
    expected = 77_594_624
    saved = layer_saved(hidden=1024, heads=16, seq=512, micro_batch=2)
    assert sum(t.bytes for t in saved) == expected
    names = [t.name for t in saved]
    assert len(set(names)) == len(names)
    assert {"attn.qkv", "attn.scores", "attn.out", "mlp.in", "mlp.act"} <= set(names)
    # the attention scores are the 5*a*s^2*b part
    assert next(t for t in saved if t.name == "attn.scores").bytes == 5 * 16 * 512 * 512 * 2
    profile = analytic_profile(**SHAPE)
    assert all(lp.saved_bytes == expected for stage in blocks(profile) for lp in stage)


def test_saved_bytes_scale_activations_but_not_masks_with_dtype():
    # fp32: 16 values x 4 bytes + 2 mask bytes per token and unit, 2 x 4 + 1 per score
    sbh, as2b = 512 * 2 * 1024, 16 * 512 * 512 * 2
    assert sum(t.bytes for t in layer_saved(hidden=1024, heads=16, seq=512, micro_batch=2, dtype_bytes=4)) \
        == sbh * 66 + as2b * 9 == 144_703_488


def test_forward_flops_and_times():
    b, s, h = 2, 512, 1024
    dense = 24 * b * s * h * h + 4 * b * s * s * h
    assert layer_flops(hidden=h, seq=s, micro_batch=b) == dense
    profile = analytic_profile(**SHAPE)
    for stage in blocks(profile):
        for lp in stage:
            assert lp.forward_s == pytest.approx(dense / FLOPS)
            assert lp.backward_s == pytest.approx(2 * dense / FLOPS)
    head = profile.stages[-1].layers[-1]
    assert head.name == "lm_head" and head.forward_s == pytest.approx(2 * b * s * h * 50304 / FLOPS)


@pytest.mark.parametrize("layers, stages", [(24, 4), (10, 4), (7, 7), (13, 3), (5, 1), (9, 8)])
def test_stage_split_is_even_with_extras_first(layers, stages):
    counts = split_layers(layers, stages)
    assert sum(counts) == layers and len(counts) == stages
    assert all(a >= b for a, b in zip(counts, counts[1:])) and max(counts) - min(counts) <= 1
    profile = analytic_profile(**(SHAPE | dict(layers=layers, stages=stages)))
    assert [len(stage) for stage in blocks(profile)] == counts
    everything = [lp for st in profile.stages for lp in st.layers]
    assert [lp.index for lp in everything] == list(range(layers + 2))  # embedding + layers + head
    assert everything[0].name == "embedding" and profile.stages[0].layers[0] is everything[0]
    assert everything[-1].name == "lm_head" and profile.stages[-1].layers[-1] is everything[-1]
    assert [st.stage for st in profile.stages] == list(range(stages))


def test_param_bytes():
    h, V = 1024, 50304
    profile = analytic_profile(**SHAPE)
    assert all(lp.param_bytes == 12 * h * h * 16 for stage in blocks(profile) for lp in stage)
    assert profile.stages[0].layers[0].param_bytes == V * h * 16
    assert profile.stages[-1].layers[-1].param_bytes == V * h * 16
    # stage 0: embedding and 6 layers
    assert profile.stages[0].static_bytes == (V * h + 6 * 12 * h * h) * 16
    bf16_weights_only = analytic_profile(**SHAPE, optimizer_bytes_per_param=2)
    assert bf16_weights_only.stages[1].static_bytes == 6 * 12 * h * h * 2
    assert profile.boundary_bytes == 2 * 512 * 1024 * 2


def test_moe_multiplies_params_by_experts_but_flops_only_by_top_k():
    b, s, h, E, k = 2, 512, 1024, 8, 2
    assert layer_params(hidden=h, experts=E) - layer_params(hidden=h) == (E - 1) * 8 * h * h + h * E
    dense_flops = layer_flops(hidden=h, seq=s, micro_batch=b)
    moe_flops = layer_flops(hidden=h, seq=s, micro_batch=b, experts=E, top_k=k)
    assert moe_flops - dense_flops == (k - 1) * 16 * b * s * h * h + 2 * b * s * h * E
    # eight times the experts: only the router's flops grow
    many = layer_flops(hidden=h, seq=s, micro_batch=b, experts=8 * E, top_k=k)
    assert many - moe_flops == 2 * b * s * h * 7 * E

    dense = analytic_profile(**SHAPE)
    moe = analytic_profile(**SHAPE, experts=E, top_k=k)
    for d_stage, m_stage in zip(blocks(dense), blocks(moe)):
        for d, m in zip(d_stage, m_stage):
            assert m.param_bytes - d.param_bytes == ((E - 1) * 8 * h * h + h * E) * 16
            assert m.forward_s * FLOPS == pytest.approx(moe_flops)
    # top-1 MoE saves what a dense layer saves plus the routing probabilities
    top1 = layer_saved(hidden=h, heads=16, seq=s, micro_batch=b, experts=E, top_k=1)
    assert sum(t.bytes for t in top1) - 77_594_624 == b * s * E * 2
    # each token's k copies go through the FFN: its input and the GeLU's input and output (9 values)
    top2 = layer_saved(hidden=h, heads=16, seq=s, micro_batch=b, experts=E, top_k=k)
    assert sum(t.bytes for t in top2) - sum(t.bytes for t in top1) == (k - 1) * 9 * 2 * b * s * h


def test_bert_ends_in_a_pooler_instead_of_an_lm_head():
    h = 1024
    gpt, bert = analytic_profile(**SHAPE), analytic_profile(**SHAPE, arch="bert")
    assert blocks(gpt) == blocks(bert)
    head = bert.stages[-1].layers[-1]
    assert head.name == "pooler" and head.param_bytes == (h * h + 2 * h) * 16
    assert head.saved_bytes < gpt.stages[-1].layers[-1].saved_bytes


def test_1f1b_puts_the_most_activations_on_the_first_stage():
    profile = analytic_profile(**(SHAPE | dict(vocab=1024)))  # a small vocabulary: the head does not dominate
    S, M = len(profile.stages), profile.micro_batches
    peaks = [in_flight_peak(profile.schedule, s, S, M) for s in range(S)]
    assert peaks == [S - s for s in range(S)] and peaks[0] == S
    per_micro_batch = [sum(lp.saved_bytes for lp in st.layers) for st in profile.stages]
    activation_peak = [peak * saved for peak, saved in zip(peaks, per_micro_batch)]
    assert activation_peak[0] == max(activation_peak)
    assert activation_peak[0] >= (S - 1) * activation_peak[-1]
    gpipe = analytic_profile(**SHAPE, schedule="gpipe")
    assert all(in_flight_peak("gpipe", s, S, M) == M for s in range(S)) and gpipe.schedule == "gpipe"


def test_profile_round_trips_through_json():
    profile = analytic_profile(**SHAPE, experts=4, top_k=2)
    assert PipelineProfile.from_json(profile.to_json()) == profile


@pytest.mark.parametrize("change, match", [
    (dict(arch="t5"), "arch"), (dict(layers=3), "layers"), (dict(layers=True), "layers"),
    (dict(hidden=0), "hidden"), (dict(heads=3), "heads"), (dict(seq=0), "seq"),
    (dict(micro_batch=0), "micro_batch"), (dict(micro_batches=0), "micro_batches"), (dict(vocab=0), "vocab"),
    (dict(experts=-1), "experts"), (dict(experts=4, top_k=5), "top_k"), (dict(top_k=0), "top_k"),
    (dict(stages=0), "stages"), (dict(schedule="zb-h1"), "schedule"), (dict(flops=0.0), "flops"),
    (dict(dtype_bytes=0), "dtype_bytes"), (dict(optimizer_bytes_per_param=-1), "optimizer_bytes_per_param"),
])
def test_bad_arguments_name_themselves(change, match):
    with pytest.raises(ValueError, match=match):
        analytic_profile(**(SHAPE | change))
