"""Training step time with expert states on SSD vs all in memory, side by side in one run.

Each configuration is its own `semoe train` process with its own fresh --out under --workdir,
on the same model and batch, run one after the other and alternated (device, ssd, device, ssd
with --repeats 2) so drift on a noisy machine hits both:

    device   --expert-states device: every expert weight, gradient and Adam moment in memory
    ssd      --expert-states ssd --cpu-cache 25%: the states in the store, a quarter cached

The first --warmup-steps-skip steps of each run are dropped; a row is the median step_s of the
rest (pooled over repeats). The ratio ssd/device is the cost of keeping expert states on SSD:
1.0 means free, the target is <= 1.15 at both batch shapes. The same ratio at a small batch
(--small-batch, on by default) shows how it depends on the compute per step: less compute hides
less SSD traffic. Beside it, the disk's own time for the bytes an ssd step moved (O_DIRECT rates
measured before and after the runs, their means): where that alone exceeds the target, only fewer
bytes can meet it. And the least step the step's order allows (`least_ssd_step`): the update waits
for the whole backward (the gradient norm), the next forward for the update, so all the bytes but
what memory can hold across a backward cross the disk between one backward's end and the next
forward's end; the in-memory step's forward, backward and update are timed in this process for it.

--dense instead trains the same model on --nproc ranks (default 2) once per --dense-states mode
(replicated, zero1, fsdp) and prints the dense bytes each rank holds (parameters, gradients and
AdamW moments, measured from the tensors by the trainer and logged per step), their ratio to
replicated (fsdp's target is about 1/N) and the median step time of each mode.

--peer instead trains the same Mixtral-shaped model (--arch: or a qwen3_moe or gpt_oss one) two
ways on the same batches: `semoe train --init-from` the store imported from transformers' checkpoint
(--peer-states device: everything in memory; ssd: states on SSD at --cpu-cache), and transformers'
own model with torch.optim.AdamW (bench/train_peer_transformers.py), alternated --repeats times at each batch
shape. It prints tokens/s of both and their ratio (the target is >= 1.0), and the loss of both at
every step. The losses must agree within LOSS_TOL while the two optimizers do the same thing: up
to the step after the first in which some expert was chosen by no token. From there they differ by
design: semoe's expert AdamW is sparse (an expert no token chose keeps its weights, moments and
step count, as SE-MoE), torch's AdamW on transformers' stacked expert tensors moves every expert
by its momentum and weight decay; the bench prints those steps' differences beside the count of
idle experts.

--largest instead trains, with states on SSD, a model whose expert states are at least
--state-factor (3) times --memory SIZE (3GiB), while a balloon process (bench_vs_llamacpp' `Balloon`, the
page cache dropped first) holds all other memory, so that only SIZE is available to the run and
its page cache. Measured in the same run: the disk's O_DIRECT write and read rates (a file of
--disk-probe bytes, before and after the run: the bound takes their means) and the same model's
step with every state in memory (--expert-states device, no balloon: the compute). Per step it
prints the seconds, the bytes read and written, and the bound max(compute, read bytes / read rate
+ write bytes / write rate) with the step's ratio to it (the target is <= 1.3); the peak RSS
against SIZE; and each step's loss beside the in-memory run's (the same arithmetic on CPU: they
must be equal). It refuses (exit 2) if the model is too small for the factor or the disk too full.

    python bench/bench_train.py --workdir DIR [--steps 8] [--repeats 2] [--no-small-batch] [--json]
    python bench/bench_train.py --workdir DIR --dense [--nproc 2] [--steps 8]
    python bench/bench_train.py --workdir DIR --peer [--arch mixtral] [--peer-states device] [--steps 8]
    python bench/bench_train.py --workdir DIR --largest [--memory 3GiB] [--state-factor 3] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "expert_ffn", "experts", "top_k")
COMPARE = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn": 768, "expert_ffn": 512, "experts": 8,
           "top_k": 2, "batch_size": 16, "seq_len": 512, "steps": 8, "cpu_cache": "25%"}
LARGEST = {"layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 4, "ffn": 4096, "expert_ffn": 4096, "experts": 18,
           "top_k": 2, "batch_size": 4, "seq_len": 128, "steps": 4, "cpu_cache": "1GiB"}
BOUND_TARGET = 1.3  # --largest: step time over max(compute, the disk's time for the bytes moved)
# --largest: the SSD run's losses against the in-memory run's. The same arithmetic on CPU, so bit for bit
# expected; one run in four under the balloon gave a first loss one float32 rounding (1.7e-7) apart
LARGEST_LOSS_TOL = 1e-6
TARGET_RATIO = 1.15  # ssd over device step time at a 25% cache, at both batch shapes
PEER_TARGET = 1.0  # semoe's tokens/s over transformers + AdamW's
# relative loss difference semoe vs transformers while both optimizers make the same updates: float32
# matmul blocking and reduction order only (measured: at most 6e-7 over four such steps)
LOSS_TOL = 1e-5
GIB = 2**30


def model_config(args: argparse.Namespace):
    from semoe.model.config import named_config

    return named_config("gpt-moe-small", num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, ffn_size=args.ffn, moe_ffn_size=args.expert_ffn,
                        num_experts=args.experts, top_k=args.top_k)


def train(args: argparse.Namespace, name: str, batch: int, seq: int, extra: list[str], *, shape: bool = True,
          keep: bool | None = None, steps: int | None = None) -> list[dict]:
    """One `semoe train` run into a fresh --out (WORKDIR/name); its --log-json lines. `shape`: pass
    the model's shape flags (not with --init-from); `keep`: keep the run directory (default --keep);
    `steps`: default --steps."""
    steps = args.steps if steps is None else steps
    out = os.path.join(args.workdir, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    log = os.path.join(out, "steps.jsonl")
    cmd = [sys.executable, "-m", "tools.cli", "train", "--out", os.path.join(out, "run"), "--log-json", log, "-q",
           "--steps", str(steps), "--checkpoint-every", str(max(1000, steps + 1)),
           "--batch-size", str(batch), "--seq-len", str(seq), *extra]
    for flag in SHAPE_FLAGS if shape else ():
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    print(f"running {name} ...", file=sys.stderr, flush=True)
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTHONPATH": ROOT})
    if res.returncode != 0:
        print(res.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{name} failed (exit {res.returncode}); its run directory is {out}")
    with open(log, encoding="utf-8") as f:
        steps = [json.loads(line) for line in f if line.strip()]
    if not (args.keep if keep is None else keep):
        shutil.rmtree(out, ignore_errors=True)
    return steps


def summarize(runs: list[list[dict]], skip: int, tokens_per_step: int) -> dict:
    """Median over the steps after warm-up, pooled over the repeats."""
    kept = [s for steps in runs for s in steps[skip:]]
    med = statistics.median(s["step_s"] for s in kept)
    hits = [s["cpu_hit_rate"] for s in kept if s["cpu_hit_rate"] is not None]
    return {"median_step_s": med, "tokens_per_s": tokens_per_step / med,
            "per_run_median_step_s": [statistics.median(s["step_s"] for s in steps[skip:]) for steps in runs],
            "cpu_hit_rate": statistics.mean(hits) if hits else None,
            "ssd_read_gbps": statistics.median(s["ssd_read_gbps"] for s in kept),
            "ssd_write_gbps": statistics.median(s["ssd_write_gbps"] for s in kept),
            "peak_rss_bytes": max(s["peak_rss_bytes"] for steps in runs for s in steps)}


def phases(args: argparse.Namespace, batch: int, seq: int, steps: int = 10) -> dict:
    """The in-memory step's forward, backward and the rest (norm, clipping, AdamW), medians over the
    steps after warm-up, timed in this process on the model compare() trains."""
    from semoe.train.trainer import Trainer
    from semoe.train.config import TrainConfig

    out = os.path.join(args.workdir, f"phases-{batch}x{seq}")
    shutil.rmtree(out, ignore_errors=True)
    trainer = Trainer(TrainConfig(out=out, steps=steps, batch_size=batch, seq_len=seq, checkpoint_every=steps + 1,
                                  expert_states="device"), model_config(args))
    marks: dict[str, float] = {}
    trainer.model.register_forward_hook(lambda *_: marks.__setitem__("forward", time.perf_counter()))
    end_backward = trainer.states.end_backward

    def timed_end_backward() -> None:
        marks["backward"] = time.perf_counter()
        end_backward()

    trainer.states.end_backward = timed_end_backward
    rows = []
    try:
        for i in range(steps):
            t0 = time.perf_counter()
            trainer.train_step()
            if i >= args.warmup_steps_skip:
                rows.append((marks["forward"] - t0, marks["backward"] - marks["forward"],
                             time.perf_counter() - marks["backward"]))
    finally:
        trainer.close()
        shutil.rmtree(out, ignore_errors=True)
    return {k: statistics.median(r[i] for r in rows) for i, k in enumerate(("forward_s", "backward_s", "rest_s"))}


def least_ssd_step(ph: dict, read_bytes: float, written_bytes: float, held_bytes: float, disk: dict) -> dict:
    """The shortest ssd step the step's order allows. The update needs every gradient, so its reads
    of Adam moments and its writes cannot start before the backward ends, and the next forward
    needs each layer's updated weights. Bytes moved outside the window from one backward's end to
    the next forward's end must be held in memory across the backward (moments read ahead, states
    written late), at most the cache's bytes; the rest crosses the disk within that window, whose
    compute is the forward and the update. So no step is shorter than
    backward + max(forward + rest, disk time of (bytes - cache)), with the cache spent on whichever
    of reads or writes saves more disk time."""
    r, w = disk["read_bps"], disk["write_bps"]
    window_s = min(max(0.0, read_bytes - held_bytes) / r + written_bytes / w,
                   read_bytes / r + max(0.0, written_bytes - held_bytes) / w)
    least_s = ph["backward_s"] + max(ph["forward_s"] + ph["rest_s"], window_s)
    return {**ph, "window_disk_s": window_s, "least_s": least_s,
            "least_vs_device": least_s / (ph["forward_s"] + ph["backward_s"] + ph["rest_s"])}


def compare(args: argparse.Namespace, label: str, batch: int, seq: int) -> dict:
    """device vs ssd at one batch shape, alternated --repeats times."""
    modes = {"device": ["--expert-states", "device"], "ssd": ["--expert-states", "ssd", "--cpu-cache", args.cpu_cache]}
    runs: dict[str, list] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode, extra in modes.items():
            runs[mode].append(train(args, f"{label}-{mode}-{rep}", batch, seq, extra))
    rows = {m: summarize(r, args.warmup_steps_skip, batch * seq) for m, r in runs.items()}
    kept = [st for steps in runs["ssd"] for st in steps[args.warmup_steps_skip:]]
    per_step = {k: statistics.median(st[f"ssd_{k}_gbps"] * 1e9 * st["step_s"] for st in kept)
                for k in ("read", "write")}
    return {"batch_size": batch, "seq_len": seq, "rows": rows, "phases": phases(args, batch, seq),
            "read_bytes_per_step": per_step["read"], "written_bytes_per_step": per_step["write"],
            "ssd_vs_device": rows["ssd"]["median_step_s"] / rows["device"]["median_step_s"]}


def against_disk(r: dict, disk: dict, cache_bytes: int) -> None:
    """Add to compare()'s result the disk's own time for the ssd step's bytes and the least step."""
    read, written = r["read_bytes_per_step"], r["written_bytes_per_step"]
    r["disk_s"] = read / disk["read_bps"] + written / disk["write_bps"]
    r["disk_vs_device"] = r["disk_s"] / r["rows"]["device"]["median_step_s"]
    r["least"] = least_ssd_step(r["phases"], read, written, cache_bytes, disk)


