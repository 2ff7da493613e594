"""An OpenAI-compatible HTTP server for one `Engine`: /v1/completions, /v1/chat/completions,
/v1/models, /health and /metrics.

Requests are checked on the event loop, then queued for one worker thread that runs
`engine.generate` (the engine is one model: one request computes at a time). Tokens cross back to
the event loop through `loop.call_soon_threadsafe` into the request's asyncio.Queue.

Extensions to the OpenAI format: each choice (and each streamed chunk) carries `token_ids`, the ids
generated; `logprobs` hold the chosen tokens' log-probabilities only (`top_logprobs` is null/empty:
alternatives are not computed). Sampling is greedy unless `temperature` > 0.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.chat import ROLES, ChatTemplate, ChatTemplateError
from semoe.generate import SamplingConfig

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5  # how often a request waiting for the engine checks whether its client left
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_MAX_STOPS = 4  # as OpenAI
_MAX_SEED = 2**63
# Engine offload stats exported as gauges `semoe_offload_<key>` (absent for resident engines).
OFFLOAD_STATS = ("gpu_hit_rate", "cpu_hit_rate", "ssd_bytes_per_token", "device_copy_bytes_per_token",
                 "ideal_bytes_per_token", "prefetch_precision", "prefetch_recall")


# -- errors and request parsing ---------------------------------------------------------------

class APIError(Exception):
    """A request that fails, answered as OpenAI does: `{"error": {message, type, param}}`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type

    def response(self) -> JSONResponse:
        """The JSON error response."""
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": None}}, status_code=self.status)


@dataclass(kw_only=True)
class GenRequest:
    """A checked request: what to generate and how to answer."""

    chat: bool
    prompt_ids: list[int]
    sampling: SamplingConfig
    stops: tuple[str, ...] = ()  # stop strings: the text is cut before the first one produced
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


_JSON_TYPES: dict[str, tuple[type, ...]] = {"integer": (int,), "number": (int, float), "boolean": (bool,),
                                            "string": (str,), "array": (list,), "object": (dict,)}


def _field(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """`body[name]` checked against a JSON type; absent or null gives `default`."""
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass in Python, but `true` is not a number in JSON
    if not isinstance(value, _JSON_TYPES[kind]) or (isinstance(value, bool) and kind != "boolean"):
        raise APIError(f"{name} must be a {kind}, got {json.dumps(value)}", param=name)
    return value


def _prompt_ids(value: Any, engine, *, param: str) -> list[int]:
    """Token ids of a prompt given as text or as ids, checked against the vocabulary."""
    tok = engine.tokenizer
    if isinstance(value, str):
        if tok is None:
            raise APIError(f"{param}: this model has no tokenizer; give the prompt as a list of token ids",
                           param=param)
        ids = tok.encode(value, add_bos=tok.add_bos_default)
    elif isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        ids = list(value)
    else:
        raise APIError(f"{param} must be a string or a list of token ids (one prompt per request)", param=param)
    if not ids:
        raise APIError(f"{param} is empty: give at least one token", param=param)
    vocab = engine.model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise APIError(f"{param}: token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})", param=param)
    return ids


def _stops(body: dict, engine) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and stops and all(isinstance(s, str) and s for s in stops)):
        raise APIError("stop must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stops) > _MAX_STOPS:
        raise APIError(f"stop: at most {_MAX_STOPS} strings, got {len(stops)}", param="stop")
    if engine.tokenizer is None:
        raise APIError("stop: this model has no tokenizer, so its output has no text to match", param="stop")
    return tuple(stops)


def _sampling(body: dict, engine, prompt: list[int], *, prompt_param: str, max_tokens: int | None
              ) -> SamplingConfig:
    """Sampling fields shared by both endpoints; `max_tokens` None means the rest of the context."""
    if _field(body, "n", "integer", 1) != 1:
        raise APIError("n must be 1: one completion per request", param="n")
    max_position = engine.model.config.max_position
    room = max_position - len(prompt)
    if room < 1:
        raise APIError(f"{prompt_param}: {len(prompt)} tokens leave no room in the model's context of "
                       f"{max_position}", param=prompt_param)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < 1:
        raise APIError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    elif max_tokens > room:
        raise APIError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                       f"of {max_position} tokens", param="max_tokens")
    temperature = _field(body, "temperature", "number", 0.0)
    if not temperature >= 0:  # written so that NaN fails too
        raise APIError(f"temperature must be >= 0, got {temperature}", param="temperature")
    top_p = _field(body, "top_p", "number", 1.0)
    if not 0 < top_p <= 1:
        raise APIError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    seed = _field(body, "seed", "integer", 0)
    if not 0 <= seed < _MAX_SEED:
        raise APIError(f"seed must be in [0, 2**63), got {seed}", param="seed")
    return SamplingConfig(max_new_tokens=max_tokens, greedy=temperature == 0,
                          temperature=temperature if temperature > 0 else 1.0, top_p=top_p, seed=seed,
                          stop_ids=engine.stop_ids())


