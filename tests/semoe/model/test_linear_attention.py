"""semoe/model/linear_attention.py: the gated delta rule's chunked prompt pass equals its token-by-token
recurrence, both equal transformers' own reference (the oracle), a prompt split anywhere carries its
state exactly, and the causal convolution's state does the same."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from semoe.model.linear_attention import causal_conv, delta_rule_chunked, delta_rule_recurrent, l2_unit


def _inputs(B=2, H=3, T=70, Dk=16, Dv=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_unit(torch.randn(B, H, T, Dk, generator=g, dtype=dtype)) / Dk ** 0.5
    k = l2_unit(torch.randn(B, H, T, Dk, generator=g, dtype=dtype))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    a = -torch.nn.functional.softplus(torch.randn(B, H, T, generator=g, dtype=dtype))  # log-decays <= 0
    beta = torch.sigmoid(torch.randn(B, H, T, generator=g, dtype=dtype))
    state = torch.randn(B, H, Dk, Dv, generator=g, dtype=dtype) * 0.1
    return q, k, v, a, beta, state


@pytest.mark.parametrize("T, chunk", [(1, 64), (5, 64), (64, 64), (70, 16), (130, 64), (33, 1)])
def test_the_chunked_form_equals_the_recurrence(T, chunk):
    """In float64 to 1e-10 (the same arithmetic reassociated); from zeros and from a given state."""
    q, k, v, a, beta, state = _inputs(T=T)
    for s in (None, state):
        want, want_S = delta_rule_recurrent(q, k, v, a, beta, s)
        got, got_S = delta_rule_chunked(q, k, v, a, beta, s, chunk=chunk)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        torch.testing.assert_close(got_S, want_S, rtol=0, atol=1e-10)


def test_float32_inputs_keep_a_float32_state_within_1e_5():
    q, k, v, a, beta, state = (x.float() for x in _inputs(T=130))
    want, want_S = delta_rule_recurrent(q, k, v, a, beta, state)
    got, got_S = delta_rule_chunked(q, k, v, a, beta, state)
    assert got.dtype == got_S.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_S, want_S, rtol=0, atol=1e-5)


def test_both_forms_equal_transformers_reference():
    """transformers' Qwen3-Next functions take (B, T, H, D), raw q and k (normalised inside) and the
    log-decay as `g`: the same rule, to float32 rounding (1e-5)."""
    B, H, T, Dk, Dv = 1, 2, 40, 16, 8
    g = torch.Generator().manual_seed(3)
    q_raw, k_raw = torch.randn(B, T, H, Dk, generator=g), torch.randn(B, T, H, Dk, generator=g)
    v = torch.randn(B, T, H, Dv, generator=g)
    a = -torch.nn.functional.softplus(torch.randn(B, T, H, generator=g))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    want, want_S = hf.torch_recurrent_gated_delta_rule(q_raw, k_raw, v, a, beta, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
    ours = dict(q_BHTK=l2_unit(q_raw.transpose(1, 2)) / Dk ** 0.5, k_BHTK=l2_unit(k_raw.transpose(1, 2)),
                v_BHTV=v.transpose(1, 2), a_BHT=a.transpose(1, 2), beta_BHT=beta.transpose(1, 2))
    for fn in (delta_rule_recurrent, delta_rule_chunked):
        got, got_S = fn(**ours)
        torch.testing.assert_close(got.transpose(1, 2), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_S, want_S, rtol=0, atol=1e-5)


@pytest.mark.parametrize("split", [1, 17, 64, 69])
def test_a_prompt_split_anywhere_carries_its_state(split):
    """A prefix's chunked pass, then the rest (chunked or token by token) from its state: the whole's
    outputs and state (what a reused prefix or decoding after a prompt relies on)."""
    q, k, v, a, beta, _ = _inputs(T=70)
    want, want_S = delta_rule_chunked(q, k, v, a, beta)
    head, S = delta_rule_chunked(*(x[:, :, :split] for x in (q, k, v, a, beta)))
    for fn in (delta_rule_chunked, delta_rule_recurrent):
        tail, tail_S = fn(*(x[:, :, split:] for x in (q, k, v, a, beta)), S)
        torch.testing.assert_close(torch.cat([head, tail], dim=2), want, rtol=0, atol=1e-10)
        torch.testing.assert_close(tail_S, want_S, rtol=0, atol=1e-10)


def test_a_wrong_state_is_refused_by_shape():
    q, k, v, a, beta, state = _inputs(T=4)
    with pytest.raises(ValueError, match=r"state of shape \(2, 3, 8, 8\), expected \(2, 3, 16, 8\)"):
        delta_rule_chunked(q, k, v, a, beta, state[:, :, :8])


def test_the_causal_convolution_carries_its_state_and_equals_transformers():
    B, C, T, K = 2, 6, 11, 4
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(B, C, T, generator=g), torch.randn(C, K, generator=g)
    whole, state = causal_conv(x, w)
    torch.testing.assert_close(whole, hf.causal_conv1d_fn(x, w, activation="silu"), rtol=0, atol=1e-6)
    torch.testing.assert_close(state, x[:, :, -(K - 1):])
    # a prompt of 5, then one step at a time: the whole's outputs and its state
    out, s = causal_conv(x[:, :, :5], w)
    steps = [out]
    for t in range(5, T):
        y, s = causal_conv(x[:, :, t:t + 1], w, s)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, dim=-1), whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(s, state)


def _layers(seed: int = 0):
    """transformers' Qwen3-Next Gated DeltaNet (2 key heads, 4 value heads) and ours with its weights."""
    from transformers import Qwen3NextConfig

    from semoe.model.linear_attention import GatedDeltaNet

    cfg = Qwen3NextConfig(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
                          layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    theirs = hf.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():  # the norm's weight and dt_bias away from their ones, as trained ones are
        theirs.norm.weight.uniform_(0.5, 1.5)
        theirs.dt_bias.uniform_(-1, 1)
    ours = GatedDeltaNet(48, 2, 4, 16, 8, 4, 1e-6)
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=False)
    assert missing == [] and unexpected == []  # the published tensors' names and shapes
    return theirs, ours


