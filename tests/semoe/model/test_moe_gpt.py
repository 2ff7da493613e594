"""The model's own behaviour: dispatch against a per-token reference, capacity, losses, store round trip."""

from __future__ import annotations

import pytest
import torch

from semoe.checkpoints.model_io import load_store, save_store
from semoe.model.config import MoEConfig, named_config
from semoe.checkpoints.hf_config import from_hf_config
from semoe.model.moe_gpt import DenseFFN, MoEFeedForward, MoEGPT
from semoe.model.experts import swiglu


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


@pytest.mark.parametrize("shared", [0, 48])
def test_a_decoding_steps_single_row_takes_the_short_path_with_the_same_bits(shared):
    """One row in inference goes straight from the routing to its experts (no dispatch); it must
    give exactly the bits of the dispatching path (which training takes) and of the reference, and
    sync with the host once."""
    from storage.host_sync_counter import HostSyncCounter

    torch.manual_seed(2)
    cfg = named_config("tiny", shared_expert_size=shared, norm_topk_prob=False)
    ffn = MoEFeedForward(cfg, 0)
    with torch.no_grad():
        for t in range(5):
            x = torch.randn(1, 1, cfg.hidden_size)
            with HostSyncCounter() as c:
                short, stats = ffn.eval()(x)
            assert dict(c.counts) == {"tolist": 1}
            dispatched, _ = ffn.train()(x)  # no capacity factor: the same rows, through dispatch_order
            assert torch.equal(short, dispatched)
            torch.testing.assert_close(short, _reference_moe(ffn, x), atol=1e-6, rtol=1e-5)
            assert stats.ids_NK.shape == (1, cfg.top_k) and int(stats.dropped) == 0


def test_capacity_drops_tokens_in_training_only():
    torch.manual_seed(1)
    cfg = named_config("tiny", capacity_factor=0.25)
    ffn = MoEFeedForward(cfg, 0)
    x = torch.randn(1, 32, cfg.hidden_size)
    ffn.train()
    out, stats = ffn(x)
    assert stats.dropped > 0
    from semoe.model.routing import capacity_keep_mask, expert_capacity

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


def test_an_embedding_left_in_the_store_reads_the_rows_the_resident_table_holds(tmp_path):
    """Offloaded engines leave the token embedding in the store and read the rows each step needs:
    the same bits as the resident table (repeated ids, 2-D ids, another compute dtype), no table in
    memory, and an id out of range refused."""
    from semoe.checkpoints.model_io import StoredEmbedding

    torch.manual_seed(4)
    model = MoEGPT(named_config("tiny")).eval()
    store = save_store(model, str(tmp_path / "store"))
    back = load_store(store.root, embedding_in_store=True)
    assert isinstance(back.embed, StoredEmbedding) and back.embed.weight.numel() == 0
    assert not any(n.startswith("embed.") for n, _ in back.named_parameters())
    V = model.config.vocab_size
    ids = torch.tensor([[3, 7, 3, 0], [V - 1, 7, 2, 2]])
    with torch.no_grad():
        assert torch.equal(back.embed(ids), model.embed(ids))
        assert torch.equal(back(ids).logits, model(ids).logits)
        half = load_store(store.root, embedding_in_store=True, dtype=torch.bfloat16)
        assert torch.equal(half.embed(ids), model.embed(ids).bfloat16())
        with pytest.raises(IndexError, match=f"token ids must be in 0..{V - 1}"):
            back.embed(torch.tensor([[V]]))


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


# -- what a layer asks of the host, and which attention kernel it can get -----------------------


def test_moe_layer_syncs_with_the_host_only_for_its_data_dependent_sizes():
    """Training with token dropping: the routing's nonzero and the per-expert counts are the layer's
    only host syncs (inherent: the host slices rows by them); the dropped count stays a tensor."""
    from storage.host_sync_counter import HostSyncCounter

    torch.manual_seed(1)
    ffn = MoEFeedForward(named_config("tiny", capacity_factor=0.5), 0).train()
    x = torch.randn(2, 9, ffn.config.hidden_size)
    with HostSyncCounter() as c:
        _, stats = ffn(x)
    assert dict(c.counts) == {"nonzero": 1, "tolist": 1}
    assert isinstance(stats.dropped, torch.Tensor) and int(stats.dropped) > 0


