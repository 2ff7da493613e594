"""The step simulator on hand-made pipelines whose times and peaks can be worked out on paper."""

from __future__ import annotations

import json

import pytest
from helpers.pipelines import GB, make_profile, make_topology

from mpress.planner import stripes
from mpress.profile import Decision, PipelineProfile, Plan, Stripe
from mpress.simulator import simulate
from mpress.trace import chrome_trace, memory_png


def uniform(stages: int, layers: int, micro_batches: int, saved: int = 100, **kw) -> PipelineProfile:
    return make_profile([[(1.0, 2.0, saved)] * layers for _ in range(stages)], micro_batches, **kw)


def test_two_stages_unit_times():
    # 1F1B, F = 1, B = 2 per stage: s0 F0 [0,1] F1 [1,2]; s1 F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7];
    # s0 B0 [4,6] B1 [7,9]
    p = make_profile([[(1.0, 2.0, 10)], [(1.0, 2.0, 10)]], 2)
    sim = simulate(p, Plan(), make_topology(2))
    assert sim.step_time_s == 9.0
    assert [(o.kind, o.micro_batch, o.start_s, o.end_s) for o in sim.ops[0]] == [
        ("F", 0, 0.0, 1.0), ("F", 1, 1.0, 2.0), ("B", 0, 4.0, 6.0), ("B", 1, 7.0, 9.0)]
    assert [(o.kind, o.micro_batch) for o in sim.ops[1]] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_boundary_transfers_add_to_the_critical_path(schedule):
    # each transfer takes 0.5 s: s1 F0 [1.5,2.5], then (1F1B) B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5];
    # s0 B0 [5,7] B1 [8,10]. GPipe: s1 F0 [1.5,2.5] F1 [2.5,3.5] B0 [3.5,5.5] B1 [5.5,7.5];
    # s0 B0 [6,8] B1 [8,10]
    p = make_profile([[(1.0, 2.0, 10)], [(1.0, 2.0, 10)]], 2, schedule=schedule, boundary_bytes=50)
    sim = simulate(p, Plan(), make_topology(2, {(0, 1): 100.0}))
    assert sim.step_time_s == 10.0


def test_a_busy_link_delays_the_boundary_transfer():
    # stage 0's d2d swap-out occupies link 0 -> 1 over [1, 3]; the activation waits for it: [3, 3.5];
    # s1 F0 [3.5,4.5] B0 [4.5,5.5]; grad [5.5,6]; s0's swap-in [3,5] is ready; s0 B0 [6,7]
    p = make_profile([[(1.0, 1.0, 200)], [(1.0, 1.0, 0)]], 1, boundary_bytes=50)
    topo = make_topology(2, {(0, 1): 100.0})
    assert simulate(p, Plan(), topo).step_time_s == 5.0
    plan = Plan(decisions=[Decision(stage=0, layer=0, technique="d2d", stripes=[Stripe(device=1, bytes=200)])])
    sim = simulate(p, plan, topo)
    assert sim.step_time_s == 7.0
    assert sim.peak_bytes[1] == 200  # the stripe sits on the peer while swapped out


@pytest.mark.parametrize("stages,micro_batches", [(4, 8), (2, 5), (3, 3), (4, 2)])
def test_peak_memory_follows_the_schedule(stages, micro_batches):
    saved, static = 100 * 3, 7 * 3  # per micro-batch, per stage (3 layers)
    kw = {"saved": 100, "param_bytes": 7}
    one_f_one_b = simulate(uniform(stages, 3, micro_batches, **kw), Plan(), make_topology(stages))
    gpipe = simulate(uniform(stages, 3, micro_batches, schedule="gpipe", **kw), Plan(), make_topology(stages))
    assert one_f_one_b.peak_bytes[0] == static + min(stages, micro_batches) * saved
    assert one_f_one_b.peak_bytes[stages - 1] == static + saved
    assert gpipe.peak_bytes == [static + micro_batches * saved] * stages
    assert one_f_one_b.memory[0][0] == (0.0, static)
    assert one_f_one_b.memory[0][-1] == (one_f_one_b.step_time_s, static)


def _host_profile_plan(host_bw: float):
    # one stage, GPipe, 4 micro-batches of 2 layers (F = B = 1 each): layer 0 goes to host
    p = make_profile([[(1.0, 1.0, 100), (1.0, 1.0, 100)]], 4, schedule="gpipe")
    plan = Plan(decisions=[Decision(stage=0, layer=0, technique="host")])
    return p, plan, make_topology(1, host_bw=host_bw)


def _host_case(host_bw: float):
    p, plan, topo = _host_profile_plan(host_bw)
    return simulate(p, Plan(), topo), simulate(p, plan, topo)


