"""Devices and the links between them: what D2D swap and the device mapping search plan against.

`Topology.link_bw[i][j]` is the bandwidth (bytes/s) of the direct link from device i to device j
(0: none; such a pair's traffic crosses PCIe through the host at `pcie_peer_bw`), `host_bw[i]`
the device <-> host bandwidth (bytes/s, each direction) used by host swap.

Where a topology comes from: `builtin` (DGX-1, NVSwitch and PCIe-only machines from published
figures), `from_nvml` (this machine's GPUs, as NVML reports them) or `measure_cpu` (CPU ranks on
this machine, measured). All bandwidths are per direction.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
NVLINK2_BW = 25e9  # bytes/s per NVLink2 link per direction (V100)

# DGX-1 with V100 (hybrid cube-mesh): NVLinks between each pair of GPUs, as `nvidia-smi topo -m`
# reports it on DGX-1V machines ("NV2" = two links bonded, 50 GB/s; "-" = none, PCIe/QPI).
# Each V100 has six NVLink ports and all of them are used; rows sum to 6.
#
#          GPU0 GPU1 GPU2 GPU3 GPU4 GPU5 GPU6 GPU7
#   GPU0    X   NV1  NV1  NV2  NV2   -    -    -
#   GPU1   NV1   X   NV2  NV1   -   NV2   -    -
#   GPU2   NV1  NV2   X   NV2   -    -   NV1   -
#   GPU3   NV2  NV1  NV2   X    -    -    -   NV1
#   GPU4   NV2   -    -    -    X   NV1  NV1  NV2
#   GPU5    -   NV2   -    -   NV1   X   NV2  NV1
#   GPU6    -    -   NV1   -   NV1  NV2   X   NV2
#   GPU7    -    -    -   NV1  NV2  NV1  NV2   X
#
# GPUs 0-3 and 4-7 are two fully connected quads; the cross links pair GPU i with GPU i + 4.
_DGX1_NVLINKS = (
    (0, 1, 1, 2, 2, 0, 0, 0),
    (1, 0, 2, 1, 0, 2, 0, 0),
    (1, 2, 0, 2, 0, 0, 1, 0),
    (2, 1, 2, 0, 0, 0, 0, 1),
    (2, 0, 0, 0, 0, 1, 1, 2),
    (0, 2, 0, 0, 1, 0, 2, 1),
    (0, 0, 1, 0, 1, 2, 0, 2),
    (0, 0, 0, 1, 2, 1, 2, 0),
)

# Sustained flop/s of one GPU for the analytic model: fp16/bf16 tensor-core peak times the
# fraction large-model training reaches in practice.
V100_FLOPS = 125e12 * 0.4
A100_FLOPS = 312e12 * 0.45
H100_FLOPS = 989e12 * 0.45
PCIE_GPU_FLOPS = 65e12 * 0.4  # T4 / V100-PCIe class

# kind -> (GPU <-> NVSwitch fabric bandwidth per direction, host link, memory, flop/s).
# A100: 12 NVLink3 links x 25 GB/s, PCIe4 x16; H100 SXM: 18 NVLink4 links x 25 GB/s, PCIe5 x16.
_NVSWITCH = {
    "a100": (300e9, 25e9, 80 * GiB, A100_FLOPS),
    "h100": (450e9, 50e9, 80 * GiB, H100_FLOPS),
}

BUILTIN = ("dgx1", "nvswitch", "nvswitch-a100", "nvswitch-h100", "pcie")

# NVML's nvmlNvlinkVersion_t -> bytes/s per link per direction. NVLink 1.0 (P100) signals at
# 20 GB/s; 2.x (V100), 3.x (A100) and 4.0 (H100) at 25 GB/s (A100 and H100 reach 300 / 450 GB/s
# with more links, not faster ones); 5.0 (B200) at 50 GB/s.
_NVLINK_BW = {1: 20e9, 2: 25e9, 3: 25e9, 4: 25e9, 5: 25e9, 6: 25e9, 7: 50e9}

# PCIe generation -> bytes/s per lane per direction after line coding (8b/10b up to gen 2,
# 128b/130b from gen 3); packet overheads leave about 80% of that to a device, which is why a
# PCIe3 x16 GPU sees ~12 GB/s of its 15.75.
_PCIE_LANE_BW = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
_PCIE_EFFICIENCY = 0.8

# Substrings of NVML device names -> sustained flop/s (first match wins).
_GPU_FLOPS = (("H200", H100_FLOPS), ("H100", H100_FLOPS), ("H800", H100_FLOPS),
              ("A100", A100_FLOPS), ("A800", A100_FLOPS), ("V100", V100_FLOPS), ("T4", PCIE_GPU_FLOPS))


@dataclass(kw_only=True)
class Topology:
    """A machine's devices, their memory, compute speed and links."""

    name: str
    link_bw: list[list[float]]  # bytes/s, direct links; 0 where there is none
    host_bw: list[float]  # bytes/s per device to and from host memory
    device_memory_bytes: list[int]
    flops: float = 0.0  # sustained flop/s of one device (the analytic model's compute speed)
    pcie_peer_bw: float = 0.0  # bytes/s between devices without a direct link (through the host)

    def __post_init__(self) -> None:
        n = len(self.link_bw)
        if n < 1 or any(len(row) != n for row in self.link_bw):
            raise ValueError(f"topology {self.name}: link_bw must be a square matrix, got {n} rows")
        if len(self.host_bw) != n or len(self.device_memory_bytes) != n:
            raise ValueError(f"topology {self.name}: host_bw and device_memory_bytes need {n} entries")
        if any(self.link_bw[i][i] for i in range(n)):
            raise ValueError(f"topology {self.name}: a device has no link to itself (diagonal must be 0)")

    @property
    def devices(self) -> int:
        return len(self.link_bw)

    def peer_bw(self, i: int, j: int) -> float:
        """Bandwidth for a D2D copy from i to j: the direct link, else PCIe through the host."""
        return self.link_bw[i][j] or self.pcie_peer_bw

    def subset(self, devices: list[int]) -> Topology:
        """The same machine restricted to `devices`, renumbered 0.. in the order given."""
        if not devices or len(set(devices)) != len(devices):
            raise ValueError(f"topology {self.name}: subset needs distinct devices, got {devices}")
        bad = [d for d in devices if not 0 <= d < self.devices]
        if bad:
            raise ValueError(f"topology {self.name}: devices {bad} outside 0..{self.devices - 1}")
        return Topology(name=self.name, link_bw=[[self.link_bw[i][j] for j in devices] for i in devices],
                        host_bw=[self.host_bw[i] for i in devices],
                        device_memory_bytes=[self.device_memory_bytes[i] for i in devices],
                        flops=self.flops, pcie_peer_bw=self.pcie_peer_bw)


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _uniform(name: str, devices: int, *, link_bw: float, host_bw: float, memory_bytes: int,
             flops: float, pcie_peer_bw: float) -> Topology:
    """`devices` identical devices, every pair joined by a `link_bw` link (0: no direct links)."""
    _check_count("gpus", devices)
    _check_positive("gpu_memory_bytes", memory_bytes)
    return Topology(name=name,
                    link_bw=[[0.0 if i == j else link_bw for j in range(devices)] for i in range(devices)],
                    host_bw=[host_bw] * devices, device_memory_bytes=[int(memory_bytes)] * devices,
                    flops=flops, pcie_peer_bw=pcie_peer_bw)


