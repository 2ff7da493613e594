"""Memory owned by peer ranks that this rank writes its swapped activations into (D2D swapping).

Every rank owns one segment of `capacity_bytes` and lends it out. The segment is split into
`world` fixed, disjoint slices, one per writer: rank w only ever writes and reads slice w of each
peer's segment. So no allocation protocol crosses processes: each writer runs a plain first-fit
allocator over its own slices, and no owner ever touches the data lent out. The owner's own slice
of its own segment stays unused (swapping to oneself saves nothing).

Two implementations: `SharedMemoryPeers` (CPU ranks on one host: segments are shared-memory files)
and `CudaIpcPeers` (GPU ranks on one node: segments are device buffers opened through CUDA IPC);
`peer_memory_class` picks one for a device. `InProcessPeers` plays every rank of a group inside one
process, for tests.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import tempfile
from abc import ABC, abstractmethod
from bisect import insort
from dataclasses import dataclass
from typing import Callable, Self

import torch
import torch.distributed as dist

from mpress.topology import PciAddress, cuda_pci_address, format_pci

ALIGNMENT = 64  # bytes; every allocation starts on a multiple of this


class PeerMemoryError(RuntimeError):
    """Base class for errors raised by peer memory."""


class PeerMemoryFullError(PeerMemoryError):
    """A writer's slice of a peer's segment has no gap large enough for a request."""


def _round_up(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


@dataclass(frozen=True)
class _Block:
    offset: int
    nbytes: int  # aligned size taken from the slice


class SliceAllocator:
    """First-fit allocation of aligned blocks within one slice of `capacity_bytes` (bookkeeping
    only: it hands out offsets and never touches memory)."""

    def __init__(self, capacity_bytes: int, *, alignment: int = ALIGNMENT) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"SliceAllocator: capacity_bytes={capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.alignment = alignment
        self._blocks: list[_Block] = []  # sorted by offset

    @property
    def used_bytes(self) -> int:
        """Aligned bytes currently allocated."""
        return sum(b.nbytes for b in self._blocks)

    def largest_gap(self) -> int:
        """The largest request (in aligned bytes) that `alloc` could satisfy now."""
        return max((stop - start for start, stop in self._gaps()), default=0)

    def alloc(self, nbytes: int) -> int:
        """The offset of a free block of at least `nbytes`; raises PeerMemoryFullError."""
        if nbytes <= 0:
            raise ValueError(f"SliceAllocator.alloc: nbytes={nbytes} must be positive")
        size = _round_up(nbytes, self.alignment)
        for start, stop in self._gaps():
            if stop - start >= size:
                insort(self._blocks, _Block(start, size), key=lambda b: b.offset)
                return start
        raise PeerMemoryFullError(
            f"no gap of {size} bytes in a slice of {self.capacity_bytes} bytes "
            f"({self.used_bytes} used, largest gap {self.largest_gap()})")

    def free(self, offset: int) -> None:
        """Give back the block that `alloc` returned at `offset`."""
        for i, block in enumerate(self._blocks):
            if block.offset == offset:
                del self._blocks[i]
                return
        raise ValueError(f"SliceAllocator.free: no block allocated at offset {offset}")

    def _gaps(self):
        cursor = 0
        for block in self._blocks:
            if block.offset > cursor:
                yield cursor, block.offset
            cursor = block.offset + block.nbytes
        # the slice's end is rounded down so that no aligned block runs past it
        end = self.capacity_bytes - self.capacity_bytes % self.alignment
        if end > cursor:
            yield cursor, end


class PeerMemory(ABC):
    """Slices of peers' segments this rank may write: allocate, write, read back, free.

    Offsets are relative to this rank's slice of the peer's segment. On CUDA, `put` and `get`
    are ordered on the current stream; on CPU they are plain memory copies.
    """

    def __init__(self, rank: int, world: int, capacity_bytes: int) -> None:
        if world < 2:
            raise ValueError(f"{type(self).__name__}: world={world} must be >= 2 to have a peer")
        if not 0 <= rank < world:
            raise ValueError(f"{type(self).__name__}: rank={rank} must be in 0..{world - 1}")
        slice_bytes = capacity_bytes // world // ALIGNMENT * ALIGNMENT
        if slice_bytes <= 0:
            raise ValueError(
                f"{type(self).__name__}: capacity_bytes={capacity_bytes} is too small to give "
                f"each of {world} writers an aligned slice of {ALIGNMENT} bytes")
        self.rank = rank
        self.world = world
        self.capacity_bytes = capacity_bytes
        self.slice_bytes = slice_bytes
        self._allocators = {p: SliceAllocator(slice_bytes) for p in range(world) if p != rank}

    def slice_range(self, writer: int) -> tuple[int, int]:
        """`(start, stop)` byte offsets of `writer`'s slice within any segment."""
        return writer * self.slice_bytes, (writer + 1) * self.slice_bytes

    def used_bytes(self, peer: int) -> int:
        """Aligned bytes this rank holds in `peer`'s segment."""
        return self._allocator(peer).used_bytes

    def alloc(self, peer: int, nbytes: int) -> int:
        """Reserve `nbytes` in this rank's slice of `peer`'s segment; returns the offset."""
        try:
            return self._allocator(peer).alloc(nbytes)
        except PeerMemoryFullError as exc:
            raise PeerMemoryFullError(
                f"rank {self.rank}'s slice of peer {peer}'s segment is full: {exc}; raise "
                f"capacity_bytes (now {self.capacity_bytes} for world {self.world})") from None

    def free(self, peer: int, offset: int) -> None:
        """Give back a block that `alloc` returned."""
        self._allocator(peer).free(offset)

    def view(self, peer: int, offset: int, nbytes: int) -> torch.Tensor:
        """A writable uint8 view of `nbytes` at `offset` of this rank's slice of `peer`'s
        segment, on the device the segment lives on."""
        self._allocator(peer)
        if offset < 0 or nbytes < 0 or offset + nbytes > self.slice_bytes:
            raise ValueError(
                f"{type(self).__name__}: bytes [{offset}, {offset + nbytes}) are outside the "
                f"slice of {self.slice_bytes} bytes")
        start = self.rank * self.slice_bytes + offset
        return self.segment(peer)[start:start + nbytes]

    def put(self, peer: int, offset: int, data: torch.Tensor) -> None:
        """Write the bytes of `data` (a uint8 tensor) at `offset` of `peer`'s slice."""
        if data.dtype != torch.uint8:
            raise TypeError(f"{type(self).__name__}.put: data must be uint8, got {data.dtype}")
        self.view(peer, offset, data.numel()).copy_(data.reshape(-1))

    def get(self, peer: int, offset: int, nbytes: int) -> torch.Tensor:
        """A copy, on this rank's device, of `nbytes` at `offset` of `peer`'s slice."""
        return self.view(peer, offset, nbytes).to(self.device, copy=True)

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device this rank computes on (where `get` returns data)."""

    @property
    def device_bytes(self) -> int:
        """Memory this peer memory takes on `device`, outside any budget of saved activations
        (0 where segments live in host memory)."""
        return 0

    @abstractmethod
    def segment(self, owner: int) -> torch.Tensor:
        """The whole uint8 segment owned by rank `owner`, as mapped in this process."""

    @abstractmethod
    def close(self) -> None:
        """Unmap every segment and free the one this rank owns."""

    def _allocator(self, peer: int) -> SliceAllocator:
        if peer == self.rank:
            raise ValueError(f"{type(self).__name__}: rank {self.rank} cannot use itself as a peer")
        if not 0 <= peer < self.world:
            raise ValueError(f"{type(self).__name__}: peer={peer} must be in 0..{self.world - 1}")
        return self._allocators[peer]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessPeers(PeerMemory):
    """Every rank of a group in one process, segments in plain host memory (for tests)."""

    def __init__(self, rank: int, world: int, capacity_bytes: int,
                 segments: list[torch.Tensor]) -> None:
        super().__init__(rank, world, capacity_bytes)
        self._segments = segments

    @classmethod
    def group(cls, world: int, capacity_bytes: int) -> list[InProcessPeers]:
        """One instance per rank, sharing the same `world` segments."""
        segments = [torch.zeros(capacity_bytes, dtype=torch.uint8) for _ in range(world)]
        return [cls(rank, world, capacity_bytes, segments) for rank in range(world)]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def segment(self, owner: int) -> torch.Tensor:
        return self._segments[owner]

    def close(self) -> None:
        pass


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def segment_path(name: str, rank: int, directory: str | None = None) -> str:
    """Where rank `rank`'s segment of the group `name` lives while ranks attach to it."""
    return os.path.join(directory or _shm_dir(), f"mpress-{name}-{rank}")


def shm_free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still write into the filesystem holding `directory`."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class SharedMemorySpaceError(PeerMemoryError):
    """The shared-memory filesystem cannot hold every rank's segment: touching one would SIGBUS."""

    def __init__(self, directory: str, free_bytes: int, need_bytes: int) -> None:
        self.directory, self.free_bytes, self.need_bytes = directory, free_bytes, need_bytes
        super().__init__(self.line("lower the peer memory (capacity_bytes)"))

    def line(self, remedy: str) -> str:
        """The one-line explanation, ending in `remedy` (what the caller's user can lower)."""
        return (f"{self.directory} has {self.free_bytes} bytes free, D2D swap needs {self.need_bytes}; "
                f"enlarge it (docker --shm-size) or {remedy}")


class SharedMemoryPeers(PeerMemory):
    """CPU ranks on one host: each rank's segment is a shared-memory file every rank maps.

    Collective: every rank of the (default or given) torch.distributed group constructs it with
    the same `name` and `capacity_bytes`. The ranks first agree that the filesystem has room for
    all `world` segments (the files are sparse, and a page that cannot be backed when it is first
    written kills the process with SIGBUS); raises SharedMemorySpaceError on every rank otherwise.
    The owner creates its file, all ranks map all files between two barriers, then each owner
    unlinks its file at once: the mappings stay valid and nothing is left in /dev/shm even if a
    rank dies later. `close` unmaps.
    """

    def __init__(self, rank: int, world: int, capacity_bytes: int, name: str, *,
                 group: dist.ProcessGroup | None = None, directory: str | None = None) -> None:
        super().__init__(rank, world, capacity_bytes)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"SharedMemoryPeers: name={name!r} may hold only letters, digits, '_', '.', '-'")
        if not dist.is_initialized():
            raise PeerMemoryError("SharedMemoryPeers needs an initialized torch.distributed process group")
        if dist.get_world_size(group) != world or dist.get_rank(group) != rank:
            raise ValueError(
                f"SharedMemoryPeers: rank={rank}, world={world} differ from the process group's "
                f"rank {dist.get_rank(group)} of {dist.get_world_size(group)}")
        self.name = name
        self._paths = [segment_path(name, r, directory) for r in range(world)]
        self._segments: list[torch.Tensor] = []
        self._check_room(os.path.dirname(self._paths[rank]), group)
        self._create(self._paths[rank])
        try:
            dist.barrier(group)  # every owner has created its file
            self._segments = [torch.from_file(path, shared=True, size=capacity_bytes, dtype=torch.uint8)
                              for path in self._paths]
            dist.barrier(group)  # every rank has mapped every file
        finally:
            self._unlink()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def segment(self, owner: int) -> torch.Tensor:
        if not self._segments:
            raise PeerMemoryError(f"SharedMemoryPeers {self.name!r} is closed")
        return self._segments[owner]

    def close(self) -> None:
        self._unlink()
        self._segments = []

    def _check_room(self, directory: str, group: dist.ProcessGroup | None) -> None:
        # Every rank decides on the least free space any rank saw, so that all raise or none does.
        seen: list = [None] * self.world
        dist.all_gather_object(seen, shm_free_bytes(directory), group=group)
        need = self.world * self.capacity_bytes
        if min(seen) < need:
            raise SharedMemorySpaceError(directory, min(seen), need)

    def _create(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise PeerMemoryError(
                f"SharedMemoryPeers: segment {path} already exists: another group uses the name "
                f"{self.name!r}, or a crashed run left it behind") from None
        try:
            os.ftruncate(fd, self.capacity_bytes)
        finally:
            os.close(fd)

    def _unlink(self) -> None:
        try:
            os.unlink(self._paths[self.rank])
        except FileNotFoundError:
            pass


# -- CUDA IPC -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IpcSegment:
    """What a rank publishes about its segment: its host, its GPU's PCI address (the one name
    of a GPU all processes share, whatever their CUDA_VISIBLE_DEVICES), and how to open it."""

    host: str
    pci: PciAddress
    rebuild: Callable[..., torch.Tensor]
    args: tuple


def open_ordinals(segments: list[IpcSegment], rank: int, visible: list[PciAddress]) -> list[int | None]:
    """The CUDA ordinal, in this process's numbering (`visible[i]` is ordinal i's PCI address),
    that each rank's segment is opened on; None for `rank`'s own. CUDA IPC opens a peer's memory
    on the peer's GPU, so that GPU must be visible here."""
    hosts = sorted({s.host for s in segments})
    if len(hosts) > 1:
        raise NotImplementedError(f"CudaIpcPeers: CUDA IPC maps memory within one node; ranks span {hosts}")
    ordinals: list[int | None] = []
    for r, seg in enumerate(segments):
        if r == rank:
            ordinals.append(None)
        elif seg.pci in visible:
            ordinals.append(visible.index(seg.pci))
        else:
            raise PeerMemoryError(
                f"CudaIpcPeers: rank {r}'s GPU {format_pci(seg.pci)} is not visible to rank {rank}, which sees "
                f"{[format_pci(v) for v in visible]} (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); every rank must see every rank's GPU: give them "
                f"all the same CUDA_VISIBLE_DEVICES and pick each rank's GPU by its local rank")
    return ordinals


def rebuild_args_on(rebuild: Callable[..., torch.Tensor], args: tuple, ordinal: int) -> tuple:
    """`args` of torch's CUDA tensor rebuild with the storage's device replaced by `ordinal`: the
    exporter's ordinal is in its own CUDA_VISIBLE_DEVICES numbering, which may differ from ours."""
    names = list(inspect.signature(rebuild).parameters)
    if "storage_device" not in names:
        raise PeerMemoryError(f"CudaIpcPeers: {getattr(rebuild, '__name__', rebuild)!r} takes no storage_device; "
                              f"this torch's CUDA IPC is not supported")
    out = list(args)
    out[names.index("storage_device")] = ordinal
    return tuple(out)


class CudaOps:
    """The CUDA calls CudaIpcPeers makes, behind one seam (tests pass CPU stand-ins)."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise PeerMemoryError("CudaIpcPeers needs CUDA, none is available")

    def visible(self) -> list[PciAddress]:
        """PCI addresses of this process's CUDA devices, by ordinal."""
        return [cuda_pci_address(i) for i in range(torch.cuda.device_count())]

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def export(self, tensor: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple]:
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(tensor)

    def open(self, rebuild: Callable[..., torch.Tensor], args: tuple, ordinal: int) -> torch.Tensor:
        # Opening on the exporter's GPU makes this process a CUDA context there.
        return rebuild(*rebuild_args_on(rebuild, args, ordinal))

    def free_bytes(self, device: torch.device) -> int:
        """Free memory on `device` as the driver reports it (every process's use counts)."""
        torch.cuda.synchronize(device)
        return torch.cuda.mem_get_info(device)[0]


def _cuda_device(device: torch.device | str) -> torch.device:
    """`device` with its ordinal (a bare "cuda" is the current device)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"CudaIpcPeers: device={device} is not a CUDA device")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class CudaIpcPeers(PeerMemory):
    """GPU ranks on one node: each rank's segment is a device buffer that the other ranks open
    through CUDA IPC, so `put` / `get` are device-to-device copies over NVLink or PCIe.

    Collective over the (default or given) process group; the current CUDA device must be this
    rank's (`torch.cuda.set_device`), as object collectives over NCCL need. Each rank publishes its
    segment's IPC handle with its GPU's PCI address; a peer opens it on the ordinal that address
    has in its own process, so ranks may number GPUs differently (CUDA_VISIBLE_DEVICES orders), as
    long as each sees all of them. Opening a segment makes the opening process a CUDA context on
    the owner's GPU: every rank measures what the other ranks' contexts took on its GPU
    (`foreign_context_bytes`), and `device_bytes` counts it with the segment.
    """

    def __init__(self, rank: int, world: int, capacity_bytes: int, *, device: torch.device | str,
                 group: dist.ProcessGroup | None = None, ops: CudaOps | None = None) -> None:
        ops = CudaOps() if ops is None else ops
        super().__init__(rank, world, capacity_bytes)
        self._device = _cuda_device(device)
        # Owned for the group's lifetime: peers map this memory, and it must outlive their use.
        self._own: torch.Tensor | None = ops.allocate(capacity_bytes, self._device)
        rebuild, args = ops.export(self._own)
        mine = IpcSegment(host=socket.gethostname(), pci=ops.visible()[self._device.index], rebuild=rebuild, args=args)
        shared: list = [None] * world
        dist.all_gather_object(shared, mine, group=group)
        ordinals, problem = None, None
        try:
            ordinals = open_ordinals(shared, rank, ops.visible())
        except PeerMemoryError as exc:  # each rank sees its own devices: raise on all or none
            problem = str(exc)
        problems: list = [None] * world
        dist.all_gather_object(problems, problem, group=group)
        if any(problems):
            raise PeerMemoryError(next(p for p in problems if p))
        free_before = ops.free_bytes(self._device)
        dist.barrier(group)  # every rank has measured its GPU before any peer opens a segment on it
        self._segments = [self._own if o is None else ops.open(s.rebuild, s.args, o)
                          for s, o in zip(shared, ordinals)]
        dist.barrier(group)  # every peer's context exists on every GPU
        self.foreign_context_bytes = max(0, free_before - ops.free_bytes(self._device))

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def device_bytes(self) -> int:
        return self.capacity_bytes + self.foreign_context_bytes

    def segment(self, owner: int) -> torch.Tensor:
        if not self._segments:
            raise PeerMemoryError("CudaIpcPeers is closed")
        return self._segments[owner]

    def close(self) -> None:
        # Mapped peer buffers are closed when their tensors die; the owned buffer goes back to
        # the caching allocator once no peer holds it (torch's IPC reference counting).
        self._segments = []
        self._own = None


def peer_memory_class(device: torch.device | str) -> type[PeerMemory]:
    """The PeerMemory for ranks computing on `device`: CUDA IPC between GPUs (copies stay on the
    devices), shared-memory files between CPU ranks."""
    return CudaIpcPeers if torch.device(device).type == "cuda" else SharedMemoryPeers