def expert_ram(args: argparse.Namespace) -> dict:
    """Memory the expert states take in each mode."""
    from semoe.train.config import expert_state_bytes
    from tools.size_flags import parse_size

    cfg = model_config(args)
    params = cfg.num_parameters()["experts"]
    cache = parse_size(args.cpu_cache, flag="--cpu-cache", percent_of=expert_state_bytes(cfg))
    return {"expert_params": params, "device_bytes": 16 * params, "ssd_cache_bytes": cache}


def print_compare(res: dict, ram: dict) -> None:
    print(f"{'config':22} {'s/step':>8} {'tokens/s':>9} {'cpu hit':>7} {'read GB/s':>9} {'write GB/s':>10} "
          f"{'peak RSS':>9}")
    for r in res.values():
        for mode, row in r["rows"].items():
            hit = f"{row['cpu_hit_rate']:.2f}" if row["cpu_hit_rate"] is not None else "-"
            name = f"{mode} batch {r['batch_size']}x{r['seq_len']}"
            print(f"{name:22} {row['median_step_s']:8.3f} "
                  f"{row['tokens_per_s']:9,.0f} {hit:>7} {row['ssd_read_gbps']:9.2f} {row['ssd_write_gbps']:10.2f} "
                  f"{row['peak_rss_bytes'] / GIB:7.2f}Gi")
    for label, r in res.items():
        verdict = "meets" if r["ssd_vs_device"] <= TARGET_RATIO else "misses"
        print(f"ssd/device median step time, {label} batch {r['batch_size']}x{r['seq_len']}: "
              f"{r['ssd_vs_device']:.2f} ({verdict} the target <= {TARGET_RATIO}); the disk alone needs "
              f"{r['disk_s']:.3f} s for the ssd step's bytes, {r['disk_vs_device']:.2f}x the device step")
        q = r["least"]
        print(f"  the step's order at {r['batch_size']}x{r['seq_len']}: in memory, forward {q['forward_s']:.3f} s, "
              f"backward {q['backward_s']:.3f}, the rest {q['rest_s']:.3f}; of the "
              f"{r['read_bytes_per_step'] / 1e6:.0f} MB read and {r['written_bytes_per_step'] / 1e6:.0f} MB "
              f"written a step, all but the cache's "
              f"{ram['ssd_cache_bytes'] / 1e6:.0f} MB cross the disk between a backward's end and the next forward's "
              f"end ({q['window_disk_s']:.3f} s): no ssd step under {q['least_s']:.3f} s, "
              f"{q['least_vs_device']:.2f}x the device step")
    print(f"RAM for expert states ({ram['expert_params']:,} expert params): device {ram['device_bytes'] / GIB:.3f} GiB "
          f"(16 B/param: weight, grad, 2 Adam moments) vs ssd {ram['ssd_cache_bytes'] / GIB:.3f} GiB of CPU cache "
          f"({ram['device_bytes'] / ram['ssd_cache_bytes']:.1f}x less)")