def dgx1(gpu_memory_bytes: int = 32 * GiB) -> Topology:
    """NVIDIA DGX-1 with eight V100s on the hybrid cube-mesh NVLink2 topology (table above)."""
    _check_positive("gpu_memory_bytes", gpu_memory_bytes)
    return Topology(name="dgx1", link_bw=[[links * NVLINK2_BW for links in row] for row in _DGX1_NVLINKS],
                    host_bw=[12e9] * 8, device_memory_bytes=[int(gpu_memory_bytes)] * 8,
                    flops=V100_FLOPS, pcie_peer_bw=10e9)


def nvswitch(gpus: int = 8, kind: str = "a100", gpu_memory_bytes: int | None = None) -> Topology:
    """`gpus` A100s or H100s behind NVSwitches: every pair gets a GPU's full NVLink bandwidth."""
    if kind not in _NVSWITCH:
        raise ValueError(f"kind must be one of {tuple(_NVSWITCH)}, got {kind!r}")
    link, host, memory, flops = _NVSWITCH[kind]
    return _uniform(f"nvswitch-{kind}", gpus, link_bw=link, host_bw=host,
                    memory_bytes=memory if gpu_memory_bytes is None else gpu_memory_bytes,
                    flops=flops, pcie_peer_bw=host)


def pcie(gpus: int = 8, gpu_memory_bytes: int = 16 * GiB) -> Topology:
    """`gpus` PCIe3 GPUs (T4 / V100-PCIe class) with no direct links: peers copy over PCIe."""
    return _uniform("pcie", gpus, link_bw=0.0, host_bw=12e9, memory_bytes=gpu_memory_bytes,
                    flops=PCIE_GPU_FLOPS, pcie_peer_bw=12e9)


