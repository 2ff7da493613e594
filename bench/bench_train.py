"""Training step time with expert states on SSD vs all in memory, side by side in one run.

Each configuration is its own `semoe train` process with its own fresh --out under --workdir,
on the same model and batch, run one after the other and alternated (device, ssd, device, ssd
with --repeats 2) so drift on a noisy machine hits both:

    device   --expert-states device: every expert weight, gradient and Adam moment in memory
    ssd      --expert-states ssd --cpu-cache 25%: the states in the store, a quarter cached

The first --warmup-steps-skip steps of each run are dropped; a row is the median step_s of the
rest (pooled over repeats). The ratio ssd/device is the cost of keeping expert states on SSD:
1.0 means free, the target is <= 1.3. The same ratio at a small batch (--small-batch, on by
default) shows how it depends on the compute per step: less compute hides less SSD traffic.

--dense instead trains the same model on --nproc ranks (default 2) once per --dense-states mode
(replicated, zero1, fsdp) and prints the dense bytes each rank holds (parameters, gradients and
AdamW moments, measured from the tensors by the trainer and logged per step), their ratio to
replicated (fsdp's target is about 1/N) and the median step time of each mode.

--peer instead trains the same Mixtral-shaped model (--arch: or a qwen3_moe or gpt_oss one) two
ways on the same batches: `semoe train --init-from` the store imported from transformers' checkpoint
(--peer-states device: everything in memory; ssd: states on SSD at --cpu-cache), and transformers'
own model with torch.optim.AdamW (bench/train_peer.py), alternated --repeats times at each batch
shape. It prints tokens/s of both and their ratio (the target is >= 1.0), and the loss of both at
every step with the largest relative difference (first step: before any update, float32 reduction
order only; later steps: AdamW amplifies that, see LOSS_TOL).

--largest instead trains, with states on SSD, a model whose expert states are at least
--ram-factor times this machine's RAM (tens of GB written under --workdir) and reports s/step,
loss per step (it must fall) and peak RSS vs RAM. It refuses (exit 2) if the model is too small
or the disk too full.

    python bench/bench_train.py --workdir DIR [--steps 8] [--repeats 2] [--no-small-batch] [--json]
    python bench/bench_train.py --workdir DIR --dense [--nproc 2] [--steps 8]
    python bench/bench_train.py --workdir DIR --peer [--arch mixtral] [--peer-states device] [--steps 8]
    python bench/bench_train.py --workdir DIR --largest [--ram-factor 1.5] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from storage.envinfo import ram_info  # noqa: E402

SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "expert_ffn", "experts", "top_k")
COMPARE = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn": 768, "expert_ffn": 512, "experts": 8,
           "top_k": 2, "batch_size": 16, "seq_len": 512, "steps": 8, "cpu_cache": "25%"}
LARGEST = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "ffn": 4096, "expert_ffn": 4096, "experts": 32,
           "top_k": 2, "batch_size": 4, "seq_len": 128, "steps": 3, "cpu_cache": "4GiB"}
TARGET_RATIO = 1.3
PEER_TARGET = 1.0  # semoe's tokens/s over transformers + AdamW's
# relative loss differences semoe vs transformers: the first step's loss is computed before any update
# (float32 matmul blocking and reduction order only); later ones after AdamW, whose first steps move
# every weight by about lr whatever the gradient's size, so rounding differences in small gradients grow
LOSS_TOL = {"first": 1e-5, "later": 1e-3}
GIB = 2**30


def model_config(args: argparse.Namespace):
    from semoe.config import named_config

    return named_config("gpt-moe-small", num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, ffn_size=args.ffn, moe_ffn_size=args.expert_ffn,
                        num_experts=args.experts, top_k=args.top_k)


def ram_bytes() -> int:
    total = ram_info()["ram_total_bytes"]
    if total is None:
        raise SystemExit(ram_info()["ram_reason"])
    return total


def train(args: argparse.Namespace, name: str, batch: int, seq: int, extra: list[str], *, shape: bool = True,
          keep: bool | None = None) -> list[dict]:
    """One `semoe train` run into a fresh --out (WORKDIR/name); its --log-json lines. `shape`: pass
    the model's shape flags (not with --init-from); `keep`: keep the run directory (default --keep)."""
    out = os.path.join(args.workdir, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    log = os.path.join(out, "steps.jsonl")
    cmd = [sys.executable, "-m", "tools.cli", "train", "--out", os.path.join(out, "run"), "--log-json", log, "-q",
           "--steps", str(args.steps), "--checkpoint-every", str(max(1000, args.steps + 1)),
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


def compare(args: argparse.Namespace, label: str, batch: int, seq: int) -> dict:
    """device vs ssd at one batch shape, alternated --repeats times."""
    modes = {"device": ["--expert-states", "device"], "ssd": ["--expert-states", "ssd", "--cpu-cache", args.cpu_cache]}
    runs: dict[str, list] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode, extra in modes.items():
            runs[mode].append(train(args, f"{label}-{mode}-{rep}", batch, seq, extra))
    rows = {m: summarize(r, args.warmup_steps_skip, batch * seq) for m, r in runs.items()}
    return {"batch_size": batch, "seq_len": seq, "rows": rows,
            "ssd_vs_device": rows["ssd"]["median_step_s"] / rows["device"]["median_step_s"]}


def expert_ram(args: argparse.Namespace) -> dict:
    """Memory the expert states take in each mode."""
    from semoe.train_config import expert_state_bytes
    from tools.sizes import parse_size

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
              f"{r['ssd_vs_device']:.2f} ({verdict} the target <= {TARGET_RATIO})")
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
    import train_peer
    from semoe.run_store import RunStore
    from semoe.train_config import TrainConfig

    hf, store = train_peer.make_checkpoint(os.path.join(args.workdir, f"peer-{args.arch}"), args.arch)
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
            batches = train_peer.run_batches(os.path.join(run, "run"), batch, seq, defaults.seed, len(steps))
            if not args.keep:
                shutil.rmtree(run, ignore_errors=True)
            print(f"running transformers ({label}, {rep}) ...", file=sys.stderr, flush=True)
            theirs.append(train_peer.train_transformers(
                hf, batches, [s["lr"] for s in steps], betas=defaults.betas, eps=defaults.eps,
                weight_decay=defaults.weight_decay, grad_clip=defaults.grad_clip, aux_coef=model.aux_loss_coef,
                z_coef=model.z_loss_coef))
            ours.append(steps)
        skip = args.warmup_steps_skip
        med = {k: statistics.median(s["step_s"] for r in runs for s in r[skip:]) for k, runs in
               (("semoe", ours), ("transformers", theirs))}
        loss = {"semoe": [s["loss"] for s in ours[0]], "transformers": [s["loss"] for s in theirs[0]]}
        rel = [abs(a - b) / abs(b) for a, b in zip(loss["semoe"], loss["transformers"])]
        out["shapes"][label] = {
            "batch_size": batch, "seq_len": seq, "median_step_s": med,
            "tokens_per_s": {k: batch * seq / v for k, v in med.items()},
            "semoe_vs_transformers": med["transformers"] / med["semoe"], "loss": loss,
            "first_loss_rel_diff": rel[0], "max_later_loss_rel_diff": max(rel[1:], default=0.0),
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
        print("  step  loss semoe  loss transformers  rel diff")
        for i, (a, b) in enumerate(zip(row["loss"]["semoe"], row["loss"]["transformers"]), 1):
            print(f"  {i:4d}  {a:10.6f}  {b:17.6f}  {abs(a - b) / abs(b):8.1e}")
        ok = (row["first_loss_rel_diff"] <= LOSS_TOL["first"] and row["max_later_loss_rel_diff"] <= LOSS_TOL["later"])
        print(f"  losses {'agree' if ok else 'DIFFER'}: first step {row['first_loss_rel_diff']:.1e} "
              f"(tolerance {LOSS_TOL['first']:.0e}), later steps at most {row['max_later_loss_rel_diff']:.1e} "
              f"(tolerance {LOSS_TOL['later']:.0e})")


def largest(args: argparse.Namespace) -> dict:
    from semoe.train_config import expert_state_bytes

    cfg = model_config(args)
    n = cfg.num_parameters()
    # 3 kinds (weight, 2 Adam moments) * layers * experts * float32 expert
    state = expert_state_bytes(cfg)
    ram, free = ram_bytes(), shutil.disk_usage(args.workdir).free
    if state < args.ram_factor * ram:
        print(f"refusing: expert states of {state / GIB:.1f} GiB are below {args.ram_factor} x RAM "
              f"({ram / GIB:.1f} GiB); raise --experts or --expert-ffn", file=sys.stderr)
        raise SystemExit(2)
    if free < 1.4 * state:
        print(f"refusing: {free / GIB:.1f} GiB free under {args.workdir}, need 1.4 x {state / GIB:.1f} GiB "
              f"= {1.4 * state / GIB:.1f} GiB", file=sys.stderr)
        raise SystemExit(2)
    # a model this wide needs a gentler step than the small default's peak rate, from the first step
    extra = ["--expert-states", "ssd", "--cpu-cache", args.cpu_cache, "--lr", str(args.lr), "--warmup-steps", "1"]
    helptext = subprocess.run([sys.executable, "-m", "tools.cli", "train", "--help"], cwd=ROOT, capture_output=True,
                              text=True, check=False, env={**os.environ, "PYTHONPATH": ROOT}).stdout
    if "--grad-memory" in helptext:
        extra += ["--grad-memory", args.grad_memory]
    steps = train(args, "largest", args.batch_size, args.seq_len, extra)
    losses = [s["loss"] for s in steps]
    peak = max(s["peak_rss_bytes"] for s in steps)
    return {"dense_params": n["dense"], "expert_params": n["experts"], "total_params": n["dense"] + n["experts"],
            "expert_state_bytes": state, "ram_bytes": ram, "state_vs_ram": state / ram,
            "step_s": [s["step_s"] for s in steps], "loss": losses,
            "loss_fell": all(b < a for a, b in zip(losses, losses[1:])),
            "cpu_hit_rate": [s["cpu_hit_rate"] for s in steps], "peak_rss_bytes": peak, "peak_rss_vs_ram": peak / ram}


def print_largest(r: dict) -> None:
    print(f"model: {r['total_params'] / 1e9:.2f} B params ({r['dense_params'] / 1e6:.1f} M dense, "
          f"{r['expert_params'] / 1e9:.2f} B in experts)")
    print(f"expert states {r['expert_state_bytes'] / GIB:.1f} GiB = {r['state_vs_ram']:.2f} x RAM "
          f"({r['ram_bytes'] / GIB:.1f} GiB)")
    for i, (dt, loss) in enumerate(zip(r["step_s"], r["loss"]), 1):
        print(f"step {i}: {dt:8.2f} s/step  loss {loss:.4f}")
    print(f"loss {'fell' if r['loss_fell'] else 'did NOT fall'}: {r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}")
    print(f"peak RSS {r['peak_rss_bytes'] / GIB:.2f} GiB = {r['peak_rss_vs_ram']:.2f} x RAM")


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
    shape.add_argument("--cpu-cache", default=None, help="ssd: CPU cache [25%%; --largest: 4GiB]")
    ap.add_argument("--repeats", type=int, default=2, help="alternated device/ssd pairs per batch shape")
    ap.add_argument("--warmup-steps-skip", type=int, default=2, help="steps dropped from each run")
    ap.add_argument("--small-batch", action=argparse.BooleanOptionalAction, default=True,
                    help="also compare at --small-batch-size x --small-seq-len")
    ap.add_argument("--small-batch-size", type=int, default=4)
    ap.add_argument("--small-seq-len", type=int, default=128)
    ap.add_argument("--ram-factor", type=float, default=1.5, help="--largest: expert states >= this x RAM")
    ap.add_argument("--lr", type=float, default=1e-4, help="--largest: peak learning rate")
    ap.add_argument("--grad-memory", default="2GiB", help="--largest: passed on if `semoe train` has the flag")
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
        res = {"default": compare(args, "default", args.batch_size, args.seq_len)}
        if args.small_batch:
            res["small"] = compare(args, "small", args.small_batch_size, args.small_seq_len)
        out = {"target_ratio": TARGET_RATIO, "expert_ram": expert_ram(args), "compare": res}
        if not args.json:
            print_compare(res, out["expert_ram"])
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
