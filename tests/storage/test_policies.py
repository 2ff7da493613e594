"""Eviction policies on hand-made reference sequences with exact victims."""

from __future__ import annotations

import math
import random

import pytest

from storage.policies import (
    POLICY_NAMES,
    BeladyPolicy,
    EvictionPolicy,
    LFUAgingPolicy,
    LFUPolicy,
    LRUPolicy,
    NextUsePolicy,
    ScheduledPolicy,
    make_policy,
)


def _insert(policy: EvictionPolicy, *keys: str) -> None:
    for key in keys:
        policy.on_insert(key)


def test_lru_evicts_least_recent_and_insert_counts_as_use():
    # A B C A D with room for 3: D's arrival evicts B.
    policy = LRUPolicy()
    _insert(policy, "A", "B", "C")
    policy.on_access("A")
    assert policy.victim({"A", "B", "C"}) == "B"
    policy.on_remove("B")
    policy.on_insert("D")
    assert policy.victim({"A", "C", "D"}) == "C"


def test_victim_only_among_candidates():
    policy = LRUPolicy()
    _insert(policy, "A", "B", "C")
    assert policy.victim({"B", "C"}) == "B"
    assert policy.victim(["C"]) == "C"  # any iterable is accepted


@pytest.mark.parametrize("name", ["lru", "lfu", "lfu-aging"])
def test_victim_needs_a_candidate(name):
    policy = make_policy(name)
    policy.on_insert("A")
    with pytest.raises(ValueError, match="at least one candidate"):
        policy.victim(set())


def test_lfu_and_lru_disagree_on_a_frequent_old_key():
    # A used twice long ago, B and C once each since: LRU drops A, LFU keeps it.
    lru, lfu = LRUPolicy(), LFUPolicy()
    for policy in (lru, lfu):
        policy.on_insert("A")
        policy.on_access("A")
        _insert(policy, "B", "C")
    assert lru.victim({"A", "B", "C"}) == "A"
    assert lfu.victim({"A", "B", "C"}) == "B"


def test_lfu_ties_go_to_least_recently_used():
    policy = LFUPolicy()
    _insert(policy, "A", "B", "C")
    policy.on_access("A")
    assert policy.victim({"A", "B", "C"}) == "B"  # B and C at 1; B used earlier
    policy.on_access("B")
    assert policy.victim({"A", "B", "C"}) == "C"
    assert policy.victim({"A", "B"}) == "A"  # both at 2; A's last use came first


def test_lfu_drops_counts_on_removal():
    policy = LFUPolicy()
    policy.on_insert("A")
    for _ in range(3):
        policy.on_access("A")
    policy.on_remove("A")
    policy.on_insert("A")
    policy.on_insert("B")
    policy.on_access("B")
    assert policy.count("A") == 1
    assert policy.victim({"A", "B"}) == "A"


@pytest.mark.parametrize(
    ("policy", "expected"), [(LFUPolicy(), "B"), (LFUAgingPolicy(aging_interval=4), "A")]
)
def test_aging_makes_an_old_hot_key_evictable(policy, expected):
    # References 1-4 make A hot; the 4th and 8th halve every count under aging_interval=4:
    # after C's insertion A=1, B=1, C=0 (aged) versus A=4, B=3, C=1 (plain LFU).
    policy.on_insert("A")
    for _ in range(3):
        policy.on_access("A")
    policy.on_insert("B")
    policy.on_access("B")
    policy.on_access("B")
    policy.on_insert("C")
    assert policy.victim({"A", "B"}) == expected
    assert policy.victim({"A", "B", "C"}) == "C"


def test_aging_halves_with_floor_division():
    policy = LFUAgingPolicy(aging_interval=3)
    policy.on_insert("A")
    policy.on_access("A")
    assert policy.count("A") == 2
    policy.on_access("A")  # third reference: 3 // 2
    assert policy.count("A") == 1


def test_aging_interval_validated():
    with pytest.raises(ValueError, match=r"^aging_interval must be a positive integer, got 0$"):
        LFUAgingPolicy(aging_interval=0)


def test_belady_evicts_the_farthest_next_use():
    future = ["A", "B", "C", "D", "A", "B", "C"]
    policy = BeladyPolicy(future)
    _insert(policy, "A", "B", "C")
    assert policy.victim({"A", "B", "C"}) == "C"  # next uses: A at 4, B at 5, C at 6
    policy.on_remove("C")
    policy.on_insert("D")
    policy.on_access("A")
    policy.on_access("B")
    # A, B and D are never used again: the least recently referenced, D, goes first.
    assert policy.victim({"A", "B", "D"}) == "D"
    assert policy.victim({"A", "B"}) == "A"
    assert policy.position == 6


def test_belady_rejects_a_replay_out_of_step():
    policy = BeladyPolicy(["A", "B"])
    with pytest.raises(ValueError) as info:
        policy.on_insert("B")
    assert str(info.value) == (
        "reference at position 0 is to 'B' but the future has 'A' there; the replay is out of step"
    )
    policy.on_insert("A")
    policy.on_insert("B")
    with pytest.raises(ValueError, match="past the end of the future"):
        policy.on_access("A")


