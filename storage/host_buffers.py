"""Reusable, aligned (and on GPU hosts pinned) host buffers for the hot read path.

Chunk files are read with ``os.preadv`` straight into these buffers, possibly through
``O_DIRECT``, which needs both the address and the length of every buffer aligned to the block
size. Pinned buffers let the host-to-device copy that follows run asynchronously.

Memory is carved from slabs: one large uint8 tensor holds several buffers of one size class
(the requested size rounded up to the alignment), so a pool of many small buffers costs few
pinned allocations. Capacity is accounted per slab, and a slab is given back only when all of its
buffers are free, so a slab is kept small relative to the capacity.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from storage.errors import StorageError

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
logger = logging.getLogger(__name__)

_MIN_ALIGNMENT = 512
_MAX_SLAB_FRACTION = 16


class PoolError(StorageError, RuntimeError):
    """Base class for errors raised by :class:`HostBufferPool`."""


class PoolExhaustedError(PoolError, TimeoutError):
    """No buffer of the requested size became available within the timeout."""


class OversizeRequestError(PoolError, ValueError):
    """The request is larger than the whole pool, so waiting could never satisfy it."""


class BufferStateError(PoolError):
    """A buffer was released twice, or released to a pool that does not own it."""


@dataclass(kw_only=True)
class HostBufferPoolConfig:
    """Configuration of a :class:`HostBufferPool`.

    ``pin=None`` pins when CUDA is available. ``slab_bytes`` is the largest slab allocated at a
    time (and at most 1/16 of the capacity): buffers smaller than it are carved in groups.
    """

    capacity_bytes: int
    pin: bool | None = None
    alignment: int = 4096
    slab_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        if not isinstance(self.alignment, int) or self.alignment < _MIN_ALIGNMENT or (
            self.alignment & (self.alignment - 1)
        ):
            raise ValueError(
                f"HostBufferPoolConfig.alignment={self.alignment!r}: "
                f"must be a power of two >= {_MIN_ALIGNMENT}"
            )
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes < self.alignment:
            raise ValueError(
                f"HostBufferPoolConfig.capacity_bytes={self.capacity_bytes!r}: must be an int "
                f">= alignment ({self.alignment})"
            )
        if not isinstance(self.slab_bytes, int) or self.slab_bytes <= 0:
            raise ValueError(
                f"HostBufferPoolConfig.slab_bytes={self.slab_bytes!r}: must be a positive int"
            )
        if self.pin is not None and not isinstance(self.pin, bool):
            raise ValueError(f"HostBufferPoolConfig.pin={self.pin!r}: must be True, False or None")


def round_up(nbytes: int, alignment: int) -> int:
    """Round ``nbytes`` up to a multiple of ``alignment`` (a power of two)."""
    return (nbytes + alignment - 1) & ~(alignment - 1)


def aligned_empty(nbytes: int, *, alignment: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate ``nbytes`` of uint8 whose address is a multiple of ``alignment``.

    Returns ``(base, view)``; ``view`` keeps ``base`` alive.
    ``view`` has a storage of its own that starts at the aligned address: torch's ``is_pinned()``
    (and with it a non-blocking copy's view of the memory) asks CUDA about a tensor's storage's
    first byte, which for a plain slice of ``base`` lies before a range page-locked in place.
    """
    base = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
    offset = (-base.data_ptr()) % alignment
    if nbytes == 0:
        return base, base[offset:offset]
    window = (ctypes.c_uint8 * nbytes).from_address(base.data_ptr() + offset)
    window.base = base  # the view holds the window, the window the allocation
    return base, torch.frombuffer(window, dtype=torch.uint8)


