"""semoe against llama.cpp on the same checkpoint: decode speed resident, and with memory short.

The 3 GB Mixtral-shaped float32 checkpoint of bench_offload.py and its stores of bench_quant.py
(float32, int8, int4), and llama.cpp's own conversions of it (f32, q8_0, q4_0; bench/llama_peer.py
builds the peer into its own environment once). Every run is its own process, decodes greedily
after the same prompt ids with 2 threads, after one warm-up generation; speed is timed from the first
new token on (the prompt excluded); the median of --repeats rounds is reported.

    resident  tok/s of both engines at each precision, greedy tokens' agreement (f32 against f32),
              peak RSS
    limited   with the page cache dropped first, a balloon process holds all but SIZE of the
              available memory (no swap: it stays resident; it sizes itself after its own start
              and tops up until MemAvailable is SIZE) while one engine runs, SIZE = 50% and
              25% of the model's bytes: semoe with its CPU cache sized so that its own memory (its
              peak RSS less its file-backed pages), the int8 dense weights the torch-free runner maps
              from the store (paged in as used where SIZE leaves them no room beside its least
              cache) and --margin (64 MiB) for the code it runs fit SIZE
              (--cpu-cache-auto: the engine's `--cpu-cache auto` instead, which sizes it from
              MemAvailable less a reserve and under this balloon took less: 0.03 GiB at int4 50%),
              llama.cpp with mmap and the page cache (and --no-repack: its q4_0 kernels otherwise
              copy the whole model into anonymous memory at load). tok/s and bytes read from storage per
              decoded token (/proc/PID/io read_bytes: O_DIRECT reads and mmap page faults alike)

    python bench/bench_vs_llamacpp.py --workdir /path/of/bench_quant [--repeats 3] [--parts resident,limited]

A memory sweep as a user meets it: --memory 25,33,50,67 --defaults --cold. --defaults adds, at each
SIZE, `semoe generate` with no budget flag (default-BITS-SIZE: the engine or the torch-free runner
and its cache as it chooses them from the memory it finds) beside ours on the bench's sizing;
--cold times each process's first generation in full as well (the page cache dropped before the
process, so both engines start cold), beside the second in the same process (warm).

--arch ARCH makes WORKDIR's checkpoint first instead (each piece once): a random-weight float32
checkpoint of that architecture from transformers' own class, about 3 GB (ARCH_SHAPES: 8 layers,
hidden size 1024, 32000 tokens, 32 experts of 768 where the architecture routes many small
experts), its stores (the import, int8 and int4) and llama.cpp's conversions by its own converter
(f32, q8_0) and llama-quantize (q4_0). The resident part then also runs transformers' greedy
decoding at float32, the reference both engines' tokens are held to; where a token differs, the
report gives transformers' gap between its two best logits at that step (a near-tie, or not).

    python bench/bench_vs_llamacpp.py --workdir /path/qwen3 --arch qwen3_moe [--parts resident]

--shape NAME=N,... changes that checkpoint's shape (hidden, layers, heads, kv_heads, head_dim,
experts, top_k, expert_width, positions, in each architecture's own config fields); a sweep of shapes
is a WORKDIR each. A long context takes positions (ARCH_SHAPES: 4096) and --prompt-tokens; past 8192
prompt tokens transformers' reference does not run (its eager attention holds every score):

    python bench/bench_vs_llamacpp.py --workdir /path/q35-64k --arch qwen3_5_moe_text --shape positions=65600 \
        --parts resident --resident-bits f32 --prompt-tokens 65536 --new-tokens 16 --repeats 1


    for s in head_dim=64,experts=64 head_dim=256,heads=4 experts=128,top_k=8,expert_width=256; do
      python bench/bench_vs_llamacpp.py --workdir /path/qwen3-$s --arch qwen3_moe --shape $s --parts resident
    done
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

from llama_peer import WARM_PROMPT  # noqa: E402  (the warm-up generation's prompt at most, both engines')

# This process stays free of torch (the engines import it in their own processes): it lives through
# every memory-limited run, and torch's 150 MiB and mapped code would come out of SIZE for both
# engines, unevenly (llama.cpp's page cache felt it most: 2 tok/s instead of 18 at int4 50%).
from bench_offload import drop_cache, prompt_ids  # noqa: E402
from peer_checkpoints import (ARCH_SHAPES, GGUF_BITS, SHAPE_FIELDS, parse_shape, prepare_arch,  # noqa: E402
                              prepare_wide)

# (our precision, our store in WORKDIR, llama.cpp's type: WORKDIR/llama-TYPE.gguf); mxfp4: a checkpoint that
# ships MXFP4 experts (gpt-oss), its import and llama.cpp's conversion, both keeping them as they are
TRANSFORMERS_PROMPT = 8192  # the longest prompt the transformers reference runs (its T x T scores per head)
PAIRS = (("f32", "store", "f32"), ("int8", "store-int8", "q8_0"), ("int4", "store-int4", "q4_0"),
         ("mxfp4", "store", "mxfp4"), *((g, f"store-gguf-{g}", g) for g in GGUF_BITS))
MARGIN_MIB = 64  # left in SIZE beside our own memory and cache (--margin): the library code decoding runs


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def run_ours(store: str, prompt: list[int], new_tokens: int, cpu_cache: int | str | None,
             ring_slots: int | None = None, dense: str = "auto", first: bool = False) -> dict:
    """Greedy decode of our engine (resident without a cache budget), after a warm-up generation
    (`first`: after a first generation timed in full, its figures under "first")."""
    from inference.engine import Engine
    from inference.engine_config import EngineConfig
    from inference.memory_guard import AUTO_RESERVE_BYTES
    from semoe.decode.loop import SamplingConfig
    from storage.process_memory import major_faults, peak_rss_bytes, status_bytes

    cfg = EngineConfig(dtype="float32", cpu_cache_bytes=cpu_cache, ring_slots=ring_slots, read_mode="direct",
                       dense=dense) if cpu_cache else EngineConfig(dtype="float32", dense=dense)
    engine = Engine.load(store, cfg)
    start_cache = engine.offload.tier.cache.capacity_bytes if engine.offload else None
    try:
        sampling = SamplingConfig(max_new_tokens=new_tokens)

        def timed() -> dict:
            read0, faults0 = _read_bytes(), major_faults()
            res = engine.generate(prompt, sampling)
            return {"tokens": res.tokens, "decode_tok_s": res.decode_tok_s, "ttft_s": res.ttft_s,
                    "read_bytes_per_token": (_read_bytes() - read0) / len(res.tokens),
                    "major_faults_per_token": (major_faults() - faults0) / len(res.tokens),
                    "expert_read_bytes_per_token": res.stats.get("ssd_bytes_per_token", 0.0),
                    "process_read_bytes": _read_bytes()}  # since the process started: its load too

        if first:
            cold = timed()
        else:  # (on the prompt's first tokens: a long prompt is evaluated once, timed)
            engine.generate(prompt[:WARM_PROMPT], SamplingConfig(max_new_tokens=4))
        out = timed()
        if first:
            out["first"] = cold
        return {**out, "peak_rss_bytes": peak_rss_bytes(), "rss_file_bytes": status_bytes("RssFile") or 0,
                "cpu_cache_bytes": engine.offload.tier.cache.capacity_bytes if engine.offload else None,
                "cpu_cache_start_bytes": start_cache, "auto_reserve_bytes": AUTO_RESERVE_BYTES}
    finally:
        engine.close()


def run_lean(store: str, prompt: list[int], new_tokens: int, cpu_cache: int | None, dense: str = "auto",
             first: bool = False, kv_cache: str = "f32") -> dict:
    """Greedy decode of the torch-free runner (`inference.torch_free.runner`) with a CPU cache of `cpu_cache` bytes
    (0: the least it decodes with; None: its own choice, as `semoe generate`'s, the sequence's memory
    left free beside it), after a warm-up generation (`first`: after a first generation timed in full,
    its figures under "first")."""
    from inference.torch_free.runner import LeanConfig, LeanModel
    from semoe.checkpoints.hf_config import store_model_config
    from inference.torch_free.sequence_memory import sequence_plan
    from semoe.decode.loop import SamplingConfig
    from storage.process_memory import available_ram_bytes
    from storage.reader import StoreReader

    c = store_model_config(StoreReader.open(store))  # as `semoe generate` chooses
    kv_cache, keep = sequence_plan(c, len(prompt), new_tokens, kv_cache, available_ram_bytes())
    keep = keep if cpu_cache is None else 0
    config = LeanConfig(cache_bytes=cpu_cache, keep_bytes=keep, read_mode="direct", dense=dense, kv_cache=kv_cache)
    with LeanModel(store, config) as model:
        uses: dict[int, list[int]] = {}  # layer -> the experts decoding steps chose in the timed generation
        used: set[tuple[int, int]] = set()  # (layer, expert) the prompt pass chose (its guesses aside)
        begin, at_first = model.cache.begin, {}

        def counted(layer: int, experts: list[int], *, speculative: bool = False):
            if not speculative and not at_first:  # the prompt's pass
                used.update((layer, e) for e in experts)
            elif not speculative:  # a decoding step (the first token is out)
                uses.setdefault(layer, []).extend(experts)
            return begin(layer, experts, speculative=speculative)

        model.cache.begin = counted
        cold = None
        if first:
            cold = _lean_timed(model, prompt, new_tokens, uses, used, at_first)
        else:
            model.generate(prompt[:WARM_PROMPT], SamplingConfig(max_new_tokens=4))
        out = _lean_timed(model, prompt, new_tokens, uses, used, at_first)
        return out if cold is None else {**out, "first": cold}


def _lean_timed(model, prompt: list[int], new_tokens: int, uses: dict, used: set, at_first: dict) -> dict:
    """One timed generation of run_lean's `model`; `uses`, `used` and `at_first` are what its hooks
    fill (emptied here first)."""
    from semoe.decode.loop import SamplingConfig
    from storage.process_memory import major_faults, status_bytes

    for state in (uses, used, at_first):
        state.clear()

    def first(_token: int, _logprob: float) -> None:  # the prompt is done: decoding's figures from here
        if not at_first:
            at_first.update(read=_read_bytes(), expert=model.cache.read_bytes, wait=model.cache.read_s,
                            t=time.perf_counter())

    cache = model.cache.n * model.slot_bytes
    read0, faults0, expert0 = _read_bytes(), major_faults(), model.cache.read_bytes
    res = model.generate(prompt, SamplingConfig(max_new_tokens=new_tokens), on_token=first)
    steps = max(1, len(res.tokens) - 1)
    waited = model.cache.read_s - at_first["wait"]
    wait_share = waited / (time.perf_counter() - at_first["t"])
    decode_expert_bytes = model.cache.read_bytes - at_first["expert"]
    chunk = model.store.manifest.chunk
    return {"tokens": res.tokens, "decode_tok_s": res.decode_tok_s, "ttft_s": res.ttft_s,
            # decoding's reads per step after the first token; the prompt's apart, against the bytes of
            # the experts it chose (each read once: 1.0)
            "read_bytes_per_token": (_read_bytes() - at_first["read"]) / steps,
            "prompt_read_bytes": at_first["read"] - read0,
            "prompt_expert_read_bytes": at_first["expert"] - expert0,
            "prompt_used_expert_bytes": sum(chunk(lay, e).bytes for lay, e in used),
            "major_faults_per_token": (major_faults() - faults0) / len(res.tokens),
            "expert_read_bytes_per_token": decode_expert_bytes / steps,
            "peak_rss_bytes": res.stats["peak_rss_bytes"], "rss_file_bytes": status_bytes("RssFile") or 0,
            "cpu_cache_bytes": cache, "cpu_cache_start_bytes": cache, "auto_reserve_bytes": 0,
            "read_wait_share": wait_share, "mapped_bytes": model.mapped_bytes,
            "read_gbps_waiting": decode_expert_bytes / waited / 1e9 if waited > 0 else None,
            "routing_entropy": routing_entropy(uses, model.config.num_experts),
            "process_read_bytes": _read_bytes()}  # since the process started: its load too


def routing_entropy(uses: dict[int, list[int]], n_experts: int) -> float:
    """The normalized entropy of each layer's expert picks (1: every expert picked equally often; a few
    experts taking most tokens, as random weights can route, well under 0.9), the least over layers."""
    import math
    from collections import Counter

    least = 1.0
    for picks in uses.values():
        p = [n / len(picks) for n in Counter(picks).values()]
        least = min(least, -sum(x * math.log(x) for x in p) / math.log(n_experts))
    return least


def run_transformers(hf: str, prompt: list[int], new_tokens: int) -> dict:
    """transformers' greedy decoding at float32, step by step with its KV cache: the tokens, and at each
    step the gap between the two largest logits (how close the choice was)."""
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokens, gaps, past, ids = [], [], None, torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(ids, past_key_values=past, use_cache=True)
            past, top = out.past_key_values, out.logits[0, -1].float().topk(2)
            tokens.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids = top.indices[:1].view(1, 1)
    return {"tokens": tokens, "logit_gaps": gaps, "decode_tok_s": new_tokens / (time.perf_counter() - t0),
            "read_bytes_per_token": 0.0, "peak_rss_bytes": 0}


def run_llama(gguf: str, prompt: list[int], new_tokens: int, repack: bool = True, first: bool = False) -> dict:
    import llama_peer as peer

    return peer.decode_run(gguf, prompt, new_tokens, n_threads=2, kv_type="f32", env=peer.ensure_env(),
                           repack=repack, first=first)


def model_bytes(workdir: str, ours: str) -> int:
    """Bytes of one of our stores' weights (experts and dense), the SIZE reference of its precision:
    its manifest read as JSON (`storage.store` imports torch, which this process must not)."""
    with open(os.path.join(workdir, ours, "manifest.json")) as f:
        return sum(t["bytes"] for t in json.load(f)["tensors"] if t.get("kind", "weight") == "weight")


# -- memory pressure ---------------------------------------------------------------------------


def available_bytes() -> int:
    """MemAvailable (`storage.process_memory`, which imports no torch, as this process must not)."""
    from storage.process_memory import available_ram_bytes

    return available_ram_bytes()


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class Balloon:
    """A process holding all but `keep` bytes of the available memory, touched so that it is resident;
    ended on exit whatever happens."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Balloon":
        if "torch" in sys.modules:  # its memory would sit beside both engines' (see the imports above)
            raise SystemExit("bench_vs_llamacpp: this process imported torch; the memory-limited runs need it "
                             "torch-free")
        drop_page_cache()
        if available_bytes() <= self.keep:
            raise SystemExit(f"only {available_bytes()} bytes available, less than SIZE {self.keep}")
        # The balloon sizes itself from MemAvailable as seen once its interpreter and numpy are
        # resident (about 30 MB, which would otherwise come out of SIZE), and tops itself up until
        # what is left is SIZE (within about 10 MiB): the kernel frees some of its own caches under the
        # pressure the first allocation makes, so the top-ups take half of what is over each time.
        code = ("import numpy as np, sys, time\n"
                "def avail():\n"
                "    return next(int(l.split()[1]) * 1024 for l in open('/proc/meminfo') if l.startswith('MemAvailable:'))\n"
                "held = []\n"
                "for i in range(8):\n"
                f"    more = avail() - {self.keep}\n"
                "    if more < 4 << 20:\n"
                "        break\n"
                "    held.append(np.ones(more if i == 0 else more // 2, dtype=np.uint8))\n"  # written: resident
                "    time.sleep(0.2)\n"
                "print('ready', flush=True)\n"
                "time.sleep(3600)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the balloon process failed")
        return self

    @property
    def alive(self) -> bool:
        """False once the kernel's OOM killer took the balloon: a run then had more than SIZE."""
        return self.proc is not None and self.proc.poll() is None

    def __exit__(self, *exc: object) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


