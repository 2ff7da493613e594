"""The hot read path: pieces read in parallel, checksums combined, corruption caught in any piece; and
whole-file writes past the page cache where the file system takes them.

What the reader delivers is checked against the tensors written and a plain `open()` + `read()` of
the chunk file, never against the store's own reads (which share the reader's `read_range`)."""

from __future__ import annotations

import pytest
import torch

from storage.errors import CorruptTensorError
from storage.chunk_io import ChunkReader, ChunkReaderConfig
from storage.host_buffers import aligned_empty
from storage.store import ExpertTensor, Store


def written() -> dict[str, torch.Tensor]:
    """The expert's tensors: 9, 2 and 5 pages, several pieces each at a 2-page piece size."""
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(9 * 1024, generator=gen), "b": torch.randn(2 * 1024, generator=gen),
            "c": torch.randn(5 * 1024 - 7, generator=gen)}


@pytest.fixture()
def store(tmp_path):
    s = Store.create(str(tmp_path / "s"))
    with s.writer() as w:
        w.put_expert(0, 0, [ExpertTensor(name=n, tensor=t) for n, t in written().items()], num_experts=1)
        w.commit()
    return s


@pytest.mark.parametrize("mode", ["direct", "drop", "cached"])
@pytest.mark.parametrize("piece_pages", [1, 2, 3, 64])
def test_pieces_combine_to_the_recorded_checksums(store, mode, piece_pages):
    chunk = store.manifest.chunk(0, 0)
    _, buf = aligned_empty(chunk.bytes, alignment=4096, pin=False)
    with ChunkReader(ChunkReaderConfig(mode=mode, piece_bytes=piece_pages * 4096, io_bytes=4096)) as reader:
        crcs = reader.read_many([store.chunk_request(chunk, memoryview(buf.numpy()))])[0]
    assert crcs == [e.crc32c for e in store.manifest.chunk_tensors(chunk)]
    store.check_crcs(chunk, crcs)
    with open(store.path(chunk.file), "rb") as f:
        assert buf[:chunk.bytes].numpy().tobytes() == f.read()
    views, want = store.chunk_views(chunk, buf), written()
    assert views.keys() == want.keys() and all(torch.equal(views[k], want[k]) for k in want)


@pytest.mark.parametrize("tensor,page", [("a", 7), ("c", 4)])
def test_a_flipped_byte_in_a_later_piece_is_caught(store, tensor, page):
    chunk = store.manifest.chunk(0, 0)
    entry = store.manifest.tensor(tensor)
    with open(store.path(chunk.file), "r+b") as f:
        f.seek(entry.offset + page * 4096 + 11)
        b = f.read(1)
        f.seek(entry.offset + page * 4096 + 11)
        f.write(bytes([b[0] ^ 0x08]))
    _, buf = aligned_empty(chunk.bytes, alignment=4096, pin=False)
    with ChunkReader(ChunkReaderConfig(piece_bytes=2 * 4096)) as reader:
        crcs = reader.read_many([store.chunk_request(chunk, memoryview(buf.numpy()))])[0]
    with pytest.raises(CorruptTensorError, match=rf"tensor {tensor} \(weight\) is corrupt"):
        store.check_crcs(chunk, crcs)


def test_a_gate_that_refuses_abandons_the_read_and_counts_what_was_read(store):
    from storage.chunk_io import ReadCancelled

    chunk = store.manifest.chunk(0, 0)
    _, buf = aligned_empty(chunk.bytes, alignment=4096, pin=False)
    calls = []

    def gate():  # threads=1 reads the first piece first: before opening it, before pages 2 and 3, then refuse
        calls.append(1)
        return len(calls) <= 3

    with ChunkReader(ChunkReaderConfig(piece_bytes=64 * 4096, io_bytes=4096, threads=1)) as reader:
        req = store.chunk_request(chunk, memoryview(buf.numpy()))
        req.gate = gate
        with pytest.raises(ReadCancelled) as info:
            reader.read_many([req])
    assert info.value.nbytes == 3 * 4096  # pages 1 to 3 were read before the fourth call refused

    with ChunkReader(ChunkReaderConfig(piece_bytes=2 * 4096, io_bytes=4096)) as reader:  # a gate that lets all through
        req = store.chunk_request(chunk, memoryview(buf.numpy()))
        req.gate = lambda: True
        crcs = reader.read_many([req])[0]
    store.check_crcs(chunk, crcs)


def test_write_file_goes_past_the_page_cache_where_it_can_and_buffered_elsewhere(tmp_path, monkeypatch):
    """`write_file(direct=True)`: O_DIRECT for a block-aligned buffer, buffered for an unaligned one,
    and on a file system that refuses O_DIRECT (EINVAL, simulated) buffered, remembered so that the
    next write does not try again; the file holds the bytes every time (read back with `open()`)."""
    import errno
    import os

    import storage.chunk_io as fileio

    opened: list[bool] = []
    real_open = os.open

    def recording_open(path, flags, *args):
        opened.append(bool(flags & os.O_DIRECT))
        return real_open(path, flags, *args)

    monkeypatch.setattr(fileio.os, "open", recording_open)
    monkeypatch.setattr(fileio, "_direct_ok", {})
    _, buf = aligned_empty(3 * 4096, alignment=4096, pin=False)
    buf.copy_(torch.arange(buf.numel()) % 251)
    data = memoryview(buf.numpy())
    fileio.write_file(str(tmp_path / "aligned"), data, direct=True)
    fileio.write_file(str(tmp_path / "unaligned"), data[1:], direct=True)
    fileio.write_file(str(tmp_path / "buffered"), data)
    assert opened == [True, False, False]
    for name, want in (("aligned", data), ("unaligned", data[1:]), ("buffered", data)):
        assert open(tmp_path / name, "rb").read() == bytes(want), name

    def refusing_open(path, flags, *args):
        opened.append(bool(flags & os.O_DIRECT))
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(fileio.os, "open", refusing_open)
    opened.clear()
    fileio.write_file(str(tmp_path / "refused1"), data, direct=True)
    fileio.write_file(str(tmp_path / "refused2"), data, direct=True)
    assert opened == [True, False, False]  # tried once, then buffered for this device
    assert open(tmp_path / "refused2", "rb").read() == bytes(data)


@pytest.mark.parametrize("direct", [True, False])
def test_write_file_over_an_existing_file_leaves_exactly_the_new_bytes(tmp_path, direct):
    """Rewriting a file overwrites it in place (not truncated first): over one of the same length, a
    longer one (its tail cut) and a shorter one, the file holds exactly the new bytes each time."""
    from storage.chunk_io import write_file

    _, buf = aligned_empty(4 * 4096, alignment=4096, pin=False)
    buf.copy_(torch.arange(buf.numel()) % 251)
    path = str(tmp_path / "chunk")
    write_file(path, memoryview(buf.numpy()), direct=direct)
    buf.add_(1)
    write_file(path, memoryview(buf.numpy()), direct=direct)
    assert open(path, "rb").read() == buf.numpy().tobytes()
    shorter = memoryview(buf.numpy())[:2 * 4096]
    write_file(path, shorter, direct=direct)
    assert open(path, "rb").read() == bytes(shorter)
    write_file(path, memoryview(buf.numpy()), direct=direct)
    assert open(path, "rb").read() == buf.numpy().tobytes()
