"""Ring-memory expert offload: SSD -> CPU cache -> a ring of K expert slots in device memory.

`OffloadedExperts` is the expert provider installed in every MoE layer of a model loaded without
its experts. For each layer it hands out the routed experts as they become ready while the rest
are still being read, and it prefetches the experts `inference.offload.next_layer_predictor` expects the next MoE
layer to use (that layer's router applied to the current hidden state), so their reads and copies
overlap this layer's compute. Ring slots keep experts across tokens; a slot is never taken from an
expert the current layer still needs.

What to do is decided by `inference.offload.ring_bookkeeping` (slots, victims, guesses, counters); this module
carries it out. A copying ring gives each slot its own buffer in device memory, filled by the
copy stream from the CPU-cache buffer (plain tensors cast to the compute dtype on the way when the
store's differs; compact codes and scales copied as stored, so a slot holds the compact bytes);
the copy into a slot waits only for the event recorded after the slot's last reader,
and compute waits only for that copy's event. On a GPU that is the only mode; on CPU it runs when
the device memory is budgeted (`--device-memory`) or the dtypes differ, through the same calls
(the copy stream is a worker thread). Otherwise, on CPU, a slot holds the CPU-cache entry itself
and nothing is copied: the same bookkeeping, without the copies.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Iterator

import torch

from inference.engine_config import EngineConfig
from inference.memory_guard import CPU_CACHE_AUTO, MemoryGuard, cpu_cache_size
from inference.offload.next_layer_predictor import NextLayerPredictor
from inference.offload.ring_bookkeeping import GuessTracker, RingBook, RingCounters, RoutingReplay, SlotRecord
from semoe.model.expert_layout import ExpertLayout, TensorSlice, expert_layouts, expert_weights, place, placed_bytes
from semoe.model.experts import ExpertWeights, expert_mlp
from semoe.model.moe_gpt import MoEGPT
from storage.dtypes import dtype_name, torch_dtype
from storage.keys import ExpertKey
from storage.io_queue import PrefetchQueue, PrefetchQueueConfig, Priority
from storage.store import Store
from storage.streams import COMPLETE, CopyHandle, CopyStream, StreamEvent, make_copy_stream
from storage.tiered_experts import ExpertHandle, TieredExpertStore, TieredStoreConfig

log = logging.getLogger(__name__)

FILL_WORKERS = 4  # threads filling ring slots (each waits on the tier's reads or a copy, not the CPU)

__all__ = ["OffloadedExperts", "RoutingReplay"]


class _SlotMemory:
    """Moves an expert into a slot: per-slot buffers, the copy stream, and each slot's last-reader event.

    A buffer of its own per slot, where the expert is placed as `semoe.model.expert_layout.place` says
    (plain floating tensors cast to the compute dtype on the copy stream, compact codes and scales
    copied as stored): a copy into one never touches another, inside the ring's budget."""

    def __init__(self, copier: CopyStream, slots: int, nbytes: int, dtype: torch.dtype) -> None:
        self.copier = copier
        self.dtype = dtype
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=copier.device) for _ in range(slots)]
        self.last_reader: list[StreamEvent] = [COMPLETE] * slots

    def fill(self, index: int, raw: torch.Tensor, layout: ExpertLayout, dst: tuple[TensorSlice, ...]
             ) -> list[CopyHandle]:
        """Issue the copies of one expert into slot `index` (its tensors to `dst`, as `place` put them),
        after the slot's last reader."""
        after, buf = self.last_reader[index], self.buffers[index]
        handles = [self.copier.copy(s.view(raw), d.view(buf), cast=True, after=after)
                   for s, d in zip(layout.tensors, dst)]
        return handles

    def read_done(self, index: int) -> None:
        """The compute that reads slot `index` is queued: later copies into it wait for this point."""
        self.last_reader[index] = self.copier.record_compute()


@dataclass(eq=False)
class _Loaded:
    """What the mover keeps per slot: the weights compute uses, the copies to wait on, the CPU-cache
    handle (held while a slot uses it in place, or until its copy is done)."""

    weights: ExpertWeights
    copies: list[CopyHandle]
    host: ExpertHandle | None


