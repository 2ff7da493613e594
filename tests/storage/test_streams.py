"""Copy streams: the CPU thread stream is tested here; the CUDA stream where a GPU exists."""

import logging
import threading

import pytest
import torch

from storage.streams import (
    CopyStreamClosedError,
    CudaCopyStream,
    ThreadCopyStream,
    make_copy_stream,
)

TIMEOUT_S = 30  # only ever reached if something is broken


class HookedTensor(torch.Tensor):
    """A destination tensor whose ``copy_`` first calls ``self.hook()``: to record the order of
    copies, hold one back, or make it fail."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            args[0].hook()
        return super().__torch_function__(func, types, args, kwargs or {})


def hooked(shape, hook) -> HookedTensor:
    dst = torch.empty(shape).as_subclass(HookedTensor)
    dst.hook = hook
    return dst


@pytest.fixture
def stream():
    with ThreadCopyStream() as s:
        yield s


def test_copies_are_correct_and_run_in_issue_order(stream):
    order = []
    srcs = [torch.arange(10.0) + 100 * i for i in range(6)]
    handles = []
    for i, src in enumerate(srcs):
        dst = hooked(src.shape, lambda i=i: order.append(i)) if i % 2 else None
        handles.append(stream.copy_to_device(src, dst))
    for src, handle in zip(srcs, handles):
        assert torch.equal(handle.wait(), src)
        assert handle.tensor.data_ptr() != src.data_ptr()
    assert order == [1, 3, 5]


def test_wait_waits_for_that_copy_only(stream):
    gate = threading.Event()
    early = stream.copy_to_device(torch.ones(4))
    late = stream.copy_to_device(torch.full((4,), 7.0), hooked((4,), lambda: gate.wait(TIMEOUT_S)))
    assert torch.equal(early.wait(), torch.ones(4))
    assert early.done()
    assert not late.done()  # held back by the gate
    gate.set()
    assert torch.equal(late.wait(), torch.full((4,), 7.0))
    assert late.done()


def test_exception_in_a_copy_reaches_wait_and_the_stream_keeps_going(stream):
    def fail():
        raise RuntimeError("device fell off the bus")

    bad = stream.copy_to_device(torch.ones(3), hooked((3,), fail))
    with pytest.raises(RuntimeError, match="fell off the bus"):
        bad.wait()
    assert bad.done()
    assert torch.equal(stream.copy_to_device(torch.ones(3)).wait(), torch.ones(3))


def test_in_place_ok_returns_the_source_without_copying(stream):
    src = torch.arange(8)
    handle = stream.copy_to_device(src, in_place_ok=True)
    assert handle.done()
    assert handle.wait() is src
    copied = stream.copy_to_device(src).wait()
    assert copied.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    src += 1
    assert torch.equal(copied, torch.arange(8))


def test_bad_requests_raise_when_issued(stream):
    with pytest.raises(ValueError, match=r"dst \(3,\) torch.float32 does not match src \(4,\)"):
        stream.copy_to_device(torch.ones(4), torch.empty(3))
    with pytest.raises(ValueError, match="dtype|does not match"):
        stream.copy_to_device(torch.ones(4), torch.empty(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="device=meta"):
        stream.copy_to_device(torch.ones(4), device="meta")
    with pytest.raises(TypeError, match="src must be a torch.Tensor"):
        stream.copy_to_device([1, 2, 3])
    assert stream.copy_to_device(torch.ones(2), device="cpu").wait().sum() == 2


def test_close_finishes_issued_copies_then_refuses_new_ones():
    stream = ThreadCopyStream()
    gate = threading.Event()
    held = stream.copy_to_device(torch.ones(2), hooked((2,), lambda: gate.wait(TIMEOUT_S)))
    closer = threading.Thread(target=stream.close)
    closer.start()
    gate.set()
    closer.join(TIMEOUT_S)
    assert held.done() and torch.equal(held.wait(), torch.ones(2))
    with pytest.raises(CopyStreamClosedError):
        stream.copy_to_device(torch.ones(2))
    stream.close()  # closing twice is harmless


def test_make_copy_stream_picks_the_thread_stream_for_cpu():
    for device in ("cpu", torch.device("cpu")):
        with make_copy_stream(device) as stream:
            assert isinstance(stream, ThreadCopyStream)
            assert stream.device == torch.device("cpu")


def test_thread_stream_refuses_cuda():
    with pytest.raises(ValueError, match="CudaCopyStream"):
        ThreadCopyStream("cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_stream_without_cuda_is_an_error():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        CudaCopyStream("cuda")


@pytest.mark.cuda
def test_cuda_copies_equal_the_source():
    with make_copy_stream("cuda") as stream:
        assert isinstance(stream, CudaCopyStream)
        srcs = [torch.randn(256, 64).pin_memory() for _ in range(4)]
        handles = [stream.copy_to_device(src) for src in srcs]
        dst = torch.empty(256, 64, device="cuda")
        handles.append(stream.copy_to_device(srcs[0], dst))
        for src, handle in zip(srcs + srcs[:1], handles):
            # wait() orders the compute stream after the copy; the product runs on it.
            doubled = handle.wait() * 2
            assert torch.equal(doubled.cpu(), src * 2)
        assert handles[-1].tensor is dst


@pytest.mark.cuda
def test_cuda_wait_is_an_event_on_the_compute_stream():
    with CudaCopyStream("cuda") as stream:
        src = torch.arange(1 << 20, dtype=torch.int64).pin_memory()
        handle = stream.copy_to_device(src)
        assert handle.tensor.is_cuda
        handle.wait()
        # The compute stream now waits for the copy, so work queued on it sees the data.
        total = handle.tensor.sum()
        torch.cuda.current_stream().synchronize()
        assert handle.done()
        assert total.item() == src.sum().item()
        handle.synchronize()  # the source may now be reused


@pytest.mark.cuda
def test_cuda_unpinned_source_warns_once(caplog):
    with CudaCopyStream("cuda") as stream, caplog.at_level(logging.WARNING, "storage.streams"):
        for _ in range(3):
            stream.copy_to_device(torch.ones(16)).synchronize()
    # one warning from the stream's logger for three unpinned copies (counted, not read)
    assert sum(r.name == "storage.streams" and r.levelno == logging.WARNING for r in caplog.records) == 1


@pytest.mark.cuda
def test_cuda_in_place_ok_returns_a_device_source():
    with CudaCopyStream("cuda") as stream:
        src = torch.ones(4, device="cuda")
        assert stream.copy_to_device(src, in_place_ok=True).wait() is src


# -- the fake CUDA stream: each hazard it models is reported ---------------------------------------

from storage.streams import COMPLETE, CopyOrderError, FakeCudaCopyStream, copy_stream_factory  # noqa: E402


@pytest.fixture
def fake():
    with FakeCudaCopyStream(seed=1, max_delay_s=0.002, compute_lag_s=0.05) as s:
        yield s


def test_fake_poisons_the_destination_until_the_copy_ran(fake):
    dst = torch.zeros(64)
    handle = fake.copy(torch.ones(64), dst)
    assert torch.isnan(dst).all() or torch.equal(dst, torch.ones(64))  # poisoned at issue, or already copied
    assert torch.equal(handle.wait(), torch.ones(64))
    assert fake.violations == []


def test_fake_reports_a_source_changed_before_its_copy_ran():
    with FakeCudaCopyStream(seed=1, max_delay_s=0.05) as fake:
        src = torch.ones(16)
        handle = fake.copy(src, torch.empty(16))
        src.fill_(2.0)  # the buffer reused before the copy ran
        with pytest.raises(CopyOrderError, match="changed between issue and copy"):
            handle.wait()
        assert len(fake.violations) == 1


def test_fake_reports_a_copy_into_memory_queued_compute_still_reads(fake):
    slot = torch.empty(32)
    fake.copy(torch.ones(32), slot).wait()  # compute is handed the slot...
    fake.record_compute()  # ...and its reading is queued, finishing up to 50 ms later (seeded: not before the refill)
    bad = fake.copy(torch.full((32,), 2.0), slot)  # a refill that forgot to wait for the reader
    with pytest.raises(CopyOrderError, match="queued compute may still read it"):
        bad.wait()
    good = fake.copy(torch.full((32,), 3.0), torch.empty(32))
    assert torch.equal(good.wait(), torch.full((32,), 3.0))


def test_fake_refill_after_the_readers_event_is_clean(fake):
    slot = torch.empty(32)
    fake.copy(torch.ones(32), slot).wait()
    reader = fake.record_compute()
    assert torch.equal(fake.copy(torch.full((32,), 2.0), slot, after=reader).wait(), torch.full((32,), 2.0))
    assert fake.violations == [] and fake.host_syncs == 0


def test_fake_reorders_copies_and_counts_host_syncs_by_thread():
    with FakeCudaCopyStream(seed=4, max_delay_s=0.02, workers=2) as fake:
        order = []
        dsts = [hooked((4,), lambda i=i: order.append(i)) for i in range(12)]
        handles = [fake.copy(torch.full((4,), float(i)), dsts[i]) for i in range(12)]
        handles[0].synchronize()
        for i, h in enumerate(handles):
            assert torch.equal(h.wait(), torch.full((4,), float(i)))
    assert order != sorted(order)  # issue order is not promised
    assert fake.host_syncs == 1 and fake.syncs_by_thread[threading.current_thread().name] == 1


def test_copy_casts_when_asked_and_refuses_a_silent_dtype_change(stream):
    src = torch.arange(6, dtype=torch.bfloat16)
    assert torch.equal(stream.copy(src, torch.empty(6), cast=True).wait(), src.float())
    with pytest.raises(ValueError, match="does not match"):
        stream.copy(src, torch.empty(6))
    assert stream.record_compute() is COMPLETE  # host compute has already run


def test_copy_stream_factory_builds_and_collects_cpu_streams():
    with copy_stream_factory(lambda device: FakeCudaCopyStream(device)) as made:
        s = make_copy_stream("cpu")
        assert isinstance(s, FakeCudaCopyStream) and made == [s]
        s.close()
    with make_copy_stream("cpu") as plain:
        assert type(plain) is ThreadCopyStream


def test_fake_fresh_allocation_forgets_the_readers_of_freed_memory(fake):
    slot = torch.empty(32)
    fake.copy(torch.ones(32), slot).wait()  # handed to compute, no reader event yet
    span = (slot.data_ptr(), slot.data_ptr() + 32 * 4)
    del slot  # freed: the allocator may hand the same bytes out again
    fresh = fake.copy(torch.full((32,), 5.0))
    if (fresh.tensor.data_ptr(), fresh.tensor.data_ptr() + 128) == span:
        assert span not in fake._readers
    assert torch.equal(fresh.wait(), torch.full((32,), 5.0))
    assert fake.violations == []
