"""Capacity sweeps for `semoe store cache-sim --plot`."""

from __future__ import annotations

import pytest

from storage.cache_sim import capacity_points, hit_rate_curves, hit_rate_png, simulate


def test_capacity_points_span_the_largest_record_to_every_expert():
    trace = [(0, [0, 1, 1]), (1, [2]), (0, [3, 0])]
    assert capacity_points(trace) == [2, 3, 4]  # 4 distinct (layer, expert) keys
    wide = [(0, [e]) for e in range(100)]
    points = capacity_points(wide, max_points=5)
    assert points == [1, 26, 50, 75, 100]
    with pytest.raises(ValueError, match="no records"):
        capacity_points([])


def test_curves_are_simulate_at_each_capacity_and_belady_is_the_ceiling(tmp_path):
    trace = [(0, [e % 5, (e * 3) % 7]) for e in range(40)]
    caps = capacity_points(trace)
    curves = hit_rate_curves(trace, caps, ["lru", "belady"])
    assert curves["lru"] == [simulate(trace, c, "lru") for c in caps]
    assert all(l.hits <= b.hits for l, b in zip(curves["lru"], curves["belady"]))
    assert curves["lru"][-1] == curves["belady"][-1]  # room for everything: compulsory misses only
    hit_rate_png(caps, curves, tmp_path / "c.png", title="t")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