class OffloadedExperts:
    """The expert provider of an offloaded model (one instance serves every MoE layer)."""

    ALWAYS_COPIES = False  # a subclass whose slots are device memory on CPU too (`inference.offload.hybrid`)

    def __init__(self, model: MoEGPT, store: Store, settings: EngineConfig, *, cpu_cache_bytes: int, ring_slots: int,
                 copies: bool, grow_to: int | None = None) -> None:
        """`settings`: the engine's config (device, dtype, read mode, cache policy, prefetch,
        speculation, memory guard); the budgets as `attach` sets them from it. `grow_to`: an auto
        budget, which the memory guard raises while memory is free, up to this."""
        self.config = model.config
        self.mlp = expert_mlp(model.config)
        self.device = device = torch.device(settings.device)
        self.dtype = dtype = getattr(torch, settings.dtype)
        self.store = store
        self.prefetch_enabled = settings.prefetch
        self.moe_layers = model.config.moe_layer_ids
        self.predictor = NextLayerPredictor(model)
        self.layouts = expert_layouts(store.manifest, model.config, store.root)
        self.chunk_bytes = {k: store.manifest.chunk(k.layer, k.expert, k.kind).bytes for k in self.layouts}
        self.tier = TieredExpertStore(store, TieredStoreConfig(
            cpu_cache_bytes=cpu_cache_bytes, read_mode=settings.read_mode, prefetch_workers=2,
            policy=settings.cache_policy, pin_memory=device.type == "cuda"))
        self.book = RingBook(ring_slots, self.moe_layers)
        self.ring_slots = ring_slots
        must_copy = self.must_copy(store, device, dtype)
        self.copies = copies
        if must_copy and not copies:
            raise ValueError(f"an in-place ring needs a CPU device and a {dtype} store, got {device} "
                             f"and a store of another dtype or device")
        self.in_place = not self.copies
        biggest = max(self.chunk_bytes.values())
        floor = self.least_cpu_cache(ring_slots, model.config.top_k, biggest, copies=self.copies)
        self.guard = MemoryGuard(self.tier, floor_bytes=min(floor, cpu_cache_bytes), step_bytes=biggest,
                                 ceiling_bytes=grow_to, keep_bytes=settings.keep_bytes) \
            if settings.memory_guard else None
        self.memory: _SlotMemory | None = None
        # where each expert's tensors lie in the memory compute reads: a slot's buffer when copying
        # (placed once here, not at every fill), else the CPU-cache entry, which is the chunk itself
        placed = {k: place(layout, dtype) for k, layout in self.layouts.items()} if self.copies else {}
        self.compute_slices = {k: placed[k][0] if self.copies else layout.tensors for k, layout in self.layouts.items()}
        if self.copies:
            nbytes = max(size for _, size in placed.values())
            self.memory = _SlotMemory(make_copy_stream(device), ring_slots, nbytes, dtype)
        self._loaded: dict[int, _Loaded] = {}  # slot index -> what is in it
        # in place, the weights built on a CPU-cache entry, for as long as the entry lives: a hit
        # hands out the same object (and the kernels' operands derived from it) without rebuilding
        self._entry_weights: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._errors: dict[ExpertKey, BaseException] = {}  # failed loads, raised to the layer that needs them
        self._cond = threading.Condition()
        self.queue = PrefetchQueue(PrefetchQueueConfig(workers=FILL_WORKERS))
        self.guesses = GuessTracker(settings.speculate_min_precision)
        self._closed = False

    @property
    def replay(self) -> RoutingReplay | None:
        """A recorded routing to predict from, for benchmarks (`NextLayerPredictor.replay`)."""
        return self.predictor.replay

    @replay.setter
    def replay(self, replay: RoutingReplay | None) -> None:
        self.predictor.replay = replay

    @property
    def counters(self) -> RingCounters:
        """The current request's counters."""
        return self.guesses.counters

    @property
    def precision(self) -> float | None:
        """Running precision of next-layer guesses, once judged."""
        return self.guesses.precision

    @staticmethod
    def must_copy(store: Store, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether experts must be copied into the ring: the device is not the host, or a plain
        (not compact) floating tensor of the store is not in the compute dtype."""
        m = store.manifest
        stored = {t.dtype for c in m.chunks if c.kind == "weight" for t in m.chunk_tensors(c)
                  if t.quant is None and torch_dtype(t.dtype).is_floating_point}
        return device.type != "cpu" or not stored <= {dtype_name(dtype)}

    @staticmethod
    def slot_bytes(store: Store, dtype: torch.dtype) -> int:
        """Device bytes of one slot of a copying ring: the largest expert as placed for `dtype`
        (compact tensors as stored, plain ones in the compute dtype)."""
        return placed_bytes(store.manifest, dtype)

    @staticmethod
    def least_cpu_cache(slots: int, top_k: int, biggest: int, *, copies: bool) -> int:
        """The smallest CPU cache a ring works with. In place, ring slots are CPU-cache entries: the
        cache must hold the ring and room to spare. Copying, each slot's source stays pinned in the
        cache until its copy lands: it must hold one expert per slot, or fills in flight pin the
        whole cache and a needed read cannot enter."""
        return slots * biggest if copies else (slots + top_k) * biggest

    @classmethod
    def attach(cls, model: MoEGPT, store: Store, config: EngineConfig) -> "OffloadedExperts":
        """Build from an EngineConfig and install as the provider of every MoE layer of `model`, whose
        experts are in `store` (open: the engine opens it once and hands it down)."""
        device = torch.device(config.device)
        dtype = getattr(torch, config.dtype)
        expert_bytes = sum(c.bytes for c in store.manifest.chunks if c.kind == "weight")
        biggest = max(c.bytes for c in store.manifest.chunks if c.kind == "weight")
        top_k = model.config.top_k
        if config.ring_slots is not None:
            slots = config.ring_slots
        elif config.device_memory_bytes is not None:
            slot = cls.slot_bytes(store, dtype)
            slots = config.device_memory_bytes // slot
            if slots < 2:
                raise ValueError(f"--device-memory {config.device_memory_bytes} bytes holds {slots} expert(s) of "
                                 f"{slot} bytes; at least 2 are needed")
        else:
            slots = cls.default_slots(store, config, dtype, top_k)
        # a budget of device memory is a ring in memory of its own, on CPU too
        copies = cls.ALWAYS_COPIES or config.device_memory_bytes is not None or cls.must_copy(store, device, dtype)
        least = cls.least_cpu_cache(slots, top_k, biggest, copies=copies)
        cpu = cpu_cache_size(config.cpu_cache_bytes, expert_bytes=expert_bytes, least_bytes=least,
                             keep_bytes=config.keep_bytes)
        grow_to = expert_bytes if config.cpu_cache_bytes == CPU_CACHE_AUTO else None
        if grow_to is not None:
            log.info("offload: --cpu-cache auto: %d bytes (the memory available now less a reserve, at least %d; "
                     "%d bytes of experts)", cpu, least, expert_bytes)
        self = cls(model, store, config, cpu_cache_bytes=cpu, ring_slots=slots, copies=copies, grow_to=grow_to)
        for ffn in model.moe_layers():
            ffn.use_experts(self)
        log.info("offload: %d ring slots, CPU cache %d bytes, %s", slots, cpu,
                 "in place" if self.in_place else f"copies to {device} in {dtype}")
        return self

    @classmethod
    def default_slots(cls, store: Store, config: EngineConfig, dtype: torch.dtype, top_k: int) -> int:
        """Ring slots with no budget given: the current layer's experts plus the next layer's predicted ones."""
        return 2 * top_k

    def expert_nbytes(self, layer: int, expert: int) -> int:
        """Bytes of one expert's weights as compute reads them: placed in a slot, or in the CPU cache."""
        return sum(t.nbytes for t in self.compute_slices[ExpertKey(layer, expert)])

    # -- data movement (on the queue's worker threads) -------------------------------------------
    def _fill(self, key: ExpertKey, demand: bool, *, wait: bool = True) -> bool:
        """Bring `key` into a slot. `demand`: the current layer needs it (the read may wait for a
        slot, and is a use the CPU tier counts); otherwise a guess for the next layer. `wait=False`:
        give up (False) rather than wait for a slot to free."""
        with self._cond:
            while True:
                taken = self.book.take(key)
                if taken is not None or key in self.book or not demand or not wait or self._closed:
                    break
                self._cond.wait()
            if taken is None:
                return False
            record, evicted = taken
            if evicted is not None:
                self._vacate(evicted)
        try:
            host = self.tier.get(key, speculative=not demand)
            record.use_seen = demand
            layout, dst = self.layouts[key], self.compute_slices[key]
            if self.memory is None:  # in place: the slot holds the CPU-cache entry
                loaded = _Loaded(weights=self._weights_in_place(key, host), copies=[], host=host)
            else:
                copies = self.memory.fill(record.index, host.raw, layout, dst)
                weights = expert_weights(self.memory.buffers[record.index], layout, dst, self.mlp)
                loaded = _Loaded(weights=weights, copies=copies, host=host)
            with self._cond:
                self._loaded[record.index] = loaded
                if self.memory is None:
                    self.book.landed(key)
                else:
                    self.book.issued(key)
                    self.counters.device_copy_bytes += sum(t.nbytes for t in dst)
                self._cond.notify_all()
            if self.memory is not None:
                # This worker, not compute, waits for the copy: then the source goes back to the
                # CPU cache and the slot may be chosen as a victim (never two copies into one slot).
                for h in copies:
                    h.synchronize()
                host.release()
                loaded.host = None
                with self._cond:
                    self.book.landed(key)
                    self._cond.notify_all()
        except BaseException as e:
            # a wrong guess abandoned by `stream`: nothing waits for it, nothing failed
            abandoned = not demand and isinstance(e, CancelledError)
            with self._cond:
                if not abandoned:
                    self._errors[key] = e
                if self.book.get(key) is record:
                    self.book.drop(key)
                    self._loaded.pop(record.index, None)
                self.guesses.read_ahead.discard(key)
                self._cond.notify_all()
            if not abandoned:
                raise
        return True

    def _weights_in_place(self, key: ExpertKey, host: ExpertHandle) -> ExpertWeights:
        """`key`'s weights as views of its CPU-cache entry `host`, built once per entry."""
        with self._cond:
            weights = self._entry_weights.get(host.payload)
        if weights is None:
            layout = self.layouts[key]
            weights = expert_weights(host.raw, layout, layout.tensors, self.mlp)
            with self._cond:
                self._entry_weights[host.payload] = weights
        return weights

    def _vacate(self, record: SlotRecord) -> None:
        """Forget an evicted slot's contents (caller holds the lock)."""
        loaded = self._loaded.pop(record.index, None)
        if loaded is not None and loaded.host is not None:
            loaded.host.release()

    def _request(self, key: ExpertKey, priority: float, *, demand: bool) -> None:
        """Queue a fill (deduplicated by key; a more urgent request moves a queued one forward)."""
        if key not in self.book:
            self.queue.submit(key, lambda: self._fill(key, demand), priority=priority)

    # -- the provider ---------------------------------------------------------------------------
    def stream(self, layer: int, experts: list[int], x_ND: torch.Tensor) -> Iterator[tuple[int, ExpertWeights]]:
        """Hand out the layer's experts as they become usable; predict and prefetch the next layer."""
        keys = [ExpertKey(layer, e) for e in experts]
        if self.guard is not None and layer == self.moe_layers[0]:  # once per forward step
            self.guard.step()
        with self._cond:
            guessed = self.guesses.guesses(layer)
            self.guesses.account(layer, experts, in_ring={k.expert for k in keys if k in self.book},
                                 cached={e: self.tier.cached(ExpertKey(layer, e)) for e in experts},
                                 nbytes={k.expert: self.chunk_bytes[k] for k in keys})
            self.book.begin_layer(layer, keys)
            for k in keys:
                self._errors.pop(k, None)
        self.predictor.seen(layer, experts)
        # the routing is known: guesses still being read are either needed now or wasted bandwidth
        wrong = [ExpertKey(layer, e) for e in guessed if e not in experts]
        for key in wrong:
            self.queue.cancel(key)
        self.tier.cancel_guesses(wrong)
        # In place, an expert already in the CPU cache takes its slot here, on this thread: a hit
        # costs no hand-over to a worker and back. Reads go to the workers first, so they start
        # before this thread is busy with the hits.
        hits = [k for k in keys if self.in_place and k not in self.book and self.tier.ready(k)]
        for key in keys:
            self.tier.hurry(key)
            if key not in hits:
                self._request(key, Priority.NOW, demand=True)
        for key in hits:
            if not self._fill(key, True, wait=False):
                self._request(key, Priority.NOW, demand=True)
        if self.prefetch_enabled:
            self._predict(layer, x_ND)
        pending = set(keys)
        while pending:
            key, loaded = self._next_usable(pending)
            try:
                # compute waits for this expert's copies only (on CPU: the host waits)
                for h in loaded.copies:
                    h.wait()
                yield key.expert, loaded.weights
            finally:
                with self._cond:
                    self.book.give_back(key)
                    if self.memory is not None:
                        self.memory.read_done(self.book.get(key).index)
                    pending.discard(key)
                    self._cond.notify_all()

    def _next_usable(self, pending: set[ExpertKey]) -> tuple[ExpertKey, _Loaded]:
        """Pin the next of `pending` whose slot is usable, waiting for one; raise a failed load's error."""
        with self._cond:
            while True:
                usable = [k for k in pending if (r := self.book.get(k)) is not None and r.usable]
                if usable:
                    break
                for k in pending:
                    err = self._errors.pop(k, None)
                    if err is not None:
                        raise err
                    if k not in self.book:  # its fill has not started or was dropped
                        self._request(k, Priority.NOW, demand=True)
                self._cond.wait(timeout=0.05)
            key = min(usable)
            if self.book.hand_out(key):  # a ring hit or a right guess: the CPU cache's policy must see the use
                self.tier.record_use(key)
            return key, self._loaded[self.book.get(key).index]

    def _predict(self, layer: int, x_ND: torch.Tensor) -> None:
        """Prefetch the experts the predictor expects the next MoE layer to use (`_stage_guesses`)."""
        predicted = self.predictor.predict(layer, x_ND)
        if predicted is None:
            return
        nxt, picked = predicted
        with self._cond:
            cached = {e: self.tier.cached(ExpertKey(nxt, e)) for e in picked}
            self.guesses.predicted(nxt, cached)
            # A guess read from SSD uses only the disk's idle time (the tier pauses it while a
            # needed read is in flight) and is abandoned once the layer's routing proves it wrong,
            # so a wrong guess costs the bytes read in that idle time. `min_precision` can still
            # switch guessing off for a model whose guesses are mostly wrong. Guesses already in
            # the CPU cache cost no SSD bandwidth and are always staged when the ring copies.
            speculate = self.guesses.speculate(self.predictor.known)
        self._stage_guesses(nxt, picked, cached, speculate)

    def _stage_guesses(self, nxt: int, picked: list[int], cached: dict[int, bool], speculate: bool) -> None:
        """Bring layer `nxt`'s guessed experts into ring slots (read from SSD only where `speculate`)."""
        for rank, e in enumerate(picked[:self.ring_slots]):
            key = ExpertKey(nxt, e)
            if key in self.book or not (speculate or (cached[e] and self.copies)):
                continue
            if not cached[e]:
                with self._cond:
                    self.guesses.read_ahead.add(key)
            self._request(key, Priority.NEXT + rank / 1000, demand=False)
            with self._cond:
                r = self.book.get(key)
                if r is not None:
                    r.prefetched = True

    # -- requests and reporting -------------------------------------------------------------------
    def warm_idle(self, *, in_request: bool = True) -> int:
        """Read experts not yet cached into the CPU cache's free room, at the lowest priority.

        Only what fits without evicting anything: with a cache as large as the experts, the whole
        model ends up resident; with a small one, nothing is read speculatively.
        """
        free = self.tier.cache.capacity_bytes - self.tier.cache.used_bytes
        keys = []
        for layer in self.moe_layers:
            for e in range(self.config.num_experts):
                nbytes = self.chunk_bytes[ExpertKey(layer, e)]
                if nbytes <= free and not self.tier.cached(ExpertKey(layer, e)):
                    keys.append(ExpertKey(layer, e))
                    free -= nbytes
        started = self.tier.prefetch(keys, priority=Priority.IDLE) if keys else []
        if in_request:  # reads while loading belong to the load, not to a request's traffic
            with self._cond:
                self.guesses.read_ahead.update(started)  # keys already (kind "weight")
        return len(started)

    def begin_request(self) -> None:
        """Start counting for one request, and fill idle cache room."""
        self.warm_idle()
        s = self.tier.stats()
        with self._cond:
            self.guesses.reset(RingCounters(ssd_bytes_at_start=s.ssd_bytes,
                                            cpu_hits_at_start=s.hits + s.inflight_hits,
                                            cpu_lookups_at_start=s.hits + s.inflight_hits + s.misses))

    def request_stats(self, *, tokens: int) -> dict:
        """The counters of the request since `begin_request`, per generated token where it says so."""
        self.queue_drain()
        s = self.tier.stats()
        c = self.counters
        lookups = s.hits + s.inflight_hits + s.misses - c.cpu_lookups_at_start
        per = max(tokens, 1)
        return {
            # uses served from a ring slot: device memory on a GPU, CPU-cache entries in place on CPU
            "ring_hit_rate": c.ring_hits / c.uses if c.uses else 0.0,
            "cpu_hit_rate": (s.hits + s.inflight_hits - c.cpu_hits_at_start) / lookups if lookups else 0.0,
            "ssd_bytes_per_token": (s.ssd_bytes - c.ssd_bytes_at_start) / per,
            "device_copy_bytes_per_token": c.device_copy_bytes / per,
            "ideal_bytes_per_token": c.ssd_ideal_bytes / per,
            "prefetch_precision": c.predicted_used / c.predicted if c.predicted else 0.0,
            "prefetch_recall": c.routed_predicted / c.routed if c.routed else 0.0,
            "cpu_cache_bytes": self.tier.cache.capacity_bytes,  # lowered by the memory guard under pressure
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
        """Stop the threads, release every slot, close the copy stream."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.queue.close(wait=True)
        with self._cond:
            for r in self.book.evict_all_idle():
                self._vacate(r)
        if self.memory is not None:
            self.memory.copier.close()
        self.tier.close()

