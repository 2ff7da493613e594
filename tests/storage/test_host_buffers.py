"""HostBufferPool: alignment, blocking, errors, reuse, accounting, and real preadv reads."""

import errno
import os
import threading

import pytest
import torch

from storage.host_buffers import (BufferStateError, HostBufferPool, HostPinner, HostBufferPoolConfig,
                                  OversizeRequestError, PoolExhaustedError, aligned_empty, round_up)

KiB = 1024
ALIGN = 4096


def make_pool(capacity_bytes: int, **kwargs) -> HostBufferPool:
    return HostBufferPool(HostBufferPoolConfig(capacity_bytes=capacity_bytes, pin=False, **kwargs))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": 100}, "capacity_bytes"),
        ({"capacity_bytes": 2**20, "alignment": 256}, "alignment"),
        ({"capacity_bytes": 2**20, "alignment": 3000}, "alignment"),
        ({"capacity_bytes": 2**20, "slab_bytes": 0}, "slab_bytes"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"{field}="):
        HostBufferPoolConfig(**kwargs)


def test_buffers_are_aligned_in_address_and_length():
    pool = make_pool(1024 * KiB)
    bufs = [pool.acquire(n) for n in (1, 100, 4096, 4097, 10_000, 3 * 4096 + 5)]
    for buf in bufs:
        assert buf.tensor.dtype == torch.uint8 and buf.tensor.dim() == 1
        assert buf.tensor.data_ptr() % ALIGN == 0
        assert buf.tensor.numel() % ALIGN == 0
        assert buf.tensor.numel() >= buf.nbytes
        assert buf.payload.numel() == buf.nbytes
        assert len(buf.memoryview()) == buf.tensor.numel()
    # Buffers never overlap, even when carved from one slab.
    spans = sorted((b.tensor.data_ptr(), b.tensor.data_ptr() + b.tensor.numel()) for b in bufs)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_in_use_and_peak_accounting():
    pool = make_pool(64 * KiB)
    a = pool.acquire(100)
    b = pool.acquire(5000)
    assert pool.in_use_bytes == 4096 + 8192
    a.release()
    assert pool.in_use_bytes == 8192
    assert pool.peak_in_use_bytes == 4096 + 8192
    b.release()
    assert pool.in_use_bytes == 0
    assert pool.peak_in_use_bytes == 4096 + 8192
    assert pool.capacity_bytes == 64 * KiB
    assert pool.allocated_bytes <= pool.capacity_bytes


def test_released_buffer_is_reused_for_the_same_size_class():
    pool = make_pool(2 * ALIGN, slab_bytes=ALIGN)
    a = pool.acquire(ALIGN)
    ptr = a.tensor.data_ptr()
    a.release()
    b = pool.acquire(ALIGN - 10)
    assert b.tensor.data_ptr() == ptr
    assert pool.allocated_bytes == ALIGN


def test_small_buffers_are_carved_from_one_slab():
    pool = make_pool(1024 * KiB, slab_bytes=64 * KiB)
    bufs = [pool.acquire(ALIGN) for _ in range(16)]
    assert pool.allocated_bytes == 64 * KiB
    bases = {b._slab.base.data_ptr() for b in bufs}
    assert len(bases) == 1


def test_free_buffers_of_another_size_class_are_dropped_to_make_room():
    pool = make_pool(4 * ALIGN, slab_bytes=ALIGN)
    small = [pool.acquire(ALIGN) for _ in range(4)]
    for buf in small:
        buf.release()
    assert pool.allocated_bytes == 4 * ALIGN
    big = pool.acquire(3 * ALIGN, timeout=0)
    assert big.tensor.numel() == 3 * ALIGN
    assert pool.allocated_bytes == 4 * ALIGN
    assert pool.in_use_bytes == 3 * ALIGN


def test_acquire_blocks_until_another_thread_releases():
    pool = make_pool(2 * ALIGN)
    held = [pool.acquire(ALIGN), pool.acquire(ALIGN)]
    waiting = threading.Event()
    got: list = []

    def acquirer():
        waiting.set()
        got.append(pool.acquire(ALIGN, timeout=30))

    thread = threading.Thread(target=acquirer)
    thread.start()
    waiting.wait()
    assert not got  # cannot have succeeded: both buffers are held
    held[0].release()
    thread.join(timeout=30)
    assert len(got) == 1
    assert got[0].tensor.data_ptr() == held[0].tensor.data_ptr()


