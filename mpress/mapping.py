"""Step (e) of the planner (mpress.planner): which device each pipeline stage runs on. A local search
over stage -> device permutations, scored by the transfer time a mapping forces, puts pressured stages
next to light devices over fast links."""

from __future__ import annotations

from mpress.profile import PipelineProfile
from mpress.schedule import in_flight_peak
from mpress.simulator import SimResult
from mpress.topology import Topology


def _mapping_cost(mapping: list[int], demand: list[int], budgets: list[int], profile: PipelineProfile,
                  topology: Topology, k: list[int]) -> float:
    """Transfer seconds per step a mapping forces: each stage's excess over its device's budget
    moved out and back over the host link plus the links to devices with free memory, and the
    pipeline boundary traffic."""
    M, n = profile.micro_batches, topology.devices
    holder = {d: s for s, d in enumerate(mapping)}
    free = [budgets[d] - (demand[holder[d]] if d in holder else 0) for d in range(n)]
    cost = 0.0
    for s, d in enumerate(mapping):
        excess = demand[s] - budgets[d]
        if excess > 0:
            bw = topology.host_bw[d] + sum(topology.peer_bw(d, p) * min(1.0, free[p] / excess)
                                           for p in range(n) if p != d and free[p] > 0)
            cost += 2 * M * excess / k[s] / bw if bw > 0 else float("inf")
    if profile.boundary_bytes:
        for s in range(len(mapping) - 1):
            bw = topology.peer_bw(mapping[s], mapping[s + 1])
            cost += 2 * M * profile.boundary_bytes / bw if bw > 0 else float("inf")
    return cost


def search_stage_mapping(profile: PipelineProfile, topology: Topology, budgets: list[int],
                         base: SimResult) -> list[int]:
    """Best-improvement local search from the identity over stage swaps and moves to unused devices,
    scored by `_mapping_cost`; `base` is the keep-all simulation that gives each stage's demand."""
    S = len(profile.stages)
    demand = [base.peak_bytes[d] for d in base.mapping]
    k = [in_flight_peak(profile.schedule, s, S, profile.micro_batches) for s in range(S)]
    current = list(base.mapping)
    cost = _mapping_cost(current, demand, budgets, profile, topology, k)
    while True:
        unused = [d for d in range(topology.devices) if d not in current]
        neighbours = []
        for a in range(S):
            for b in range(a + 1, S):
                m = list(current)
                m[a], m[b] = m[b], m[a]
                neighbours.append(m)
            for d in unused:
                m = list(current)
                m[a] = d
                neighbours.append(m)
        best = min(neighbours, key=lambda m: _mapping_cost(m, demand, budgets, profile, topology, k),
                   default=current)
        best_cost = _mapping_cost(best, demand, budgets, profile, topology, k)
        if not best_cost < cost * (1 - 1e-9):
            return current
        current, cost = best, best_cost
