"""The ring's bookkeeping: which slot holds which expert, what to evict, how good the guesses are.

Plain Python: no threads, no tensors, no I/O. `inference.offload.expert_ring.OffloadedExperts` calls it under its
lock and carries out its decisions (reads, copies); tests drive it with exact orders.

A slot's life: `take` gives a LOADING slot (evicting a victim if none is free); the mover reads
the expert and, for a copying ring, issues the copy and calls `issued` (compute may use the slot
from then on: it waits on the copy's event, not the host); `landed` once the copy is done (only
a landed slot may be evicted, so two copies never race into one buffer); `hand_out` / `give_back`
bracket a layer's use. `drop` frees a slot whose load failed or was abandoned.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from storage.keys import ExpertKey

log = logging.getLogger(__name__)


class SlotState(enum.Enum):
    """Where a ring slot is in its lifecycle."""

    LOADING = "loading"  # being read from the CPU tier; nothing to wait on yet
    ISSUED = "issued"  # its copy is on the copy stream: usable by compute after the copy's event
    READY = "ready"  # its bytes are in place (or held in place): usable, and evictable when idle


@dataclass(eq=False)
class SlotRecord:
    """One expert in the ring."""

    key: ExpertKey
    index: int  # which slot buffer
    state: SlotState = SlotState.LOADING
    pins: int = 0  # layers using it right now
    prefetched: bool = False  # brought in by a prediction, not yet used
    use_seen: bool = False  # the CPU tier already counted its next use (a demand read filled it)
    last_use: int = 0

    @property
    def usable(self) -> bool:
        """Compute may use it (after waiting on its copy, if one is in flight)."""
        return self.state is not SlotState.LOADING


class RingBook:
    """Slots of the ring, the current layer's needed set, and the victim rule.

    Victim: among landed, unpinned slots the current layer does not need, the one whose layer runs
    furthest in the future; a guess for the very next layer only when nothing else is left; ties go
    to the least recently used.
    """

    def __init__(self, slots: int, moe_layers: list[int]) -> None:
        if slots < 2:
            raise ValueError(f"ring_slots must be >= 2 (one computing, one loading), got {slots}")
        if not moe_layers:
            raise ValueError("a ring needs at least one MoE layer")
        self.slots = slots
        self.moe_layers = list(moe_layers)
        self._order = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.records: dict[ExpertKey, SlotRecord] = {}
        self.free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.needed: set[ExpertKey] = set()
        self.current_layer = self.moe_layers[0]
        self._clock = 0

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self.records

    def get(self, key: ExpertKey) -> SlotRecord | None:
        """The slot holding or loading `key`."""
        return self.records.get(key)

    def begin_layer(self, layer: int, keys: list[ExpertKey]) -> None:
        """A layer starts: its experts are needed until handed out, and never evicted meanwhile."""
        self.current_layer = layer
        self.needed = set(keys)

    def distance(self, layer: int) -> int:
        """How many MoE layers until `layer` runs again, counting from the current one."""
        return (self._order[layer] - self._order[self.current_layer]) % len(self.moe_layers)

    def victim(self) -> SlotRecord | None:
        """The slot to evict next, or None when every slot is busy."""
        best = None
        for r in self.records.values():
            if r.state is not SlotState.READY or r.pins or r.key in self.needed:
                continue
            d = self.distance(r.key.layer)
            rank = (r.prefetched and d == 1, -d, r.last_use)
            if best is None or rank < best[0]:
                best = (rank, r)
        return best[1] if best else None

    def take(self, key: ExpertKey) -> tuple[SlotRecord, SlotRecord | None] | None:
        """A LOADING slot for `key` and the record it evicted (if any); None when `key` already has
        a slot or no slot can be freed now."""
        if key in self.records:
            return None
        evicted = None
        if not self.free:
            evicted = self.victim()
            if evicted is None:
                return None
            self._release(evicted)
        record = SlotRecord(key=key, index=self.free.pop())
        self.records[key] = record
        return record, evicted

    def issued(self, key: ExpertKey) -> None:
        """Its copy is issued: compute may use it (after the copy's event)."""
        self.records[key].state = SlotState.ISSUED

    def landed(self, key: ExpertKey) -> None:
        """Its bytes are in place."""
        r = self.records.get(key)
        if r is not None:
            r.state = SlotState.READY

    def drop(self, key: ExpertKey) -> SlotRecord | None:
        """Free the slot of a load that failed or was abandoned."""
        r = self.records.get(key)
        if r is not None:
            self._release(r)
        return r

    def _release(self, record: SlotRecord) -> None:
        del self.records[record.key]
        self.free.append(record.index)

    def hand_out(self, key: ExpertKey) -> bool:
        """Pin `key` for the current layer's use. Returns whether the CPU tier has not seen this use
        (a ring hit, or a right guess): its policy must be told."""
        r = self.records[key]
        r.pins += 1
        unseen = not r.use_seen
        r.use_seen = r.prefetched = False
        self.needed.discard(key)
        self._clock += 1
        r.last_use = self._clock
        return unseen

    def give_back(self, key: ExpertKey) -> None:
        """The layer is done with `key` (its compute is queued)."""
        self.records[key].pins -= 1

    def evict_all_idle(self) -> list[SlotRecord]:
        """Release every landed, unpinned slot (shutdown); returns them."""
        gone = [r for r in self.records.values() if r.state is SlotState.READY and not r.pins]
        for r in gone:
            self._release(r)
        return gone


@dataclass(kw_only=True)
class RingCounters:
    """Per-request counters; turned into the reported stats by `OffloadedExperts.request_stats`."""

    uses: int = 0  # (layer, expert) uses
    ring_hits: int = 0  # found in the ring (usable or still loading)
    ssd_ideal_bytes: int = 0  # bytes of used experts that had to come from SSD
    device_copy_bytes: int = 0
    predicted: int = 0
    predicted_used: int = 0
    routed: int = 0
    routed_predicted: int = 0
    ssd_bytes_at_start: int = 0
    cpu_hits_at_start: int = 0
    cpu_lookups_at_start: int = 0


class GuessTracker:
    """Next-layer predictions and how often they are right.

    `predicted` records, per layer, the guessed experts and whether each was in the CPU cache when
    guessed; `account` judges them when the layer runs, and adds the layer's uses to the counters.
    `precision` (an EMA over visits, judged after 8) gates reading guesses from SSD.
    """

    JUDGE_AFTER = 8

    def __init__(self, min_precision: float) -> None:
        self.min_precision = min_precision
        self.counters = RingCounters()
        self.pending: dict[int, dict[int, bool]] = {}  # layer -> {expert: was in the CPU cache}
        self.read_ahead: set[ExpertKey] = set()  # read before any use asked for it
        self.precision: float | None = None
        self._ema = 0.0
        self._visits = 0

    def reset(self, counters: RingCounters) -> None:
        """Start a request's counters (predictions and precision carry over)."""
        self.counters = counters

    def speculate(self, known: bool) -> bool:
        """Whether guesses not in the CPU cache may be read from SSD."""
        if known or self.min_precision <= 0:
            return True
        return self.precision is not None and self.precision >= self.min_precision

    def predicted(self, layer: int, cached: dict[int, bool]) -> None:
        """Guesses for `layer` (in rank order) and whether each was cached."""
        self.pending[layer] = dict(cached)
        self.counters.predicted += len(cached)

    def guesses(self, layer: int) -> dict[int, bool]:
        """The pending guesses for `layer`."""
        return self.pending.get(layer, {})

    def account(self, layer: int, experts: list[int], *, in_ring: set[int], cached: dict[int, bool],
                nbytes: dict[int, int]) -> None:
        """Counters for one layer visit: `in_ring` the experts found in the ring, `cached` whether
        each was in the CPU cache now, `nbytes` each expert's bytes."""
        c = self.counters
        predicted = self.pending.pop(layer, None)
        for e in experts:
            key = ExpertKey(layer, e)
            c.uses += 1
            c.ring_hits += e in in_ring
            # An oracle reads each expert once per stay in the cache: this use needed an SSD read
            # unless an earlier use left the expert cached (a guess read ahead of this use counts).
            was_cached = predicted[e] if predicted is not None and e in predicted else cached[e]
            if not was_cached or key in self.read_ahead:
                c.ssd_ideal_bytes += nbytes[e]
            self.read_ahead.discard(key)
        if predicted is None:
            return
        used = sum(1 for e in experts if e in predicted)
        c.predicted_used += used
        c.routed += len(experts)
        c.routed_predicted += used
        if predicted:
            p = used / len(predicted)
            self._visits += 1
            self._ema = p if self._visits == 1 else 0.9 * self._ema + 0.1 * p
            if self._visits >= self.JUDGE_AFTER:
                self.precision = self._ema


class RoutingReplay:
    """A perfect next-layer predictor, for benchmarks: the routing of an earlier run of the same
    request, replayed. Offloaded generation is deterministic, so the layer visits repeat exactly;
    the replay shows how fast the engine is when the next layer's experts are known one layer
    ahead, the ceiling of any predictor. Record with `RoutingReplay()` installed as
    `OffloadedExperts.replay`, then install `RoutingReplay(recorded.visits)` on a fresh engine. A
    replay stops predicting at the first visit that differs from the record."""

    def __init__(self, visits: list[tuple[int, list[int]]] | None = None) -> None:
        self.recording = visits is None
        self.visits: list[tuple[int, list[int]]] = [] if visits is None else [(v[0], list(v[1])) for v in visits]
        self._cursor = 0
        self.diverged = False

    def seen(self, layer: int, experts: list[int]) -> None:
        """A layer visit with its routed experts (called as the visit starts)."""
        if self.recording:
            self.visits.append((layer, list(experts)))
            return
        if self.diverged or self._cursor >= len(self.visits):
            return
        if self.visits[self._cursor] != (layer, list(experts)):
            log.warning("routing replay: visit %d differs from the record (layer %d, experts %s); "
                        "no more predictions", self._cursor, layer, experts)
            self.diverged = True
            return
        self._cursor += 1

    def upcoming(self, layer: int) -> list[int]:
        """The experts the next visit uses, if it is a visit of `layer`; else none."""
        if self.recording or self.diverged or self._cursor >= len(self.visits):
            return []
        nxt, experts = self.visits[self._cursor]
        return list(experts) if nxt == layer else []

