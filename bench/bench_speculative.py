"""Speculative decoding's own gain with memory short: the torch-free runner with and without it on a store.

With memory short, a decoding step is bound by reading the experts it misses; a verification pass of k + 1
rows reads the union of their experts once. Random weights draft at random, so the drafts here are an
oracle's: the tokens plain greedy decoding produced, each made wrong with probability 1 - --acceptance
(seeded). The runner's expert cache holds --memory of the store's expert bytes (its reads go around the
page cache, O_DIRECT: the cache is all the memory the experts get); each run is its own process, cold
(an empty cache), plain and speculative interleaved, --repeats rounds, medians. Reported: tok/s, MiB read
a token, the drafts kept, and the experts a pass reads against a token's (the union's growth: near k + 1
where consecutive tokens route apart, as random routers do; trained models route consecutive tokens alike).
Where the store holds the checkpoint's multi-token-prediction layer, two more runs interleave: drafting with
it (k a pass: its own acceptance, which on random weights is that of a random layer) and `semoe generate`'s
default (`--speculative auto`: the layer's drafts only while they pay).

    python bench/bench_speculative.py --store /path/store [--memory 33] [--k 3] [--acceptance 0.7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)


def one(args: argparse.Namespace, k: int, reference: list[int] | None, mode: str = "oracle") -> dict:
    """One generation in this process (the child's side): plain (k = 0), or speculative with the oracle's
    drafts, the layer's (`mode` "mtp") or the layer's while they pay ("auto")."""
    import random

    from inference.torch_free.runner import LeanConfig, LeanModel
    from semoe.decode.loop import SamplingConfig
    from storage.reader import StoreReader

    store = StoreReader.open(args.store)
    experts = sum(ch.bytes for ch in store.manifest.chunks if ch.kind == "weight")
    rng = random.Random(args.seed)

    def oracle(tokens: list[int], n: int) -> list[int]:
        right = reference[len(tokens):len(tokens) + n]
        return [t if rng.random() < args.acceptance else (t + 1) % args.vocab for t in right]

    prompt = [(7 * i + 3) % args.vocab for i in range(args.prompt_tokens)]
    with LeanModel(store, LeanConfig(cache_bytes=int(experts * args.memory / 100))) as lean:
        cfg = SamplingConfig(max_new_tokens=args.new_tokens)
        res = lean.generate(prompt, cfg, speculative=k, draft=oracle if k and mode == "oracle" else None,
                            paying=mode == "auto")
    return {"tokens": res.tokens, "tok_s": res.decode_tok_s, "stats": res.stats}


def child(args: argparse.Namespace, k: int, reference: list[int] | None, mode: str = "oracle") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--store", args.store, "--child", str(k), "--mode", mode,
           "--memory", str(args.memory), "--acceptance", str(args.acceptance), "--new-tokens", str(args.new_tokens),
           "--prompt-tokens", str(args.prompt_tokens), "--seed", str(args.seed), "--vocab", str(args.vocab)]
    out = subprocess.run(cmd, input=json.dumps(reference), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"bench_speculative: a run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True)
    p.add_argument("--memory", type=float, default=33.3, help="the expert cache, %% of the store's expert bytes")
    p.add_argument("--k", type=int, default=3, help="tokens drafted a pass")
    p.add_argument("--acceptance", type=float, default=0.7, help="the oracle's share of right drafts")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=1000, help="token ids the prompt and wrong drafts take")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="oracle", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(one(args, args.child, json.loads(sys.stdin.read()), args.mode)))
        return
    from inference.torch_free.mtp import mtp_layers
    from storage.reader import StoreReader

    kinds = [("plain", 0, "oracle"), ("speculative", args.k, "oracle")]
    if mtp_layers(StoreReader.open(args.store)):
        kinds += [("mtp", args.k, "mtp"), ("auto", args.k, "auto")]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in kinds}
    reference = None
    for r in range(args.repeats):
        for name, k, mode in kinds:
            print(f"{name} ({r + 1}/{args.repeats}) ...", file=sys.stderr, flush=True)
            got = child(args, k, reference, mode)
            if reference is None:
                reference = got["tokens"]
            if got["tokens"] != reference:
                sys.exit(f"bench_speculative: {name} gave other tokens than greedy decoding: {got['tokens']}")
            runs[name].append(got)
    report = {}
    for name, rs in runs.items():
        st = [r["stats"] for r in rs]
        report[name] = {"tok_s": statistics.median(r["tok_s"] for r in rs), "runs": [r["tok_s"] for r in rs],
                        "mib_per_token": statistics.median(s["ssd_bytes_per_token"] for s in st) / 2**20,
                        "expert_reads": statistics.median(s["expert_reads"] for s in st)}
        if name != "plain":
            report[name].update(passes=st[0]["passes"], drafted=st[0]["drafted"], accepted=st[0]["accepted"],
                                plain_passes=st[0].get("plain_passes", 0),
                                ratio=report[name]["tok_s"] / report["plain"]["tok_s"])
    plain, spec = report["plain"], report["speculative"]
    report["ratio"] = spec["tok_s"] / plain["tok_s"]
    report["tokens_per_pass"] = (args.new_tokens - 1) / spec["passes"]
    # experts read a pass against a token's: the union's growth over a pass's rows
    report["reads_per_pass_over_token"] = (spec["expert_reads"] / spec["passes"]) / (plain["expert_reads"] /
                                                                                    (args.new_tokens - 1))
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for name in runs:
        r = report[name]
        print(f"{name:12s} {r['tok_s']:7.2f} tok/s (runs {', '.join(f'{x:.2f}' for x in r['runs'])}) | "
              f"read {r['mib_per_token']:7.2f} MiB/tok | expert reads {r['expert_reads']:.0f}")
    for name in ("mtp", "auto"):
        if name in report:
            r = report[name]
            print(f"{name}: the checkpoint's layer drafting{' while it pays' if name == 'auto' else ''}: kept "
                  f"{r['accepted']} of {r['drafted']} ({r['accepted'] / max(1, r['drafted']):.2f}), "
                  f"{r['plain_passes']} plain passes of {r['passes']}; {r['ratio']:.2f}x plain tok/s")
    print(f"drafts kept {spec['accepted']} of {spec['drafted']} ({spec['accepted'] / max(1, spec['drafted']):.2f}), "
          f"{report['tokens_per_pass']:.2f} tokens a pass; a pass reads {report['reads_per_pass_over_token']:.2f}x "
          f"a token's experts")
    print(f"speculative / plain = {report['ratio']:.2f}x tok/s (k = {args.k}, oracle acceptance {args.acceptance}, "
          f"expert cache {args.memory:.0f}% of the experts)")


if __name__ == "__main__":
    main()
