"""Tiny random-weight MoE models built with transformers' own classes and saved with save_pretrained."""

from __future__ import annotations

import json
import pathlib

import torch

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def tiny_config(arch: str):
    """A tiny transformers config of one MoE architecture."""
    import transformers

    if arch == "mixtral":
        return transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                           shared_expert_intermediate_size=40, decoder_sparse_step=1)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                                        eos_token_id=1, bos_token_id=None)
    raise ValueError(arch)


def make_hf_checkpoint(arch: str, path: pathlib.Path, *, dtype: str = "float32", max_shard_size: str = "5GB",
                       seed: int = 0) -> pathlib.Path:
    """Save a tiny random model of `arch` with save_pretrained; returns the directory."""
    import transformers

    cfg = tiny_config(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    return path


def load_safetensors_dir(path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in a directory, read by the safetensors library."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def add_word_tokenizer(path, *, chat_template: str | None = None) -> None:
    """A word-level tokenizer.json covering all 96 ids, with <s> and </s> as special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ("the cat sat on a mat and dog ran to big red blue one two three four five six seven user "
             "assistant system").split()
    words += [f"w{i}" for i in range(96 - 3 - len(words))]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