def _stream_fields(body: dict) -> tuple[bool, bool]:
    stream = _field(body, "stream", "boolean", False)
    options = _field(body, "stream_options", "object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError("stream_options.include_usage must be a boolean", param="stream_options")
    return stream, include_usage


def parse_completion(body: dict, engine) -> GenRequest:
    """A /v1/completions body, checked; APIError names the first bad field."""
    if "prompt" not in body:
        raise APIError("prompt is required", param="prompt")
    if body.get("echo") not in (None, False):
        raise APIError("echo is not supported", param="echo")
    if body.get("suffix") not in (None, ""):
        raise APIError("suffix is not supported", param="suffix")
    if _field(body, "best_of", "integer", 1) != 1:
        raise APIError("best_of must be 1", param="best_of")
    prompt = _prompt_ids(body["prompt"], engine, param="prompt")
    logprobs = _field(body, "logprobs", "integer")
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise APIError(f"logprobs must be in [0, 5], got {logprobs}", param="logprobs")
    stream, include_usage = _stream_fields(body)
    sampling = _sampling(body, engine, prompt, prompt_param="prompt",
                         max_tokens=_field(body, "max_tokens", "integer", 16))
    return GenRequest(chat=False, prompt_ids=prompt, sampling=sampling, stops=_stops(body, engine),
                      logprobs=logprobs is not None, stream=stream, include_usage=include_usage)


def _messages(value: Any) -> list[dict[str, str]]:
    """Messages as {role, content} with text content; content parts of type "text" are joined."""
    if not isinstance(value, list) or not value:
        raise APIError("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"{where} must be an object with role and content", param=where)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise APIError(f"{where}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                           param=f"{where}.role")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise APIError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
        out.append({"role": role, "content": content})
    return out


def parse_chat(body: dict, engine, template: ChatTemplate) -> GenRequest:
    """A /v1/chat/completions body, checked and rendered with the chat template."""
    if "messages" not in body:
        raise APIError("messages is required", param="messages")
    messages = _messages(body["messages"])
    if engine.tokenizer is None:
        raise APIError("this model has no tokenizer, so it cannot take chat messages; use /v1/completions "
                       "with token ids", param="messages")
    try:
        ids = template.encode(engine.tokenizer, messages)
    except ChatTemplateError as e:
        raise APIError(str(e), param="messages") from e
    prompt = _prompt_ids(ids, engine, param="messages")
    if _field(body, "top_logprobs", "integer", 0) < 0:
        raise APIError("top_logprobs must be >= 0", param="top_logprobs")
    stream, include_usage = _stream_fields(body)
    max_tokens = _field(body, "max_completion_tokens", "integer", _field(body, "max_tokens", "integer"))
    sampling = _sampling(body, engine, prompt, prompt_param="messages", max_tokens=max_tokens)
    return GenRequest(chat=True, prompt_ids=prompt, sampling=sampling, stops=_stops(body, engine),
                      logprobs=_field(body, "logprobs", "boolean", False), stream=stream,
                      include_usage=include_usage)


# -- text as it is generated --------------------------------------------------------------------

class TextAssembler:
    """Detokenises a growing list of ids, cuts at the first stop string, and says which new text is
    safe to stream: text that could still turn into a stop string, or an incomplete UTF-8 character
    (U+FFFD at the end), is held back until the next token settles it."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._ids: list[int] = []
        self.text = ""  # all text so far (cut at the stop string once one is found)
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Take one token; returns the text that may be streamed now. Sets `stopped` at a stop string."""
        self._ids.append(token_id)
        self.text = self._decode(self._ids)
        hits = [i for i in (self.text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held())

    def finish(self) -> str:
        """Whatever was held back, once generation has ended."""
        return self._take(len(self.text))

    def _held(self) -> int:
        """Characters at the end of `text` that must wait."""
        if self.text.endswith("\ufffd"):
            return len(self.text) - len(self.text.rstrip("\ufffd"))
        held = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def _take(self, upto: int) -> str:
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out


# -- metrics ---------------------------------------------------------------------------------

class ServerMetrics:
    """Prometheus metrics of one server, in their own registry (several servers may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("semoe_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("semoe_prompt_tokens", "prompt tokens processed", registry=r)
        self.generated_tokens = Counter("semoe_generated_tokens", "tokens generated", registry=r)
        self.generation_seconds = Counter("semoe_generation_seconds", "wall time spent generating", registry=r)
        self.cancelled = Counter("semoe_cancelled_requests", "generations stopped because the client left",
                                 registry=r)
        self.failed = Counter("semoe_failed_generations", "generations that raised an error", registry=r)
        self.queue_depth = Gauge("semoe_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("semoe_requests_running", "requests generating now (0 or 1)", registry=r)
        self.last_tok_s = Gauge("semoe_last_request_tokens_per_second",
                                "decode speed of the last request (tokens after the first / their time)", registry=r)
        self.last_ttft = Gauge("semoe_last_request_ttft_seconds", "time to first token of the last request",
                               registry=r)
        self.overall_tok_s = Gauge("semoe_tokens_per_second", "tokens generated / generation seconds, all requests",
                                   registry=r)
        self.peak_rss = Gauge("semoe_peak_rss_bytes", "peak resident memory of the server process", registry=r)
        self.offload = {k: Gauge(f"semoe_offload_{k}", f"engine offload stat {k} of the last request", registry=r)
                        for k in OFFLOAD_STATS}
        self._tokens = 0
        self._seconds = 0.0

    def observe(self, *, prompt_tokens: int, tokens: int, seconds: float, ttft_s: float, decode_tok_s: float,
                stats: dict) -> None:
        """Record one finished generation (called from the worker thread only)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(tokens)
        self.generation_seconds.inc(seconds)
        self._tokens += tokens
        self._seconds += seconds
        self.overall_tok_s.set(self._tokens / self._seconds if self._seconds > 0 else 0.0)
        self.last_tok_s.set(decode_tok_s)
        self.last_ttft.set(ttft_s)
        for k, gauge in self.offload.items():
            if stats.get(k) is not None:
                gauge.set(float(stats[k]))
        if stats.get("peak_rss_bytes") is not None:
            self.peak_rss.set(stats["peak_rss_bytes"])


# -- the worker thread ------------------------------------------------------------------------

@dataclass(kw_only=True)
class TokenEvent:
    """One generated token and the text it releases (possibly empty)."""

    token_id: int
    logprob: float
    text: str


@dataclass(kw_only=True)
class DoneEvent:
    """The end of a generation."""

    tokens: list[int]
    logprobs: list[float]
    text: str
    tail: str  # text not yet streamed (held back until the end)
    finish_reason: str  # "stop" | "length"


@dataclass(kw_only=True)
class ErrorEvent:
    """Generation raised; the message goes to this request's client only."""

    message: str


class QueueFullError(Exception):
    """More requests are waiting than the server admits."""


class _Cancelled(Exception):
    """Raised inside `on_token` to end a generation whose client has left."""


class _StopString(Exception):
    """Raised inside `on_token` to end a generation that produced a stop string."""


@dataclass(kw_only=True, eq=False)
class Job:
    """One request on its way through the worker; events go back to `loop` through `events`."""

    request: GenRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def post(self, event: TokenEvent | DoneEvent | ErrorEvent) -> None:
        """Hand an event to the event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            self.cancelled.set()


class GenerationWorker:
    """One thread that runs queued jobs on the engine, oldest first; at most `max_queue` may wait."""

    def __init__(self, engine, metrics: ServerMetrics, *, max_queue: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._pending: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._current: Job | None = None  # the job generating now
        self._thread = threading.Thread(target=self._run, name="semoe-generate", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFullError when `max_queue` are already waiting."""
        with self._cv:
            if self._closing:
                raise QueueFullError("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFullError(f"the request queue is full ({len(self._pending)} waiting); retry later")
            self._pending.append(job)
            self.metrics.queue_depth.set(len(self._pending))
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Give up a job whose client has left: a waiting one leaves the queue (freeing its place), a
        running one stops at its next token."""
        with self._cv:
            job.cancelled.set()
            if job in self._pending:
                self._pending.remove(job)
                self.metrics.queue_depth.set(len(self._pending))
                self.metrics.cancelled.inc()

    @property
    def waiting(self) -> int:
        """Jobs queued, not yet started."""
        return len(self._pending)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Answer waiting jobs with an error, stop the running one at its next token, join the thread."""
        with self._cv:
            self._closing = True
            for job in self._pending:
                job.cancelled.set()
                job.post(ErrorEvent(message="the server is shutting down"))
            self._pending.clear()
            self.metrics.queue_depth.set(0)
            self._cv.notify()
        current = self._current
        if current is not None:
            current.cancelled.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the generation thread did not stop within %.0f s", timeout_s)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                job = self._pending.popleft()
                self.metrics.queue_depth.set(len(self._pending))
            self._current = job
            self.metrics.running.set(1)
            try:
                self._execute(job)
            finally:
                self.metrics.running.set(0)
                self._current = None

    def _execute(self, job: Job) -> None:
        req = job.request
        tok = self.engine.tokenizer
        text = TextAssembler(tok.decode if tok is not None else (lambda ids: ""), req.stops)
        tokens: list[int] = []
        logprobs: list[float] = []
        t0 = time.perf_counter()
        t_first: float | None = None

        def on_token(token_id: int, logprob: float) -> None:
            nonlocal t_first
            if job.cancelled.is_set():
                raise _Cancelled
            t_first = t_first or time.perf_counter()
            tokens.append(token_id)
            logprobs.append(logprob)
            delta = text.add(token_id)
            if req.stream:
                job.post(TokenEvent(token_id=token_id, logprob=logprob, text=delta))
            if text.stopped:
                raise _StopString

        stats: dict = {}
        try:
            stats = self.engine.generate(req.prompt_ids, req.sampling, on_token=on_token).stats
            finish = "stop" if tokens and tokens[-1] in req.sampling.stop_ids else "length"
        except _StopString:
            finish = "stop"
        except _Cancelled:
            self.metrics.cancelled.inc()
            log.info("client left: generation stopped after %d tokens", len(tokens))
            return
        except Exception as e:  # noqa: BLE001 - any failure is this request's alone; the server keeps serving
            self.metrics.failed.inc()
            log.exception("generation failed")
            job.post(ErrorEvent(message=f"generation failed: {type(e).__name__}: {e}"))
            return
        t_end = time.perf_counter()
        first = t_first if t_first is not None else t_end
        decode_s = t_end - first
        self.metrics.observe(prompt_tokens=len(req.prompt_ids), tokens=len(tokens), seconds=t_end - t0,
                             ttft_s=first - t0, decode_tok_s=(len(tokens) - 1) / decode_s if decode_s > 0 else 0.0,
                             stats=stats)
        tail = text.finish()
        job.post(DoneEvent(tokens=tokens, logprobs=logprobs, text=text.text, tail=tail, finish_reason=finish))


# -- response bodies --------------------------------------------------------------------------

def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Reply:
    """Builds the JSON objects of one request's answer, completion or chat."""

    def __init__(self, req: GenRequest, model: str, token_text: Callable[[int], str]) -> None:
        self.req = req
        self.model = model
        self.token_text = token_text
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offset = 0  # characters of token text before the next logprobs entry (text_offset)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, tokens: list[int], logprobs: list[float]) -> dict | None:
        if not self.req.logprobs:
            return None
        strs = [self.token_text(t) for t in tokens]
        if self.req.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                for s, lp in zip(strs, logprobs)]}
        offsets = []
        for s in strs:
            offsets.append(self._offset)
            self._offset += len(s)
        return {"tokens": strs, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}

    def full(self, done: DoneEvent) -> dict:
        """The non-streamed answer."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "token_ids": done.tokens,
                                  "logprobs": self._logprobs(done.tokens, done.logprobs)}
        if self.req.chat:
            choice["message"] = {"role": "assistant", "content": done.text}
        else:
            choice["text"] = done.text
        return {**self._head("chat.completion" if self.req.chat else "text_completion"), "choices": [choice],
                "usage": _usage(len(self.req.prompt_ids), len(done.tokens))}

    def chunk(self, *, text: str | None = None, token_ids: tuple[int, ...] = (), logprobs: tuple[float, ...] = (),
              finish_reason: str | None = None, role: bool = False) -> dict:
        """One streamed chunk."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "token_ids": list(token_ids),
                                  "logprobs": self._logprobs(list(token_ids), list(logprobs)) if token_ids else None}
        if self.req.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = {**self._head("chat.completion.chunk" if self.req.chat else "text_completion"), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, done: DoneEvent) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        return {**self._head("chat.completion.chunk" if self.req.chat else "text_completion"), "choices": [],
                "usage": _usage(len(self.req.prompt_ids), len(done.tokens))}


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