def test_the_layer_equals_transformers_and_decodes_from_its_state():
    """A 70-token prompt through transformers' layer and ours: the same outputs (1e-5, float32). Then the
    prompt's first 50 tokens, and the other 20 one at a time from the state: the whole's outputs."""
    theirs, ours = _layers()
    x = torch.randn(2, 70, 48)
    with torch.no_grad():
        want = theirs(x)
        got, _ = ours(x)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        out, state = ours(x[:, :50])
        outs = [out]
        for t in range(50, 70):
            y, state = ours(x[:, t:t + 1], state)
            outs.append(y)
    torch.testing.assert_close(torch.cat(outs, dim=1), want, rtol=0, atol=1e-5)
    assert state.recurrent.shape == (2, 4, 16, 8) and state.conv.shape == (2, ours.conv_dim, 3)


def test_gated_full_attention_equals_transformers():
    """Qwen3-Next's full-attention layer: q_proj giving each head's query and then its output gate, as the
    checkpoint holds it, its zero-centred q/k norms used as 1 + w, a quarter of each head rotated. The
    same output as transformers' layer (1e-5); the fast paths name the parts they do not compute."""
    from transformers import Qwen3NextConfig

    from semoe.decode.support import plan_refusal
    from semoe.model.attention import Attention, rope_tables
    from semoe.model.config import MoEConfig

    H, G, Dh, D, T = 4, 2, 32, 64, 9
    hc = Qwen3NextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=G, head_dim=Dh,
                         partial_rotary_factor=0.25, num_hidden_layers=1, layer_types=["full_attention"])
    hc._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = hf.Qwen3NextAttention(hc, 0).eval()
    with torch.no_grad():
        theirs.q_norm.weight.normal_(0, 0.2)
        theirs.k_norm.weight.normal_(0, 0.2)
    c = MoEConfig(vocab_size=32, hidden_size=D, num_layers=1, num_heads=H, num_kv_heads=G, head_dim=Dh, ffn_size=64,
                  moe_ffn_size=32, num_experts=4, top_k=2, qk_norm="head", rope_dim=Dh // 4,
                  rope_theta=hc.rope_parameters["rope_theta"], attn_output_gate=True, rms_norm_eps=hc.rms_norm_eps,
                  norm_plus_one=True)
    ours = Attention(c, 0).eval()
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            getattr(ours, name).weight.copy_(getattr(theirs, name).weight)
        x = torch.randn(1, T, D)
        pos = torch.arange(T)[None]
        cos, sin = hf.Qwen3NextRotaryEmbedding(hc)(x, pos)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        want, _ = theirs(x, (cos, sin), mask)
        got = ours(x, *rope_tables(c, pos, torch.float32), None)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert plan_refusal(c) is None  # the fast paths take both (tests/semoe/model/test_qwen3_next.py)
