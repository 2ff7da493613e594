"""Ring-memory expert offload: SSD -> CPU cache -> a ring of K expert slots in device memory.

`OffloadedExperts` is the expert provider installed in every MoE layer of a model loaded without
its experts. For each layer it hands out the routed experts as they become ready while the rest
are still being read, and it predicts the next MoE layer's experts by applying that layer's router
to the current hidden state, so their reads and copies overlap this layer's compute. Ring slots
keep experts across tokens; a slot is never taken from an expert the current layer still needs.

On a GPU, slots are device buffers refilled by `CudaCopyStream` from pinned CPU-cache buffers. Where
the device is the CPU, a slot holds the CPU-cache entry itself (pinned): nothing is copied that can
be used in place. Either way the same bookkeeping runs.
"""

from __future__ import annotations

import enum
import logging
import threading
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Iterator

import torch

from semoe.gating import route_topk
from semoe.model import ExpertWeights, MoEGPT
from storage.prefetch import PrefetchQueue, PrefetchQueueConfig
from storage.store import Store
from storage.streams import make_copy_stream
from storage.tiered import TieredExpertStore, TieredStoreConfig

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (layer, expert)
URGENT, SOON, LATER = 0.0, 1.0, 2.0  # queue priorities: needed now, next layer, speculative


class SlotState(enum.Enum):
    """Where a ring slot is in its lifecycle."""

    LOADING = "loading"
    READY = "ready"


@dataclass(eq=False)
class Slot:
    """One expert in the ring."""

    key: Key
    index: int  # which device buffer (GPU); unused in place
    state: SlotState = SlotState.LOADING
    pins: int = 0  # users right now (the layer computing with it)
    prefetched: bool = False  # brought in by a prediction, not yet used
    counted: bool = False  # the CPU cache saw the next use already (a demand `get` filled the slot)
    weights: ExpertWeights | None = None
    host: object | None = None  # the CPU-cache handle the slot holds (in place) or copies from
    error: BaseException | None = None
    last_use: int = 0


@dataclass(kw_only=True)
class RingCounters:
    """Per-request counters; turned into the reported stats by `OffloadedExperts.request_stats`."""

    uses: int = 0  # (layer, expert) uses
    ring_hits: int = 0  # found in the ring (ready or already loading)
    ssd_ideal_bytes: int = 0  # bytes of used experts that had to come from SSD
    device_copy_bytes: int = 0
    predicted: int = 0
    predicted_used: int = 0
    routed: int = 0
    routed_predicted: int = 0
    ssd_bytes_at_start: int = 0
    cpu_hits_at_start: int = 0
    cpu_lookups_at_start: int = 0
    predictions: dict = field(default_factory=dict)  # layer -> {expert: was cached in CPU when predicted}


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