DENSE_MODES = ("replicated", "zero1", "fsdp")


def dense_modes(args: argparse.Namespace) -> dict:
    """Each --dense-states mode on --nproc ranks: dense bytes per rank and step time."""
    rows = {}
    for mode in DENSE_MODES:
        steps = train(args, f"dense-{mode}", args.batch_size, args.seq_len,
                      ["--nproc", str(args.nproc), "--dense-states", mode, "--expert-states", "cpu"])
        kept = steps[args.warmup_steps_skip:]
        rows[mode] = {"dense_bytes_per_rank": steps[-1]["dense_bytes_per_rank"],
                      "median_step_s": statistics.median(s["step_s"] for s in kept),
                      "loss": [s["loss"] for s in steps]}
    base = rows["replicated"]
    for row in rows.values():
        row["bytes_vs_replicated"] = row["dense_bytes_per_rank"] / base["dense_bytes_per_rank"]
        row["step_vs_replicated"] = row["median_step_s"] / base["median_step_s"]
        row["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["loss"], base["loss"]))
    return {"nproc": args.nproc, "dense_params": model_config(args).num_parameters()["dense"], "rows": rows}


def print_dense(r: dict) -> None:
    print(f"dense states on {r['nproc']} ranks ({r['dense_params'] / 1e6:.1f} M dense parameters; bytes per rank = "
          f"parameters + gradients + AdamW moments held by the rank)")
    print(f"{'mode':11} {'dense MiB/rank':>14} {'vs replicated':>13} {'s/step':>8} {'vs replicated':>13} "
          f"{'max loss diff':>13}")
    for mode, row in r["rows"].items():
        print(f"{mode:11} {row['dense_bytes_per_rank'] / 2**20:14.2f} {row['bytes_vs_replicated']:13.3f} "
              f"{row['median_step_s']:8.3f} {row['step_vs_replicated']:13.2f} {row['max_loss_rel_diff']:13.1e}")
    print(f"fsdp holds {r['rows']['fsdp']['bytes_vs_replicated']:.3f} of replicated's dense bytes per rank "
          f"(1/N = {1 / r['nproc']:.3f})")


def peer(args: argparse.Namespace) -> dict:
    """semoe (`--init-from` transformers' checkpoint) against transformers + AdamW, alternated, at
    each batch shape; the peer takes semoe's batches and learning rates of the same step."""
    import train_peer_transformers
    from semoe.train.run_store import RunStore
    from semoe.train.config import TrainConfig

    hf, store = train_peer_transformers.make_checkpoint(os.path.join(args.workdir, f"peer-{args.arch}"), args.arch)
    model = RunStore.open(store).model_config()
    defaults = TrainConfig(out="")
    states = ["--expert-states", args.peer_states] + (["--cpu-cache", args.cpu_cache]
                                                      if args.peer_states == "ssd" else [])
    shapes = {"default": (args.batch_size, args.seq_len)}
    if args.small_batch:
        shapes["small"] = (args.small_batch_size, args.small_seq_len)
    out = {"arch": args.arch, "states": args.peer_states, "shapes": {}}
    for label, (batch, seq) in shapes.items():
        ours, theirs = [], []
        for rep in range(args.repeats):
            name = f"peer-{label}-{rep}"
            steps = train(args, name, batch, seq, ["--init-from", store, *states], shape=False, keep=True)
            run = os.path.join(args.workdir, name)
            batches = train_peer_transformers.run_batches(os.path.join(run, "run"), batch, seq, defaults.seed,
                                                          len(steps))
            if not args.keep:
                shutil.rmtree(run, ignore_errors=True)
            print(f"running transformers ({label}, {rep}) ...", file=sys.stderr, flush=True)
            theirs.append(train_peer_transformers.train_transformers(
                hf, batches, [s["lr"] for s in steps], betas=defaults.betas, eps=defaults.eps,
                weight_decay=defaults.weight_decay, grad_clip=defaults.grad_clip, aux_coef=model.aux_loss_coef,
                z_coef=model.z_loss_coef))
            ours.append(steps)
        skip = args.warmup_steps_skip
        med = {k: statistics.median(s["step_s"] for r in runs for s in r[skip:]) for k, runs in
               (("semoe", ours), ("transformers", theirs))}
        loss = {"semoe": [s["loss"] for s in ours[0]], "transformers": [s["loss"] for s in theirs[0]]}
        rel = [abs(a - b) / abs(b) for a, b in zip(loss["semoe"], loss["transformers"])]
        idle = [s["idle_experts"] for s in theirs[0]]
        # step i's loss follows updates 1..i-1: the same updates while no expert was idle in them
        same = next((i + 1 for i, n in enumerate(idle) if n), len(idle))
        out["shapes"][label] = {
            "batch_size": batch, "seq_len": seq, "median_step_s": med,
            "tokens_per_s": {k: batch * seq / v for k, v in med.items()},
            "semoe_vs_transformers": med["transformers"] / med["semoe"], "loss": loss, "idle_experts": idle,
            "same_updates_steps": same, "max_same_updates_rel_diff": max(rel[:same]),
            "max_later_rel_diff": max(rel[same:], default=None),
            "peak_rss_bytes": max(s["peak_rss_bytes"] for r in ours for s in r)}
    return out


def print_peer(r: dict) -> None:
    print(f"{r['arch']}: semoe train --init-from (expert states {r['states']}) vs transformers + torch.optim.AdamW, "
          f"the same batches and learning rates")
    for label, row in r["shapes"].items():
        tps = row["tokens_per_s"]
        verdict = "meets" if row["semoe_vs_transformers"] >= PEER_TARGET else "misses"
        print(f"batch {row['batch_size']}x{row['seq_len']}: semoe {row['median_step_s']['semoe']:.3f} s/step "
              f"{tps['semoe']:,.0f} tok/s, transformers {row['median_step_s']['transformers']:.3f} s/step "
              f"{tps['transformers']:,.0f} tok/s: {row['semoe_vs_transformers']:.2f}x ({verdict} >= {PEER_TARGET})")
        print("  step  loss semoe  loss transformers  rel diff  experts no token chose")
        for i, (a, b, n) in enumerate(zip(row["loss"]["semoe"], row["loss"]["transformers"], row["idle_experts"]), 1):
            print(f"  {i:4d}  {a:10.6f}  {b:17.6f}  {abs(a - b) / abs(b):8.1e}  {n:4d}")
        same, worst = row["same_updates_steps"], row["max_same_updates_rel_diff"]
        print(f"  steps 1-{same} (the same updates): losses {'agree' if worst <= LOSS_TOL else 'DIFFER'}, at most "
              f"{worst:.1e} apart (tolerance {LOSS_TOL:.0e})")
        if row["max_later_rel_diff"] is not None:
            print(f"  steps {same + 1}-{len(row['idle_experts'])}: after an expert no token chose (sparse vs dense "
                  f"AdamW) at most {row['max_later_rel_diff']:.1e} apart")


def sizes(args: argparse.Namespace) -> dict:
    """Expert-state and parameter counts of the model, from a child process: this one stays free of
    torch, whose memory would sit beside the balloon's."""
    code = ("import json, sys; sys.path.insert(0, %r)\n"
            "from bench_train import model_config, argparse\n"
            "from semoe.train.config import expert_state_bytes\n"
            "cfg = model_config(argparse.Namespace(**json.loads(sys.argv[1])))\n"
            "n = cfg.num_parameters()\n"
            "print(json.dumps({'state': expert_state_bytes(cfg), 'dense': n['dense'], 'experts': n['experts']}))\n"
            % os.path.join(ROOT, "bench"))
    shape = json.dumps({k: getattr(args, k) for k in SHAPE_FLAGS})
    res = subprocess.run([sys.executable, "-c", code, shape], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    return json.loads(res.stdout)


def disk_rates(folder: str, nbytes: int) -> dict:
    """O_DIRECT rates of one file of `nbytes` in 4 MiB blocks under `folder`, in bytes/s: written new
    (`new_write_bps`: the file system allocates its blocks), read (`read_bps`), then written again over
    itself (`write_bps`: as the SSD backend rewrites its states step after step; the faster of the two)."""
    import mmap

    block = 4 << 20
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(block))
    path = os.path.join(folder, "disk-probe")
    n = max(1, nbytes // block)

    def write(flags: int) -> float:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | flags, 0o644)
        t0 = time.perf_counter()
        try:
            for _ in range(n):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        return n * block / (time.perf_counter() - t0)

    try:
        new = write(os.O_TRUNC)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        t0 = time.perf_counter()
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)
        read_s = time.perf_counter() - t0
        again = write(0)  # after the read, which would otherwise find the twice-written file in a host's cache
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"new_write_bps": new, "write_bps": max(new, again), "read_bps": n * block / read_s}


