"""DeepSeek-V4's parts against transformers' modules (the oracle): the hyper-connections
(semoe/model/hyper_connections.py: the same mixing weights, block input and merged streams, and
Sinkhorn's result doubly stochastic), the grouped output projection and the clamped activation."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from semoe.model.hyper_connections import HyperConnection, HyperHead, sinkhorn


def _config(**kw) -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=32, **kw)


def _pair(theirs_cls, ours, seed: int):
    """transformers' module with every parameter drawn from N(0, 0.5), and `ours` holding the same tensors
    under the published names."""
    torch.manual_seed(seed)
    theirs = theirs_cls(_config())
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.5)
    ours.load_state_dict(theirs.state_dict())  # the published names and shapes
    return theirs, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hyper_connection_equals_transformers(dtype):
    cfg = _config()
    theirs, ours = _pair(hf.DeepseekV4HyperConnection,
                         HyperConnection(32, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps), 0)
    x = torch.randn(2, 5, cfg.hc_mult, 32).to(dtype)
    with torch.no_grad():
        want, got = theirs(x), ours(x)
        for w, g in zip(want, got):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=0, atol=0)  # the same operations in the same order
        post, comb, collapsed = got
        block = torch.randn(2, 5, 32).to(dtype)
        merged = HyperConnection.merge(post, comb, block, x)
        reference = post.to(dtype).unsqueeze(-1) * block.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)
        torch.testing.assert_close(merged, reference, rtol=0, atol=0)


def test_sinkhorn_makes_rows_and_columns_sum_to_one():
    m = torch.rand(3, 4, 4) + 0.1
    out = sinkhorn(m, 20, 1e-6)
    torch.testing.assert_close(out.sum(-1), torch.ones(3, 4), rtol=0, atol=1e-4)
    torch.testing.assert_close(out.sum(-2), torch.ones(3, 4), rtol=0, atol=1e-4)


def test_the_head_equals_transformers():
    cfg = _config()
    theirs, ours = _pair(hf.DeepseekV4HyperHead, HyperHead(32, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps), 1)
    x = torch.randn(2, 3, cfg.hc_mult, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


def test_the_grouped_output_projection_equals_transformers():
    from semoe.model.attention import grouped_output

    H, Dh, G, R, D = 8, 16, 4, 12, 32
    torch.manual_seed(2)
    o_a = hf.DeepseekV4GroupedLinear(H * Dh // G, G * R, G)
    o_b = torch.nn.Linear(G * R, D, bias=False)
    x = torch.randn(2, 3, H, Dh)
    with torch.no_grad():
        want = o_b(o_a(x.reshape(2, 3, G, -1)).flatten(2))
        got = grouped_output(x, o_a.weight.view(G, R, -1), o_b)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_clamped_activation_equals_transformers_shared_expert():
    from semoe.model.experts import clamped_silu_glu

    cfg = DeepseekV4Config(hidden_size=32, intermediate_size=48, swiglu_limit=0.5)
    torch.manual_seed(3)
    mlp = hf.DeepseekV4MLP(cfg)
    x = torch.randn(5, 32) * 3  # past the limit on both sides
    with torch.no_grad():
        want = mlp(x)
        got = mlp.down_proj(clamped_silu_glu(mlp.gate_proj(x), mlp.up_proj(x), cfg.swiglu_limit))
        assert (mlp.up_proj(x).abs() > cfg.swiglu_limit).any() and (mlp.gate_proj(x) > cfg.swiglu_limit).any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
