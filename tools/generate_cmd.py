"""`semoe generate`: text from a HuggingFace directory or a store, everything resident on the device."""

from __future__ import annotations

import argparse
import sys

from tools.common import UsageError, emit_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `semoe generate`."""
    p = sub.add_parser("generate", help="generate text from a MoE model",
                       description="Generate tokens from a HuggingFace MoE checkpoint directory or a store. "
                                   "Greedy by default; --temperature/--top-p/--seed sample instead.")
    p.add_argument("--model", required=True, metavar="PATH", help="HuggingFace directory or store")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    p.add_argument("--greedy", action="store_true", help="pick the most likely token (the default)")
    p.add_argument("--temperature", type=float, help="sample with this temperature")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (with sampling)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N (default auto: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default float32)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--json", action="store_true",
                   help='print {"tokens", "text", "logprobs", "ttft_s", "decode_tok_s"} on stdout')
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


def resolve_device(name: str) -> "torch.device":  # noqa: F821
    """`auto` is cuda when available, else cpu; an unavailable cuda is a usage error."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    return dev


def run(args: argparse.Namespace) -> int:
    import torch

    from semoe.checkpoint import is_store, load_model, load_model_tokenizer
    from semoe.generate import SamplingConfig, generate

    sampling = args.temperature is not None or args.top_p is not None
    if args.greedy and sampling:
        raise UsageError("--greedy cannot be combined with --temperature/--top-p")
    device = resolve_device(args.device)
    model = load_model(args.model, device=device, dtype=getattr(torch, args.dtype))
    tok = load_model_tokenizer(args.model, model.config)
    if args.prompt_ids is not None:
        prompt = parse_prompt_ids(args.prompt_ids)
    elif tok is None:
        raise UsageError(f"--prompt: {args.model} has no tokenizer (tokenizer.json); give --prompt-ids instead")
    else:
        prompt = tok.encode(args.prompt, add_bos=tok.add_bos_default)
    stops = () if args.ignore_eos else tuple(i for i in _ids(model.config.eos_token_id) if i is not None)
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=not sampling,
                         temperature=args.temperature if args.temperature is not None else 1.0,
                         top_p=args.top_p if args.top_p is not None else 1.0, seed=args.seed, stop_ids=stops)
    res = generate(model, prompt, cfg)
    text = tok.decode(res.tokens) if tok is not None else ""
    if args.json:
        emit_json({"tokens": res.tokens, "text": text, "logprobs": res.logprobs, "ttft_s": res.ttft_s,
                   "decode_tok_s": res.decode_tok_s})
    else:
        print(text)
        print(f"[{len(res.tokens)} tokens, ttft {res.ttft_s * 1e3:.1f} ms, {res.decode_tok_s:.1f} tok/s, "
              f"{'store' if is_store(args.model) else 'huggingface'} model on {device}]", file=sys.stderr)
    return 0


def _ids(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
