"""bench/make_real.py: checkpoints of the published configs, here at small shapes (the same fields and
formats), loaded by transformers as the models ship, routing spread over the experts."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import make_real  # noqa: E402

SMALL = {
    "gpt-oss-20b": dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_local_experts=8, vocab_size=640, sliding_window=8),
    "qwen3-30b-a3b": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_experts=16, vocab_size=640),
    "qwen3.5-35b-a3b": dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, vocab_size=640,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16),
    "deepseek-v4-flash": dict(hidden_size=64, num_attention_heads=4, head_dim=16, q_lora_rank=32, o_groups=2,
                              o_lora_rank=16, n_routed_experts=16, moe_intermediate_size=32, vocab_size=640,
                              index_n_heads=4, index_head_dim=16, index_topk=4, hc_mult=2, sliding_window=8,
                              compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}),
}
# Qwen3.5: a full-attention layer after three linear ones; DeepSeek-V4: a CSA layer after three HCA ones
LAYERS = {"qwen3.5-35b-a3b": 4, "deepseek-v4-flash": 4}


def load(model: str, path: str, **kw):
    """The checkpoint through transformers' own loader; MXFP4 dequantized (its kernels need a GPU)."""
    import transformers

    if model == "gpt-oss-20b":
        kw["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)


@pytest.fixture(scope="module", params=sorted(SMALL))
def small(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("real") / request.param)
    make_real.write(request.param, out, layers=LAYERS.get(request.param, 3), overrides=SMALL[request.param],
                    shard_bytes=64 << 10, progress=False)
    return request.param, out


def test_the_checkpoint_loads_in_transformers_with_every_weight_and_decodes(small):
    model, path = small
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["num_hidden_layers"] == LAYERS.get(model, 3) and cfg["model_type"] == make_real.MODELS[model]["model_type"]
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1  # written shard by shard
    m, info = load(model, path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(3, cfg["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = m(ids).logits
    assert logits.shape == (1, 24, cfg["vocab_size"]) and torch.isfinite(logits).all()
    if model == "gpt-oss-20b":  # the MXFP4 codes decode to weights of the drawn std (e8m0 scale chosen for it)
        w = m.model.layers[0].mlp.experts.gate_up_proj.float()
        assert w.std().item() == pytest.approx(cfg["initializer_range"], rel=0.35)


@pytest.mark.slow  # 40 s: transformers decoding at the published width
@pytest.mark.parametrize("model", sorted(SMALL))
def test_decoding_routes_over_every_expert_at_the_published_width(model, tmp_path):
    """At the published hidden size, heads and expert width (2 layers, Qwen3.5's 4, 8 experts, a small vocabulary),
    64 greedily decoded tokens do not fall into a short cycle, and every layer's top-k picks over them
    have a normalized entropy of at least 0.95 (1: every expert picked equally). With transformers'
    own initialization, 4 such layers of qwen3-30b-a3b decoded 9 distinct tokens of 96 and routed
    them with an entropy of 0.84; make_real's weights, 94 and 0.995."""
    E = 8
    key = {"gpt-oss-20b": "num_local_experts", "deepseek-v4-flash": "n_routed_experts"}.get(model, "num_experts")
    ov = {key: E, "vocab_size": 2048}
    layers = LAYERS.get(model, 2)  # (transformers' cache needs Qwen3.5's full-attention layer)
    path = make_real.write(model, str(tmp_path / "m"), layers=layers, overrides=ov, progress=False)
    m = load(model, path).eval()
    cfg = json.load(open(os.path.join(path, "config.json")))
    prompt = torch.randint(3, 2048, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        new = m.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)[:, 16:]
        out = m(new, output_router_logits=True)  # the decoded tokens' routing
    assert len(set(new[0].tolist())) >= 48
    K = cfg["num_experts_per_tok"]
    hashed = cfg.get("mlp_layer_types", []).count("hash_moe")  # (DeepSeek-V4's first layers route by token id)
    assert len(out.router_logits) == layers - hashed
    for layer, logits in enumerate(out.router_logits):
        counts = torch.bincount(logits.reshape(-1, E).topk(K, dim=-1).indices.flatten(), minlength=E).double()
        p = counts / counts.sum()
        entropy = -(p[p > 0] * p[p > 0].log()).sum().item() / math.log(E)
        assert entropy >= 0.95, (model, layer, entropy, counts.tolist())


def test_the_tokenizer_has_exactly_the_vocabulary_beyond_what_is_trained(tmp_path, monkeypatch):
    """Real vocabularies (150k to 200k) exceed what the sources teach: the BPE is topped up with
    merges that come last, so text encodes as it did, and every id decodes."""
    import llama_peer
    from tokenizers import Tokenizer

    monkeypatch.setattr(llama_peer, "TRAINED_VOCAB", 400)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    trained = Tokenizer.from_file(llama_peer.add_tokenizer(str(tmp_path / "a"), 400, max_corpus_bytes=1 << 20))
    grown = Tokenizer.from_file(llama_peer.add_tokenizer(str(tmp_path / "b"), 700, max_corpus_bytes=1 << 20))
    assert trained.get_vocab_size() == 400 and grown.get_vocab_size() == 700
    assert sorted(grown.get_vocab().values()) == list(range(700))
    text = "def main(argv):\n    return sorted(x for x in argv if x)  # ok"
    assert grown.encode(text).ids == trained.encode(text).ids
    assert all(grown.decode([i]) is not None for i in range(3, 700))


def test_a_disk_too_small_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 1 << 30))
    with pytest.raises(SystemExit, match=r"needs 12\.8 GiB; .* has 1\.0 GiB free \(--layers"):
        make_real.write("gpt-oss-20b", str(tmp_path / "g"), progress=False)
    assert os.listdir(tmp_path) == []
    with pytest.raises(SystemExit, match="--layers: gpt-oss-20b has 24 layers; got 30"):
        make_real.write("gpt-oss-20b", str(tmp_path / "g"), layers=30, progress=False)


def test_an_interrupted_write_leaves_nothing_behind(tmp_path, monkeypatch):
    calls = []

    def fail(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    real = make_real.write_file
    monkeypatch.setattr(make_real, "write_file", fail)
    with pytest.raises(KeyboardInterrupt):
        make_real.write("qwen3-30b-a3b", str(tmp_path / "q"), layers=2, overrides=SMALL["qwen3-30b-a3b"],
                        shard_bytes=64 << 10, progress=False)
    assert os.listdir(tmp_path) == []


def test_qwen35s_mtp_layer_is_written_as_released_and_drafts(tmp_path):
    """Qwen3.5-35B-A3B ships a multi-token-prediction layer (`mtp.*`, which transformers' causal LM leaves
    out): the store keeps it, its experts as layer N's chunks, and the runner drafts with it."""
    from inference.torch_free.mtp import Drafter, default_draft, mtp_layers
    from inference.torch_free.runner import LeanConfig, LeanModel
    from semoe.checkpoints.hf_convert import import_checkpoint

    path = make_real.write("qwen3.5-35b-a3b", str(tmp_path / "m"), layers=4, overrides=SMALL["qwen3.5-35b-a3b"],
                           progress=False)
    store = import_checkpoint(path, str(tmp_path / "store"))
    assert mtp_layers(store) == [4] and store.manifest.expert_layers()[4] == 16
    with LeanModel(store.root, LeanConfig(cache_bytes=None)) as lean, lean.sequence(32) as seq:
        assert isinstance(default_draft(lean, seq, [5, 6, 7]), Drafter)
        assert lean._mtp is not None and lean._mtp.proj.I == 2 * 64
