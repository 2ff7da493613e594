"""Offloaded inference vs transformers in RAM vs accelerate's disk offload, side by side in one run.

A Mixtral-shaped float32 checkpoint of about 3 GB (hidden 1024, ffn 3584, 8 layers, 8 experts,
top-2) is made with transformers once (kept in --workdir) and imported into a store. Each
configuration then runs in its own process (so peak RSS is its own) on the same prompt:

    transformers      the whole model in RAM
    accelerate        accelerate.disk_offload (weights memory-mapped from disk)
    ours-100|50|25    semoe's engine with the CPU cache at that share of expert bytes, store cold
    ours-25-replay    the same at 25%, predicting the next layer's experts from a recorded run of
                      the same request instead of the router: the ceiling of any predictor
                      (a diagnostic, not in the default list)
    lean-100|50|25    the torch-free runner (`semoe generate --lean`) with its expert cache at that
                      share, store cold (lean-100 gives its compute per token)

and the raw disk bandwidth and our compute time per token (all experts cached) are measured in the
same run, giving the bound max(compute/token, SSD bytes/token / disk bandwidth). Decode speed is
timed from the first token on, so the bound takes the SSD bytes read from then on per decoded token
(the prompt's reads are part of TTFT); bytes per token over the whole request are printed too.

A virtual disk's rate drifts by half within minutes, so each offloaded run also rates the disk right
before and after itself, in its own process, as the store's reader reads while decoding (expert
chunks two at a time, each split over the reader's threads, checksummed): the bound at that rate (the mean of
the two) is the `x reader bound` column. Each run also says how long decoding waited for reads per
token, and the compute it left exposed (the rest of the step).

`--model qwen3-30b-a3b` takes a Qwen3-30B-A3B-shaped checkpoint instead (`make_real.py`: its published
config, bfloat16, routers spread as trained ones route, `--layers` of them, 2 by default: 3.4 GiB).

    python bench/bench_offload.py --workdir /path/with/4GB/free [--new-tokens 32]
    python bench/bench_offload.py --workdir DIR --configs disk,ours-100,ours-25,lean-100,lean-25 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)


MODELS = ("mixtral", "qwen3-30b-a3b")


def prompt_ids(n: int, vocab_size: int = SHAPE["vocab_size"]) -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def workdir_model(workdir: str) -> str:
    """Which model WORKDIR holds (`model.txt`, written when it is made); mixtral for one made before."""
    try:
        with open(os.path.join(workdir, "model.txt")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return "mixtral" if os.path.exists(os.path.join(workdir, "hf", "config.json")) else ""


def make_checkpoint(workdir: str, model: str = "mixtral", layers: int = 2) -> tuple[str, str]:
    """The HuggingFace checkpoint and its store (made once)."""
    from semoe.checkpoints.hf_convert import import_checkpoint

    hf, store = os.path.join(workdir, "hf"), os.path.join(workdir, "store")
    held = workdir_model(workdir)
    if held and held != model:
        raise SystemExit(f"{workdir} holds the {held} checkpoint, not {model}: give another --workdir")
    if model != "mixtral":
        if not os.path.exists(os.path.join(hf, "config.json")):
            print(f"making a {model}-shaped checkpoint with make_real.py ({layers} layers) ...", file=sys.stderr)
            subprocess.run([sys.executable, os.path.join(ROOT, "bench", "make_real.py"), model, hf,
                            "--layers", str(layers)], check=True)
    elif not os.path.exists(os.path.join(hf, "config.json")):
        import torch
        import transformers

        print("making a Mixtral-shaped float32 checkpoint with transformers ...", file=sys.stderr)
        torch.manual_seed(0)
        cfg = transformers.MixtralConfig(**SHAPE)
        hf_model = transformers.MixtralForCausalLM(cfg).to(torch.float32)
        hf_model.save_pretrained(hf, max_shard_size="1GB")
        del hf_model
    with open(os.path.join(workdir, "model.txt"), "w") as f:
        f.write(model + "\n")
    if not os.path.exists(os.path.join(store, "manifest.json")):
        print("importing it into a store ...", file=sys.stderr)
        import_checkpoint(hf, store)
    return hf, store


def vocab_size(workdir: str) -> int:
    with open(os.path.join(workdir, "hf", "config.json")) as f:
        return json.load(f)["vocab_size"]


def drop_cache(path: str) -> None:
    from storage.chunk_io import drop_from_page_cache

    for dirpath, _, files in os.walk(path):
        for f in files:
            drop_from_page_cache(os.path.join(dirpath, f))


class TimingStreamer:
    """Records when transformers emits each token (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(hf: str, prompt: list[int], new_tokens: int, accelerate_dir: str | None) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    if accelerate_dir is not None:
        from accelerate import disk_offload

        disk_offload(model, offload_dir=accelerate_dir, execution_device="cpu")
    ids = torch.tensor([prompt])
    streamer = TimingStreamer()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             streamer=streamer, pad_token_id=0)
    times = streamer.times[1:]  # the first put() is the prompt
    tokens = out[0, len(prompt):].tolist()
    return {"tokens": tokens, "ttft_s": times[0] - t0,
            "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]), "ssd_bytes_per_token": None}


def _engine_config(store: str, cache_fraction: float):
    from inference.engine_config import EngineConfig

    return EngineConfig(cpu_cache_bytes=_budget(store, cache_fraction), read_mode="direct")


def record_routing(store: str, prompt: list[int], new_tokens: int) -> dict:
    """The layer visits of the request and their experts (for ours-N-replay; run in its own process
    so that its memory is not counted in the measured run's peak RSS)."""
    from inference.engine import Engine
    from inference.offload.ring_bookkeeping import RoutingReplay
    from semoe.decode.loop import SamplingConfig

    engine = Engine.load(store, _engine_config(store, 0.25))
    try:
        engine.offload.replay = RoutingReplay()
        engine.generate(prompt, SamplingConfig(max_new_tokens=new_tokens))
        return {"visits": engine.offload.replay.visits}
    finally:
        engine.close()


def reader_gbps(store: str, seed: int, nbytes: int = 512 << 20) -> float:
    """The store's reader on this disk now, as decoding reads: expert chunks at random (about `nbytes`
    of them), two in flight (the tier's two prefetch workers), each split over the reader's threads
    (its default settings, O_DIRECT) and checksummed."""
    import random

    from storage.chunk_io import ALIGN, ChunkReader, ChunkReaderConfig
    from storage.host_buffers import aligned_empty, round_up
    from storage.store import Store

    st = Store.open(store)
    chunks = [c for c in st.manifest.chunks if c.kind == "weight"]
    big = max(c.bytes for c in chunks)
    held = [aligned_empty(round_up(big, ALIGN), alignment=ALIGN, pin=False)[1] for _ in range(2)]
    bufs = [memoryview(t.numpy()) for t in held]
    picked = random.Random(seed).choices(chunks, k=max(2, nbytes // big))
    with ChunkReader(ChunkReaderConfig(mode="direct")) as reader:
        t0 = time.perf_counter()
        for i in range(0, len(picked) - 1, 2):
            reqs = [st.chunk_request(c, b) for c, b in zip(picked[i:i + 2], bufs)]
            for c, crcs in zip(picked[i:i + 2], reader.read_many(reqs)):
                st.check_crcs(c, crcs)
        dt = time.perf_counter() - t0
    return sum(c.bytes for c in picked[:len(picked) // 2 * 2]) / dt / 1e9


def _budget(store: str, cache_fraction: float) -> int:
    from storage.store import Store

    chunks = Store.open(store).manifest.chunks
    return int(sum(c.bytes for c in chunks) * cache_fraction) + (max(c.bytes for c in chunks)
                                                                if cache_fraction >= 1 else 0)


def _decode_figures(marks: list[tuple[float, int, float]]) -> dict:
    """From (time, bytes read so far, seconds waited for reads so far) at each token: the decode
    phase's (after the first token) bytes and waiting per decoded token."""
    (t0, b0, w0), (t1, b1, w1) = marks[0], marks[-1]
    n = max(len(marks) - 1, 1)
    return {"decode_ssd_bytes_per_token": (b1 - b0) / n, "decode_wait_s_per_token": (w1 - w0) / n,
            "decode_s_per_token": (t1 - t0) / n}


def run_ours(store: str, prompt: list[int], new_tokens: int, cache_fraction: float,
             recorded: list | None = None) -> dict:
    from inference.engine import Engine
    from inference.offload.ring_bookkeeping import RoutingReplay
    from semoe.decode.loop import SamplingConfig

    before = reader_gbps(store, 1)
    drop_cache(store)
    engine = Engine.load(store, _engine_config(store, cache_fraction))
    if recorded is not None:
        engine.offload.replay = RoutingReplay(recorded)
    waited = [0.0]  # seconds the step waited for the ring to hand out an expert
    stream = engine.offload.stream

    def timed_stream(*a):
        it = stream(*a)
        while True:
            t = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                waited[0] += time.perf_counter() - t
            yield item

    engine.offload.stream = timed_stream
    try:
        # Decode speed is timed from the first token on, so its bytes must be too: the prompt's
        # reads belong to TTFT. Snapshot the traffic when the first token comes out.
        marks, ideal = [], []

        def on_token(*_):
            ssd, ide = engine.offload.traffic()
            marks.append((time.perf_counter(), ssd, waited[0]))
            ideal.append(ide)

        res = engine.generate(prompt, SamplingConfig(max_new_tokens=new_tokens), on_token=on_token)
        decode_tokens = max(len(marks) - 1, 1)
        out = {"tokens": res.tokens, "ttft_s": res.ttft_s, "decode_tok_s": res.decode_tok_s, **res.stats,
               **_decode_figures(marks), "decode_ideal_bytes_per_token": (ideal[-1] - ideal[0]) / decode_tokens}
        if recorded is not None and engine.offload.replay.diverged:
            raise SystemExit("the replayed request routed differently from its record")
        if cache_fraction >= 1:  # everything is cached now: decode speed here is compute alone
            warm = engine.generate(prompt, SamplingConfig(max_new_tokens=new_tokens))
            out["warm_decode_tok_s"] = warm.decode_tok_s
    finally:
        engine.close()
    out["reader_gbps"] = (before + reader_gbps(store, 2)) / 2
    return out


def run_lean(store: str, prompt: list[int], new_tokens: int, cache_fraction: float) -> dict:
    """The torch-free runner at `cache_fraction` of the expert bytes, store cold (what `semoe generate
    --lean --cpu-cache N%` runs)."""
    from inference.torch_free.runner import LeanConfig, LeanModel
    from semoe.decode.loop import SamplingConfig

    before = reader_gbps(store, 1)
    drop_cache(store)
    with LeanModel(store, LeanConfig(cache_bytes=_budget(store, cache_fraction), read_mode="direct")) as model:
        cache = model.cache
        marks = []
        res = model.generate(prompt, SamplingConfig(max_new_tokens=new_tokens),
                             on_token=lambda *_: marks.append((time.perf_counter(), cache.read_bytes, cache.read_s)))
        out = {"tokens": res.tokens, "ttft_s": res.ttft_s, "decode_tok_s": res.decode_tok_s,
               "ssd_bytes_per_token": res.stats["ssd_bytes_per_token"], **_decode_figures(marks)}
        if cache_fraction >= 1:
            out["warm_decode_tok_s"] = model.generate(prompt, SamplingConfig(max_new_tokens=new_tokens)).decode_tok_s
    out["reader_gbps"] = (before + reader_gbps(store, 2)) / 2
    return out


def raw_disk_gbps(store: str) -> dict:
    """The disk's read bandwidth over the expert chunk files, cold, two ways: a plain sequential
    read, and O_DIRECT reads of 8 files at a time split into parallel pieces with no checksum
    (a deeper queue, which a virtual disk may serve faster)."""
    from storage.read_throughput import run_bench
    from storage.store import Store

    res = run_bench(Store.open(store), cold=True, repeats=1, with_tensorstore=False, verify=False)
    return {"raw_gbps": res.raw_gbps, "direct_gbps": res.store_gbps}


def child(args: argparse.Namespace) -> None:
    from storage.process_memory import peak_rss_bytes

    prompt = prompt_ids(args.prompt_tokens, vocab_size(args.workdir))
    hf, store = os.path.join(args.workdir, "hf"), os.path.join(args.workdir, "store")
    if args.only == "transformers":
        r = run_transformers(hf, prompt, args.new_tokens, None)
    elif args.only == "accelerate":
        off = os.path.join(args.workdir, "accelerate-offload")
        r = run_transformers(hf, prompt, args.new_tokens, off)
    elif args.only == "disk":
        r = raw_disk_gbps(store)
    elif args.only == "record":
        print(json.dumps(record_routing(store, prompt, args.new_tokens)))
        return
    elif args.only.startswith("lean-"):
        r = run_lean(store, prompt, args.new_tokens, int(args.only.split("-")[1]) / 100)
    else:
        recorded = None
        if args.only.endswith("-replay"):  # the request's routing, recorded by another process
            recorded = json.loads(_child(args, "record").stdout.strip().splitlines()[-1])["visits"]
        r = run_ours(store, prompt, args.new_tokens, int(args.only.split("-")[1]) / 100, recorded)
    r["peak_rss_bytes"] = peak_rss_bytes()
    print(json.dumps(r))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="where the checkpoint, store and offload folders live")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--configs", default="disk,transformers,accelerate,ours-100,ours-50,ours-25")
    ap.add_argument("--model", choices=MODELS, default="mixtral",
                    help="the checkpoint WORKDIR holds: bench_offload's Mixtral-shaped float32 one (default), "
                         "or a Qwen3-30B-A3B-shaped bfloat16 one from make_real.py")
    ap.add_argument("--layers", type=int, default=2, help="layers of the make_real.py model (default 2)")
    ap.add_argument("--only", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each configuration, in rounds; the one with the median decode speed is "
                         "reported (this machine's speed drifts by 10-20%% between runs)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.only:
        child(args)
        return 0
    for name in args.configs.split(","):
        base, _, share = name.removesuffix("-replay").partition("-")
        if name not in ("disk", "transformers", "accelerate") and not (
                base in ("ours", "lean") and share.isdigit() and 0 < int(share) <= 100
                and not (base == "lean" and name.endswith("-replay"))):
            ap.error(f"--configs: unknown configuration {name!r} (disk, transformers, accelerate, ours-N, "
                     f"ours-N-replay, lean-N with N a percentage)")
    os.makedirs(args.workdir, exist_ok=True)
    make_checkpoint(args.workdir, args.model, args.layers)
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.repeats):  # rounds, so a slow spell of the machine hits every configuration
        for name in args.configs.split(","):
            print(f"running {name} ({round_ + 1}/{args.repeats}) ...", file=sys.stderr)
            # accelerate writes its 3 GB offload folder: flush it now, or its writeback would run
            # during the next configuration and slow it down
            os.sync()
            res = _child(args, name)
            runs.setdefault(name, []).append(json.loads(res.stdout.strip().splitlines()[-1]))
    results = {name: _median_run(rs) for name, rs in runs.items()}
    report(results, args.json)
    return 0


def _child(args: argparse.Namespace, name: str) -> subprocess.CompletedProcess:
    """Run one configuration in a process of its own (so its peak RSS is its own)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--workdir", args.workdir, "--only", name,
           "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if res.returncode != 0:
        print(res.stderr, file=sys.stderr)
        raise SystemExit(f"{name} failed")
    return res


def _median_run(rs: list[dict]) -> dict:
    """The run with the median decode speed (for the disk: the median read rates)."""
    key = "decode_tok_s" if "decode_tok_s" in rs[0] else "raw_gbps"
    return sorted(rs, key=lambda r: r[key])[len(rs) // 2]


def report(results: dict, as_json: bool) -> None:
    raw = results.get("disk", {}).get("raw_gbps")
    direct = results.get("disk", {}).get("direct_gbps")
    hf = results.get("transformers")
    acc = results.get("accelerate")
    compute = {}  # each front-end's compute per token: its run with every expert cached, warm
    for front in ("ours", "lean"):
        full = results.get(f"{front}-100")
        if full and full.get("warm_decode_tok_s"):
            compute[front] = 1 / full["warm_decode_tok_s"]
    compute_s = compute.get("ours")
    summary = {}
    for name, r in results.items():
        if name == "disk":
            continue
        row = {k: r.get(k) for k in ("decode_tok_s", "ttft_s", "ssd_bytes_per_token", "ideal_bytes_per_token",
                                     "decode_ssd_bytes_per_token", "decode_ideal_bytes_per_token",
                                     "ring_hit_rate", "cpu_hit_rate", "prefetch_precision", "prefetch_recall",
                                     "peak_rss_bytes")}
        if hf and r.get("tokens") is not None:
            row["same_tokens_as_transformers"] = r["tokens"] == hf["tokens"]
        own = compute.get(name.split("-")[0])
        if r.get("decode_wait_s_per_token") is not None:
            row["decode_wait_s_per_token"] = r["decode_wait_s_per_token"]
            # the rest of a step: compute that no read overlapped (or that slowed while reads ran)
            row["exposed_compute_s_per_token"] = 1 / r["decode_tok_s"] - r["decode_wait_s_per_token"]
        if r.get("reader_gbps") and own:
            row["reader_gbps"] = r["reader_gbps"]
            row["reader_bound_s_per_token"] = max(own, r["decode_ssd_bytes_per_token"] / (r["reader_gbps"] * 1e9))
            row["vs_reader_bound"] = (1 / r["decode_tok_s"]) / row["reader_bound_s_per_token"]
        if r.get("decode_ssd_bytes_per_token") is not None and raw and own:
            # decode time per token against the decode phase's own bytes per token
            bound = max(own, r["decode_ssd_bytes_per_token"] / (raw * 1e9))
            row["bound_s_per_token"] = bound
            row["vs_bound"] = (1 / r["decode_tok_s"]) / bound
            if direct:  # the same against the deeper-queue O_DIRECT rate, where that is faster
                fast = max(own, r["decode_ssd_bytes_per_token"] / (max(raw, direct) * 1e9))
                row["vs_bound_fastest_read"] = (1 / r["decode_tok_s"]) / fast
            if r.get("ideal_bytes_per_token"):  # the whole request, prompt included
                row["ssd_vs_ideal"] = r["ssd_bytes_per_token"] / r["ideal_bytes_per_token"]
            if r.get("decode_ideal_bytes_per_token"):
                row["decode_ssd_vs_ideal"] = r["decode_ssd_bytes_per_token"] / r["decode_ideal_bytes_per_token"]
        if hf and name != "transformers" and r.get("decode_tok_s"):
            row["vs_transformers"] = r["decode_tok_s"] / hf["decode_tok_s"]
        if acc and name != "accelerate":
            row["vs_accelerate"] = r["decode_tok_s"] / acc["decode_tok_s"]
        summary[name] = row
    out = {"raw_disk_gbps": raw, "direct_disk_gbps": direct, "compute_s_per_token": compute_s,
           "lean_compute_s_per_token": compute.get("lean"), "configs": summary}
    if as_json:
        print(json.dumps(out, indent=1))
        return
    print(f"raw disk read {raw:.2f} GB/s (O_DIRECT, 8 files in flight: {direct or 0:.2f} GB/s); our compute "
          f"per token (all experts cached) {compute_s * 1e3:.1f} ms" if raw and compute_s else "")
    if compute.get("lean"):
        print(f"the torch-free runner's compute per token (all experts cached) {compute['lean'] * 1e3:.1f} ms")
    for name, row in summary.items():
        parts = [f"{name:13} decode {row['decode_tok_s']:6.2f} tok/s", f"TTFT {row['ttft_s']:6.2f} s"]
        if row.get("ideal_bytes_per_token") is not None:
            parts.append(f"SSD {row['ssd_bytes_per_token'] / 2**20:6.1f} MiB/tok (ideal "
                         f"{row['ideal_bytes_per_token'] / 2**20:.1f}), decode "
                         f"{row['decode_ssd_bytes_per_token'] / 2**20:6.1f} (ideal "
                         f"{row['decode_ideal_bytes_per_token'] / 2**20:.1f})")
        elif row.get("decode_ssd_bytes_per_token") is not None:
            parts.append(f"SSD {row['ssd_bytes_per_token'] / 2**20:6.1f} MiB/tok, decode "
                         f"{row['decode_ssd_bytes_per_token'] / 2**20:6.1f}")
        if row.get("decode_wait_s_per_token") is not None:
            parts.append(f"waits {row['decode_wait_s_per_token'] * 1e3:.1f} ms/tok for reads, "
                         f"{row['exposed_compute_s_per_token'] * 1e3:.1f} ms the rest")
        if row.get("reader_gbps"):
            parts.append(f"reader {row['reader_gbps']:.2f} GB/s around it: {row['vs_reader_bound']:.2f}x reader bound")
        for key, label in (("vs_transformers", "x transformers"), ("vs_accelerate", "x accelerate"),
                           ("vs_bound", "x bound"), ("vs_bound_fastest_read", "x bound at the O_DIRECT rate"),
                           ("ssd_vs_ideal", "x ideal bytes"),
                           ("decode_ssd_vs_ideal", "x ideal decode bytes")):
            if row.get(key) is not None:
                parts.append(f"{row[key]:.2f}{label}")
        parts.append(f"peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB")
        if "same_tokens_as_transformers" in row:
            parts.append("same tokens" if row["same_tokens_as_transformers"] else "DIFFERENT tokens")
        print(" | ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
