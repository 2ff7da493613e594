"""Model data in MPress: optimizer states placed on the device, in host memory or in peers, played
by the simulator on pipelines worked out on paper, chosen by the planner where only they make a
model fit, and scored against the offload-everything baseline."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers.pipelines import make_topology

from mpress.analytic import analytic_profile
from mpress.planner import offload_everything, plan
from mpress.profile import (Decision, LayerProfile, ModelDataDecision, PipelineProfile, Plan, SavedTensor, StageProfile,
                            Stripe)
from mpress.schedule import in_flight_peak
from mpress.simulator import simulate
from mpress.topology import builtin
from mpress.trace import trace_events

GB = 10**9


def model_profile(stages: int, layers: int, *, state: int = 60, update: int = 40, step_s: float = 0.5,
                  host_step_s: float = 3.0) -> PipelineProfile:
    """Layers of forward 1 s, backward 2 s and no saved activations, whose model data are `update`
    bytes of weights and gradients and `state` bytes of optimizer states; one micro-batch (GPipe)."""
    out, index = [], 0
    for s in range(stages):
        lps = []
        for _ in range(layers):
            lps.append(LayerProfile(index=index, name=f"layer{index}", forward_s=1.0, backward_s=2.0,
                                    param_bytes=state + update, state_bytes=state, update_bytes=update,
                                    step_s=step_s, host_step_s=host_step_s))
            index += 1
        out.append(StageProfile(stage=s, layers=lps))
    return PipelineProfile(stages=out, micro_batches=1, schedule="gpipe")


def host(stage: int, layer: int, step_on: str = "device") -> ModelDataDecision:
    return ModelDataDecision(stage=stage, layer=layer, technique="host", step_on=step_on)


def test_kept_model_data_steps_after_the_last_backward():
    # 3 x (F 1 + B 2) = 9 s, then three steps of 0.5 s; all 300 bytes resident
    sim = simulate(model_profile(1, 3), Plan(), make_topology(1, host_bw=10.0))
    assert sim.step_time_s == 10.5 and sim.optimizer_s == 1.5
    assert sim.peak_bytes == [300]
    assert sim.model_bytes == {"keep": 180, "host": 0, "d2d": 0}


def test_states_in_host_memory_come_in_one_layer_ahead_and_leave_after_the_step():
    # static 3 x 40. Host link 10 B/s, 6 s a copy, in and out lanes separate. From t = 9:
    # in L0 [9,15] step [15,15.5] out [15.5,21.5]; in L1 [15,21] step [21,21.5] out [21.5,27.5];
    # in L2 waits for L0 to have left: [21.5,27.5] step [27.5,28] out [28,34]. At most two layers'
    # states are on the device: peak 120 + 2 x 60.
    sim = simulate(model_profile(1, 3), Plan(model_data=[host(0, i) for i in range(3)]),
                   make_topology(1, host_bw=10.0), record=True)
    assert sim.step_time_s == 34.0 and sim.optimizer_s == 25.0
    assert sim.peak_bytes == [240]
    assert sim.model_bytes == {"keep": 0, "host": 180, "d2d": 0}
    assert sim.model_moved_bytes == {"keep": 0, "host": 360, "d2d": 0}
    lanes = {(e.stream, e.name): (e.start_s, e.start_s + e.dur_s) for e in sim.events if e.stream.startswith("model")}
    assert lanes[("model in", "states in L2")] == (21.5, 27.5)
    assert lanes[("model out", "states out L0")] == (15.5, 21.5)
    # during the pipeline only the weights and gradients are there
    assert min(b for t, b in sim.memory[0] if t < 9.0) == 120


def test_a_host_step_sends_gradients_out_and_weights_back_and_the_cpu_is_shared():
    # two stages of one layer each, both stepped on the host (CPU Adam 3 s). GPipe, M = 1:
    # s0 F [0,1], s1 F [1,2] B [2,4], s0 B [4,6]. s1: grads out 20 B [4,6], adam [6,9], weights in
    # [9,11]. s0: grads out [6,8], adam waits for the CPU: [9,12], weights in [12,14].
    p = model_profile(2, 1)
    sim = simulate(p, Plan(model_data=[host(0, 0, "host"), host(1, 1, "host")]),
                   make_topology(2, host_bw=10.0), record=True)
    assert sim.step_time_s == 14.0
    cpu = sorted((e.start_s, e.start_s + e.dur_s) for e in sim.events if e.stream == "cpu")
    assert cpu == [(6.0, 9.0), (9.0, 12.0)]
    assert sim.peak_bytes == [40, 40]  # the states never come to the device
    assert sim.model_moved_bytes["host"] == 80  # 20 out and 20 back per layer


def test_states_striped_over_a_peer_sit_there_all_step():
    # stage 0's states (60 B) on device 1 over a 30 B/s link: in [3,5] step [5,5.5] out [5.5,7.5]
    p = model_profile(1, 1)
    d2d = ModelDataDecision(stage=0, layer=0, technique="d2d", stripes=[Stripe(device=1, bytes=60)])
    sim = simulate(p, Plan(model_data=[d2d]), make_topology(2, {(0, 1): 30.0}, host_bw=10.0))
    assert sim.step_time_s == 7.5
    assert sim.peak_bytes == [100, 60]  # back for the step on device 0; held by device 1
    assert min(b for t, b in sim.memory[0]) == 40


@pytest.mark.parametrize("decision,message", [
    (ModelDataDecision(stage=0, layer=0, technique="d2d", stripes=[Stripe(device=1, bytes=50)]),
     "stripes carry 50 bytes"),
    (ModelDataDecision(stage=0, layer=1, technique="host"), "no such layer"),
    (ModelDataDecision(stage=0, layer=0, technique="d2d", stripes=[Stripe(device=0, bytes=60)]), "peer"),
])
def test_bad_model_data_decisions_are_refused(decision, message):
    with pytest.raises(ValueError, match=message):
        simulate(model_profile(1, 1), Plan(model_data=[decision]), make_topology(2, {(0, 1): 30.0}))


def test_a_step_on_the_host_needs_states_in_host_memory():
    with pytest.raises(ValueError, match="runs on the host only"):
        ModelDataDecision(stage=0, layer=0, technique="d2d", step_on="host")


def test_plans_with_model_data_round_trip_through_json():
    p = Plan(model_data=[host(0, 1, "host"),
                         ModelDataDecision(stage=1, layer=2, technique="d2d", stripes=[Stripe(device=3, bytes=7)])])
    assert Plan.from_json(p.to_json()) == p
    assert Plan.from_json(json.dumps({"decisions": [], "mapping": []})).model_data == []  # older plans


def test_the_planner_moves_model_data_when_nothing_else_can_fit():
    # parameters, gradients and states: 3 x 100 on one device with a budget of 200; no activations,
    # so only moving states can fit it
    p = model_profile(1, 3, state=60, update=40)
    res = plan(p, make_topology(1, host_bw=10.0), budget_bytes=250)
    assert res.fits, res.reason
    assert {d.technique for d in res.plan.model_data} == {"host"}
    assert res.sim.peak_bytes[0] <= 250
    assert plan(p, make_topology(1, host_bw=10.0), budget_bytes=119, host_steps=False).reason.startswith(
        "device 0 (stage 0): parameters and gradients alone take 120 bytes")
    # streaming weights, the stage still holds two layers' weights and one's gradients
    assert plan(p, make_topology(1, host_bw=10.0), budget_bytes=59).reason.startswith(
        "device 0 (stage 0): the weights streaming holds alone take 60 bytes")


def paper_gpt(layers: int) -> tuple[PipelineProfile, object]:
    topo = builtin("dgx1", 8, gpu_memory_bytes=32 * GB)
    return analytic_profile(arch="gpt", layers=layers, hidden=5120, heads=40, seq=1024, micro_batch=2,
                            micro_batches=16, vocab=50257, stages=8, flops=topo.flops), topo


@pytest.mark.parametrize("layers", [16, 32, 64, 128])
def test_paper_scale_gpt_on_a_dgx1_fits(layers):
    """GPT hidden 5120 (5.3B, 10.3B, 20.4B, 40.5B parameters) on 8 x 32 GB with 768 GB of host
    memory. At 128 layers host memory is what runs short: it must go to the choices taken, not to
    every stage's candidates."""
    profile, topo = paper_gpt(layers)
    res = plan(profile, topo, host_memory_bytes=768 * GB)
    assert res.fits, res.reason
    k = {st.stage: in_flight_peak(profile.schedule, st.stage, len(profile.stages), profile.micro_batches)
         for st in profile.stages}
    host_held = res.sim.model_bytes["host"] + res.sim.streamed_bytes + sum(
        lp.saved_bytes * k[st.stage] for st in profile.stages for lp in st.layers
        if res.plan.decision(st.stage, lp.index).technique == "host")
    assert host_held <= 768 * GB
    if layers == 64:
        # parameters and optimizer states alone exceed a GPU, so model data must move, and every
        # technique takes part
        assert max(st.static_bytes for st in profile.stages) > 32 * GB
        acts = {d.technique for d in res.plan.decisions}
        model = {d.technique for d in res.plan.model_data}
        assert {"recompute", "host", "d2d"} <= acts | model and "host" in model
        assert sum(res.sim.model_bytes[t] for t in ("host", "d2d")) > 100 * GB
        host_used = res.sim.model_bytes["host"] + sum(
            lp.saved_bytes * profile.micro_batches for st in profile.stages for lp in st.layers
            if res.plan.decision(st.stage, lp.index).technique == "host")
        assert host_used > 0
    base = simulate(profile, offload_everything(profile, res.plan.mapping), topo)
    assert base.step_time_s > res.sim.step_time_s  # the plan beats offloading everything


