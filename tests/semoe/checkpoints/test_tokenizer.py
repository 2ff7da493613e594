"""Tokenizers: byte round trips, and HuggingFace parity on a tokenizer trained here (no network)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from semoe.checkpoints.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from storage.errors import BadInputError

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts layers route each token to a few experts.",
    "héllo wörld, naïve café ✓ — ünïcödé 日本語 🙂",
    "def f(x):\n    return x * 2\n",
]
SAMPLES = ["", "hello world", "The lazy fox routes tokens.", "naïve ✓ 🙂 <s> inside", "  spaces\n\ttabs ",
           "unseen: Ωμέγα ∑ xyzzy"]


def _random_text(rng: random.Random) -> str:
    """Random code points from ASCII to the astral planes, surrogates excluded (they are not text)."""
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    out = []
    for _ in range(rng.randrange(0, 40)):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def test_byte_round_trip_random_unicode():
    tok = ByteTokenizer()
    rng = random.Random(1234)
    for _ in range(2000):
        text = _random_text(rng)
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text


def test_byte_specials_and_invalid_bytes():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    assert tok.encode("hi", add_bos=True, add_eos=True) == [256, 104, 105, 257]
    assert tok.decode([256, 104, 258, 105, 257]) == "hi"
    assert tok.decode([0xC3]) == "\ufffd"  # a truncated two-byte sequence
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffd\ufffd\ufffdb"  # lone surrogate: no crash
    assert not tok.add_bos_default and not tok.add_eos_default


def _build_hf_dir(path, *, post_processor: bool, config: str = "tokenizer_config"):
    """Train a byte-level BPE on a few sentences and save it as a HuggingFace tokenizer directory."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SENTENCES * 5, trainer)
    if post_processor:  # Llama/Mixtral style: BOS in front of every sequence
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    if config == "tokenizer_config":
        (path / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
            "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}, "pad_token": "<pad>"}))
    else:
        (path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    return path


@pytest.mark.parametrize("post_processor", [True, False])
def test_hf_matches_transformers(tmp_path, post_processor):
    from transformers import AutoTokenizer

    d = _build_hf_dir(tmp_path / "tok", post_processor=post_processor)
    ours = HFTokenizer(str(d))
    theirs = AutoTokenizer.from_pretrained(str(d))
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_token_id, theirs.eos_token_id,
                                                       theirs.pad_token_id) == (0, 1, 2)
    assert ours.vocab_size == len(theirs)
    assert ours.add_bos_default is post_processor and not ours.add_eos_default
    for text in SAMPLES:
        expected = theirs(text)["input_ids"]
        assert ours.encode(text, add_bos=ours.add_bos_default, add_eos=ours.add_eos_default) == expected
        plain = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == plain
        assert ours.encode(text, add_bos=True, add_eos=True) == [0, *plain, 1]
        assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=True)
        assert ours.decode(expected) == text.replace("<s>", "")  # special tokens are skipped, even typed ones


def test_hf_special_ids_from_config_json(tmp_path):
    d = _build_hf_dir(tmp_path / "tok", post_processor=False, config="config")
    tok = load_tokenizer(str(d))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, None)  # a list of eos ids: the first


def test_hf_fingerprint_follows_file_content(tmp_path):
    a = HFTokenizer(str(_build_hf_dir(tmp_path / "a", post_processor=False)))
    b = HFTokenizer(str(_build_hf_dir(tmp_path / "b", post_processor=False)))
    c = HFTokenizer(str(_build_hf_dir(tmp_path / "c", post_processor=True)))
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.fingerprint != ByteTokenizer().fingerprint


def test_load_tokenizer_byte_fallback(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path), vocab_size=259), ByteTokenizer)
    with pytest.raises(BadInputError) as e:
        load_tokenizer(str(tmp_path), vocab_size=1000)
    assert str(e.value) == f"{tmp_path}: no tokenizer.json and vocab_size 1000 is not the byte tokenizer's 259"
    with pytest.raises(BadInputError, match="no tokenizer directory: no tokenizer.json"):
        load_tokenizer(None, vocab_size=300)


def test_load_tokenizer_bad_input(tmp_path):
    with pytest.raises(BadInputError, match="missing: expected a tokenizer directory"):
        load_tokenizer(str(tmp_path / "missing"))
    d = _build_hf_dir(tmp_path / "tok", post_processor=False)
    assert load_tokenizer(str(d), vocab_size=512).vocab_size <= 512
    with pytest.raises(BadInputError, match=r"tokenizer.json: \d+ tokens, more than the model's vocab_size 10$"):
        load_tokenizer(str(d), vocab_size=10)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(BadInputError, match="tokenizer.json: not a readable tokenizers file"):
        load_tokenizer(str(d))
    bad = tmp_path / "badcfg"
    _build_hf_dir(bad, post_processor=False)
    (bad / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(BadInputError, match="tokenizer_config.json: expected a JSON object, got list"):
        load_tokenizer(str(bad))


def test_decode_skips_the_tokens_the_config_names_as_transformers_does(tmp_path):
    """A tokenizer.json that does not mark <s>, </s>, <unk> special (word-level ones often do not):
    transformers still leaves them out of decode(skip_special_tokens=True), since its config names them."""
    from transformers import AutoTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "two": 3, "cat": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    ids = [2, 3, 2, 0, 4, 1]
    want = AutoTokenizer.from_pretrained(str(tmp_path)).decode(ids, skip_special_tokens=True)
    assert HFTokenizer(str(tmp_path)).decode(ids) == want == "two cat"