# -- the run -------------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    spec = json.loads(args.only)
    prompt = prompt_ids(args.prompt_tokens)
    first = bool(spec.get("first"))
    if spec["engine"] == "default":  # what `semoe generate` runs with no budget flag, chosen as it chooses
        drop_cache(spec["path"])
        if default_is_lean(spec["path"]):
            r = run_lean(spec["path"], prompt, args.new_tokens, None, args.dense, first, "auto")  # the CLI's defaults
        else:
            r = run_ours(spec["path"], prompt, args.new_tokens, None, None, args.dense, first)
    elif spec["engine"] == "ours":
        if spec.get("cold"):
            drop_cache(spec["path"])
        r = run_ours(spec["path"], prompt, args.new_tokens, spec.get("cpu_cache"), spec.get("ring_slots"),
                     args.dense, first)
    elif spec["engine"] == "lean":
        if spec.get("cold"):
            drop_cache(spec["path"])
        r = run_lean(spec["path"], prompt, args.new_tokens, spec["cpu_cache"], args.dense, first, args.kv_cache)
    elif spec["engine"] == "transformers":
        r = run_transformers(spec["path"], prompt, args.new_tokens)
    else:
        r = run_llama(spec["path"], prompt, args.new_tokens, spec.get("repack", True), first)
    print(json.dumps(r))


