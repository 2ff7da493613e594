"""`semoe generate`: text from a HuggingFace directory or a store, resident where it fits the memory
available and offloaded behind a CPU cache where it does not."""

from __future__ import annotations

import argparse
import contextlib
import sys

from tools.cli_output import UsageError, emit_json
from tools.engine_flags import (add_budget_flags, add_device_flags, add_routing_trace_flag, engine_config_from_args,
                                lean_by_itself, lean_cache_bytes, load_engine, refuse_for_lean, say_placement)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `semoe generate`."""
    p = sub.add_parser("generate", help="generate text from a MoE model",
                       description="Generate tokens from a HuggingFace MoE checkpoint directory or a store. "
                                   "Greedy by default; --temperature/--top-p/--seed sample instead.")
    p.add_argument("--model", required=True, metavar="PATH",
                   help="store, HuggingFace directory, or .gguf file (imported into a store on first use)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the model's own chat template "
                        "(chat_template.jinja or tokenizer_config.json; a plain 'role: text' one if it ships none)")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user's")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    p.add_argument("--greedy", action="store_true", help="pick the most likely token (the default)")
    p.add_argument("--temperature", type=float, help="sample with this temperature")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (with sampling)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    add_device_flags(p)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--json", action="store_true",
                   help='print {"tokens", "text", "logprobs", "ttft_s", "decode_tok_s"} on stdout, and "stats" '
                        "when offloaded")
    p.add_argument("--profile", action="store_true",
                   help="time each decoded token's attention, router, experts, dense feed-forward, lm_head and "
                        "the rest, with the GB/s of weights each touched against this machine's memory read rate "
                        "(on stderr; under --json as \"profile\")")
    p.add_argument("--lean", action="store_true",
                   help="decode on CPU in a process that never imports torch (inference/torch_free/): the compiled "
                        "kernels over a store, experts read from it into --cpu-cache (default: room for every "
                        "expert where the memory left allows) as the router picks them, the token embedding left on "
                        "storage. For machines where memory is shorter than the model: torch's runtime alone would "
                        "hold 0.15 GiB. Taken by itself where a store does not fit the memory available, or with "
                        "--cpu-cache alone on CPU, and no flag asks for the engine (stderr says so). Sampling and --chat as the "
                        "engine's; "
                        "every architecture semoe loads; --dense auto, float or int8")
    p.add_argument("--kv-cache", choices=("auto", "f32", "f16"), default="auto",
                   help="the torch-free runner's KV cache (with --lean, or where generate takes it by itself): f32, "
                        "or f16, half the bytes (llama.cpp's default), each key and value rounded to float16 as "
                        "written, for grouped-query attention (every architecture but DeepSeek's latent one); auto "
                        "(default): f16 where a float32 cache for the prompt and --max-new-tokens would take more "
                        "than an eighth of the memory available (stderr says so), else f32")
    p.add_argument("--speculative", default="auto", metavar="K|auto",
                   help="draft up to K tokens a step and verify them in one pass of K + 1 rows, greedy, in the "
                        "torch-free runner (it implies --lean): a pass reads the union of its rows' experts once, "
                        "where memory is short the step's cost. Drafts with the checkpoint's own "
                        "multi-token-prediction layer where the store holds one (DeepSeek-V3, GLM-4.5, Qwen3-Next, "
                        "Qwen3.5), else by lookup: the tokens that followed the latest earlier occurrence of the "
                        "sequence's last 1-3 tokens, prompt included. The tokens are greedy decoding's. 0: off. "
                        "auto (default): K = 3 where the store holds such a layer, decoding is greedy and runs in "
                        "the runner (--lean, or taken by itself with memory short), drafting only while it pays "
                        "(passes with and without drafts timed in turns); off otherwise")
    add_routing_trace_flag(p)
    add_budget_flags(p)
    p.set_defaults(handler=run)


def parse_prompt_ids(text: str) -> list[int]:
    """Token ids from "1,2,3"; UsageError names the flag on anything else."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise UsageError(f"--prompt-ids must be non-negative integers, got {text!r}")
    return ids


AUTO_K = 3  # the tokens `--speculative auto` drafts a step


def speculative_flag(args: argparse.Namespace) -> int | None:
    """--speculative as K >= 0, or None for auto; UsageError names the flag on anything else."""
    if args.speculative == "auto":
        return None
    try:
        k = int(args.speculative)
    except (TypeError, ValueError):
        raise UsageError(f"--speculative must be auto or a count of tokens >= 0, got {args.speculative!r}") from None
    if k < 0:
        raise UsageError(f"--speculative must be >= 0 (the tokens drafted a step), got {k}")
    return k


