"""The model's own behaviour: dispatch against a per-token reference, capacity, losses, store round trip."""

from __future__ import annotations

import pytest
import torch

from semoe.checkpoint import load_store, save_store
from semoe.config import MoEConfig, from_hf_config, named_config
from semoe.model import DenseFFN, MoEFeedForward, MoEGPT, swiglu


def _reference_moe(ffn: MoEFeedForward, x_BTD: torch.Tensor, keep_NK: torch.Tensor | None = None) -> torch.Tensor:
    """A token-by-token loop: sum over kept choices of weight * expert(token)."""
    x = x_BTD.reshape(-1, x_BTD.shape[-1])
    r = ffn.route(x)
    ex = ffn.experts
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t])
        for k in range(r.ids_TK.shape[1]):
            if keep_NK is not None and not keep_NK[t, k]:
                continue
            e = int(r.ids_TK[t, k])
            y = y + r.weights_TK[t, k] * swiglu(x[t:t + 1], ex.w_gate[e], ex.w_up[e], ex.w_down[e])[0]
        if ffn.config.shared_expert_size:
            y = y + torch.sigmoid(ffn.shared_gate(x[t])) * ffn.shared(x[t:t + 1])[0]
        rows.append(y)
    return torch.stack(rows).view_as(x_BTD)


@pytest.mark.parametrize("shared", [0, 48])
def test_dispatch_equals_per_token_reference_forward_and_backward(shared):
    torch.manual_seed(0)
    cfg = named_config("tiny", shared_expert_size=shared, norm_topk_prob=False)
    ffn = MoEFeedForward(cfg, 0).eval()
    x = torch.randn(2, 7, cfg.hidden_size, requires_grad=True)
    out, stats = ffn(x)
    ref = _reference_moe(ffn, x)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), [x, ffn.experts.w_gate, ffn.router.weight])
    ref_grads = torch.autograd.grad((ref * g).sum(), [x, ffn.experts.w_gate, ffn.router.weight])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert stats.ids_NK.shape == (14, cfg.top_k) and stats.dropped == 0


def test_capacity_drops_tokens_in_training_only():
    torch.manual_seed(1)
    cfg = named_config("tiny", capacity_factor=0.25)
    ffn = MoEFeedForward(cfg, 0)
    x = torch.randn(1, 32, cfg.hidden_size)
    ffn.train()
    out, stats = ffn(x)
    assert stats.dropped > 0
    from semoe.gating import capacity_keep_mask, expert_capacity

    r = ffn.route(x.reshape(-1, cfg.hidden_size))
    keep = capacity_keep_mask(r.ids_TK, cfg.num_experts, expert_capacity(32, cfg.num_experts, cfg.top_k, 0.25))
    assert int((~keep).sum()) == stats.dropped
    torch.testing.assert_close(out, _reference_moe(ffn, x, keep), atol=1e-6, rtol=1e-5)
    ffn.eval()
    assert ffn(x)[1].dropped == 0


def test_forward_returns_losses_and_stores_nothing_on_self():
    torch.manual_seed(2)
    cfg = named_config("tiny", moe_layers=(1,))
    model = MoEGPT(cfg).train()
    assert isinstance(model.layers[0].ffn, DenseFFN) and isinstance(model.layers[1].ffn, MoEFeedForward)
    before = {name: set(vars(m)) for name, m in model.named_modules()}
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    out = model(ids)
    assert {name: set(vars(m)) for name, m in model.named_modules()} == before
    assert out.logits.shape == (2, 16, cfg.vocab_size) and set(out.router) == {1}
    assert out.aux_loss.item() >= 1.0 - 1e-5 and out.z_loss.item() > 0
    (out.aux_loss + out.z_loss).backward()
    assert model.layers[1].ffn.router.weight.grad.abs().sum() > 0


def test_gpt_moe_save_and_load_through_a_store(tmp_path):
    torch.manual_seed(3)
    model = MoEGPT(named_config("tiny", shared_expert_size=32)).eval()
    store = save_store(model, str(tmp_path / "store"))
    assert store.verify() == []
    assert len(store.manifest.chunks) == model.config.num_layers * model.config.num_experts
    back = load_store(store.root)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    assert back.config.replace(extra={}) == model.config.replace(extra={})


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="top_k must be in 1..num_experts"):
        named_config("tiny", top_k=9)
    with pytest.raises(ValueError, match="num_heads .* must divide by num_kv_heads"):
        named_config("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="moe_layers has layers \\[5\\]"):
        named_config("tiny", moe_layers=(5,))
    with pytest.raises(ValueError, match="config.json: field 'num_experts_per_tok' is missing"):
        from_hf_config({"model_type": "mixtral", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
                        "num_attention_heads": 2})
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        from_hf_config({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "num_experts_per_tok": 1})


def test_qwen2_moe_dense_layers_follow_decoder_sparse_step():
    cfg = from_hf_config({"model_type": "qwen2_moe", "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 4,
                          "num_attention_heads": 2, "num_experts_per_tok": 1, "num_experts": 2,
                          "moe_intermediate_size": 4, "intermediate_size": 8, "decoder_sparse_step": 2,
                          "mlp_only_layers": [3]})
    assert cfg.moe_layer_ids == [1] and isinstance(cfg, MoEConfig)
