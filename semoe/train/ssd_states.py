"""Expert training states on SSD: the store behind a CPU cache, written back copy-on-write.

Every expert has up to three chunk files in the store (`weight`, `adam_m`, `adam_v`; a missing
moment is zeros). Weights are read through `TieredExpertStore` (its CPU cache, prefetch queue and
checked direct reads), so forward and backward pay SSD reads only for cache misses. The cache evicts
the weight whose next use in the step's order lies furthest ahead (`semoe.train.state_schedule`).

Between host and device everything goes through the copy stream (`storage.streams`), on CPU as on
CUDA, and nothing in forward or backward blocks the host:

    fetch      cache entry ──copy──▶ device slot; compute waits on that copy only (`wait()`); the
               entry stays pinned until the copy is done (polled), the slot is refilled only after
               the compute that read it (its last reader's event)
    add_grad   device gradient ──copy after the compute that made it──▶ host staging buffer (pinned
               on a GPU, from a pool); summed once the copy is done (polled, in issue order), in host
               memory up to `grad_budget_bytes` and in spill files of `spill_dir` beyond it

The step boundary (the gradient norm, the optimizer thread) waits for the copies still in flight.
On CPU the expert can also be used in place, without copies (`SSDStatesConfig.copy_on_cpu` off):
the same records, with copies that are complete at issue.

The optimizer step streams experts tile by tile (a tile is one expert's three states), in layer
order: the tiles ahead are being read while this one is updated in place in its cache buffer, and
the tiles behind are being written by a writer pool. Writes go into the staged version of the store
(`begin_version`), never over a committed file, so a crash at any moment leaves the last checkpoint
intact; the trainer's checkpoint adopts the written entries and commits them.

The overlay manifest: this rank's private copy of the committed manifest, updated as chunks are
written, so reads always find the newest file of each expert.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from semoe.model.config import MoEConfig
from semoe.train.expert_grads import GradAccumulator
from semoe.train.expert_states import (STATE_KINDS, AdamWConfig, ChunkFormat, ExpertStates, GradFactors, Held, Key,
                                       adamw_, squared_norms_sum)
from semoe.train.state_schedule import BACKWARD, FORWARD, UPDATE, StepSchedule
from storage.errors import CacheFullError, StorageError
from storage.chunk_io import ALIGN, ReadMode
from storage.keys import ExpertKey
from storage.manifest import ChunkEntry, Manifest, TensorEntry
from storage.host_buffers import HostBuffer, HostBufferPool, HostBufferPoolConfig, PoolExhaustedError, round_up
from storage.store import Store
from storage.streams import COMPLETE, CopyHandle, StreamEvent, make_copy_stream
from storage.tiered_experts import ExpertHandle, TieredExpertStore, TieredStoreConfig

log = logging.getLogger(__name__)

DEVICE_SLOTS = 2  # expert weights on the device: one being computed with while the next is copied
# longest a state waits for other threads' pins to leave a full cache before CacheFullError (a
# writer holds a weight for the few milliseconds its chunk takes to write)
PINNED_WAIT_S = 30.0
GRAD_COPIES_IN_FLIGHT = 8  # staging buffers beyond the budgeted sums; past them backward waits for a copy
# A gradient is kept as its products (`GradFactors`) where they take at most this fraction of its bytes:
# made again when the expert is stepped (one more set of its weight-gradient products) instead of
# being held in memory or written to a spill file and read back.
FACTORS_MAX_FRACTION = 0.25


# -- bookkeeping: plain Python, no streams ----------------------------------------------------------


def read_ahead(keys: list[Key], depth: int) -> list[list[Key]]:
    """For each tile in update order, the tiles whose moment reads start just before it is updated:
    the first tile starts itself and the `depth` after it, each later one the next not yet started."""
    plan, started = [], 0
    for i in range(len(keys)):
        end = min(len(keys), i + 1 + depth)
        plan.append(keys[started:end])
        started = max(started, end)
    return plan


@dataclass(eq=False)
class _Slot:
    """Device memory for one expert's weights; refilled only after `last_reader` (the compute that
    used it last) has run."""

    raw: torch.Tensor
    last_reader: StreamEvent = COMPLETE


@dataclass(eq=False)
class _Loan:
    """One fetch: the cache entry a copy reads, pinned until that copy is done. Without a `slot`
    the entry is used in place and stays pinned until `Held.release()` too."""

    entry: ExpertHandle
    copy: CopyHandle
    slot: _Slot | None
    returned: bool = False

    def source_free(self) -> bool:
        return (self.slot is not None or self.returned) and self.copy.done()


@dataclass(eq=False)
class _GradCopy:
    """One gradient on its way to host memory: summed once every copy is done."""

    key: Key
    copies: list[CopyHandle]
    scale: float
    staging: HostBuffer | None  # None: the gradient is used in place


def _arrive(pending: deque[_GradCopy], into: GradAccumulator, *, block: bool) -> None:
    """Sum the gradients whose copies are done, strictly in issue order (float sums depend on the
    order); `block` waits for the rest (a host sync: only at the step boundary)."""
    while pending:
        first = pending[0]
        if not all(c.done() for c in first.copies):
            if not block:
                return
            for c in first.copies:
                if not c.done():
                    c.synchronize()
        pending.popleft()
        # The host reads the staging memory itself, after the copies are done: no compute is
        # ordered after them, so no wait(). (A failed copy raises at issue on CUDA.)
        grads = [c.tensor for c in first.copies]
        staging = first.staging
        if first.scale != 1.0:
            grads = [g * first.scale for g in grads]
            if staging is not None:
                staging.release()
                staging = None
        if staging is None:
            into.add(first.key, grads)
        else:  # the gradient is the staging buffer's bytes, in the chunk's layout
            into.add(first.key, grads, staging.release, raw=staging.payload)


# -- the backend ------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SSDStatesConfig:
    """How the SSD backend holds and moves one rank's expert states."""

    cpu_cache_bytes: int  # the CPU cache of weights, and the moments in flight
    spill_dir: str  # gradient sums beyond `grad_budget_bytes` are spilled here
    grad_budget_bytes: int | None = None  # host memory for gradient sums (default: cpu_cache_bytes)
    read_mode: ReadMode = ReadMode.DIRECT
    prefetch_depth: int = 1  # tiles whose moments are read ahead of the one being updated
    write_threads: int = 1
    # on a CPU device, copy weights and gradients through the copy stream as on a GPU (the tests
    # run the GPU's path this way) instead of using host memory in place
    copy_on_cpu: bool = False


