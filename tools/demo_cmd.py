"""`semoe demo`: the main job on its embedded default.

Builds a small Mixtral-layout checkpoint, imports it into a store, verifies it, then serves every
expert through the SSD -> CPU tier with a cache at half the expert bytes while replaying a skewed
routing trace (the next layer's experts prefetched while the current one is used), and prints the
tier's statistics beside an offline comparison of eviction policies on the same trace.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

import torch

from tools.common import emit_json
from tools.progress import byte_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `semoe demo`."""
    p = sub.add_parser("demo", help="run the main job on an embedded default",
                       description="Build a small Mixtral-layout checkpoint, import it into a store, verify it, "
                                   "read every expert back through the CPU cache while replaying a routing trace, "
                                   "and print the statistics.")
    p.add_argument("--workdir", help="keep the checkpoint and store here (default: a temporary directory, removed)")
    p.add_argument("--cache-fraction", type=float, default=0.5,
                   help="CPU cache size as a fraction of expert bytes (default 0.5)")
    p.add_argument("--tokens", type=int, default=256, help="tokens in the replayed routing trace (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(handler=run)


def routing_trace(layers: int, experts: int, top_k: int, tokens: int, seed: int) -> list[tuple[int, list[int]]]:
    """A skewed routing trace: per layer a few popular experts (Zipf-like), drifting slowly.

    Expert popularity in trained MoE models is skewed and fairly stable within a layer; every
    64 tokens two neighbouring ranks of one layer swap, so popularity does drift a little.
    """
    rng = random.Random(seed)
    order = [rng.sample(range(experts), experts) for _ in range(layers)]
    weights = [1.0 / (r + 1) ** 1.2 for r in range(experts)]
    trace = []
    for t in range(tokens):
        for layer in range(layers):
            if t and t % 64 == 0 and layer == rng.randrange(layers):  # the drift LFU needs aging for
                r = rng.randrange(experts - 1)
                order[layer][r], order[layer][r + 1] = order[layer][r + 1], order[layer][r]
            chosen: list[int] = []
            while len(chosen) < top_k:
                e = order[layer][rng.choices(range(experts), weights)[0]]
                if e not in chosen:
                    chosen.append(e)
            trace.append((layer, chosen))
    return trace


def run(args: argparse.Namespace) -> int:
    from storage.cache_sim import simulate_all
    from storage.hf import import_checkpoint
    from storage.tiered import TieredExpertStore, TieredStoreConfig
    from tools.synthetic import SyntheticMoE, write_checkpoint

    if not 0 < args.cache_fraction <= 1:
        raise ValueError(f"--cache-fraction must be in (0, 1], got {args.cache_fraction}")
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    work = args.workdir or tempfile.mkdtemp(prefix="semoe-demo-")
    if args.workdir and os.path.exists(work) and os.listdir(work):
        raise ValueError(f"--workdir {work}: directory is not empty")
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    spec = SyntheticMoE(layers=4, experts=8, hidden=256, ffn=704, vocab=2048, dtype="bfloat16", shard_bytes=8 << 20)
    try:
        hf_dir, store_dir = os.path.join(work, "checkpoint"), os.path.join(work, "store")
        t0 = time.perf_counter()
        write_checkpoint(spec, hf_dir, seed=args.seed)
        say(f"1. wrote a Mixtral-layout checkpoint ({spec.layers} layers x {spec.experts} experts, "
            f"{spec.expert_bytes() / 2**20:.1f} MiB of experts) to {hf_dir}")
        with byte_bar(spec.expert_bytes(), "import") as bar:
            store = import_checkpoint(hf_dir, store_dir, progress=bar.update)
        info = store.describe()
        say(f"2. imported into {store_dir}: version {info['version']}, {info['tensors']} tensors, "
            f"{len(store.manifest.chunks)} expert chunk files")
        problems = store.verify()
        if problems:
            raise RuntimeError(f"verify found {len(problems)} problems, first: {problems[0]}")
        say(f"3. verified every checksum ({info['tensors']} tensors, {len(store.manifest.files)} side files)")

        trace = routing_trace(spec.layers, spec.experts, spec.top_k, args.tokens, args.seed)
        chunk = store.manifest.chunk(0, 0).bytes
        capacity_experts = max(spec.top_k, int(args.cache_fraction * len(store.manifest.chunks)))
        tier = TieredExpertStore(store, TieredStoreConfig(cpu_cache_bytes=capacity_experts * chunk,
                                                          read_mode="direct"))
        x = torch.randn(1, spec.hidden)
        checksum = 0.0
        t1 = time.perf_counter()
        with tier:
            # first every expert once (the "read every expert back" pass), then the routing trace
            for c in store.manifest.chunks:
                with tier.get(c.layer, c.expert) as h:
                    assert_finite(h.tensors)
            tier.reset_stats()
            for i, (layer, experts) in enumerate(trace):
                if i + 1 < len(trace):  # the next layer's experts load while this layer computes
                    tier.prefetch([(trace[i + 1][0], e) for e in trace[i + 1][1]], priority=float(i + 1))
                for e in experts:
                    with tier.get(layer, e) as h:
                        w = list(h.tensors.values())
                        checksum += float((x @ w[0].float().T).sum())  # touch the bytes like a layer would
            stats = tier.stats()
        wall = time.perf_counter() - t1
        sim = simulate_all(trace, capacity_experts, aging_interval=max(8, capacity_experts))
        result = {
            "workdir": work, "store_version": info["version"], "expert_bytes": info["expert_bytes"],
            "dense_bytes": info["dense_bytes"], "cache_experts": capacity_experts, "cache_bytes": capacity_experts * chunk,
            "lookups": stats.hits + stats.misses + stats.inflight_hits, "tier": stats.to_json(),
            "ssd_gbps": stats.ssd_bytes / stats.ssd_read_s / 1e9 if stats.ssd_read_s else None,
            "trace_wall_s": wall, "total_s": time.perf_counter() - t0,
            "policy_sim": {k: v.to_json() for k, v in sim.items()},
        }
        say(f"4. replayed {len(trace)} routing steps ({args.tokens} tokens x {spec.layers} layers, top-{spec.top_k}) "
            f"through a CPU cache of {capacity_experts}/{len(store.manifest.chunks)} experts in {wall:.2f} s:")
        say(f"   hits {stats.hits}, in-flight hits {stats.inflight_hits}, misses {stats.misses}, "
            f"hit rate {stats.hit_rate:.3f} (LFU with aging), evictions {stats.evictions}")
        say(f"   SSD: {stats.ssd_reads} reads, {stats.ssd_bytes / 2**20:.1f} MiB, prefetches issued "
            f"{stats.prefetch_issued}, dropped {stats.prefetch_dropped}")
        say("5. the same trace, offline, by policy: " + ", ".join(
            f"{k} {v.hit_rate:.3f}" for k, v in sim.items()))
        if args.json:
            emit_json(result)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def assert_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Fail loudly if an expert came back with NaN or inf (random weights never have them)."""
    for name, t in tensors.items():
        if not torch.isfinite(t.float()).all():
            raise RuntimeError(f"tensor {name} read back with non-finite values")