def default_is_lean(store: str) -> bool:
    """Whether `semoe generate --model STORE` with no other flag decodes in the torch-free runner
    (`tools.engine_flags.lean_by_itself`, asked of its own parser's defaults; no torch imported)."""
    from tools.cli import build_parser
    from tools.engine_flags import lean_by_itself

    args = build_parser().parse_args(["generate", "--model", store, "--prompt-ids", "1"])
    return lean_by_itself(args) is not None


def _run(args: argparse.Namespace, spec: dict, check: bool = True) -> dict | None:
    """One run in its own process; a failure ends the bench (`check`) or gives None."""
    cmd = [sys.executable, os.path.abspath(__file__), "--workdir", args.workdir, "--only", json.dumps(spec),
           "--dense", args.dense, "--kv-cache", args.kv_cache,
           "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if res.returncode != 0:
        print(res.stderr[-4000:], file=sys.stderr)
        if not check:
            return None
        raise SystemExit(f"{spec} failed")
    got = json.loads(res.stdout.strip().splitlines()[-1])
    if "decode_tok_s" in got:  # each run's figures as it ends (a long run's survive the bench's end)
        print(f"  {spec.get('engine')}: {got['decode_tok_s']:.2f} tok/s decoding, {got.get('ttft_s', 0):.1f} s to the "
              f"first token, {got.get('read_bytes_per_token', 0) / 2**20:.2f} MiB read a token", file=sys.stderr,
              flush=True)
    return got


def resident(args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.repeats):
        for bits, ours, gguf in PAIRS:
            if bits not in args.resident_bits.split(","):
                continue
            for engine, path in (("ours", os.path.join(args.workdir, ours)),
                                 ("llama", os.path.join(args.workdir, f"llama-{gguf}.gguf"))):
                name = f"{engine}-{bits if engine == 'ours' else gguf}"
                print(f"resident {name} ({round_ + 1}/{args.repeats}) ...", file=sys.stderr)
                runs.setdefault(name, []).append(_run(args, {"engine": engine, "path": path}))
    out = _medians(runs)
    if args.arch and args.prompt_tokens > TRANSFORMERS_PROMPT:
        print(f"resident transformers-f32: not run for a prompt of {args.prompt_tokens} tokens (its eager attention "
              f"holds the prompt's scores, {TRANSFORMERS_PROMPT} tokens at most here)", file=sys.stderr)
    elif args.arch:  # the reference tokens: one run (its speed is not what is compared)
        print("resident transformers-f32 ...", file=sys.stderr)
        out["transformers-f32"] = _run(args, {"engine": "transformers", "path": os.path.join(args.workdir, "hf")})
        out["transformers-f32"]["decode_tok_s_runs"] = [out["transformers-f32"]["decode_tok_s"]]
    return out


def footprint(args: argparse.Namespace, ours: str) -> dict:
    """Our process with the smallest CPU cache it runs with (raised to what a ring of 2 slots needs;
    on CPU the slots are CPU-cache entries, and 2 serve top-2 routing), no balloon: its peak RSS less
    that cache and less its file-backed pages (the code of torch and the other libraries, which the
    kernel keeps or drops under pressure as it does llama.cpp's mapped weights) is the memory it
    holds of its own besides the cache."""
    spec = {"engine": "lean", "path": os.path.join(args.workdir, ours), "cpu_cache": 0, "cold": True} if args.lean \
        else {"engine": "ours", "path": os.path.join(args.workdir, ours), "cpu_cache": 1, "cold": True, "ring_slots": 2}
    r = _run(args, spec)
    return {"peak_rss_bytes": r["peak_rss_bytes"], "min_cache_bytes": r["cpu_cache_bytes"],
            "rss_file_bytes": r["rss_file_bytes"], "auto_reserve_bytes": r["auto_reserve_bytes"],
            "mapped_bytes": r.get("mapped_bytes", 0)}


def disk_rate(store: str) -> dict:
    """The disk's read rate in this run: `semoe store bench --cold` of the store (every expert chunk once
    by a plain buffered read, a dd-style O_DIRECT read and the store's own hot path, each cold)."""
    res = subprocess.run([sys.executable, "-m", "tools.cli", "store", "bench", "--cold", "--repeats", "1",
                          "--no-tensorstore", "--json", store], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    if res.returncode != 0:
        print(res.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"semoe store bench --cold {store} failed")
    r = json.loads(res.stdout)
    return {"raw_gbps": r["raw_gbps"], "raw_direct_gbps": r["raw_direct_gbps"], "store_gbps": r["store_gbps"],
            "bytes": r["bytes"], "disk_gbps": max(r["raw_gbps"], r["raw_direct_gbps"] or 0.0)}


def limited(args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {}
    notes = {}
    disk = None
    for bits, ours, gguf in PAIRS:
        if bits not in args.limited_bits.split(","):
            continue
        if disk is None:
            print(f"the disk's read rate: semoe store bench --cold {ours} ...", file=sys.stderr)
            disk = disk_rate(os.path.join(args.workdir, ours))
        fp = footprint(args, ours)
        # its own anonymous memory; the dense weights the runner maps from the store (file-backed, as
        # llama.cpp's) are given room beside the cache where SIZE allows, else paged as used
        base, mapped = fp["peak_rss_bytes"] - fp["rss_file_bytes"] - fp["min_cache_bytes"], fp["mapped_bytes"]
        total = model_bytes(args.workdir, ours)
        for share in (int(s) for s in args.memory.split(",")):
            size = total * share // 100
            left = fp["auto_reserve_bytes"] if args.cpu_cache_auto else args.margin << 20
            cache = size - base - mapped - left
            if mapped and cache < fp["min_cache_bytes"] <= size - base - left:
                cache = fp["min_cache_bytes"]
                notes[f"paged-{bits}-{share}%"] = (
                    f"ours at {share}%: its {mapped / 2**30:.2f} GiB of mapped dense weights do not all fit beside "
                    f"its least cache: they are paged in as used, as llama.cpp's mapped weights")
            specs = [("llama", {"engine": "llama", "path": os.path.join(args.workdir, f"llama-{gguf}.gguf"),
                                "repack": False})]
            if cache >= fp["min_cache_bytes"] and args.lean:
                specs.insert(0, ("ours", {"engine": "lean", "path": os.path.join(args.workdir, ours),
                                          "cpu_cache": cache, "cold": True}))
            elif cache >= fp["min_cache_bytes"]:
                specs.insert(0, ("ours", {"engine": "ours", "path": os.path.join(args.workdir, ours),
                                          "cpu_cache": "auto" if args.cpu_cache_auto else cache, "cold": True,
                                          "ring_slots": 2}))
            else:
                notes[f"ours-{bits}-{share}%"] = (
                    f"does not fit SIZE {size / 2**30:.2f} GiB: it holds {base / 2**30:.2f} GiB of its own besides its "
                    f"cache and {fp['rss_file_bytes'] / 2**30:.2f} GiB of mapped code, leaves {left >> 20} MiB "
                    f"for the code it runs, and its ring needs a cache of {fp['min_cache_bytes'] / 2**30:.2f} GiB")
            if args.defaults:
                specs.insert(0, ("default", {"engine": "default", "path": os.path.join(args.workdir, ours)}))
            for _, spec in specs:
                spec["first"] = args.cold
            for round_ in range(args.repeats):
                for engine, spec in specs:
                    name = f"{engine}-{gguf if engine == 'llama' else bits}-{share}%"
                    if name in notes:
                        continue
                    print(f"limited {name}: SIZE {size / 2**30:.2f} GiB ({round_ + 1}/{args.repeats}) ...",
                          file=sys.stderr)
                    with Balloon(size) as balloon:
                        r = _run(args, spec, check=False)
                        killed = not balloon.alive
                    if killed or r is None:  # the kernel's OOM killer takes the largest process: the balloon
                        notes[name] = (f"did not fit SIZE {size / 2**30:.2f} GiB: "
                                       + ("the balloon was killed (out of memory)" if killed else "the run failed")
                                       + "; not a memory-limited measurement, no figure")
                        runs.pop(name, None)
                        continue
                    r["size_bytes"] = size
                    # the model once, against which a cold run's reads since its start are held
                    r["model_bytes"] = total if engine != "llama" else os.path.getsize(spec["path"])
                    runs.setdefault(name, []).append(r)
    out = _medians(runs)
    out["notes"] = notes
    if disk:
        out["disk"] = disk
    return out


def _medians(runs: dict[str, list[dict]]) -> dict:
    """Per configuration, the run with the median decode speed, and every run's speed."""
    out = {}
    for name, rs in runs.items():
        r = dict(sorted(rs, key=lambda r: r["decode_tok_s"])[len(rs) // 2])
        r["decode_tok_s_runs"] = [x["decode_tok_s"] for x in rs]
        ttfts = sorted(x["ttft_s"] for x in rs if "ttft_s" in x)
        if ttfts:  # the prompt's evaluation: its own median
            r["ttft_s"], r["ttft_s_runs"] = ttfts[len(ttfts) // 2], [x.get("ttft_s") for x in rs]
        out[name] = r
    return out


def _agreement(a: list[int], b: list[int]) -> int:
    """Greedy tokens in common before the first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ratios(part: str, what: str, who: str, ours: dict | None, peer: dict | None, gguf: str) -> None:
    """The lines setting `ours` (a run of `who`: ours on the bench's flags, or `default`: no budget
    flag) beside llama.cpp's run `peer`: decode speed and the prompt's, warm and, where timed, cold."""
    if not (ours and peer):
        return
    for when, a, b in (("", ours, peer), (" cold", ours.get("first"), peer.get("first"))):
        if not (a and b):
            continue
        print(f"{part:8} {what}{when}: {who} / llama.cpp {gguf} = {a['decode_tok_s'] / b['decode_tok_s']:.2f}x tok/s")
        if a.get("ttft_s") and b.get("ttft_s"):
            print(f"{part:8} {what}{when}: time to the first token after the prompt, {who} {a['ttft_s']:.2f} s, "
                  f"llama.cpp {b['ttft_s']:.2f} s: {who} / llama.cpp = {b['ttft_s'] / a['ttft_s']:.2f}x prompt tok/s")


def first_differences(args, res: dict) -> dict:
    """For each GGUF file both engines ran where their greedy tokens part: llama.cpp's own logits at that
    position (the prompt and its tokens so far, read at once), its two best apart, and semoe's pick's logit
    less that of llama.cpp's decoding's pick (positive: llama.cpp read at once prefers semoe's)."""
    import llama_peer as peer

    out = {}
    prompt = prompt_ids(args.prompt_tokens)
    for g in GGUF_BITS:
        ours, theirs = res.get(f"ours-{g}"), res.get(f"llama-{g}")
        if not (ours and theirs):
            continue
        n = _agreement(ours["tokens"], theirs["tokens"])
        if n == min(len(ours["tokens"]), len(theirs["tokens"])):
            continue
        row = peer.logits(os.path.join(args.workdir, f"llama-{g}.gguf"), prompt + theirs["tokens"][:n])[-1]
        top = sorted(row.tolist(), reverse=True)
        out[g] = {"at": n, "llama_top2_gap": top[0] - top[1],
                  "semoe_pick_minus_llama_pick": float(row[ours["tokens"][n]] - row[theirs["tokens"][n]])}
    return out


def report(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=1))
        return
    for part in ("resident", "limited"):
        rows = dict(result.get(part, {}))
        disk = rows.pop("disk", None)
        if disk:
            print(f"{part:8} the disk in this run (`semoe store bench --cold`, {disk['bytes'] / 2**30:.2f} GiB of "
                  f"expert chunks): plain read {disk['raw_gbps']:.2f} GB/s, "
                  f"O_DIRECT {disk['raw_direct_gbps'] or 0:.2f}, "
                  f"the store's hot path {disk['store_gbps']:.2f}")
        for name, why in rows.pop("notes", {}).items():
            print(f"{part:8} {name:18} {why}")
        for name, r in rows.items():
            line = (f"{part:8} {name:18} {r['decode_tok_s']:7.2f} tok/s (runs "
                    f"{', '.join(f'{x:.2f}' for x in r['decode_tok_s_runs'])}) | read "
                    f"{r['read_bytes_per_token'] / 2**20:8.2f} MiB/tok | peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
            if part == "limited":  # what the reads take: against the disk's rate, read-bound or not
                line += f" | reads {r['read_bytes_per_token'] * r['decode_tok_s'] / 1e9:.2f} GB/s"
                if "read_wait_share" in r:  # the lean runner reads on the decoding thread: its wait is the read's
                    line += f", waiting on them {r['read_wait_share']:.0%} of the time"
                if r.get("read_gbps_waiting") and disk:
                    line += (f", at {r['read_gbps_waiting']:.2f} GB/s while waiting "
                             f"({r['read_gbps_waiting'] / disk['disk_gbps']:.2f}x the disk's faster plain read)")
            if "routing_entropy" in r:
                line += f" | routing entropy {r['routing_entropy']:.3f} (least over layers)"
            if r.get("prompt_used_expert_bytes"):
                line += (f" | the prompt read {r['prompt_read_bytes'] / 2**20:.0f} MiB, its experts "
                         f"{r['prompt_expert_read_bytes'] / r['prompt_used_expert_bytes']:.2f}x the bytes of those "
                         f"it chose")
            if part == "limited" and r.get("cpu_cache_bytes"):
                line += (f" | CPU cache {r['cpu_cache_start_bytes'] / 2**30:.3f} GiB at the start, "
                         f"{r['cpu_cache_bytes'] / 2**30:.3f} at the end | of the reads, experts "
                         f"{r['expert_read_bytes_per_token'] / 2**20:.2f} MiB/tok | major faults "
                         f"{r['major_faults_per_token']:.1f}/tok")
            print(line)
            cold = r.get("first")
            if cold:  # the process's first generation: the page cache dropped before it, nothing warm
                line = (f"{part:8} {name + ' cold':18} {cold['decode_tok_s']:7.2f} tok/s | read "
                        f"{cold['read_bytes_per_token'] / 2**20:8.2f} MiB/tok | time to the first token "
                        f"{cold['ttft_s']:.2f} s")
                if cold.get("process_read_bytes") and r.get("model_bytes"):
                    line += (f" | read {cold['process_read_bytes'] / 2**30:.3f} GiB from its start to its last token, "
                             f"{cold['process_read_bytes'] / r['model_bytes']:.3f}x the model's "
                             f"{r['model_bytes'] / 2**30:.3f} GiB")
                print(line)
        shares = sorted({n.rsplit("-", 1)[1] for n in rows if n.endswith("%")}, key=lambda x: -int(x[:-1]))
        for bits, _, gguf in PAIRS:
            for suffix in [""] if part == "resident" else [f"-{s}" for s in shares]:
                for who in ("ours", "default"):
                    _ratios(part, f"{bits}{suffix}", who, rows.get(f"{who}-{bits}{suffix}"),
                            rows.get(f"llama-{gguf}{suffix}"), gguf)
    res = result.get("resident", {})
    for g in GGUF_BITS:  # the same file in both engines
        if f"ours-{g}" in res and f"llama-{g}" in res:
            a, b = res[f"ours-{g}"]["tokens"], res[f"llama-{g}"]["tokens"]
            line = f"greedy tokens on llama-{g}.gguf, semoe against llama.cpp: the first {_agreement(a, b)} of " \
                f"{len(a)} identical"
            d = result.get("first_differences", {}).get(g)
            if d:
                line += (f"; there, in llama.cpp's logits with the prompt and tokens read at once, its two best are "
                         f"{d['llama_top2_gap']:.2e} apart and semoe's pick scores {d['semoe_pick_minus_llama_pick']:+.2e} "
                         f"against the pick of its decoding")
            print(line)
    if "ours-f32" in res and "llama-f32" in res:
        n = _agreement(res["ours-f32"]["tokens"], res["llama-f32"]["tokens"])
        print(f"greedy tokens at f32: the first {n} of {len(res['ours-f32']['tokens'])} identical")
    ref = res.get("transformers-f32")
    for name in ("ours-f32", "llama-f32") if ref else ():
        if name in res:
            toks = res[name]["tokens"]
            n = _agreement(toks, ref["tokens"])
            line = f"greedy tokens at f32, {name} against transformers: the first {n} of {len(toks)} identical"
            if n < len(toks):
                line += (f"; at token {n} transformers' two best logits are {ref['logit_gaps'][n]:.2e} apart "
                         f"(its smallest gap before: {min(ref['logit_gaps'][:n], default=float('nan')):.2e})")
            print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="bench_quant's --workdir (checkpoint, stores, GGUF files)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="resident,limited")
    ap.add_argument("--memory", default="50,25", help="SIZE as percentages of the model's bytes")
    ap.add_argument("--margin", type=int, default=MARGIN_MIB, metavar="MIB",
                    help="MiB of SIZE left for the code our process runs (its file-backed pages), beside its own "
                         "memory and its CPU cache (default %(default)s)")
    ap.add_argument("--cpu-cache-auto", action="store_true",
                    help="run our engine with --cpu-cache auto (its own sizing from MemAvailable) instead")
    ap.add_argument("--lean", action="store_true",
                    help="in the memory-limited part, run our torch-free decoder (`semoe generate --lean`, "
                         "inference/torch_free/runner.py) instead of the engine: its process holds no torch runtime")
    ap.add_argument("--defaults", action="store_true",
                    help="in the memory-limited part, also run `semoe generate` as a user would, with no budget "
                         "flag: its own choice of engine and cache from the memory it finds (default-BITS-SIZE)")
    ap.add_argument("--cold", action="store_true",
                    help="in the memory-limited part, time each process's first generation in full too (the page "
                         "cache dropped before the process: both engines cold), beside its second (warm)")
    ap.add_argument("--resident-bits", default="f32,int8,int4", help="precisions of the resident runs")
    ap.add_argument("--limited-bits", default="f32,int8,int4", help="precisions of the memory-limited runs")
    ap.add_argument("--experts", type=int, default=None,
                    help="make WORKDIR's checkpoint first (when missing): the bench model's shape with this many "
                         "experts a layer, in bfloat16, with its int8/int4 stores and llama.cpp's q8_0/q4_0; "
                         "int8 and int4 only")
    ap.add_argument("--arch", choices=sorted(ARCH_SHAPES),
                    help="make WORKDIR's checkpoint first (when missing): a 3 GB-class float32 checkpoint of this "
                         "architecture, its stores and llama.cpp's conversions; transformers' greedy tokens join "
                         "the resident part")
    ap.add_argument("--shape", default="",
                    help="with --arch: the checkpoint's shape changed from ARCH_SHAPES', as NAME=N,... with NAME one "
                         f"of {', '.join(SHAPE_FIELDS)} (e.g. hidden=2048,head_dim=64,experts=128,top_k=8,"
                         "expert_width=256); a sweep is one WORKDIR a shape")
    ap.add_argument("--dense", default="auto", choices=("auto", "float", "int8"),
                    help="our dense linear weights (`semoe generate --dense`): auto keeps a checkpoint's own "
                         "FP8 model's as stored (bfloat16) and makes them int8 beside int8, int4 or MXFP4 experts")
    ap.add_argument("--kv-cache", default="f32", choices=("f32", "f16"),
                    help="the KV cache of our torch-free runner in the memory-limited part (`semoe generate "
                         "--kv-cache`); the default run (--defaults) keeps the command's default, auto")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", help=argparse.SUPPRESS)
    ap.add_argument("--prepare-wide", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prepare-arch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only:
        child(args)
        return 0
    if args.prepare_wide:
        prepare_wide(args.workdir, args.prepare_wide)
        return 0
    try:
        shape = parse_shape(args.shape)
    except ValueError as e:
        ap.error(str(e))
    if shape and args.arch is None and args.prepare_arch is None:
        ap.error("--shape changes an --arch checkpoint's shape: give --arch too")
    bits = {b for part, flag in (("resident", args.resident_bits), ("limited", args.limited_bits))
            if part in args.parts.split(",") for b in flag.split(",")}
    if args.prepare_arch:
        prepare_arch(args.workdir, args.prepare_arch, shape, tuple(sorted(bits)))
        return 0
    if args.arch is not None:
        if args.experts is not None:
            raise SystemExit("--arch and --experts each make WORKDIR's checkpoint: give one")
        os.makedirs(args.workdir, exist_ok=True)
        # in a process of its own: making the checkpoint imports torch, which this one must not; the
        # precisions measured go with it (the stores and GGUF files of no other are made)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--workdir", args.workdir, "--prepare-arch",
                        args.arch, "--shape", args.shape, "--parts", args.parts, "--resident-bits",
                        args.resident_bits, "--limited-bits", args.limited_bits], check=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
    if args.experts is not None:
        if "f32" in bits:
            raise SystemExit("--experts makes a bfloat16 checkpoint: measure int8 and int4 there "
                             "(--resident-bits int8,int4 --limited-bits int8,int4)")
        os.makedirs(args.workdir, exist_ok=True)
        # in a process of its own: making the checkpoint imports torch, which this one must not
        subprocess.run([sys.executable, os.path.abspath(__file__), "--workdir", args.workdir, "--prepare-wide",
                        str(args.experts)], check=True, env={**os.environ, "PYTHONPATH": ROOT})
    missing = [p for b, _, g in PAIRS if b in bits for p in [os.path.join(args.workdir, f"llama-{g}.gguf")]
               if not os.path.exists(p)]
    if missing:
        raise SystemExit(f"{missing[0]} is missing: run bench_quant.py --workdir {args.workdir} first (its peer part)")
    result = {}
    parts = args.parts.split(",")
    if "resident" in parts:
        result["resident"] = resident(args)
        result["first_differences"] = first_differences(args, result["resident"])
    if "limited" in parts:
        result["limited"] = limited(args)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
