"""Eviction policies for the CPU expert cache.

A policy only ranks keys: it never sees payloads, sizes or pins. The cache reports every reference
(`on_insert`, `on_access`) and every removal (`on_remove`), and when it needs room it asks
`victim(candidates)` to pick one key among those it may evict (READY and unpinned). Policies are
not thread-safe on their own; the cache calls them under its lock.

Complexity (n = keys tracked, p = tracked keys that rank below the victim but are not candidates,
typically the few pinned experts of the current and next layer):

    policy      reference        victim
    lru         O(1)             O(p + 1)
    lfu         O(log n) amort.  O((p + 1) log n) amortised
    lfu-aging   as lfu, plus an O(n) halving every `aging_interval` references
    belady      O(log n) amort.  O((p + 1) log n) amortised; O(len(future)) to build
    next-use    O(log n) amort.  O(layers x (p + 1) log n) amortised
    scheduled   O(log n) + ins.  O(p + 1); each of its owner's forecasts as a reference (ins.: a list insertion)
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

logger = logging.getLogger(__name__)

Key = Hashable

DEFAULT_AGING_INTERVAL = 1024  # references between two halvings of every LFU count


def _require_positive_int(field: str, value: object) -> int:
    """Return `value` if it is an int > 0 (bools excluded), else raise ValueError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field} must be a positive integer, got {value!r}")
    return value


def _as_set(candidates: Iterable[Key]) -> AbstractSet[Key]:
    # The cache passes its live set of evictable keys; only a bare iterable needs copying.
    return candidates if isinstance(candidates, AbstractSet) else frozenset(candidates)


class EvictionPolicy(ABC):
    """Ranks cached keys and picks which one to evict; the cache drives it through these hooks."""

    name: str = ""

    def on_insert(self, key: Key) -> None:
        """Record that `key` entered the cache; by default an insertion counts as a use."""
        self.on_access(key)

    def on_admit(self, key: Key) -> None:
        """Record that `key` entered the cache read ahead of any use (a prefetch or a guess); its
        use, if it comes, is reported by `on_access`. By default this is an insertion."""
        self.on_insert(key)

    @abstractmethod
    def on_access(self, key: Key) -> None:
        """Record a use (a cache hit) of `key`."""

    @abstractmethod
    def on_remove(self, key: Key) -> None:
        """Forget `key` (evicted or failed); removing an unknown key is a no-op."""

    @abstractmethod
    def victim(self, candidates: Iterable[Key]) -> Key:
        """Pick the key to evict among `candidates` (non-empty; a set gives O(1) membership)."""


class _LazyMinHeap:
    """Min-heap of (rank, key) in which only the rank last set for a key is live.

    Updating a key pushes a new item and leaves the old one in place; stale items are dropped when
    they reach the top, and the heap is rebuilt once stale items outnumber live ones, so every
    operation stays O(log n) amortised. Ranks must end in a component unique per key (a reference
    tick) so that two live items never tie and keys, which need not be orderable, are never
    compared.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, ...], Key]] = []
        self._rank: dict[Key, tuple[int, ...]] = {}

    def get(self, key: Key) -> tuple[int, ...] | None:
        return self._rank.get(key)

    def set(self, key: Key, rank: tuple[int, ...]) -> None:
        self._rank[key] = rank
        heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > 2 * len(self._rank) + 64:
            self._rebuild()

    def discard(self, key: Key) -> None:
        self._rank.pop(key, None)

    def remap(self, fn: Callable[[tuple[int, ...]], tuple[int, ...]]) -> None:
        """Apply `fn` to every live rank (O(n))."""
        self._rank = {key: fn(rank) for key, rank in self._rank.items()}
        self._rebuild()

    def min_among(self, candidates: AbstractSet[Key]) -> Key:
        """Return the live key of least rank that is in `candidates`."""
        heap = self._heap
        set_aside = []
        try:
            while heap:
                rank, key = heap[0]
                if self._rank.get(key) != rank:
                    heapq.heappop(heap)  # stale
                elif key in candidates:
                    return key
                else:
                    set_aside.append(heapq.heappop(heap))
        finally:
            for item in set_aside:
                heapq.heappush(heap, item)
        raise ValueError(f"none of the {len(candidates)} candidates is tracked by the policy")

    def _rebuild(self) -> None:
        self._heap = [(rank, key) for key, rank in self._rank.items()]
        heapq.heapify(self._heap)


def _check_candidates(candidates: Iterable[Key]) -> AbstractSet[Key]:
    pool = _as_set(candidates)
    if not pool:
        raise ValueError("victim() needs at least one candidate")
    return pool


class LRUPolicy(EvictionPolicy):
    """Least recently used; an insertion counts as a use."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # least recent first

    def on_access(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Iterable[Key]) -> Key:
        pool = _check_candidates(candidates)
        for key in self._order:
            if key in pool:
                return key
        raise ValueError(f"none of the {len(pool)} candidates is tracked by the policy")


