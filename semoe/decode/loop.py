"""One sequence's generation loop, shared by the engine (`semoe.decode.generate.generate`, torch) and the
torch-free runner (`inference.torch_free.runner`): how the next token is chosen (`SamplingConfig`), when to stop
(a stop id emitted, or `max_new_tokens`), what each new token is handed to (`on_token`, for
streaming) and the timings (time to the first token, decode speed from it on). Each front-end gives
its first logits, its step and its chooser: the engine's draws with torch's generator
(`semoe.decode.generate.choose`), the torch-free one with numpy's (`choose`, below), from the same
distribution (temperature, then nucleus truncation); a seed repeats a front-end's draws, not the
other's.

This module imports no torch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np

Logits = TypeVar("Logits")


@dataclass(kw_only=True)
class SamplingConfig:
    """How the next token is chosen."""

    max_new_tokens: int
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # generation ends after emitting one of these

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.stop_ids = tuple(self.stop_ids)


@dataclass
class Generated:
    """The loop's tokens, each one's log-probability under the model, and its timings."""

    tokens: list[int]
    logprobs: list[float]
    ttft_s: float  # the loop's start (the prompt in) -> first token out
    decode_tok_s: float  # tokens per second after the first


def run(first: Callable[[], Logits], step: Callable[[int], Logits],
        choose: Callable[[Logits], tuple[int, float]], cfg: SamplingConfig,
        on_token: Callable[[int, float], None] | None = None, sync: Callable[[], None] | None = None) -> Generated:
    """Generate after a prompt: `first()` gives the logits after it (the prompt's pass), `step(token)`
    the logits after one more token, `choose(logits)` the next token and its log-probability;
    `on_token(id, logprob)` is called as each token is chosen, `sync()` waits for queued device work
    before a time is read."""
    t0 = time.perf_counter()
    logits = first()
    tokens: list[int] = []
    logprobs: list[float] = []
    t_first = None
    while True:
        token, lp = choose(logits)
        tokens.append(token)
        logprobs.append(lp)
        if on_token is not None:
            on_token(token, lp)
        if t_first is None:
            if sync is not None:
                sync()
            t_first = time.perf_counter()
        if len(tokens) == cfg.max_new_tokens or token in cfg.stop_ids:
            break
        logits = step(token)
    if sync is not None:
        sync()
    decode_s = time.perf_counter() - t_first
    return Generated(tokens, logprobs, t_first - t0,
                     (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else 0.0)


def probs(logits_V: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The sampling distribution of one row of logits, as `semoe.decode.generate.logits_to_probs`: softmax of
    logits / temperature in float32, then the smallest prefix of the most likely tokens whose mass
    reaches top_p (always the most likely one), renormalised."""
    z = logits_V.astype(np.float32) / np.float32(temperature)
    p = np.exp(z - z.max())
    p = (p / p.sum()).astype(np.float32)
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        sorted_p = p[order]
        drop = np.cumsum(sorted_p, dtype=np.float32) - sorted_p >= np.float32(top_p)
        kept = np.zeros_like(p)
        kept[order] = np.where(drop, np.float32(0), sorted_p)
        p = kept / kept.sum()
    return p


def choose(logits_V: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator) -> tuple[int, float]:
    """The next token of one sequence from its logits (V,): the argmax when greedy, else a draw from
    `probs` with `rng`; and its log-probability under the logits (before temperature and top-p)."""
    if cfg.greedy:
        token = int(np.argmax(logits_V))
    else:
        p = probs(logits_V, cfg.temperature, cfg.top_p).astype(np.float64)
        token = int(min(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"), len(p) - 1))
    m = float(logits_V.max())
    return token, float(logits_V[token]) - m - math.log(float(np.exp(logits_V - m).sum()))


@dataclass
class Speculated(Generated):
    """`Generated` by speculative decoding: also the verification passes run, the tokens drafted and
    those of them kept."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0


def run_speculative(first: Callable[[], Logits], verify: Callable[[list[int]], list[Logits]],
                    keep: Callable[[int], None], draft: Callable[[list[int], int], list[int]], k: int,
                    choose: Callable[[Logits], tuple[int, float]], cfg: SamplingConfig,
                    on_token: Callable[[int, float], None] | None = None) -> Speculated:
    """`run` with up to k tokens drafted a step and verified at once, greedy: `draft(tokens, n)` proposes up
    to n tokens to follow `tokens` (the ones generated so far); `verify(rows)` runs the last chosen token and
    the proposals at the sequence's next positions in one pass and gives each row's logits; `keep(n)` keeps
    the first n of those positions (the rest are undone). Row j's token is chosen from its logits and
    emitted; the pass stops at the first that differs from the proposal after it (the rows after were
    computed on a token that is not the sequence's), so the tokens are `run`'s, in fewer passes where the
    drafts are right."""
    if not cfg.greedy:
        raise ValueError("speculative decoding here is greedy: its drafts carry no probabilities to sample against")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    t0 = time.perf_counter()
    token, lp = choose(first())
    out = Speculated([token], [lp], 0.0, 0.0)
    if on_token is not None:
        on_token(token, lp)
    out.ttft_s = time.perf_counter() - t0
    t_first = time.perf_counter()
    done = cfg.max_new_tokens == 1 or token in cfg.stop_ids
    while not done:
        proposal = list(draft(out.tokens, min(k, cfg.max_new_tokens - len(out.tokens) - 1)))[:k]
        rows = verify([token, *proposal])
        out.passes += 1
        out.drafted += len(proposal)
        kept = 1
        for j, logits in enumerate(rows):
            token, lp = choose(logits)
            out.tokens.append(token)
            out.logprobs.append(lp)
            if on_token is not None:
                on_token(token, lp)
            done = len(out.tokens) == cfg.max_new_tokens or token in cfg.stop_ids
            if done or j == len(proposal) or token != proposal[j]:
                break
            kept += 1
        out.accepted += kept - 1
        keep(kept)
    decode_s = time.perf_counter() - t_first
    n = len(out.tokens)
    out.decode_tok_s = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
    return out


class PromptLookup:
    """Drafts by lookup, `run_speculative`'s `draft`: up to n tokens that followed the latest earlier
    occurrence of the sequence's last m tokens (m = `longest` down to 1; the sequence is `history`, the
    prompt, then the tokens generated), none where no suffix recurs. Text that repeats its context (code
    edits, quotes, summaries, a model caught in a loop) drafts right; other text drafts nothing and costs
    nothing. Each m-gram's latest start is indexed as the sequence grows: a draft costs the same at any
    length."""

    def __init__(self, history: list[int] = (), longest: int = 3) -> None:
        self.seq: list[int] = []
        self.longest, self.seen = longest, 0
        self.starts: dict[tuple[int, ...], int] = {}  # m-gram -> its latest start with a token after it
        self._extend(history)

    def _extend(self, tokens) -> None:
        for t in tokens:
            n = len(self.seq)  # the m-grams ending at n - 1 now have a token after them
            for m in range(1, min(self.longest, n) + 1):
                self.starts[tuple(self.seq[n - m:n])] = n - m
            self.seq.append(t)

    def __call__(self, tokens: list[int], n: int) -> list[int]:
        """Up to n tokens to follow `tokens`, the generated ones so far (each call's extend the last's)."""
        self._extend(tokens[self.seen:])
        self.seen = len(tokens)
        seq = self.seq
        for m in range(min(self.longest, len(seq)), 0, -1):
            start = self.starts.get(tuple(seq[len(seq) - m:]))
            if start is not None:
                return seq[start + m:start + m + n]
        return []


def prompt_lookup(tokens: list[int], n: int, history: list[int] = (), longest: int = 3) -> list[int]:
    """`PromptLookup`'s draft for `tokens` after `history`, made afresh."""
    return PromptLookup(history, longest)(tokens, n)


class Paying:
    """`run_speculative`'s draft that drafts only while drafting pays: the passes with drafts and those
    without (plain steps: the draft asked for none) are timed per token they emit, in turns (`probe`
    passes of each, then `hold` passes of the faster, then again; held twice as long each turn the same
    kind wins, up to 16 `hold`s), so a drafter whose tokens are seldom kept (or whose union of experts costs
    more than the passes it saves) costs the probes alone, fewer and fewer.
    The wall time from one call to the next is the pass the call drafted for (its draft, its
    verification, keeping); `draft(tokens, 0)` is still called on plain passes, so a drafter that must
    see every row (`inference.torch_free.mtp.Drafter`) keeps up. `turn` alone (no `draft`) decides a
    server's steps, timed by the tokens all its requests emit."""

    def __init__(self, draft: Callable[[list[int], int], list[int]] | None, probe: int = 4, hold: int = 32,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.draft, self.probe, self.hold, self.clock = draft, probe, hold, clock
        self.plan = ["draft"] * probe + ["plain"] * probe  # the passes ahead, by kind
        self.rate = {"draft": [0.0, 0], "plain": [0.0, 0]}  # this turn's seconds and tokens, by kind
        self.last: tuple[str, float, int] | None = None  # the last call's kind, time and tokens so far
        self.passes = {"draft": 0, "plain": 0}
        self.best, self.held = None, hold  # the last turn's faster kind, and how long it is held

    def turn(self, made: int) -> bool:
        """Whether the pass about to run drafts; `made`: the tokens emitted so far (a server's, all its
        requests'), the last pass's made the difference since the last call."""
        now = self.clock()
        if self.last is not None:
            kind, t0, n0 = self.last
            self.rate[kind][0] += now - t0
            self.rate[kind][1] += made - n0
        if not self.plan:  # a turn done: hold the faster, then probe both again
            s = {k: sec / got if got else math.inf for k, (sec, got) in self.rate.items()}
            best = "draft" if s["draft"] < s["plain"] else "plain"
            if best == self.best:  # the same again: probe half as often (up to 16 holds apart)
                self.held = min(2 * self.held, 16 * self.hold)
            else:
                self.best, self.held = best, self.hold
            self.plan = [best] * self.held + ["draft"] * self.probe + ["plain"] * self.probe
            self.rate = {"draft": [0.0, 0], "plain": [0.0, 0]}
        kind = self.plan.pop(0)
        self.passes[kind] += 1
        self.last = (kind, now, made)
        return kind == "draft"

    def __call__(self, tokens: list[int], n: int) -> list[int]:
        return self.draft(tokens, n if self.turn(len(tokens)) else 0)
