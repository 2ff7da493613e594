"""`semoe serve`: an OpenAI-compatible HTTP server for one model, resident or offloaded.

The device, dtype and budget flags are shared with `semoe generate` (tools/engine_flags.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from tools.cli_output import UsageError
from tools.generate_cmd import speculative_flag
from tools.size_flags import parse_size
from tools.engine_flags import (add_budget_flags, add_device_flags, add_routing_trace_flag, engine_config_from_args,
                                lean_by_itself, load_engine, open_model, say_placement)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `semoe serve`."""
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a HuggingFace MoE checkpoint directory or a store on /v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health, /ready and /metrics. Running requests decode "
                                   "together, one batched forward a step (continuous batching); more wait in "
                                   "arrival order. Any offload budget keeps the experts in the store.")
    p.add_argument("--model", required=True, metavar="PATH",
                   help="store, HuggingFace directory, or .gguf file (imported into a store on first use)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    add_device_flags(p)
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait for a place in the batch; more get HTTP 503 with Retry-After "
                        "(default 64)")
    p.add_argument("--max-batch", type=int, default=16, metavar="N",
                   help="requests decoding together (default 16); each step computes one token of each and reads "
                        "the union of their experts once per layer")
    p.add_argument("--speculative", default="auto", metavar="K|auto",
                   help="draft up to K tokens for each greedy decoding request a step and verify them in that "
                        "step's pass: with the checkpoint's own multi-token-prediction layer where the store holds "
                        "one and the server runs through the compiled kernels (--lean, or taken by itself), else by "
                        "lookup in the request's prompt and tokens. A request gains a token for each draft kept; "
                        "its tokens are greedy decoding's. For models whose state is their attention caches (not "
                        "Qwen3-Next's or DeepSeek-V4's). 0: off. auto (default): 3 where the layer drafts, only "
                        "while drafting pays (steps with and without drafts timed in turns); off otherwise")
    p.add_argument("--max-batch-tokens", type=int, default=256, metavar="N",
                   help="rows of one step: a token per decoding request, then prompt tokens of new requests; a "
                        "longer prompt is prefilled over several steps (default 256, at least --max-batch)")
    p.add_argument("--prefill-chunk", default="auto", metavar="N|auto",
                   help="prompt rows a step takes while other requests decode, so that their next token never waits "
                        "behind more than one chunk; a step with no decoding request takes prompts up to "
                        "--max-batch-tokens. auto (default): as many as keep that step within about 1.75 times a "
                        "decoding-only step, timed as the server runs (64 until then, at least 8); where more "
                        "requests are starting than decoding, that 1.75 is multiplied by how many times more")
    p.add_argument("--kv-memory", metavar="SIZE",
                   help="memory for the running requests' KV caches together (512MiB, 2GiB; default: no limit). "
                        "A request's cache holds its prompt and 256 more positions at first and grows by 256 as it "
                        "generates; new requests wait while it is full, a cache that cannot grow makes the newest "
                        "request wait and recompute its tokens later, a request without max_tokens stops where it "
                        "fills, and one whose max_tokens can never fit gets HTTP 400")
    p.add_argument("--prefix-cache", metavar="SIZE",
                   help="memory for finished requests' KV caches, kept so that a prompt beginning with the same "
                        "tokens (a chat's system prompt and earlier turns) reuses them instead of computing them "
                        "again (512MiB, 0: off). Default: shared with --kv-memory, whose running requests evict "
                        "them first, or 1GiB where --kv-memory is not given. /metrics counts hits, reused tokens "
                        "and evictions")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C: take no new requests (/ready answers 503), give the queued and "
                        "running ones this long to finish, then end the rest with HTTP 503 \"the server is "
                        "stopping\", close the store and exit 0 (default 30)")
    p.add_argument("--request-log", metavar="FILE",
                   help="append one JSON line per finished request (or choice of one) to FILE: id, choice, status (stop, length, cancelled, "
                        "error), prompt and generated tokens, time to first token, mean inter-token latency, "
                        "latency")
    p.add_argument("--lean", action="store_true",
                   help="step through semoe's compiled CPU kernels over the runner's expert cache (a store only): "
                        "each step's rows at once, the union of the experts they chose read from the store once a "
                        "layer into a cache of --cpu-cache (default: sized from the memory left beside --kv-memory). "
                        "Taken by itself, with no budget flag, where the model does not fit the memory available")
    add_routing_trace_flag(p)
    add_budget_flags(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from inference.chat_template import load_chat_template
    from inference.serving.serve_config import ServeConfig
    from inference.serving.http_server import serve
    from semoe.evaluation.routing_trace import routing_trace
    from tools.gguf_store import gguf_store

    args.model = gguf_store(args.model)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.request_log is not None:
        where = os.path.dirname(os.path.abspath(args.request_log))
        if not os.path.isdir(where) or os.path.isdir(args.request_log):
            raise UsageError(f"--request-log {args.request_log}: expected a file in an existing directory")
    try:  # the server's limits, checked once
        serve_config = ServeConfig(max_queue=args.max_queue, max_batch=args.max_batch,
                                   max_batch_tokens=args.max_batch_tokens, request_log=args.request_log,
                                   shutdown_timeout=args.shutdown_timeout, prefill_chunk=_prefill_chunk(args),
                                   speculative=speculative_flag(args) or 0,
                                   kv_memory_bytes=parse_size(args.kv_memory, flag="--kv-memory")
                                   if args.kv_memory is not None else None,
                                   prefix_cache_bytes=None if args.prefix_cache is None else 0
                                   if args.prefix_cache.strip() == "0" else parse_size(args.prefix_cache,
                                                                                       flag="--prefix-cache"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    said = None if args.lean else lean_by_itself(args, keep_bytes=serve_config.kv_memory_bytes or 0,
                                                 how="serving through the compiled kernels (as --lean)")
    if args.lean or said is not None:
        if said is not None:
            print(f"semoe: {said}", file=sys.stderr, flush=True)
        engine, serve_config = lean_engine(args, serve_config)
        if args.speculative == "auto":
            serve_config = _auto_speculative(engine, serve_config)
        template, mode, device, trace = load_chat_template(args.model), "offloaded, compiled kernels", "cpu", None
        print(f"semoe: decoding through {engine.decode_path()}", file=sys.stderr, flush=True)
    else:
        store = open_model(args)  # the store, where --model is one: opened once, read by the sizing and the load
        # an auto CPU cache, and the choice to offload, leave the KV caches their memory
        config = engine_config_from_args(args, keep_bytes=serve_config.kv_memory_bytes or 0, store=store)
        template = load_chat_template(args.model, store)
        engine = load_engine(args, config, store=store)
        say_placement(args, engine)
        mode, device, trace = "offloaded" if config.offloaded else "resident", config.device, engine.model
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: make SIGTERM an
    # exception too, so that engine.close() still removes a temporary store.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with routing_trace(trace, args.routing_trace) if trace is not None else contextlib.nullcontext():
            serve(engine, args.host, args.port, serve_config, chat_template=template,
                  on_ready=lambda url: print(f"serving {engine.name} ({mode} on {device}) at {url}/v1 "
                                             f"(Ctrl-C to stop)", file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("semoe serve: stopped", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()
    return 0


def _prefill_chunk(args: argparse.Namespace) -> int | None:
    """--prefill-chunk: None for auto, else its integer (ServeConfig checks the range)."""
    if str(args.prefill_chunk).strip().lower() == "auto":
        return None
    try:
        return int(args.prefill_chunk)
    except ValueError:
        raise UsageError(f"--prefill-chunk must be auto or an integer >= 1, got {args.prefill_chunk!r}") from None


def lean_engine(args: argparse.Namespace, serve_config: "ServeConfig"):  # noqa: F821
    """The engine over the runner's model (`inference.serving.torch_free_engine.LeanEngine`) for `--model`, a store,
    and the serve config it runs with: where --kv-memory is not given, the KV memory is an eighth of
    the memory available (said on stderr); the expert cache leaves it free (the kept prefixes share it)."""
    from dataclasses import replace

    from inference.torch_free.runner import LeanConfig, LeanModel, dense_load_bytes
    from inference.serving.torch_free_engine import LeanEngine
    from storage.process_memory import available_ram_bytes
    from storage.reader import StoreReader
    from tools.engine_flags import lean_cache_bytes, refuse_for_lean
    from tools.progress import byte_bar

    refuse_for_lean(args, "serves in float32 on CPU through the compiled kernels")
    store = StoreReader.open(args.model)
    cache = lean_cache_bytes(args, store)
    if serve_config.kv_memory_bytes is None:
        kv = max(available_ram_bytes() // 8, serve_config.prefix_cache_bytes or 0, 1)
        serve_config = replace(serve_config, kv_memory_bytes=kv)
        print(f"semoe: --kv-memory not given: the running requests' KV caches take at most {kv / 2**20:.0f} MiB, "
              f"an eighth of the memory available", file=sys.stderr, flush=True)
    keep = serve_config.kv_memory_bytes  # the running requests' caches and the kept prefixes, together
    with byte_bar(dense_load_bytes(store), "loading weights") as bar:
        model = LeanModel(store, LeanConfig(cache_bytes=cache, keep_bytes=keep, dense=args.dense, kv_cache="f32"),
                          progress=bar.update)
    return LeanEngine(model, name=os.path.basename(os.path.normpath(args.model))), serve_config


def _auto_speculative(engine, serve_config: "ServeConfig") -> "ServeConfig":  # noqa: F821
    """--speculative auto over the runner's engine: AUTO_K drafted tokens a step, while drafting pays, where the
    store holds a multi-token-prediction layer and the model rolls back by its caches' length; off otherwise."""
    from dataclasses import replace

    from inference.serving.batch_scheduler import rolls_back
    from inference.torch_free.mtp import mtp_layers, mtp_refusal
    from tools.generate_cmd import AUTO_K

    layers = mtp_layers(engine.lean.store)
    if mtp_refusal(engine.lean.store) is not None or not rolls_back(engine.model_config):
        return serve_config
    print(f"semoe: drafting {AUTO_K} tokens a step for greedy requests with the checkpoint's multi-token-prediction "
          f"layer {layers[0]}, while it pays (--speculative 0: off)", file=sys.stderr, flush=True)
    return replace(serve_config, speculative=AUTO_K, paying=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
