"""The GPU check: hybrid decode and prefill against both of its ends and its bound, in one table.

    python bench/bench_hybrid.py --workdir DIR                 # on a machine with a GPU
    python bench/bench_hybrid.py --workdir DIR --dry-run       # on CPU: the same steps, small shapes

On one machine with a GPU (`inference.offload.hybrid`), for each model of make_real.py (gpt-oss-20b
with its MXFP4 experts as shipped; Qwen3-30B-A3B with int4 experts, `store quantize --bits 4`) at
`--layers`, and each device-memory cap (`--caps`, GiB: the dense weights, the KV cache and the device's
cache of experts together):

- decode (`--new-tokens` greedy tokens after a 32-token prompt) and prefill (`--prompts`: the time to
  the first token of prompts of 512 and 4096 tokens) with experts_on=hybrid, against
  (a) every routed expert on the CPU (experts_on=cpu) and (b) every routed expert streamed to the
  device through its ring (experts_on=device, SE-MoE's design);
- (c) the bound of the hybrid's own run: max(the device's part, the bytes the CPU's kernels read ÷ their
  rate, the bytes copied ÷ the link's rate), each rate measured at load (`measure_rates`), the
  device's part being the dense weights and its cached experts read at its rate;
- (d) transformers with accelerate's device-map offload at the same cap, the floor, where accelerate
  is installed (it is not a dependency of semoe; the row says so where it is missing).

Then the `cuda` tests (`pytest -m cuda`), and the training step with expert states on SSD against
states in device memory (bench_train.py's comparison at a mid-size shape; its own table). The CPU side
of the hybrid gets every expert of the model in its cache (`--cpu-cache`, default all): the machine
this measures has a big CPU memory beside a small GPU.

(e) llama.cpp with `--n-cpu-moe` (the peer users pick on such a machine) at the same cap: built from
`--llama-src` (a llama.cpp source tree, such as llama_peer.py's sdist's vendor/llama.cpp, carried to the
machine, which has no network) with CUDA for `--cuda-arch` (90: H100/H200) only, within
`--llama-build-timeout` (the row says how long the build took, or that it did not finish); its GGUF
made by the tree's own converter (llama_peer's patched copy) and llama-quantize (q4_0 for Qwen3,
gpt-oss's MXFP4 as converted); `--n-cpu-moe` is the layers whose experts do not fit the cap's room.

`--dry-run` runs every step on CPU (the engine's device "cpu", whose copy stream is a worker thread)
with make_real's configs shrunk to a few MiB, and skips what needs a GPU (the cuda tests, accelerate):
so that a GPU's first run of this script is not its first run. Nothing is timed there that means
anything. The CPU's kernels take `--threads` threads (default: all cores but one, which queues the
device's work).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

MODELS = ("gpt-oss-20b", "qwen3-30b-a3b")
# make_real's configs shrunk for --dry-run: the same parts, a few MiB
DRY_SHAPES = {
    "gpt-oss-20b": dict(hidden_size=128, intermediate_size=128, num_local_experts=8, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, vocab_size=512),
    "qwen3-30b-a3b": dict(hidden_size=128, moe_intermediate_size=64, num_experts=16, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=512, intermediate_size=256),
}
MODES = ("hybrid", "cpu", "device")
CAPS, PROMPTS = (4, 8, 16), (512, 4096)  # device memory caps (GiB), prompt lengths of the prefill part
DRY_CAPS, DRY_PROMPTS = (0.25, 0.5, 1.0), (16, 64)  # --dry-run: the device cache as a share of the expert bytes
GROUP_SIZE = 64  # int4 groups of the Qwen3 store


def prepare(model: str, workdir: str, layers: int, dry: bool) -> str:
    """The store measured for `model` (made once in WORKDIR): make_real's checkpoint imported, Qwen3's
    experts quantized to int4."""
    import make_real
    from semoe.checkpoints.hf_convert import import_checkpoint
    from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store

    hf, store = os.path.join(workdir, f"{model}-hf"), os.path.join(workdir, f"{model}-store")
    if not os.path.exists(hf):
        print(f"making {model} with {layers} layers ...", file=sys.stderr, flush=True)
        make_real.write(model, hf, layers, overrides=DRY_SHAPES[model] if dry else None, progress=not dry)
    if not os.path.exists(os.path.join(store, "manifest.json")):
        print(f"importing {model} ...", file=sys.stderr, flush=True)
        import_checkpoint(hf, store)
    if model.startswith("qwen3"):
        q = store + "-int4"
        if not os.path.exists(os.path.join(q, "manifest.json")):
            print(f"quantizing {model} to int4 ...", file=sys.stderr, flush=True)
            quantize_store(store, q, QuantizeConfig(bits=4, group_size=GROUP_SIZE))
        store = q
    return store


def device_cache_bytes(store: str, cap_gib: float, device: str, dry: bool) -> int | None:
    """The device's cache of experts within a cap: the cap less the dense weights (as the device holds
    them) and a reserve for activations and KV caches (1 GiB); None where nothing is left. --dry-run:
    the cap is a share of the expert bytes."""
    from storage.store import Store

    s = Store.open(store)
    experts = sum(c.bytes for c in s.manifest.chunks if c.kind == "weight")
    if dry:
        return max(int(cap_gib * experts), 1)
    from inference.placement import model_bytes

    mb = model_bytes(store, 2)  # bfloat16 on the GPU
    dense = mb.total - mb.experts
    left = int(cap_gib * 2**30) - dense - (1 << 30)
    return left if left > 0 else None


def run_mode(store: str, mode: str, device: str, cache: int, cpu_cache: int | str, prompts: list[int],
             new_tokens: int, threads: int) -> dict:
    """One engine with `mode`'s experts: decode tok/s, prefill tok/s per prompt length, its counters."""
    import torch

    from inference.engine import Engine
    from inference.engine_config import EngineConfig
    from semoe.decode.loop import SamplingConfig

    torch.set_num_threads(threads)
    config = EngineConfig(device=device, cpu_cache_bytes=cpu_cache, device_memory_bytes=cache, experts_on=mode)
    engine = Engine.load(store, config)
    try:
        vocab = engine.model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        ids = lambda n: torch.randint(3, vocab, (n,), generator=gen).tolist()  # noqa: E731
        engine.generate(ids(8), SamplingConfig(max_new_tokens=2))  # warm: kernels, allocator, caches
        res = engine.generate(ids(32), SamplingConfig(max_new_tokens=new_tokens))
        out = {"decode_tok_s": res.decode_tok_s, "stats": res.stats, "path": engine.decode_path()}
        for n in prompts:
            r = engine.generate(ids(n), SamplingConfig(max_new_tokens=1))
            out[f"prefill_{n}_tok_s"] = n / r.ttft_s
        off = engine.offload
        if getattr(off, "rates", None) is not None:
            r = off.rates
            out["rates"] = r.__dict__
            dense = sum(p.numel() * p.element_size() for p in engine.model.parameters())
            h = res.stats["hybrid"]
            parts = {"device": (dense + h["device_hit_bytes_per_token"]) / r.device_bytes_s,
                     "cpu": h["cpu_bytes_per_token"] / r.cpu_bytes_s,
                     "link": res.stats["device_copy_bytes_per_token"] / r.h2d_bytes_s}
            out["bound_tok_s"] = 1.0 / max(parts.values())
            out["bound_parts_s"] = parts
        return out
    finally:
        engine.close()


