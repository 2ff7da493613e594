"""Peer memory beyond the allocator: which kind a device gets, the shared-memory filesystem checked
on every rank before any segment exists, and CUDA IPC's exchange (handles, GPUs named by PCI
address whatever each rank's CUDA_VISIBLE_DEVICES order, the other ranks' CUDA contexts counted)
run on CPU with stand-ins for the CUDA calls, and for real on a machine with 2 GPUs.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_ranks

import mpress.peer_memory as peer_memory
from mpress.peer_memory import (
    CudaIpcPeers,
    IpcSegment,
    PeerMemoryError,
    SharedMemoryPeers,
    SharedMemorySpaceError,
    open_ordinals,
    peer_memory_class,
    rebuild_args_on,
    segment_path,
    shm_free_bytes,
)
from mpress.topology import format_pci

GPU_A, GPU_B = (0, 0x0A, 0), (0, 0x41, 0)  # PCI (domain, bus, device)
CONTEXT = 300 << 20  # what a fake CUDA context takes on the GPU it is made on
SEGMENT = 4096


@pytest.mark.parametrize("device, kind", [("cuda:1", CudaIpcPeers), ("cuda", CudaIpcPeers), ("cpu", SharedMemoryPeers),
                                          (torch.device("cpu"), SharedMemoryPeers)])
def test_gpus_lend_memory_through_cuda_ipc_and_cpu_ranks_through_shared_memory(device, kind):
    assert peer_memory_class(device) is kind


# -- /dev/shm ---------------------------------------------------------------------------------------


def test_shm_free_bytes_is_what_statvfs_lets_a_user_write(tmp_path):
    st = os.statvfs(tmp_path)
    assert shm_free_bytes(str(tmp_path)) == st.f_bavail * st.f_frsize > 0


def shm_worker(rank: int, name: str, out: str) -> None:
    # rank 1's filesystem view is the short one: both ranks must still refuse, alike
    peer_memory.shm_free_bytes = lambda directory: [10**12, 1000][rank]
    try:
        SharedMemoryPeers(rank, 2, SEGMENT, name)
        message = None
    except SharedMemorySpaceError as exc:
        message = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"message": message, "left": os.path.exists(segment_path(name, rank))}, f)


@pytest.mark.slow  # starts processes
def test_a_full_dev_shm_is_refused_on_every_rank_before_any_segment_exists(tmp_path):
    name = f"test-shm-{uuid.uuid4().hex[:12]}"
    run_ranks(shm_worker, name, str(tmp_path))
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    shm = os.path.dirname(segment_path(name, 0))
    want = (f"{shm} has 1000 bytes free, D2D swap needs {2 * SEGMENT}; enlarge it (docker --shm-size) or "
            f"lower the peer memory (capacity_bytes)")
    assert results == [{"message": want, "left": False}] * 2


def test_the_space_error_names_the_callers_remedy():
    err = SharedMemorySpaceError("/dev/shm", 64 << 20, 3 << 30)
    assert err.line("raise --stage-memory") == ("/dev/shm has 67108864 bytes free, D2D swap needs 3221225472; "
                                                "enlarge it (docker --shm-size) or raise --stage-memory")


# -- CUDA IPC, the exchange without CUDA -------------------------------------------------------------


def segment(host: str, pci) -> IpcSegment:
    return IpcSegment(host=host, pci=pci, rebuild=rebuild_segment, args=())


def test_each_peer_is_opened_on_the_ordinal_its_gpu_has_here():
    segments = [segment("node", GPU_A), segment("node", GPU_B)]
    assert open_ordinals(segments, 0, [GPU_A, GPU_B]) == [None, 1]
    # rank 1 was started with CUDA_VISIBLE_DEVICES=1,0: GPU A is its ordinal 1, not rank 0's 0
    assert open_ordinals(segments, 1, [GPU_B, GPU_A]) == [1, None]


def test_a_peer_gpu_this_rank_cannot_see_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    segments = [segment("node", GPU_A), segment("node", GPU_B)]
    with pytest.raises(PeerMemoryError, match=rf"rank 0's GPU {format_pci(GPU_A)} is not visible to rank 1, which "
                                              rf"sees \['{format_pci(GPU_B)}'\] \(CUDA_VISIBLE_DEVICES='1'\)"):
        open_ordinals(segments, 1, [GPU_B])
    with pytest.raises(NotImplementedError, match=r"within one node; ranks span \['n1', 'n2'\]"):
        open_ordinals([segment("n1", GPU_A), segment("n2", GPU_B)], 0, [GPU_A, GPU_B])


def test_the_rebuild_opens_the_storage_on_our_ordinal():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = tuple(range(15))  # rebuild_cuda_tensor's 15 arguments, storage_device the 7th
    assert rebuild_args_on(rebuild_cuda_tensor, args, 9) == (0, 1, 2, 3, 4, 5, 9, 7, 8, 9, 10, 11, 12, 13, 14)
    assert rebuild_args_on(rebuild_segment, ("p", 8, 0), 3) == ("p", 8, 3)
    with pytest.raises(PeerMemoryError, match="takes no storage_device"):
        rebuild_args_on(lambda handle, size: None, ("h", 1), 0)


def rebuild_segment(path: str, nbytes: int, storage_device: int) -> torch.Tensor:
    """The stand-in for torch's CUDA rebuild: maps the segment's file."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class FakeCudaOps:
    """CudaIpcPeers' CUDA calls on CPU. A segment is a file named after its GPU; each GPU's free
    memory is a counter shared by the ranks. Opening a peer's segment on an ordinal takes a
    context's bytes from the GPU that ordinal is here, and refuses a GPU that is not the
    segment's (a rank that opened a peer on its own numbering of the exporter's ordinal)."""

    def __init__(self, directory: str, visible: list) -> None:
        self.directory, self._visible, self.opened = directory, visible, []
        self._free = torch.from_file(os.path.join(directory, "free"), shared=True, size=2, dtype=torch.int64)

    def visible(self) -> list:
        return list(self._visible)

    def _path(self, pci) -> str:
        return os.path.join(self.directory, f"segment-{format_pci(pci)}")

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self._exported = (self._path(self._visible[device.index]), nbytes, device.index)
        with open(self._exported[0], "wb") as f:
            f.truncate(nbytes)
        return torch.from_file(self._exported[0], shared=True, size=nbytes, dtype=torch.uint8)

    def export(self, tensor: torch.Tensor):
        return rebuild_segment, self._exported  # the ordinal in the exporter's numbering, as torch's is

    def open(self, rebuild, args, ordinal: int) -> torch.Tensor:
        path, nbytes, device = rebuild_args_on(rebuild, args, ordinal)
        gpu = self._visible[device]
        if path != self._path(gpu):
            raise RuntimeError(f"opened {path} on ordinal {device}, which is {format_pci(gpu)} here")
        self.opened.append(device)
        self._free[[GPU_A, GPU_B].index(gpu)] -= CONTEXT
        return rebuild(path, nbytes, device)

    def free_bytes(self, device: torch.device) -> int:
        return int(self._free[[GPU_A, GPU_B].index(self._visible[device.index])])