def test_host_swap_hidden_by_a_long_idle_time():
    base, swapped = _host_case(host_bw=1000.0)  # 0.1 s a copy
    assert base.step_time_s == swapped.step_time_s == 16.0
    assert base.peak_bytes == [800]
    # at F3's start: layer 1 of m0..m2 (300), m0's layer 0 prefetched (100), m3's layers (200)
    assert swapped.peak_bytes == [600]
    assert swapped.moved_bytes["host"] == 2 * 4 * 100
    assert swapped.saved_bytes == {"keep": 400, "recompute": 0, "host": 400, "d2d": 0}
    assert swapped.host_swap_bytes == 400 and swapped.recompute_bytes == swapped.d2d_swap_bytes == 0
    assert not swapped.swap_wait_s


def test_host_swap_exposed_by_a_slow_link():
    base, swapped = _host_case(host_bw=10.0)  # 10 s a copy
    assert swapped.step_time_s > base.step_time_s + 10
    assert swapped.swap_wait_s[(0, 0)] > 10


def test_a_swaps_own_cost_lengthens_the_layers_forward_and_backward():
    # reference: the hidden swap of the case above, its layer's forward and backward lengthened by
    # what the runtime spends swapping it (measured by mpress.profiler.measure_runtime)
    p, plan, topo = _host_profile_plan(host_bw=1000.0)
    lp = p.stages[0].layers[0]
    lp.swap_forward_s, lp.swap_backward_s = 0.25, 0.5
    slow = _host_profile_plan(host_bw=1000.0)[0]
    slow.stages[0].layers[0].forward_s += 0.25
    slow.stages[0].layers[0].backward_s += 0.5
    swapped = simulate(p, plan, topo)
    assert swapped.step_time_s == pytest.approx(simulate(slow, plan, topo).step_time_s, rel=1e-12)
    assert swapped.step_time_s == pytest.approx(16.0 + 4 * (0.25 + 0.5), rel=1e-12)
    # a kept layer pays nothing for it
    assert simulate(p, Plan(), topo).step_time_s == 16.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recompute_adds_a_forward_per_micro_batch(schedule):
    layers = [(1.0, 2.0, 100), (0.25, 0.5, 100), (0.5, 1.0, 100)]
    p = make_profile([layers], 3, schedule=schedule)
    plan = Plan(decisions=[Decision(stage=0, layer=1, technique="recompute")])
    base, sim = simulate(p, Plan(), make_topology(1)), simulate(p, plan, make_topology(1))
    assert sim.step_time_s == base.step_time_s + 3 * 0.25
    assert sim.recompute_s == 3 * 0.25
    assert sim.peak_bytes[0] == base.peak_bytes[0] - 100 * (3 if schedule == "gpipe" else 1)


def test_a_recomputed_layer_holds_its_profiled_replay_inputs():
    # the previous layer's output (100 bytes) unless the profile says what the replay keeps
    # (here 30: the input and a table the layer reads beside it)
    p = make_profile([[(1.0, 2.0, 100), (0.25, 0.5, 100)]], 3, schedule="gpipe")
    p.stages[0].layers[0].output_bytes = 100
    plan = Plan(decisions=[Decision(stage=0, layer=1, technique="recompute")])
    base = simulate(p, Plan(), make_topology(1)).peak_bytes[0]
    assert simulate(p, plan, make_topology(1)).peak_bytes[0] == base - 3 * (100 - 100)
    p.stages[0].layers[1].replay_bytes = 30
    assert simulate(p, plan, make_topology(1)).peak_bytes[0] == base - 3 * (100 - 30)


def test_recompute_equals_a_longer_backward_in_a_pipeline():
    # reference: keeping the layer with its backward lengthened by its forward times the same
    stages = [[(1.0, 2.0, 100), (0.5, 1.0, 100)], [(1.0, 2.0, 100)], [(1.0, 2.0, 100)]]
    p = make_profile(stages, 6, boundary_bytes=10)
    slow = make_profile(stages, 6, boundary_bytes=10)
    slow.stages[0].layers[1].backward_s += 0.5
    topo = make_topology(3, {(0, 1): 100.0, (1, 2): 100.0})
    plan = Plan(decisions=[Decision(stage=0, layer=1, technique="recompute")])
    assert simulate(p, plan, topo).step_time_s == pytest.approx(simulate(slow, Plan(), topo).step_time_s,
                                                              rel=1e-12)


