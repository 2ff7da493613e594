"""Trace reading and policy replay for `semoe store cache-sim`."""

from __future__ import annotations

import json
import math
import random
from itertools import combinations

import pytest

from storage.cache_sim import SimResult, TraceError, read_trace, simulate, simulate_all
from storage.errors import BadInputError
from storage.policies import POLICY_NAMES

# Silberschatz's reference string: with 3 frames OPT takes 9 faults, LRU 12.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def _single_expert_trace(refs):
    return [(0, [expert]) for expert in refs]


def _random_trace(rng: random.Random, n_records: int, n_layers: int, n_experts: int, top_k: int):
    return [
        (rng.randrange(n_layers), [rng.randrange(n_experts) for _ in range(rng.randint(1, top_k))])
        for _ in range(n_records)
    ]


def _optimal_misses(trace, capacity: int) -> int:
    """Fewest misses of any demand-paging cache that keeps each record's experts resident together.

    Exhaustive search over every eviction choice, keyed by the resident set.
    """
    best = {frozenset(): 0}
    for layer, experts in trace:
        needed = {(layer, e) for e in experts}
        step: dict[frozenset, int] = {}
        for resident, cost in best.items():
            missing = needed - resident
            n_evict = max(0, len(resident) + len(missing) - capacity)
            for dropped in combinations(sorted(resident - needed), n_evict):
                after = (resident - set(dropped)) | needed
                step[after] = min(step.get(after, math.inf), cost + len(missing))
        best = step
    return min(best.values())


def test_textbook_sequence_belady_and_lru():
    trace = _single_expert_trace(TEXTBOOK)
    results = simulate_all(trace, 3, ["belady", "lru"])
    assert results["belady"] == SimResult(hits=11, misses=9)
    assert results["lru"] == SimResult(hits=8, misses=12)


@pytest.mark.parametrize("seed", range(8))
def test_belady_is_optimal(seed):
    rng = random.Random(seed)
    trace = _random_trace(rng, n_records=14, n_layers=2, n_experts=4, top_k=3)
    assert simulate(trace, 4, "belady").misses == _optimal_misses(trace, 4)


@pytest.mark.parametrize("seed", range(4))
def test_belady_hits_at_least_every_other_policy(seed):
    rng = random.Random(seed)
    trace = _random_trace(rng, n_records=600, n_layers=3, n_experts=8, top_k=3)
    results = simulate_all(trace, 6, aging_interval=16)
    for name, result in results.items():
        assert result.hits + result.misses == results["belady"].hits + results["belady"].misses
        assert results["belady"].hits >= result.hits, name
    assert results["belady"].hits > results["lru"].hits  # strictly better on a random trace


def test_record_experts_are_not_evicted_for_each_other():
    # At the third record LRU's victim would be expert 1, which that record still needs; it is
    # pinned, so 2 goes instead and 1 stays a hit.
    trace = [(0, [1]), (0, [2]), (0, [3, 1])]
    assert simulate(trace, 2, "lru") == SimResult(hits=1, misses=3)


def test_duplicates_within_a_record_count_once():
    assert simulate([(0, [4, 4, 4]), (1, [4])], 2, "lru") == SimResult(hits=0, misses=2)


def test_record_larger_than_capacity():
    with pytest.raises(ValueError) as info:
        simulate([(0, [1]), (5, [1, 2, 3])], 2, "lru")
    assert str(info.value) == (
        "trace record 1 (layer 5) needs 3 distinct experts at once but capacity_experts=2"
    )


def test_simulate_validates_capacity_and_policy():
    with pytest.raises(ValueError, match=r"^capacity_experts must be a positive integer, got 0$"):
        simulate([], 0, "lru")
    with pytest.raises(ValueError, match="policy must be one of"):
        simulate([], 4, "fifo")


def test_simulate_all_keys_and_json():
    results = simulate_all(_single_expert_trace(TEXTBOOK), 3)
    assert tuple(results) == POLICY_NAMES
    assert results["lru"].to_json() == {"hits": 8, "misses": 12, "hit_rate": 0.4}
    assert list(simulate_all([], 3, ["lru"])) == ["lru"]
    assert simulate([], 3, "lfu").to_json() == {"hits": 0, "misses": 0, "hit_rate": 0.0}


def test_read_trace_round_trip(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(
        json.dumps({"layer": 0, "experts": [3, 1]})
        + "\n\n   \n"
        + json.dumps({"layer": 2, "experts": [], "token": 17})
        + "\r\n"
    )
    assert read_trace(path) == [(0, [3, 1]), (2, [])]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"layer": 0, "experts": [1, -2]}', '"experts" must be a list of non-negative integers'),
        ('{"layer": 0, "experts": [1.0]}', '"experts" must be a list of non-negative integers'),
        ('{"layer": 0, "experts": 3}', '"experts" must be a list of non-negative integers'),
        ('{"layer": 0}', '"experts" must be a list of non-negative integers'),
        ('{"layer": true, "experts": [1]}', '"layer" must be a non-negative integer'),
        ('{"experts": [1]}', '"layer" must be a non-negative integer'),
        ("[0, [1]]", 'expected an object {"layer": L, "experts": [e, ...]}'),
        ('{"layer": 0, "experts": [1]', "not valid JSON (Expecting ',' delimiter)"),
    ],
)
def test_bad_trace_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    good = json.dumps({"layer": 0, "experts": [0]})
    path.write_text("\n".join([good, "", good, "", good, "", line, good]) + "\n")
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert str(info.value) == f"{path}:7: {message}"
    assert isinstance(info.value, ValueError) and isinstance(info.value, BadInputError)


def test_trace_not_utf8(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b'{"layer": 0, "experts": [0]}\n{"layer": 1, "experts": [\xff]}\n')
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert str(info.value) == f"{path}:2: not UTF-8 text"