class HostPinner:
    """Page-locks host memory in place, exactly the bytes asked for.

    torch's pinned allocator rounds every allocation up to a power of two and keeps freed blocks
    cached, so a pool of pinned slabs would pin up to twice its budget, unaccounted. Registering
    pageable memory with ``cudaHostRegister`` pins what the pool counts and no more. This class
    keeps the account; the CUDA calls are in `_register` / `_unregister`, which a test replaces.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pinned: dict[int, int] = {}  # address -> bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked by this pinner right now."""
        with self._lock:
            return sum(self._pinned.values())

    def pin(self, t: torch.Tensor) -> None:
        """Page-lock ``t``'s bytes (contiguous, page-aligned) until `unpin` or until ``t`` is freed."""
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        self._register(ptr, nbytes)
        with self._lock:
            self._pinned[ptr] = nbytes
        # memory freed while registered stays registered with the driver, and the next allocation
        # placed there cannot be (cudaErrorHostMemoryAlreadyRegistered): a pool dropped unclosed
        # unregisters its slabs as they go
        weakref.finalize(t, self._unpin_address, ptr)

    def unpin(self, t: torch.Tensor) -> None:
        """Undo `pin`."""
        self._unpin_address(t.data_ptr())

    def _unpin_address(self, ptr: int) -> None:
        with self._lock:
            if self._pinned.pop(ptr, None) is None:
                return
        self._unregister(ptr)

    def _register(self, ptr: int, nbytes: int) -> None:
        # portable: pinned for every CUDA context, not only the current device's (a rank may
        # register before it picks its GPU, and peers copy from it on theirs)
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            raise PoolError(f"cudaHostRegister of {nbytes} bytes failed: CUDA error {int(err)} "
                            "(is the locked-memory limit, ulimit -l, too low?)")

    def _unregister(self, ptr: int) -> None:
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
        if int(err) != 0:
            logger.warning("cudaHostUnregister failed: CUDA error %d", int(err))


@dataclass(eq=False)
class _Slab:
    """One allocation holding ``len(buffers)`` buffers of ``size`` bytes each."""

    size: int
    base: torch.Tensor
    flat: torch.Tensor  # the aligned bytes the buffers are carved from (what is pinned)
    buffers: list[torch.Tensor]
    free: list[int]

    @property
    def nbytes(self) -> int:
        return self.size * len(self.buffers)

    @property
    def fully_free(self) -> bool:
        return len(self.free) == len(self.buffers)