def builtin(name: str, gpus: int, gpu_memory_bytes: int | None = None) -> Topology:
    """A named machine with `gpus` GPUs: "dgx1" (its first `gpus` GPUs, at most 8), "nvswitch"
    (= "nvswitch-a100"), "nvswitch-h100" or "pcie"; `gpu_memory_bytes` None keeps the default."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"topology {name!r}: gpus must be an integer >= 1, got {gpus!r}")
    memory = {} if gpu_memory_bytes is None else {"gpu_memory_bytes": gpu_memory_bytes}
    if name == "dgx1":
        if gpus > 8:
            raise ValueError(f"topology 'dgx1' has 8 GPUs, got gpus={gpus}")
        return dgx1(**memory).subset(list(range(gpus)))
    if name in ("nvswitch", "nvswitch-a100", "nvswitch-h100"):
        return nvswitch(gpus, "h100" if name == "nvswitch-h100" else "a100", gpu_memory_bytes)
    if name == "pcie":
        return pcie(gpus, **memory)
    raise ValueError(f"unknown topology {name!r}; built in: {', '.join(BUILTIN)}")


def _at_or_below(table: dict[int, float], key: int) -> float:
    """table[key], else the entry of the nearest known key below it (or the smallest key)."""
    known = [k for k in table if k <= key]
    if key not in table:
        logger.warning("no figure for version/generation %s; using %s's", key, max(known, default=min(table)))
    return table[max(known, default=min(table))]


PciAddress = tuple[int, int, int]  # (domain, bus, device) of a GPU: the same in every process


def parse_pci(bus_id: str | bytes) -> PciAddress:
    """(domain, bus, device) of a PCI bus id: NVML writes them with 4- or 8-digit domains
    ("0000:06:00.0" / "00000000:06:00.0"), so compare numbers, not text."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode()
    try:
        domain, bus, rest = bus_id.strip().lower().split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        raise ValueError(f"not a PCI bus id: {bus_id!r} (want domain:bus:device.function)") from None


def format_pci(address: PciAddress) -> str:
    """The bus id `nvidia-smi` prints for a GPU (function 0)."""
    return "{:08X}:{:02X}:{:02X}.0".format(*address)


def pci_bus_key(pci_info) -> PciAddress:
    return parse_pci(pci_info.busId)


def cuda_pci_address(device) -> PciAddress:
    """The PCI address of a CUDA device given by this process's ordinal (or torch.device)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return props.pci_domain_id, props.pci_bus_id, props.pci_device_id


def nvml_indices(devices: list[PciAddress], nvml_devices: list[PciAddress]) -> list[int]:
    """NVML's index of each of `devices`, in the order given. NVML numbers every GPU of the
    machine in PCI order; a process's CUDA ordinals follow CUDA_VISIBLE_DEVICES (and
    CUDA_DEVICE_ORDER), so ranks must be matched to NVML by PCI address, never by number."""
    where = {address: i for i, address in enumerate(nvml_devices)}
    missing = [format_pci(d) for d in devices if d not in where]
    if missing:
        raise ValueError(f"GPUs {missing} are not among the {[format_pci(d) for d in nvml_devices]} NVML reports")
    shared = sorted({format_pci(d) for d in devices if devices.count(d) > 1})
    if shared:
        raise ValueError(f"GPUs {shared} each run more than one rank: a topology needs one GPU per rank")
    return [where[d] for d in devices]


def nvml_text(value) -> str:
    """An NVML string (bytes in older bindings) as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def from_nvml(devices: list[PciAddress] | None = None) -> Topology:
    """This machine's GPUs as NVML reports them: NVLinks counted per pair (links into NVSwitches
    give every pair of switch-attached GPUs the smaller of their switch bandwidths), memory, PCIe
    host bandwidth and, for known GPU names, sustained flop/s (0 otherwise). With `devices` (PCI
    addresses, e.g. each rank's `cuda_pci_address`), only those GPUs, numbered 0.. in that order."""
    try:
        import pynvml
    except ImportError as e:
        raise RuntimeError("from_nvml needs NVML's Python bindings (pip install nvidia-ml-py)") from e
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise RuntimeError(f"NVML is unavailable (no NVIDIA driver on this machine?): {e}") from e
    try:
        topology, addresses = _read_nvml(pynvml)
    except pynvml.NVMLError as e:
        raise RuntimeError(f"NVML query failed: {e}") from e
    finally:
        pynvml.nvmlShutdown()
    return topology if devices is None else topology.subset(nvml_indices(devices, addresses))


class NvLinks:
    """Active NVLinks of n GPUs: `pairs[i][j]` links between GPUs i and j (direct, or through
    NVSwitches), `bw[i][j]` their bandwidth in bytes/s, and `active[i]` GPU i's links in all."""

    def __init__(self, n: int) -> None:
        self.pairs = [[0] * n for _ in range(n)]
        self.bw = [[0.0] * n for _ in range(n)]
        self.active = [0] * n


