"""Devices and the links between them: what D2D swap and the device mapping search plan against.

`Topology.link_bw[i][j]` is the bandwidth (bytes/s) of the direct link from device i to device j
(0: none; such a pair's traffic crosses PCIe through the host at `pcie_peer_bw`), `host_bw[i]`
the device <-> host bandwidth (bytes/s, each direction) used by host swap.
"""

from __future__ import annotations

from dataclasses import dataclass


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