def test_make_policy_builds_each_registered_policy():
    assert POLICY_NAMES == ("lfu-aging", "lfu", "lru", "belady", "next-use")
    assert type(make_policy("lfu-aging", aging_interval=8)) is LFUAgingPolicy
    assert type(make_policy("lfu")) is LFUPolicy
    assert type(make_policy("lru")) is LRUPolicy
    assert type(make_policy("belady", future=[1, 2])) is BeladyPolicy
    assert type(make_policy("next-use", decay=0.5)) is NextUsePolicy
    for name in POLICY_NAMES:
        kwargs = {"future": []} if name == "belady" else {}
        assert make_policy(name, **kwargs).name == name


def test_make_policy_unknown_name():
    with pytest.raises(ValueError) as info:
        make_policy("fifo")
    assert str(info.value) == "unknown eviction policy 'fifo'; allowed: lfu-aging, lfu, lru, belady, next-use"


@pytest.mark.parametrize("name", ["lfu", "lfu-aging"])
def test_frequency_heap_stays_correct_through_compaction(name):
    # Many updates to few keys force the lazy heap to rebuild; the victim must stay exact.
    policy = make_policy(name, **({"aging_interval": 1000} if name == "lfu-aging" else {}))
    _insert(policy, "A", "B", "C")
    for _ in range(500):
        policy.on_access("A")
        policy.on_access("B")
    policy.on_access("C")
    assert policy.victim({"A", "B", "C"}) == "C"
    assert policy.victim({"A", "B"}) == "A"


def test_next_use_is_optimal_on_a_strict_layer_cycle_where_lru_and_lfu_get_nothing():
    from storage.cache_sim import simulate

    # every token uses experts 0 and 1 of each of 4 layers: 8 experts, room for 6; a record is one
    # layer's experts, pinned together as a layer's experts are
    trace = [(layer, [0, 1]) for _ in range(20) for layer in range(4)]
    got = {name: simulate(trace, 6, name) for name in ("next-use", "lru", "lfu-aging", "lfu", "belady")}
    assert got["lru"].hits == got["lfu-aging"].hits == got["lfu"].hits == 0  # they evict the next layer's
    assert got["next-use"].hits == got["belady"].hits > 0  # every expert is certain: its distance is exact


def test_next_use_weighs_distance_against_use_rate():
    policy = NextUsePolicy(decay=0.5)
    # layers 0..3; expert 0 of each layer is used every token, expert 1 of layer 1 only once
    for t in range(6):
        for layer in range(4):
            policy.on_access((layer, 0))
            if layer == 1 and t == 0:
                policy.on_access((1, 1))
    # now at layer 3: layer 0 runs next, layer 3 (current) is furthest
    assert policy.rate((0, 0)) == pytest.approx(1.0)
    assert policy.rate((1, 1)) == pytest.approx(0.5 ** 5 / sum(0.5 ** k for k in range(6)))
    assert policy.expected_distance((0, 0)) == pytest.approx(1)
    assert policy.expected_distance((3, 0)) == pytest.approx(4)
    # a rare expert of a near layer is further away than a certain one of the furthest layer
    assert policy.expected_distance((1, 1)) > policy.expected_distance((3, 0))
    assert policy.victim({(0, 0), (1, 1), (3, 0)}) == (1, 1)
    assert policy.victim({(0, 0), (2, 0), (3, 0)}) == (3, 0)


def test_next_use_keeps_history_after_eviction_and_breaks_ties_by_recency():
    policy = NextUsePolicy()
    for _ in range(3):
        for layer in range(2):
            for e in (0, 1):
                policy.on_access((layer, e))
    policy.on_remove((0, 0))
    assert policy.rate((0, 0)) == pytest.approx(policy.rate((0, 1)))  # the history stayed
    with pytest.raises(ValueError, match="none of the 1 candidates"):
        policy.victim({(0, 0)})  # not cached any more
    policy.on_insert((0, 0))
    assert policy.victim({(0, 0), (0, 1)}) == (0, 1)  # same distance and rate: the less recent goes
    with pytest.raises(ValueError, match="decay"):
        NextUsePolicy(decay=1.0)


def test_next_use_victim_equals_a_scan_of_every_candidate():
    """The per-layer heaps pick what scoring every candidate would: the largest expected distance,
    the least recently used on ties."""
    import random

    rng = random.Random(3)
    policy = NextUsePolicy()
    last: dict = {}
    cached: set = set()
    tick = 0
    for token in range(60):
        for layer in range(6):
            for e in rng.sample(range(12), 2) + ([rng.randrange(12)] if rng.random() < 0.2 else []):
                key = (layer, e)
                policy.on_access(key)
                tick += 1
                last[key] = tick
                cached.add(key)
            if len(cached) > 20:
                pool = {k for k in cached if rng.random() < 0.8 and k[0] != layer} or set(cached)
                want = max(pool, key=lambda k: (policy.expected_distance(k), -last[k]))
                got = policy.victim(pool)
                assert got == want, (token, layer)
                policy.on_remove(got)
                cached.discard(got)


