"""Play one training step of a compaction plan over the pipeline schedule: step time, memory per device.

Model, per device (one pipeline stage per device, `Plan.device_of`):

- three streams: `compute` runs the stage's ops in schedule order (`stage_ops`), `host` copies saved
  tensors to and from host memory at the device's own `host_bw` (host links are not shared between
  devices), `d2d` copies them to and from peer devices. A copy stream runs one copy at a time, first
  in, first out; a D2D copy sends its stripes concurrently, each over its own link.
- links: every directed device pair is a resource that carries one transfer at a time (pipeline
  boundary activations and gradients, D2D stripes). A transfer takes the first idle window on the
  link at or after its issue time that is long enough for it; it is never split or preempted. Ops
  are played in order of start time, so this is first come, first served up to transfers issued by
  ops that overlap in time.
- dependencies: F(m) of stage s starts when the compute stream is free and F(m) of stage s - 1 has
  finished and its output has crossed the link; B(m) likewise after B(m) of stage s + 1 (the last
  stage's after its own F(m)).
- techniques per layer: `keep` holds the layer's saved bytes from the start of its forward to the end
  of its backward; `recompute` holds only its input and its backward first replays its forward;
  `host` and `d2d` hold the bytes from the start of the forward until the swap-out copy finishes, and again from
  the start of the swap-in copy until the end of the backward, which waits for the copy. Swap-ins
  for a backward are issued when the stage's previous op starts (after that op's own swap-outs when
  they swap out the same micro-batch); a D2D stripe occupies its peer's memory from the start of its
  swap-out to the end of its swap-in. A swapped layer's forward and backward take `swap_forward_s` /
  `swap_backward_s` longer on the compute stream (the runtime's own work, measured).
- memory: static bytes are always resident; at equal times frees count before allocations. Runs of
  consecutive kept or recomputed layers are charged as one block, so the model costs O(ops x
  segments), not O(ops x layers).
- model data (`Plan.model_data`): a layer whose optimizer states live in host memory or in peers
  does not hold them on its device; a peer holds its stripes all step. After a stage's last
  backward its optimizer phase runs layer by layer on the compute stream: a kept layer steps in
  place; states off the device come in (host link or peer links; PCIe is full duplex, so states
  coming in and going out use separate `model in` / `model out` lanes), one layer ahead of its step,
  and go back after it, so at most two layers' states are on the device at once; a step on the
  host sends the gradients out, runs CPU Adam (one CPU per host: the stages' host steps take turns)
  and brings the weights back. The step ends when every stage's optimizer phase has.
- streamed weights (`ModelDataDecision.weights == "host"`): the layer's weights and gradients
  (`update_bytes`) leave the stage's static memory; the stage holds instead two of its streamed
  layers' weights and one's gradients all step (the layer running, the next one coming in). The
  layer is a segment of its own. Its weights come in on the `host` copy stream, first in, first
  out with the activations' swaps (the runtime has one copy stream), before each of its forwards
  and backwards: issued as the previous streamed layer in that direction starts (the next one is
  fetched while one runs), or as the layer itself is reached when none came before it; its
  gradients go out on the same stream after each backward. Its step on the host copies nothing
  and starts once its last gradients have landed.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from itertools import accumulate

from mpress.profile import MODEL_TECHNIQUES, TECHNIQUES, Decision, ModelDataDecision, PipelineProfile, Plan
from mpress.schedule import Op, stage_ops
from mpress.topology import Topology

RUN, HOST, D2D = 0, 1, 2  # segment kinds
STREAMS = ("compute", "host", "d2d", "p2p", "model in", "model out", "cpu")
_CPU = (-1, -1)  # the host CPU as a link-like resource: one host step at a time


@dataclass(frozen=True)
class TraceEvent:
    """One interval on one stream of one device."""

    name: str
    device: int
    stream: str  # one of STREAMS
    start_s: float
    dur_s: float


@dataclass(frozen=True)
class OpSpan:
    """When one op of one stage ran (including waits for swap-ins)."""

    kind: str
    micro_batch: int
    start_s: float
    end_s: float


@dataclass(kw_only=True)
class SimResult:
    """What one simulated step costs: time, memory per device and traffic per technique."""

    step_time_s: float
    peak_bytes: list[int]  # per device of the topology
    memory: list[list[tuple[float, int]]]  # per device: (time_s, bytes resident from then on)
    budget_bytes: list[int]  # per device: the memory the peaks are compared against
    mapping: list[int]  # mapping[stage] = device
    ops: list[list[OpSpan]]  # per stage, in schedule order
    saved_bytes: dict[str, int]  # per technique: saved-tensor bytes it handled this step
    moved_bytes: dict[str, int]  # per technique: bytes it copied over links this step
    recompute_s: float  # forward time replayed by recomputation, summed over stages
    swap_wait_s: dict[tuple[int, int], float]  # (stage, layer): time backwards waited for its swap-ins
    events: list[TraceEvent] = field(default_factory=list)  # only when simulated with record=True
    # model data: optimizer-state bytes per technique (keep / host / d2d), bytes copied for them
    # this step, and the longest stage's optimizer phase (after its last backward)
    model_bytes: dict[str, int] = field(default_factory=dict)
    model_moved_bytes: dict[str, int] = field(default_factory=dict)
    optimizer_s: float = 0.0
    streamed_bytes: int = 0  # weights and gradients of streamed layers (off their devices between uses)

    @property
    def recompute_bytes(self) -> int:
        return self.saved_bytes["recompute"]

    @property
    def host_swap_bytes(self) -> int:
        return self.saved_bytes["host"]

    @property
    def d2d_swap_bytes(self) -> int:
        return self.saved_bytes["d2d"]

    def overflow(self, budget_bytes: list[int] | None = None) -> list[tuple[int, int]]:
        """(device, bytes over) for every device whose peak exceeds its budget."""
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        return [(d, p - b) for d, (p, b) in enumerate(zip(self.peak_bytes, budget)) if p > b]


@dataclass(slots=True)
class _Segment:
    """A run of kept / recomputed layers, or one swapped layer, played as a unit."""

    kind: int
    first: int  # global layer indices
    last: int
    forward_s: float
    backward_s: float  # recomputed forwards included
    bytes: int  # kept bytes of a run; swapped bytes of a swapped layer
    stripes: tuple[tuple[int, int, float], ...] = ()  # d2d: (peer, bytes, bytes/s)
    weights: int = 0  # a streamed layer (a segment of its own): bytes of its weights, and of its gradients

    @property
    def label(self) -> str:
        return f"L{self.first}" if self.first == self.last else f"L{self.first}-{self.last}"


def _mapping(plan: Plan, stages: int, topology: Topology) -> list[int]:
    mapping = list(plan.mapping) if plan.mapping else list(range(stages))
    if len(mapping) != stages:
        raise ValueError(f"plan.mapping has {len(mapping)} entries for {stages} stages")
    if len(set(mapping)) != stages or not all(0 <= d < topology.devices for d in mapping):
        raise ValueError(f"plan.mapping must place each stage on its own device in "
                         f"0..{topology.devices - 1}, got {mapping}")
    return mapping


def _segments(profile: PipelineProfile, plan: Plan, topology: Topology, mapping: list[int],
              streamed: dict[int, int] | None = None) -> list[list[_Segment]]:
    """Each stage's layers grouped into segments, after checking the plan against the profile;
    `streamed` (layer -> bytes of its weights) layers are segments of their own."""
    streamed = streamed or {}
    owner = {layer.index: s for s, st in enumerate(profile.stages) for layer in st.layers}
    chosen: dict[int, Decision] = {}
    for d in plan.decisions:
        if owner.get(d.layer) != d.stage:
            raise ValueError(f"plan decision for stage {d.stage}, layer {d.layer}: the profile has no "
                             f"such layer in that stage")
        if d.technique not in TECHNIQUES:
            raise ValueError(f"technique must be one of {TECHNIQUES}, got {d.technique!r}")
        chosen[d.layer] = d
    stages: list[list[_Segment]] = []
    kept_input = recompute_held(profile)
    for s, st in enumerate(profile.stages):
        dev, segs = mapping[s], []
        for layer in st.layers:
            d = chosen.get(layer.index)
            tech = d.technique if d else "keep"
            nbytes = layer.saved_bytes
            weights = streamed.get(layer.index, 0)
            if tech in ("host", "d2d") and nbytes:
                stripes = _check_swap(d, nbytes, dev, topology)
                segs.append(_Segment(HOST if tech == "host" else D2D, layer.index, layer.index,
                                     layer.forward_s + layer.swap_forward_s,
                                     layer.backward_s + layer.swap_backward_s, nbytes, stripes, weights))
                continue
            extra = layer.forward_s if tech == "recompute" else 0.0
            held = nbytes if tech != "recompute" else kept_input[layer.index]
            if segs and segs[-1].kind == RUN and not segs[-1].weights and not weights:
                run = segs[-1]
                run.last, run.forward_s = layer.index, run.forward_s + layer.forward_s
                run.backward_s += layer.backward_s + extra
                run.bytes += held
            else:
                segs.append(_Segment(RUN, layer.index, layer.index, layer.forward_s,
                                     layer.backward_s + extra, held, weights=weights))
        stages.append(segs)
    return stages


def _model_data(profile: PipelineProfile, plan: Plan, topology: Topology,
                mapping: list[int]) -> dict[int, tuple[ModelDataDecision, tuple]]:
    """layer -> (decision, d2d stripes as (peer, bytes, bytes/s)) for every layer whose optimizer
    states do not stay on its device, after checking the decisions against the profile."""
    layers = {layer.index: (s, layer) for s, st in enumerate(profile.stages) for layer in st.layers}
    out = {}
    for d in plan.model_data:
        where = f"plan model-data decision for stage {d.stage}, layer {d.layer}"
        if d.layer not in layers or layers[d.layer][0] != d.stage:
            raise ValueError(f"{where}: the profile has no such layer in that stage")
        if d.technique not in MODEL_TECHNIQUES:
            raise ValueError(f"{where}: technique must be one of {MODEL_TECHNIQUES}, got {d.technique!r}")
        if d.technique == "keep":
            continue
        stripes = _check_swap(d, layers[d.layer][1].state_bytes, mapping[d.stage], topology,
                              where=where, holds="the layer's optimizer states are")
        out[d.layer] = (d, stripes)
    return out


def recompute_held(profile: PipelineProfile) -> dict[int, int]:
    """Bytes a recomputed layer still holds per micro-batch: its inputs, kept to replay the forward
    (`replay_bytes` where profiled; else the previous layer's output, the stage's input,
    `boundary_bytes`, for its first layer), never more than the layer would save anyway."""
    out = {}
    for st in profile.stages:
        prev = profile.boundary_bytes
        for layer in st.layers:
            out[layer.index] = min(layer.saved_bytes, layer.replay_bytes or prev)
            prev = layer.output_bytes
    return out


def _check_swap(d: Decision | ModelDataDecision, nbytes: int, dev: int, topology: Topology, *,
                where: str | None = None, holds: str = "the layer saves") -> tuple:
    """A host or d2d decision of `nbytes` on device `dev` checked against the topology; its d2d
    stripes as (peer, bytes, bytes/s)."""
    where = where or f"plan decision for stage {d.stage}, layer {d.layer}"
    if d.technique == "host":
        if topology.host_bw[dev] <= 0:
            raise ValueError(f"{where}: host swap needs host_bw > 0 on device {dev}")
        return ()
    if not d.stripes:
        raise ValueError(f"{where}: d2d needs at least one stripe")
    if sum(x.bytes for x in d.stripes) != nbytes:
        raise ValueError(f"{where}: stripes carry {sum(x.bytes for x in d.stripes)} bytes, {holds} {nbytes}")
    stripes = []
    for x in d.stripes:
        if not 0 <= x.device < topology.devices or x.device == dev:
            raise ValueError(f"{where}: stripe device {x.device} must be a peer of device {dev}")
        bw = min(topology.peer_bw(dev, x.device), topology.peer_bw(x.device, dev))
        if bw <= 0:
            raise ValueError(f"{where}: no path between device {dev} and device {x.device}")
        if x.bytes:
            stripes.append((x.device, x.bytes, bw))
    return tuple(stripes)


class _Links:
    """Directed links as resources holding sorted, disjoint busy intervals."""

    def __init__(self) -> None:
        self._busy: dict[tuple[int, int], tuple[list[float], list[float]]] = {}

    def reserve(self, src: int, dst: int, t: float, dur: float) -> float:
        """Book the first idle window of length `dur` at or after `t`; return its start."""
        starts, ends = self._busy.setdefault((src, dst), ([], []))
        k = bisect_right(ends, t)
        while k < len(starts) and starts[k] < t + dur:
            t = max(t, ends[k])
            k += 1
        starts.insert(k, t)
        ends.insert(k, t + dur)
        return t


def _next_streamed(order: range, segs: list[_Segment]) -> list[int | None]:
    """For each segment position, the position of the next streamed segment after it in `order`."""
    out: list[int | None] = [None] * len(segs)
    later = None
    for i in reversed(list(order)):
        out[i] = later
        if segs[i].weights:
            later = i
    return out


class _Step:
    """The mutable state of one simulated step; `play` runs it."""

    def __init__(self, profile: PipelineProfile, topology: Topology, mapping: list[int],
                 segs: list[list[_Segment]], record: bool,
                 model: dict[int, tuple[ModelDataDecision, tuple]] | None = None) -> None:
        self.profile, self.topology, self.mapping, self.record = profile, topology, mapping, record
        self.segs = segs
        self.model = model or {}
        self.swaps_back = [[g for g in reversed(ss) if g.kind != RUN] for ss in segs]  # backward order
        self.links = _Links()
        n = topology.devices
        self.mem: list[list[tuple[float, int]]] = [[] for _ in range(n)]  # (time, +/- bytes)
        self.stream_free = {"host": [0.0] * n, "d2d": [0.0] * n}
        self.events: list[TraceEvent] = []
        self.wait: dict[tuple[int, int], float] = {}
        # per stage, segment position -> position of the next streamed segment forward / backward
        self.next_up = [_next_streamed(range(len(ss)), ss) for ss in segs]
        self.next_down = [_next_streamed(range(len(ss) - 1, -1, -1), ss) for ss in segs]
        self.grads_landed: dict[int, float] = {}  # streamed layer -> when its last gradients reached the host

    def _event(self, name: str, dev: int, stream: str, start: float, end: float) -> None:
        self.events.append(TraceEvent(name, dev, stream, start, end - start))

    def _copy(self, s: int, m: int, g: _Segment, issue: float, out: bool) -> float:
        """One swap copy of `g` for micro-batch m; returns when it ends."""
        dev = self.mapping[s]
        mem = self.mem[dev]
        stream = "host" if g.kind == HOST else "d2d"
        if g.kind == HOST:
            start, end = self._host_copy(dev, issue, g.bytes)
        else:
            free = self.stream_free[stream]
            start = end = max(issue, free[dev])
            for peer, nbytes, bw in g.stripes:
                dur = nbytes / bw
                a = self.links.reserve(dev, peer, start, dur) if out else \
                    self.links.reserve(peer, dev, start, dur)
                self.mem[peer].append((a, nbytes) if out else (a + dur, -nbytes))
                end = max(end, a + dur)
            free[dev] = end
        mem.append((end, -g.bytes) if out else (start, g.bytes))
        if self.record:
            self._event(f"{'out' if out else 'in'} {g.label} m{m}", dev, stream, start, end)
        return end

    def _weights_copy(self, s: int, issue: float, nbytes: int, name: str) -> float:
        """A streamed layer's weights in (or gradients out) on the device's host copy stream,
        behind the swaps queued there; returns when it ends."""
        dev = self.mapping[s]
        start, end = self._host_copy(dev, issue, nbytes)
        if self.record:
            self._event(name, dev, "host", start, end)
        return end

    def _host_copy(self, dev: int, issue: float, nbytes: int) -> tuple[float, float]:
        """`nbytes` over device `dev`'s host copy stream, first in, first out: (start, end)."""
        free = self.stream_free["host"]
        start = max(issue, free[dev])
        free[dev] = end = start + nbytes / self.topology.host_bw[dev]
        return start, end

    def _weights_in(self, s: int, m: int, i: int, t: float, pending: float | None,
                    after: list[int | None]) -> tuple[float, float | None]:
        """Segment i of stage s, streamed, about to run at t for micro-batch m: (when its weights are
        in, the copy of the next streamed segment's, which starts as this one runs)."""
        segs = self.segs[s]
        g = segs[i]
        ready = pending if pending is not None else self._weights_copy(s, t, g.weights, f"weights {g.label} m{m}")
        t = max(t, ready)
        j = after[i]
        nxt = None if j is None else self._weights_copy(s, t, segs[j].weights, f"weights {segs[j].label} m{m}")
        return t, nxt

    def _prefetch(self, s: int, m: int, issue: float) -> list[float]:
        return [self._copy(s, m, g, issue, out=False) for g in self.swaps_back[s]]

    def _forward(self, s: int, m: int, t: float) -> float:
        dev, record = self.mapping[s], self.record
        mem, pending = self.mem[dev], None
        for i, g in enumerate(self.segs[s]):
            if g.weights:
                t, pending = self._weights_in(s, m, i, t, pending, self.next_up[s])
            if g.bytes:
                mem.append((t, g.bytes))
            if record:
                self._event(f"F{m} {g.label}", dev, "compute", t, t + g.forward_s)
            t += g.forward_s
            if g.kind != RUN:
                self._copy(s, m, g, t, out=True)
        return t

    def _backward(self, s: int, m: int, t: float, ready: list[float]) -> float:
        dev, record = self.mapping[s], self.record
        mem, j, pending, segs = self.mem[dev], 0, None, self.segs[s]
        for i in range(len(segs) - 1, -1, -1):
            g = segs[i]
            if g.kind != RUN:
                r = ready[j]
                j += 1
                if r > t:
                    key = (s, g.first)
                    self.wait[key] = self.wait.get(key, 0.0) + (r - t)
                    t = r
            if g.weights:
                t, pending = self._weights_in(s, m, i, t, pending, self.next_down[s])
            if record:
                self._event(f"B{m} {g.label}", dev, "compute", t, t + g.backward_s)
            t += g.backward_s
            if g.bytes:
                mem.append((t, -g.bytes))
            if g.weights:
                landed = self._weights_copy(s, t, g.weights, f"grads {g.label} m{m}")
                self.grads_landed[g.first] = max(self.grads_landed.get(g.first, 0.0), landed)
        return t

    def _send(self, s: int, to: int, t: float, what: str) -> float:
        """Boundary activation (or its gradient) from stage s to stage `to`; returns arrival."""
        nbytes = self.profile.boundary_bytes
        if not nbytes:
            return t
        src, dst = self.mapping[s], self.mapping[to]
        bw = self.topology.peer_bw(src, dst)
        if bw <= 0:
            raise ValueError(f"no path between device {src} and device {dst} for stages {s} -> {to}")
        dur = nbytes / bw
        start = self.links.reserve(src, dst, t, dur)
        if self.record:
            self._event(what, src, "p2p", start, start + dur)
        return start + dur

    def play(self) -> tuple[float, list[list[OpSpan]]]:
        p = self.profile
        S, M = len(p.stages), p.micro_batches
        ops: list[list[Op]] = [stage_ops(p.schedule, s, S, M) for s in range(S)]
        arrive = {"F": [[None] * M for _ in range(S)], "B": [[None] * M for _ in range(S)]}
        arrive["F"][0] = [0.0] * M
        nxt, busy_until, queued = [0] * S, [0.0] * S, [False] * S
        ready_in: list[list[float]] = [[] for _ in range(S)]  # swap-in ends for the stage's next B
        spans: list[list[OpSpan]] = [[] for _ in range(S)]
        heap: list[tuple[float, int]] = []

        def push(s: int) -> None:
            if queued[s] or nxt[s] == len(ops[s]):
                return
            op = ops[s][nxt[s]]
            a = arrive[op.kind][s][op.micro_batch]
            if a is not None:
                queued[s] = True
                heapq.heappush(heap, (max(a, busy_until[s]), s))

        push(0)
        while heap:
            start, s = heapq.heappop(heap)
            queued[s] = False
            i = nxt[s]
            op, follow = ops[s][i], ops[s][i + 1] if i + 1 < len(ops[s]) else None
            m = op.micro_batch
            prefetch = follow is not None and follow.kind == "B" and bool(self.swaps_back[s])
            if op.kind == "F":
                same = prefetch and follow.micro_batch == m  # B(m) right after F(m): wait for its swap-outs
                pending = self._prefetch(s, follow.micro_batch, start) if prefetch and not same else []
                end = self._forward(s, m, start)
                if same:
                    pending = self._prefetch(s, m, start)
            else:
                pending = self._prefetch(s, follow.micro_batch, start) if prefetch else []
                end = self._backward(s, m, start, ready_in[s])
            ready_in[s] = pending
            spans[s].append(OpSpan(op.kind, m, start, end))
            busy_until[s], nxt[s] = end, i + 1
            if op.kind == "F":
                if s + 1 < S:
                    arrive["F"][s + 1][m] = self._send(s, s + 1, end, f"act m{m} -> s{s + 1}")
                    push(s + 1)
                else:
                    arrive["B"][s][m] = end
            elif s > 0:
                arrive["B"][s - 1][m] = self._send(s, s - 1, end, f"grad m{m} -> s{s - 1}")
                push(s - 1)
            push(s)
        if any(nxt[s] != len(ops[s]) for s in range(S)):
            raise RuntimeError(f"schedule {p.schedule!r} deadlocked at ops {nxt}")  # a schedule bug
        self.optimizer_s = 0.0
        for s in sorted(range(S), key=lambda s: (busy_until[s], s)):  # first done, first to the shared CPU
            end = self._optimizer(s, busy_until[s])
            self.optimizer_s = max(self.optimizer_s, end - busy_until[s])
            busy_until[s] = end
        return max(busy_until), spans

    def _optimizer(self, s: int, t: float) -> float:
        """Stage s's optimizer phase from time t (see the module docstring); returns its end."""
        dev, record = self.mapping[s], self.record
        host_bw = self.topology.host_bw[dev]
        mem = self.mem[dev]
        comp = t_in = t_out = prev_step = t
        back: list[float] = []  # when each moved layer's states have left the device
        for layer in self.profile.stages[s].layers:
            decision, stripes = self.model.get(layer.index, (None, ()))
            name = f"L{layer.index}"
            if decision is not None and decision.step_on == "host" and decision.weights == "host":
                # weights and gradients are there once the last gradients have landed
                cpu = self.links.reserve(*_CPU, max(t, self.grads_landed.get(layer.index, t)), layer.host_step_s)
                t_in = max(t_in, cpu + layer.host_step_s)
                if record:
                    self._event(f"adam {name}", dev, "cpu", cpu, cpu + layer.host_step_s)
                continue
            if decision is not None and decision.step_on == "host":
                half = layer.update_bytes / 2  # gradients out, weights back
                a, out_end = max(t_out, t), max(t_out, t) + half / host_bw
                t_out = out_end
                cpu = self.links.reserve(*_CPU, out_end, layer.host_step_s)
                b = max(t_in, cpu + layer.host_step_s)
                t_in = b + half / host_bw
                if record:
                    self._event(f"grads out {name}", dev, "model out", a, out_end)
                    self._event(f"adam {name}", dev, "cpu", cpu, cpu + layer.host_step_s)
                    self._event(f"weights in {name}", dev, "model in", b, t_in)
                continue
            start = comp
            if decision is not None:  # states come in, one layer ahead of their step, once two layers back left
                a = max(t_in, prev_step, back[-2] if len(back) > 1 else t)
                if decision.technique == "host":
                    t_in = a + layer.state_bytes / host_bw
                else:
                    t_in = max([a] + [self.links.reserve(peer, dev, a, n / bw) + n / bw for peer, n, bw in stripes])
                mem.append((a, layer.state_bytes))
                if record:
                    self._event(f"states in {name}", dev, "model in", a, t_in)
                start = max(comp, t_in)
            prev_step = start
            comp = start + layer.step_s
            if record and layer.step_s:
                self._event(f"step {name}", dev, "compute", start, comp)
            if decision is not None:  # and go back
                a = max(t_out, comp)
                if decision.technique == "host":
                    t_out = a + layer.state_bytes / host_bw
                else:
                    t_out = max([a] + [self.links.reserve(dev, peer, a, n / bw) + n / bw for peer, n, bw in stripes])
                mem.append((t_out, -layer.state_bytes))
                back.append(t_out)
                if record:
                    self._event(f"states out {name}", dev, "model out", a, t_out)
        return max(comp, t_in, t_out)


