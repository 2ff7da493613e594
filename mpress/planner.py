"""Choose, per (stage, layer), keep / recompute / host swap / D2D swap, and a stage -> device mapping,
so that every device fits its memory budget at the least step time (MPress, HPCA 2023).

The steps, each scored or checked in the simulator:

(a) lifetimes: simulate keep-all; each layer's idle time is the shortest gap, over micro-batches,
    between the end of its forward and the start of its backward. If everything fits, keep all.
(b) host swap for layers whose idle time hides a swap-out plus a swap-in over `host_bw`, largest
    saved bytes first, while the device's host copies per micro-batch fit in its compute time, unless
    the swap's own cost on the compute stream (`swap_forward_s + swap_backward_s`, measured) is no
    less than replaying the layer's forward.
(c) recompute or (exposed) host swap for the rest, whichever costs less added time per byte of peak
    removed (a swap costs its exposed copy time plus its cost on the compute stream); costs within
    10% count as equal and then later layers (the shortest idle times) go first, so recomputation
    forms a run of consecutive layers at the end of the stage. (b) and (c)
    stop once the estimate fits; the simulator then says what is still over and more of the same
    queue is taken.
(d) the costliest choices (exposed host swaps by their measured wait, recomputes by M x forward_s)
    become D2D swaps striped over peers with free memory (budget minus simulated peak) in proportion
    to link bandwidth; a batch of them is kept when the simulated step fits and is faster (else the
    batch is halved), and the search stops once a kept batch gains less than `min_gain`.
Model data: a layer's optimizer states (`LayerProfile.state_bytes`) may move to host memory for the
whole step, stepped on the device (brought in and out around the optimizer step) or on the host
(CPU Adam; gradients out, weights back), whichever the cost model prices lower. Such a move enters
the same queues as (b) and (c), priced as the optimizer-phase time it adds per byte of peak it
removes (it removes the full state bytes, at every moment of the pipeline). In (d) the states of
host-swapped layers may instead be striped over peers with free memory, accepted as (d) accepts
activation D2D: when the simulated step fits and is faster. When no plan fits that way, a layer
stepped on the host may also stream its weights and gradients from host memory
(`weights="host"`): that enters the queues too, priced as the copy time its forwards and
backwards cannot hide behind their compute per byte it removes; once the plan fits, the most
streamed layers that can keep their weights on the device with the plan still fitting and no
slower do (a bisection per stage). Host memory (`host_memory_bytes`) goes to choices as they are
taken, in queue order.

(e) without a given mapping, a local search over stage -> device permutations, scored by an estimate
    of the transfer time the mapping forces, puts pressured stages next to light devices over fast
    links; the best mapping found and the identity are both compacted and the faster one kept.
(f) the greedy steps can miss plain answers: where the offload-everything baseline
    (`offload_everything`) fits and is faster than the plan found, or no plan was found, it is
    the plan.

Peak estimates: recomputing a layer removes its saved bytes times the stage's micro-batches in flight
k; swapping removes k - 2 times them, since one micro-batch is being produced (not yet copied out)
and one is prefetched for the next backward while the peak builds.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from dataclasses import dataclass
from itertools import accumulate
from numbers import Integral

from mpress.profile import Decision, LayerProfile, ModelDataDecision, PipelineProfile, Plan, Stripe
from mpress.schedule import in_flight_peak
from mpress.mapping import search_stage_mapping
from mpress.simulator import SimResult, recompute_held, simulate
from mpress.topology import Topology

log = logging.getLogger(__name__)

MAX_FIX_ROUNDS = 32  # simulate / add-more rounds after the first estimate (each adds >= 1 choice)
# times closer than this, relatively, are equal: sums of per-layer times differ in their last bits
# with the order and method of summation (Python 3.12's sum() is compensated), and among identical
# layers the planner's estimates meet their thresholds exactly
TIME_RTOL = 1e-9


@dataclass(kw_only=True)
class PlanResult:
    """A plan, its simulated step, whether it fits the budget (and why not) and how long planning took."""

    plan: Plan
    sim: SimResult
    fits: bool
    reason: str
    planning_s: float


def idle_times(profile: PipelineProfile, sim: SimResult) -> dict[tuple[int, int], float]:
    """(stage, layer) -> shortest gap over micro-batches between the layer's forward end and its
    backward start, read off `sim` (a simulation of the keep-all plan)."""
    idle: dict[tuple[int, int], float] = {}
    for s, st in enumerate(profile.stages):
        f_start = {o.micro_batch: o.start_s for o in sim.ops[s] if o.kind == "F"}
        gap = min(o.start_s - f_start[o.micro_batch] for o in sim.ops[s] if o.kind == "B")
        fwd_end = accumulate(layer.forward_s for layer in st.layers)
        # summed from the stage's end, not taken off its total: the last layer's is exactly 0
        bwd_after = list(accumulate((layer.backward_s for layer in st.layers[:0:-1]), initial=0.0))
        for layer, f, b in zip(st.layers, fwd_end, reversed(bwd_after)):
            idle[(s, layer.index)] = gap - f + b
    return idle


def stripes(nbytes: int, device: int, peers: list[int], topology: Topology) -> list[Stripe]:
    """Split `nbytes` over `peers` in proportion to the link bandwidth from `device` to each; the
    rounding remainder goes to the fastest peer."""
    bw = [topology.peer_bw(device, p) for p in peers]
    total = sum(bw)
    if not peers or total <= 0:
        raise ValueError(f"device {device} has no link to any of peers {peers}")
    parts = [int(nbytes * b // total) for b in bw]
    parts[bw.index(max(bw))] += nbytes - sum(parts)
    return [Stripe(device=p, bytes=n) for p, n in zip(peers, parts) if n]


def _budgets(budget_bytes: int | list[int] | None, topology: Topology) -> list[int]:
    n = topology.devices
    if budget_bytes is None:
        return list(topology.device_memory_bytes)
    budgets = [int(budget_bytes)] * n if isinstance(budget_bytes, Integral) else [int(b) for b in budget_bytes]
    if len(budgets) != n:
        raise ValueError(f"budget_bytes has {len(budgets)} entries for {n} devices")
    if min(budgets) < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return budgets


def _swap_compute_s(lp: LayerProfile) -> float:
    """What swapping the layer adds on the compute stream per micro-batch (forward and backward)."""
    return lp.swap_forward_s + lp.swap_backward_s


def _at_most(a: float, b: float) -> bool:
    """a <= b, up to rounding (`TIME_RTOL`)."""
    return a <= b + TIME_RTOL * max(abs(a), abs(b))


def _excess(a: float, b: float) -> float:
    """How far time a exceeds time b; 0 within rounding."""
    return 0.0 if _at_most(a, b) else a - b


def _cost_bucket(cost: float) -> float:
    """Costs within 10% of each other sort as equal, so that among near-uniform layers the later
    ones win and recomputation forms one run at the end of the stage."""
    return -math.inf if cost <= 0 else math.floor(math.log(cost, 1.1))


class _Tie(enum.IntEnum):
    """Between choices for one layer at the same cost per byte, which comes first."""

    HOST_SWAP = 0  # the activations to host memory
    STATES_STEPPED_ON_DEVICE = 1  # the optimizer states moved, stepped on the device
    STATES_STEPPED_ON_HOST = 2  # ... stepped on the host
    WEIGHTS_STREAMED = 3  # the weights and gradients streamed for each use
    RECOMPUTE = 4


class _Compactor:
    """Steps (a)-(d) for one stage -> device mapping."""

    def __init__(self, profile: PipelineProfile, topology: Topology, budgets: list[int],
                 mapping: list[int], host_memory_bytes: int | None = None, host_steps: bool = True,
                 stream: bool = True) -> None:
        self.profile, self.topology, self.budgets, self.mapping = profile, topology, budgets, mapping
        self.host_steps = host_steps  # may a moved layer's optimizer step run on the host CPU
        self.stream = stream  # may a layer's weights stream from host memory
        # host memory left for swapped activations: a layer swapped out holds k micro-batches there
        self.host_room = math.inf if host_memory_bytes is None else host_memory_bytes
        S, M = len(profile.stages), profile.micro_batches
        self.M = M
        self.k = [in_flight_peak(profile.schedule, s, S, M) for s in range(S)]
        self.stage_on = {d: s for s, d in enumerate(mapping)}
        self.layer: dict[int, tuple[int, LayerProfile]] = {
            lp.index: (s, lp) for s, st in enumerate(profile.stages) for lp in st.layers}
        self.choice: dict[int, Decision] = {}  # layer -> how its activations are compacted
        self.md: dict[int, ModelDataDecision] = {}  # layer -> where its model data goes
        self.queue: list[list[Decision | ModelDataDecision]] = []  # per stage: the choices still to take
        self.kept_input = recompute_held(profile)

    def to_plan(self, choice: dict[int, Decision] | None = None, md: dict[int, ModelDataDecision] | None = None) -> Plan:
        choice = self.choice if choice is None else choice
        md = self.md if md is None else md
        return Plan(decisions=[dataclasses.replace(choice[i], stripes=list(choice[i].stripes)) for i in sorted(choice)],
                    mapping=list(self.mapping),
                    model_data=[dataclasses.replace(md[i], stripes=list(md[i].stripes)) for i in sorted(md)])

    def simulate(self, choice: dict[int, Decision] | None = None,
                 md: dict[int, ModelDataDecision] | None = None) -> SimResult:
        return simulate(self.profile, self.to_plan(choice, md), self.topology)

    def decision(self, layer: int, technique: str, stripes: list[Stripe] | None = None) -> Decision:
        return Decision(stage=self.layer[layer][0], layer=layer, technique=technique, stripes=stripes or [])

    def moved(self, layer: int, step_on: str, weights: str = "keep") -> ModelDataDecision:
        """`layer`'s optimizer states in host memory, stepped `step_on` (device or host); with
        `weights="host"` its weights streamed from there too."""
        return ModelDataDecision(stage=self.layer[layer][0], layer=layer, technique="host", step_on=step_on,
                                 weights=weights)

    def model_cost(self, s: int, lp: LayerProfile) -> tuple[float, str]:
        """(optimizer-phase seconds that moving `lp`'s states to host memory adds, where its step
        then runs): on the device the states cross the host link in and out (full duplex, one
        direction exposed); on the host the gradients go out and the weights come back, and CPU
        Adam is shared by every stage."""
        host_bw = self.topology.host_bw[self.mapping[s]]
        on_device = lp.state_bytes / host_bw
        on_host = (lp.update_bytes / host_bw + lp.host_step_s * len(self.profile.stages) - lp.step_s
                   if lp.host_step_s and self.host_steps else math.inf)
        return (on_device, "device") if on_device <= on_host else (max(on_host, 0.0), "host")

    def can_stream(self, s: int, lp: LayerProfile) -> bool:
        return bool(self.stream and lp.update_bytes and lp.host_step_s and self.host_steps
                    and self.topology.host_bw[self.mapping[s]] > 0)

    def stream_cost(self, s: int, lp: LayerProfile) -> float:
        """Seconds per step that streaming `lp`'s weights adds: the copy time its forwards and
        backwards cannot hide, and its optimizer step moved to the host."""
        copy_s = lp.update_bytes / 2 / self.topology.host_bw[self.mapping[s]]
        exposed = max(copy_s - lp.forward_s, 0.0) + max(copy_s - lp.backward_s, 0.0)
        return self.M * exposed + max(lp.host_step_s * len(self.profile.stages) - lp.step_s, 0.0)

    def freed(self, d: ModelDataDecision) -> int:
        """Device bytes moving `d.layer`'s model data as `d` says frees: its states, and with its
        weights streamed, its weights and gradients (and the states, unless they moved already)."""
        lp = self.layer[d.layer][1]
        if d.weights == "host":
            return lp.update_bytes + (0 if d.layer in self.md else lp.state_bytes)
        return lp.state_bytes

    def reduction(self, layer: int, technique: str) -> int:
        """Device bytes at the peak that `technique` (a `Decision`'s) for `layer`'s activations saves."""
        s, lp = self.layer[layer]
        k = self.k[s]
        if technique == "recompute":  # the layer's input stays to replay it
            return max(lp.saved_bytes - self.kept_input[layer], 0) * k
        return lp.saved_bytes * max(k - 2, 0)

    # (b) and (c): an ordered queue of choices per stage
    def build_queues(self, idle: dict[tuple[int, int], float]) -> None:
        for s, st in enumerate(self.profile.stages):
            host_bw, k, M = self.topology.host_bw[self.mapping[s]], self.k[s], self.M
            period = st.forward_s + st.backward_s
            hidden, load = [], 0.0
            can_swap = host_bw > 0 and k > 2
            layers = [lp for lp in st.layers if lp.saved_bytes]
            if can_swap:
                for lp in sorted(layers, key=lambda lp: (-lp.saved_bytes, lp.index)):
                    swap_s = 2 * lp.saved_bytes / host_bw
                    held = lp.saved_bytes * k
                    if _swap_compute_s(lp) >= lp.forward_s:  # dearer than replaying it: left to (c)
                        continue
                    hides = _at_most(swap_s, idle[(s, lp.index)]) and _at_most(load + swap_s, period)
                    if hides and held <= self.host_room:
                        hidden.append(self.decision(lp.index, "host"))
                        load += swap_s
            taken = {d.layer for d in hidden}
            rest = []
            for lp in layers:
                if lp.index in taken:
                    continue
                gain = self.reduction(lp.index, "recompute")
                per_byte = {"recompute": M * lp.forward_s / gain if gain else math.inf}
                if can_swap and lp.saved_bytes * k <= self.host_room:
                    swap_s = 2 * lp.saved_bytes / host_bw
                    exposed = max(_excess(swap_s, idle[(s, lp.index)]), _excess(load + swap_s, period))
                    per_byte["host"] = M * (exposed + _swap_compute_s(lp)) / self.reduction(lp.index, "host")
                tech = min(per_byte, key=lambda t: (per_byte[t], t != "recompute"))
                tie = _Tie.HOST_SWAP if tech == "host" else _Tie.RECOMPUTE
                rest.append((_cost_bucket(per_byte[tech]), -lp.index, tie, self.decision(lp.index, tech)))
            if host_bw > 0:  # model data: the optimizer states to host memory
                for lp in st.layers:
                    if lp.state_bytes and lp.state_bytes <= self.host_room:
                        added, on = self.model_cost(s, lp)
                        tie = _Tie.STATES_STEPPED_ON_DEVICE if on == "device" else _Tie.STATES_STEPPED_ON_HOST
                        rest.append((_cost_bucket(added / lp.state_bytes), -lp.index, tie, self.moved(lp.index, on)))
                for lp in st.layers:  # and the weights and gradients, streamed for each use
                    if self.can_stream(s, lp):
                        need = lp.update_bytes + lp.state_bytes
                        rest.append((_cost_bucket(self.stream_cost(s, lp) / need), -lp.index,
                                     _Tie.WEIGHTS_STREAMED, self.moved(lp.index, "host", "host")))
            # cheapest per byte first, then the later layer, then `_Tie`'s order: the last sort key,
            # never reached by the records themselves
            rest.sort(key=lambda r: r[:3])
            self.queue.append(hidden + [choice for *_, choice in rest])

    def host_bytes(self, d: Decision | ModelDataDecision) -> int:
        """Host memory taking `d` fills (0 for recompute and D2D)."""
        if isinstance(d, ModelDataDecision):
            return self.freed(d)
        s, lp = self.layer[d.layer]
        return lp.saved_bytes * self.k[s] if d.technique == "host" else 0

    def shed(self, s: int, excess: int) -> bool:
        """Take choices off stage s's queue until their estimated reduction covers `excess`; with the
        queue empty, turn host swaps into recomputes, then the stage's optimizer steps of states in
        host memory into steps on the host. False when nothing is left to do. Host memory
        is taken as choices are (not as the queues are built, so that no stage's unused candidates
        keep another stage from it); a host swap it has no room for becomes a recompute."""
        changed = False
        queue = self.queue[s]
        while excess > 0 and queue:
            choice = queue.pop(0)
            layer = choice.layer
            model = isinstance(choice, ModelDataDecision)
            if model and choice.weights != "host" and layer in self.md:
                continue  # its weights stream: its states moved with them
            need = self.host_bytes(choice)
            if need > self.host_room:
                if model or choice.technique != "host" or not self.reduction(layer, "recompute"):
                    continue
                choice, need = self.decision(layer, "recompute"), 0
            self.host_room -= need
            if model:
                excess -= self.freed(choice)
                self.md[layer] = choice
            else:
                excess -= self.reduction(layer, choice.technique)
                self.choice[layer] = choice
            changed = True
        if excess > 0 and not queue:
            swapped = sorted((i for i, d in self.choice.items()
                              if d.technique != "recompute" and self.layer[i][0] == s),
                             key=lambda i: (-self.layer[i][1].saved_bytes, i))
            for layer in swapped:
                if excess <= 0:
                    break
                excess -= self.reduction(layer, "recompute") - self.reduction(layer, self.choice[layer].technique)
                self.host_room += self.host_bytes(self.choice[layer])
                self.choice[layer] = self.decision(layer, "recompute")
                changed = True
        if excess > 0 and not queue and self.host_steps:
            # states stepped on the device come back in for their step, two layers' at a time:
            # stepped on the host they never do
            for layer, d in sorted(self.md.items()):
                lp = self.layer[layer][1]
                if self.layer[layer][0] == s and d.technique == "host" and d.step_on == "device" and lp.host_step_s:
                    self.md[layer] = dataclasses.replace(d, step_on="host")
                    changed = True
        return changed

    def fit(self, base: SimResult) -> SimResult:
        """(b), (c) and the simulate / add-more rounds until every device fits or nothing is left."""
        for s, d in enumerate(self.mapping):
            if base.peak_bytes[d] > self.budgets[d]:
                self.shed(s, base.peak_bytes[d] - self.budgets[d])
        sim = self.simulate()
        for _ in range(MAX_FIX_ROUNDS):
            over = [(self.stage_on[d], x) for d, x in sim.overflow(self.budgets) if d in self.stage_on]
            shed = [self.shed(s, x) for s, x in over]  # every stage over budget, not the first only
            if not any(shed):
                break
            sim = self.simulate()
        return sim

    def unstream(self, sim: SimResult) -> SimResult:
        """The queues overshoot with streaming (its working set of whole layers is not in their
        estimate), and it slows every use of a layer: per stage, the most of its streamed layers
        (dearest to stream first) whose weights can stay on the device with the plan still fitting
        and no slower, found by bisection."""
        for s in range(len(self.profile.stages)):
            streamed = sorted((i for i, d in self.md.items() if d.weights == "host" and self.layer[i][0] == s),
                              key=lambda i: (-self.stream_cost(s, self.layer[i][1]), i))
            lo, hi, best = 0, len(streamed), None  # lo layers can stay; hi + 1 cannot
            while lo < hi:
                n = (lo + hi + 1) // 2
                md = dict(self.md)
                for i in streamed[:n]:
                    md[i] = dataclasses.replace(md[i], weights="keep")
                tried = self.simulate(md=md)
                if not tried.overflow(self.budgets) and tried.step_time_s <= sim.step_time_s * (1 + 1e-9):
                    lo, best = n, (md, tried)
                else:
                    hi = n - 1
            if best is not None:
                self.md, sim = best
                self.host_room += sum(self.layer[i][1].update_bytes for i in streamed[:lo])
        return sim

    # (d): D2D swap to peers with free memory
    def _peer_stripes(self, s: int, nbytes: int, room: list[int], hold: int | None = None) -> list[Stripe]:
        """Stripes of `nbytes` over peers whose `room` takes `hold` copies of their stripe (default:
        the stage's micro-batches in flight but one); `room` is charged for them."""
        dev, hold = self.mapping[s], max(self.k[s] - 1, 1) if hold is None else hold
        peers = [p for p in range(self.topology.devices)
                 if p != dev and room[p] > 0 and self.topology.peer_bw(dev, p) > 0
                 and self.topology.peer_bw(p, dev) > 0]
        while peers:
            split = stripes(nbytes, dev, peers, self.topology)
            short = {x.device for x in split if x.bytes * hold > room[x.device]}
            if not short:
                for x in split:
                    room[x.device] -= x.bytes * hold
                return split
            peers = [p for p in peers if p not in short]
        return []

    def _d2d_trial(self, costly: list[tuple[float, int]],
                   sim: SimResult) -> tuple[dict[int, Decision], SimResult] | None:
        """Convert `costly` layers to D2D, paying back the device memory a converted recompute
        needs (2 micro-batches of its bytes) by moving kept layers of its stage to D2D too."""
        room = [b - p for b, p in zip(self.budgets, sim.peak_bytes)]
        choice = dict(self.choice)
        kept = {s: sorted((lp for lp in st.layers if lp.saved_bytes and lp.index not in choice),
                          key=lambda lp: (-lp.saved_bytes, lp.index))
                for s, st in enumerate(self.profile.stages)}
        converted = 0
        for _, layer in costly:
            s, lp = self.layer[layer]
            dev = self.mapping[s]
            need = 0  # device bytes the conversion costs at the peak
            if choice[layer].technique == "recompute":
                need = self.reduction(layer, "recompute") - self.reduction(layer, "d2d")
            trial_room = list(room)
            split = self._peer_stripes(s, lp.saved_bytes, trial_room)
            if not split:
                continue
            moves, j = [(layer, split)], 0
            while need > trial_room[dev] and j < len(kept[s]) and self.reduction(kept[s][j].index, "d2d"):
                extra_split = self._peer_stripes(s, kept[s][j].saved_bytes, trial_room)
                if not extra_split:
                    break
                moves.append((kept[s][j].index, extra_split))
                trial_room[dev] += self.reduction(kept[s][j].index, "d2d")
                j += 1
            if need > trial_room[dev]:
                continue
            trial_room[dev] -= need
            del kept[s][:j]
            room = trial_room
            for i, split in moves:
                choice[i] = self.decision(i, "d2d", split)
            converted += 1
        return (choice, self.simulate(choice)) if converted else None

    def _halving_search(self, sim: SimResult, min_gain: float, candidates, trial, accept) -> SimResult:
        """Shared by (d) for activations and for model data: `trial(first n of candidates(sim),
        sim)` gives (choices, simulated step) or None when nothing converts; the largest n (halving)
        whose step fits and is faster is `accept`ed, and the search repeats until a round gains
        less than `min_gain`."""
        while True:
            items = candidates(sim)
            n, accepted = len(items), None
            while n and accepted is None:
                tried = trial(items[:n], sim)
                if tried is None:  # no peer can take any of them; fewer will not help
                    break
                if not tried[1].overflow(self.budgets) and tried[1].step_time_s < sim.step_time_s:
                    accepted = tried
                n //= 2
            if accepted is None:
                return sim
            gain = (sim.step_time_s - accepted[1].step_time_s) / sim.step_time_s
            accept(accepted[0])
            sim = accepted[1]
            if gain < min_gain:
                return sim

    def d2d(self, sim: SimResult, min_gain: float) -> SimResult:
        """(d): the costliest choices first, halving the batch until a trial fits and is faster."""
        def costly(sim: SimResult) -> list[tuple[float, int]]:
            out = []
            for layer, d in self.choice.items():
                s, lp, tech = *self.layer[layer], d.technique
                cost = self.M * lp.forward_s if tech == "recompute" else \
                    sim.swap_wait_s.get((s, layer), 0.0) if tech == "host" else 0.0
                if cost > 0:
                    out.append((cost, layer))
            return sorted(out, key=lambda c: (-c[0], c[1]))

        return self._halving_search(sim, min_gain, costly, self._d2d_trial,
                                    lambda choice: setattr(self, "choice", choice))

    def model_d2d(self, sim: SimResult, min_gain: float) -> SimResult:
        """(d) for model data: host-held optimizer states striped over peers' free memory instead
        (they stay there all step), largest first, halving the batch until a trial fits and is
        faster."""
        def movable(sim: SimResult) -> list[int]:
            return sorted((i for i, d in self.md.items() if d.technique == "host" and d.weights == "keep"),
                          key=lambda i: (-self.layer[i][1].state_bytes, i))

        def trial(layers: list[int], sim: SimResult):
            room = [b - p for b, p in zip(self.budgets, sim.peak_bytes)]
            md, converted = dict(self.md), 0
            for layer in layers:
                s, lp = self.layer[layer]
                split = self._peer_stripes(s, lp.state_bytes, room, hold=1)
                if split:
                    md[layer] = ModelDataDecision(stage=s, layer=layer, technique="d2d", stripes=split)
                    converted += 1
            return (md, self.simulate(md=md)) if converted else None

        return self._halving_search(sim, min_gain, movable, trial, lambda md: setattr(self, "md", md))


def _result(plan_: Plan, sim: SimResult, budgets: list[int], t0: float, stage_on: dict[int, int],
            note: str) -> PlanResult:
    sim = dataclasses.replace(sim, budget_bytes=list(budgets))
    over = sim.overflow()
    if over:
        d, x = max(over, key=lambda o: (o[1], -o[0]))
        where = f"device {d}" + (f" (stage {stage_on[d]})" if d in stage_on else "")
        reason = (f"{where} needs {sim.peak_bytes[d]} bytes at its peak, {x} over its budget of "
                  f"{budgets[d]} bytes{note}")
    else:
        counts = {}
        for dec in plan_.decisions:
            counts[dec.technique] = counts.get(dec.technique, 0) + 1
        for dec in plan_.model_data:
            counts[f"model-data {dec.technique}"] = counts.get(f"model-data {dec.technique}", 0) + 1
            if dec.weights == "host":
                counts["streamed weights"] = counts.get("streamed weights", 0) + 1
        reason = "fits " + (", ".join(f"{n} {t}" for t, n in sorted(counts.items())) or "keeping all")
    return PlanResult(plan=plan_, sim=sim, fits=not over, reason=reason,
                      planning_s=time.perf_counter() - t0)


def _compact(profile: PipelineProfile, topology: Topology, budgets: list[int], mapping: list[int],
             min_gain: float, base: SimResult | None, t0: float, host_memory_bytes: int | None = None,
             host_steps: bool = True, stream: bool = True) -> PlanResult:
    c = _Compactor(profile, topology, budgets, mapping, host_memory_bytes, host_steps, stream)
    base = base or c.simulate()
    if not base.overflow(budgets):
        return _result(c.to_plan(), base, budgets, t0, c.stage_on, "")
    for s, st in enumerate(profile.stages):
        d = mapping[s]
        movable = sum(lp.state_bytes for lp in st.layers) if topology.host_bw[d] > 0 else 0
        streamable = [lp for lp in st.layers if c.can_stream(s, lp)]
        if streamable:  # all but the two layers' weights and one's gradients streaming holds
            most = max(lp.update_bytes // 2 for lp in streamable)
            movable += sum(lp.update_bytes for lp in streamable) - 3 * most
        resident = st.static_bytes - movable
        if resident > budgets[d]:
            what = ("parameters and gradients" if not streamable else "the weights streaming holds") if movable \
                else "parameters and optimizer states"
            return PlanResult(plan=c.to_plan(), sim=dataclasses.replace(base, budget_bytes=list(budgets)),
                              fits=False, planning_s=time.perf_counter() - t0,
                              reason=f"device {d} (stage {s}): {what}"
                                     f"{' (with the embedding or head and their activations)' if st.fixed_bytes else ''}"
                                     f" alone take {resident} bytes, {resident - budgets[d]} over "
                                     f"its budget of {budgets[d]} bytes")
    c.build_queues(idle_times(profile, base))
    sim = c.fit(base)
    if stream and not sim.overflow(budgets):
        sim = c.unstream(sim)
    if not sim.overflow(budgets):
        sim = c.d2d(sim, min_gain)
        sim = c.model_d2d(sim, min_gain)
    return _result(c.to_plan(), sim, budgets, t0, c.stage_on,
                   " with every layer compacted" if sim.overflow(budgets) else "")


def offload_everything(profile: PipelineProfile, mapping: list[int] | None = None) -> Plan:
    """The ZeRO-Infinity-style baseline: every layer's optimizer states in host memory and its
    optimizer step on the CPU, every layer's activations recomputed (activation checkpointing).
    (ZeRO-Infinity also streams the fp16 weights from host memory layer by layer, which only adds
    traffic; this baseline keeps them on the device, so it is scored generously.)"""
    decisions, model = [], []
    for s, st in enumerate(profile.stages):
        for lp in st.layers:
            if lp.saved_bytes:
                decisions.append(Decision(stage=s, layer=lp.index, technique="recompute"))
            if lp.state_bytes:
                model.append(ModelDataDecision(stage=s, layer=lp.index, technique="host",
                                               step_on="host" if lp.host_step_s else "device"))
    return Plan(decisions=decisions, mapping=list(mapping or []), model_data=model)


def plan(profile: PipelineProfile, topology: Topology, *, budget_bytes: int | list[int] | None = None,
         mapping: list[int] | None = None, search_mapping: bool = True,
         min_gain: float = 0.01, host_memory_bytes: int | None = None, host_steps: bool = True) -> PlanResult:
    """Compaction plan for `profile` on `topology` within `budget_bytes` per device (default: each
    device's memory) and `host_memory_bytes` of host memory for swapped activations and optimizer
    states (default: no limit). A given `mapping` is kept as is; without one the identity is the
    start and, with `search_mapping`, a searched mapping competes with it. `host_steps` False keeps
    every optimizer step on its device."""
    t0 = time.perf_counter()
    budgets = _budgets(budget_bytes, topology)
    S = len(profile.stages)
    if S > topology.devices:
        raise ValueError(f"{S} stages need {S} devices, topology {topology.name} has {topology.devices}")
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    start = list(mapping) if mapping else list(range(S))
    base = simulate(profile, Plan(mapping=start), topology)
    candidates = [start]
    if mapping is None and search_mapping and base.overflow(budgets):
        found = search_stage_mapping(profile, topology, budgets, base)
        if found != start:
            candidates.append(found)
    # streaming weights slows every forward and backward of a layer: it is the last resort, tried
    # for a mapping only when no plan without it fits
    results = []
    for m in candidates:
        result = _compact(profile, topology, budgets, m, min_gain, base if m == start else None, t0,
                          host_memory_bytes, host_steps, stream=False)
        if not result.fits:
            result = _compact(profile, topology, budgets, m, min_gain, base if m == start else None, t0,
                              host_memory_bytes, host_steps, stream=True)
        results.append(result)
    best = min(results, key=lambda r: (not r.fits, r.sim.step_time_s if r.fits else
                                       sum(x for _, x in r.sim.overflow())))
    if host_steps:  # the greedy search must not lose to offloading everything where that fits
        everything = offload_everything(profile, best.plan.mapping)
        held = sum(lp.state_bytes for st in profile.stages for lp in st.layers)
        if host_memory_bytes is None or held <= host_memory_bytes:
            sim = simulate(profile, everything, topology)
            if not sim.overflow(budgets) and (not best.fits or sim.step_time_s < best.sim.step_time_s):
                best = _result(everything, sim, budgets, t0, {d: s for s, d in enumerate(best.plan.mapping)}, "")
    best.planning_s = time.perf_counter() - t0
    log.info("planned %d stages in %.3f s: %s, step %.4f s", S, best.planning_s, best.reason,
             best.sim.step_time_s)
    return best

