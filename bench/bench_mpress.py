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
from mpress.executor import Executor, host_pool_bytes_for  # noqa: E402
from mpress.planner import plan  # noqa: E402
from mpress.profile import PipelineProfile, Plan, StageProfile  # noqa: E402
from mpress.profiler import profile_layers  # noqa: E402
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


def pipeline_run(args: argparse.Namespace, workdir: str) -> dict:
    """A real 2-stage GPipe run of the MoE GPT (`semoe train --pipeline 2`): the planner's simulated
    step time (from each stage's profile) against the measured one."""
    import re
    import shutil
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tempfile.mkdtemp(prefix="mpress-pipe-", dir=workdir)
    log = os.path.join(out, "log.jsonl")
    cmd = [sys.executable, "-m", "tools.cli", "-v", "train", "--out", os.path.join(out, "run"), "--pipeline", "2",
           "--schedule", "gpipe", "--micro-batches", "4", "--batch-size", "16", "--seq-len", "128", "--steps", "8",
           "--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "4", "--ffn", "768", "--expert-ffn",
           "512", "--experts", "4", "--expert-states", "device", "--stage-memory", args.pipeline_stage_memory,
           "--checkpoint-every", "1000", "--log-json", log, "-q"]
    try:
        res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
        if res.returncode:
            raise SystemExit(f"pipeline run failed:\n{res.stderr[-3000:]}")
        simulated = float(re.search(r"simulated step ([0-9.]+) s", res.stderr).group(1))
        with open(log, encoding="utf-8") as f:
            steps = [json.loads(line)["step_s"] for line in f]
        measured = statistics.median(steps[2:])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"simulated_s": simulated, "measured_s": measured, "simulator_error": simulated / measured - 1}


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
    out["pipeline"] = pipeline_run(args, args.workdir or os.environ.get("TMPDIR", "/tmp"))
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
          f"{pp['measured_s']:.3f} s/step ({pp['simulator_error']:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
