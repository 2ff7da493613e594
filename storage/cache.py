"""CPU expert cache: bookkeeping of which expert payloads are resident, bounded in bytes.

Plain Python and deterministic: the cache decides what is resident, what to evict and who waits
for what; it never reads or copies data. Payloads are opaque objects produced by a loader.

Lifecycle of an entry:

    reserve ──> LOADING ──complete──> READY ──evict / policy──> EVICTED
                   └─────fail──────> FAILED

Bytes are counted from `reserve` on, so loads in flight cannot overcommit the cache. LOADING and
pinned entries are never evicted; `reserve` raises CacheFullError rather than wait for room.
One condition variable guards all state, so loader and consumer threads may call any method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from storage.errors import CacheFullError
from storage.policies import (
    DEFAULT_AGING_INTERVAL,
    POLICY_NAMES,
    EvictionPolicy,
    Key,
    _require_positive_int,
    make_policy,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CacheEntry",
    "CacheStats",
    "EntryState",
    "ExpertCache",
    "ExpertCacheConfig",
]


class EntryState(enum.Enum):
    """Where a cache entry is in its lifecycle; EVICTED and FAILED entries are no longer cached."""

    LOADING = "loading"
    READY = "ready"
    EVICTED = "evicted"
    FAILED = "failed"


@dataclass(kw_only=True, eq=False)
class CacheEntry:
    """One cached item. Fields change only under the cache's lock; treat them as read-only."""

    key: Key
    nbytes: int
    state: EntryState = EntryState.LOADING
    payload: Any = None  # set by complete(); dropped once the entry leaves the cache
    pin_count: int = 0  # entries with pins are never evicted
    waiters: int = 0  # threads blocked in wait_ready on this entry
    error: BaseException | None = None  # the load's exception once FAILED

    @property
    def evictable(self) -> bool:
        """True when the cache may evict this entry: READY and not pinned."""
        return self.state is EntryState.READY and self.pin_count == 0


@dataclass(kw_only=True)
class CacheStats:
    """Counters since construction or the last reset_stats().

    Only lookups count hits and misses: `hits` found a READY entry, `inflight_hits` found one
    still LOADING (no new load, but the caller waits), `misses` found nothing. `insertions` counts
    loads completed (complete()), `evictions` every READY entry removed, whether by the policy,
    evict() or clear(); failed loads count in neither.
    """

    hits: int = 0
    misses: int = 0
    inflight_hits: int = 0
    insertions: int = 0
    evictions: int = 0
    bytes_inserted: int = 0
    bytes_evicted: int = 0

    @property
    def lookups(self) -> int:
        """All lookups counted: hits + inflight_hits + misses."""
        return self.hits + self.inflight_hits + self.misses

    @property
    def hit_rate(self) -> float:
        """READY hits over all lookups (in-flight hits are not hits); 0.0 before any lookup."""
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(kw_only=True)
class ExpertCacheConfig:
    """Size and eviction policy of an ExpertCache."""

    capacity_bytes: int
    policy: str = "lfu-aging"  # one of POLICY_NAMES
    aging_interval: int = DEFAULT_AGING_INTERVAL  # references between count halvings (lfu-aging)

    def __post_init__(self) -> None:
        _require_positive_int("capacity_bytes", self.capacity_bytes)
        if self.policy not in POLICY_NAMES:
            allowed = ", ".join(POLICY_NAMES)
            raise ValueError(f"policy must be one of {allowed}, got {self.policy!r}")
        _require_positive_int("aging_interval", self.aging_interval)


def _policy_from_config(config: ExpertCacheConfig) -> EvictionPolicy:
    if config.policy == "belady":
        raise ValueError(
            "policy 'belady' needs the future access sequence; pass policy=BeladyPolicy(future)"
        )
    if config.policy == "lfu-aging":
        return make_policy(config.policy, aging_interval=config.aging_interval)
    return make_policy(config.policy)


EvictCallback = Callable[[Key, Any], None]