def read_nvlinks(nvml, handles: list) -> NvLinks:
    """Every GPU's active NVLinks counted by where they end: another GPU, or an NVSwitch (which joins
    every pair of switch-attached GPUs with the fewer of their switch links, and the smaller of their
    switch bandwidths). The one NVLink walker: the planner's topology and `semoe env` read it."""
    n = len(handles)
    out, to_switch, switch_bw = NvLinks(n), [0] * n, [0.0] * n
    index_of = {pci_bus_key(nvml.nvmlDeviceGetPciInfo(h)): i for i, h in enumerate(handles)}
    for i, h in enumerate(handles):
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(h, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                remote = pci_bus_key(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link))
            except nvml.NVMLError:
                continue  # a link number past the device's last, or a GPU without NVLink
            bw = _link_bw(nvml, h, link)
            out.active[i] += 1
            j = index_of.get(remote)
            if j is not None:
                if j != i:
                    out.pairs[i][j] += 1
                    out.bw[i][j] += bw
            elif remote_is_switch(nvml, h, link):
                to_switch[i] += 1
                switch_bw[i] += bw
    for i in range(n):
        for j in range(n):
            if i != j and to_switch[i] and to_switch[j]:
                out.pairs[i][j] += min(to_switch[i], to_switch[j])
                out.bw[i][j] += min(switch_bw[i], switch_bw[j])
    return out


def _link_bw(nvml, handle, link: int) -> float:
    """One NVLink's bandwidth by its version (the oldest known where the driver cannot tell)."""
    try:
        version = nvml.nvmlDeviceGetNvLinkVersion(handle, link)
    except nvml.NVMLError:
        version = 0
    return _at_or_below(_NVLINK_BW, version)


def _read_nvml(nvml) -> tuple[Topology, list[PciAddress]]:
    n = nvml.nvmlDeviceGetCount()
    if n < 1:
        raise RuntimeError("NVML reports no GPUs on this machine")
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    addresses = [pci_bus_key(nvml.nvmlDeviceGetPciInfo(h)) for h in handles]
    link_bw = read_nvlinks(nvml, handles).bw
    host_bw = [_pcie_bw(nvml, h) for h in handles]
    memory = [int(nvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
    name = nvml_text(nvml.nvmlDeviceGetName(handles[0]))
    flops = next((f for key, f in _GPU_FLOPS if key in name), 0.0)
    if not flops:
        logger.warning("no sustained flop/s figure for %r; the topology's flops is 0", name)
    return Topology(name="nvml", link_bw=link_bw, host_bw=host_bw, device_memory_bytes=memory,
                    flops=flops, pcie_peer_bw=min(host_bw)), addresses


def remote_is_switch(nvml, handle, link: int) -> bool:
    """Whether an NVLink whose far end is not one of our GPUs ends in an NVSwitch (not a CPU).
    Drivers that cannot tell are taken to mean a switch: NVLink to CPUs is rare (POWER9 only)."""
    try:
        return nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link) == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    except (AttributeError, nvml.NVMLError):
        return True


def _pcie_bw(nvml, handle) -> float:
    """Device <-> host bytes/s from the PCIe link. The maximum generation and width the device
    and its slot support, not the current ones: idle GPUs drop their link to gen 1 to save power."""
    try:
        gen = nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)
        width = nvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
    except nvml.NVMLError:
        gen = nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        width = nvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
    return _at_or_below(_PCIE_LANE_BW, gen) * width * _PCIE_EFFICIENCY


def measure_cpu(devices: int, device_memory_bytes: int, nbytes: int = 64 * MiB, repeats: int = 3,
                *, flops_seconds: float = 0.2) -> Topology:
    """CPU ranks on this machine, measured: the best of `repeats` copies of `nbytes` between two
    shared-memory buffers gives every pair's bandwidth and host_bw (device and host memory are the
    same RAM here); float32 512 x 512 matmuls for `flops_seconds` give flops."""
    for name, value in (("devices", devices), ("nbytes", nbytes), ("repeats", repeats)):
        _check_count(name, value)
    _check_positive("device_memory_bytes", device_memory_bytes)
    _check_positive("flops_seconds", flops_seconds)
    bw = _copy_bw(nbytes, repeats)
    return _uniform("cpu", devices, link_bw=bw, host_bw=bw, memory_bytes=device_memory_bytes,
                    flops=_matmul_flops(flops_seconds), pcie_peer_bw=bw)


def _copy_bw(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8).share_memory_()
    dst = torch.zeros(nbytes, dtype=torch.uint8).share_memory_()
    dst.copy_(src)  # fault every page in before timing
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9)


def _matmul_flops(seconds: float, n: int = 512) -> float:
    import torch

    a_NN, b_NN = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a_NN, b_NN)  # warm-up: thread pool, allocator
    count, start = 0, time.perf_counter()
    while True:
        torch.mm(a_NN, b_NN)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * n**3 * count / elapsed