def test_stripes_follow_link_bandwidth():
    topo = make_topology(3, {(0, 1): 50 * GB, (0, 2): 25 * GB})
    assert stripes(300, 0, [1, 2], topo) == [Stripe(device=1, bytes=200), Stripe(device=2, bytes=100)]
    assert sum(x.bytes for x in stripes(1000, 0, [1, 2], topo)) == 1000
    # a one-stage step on device 0, stripes on devices 1 and 2: both copies take 300 / 75e9 s
    p = make_profile([[(1.0, 1.0, 300)]], 1)
    plan = Plan(decisions=[Decision(stage=0, layer=0, technique="d2d", stripes=stripes(300, 0, [1, 2], topo))])
    sim = simulate(p, plan, topo, record=True)
    copies = [e for e in sim.events if e.stream == "d2d"]
    assert [e.name.split()[0] for e in copies] == ["out", "in"]
    assert all(e.dur_s == pytest.approx(300 / (75 * GB)) for e in copies)
    assert sim.peak_bytes[1:] == [200, 100]
    assert sim.moved_bytes["d2d"] == 600


def test_bad_plans_are_rejected():
    p = make_profile([[(1.0, 1.0, 300)], [(1.0, 1.0, 300)]], 1)
    topo = make_topology(3, {(0, 1): GB})
    with pytest.raises(ValueError, match="stage 1, layer 0"):
        simulate(p, Plan(decisions=[Decision(stage=1, layer=0, technique="host")]), topo)
    with pytest.raises(ValueError, match="stripes carry 100 bytes"):
        simulate(p, Plan(decisions=[Decision(stage=0, layer=0, technique="d2d",
                                             stripes=[Stripe(device=1, bytes=100)])]), topo)
    with pytest.raises(ValueError, match="no path between device 0 and device 2"):
        simulate(p, Plan(decisions=[Decision(stage=0, layer=0, technique="d2d",
                                             stripes=[Stripe(device=2, bytes=300)])]), topo)
    with pytest.raises(ValueError, match="own device"):
        simulate(p, Plan(mapping=[1, 1]), topo)


def test_eight_by_sixty_four_with_half_the_layers_compacted():
    """The planner's scale: 8 stages x 64 layers (F 2 ms, B 4 ms, 100 MB saved) x 32 micro-batches,
    every other layer compacted (11 host, 10 recompute, 11 D2D per stage). The traffic is the plan's
    on paper, and the step is 1F1B's M + S - 1 slots of F + B + recompute, each with at most one
    20 us boundary transfer each way (the links keep up with every swap). How fast this simulates is
    measured by bench/bench_mpress.py, not asserted here."""
    S, L, M, saved = 8, 64, 32, 10**8
    p = make_profile([[(2e-3, 4e-3, saved)] * L for _ in range(S)], M, boundary_bytes=10**6)
    topo = make_topology(S, {(i, j): 50 * GB for i in range(S) for j in range(i + 1, S)}, host_bw=16 * GB)
    decisions = [Decision(stage=s, layer=L * s + i, technique=("host", "recompute", "d2d")[i % 3],
                          stripes=stripes(saved, s, [(s + 1) % S, (s + 2) % S], topo) if i % 3 == 2 else [])
                 for s in range(S) for i in range(0, L, 2)]
    sim = simulate(p, Plan(decisions=decisions), topo)
    per_stage = {"keep": 32, "host": 11, "recompute": 10, "d2d": 11}
    assert sim.saved_bytes == {t: S * n * saved * M for t, n in per_stage.items()}
    assert sim.moved_bytes == {"keep": 0, "recompute": 0, "host": 2 * S * 11 * saved * M,
                               "d2d": 2 * S * 11 * saved * M}
    assert sim.recompute_s == pytest.approx(S * 10 * 2e-3 * M)
    assert all(sorted((o.kind, o.micro_batch) for o in ops) == sorted((k, m) for k in "BF" for m in range(M))
               for ops in sim.ops)
    assert sum(sim.swap_wait_s.values()) == 0
    slots = (M + S - 1) * (L * 2e-3 + L * 4e-3 + 10 * 2e-3)
    assert slots <= sim.step_time_s <= slots + (M + S - 1) * 2 * 10**6 / (50 * GB)


def test_chrome_trace_and_memory_png(tmp_path):
    p = make_profile([[(1.0, 1.0, 100), (1.0, 1.0, 100)], [(1.0, 1.0, 100)]], 3, boundary_bytes=10)
    topo = make_topology(3, {(0, 1): 100.0, (0, 2): 100.0})
    plan = Plan(decisions=[Decision(stage=0, layer=0, technique="host"),
                           Decision(stage=0, layer=1, technique="d2d", stripes=[Stripe(device=2, bytes=100)])])
    sim = simulate(p, plan, topo, record=True)
    chrome_trace(sim, tmp_path / "step.json")
    doc = json.loads((tmp_path / "step.json").read_text())
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(0, "compute"), (0, "host"), (0, "d2d"), (0, "p2p")} <= threads
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(sim.step_time_s * 1e6)
    assert {e["pid"] for e in events if e["ph"] == "C"} == {0, 1, 2}
    memory_png(sim, tmp_path / "memory.png", budget_bytes=300)
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