def test_waiter_for_another_size_class_gets_the_room_once_enough_is_released():
    pool = make_pool(2 * ALIGN, slab_bytes=ALIGN)
    small = [pool.acquire(ALIGN), pool.acquire(ALIGN)]
    got: list = []
    thread = threading.Thread(target=lambda: got.append(pool.acquire(2 * ALIGN, timeout=30)))
    thread.start()
    small[0].release()
    # One free small buffer is not enough room: the waiter must not take it.
    with pytest.raises(PoolExhaustedError):
        pool.acquire(2 * ALIGN, timeout=0)
    small[1].release()
    thread.join(timeout=30)
    assert len(got) == 1 and got[0].tensor.numel() == 2 * ALIGN
    assert pool.allocated_bytes == 2 * ALIGN


def test_exhausted_pool_times_out_with_a_specific_error():
    pool = make_pool(2 * ALIGN)
    pool.acquire(2 * ALIGN)
    with pytest.raises(PoolExhaustedError, match=r"4096 bytes.*capacity 8192"):
        pool.acquire(ALIGN, timeout=0.01)
    with pytest.raises(TimeoutError):
        pool.acquire(ALIGN, timeout=0)


def test_request_larger_than_capacity_fails_immediately():
    pool = make_pool(2 * ALIGN)
    with pytest.raises(OversizeRequestError, match=r"8193 bytes .*capacity of 8192"):
        pool.acquire(2 * ALIGN + 1)  # would block forever without the check
    with pytest.raises(ValueError, match="nbytes=0"):
        pool.acquire(0)


def test_double_release_is_an_error():
    pool = make_pool(2 * ALIGN)
    buf = pool.acquire(10)
    buf.release()
    with pytest.raises(BufferStateError, match="already released"):
        pool.release(buf)
    assert pool.in_use_bytes == 0


def test_release_to_another_pool_is_an_error():
    buf = make_pool(ALIGN).acquire(10)
    with pytest.raises(BufferStateError, match="another pool"):
        make_pool(ALIGN).release(buf)


def test_buffer_context_manager_releases():
    pool = make_pool(ALIGN)
    with pool.acquire(10) as buf:
        assert pool.in_use_bytes == ALIGN
    assert buf.released and pool.in_use_bytes == 0


def test_pin_true_without_cuda_is_rejected():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available, so pinning works here")
    with pytest.raises(ValueError, match="pin=True"):
        HostBufferPool(HostBufferPoolConfig(capacity_bytes=ALIGN, pin=True))


@pytest.mark.cuda
def test_buffers_are_pinned_by_default_with_cuda():
    pool = HostBufferPool(HostBufferPoolConfig(capacity_bytes=1024 * KiB))
    buf = pool.acquire(10_000)
    assert buf.tensor.is_pinned()
    assert buf.tensor.data_ptr() % ALIGN == 0


def write_file(path, nbytes: int) -> bytes:
    gen = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    path.write_bytes(data)
    return data


def test_preadv_reads_the_right_bytes(tmp_path):
    path = tmp_path / "chunk.bin"
    data = write_file(path, 3 * ALIGN + 123)
    pool = make_pool(1024 * KiB)
    with pool.acquire(len(data)) as buf:
        fd = os.open(path, os.O_RDONLY)
        try:
            n = os.preadv(fd, [buf.memoryview()], 0)
        finally:
            os.close(fd)
        assert n == len(data)
        assert buf.payload.numpy().tobytes() == data


def test_preadv_with_o_direct(tmp_path):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("os.O_DIRECT does not exist on this platform")
    path = tmp_path / "chunk.bin"
    data = write_file(path, 5 * ALIGN + 7)  # a short last block, as real chunk files have
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip(f"the filesystem of {tmp_path} does not support O_DIRECT (e.g. tmpfs)")
        raise
    pool = make_pool(1024 * KiB)
    try:
        with pool.acquire(len(data)) as buf:
            n = os.preadv(fd, [buf.memoryview()], 0)
            assert n == len(data)
            assert buf.payload.numpy().tobytes() == data
    finally:
        os.close(fd)


