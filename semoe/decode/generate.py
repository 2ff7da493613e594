"""Text generation as small free functions: prefill, decode one token, sample.

Legend: B batch, T prompt tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from semoe.decode import loop
from semoe.decode.loop import SamplingConfig
from semoe.decode.plan import DecodePlan
from semoe.model.attention import KVCache
from semoe.model.moe_gpt import MoEGPT


@dataclass(kw_only=True)
class GenerationResult:
    """Generated tokens, each one's log-probability under the model, and timings."""

    tokens: list[int]
    logprobs: list[float]  # log softmax of the model's logits (before temperature and top-p)
    prompt_tokens: int
    ttft_s: float  # prompt in -> first token out
    decode_tok_s: float  # tokens per second after the first
    stats: dict = field(default_factory=dict)


def logits_to_probs(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution: temperature, then nucleus (top-p) truncation, renormalised."""
    probs = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits_BV: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids (B,): argmax when greedy, else a draw from `logits_to_probs`."""
    if cfg.greedy:
        return logits_BV.argmax(dim=-1)
    probs = logits_to_probs(logits_BV, cfg.temperature, cfg.top_p)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits_BV.device)


def choose(logits_1V: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None, top: int = 0
           ) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """One sequence's next token (`sample`), its log-probability under the logits, and the `top` most
    likely tokens with theirs, most likely first (none for `top` 0); one log-softmax for both."""
    token = int(sample(logits_1V, cfg, generator)[0])
    logprobs_V = torch.log_softmax(logits_1V.float(), dim=-1)[0]
    if not top:
        return token, float(logprobs_V[token]), ()
    values, ids = torch.topk(logprobs_V, min(top, logprobs_V.shape[-1]))
    return token, float(logprobs_V[token]), tuple(zip(ids.tolist(), values.tolist()))


@torch.no_grad()
def prefill(model: MoEGPT, ids_BT: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run the prompt through the model, filling the cache; logits of the last position (B, V). One
    sequence goes through the packed forward a batching server uses (only its last row's logits)."""
    if ids_BT.shape[0] == 1:
        T = ids_BT.shape[1]
        return model.forward_packed(ids_BT[0], [cache], [T], rows=[T - 1]).logits[:, -1]
    return model(ids_BT, cache).logits[:, -1]


@torch.no_grad()
def decode_one_token(model: MoEGPT, ids_B1: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One decoding step: logits (B, V) of the next position (one sequence: the packed forward)."""
    if ids_B1.shape[0] == 1:
        return model.forward_packed(ids_B1[0], [cache], [1]).logits[:, -1]
    return model(ids_B1, cache).logits[:, -1]


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on CPU, where it has already run)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_prompt(config, prompt: list[int], max_new_tokens: int) -> None:
    """ValueError naming what is wrong with `prompt` and `max_new_tokens` for a model of `config`."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    vocab = config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
    if len(prompt) + max_new_tokens > config.max_position:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_position {config.max_position}")


def new_cache(model: MoEGPT, prompt: list[int], max_new_tokens: int) -> KVCache:
    """The KV cache of one sequence for `prompt` and up to `max_new_tokens` more, after checking the
    prompt (`check_prompt`)."""
    check_prompt(model.config, prompt, max_new_tokens)
    return KVCache.empty(model.config, 1, len(prompt) + max_new_tokens, device=model.embed.weight.device,
                         dtype=model.embed.weight.dtype)


def generate(model: MoEGPT, prompt: list[int], cfg: SamplingConfig,
             on_token: Callable[[int, float], None] | None = None, *,
             plan: DecodePlan | None | Literal["build"] = "build") -> GenerationResult:
    """Generate up to `cfg.max_new_tokens` tokens after `prompt` (one sequence); `on_token(id,
    logprob)` is called as each token is chosen (for streaming). Decoding steps go through `plan`
    where it takes them: the caller's (an engine owns one for its model), by default one built for
    this call, or none (None: the modules alone)."""
    cache = new_cache(model, prompt, cfg.max_new_tokens)
    device = cache.k[0].device
    gen = torch.Generator().manual_seed(cfg.seed)
    if plan == "build":
        plan = DecodePlan.build(model)  # None where the model has a part it does not take

    def step(token: int) -> torch.Tensor:
        if plan is not None and plan.takes(cache):
            return plan.step(token, cache)
        return decode_one_token(model, torch.tensor([[token]], device=device), cache)

    def first() -> torch.Tensor:
        logits = None if plan is None else plan.prefill(prompt, cache)
        return prefill(model, torch.tensor([prompt], device=device), cache) if logits is None else logits

    out = loop.run(first, step,
                   lambda logits: choose(logits, cfg, gen)[:2], cfg, on_token, lambda: sync(device))
    return GenerationResult(tokens=out.tokens, logprobs=out.logprobs, prompt_tokens=len(prompt), ttft_s=out.ttft_s,
                            decode_tok_s=out.decode_tok_s)