@dataclass(eq=False)
class HostBuffer:
    """One acquired buffer: ``tensor`` is the aligned uint8 view (length rounded up to the
    alignment), ``nbytes`` the size that was requested. Release it exactly once."""

    tensor: torch.Tensor
    nbytes: int
    _pool: HostBufferPool = field(repr=False)
    _slab: _Slab = field(repr=False)
    _index: int = field(repr=False)
    released: bool = False

    @property
    def payload(self) -> torch.Tensor:
        """The first ``nbytes`` bytes: the data the caller asked room for."""
        return self.tensor[: self.nbytes]

    def memoryview(self) -> memoryview:
        """A writable memoryview over the whole aligned buffer, for ``os.preadv``."""
        return memoryview(self.tensor.numpy())

    def release(self) -> None:
        """Return the buffer to its pool."""
        self._pool.release(self)

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class HostBufferPool:
    """A thread-safe pool of aligned host buffers bounded by ``capacity_bytes``.

    ``acquire`` prefers a free buffer of the same size class, then carves a new one from
    unallocated capacity, then drops wholly free slabs of other size classes to make room, and
    otherwise blocks until another thread releases a buffer.
    """

    def __init__(self, config: HostBufferPoolConfig, *, pinner: HostPinner | None = None) -> None:
        self.config = config
        self.pin = torch.cuda.is_available() if config.pin is None else config.pin
        if self.pin and pinner is None and not torch.cuda.is_available():
            raise ValueError("HostBufferPoolConfig.pin=True: pinned memory needs CUDA, none found")
        self.pinner = (pinner or HostPinner()) if self.pin else None
        self._cond = threading.Condition()
        self._slabs: dict[int, list[_Slab]] = {}
        # Bytes of slabs that exist or are being allocated right now (reserved outside the lock).
        self._allocated_bytes = 0
        self._in_use_bytes = 0
        self._peak_in_use_bytes = 0
        self._closed = False

    @property
    def capacity_bytes(self) -> int:
        """Upper bound on the bytes of all slabs together."""
        return self.config.capacity_bytes

    @property
    def in_use_bytes(self) -> int:
        """Aligned bytes of the buffers currently acquired."""
        with self._cond:
            return self._in_use_bytes

    @property
    def peak_in_use_bytes(self) -> int:
        """Highest ``in_use_bytes`` observed since the pool was created."""
        with self._cond:
            return self._peak_in_use_bytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes held in slabs (acquired or free), at most ``capacity_bytes``."""
        with self._cond:
            return self._allocated_bytes

    def acquire(self, nbytes: int, timeout: float | None = None) -> HostBuffer:
        """Take a buffer of at least ``nbytes``, waiting up to ``timeout`` seconds (``None``:
        forever) while the pool is exhausted."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"HostBufferPool.acquire: nbytes={nbytes!r} must be a positive int")
        size = round_up(nbytes, self.config.alignment)
        if size > self.capacity_bytes:
            raise OversizeRequestError(
                f"HostBufferPool.acquire: request of {nbytes} bytes ({size} aligned) exceeds "
                f"the pool capacity of {self.capacity_bytes} bytes"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise PoolError("HostBufferPool.acquire: the pool is closed")
                buf = self._take_free(size, nbytes)
                if buf is not None:
                    return buf
                if self._make_room(size):
                    count = self._slab_count(size)
                    self._allocated_bytes += count * size
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PoolExhaustedError(
                        f"HostBufferPool.acquire: no buffer for {nbytes} bytes ({size} aligned) "
                        f"within {timeout} s; capacity {self.capacity_bytes} bytes, "
                        f"{self._in_use_bytes} in use"
                    )
                self._cond.wait(remaining)
        # Allocating (and pinning) can take long; the capacity is already reserved, so other
        # threads keep acquiring and releasing meanwhile.
        try:
            slab = self._new_slab(size, count)
        except BaseException:
            with self._cond:
                self._allocated_bytes -= count * size
                self._cond.notify_all()
            raise
        with self._cond:
            self._slabs.setdefault(size, []).append(slab)
            buf = self._take_free(size, nbytes)
            if count > 1:
                self._cond.notify_all()
        if buf is None:  # unreachable: the new slab has free slots and only this thread saw it
            raise PoolError("HostBufferPool.acquire: internal error, new slab has no free buffer")
        return buf

    def release(self, buf: HostBuffer) -> None:
        """Give ``buf`` back; releasing it twice raises :class:`BufferStateError`."""
        if buf._pool is not self:
            raise BufferStateError("HostBufferPool.release: the buffer belongs to another pool")
        with self._cond:
            if buf.released:
                raise BufferStateError(
                    f"HostBufferPool.release: buffer of {buf.nbytes} bytes was already released"
                )
            buf.released = True
            buf._slab.free.append(buf._index)
            self._in_use_bytes -= buf._slab.size
            if self._closed:
                self._drop_free_slabs(need=None)
            elif self._allocated_bytes > self.capacity_bytes:  # shrunk: give the memory back
                self._drop_free_slabs(need=self._allocated_bytes - self.capacity_bytes)
            self._cond.notify_all()

    def shrink(self, capacity_bytes: int) -> None:
        """Lower the capacity to ``capacity_bytes``: wholly free slabs are dropped now until the
        slabs fit it, and the others as their buffers come back (``release_free_heap`` then
        returns the memory to the system)."""
        with self._cond:
            if not 0 < capacity_bytes <= self.capacity_bytes:
                raise ValueError(f"HostBufferPool.shrink: capacity_bytes={capacity_bytes} must be in "
                                 f"(0, {self.capacity_bytes}]")
            self.config = dataclasses.replace(self.config, capacity_bytes=capacity_bytes)
            if self._allocated_bytes > capacity_bytes:
                self._drop_free_slabs(need=self._allocated_bytes - capacity_bytes)

    def grow(self, capacity_bytes: int) -> None:
        """Raise the capacity to ``capacity_bytes``: acquires waiting for room go on."""
        with self._cond:
            if capacity_bytes < self.capacity_bytes:
                raise ValueError(f"HostBufferPool.grow: capacity_bytes={capacity_bytes} is below the capacity "
                                 f"{self.capacity_bytes}")
            self.config = dataclasses.replace(self.config, capacity_bytes=capacity_bytes)
            self._cond.notify_all()

    def close(self) -> None:
        """Drop all free slabs and refuse further acquires; acquired buffers stay valid."""
        with self._cond:
            self._closed = True
            self._drop_free_slabs(need=None)
            self._cond.notify_all()

    def __enter__(self) -> HostBufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Bookkeeping below runs with self._cond held.

    def _take_free(self, size: int, nbytes: int) -> HostBuffer | None:
        candidates = [slab for slab in self._slabs.get(size, ()) if slab.free]
        if not candidates:
            return None
        # The fullest slab first, so the others have a chance to become wholly free and
        # droppable for another size class.
        slab = min(candidates, key=lambda s: len(s.free))
        index = slab.free.pop()
        self._in_use_bytes += size
        self._peak_in_use_bytes = max(self._peak_in_use_bytes, self._in_use_bytes)
        return HostBuffer(
            tensor=slab.buffers[index], nbytes=nbytes, _pool=self, _slab=slab, _index=index
        )

    def _make_room(self, size: int) -> bool:
        """True when ``size`` bytes of unallocated capacity exist, dropping wholly free slabs of
        other size classes if that is what it takes; drops nothing when it would not suffice."""
        unallocated = self.capacity_bytes - self._allocated_bytes
        if unallocated >= size:
            return True
        droppable = sum(s.nbytes for slabs in self._slabs.values() for s in slabs if s.fully_free)
        if unallocated + droppable < size:
            return False
        self._drop_free_slabs(need=size - unallocated)
        return True

    def _drop_free_slabs(self, need: int | None) -> None:
        """Drop wholly free slabs, oldest size class first, until ``need`` bytes are freed
        (``None``: all of them)."""
        freed = 0
        for size in list(self._slabs):
            kept = []
            for slab in self._slabs[size]:
                if slab.fully_free and (need is None or freed < need):
                    freed += slab.nbytes
                    self._allocated_bytes -= slab.nbytes
                    if self.pinner is not None:
                        self.pinner.unpin(slab.flat)
                else:
                    kept.append(slab)
            if kept:
                self._slabs[size] = kept
            else:
                del self._slabs[size]
        if freed:
            logger.debug("HostBufferPool: dropped %d bytes of free slabs", freed)

    def _slab_count(self, size: int) -> int:
        """Buffers to carve in one slab: several when they are small, never past capacity.

        A slab is at most 1/16 of the capacity: a slab with one buffer in use cannot be
        dropped, so large slabs would strand capacity that other size classes wait for.
        """
        unallocated = self.capacity_bytes - self._allocated_bytes
        slab_bytes = min(self.config.slab_bytes, self.capacity_bytes // _MAX_SLAB_FRACTION)
        return max(1, min(slab_bytes // size, unallocated // size))

    def _new_slab(self, size: int, count: int) -> _Slab:
        # pageable and aligned, then page-locked in place: exactly the slab's bytes are pinned
        base, flat = aligned_empty(size * count, alignment=max(self.config.alignment, 4096), pin=False)
        if self.pinner is not None:
            self.pinner.pin(flat)
        buffers = [flat[i * size : (i + 1) * size] for i in range(count)]
        logger.debug("HostBufferPool: new slab of %d x %d bytes (pinned=%s)", count, size, self.pin)
        return _Slab(size=size, base=base, flat=flat, buffers=buffers, free=list(range(count)))

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory this pool has page-locked (its slabs', nothing rounded up)."""
        return self.pinner.pinned_bytes if self.pinner is not None else 0
