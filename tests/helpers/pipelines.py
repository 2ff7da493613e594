"""Hand-made pipeline profiles and topologies for the MPress simulator's and planner's tests."""

from __future__ import annotations

from mpress.profile import LayerProfile, PipelineProfile, SavedTensor, StageProfile
from mpress.topology import Topology

GB = 10**9


def make_profile(stages: list[list[tuple[float, float, int]]], micro_batches: int, *,
                 schedule: str = "1f1b", boundary_bytes: int = 0, param_bytes: int = 0) -> PipelineProfile:
    """stages[s] = [(forward_s, backward_s, saved_bytes) per layer]; layer indices run globally."""
    out, index = [], 0
    for s, layers in enumerate(stages):
        lps = []
        for fwd, bwd, saved in layers:
            lps.append(LayerProfile(index=index, name=f"layer{index}", forward_s=fwd, backward_s=bwd,
                                    saved=[SavedTensor(name="x", bytes=saved)] if saved else [],
                                    param_bytes=param_bytes))
            index += 1
        out.append(StageProfile(stage=s, layers=lps))
    return PipelineProfile(stages=out, micro_batches=micro_batches, schedule=schedule,
                           boundary_bytes=boundary_bytes)


def make_topology(n: int, links: dict[tuple[int, int], float] | None = None, *, host_bw: float = GB,
                  memory: int | list[int] = 10**15, pcie_peer_bw: float = 0.0) -> Topology:
    """n devices; `links` are symmetric direct links in bytes/s."""
    bw = [[0.0] * n for _ in range(n)]
    for (i, j), b in (links or {}).items():
        bw[i][j] = bw[j][i] = b
    mem = memory if isinstance(memory, list) else [memory] * n
    return Topology(name=f"test{n}", link_bw=bw, host_bw=[host_bw] * n, device_memory_bytes=mem,
                    pcie_peer_bw=pcie_peer_bw)
