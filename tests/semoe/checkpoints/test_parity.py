"""The model against transformers, for tiny random checkpoints of every supported architecture.

Tolerance: float32 logits (at most about 0.4) within 1e-5 absolute. The implementations differ
in matmul blocking and reduction order only, which measures under 1e-7 here; 1e-5 leaves room for
other BLAS builds while staying ten times stricter than the 1e-4 the architectures were accepted
at. Greedy tokens must be identical.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.hf_models import load_hf_model, make_hf_checkpoint

from semoe.checkpoints.model_io import load_hf, load_model, load_store
from semoe.model.config import ARCHITECTURES
from semoe.decode.loop import SamplingConfig
from semoe.decode.generate import generate
from semoe.model.attention import KVCache
from storage.errors import BadInputError
from semoe.model.hf_names import SUPPORTED_MODEL_TYPES
from semoe.checkpoints.hf_convert import import_checkpoint
from helpers.procs import ROOT, child_env

ATOL = 1e-5
ARCHS = ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss",
         "minimax_m2", "dots1", "kimi_k25", "ernie4_5_moe", "hunyuan_v1_moe", "llama4", "deepseek_v32",
         "glm_moe_dsa", "qwen3_next", "qwen3_5_moe", "deepseek_v4"]
PROMPTS = [[1, 5, 9, 2], [7], list(range(3, 40, 3)), [11, 12, 13, 14, 15, 16, 17, 18]]


SHARDED = ("mixtral", "qwen2_moe", "olmoe", "gpt_oss")  # also from a sharded directory (gpt-oss: fused experts)


@pytest.fixture(scope="module", params=[(a, s) for a in ARCHS for s in (False, True) if a in SHARDED or not s],
                ids=lambda p: f"{p[0]}-{'sharded' if p[1] else 'single'}")
def checkpoint(request, tmp_path_factory):
    arch, sharded = request.param
    path = tmp_path_factory.mktemp("parity") / arch
    make_hf_checkpoint(arch, path, max_shard_size="30KB" if sharded else "5GB", seed=3)
    assert (path / "model.safetensors.index.json").exists() == sharded
    return arch, path


def _hf_model(path):

    m = load_hf_model(path, dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def test_logits_match_transformers(checkpoint):
    arch, path = checkpoint
    ref = _hf_model(path)
    ours = load_hf(str(path))
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=ATOL, rtol=0)
        batch = torch.tensor([PROMPTS[0], PROMPTS[3][:4]])
        torch.testing.assert_close(ours(batch).logits, ref(batch).logits, atol=ATOL, rtol=0)


def test_greedy_generation_matches_transformers(checkpoint):
    arch, path = checkpoint
    ref = _hf_model(path)
    ours = load_hf(str(path))
    for prompt in PROMPTS[:3]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = ref.generate(ids, max_new_tokens=32, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        want = out.sequences[0, len(prompt):].tolist()
        res = generate(ours, prompt, SamplingConfig(max_new_tokens=32))
        assert res.tokens == want
        want_lp = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, want)]
        assert res.logprobs == pytest.approx(want_lp, abs=ATOL)


def test_kv_cache_decode_matches_full_recomputation(checkpoint):
    _, path = checkpoint
    model = load_hf(str(path))
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    with torch.no_grad():
        full = model(torch.tensor([seq])).logits[0]
        cache = KVCache.empty(model.config, 1, len(seq))
        steps = [model(torch.tensor([seq[:5]]), cache).logits[0]]  # a prefill of 5, then one at a time
        for t in seq[5:]:
            steps.append(model(torch.tensor([[t]]), cache).logits[0])
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=0)


def test_latent_attention_caches_the_latent_not_keys_and_values(tmp_path):
    """DeepSeek's cache: per position one kv_lora_rank latent and one rotary key, shared by all heads."""
    path = make_hf_checkpoint("deepseek_v3", tmp_path / "ck", seed=3)
    c = load_hf(str(path)).config
    cache = KVCache.empty(c, 2, 10)
    assert [tuple(t.shape) for t in (cache.k[0], cache.v[0])] == [(2, 1, 10, c.kv_lora_rank),
                                                                  (2, 1, 10, c.qk_rope_head_dim)]
    per_position = c.kv_lora_rank + c.qk_rope_head_dim
    assert per_position < c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)


def test_store_gives_the_same_logits_and_tokens(checkpoint, tmp_path):
    arch, path = checkpoint
    store = import_checkpoint(str(path), str(tmp_path / "store"))
    from_store, from_hf = load_store(store.root), load_hf(str(path))
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(from_store(ids).logits, from_hf(ids).logits)
    cfg = SamplingConfig(max_new_tokens=32)
    got, want = generate(from_store, PROMPTS[0], cfg), generate(from_hf, PROMPTS[0], cfg)
    assert got.tokens == want.tokens and len(got.tokens) == 32