def test_next_use_read_ahead_is_not_a_use_and_starts_no_visit():
    policy = NextUsePolicy()
    policy.on_access((0, "a"))
    policy.on_access((1, "b"))
    policy.on_access((0, "a"))
    policy.on_admit((1, "guess"))  # read for layer 1 while layer 0 runs
    policy.on_access((0, "a2"))  # still the same visit of layer 0
    assert policy.rate((0, "a")) == pytest.approx(1.0)  # used in both visits of layer 0
    assert policy.rate((1, "guess")) == 0.0
    # never used: it goes before a used expert of its layer, and before layer 0's used experts
    assert policy.victim({(1, "guess"), (1, "b"), (0, "a")}) == (1, "guess")
    policy.on_access((1, "guess"))  # the guess was right
    assert policy.rate((1, "guess")) > 0


def test_scheduled_evicts_the_furthest_forecast_and_keys_without_one_first():
    policy = ScheduledPolicy(period=10)
    _insert(policy, "A", "B", "C", "D")
    policy.expect("A", 3)
    policy.expect("B", 7)
    policy.expect("C", 5)
    assert policy.victim({"A", "B", "C", "D"}) == "D"  # no forecast: never needed as far as anyone knows
    assert policy.victim({"A", "B", "C"}) == "B"
    policy.expect("B", 2)  # a new forecast replaces the old
    assert policy.victim({"A", "B", "C"}) == "C"
    with pytest.raises(ValueError):
        ScheduledPolicy(period=0)


def test_scheduled_forecasts_that_passed_recur_a_period_later_and_ties_go_to_the_least_recent():
    policy = ScheduledPolicy(period=10)
    _insert(policy, "A", "B", "C")
    policy.expect("A", 2)
    policy.expect("B", 8)
    policy.expect("C", 8)
    policy.advance(2)
    assert policy.next_use("A") == 2  # due now, not passed
    assert policy.victim({"A", "B", "C"}) == "B"  # B and C tie; B was used less recently
    policy.on_access("B")
    assert policy.victim({"A", "B", "C"}) == "C"
    policy.advance(5)  # A's use passed without it: expected again at 12, after B and C
    assert policy.next_use("A") == 12
    assert policy.victim({"A", "B", "C"}) == "A"
    policy.advance(25)
    assert policy.next_use("A") == 32 and policy.next_use("B") == 28
    policy.on_remove("A")
    assert policy.victim({"A", "B", "C"}) == "C"  # A is no longer cached; B and C tie, C the less recent
    assert policy.next_use("A") == 32  # its forecast outlives the eviction


def _scheduled_reference(order: list, when: dict, now: float, period: float, pool: set):
    """Belady's rule written plainly: among cached candidates, no forecast first, else the furthest
    next use (a passed forecast recurs a period later); ties to the least recently used."""
    best, best_rank = None, None
    for key in order:  # least recent first
        if key not in pool:
            continue
        w = when.get(key)
        if w is None:
            rank = math.inf
        elif w < now:
            rank = w + math.ceil((now - w) / period) * period
        else:
            rank = w
        if best_rank is None or rank > best_rank:
            best, best_rank = key, rank
    return best


@pytest.mark.parametrize("seed", range(4))
def test_scheduled_picks_what_the_plain_rule_picks_over_random_uses_forecasts_and_steps(seed):
    """The sorted lists against the plain O(n) rule, op by op: references, removals, forecasts
    ahead of and behind now, now moving forward by steps and periods and back (micro-batches),
    candidate sets with keys not cached."""
    rng = random.Random(seed)
    period = 9
    policy = ScheduledPolicy(period=period)
    order: list = []  # cached keys, least recent first
    when: dict = {}
    now = -math.inf
    for _ in range(3000):
        op = rng.random()
        key = rng.randrange(40)
        if op < 0.3:
            policy.on_access(key)
            if key in order:
                order.remove(key)
            order.append(key)
        elif op < 0.4:
            policy.on_remove(key)
            if key in order:
                order.remove(key)
        elif op < 0.65:
            base = 0 if now == -math.inf else now
            w = base + rng.choice([rng.randint(-12, 20), rng.randint(0, 3), 0])
            policy.expect(key, w)
            when[key] = w
        elif op < 0.8:
            base = 0 if now == -math.inf else now
            now = base + rng.choice([1, 1, 2, period, 3 * period + 2, -rng.randint(1, 8)])
            policy.advance(now)
        else:
            pool = set(rng.sample(range(45), rng.randint(1, 20)))
            expected = _scheduled_reference(order, when, now, period, pool)
            if expected is None:
                with pytest.raises(ValueError):
                    policy.victim(pool)
            else:
                assert policy.victim(pool) == expected
        for k in (key,):
            expected_next = when.get(k, math.inf)
            if expected_next != math.inf and expected_next < now:
                expected_next += math.ceil((now - expected_next) / period) * period
            assert policy.next_use(k) == expected_next