# -- the application --------------------------------------------------------------------------

class _CountRequests:
    """ASGI middleware: counts every answered HTTP request by endpoint and status (streams included)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"  # bounded label values
        status = 500

        async def send_counting(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


async def _next_event(job: Job, request: Request, worker: GenerationWorker
                      ) -> TokenEvent | DoneEvent | ErrorEvent | None:
    """The job's next event; None (and the job cancelled) when the client has disconnected meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=_DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                worker.cancel(job)
                return None


def create_app(engine, *, max_queue: int = 64, chat_template: ChatTemplate | None = None) -> FastAPI:
    """The FastAPI application serving `engine`; `chat_template` defaults to the fallback template
    (load a model's own with `inference.chat.load_chat_template`)."""
    if not isinstance(max_queue, int) or max_queue < 0:
        raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
    template = chat_template or ChatTemplate.default()
    metrics = ServerMetrics()
    worker = GenerationWorker(engine, metrics, max_queue=max_queue)
    started = int(time.time())
    tok = engine.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="semoe", lifespan=lifespan)
    app.state.metrics = metrics
    app.state.worker = worker
    app.add_middleware(_CountRequests, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        # OpenAI clients expect 400 with an error object, not FastAPI's 422
        err = (e.errors() or [{}])[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        return APIError(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid request')}",
                        param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return APIError(str(e.detail), status=e.status_code, type="not_found_error" if e.status_code == 404
                        else "invalid_request_error").response()

    async def answer(request: Request, req: GenRequest) -> Response:
        job = Job(request=req, loop=asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFullError as e:
            raise APIError(str(e), status=503, type="server_overloaded") from None
        reply = _Reply(req, engine.name, lambda t: tok.decode([t]) if tok is not None else "")
        event = await _next_event(job, request, worker)
        if event is None:
            return Response(status_code=499)  # nobody reads it; the status only reaches the metrics
        if isinstance(event, ErrorEvent):
            raise APIError(event.message, status=500, type="server_error")
        if not req.stream:
            return JSONResponse(reply.full(event))
        return StreamingResponse(_stream(job, event, reply, worker), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, parse_completion(await _json_body(request), engine))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer(request, parse_chat(await _json_body(request), engine, template))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": started,
                                            "owned_by": "semoe",
                                            "max_model_len": engine.model.config.max_position}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": engine.name, "queue_depth": worker.waiting}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _stream(job: Job, first: TokenEvent | DoneEvent | ErrorEvent, reply: _Reply,
                  worker: GenerationWorker) -> AsyncIterator[str]:
    """Server-sent events of one request, ending with `data: [DONE]`. Leaving early (the client
    disconnected) cancels the generation."""
    try:
        if reply.req.chat:
            yield _sse(reply.chunk(text="", role=True))
        event = first
        while True:
            if isinstance(event, TokenEvent):
                yield _sse(reply.chunk(text=event.text, token_ids=(event.token_id,), logprobs=(event.logprob,)))
            elif isinstance(event, DoneEvent):
                if event.tail:
                    yield _sse(reply.chunk(text=event.tail))
                yield _sse(reply.chunk(text=None if reply.req.chat else "", finish_reason=event.finish_reason))
                if reply.req.include_usage:
                    yield _sse(reply.usage_chunk(event))
                break
            else:  # the status line has gone out already: report in the stream, as OpenAI does
                yield _sse({"error": {"message": event.message, "type": "server_error", "param": None,
                                      "code": None}})
                break
            event = await job.events.get()
        yield _sse("[DONE]")
    finally:
        worker.cancel(job)  # a no-op once the generation has ended


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port); OSError when it is taken."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def url_of(sock: socket.socket) -> str:
    """http://host:port of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(engine, host: str = "127.0.0.1", port: int = 8000, *, max_queue: int = 64,
          chat_template: ChatTemplate | None = None, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve `engine` until interrupted (Ctrl-C shuts down gracefully); `on_ready(url)` once bound."""
    sock = bind_socket(host, port)
    app = create_app(engine, max_queue=max_queue, chat_template=chat_template)
    config = uvicorn.Config(app, log_level=logging.getLogger().getEffectiveLevel(), access_log=False,
                            timeout_graceful_shutdown=5)
    if on_ready is not None:
        on_ready(url_of(sock))
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