class LFUPolicy(EvictionPolicy):
    """Least frequently used. Ties go to the least recently used key.

    An insertion counts as a use (count 1). Counts are dropped when a key is removed, so a key
    that comes back starts again from 1.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._ranks = _LazyMinHeap()  # key -> (count, tick of last use)
        self._tick = 0  # references seen so far; orders last uses
        self._aging_interval: int | None = None

    def on_access(self, key: Key) -> None:
        self._tick += 1
        rank = self._ranks.get(key)
        count = 0 if rank is None else rank[0]
        self._ranks.set(key, (count + 1, self._tick))
        if self._aging_interval is not None and self._tick % self._aging_interval == 0:
            self._ranks.remap(lambda rank: (rank[0] // 2, rank[1]))

    def on_remove(self, key: Key) -> None:
        self._ranks.discard(key)

    def victim(self, candidates: Iterable[Key]) -> Key:
        return self._ranks.min_among(_check_candidates(candidates))

    def count(self, key: Key) -> int:
        """Current (possibly aged) use count of `key`; 0 when it is not tracked."""
        rank = self._ranks.get(key)
        return 0 if rank is None else rank[0]


class LFUAgingPolicy(LFUPolicy):
    """LFU whose counts decay, so experts that were hot long ago become evictable.

    After every `aging_interval`-th reference (insertions and hits alike, the current one
    included) every count is halved with floor division. Ties go to the least recently used key;
    counts are dropped on removal (no history of evicted keys is kept).
    """

    name = "lfu-aging"

    def __init__(self, *, aging_interval: int = DEFAULT_AGING_INTERVAL) -> None:
        super().__init__()
        self._aging_interval = _require_positive_int("aging_interval", aging_interval)


class BeladyPolicy(EvictionPolicy):
    """Offline optimal MIN: evicts the candidate whose next use lies farthest in the future.

    Contract: `future` is the exact sequence of references the cache will report. Each
    `on_insert` or `on_access` consumes the next position and must name the key stored there
    (ValueError otherwise: a replay out of step would silently stop being optimal). Keys never used
    again are infinitely far; among those the least recently referenced goes first. Finite next
    uses are distinct positions, so no other tie can occur.
    """

    name = "belady"

    def __init__(self, future: Sequence[Key]) -> None:
        self._future = list(future)
        never = len(self._future)
        self._next_use = [never] * never  # position -> position of the next use of the same key
        last_seen: dict[Key, int] = {}
        for pos in range(never - 1, -1, -1):
            key = self._future[pos]
            self._next_use[pos] = last_seen.get(key, never)
            last_seen[key] = pos
        self._position = 0
        self._ranks = _LazyMinHeap()  # key -> (-next use, position of last use)

    @property
    def position(self) -> int:
        """Number of references consumed so far (the index of the next expected one)."""
        return self._position

    def on_access(self, key: Key) -> None:
        pos = self._position
        if pos >= len(self._future):
            raise ValueError(
                f"reference to {key!r} at position {pos} is past the end of the future "
                f"({len(self._future)} references)"
            )
        if self._future[pos] != key:
            raise ValueError(
                f"reference at position {pos} is to {key!r} but the future has "
                f"{self._future[pos]!r} there; the replay is out of step"
            )
        self._position = pos + 1
        self._ranks.set(key, (-self._next_use[pos], pos))

    def on_remove(self, key: Key) -> None:
        self._ranks.discard(key)

    def victim(self, candidates: Iterable[Key]) -> Key:
        return self._ranks.min_among(_check_candidates(candidates))


class NextUsePolicy(EvictionPolicy):
    """For experts used layer after layer: evicts the one whose next use is expected furthest away.

    A model's layers run in a cycle, so recency misleads: the least recently used experts belong
    to the layer that runs next, and LRU, like LFU with its LRU tie-break, evicts exactly those. A
    cache smaller than one token's experts then gets no hit at all. This policy ranks by expected
    distance instead, counted in layer visits:

        next use of expert e of layer l  ~  d(l) + L * (1 - p) / p

    where L is the number of layers seen, d(l) how many layer visits until l runs again (L for the
    layer running now), and p the share of l's visits that used e: a moving average decaying by
    `decay` per visit of l (the aging), kept after eviction so an expert that comes back keeps its
    history. Ties go to the least recently used key.

    Keys are tuples whose first item is the layer, e.g. (layer, expert) or (layer, expert, kind);
    other keys all count as layer 0. A visit of a layer starts with an access naming a layer other
    than the previous access's.

    Within a layer every key ages by the same factor per visit, so their order by p changes only
    when one is used: each layer keeps its cached keys in a heap ordered by p (as a logarithm
    relative to a fixed visit, which never overflows), and `victim` compares the least used
    candidate of each layer: O(layers x log n), not a scan of the whole cache.
    """

    name = "next-use"

    def __init__(self, *, decay: float = 0.8) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        self._decay = decay
        self._log_decay = math.log(decay)
        self._layers: list[Any] = []  # distinct layers seen, sorted
        self._position: dict[Any, int] = {}  # layer -> index in _layers
        self._current: Any = None
        self._visits: dict[Any, int] = {}  # layer -> visits so far
        self._uses: dict[Key, tuple[float, int]] = {}  # key -> (decayed uses, visit count they date from)
        self._heaps: dict[Any, _LazyMinHeap] = {}  # layer -> its cached keys by (log uses at visit 0, tick)
        self._tick = 0

    @staticmethod
    def _layer(key: Key) -> Any:
        return key[0] if isinstance(key, tuple) and key else 0

    def _see_layer(self, layer: Any) -> None:
        if layer not in self._position:
            bisect.insort(self._layers, layer)
            self._position = {lay: i for i, lay in enumerate(self._layers)}
            self._visits.setdefault(layer, 0)
            self._heaps[layer] = _LazyMinHeap()

    def _uses_now(self, key: Key, layer: Any) -> float:
        uses, since = self._uses.get(key, (0.0, 0))
        return uses * self._decay ** (self._visits[layer] - since)

    def rate(self, key: Key) -> float:
        """The share of its layer's visits that used `key` (aged); 0 for a key never used."""
        layer = self._layer(key)
        if layer not in self._position or not self._visits[layer]:
            return 0.0
        visits = (1 - self._decay ** self._visits[layer]) / (1 - self._decay)  # sum of decay**k
        return self._uses_now(key, layer) / visits

    def on_access(self, key: Key) -> None:
        layer = self._layer(key)
        self._see_layer(layer)
        if layer != self._current:
            self._current = layer
            self._visits[layer] += 1
        uses = self._uses_now(key, layer) + 1.0
        since = self._visits[layer]
        self._uses[key] = (uses, since)
        self._tick += 1
        # uses * decay**(v - since) for every later v: order by log(uses) - since * log(decay)
        self._heaps[layer].set(key, (math.log(uses) - since * self._log_decay, self._tick))

    def on_admit(self, key: Key) -> None:
        """Track a key read ahead, ranked by its use history alone: a read-ahead is not a use,
        and must not start a visit of its layer (it is read while another layer runs)."""
        layer = self._layer(key)
        self._see_layer(layer)
        uses, since = self._uses.get(key, (0.0, self._visits[layer]))
        self._tick += 1
        rank = math.log(uses) - since * self._log_decay if uses > 0 else -math.inf
        self._heaps[layer].set(key, (rank, self._tick))

    def on_remove(self, key: Key) -> None:
        heap = self._heaps.get(self._layer(key))
        if heap is not None:
            heap.discard(key)  # the use history stays

    def expected_distance(self, key: Key) -> float:
        """Layer visits until `key` is expected to be used again."""
        layer = self._layer(key)
        n = len(self._layers)
        here = self._position.get(self._current, 0)
        d = (self._position.get(layer, 0) - here) % n if n else 0
        p = max(self.rate(key), 1e-12)
        return (d or n) + n * (1 - p) / p

    def victim(self, candidates: Iterable[Key]) -> Key:
        pool = _check_candidates(candidates)
        best, best_rank = None, None
        for layer, heap in self._heaps.items():
            try:
                key = heap.min_among(pool)  # the layer's least used candidate (least recent on ties)
            except ValueError:
                continue
            rank = (self.expected_distance(key), -heap.get(key)[1])
            if best_rank is None or rank > best_rank:
                best, best_rank = key, rank
        if best is None:
            raise ValueError(f"none of the {len(pool)} candidates is tracked by the policy")
        return best


