"""A simulated step as pictures: a Chrome / Perfetto trace of every stream, and memory per device."""

from __future__ import annotations

import json
import os

from mpress.simulator import STREAMS, SimResult

GIB = 2**30


def _stage_of(sim: SimResult) -> dict[int, int]:
    return {d: s for s, d in enumerate(sim.mapping)}


def trace_events(sim: SimResult) -> list[dict]:
    """Chrome trace events: one process per device, one thread per stream, memory as counters.

    Slices on one thread must nest (Perfetto drops the rest): where a stream's transfers overlap
    (several links at once), the overlapping ones go to extra lanes ("p2p 2", ...) of that stream."""
    stage_of = _stage_of(sim)
    events: list[dict] = []
    lanes: dict[tuple[int, str], list[float]] = {}  # (device, stream) -> end time of each lane
    tids: dict[tuple[int, str, int], int] = {}
    slices = []
    for e in sorted(sim.events, key=lambda e: (e.device, e.stream, e.start_s)):
        ends = lanes.setdefault((e.device, e.stream), [])
        lane = next((i for i, end in enumerate(ends) if end <= e.start_s + 1e-12), len(ends))
        if lane == len(ends):
            ends.append(0.0)
        ends[lane] = e.start_s + e.dur_s
        tid = tids.setdefault((e.device, e.stream, lane), len(STREAMS) * lane + STREAMS.index(e.stream))
        slices.append({"ph": "X", "name": e.name, "cat": e.stream, "pid": e.device, "tid": tid,
                       "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6})
    for dev in range(len(sim.peak_bytes)):
        name = f"device {dev}" + (f" (stage {stage_of[dev]})" if dev in stage_of else "")
        events.append({"ph": "M", "name": "process_name", "pid": dev, "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": dev, "tid": 0,
                       "args": {"sort_index": dev}})
        names = {STREAMS.index(stream): stream for stream in STREAMS}
        names.update({tid: f"{stream} {lane + 1}" for (d, stream, lane), tid in tids.items() if d == dev and lane})
        for tid, thread in sorted(names.items()):
            events.append({"ph": "M", "name": "thread_name", "pid": dev, "tid": tid, "args": {"name": thread}})
    events += slices
    for dev, points in enumerate(sim.memory):
        for t, nbytes in points:
            events.append({"ph": "C", "name": "memory", "pid": dev, "tid": 0, "ts": t * 1e6,
                           "args": {"GiB": nbytes / GIB}})
    return events


def chrome_trace(sim: SimResult, path: str | os.PathLike) -> None:
    """Write `sim` as a Chrome / Perfetto trace (open in ui.perfetto.dev or chrome://tracing).
    Streams are filled only for a simulation run with `record=True`; memory counters always are."""
    with open(path, "w") as f:
        json.dump({"traceEvents": trace_events(sim), "displayTimeUnit": "ms"}, f)


def memory_png(sim: SimResult, path: str | os.PathLike, *, budget_bytes: int | list[int] | None = None) -> None:
    """Plot each device's memory over the step, with its budget (one for all devices, one per device,
    default `sim.budget_bytes`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    budget = sim.budget_bytes if budget_bytes is None else budget_bytes
    if isinstance(budget, int):
        budget = [budget] * len(sim.memory)
    stage_of = _stage_of(sim)
    n = len(sim.memory)
    fig = Figure(figsize=(8, 1.6 * n + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    for dev, ax in enumerate(axes):
        t = [p[0] for p in sim.memory[dev]]
        gib = [p[1] / GIB for p in sim.memory[dev]]
        ax.step(t, gib, where="post", lw=1.2, label="resident")
        ax.axhline(budget[dev] / GIB, color="tab:red", ls="--", lw=1, label="budget")
        title = f"device {dev}" + (f" (stage {stage_of[dev]})" if dev in stage_of else "")
        ax.set_ylabel("GiB")
        ax.set_title(f"{title}: peak {sim.peak_bytes[dev] / GIB:.2f} GiB", fontsize=9, loc="left")
        ax.set_ylim(bottom=0)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("time (s)")
    fig.savefig(path, format="png", dpi=100)