def ipc_worker(rank: int, directory: str, visible_by_rank: list, out: str) -> None:
    visible = [tuple(v) for v in visible_by_rank[rank]]
    own = visible.index([GPU_A, GPU_B][rank])
    ops = FakeCudaOps(directory, visible)
    peers = CudaIpcPeers(rank, 2, 2 * SEGMENT, device=torch.device("cuda", own), ops=ops)
    data = torch.arange(100, dtype=torch.uint8)
    if rank == 0:
        peers.put(1, peers.alloc(1, data.numel()), data)
    dist.barrier()  # rank 0 wrote into rank 1's segment
    written = None
    if rank == 1:
        start, _ = peers.slice_range(0)
        written = peers.segment(1)[start:start + data.numel()].tolist()
    short = FakeCudaOps(directory, [visible[own]])  # a rank that sees only its own GPU
    try:
        CudaIpcPeers(rank, 2, 2 * SEGMENT, device=torch.device("cuda", 0), ops=short)
        refused = None
    except PeerMemoryError as exc:
        refused = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"opened": ops.opened, "foreign": peers.foreign_context_bytes, "device_bytes": peers.device_bytes,
                   "written": written, "refused": refused}, f)


@pytest.mark.slow  # starts processes
def test_cuda_ipc_exchange_numbers_gpus_by_pci_address_and_counts_peer_contexts(tmp_path):
    torch.full((2,), 80 << 30, dtype=torch.int64).numpy().tofile(tmp_path / "free")
    # rank 1 runs with CUDA_VISIBLE_DEVICES=1,0: it numbers the GPUs the other way round
    visible = [[GPU_A, GPU_B], [GPU_B, GPU_A]]
    run_ranks(ipc_worker, str(tmp_path), visible, str(tmp_path))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in range(2))
    assert r0["opened"] == [1] and r1["opened"] == [1]  # each opened the other's GPU on its own ordinal for it
    assert r1["written"] == list(range(100))  # rank 0's put landed in rank 1's segment, in rank 0's slice
    # one context of the other rank on each GPU, counted by the GPU's owner with its segment
    assert r0["foreign"] == r1["foreign"] == CONTEXT
    assert r0["device_bytes"] == r1["device_bytes"] == 2 * SEGMENT + CONTEXT
    # a rank that cannot see its peer's GPU: every rank raises the same line, none hangs
    assert r0["refused"] == r1["refused"] and "is not visible to rank" in r0["refused"]