class ScheduledPolicy(LRUPolicy):
    """Belady's rule over the cache owner's own forecast, for uses that follow a known order.

    A training step uses each expert's weights in a fixed order: forward up the layers, backward
    down them, the optimizer up again. Its owner knows, at each use, when the next one comes, and
    says so with `expect(key, when)` (a time in its own units: a position in the repeating
    schedule); `advance(now)` says where it is. The victim is the candidate whose forecast use lies
    furthest ahead. A forecast that passed unused (an expert the router did not choose) recurs
    `period` later, as the schedule repeats; a key with no forecast goes first; ties go to the least
    recently used (LRU's order, kept as LRU keeps it). Forecasts outlive evictions: a key read again
    keeps its own.

    Cached keys with a forecast sit in two sorted lists: those whose forecast is still ahead, by
    forecast, and those whose forecast passed, by its phase in the period (a passed forecast next
    recurs at now + ((when - now) mod period), so their order is the phases' read circularly from
    now's). A victim then costs O(p + 1), a reference or a forecast O(log n) plus a list insertion.
    `advance` moves the forecasts it passes from the first list to the second; a step back
    (micro-batches repeat positions) rebuilds both.

    Unlike the others, its owner calls it from threads of its own (the trainer's main thread and its
    optimizer thread), so it holds a lock for its forecasts.
    """

    name = "scheduled"

    def __init__(self, period: float) -> None:
        if not period > 0:
            raise ValueError(f"period must be > 0, got {period!r}")
        super().__init__()
        self.period = period
        self._lock = threading.Lock()
        self._when: dict[Key, float] = {}
        self._now = -math.inf
        self._clock = 0  # references so far: a cached key's tick orders ties least recent first
        self._tick: dict[Key, int] = {}
        self._keys: dict[int, Key] = {}  # tick -> cached key
        self._entry: dict[Key, tuple[list, tuple[float, int]]] = {}  # cached key -> (its list, its item)
        self._ahead: list[tuple[float, int]] = []  # (when, -tick), forecasts at or after now
        self._passed: list[tuple[float, int]] = []  # (when mod period, -tick), forecasts before now
        self._unforecast: OrderedDict[Key, None] = OrderedDict()  # cached keys with no forecast, LRU first

    # -- the cache's hooks -------------------------------------------------------------------------
    def on_access(self, key: Key) -> None:
        with self._lock:
            super().on_access(key)
            self._unindex(key)
            self._keys.pop(self._tick.get(key), None)
            self._clock += 1
            self._tick[key] = self._clock
            self._keys[self._clock] = key
            self._index(key)

    def on_remove(self, key: Key) -> None:
        with self._lock:
            super().on_remove(key)
            self._unindex(key)
            self._keys.pop(self._tick.pop(key, None), None)

    # -- the owner's forecasts ---------------------------------------------------------------------
    def expect(self, key: Key, when: float) -> None:
        """`key`'s next use is expected at `when`."""
        with self._lock:
            self._unindex(key)
            self._when[key] = when
            self._index(key)

    def advance(self, now: float) -> None:
        """The schedule has reached `now`: forecasts before it passed unused."""
        with self._lock:
            back = now < self._now
            self._now = now
            if back:
                for key in list(self._entry):
                    self._unindex(key)
                    self._index(key)
                return
            cut = bisect.bisect_left(self._ahead, (now, -math.inf))
            for when, neg_tick in self._ahead[:cut]:
                key = self._keys[-neg_tick]
                item = (when % self.period, neg_tick)
                bisect.insort(self._passed, item)
                self._entry[key] = (self._passed, item)
            del self._ahead[:cut]

    def next_use(self, key: Key) -> float:
        """When `key` is expected next (inf without a forecast)."""
        with self._lock:
            when = self._when.get(key)
            if when is None:
                return math.inf
            if when < self._now:
                when += math.ceil((self._now - when) / self.period) * self.period
            return when

    # -- the ranking -------------------------------------------------------------------------------
    def _index(self, key: Key) -> None:
        if key not in self._tick:  # not cached: only its forecast is kept
            return
        when = self._when.get(key)
        if when is None:
            self._unforecast[key] = None
            return
        ahead = when >= self._now
        target = self._ahead if ahead else self._passed
        item = (when if ahead else when % self.period, -self._tick[key])
        bisect.insort(target, item)
        self._entry[key] = (target, item)

    def _unindex(self, key: Key) -> None:
        self._unforecast.pop(key, None)
        found = self._entry.pop(key, None)
        if found is not None:
            target, item = found
            del target[bisect.bisect_left(target, item)]

    def _furthest_first(self):
        """(rank, tick, key) of every cached key with a forecast, the furthest next use first and
        ties least recent first: the two lists merged, the passed one read circularly from now."""
        now, period = self._now, self.period
        phase = now % period if self._passed else 0.0
        split = bisect.bisect_left(self._passed, (phase, -math.inf))
        passed = itertools.chain(range(split - 1, -1, -1), range(len(self._passed) - 1, split - 1, -1))
        i, b = len(self._ahead) - 1, next(passed, None)
        while i >= 0 or b is not None:
            a = self._ahead[i] if i >= 0 else None
            item = self._passed[b] if b is not None else None
            # higher rank first; equal ranks by the lower tick (the larger -tick)
            if item is None or (a is not None and a >= (now + (item[0] - phase) % period, item[1])):
                i -= 1
                yield self._keys[-a[1]]
            else:
                b = next(passed, None)
                yield self._keys[-item[1]]

    def victim(self, candidates: Iterable[Key]) -> Key:
        pool = _check_candidates(candidates)
        with self._lock:
            for key in self._unforecast:  # no forecast: least recent first
                if key in pool:
                    return key
            for key in self._furthest_first():
                if key in pool:
                    return key
        raise ValueError(f"none of the {len(pool)} candidates is tracked by the policy")


# `scheduled` is not built by name: it needs an owner that forecasts its uses
_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {
    LFUAgingPolicy.name: LFUAgingPolicy,
    LFUPolicy.name: LFUPolicy,
    LRUPolicy.name: LRUPolicy,
    BeladyPolicy.name: BeladyPolicy,
    NextUsePolicy.name: NextUsePolicy,
}

POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)  # ("lfu-aging", "lfu", "lru", "belady", "next-use")


def make_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    """Build the policy registered as `name`; `kwargs` go to its constructor.

    `lfu-aging` takes `aging_interval`, `belady` requires `future`, `next-use` takes `decay`; the
    others take nothing.
    """
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown eviction policy {name!r}; allowed: {', '.join(POLICY_NAMES)}")
    logger.debug("eviction policy %s %s", name, sorted(kwargs))
    return factory(**kwargs)