def largest(args: argparse.Namespace) -> dict:
    from bench_vs_llamacpp import Balloon
    from tools.size_flags import parse_size

    memory = parse_size(args.memory, flag="--memory")
    n = sizes(args)
    state, free = n["state"], shutil.disk_usage(args.workdir).free
    if state < args.state_factor * memory:
        print(f"refusing: expert states of {state / GIB:.2f} GiB are below {args.state_factor} x --memory "
              f"({memory / GIB:.2f} GiB); raise --experts or --expert-ffn", file=sys.stderr)
        raise SystemExit(2)
    # the first checkpoint's weights, the staged version's three states, the spilled gradients
    if free < 2.2 * state:
        print(f"refusing: {free / GIB:.1f} GiB free under {args.workdir}, need 2.2 x {state / GIB:.1f} GiB "
              f"= {2.2 * state / GIB:.1f} GiB", file=sys.stderr)
        raise SystemExit(2)
    # a model this wide needs a gentler step than the small default's peak rate, from the first step
    common = ["--lr", str(args.lr), "--warmup-steps", "1"]
    probe = parse_size(args.disk_probe, flag="--disk-probe")
    before = disk_rates(args.workdir, probe)
    print(f"disk: O_DIRECT write {before['write_bps'] / 1e9:.2f} GB/s over a file "
          f"(a new one {before['new_write_bps'] / 1e9:.2f}), "
          f"read {before['read_bps'] / 1e9:.2f} GB/s",
          file=sys.stderr)
    in_memory = train(args, "in-memory", args.batch_size, args.seq_len, ["--expert-states", "device", *common],
                      steps=args.memory_steps)
    ssd_flags = ["--expert-states", "ssd", "--cpu-cache", args.cpu_cache, "--grad-memory", args.grad_memory, *common]
    with Balloon(memory) as balloon:
        steps = train(args, "ssd", args.batch_size, args.seq_len, ssd_flags)
        killed = not balloon.alive
    # This machine's disk drifts (a VM's: its rates moved 2x within minutes), so it is rated before
    # and after the run, and the bound takes the mean of the two
    after = disk_rates(args.workdir, probe)
    disk = {k: (before[k] + after[k]) / 2 for k in before}
    compute = min(s["step_s"] for s in in_memory)

    def bound_s(read: float, written: float, rates: dict) -> float:
        return max(compute, read / rates["read_bps"] + written / rates["write_bps"])

    rows = []
    for s in steps:
        read, written = s["ssd_read_gbps"] * s["step_s"] * 1e9, s["ssd_write_gbps"] * s["step_s"] * 1e9
        bound = bound_s(read, written, disk)
        moments, spill_r, spill_w = (s.get(k, 0) for k in ("moment_read_bytes", "spill_read_bytes",
                                                           "spill_written_bytes"))
        rows.append({"step_s": s["step_s"], "read_bytes": read, "written_bytes": written, "bound_s": bound,
                     "vs_bound": s["step_s"] / bound, "loss": s["loss"], "cpu_hit_rate": s["cpu_hit_rate"],
                     "weight_read_bytes": read - moments - spill_r, "moment_read_bytes": moments,
                     "spill_read_bytes": spill_r, "state_written_bytes": written - spill_w,
                     "spill_written_bytes": spill_w})
    # the first step reads no moments (none written yet) and its writes finish in the next: the steady
    # state is the steps after it, summed
    later = rows[1:] or rows
    total = {k: sum(r[k] for r in later) for k in ("step_s", "bound_s")}
    at_probe = [total["step_s"] / sum(bound_s(r["read_bytes"], r["written_bytes"], p) for r in later)
                for p in (before, after)]
    peak = max(s["peak_rss_bytes"] for s in steps)
    return {"dense_params": n["dense"], "expert_params": n["experts"], "expert_state_bytes": state,
            "memory_bytes": memory, "state_vs_memory": state / memory, "disk": disk, "compute_s": compute,
            "disk_before": before, "disk_after": after, "steady_vs_bound_at_each_probe": at_probe,
            "steps": rows, "steady_vs_bound": total["step_s"] / total["bound_s"], "peak_rss_bytes": peak,
            "balloon_killed": killed, "in_memory_loss": [s["loss"] for s in in_memory],
            "in_memory_step_s": [s["step_s"] for s in in_memory]}


