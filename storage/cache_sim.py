"""Replay an expert-routing trace through ExpertCache to compare eviction policies offline.

Backs `semoe store cache-sim`. A trace is JSONL, one record per line, in the order a model asks
for experts:

    {"layer": 3, "experts": [5, 17]}

Each record is the set of experts one layer needs at once; the cache counts capacity in experts
(every entry is 1 "byte") and keys them `(layer, expert)`. `hit_rate_curves` sweeps capacities
and `hit_rate_png` draws them (`semoe store cache-sim --plot`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from storage.cache import ExpertCache, ExpertCacheConfig
from storage.errors import BadInputError
from storage.policies import (
    DEFAULT_AGING_INTERVAL,
    POLICY_NAMES,
    BeladyPolicy,
    _require_positive_int,
)

logger = logging.getLogger(__name__)

TraceRecord = tuple[int, list[int]]  # (layer, experts)

_RECORD_SHAPE = '{"layer": L, "experts": [e, ...]}'


class TraceError(BadInputError, ValueError):
    """A trace file that cannot be read; the message is one line naming file and line."""


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_record(text: str, where: str) -> TraceRecord:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected an object {_RECORD_SHAPE}")
    layer, experts = obj.get("layer"), obj.get("experts")
    if not _is_index(layer):
        raise TraceError(f'{where}: "layer" must be a non-negative integer')
    if not isinstance(experts, list) or not all(_is_index(e) for e in experts):
        raise TraceError(f'{where}: "experts" must be a list of non-negative integers')
    return layer, experts


def read_trace(path: str | os.PathLike[str]) -> list[TraceRecord]:
    """Read a JSONL trace into (layer, experts) records; skips blank lines, ignores extra fields.

    Raises TraceError with a `file:line: what was expected` message on the first bad line.
    """
    records = []
    # Decoded line by line, so a bad byte is reported on its own line, not a buffer's first.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{where}: not UTF-8 text") from None
            if line.strip():
                records.append(_parse_record(line, where))
    return records


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Hits and misses of one replay; a record's experts count once each."""

    hits: int
    misses: int

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 for an empty trace."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def to_json(self) -> dict[str, int | float]:
        """The result as a JSON-ready dict."""
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hit_rate}


def _record_keys(layer: int, experts: Iterable[int]) -> list[tuple[int, int]]:
    # Duplicates count once; first-seen order is kept so the Belady future matches the replay.
    return [(layer, expert) for expert in dict.fromkeys(experts)]


def _replay_record(cache: ExpertCache, keys: list[tuple[int, int]]) -> None:
    # Pin the record's resident experts before touching any: the experts one layer needs at once
    # must never be evicted to make room for each other, whatever order they are listed in.
    for key in keys:
        if key in cache:
            cache.pin(key)
    for key in keys:
        if cache.lookup(key) is None:
            cache.reserve(key, 1, use=True)  # a miss served; pinned by reserve, like the residents above
            cache.complete(key, None)
    for key in keys:
        cache.unpin(key)


def simulate(
    trace: Sequence[TraceRecord],
    capacity_experts: int,
    policy: str,
    *,
    aging_interval: int = DEFAULT_AGING_INTERVAL,
) -> SimResult:
    """Replay `trace` through an ExpertCache holding `capacity_experts` experts under `policy`.

    Raises ValueError if a record needs more distinct experts at once than the cache holds.
    """
    _require_positive_int("capacity_experts", capacity_experts)
    config = ExpertCacheConfig(
        capacity_bytes=capacity_experts, policy=policy, aging_interval=aging_interval
    )
    records = [_record_keys(layer, experts) for layer, experts in trace]
    for index, keys in enumerate(records):
        if len(keys) > capacity_experts:
            raise ValueError(
                f"trace record {index} (layer {trace[index][0]}) needs {len(keys)} distinct "
                f"experts at once but capacity_experts={capacity_experts}"
            )
    belady = BeladyPolicy([key for keys in records for key in keys]) if policy == "belady" else None
    cache = ExpertCache(config, policy=belady)
    for keys in records:
        _replay_record(cache, keys)
    stats = cache.stats()
    result = SimResult(hits=stats.hits, misses=stats.misses)
    logger.debug("cache-sim %s capacity=%d: %s", policy, capacity_experts, result)
    return result


def simulate_all(
    trace: Sequence[TraceRecord],
    capacity_experts: int,
    policies: Iterable[str] = POLICY_NAMES,
    *,
    aging_interval: int = DEFAULT_AGING_INTERVAL,
) -> dict[str, SimResult]:
    """simulate() once per policy name, in the order given."""
    return {
        name: simulate(trace, capacity_experts, name, aging_interval=aging_interval)
        for name in policies
    }


def capacity_points(trace: Sequence[TraceRecord], max_points: int = 32) -> list[int]:
    """Capacities worth sweeping, ascending: from the largest record (the least a cache can replay) to
    the trace's distinct experts (where every policy misses each expert once only), at most
    `max_points` of them, evenly spread."""
    _require_positive_int("max_points", max_points)
    if not trace:
        raise ValueError("the trace has no records")
    low = max(1, max(len(set(experts)) for _, experts in trace))
    high = max(low, len({(layer, e) for layer, experts in trace for e in experts}))
    if high - low + 1 <= max_points:
        return list(range(low, high + 1))
    if max_points == 1:
        return [high]
    return sorted({round(low + i * (high - low) / (max_points - 1)) for i in range(max_points)})


def hit_rate_curves(
    trace: Sequence[TraceRecord],
    capacities: Sequence[int],
    policies: Iterable[str] = POLICY_NAMES,
    *,
    aging_interval: int = DEFAULT_AGING_INTERVAL,
) -> dict[str, list[SimResult]]:
    """simulate() at every capacity for every policy: {policy: [result per capacity]}."""
    return {
        name: [simulate(trace, c, name, aging_interval=aging_interval) for c in capacities]
        for name in policies
    }


def hit_rate_png(
    capacities: Sequence[int],
    curves: dict[str, list[SimResult]],
    path: str | os.PathLike[str],
    *,
    title: str = "",
) -> None:
    """Plot hit rate against capacity, one line per policy, Belady (the optimum) as a dashed ceiling."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, results in curves.items():
        rates = [r.hit_rate for r in results]
        if name == "belady":
            ax.plot(capacities, rates, color="black", ls="--", lw=1.5, label="belady (optimal, offline)")
            ax.fill_between(capacities, rates, 1.0, color="0.9", lw=0)  # out of any policy's reach
        else:
            ax.plot(capacities, rates, marker="o", ms=3, lw=1.2, label=name)
    ax.set_xlabel("cache capacity (experts)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0.0, 1.0)
    ax.set_xlim(capacities[0], capacities[-1] if len(capacities) > 1 else capacities[0] + 1)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    fig.savefig(path, format="png", dpi=100)