def run_accelerate(hf: str, cap_gib: float, new_tokens: int) -> dict:
    """(d) transformers with accelerate's device map at the cap: decode tok/s, or why not."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return {"skipped": "accelerate is not installed (not a dependency of semoe)"}
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf, device_map="auto", max_memory={0: f"{cap_gib}GiB", "cpu": "120GiB"}, dtype=torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (1, 32), device=model.device)
    model.generate(ids, max_new_tokens=2, do_sample=False)
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return {"decode_tok_s": new_tokens / (time.perf_counter() - t)}


def build_llama(llama_src: str, workdir: str, arch: str, timeout_s: float) -> dict:
    """(e)'s binaries: llama-bench and llama-quantize built with CUDA for `arch` only, once; the seconds
    the build took, or why there are none."""
    if not os.path.exists(os.path.join(llama_src, "CMakeLists.txt")):
        return {"skipped": f"--llama-src {llama_src}: no llama.cpp source tree there"}
    if shutil.which("nvcc") is None or shutil.which("cmake") is None:
        return {"skipped": "no nvcc or cmake on this machine"}
    build = os.path.join(workdir, f"llama-cuda-sm{arch}")
    bins = {t: os.path.join(build, "bin", t) for t in ("llama-bench", "llama-quantize")}
    if all(os.path.exists(b) for b in bins.values()):
        return {"bins": bins, "build_s": 0.0}
    t0 = time.perf_counter()
    try:
        subprocess.run(["cmake", "-S", llama_src, "-B", build, "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                       check=True, capture_output=True, timeout=timeout_s)
        left = timeout_s - (time.perf_counter() - t0)
        subprocess.run(["cmake", "--build", build, "--target", "llama-bench", "llama-quantize",
                        f"-j{os.cpu_count() or 2}"], check=True, capture_output=True, timeout=max(left, 1))
    except subprocess.TimeoutExpired:
        return {"skipped": f"its CUDA build did not finish in {timeout_s:.0f} s"}
    except subprocess.CalledProcessError as e:
        return {"skipped": f"its CUDA build failed: {(e.stderr or b'').decode(errors='replace').strip()[-300:]}"}
    return {"bins": bins, "build_s": time.perf_counter() - t0}


def run_llama(built: dict, llama_src: str, model: str, workdir: str, store: str, cache: int, prompts: list[int],
              new_tokens: int) -> dict:
    """(e) llama-bench with every layer on the GPU but `--n-cpu-moe` layers' experts, those that do not fit
    the room the cap leaves for experts (`cache` bytes, as semoe's device cache has): decode and prefill
    tok/s, or why not."""
    if "bins" not in built:
        return {"skipped": built["skipped"]}
    import llama_peer as peer
    from storage.store import Store

    hf, gguf = os.path.join(workdir, f"{model}-hf"), os.path.join(workdir, f"{model}-llama.gguf")
    if not os.path.exists(gguf):
        script = peer._patched_converter(llama_src, os.path.join(workdir, "llama-converter"))
        env = dict(os.environ, PYTHONPATH=os.path.join(llama_src, "gguf-py"))
        out = gguf if not model.startswith("qwen3") else gguf + ".bf16"
        subprocess.run([sys.executable, script, hf, "--outfile", out, "--outtype", "bf16"], check=True, env=env,
                       capture_output=True)
        if out != gguf:
            subprocess.run([built["bins"]["llama-quantize"], out, gguf, "q4_0"], check=True, capture_output=True)
    m = Store.open(store).manifest
    layers = sorted({c.layer for c in m.chunks if c.kind == "weight"})
    per_layer = sum(c.bytes for c in m.chunks if c.kind == "weight") / len(layers)
    n_cpu_moe = max(0, min(len(layers), len(layers) - int(cache // per_layer)))
    res = subprocess.run([built["bins"]["llama-bench"], "-m", gguf, "-ngl", "99", "--n-cpu-moe", str(n_cpu_moe),
                          "-p", ",".join(map(str, prompts)), "-n", str(new_tokens), "-r", "2", "-o", "json"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return {"skipped": f"llama-bench failed: {res.stderr.strip()[-300:]}"}
    out = {"n_cpu_moe": n_cpu_moe, "build_s": built["build_s"]}
    for r in json.loads(res.stdout):
        key = "decode_tok_s" if r.get("n_gen") else f"prefill_{r.get('n_prompt')}_tok_s"
        out[key] = r["avg_ts"]
    return out


def cuda_tests() -> dict:
    """`pytest -m cuda`: its last line and exit code."""
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "cuda"], cwd=ROOT,
                         capture_output=True, text=True)
    tail = (res.stdout.strip().splitlines() or [""])[-1]
    return {"rc": res.returncode, "summary": tail, "seconds": time.perf_counter() - t}


def train_step(workdir: str, dry: bool) -> dict:
    """bench_train.py's ssd-vs-device step comparison (a mid-size model; tiny with --dry-run)."""
    shape = ["--layers", "2", "--hidden", "64", "--experts", "4", "--expert-ffn", "64", "--ffn", "128",
             "--batch-size", "2", "--seq-len", "32", "--steps", "3", "--repeats", "1", "--no-small-batch",
             "--warmup-steps-skip", "1", "--cpu-cache", "50%"] if dry else \
        ["--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--experts", "16",
         "--expert-ffn", "2048", "--ffn", "4096", "--batch-size", "8", "--seq-len", "512", "--steps", "6",
         "--repeats", "1", "--no-small-batch"]
    out = os.path.join(workdir, "train")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    res = subprocess.run([sys.executable, os.path.join(BENCH, "bench_train.py"), "--workdir", out, "--json", *shape],
                         cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        return {"rc": res.returncode, "error": (res.stderr.strip().splitlines() or [""])[-1]}
    return {"rc": 0, "result": json.loads(res.stdout)}


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def table(rows: list[dict]) -> str:
    """The one table: per model, cap and part, the hybrid against (a), (b), (c) and (d)."""
    head = ("| model | cap | part | hybrid | (a) all CPU | (b) all streamed | hybrid / best of (a), (b) | "
            "(c) bound | hybrid / (c) | (d) accelerate | (e) llama.cpp --n-cpu-moe | hybrid / (e) |\n" + "|---" * 12 + "|")
    lines = [head]
    for r in rows:
        best = max((r.get("cpu"), r.get("device")), key=lambda v: v or 0)
        lines.append(f"| {r['model']} | {r['cap']} | {r['part']} | {_f(r.get('hybrid'))} | {_f(r.get('cpu'))} | "
                     f"{_f(r.get('device'))} | {ratio(r.get('hybrid'), best)} | {_f(r.get('bound'))} | "
                     f"{ratio(r.get('hybrid'), r.get('bound'))} | {r.get('accelerate', '-')} | "
                     f"{_f(r['llama']) if isinstance(r.get('llama'), float) else r.get('llama', '-')} | "
                     f"{ratio(r.get('hybrid'), r.get('llama')) if isinstance(r.get('llama'), float) else '-'} |")
    return "\n".join(lines)


def _f(v: float | None) -> str:
    return f"{v:.2f}" if v else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workdir", required=True, help="where the checkpoints and stores are made (kept between runs)")
    ap.add_argument("--dry-run", action="store_true", help="on CPU, small shapes: every step, no meaningful time")
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)} [both]")
    ap.add_argument("--layers", type=int, default=None, help="layers of each model [4; --dry-run 2]")
    ap.add_argument("--caps", help="device memory caps in GiB [4,8,16]; --dry-run: shares of the expert bytes for "
                                   "the device's cache [0.25,0.5,1]")
    ap.add_argument("--prompts", help="prompt lengths of the prefill part [512,4096; --dry-run 16,64]")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--cpu-cache", default=None, help="the CPU cache in bytes [every expert]")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="the CPU kernels' threads [all cores but one]")
    ap.add_argument("--parts", default="cuda-tests,decode,accelerate,llama,train",
                    help="of cuda-tests, decode (decode and prefill), accelerate, llama, train [all]")
    ap.add_argument("--llama-src", help="(e): a llama.cpp source tree to build with CUDA [none: (e) skipped]")
    ap.add_argument("--cuda-arch", default="90", help="(e): the CUDA architecture built for [90]")
    ap.add_argument("--llama-build-timeout", type=float, default=240, help="(e): seconds the build may take [240]")
    ap.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if unknown := parts - {"cuda-tests", "decode", "accelerate", "llama", "train"}:
        ap.error(f"--parts: unknown {', '.join(sorted(unknown))}")
    models = args.models.split(",")
    if unknown := set(models) - set(MODELS):
        ap.error(f"--models: unknown {', '.join(sorted(unknown))} (one of {', '.join(MODELS)})")
    import torch

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        ap.error("no GPU on this machine: --dry-run runs the same steps on CPU")
    device = "cpu" if dry else "cuda"
    layers = args.layers or (2 if dry else 4)
    caps = [float(c) for c in args.caps.split(",")] if args.caps else list(DRY_CAPS if dry else CAPS)
    prompts = [int(p) for p in args.prompts.split(",")] if args.prompts else list(DRY_PROMPTS if dry else PROMPTS)
    os.makedirs(args.workdir, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if not dry else "cpu (dry run)", "runs": []}
    rows = []
    if "cuda-tests" in parts:
        report["cuda_tests"] = {"skipped": "dry run: no GPU"} if dry else cuda_tests()
        print(f"cuda tests: {report['cuda_tests']}", file=sys.stderr, flush=True)
    built = {"skipped": "not asked (--parts)"}
    if "llama" in parts:
        built = {"skipped": "dry run: no GPU"} if dry else \
            {"skipped": "--llama-src not given"} if not args.llama_src else \
            build_llama(args.llama_src, args.workdir, args.cuda_arch, args.llama_build_timeout)
        report["llama_build"] = {k: v for k, v in built.items() if k != "bins"}
        print(f"llama.cpp: {report['llama_build']}", file=sys.stderr, flush=True)
    for model in models if parts & {"decode", "accelerate", "llama"} else []:
        store = prepare(model, args.workdir, layers, dry)
        from storage.store import Store

        experts = sum(c.bytes for c in Store.open(store).manifest.chunks if c.kind == "weight")
        cpu_cache = int(args.cpu_cache) if args.cpu_cache else experts + (64 << 20)
        for cap in caps:
            cache = device_cache_bytes(store, cap, device, dry)
            label = f"{cap:g} of the experts" if dry else f"{cap:g} GiB"
            if cache is None:
                rows.append({"model": model, "cap": label, "part": "decode", "accelerate": "the dense part does not fit"})
                continue
            got = {}
            for mode in MODES if "decode" in parts else ():
                print(f"{model}, {label}, experts on {mode} ...", file=sys.stderr, flush=True)
                got[mode] = run_mode(store, mode, device, cache, cpu_cache, prompts, args.new_tokens, args.threads)
                report["runs"].append({"model": model, "cap": cap, "mode": mode, **got[mode]})
            acc = "-"
            if "accelerate" in parts:
                d = {"skipped": "dry run: no GPU"} if dry else \
                    run_accelerate(os.path.join(args.workdir, f"{model}-hf"), cap, args.new_tokens)
                report["runs"].append({"model": model, "cap": cap, "mode": "accelerate", **d})
                acc = _f(d.get("decode_tok_s")) if "decode_tok_s" in d else d["skipped"]
            lcpp = {}
            if "llama" in parts:
                lcpp = run_llama(built, args.llama_src, model, args.workdir, store, cache, prompts, args.new_tokens)
                report["runs"].append({"model": model, "cap": cap, "mode": "llama.cpp", **lcpp})
            skip = lcpp.get("skipped", "-")
            if got:
                rows.append({"model": model, "cap": label, "part": "decode tok/s", "accelerate": acc,
                             "bound": got["hybrid"].get("bound_tok_s"), "llama": lcpp.get("decode_tok_s", skip),
                             **{m: got[m]["decode_tok_s"] for m in MODES}})
                for n in prompts:
                    rows.append({"model": model, "cap": label, "part": f"prefill {n} tok/s",
                                 "llama": lcpp.get(f"prefill_{n}_tok_s", skip),
                                 **{m: got[m][f"prefill_{n}_tok_s"] for m in MODES}})
    if "train" in parts:
        print("training step: expert states on SSD against in device memory ...", file=sys.stderr, flush=True)
        report["train"] = train_step(args.workdir, dry)
    print(table(rows))
    if "train" in report:
        t = report["train"]
        print(f"\ntraining step, states on SSD / in device memory: {json.dumps(t.get('result', t))[:2000]}")
    if "cuda_tests" in report:
        print(f"cuda tests: {report['cuda_tests']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    failed = report.get("cuda_tests", {}).get("rc", 0) or report.get("train", {}).get("rc", 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
