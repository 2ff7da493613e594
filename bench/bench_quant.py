"""Compact experts side by side in one run: float32, bfloat16, int8 and int4 stores of one checkpoint.

On the 3 GB Mixtral-shaped float32 checkpoint of bench_offload.py (made once in --workdir), with
each store made once beside it (`store import --dtype bfloat16`, `store quantize --bits 8|4`):

    decode    tok/s and SSD bytes per token, each configuration in its own process with the store
              dropped from the page cache first: every store with its CPU cache at 100% and at 25%
              of its own expert bytes, and the compact ones at the float32 store's 25% in bytes
              (the same memory holds more experts); prompt excluded, median of --repeats. Every
              run decodes the same fixed token stream, teacher-forced, so that every store reads
              the experts of the same tokens (generated tokens would differ between stores, and
              with them the experts read)
    quality   on the same token ids (a fixed pseudo-random stream: this model has random weights
              and no tokenizer), the mean KL divergence of each store's next-token distribution
              from float32's and the share of positions whose top token agrees
    trained   a gpt-moe-small model trained here (`semoe train`, --train-steps) and its int8/int4
              quantizations: perplexity on the embedded corpus's validation split, with an
              "experts zeroed" row that shows the measure sees a loss
    llama.cpp the same checkpoint converted by llama.cpp's own converter to f32 and q8_0, and
              quantized by its llama-quantize to q4_0, in the peer's own environment
              (bench/llama_peer.py; built once, about 12 minutes): the KL divergence of q8_0 and
              q4_0 from its f32 on the same windows of the same token ids (--no-peer skips it)

    python bench/bench_quant.py --workdir /path/with/8GB/free [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

from bench_offload import drop_cache, make_checkpoint, prompt_ids  # noqa: E402

STORES = ("f32", "bf16", "int8", "int4")
GROUP_SIZE = 128
EVAL_WINDOWS, EVAL_SEQ = 2, 256  # quality on the 3 GB model: 2 windows of 256 tokens


def make_stores(workdir: str) -> dict[str, str]:
    """The four stores of the bench checkpoint (each made once)."""
    from semoe.checkpoints.hf_convert import import_checkpoint
    from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store

    hf, f32 = make_checkpoint(workdir)
    paths = {"f32": f32, **{k: os.path.join(workdir, f"store-{k}") for k in STORES[1:]}}
    if not os.path.exists(os.path.join(paths["bf16"], "manifest.json")):
        print("importing a bfloat16 store ...", file=sys.stderr)
        import_checkpoint(hf, paths["bf16"], dtype="bfloat16")
    for name, bits in (("int8", 8), ("int4", 4)):
        if not os.path.exists(os.path.join(paths[name], "manifest.json")):
            print(f"quantizing to {name} ...", file=sys.stderr)
            quantize_store(f32, paths[name], QuantizeConfig(bits=bits, group_size=GROUP_SIZE))
    return paths


def expert_bytes(store: str) -> int:
    from storage.reader import StoreReader

    return StoreReader.open(store).manifest.expert_bytes()


# -- one decode run (in its own process) -------------------------------------------------------


def run_decode(store: str, budget: int, ids: list[int], prompt_tokens: int, dtype: str) -> dict:
    """Decode the fixed token stream `ids` (teacher-forced after `prompt_tokens`, so every store reads
    the experts of the same tokens) with the CPU cache at `budget` bytes, store cold. Time and SSD
    bytes are counted from the first decoded token on, as in bench_offload (the prompt's reads are
    part of TTFT); `argmax` are the model's own next-token choices."""
    import torch

    from inference.engine import Engine
    from inference.engine_config import EngineConfig
    from semoe.decode.generate import decode_one_token, prefill
    from semoe.model.attention import KVCache
    from storage.process_memory import peak_rss_bytes

    drop_cache(store)
    engine = Engine.load(store, EngineConfig(dtype=dtype, cpu_cache_bytes=budget, read_mode="direct"))
    try:
        model, offload = engine.model, engine.offload
        offload.begin_request()
        cache = KVCache.empty(model.config, 1, len(ids), device="cpu", dtype=model.embed.weight.dtype)
        t0 = time.perf_counter()
        with torch.no_grad():
            argmax = [int(prefill(model, torch.tensor([ids[:prompt_tokens]]), cache).argmax())]
            ttft = time.perf_counter() - t0
            ssd0, _ = offload.traffic()
            t1 = time.perf_counter()
            for t in ids[prompt_tokens:-1]:
                argmax.append(int(decode_one_token(model, torch.tensor([[t]]), cache).argmax()))
            t2 = time.perf_counter()
        ssd1, _ = offload.traffic()
        steps = len(ids) - 1 - prompt_tokens
        stats = offload.request_stats(tokens=len(ids))
        return {"argmax": argmax, "decode_tok_s": steps / (t2 - t1), "ttft_s": ttft,
                "decode_ssd_bytes_per_token": (ssd1 - ssd0) / steps, "cpu_hit_rate": stats["cpu_hit_rate"],
                "peak_rss_bytes": peak_rss_bytes()}
    finally:
        engine.close()


