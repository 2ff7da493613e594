"""Store benchmarks, each measured side by side in one run and printed as ratios.

1. Read throughput of every expert chunk: the hot path (preadv into aligned buffers, each tensor
   checksummed as it arrives) vs a plain sequential read of the same files vs tensorstore's own
   read, cold (O_DIRECT, page cache dropped before each pass) and warm.
2. CPU cache overhead: a hit and a miss through TieredExpertStore vs a plain read of the chunk.
3. Commit latency: updating one expert in a committed store (new files, fsync, manifest rename)
   vs writing and fsyncing the same bytes to a plain file.

    python bench/bench_store.py [--workdir DIR] [--layers 4] [--experts 8] [--hidden 1024] [--ffn 3584]

The default model is Mixtral-shaped (bfloat16 experts of 21 MiB, 672 MiB in all).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from storage.read_throughput import run_bench  # noqa: E402
from storage.keys import ExpertKey  # noqa: E402
from storage.chunk_io import ALIGN, drop_from_page_cache  # noqa: E402
from storage.host_buffers import aligned_empty  # noqa: E402
from semoe.checkpoints.hf_convert import import_checkpoint  # noqa: E402
from storage.store import ExpertTensor, Store  # noqa: E402
from storage.tiered_experts import TieredExpertStore, TieredStoreConfig  # noqa: E402
from tools.synthetic_checkpoint import SyntheticMoE, write_checkpoint  # noqa: E402


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cache_overhead(store: Store, repeats: int) -> dict:
    """Median seconds of a cache hit, a cache miss (cold chunk) and a plain cold read of one chunk."""
    chunks = list(store.manifest.chunks)
    chunk = chunks[0]
    _, buf = aligned_empty(chunk.bytes, alignment=ALIGN, pin=False)

    def plain() -> None:
        drop_from_page_cache(store.path(chunk.file))
        with open(store.path(chunk.file), "rb", buffering=0) as f:
            f.readinto(memoryview(buf.numpy()))

    t_plain = median_time(plain, repeats)
    with TieredExpertStore(store, TieredStoreConfig(cpu_cache_bytes=2 * chunk.bytes, read_mode="direct")) as tier:
        def miss() -> None:
            tier.cache.clear()
            drop_from_page_cache(store.path(chunk.file))
            tier.get(ExpertKey(chunk.layer, chunk.expert)).release()

        t_miss = median_time(miss, repeats)
        tier.get(ExpertKey(chunk.layer, chunk.expert)).release()
        t_hit = median_time(lambda: tier.get(ExpertKey(chunk.layer, chunk.expert)).release(), repeats * 100)
    return {"chunk_bytes": chunk.bytes, "plain_read_s": t_plain, "miss_s": t_miss, "hit_s": t_hit,
            "miss_vs_plain_read": t_miss / t_plain, "hit_vs_plain_read": t_hit / t_plain}


def commit_latency(store: Store, repeats: int) -> dict:
    """Median seconds to commit one updated expert vs a plain write+fsync of the same bytes."""
    chunk = store.manifest.chunk(0, 0)
    tensors = store.read_expert(0, 0)
    n_experts = store.manifest.expert_layers()[0]

    def commit() -> None:
        with store.writer() as w:
            w.put_expert(0, 0, [ExpertTensor(name=k, tensor=v) for k, v in tensors.items()], num_experts=n_experts)
            w.commit()

    data = np.zeros(chunk.bytes, dtype=np.uint8)
    path = os.path.join(store.root, "plain-write.bin")

    def plain() -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    t_commit, t_plain = median_time(commit, repeats), median_time(plain, repeats)
    os.remove(path)
    store.gc()
    return {"bytes": chunk.bytes, "commit_s": t_commit, "plain_write_fsync_s": t_plain,
            "commit_vs_plain_write": t_commit / t_plain}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where the checkpoint and store go (default: a temporary directory)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=3584)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="semoe-bench-")
    try:
        store_dir = os.path.join(work, "store")
        if not os.path.exists(store_dir):
            spec = SyntheticMoE(layers=args.layers, experts=args.experts, hidden=args.hidden, ffn=args.ffn,
                                vocab=4096, dtype="bfloat16", shard_bytes=1 << 30)
            write_checkpoint(spec, os.path.join(work, "hf"))
            import_checkpoint(os.path.join(work, "hf"), store_dir)
        store = Store.open(store_dir)
        out = {
            "read_cold": run_bench(store, cold=True, repeats=args.repeats).to_json(),
            "read_warm": run_bench(store, cold=False, repeats=args.repeats).to_json(),
            "cache": cache_overhead(store, args.repeats),
            "commit": commit_latency(store, args.repeats),
        }
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    gb = out["read_cold"]["bytes"] / 1e9
    print(f"expert chunks: {out['read_cold']['files']} files, {gb:.2f} GB")
    for name in ("read_cold", "read_warm"):
        r = out[name]
        print(f"{name:10} hot path {r['store_gbps']:6.2f} GB/s | plain read {r['raw_gbps']:6.2f} GB/s | "
              f"ratio {r['ratio']:.2f} | tensorstore+check {r['tensorstore_gbps']:.2f} GB/s (x{r['vs_tensorstore']:.2f}),"
              f" tensorstore alone {r['tensorstore_unchecked_gbps']:.2f} GB/s (x{r['vs_tensorstore_unchecked']:.2f})")
    c = out["cache"]
    print(f"cache      hit {c['hit_s'] * 1e6:.1f} us ({c['hit_vs_plain_read']:.4f}x a plain cold read), miss "
          f"{c['miss_s'] * 1e3:.2f} ms ({c['miss_vs_plain_read']:.2f}x a plain cold read of {c['chunk_bytes'] >> 20} MiB)")
    c = out["commit"]
    print(f"commit     one expert {c['commit_s'] * 1e3:.1f} ms vs plain write+fsync {c['plain_write_fsync_s'] * 1e3:.1f} ms"
          f" ({c['commit_vs_plain_write']:.2f}x)")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
