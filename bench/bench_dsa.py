"""DeepSeek sparse attention at long context: one decoding step of a DSA layer against the same layer
attending over every cached position, side by side in one run.

The layer has DeepSeek-V3.2's attention shape (latent 512, rotary 64, no-rope and value heads of 128,
query rank 1536; its indexer: 64 heads of 128, top 2048), with --heads query heads (V3.2 has 128;
the default 32 keeps the dense side's expanded keys and values of 64k positions in memory) and a
--hidden input (the projections in and out cost the same on both sides). Its KV cache is filled
with N positions (random rows: the cost of a step does not depend on their values), then one query
at position N is decoded:

    sparse   the DSA layer: the indexer scores all N positions from its cached keys, attention
             reads the 2048 it chose (gathered; the rest are never expanded)
    dense    the same weights without the indexer (DeepSeek-V3's latent attention): every position

Each side runs on two paths: the model's modules (`LatentAttention`), and the fast core: a
one-layer model with that layer (and tiny experts and vocabulary beside it) through its one-call
step (`DecodePlan`, decode_step.c: the indexer's scores and top-k in C, then the absorbed latent
attention over the gathered rows).

Printed per N and path: ms per step (median of --rounds, after one warm-up), the ratio dense /
sparse (the target: >= 2x at 16k and 64k), and the KV bytes each step reads: dense N x (latent +
rotary key), sparse N x the indexer's key (scoring) plus 2048 x (latent + rotary key). Float32, on
this CPU.

    python bench/bench_dsa.py [--positions 16384,65536] [--heads 32] [--hidden 2048] [--rounds 3]
                              [--paths modules,fast] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from semoe.decode.plan import DecodePlan  # noqa: E402
from semoe.model.attention import KVCache, LatentAttention, rope_tables  # noqa: E402
from semoe.model.config import MoEConfig  # noqa: E402
from semoe.model.moe_gpt import MoEGPT  # noqa: E402

PATHS = ("modules", "fast")


def _config(heads: int, hidden: int, positions: int, indexer: bool) -> MoEConfig:
    return MoEConfig(arch="deepseek_v32" if indexer else "deepseek_v3", vocab_size=256, hidden_size=hidden,
                     num_layers=1, num_heads=heads, num_kv_heads=heads, ffn_size=256, moe_ffn_size=256,
                     num_experts=4, top_k=2, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position=positions + 1,
                     rope_interleave=True, **(dict(index_topk=2048, index_heads=64, index_head_dim=128)
                                              if indexer else {}))


def _step_ms(layer: LatentAttention, positions: int, rounds: int) -> float:
    c = layer.config
    cache = KVCache.empty(c, 1, positions + 1)
    torch.manual_seed(1)
    for t in (*cache.k, *cache.v):
        t[:, :, :positions].normal_()
    x = torch.randn(1, 1, c.hidden_size)
    cos, sin = rope_tables(c, torch.tensor([[positions]]), torch.float32)
    times = []
    with torch.no_grad():
        for _ in range(rounds + 1):
            cache.length = positions
            start = time.perf_counter()
            layer(x, cos, sin, cache)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def _fast_step_ms(model: MoEGPT, positions: int, rounds: int) -> float:
    """One step of the one-layer `model` at `positions` through its one-call step."""
    plan = DecodePlan(model)
    if plan.net is None:
        raise SystemExit(f"bench_dsa: the one-call step does not take the model: {plan.whole_refusal}")
    cache = KVCache.empty(model.config, 1, positions + 1)
    torch.manual_seed(1)
    for t in (*cache.k, *cache.v):
        t[:, :, :positions].normal_()
    times = []
    for _ in range(rounds + 1):
        cache.length = positions
        start = time.perf_counter()
        plan.step(5, cache)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def _side_by_side(n: int, args, path: str) -> tuple[float, float, MoEConfig]:
    """(sparse ms, dense ms, the sparse config) of one step at n positions on `path`, the same weights
    on both sides but the indexer."""
    torch.manual_seed(0)
    if path == "modules":
        sparse = LatentAttention(_config(args.heads, args.hidden, n, True), 0).eval()
        dense = LatentAttention(_config(args.heads, args.hidden, n, False), 0).eval()
        time_of = _step_ms
    else:
        sparse = MoEGPT(_config(args.heads, args.hidden, n, True)).eval()
        dense = MoEGPT(_config(args.heads, args.hidden, n, False)).eval()
        time_of = _fast_step_ms
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if ".indexer." not in f".{k}"})
    return time_of(sparse, n, args.rounds), time_of(dense, n, args.rounds), sparse.config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--positions", default="16384,65536", help="cached positions to decode after, comma-separated")
    ap.add_argument("--heads", type=int, default=32, help="query heads (DeepSeek-V3.2: 128; default 32)")
    ap.add_argument("--hidden", type=int, default=2048, help="the layer's input width (DeepSeek-V3.2: 7168)")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per side and size (median; default 3)")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="comma-separated: modules (the model's modules), fast (the one-call step)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    paths = args.paths.split(",")
    if not paths or any(p not in PATHS for p in paths):
        ap.error(f"--paths: expected a comma-separated list of {', '.join(PATHS)}, got {args.paths!r}")
    try:
        sizes = [int(n) for n in args.positions.split(",")]
    except ValueError:
        ap.error(f"--positions: expected comma-separated integers, got {args.positions!r}")
    if any(n < 1 for n in sizes) or args.heads < 1 or args.hidden < 1 or args.rounds < 1:
        ap.error("--positions, --heads, --hidden and --rounds must be positive")
    rows = []
    for n in sizes:
        for path in paths:
            s_ms, d_ms, c = _side_by_side(n, args, path)
            row_bytes, index_bytes = 4 * (c.kv_lora_rank + c.qk_rope_head_dim), 4 * c.index_head_dim
            rows.append(dict(positions=n, path=path, sparse_ms=round(s_ms, 1), dense_ms=round(d_ms, 1),
                             speedup=round(d_ms / s_ms, 2), dense_kv_bytes=n * row_bytes,
                             sparse_kv_bytes=n * index_bytes + min(c.index_topk, n) * row_bytes))
    if args.json:
        print(json.dumps({"heads": args.heads, "hidden": args.hidden, "threads": torch.get_num_threads(),
                          "rows": rows}))
        return 0
    print(f"DSA decode step, one layer ({args.heads} heads, hidden {args.hidden}, {torch.get_num_threads()} threads, "
          "float32)")
    print(f"{'positions':>10} {'path':>8} {'sparse ms':>10} {'dense ms':>10} {'dense/sparse':>13} "
          f"{'KV read sparse':>15} {'KV read dense':>14}")
    for r in rows:
        print(f"{r['positions']:>10} {r['path']:>8} {r['sparse_ms']:>10.1f} {r['dense_ms']:>10.1f} "
              f"{r['speedup']:>12.2f}x "
              f"{r['sparse_kv_bytes'] / 2**20:>12.1f} MiB {r['dense_kv_bytes'] / 2**20:>11.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
