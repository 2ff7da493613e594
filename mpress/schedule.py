"""Pipeline schedules as plain op orders: which forward (F) or backward (B) of which micro-batch each
stage runs next. The simulator plays them; the planner reads lifetimes off them; the runtime uses
torch.distributed.pipelining's schedules of the same names, whose orders these match.

GPipe: every forward, then every backward, in micro-batch order. 1F1B: stage s runs
min(S - s - 1, M) warm-up forwards, then alternates one forward and one backward, then drains the
remaining backwards; a stage holds at most S - s micro-batches of activations at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpress.profile import SCHEDULES


@dataclass(frozen=True)
class Op:
    """One forward or backward of one micro-batch on one stage."""

    kind: str  # "F" or "B"
    micro_batch: int


def stage_ops(schedule: str, stage: int, stages: int, micro_batches: int) -> list[Op]:
    """The order in which `stage` runs its 2 * micro_batches ops."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage}")
    M = micro_batches
    if schedule == "gpipe":
        return [Op("F", m) for m in range(M)] + [Op("B", m) for m in range(M)]
    warmup = min(stages - stage - 1, M)
    ops = [Op("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while f < M:
        ops.append(Op("F", f))
        f += 1
        ops.append(Op("B", b))
        b += 1
    ops += [Op("B", m) for m in range(b, M)]
    return ops


def in_flight_peak(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """The most micro-batches whose activations `stage` holds at once under the schedule."""
    live = peak = 0
    for op in stage_ops(schedule, stage, stages, micro_batches):
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak
