"""config.json -> MoEConfig for the families whose published configs spell things their own way: what
each builder reads, and the values it refuses in one line naming the field."""

from __future__ import annotations

import pytest

from semoe.checkpoints.hf_config import from_hf_config

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5)
# as ERNIE-4.5-21B-A3B's config.json names its fields
ERNIE = dict(BASE, model_type="ernie4_5_moe", moe_num_experts=8, moe_k=2, moe_intermediate_size=24,
             moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=2,
             rope_theta=500000.0)
# as Hunyuan-A13B's: per-layer lists, its NTK alpha under the legacy rope_scaling
HUNYUAN = dict(BASE, model_type="hunyuan_v1_moe", num_experts=8, moe_topk=[2] * 6, head_dim=16,
               attention_head_dim=16, use_qk_norm=True, use_cla=False, use_mixed_mlp_moe=True, rope_theta=10000.0,
               rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32})


# as GLM-5's: DeepSeek-V3's latent attention and routing with the sparse-attention indexer
GLM5 = dict(BASE, model_type="glm_moe_dsa", num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, index_topk=4, index_n_heads=4, index_head_dim=16)


def test_glm5_full_and_shared_indexer_layers():
    c = from_hf_config(dict(GLM5, indexer_types=["full", "shared", "full"]))
    assert c.index_layers == (0, 2) and [c.indexes(i) for i in range(3)] == [True, False, True]
    assert c.index_rope_interleave and c.index_topk == 4
    assert from_hf_config(GLM5).index_layers is None


def test_ernie_moe_layers_shared_experts_and_rotary():
    c = from_hf_config(ERNIE)
    # layer i is MoE where (i + 1) % interval == 0, from the start index to the end (-1: the last)
    assert c.moe_layers == (1, 3, 5)
    assert (c.num_experts, c.top_k, c.moe_ffn_size, c.shared_expert_size) == (8, 2, 24, 48)
    assert c.rope_interleave and c.rope_theta == 500000.0 and c.tie_embeddings  # tied unless it says not
    assert (c.router, c.router_scores, c.score_correction_bias, c.n_group) == ("grouped", "softmax", True, 1)
    assert not c.shared_expert_gate


def test_hunyuan_lists_and_ntk_alpha():
    # also as Hunyuan-A13B's remote-code config names itself: model type hunyuan, its architecture
    remote = dict(HUNYUAN, model_type="hunyuan", architectures=["HunYuanMoEV1ForCausalLM"], num_shared_expert=[1] * 6)
    assert from_hf_config(remote).arch == "hunyuan_v1_moe"
    c = from_hf_config(HUNYUAN)
    assert (c.top_k, c.num_experts, c.moe_ffn_size, c.shared_expert_size) == (2, 8, 48, 48)
    assert c.qk_norm == "head_after_rope" and c.rope_scaling is None
    assert c.rope_theta == pytest.approx(10000.0 * 1000.0 ** (16 / 14), rel=1e-12)


@pytest.mark.parametrize("cfg, field", [
    (dict(ERNIE, use_bias=True), "use_bias"),
    (dict(ERNIE, moe_layer_end_index=[5, 5]), "moe_layer_start_index/end_index/interval"),
    (dict(HUNYUAN, use_cla=True), "use_cla"),
    (dict(HUNYUAN, moe_topk=[2, 2, 2, 4, 2, 2]), "moe_topk differs between layers"),
    (dict(HUNYUAN, num_shared_expert=[2] * 6), "num_shared_expert [2, 2, 2, 2, 2, 2] is not supported"),
    (dict(HUNYUAN, rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 2.0}), "rope alpha"),
    (dict(HUNYUAN, rope_scaling={"type": "dynamic", "factor": 2.0}), "rope type 'dynamic' is not supported"),
    (dict(GLM5, indexer_types=["full", "shared"]), "indexer_types must give each of the 3 layers"),
    (dict(GLM5, indexer_types=["shared", "full", "full"]), "indexer_types must start with 'full'"),
], ids=["ernie-bias", "ernie-vl-layers", "hunyuan-cla", "hunyuan-topk-list", "hunyuan-shared", "hunyuan-alpha-factor",
        "hunyuan-dynamic", "glm5-indexer-types", "glm5-first-shared"])
def test_values_the_model_does_not_implement_are_refused_in_one_line(cfg, field):
    with pytest.raises(ValueError) as e:
        from_hf_config(cfg)
    assert str(e.value).startswith("config.json: ") and field in str(e.value) and "\n" not in str(e.value)