def test_model_data_transfers_have_their_own_trace_lanes():
    profile, topo = paper_gpt(64)
    res = plan(profile, topo, host_memory_bytes=768 * GB)
    events = trace_events(simulate(profile, res.plan, topo, record=True))
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"model in", "model out", "compute", "host", "d2d"} <= threads
    names = [e["name"] for e in events if e.get("cat") in ("model in", "model out")]
    assert any(n.startswith("states in") for n in names) and any(n.startswith("states out") for n in names)


def streamed(stage: int, layer: int) -> ModelDataDecision:
    return ModelDataDecision(stage=stage, layer=layer, technique="host", step_on="host", weights="host")


def host_lane(sim) -> list[tuple[str, float, float]]:
    return [(e.name, e.start_s, e.start_s + e.dur_s) for e in sim.events if e.stream == "host"]


def test_streamed_weights_leave_the_device_and_come_in_on_the_host_copy_stream():
    # layer 1 of 3 streams its 20 B of weights over a 10 B/s link, 2 s a copy. Forward: L0 [0, 1];
    # no streamed layer before L1 fetched it, so its weights come in [1, 3] and it runs [3, 4];
    # L2 [4, 5]. Backward: L2 [5, 7]; L1's weights [7, 9], L1 [9, 11], its gradients out
    # [11, 13] while L0 runs [11, 13]. L0 and L2 step on the device; CPU Adam steps L1 once its
    # gradients have landed, [13, 16], over its host copies (nothing to copy).
    # Memory: L0 and L2 100 each; L1 nothing between uses; the stage holds two layers' weights
    # and one's gradients for the streaming: 3 x 20.
    sim = simulate(model_profile(1, 3), Plan(model_data=[streamed(0, 1)]), make_topology(1, host_bw=10.0),
                   record=True)
    assert host_lane(sim) == [("weights L1 m0", 1.0, 3.0), ("weights L1 m0", 7.0, 9.0), ("grads L1 m0", 11.0, 13.0)]
    assert [(e.start_s, e.dur_s) for e in sim.events if e.stream == "cpu"] == [(13.0, 3.0)]
    assert sim.step_time_s == 16.0
    assert sim.peak_bytes == [260]
    assert sim.streamed_bytes == 40 and sim.model_moved_bytes["host"] == 60  # in twice, out once, M = 1


