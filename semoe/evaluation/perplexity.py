"""Teacher-forced evaluation: perplexity of a model, and its divergence from a reference model.

The maths are pure functions of logits and targets, computed in float32 log-softmax whatever the
model's dtype. `evaluate` runs them over non-overlapping windows of a token stream, one forward per
window and no KV cache carried across windows, through a callable that maps token ids to logits,
so it runs the same on a resident model, an offloaded one, or a fake in a test.

The stream is cut into windows of inputs `ids[s:s+L]` scored against targets `ids[s+1:s+L+1]`, so
every token after the first is scored exactly once (the last window may be shorter). Each window
starts with an empty context: positions early in a window see fewer tokens, as in nanoGPT's
evaluation.

Shape legend: T tokens of one window, V vocabulary, N tokens of the whole stream.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from semoe.model.moe_gpt import MoEGPT

log = logging.getLogger(__name__)

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # ids (1, T) -> logits (1, T, V)


@dataclass(kw_only=True)
class EvalConfig:
    """How much of the token stream is scored, and in windows of how many tokens."""

    seq_len: int = 256  # tokens per window (one forward each)
    max_tokens: int = 4096  # positions scored at most

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(kw_only=True)
class EvalResult:
    """Sums over every scored position; the means are properties."""

    tokens: int  # positions scored
    windows: int
    seq_len: int
    nll_sum: float  # nats
    kl_sum: float | None = None  # nats; None without a reference
    agree: int | None = None  # positions whose argmax token matches the reference's
    kl_tokens: list[float] = field(default_factory=list)  # each position's KL, nats (its tail: `kl_quantile`)

    @property
    def mean_nll(self) -> float:
        """Mean negative log-likelihood of the targets, in nats."""
        return self.nll_sum / self.tokens

    @property
    def perplexity(self) -> float:
        """exp(mean NLL); inf when that overflows a float."""
        try:
            return math.exp(self.mean_nll)
        except OverflowError:
            return math.inf

    @property
    def kl_divergence(self) -> float | None:
        """Mean KL(reference || model) per position, in nats (llama.cpp's KLD); None without a reference."""
        return None if self.kl_sum is None else self.kl_sum / self.tokens

    def kl_quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) of the positions' KL(reference || model), in nats (llama.cpp reports the
        median, 99th and 99.9th percentiles); None without a reference."""
        if self.kl_sum is None or not self.kl_tokens:
            return None
        return float(np.quantile(np.asarray(self.kl_tokens, dtype=np.float64), q))

    @property
    def top_token_agreement(self) -> float | None:
        """Share of positions where both models' most likely token is the same; None without a reference."""
        return None if self.agree is None else self.agree / self.tokens


# -- the maths -----------------------------------------------------------------------------------


def token_nll(logits_TV: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (T,) of each target under float32 log-softmax of its logits."""
    logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
    return -logp_TV.gather(-1, targets_T.long()[:, None]).squeeze(-1)


def kl_divergence(ref_logits_TV: torch.Tensor, logits_TV: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) (T,) = sum_v p_ref (log p_ref - log p_model), in float32 nats."""
    ref_logp_TV = torch.log_softmax(ref_logits_TV.float(), dim=-1)
    logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
    ref_p_TV = ref_logp_TV.exp()
    # a token the reference rules out (p_ref = 0, log p_ref = -inf) adds nothing, not 0 * inf = nan
    terms_TV = torch.where(ref_p_TV > 0, ref_p_TV * (ref_logp_TV - logp_TV), torch.zeros_like(ref_p_TV))
    return terms_TV.sum(-1)


def top_token_agreement(ref_logits_TV: torch.Tensor, logits_TV: torch.Tensor) -> torch.Tensor:
    """Whether each position's most likely token is the same under both models (T,) bool."""
    return ref_logits_TV.argmax(-1) == logits_TV.argmax(-1)


def window_bounds(n_ids: int, seq_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) of each window's inputs over a stream of `n_ids` tokens; targets are shifted by one."""
    scored = min(max_tokens, n_ids - 1)
    return [(s, min(s + seq_len, scored)) for s in range(0, max(scored, 0), seq_len)]


# -- inputs and the loop -------------------------------------------------------------------------


def gather_tokens(documents: Iterable[Iterable[str]], encode: Callable[[str], list[int]], *,
                  eos_id: int | None, limit: int) -> list[int]:
    """Token ids of `documents` (each a sequence of text pieces), EOS after each non-empty one, as
    training shards lay them out; stops tokenizing once `limit` ids are gathered."""
    ids: list[int] = []
    for pieces in documents:
        before = len(ids)
        for text in pieces:
            ids.extend(encode(text))
            if len(ids) >= limit:
                return ids[:limit]
        if eos_id is not None and len(ids) > before:
            ids.append(eos_id)
    return ids[:limit]


def model_logits(model: MoEGPT) -> LogitsFn:
    """The callable `evaluate` takes: a fresh forward of `model` with no KV cache, on its device."""
    device = model.embed.weight.device

    def logits(ids_1T: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(ids_1T.to(device)).logits

    return logits


def evaluate(ids_N: torch.Tensor, logits_fn: LogitsFn, *, config: EvalConfig, reference_fn: LogitsFn | None = None,
             on_window: Callable[[int], None] | None = None) -> EvalResult:
    """Score `ids_N` window by window with `logits_fn`, and against `reference_fn` when given.

    `on_window(tokens)` is called after each window (a progress bar's update).
    """
    ids_N = torch.as_tensor(ids_N, dtype=torch.long).reshape(-1)
    bounds = window_bounds(len(ids_N), config.seq_len, config.max_tokens)
    if not bounds:
        raise ValueError(f"need at least 2 tokens to score one, got {len(ids_N)}")
    nll_sum, kl_sum, agree, kl_tokens = 0.0, 0.0, 0, []
    for start, stop in bounds:
        inputs_1T = ids_N[start:stop][None]
        targets_T = ids_N[start + 1:stop + 1]
        logits_TV = logits_fn(inputs_1T)[0]
        # sums in float64 on the host: thousands of float32 terms would otherwise lose digits
        nll_sum += token_nll(logits_TV, targets_T.to(logits_TV.device)).double().sum().item()
        if reference_fn is not None:
            ref_TV = reference_fn(inputs_1T)[0].to(logits_TV.device)
            if ref_TV.shape != logits_TV.shape:
                raise ValueError(f"reference logits {tuple(ref_TV.shape)} do not match the model's "
                                 f"{tuple(logits_TV.shape)}")
            kl_T = kl_divergence(ref_TV, logits_TV).double()
            kl_sum += kl_T.sum().item()
            kl_tokens += kl_T.cpu().tolist()
            agree += int(top_token_agreement(ref_TV, logits_TV).sum())
        if on_window is not None:
            on_window(stop - start)
    tokens = bounds[-1][1]
    result = EvalResult(tokens=tokens, windows=len(bounds), seq_len=config.seq_len, nll_sum=nll_sum,
                        kl_sum=kl_sum if reference_fn is not None else None,
                        agree=agree if reference_fn is not None else None, kl_tokens=kl_tokens)
    log.info("evaluated %d tokens in %d windows: mean NLL %.4f", tokens, len(bounds), result.mean_nll)
    return result
