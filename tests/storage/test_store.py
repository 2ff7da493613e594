"""The store's format, commits and checks, on real files in temporary directories."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr

from storage.errors import BadInputError, CorruptTensorError, NotAStoreError, StoreLockedError
from storage.layout import array_of_chunk
from storage.reader import MANIFEST
from storage.store import ExpertTensor, Store

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def _rand(shape, dtype, gen):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-128, 127, shape, generator=gen).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _expert(layer, e, gen, dtype=torch.float32, value=None):
    w1 = _rand((6, 4), dtype, gen) if value is None else torch.full((6, 4), float(value)).to(dtype)
    w2 = _rand((4, 6), dtype, gen) if value is None else torch.full((4, 6), float(value)).to(dtype)
    return [ExpertTensor(name=f"layers.{layer}.experts.{e}.w1", tensor=w1),
            ExpertTensor(name=f"layers.{layer}.experts.{e}.w2", tensor=w2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_exact(tmp_path, dtype):
    gen = torch.Generator().manual_seed(1)
    store = Store.create(str(tmp_path / "s"))
    dense = {"embed": _rand((7, 5), dtype, gen), "zeros": torch.zeros(3, 3, dtype=dtype),
             "scalar": torch.tensor(2).to(dtype), "empty": torch.zeros(0, 4, dtype=dtype)}
    experts = {e: _expert(0, e, gen, dtype) for e in range(3)}
    experts[3] = _expert(0, 3, gen, dtype, value=0)  # an all-zero expert must round-trip too
    with store.writer() as w:
        for name, t in dense.items():
            w.put_dense(name, t)
        for e, tensors in experts.items():
            w.put_expert(0, e, tensors, num_experts=4)
        w.commit()
    reopened = Store.open(store.root)
    for name, t in dense.items():
        assert _same_bits(reopened.read_tensor(name), t), name
        assert _same_bits(reopened.read_tensor_ts(reopened.manifest.tensor(name)), t), name
    for e, tensors in experts.items():
        got = reopened.read_expert(0, e)
        for x in tensors:
            assert _same_bits(got[x.name], x.tensor), x.name
    assert reopened.verify() == []


def test_expert_chunk_is_one_padded_file_readable_by_zarr(tmp_path):
    gen = torch.Generator().manual_seed(2)
    store = Store.create(str(tmp_path / "s"))
    tensors = _expert(3, 1, gen)
    with store.writer() as w:
        w.put_expert(3, 0, _expert(3, 0, gen), num_experts=2)
        w.put_expert(3, 1, tensors, num_experts=2)
        w.put_dense("norm", torch.arange(5, dtype=torch.float32))
        w.commit()
    chunk = store.manifest.chunk(3, 1)
    assert os.path.getsize(store.path(chunk.file)) == chunk.bytes
    assert chunk.bytes % 4096 == 0
    entries = store.manifest.chunk_tensors(chunk)
    assert {e.file for e in entries} == {chunk.file}  # one contiguous read gets the expert
    # any zarr v3 reader opens the arrays: the expert array as bytes, the dense one typed
    array_dir, index = array_of_chunk(store.path(chunk.file))
    assert index == (1, 0)
    z = zarr.open_array(array_dir, mode="r")
    assert z.shape == (2, chunk.bytes)
    row = np.asarray(z[1])
    w1 = entries[0]
    assert np.array_equal(row[w1.offset:w1.offset + w1.bytes].view(np.float32).reshape(w1.shape),
                          tensors[0].tensor.numpy())
    layout = z.attrs["semoe"]["layout"]
    assert [item["offset"] for item in layout] == [e.offset for e in entries]
    dense_dir, _ = array_of_chunk(store.path(store.manifest.tensor("norm").file))
    assert np.array_equal(zarr.open_array(dense_dir, mode="r")[:], np.arange(5, dtype=np.float32))


def test_bfloat16_arrays_open_typed_in_tensorstore(tmp_path):
    store = Store.create(str(tmp_path / "s"))
    t = torch.randn(4, 3).bfloat16()
    with store.writer() as w:
        w.put_dense("x", t)
        w.commit()
    array_dir, _ = array_of_chunk(store.path(store.manifest.tensor("x").file))
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": array_dir}}).result()
    assert arr.dtype.name == "bfloat16"
    assert np.array_equal(np.asarray(arr.read().result()).astype(np.float32), t.float().numpy())


def test_uncommitted_writes_are_invisible_and_removed(tmp_path):
    store = Store.create(str(tmp_path / "s"))
    with store.writer() as w:
        w.put_dense("a", torch.ones(3))
        w.commit()
    files_before = sorted(os.listdir(tmp_path / "s" / "arrays"))
    with pytest.raises(RuntimeError):
        with store.writer() as w:
            w.put_dense("a", torch.zeros(3))
            w.put_dense("b", torch.zeros(3))
            raise RuntimeError("writer fails before commit")
    again = Store.open(store.root)
    assert again.version == 1 and not again.manifest.has_tensor("b")
    assert torch.equal(again.read_tensor("a"), torch.ones(3))
    assert sorted(os.listdir(tmp_path / "s" / "arrays")) == files_before


def test_one_writer_at_a_time(tmp_path):
    store = Store.create(str(tmp_path / "s"))
    with store.writer():
        with pytest.raises(StoreLockedError, match="another process is writing"):
            store.writer()
    with store.writer() as w:  # released again
        w.commit()


def test_readers_during_commits_see_only_committed_versions(tmp_path):
    """Readers keep reading while a writer commits: every read matches the version it opened."""
    store = Store.create(str(tmp_path / "s"))

    def commit(v: int) -> None:
        with store.writer() as w:
            w.put_dense("d", torch.full((64,), float(v)))
            for e in range(2):
                w.put_expert(0, e, [ExpertTensor(name=f"e{e}", tensor=torch.full((32, 8), float(v)))],
                             num_experts=2)
            w.commit()

    commit(1)
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            s = Store.open(store.root)
            v = float(s.version)
            for t in (s.read_tensor("d"), s.read_expert(0, 0)["e0"], s.read_expert(0, 1)["e1"]):
                if not torch.all(t == v):
                    errors.append(f"version {v} read {t.flatten()[0].item()}")
            reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for v in range(2, 12):
        commit(v)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert reads[0] > 0
    assert Store.open(store.root).version == 11


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_flipped_byte_is_caught_by_verify_and_by_read(tmp_path):
    gen = torch.Generator().manual_seed(3)
    store = Store.create(str(tmp_path / "s"))
    with store.writer() as w:
        w.put_dense("dense.weight", torch.randn(16, 16, generator=gen))
        for e in range(2):
            w.put_expert(0, e, _expert(0, e, gen), num_experts=2)
        w.commit()
    victim = store.manifest.tensor("layers.0.experts.1.w2")
    _flip_byte(store.path(victim.file), victim.offset + 5)
    dense = store.manifest.tensor("dense.weight")
    _flip_byte(store.path(dense.file), 17)
    problems = store.verify()
    assert sorted(p.tensor for p in problems) == ["dense.weight", "layers.0.experts.1.w2"]
    assert all(p.what == "checksum mismatch" for p in problems)
    with pytest.raises(CorruptTensorError, match=r"tensor layers\.0\.experts\.1\.w2 \(weight\) is corrupt"):
        store.read_expert(0, 1)
    with pytest.raises(CorruptTensorError, match=r"tensor dense\.weight"):
        store.read_tensor("dense.weight")
    store.read_expert(0, 0)  # the healthy expert still reads


def test_a_dense_weight_read_a_block_of_rows_at_a_time(tmp_path):
    """`read_dense_rows` gives the weight's rows in order, each block a new buffer, and checks the
    whole weight's checksum when the last block is read: a flipped byte in any block is caught."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(37, 24, generator=gen).to(torch.bfloat16)
    store = Store.create(str(tmp_path / "s"))
    with store.writer() as wr:
        wr.put_dense("dense.weight", w)
        wr.put_dense("norm.weight", torch.randn(24, generator=gen))
        wr.commit()
    blocks = list(store.read_dense_rows("dense.weight", 8))
    assert [tuple(b.shape) for b in blocks] == [(8, 24)] * 4 + [(5, 24)]
    assert all(b.dtype == torch.bfloat16 for b in blocks) and torch.equal(torch.cat(blocks), w)
    (norm,) = store.read_dense_rows("norm.weight", 8)  # not 2-D: whole
    assert torch.equal(norm, store.read_tensor("norm.weight"))
    entry = store.manifest.tensor("dense.weight")
    _flip_byte(store.path(entry.file), entry.offset + 10 * 24 * 2 + 3)  # in the second block
    rows = store.read_dense_rows("dense.weight", 8)
    for _ in range(4):
        next(rows)
    with pytest.raises(CorruptTensorError, match=r"tensor dense\.weight \(weight\) is corrupt"):
        next(rows)