def test_the_next_streamed_layer_comes_in_while_one_runs():
    # L1 and L2 stream (2 s a copy). Forward: L1's weights [1, 3], L1 [3, 4] while L2's come in
    # [3, 5]; L2 [5, 6]. Backward: L2's [6, 8], L2 [8, 10] while L1's come in [8, 10]; L2's
    # gradients out [10, 12] while L1 runs [10, 12]; L1's out [12, 14] while L0 runs [12, 14].
    # CPU Adam: L1 [14, 17], then L2 [17, 20] (one CPU).
    sim = simulate(model_profile(1, 3), Plan(model_data=[streamed(0, 1), streamed(0, 2)]),
                   make_topology(1, host_bw=10.0), record=True)
    assert host_lane(sim) == [("weights L1 m0", 1.0, 3.0), ("weights L2 m0", 3.0, 5.0), ("weights L2 m0", 6.0, 8.0),
                              ("weights L1 m0", 8.0, 10.0), ("grads L2 m0", 10.0, 12.0), ("grads L1 m0", 12.0, 14.0)]
    assert sim.step_time_s == 20.0


def test_weight_copies_queue_behind_activation_swaps_on_the_host_copy_stream():
    # as above with L1 alone streamed, and L0's 20 B of activations swapped to host memory: its
    # swap-out [1, 3] goes first, so L1's weights come in [3, 5] and L1 runs [5, 6]; the swap-in,
    # issued with the forward, waits for them [5, 7]. Backward: L2 [7, 9], L1's weights [9, 11],
    # L1 [11, 13], its gradients out [13, 15], L0 [13, 15]; CPU Adam L1 [15, 18].
    p = model_profile(1, 3)
    p.stages[0].layers[0].saved = [SavedTensor(name="x", bytes=20)]
    plan_ = Plan(decisions=[Decision(stage=0, layer=0, technique="host")], model_data=[streamed(0, 1)])
    sim = simulate(p, plan_, make_topology(1, host_bw=10.0), record=True)
    assert host_lane(sim) == [("out L0 m0", 1.0, 3.0), ("weights L1 m0", 3.0, 5.0), ("in L0 m0", 5.0, 7.0),
                              ("weights L1 m0", 9.0, 11.0), ("grads L1 m0", 13.0, 15.0)]
    assert sim.step_time_s == 18.0