class OffloadedExperts:
    """The expert provider of an offloaded model (one instance serves every MoE layer)."""

    def __init__(self, model: MoEGPT, store: Store, *, device: torch.device, dtype: torch.dtype,
                 cpu_cache_bytes: int, ring_slots: int, prefetch: bool = True, read_mode: str = "direct",
                 workers: int = 4, min_precision: float = 0.8, cache_policy: str = "next-use") -> None:
        self.config = model.config
        self.device = device
        self.dtype = dtype
        self.store = store
        self.prefetch_enabled = prefetch
        self.moe_layers = model.config.moe_layer_ids
        self._next_layer = {a: b for a, b in zip(self.moe_layers, self.moe_layers[1:])}
        self._routers = {f.layer: f for f in model.moe_layers()}
        chunks = store.manifest.chunks
        self.chunk_bytes = {(c.layer, c.expert): c.bytes for c in chunks if c.kind == "weight"}
        self.tier = TieredExpertStore(store, TieredStoreConfig(cpu_cache_bytes=cpu_cache_bytes, read_mode=read_mode,
                                                               prefetch_workers=2, policy=cache_policy))
        if ring_slots < 2:
            raise ValueError(f"ring_slots must be >= 2 (one computing, one loading), got {ring_slots}")
        self.ring_slots = ring_slots
        first = store.manifest.chunk(*next(iter(self.chunk_bytes)))
        self._store_dtype = store.manifest.chunk_tensors(first)[0].dtype
        self.in_place = device.type == "cpu" and str(self._store_dtype) == _manifest_dtype(dtype)
        self._copier = None if self.in_place else make_copy_stream(device)
        self._buffers: list[torch.Tensor] = []
        if device.type == "cuda":
            biggest = max(self.chunk_bytes.values())
            self._buffers = [torch.empty(biggest, dtype=torch.uint8, device=device) for _ in range(ring_slots)]
        self._slots: dict[Key, Slot] = {}
        self._needed: set[Key] = set()  # the current layer's experts not yet handed out: never evicted
        self._errors: dict[Key, BaseException] = {}  # failed loads, raised to the layer that needs them
        self._free = list(range(ring_slots))
        self._cond = threading.Condition()
        self._clock = 0
        self._current_layer = self.moe_layers[0] if self.moe_layers else 0
        self.queue = PrefetchQueue(PrefetchQueueConfig(workers=workers))
        self.counters = RingCounters()
        self._closed = False
        self.min_precision = min_precision
        self._read_ahead: set[Key] = set()  # read before any use asked for it (warm-up, guesses)
        self.precision: float | None = None  # running precision of next-layer guesses, once judged
        self._precision_ema = 0.0
        self._visits = 0
        self.replay: RoutingReplay | None = None  # benchmarks: predict from a recorded run

    @classmethod
    def attach(cls, model: MoEGPT, store_path: str, config) -> "OffloadedExperts":
        """Build from an EngineConfig and install as the provider of every MoE layer of `model`."""
        store = Store.open(store_path)
        device = torch.device(config.device)
        expert_bytes = sum(c.bytes for c in store.manifest.chunks if c.kind == "weight")
        biggest = max(c.bytes for c in store.manifest.chunks if c.kind == "weight")
        top_k = model.config.top_k
        if config.ring_slots is not None:
            slots = config.ring_slots
        elif config.device_memory_bytes is not None and device.type == "cuda":
            slots = config.device_memory_bytes // biggest
            if slots < 2:
                raise ValueError(f"--device-memory {config.device_memory_bytes} bytes holds {slots} expert(s) of "
                                 f"{biggest} bytes; at least 2 are needed")
        else:  # the current layer's experts plus the next layer's predicted ones
            slots = 2 * top_k
        cpu = config.cpu_cache_bytes if config.cpu_cache_bytes is not None else expert_bytes
        if device.type == "cpu":
            # in place, ring slots are CPU-cache entries: the cache must hold the ring and room to spare
            cpu = max(cpu, (slots + top_k) * biggest)
        self = cls(model, store, device=device, dtype=getattr(torch, config.dtype), cpu_cache_bytes=cpu,
                   ring_slots=slots, prefetch=config.prefetch, read_mode=config.read_mode,
                   min_precision=config.speculate_min_precision, cache_policy=config.cache_policy)
        for ffn in model.moe_layers():
            ffn.use_experts(self)
        log.info("offload: %d ring slots, CPU cache %d bytes, %s", slots, cpu,
                 "in place" if self.in_place else f"copies to {device}")
        return self

    # -- bookkeeping (plain Python, under the lock) ----------------------------------------------
    def _distance(self, layer: int) -> int:
        """How many MoE layers until `layer` runs again, counting from the current one."""
        n = len(self.moe_layers)
        return (self.moe_layers.index(layer) - self.moe_layers.index(self._current_layer)) % n

    def _victim(self) -> Slot | None:
        """The ready, unpinned, unneeded slot used furthest in the future (ties: least recently used)."""
        best = None
        for s in self._slots.values():
            if s.state is not SlotState.READY or s.pins or s.key in self._needed:
                continue
            rank = (s.prefetched and self._distance(s.key[0]) == 1, -self._distance(s.key[0]), s.last_use)
            if best is None or rank < best[0]:
                best = (rank, s)
        return best[1] if best else None

    def _take_slot(self, key: Key, *, wait: bool) -> Slot | None:
        """A slot for `key` (LOADING); evicts a victim; waits for one only if `wait`."""
        with self._cond:
            while True:
                if key in self._slots:
                    return None  # someone else is loading or holds it
                if self._free:
                    index = self._free.pop()
                    break
                victim = self._victim()
                if victim is not None:
                    self._evict_locked(victim)
                    index = self._free.pop()
                    break
                if not wait or self._closed:
                    return None
                self._cond.wait()
            slot = Slot(key=key, index=index)
            self._slots[key] = slot
            return slot

    def _evict_locked(self, slot: Slot) -> None:
        del self._slots[slot.key]
        self._free.append(slot.index)
        if slot.host is not None:
            slot.host.release()
            slot.host = None

    # -- data movement (on the queue's worker threads) -------------------------------------------
    def _fill(self, key: Key, wait: bool) -> None:
        slot = self._take_slot(key, wait=wait)
        if slot is None:
            return
        try:
            # a fill that may wait is for the current layer; the others are predictions
            host = self.tier.get(key[0], key[1], speculative=not wait)
            slot.counted = wait
            slot.weights, copied = self._place(host, slot)
            if copied:
                host.release()
            else:
                slot.host = host
            with self._cond:
                slot.state = SlotState.READY
                self.counters.device_copy_bytes += self.chunk_bytes[key] if copied else 0
                self._cond.notify_all()
        except BaseException as e:
            # a wrong guess abandoned by `stream`: nothing waits for it, nothing failed
            abandoned = not wait and isinstance(e, CancelledError)
            with self._cond:
                if not abandoned:
                    slot.error = e
                    self._errors[key] = e
                self._slots.pop(key, None)
                self._free.append(slot.index)
                self._read_ahead.discard(key)
                self._cond.notify_all()
            if not abandoned:
                raise

    def _place(self, host, slot: Slot) -> tuple[ExpertWeights, bool]:
        """Expert weights usable on the device: the host tensors themselves, or copies."""
        gate, up, down = (host.tensors[n] for n in self._names(slot.key))
        if self.in_place:
            return ExpertWeights(gate, up, down), False
        if self._buffers:  # GPU: raw bytes into the slot's buffer on the copy stream, then views
            chunk = self.store.manifest.chunk(*slot.key)
            buf = self._buffers[slot.index]
            self._copier.copy_to_device(host.buffer.tensor[:chunk.bytes], buf[:chunk.bytes]).synchronize()
            views = self.store.chunk_views(chunk, buf)
            gate, up, down = (views[n].to(self.dtype) for n in self._names(slot.key))
            return ExpertWeights(gate, up, down), True
        return ExpertWeights(*(t.to(self.device, self.dtype) for t in (gate, up, down))), True

    def _names(self, key: Key) -> tuple[str, str, str]:
        from semoe.checkpoint import hf_expert_names

        return hf_expert_names(self.config, key[0], key[1])

    def _request(self, key: Key, priority: float, *, wait: bool) -> None:
        """Queue a fill (deduplicated by key; a more urgent request moves a queued one forward)."""
        if key not in self._slots:
            self.queue.submit(("fill", key), lambda: self._fill(key, wait), priority=priority)

    # -- the provider ---------------------------------------------------------------------------
    def stream(self, layer: int, experts: list[int], x_ND: torch.Tensor) -> Iterator[tuple[int, ExpertWeights]]:
        """Hand out the layer's experts as they become ready; predict and prefetch the next layer."""
        with self._cond:
            self._current_layer = layer
            guessed = self.counters.predictions.get(layer, {})
            self._account(layer, experts)
            self._needed = {(layer, e) for e in experts}
            for e in experts:
                self._errors.pop((layer, e), None)
        if self.replay is not None:
            self.replay.seen(layer, experts)
        # the routing is known: guesses still being read are either needed now or wasted bandwidth
        wrong = [(layer, e) for e in guessed if e not in experts]
        for key in wrong:
            self.queue.cancel(("fill", key))
        self.tier.cancel_guesses(wrong)
        for e in experts:
            self.tier.hurry(layer, e)
            self._request((layer, e), URGENT, wait=True)
        if self.prefetch_enabled:
            self._predict(layer, x_ND)
        pending = set(experts)
        while pending:
            with self._cond:
                while True:
                    ready = [e for e in pending if (s := self._slots.get((layer, e))) is not None
                             and s.state is SlotState.READY]
                    if ready:
                        break
                    for e in pending:
                        err = self._errors.pop((layer, e), None)
                        if err is not None:
                            raise err
                        if (layer, e) not in self._slots:  # its fill has not started or was dropped
                            self._request((layer, e), URGENT, wait=True)
                    self._cond.wait(timeout=0.05)
                e = min(ready)
                slot = self._slots[(layer, e)]
                slot.pins += 1
                if not slot.counted:  # a ring hit or a right guess: the CPU cache's policy must see the use
                    self.tier.record_use(layer, e)
                slot.counted = slot.prefetched = False
                self._needed.discard((layer, e))
                self._clock += 1
                slot.last_use = self._clock
            try:
                yield e, slot.weights
            finally:
                with self._cond:
                    slot.pins -= 1
                    pending.discard(e)
                    self._cond.notify_all()

    def _predict(self, layer: int, x_ND: torch.Tensor) -> None:
        """Apply the next MoE layer's router to this layer's input; prefetch the experts it picks."""
        nxt = self._next_layer.get(layer)
        if nxt is None:
            return
        known = self.replay is not None and not self.replay.recording
        if known:
            picked = self.replay.upcoming(nxt)
        else:
            with torch.no_grad():
                r = route_topk(self._routers[nxt].router(x_ND), self.config.top_k, normalize=False)
            # most-picked first: with a long prompt the union may exceed the ring
            counts = torch.bincount(r.ids_TK.flatten(), minlength=self.config.num_experts).tolist()
            picked = sorted((e for e, n in enumerate(counts) if n), key=lambda e: -counts[e])
        with self._cond:
            cached = {e: self.tier.cached(nxt, e) for e in picked}
            self.counters.predictions[nxt] = cached
            self.counters.predicted += len(picked)
            # A guess read from SSD uses only the disk's idle time (the tier pauses it while a
            # needed read is in flight) and is abandoned once the layer's routing proves it wrong,
            # so a wrong guess costs the bytes read in that idle time. `min_precision` can still
            # switch guessing off for a model whose guesses are mostly wrong. Guesses already in
            # the CPU cache cost no SSD bandwidth and are always staged (on a GPU that is the
            # host-to-device copy).
            speculate = known or self.min_precision <= 0 or (self.precision is not None and
                                                             self.precision >= self.min_precision)
        for rank, e in enumerate(picked[:self.ring_slots]):
            if (nxt, e) in self._slots or not (speculate or (cached[e] and not self.in_place)):
                continue
            if not cached[e]:
                with self._cond:
                    self._read_ahead.add((nxt, e))
            self._request((nxt, e), SOON + rank / 1000, wait=False)
            with self._cond:
                s = self._slots.get((nxt, e))
                if s is not None:
                    s.prefetched = True

    def _account(self, layer: int, experts: list[int]) -> None:
        """Counters for one layer visit (caller holds the lock)."""
        c = self.counters
        predicted = c.predictions.pop(layer, None)
        for e in experts:
            key = (layer, e)
            c.uses += 1
            if key in self._slots:
                c.ring_hits += 1
            # An oracle reads each expert once per stay in the cache: this use needed an SSD read
            # unless an earlier use left the expert cached (a guess read ahead of this use counts).
            was_cached = predicted[e] if predicted is not None and e in predicted else self.tier.cached(*key, "weight")
            if not was_cached or key in self._read_ahead:
                c.ssd_ideal_bytes += self.chunk_bytes[key]
            self._read_ahead.discard(key)
        if predicted is not None:
            used = sum(1 for e in experts if e in predicted)
            c.predicted_used += used
            c.routed += len(experts)
            c.routed_predicted += used
            if predicted:
                p = used / len(predicted)
                self._visits += 1
                self._precision_ema = p if self._visits == 1 else 0.9 * self._precision_ema + 0.1 * p
                if self._visits >= 8:  # enough guesses to judge
                    self.precision = self._precision_ema

    # -- reporting --------------------------------------------------------------------------------
    def warm_idle(self, *, in_request: bool = True) -> int:
        """Read experts not yet cached into the CPU cache's free room, at the lowest priority.

        Only what fits without evicting anything: with a cache as large as the experts, the whole
        model ends up resident; with a small one, nothing is read speculatively.
        """
        free = self.tier.cache.capacity_bytes - self.tier.cache.used_bytes
        keys = []
        for layer in self.moe_layers:
            for e in range(self.config.num_experts):
                nbytes = self.chunk_bytes[(layer, e)]
                if nbytes <= free and not self.tier.cached(layer, e):
                    keys.append((layer, e))
                    free -= nbytes
        started = self.tier.prefetch(keys, priority=LATER) if keys else []
        if in_request:  # reads while loading belong to the load, not to a request's traffic
            with self._cond:
                self._read_ahead.update((layer, e) for layer, e, _ in started)
        return len(started)

    def begin_request(self) -> None:
        """Start counting for one request, and fill idle cache room."""
        self.warm_idle()
        s = self.tier.stats()
        with self._cond:
            self.counters = RingCounters(ssd_bytes_at_start=s.ssd_bytes, cpu_hits_at_start=s.hits + s.inflight_hits,
                                         cpu_lookups_at_start=s.hits + s.inflight_hits + s.misses)

    def request_stats(self, *, tokens: int) -> dict:
        """The counters of the request since `begin_request`, per generated token where it says so."""
        self.queue_drain()
        s = self.tier.stats()
        c = self.counters
        lookups = s.hits + s.inflight_hits + s.misses - c.cpu_lookups_at_start
        per = max(tokens, 1)
        return {
            "gpu_hit_rate": c.ring_hits / c.uses if c.uses else 0.0,
            "cpu_hit_rate": (s.hits + s.inflight_hits - c.cpu_hits_at_start) / lookups if lookups else 0.0,
            "ssd_bytes_per_token": (s.ssd_bytes - c.ssd_bytes_at_start) / per,
            "device_copy_bytes_per_token": c.device_copy_bytes / per,
            "ideal_bytes_per_token": c.ssd_ideal_bytes / per,
            "prefetch_precision": c.predicted_used / c.predicted if c.predicted else 0.0,
            "prefetch_recall": c.routed_predicted / c.routed if c.routed else 0.0,
        }

    def traffic(self) -> tuple[int, int]:
        """(bytes read from SSD so far, ideal bytes of the current request so far): two snapshots split a
        request into phases."""
        with self._cond:
            ideal = self.counters.ssd_ideal_bytes
        return self.tier.stats().ssd_bytes, ideal

    def queue_drain(self) -> None:
        """Cancel speculative fills still queued (a finished request does not need them)."""
        self.queue.cancel_all()

    def close(self) -> None:
        """Stop the threads and release every slot."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.queue.close(wait=True)
        with self._cond:
            for s in list(self._slots.values()):
                if s.state is SlotState.READY:
                    self._evict_locked(s)
        self.tier.close()


def _manifest_dtype(dtype: torch.dtype) -> str:
    from storage.dtypes import dtype_name

    return dtype_name(dtype)