def _record_sdpa(monkeypatch) -> list[dict]:
    import torch.nn.functional as F

    calls: list[dict] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append({"T": q.shape[-2], "S": k.shape[-2], "mask": attn_mask is not None, "is_causal": is_causal})
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_attention_asks_for_the_causal_kernel_unless_the_cache_is_offset(monkeypatch):
    """No cache offset (training, first prefill): is_causal and no mask, which flash attention
    takes; a chunk after cached positions needs the explicit offset mask; one token needs neither.
    The three give the full forward's logits (float32, atol 1e-5)."""
    from semoe.model.attention import KVCache

    torch.manual_seed(0)
    cfg = named_config("tiny")
    model = MoEGPT(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    calls = _record_sdpa(monkeypatch)
    with torch.no_grad():
        full = model(ids).logits
        assert calls and all(c == {"T": 12, "S": 12, "mask": False, "is_causal": True} for c in calls)
        calls.clear()
        cache = KVCache.empty(cfg, 2, 16)
        first = model(ids[:, :8], cache).logits
        assert all(c["is_causal"] and not c["mask"] for c in calls)
        calls.clear()
        second = model(ids[:, 8:11], cache).logits
        assert all(c == {"T": 3, "S": 11, "mask": True, "is_causal": False} for c in calls)
        calls.clear()
        last = model(ids[:, 11:], cache).logits
        assert all(c == {"T": 1, "S": 12, "mask": False, "is_causal": False} for c in calls)
    torch.testing.assert_close(torch.cat([first, second, last], dim=1), full, atol=1e-5, rtol=1e-5)


PACKED_VARIANTS = {  # attention variants the packed forward must keep per sequence
    "gqa": dict(),
    "window-sinks-biases": dict(sliding_window=4, attention_sinks=True, attention_bias=True, o_proj_bias=True),
    "mla": dict(attention="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                rope_interleave=True),
}


@pytest.mark.parametrize("variant", list(PACKED_VARIANTS))
def test_the_packed_forward_gives_each_sequence_its_own_forwards_logits_and_cache(variant):
    """Three sequences at different points (a prompt's chunk into a fresh cache, one decoding token
    after 7 cached positions, 3 tokens after 2), packed into one forward without padding: each row's
    logits and each cache's keys and values are what that sequence's own forward gives (float32 sums
    over other row counts: 1e-5 relative), the caches advance by their counts, and only the rows
    asked for get logits."""
    from semoe.model.attention import KVCache

    torch.manual_seed(6)
    cfg = named_config("tiny", max_position=32, **PACKED_VARIANTS[variant])
    model = MoEGPT(cfg).eval()
    if cfg.attention_sinks:
        with torch.no_grad():
            for b in model.layers:
                b.attn.sinks.normal_()
    history = {"a": [], "b": torch.randint(0, 259, (7,)).tolist(), "c": torch.randint(0, 259, (2,)).tolist()}
    new = {"a": torch.randint(0, 259, (5,)).tolist(), "b": [17], "c": torch.randint(0, 259, (3,)).tolist()}

    def primed(name: str) -> KVCache:
        cache = KVCache.empty(cfg, 1, 16)
        if history[name]:
            with torch.no_grad():
                model(torch.tensor([history[name]]), cache)
        return cache

    alone = {}
    for name in new:
        cache = primed(name)
        with torch.no_grad():
            alone[name] = (model(torch.tensor([new[name]]), cache).logits[0], cache)
    caches = {name: primed(name) for name in new}
    ids = torch.tensor(new["a"] + new["b"] + new["c"])
    with torch.no_grad():
        out = model.forward_packed(ids, [caches[n] for n in new], [len(new[n]) for n in new])
    assert out.logits.shape == (1, 9, cfg.vocab_size)
    rows = {"a": slice(0, 5), "b": slice(5, 6), "c": slice(6, 9)}
    for name in new:
        want, cache = alone[name]
        torch.testing.assert_close(out.logits[0, rows[name]], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        got = caches[name]
        assert got.length == cache.length == len(history[name]) + len(new[name])
        for layer in range(cfg.num_layers):
            torch.testing.assert_close(got.k[layer], cache.k[layer], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got.v[layer], cache.v[layer], rtol=1e-5, atol=1e-6)
    # only the rows sampled from: each sequence's last, or any set
    caches = {name: primed(name) for name in new}
    with torch.no_grad():
        last = model.forward_packed(ids, [caches[n] for n in new], [5, 1, 3], rows=[4, 5, 8]).logits
    torch.testing.assert_close(last[0], out.logits[0, [4, 5, 8]], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"counts \[5, 1\] do not pack 9 tokens"):
        model.forward_packed(ids, [primed("a"), primed("b")], [5, 1])
    full = primed("b")
    with pytest.raises(ValueError, match="holding 7 of 16 positions cannot take 10 more"):
        model.forward_packed(torch.arange(10), [full], [10])
    one = primed("a")
    with pytest.raises(ValueError, match="appears twice"):
        model.forward_packed(torch.arange(2), [one, one], [1, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_its_float32_formula(dtype):
    """The norm (torch's fused op for float32, the formula elsewhere) against the formula written
    out: bit for bit in float32, value and gradients; bfloat16 keeps the formula itself."""
    from semoe.model.attention import RMSNorm

    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    norm = norm.to(dtype)
    x = (torch.randn(3, 7, 96, generator=g) * 4).to(dtype).requires_grad_()
    w = norm.weight.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    x32 = x_ref.float()
    want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = norm(x)
    assert got.dtype == dtype and torch.equal(got, want)
    got.sum().backward()
    want.sum().backward()
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(norm.weight.grad, w.grad, **tol)
    from semoe.kernels import torch_ops

    assert torch_ops.takes(x[0]) == torch_ops.available()  # the kernel where installed, else torch
    with torch.no_grad():  # a decoding step's rows: semoe's kernel in float32, float32's rounding
        got = norm(x[0])
    torch.testing.assert_close(got, want[0], **(dict(rtol=0, atol=0) if dtype == torch.bfloat16 else
                                                dict(rtol=1e-6, atol=1e-6)))
