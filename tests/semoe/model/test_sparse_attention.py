"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): the indexer's choice, attention over it, and the
indexer's keys in the KV cache. transformers' own models are the oracle for whole models
(tests/semoe/checkpoints/test_parity.py); here each part against a plain reference."""

from __future__ import annotations

import pytest
import torch

from semoe.model.attention import KVCache, LatentAttention, apply_rope, attend, rope_tables
from semoe.model.config import MoEConfig

# float32 throughout: the sparse layer and the references make the same products, their sums in
# another order (einsum against SDPA), so outputs agree to rounding, relative 1e-5
RTOL = 1e-5


def _config(**over) -> MoEConfig:
    kw = dict(arch="deepseek_v32", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=4,
              ffn_size=48, moe_ffn_size=24, num_experts=4, top_k=2, attention="mla", q_lora_rank=24, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True, index_topk=4,
              index_heads=8, index_head_dim=16)
    return MoEConfig(**{**kw, **over})


def _layer(config: MoEConfig, seed: int = 0) -> LatentAttention:
    torch.manual_seed(seed)
    layer = LatentAttention(config, 0)
    with torch.no_grad():  # weights large enough that scores, and so the choice, vary between positions
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() == 2 else 1.0))
    return layer.eval()


def _dense_restricted(layer: LatentAttention, x: torch.Tensor, cos, sin, keep_BTS: torch.Tensor | None
                      ) -> torch.Tensor:
    """Latent attention written out dense (keys and values expanded per head), softmax over `keep`
    (causal where None), by einsum: the plain reference of what the layer computes."""
    c = layer.config
    B, T, _ = x.shape
    H, nope, rope, dv = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q, latent, k_rot = layer.project(x)[:3]
    q = q.view(B, T, H, nope + rope)
    q_rot = apply_rope(q[..., nope:].transpose(1, 2), cos, sin, interleave=True).transpose(1, 2)
    k_rot = apply_rope(k_rot[:, None], cos, sin, interleave=True)[:, 0]
    kv = layer.kv_b_proj(latent).view(B, T, H, nope + dv)
    k = torch.cat((kv[..., :nope], k_rot[:, :, None].expand(B, T, H, rope)), dim=-1)
    qq = torch.cat((q[..., :nope], q_rot), dim=-1)
    scores = torch.einsum("bthd,bshd->bhts", qq, k) * layer.scale
    if keep_BTS is None:
        keep_BTS = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(B, T, T)
    scores = scores.masked_fill(~keep_BTS[:, None], float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), kv[..., nope:])
    return layer.o_proj(out.reshape(B, T, H * dv))


@pytest.mark.parametrize("pairs", [False, True], ids=["halves-v32", "pairs-glm5"])
def test_top_k_attention_equals_dense_attention_restricted_to_the_chosen_positions(pairs):
    layer = _layer(_config(index_rope_interleave=pairs))
    x = torch.randn(2, 12, 32)
    cos, sin = rope_tables(layer.config, torch.arange(12)[None].expand(2, 12), torch.float32)
    with torch.no_grad():
        got = layer(x, cos, sin, None)
        q, _, _, iq, ik, iw = layer.project(x)
        keys = layer.indexer.rotate(ik[:, None], cos, sin)
        chosen = layer.indexer.choose(iq, iw, keys, cos, sin, 0)
        want = _dense_restricted(layer, x, cos, sin, chosen)
        dense = _dense_restricted(layer, x, cos, sin, None)
    # each query reads its 4 best positions among those it sees (all of them for the first 4)
    seen = torch.arange(12) + 1
    assert torch.equal(chosen.sum(-1), torch.minimum(seen, torch.tensor(4))[None].expand(2, 12))
    assert not (chosen & ~torch.ones(12, 12, dtype=torch.bool).tril()).any()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()))
    # the choice matters: past 4 positions, sparse attention is not the dense one
    assert float((got[:, 4:] - dense[:, 4:]).abs().max()) > 1e-3
    torch.testing.assert_close(got[:, :4], dense[:, :4], rtol=RTOL, atol=RTOL * float(want.abs().max()))


def test_the_choice_follows_the_index_scores_written_out():
    """choose() against the scores computed by hand: sum over heads of w_h relu(q_h . k / sqrt(Di)) /
    sqrt(Hi), the best index_topk among the positions each query sees."""
    layer = _layer(_config())
    c = layer.config
    x = torch.randn(1, 9, 32)
    cos, sin = rope_tables(c, torch.arange(9)[None], torch.float32)
    with torch.no_grad():
        _, _, _, iq, ik, iw = layer.project(x)
        keys = layer.indexer.rotate(ik[:, None], cos, sin)
        chosen = layer.indexer.choose(iq, iw, keys, cos, sin, 0)
        q = layer.indexer.rotate(iq.view(1, 9, 8, 16).transpose(1, 2), cos, sin)  # (1, Hi, T, Di)
    for t in range(9):
        score = [sum(float(iw[0, t, h]) / 8 ** 0.5 * max(float(q[0, h, t] @ keys[0, 0, s]) / 4.0, 0.0)
                     for h in range(8)) for s in range(t + 1)]
        best = sorted(range(t + 1), key=lambda s: -score[s])[:4]
        assert set(torch.nonzero(chosen[0, t]).view(-1).tolist()) == set(best), t


def test_equal_scores_at_the_kth_are_taken_earliest_first():
    """Positions whose scores tie at the k-th best (every head's relu 0 gives a score of exactly 0) are
    taken earliest first, as the fast core's choose_top takes them: of 7 positions, 2, 4 and 6 score
    above 0 and the rest exactly 0; with top 4 the query reads 2, 4, 6 and position 0."""
    layer = _layer(_config())
    c = layer.config
    Hi, Di = c.index_heads, c.index_head_dim
    cos, sin = rope_tables(c, torch.tensor([[6]]), torch.float32)
    q = torch.zeros(1, 1, Hi, Di)
    q[..., Di - 1] = 1.0  # every head reads the keys' last dim, past the rotated ones
    keys = torch.zeros(1, 1, 7, Di)
    keys[0, 0, [2, 4, 6], Di - 1] = torch.tensor([2.0, 3.0, 1.5])
    with torch.no_grad():
        chosen = layer.indexer.choose(q.view(1, 1, -1), torch.ones(1, 1, Hi), keys, cos, sin, 6)
    assert torch.nonzero(chosen[0, 0]).view(-1).tolist() == [0, 2, 4, 6]


def test_a_topk_covering_every_position_is_latent_attention_without_an_indexer():
    """index_topk at least the sequence: every seen position is read, so the layer is DeepSeek-V3's
    latent attention with the same weights (the indexer's parameters aside)."""
    sparse = _layer(_config(index_topk=64))
    plain = LatentAttention(_config(index_topk=None, arch="deepseek_v3"), 0).eval()
    plain.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")})
    x = torch.randn(1, 10, 32)
    cos, sin = rope_tables(sparse.config, torch.arange(10)[None], torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(sparse(x, cos, sin, None), plain(x, cos, sin, None), rtol=RTOL, atol=1e-6)


def test_the_kv_cache_keeps_the_indexers_keys_and_decoding_equals_the_whole_prompt():
    """The cache holds each position's indexer key after its rotary key (counted in the cache's
    bytes), and a prompt then one token at a time gives the rows the whole sequence gives at once."""
    c = _config()
    layer = _layer(c)
    assert c.kv_shapes(1, 7)[1] == (1, 1, 7, c.qk_rope_head_dim + c.index_head_dim)
    assert KVCache.bytes_for(c, 1, 7, torch.float32) == 7 * 4 * (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim)
    x = torch.randn(1, 10, 32)
    cos, sin = rope_tables(c, torch.arange(10)[None], torch.float32)
    cache = KVCache.empty(c, 1, 16)
    with torch.no_grad():
        whole = layer(x, cos, sin, None)
        rows = [layer(x[:, :6], cos[:, :6], sin[:, :6], cache)]
        cache.length = 6
        for t in range(6, 10):
            rows.append(layer(x[:, t:t + 1], cos[:, t:t + 1], sin[:, t:t + 1], cache))
            cache.length = t + 1
    torch.testing.assert_close(torch.cat(rows, dim=1), whole, rtol=RTOL, atol=RTOL * float(whole.abs().max()))
    # the indexer's keys are there, rotated: the layer's own, position by position
    with torch.no_grad():
        keys = layer.indexer.rotate(layer.project(x)[4][:, None], cos, sin)
    torch.testing.assert_close(cache.v[0][:, :, :10, c.qk_rope_head_dim:], keys, rtol=RTOL, atol=1e-6)


def test_attend_takes_a_per_row_mask_of_the_batch():
    """The sparse layer hands attend() a (B, 1, T, S) mask; SDPA with it equals the softmax written out."""
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    mask = torch.rand(2, 1, 4, 6) > 0.4
    mask[..., 0] = True
    want = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(attend(q, k, v, mask, False), want, rtol=RTOL, atol=1e-6)


def test_glm5_shared_layers_read_the_choice_of_the_indexing_layer_before_them(tmp_path):
    """GLM-5's `indexer_types`: a "shared" layer has no indexer and reads the positions the nearest
    "full" layer before it chose, in the same step. Against transformers' own model: float32 logits
    within 1e-5 relative over a prompt longer than index_topk, and greedy decoding with the KV cache
    (prompt, then token by token) giving transformers' tokens."""
    from helpers.hf_models import load_hf_model, make_hf_checkpoint
    from semoe.checkpoints.model_io import load_hf
    from semoe.decode.generate import generate
    from semoe.decode.loop import SamplingConfig

    path = make_hf_checkpoint("glm_moe_dsa", tmp_path / "glm5", num_hidden_layers=4,
                              indexer_types=["full", "shared", "full", "shared"])
    ours, ref = load_hf(str(path)).eval(), load_hf_model(path, dtype=torch.float32).eval()
    assert [b.attn.indexer is not None for b in ours.layers] == [True, False, True, False]
    assert [b.attn.chooser is ours.layers[i - 1].attn for i, b in enumerate(ours.layers) if i % 2]
    ids = torch.tensor([[3, 17, 5, 29, 11, 2, 40, 8, 19, 23, 7, 31]])
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < RTOL
    with torch.no_grad():
        hf_tokens = ref.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    res = generate(ours, ids[0].tolist(), SamplingConfig(max_new_tokens=12))
    assert res.tokens == hf_tokens
