"""What the scheduler sends back to a request's answer, one event at a time: a token, the end of the
generation, or an error. Its own module, below both the scheduler that makes them and the wire format
(`openai_protocol`) and server that read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TokenEvent:
    """One generated token and the text it releases (possibly empty)."""

    token_id: int
    logprob: float
    text: str
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens there, where the request asks


@dataclass(kw_only=True)
class DoneEvent:
    """The end of a generation."""

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...]]  # per token, where the request asks (else empty)
    text: str
    tail: str  # text not yet streamed (held back until the end)
    finish_reason: str  # "stop" | "length"


@dataclass(kw_only=True)
class ErrorEvent:
    """Generation raised, or the server is stopping; the message goes to this request's client only."""

    message: str
    status: int = 500  # the answer's HTTP status where it has not begun: 503 when the server is stopping