class RecordingPinner(HostPinner):
    """The pool's pinning bookkeeping with the CUDA calls replaced by a record of what they got."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []

    def _register(self, ptr: int, nbytes: int) -> None:
        self.calls.append(("register", ptr, nbytes))

    def _unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr, 0))


def test_a_pinned_pool_pins_exactly_its_slabs_and_unpins_them_when_dropped():
    """A 17 MB chunk once pinned 32 MiB through torch's power-of-two pinned allocator: the pool now
    pins the slab's own bytes, page-aligned, and gives them back with the slab."""
    pinner = RecordingPinner()
    chunk = 17 * 10**6
    pool = HostBufferPool(HostBufferPoolConfig(capacity_bytes=4 * chunk + 2**20, pin=True, slab_bytes=chunk),
                          pinner=pinner)
    bufs = [pool.acquire(chunk) for _ in range(3)]
    assert pool.pinned_bytes == pool.allocated_bytes == 3 * round_up(chunk, 4096)
    for kind, ptr, nbytes in pinner.calls:
        assert kind == "register" and ptr % 4096 == 0 and nbytes == round_up(chunk, 4096)
    assert {b.tensor.data_ptr() for b in bufs} == {ptr for _, ptr, _ in pinner.calls}
    # torch's is_pinned() asks CUDA about the first byte of a tensor's storage: it must lie in the
    # registered range, not in the unaligned allocation the slab was carved from
    assert {b.tensor.untyped_storage().data_ptr() for b in bufs} == {ptr for _, ptr, _ in pinner.calls}
    for b in bufs:
        b.release()
    pool.close()
    assert pool.pinned_bytes == 0
    assert sorted(p for k, p, _ in pinner.calls if k == "unregister") == sorted(b.tensor.data_ptr() for b in bufs)


def test_a_pool_dropped_unclosed_unregisters_its_slabs():
    """Freed memory that is still registered poisons its addresses for the next registration: a pool
    nobody closed unregisters each slab when the slab's memory goes."""
    import gc

    pinner = RecordingPinner()
    pool = HostBufferPool(HostBufferPoolConfig(capacity_bytes=1 << 22, pin=True, slab_bytes=1 << 20), pinner=pinner)
    buf = pool.acquire(300_000)
    ptr = buf.tensor.data_ptr()
    buf.release()
    del buf, pool
    gc.collect()
    assert [kind for kind, p, _ in pinner.calls if p == ptr] == ["register", "unregister"]
    assert pinner.pinned_bytes == 0


def test_an_aligned_view_keeps_its_allocation_alive():
    _, view = aligned_empty(1 << 24, alignment=4096, pin=False)
    view.fill_(7)
    others = [torch.full((1 << 24,), 3, dtype=torch.uint8) for _ in range(4)]  # would reuse freed memory
    assert view.data_ptr() % 4096 == 0 and bool((view == 7).all()) and len(others) == 4


@pytest.mark.cuda
def test_cuda_pinned_pool_buffers_are_page_locked_and_counted():
    pool = HostBufferPool(HostBufferPoolConfig(capacity_bytes=64 * 2**20, pin=True, slab_bytes=2**20))
    buf = pool.acquire(3 * 10**6)
    assert buf.tensor.is_pinned()
    assert pool.pinned_bytes == pool.allocated_bytes
    buf.release()
    pool.close()
    assert pool.pinned_bytes == 0


def test_shrink_drops_free_slabs_now_and_the_others_as_their_buffers_come_back():
    pool = make_pool(4 * ALIGN, slab_bytes=ALIGN)
    bufs = [pool.acquire(ALIGN) for _ in range(4)]
    bufs[0].release()
    pool.shrink(2 * ALIGN)
    assert pool.capacity_bytes == 2 * ALIGN
    assert pool.allocated_bytes == 3 * ALIGN  # the free slab went; three are still in use
    bufs[1].release()
    assert pool.allocated_bytes == 2 * ALIGN  # returned while over the budget: dropped
    bufs[2].release()
    assert pool.allocated_bytes == 2 * ALIGN  # within the budget: kept for reuse
    assert pool.acquire(ALIGN, timeout=0) is not None
    with pytest.raises(ValueError, match="capacity_bytes"):
        pool.shrink(8 * ALIGN)
