"""The OpenAI wire format of the server: request bodies checked into a `GenRequest` (or an
`APIError` naming the bad field) and the JSON answers and stream chunks built back.

Extensions to the OpenAI format: each choice (and each streamed chunk) carries `token_ids`, the ids
generated; requests may give `stop_token_ids` (more ids that end generation) and `ignore_eos` (the
model's end-of-sequence ids do not, for benchmarks). `logprobs` hold the chosen tokens'
log-probabilities and, where asked (`logprobs: k` of a completion, `top_logprobs: k` of a chat), the
k most likely tokens at each position with theirs. `n` > 1 asks for several completions of one
prompt: each is a request of the batch of its own, choice i sampling with `seed` + i. Sampling is
greedy unless `temperature` > 0; without a `seed` each request draws its own. A field the server
does not implement gets 400 naming it, unless it holds the value that asks for nothing (a penalty
of 0, no tools).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from inference.chat_template import ROLES, ChatTemplate, ChatTemplateError
from inference.serving.scheduler_events import DoneEvent
from semoe.decode.loop import SamplingConfig

_MAX_STOPS = 4  # as OpenAI
_MAX_SEED = 2**63
_MAX_N = 16  # choices of one request: each takes a place in the batch
_MAX_TOP = {False: 5, True: 20}  # alternatives per position: a completion's `logprobs`, a chat's `top_logprobs`

# The request fields each endpoint implements. Any other field is refused by name (a client that asks
# for tools, a response format or penalties must not get an answer that silently ignored them), except
# where it holds the value that asks for nothing: a penalty of 0, no logit bias, no tools.
_COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                            "logprobs", "stop", "seed", "user", "stop_token_ids", "ignore_eos"})
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
_NEUTRAL = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
            "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
            "response_format": ({"type": "text"},), "parallel_tool_calls": (), "store": (False,),
            "metadata": ({},), "echo": (False,), "suffix": ("",), "best_of": (1,),
            "top_logprobs": (0,)}  # a completion's alternatives are asked for with `logprobs: k`


# -- errors and request parsing ---------------------------------------------------------------

class APIError(Exception):
    """A request that fails, answered as OpenAI does: `{"error": {message, type, param}}`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.headers = message, status, param, type, headers

    def response(self) -> JSONResponse:
        """The JSON error response."""
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": None}}, status_code=self.status, headers=self.headers)


@dataclass(kw_only=True)
class GenRequest:
    """A checked request: what to generate and how to answer."""

    chat: bool
    prompt_ids: list[int]
    sampling: SamplingConfig
    stops: tuple[str, ...] = ()  # stop strings: the text is cut before the first one produced
    logprobs: bool = False
    top_logprobs: int = 0  # the most likely tokens at each position, with their log-probabilities
    max_tokens_set: bool = True  # False: max_tokens was not given (the rest of the context; a KV budget caps it)
    n: int = 1  # completions of the prompt; choice i samples with seed + i (`choice`)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


_JSON_TYPES: dict[str, tuple[type, ...]] = {"integer": (int,), "number": (int, float), "boolean": (bool,),
                                            "string": (str,), "array": (list,), "object": (dict,)}


def _only_implemented(body: dict, fields: frozenset[str]) -> None:
    """APIError naming the first field of `body` this endpoint does not implement."""
    for name, value in body.items():
        if name in fields or value is None or value in _NEUTRAL.get(name, ()):
            continue
        raise APIError(f"{name} is not supported by this server" + (
            f" (only {json.dumps(_NEUTRAL[name][0])} is accepted)" if _NEUTRAL.get(name) else ""), param=name)


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
    vocab = engine.model_config.vocab_size
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
    max_position = engine.model_config.max_position
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
    seed = _field(body, "seed", "integer")
    if seed is None:  # each request its own draw, as OpenAI's; give a seed to repeat one
        seed = secrets.randbelow(_MAX_SEED)
    elif not 0 <= seed < _MAX_SEED:
        raise APIError(f"seed must be in [0, 2**63), got {seed}", param="seed")
    extra = _field(body, "stop_token_ids", "array", [])
    vocab = engine.model_config.vocab_size
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in extra):
        raise APIError(f"stop_token_ids must be a list of token ids in 0..{vocab - 1}", param="stop_token_ids")
    ignore_eos = _field(body, "ignore_eos", "boolean", False)
    stop_ids = tuple(dict.fromkeys((() if ignore_eos else engine.stop_ids()) + tuple(extra)))
    return SamplingConfig(max_new_tokens=max_tokens, greedy=temperature == 0,
                          temperature=temperature if temperature > 0 else 1.0, top_p=top_p, seed=seed,
                          stop_ids=stop_ids)


def _choices(body: dict) -> int:
    n = _field(body, "n", "integer", 1)
    if not 1 <= n <= _MAX_N:
        raise APIError(f"n must be in [1, {_MAX_N}], got {n}", param="n")
    return n


