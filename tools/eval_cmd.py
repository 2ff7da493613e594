"""`semoe eval`: perplexity of a model on text, and its KL divergence from a reference model.

The device, dtype and budget flags are shared with `semoe generate` (tools/engine_flags.py); the
budgets apply to each model loaded, so a reference too large for memory can be offloaded as well.
"""

from __future__ import annotations

import argparse
import os
import sys

from tools.cli_output import UsageError, emit_json
from tools.engine_flags import add_budget_flags, add_device_flags, add_routing_trace_flag, engine_config_from_args

DEFAULT_SEQ_LEN = 256
DEFAULT_MAX_TOKENS = 4096


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `semoe eval`."""
    p = sub.add_parser("eval", help="perplexity of a model, and KL divergence from a reference",
                       description="Score text teacher-forced over non-overlapping windows (one forward each, no "
                                   "KV cache across windows): mean NLL and perplexity; with --reference, also the "
                                   "mean KL(reference || model) per token and how often both models' top token "
                                   "agree (llama.cpp's KLD statistics).")
    p.add_argument("--model", required=True, metavar="PATH",
                   help="store, HuggingFace directory, or .gguf file (imported into a store on first use)")
    p.add_argument("--data", metavar="PATH",
                   help="a text file, or a directory of *.txt/*.md/*.py files (default: the validation split of "
                        "the built-in corpus, the Python standard library's source)")
    p.add_argument("--reference", metavar="PATH",
                   help="a second model with the same vocabulary to compare against (HuggingFace directory or store)")
    p.add_argument("--seq-len", type=int, metavar="N",
                   help=f"tokens per window (default {DEFAULT_SEQ_LEN}, or the model's max positions if fewer)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"tokens to score at most (default {DEFAULT_MAX_TOKENS})")
    add_device_flags(p)
    p.add_argument("--json", action="store_true",
                   help='print {"model", "reference", "tokens", "mean_nll", "perplexity", "kl_divergence", '
                        '"kl_median", "kl_p99", "kl_p99_9", "top_token_agreement", "seq_len", "windows"} on stdout')
    add_routing_trace_flag(p)
    add_budget_flags(p)
    p.set_defaults(handler=run)


def _check_args(args: argparse.Namespace) -> None:
    """What can be refused before loading a model."""
    if args.seq_len is not None and args.seq_len < 2:
        raise UsageError(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    for flag, path in (("--model", args.model), ("--reference", args.reference), ("--data", args.data)):
        if path is not None and not os.path.exists(path):
            raise UsageError(f"{flag} {path}: no such file or directory")


def _seq_len(args: argparse.Namespace, max_position: int) -> int:
    if args.seq_len is None:
        return min(DEFAULT_SEQ_LEN, max_position)
    if args.seq_len > max_position:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's max_position {max_position}")
    return args.seq_len


def _tokens(args: argparse.Namespace, engine) -> list[int]:
    """Token ids of --data (or the default validation text) with the model's tokenizer."""
    from semoe.train.data import eval_documents
    from semoe.evaluation.perplexity import gather_tokens

    tok = engine.tokenizer
    if tok is None:
        raise UsageError(f"--model {args.model}: no tokenizer (tokenizer.json) to tokenize the evaluation text with")
    ids = gather_tokens(eval_documents(args.data), tok.encode, eos_id=tok.eos_id, limit=args.max_tokens + 1)
    if len(ids) < 2:
        where = f"--data {args.data}" if args.data is not None else "the default validation text"
        raise UsageError(f"{where}: {len(ids)} token(s); need at least 2 to score one")
    vocab = engine.model.config.vocab_size
    if max(ids) >= vocab:
        raise UsageError(f"--model {args.model}: its tokenizer gave id {max(ids)}, outside the model's vocabulary "
                         f"of {vocab}")
    return ids


def run(args: argparse.Namespace) -> int:
    from inference.engine import Engine
    from semoe.evaluation.perplexity import EvalConfig, evaluate, model_logits
    from semoe.evaluation.routing_trace import routing_trace
    from tools.gguf_store import gguf_store
    from tools.progress import count_bar

    args.model = gguf_store(args.model)
    if args.reference is not None:
        args.reference = gguf_store(args.reference, "--reference")

    _check_args(args)
    config = engine_config_from_args(args)
    engines = [Engine.load(args.model, config)]
    try:
        model = engines[0]
        cfg = EvalConfig(seq_len=_seq_len(args, model.model.config.max_position), max_tokens=args.max_tokens)
        reference_fn = None
        if args.reference is not None:
            engines.append(Engine.load(args.reference, config))
            ref = engines[1]
            if ref.model.config.vocab_size != model.model.config.vocab_size:
                raise UsageError(f"--reference {args.reference}: vocabulary of {ref.model.config.vocab_size} tokens, "
                                 f"but --model has {model.model.config.vocab_size}")
            if ref.model.config.max_position < cfg.seq_len:
                raise UsageError(f"--seq-len {cfg.seq_len} exceeds the reference's max_position "
                                 f"{ref.model.config.max_position}")
            reference_fn = model_logits(ref.model)
        ids = _tokens(args, model)
        with count_bar(min(args.max_tokens, len(ids) - 1), "eval", "tok") as bar, \
                routing_trace(model.model, args.routing_trace):
            for e in engines:
                if e.offload is not None:
                    e.offload.begin_request()
            result = evaluate(ids, model_logits(model.model), config=cfg, reference_fn=reference_fn,
                              on_window=bar.update)
    finally:
        for e in engines:
            e.close()
    out = {"model": args.model, "reference": args.reference, "tokens": result.tokens, "mean_nll": result.mean_nll,
           "perplexity": result.perplexity, "kl_divergence": result.kl_divergence,
           "top_token_agreement": result.top_token_agreement, "seq_len": result.seq_len, "windows": result.windows,
           "kl_median": result.kl_quantile(0.5), "kl_p99": result.kl_quantile(0.99),
           "kl_p99_9": result.kl_quantile(0.999)}
    if args.json:
        emit_json(out)
        return 0
    print(f"{args.model}: {result.tokens} tokens in {result.windows} windows of {result.seq_len}")
    print(f"mean NLL    {result.mean_nll:.4f} nats")
    print(f"perplexity  {result.perplexity:.4f}")
    if args.reference is not None:
        print(f"KL(reference || model)  {result.kl_divergence:.6f} nats per token  (reference {args.reference})")
        print(f"KL per token: median {result.kl_quantile(0.5):.6f}, 99th percentile {result.kl_quantile(0.99):.6f}, "
              f"99.9th {result.kl_quantile(0.999):.6f}")
        print(f"top-token agreement     {100 * result.top_token_agreement:.2f}%")
    where = "offloaded" if config.offloaded else "resident"
    print(f"[{where} on {config.device}]", file=sys.stderr)
    return 0
