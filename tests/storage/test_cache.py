"""ExpertCache bookkeeping: eviction orders, pins, byte accounting, waits and counters."""

from __future__ import annotations

import random
import threading
import time

import pytest

from storage.errors import CacheFullError
from storage.cache import EntryState, ExpertCache, ExpertCacheConfig
from storage.errors import StorageError
from storage.policies import BeladyPolicy


class EvictLog:
    """on_evict callback recording (key, payload) in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, object]] = []

    def __call__(self, key, payload) -> None:
        self.calls.append((key, payload))

    @property
    def keys(self) -> list[object]:
        return [key for key, _ in self.calls]


def _cache(capacity: int, policy: str = "lru", **kwargs) -> tuple[ExpertCache, EvictLog]:
    log = EvictLog()
    config = ExpertCacheConfig(capacity_bytes=capacity, policy=policy, **kwargs)
    return ExpertCache(config, on_evict=log), log


def _load(cache: ExpertCache, key, nbytes: int = 1, payload=None) -> None:
    """reserve + complete + unpin: a finished load nobody is using."""
    cache.reserve(key, nbytes)
    cache.complete(key, payload if payload is not None else f"payload-{key}")
    cache.unpin(key)


def _get(cache: ExpertCache, key, nbytes: int = 1) -> None:
    """A use of `key`: a hit, or a miss followed by a load."""
    if cache.lookup(key) is None:
        _load(cache, key, nbytes)


# ---- eviction orders --------------------------------------------------------------------------


def test_lru_cache_evicts_b_on_a_b_c_a_d():
    cache, log = _cache(3)
    for key in "ABCAD":
        _get(cache, key)
    assert log.calls == [("B", "payload-B")]
    assert sorted(k for k in "ABCD" if k in cache) == ["A", "C", "D"]
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions) == (1, 4, 1)


def test_eviction_frees_enough_bytes_for_a_large_entry():
    cache, log = _cache(10)
    for key in "ABCDE":
        _load(cache, key, nbytes=2)
    _load(cache, "big", nbytes=5)  # needs 5: A, B and C (2 bytes each) go, least recent first
    assert log.keys == ["A", "B", "C"]
    assert cache.used_bytes == 9


def test_belady_instance_overrides_config():
    future = ["A", "B", "C", "A", "B"]
    config = ExpertCacheConfig(capacity_bytes=2, policy="belady")
    log = EvictLog()
    cache = ExpertCache(config, policy=BeladyPolicy(future), on_evict=log)
    for key in future:
        _get(cache, key)
    assert log.keys == ["B", "C"]  # C evicts B (next use 4 vs A's 3); B evicts C (never again)
    assert cache.stats().hits == 1


def test_belady_without_future_is_an_error():
    with pytest.raises(ValueError, match=r"pass policy=BeladyPolicy\(future\)"):
        ExpertCache(ExpertCacheConfig(capacity_bytes=4, policy="belady"))


# ---- pins, full cache, oversize ---------------------------------------------------------------


def test_cache_full_when_everything_is_pinned_or_loading():
    cache, log = _cache(2)
    cache.reserve("A", 1)  # LOADING, pinned by the loader
    cache.reserve("B", 1)
    cache.complete("B", "b")  # READY but still pinned
    with pytest.raises(CacheFullError, match=r"cannot fit 'C' \(1 bytes\): 2 of 2 bytes in use"):
        cache.reserve("C", 1)
    assert issubclass(CacheFullError, StorageError)
    assert len(cache) == 2 and log.calls == []
    cache.unpin("B")
    cache.reserve("C", 1)
    assert log.calls == [("B", "b")]
    assert "A" in cache and "B" not in cache


def test_cache_full_is_detected_before_evicting_anything():
    cache, log = _cache(3)
    _load(cache, "A", nbytes=1)
    cache.reserve("B", 2)  # pinned
    with pytest.raises(CacheFullError, match="only 1 evictable"):
        cache.reserve("C", 3)
    assert "A" in cache and log.calls == []


def test_entry_larger_than_capacity():
    cache, _ = _cache(10)
    with pytest.raises(ValueError) as info:
        cache.reserve("big", 11)
    assert str(info.value) == (
        "entry 'big' needs 11 bytes, more than the whole cache (capacity_bytes=10)"
    )
    assert len(cache) == 0 and cache.used_bytes == 0


def test_reserve_rejects_duplicates_and_bad_sizes():
    cache, _ = _cache(10)
    cache.reserve("A", 1)
    with pytest.raises(ValueError, match=r"^'A' is already cached \(loading\)$"):
        cache.reserve("A", 1)
    with pytest.raises(ValueError, match=r"^nbytes must be a positive integer, got 0$"):
        cache.reserve("B", 0)


def test_pins_are_counted_and_block_explicit_eviction():
    cache, log = _cache(4)
    _load(cache, "A")
    cache.pin("A")
    with cache.pinned("A") as entry:
        assert entry.pin_count == 2
        with pytest.raises(ValueError, match="cannot evict 'A': it is ready with 2 pins"):
            cache.evict("A")
    cache.unpin("A")
    with pytest.raises(ValueError, match="'A' is not pinned"):
        cache.unpin("A")
    cache.evict("A")
    assert log.keys == ["A"] and "A" not in cache
    with pytest.raises(KeyError):
        cache.pin("A")


def test_clear_keeps_pinned_and_loading_entries():
    cache, log = _cache(10)
    for key in "ABC":
        _load(cache, key)
    cache.pin("B")
    cache.reserve("D", 1)
    assert cache.clear() == 2
    assert sorted(log.keys) == ["A", "C"]
    assert sorted(k for k in "ABCD" if k in cache) == ["B", "D"]
    assert cache.used_bytes == 2


def test_evicted_entry_is_marked_and_drops_its_payload():
    cache, log = _cache(1)
    _load(cache, "A", payload="buf-A")
    entry = cache.lookup("A")
    _load(cache, "B")
    assert log.calls[0] == ("A", "buf-A")
    assert entry.state is EntryState.EVICTED and entry.payload is None


def test_on_evict_errors_do_not_lose_other_callbacks():
    seen = []

    def on_evict(key, payload):
        seen.append(key)
        if key == "A":
            raise OSError("pool closed")

    cache = ExpertCache(ExpertCacheConfig(capacity_bytes=2, policy="lru"), on_evict=on_evict)
    _load(cache, "A")
    _load(cache, "B")
    with pytest.raises(OSError, match="pool closed"):
        cache.clear()
    assert sorted(seen) == ["A", "B"] and len(cache) == 0


# ---- loads, waits, counters -------------------------------------------------------------------


def test_hit_miss_and_inflight_counting():
    cache, _ = _cache(10)
    assert cache.lookup("A") is None  # miss
    cache.reserve("A", 3)
    assert cache.lookup("A").state is EntryState.LOADING  # in-flight hit
    cache.complete("A", "a")
    assert cache.lookup("A").payload == "a"  # hit
    assert "A" in cache and "Z" not in cache  # membership counts nothing
    stats = cache.stats()
    assert (stats.hits, stats.inflight_hits, stats.misses) == (1, 1, 1)
    assert stats.hit_rate == pytest.approx(1 / 3)
    assert (stats.insertions, stats.bytes_inserted) == (1, 3)
    cache.reset_stats()
    assert cache.stats().lookups == 0 and cache.stats().hit_rate == 0.0


def test_lookup_or_reserve_pins_and_says_who_loads():
    cache, _ = _cache(2)
    entry, created = cache.lookup_or_reserve("A", 1)
    assert created and entry.pin_count == 1
    again, created = cache.lookup_or_reserve("A", 1)
    assert again is entry and not created and entry.pin_count == 2
    stats = cache.stats()
    assert (stats.misses, stats.inflight_hits) == (1, 1)


def _wait_for_waiter(entry) -> None:
    # Synchronisation only: spin until the other thread is blocked in wait_ready.
    deadline = time.monotonic() + 10
    while entry.waiters == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("waiter thread never started waiting")
        time.sleep(0.001)


def _run_waiter(cache, key, **kwargs):
    result = {}

    def wait():
        try:
            result["entry"] = cache.wait_ready(key, **kwargs)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, result


def test_complete_wakes_waiters():
    cache, _ = _cache(4)
    entry = cache.reserve("A", 1)
    thread, result = _run_waiter(cache, "A", pin=True)
    _wait_for_waiter(entry)
    cache.complete("A", "a")
    thread.join(10)
    assert result["entry"] is entry and entry.payload == "a"
    assert entry.pin_count == 2  # the loader's and the waiter's


def test_fail_removes_entry_and_waiters_get_the_exception():
    cache, log = _cache(4)
    entry = cache.reserve("A", 2)
    thread, result = _run_waiter(cache, "A")
    _wait_for_waiter(entry)
    error = OSError("disk gone")
    cache.fail("A", error)
    thread.join(10)
    assert result["error"] is error
    assert entry.state is EntryState.FAILED and "A" not in cache
    assert cache.used_bytes == 0 and log.calls == []
    assert cache.stats().evictions == 0
    with pytest.raises(KeyError):
        cache.wait_ready("A")


def test_wait_ready_timeout_undoes_its_pin():
    cache, _ = _cache(4)
    entry = cache.reserve("A", 1)
    with pytest.raises(TimeoutError, match="'A' still loading"):
        cache.wait_ready("A", timeout=0, pin=True)
    assert entry.pin_count == 1 and entry.waiters == 0


def test_complete_and_fail_need_a_loading_entry():
    cache, _ = _cache(4)
    _load(cache, "A")
    with pytest.raises(ValueError, match="cannot complete 'A': it is ready, not loading"):
        cache.complete("A", None)
    with pytest.raises(KeyError):
        cache.fail("B", OSError())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("capacity_bytes", 0, "capacity_bytes must be a positive integer, got 0"),
        ("policy", "fifo", "policy must be one of lfu-aging, lfu, lru, belady, next-use, got 'fifo'"),
        ("aging_interval", -1, "aging_interval must be a positive integer, got -1"),
    ],
)
def test_config_validation(field, value, message):
    kwargs = {"capacity_bytes": 8, field: value}
    with pytest.raises(ValueError) as info:
        ExpertCacheConfig(**kwargs)
    assert str(info.value) == message


# ---- randomised check against a reference model -------------------------------------------------


class ReferenceCache:
    """Dict-based model: brute-force victim by minimum rank over unpinned READY entries."""

    def __init__(self, capacity: int, policy: str, aging_interval: int) -> None:
        self.capacity = capacity
        self.policy = policy
        self.aging_interval = aging_interval if policy == "lfu-aging" else None
        self.entries: dict[int, dict] = {}  # key -> {"nbytes", "pins", "ready"}
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.refs = 0

    def used(self) -> int:
        return sum(e["nbytes"] for e in self.entries.values())

    def evictable(self) -> list[int]:
        return [k for k, e in self.entries.items() if e["ready"] and e["pins"] == 0]

    def reference(self, key: int) -> None:
        self.refs += 1
        self.count[key] = self.count.get(key, 0) + 1
        self.last[key] = self.refs
        if self.aging_interval and self.refs % self.aging_interval == 0:
            self.count = {k: c // 2 for k, c in self.count.items()}

    def rank(self, key: int):
        return self.last[key] if self.policy == "lru" else (self.count[key], self.last[key])

    def remove(self, key: int) -> None:
        del self.entries[key], self.count[key], self.last[key]

    def reserve(self, key: int, nbytes: int) -> list[int] | None:
        """Evicted keys in order, or None when the model says the cache is full."""
        evictable_bytes = sum(self.entries[k]["nbytes"] for k in self.evictable())
        if self.used() + nbytes - self.capacity > evictable_bytes:
            return None
        evicted = []
        while self.used() + nbytes > self.capacity:
            victim = min(self.evictable(), key=self.rank)
            evicted.append(victim)
            self.remove(victim)
        self.entries[key] = {"nbytes": nbytes, "pins": 1, "ready": False}
        self.reference(key)
        return evicted


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfu-aging"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_model_and_never_evicts_pinned(policy, seed):
    rng = random.Random(seed)
    capacity, aging_interval = 12, 7
    cache, log = _cache(capacity, policy, aging_interval=aging_interval)
    model = ReferenceCache(capacity, policy, aging_interval)
    lookups = full_errors = 0
    for _ in range(3000):
        op = rng.random()
        pinned = [k for k, e in model.entries.items() if e["pins"]]
        loading = [k for k, e in model.entries.items() if not e["ready"]]
        evictions_before = len(log.calls)
        if op < 0.55:
            key = rng.randrange(30)
            lookups += 1
            if key in model.entries:
                pin = rng.random() < 0.3
                entry = cache.lookup(key, pin=pin)
                assert entry is not None and entry.key == key
                model.reference(key)
                model.entries[key]["pins"] += pin
            else:
                assert cache.lookup(key) is None
                nbytes = rng.randint(1, 4)
                expected = model.reserve(key, nbytes)
                if expected is None:
                    full_errors += 1
                    with pytest.raises(CacheFullError):
                        cache.reserve(key, nbytes)
                else:
                    cache.reserve(key, nbytes)
                    assert log.keys[evictions_before:] == expected
                    if rng.random() < 0.7:
                        cache.complete(key, key)
                        model.entries[key]["ready"] = True
        elif op < 0.75 and pinned:
            key = rng.choice(pinned)
            cache.unpin(key)
            model.entries[key]["pins"] -= 1
        elif op < 0.85 and loading:
            key = rng.choice(loading)
            cache.complete(key, key)
            model.entries[key]["ready"] = True
        elif op < 0.9 and loading:
            key = rng.choice(loading)
            cache.fail(key, OSError("injected"))
            model.remove(key)
        elif model.evictable():
            key = rng.choice(model.evictable())
            cache.evict(key)
            model.remove(key)
        # Pinned and loading entries must never have left through eviction.
        for key, payload in log.calls[evictions_before:]:
            assert key not in pinned and key not in loading and payload == key
        assert cache.used_bytes == model.used() <= capacity
        assert len(cache) == len(model.entries)
        assert all(key in cache for key in model.entries)
    stats = cache.stats()
    assert stats.lookups == lookups
    assert stats.evictions == len(log.calls)
    assert full_errors > 0  # the run did exercise a full cache


# ---- threads ----------------------------------------------------------------------------------


def test_threads_smoke():
    capacity, n_threads, n_ops = 20, 8, 400
    cache, log = _cache(capacity, "lfu-aging", aging_interval=50)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(n_ops):
                key = rng.randrange(40)
                entry, created = cache.lookup_or_reserve(key, 1)
                if created:
                    cache.complete(key, ("payload", key))
                else:
                    cache.wait_ready(key)
                # Pinned since lookup_or_reserve, so it cannot have been evicted meanwhile.
                if entry.state is not EntryState.READY or entry.payload != ("payload", key):
                    raise AssertionError(f"bad entry for {key}: {entry}")
                cache.unpin(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    stats = cache.stats()
    assert stats.lookups == n_threads * n_ops
    assert stats.insertions == stats.misses
    assert stats.evictions == len(log.calls) == stats.insertions - len(cache)
    assert cache.used_bytes == len(cache) <= capacity
    assert all(payload == ("payload", key) for key, payload in log.calls)
    resident = len(cache)
    assert cache.clear() == resident  # nothing was left pinned or loading
    assert cache.used_bytes == 0


def test_speculative_entries_are_evicted_first_until_used():
    cache = ExpertCache(ExpertCacheConfig(capacity_bytes=3, policy="lru"))
    for key in ("a", "b"):
        cache.reserve(key, 1)
        cache.complete(key, key)
        cache.unpin(key)
    cache.reserve("guess", 1, probation=True)
    cache.complete("guess", "guess")
    cache.unpin("guess")
    cache.reserve("c", 1)  # LRU alone would evict "a"; the unused guess goes first
    assert "guess" not in cache and "a" in cache
    cache.complete("c", "c")
    cache.unpin("c")
    entry, must_load = cache.lookup_or_reserve("guess2", 1, probation=True)
    assert must_load
    cache.complete("guess2", "g")
    cache.unpin("guess2")
    cache.record_use("guess2")  # used after all: now ranked by the policy like the rest
    cache.reserve("d", 1)
    assert "guess2" in cache and "a" not in cache


def test_a_reserve_waits_for_reads_in_flight_to_make_room():
    """A cache full of entries still loading (reads ahead of use) has no room now but will have:
    `wait_for_room` returns once one lands and its loader's pin goes; with nothing loading it
    returns False at once (only the caller's own pins could free room)."""
    cache, _ = _cache(2)
    for key in ("a", "b"):
        cache.reserve(key, 1)  # LOADING, pinned by its loader
    with pytest.raises(CacheFullError):
        cache.reserve("c", 1)
    result = []
    waiter = threading.Thread(target=lambda: result.append(cache.wait_for_room(1, timeout=30)))
    waiter.start()
    cache.complete("a", "payload")  # READY but still pinned by the loader: no room yet
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not result
    cache.unpin("a")
    waiter.join(timeout=30)
    assert result == [True]
    cache.reserve("c", 1)  # "a" is evicted for it
    assert "a" not in cache
    cache.complete("b", "p")
    cache.complete("c", "p")
    assert cache.wait_for_room(1, timeout=30) is False  # everything pinned, nothing loading


def test_shrink_evicts_down_to_the_new_budget_and_later_reserves_keep_to_it():
    cache, log = _cache(6)
    for key in "ABCDEF":
        _load(cache, key)
    cache.pin("A")  # pinned: stays, over budget until released
    assert cache.shrink(2) == 4  # bytes evicted now
    assert cache.capacity_bytes == 2 and cache.used_bytes == 2
    assert "A" in cache and len(log.keys) == 4 and "A" not in log.keys
    cache.unpin("A")
    _load(cache, "G")
    _load(cache, "H")
    assert cache.used_bytes == 2  # each reserve evicted to stay within the lowered budget
    with pytest.raises(ValueError, match="capacity_bytes"):
        cache.shrink(3)  # growing is not what shrink does
    cache.grow(4)  # room again: the next loads stay without evicting
    _load(cache, "I")
    _load(cache, "J")
    assert cache.used_bytes == 4 and len(log.keys) == 6
    with pytest.raises(ValueError, match="below the budget"):
        cache.grow(3)


def test_shrink_evicts_unused_guesses_before_the_policys_victims():
    cache, log = _cache(3)
    _load(cache, "A")
    _load(cache, "B")
    cache.reserve("G", 1, probation=True)  # a guess, read but never used
    cache.complete("G", "payload-G")
    cache.unpin("G")
    cache.shrink(2)
    assert log.keys == ["G"]