def test_missing_and_truncated_files_are_named(tmp_path):
    gen = torch.Generator().manual_seed(4)
    store = Store.create(str(tmp_path / "s"))
    with store.writer() as w:
        for e in range(2):
            w.put_expert(1, e, _expert(1, e, gen), num_experts=2)
        w.commit()
    c0, c1 = store.manifest.chunk(1, 0), store.manifest.chunk(1, 1)
    os.remove(store.path(c0.file))
    with open(store.path(c1.file), "r+b") as f:
        f.truncate(100)
    found = {(p.tensor, p.what) for p in store.verify()}
    assert ("expert 0 of layer 1 (weight)", "file is missing") in found
    assert ("expert 1 of layer 1 (weight)", f"file has 100 bytes, expected {c1.bytes}") in found
    with pytest.raises(CorruptTensorError, match="shorter than recorded"):
        store.read_expert(1, 1)


def test_gc_removes_only_unreferenced_files(tmp_path):
    gen = torch.Generator().manual_seed(5)
    store = Store.create(str(tmp_path / "s"))
    with store.writer() as w:
        for e in range(3):
            w.put_expert(0, e, _expert(0, e, gen), num_experts=3)
        w.put_dense("keep", torch.ones(4))
        w.commit()
    old = store.manifest.chunk(0, 1).file
    for v in range(2):
        with store.writer() as w:
            w.put_expert(0, 1, _expert(0, 1, gen, value=v + 7), num_experts=3)
            w.commit()
    middle = Store.open(store.root)
    with store.writer() as w:
        w.put_expert(0, 1, _expert(0, 1, gen, value=42), num_experts=3)
        w.commit()
    r = store.gc(keep=2)
    assert r.files >= 2 and not os.path.exists(store.path(old))
    assert store.verify() == []
    # the previous version was retained, so a reader still on it keeps working
    assert torch.all(middle.read_expert(0, 1)["layers.0.experts.1.w1"] == 8)
    store.gc(keep=1)
    assert not os.path.exists(middle.path(middle.manifest.chunk(0, 1).file))
    assert torch.all(store.read_expert(0, 1)["layers.0.experts.1.w1"] == 42)
    assert store.verify() == []
    assert torch.equal(store.read_tensor("keep"), torch.ones(4))


def test_not_a_store_and_bad_targets(tmp_path):
    with pytest.raises(NotAStoreError, match="not a semoe store"):
        Store.open(str(tmp_path))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / MANIFEST).write_text("{broken")
    with pytest.raises(NotAStoreError, match="manifest is not valid JSON"):
        Store.open(str(tmp_path / "x"))
    (tmp_path / "x" / MANIFEST).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(NotAStoreError, match="not a semoe store manifest"):
        Store.open(str(tmp_path / "x"))
    with pytest.raises(BadInputError, match="target directory is not empty"):
        Store.create(str(tmp_path / "x"))


def test_expert_chunks_of_a_layer_must_agree(tmp_path):
    gen = torch.Generator().manual_seed(6)
    store = Store.create(str(tmp_path / "s"))
    with store.writer() as w:
        w.put_expert(0, 0, _expert(0, 0, gen), num_experts=2)
        with pytest.raises(BadInputError, match="differs from the layer's other experts"):
            w.put_expert(0, 1, [ExpertTensor(name="big", tensor=torch.zeros(4096))], num_experts=2)
        with pytest.raises(BadInputError, match="out of range"):
            w.put_expert(0, 2, _expert(0, 2, gen), num_experts=2)
