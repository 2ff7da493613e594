"""DeepSeek-V4's routers in semoe/model/routing.py against transformers' (the oracle): top-k on
sqrt(softplus) scores plus the correction bias, and hash routing from the frozen token-id table; and the
fast paths refuse scores their kernels do not compute."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from semoe.model.routing import route_grouped, route_hashed


def _router(cls, seed: int):
    cfg = DeepseekV4Config(hidden_size=32, num_local_experts=16, num_experts_per_tok=4, vocab_size=50,
                           scoring_func="sqrtsoftplus", routed_scaling_factor=1.5)
    torch.manual_seed(seed)
    r = cls(cfg)
    with torch.no_grad():
        r.weight.normal_(0, 0.3)
        if hasattr(r, "e_score_correction_bias"):
            r.e_score_correction_bias.normal_(0, 0.5)
        else:
            r.tid2eid.copy_(torch.stack([torch.randperm(16)[:4] for _ in range(50)]))
    return cfg, r


def test_top_k_on_sqrt_softplus_scores_equals_transformers():
    cfg, theirs = _router(hf.DeepseekV4TopKRouter, 0)
    x = torch.randn(7, 32)
    with torch.no_grad():
        logits, want_w, want_ids = theirs(x)
    got = route_grouped(logits, 4, scores="sqrtsoftplus", correction_bias_E=theirs.e_score_correction_bias,
                        normalize=True, scale=cfg.routed_scaling_factor)
    order = got.ids_TK.sort(-1).indices, want_ids.sort(-1).indices  # the same set, in any order
    assert torch.equal(got.ids_TK.gather(1, order[0]), want_ids.gather(1, order[1]))
    torch.testing.assert_close(got.weights_TK.gather(1, order[0]), want_w.gather(1, order[1]), rtol=0, atol=1e-6)


def test_hash_routing_equals_transformers():
    cfg, theirs = _router(hf.DeepseekV4HashRouter, 1)
    x, token_ids = torch.randn(7, 32), torch.randint(0, 50, (7,))
    with torch.no_grad():
        logits, want_w, want_ids = theirs(x, token_ids)
    got = route_hashed(logits, theirs.tid2eid[token_ids], scores="sqrtsoftplus", normalize=True,
                       scale=cfg.routed_scaling_factor)
    assert torch.equal(got.ids_TK, want_ids)
    torch.testing.assert_close(got.weights_TK, want_w, rtol=0, atol=1e-6)


def test_unknown_scores_are_refused_and_the_fast_path_takes_sqrtsoftplus():
    from semoe.decode.support import one_call_refusal
    from semoe.model.config import MoEConfig

    with pytest.raises(ValueError, match="scores must be one of softmax, sigmoid, sqrtsoftplus, got 'relu'"):
        route_hashed(torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.long), scores="relu", normalize=True)
    c = MoEConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=64,
                  moe_ffn_size=32, num_experts=4, top_k=2, router="grouped", router_scores="sqrtsoftplus")
    assert one_call_refusal(c) is None  # route.c computes sqrt(softplus) scores
