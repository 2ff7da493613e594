"""MPress on this machine, side by side in one run.

1. Planning time: an analytic 8-stage x 64-layer GPT on a DGX-1 at 8, 16 and 32 micro-batches (the
   planner must stay under 1 s, one simulation of the planned step under 0.5 s). The tests check
   the planner's and the simulator's results at this scale; their speed is measured here only,
   since a loaded machine would make a timed test flaky.
2. A stage of transformer layers trained GPipe-style (every micro-batch's forward, then every
   backward) on this CPU, profiled with mpress.profiler, then:
     baseline    no compaction (the activation peak is M x the layers' saved bytes)
     planned     the planner's plan for a budget of --budget-fraction (default 50%) of that peak,
                 on the measured CPU topology, run by mpress.executor
     checkpoint  plain torch.utils.checkpoint on every layer (the usual answer to the same problem)
   Printed: measured step time of each, the planned run's overhead and checkpoint's over the baseline
   (lower is better; the plan should cost less than checkpointing everything), the simulator's
   predicted step time for the plan vs the measured one (target: within 15%), and the executor's
   accounted activation peak vs the budget.
3. Real 2-stage GPipe runs of the MoE GPT (`semoe train --pipeline 2 --stage-memory`): one with a
   generous budget (activations planned), and one of 8 blocks on short sequences (optimizer states
   outweigh activations, as in a large model's stage) whose budget is 4 KiB below what the
   last stage's parameters, gradients and optimizer states take, so only moving optimizer states
   off the device (model data) fits. Each prints the simulator's step time against the measured
   median of 10 steps after 2 of warm-up (target: within 15%). Profiles take the fastest of a few
   runs (other work on a machine only adds time); the fastest step is printed beside the median.
   A third run of the 8 blocks has a budget 4 KiB below what the last stage's parameters and
   gradients take with every block's optimizer states moved, so only streaming blocks' weights
   from host memory (gradients summed there, AdamW on the host) fits.

    python bench/bench_mpress.py [--layers 8] [--hidden 512] [--seq 256] [--micro-batch 4]
                                 [--micro-batches 4] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpress.analytic import analytic_profile  # noqa: E402
from mpress.executor import Executor  # noqa: E402
from mpress.space import host_pool_bytes_for  # noqa: E402
from mpress.planner import plan  # noqa: E402
from mpress.profile import PipelineProfile, Plan, StageProfile  # noqa: E402
from mpress.profiler import measure_runtime, profile_layers  # noqa: E402
from mpress.simulator import simulate  # noqa: E402
from mpress.topology import builtin, measure_cpu  # noqa: E402


PLANNING_LIMIT_S, SIMULATION_LIMIT_S = 1.0, 0.5  # what the planner is built to stay under at this scale


def planning_time(micro_batches: tuple[int, ...] = (8, 16, 32)) -> dict:
    """Per micro-batch count: seconds to plan the 8 x 64 GPT on a DGX-1 and to simulate the plan once."""
    topo = builtin("dgx1", 8, gpu_memory_bytes=32 * 2**30)
    out = {}
    for m in micro_batches:
        prof = analytic_profile(layers=64, hidden=4096, heads=32, seq=2048, micro_batch=1, micro_batches=m,
                                vocab=50257, stages=8, flops=topo.flops)
        t0 = time.perf_counter()
        res = plan(prof, topo)
        planning_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        simulate(prof, res.plan, topo)
        simulate_s = time.perf_counter() - t0
        out[str(m)] = {"planning_s": planning_s, "simulate_s": simulate_s, "fits": res.fits,
                       "step_time_s": res.sim.step_time_s,
                       "within_limits": planning_s < PLANNING_LIMIT_S and simulate_s < SIMULATION_LIMIT_S}
    return out


def pipeline_run(workdir: str, stage_memory: str, *, layers: int = 4, steps: int = 12, batch: int = 16,
                 seq: int = 128, hidden: int = 256) -> dict:
    """A real 2-stage GPipe run of the MoE GPT (`semoe train --pipeline 2`): the planner's simulated
    step time (from each stage's profile) against the measured one, the plan's techniques and
    what each stage's parameters, gradients and optimizer states take."""
    import re
    import shutil
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tempfile.mkdtemp(prefix="mpress-pipe-", dir=workdir)
    log = os.path.join(out, "log.jsonl")
    cmd = [sys.executable, "-m", "tools.cli", "-v", "train", "--out", os.path.join(out, "run"), "--pipeline", "2",
           "--schedule", "gpipe", "--micro-batches", "4", "--batch-size", str(batch), "--seq-len", str(seq), "--steps",
           str(steps), "--layers", str(layers), "--hidden", str(hidden), "--heads", "8", "--kv-heads", "4", "--ffn",
           str(3 * hidden), "--expert-ffn", str(2 * hidden), "--experts", "4", "--expert-states", "device", "--stage-memory", stage_memory,
           "--checkpoint-every", "1000", "--log-json", log, "-q"]
    try:
        res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
        if res.returncode:
            raise SystemExit(f"pipeline run failed:\n{res.stderr[-3000:]}")
        simulated = float(re.search(r"simulated step ([0-9.]+) s", res.stderr).group(1))
        plan_line = re.search(r"stage 0: plan (\[.*?\]), model data (\[.*?\])", res.stderr)
        static = [int(x) for x in re.findall(r"optimizer states take ([0-9]+) bytes", res.stderr)]
        movable = [int(x) for x in re.findall(r"bytes, ([0-9]+) of them blocks' optimizer states", res.stderr)]
        streamed = sum(int(x) for x in re.findall(r"streams ([0-9]+) bytes of weights", res.stderr))
        with open(log, encoding="utf-8") as f:
            every = [json.loads(line)["step_s"] for line in f]
        times = every[2:] or every  # the first two steps warm up
        measured = statistics.median(times)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"stage_memory": stage_memory, "simulated_s": simulated, "measured_s": measured,
            "best_s": min(times), "steps": len(times), "simulator_error": simulated / measured - 1, "static_bytes": static,
            "movable_state_bytes": movable, "streamed_bytes": streamed,
            "activations": plan_line.group(1) if plan_line else None,
            "model_data": plan_line.group(2) if plan_line else None}