def _timeline(static: int, deltas: list[tuple[float, int]], end: float) -> tuple[int, list[tuple[float, int]]]:
    """Peak and (time, bytes) steps from allocation deltas; frees first at equal times."""
    deltas.sort()
    levels = list(accumulate((d for _, d in deltas), initial=static))
    times = [t for t, _ in deltas]
    # within a group of equal times frees come first, so no level inside a group tops its last one
    points = [(0.0, static)] + [(t, lv) for t, t_next, lv in zip(times, times[1:] + [None], levels[1:])
                                 if t != t_next]
    if points[-1][0] < end:
        points.append((end, levels[-1]))
    return max(levels), points


def simulate(profile: PipelineProfile, plan: Plan, topology: Topology, *,
             record: bool = False) -> SimResult:
    """Play one training step of `plan` on `topology`; `record` keeps every interval for a trace."""
    mapping = _mapping(plan, len(profile.stages), topology)
    model = _model_data(profile, plan, topology, mapping)
    profile, streamed, streamed_moved = _streamed(profile, model)
    streamed_bytes = 2 * sum(streamed.values())
    segs = _segments(profile, plan, topology, mapping, streamed)
    step = _Step(profile, topology, mapping, segs, record, model)
    step_time, spans = step.play()

    M = profile.micro_batches
    saved = dict.fromkeys(TECHNIQUES, 0)
    moved = dict.fromkeys(TECHNIQUES, 0)
    recompute_s = 0.0
    decided = {d.layer: d.technique for d in plan.decisions}
    for st in profile.stages:
        for layer in st.layers:
            tech = decided.get(layer.index, "keep")
            saved[tech] += layer.saved_bytes * M
            if tech in ("host", "d2d"):
                moved[tech] += 2 * layer.saved_bytes * M
            elif tech == "recompute":
                recompute_s += layer.forward_s * M

    static = [0] * topology.devices
    model_bytes = dict.fromkeys(MODEL_TECHNIQUES, 0)
    model_moved = dict.fromkeys(MODEL_TECHNIQUES, 0)
    for s, st in enumerate(profile.stages):
        static[mapping[s]] += st.static_bytes
        for layer in st.layers:
            decision, stripes = model.get(layer.index, (None, ()))
            tech = decision.technique if decision is not None else "keep"
            model_bytes[tech] += layer.state_bytes
            if decision is None:
                continue
            static[mapping[s]] -= layer.state_bytes  # off the device between steps
            for peer, nbytes, _ in stripes:
                static[peer] += nbytes  # held by the peer all step
            model_moved[tech] += layer.update_bytes if decision.step_on == "host" else 2 * layer.state_bytes
    model_moved["host"] += streamed_moved
    peaks, memory = [], []
    for dev in range(topology.devices):
        peak, points = _timeline(static[dev], step.mem[dev], step_time)
        peaks.append(peak)
        memory.append(points)
    return SimResult(step_time_s=step_time, peak_bytes=peaks, memory=memory,
                     budget_bytes=list(topology.device_memory_bytes), mapping=mapping, ops=spans,
                     saved_bytes=saved, moved_bytes=moved, recompute_s=recompute_s,
                     swap_wait_s=step.wait, events=step.events, model_bytes=model_bytes,
                     model_moved_bytes=model_moved, optimizer_s=step.optimizer_s, streamed_bytes=streamed_bytes)


def _streamed(profile: PipelineProfile, model: dict) -> tuple[PipelineProfile, dict[int, int], int]:
    """`profile` with streamed layers' weights and gradients off their stages' static memory and
    each stage's working set for the streaming (see the module docstring) in its fixed part;
    streamed layer -> bytes of its weights; the bytes the streaming copies in a step."""
    M, streamed, moved, stages = profile.micro_batches, {}, 0, []
    for st in profile.stages:
        layers, most = [], 0
        for lp in st.layers:
            decision = model.get(lp.index, (None, ()))[0]
            if decision is None or decision.weights != "host":
                layers.append(lp)
                continue
            w = lp.update_bytes // 2
            layers.append(replace(lp, param_bytes=lp.param_bytes - lp.update_bytes, update_bytes=0))
            streamed[lp.index] = w
            most, moved = max(most, w), moved + 3 * M * w
        stages.append(replace(st, layers=layers, fixed_bytes=st.fixed_bytes + 3 * most))
    if not streamed:
        return profile, {}, 0
    return replace(profile, stages=stages), streamed, moved