def print_largest(r: dict) -> None:
    print(f"model: {(r['dense_params'] + r['expert_params']) / 1e9:.2f} B params ({r['dense_params'] / 1e6:.1f} M "
          f"dense, {r['expert_params'] / 1e9:.2f} B in experts)")
    print(f"expert states {r['expert_state_bytes'] / GIB:.2f} GiB = {r['state_vs_memory']:.2f} x the "
          f"{r['memory_bytes'] / GIB:.2f} GiB available (the balloon holds the rest)")
    b, a = r["disk_before"], r["disk_after"]
    print(f"disk in this run, O_DIRECT over a file: write {b['write_bps'] / 1e9:.2f} GB/s before the ssd run and "
          f"{a['write_bps'] / 1e9:.2f} after, read {b['read_bps'] / 1e9:.2f} and {a['read_bps'] / 1e9:.2f}; the bound "
          f"takes their means. Compute (the in-memory step, no balloon) {r['compute_s']:.2f} s")
    print("step  s/step  read GB  written GB  bound s  vs bound  cpu hit  loss ssd    loss in memory")
    mem = r["in_memory_loss"]
    for i, row in enumerate(r["steps"]):
        hit = f"{row['cpu_hit_rate']:.2f}" if row["cpu_hit_rate"] is not None else "-"
        ref = f"{mem[i]:.6f}" if i < len(mem) else "-"
        print(f"{i + 1:4d}  {row['step_s']:6.2f}  {row['read_bytes'] / 1e9:7.2f}  {row['written_bytes'] / 1e9:10.2f}  "
              f"{row['bound_s']:7.2f}  {row['vs_bound']:8.2f}  {hit:>7}  {row['loss']:.6f}  {ref}")
    print("GB a step: read = weights + moments + spilled gradients; written = states + spilled gradients")
    for i, row in enumerate(r["steps"]):
        print(f"{i + 1:4d}  read {row['weight_read_bytes'] / 1e9:5.2f} + {row['moment_read_bytes'] / 1e9:5.2f} + "
              f"{row['spill_read_bytes'] / 1e9:5.2f}   written {row['state_written_bytes'] / 1e9:5.2f} + "
              f"{row['spill_written_bytes'] / 1e9:5.2f}")
    verdict = "meets" if r["steady_vs_bound"] <= BOUND_TARGET else "misses"
    each = r["steady_vs_bound_at_each_probe"]
    print(f"steps 2-{len(r['steps'])} together: {r['steady_vs_bound']:.2f} x the bound ({verdict} <= {BOUND_TARGET}); "
          f"{each[0]:.2f} x at the rates before the run alone, {each[1]:.2f} x at those after")
    rel = max(abs(a["loss"] - b) / abs(b) for a, b in zip(r["steps"], mem))
    verdict = ("equal bit for bit" if rel == 0 else f"within {rel:.1e}" if rel <= LARGEST_LOSS_TOL
               else f"DIFFERENT ({rel:.1e} apart)")
    print(f"losses {verdict} to the in-memory run's for the {min(len(mem), len(r['steps']))} steps both ran (the "
          f"same arithmetic on CPU: bit for bit expected; tolerance {LARGEST_LOSS_TOL:.0e}, float32 rounding)")
    print(f"peak RSS {r['peak_rss_bytes'] / GIB:.2f} GiB of the {r['memory_bytes'] / GIB:.2f} GiB available"
          + ("; the balloon was killed (out of memory): the run had more than SIZE" if r["balloon_killed"] else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="where the run directories go (on the SSD to measure)")
    ap.add_argument("--largest", action="store_true", help="train a model with expert states > RAM instead")
    ap.add_argument("--dense", action="store_true",
                    help="instead compare --dense-states replicated, zero1 and fsdp on --nproc ranks")
    ap.add_argument("--nproc", type=int, default=2, help="--dense: ranks")
    ap.add_argument("--peer", action="store_true",
                    help="instead compare with transformers + torch.optim.AdamW on the same model and batches")
    ap.add_argument("--arch", default="mixtral", choices=("mixtral", "qwen3_moe", "gpt_oss"),
                    help="--peer: the model's architecture [mixtral]")
    ap.add_argument("--peer-states", default="device", choices=("device", "cpu", "ssd"),
                    help="--peer: semoe's --expert-states [device: all in memory]")
    shape = ap.add_argument_group("model and batch (defaults differ with --largest)")
    for flag in (*SHAPE_FLAGS, "batch_size", "seq_len", "steps"):
        shape.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None)
    shape.add_argument("--cpu-cache", default=None, help="ssd: CPU cache [25%%; --largest: 1GiB]")
    ap.add_argument("--repeats", type=int, default=2, help="alternated device/ssd pairs per batch shape")
    ap.add_argument("--warmup-steps-skip", type=int, default=2, help="steps dropped from each run")
    ap.add_argument("--small-batch", action=argparse.BooleanOptionalAction, default=True,
                    help="also compare at --small-batch-size x --small-seq-len")
    ap.add_argument("--small-batch-size", type=int, default=4)
    ap.add_argument("--small-seq-len", type=int, default=128)
    ap.add_argument("--memory", default="3GiB", help="--largest: memory left to the run by the balloon [3GiB]")
    ap.add_argument("--state-factor", type=float, default=3.0, help="--largest: expert states >= this x --memory")
    ap.add_argument("--memory-steps", type=int, default=2, help="--largest: steps of the in-memory run")
    ap.add_argument("--disk-probe", default="2GiB", help="--largest: bytes written and read to rate the disk")
    ap.add_argument("--lr", type=float, default=1e-4, help="--largest: peak learning rate")
    ap.add_argument("--grad-memory", default="512MiB", help="--largest: semoe train --grad-memory [512MiB]")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--json", action="store_true", help="print one JSON object with all numbers")
    args = ap.parse_args()
    for key, value in (LARGEST if args.largest else COMPARE).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.largest and args.steps <= args.warmup_steps_skip:
        ap.error(f"--steps ({args.steps}) must exceed --warmup-steps-skip ({args.warmup_steps_skip})")
    os.makedirs(args.workdir, exist_ok=True)
    if args.peer:
        out = {"peer": peer(args)}
        if not args.json:
            print_peer(out["peer"])
    elif args.dense:
        out = {"dense": dense_modes(args)}
        if not args.json:
            print_dense(out["dense"])
    elif args.largest:
        out = {"largest": largest(args)}
        if not args.json:
            print_largest(out["largest"])
    else:
        # rated before and after the runs (this VM's disk drifts), the figures on the means
        before = disk_rates(args.workdir, 1 << 30)
        res = {"default": compare(args, "default", args.batch_size, args.seq_len)}
        if args.small_batch:
            res["small"] = compare(args, "small", args.small_batch_size, args.small_seq_len)
        after = disk_rates(args.workdir, 1 << 30)
        disk = {k: (before[k] + after[k]) / 2 for k in before}
        ram = expert_ram(args)
        for r in res.values():
            against_disk(r, disk, ram["ssd_cache_bytes"])
        out = {"target_ratio": TARGET_RATIO, "expert_ram": ram, "disk": disk, "disk_before": before,
               "disk_after": after, "compare": res}
        if not args.json:
            print_compare(res, ram)
            print(f"disk in this run, O_DIRECT, before the runs and after: read {before['read_bps'] / 1e9:.2f} and "
                  f"{after['read_bps'] / 1e9:.2f} GB/s, write {before['write_bps'] / 1e9:.2f} and "
                  f"{after['write_bps'] / 1e9:.2f} GB/s over a file (a new one {before['new_write_bps'] / 1e9:.2f} "
                  f"and {after['new_write_bps'] / 1e9:.2f}); the figures above take the means")
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
