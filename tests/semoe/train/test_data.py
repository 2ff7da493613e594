"""Token shards on disk, the default corpus and its split, deterministic batches, and prepare_data."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from semoe.train import data
from semoe.train.data import BatchSampler, ShardSet, build_shards, default_corpus_files, prepare_data, split_files
from semoe.checkpoints.tokenizer import ByteTokenizer, load_tokenizer
from storage.errors import BadInputError

EOS = ByteTokenizer.EOS


@pytest.fixture
def corpus(tmp_path):
    """A few small text files: ASCII, UTF-8, latin-1 (not UTF-8), empty, and CRLF line ends."""
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("hello world\nsecond line\n")
    (d / "b.md").write_text("# Títle\nünïcödé ✓ 🙂\n", encoding="utf-8")
    (d / "sub" / "c.py").write_bytes("caf\u00e9 = 1  # latin-1\n".encode("latin-1"))
    (d / "sub" / "empty.txt").write_bytes(b"")
    (d / "sub" / "crlf.txt").write_bytes(b"one\r\ntwo\r\nthree")
    (d / "ignored.bin").write_bytes(b"\x00\x01")
    return d


def _expected(files: list[str], tok: ByteTokenizer) -> list[int]:
    out = []
    for f in files:
        with open(f, "rb") as fh:
            out += tok.encode(fh.read().decode("utf-8", errors="replace")) + [EOS]
    return out


def _listing(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_shards_round_trip_across_boundaries(tmp_path, corpus):
    files = data.text_files(str(corpus))
    assert [os.path.relpath(f, corpus) for f in files] == ["a.txt", "b.md", "sub/c.py", "sub/crlf.txt",
                                                           "sub/empty.txt"]
    tok = ByteTokenizer()
    calls = []
    shards = build_shards(files, str(tmp_path / "out"), tok, shard_tokens=7,
                          progress=lambda done, total: calls.append((done, total)))
    expected = _expected(files, tok)
    assert shards.num_tokens == len(expected) and shards.vocab_size == 259
    assert shards.tokens(0, len(expected)).tolist() == expected
    rng = random.Random(0)
    for _ in range(200):
        start = rng.randrange(len(expected))
        length = rng.randrange(len(expected) - start + 1)
        assert shards.tokens(start, length).tolist() == expected[start:start + length]
    assert "\ufffd" in tok.decode(expected)  # the latin-1 byte was replaced, not dropped
    meta = json.loads((tmp_path / "out" / "shards.json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "byte" and meta["num_files"] == 5
    assert [s["file"] for s in meta["shards"]] == [f"shard-{i:05d}.bin" for i in range(len(meta["shards"]))]
    assert [s["tokens"] for s in meta["shards"]][:-1] == [7] * (len(meta["shards"]) - 1)
    assert np.fromfile(tmp_path / "out" / "shard-00000.bin", dtype="<u2").tolist() == expected[:7]
    assert calls[-1] == (sum(os.path.getsize(f) for f in files),) * 2
    shards.verify()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind
    with pytest.raises(IndexError):
        shards.tokens(len(expected) - 1, 2)


def test_uint32_shards_and_slices(tmp_path, corpus):
    files = data.text_files(str(corpus))
    shards = build_shards(files, str(tmp_path / "out"), ByteTokenizer(), shard_tokens=5, dtype="uint32")
    assert shards.dtype == np.dtype("<u4")
    expected = _expected(files, ByteTokenizer())
    part = shards.slice(3, 40)
    assert part.num_tokens == 37 and part.tokens(0, 37).tolist() == expected[3:40]
    assert part.tokens(30, 7).tolist() == expected[33:40]


def test_truncated_and_corrupt_shards(tmp_path, corpus):
    out = tmp_path / "out"
    build_shards(data.text_files(str(corpus)), str(out), ByteTokenizer(), shard_tokens=8)
    shard = out / "shard-00001.bin"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-1])
    with pytest.raises(BadInputError) as e:
        ShardSet.open(str(out))
    assert str(e.value) == f"{shard}: 15 bytes, expected 16 bytes (8 uint16 tokens)"
    shard.unlink()
    with pytest.raises(BadInputError, match="shard-00001.bin: missing, expected 16 bytes"):
        ShardSet.open(str(out))
    shard.write_bytes(bytes([raw[0] ^ 1]) + raw[1:])
    opened = ShardSet.open(str(out))  # sizes are right; only verify() reads the contents
    with pytest.raises(BadInputError, match="shard-00001.bin: crc32c mismatch"):
        opened.verify()
    with pytest.raises(BadInputError, match="no shards.json; expected a directory of token shards"):
        ShardSet.open(str(tmp_path))


def test_non_empty_out_dir_refused_and_untouched(tmp_path, corpus):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    before = _listing(tmp_path)
    with pytest.raises(BadInputError) as e:
        build_shards(data.text_files(str(corpus)), str(out), ByteTokenizer())
    assert str(e.value) == f"{out}: expected an absent or empty directory to write shards into"
    assert _listing(tmp_path) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert build_shards(data.text_files(str(corpus)), str(empty), ByteTokenizer()).num_tokens > 0


def test_failure_leaves_nothing(tmp_path, corpus):
    class Exploding(ByteTokenizer):
        kind = "test"

        def _encode_plain(self, text):
            if "world" in text:
                raise RuntimeError("tokenizer failed")
            return super()._encode_plain(text)

    files = sorted(data.text_files(str(corpus)), reverse=True)  # a.txt (which fails) comes last
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        build_shards(files, str(tmp_path / "out"), Exploding(), shard_tokens=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_default_corpus_is_stable_stdlib_source():
    files = default_corpus_files()
    assert len(files) > 100 and files == default_corpus_files()
    root = data.stdlib_root()
    rel = [os.path.relpath(f, root).replace(os.sep, "/") for f in files]
    assert "os.py" in rel and rel == sorted(rel)
    parts = {p for r in rel for p in r.split("/")[:-1]}
    assert not parts & {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo"}
    assert not any(r.startswith("_sysconfigdata") for r in rel)


def test_split_is_deterministic_disjoint_and_complete():
    files = default_corpus_files()
    train, val = split_files(files, 0.05, seed=0)
    assert set(train).isdisjoint(val) and sorted(train + val) == sorted(files)
    assert 0.02 < len(val) / len(files) < 0.10
    shuffled = list(files)
    random.Random(3).shuffle(shuffled)
    train2, val2 = split_files(shuffled, 0.05, seed=0)
    assert sorted(train2) == sorted(train) and sorted(val2) == sorted(val)
    assert set(split_files(files, 0.05, seed=1)[1]) != set(val)
    two = files[:2]
    t, v = split_files(two, 0.05)
    assert len(t) == len(v) == 1
    with pytest.raises(BadInputError, match="need at least 2"):
        split_files(files[:1])
    with pytest.raises(ValueError, match="val_fraction must be in"):
        split_files(files, 1.5)


def test_stdlib_subset_shards(tmp_path):
    files = [f for f in default_corpus_files() if os.path.dirname(f) == data.stdlib_root()][:20]
    shards = build_shards(files, str(tmp_path / "out"), ByteTokenizer(), shard_tokens=1 << 16)
    assert shards.num_tokens == len(_expected(files, ByteTokenizer()))
    n = shards.num_tokens
    assert shards.tokens(n - 1, 1).tolist() == [EOS]


def test_batch_sampler_is_a_pure_function_of_step(tmp_path, corpus):
    shards = build_shards(data.text_files(str(corpus)), str(tmp_path / "out"), ByteTokenizer(), shard_tokens=9)
    a = BatchSampler(shards, batch_size=4, seq_len=8, seed=7)
    b = BatchSampler(ShardSet.open(str(tmp_path / "out")), 4, 8, seed=7)
    flat = shards.tokens(0, shards.num_tokens)
    for step in (0, 1, 5, 10_000):
        x, y = a.batch(step)
        x2, y2 = b.batch(step)
        assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
        assert (x == x2).all() and (y == y2).all()
        assert (x[:, 1:] == y[:, :-1]).all()
        assert int(x.max()) < shards.vocab_size and int(y.max()) < shards.vocab_size
        for row, start in zip(x.tolist(), a.starts(step).tolist()):
            assert row == flat[start:start + 8].tolist()
    assert not (a.batch(0)[0] == a.batch(1)[0]).all()
    assert not (a.batch(0)[0] == BatchSampler(shards, 4, 8, seed=8).batch(0)[0]).all()
    starts = np.concatenate([a.starts(s) for s in range(500)])
    assert starts.min() == 0 and starts.max() == shards.num_tokens - 9  # every window start is reachable
    with pytest.raises(BadInputError, match=r"fewer than seq_len \+ 1"):
        BatchSampler(shards, 1, shards.num_tokens)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        BatchSampler(shards, 0, 8)


def test_prepare_data_from_directory_and_reuse(tmp_path, corpus):
    out = tmp_path / "prepared"
    seen = []
    train, val = prepare_data(str(corpus), str(out), ByteTokenizer(), val_fraction=0.3, shard_tokens=16,
                              progress=lambda done, total: seen.append((done, total)))
    files = data.text_files(str(corpus))
    tf, vf = split_files(files, 0.3, root=str(corpus))
    assert train.tokens(0, train.num_tokens).tolist() == _expected(tf, ByteTokenizer())
    assert val.tokens(0, val.num_tokens).tolist() == _expected(vf, ByteTokenizer())
    assert seen[-1][0] == seen[-1][1] == sum(os.path.getsize(f) for f in files)
    before = _listing(out)
    train2, val2 = prepare_data(str(corpus), str(out), ByteTokenizer(), val_fraction=0.3)
    assert _listing(out) == before and train2.num_tokens == train.num_tokens
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x\ny\n")
    with pytest.raises(BadInputError, match="shards of .*corpus', not of .*other'; use another output"):
        prepare_data(str(other), str(out), ByteTokenizer())
    reopened = prepare_data(str(out), str(tmp_path / "unused"), ByteTokenizer())  # a train/val pair as is
    assert reopened[0].num_tokens == train.num_tokens and not (tmp_path / "unused").exists()


def test_prepare_data_single_file_and_single_shard_set(tmp_path, corpus):
    text = "".join(f"line {i}\n" for i in range(40))
    (tmp_path / "one.txt").write_text(text)
    train, val = prepare_data(str(tmp_path / "one.txt"), str(tmp_path / "out"), ByteTokenizer(), val_fraction=0.1)
    tok = ByteTokenizer()
    assert train.tokens(0, train.num_tokens).tolist() == tok.encode("".join(text.splitlines(True)[:36])) + [EOS]
    assert val.tokens(0, val.num_tokens).tolist() == tok.encode("".join(text.splitlines(True)[36:])) + [EOS]
    whole = build_shards(data.text_files(str(corpus)), str(tmp_path / "whole"), tok)
    t, v = prepare_data(str(tmp_path / "whole"), str(tmp_path / "unused"), tok, val_fraction=0.25)
    assert t.num_tokens + v.num_tokens == whole.num_tokens and v.num_tokens == round(whole.num_tokens * 0.25)
    assert v.tokens(0, v.num_tokens).tolist() == whole.tokens(t.num_tokens, v.num_tokens).tolist()


def test_prepare_data_default_corpus(tmp_path, monkeypatch):
    subset = [f for f in default_corpus_files() if os.path.dirname(f) == data.stdlib_root()][:20]
    monkeypatch.setattr(data, "default_corpus_files", lambda: subset)
    train, val = prepare_data(None, str(tmp_path / "out"), ByteTokenizer())
    assert train.meta["source"].startswith("python-stdlib-") and val.meta["source"] == train.meta["source"]
    assert train.meta["num_files"] + val.meta["num_files"] == 20 and val.num_tokens > 0


def test_prepare_data_bad_specs(tmp_path):
    with pytest.raises(BadInputError, match="nope: no such file or directory; expected a text file"):
        prepare_data(str(tmp_path / "nope"), str(tmp_path / "out"), ByteTokenizer())
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match=r"empty: no \*.txt, \*.md, \*.py files and no shards.json"):
        prepare_data(str(tmp_path / "empty"), str(tmp_path / "out"), ByteTokenizer())
    (tmp_path / "short.txt").write_text("just one line")
    with pytest.raises(BadInputError, match="short.txt: 1 line"):
        prepare_data(str(tmp_path / "short.txt"), str(tmp_path / "out"), ByteTokenizer())
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes").write_text("x")
    (tmp_path / "two.txt").write_text("a\nb\n")
    with pytest.raises(BadInputError, match="busy: expected an absent or empty directory"):
        prepare_data(str(tmp_path / "two.txt"), str(tmp_path / "busy"), ByteTokenizer())
    assert not (tmp_path / "out").exists()


def test_hf_tokenizer_shards(tmp_path, corpus):
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world second line", "one two three"],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"], show_progress=False))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    hf = load_tokenizer(str(tmp_path / "tok"))
    files = data.text_files(str(corpus))
    shards = build_shards(files, str(tmp_path / "out"), hf, shard_tokens=3)
    expected = []
    for f in files:
        with open(f, "rb") as fh:
            expected += hf.encode(fh.read().decode("utf-8", errors="replace")) + [hf.eos_id]
    assert shards.tokens(0, shards.num_tokens).tolist() == expected
    assert shards.meta["tokenizer"] == "hf" and shards.meta["eos_id"] == hf.eos_id == 1
    with pytest.raises(BadInputError, match=r"out/shards.json: built with tokenizer hf-[0-9a-f]{8} \(vocab \d+\), "
                                            r"not byte-259 \(vocab 259\)"):
        prepare_data(str(tmp_path / "out"), str(tmp_path / "unused"), ByteTokenizer())
    (tmp_path / "out" / "shards.json").write_text(json.dumps({**shards.meta, "shards": [{"file": "../x"}]}))
    with pytest.raises(BadInputError, match="shards.json: bad shard entry"):
        ShardSet.open(str(tmp_path / "out"))