# -- CUDA IPC on GPUs -------------------------------------------------------------------------------


def cuda_ipc_worker(rank: int) -> None:
    torch.cuda.set_device(rank)
    peers = CudaIpcPeers(rank, 2, 1 << 20, device=f"cuda:{rank}")
    data = torch.arange(256, dtype=torch.uint8, device=f"cuda:{rank}").repeat(4)
    if rank == 0:
        offset = peers.alloc(1, data.numel())
        peers.put(1, offset, data)
        torch.testing.assert_close(peers.get(1, offset, data.numel()), data, rtol=0, atol=0)
        torch.cuda.synchronize()
    dist.barrier()  # rank 0's bytes are in rank 1's segment
    if rank == 1:
        start, _ = peers.slice_range(0)
        torch.testing.assert_close(peers.segment(1)[start:start + data.numel()], data, rtol=0, atol=0)
    if peers.foreign_context_bytes < 0 or peers.device_bytes < peers.capacity_bytes:
        raise AssertionError(f"rank {rank}: foreign {peers.foreign_context_bytes}, device {peers.device_bytes}")
    if rank == 0:  # the executor stripes layer 1's activations into GPU 1 and reads them back
        from mpress.executor import Executor
        from mpress.profile import Decision, Plan, Stripe
        from helpers.mlp_blocks import cuda_step, make_layers

        layers = [layer.cuda() for layer in make_layers()]
        params = [p for layer in layers for p in layer.parameters()]
        want = cuda_step(layers, params)
        plan = Plan(decisions=[Decision(stage=0, layer=1, technique="d2d", stripes=[Stripe(device=1, bytes=1)])])
        with Executor(plan, 0, device="cuda:0", peers=peers) as ex:
            got = cuda_step([ex.wrap(i, layer) for i, layer in enumerate(layers)], params)
            if not ex.stats().peer_bytes:
                raise AssertionError("nothing was swapped to GPU 1")
        for g, w in zip([*got[0], *got[1]], [*want[0], *want[1]]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)  # a copy; cuBLAS may pick other kernels
    dist.barrier()
    peers.close()


@pytest.mark.slow  # starts processes
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_ipc_peers_copy_between_two_gpus():
    run_ranks(cuda_ipc_worker)