class SSDExpertStates(ExpertStates):
    """Local experts' states in `store` (the run's, open), behind a CPU cache (`SSDStatesConfig`)."""

    @staticmethod
    def transient_bytes(config: MoEConfig, prefetch_depth: int = 1, write_threads: int = 1) -> int:
        """Moment buffers in flight: the tiles read ahead, the one updated, the ones being written."""
        return (prefetch_depth + 1 + write_threads) * 2 * ChunkFormat(config).nbytes

    @staticmethod
    def min_cache_bytes(config: MoEConfig, prefetch_depth: int = 1, write_threads: int = 1) -> int:
        """The smallest budget that works: the moments in flight, plus weights for the tiles being
        updated and written and one more."""
        return (SSDExpertStates.transient_bytes(config, prefetch_depth, write_threads)
                + (write_threads + 2) * ChunkFormat(config).nbytes)

    def __init__(self, config: MoEConfig, experts: range, device: torch.device, *, store: Store,
                 settings: SSDStatesConfig, layers: list[int] | None = None) -> None:
        super().__init__(config, experts, device, layers)
        cpu_cache_bytes, prefetch_depth, write_threads = (settings.cpu_cache_bytes, settings.prefetch_depth,
                                                          settings.write_threads)
        self.root = root = store.root
        self.format = ChunkFormat(config)
        self.overlay = Manifest.from_json(store.manifest.to_json(), source=f"{root} (overlay)")
        self.view = Store(root, self.overlay)
        # moments stream past the cache: the tiles read ahead and those being written come off the budget
        transient = self.transient_bytes(config, prefetch_depth, write_threads)
        if cpu_cache_bytes - transient < (write_threads + 2) * self.format.nbytes:
            raise ValueError(f"cpu_cache_bytes={cpu_cache_bytes} is below the minimum of "
                             f"{self.min_cache_bytes(config, prefetch_depth, write_threads)} for these experts")
        # host memory a GPU copies from or into is pinned; on a CPU device pinning buys nothing
        self._pin = torch.device(device).type == "cuda"
        # the cache evicts the weight whose next use in the step's order lies furthest ahead
        self.schedule = StepSchedule(self.layers)
        self._phase = FORWARD  # of the main thread: which pass its fetches and read-aheads serve
        self.tier = TieredExpertStore(self.view, TieredStoreConfig(cpu_cache_bytes=cpu_cache_bytes - transient,
                                                                   read_mode=settings.read_mode, pin_memory=self._pin),
                                      policy=self.schedule.policy)
        self.stream = make_copy_stream(device)
        self.in_place = torch.device(device).type == "cpu" and not settings.copy_on_cpu
        self.spill_dir = settings.spill_dir
        # states written back every step bypass the page cache as their reads do (`--read-mode direct`)
        self.direct_writes = settings.read_mode == ReadMode.DIRECT
        self.grad_budget = cpu_cache_bytes if settings.grad_budget_bytes is None else settings.grad_budget_bytes
        self.prefetch_depth = prefetch_depth
        self.write_depth = write_threads
        self.written: dict[ExpertKey, tuple[list[TensorEntry], ChunkEntry]] = {}
        self._gen = 0  # optimizer steps started: names the spill folder
        # a step's gradients read back or made from their products, one at a time: one buffer for the
        # step backward is filling, one for the step the optimizer thread is updating
        self._grad_bufs = [torch.empty(self.format.nbytes, dtype=torch.uint8) for _ in range(2)]
        self.gradients = self._new_accumulator()
        self._grad_copies: deque[_GradCopy] = deque()
        # Pinned on a GPU and reused step after step. A sum kept in memory stays in the staging
        # buffer its first gradient arrived in; two steps' sums coexist while the optimizer thread
        # updates the last step's experts and backward fills the next step's.
        held = self.grad_budget // sum(4 * math.prod(s) for s in self.format.shapes)
        self._staging = HostBufferPool(HostBufferPoolConfig(
            capacity_bytes=(2 * held + GRAD_COPIES_IN_FLIGHT) * round_up(self.format.nbytes, ALIGN), pin=self._pin,
            alignment=ALIGN))
        # the moments of the tiles in flight (read ahead, updated, being written), reused step after step:
        # an expert-sized allocation each would be a fresh mapping the kernel zeroes page by page
        self._moment_bufs = HostBufferPool(HostBufferPoolConfig(
            capacity_bytes=(prefetch_depth + 1 + write_threads) * 2 * round_up(self.format.nbytes, ALIGN), pin=False,
            alignment=ALIGN))
        self._outs: dict[Key, HostBuffer] = {}  # staging buffers handed to backward by `grad_out`
        self._loans: list[_Loan] = []
        self._loan_lock = threading.Lock()  # fetches and the optimizer thread both free loans
        self._free_slots: deque[_Slot] = deque()  # least recently released first
        self._slots_made = 0
        self._lock = threading.Lock()
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="semoe-expert-write")
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="semoe-moment-read")
        self._bytes_written = self._moment_bytes = 0
        self._spill_bytes = {"read": 0, "written": 0}  # gradients spilled to and read back from spill_dir
        self._factored = 0  # gradients kept as their products
        self._cond = threading.Condition()
        self._pending: set[Key] = set()  # experts whose update is in flight
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None

    def _new_accumulator(self) -> GradAccumulator:
        # two folders taking turns: the optimizer thread reads the last step's spills while this
        # step's backward writes its own
        return GradAccumulator(self.format, self.grad_budget, os.path.join(self.spill_dir, f"step{self._gen % 2}"),
                               self._grad_bufs[self._gen % 2], on_io=self._count_spill)

    def _count_spill(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._spill_bytes[kind] += nbytes

    # -- versions -----------------------------------------------------------------------------
    def begin_version(self, version: int) -> None:
        super().begin_version(version)
        self.written = {}

    def put_initial(self, key: Key, weights: tuple[torch.Tensor, ...]) -> None:
        entries, chunk = self.format.write(self.root, self.version, key[0], key[1], "weight",
                                           self.format.pack(list(weights)))
        self.overlay.upsert(tensors=entries, chunks=[chunk])
        self.written[ExpertKey(key[0], key[1], "weight")] = (entries, chunk)

    def checkpoint_entries(self) -> tuple[list[TensorEntry], list[ChunkEntry]]:
        """Entries of every chunk written into the staged version, for the checkpoint to adopt."""
        self.wait_idle()
        tensors = [t for entries, _ in self.written.values() for t in entries]
        return tensors, [c for _, c in self.written.values()]

    # -- forward and backward -----------------------------------------------------------------
    def _get(self, key: ExpertKey) -> ExpertHandle:
        """Pin a state in the cache. When pinned entries fill it: unpin those this object's copies
        held, else let prefetches finish, else wait (on the cache's condition, which every unpin
        signals) for the pins of other threads (the writers) to go; CacheFullError after
        PINNED_WAIT_S seconds without room."""
        deadline = time.monotonic() + PINNED_WAIT_S
        while True:
            try:
                return self.tier.get(key)
            except CacheFullError:
                if self._free_a_source():
                    continue
                self.tier.drain()  # finished prefetches are unpinned and can be evicted
                left = deadline - time.monotonic()
                if left <= 0 or not self.tier.cache.wait_for_room(self.format.nbytes, timeout=left,
                                                                  pins_elsewhere=True):
                    raise CacheFullError(f"CPU cache of {self.tier.config.cpu_cache_bytes} bytes stays full of "
                                         f"pinned expert states; give --cpu-cache more room") from None

    def _reap_loans(self) -> int:
        """Unpin the cache entries whose copies are done; returns how many."""
        with self._loan_lock:
            free, kept = [], []
            for loan in self._loans:
                (free if loan.source_free() else kept).append(loan)
            self._loans = kept
        for loan in free:
            loan.entry.release()
        return len(free)

    def _free_a_source(self) -> bool:
        """The cache is full of pinned entries: unpin those whose copies ran or, failing that, wait
        for the oldest copy in flight (a host sync, only when the cache is this tight). False when
        no copy holds an entry."""
        if self._reap_loans():
            return True
        with self._loan_lock:
            oldest = next((loan for loan in self._loans if loan.slot is not None), None)
        if oldest is None:
            return False
        oldest.copy.synchronize()
        return self._reap_loans() > 0

    def _take_slot(self) -> _Slot:
        if self._slots_made < DEVICE_SLOTS or not self._free_slots:
            self._slots_made += 1
            return _Slot(torch.empty(self.format.nbytes, dtype=torch.uint8, device=self.device))
        return self._free_slots.popleft()

    def _return(self, loan: _Loan) -> None:
        """`Held.release()`: the compute issued so far is the slot's last reader."""
        loan.returned = True
        if loan.slot is not None:
            loan.slot.last_reader = self.stream.record_compute()
            self._free_slots.append(loan.slot)
        self._reap_loans()

    def begin_forward_layer(self, layer: int, experts: list[int]) -> None:
        self._phase = FORWARD
        self.schedule.at(FORWARD, self._gen, layer)
        super().begin_forward_layer(layer, experts)

    def begin_backward_layer(self, layer: int) -> None:
        if layer not in self._backward_seen:
            self._phase = BACKWARD
            self.schedule.at(BACKWARD, self._gen, layer)
        super().begin_backward_layer(layer)

    def fetch(self, layer: int, expert: int) -> Held:
        self._wait_updated((layer, expert))
        self._reap_loans()
        key = ExpertKey(layer, expert)
        entry = self._get(key)
        self.schedule.used(key, self._phase, self._gen)
        src = entry.raw
        if src.numel() != self.format.nbytes:
            entry.release()
            raise StorageError(f"{self.root}: expert {expert} of layer {layer} has a weight chunk of "
                               f"{src.numel()} bytes, expected {self.format.nbytes} (its float32 tensors)")
        if self.in_place:
            slot, copy = None, self.stream.copy_to_device(src, in_place_ok=True)
        else:
            slot = self._take_slot()
            copy = self.stream.copy(src, slot.raw, after=slot.last_reader)
        loan = _Loan(entry, copy, slot)
        with self._loan_lock:
            self._loans.append(loan)
        return Held(*self.format.views(copy.wait()), release=lambda: self._return(loan))

    def prefetch(self, layer: int, experts: list[int], priority: float = 0.0) -> None:
        keys = [ExpertKey(layer, e) for e in experts if e in self.experts]
        for key in keys:
            self.schedule.expect(key, self._phase, self._gen)
        self.tier.prefetch(keys, priority=priority)

    def add_grad_factors(self, layer: int, expert: int, factors: GradFactors) -> None:
        """Keep the gradient as its products where they are small beside it and it is this step's first
        for the expert: its norms are taken now, from the gradient made in a scratch buffer, and it is
        made again when the expert is stepped (the same bits). Otherwise as `ExpertStates` does."""
        key = (layer, expert)
        # in place, every earlier gradient has arrived already (its copies complete at issue), so
        # keeping this one aside keeps the arrival order
        if (self.in_place and factors.dtype == torch.float32 and self.grad_scale == 1.0
                and factors.nbytes <= FACTORS_MAX_FRACTION * self.format.nbytes
                and not self.gradients.has(key) and self.gradients.room_for(factors.nbytes)):
            grads = factors.grads(self.gradients.scratch_views())
            # a factor that is a view of the layer's rows (x, dy) would keep all of them alive: copied
            own = GradFactors(*(t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t
                                for t in (factors.x_MD, factors.dg_MF, factors.du_MF, factors.dy_MD, factors.h_MF)))
            self.gradients.add_factors(key, own, list(torch._foreach_norm(grads)))
            with self._lock:
                self._factored += 1
            return
        super().add_grad_factors(layer, expert, factors)

    def grad_out(self, layer: int, expert: int) -> list[torch.Tensor] | None:
        """Where expert memory is used in place: a staging buffer's float32 views for backward to
        compute the weight gradient into (handed back by `add_grad`), so no step allocates
        expert-sized gradients. None on the copy path, which stages through the copy stream."""
        if not self.in_place:
            return None
        staging = self._take_staging()
        self._outs[(layer, expert)] = staging
        return self.format.views(staging.payload)

    def add_grad(self, layer: int, expert: int, grads: tuple[torch.Tensor, ...]) -> None:
        grads = [g.detach() for g in grads]
        staging = self._outs.pop((layer, expert), None)  # set where backward computed into `grad_out`'s buffer
        if staging is not None or (self.in_place and all(g.dtype == torch.float32 for g in grads)):
            copies = [self.stream.copy_to_device(g, in_place_ok=True) for g in grads]
        else:
            staging = self._take_staging()
            after = self.stream.record_compute()  # the gradient is being made by queued compute
            copies = [self.stream.copy(g, dst, cast=True, after=after)
                      for g, dst in zip(grads, self.format.views(staging.payload))]
        self._grad_copies.append(_GradCopy((layer, expert), copies, self.grad_scale, staging))
        _arrive(self._grad_copies, self.gradients, block=False)

    def _take_staging(self) -> HostBuffer:
        """A staging buffer; when all are taken by copies in flight, wait for the oldest (a host
        sync, only when backward runs that far ahead of the copies)."""
        while True:
            _arrive(self._grad_copies, self.gradients, block=False)
            try:
                return self._staging.acquire(self.format.nbytes, timeout=0)
            except PoolExhaustedError:
                if not self._grad_copies:
                    raise
                for c in self._grad_copies[0].copies:
                    if not c.done():
                        c.synchronize()

    def end_backward(self) -> None:
        super().end_backward()
        _arrive(self._grad_copies, self.gradients, block=False)
        self._reap_loans()

    # -- the optimizer ------------------------------------------------------------------------
    def touched(self) -> list[Key]:
        _arrive(self._grad_copies, self.gradients, block=True)
        return self.gradients.keys()

    def grad_sq_sum(self) -> torch.Tensor:
        """As `ExpertStates.grad_sq_sum` (the same norms, squared and summed in the same order, so the
        same bits), without reading spilled gradients back: their norms were taken as they were written."""
        norms = [n for key in self.touched() for n in self.gradients.norms(key)]
        if not norms:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return squared_norms_sum(norms, self.device)

    def _grads(self, key: Key) -> list[torch.Tensor]:
        return self.gradients.grads(key)

    def discard_grads(self) -> None:
        super().discard_grads()
        _arrive(self._grad_copies, self.gradients, block=True)
        self.gradients.discard()

    def _read_moment(self, key: Key, kind: str, into: HostBuffer) -> torch.Tensor:
        """A moment's chunk bytes in `into`, read past the cache (a moment is used once a step, so
        caching it would only push weights out), or zeros for one never written."""
        if not self.overlay.has_chunk(key[0], key[1], kind):
            return into.payload.zero_()
        chunk = self.overlay.chunk(key[0], key[1], kind)
        if chunk.bytes != self.format.nbytes:
            raise StorageError(f"{self.root}: {kind} of expert {key[1]} of layer {key[0]} has {chunk.bytes} bytes, "
                               f"expected {self.format.nbytes}")
        crcs = self.tier.reader.read_many([self.view.chunk_request(chunk, into.memoryview())])[0]
        self.view.check_crcs(chunk, crcs)
        with self._lock:
            self._moment_bytes += chunk.bytes
        return into.payload

    def _read_moments(self, key: Key, into: tuple[HostBuffer, HostBuffer]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read_moment(key, "adam_m", into[0]), self._read_moment(key, "adam_v", into[1])

    def step(self, lr: float, cfg: AdamWConfig, clip_coef: float = 1.0) -> None:
        """Start the expert optimizer step in the background and return.

        Experts are updated in layer order, so the next step's forward, which waits in `fetch` only
        for the experts it needs, overlaps with the updates of later layers and with every write.
        The copies still in flight are finished by the optimizer thread, not here."""
        self.wait_idle()
        if self.version is None:
            raise RuntimeError("SSDExpertStates.step before begin_version: no staged version to write into")
        grads, copies = self.gradients, self._grad_copies
        keys = sorted(set(grads.keys()) | {c.key for c in copies})
        with self._loan_lock:  # the updates rewrite cache buffers: copies reading them must finish first
            loans = [loan for loan in self._loans if loan.slot is not None or loan.returned]
            self._loans = [loan for loan in self._loans if not (loan.slot is not None or loan.returned)]
        self._gen += 1  # the next step spills into its own folder
        self.gradients, self._grad_copies = self._new_accumulator(), deque()
        with self._cond:
            self._pending = set(keys)
        self._worker = threading.Thread(target=self._update_all, name="semoe-expert-adam", daemon=True,
                                        args=(keys, grads, copies, loans, lr, cfg, clip_coef, self._gen - 1))
        self._worker.start()

    @torch.no_grad()
    def _update_all(self, keys: list[Key], grads: GradAccumulator, copies: deque[_GradCopy], loans: list[_Loan],
                    lr: float, cfg: AdamWConfig, clip_coef: float, step: int) -> None:
        try:
            for loan in loans:
                if not loan.copy.done():
                    loan.copy.synchronize()
                loan.entry.release()
            _arrive(copies, grads, block=True)
            moments: dict[Key, tuple[tuple[HostBuffer, HostBuffer], Future]] = {}
            writes: deque[Future] = deque()
            for key, ahead in zip(keys, read_ahead(keys, self.prefetch_depth)):
                for k in ahead:  # the next tiles are read while this one is updated
                    # taken here, in update order: the pool holds exactly the tiles in flight
                    bufs = tuple(self._moment_bufs.acquire(self.format.nbytes) for _ in range(2))
                    moments[k] = (bufs, self._readers.submit(self._read_moments, k, bufs))
                    self.schedule.expect(ExpertKey(k[0], k[1]), UPDATE, step)
                    self.tier.prefetch([ExpertKey(k[0], k[1])])
                bufs, read = moments.pop(key)
                m_raw, v_raw = read.result()
                h = self._get(ExpertKey(key[0], key[1]))
                self.schedule.used(ExpertKey(key[0], key[1]), UPDATE, step)
                try:
                    adamw_(self.format.views(h.raw), grads.grads(key), self.format.views(m_raw),
                           self.format.views(v_raw), step=self.next_adam_step(key), lr=lr, cfg=cfg,
                           clip_coef=clip_coef)
                except BaseException:
                    h.release()
                    raise
                with self._cond:  # usable now; the write below reads the same bytes
                    self._pending.discard(key)
                    self._cond.notify_all()
                writes.append(self._writers.submit(self._write_tile, key, [(h.release, h.raw), (bufs[0].release, m_raw),
                                                                           (bufs[1].release, v_raw)]))
                while len(writes) > self.write_depth:  # bounded: tiles being written stay pinned
                    writes.popleft().result()
            while writes:
                writes.popleft().result()
            grads.discard()
        except BaseException as e:  # surfaced by the next fetch, step or checkpoint
            log.debug("expert optimizer step failed", exc_info=True)
            with self._cond:
                self._error = e
                self._pending.clear()
                self._cond.notify_all()

    def wait_idle(self) -> None:
        """Wait for the optimizer step in flight (updates and writes); raise what it raised."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _wait_updated(self, key: Key) -> None:
        with self._cond:
            while key in self._pending and self._error is None:
                self._cond.wait()
        self._raise_error()

    def _write_tile(self, key: Key, held: list[tuple[Callable[[], None], torch.Tensor]]) -> None:
        """Write one expert's updated states into the staged version, then unpin or free them."""
        try:
            for kind, (_, raw) in zip(STATE_KINDS, held):
                buf = raw.numpy()
                entries, chunk = self.format.write(self.root, self.version, key[0], key[1], kind, buf,
                                                   direct=self.direct_writes)
                with self._lock:
                    self.overlay.upsert(tensors=entries, chunks=[chunk])
                    self.written[ExpertKey(key[0], key[1], kind)] = (entries, chunk)
                    self._bytes_written += buf.nbytes
        finally:
            for release, _ in held:
                release()

    # -- reporting and shutdown ---------------------------------------------------------------
    def stats(self) -> dict:
        s = self.tier.stats()
        with self._lock:
            spill = self._spill_bytes
            return {"cpu_hit_rate": s.hit_rate, "ssd_read_bytes": s.ssd_bytes + self._moment_bytes + spill["read"],
                    "ssd_written_bytes": self._bytes_written + spill["written"],
                    "moment_read_bytes": self._moment_bytes, "spill_read_bytes": spill["read"],
                    "spill_written_bytes": spill["written"], "factored_grads": self._factored,
                    "grad_staging_bytes": self._staging.in_use_bytes, "cpu_hits": s.hits, "cpu_misses": s.misses}

    def close(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        self.stream.close()  # finishes the copies in flight: their sources can go
        self._reap_loans()
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self.tier.close()
        self._staging.close()
        self._moment_bufs.close()