def test_the_planner_streams_weights_when_moving_states_is_not_enough():
    # 3 x 100 on a budget of 110: moving every layer's states leaves 120 (stepped on the host;
    # stepped on the device, a layer's come back in for it); streaming one layer's weights as
    # well leaves 120 - 40 + 3 x 20 = 140, two 100, which fits
    p = model_profile(1, 3, state=60, update=40)
    res = plan(p, make_topology(1, host_bw=10.0), budget_bytes=110)
    assert res.fits, res.reason
    assert sum(d.weights == "host" for d in res.plan.model_data) == 2
    assert res.sim.peak_bytes == [100] and res.sim.streamed_bytes == 80
    # without host steps nothing can stream, and the states alone leave too much
    assert not plan(p, make_topology(1, host_bw=10.0), budget_bytes=110, host_steps=False).fits


def test_the_planner_streams_no_more_layers_than_the_budget_needs():
    # 4 x 100 on a budget of 150 over a 10 B/s link: moving every layer's states leaves 160, and
    # streaming k layers' weights 160 - 40 k + 3 x 20, so two is the fewest that fit (140). The
    # queues take all four; two are kept, and they are faster: fewer copies on the host stream
    p = model_profile(1, 4, state=60, update=40)
    topo = make_topology(1, host_bw=10.0)
    res = plan(p, topo, budget_bytes=150)
    assert res.fits, res.reason
    assert sum(d.weights == "host" for d in res.plan.model_data) == 2 and res.sim.peak_bytes == [140]
    every = Plan(model_data=[streamed(0, i) for i in range(4)])
    assert res.sim.step_time_s < simulate(p, every, topo).step_time_s


@pytest.mark.parametrize("gpu_gb", [16, 12])
def test_gpt_20b_on_small_gpus_streams_weights_only_where_nothing_else_fits(gpu_gb):
    """GPT hidden 5120, 64 layers on a DGX-1 with 16 GB per GPU fits with every optimizer state
    in host memory and stepped there (brought back for a step on the GPU, two layers' states
    would not fit), no weights streamed, and faster than offloading everything; with 12 GB,
    moving every optimizer state and compacting every activation still leaves a stage over its
    budget, and streaming weights and gradients from host memory fits it."""
    topo = builtin("dgx1", 8, gpu_memory_bytes=gpu_gb * GB)
    profile = analytic_profile(arch="gpt", layers=64, hidden=5120, heads=40, seq=1024, micro_batch=2,
                               micro_batches=16, vocab=50257, stages=8, flops=topo.flops)
    res = plan(profile, topo, host_memory_bytes=768 * GB)
    assert res.fits, res.reason
    assert max(res.sim.peak_bytes) <= gpu_gb * GB
    base = simulate(profile, offload_everything(profile, res.plan.mapping), topo)
    if gpu_gb == 16:
        assert all(d.step_on == "host" for d in res.plan.model_data if d.technique == "host")
        assert res.sim.streamed_bytes == 0
        assert not base.overflow() and res.sim.step_time_s < base.step_time_s
    else:
        assert res.sim.streamed_bytes > 0 and base.overflow()
        assert not plan(profile, topo, host_memory_bytes=768 * GB, host_steps=False).fits  # no streaming without them


def test_offloading_everything_is_the_plan_where_the_search_finds_nothing_better(monkeypatch):
    """The greedy search is a heuristic: where its plan does not fit (here: made to find nothing)
    and offloading everything does, that is the plan."""
    import mpress.planner as planner

    profile, topo = paper_gpt(64)
    found = planner._compact

    def nothing(*args, **kwargs):
        res = found(*args, **kwargs)
        return dataclasses.replace(res, plan=Plan(mapping=res.plan.mapping), fits=False, reason="made to fail")

    monkeypatch.setattr(planner, "_compact", nothing)
    res = plan(profile, topo, host_memory_bytes=768 * GB)
    assert res.fits, res.reason
    assert res.plan == offload_everything(profile, res.plan.mapping)
    # and not where host memory cannot hold every optimizer state
    assert not plan(profile, topo, host_memory_bytes=100 * GB).fits
