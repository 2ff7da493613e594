"""`semoe plan`: plan memory compaction for a pipeline-parallel model from its description alone."""

from __future__ import annotations

import argparse
import sys

from tools.cli_output import UsageError, emit_json
from tools.size_flags import parse_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="plan recompute / host swap / D2D swap and the device mapping for a pipeline (no GPU needed)",
        description="Describe a transformer (optionally MoE) and a multi-GPU server; get the MPress plan: which "
                    "layers' activations are recomputed, swapped to host memory or swapped into peer GPUs over "
                    "NVLink (striped by link bandwidth), which layers' optimizer states (model data) live in host "
                    "memory (stepped on the GPU or by CPU Adam) or in peers' spare memory, which layers' weights and "
                    "gradients stream from host memory when nothing else fits, the stage-to-device "
                    "mapping, and the simulated step time and peak memory per stage, beside a ZeRO-Infinity-style "
                    "baseline that offloads every optimizer state and step to the host and recomputes every layer.")
    m = p.add_argument_group("model")
    m.add_argument("--arch", choices=("gpt", "bert"), default="gpt")
    for flag, helptext in (("layers", "transformer layers"), ("hidden", "hidden size"), ("heads", "attention heads"),
                           ("seq", "sequence length"), ("micro-batch", "sequences per micro-batch"),
                           ("micro-batches", "micro-batches per step"), ("vocab", "vocabulary size")):
        m.add_argument(f"--{flag}", type=int, required=True, help=helptext)
    m.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0: dense)")
    m.add_argument("--top-k", type=int, default=1, help="experts per token")
    h = p.add_argument_group("machine")
    h.add_argument("--gpus", type=int, required=True, help="GPUs = pipeline stages")
    h.add_argument("--topology", choices=("dgx1", "nvswitch", "pcie"), required=True)
    h.add_argument("--gpu-memory", required=True, metavar="SIZE", help="memory per GPU, e.g. 32GiB")
    h.add_argument("--host-memory", metavar="SIZE",
                   help="host memory for swapped activations and optimizer states [no limit]")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--trace", metavar="FILE", help="write a Perfetto/Chrome trace (JSON) of the planned step, and "
                                                   "FILE's stem + .png with the memory timeline")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from mpress.analytic import analytic_profile
    from mpress.planner import offload_everything, plan
    from mpress.simulator import simulate
    from mpress.topology import builtin

    for flag in ("layers", "hidden", "heads", "seq", "micro_batch", "micro_batches", "vocab", "gpus"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.experts < 0 or args.top_k < 1 or (args.experts and args.top_k > args.experts):
        raise UsageError(f"--top-k must be in 1..--experts ({args.experts}), got {args.top_k}")
    if args.layers < args.gpus:
        raise UsageError(f"--layers {args.layers} must be at least --gpus {args.gpus} (one stage per GPU)")
    gpu_memory = parse_size(args.gpu_memory, flag="--gpu-memory")
    host_memory = parse_size(args.host_memory, flag="--host-memory") if args.host_memory else None
    topo = builtin(args.topology, args.gpus, gpu_memory_bytes=gpu_memory)
    profile = analytic_profile(arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                               micro_batch=args.micro_batch, micro_batches=args.micro_batches, vocab=args.vocab,
                               experts=args.experts, top_k=args.top_k, stages=args.gpus, schedule=args.schedule,
                               flops=topo.flops)
    res = plan(profile, topo, host_memory_bytes=host_memory)
    out = summary(res, profile)
    base = simulate(profile, offload_everything(profile, res.plan.mapping), topo)
    host_need = sum(base.model_bytes.get(t, 0) for t in ("host", "d2d"))
    base_fits = not base.overflow([gpu_memory] * topo.devices) and (host_memory is None or host_need <= host_memory)
    out["baseline"] = {"name": "zero-infinity-style: optimizer states and steps on the host, every layer recomputed",
                       "step_time_s": base.step_time_s, "fits": base_fits,
                       "peak_bytes": [base.peak_bytes[d] for d in out["mapping"]],
                       "plan_speedup": base.step_time_s / res.sim.step_time_s}
    if args.trace:
        from mpress.trace import chrome_trace, memory_png

        traced = simulate(profile, res.plan, topo, record=True)
        chrome_trace(traced, args.trace)
        png = (args.trace[:-5] if args.trace.endswith(".json") else args.trace) + ".png"
        memory_png(traced, png, budget_bytes=gpu_memory)
        out["trace"], out["memory_png"] = args.trace, png
    if args.json:
        emit_json(out)
    else:
        print_summary(out, file=sys.stdout)
    return 0 if out["fits"] else 1


def stage_bytes(plan_, profile) -> list[dict]:
    """Per stage: activation bytes each technique handles per step (every micro-batch) and
    optimizer-state bytes each model-data technique places (on the device for keep), and the
    weight and gradient bytes streamed from host memory."""
    M, rows = profile.micro_batches, []
    for st in profile.stages:
        acts, model = {"recompute": 0, "host": 0, "d2d": 0}, {"keep": 0, "host": 0, "d2d": 0, "streamed": 0}
        for lp in st.layers:
            d = plan_.decision(st.stage, lp.index)
            if d.technique != "keep":
                acts[d.technique] += lp.saved_bytes * M
            decision = plan_.model_decision(st.stage, lp.index)
            model[decision.technique] += lp.state_bytes
            if decision.weights == "host":
                model["streamed"] += lp.update_bytes
        rows.append({"stage": st.stage, "device": plan_.device_of(st.stage), "activations": acts,
                     "model_data": model})
    return rows


def summary(res, profile) -> dict:
    """The plan as the JSON object `semoe plan --json` prints."""
    sim = res.sim
    per_stage = [sim.peak_bytes[res.plan.device_of(s.stage)] for s in profile.stages]
    return {"fits": res.fits, "reason": res.reason, "step_time_s": sim.step_time_s, "peak_bytes": per_stage,
            "recompute_bytes": sim.recompute_bytes, "host_swap_bytes": sim.host_swap_bytes,
            "d2d_swap_bytes": sim.d2d_swap_bytes,
            "model_data_bytes": {t: sim.model_bytes.get(t, 0) for t in ("keep", "host", "d2d")},
            "streamed_bytes": sim.streamed_bytes,
            "optimizer_s": sim.optimizer_s, "stages": stage_bytes(res.plan, profile),
            "mapping": [res.plan.device_of(s.stage) for s in profile.stages],
            "planning_s": res.planning_s,
            "decisions": [{"stage": d.stage, "layer": d.layer, "technique": d.technique,
                           "stripes": [{"device": s.device, "bytes": s.bytes} for s in d.stripes]}
                          for d in res.plan.decisions if d.technique != "keep"],
            "model_data": [{"stage": d.stage, "layer": d.layer, "technique": d.technique, "step_on": d.step_on,
                            "weights": d.weights,
                            "stripes": [{"device": s.device, "bytes": s.bytes} for s in d.stripes]}
                           for d in res.plan.model_data if d.technique != "keep"]}


def print_summary(out: dict, file) -> None:
    gib = 2**30
    print(f"fits: {'yes' if out['fits'] else 'no: ' + out['reason']}", file=file)
    print(f"step time {out['step_time_s'] * 1e3:.1f} ms (simulated); planned in {out['planning_s'] * 1e3:.0f} ms",
          file=file)
    print("stage -> device: " + ", ".join(f"{s}->{d}" for s, d in enumerate(out["mapping"])), file=file)
    print("peak per stage: " + ", ".join(f"{b / gib:.2f} GiB" for b in out["peak_bytes"]), file=file)
    print(f"activations (bytes per step): recompute {out['recompute_bytes'] / gib:.2f} GiB, host swap "
          f"{out['host_swap_bytes'] / gib:.2f} GiB, D2D swap {out['d2d_swap_bytes'] / gib:.2f} GiB", file=file)
    md = out["model_data"]
    on_host = sum(1 for d in md if d["step_on"] == "host")
    print(f"model data (optimizer states off the device): host {out['model_data_bytes']['host'] / gib:.2f} GiB, "
          f"peers {out['model_data_bytes']['d2d'] / gib:.2f} GiB, kept {out['model_data_bytes']['keep'] / gib:.2f} GiB; "
          f"{on_host} of {len(md)} moved layers step on the CPU; optimizer phase {out['optimizer_s'] * 1e3:.0f} ms",
          file=file)
    streamed = sum(1 for d in md if d["weights"] == "host")
    if streamed:
        print(f"streamed weights and gradients (in host memory between uses): {out['streamed_bytes'] / gib:.2f} GiB "
              f"of {streamed} layers", file=file)
    print(f"{'stage':>5} {'device':>6} {'peak GiB':>8} | activations GiB: {'recompute':>9} {'host':>7} {'d2d':>7} | "
          f"model data GiB: {'host':>6} {'d2d':>6} {'kept':>6} {'stream':>6}", file=file)
    for row, peak in zip(out["stages"], out["peak_bytes"]):
        a, m = row["activations"], row["model_data"]
        print(f"{row['stage']:>5} {row['device']:>6} {peak / gib:8.2f} | {'':17}{a['recompute'] / gib:9.2f} "
              f"{a['host'] / gib:7.2f} {a['d2d'] / gib:7.2f} | {'':16}{m['host'] / gib:6.2f} {m['d2d'] / gib:6.2f} "
              f"{m['keep'] / gib:6.2f} {m['streamed'] / gib:6.2f}", file=file)
    b = out.get("baseline")
    if b:
        x = b["plan_speedup"]
        verdict = ("does not fit, so it is no alternative" if not b["fits"] else
                   f"fits; the plan is {x:.2f}x faster" if x >= 1 else f"fits; the plan is {1 / x:.2f}x slower")
        print(f"baseline ({b['name']}): step {b['step_time_s'] * 1e3:.1f} ms, {verdict}", file=file)