# The compute dtype of each store: bfloat16 experts are used in place in bfloat16 (computing them in
# float32 would cast every expert on every use); int8/int4 kernels take bfloat16 activations whatever
# the model's dtype, the rest of the model stays float32.
COMPUTE_DTYPE = {"f32": "float32", "bf16": "bfloat16", "int8": "float32", "int4": "float32"}


def decode_configs(paths: dict[str, str]) -> dict[str, tuple[str, int]]:
    """name -> (store, CPU cache bytes)."""
    sizes = {k: expert_bytes(p) for k, p in paths.items()}
    biggest = {k: _biggest(p) for k, p in paths.items()}
    out = {}
    for k in STORES:
        out[f"{k}-100"] = (paths[k], sizes[k] + biggest[k])
        out[f"{k}-25"] = (paths[k], sizes[k] // 4)
        if k != "f32":
            out[f"{k}-at-f32-25"] = (paths[k], sizes["f32"] // 4)
    return out


def _biggest(store: str) -> int:
    from storage.store import Store

    return max(c.bytes for c in Store.open(store).manifest.chunks if c.kind == "weight")


# -- quality ------------------------------------------------------------------------------------


def eval_ids(vocab: int) -> list[int]:
    """The token stream both engines score: fixed pseudo-random ids (the bench model has no tokenizer)."""
    import random

    rng = random.Random(1)
    return [rng.randrange(3, vocab) for _ in range(EVAL_WINDOWS * EVAL_SEQ + 1)]


def quality(paths: dict[str, str]) -> dict:
    """KL divergence from float32 and top-token agreement of each store, resident, on eval_ids."""
    import torch

    from semoe.checkpoints.model_io import load_store
    from semoe.evaluation.perplexity import EvalConfig, evaluate, model_logits

    ref = load_store(paths["f32"])
    ids = eval_ids(ref.config.vocab_size)
    cfg = EvalConfig(seq_len=EVAL_SEQ, max_tokens=EVAL_WINDOWS * EVAL_SEQ)
    # the reference's logits once, then each store against them
    ref_logits = [model_logits(ref)(torch.tensor([ids[s:s + EVAL_SEQ]]))
                  for s in range(0, EVAL_WINDOWS * EVAL_SEQ, EVAL_SEQ)]
    del ref
    cached = iter(ref_logits * len(STORES))
    out = {}
    for k in STORES[1:]:
        model = load_store(paths[k])
        r = evaluate(ids, model_logits(model), config=cfg, reference_fn=lambda _ids: next(cached))
        out[k] = {"kl_divergence": r.kl_divergence, "top_token_agreement": r.top_token_agreement,
                  "mean_nll": r.mean_nll}
        del model
    return out


def trained_perplexity(workdir: str, steps: int) -> dict:
    """Perplexity of a model trained here and of its quantizations, with an experts-zeroed floor."""
    from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store

    run = os.path.join(workdir, f"trained-{steps}")
    store = os.path.join(run, "store")
    if not os.path.exists(os.path.join(run, "done")):
        print(f"training gpt-moe-small for {steps} steps ...", file=sys.stderr)
        _semoe("train", "--out", run, "--steps", str(steps), "--checkpoint-every", str(steps), "-q")
        open(os.path.join(run, "done"), "w").close()
    variants = {"f32": store}
    for name, bits, g in (("int8", 8, GROUP_SIZE), ("int4", 4, GROUP_SIZE), ("int4-g32", 4, 32)):
        path = os.path.join(run, f"store-{name}")
        if not os.path.exists(os.path.join(path, "manifest.json")):
            quantize_store(store, path, QuantizeConfig(bits=bits, group_size=g))
        variants[name] = path
    zeroed = os.path.join(run, "store-experts-zeroed")
    if not os.path.exists(os.path.join(zeroed, "manifest.json")):
        _zero_experts(store, zeroed)
    variants["experts-zeroed"] = zeroed
    out = {}
    for name, path in variants.items():
        res = _semoe("eval", "--model", path, "--reference", store, "--max-tokens", "8192", "--seq-len", "256",
                     "--json")
        out[name] = json.loads(res.stdout)
    base = out["f32"]["perplexity"]
    for r in out.values():
        r["perplexity_vs_f32"] = r["perplexity"] / base - 1
    return out


def _zero_experts(src: str, dst: str) -> None:
    """A copy of `src` whose routed experts' weights are all zero (the dense part as it is)."""
    from storage.store import ExpertTensor, Store, iter_expert_chunks

    source = Store.open(src)
    m = source.manifest
    out = Store.create(dst)
    with out.writer() as w:
        for f in m.files:
            w.put_file(f.name, source.read_file(f.name))
        for t in m.dense():
            w.put_dense(t.name, source.read_tensor(t.name))
        layers = m.expert_layers()
        for c in iter_expert_chunks(m):
            views = source.read_expert(c.layer, c.expert)
            tensors = [ExpertTensor(name=e.name, tensor=views[e.name] * 0, stacked=e.stacked)
                       for e in m.chunk_tensors(c)]
            w.put_expert(c.layer, c.expert, tensors, num_experts=layers[c.layer])
        w.set_model(m.model)
        w.commit()


def _semoe(*args: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    if res.returncode != 0:
        print(res.stderr, file=sys.stderr)
        raise SystemExit(f"semoe {' '.join(args)} failed")
    return res


# -- llama.cpp ------------------------------------------------------------------------------------


def peer_quality(workdir: str, env_dir: str | None) -> dict:
    """llama.cpp's own quantizations of the same checkpoint: KL of q8_0 and q4_0 from its f32."""
    import numpy as np

    import llama_peer as peer
    from bench_offload import SHAPE

    hf = os.path.join(workdir, "hf")
    env = peer.ensure_env(env_dir)
    if not os.path.exists(os.path.join(hf, "tokenizer.json")):
        peer.add_tokenizer(hf)
    ggufs = {t: os.path.join(workdir, f"llama-{t}.gguf") for t in ("f32", "q8_0", "q4_0")}
    if not os.path.exists(ggufs["f32"]):
        peer.convert(hf, ggufs["f32"], "f32", env=env)
    for t in ("q8_0", "q4_0"):
        if not os.path.exists(ggufs[t]):
            peer.quantize(ggufs["f32"], ggufs[t], t, env=env)
    ids = eval_ids(SHAPE["vocab_size"])
    windows = [ids[s:s + EVAL_SEQ] for s in range(0, EVAL_WINDOWS * EVAL_SEQ, EVAL_SEQ)]
    # float32 KV cache: the quantization of the weights alone, as on our side (llama.cpp's default f16
    # cache would add its own rounding to both sides)
    logits = {t: [peer.logits(g, w, kv_type="f32", env=env) for w in windows] for t, g in ggufs.items()}
    out = {"version": env.version}
    for t in ("q8_0", "q4_0"):
        stats = [peer.kl_stats(a, b) for a, b in zip(logits["f32"], logits[t])]
        out[t] = {"kl_divergence": float(np.mean([s["kl_divergence"] for s in stats])),
                  "top_token_agreement": float(np.mean([s["top_token_agreement"] for s in stats]))}
    return out


# -- the run -------------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    spec = json.loads(args.only)
    ids = prompt_ids(args.prompt_tokens + args.new_tokens)
    print(json.dumps(run_decode(spec["store"], spec["budget"], ids, args.prompt_tokens, spec["dtype"])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="where the checkpoint and its stores live (about 8 GB)")
    ap.add_argument("--new-tokens", type=int, default=64, help="decoded (teacher-forced) tokens per run")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1, help="decode runs per configuration, in rounds (median)")
    ap.add_argument("--train-steps", type=int, default=300, help="steps of the model trained for perplexity")
    ap.add_argument("--parts", default="decode,quality,trained,peer", help="which parts to run")
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    ap.add_argument("--peer-env", default=None, help="llama.cpp's environment (default: llama_peer's)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only:
        child(args)
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    paths = make_stores(args.workdir)
    parts = set(args.parts.split(","))
    result: dict = {"sizes": {k: expert_bytes(p) for k, p in paths.items()}}
    if "decode" in parts:
        result["decode"] = decode(args, paths)
    if "quality" in parts:
        print("quality against float32 ...", file=sys.stderr)
        result["quality"] = quality(paths)
    if "trained" in parts:
        result["trained"] = trained_perplexity(args.workdir, args.train_steps)
    if "peer" in parts and not args.no_peer:
        print("llama.cpp's quantizations ...", file=sys.stderr)
        result["llama.cpp"] = peer_quality(args.workdir, args.peer_env)
    report(result, args.json)
    return 0


def decode(args: argparse.Namespace, paths: dict[str, str]) -> dict:
    configs = decode_configs(paths)
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.repeats):
        for name, (store, budget) in configs.items():
            print(f"decode {name} ({round_ + 1}/{args.repeats}) ...", file=sys.stderr)
            os.sync()
            cmd = [sys.executable, os.path.abspath(__file__), "--workdir", args.workdir, "--only",
                   json.dumps({"store": store, "budget": budget, "dtype": COMPUTE_DTYPE[name.split("-")[0]]}),
                   "--new-tokens", str(args.new_tokens),
                   "--prompt-tokens", str(args.prompt_tokens)]
            t0 = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
            if res.returncode != 0:
                print(res.stderr, file=sys.stderr)
                raise SystemExit(f"decode {name} failed")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            r["wall_s"] = time.perf_counter() - t0
            runs.setdefault(name, []).append(r)
    med = {name: sorted(rs, key=lambda r: r["decode_tok_s"])[len(rs) // 2] for name, rs in runs.items()}
    for name, r in med.items():
        r["decode_tok_s_runs"] = [x["decode_tok_s"] for x in runs[name]]
    return med


def _f32_twin(name: str) -> str:
    """The float32 run a decode configuration compares with: the same cache share, or f32-25 for
    the float32 store's 25% in bytes."""
    share = name.split("-", 1)[1]
    return "f32-25" if share == "at-f32-25" else f"f32-{share}"


def report(result: dict, as_json: bool) -> None:
    dec = result.get("decode", {})
    summary: dict = {"expert_bytes": result["sizes"]}
    if dec:
        f25 = dec["f32-25"]
        rows = {}
        for name, r in dec.items():
            twin = dec[_f32_twin(name)]
            rows[name] = {"decode_tok_s": r["decode_tok_s"], "runs": r["decode_tok_s_runs"],
                          "decode_ssd_mib_per_token": r["decode_ssd_bytes_per_token"] / 2**20,
                          "cpu_hit_rate": r["cpu_hit_rate"], "peak_rss_gib": r["peak_rss_bytes"] / 2**30,
                          "tok_s_vs_f32": r["decode_tok_s"] / twin["decode_tok_s"],
                          "ssd_bytes_vs_f32_25": (r["decode_ssd_bytes_per_token"] / f25["decode_ssd_bytes_per_token"]
                                                  if f25["decode_ssd_bytes_per_token"] else None),
                          # positions where the model's own next-token choice is float32's (same inputs)
                          "argmax_agreement_with_f32": sum(a == b for a, b in zip(r["argmax"], twin["argmax"]))
                          / len(r["argmax"])}
        summary["decode"] = rows
    for key in ("quality", "trained", "llama.cpp"):
        if key in result:
            summary[key] = result[key]
    if as_json:
        print(json.dumps(summary, indent=1))
        return
    gib = {k: v / 2**30 for k, v in result["sizes"].items()}
    print("expert bytes: " + ", ".join(f"{k} {v:.2f} GiB ({v / gib['f32']:.3f}x)" for k, v in gib.items()))
    for name, row in summary.get("decode", {}).items():
        print(f"{name:15} decode {row['decode_tok_s']:6.2f} tok/s ({row['tok_s_vs_f32']:.2f}x f32 at the same share) "
              f"| SSD {row['decode_ssd_mib_per_token']:7.2f} MiB/tok"
              + (f" ({row['ssd_bytes_vs_f32_25']:.3f}x f32-25)" if row["ssd_bytes_vs_f32_25"] is not None else "")
              + f" | CPU hit {row['cpu_hit_rate']:.2f} | peak RSS {row['peak_rss_gib']:.2f} GiB"
              + f" | argmax = f32's {100 * row['argmax_agreement_with_f32']:.0f}%"
              + f" | runs {', '.join(f'{x:.2f}' for x in row['runs'])}")
    for name, q in summary.get("quality", {}).items():
        print(f"quality {name:5} vs f32: KL {q['kl_divergence']:.3e} nats/token, top-token agreement "
              f"{100 * q['top_token_agreement']:.2f}%")
    for name, q in summary.get("llama.cpp", {}).items():
        if isinstance(q, dict):
            print(f"llama.cpp {name:5} vs its f32: KL {q['kl_divergence']:.3e} nats/token, top-token agreement "
                  f"{100 * q['top_token_agreement']:.2f}%")
    for name, r in summary.get("trained", {}).items():
        print(f"trained {name:15} perplexity {r['perplexity']:9.4f} ({100 * r['perplexity_vs_f32']:+.3f}% vs f32) "
              f"KL {r['kl_divergence']:.3e} agreement {100 * r['top_token_agreement']:.2f}% ({r['tokens']} tokens)")


if __name__ == "__main__":
    sys.exit(main())
