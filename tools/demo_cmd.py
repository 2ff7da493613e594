"""`semoe demo`: the main job on its embedded default.

Trains a small MoE GPT on the embedded corpus (the Python standard library's source) with every
expert's weight and Adam moments in a store on SSD behind a CPU cache of a quarter of their bytes,
checkpointing as it goes; then verifies the store and generates text from it with the offload
engine (experts streamed SSD -> CPU cache -> compute), printing loss, throughput and cache
statistics of both phases.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from tools.cli_output import UsageError, emit_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `semoe demo`."""
    p = sub.add_parser("demo", help="run the main job on an embedded default: train, then generate",
                       description="Train a small MoE GPT on the embedded corpus with expert states on SSD for a "
                                   "few minutes, then generate text from the trained store with the offload "
                                   "engine, printing loss, throughput and cache statistics.")
    p.add_argument("--workdir", help="keep the run here (default: a temporary directory, removed at the end)")
    # 160 steps: 1.5-3 minutes of training on 2 cores (1,000-1,900 tok/s), loss 5.6 -> 2.3 nats/byte, so
    # the first command, install included, finishes in about 5 minutes; more steps learn further
    p.add_argument("--steps", type=int, default=160,
                   help="training steps (default 160: 1.5-3 minutes on 2 cores; 400 learns further)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--cpu-cache", type=float, default=0.25,
                   help="CPU cache for expert states as a fraction of their bytes (default 0.25)")
    p.add_argument("--prompt", default="def ", help="prompt for the generation (default 'def ')")
    p.add_argument("--max-new-tokens", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from inference.engine import Engine
    from inference.engine_config import EngineConfig
    from semoe.decode.loop import SamplingConfig
    from semoe.model.config import named_config
    from semoe.train.trainer import Trainer
    from semoe.train.config import TrainConfig, expert_state_bytes, progress_line
    from storage.store import Store

    if not 0 < args.cpu_cache <= 1:
        raise UsageError(f"--cpu-cache must be a fraction in (0, 1], got {args.cpu_cache}")
    for flag in ("steps", "batch_size", "seq_len", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.workdir and os.path.exists(args.workdir) and os.listdir(args.workdir):
        raise UsageError(f"--workdir {args.workdir}: directory is not empty")
    work = args.workdir or tempfile.mkdtemp(prefix="semoe-demo-")
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    model_config = named_config("gpt-moe-small")
    states = expert_state_bytes(model_config)
    cfg = TrainConfig(out=work, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                      expert_states="ssd", cpu_cache_bytes=int(states * args.cpu_cache),
                      checkpoint_every=max(1, args.steps // 4), warmup_steps=min(20, args.steps))
    try:
        params = model_config.num_parameters()
        say(f"1. training a MoE GPT ({model_config.num_layers} layers, {model_config.num_experts} experts top-"
            f"{model_config.top_k}, {params['dense'] / 1e6:.1f} M dense + {params['experts'] / 1e6:.1f} M expert "
            f"parameters) on the embedded corpus; expert weights and Adam moments ({states / 2**20:.0f} MiB) "
            f"live in {cfg.store} behind a CPU cache of {cfg.cpu_cache_bytes / 2**20:.0f} MiB")
        every = max(1, args.steps // 20)

        val_after = []

        def on_step(entry) -> None:
            if entry.step == 1 or entry.step % every == 0 or entry.step == args.steps:
                say("   " + progress_line(entry, args.steps))
            if entry.step == args.steps:
                val_after.append(trainer.evaluate())

        t0 = time.perf_counter()
        trainer = Trainer(cfg, model_config, on_step=on_step)
        val_before = trainer.evaluate()
        logs = trainer.run()
        train_s = time.perf_counter() - t0
        val_after = val_after[0]
        tail = logs[-max(1, len(logs) // 10):]
        train = {
            "steps": len(logs), "first_loss": logs[0].loss, "final_loss": sum(x.loss for x in tail) / len(tail),
            "val_loss_before": val_before, "val_loss_after": val_after, "train_s": train_s,
            "tokens_per_s": sum(x.tokens_per_s for x in logs) / len(logs),
            "cpu_hit_rate": sum(x.cpu_hit_rate or 0 for x in logs) / len(logs),
            "ssd_read_gbps": sum(x.ssd_read_gbps for x in logs) / len(logs),
            "ssd_write_gbps": sum(x.ssd_write_gbps for x in logs) / len(logs),
            "peak_rss_bytes": max(x.peak_rss_bytes for x in logs), "expert_state_bytes": states,
            "cpu_cache_bytes": cfg.cpu_cache_bytes,
        }
        say(f"   trained {len(logs)} steps in {train_s:.0f} s: loss {train['first_loss']:.3f} -> "
            f"{train['final_loss']:.3f}, validation {val_before:.3f} -> {val_after:.3f} nats/byte; "
            f"{train['tokens_per_s']:,.0f} tok/s, CPU cache hit rate {train['cpu_hit_rate']:.2f}, "
            f"SSD {train['ssd_read_gbps']:.2f} GB/s read, {train['ssd_write_gbps']:.2f} GB/s written, "
            f"peak RSS {train['peak_rss_bytes'] / 2**20:.0f} MiB")

        store = Store.open(cfg.store)
        problems = store.verify()
        if problems:
            raise RuntimeError(f"verify found {len(problems)} problems, first: {problems[0]}")
        say(f"2. store version {store.version} verified: {len(store.manifest.tensors)} tensors, every checksum good")

        weights = sum(c.bytes for c in store.manifest.chunks if c.kind == "weight")
        engine = Engine.load(cfg.store, EngineConfig(device="cpu", cpu_cache_bytes=max(weights // 2, 1)))
        try:
            tok = engine.tokenizer
            res = engine.generate(tok.encode(args.prompt, add_bos=tok.add_bos_default),
                                  SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=False, temperature=0.8,
                                                 top_p=0.95, seed=args.seed, stop_ids=()))
        finally:
            engine.close()
        text = tok.decode(res.tokens)
        gen = {"prompt": args.prompt, "text": text, "tokens": len(res.tokens), "ttft_s": res.ttft_s,
               "decode_tok_s": res.decode_tok_s, "stats": res.stats}
        s = res.stats
        say(f"3. generated {len(res.tokens)} tokens with experts offloaded (CPU cache {weights // 2 / 2**20:.0f} "
            f"of {weights / 2**20:.0f} MiB of expert weights): {res.decode_tok_s:.1f} tok/s, ttft "
            f"{res.ttft_s * 1e3:.0f} ms, CPU hit rate {s.get('cpu_hit_rate', 0):.2f}, "
            f"SSD {s.get('ssd_bytes_per_token', 0) / 2**20:.2f} MiB/token")
        say("   " + (args.prompt + text).replace("\n", "\n   "))
        if args.json:
            emit_json({"workdir": work, "store": cfg.store, "train": train, "generate": gen})
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0