class ExpertCache:
    """Byte-bounded cache of expert payloads with pinning, in-flight loads and pluggable eviction.

    `policy`, when given, is used instead of building `config.policy` (BeladyPolicy must be built
    by the caller, with the future). `on_evict(key, payload)` runs after an entry is evicted,
    outside the lock, so the owner can return the payload's buffers to a pool; if it raises, the
    remaining callbacks still run and the first exception is re-raised to the caller.
    """

    def __init__(
        self,
        config: ExpertCacheConfig,
        *,
        policy: EvictionPolicy | None = None,
        on_evict: EvictCallback | None = None,
    ) -> None:
        self.config = config
        self._policy = policy if policy is not None else _policy_from_config(config)
        self._on_evict = on_evict
        self._cond = threading.Condition()
        self._entries: dict[Key, CacheEntry] = {}
        self._evictable: set[Key] = set()  # keys of entries with entry.evictable, kept in sync
        # speculative entries not yet used, oldest first: evicted before anything the policy ranks,
        # so a wrong guess costs one slot instead of pushing out the working set
        self._probation: dict[Key, None] = {}
        self._used_bytes = 0
        self._evictable_bytes = 0
        self._stats = CacheStats()

    # ---- queries --------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """The byte budget."""
        return self.config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes held by LOADING and READY entries."""
        with self._cond:
            return self._used_bytes

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy in use."""
        return self._policy

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        """True if `key` is cached in any state; counts neither hit nor miss."""
        with self._cond:
            return key in self._entries

    def ready(self, key: Key) -> bool:
        """True if `key` is cached and READY; counts neither hit nor miss."""
        with self._cond:
            entry = self._entries.get(key)
            return entry is not None and entry.state is EntryState.READY

    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        with self._cond:
            return dataclasses.replace(self._stats)

    def reset_stats(self) -> None:
        """Zero the counters."""
        with self._cond:
            self._stats = CacheStats()

    # ---- lookup and loading ---------------------------------------------------------------

    def lookup(self, key: Key, *, pin: bool = False) -> CacheEntry | None:
        """The entry for `key` (READY or LOADING) or None; counts a hit, in-flight hit or miss.

        `pin=True` pins a found entry atomically, so it cannot be evicted before the caller uses it.
        """
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            self._touch_locked(entry, pin=pin)
            return entry

    def lookup_or_reserve(self, key: Key, nbytes: int, *, probation: bool = False) -> tuple[CacheEntry, bool]:
        """Atomic lookup(pin=True), else reserve(); returns (pinned entry, caller must load it).

        `probation=True` marks a new entry speculative: until a lookup uses it (or `record_use`), it
        is evicted before every entry the policy ranks.
        """
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None:
                if probation:  # a speculative request is not a use
                    self._pin_locked(entry)
                else:
                    self._touch_locked(entry, pin=True)
                return entry, False
            self._stats.misses += 1
            entry, evicted = self._reserve_locked(key, nbytes, probation, use=not probation)
        self._notify_evicted(evicted)
        return entry, True

    def record_use(self, key: Key) -> None:
        """A use of a cached entry that no lookup saw: an upper tier (a device ring) still held it,
        or a speculative read turned out right. The policy ranks it as used and it leaves
        probation; no hit is counted. Unknown keys are ignored (the entry may be gone already)."""
        with self._cond:
            if key in self._entries:
                self._probation.pop(key, None)
                self._policy.on_access(key)

    def reserve(self, key: Key, nbytes: int, *, probation: bool = False, use: bool = False) -> CacheEntry:
        """Create a LOADING entry for `key`, pinned once for the caller; evicts by policy for room.

        A reservation reads ahead of use (a prefetch) unless `use` says it is for a use now (a
        miss being served): the policy then counts the insertion as that use.

        Raises ValueError if `key` is already cached or `nbytes` exceeds the whole capacity, and
        CacheFullError if pinned and loading entries leave no room (nothing is evicted then).
        """
        with self._cond:
            entry, evicted = self._reserve_locked(key, nbytes, probation, use=use)
        self._notify_evicted(evicted)
        return entry

    def complete(self, key: Key, payload: Any) -> CacheEntry:
        """Mark the LOADING entry READY with `payload`, wake its waiters; the loader's pin stays."""
        with self._cond:
            entry = self._loading_entry_locked(key, "complete")
            entry.payload = payload
            entry.state = EntryState.READY
            self._sync_evictable(entry)
            self._stats.insertions += 1
            self._stats.bytes_inserted += entry.nbytes
            self._cond.notify_all()
            return entry

    def fail(self, key: Key, exc: BaseException) -> None:
        """Drop the LOADING entry (and all its pins); waiters get `exc` raised from wait_ready."""
        with self._cond:
            entry = self._loading_entry_locked(key, "fail")
            entry.error = exc
            entry.pin_count = 0
            self._remove_locked(entry, EntryState.FAILED)
            self._cond.notify_all()
        logger.debug("load of %r failed: %s", key, exc)

    def wait_ready(
        self, key: Key, timeout: float | None = None, *, pin: bool = False
    ) -> CacheEntry:
        """Block until `key` is READY and return its entry.

        Raises KeyError if `key` is not cached, TimeoutError after `timeout` seconds, and the load's
        own exception (as concurrent.futures.Future.result does) if the load fails. With
        `pin=False` a READY entry may be evicted as soon as this returns; `pin=True` pins it
        first (the pin is undone on timeout).
        """
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(key)
            if pin:
                self._pin_locked(entry)
            entry.waiters += 1
            try:
                done = self._cond.wait_for(lambda: entry.state is not EntryState.LOADING, timeout)
            finally:
                entry.waiters -= 1
            if not done:
                if pin:
                    self._unpin_locked(entry)
                raise TimeoutError(f"{key!r} still loading after {timeout} s")
            if entry.error is not None:  # set by fail(), together with state FAILED
                raise entry.error
            return entry

    # ---- pins and explicit eviction -------------------------------------------------------

    def pin(self, key: Key) -> CacheEntry:
        """Add a pin to `key` (any state): pinned entries are never evicted. KeyError if absent."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(key)
            self._pin_locked(entry)
            return entry

    def unpin(self, key: Key) -> None:
        """Drop one pin from `key`; ValueError if it has none."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(key)
            self._unpin_locked(entry)
            if entry.evictable:
                self._cond.notify_all()  # room for a reserve waiting in `wait_for_room`

    def wait_for_room(self, nbytes: int, timeout: float | None = None, *, pins_elsewhere: bool = False) -> bool:
        """Block until a reserve of `nbytes` could evict its way in (reads in flight landed, pins
        were released); False after `timeout` seconds, or at once when nothing is loading, since
        then only the caller's own pins could free room, unless `pins_elsewhere`: other threads
        hold pins they will release."""
        def room() -> bool:
            return self._used_bytes + nbytes - self.capacity_bytes <= self._evictable_bytes

        with self._cond:
            loading = any(e.state is EntryState.LOADING for e in self._entries.values())
            if not room() and not loading and not pins_elsewhere:
                return False
            return self._cond.wait_for(room, timeout)

    @contextlib.contextmanager
    def pinned(self, key: Key) -> Iterator[CacheEntry]:
        """Hold a pin on `key` for the duration of a `with` block."""
        entry = self.pin(key)
        try:
            yield entry
        finally:
            self.unpin(key)

    def evict(self, key: Key) -> None:
        """Evict `key` now; KeyError if absent, ValueError if it is pinned or still loading."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(key)
            if not entry.evictable:
                raise ValueError(
                    f"cannot evict {key!r}: it is {entry.state.value} with {entry.pin_count} pins"
                )
            evicted = [self._remove_locked(entry, EntryState.EVICTED)]
        self._notify_evicted(evicted)

    def shrink(self, capacity_bytes: int) -> int:
        """Lower the byte budget to `capacity_bytes`, evicting as a reserve would (unused guesses
        first, then the policy's victims) until the entries fit or none is evictable; pinned and
        loading entries that keep the cache over budget are evicted by later reserves once
        released. Returns the bytes evicted now."""
        with self._cond:
            if not 0 < capacity_bytes <= self.capacity_bytes:
                raise ValueError(f"capacity_bytes={capacity_bytes} must be in (0, {self.capacity_bytes}]")
            self.config = dataclasses.replace(self.config, capacity_bytes=capacity_bytes)
            evicted, before = [], self._used_bytes
            while self._used_bytes > capacity_bytes and self._evictable:
                evicted.append(self._remove_locked(self._victim_locked(), EntryState.EVICTED))
            freed = before - self._used_bytes
        self._notify_evicted(evicted)
        return freed

    def grow(self, capacity_bytes: int) -> None:
        """Raise the byte budget to `capacity_bytes` (memory found free): reserves waiting for room
        go on."""
        with self._cond:
            if capacity_bytes < self.capacity_bytes:
                raise ValueError(f"capacity_bytes={capacity_bytes} is below the budget {self.capacity_bytes}")
            self.config = dataclasses.replace(self.config, capacity_bytes=capacity_bytes)
            self._cond.notify_all()

    def clear(self) -> int:
        """Evict every evictable entry; pinned and loading ones stay. Returns how many left."""
        with self._cond:
            victims = [self._entries[key] for key in list(self._evictable)]
            evicted = [self._remove_locked(entry, EntryState.EVICTED) for entry in victims]
        logger.debug("cleared %d entries", len(evicted))
        self._notify_evicted(evicted)
        return len(evicted)

    # ---- internals (callers hold the lock) -------------------------------------------------

    def _touch_locked(self, entry: CacheEntry, *, pin: bool) -> None:
        self._probation.pop(entry.key, None)
        if entry.state is EntryState.READY:
            self._stats.hits += 1
        else:
            self._stats.inflight_hits += 1
        self._policy.on_access(entry.key)
        if pin:
            self._pin_locked(entry)

    def _reserve_locked(self, key: Key, nbytes: int, probation: bool = False, use: bool = False
                        ) -> tuple[CacheEntry, list[tuple[Key, Any]]]:
        _require_positive_int("nbytes", nbytes)
        existing = self._entries.get(key)
        if existing is not None:
            raise ValueError(f"{key!r} is already cached ({existing.state.value})")
        if nbytes > self.capacity_bytes:
            raise ValueError(
                f"entry {key!r} needs {nbytes} bytes, more than the whole cache "
                f"(capacity_bytes={self.capacity_bytes})"
            )
        evicted = self._make_room_locked(key, nbytes)
        entry = CacheEntry(key=key, nbytes=nbytes, pin_count=1)
        self._entries[key] = entry
        self._used_bytes += nbytes
        if use:  # a miss: the entry is read for a use
            self._policy.on_insert(key)
        else:  # read ahead of any use; `lookup`, `lookup_or_reserve` or `record_use` report the use
            self._policy.on_admit(key)
        if probation:
            self._probation[key] = None
        return entry, evicted

    def _make_room_locked(self, key: Key, nbytes: int) -> list[tuple[Key, Any]]:
        overflow = self._used_bytes + nbytes - self.capacity_bytes
        if overflow <= 0:
            return []
        # Check before evicting anything: a reserve that cannot succeed must not empty the cache.
        if overflow > self._evictable_bytes:
            raise CacheFullError(
                f"cannot fit {key!r} ({nbytes} bytes): {self._used_bytes} of "
                f"{self.capacity_bytes} bytes in use, only {self._evictable_bytes} evictable; "
                f"the rest is pinned or loading"
            )
        evicted = []
        while self._used_bytes + nbytes > self.capacity_bytes:
            evicted.append(self._remove_locked(self._victim_locked(), EntryState.EVICTED))
        return evicted

    def _victim_locked(self) -> CacheEntry:
        """The entry to evict next: the oldest unused guess, else the policy's choice."""
        victim_key = next((k for k in self._probation if k in self._evictable), None)
        if victim_key is None:
            victim_key = self._policy.victim(self._evictable)
        victim = self._entries.get(victim_key)
        if victim is None or not victim.evictable:
            raise RuntimeError(f"policy {self._policy.name!r} chose {victim_key!r}, which is not evictable")
        return victim

    def _remove_locked(self, entry: CacheEntry, state: EntryState) -> tuple[Key, Any]:
        del self._entries[entry.key]
        self._probation.pop(entry.key, None)
        self._policy.on_remove(entry.key)
        entry.state = state
        self._sync_evictable(entry)
        self._used_bytes -= entry.nbytes
        if state is EntryState.EVICTED:
            self._stats.evictions += 1
            self._stats.bytes_evicted += entry.nbytes
        # Stale references must not reach a payload whose buffers go back to a pool.
        payload, entry.payload = entry.payload, None
        return entry.key, payload

    def _sync_evictable(self, entry: CacheEntry) -> None:
        # The single place that keeps _evictable and _evictable_bytes equal to entry.evictable.
        listed = entry.key in self._evictable
        if entry.evictable and not listed:
            self._evictable.add(entry.key)
            self._evictable_bytes += entry.nbytes
        elif listed and not entry.evictable:
            self._evictable.remove(entry.key)
            self._evictable_bytes -= entry.nbytes

    def _pin_locked(self, entry: CacheEntry) -> None:
        entry.pin_count += 1
        self._sync_evictable(entry)

    def _unpin_locked(self, entry: CacheEntry) -> None:
        if entry.pin_count == 0:
            raise ValueError(f"{entry.key!r} is not pinned")
        entry.pin_count -= 1
        self._sync_evictable(entry)

    def _loading_entry_locked(self, key: Key, action: str) -> CacheEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(key)
        if entry.state is not EntryState.LOADING:
            raise ValueError(f"cannot {action} {key!r}: it is {entry.state.value}, not loading")
        return entry

    def _notify_evicted(self, evicted: list[tuple[Key, Any]]) -> None:
        if self._on_evict is None or not evicted:
            return
        first_error: Exception | None = None
        for key, payload in evicted:
            try:
                self._on_evict(key, payload)
            except Exception as exc:  # the other payloads must still be returned to their owner
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
