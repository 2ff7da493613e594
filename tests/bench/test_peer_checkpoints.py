"""bench/peer_checkpoints.py: the shapes bench_vs_llamacpp measures. Every architecture's checkpoint is
one semoe imports and its fast core takes, and --shape lands in each architecture's own fields."""

from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import peer_checkpoints as pc  # noqa: E402


@pytest.mark.parametrize("arch", sorted(pc.ARCH_SHAPES))
def test_every_bench_architecture_is_imported_and_on_the_fast_core_or_named_off_it(arch):
    import transformers

    from semoe.checkpoints.hf_config import from_hf_config
    from semoe.decode.support import one_call_refusal

    cls, fields = pc.ARCH_SHAPES[arch]
    config = from_hf_config(getattr(transformers, cls)(**fields).to_dict())
    assert config.arch == arch
    assert one_call_refusal(config) is None
    assert config.hidden_size == 1024 and config.num_layers == 8


def test_a_shape_lands_in_each_architectures_own_fields():
    shape = pc.parse_shape("hidden=2048,experts=64,top_k=8,expert_width=256,head_dim=64")
    assert shape == dict(hidden=2048, experts=64, top_k=8, expert_width=256, head_dim=64)
    _, qwen = pc.shaped_fields("qwen3_moe", shape)
    assert (qwen["hidden_size"], qwen["num_experts"], qwen["num_experts_per_tok"], qwen["moe_intermediate_size"],
            qwen["head_dim"]) == (2048, 64, 8, 256, 64)
    _, ernie = pc.shaped_fields("ernie4_5_moe", shape)
    assert (ernie["moe_num_experts"], ernie["moe_k"]) == (64, 8)
    _, hunyuan = pc.shaped_fields("hunyuan_v1_moe", shape)  # transformers' experts are intermediate_size wide
    assert hunyuan["intermediate_size"] == hunyuan["moe_intermediate_size"] == 256
    _, dots = pc.shaped_fields("dots1", {"heads": 16})  # llama.cpp's loader takes dots1 without grouped heads
    assert dots["num_key_value_heads"] == dots["num_attention_heads"] == 16
    with pytest.raises(ValueError, match="dots1 has as many key-value heads as heads"):
        pc.shaped_fields("dots1", {"kv_heads": 2})
    # the shared experts' width as llama.cpp's converter reads it equals transformers'
    assert ernie["intermediate_size"] // ernie["num_key_value_heads"] == 256 * ernie["moe_num_shared_experts"]
    _, long = pc.shaped_fields("qwen3_next", pc.parse_shape("positions=65600"))  # a long-context checkpoint
    assert long["max_position_embeddings"] == 65600
    _, mixtral = pc.shaped_fields("mixtral", shape)
    assert (mixtral["num_local_experts"], mixtral["intermediate_size"]) == (64, 256)
    # latent attention: as many key-value heads as heads (llama.cpp's converter splits kv_b by them)
    _, dsa = pc.shaped_fields("deepseek_v32", pc.parse_shape("heads=16,experts=64"))
    assert (dsa["num_attention_heads"], dsa["num_key_value_heads"], dsa["n_routed_experts"]) == (16, 16, 64)
    _, gqa = pc.shaped_fields("qwen3_moe", pc.parse_shape("heads=16"))
    assert gqa["num_key_value_heads"] == pc.ARCH_SHAPES["qwen3_moe"][1]["num_key_value_heads"]
    assert pc.ARCH_SHAPES["qwen3_moe"][1]["num_experts"] == 32  # the table itself is left as it was
    with pytest.raises(ValueError, match="deepseek_v3 has no head_dim"):
        pc.shaped_fields("deepseek_v3", shape)


@pytest.mark.parametrize("text, why", [("heads=4,depth=2", "unknown name 'depth'"), ("top_k=0", "top_k needs"),
                                       ("hidden=big", "hidden needs")])
def test_a_bad_shape_is_named(text, why):
    with pytest.raises(ValueError, match=why):
        pc.parse_shape(text)