def choice(req: GenRequest, index: int) -> GenRequest:
    """Choice `index` of a request as a request of its own: one completion, sampled with the
    request's seed + index."""
    return dataclasses.replace(req, n=1, sampling=dataclasses.replace(
        req.sampling, seed=(req.sampling.seed + index) % _MAX_SEED))


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
    _only_implemented(body, _COMPLETION_FIELDS)
    prompt = _prompt_ids(body["prompt"], engine, param="prompt")
    logprobs = _field(body, "logprobs", "integer")
    if logprobs is not None and not 0 <= logprobs <= _MAX_TOP[False]:
        raise APIError(f"logprobs must be in [0, {_MAX_TOP[False]}], got {logprobs}", param="logprobs")
    stream, include_usage = _stream_fields(body)
    sampling = _sampling(body, engine, prompt, prompt_param="prompt",
                         max_tokens=_field(body, "max_tokens", "integer", 16))
    return GenRequest(chat=False, prompt_ids=prompt, sampling=sampling, stops=_stops(body, engine),
                      logprobs=logprobs is not None, top_logprobs=logprobs or 0, n=_choices(body), stream=stream,
                      include_usage=include_usage)


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
    _only_implemented(body, _CHAT_FIELDS)
    messages = _messages(body["messages"])
    if engine.tokenizer is None:
        raise APIError("this model has no tokenizer, so it cannot take chat messages; use /v1/completions "
                       "with token ids", param="messages")
    try:
        ids = template.encode(engine.tokenizer, messages)
    except ChatTemplateError as e:
        raise APIError(str(e), param="messages") from e
    prompt = _prompt_ids(ids, engine, param="messages")
    stream, include_usage = _stream_fields(body)
    max_tokens = _field(body, "max_completion_tokens", "integer", _field(body, "max_tokens", "integer"))
    sampling = _sampling(body, engine, prompt, prompt_param="messages", max_tokens=max_tokens)
    logprobs = _field(body, "logprobs", "boolean", False)
    top = _field(body, "top_logprobs", "integer", 0)
    if not 0 <= top <= _MAX_TOP[True]:
        raise APIError(f"top_logprobs must be in [0, {_MAX_TOP[True]}], got {top}", param="top_logprobs")
    if top and not logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    return GenRequest(chat=True, prompt_ids=prompt, sampling=sampling, stops=_stops(body, engine),
                      logprobs=logprobs, top_logprobs=top, n=_choices(body), stream=stream,
                      include_usage=include_usage, max_tokens_set=max_tokens is not None)


# -- response bodies --------------------------------------------------------------------------

def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Reply:
    """Builds the JSON objects of one request's answer, completion or chat, with its `n` choices."""

    def __init__(self, req: GenRequest, model: str, token_text: Callable[[int], str]) -> None:
        self.req = req
        self.model = model
        self.token_text = token_text
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offsets = [0] * req.n  # per choice: characters of token text before its next logprobs entry

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, index: int, tokens: list[int], logprobs: list[float],
                  tops: list[tuple[tuple[int, float], ...]]) -> dict | None:
        if not self.req.logprobs:
            return None
        strs = [self.token_text(t) for t in tokens]
        tops = tops or [()] * len(tokens)
        if self.req.chat:
            def entry(s: str, lp: float) -> dict:
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            return {"content": [{**entry(s, lp), "top_logprobs": [entry(self.token_text(t), tlp) for t, tlp in top]}
                                for s, lp, top in zip(strs, logprobs, tops)]}
        offsets = []
        for s in strs:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(s)
        top_logprobs = [{self.token_text(t): tlp for t, tlp in top} for top in tops] \
            if self.req.top_logprobs else None
        return {"tokens": strs, "token_logprobs": logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}

    def full(self, done: list[DoneEvent]) -> dict:
        """The non-streamed answer: choice i from `done[i]`."""
        choices = []
        for i, d in enumerate(done):
            choice: dict[str, Any] = {"index": i, "finish_reason": d.finish_reason, "token_ids": d.tokens,
                                      "logprobs": self._logprobs(i, d.tokens, d.logprobs, d.top_logprobs)}
            if self.req.chat:
                choice["message"] = {"role": "assistant", "content": d.text}
            else:
                choice["text"] = d.text
            choices.append(choice)
        return {**self._head("chat.completion" if self.req.chat else "text_completion"), "choices": choices,
                "usage": self._usage(done)}

    def _usage(self, done: list[DoneEvent]) -> dict:
        return _usage(len(self.req.prompt_ids), sum(len(d.tokens) for d in done))

    def chunk(self, *, index: int = 0, text: str | None = None, token_ids: tuple[int, ...] = (),
              logprobs: tuple[float, ...] = (), tops: tuple[tuple[tuple[int, float], ...], ...] = (),
              finish_reason: str | None = None, role: bool = False) -> dict:
        """One streamed chunk of choice `index`."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "token_ids": list(token_ids),
                                  "logprobs": self._logprobs(index, list(token_ids), list(logprobs), list(tops))
                                  if token_ids else None}
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

    def usage_chunk(self, done: list[DoneEvent]) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage of them all."""
        return {**self._head("chat.completion.chunk" if self.req.chat else "text_completion"), "choices": [],
                "usage": self._usage(done)}


def sse(obj: dict | str) -> str:
    """One server-sent event: a JSON object, or a bare string such as `[DONE]`."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