def test_sampling_is_reproducible_and_respects_top_p(checkpoint):
    _, path = checkpoint
    model = load_hf(str(path))
    cfg = SamplingConfig(max_new_tokens=12, greedy=False, temperature=0.8, top_p=0.9, seed=7)
    a, b = generate(model, PROMPTS[0], cfg), generate(model, PROMPTS[0], cfg)
    assert a.tokens == b.tokens and len(a.tokens) == 12
    tiny_p = SamplingConfig(max_new_tokens=12, greedy=False, temperature=1.0, top_p=1e-6, seed=1)
    assert generate(model, PROMPTS[0], tiny_p).tokens == generate(model, PROMPTS[0],
                                                                   SamplingConfig(max_new_tokens=12)).tokens


def _semoe(*args):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)


def _add_word_tokenizer(path) -> None:
    """A real tokenizer.json (word level, 20 words + specials) beside the checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the cat sat on a mat and dog ran to big red blue one two three four five six seven".split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_generate_cli_json_from_hf_and_store(arch, tmp_path):
    import transformers

    path = make_hf_checkpoint(arch, tmp_path / arch, max_shard_size="30KB", seed=3)
    _add_word_tokenizer(path)
    store = import_checkpoint(str(path), str(tmp_path / "store"))
    assert store.manifest.has_file("tokenizer.json")
    model = load_hf(str(path))
    want = generate(model, [1, 2, 3], SamplingConfig(max_new_tokens=8))
    # the class tokenizer_config.json names (AutoTokenizer maps Qwen3.5's model type to its own BPE class,
    # which rebuilds a different tokenizer from this word-level vocabulary)
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    prompt_ids = hf_tok("the cat sat on a mat")["input_ids"]
    want_text = generate(model, prompt_ids, SamplingConfig(max_new_tokens=6))
    for model_path in (str(path), store.root):
        res = _semoe("generate", "--model", model_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
                     "--greedy", "--ignore-eos", "--json")
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert sorted(out) == ["decode_tok_s", "logprobs", "text", "tokens", "ttft_s"]
        assert out["tokens"] == want.tokens
        assert out["logprobs"] == pytest.approx(want.logprobs, abs=1e-6)
        assert out["text"] == hf_tok.decode(want.tokens, skip_special_tokens=True)
        assert out["ttft_s"] > 0 and out["decode_tok_s"] > 0
        res = _semoe("generate", "--model", model_path, "--prompt", "the cat sat on a mat", "--max-new-tokens", "6",
                     "--ignore-eos", "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["tokens"] == want_text.tokens


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_generate_cli_bad_flags(tmp_path):
    path = make_hf_checkpoint("olmoe", tmp_path / "ck")
    for args, message in ((["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
                          (["--prompt", "hello"], "has no tokenizer"),
                          (["--prompt-ids", "1,500"], "outside the vocabulary"),
                          (["--prompt-ids", "1", "--greedy", "--temperature", "0.5"], "--greedy cannot be combined"),
                          (["--prompt-ids", "1", "--cpu-cache", "50%", "--cache-policy", "belady"],
                           "--cache-policy must be one of next-use, lfu-aging, lfu, lru")):
        res = _semoe("generate", "--model", str(path), *args)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and message in res.stderr, res.stderr


# -- bad checkpoints ---------------------------------------------------------------------------

def _rewrite(path, drop: str | None = None, reshape: str | None = None):
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    tensors = load_file(str(f))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].clone()
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = make_hf_checkpoint("olmoe", tmp_path / "ck")
    _rewrite(path, drop="model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(BadInputError, match=r"tensor model\.layers\.1\.self_attn\.k_norm\.weight is missing"):
        load_model(str(path))
    path2 = make_hf_checkpoint("mixtral", tmp_path / "ck2")
    _rewrite(path2, drop="model.layers.0.block_sparse_moe.experts.2.w3.weight")
    with pytest.raises(BadInputError, match=r"experts\.2\.w3\.weight"):
        load_model(str(path2))


def test_wrong_shape_is_named(tmp_path):
    path = make_hf_checkpoint("qwen2_moe", tmp_path / "ck")
    _rewrite(path, reshape="model.layers.0.mlp.shared_expert.up_proj.weight")
    with pytest.raises(BadInputError, match=r"shared_expert\.up_proj\.weight has shape \(39, 32\), expected \(40, 32\)"):
        load_model(str(path))


def test_unsupported_architecture_is_named(tmp_path):
    path = make_hf_checkpoint("olmoe", tmp_path / "ck")
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInputError, match=r"config\.json: config\.json: hidden_act 'gelu' is not supported|"
                                            r"hidden_act 'gelu' is not supported"):
        load_model(str(path))
    for change, message in (({"index_topk": 4}, "DeepSeek sparse attention is taken for model types deepseek_v32"),
                            ({"vision_config": {}}, "multimodal towers are not implemented"),
                            ({"model_type": "llama"}, "supported: " + ", ".join(SUPPORTED_MODEL_TYPES))):
        (path / "config.json").write_text(json.dumps({**cfg, "hidden_act": "silu", **change}))
        with pytest.raises(BadInputError, match=re.escape(message)) as e:
            load_model(str(path))
        assert "\n" not in str(e.value) and "config.json" in str(e.value)
    # one list: what the model builds is what store import accepts
    assert set(ARCHITECTURES) - {"gpt_moe"} == set(SUPPORTED_MODEL_TYPES) - {"semoe_gpt"}
    shutil.rmtree(path)
    with pytest.raises(BadInputError, match="no such directory"):
        load_model(str(path))