def auto_speculative(args: argparse.Namespace) -> None:
    """--speculative auto, where the runner decodes: K = AUTO_K, drafting while it pays (`args.paying`),
    where the store holds a multi-token-prediction layer and decoding is greedy; else 0. Says so."""
    from inference.torch_free.mtp import mtp_layers, mtp_refusal
    from storage.reader import StoreReader

    store = StoreReader.open(args.model)
    greedy = args.temperature is None and args.top_p is None
    layers = mtp_layers(store) if greedy and mtp_refusal(store) is None else []
    args.speculative, args.paying = (AUTO_K, True) if layers else (0, False)
    if layers:
        print(f"semoe: drafting {AUTO_K} tokens a step with the checkpoint's multi-token-prediction layer "
              f"{layers[0]}, while it pays (--speculative 0: off)", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from tools.gguf_store import gguf_store

    args.model = gguf_store(args.model)
    k = speculative_flag(args)
    args.paying = False
    if k and (args.temperature is not None or args.top_p is not None):
        raise UsageError("--speculative decodes greedily: drop --temperature and --top-p, or --speculative")
    if args.lean:
        return run_lean(args)
    if k:  # the engine decodes a token a step
        print("semoe: --speculative decodes in the torch-free runner (as --lean)", file=sys.stderr, flush=True)
        return run_lean(args)
    said = lean_by_itself(args, sized_cache=True)
    if said is not None:
        print(f"semoe: {said}", file=sys.stderr, flush=True)
        return run_lean(args)
    args.speculative = 0
    from semoe.decode.profile import DecodeProfile, format_report, memory_read_gbps
    from semoe.decode.generate import check_prompt
    from semoe.evaluation.routing_trace import routing_trace

    check_sampling_flags(args)
    if args.kv_cache == "f16":
        raise UsageError(f"--kv-cache {args.kv_cache} is the torch-free runner's: add --lean (the engine keeps its "
                         f"KV cache in its --dtype)")
    config = engine_config_from_args(args)
    engine = load_engine(args, config)
    try:
        prompt = build_prompt(args, engine.tokenizer)
        tok = engine.tokenizer
        cfg = sampling_config(args, engine.stop_ids())
        check_prompt(engine.model.config, prompt, args.max_new_tokens)  # a bad prompt: its one line alone
        say_placement(args, engine)
        # `profile`: the DecodeProfile with --profile; None otherwise (what nullcontext yields)
        with routing_trace(engine.model, args.routing_trace), \
                (DecodeProfile(engine.model) if args.profile else contextlib.nullcontext()) as profile:
            res = engine.generate(prompt, cfg)
    finally:
        engine.close()
    report = None
    if profile is not None:
        report = profile.report(memory_read_gbps() if config.device == "cpu" else None)
        for line in format_report(report):
            print(line, file=sys.stderr)
    text = tok.decode(res.tokens) if tok is not None else ""
    if args.json:
        out = {"tokens": res.tokens, "text": text, "logprobs": res.logprobs, "ttft_s": res.ttft_s,
               "decode_tok_s": res.decode_tok_s}
        if config.offloaded:
            out["stats"] = res.stats
        if report is not None:
            out["profile"] = report
        emit_json(out)
    else:
        print(text)
        where = "offloaded" if config.offloaded else "resident"
        print(f"[{len(res.tokens)} tokens, ttft {res.ttft_s * 1e3:.1f} ms, {res.decode_tok_s:.1f} tok/s, {where} "
              f"on {config.device}, peak RSS {res.stats.get('peak_rss_bytes', 0) / 2**20:.0f} MiB]", file=sys.stderr)
    return 0


def check_sampling_flags(args: argparse.Namespace) -> None:
    """UsageError for a combination of the prompt and sampling flags that makes no sense."""
    if (args.chat or args.system is not None) and args.prompt is None:
        raise UsageError("--chat and --system need --prompt (text), not --prompt-ids")
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat")
    if args.greedy and (args.temperature is not None or args.top_p is not None):
        raise UsageError("--greedy cannot be combined with --temperature/--top-p")


def build_prompt(args: argparse.Namespace, tok) -> list[int]:
    """The prompt's token ids: --prompt-ids as given, or --prompt encoded by the model's tokenizer
    (`tok`; None where the model has none), through its chat template with --chat."""
    if args.prompt_ids is not None:
        return parse_prompt_ids(args.prompt_ids)
    if tok is None:
        raise UsageError(f"--prompt: {args.model} has no tokenizer (tokenizer.json); give --prompt-ids instead")
    if args.chat:
        from inference.chat_template import load_chat_template

        messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        return load_chat_template(args.model).encode(tok, [*messages, {"role": "user", "content": args.prompt}])
    return tok.encode(args.prompt, add_bos=tok.add_bos_default)


def sampling_config(args: argparse.Namespace, stop_ids: tuple[int, ...]) -> "SamplingConfig":  # noqa: F821
    """How tokens are chosen, from the flags; generation stops at `stop_ids` (the model's) unless
    --ignore-eos."""
    from semoe.decode.loop import SamplingConfig

    sampling = args.temperature is not None or args.top_p is not None
    return SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=not sampling,
                          temperature=args.temperature if args.temperature is not None else 1.0,
                          top_p=args.top_p if args.top_p is not None else 1.0, seed=args.seed,
                          stop_ids=() if args.ignore_eos else stop_ids)


