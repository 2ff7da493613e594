"""The torch-free runner's expert cache (`inference.torch_free.runner`): `storage.cache.ExpertCache` (next-use
eviction, keyed by `ExpertKey`) over `n` slots of one chunk's bytes in one anonymous mapping
(page-aligned, for O_DIRECT). An entry's payload is its slot, taken from the free list when its chunk
is read and given back when it is evicted; the chunks missing for a layer are read at once and
checked against the manifest.

`ensure` reads what is missing and waits. `begin` starts those reads and `end` waits for them, so that
the caller computes meanwhile (the prompt pass reads a layer's next group of experts while it computes
the last, and the next layer's experts while it finishes this one); `end(keep=True)` leaves the
entries pinned, so that no later `begin` takes their slots while they are computed, until `release`."""

from __future__ import annotations

import ctypes
import mmap
import time
from dataclasses import dataclass, field
from typing import Callable

from storage.cache import ExpertCache, ExpertCacheConfig
from storage.chunk_io import ChunkReader
from storage.keys import ExpertKey
from storage.policies import NextUsePolicy
from storage.reader import StoreReader


@dataclass
class Pending:
    """Reads `begin` started: the hits' slots, and per load (key, slot, chunk, request, its pieces)."""
    layer: int
    experts: list[int]
    where: dict = field(default_factory=dict)
    loads: list = field(default_factory=list)


class ExpertSlots:
    def __init__(self, store: StoreReader, n: int, slot_bytes: int, reader: ChunkReader,
                 on_load: Callable[[ExpertKey, int], None]) -> None:
        self.store, self.n, self.slot_bytes, self.reader, self.on_load = store, n, slot_bytes, reader, on_load
        self.mem = mmap.mmap(-1, n * slot_bytes)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        self.view = memoryview(self.mem)
        self.free = list(range(n - 1, -1, -1))
        self.cache = ExpertCache(ExpertCacheConfig(capacity_bytes=n * slot_bytes, policy=NextUsePolicy.name),
                                 on_evict=lambda key, slot: self.free.append(slot))
        self.read_bytes = 0
        self.read_s = 0.0  # time spent waiting for reads

    def ensure(self, layer: int, experts: list[int]) -> list[int]:
        """The slots of these experts of `layer`, reading the missing ones (all at once)."""
        return self.end(self.begin(layer, experts))

    def begin(self, layer: int, experts: list[int], *, speculative: bool = False) -> Pending:
        """Pin these experts of `layer` and start reading the missing ones (`speculative`: a guess, whose
        entries go first when room is needed until a lookup uses them); `end` waits for them."""
        p = Pending(layer, list(experts))
        try:
            for k in dict.fromkeys(ExpertKey(layer, e) for e in experts):
                entry, must_load = self.cache.lookup_or_reserve(k, self.slot_bytes, probation=speculative)
                if not must_load:
                    p.where[k] = entry.payload
                    continue
                slot = self.free.pop()
                chunk = self.store.manifest.chunk(layer, k.expert)
                buf = self.view[slot * self.slot_bytes:slot * self.slot_bytes + chunk.bytes]
                p.loads.append([k, slot, chunk, self.store.chunk_request(chunk, buf), None])
            for load, pieces in zip(p.loads, self.reader.submit_many([ld[3] for ld in p.loads])):
                load[4] = pieces
        except BaseException as e:
            self._abandon(p, e)
            raise
        return p

    def end(self, p: Pending, *, keep: bool = False) -> list[int]:
        """Wait for `begin`'s reads, check them, and give the experts' slots (in `experts` order); the
        entries stay pinned with `keep` (then `release` them), else they are unpinned."""
        try:
            if p.loads:
                t0 = time.perf_counter()
                crcs = [self.reader.settle(req, pieces) for _, _, _, req, pieces in p.loads]
                self.read_s += time.perf_counter() - t0
                for (_, _, chunk, _, _), got in zip(p.loads, crcs):
                    self.store.check_crcs(chunk, got)
                for k, slot, chunk, _, _ in p.loads:
                    self.on_load(k, slot)
                    self.cache.complete(k, slot)
                    p.where[k] = slot
                    self.read_bytes += chunk.bytes
                p.loads = []
        except BaseException as e:
            self._abandon(p, e)
            raise
        slots = [p.where[ExpertKey(p.layer, e)] for e in p.experts]
        if not keep:
            self._unpin(p)
        return slots

    def release(self, p: Pending) -> None:
        """Unpin the entries `end(keep=True)` left pinned."""
        self._unpin(p)

    def _unpin(self, p: Pending) -> None:
        for k in p.where:
            self.cache.unpin(k)
        p.where = {}

    def _abandon(self, p: Pending, e: BaseException) -> None:
        """Reserved entries never complete: each goes, its slot comes back (after its pieces settled,
        so that no read lands in a slot given to another); the hits are unpinned."""
        for k, slot, _, _, pieces in p.loads:
            for f, *_ in pieces or ():
                f.exception()  # waits; its error is `e` or one like it
            self.cache.fail(k, e)
            self.free.append(slot)
        p.loads = []
        self._unpin(p)

    @property
    def hits(self) -> int:
        return self.cache.stats().hits

    @property
    def misses(self) -> int:
        return self.cache.stats().insertions