def model_data_run(workdir: str) -> dict:
    """The 8-block pipeline under a budget 4 KiB below its last stage's model data: a short probe
    run reads what each stage's parameters, gradients and optimizer states take."""
    # short sequences: optimizer states outweigh the activations, as in a large model's stage
    shape = dict(layers=8, batch=8, seq=32)
    probe = pipeline_run(workdir, "64GiB", steps=1, **shape)
    budget = max(probe["static_bytes"]) - 4096
    return {**pipeline_run(workdir, str(budget), **shape), "model_data_bytes": max(probe["static_bytes"])}


def streamed_run(workdir: str) -> dict:
    """The same pipeline under a budget 4 KiB below its last stage's parameters and gradients
    alone (every block's optimizer states moved off): only streaming blocks' weights from host
    memory fits."""
    shape = dict(layers=8, batch=8, seq=32)
    probe = pipeline_run(workdir, "64GiB", steps=1, **shape)
    budget = max(a - b for a, b in zip(probe["static_bytes"], probe["movable_state_bytes"])) - 4096
    return {**pipeline_run(workdir, str(budget), **shape), "weights_and_grads_bytes": budget + 4096}


def make_layers(n: int, hidden: int) -> list[tuple[str, nn.Module]]:
    torch.manual_seed(0)
    return [(f"layer{i}", nn.TransformerEncoderLayer(hidden, max(1, hidden // 64), 4 * hidden, dropout=0.0,
                                                     batch_first=True, norm_first=True)) for i in range(n)]


def step(layers, xs, wrap) -> float:
    """GPipe on one stage: all forwards, then all backwards; returns seconds."""
    for _, m in layers:
        m.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    outs = []
    for x in xs:
        h = x
        for i, (_, m) in enumerate(layers):
            h = wrap(i, m, h)
        outs.append(h.float().pow(2).mean())
    for loss in outs:
        loss.backward()
    return time.perf_counter() - t0


def measure(layers, xs, wrap, repeats: int) -> float:
    step(layers, xs, wrap)  # warm-up
    return statistics.median(step(layers, xs, wrap) for _ in range(repeats))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--budget-fraction", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pipeline-stage-memory", default="8GiB",
                    help="--stage-memory of the 2-stage pipeline run (default: room for everything)")
    ap.add_argument("--workdir", default=None, help="scratch space for the pipeline run (default: the temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    out = {"planning_8x64": planning_time()}
    layers = make_layers(args.layers, args.hidden)
    x = torch.randn(args.micro_batch, args.seq, args.hidden)
    xs = [torch.randn_like(x).requires_grad_() for _ in range(args.micro_batches)]
    profiled = profile_layers(layers, x.requires_grad_(), repeats=args.repeats)
    measure_runtime(layers, x, profiled, repeats=args.repeats)  # as the executor runs them
    prof = PipelineProfile(stages=[StageProfile(stage=0, layers=profiled)], micro_batches=args.micro_batches,
                           schedule="gpipe")
    static = sum(lp.param_bytes for lp in profiled)
    act_peak = args.micro_batches * sum(lp.saved_bytes for lp in profiled)
    budget = static + int(args.budget_fraction * act_peak)
    topo = measure_cpu(1, budget)
    res = plan(prof, topo, budget_bytes=budget)
    techniques = {}
    for d in res.plan.decisions:
        techniques[d.technique] = techniques.get(d.technique, 0) + 1

    baseline = measure(layers, xs, lambda i, m, h: m(h), args.repeats)
    ckpt = measure(layers, xs, lambda i, m, h: checkpoint(m, h, use_reentrant=False), args.repeats)
    with Executor(res.plan, 0, device="cpu", budget_bytes=budget - static,
                  host_pool_bytes=host_pool_bytes_for(prof, res.plan, 0)) as ex:
        wrapped = [ex.wrap(i, m) for i, (_, m) in enumerate(layers)]
        planned = measure(layers, xs, lambda i, m, h: wrapped[i](h), args.repeats)
        accounted = ex.stats().peak_bytes
    predicted = res.sim.step_time_s
    unplanned_sim = simulate(prof, Plan(), topo).step_time_s
    out["stage"] = {
        "layers": args.layers, "hidden": args.hidden, "tokens_per_micro_batch": args.micro_batch * args.seq,
        "micro_batches": args.micro_batches, "activation_peak_bytes": act_peak, "budget_activation_bytes":
        budget - static, "plan_fits": res.fits, "techniques": techniques,
        "measured_s": {"baseline": baseline, "planned": planned, "checkpoint_all": ckpt},
        "overhead_vs_baseline": {"planned": planned / baseline, "checkpoint_all": ckpt / baseline},
        "simulated_s": {"planned": predicted, "baseline": unplanned_sim},
        "simulator_error": {"planned": predicted / planned - 1, "baseline": unplanned_sim / baseline - 1},
        "accounted_activation_peak_bytes": accounted,
    }
    workdir = args.workdir or os.environ.get("TMPDIR", "/tmp")
    out["pipeline"] = pipeline_run(workdir, args.pipeline_stage_memory)
    out["pipeline_model_data"] = model_data_run(workdir)
    out["pipeline_streamed"] = streamed_run(workdir)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    s = out["stage"]
    for m, p in out["planning_8x64"].items():
        print(f"planning 8 stages x 64 layers x {m} micro-batches (DGX-1): {p['planning_s'] * 1e3:.0f} ms "
              f"(limit {PLANNING_LIMIT_S:.0f} s), one simulation {p['simulate_s'] * 1e3:.0f} ms (limit "
              f"{SIMULATION_LIMIT_S} s), fits {p['fits']}")
    print(f"stage of {args.layers} layers, {args.micro_batches} micro-batches GPipe, budget "
          f"{args.budget_fraction:.0%} of the {act_peak / 2**20:.0f} MiB activation peak; plan: {techniques}")
    for k, v in s["measured_s"].items():
        print(f"  {k:15s} {v:.3f} s/step  ({v / baseline:.2f}x baseline)")
    print(f"  simulator: planned {predicted:.3f} s vs measured {planned:.3f} s ({s['simulator_error']['planned']:+.1%}); "
          f"baseline {unplanned_sim:.3f} s vs {baseline:.3f} s ({s['simulator_error']['baseline']:+.1%})")
    print(f"  executor's accounted activation peak {accounted / 2**20:.0f} MiB <= budget "
          f"{(budget - static) / 2**20:.0f} MiB: {accounted <= budget - static}")
    pp = out["pipeline"]
    print(f"2-stage GPipe run of the MoE GPT: simulated {pp['simulated_s']:.3f} s/step vs measured "
          f"{pp['measured_s']:.3f} s/step, median of {pp['steps']} (fastest {pp['best_s']:.3f}) "
          f"({pp['simulator_error']:+.1%}, target within 15%)")
    md = out["pipeline_model_data"]
    print(f"2-stage GPipe run of 8 blocks, budget {int(md['stage_memory']) / 2**20:.2f} MiB per stage < the last "
          f"stage's {md['model_data_bytes'] / 2**20:.2f} MiB of parameters, gradients and optimizer states; plan: "
          f"activations {md['activations']}, model data {md['model_data']}: simulated {md['simulated_s']:.3f} "
          f"s/step vs measured {md['measured_s']:.3f} s/step, median of {md['steps']} (fastest {md['best_s']:.3f}) "
          f"({md['simulator_error']:+.1%}, target within 15%)")
    sw = out["pipeline_streamed"]
    print(f"2-stage GPipe run of 8 blocks, budget {int(sw['stage_memory']) / 2**20:.2f} MiB per stage < the last "
          f"stage's {sw['weights_and_grads_bytes'] / 2**20:.2f} MiB of parameters and gradients with every block's "
          f"optimizer states moved; plan: activations {sw['activations']}, model data {sw['model_data']}, "
          f"{sw['streamed_bytes'] / 2**20:.2f} MiB of weights and gradients streamed: simulated {sw['simulated_s']:.3f} "
          f"s/step vs measured {sw['measured_s']:.3f} s/step, median of {sw['steps']} (fastest {sw['best_s']:.3f}) "
          f"({sw['simulator_error']:+.1%}, target within 15%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