def run_lean(args: argparse.Namespace) -> int:
    """`semoe generate --lean`: the torch-free runner (no module imported here may import torch)."""
    from inference.torch_free.runner import LeanConfig, LeanModel, dense_load_bytes
    from semoe.checkpoints.hf_config import store_model_config
    from semoe.checkpoints.tokenizer import store_tokenizer
    from inference.torch_free.sequence_memory import KV16_SHARE, sequence_parts, sequence_plan
    from storage.process_memory import available_ram_bytes
    from storage.reader import StoreReader
    from tools.progress import byte_bar, count_bar

    check_sampling_flags(args)
    refuse_for_lean(args, "decodes in float32 on CPU, one sequence, evicting by next use, without profiles or traces")
    if speculative_flag(args) is None:
        auto_speculative(args)
    args.speculative = int(args.speculative)
    store = StoreReader.open(args.model)  # the manifest, read once: for the cache's size and the model
    cache = lean_cache_bytes(args, store)
    c = store_model_config(store)
    tok = store_tokenizer(store, c.vocab_size, c.arch)
    prompt = build_prompt(args, tok)  # before loading: the sequence's memory is kept free beside the cache
    kv_cache, keep = sequence_plan(c, len(prompt), args.max_new_tokens, args.kv_cache, available_ram_bytes())
    if args.kv_cache == "auto" and kv_cache == "f16":
        positions = len(prompt) + args.max_new_tokens
        kv = sequence_parts(c, len(prompt), positions)["kv"]
        print(f"semoe: a float32 KV cache of {positions} positions would take {kv / 2**20:.0f} MiB, more than "
              f"1/{KV16_SHARE} of the memory available: keeping it in float16 (--kv-cache f32 keeps float32)",
              file=sys.stderr, flush=True)
    with byte_bar(dense_load_bytes(store), "loading weights") as bar:
        model = LeanModel(store, LeanConfig(cache_bytes=cache, keep_bytes=keep, dense=args.dense, kv_cache=kv_cache),
                          progress=bar.update, tokenizer=tok)
    with model:
        with count_bar(model.config.num_layers, f"prompt of {len(prompt)} tokens", "layer") as bar:
            def layer_done(done: int, layers: int) -> None:
                bar.update(1)
                if done == layers:
                    bar.close()  # decoding follows: the bar goes

            res = model.generate(prompt, sampling_config(args, model.stop_ids()), on_prompt_layer=layer_done,
                                 speculative=args.speculative, paying=getattr(args, "paying", False))
    text = tok.decode(res.tokens) if tok is not None else ""
    if args.json:
        emit_json({"tokens": res.tokens, "text": text, "logprobs": res.logprobs, "ttft_s": res.ttft_s,
                   "decode_tok_s": res.decode_tok_s, "stats": res.stats})
    else:
        print(text)
        print(f"[{len(res.tokens)} tokens, ttft {res.ttft_s * 1e3:.1f} ms, {res.decode_tok_s:.1f} tok/s, lean on cpu, "
              f"expert cache {res.stats['cache_bytes'] / 2**20:.0f} MiB, read {res.stats['ssd_bytes'] / 2**20:.1f} MiB, "
              f"peak RSS {res.stats['peak_rss_bytes'] / 2**20:.0f} MiB]", file=sys.stderr)
        if args.speculative:
            st = res.stats
            plain = f", {st['plain_passes']} of them plain (drafting did not pay)" if st["plain_passes"] else ""
            print(f"[speculative: {st['passes']} passes{plain}, {st['accepted']} of {st['drafted']} drafted tokens "
                  f"kept, drafted by {st['drafter']}]", file=sys.stderr)
    return 0
