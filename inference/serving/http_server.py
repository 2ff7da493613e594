"""An OpenAI-compatible HTTP server for one `Engine`: /v1/completions, /v1/chat/completions,
/v1/models, /health (live), /ready (taking requests) and /metrics.

Requests are checked on the event loop, then queued for the batch scheduler's thread
(`inference.serving.batch_scheduler`), which decodes every running request together, one packed forward a step.
Tokens cross back to the event loop through `loop.call_soon_threadsafe` into the request's
asyncio.Queue.

The OpenAI wire format (checking request bodies, building answers and stream chunks) lives in
`inference.serving.openai_protocol`; this module is the HTTP app and the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import aiofiles
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.chat_template import ChatTemplate
from inference.serving.openai_protocol import APIError, GenRequest, Reply, choice, parse_chat, parse_completion, sse
from inference.serving.scheduler_events import DoneEvent, ErrorEvent, TokenEvent
from inference.serving.batch_scheduler import BatchScheduler, Job, KVMemoryError, QueueFullError, ServerStoppingError
from inference.serving.serve_config import ServeConfig

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5  # how often a request waiting for the engine checks whether its client left
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics")
RETRY_AFTER_S = 1  # what a request refused for a full queue is told to wait (`Retry-After`)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Engine offload stats exported as gauges `semoe_offload_<key>` (absent for resident engines).
OFFLOAD_STATS = ("ring_hit_rate", "cpu_hit_rate", "ssd_bytes_per_token", "device_copy_bytes_per_token",
                 "ideal_bytes_per_token", "prefetch_precision", "prefetch_recall")


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
        self.running = Gauge("semoe_requests_running", "requests in the batch now (admitted, not finished)",
                             registry=r)
        self.batch = Histogram("semoe_batch_requests", "requests in one step's packed forward",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.last_tok_s = Gauge("semoe_last_request_tokens_per_second",
                                "decode speed of the last request (tokens after the first / their time)", registry=r)
        self.last_ttft = Gauge("semoe_last_request_ttft_seconds",
                               "time to first token of the last request (from its arrival)",
                               registry=r)
        self.overall_tok_s = Gauge("semoe_tokens_per_second", "tokens generated / generation seconds, all requests",
                                   registry=r)
        self.peak_rss = Gauge("semoe_peak_rss_bytes", "peak resident memory of the server process", registry=r)
        self.offload = {k: Gauge(f"semoe_offload_{k}", f"engine offload stat {k} of the last request", registry=r)
                        for k in OFFLOAD_STATS}
        self.ttft = Histogram("semoe_time_to_first_token_seconds", "arrival to first token (queueing included)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("semoe_inter_token_latency_seconds", "time between a request's successive tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("semoe_request_latency_seconds", "arrival to last token, per finished request",
                             buckets=LATENCY_BUCKETS + (60.0, 120.0, 300.0), registry=r)
        self.kv_bytes = Gauge("semoe_kv_cache_bytes", "KV cache bytes held by the requests generating now",
                              registry=r)
        self.preempted = Counter("semoe_preempted_requests", "requests whose KV cache was freed to let another's "
                                 "grow (they go on later, computing their tokens again)", registry=r)
        self._tokens = 0
        self._seconds = 0.0

    def count_storage_reads(self, read_bytes: Callable[[], int]) -> None:
        """Export `read_bytes()` (the engine's bytes read from storage so far) as a counter, read at scrape."""

        class Reads:
            def collect(self):
                yield CounterMetricFamily("semoe_storage_read_bytes", "bytes read from storage (experts from the "
                                          "SSD tier) since the server started", value=read_bytes())

        self.registry.register(Reads())

    def count_prefix_cache(self, prefix) -> None:
        """Export the prefix cache's counters (`inference.serving.prefix_cache.PrefixCache`), read at scrape."""

        class Prefixes:
            def collect(self):
                yield CounterMetricFamily("semoe_prefix_cache_hits", "requests whose prompt began with a kept "
                                          "prefix's tokens", value=prefix.hits)
                yield CounterMetricFamily("semoe_prefix_cache_reused_tokens", "prompt tokens taken from kept "
                                          "prefixes instead of computed", value=prefix.tokens_reused)
                yield CounterMetricFamily("semoe_prefix_cache_evictions", "kept prefixes dropped for room",
                                          value=prefix.evictions)
                yield GaugeMetricFamily("semoe_prefix_cache_bytes", "KV bytes of the kept prefixes", value=prefix.bytes)
                yield GaugeMetricFamily("semoe_prefix_cache_entries", "kept prefixes", value=len(prefix))

        self.registry.register(Prefixes())

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


class RequestLog:
    """`--request-log FILE`: one JSON line per finished request (id, choice, status, tokens in and out, time
    to first token, mean inter-token latency, latency), appended by a task on the server's event loop
    with aiofiles, so that the loop never waits on the disk; the worker hands records over
    thread-safely. Lines are flushed as written; the file is opened for appending (never truncated)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._queue: asyncio.Queue[dict | None] | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Open the file (OSError names it) and start the writer task on the running loop."""
        self._queue = asyncio.Queue()
        handle = await aiofiles.open(self.path, "a", encoding="utf-8")
        self._task = asyncio.get_running_loop().create_task(self._write(handle))

    def put(self, loop: asyncio.AbstractEventLoop, record: dict) -> None:
        """Queue a record from any thread."""
        try:
            loop.call_soon_threadsafe(self._queue.put_nowait, record)
        except RuntimeError:  # the loop has closed
            log.warning("request log: the server stopped before request %s was written", record.get("id"))

    async def _write(self, handle) -> None:
        try:
            while (record := await self._queue.get()) is not None:
                await handle.write(json.dumps(record) + "\n")
                await handle.flush()
        finally:
            await handle.close()

    async def close(self) -> None:
        """Write what is queued, then close the file."""
        if self._task is not None:
            self._queue.put_nowait(None)
            await self._task


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


class _Answer:
    """The events of an answer's jobs (its `n` choices) merged into one queue of (index, event), each
    job's up to its end; `cancel` gives up every job still running."""

    def __init__(self, jobs: list[Job], worker: BatchScheduler) -> None:
        self.jobs = jobs
        self.worker = worker
        self.events: asyncio.Queue[tuple[int, TokenEvent | DoneEvent | ErrorEvent]] = asyncio.Queue()
        self._pumps = [asyncio.get_running_loop().create_task(self._pump(i, job)) for i, job in enumerate(jobs)]

    async def _pump(self, index: int, job: Job) -> None:
        while True:
            event = await job.events.get()
            self.events.put_nowait((index, event))
            if not isinstance(event, TokenEvent):
                return

    async def next(self, request: Request) -> tuple[int, TokenEvent | DoneEvent | ErrorEvent] | None:
        """The next event of any choice; None (and the jobs cancelled) when the client has
        disconnected meanwhile."""
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), timeout=_DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.cancel()
                    return None

    def cancel(self) -> None:
        for job in self.jobs:
            self.worker.cancel(job)  # a no-op once its generation has ended
        for pump in self._pumps:
            pump.cancel()


def create_app(engine, config: ServeConfig | None = None, *, chat_template: ChatTemplate | None = None) -> FastAPI:
    """The FastAPI application serving `engine` within `config` (`ServeConfig`: queue, batch, KV memory,
    request log; its defaults where None); `chat_template` defaults to the fallback template (load a
    model's own with `inference.chat_template.load_chat_template`)."""
    config = config or ServeConfig()
    template = chat_template or ChatTemplate.default()
    metrics = ServerMetrics()
    metrics.count_storage_reads(engine.storage_read_bytes)
    records = RequestLog(config.request_log) if config.request_log else None
    worker = BatchScheduler(engine, metrics, config,
                            on_finished=(lambda job, rec: records.put(job.loop, rec)) if records else None)
    metrics.count_prefix_cache(worker.prefix)
    started = int(time.time())
    tok = engine.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if records is not None:
            await records.start()
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)
            if records is not None:
                await records.close()

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
        reply = Reply(req, engine.name, lambda t: tok.decode([t]) if tok is not None else "")
        try:
            req = worker.sized(req)  # the scheduler alone decides what the KV memory admits
        except KVMemoryError as e:  # it would wait forever
            raise APIError(str(e), param="max_tokens") from None
        loop = asyncio.get_running_loop()
        jobs = [Job(request=choice(req, i), loop=loop, id=reply.id, index=i)
                for i in range(req.n)]  # the log names the answer's id
        try:
            worker.submit(*jobs)
        except QueueFullError as e:  # back-pressure: come back soon
            raise APIError(str(e), status=503, type="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ServerStoppingError as e:
            raise APIError(str(e), status=503, type="server_stopping") from None
        answer = _Answer(jobs, worker)
        if req.stream:
            first = await answer.next(request)
            if first is None:
                return Response(status_code=499)  # nobody reads it; the status only reaches the metrics
            if isinstance(first[1], ErrorEvent):
                answer.cancel()
                raise _failed(first[1])
            return StreamingResponse(_stream(answer, first, reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        done: dict[int, DoneEvent] = {}
        while len(done) < req.n:
            event = await answer.next(request)
            if event is None:
                return Response(status_code=499)
            if isinstance(event[1], ErrorEvent):
                answer.cancel()
                raise _failed(event[1])
            done[event[0]] = event[1]
        return JSONResponse(reply.full([done[i] for i in range(req.n)]))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, parse_completion(await _json_body(request), engine))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer(request, parse_chat(await _json_body(request), engine, template))

    card = {"id": engine.name, "object": "model", "created": started, "owned_by": "semoe",
            "max_model_len": engine.model_config.max_position}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != engine.name:
            raise APIError(f"model {model_id!r} is not served here (this server serves {engine.name!r})",
                           status=404, param="model", type="not_found_error")
        return card

    @app.get("/health")
    async def health() -> dict:  # the process answers: live, draining or not
        return {"status": "ok", "model": engine.name, "queue_depth": worker.waiting, "draining": worker.draining}

    @app.get("/ready")
    async def ready() -> JSONResponse:  # the model is loaded and the server takes requests
        if worker.draining:
            return JSONResponse({"status": "draining", "model": engine.name}, status_code=503)
        return JSONResponse({"status": "ready", "model": engine.name})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _failed(event: ErrorEvent) -> APIError:
    """The error answer of a generation that failed (500) or that the server's stopping ended (503)."""
    return APIError(event.message, status=event.status, type="server_error" if event.status == 500 else "server_stopping")


async def _stream(answer: _Answer, first: tuple[int, TokenEvent | DoneEvent | ErrorEvent], reply: Reply
                  ) -> AsyncIterator[str]:
    """Server-sent events of one answer (its choices' chunks as they come, each naming its index),
    ending with `data: [DONE]`. Leaving early (the client disconnected) cancels the generations."""
    try:
        n = reply.req.n
        if reply.req.chat:
            for i in range(n):
                yield sse(reply.chunk(index=i, text="", role=True))
        index, event = first
        done: dict[int, DoneEvent] = {}
        while True:
            if isinstance(event, TokenEvent):
                yield sse(reply.chunk(index=index, text=event.text, token_ids=(event.token_id,),
                                      logprobs=(event.logprob,), tops=(event.top,)))
            elif isinstance(event, DoneEvent):
                if event.tail:
                    yield sse(reply.chunk(index=index, text=event.tail))
                yield sse(reply.chunk(index=index, text=None if reply.req.chat else "",
                                      finish_reason=event.finish_reason))
                done[index] = event
                if len(done) == n:
                    if reply.req.include_usage:
                        yield sse(reply.usage_chunk(list(done.values())))
                    break
            else:  # the status line has gone out already: report in the stream, as OpenAI does
                yield sse({"error": {"message": event.message, "type": "server_error", "param": None,
                                      "code": None}})
                break
            index, event = await answer.events.get()
        yield sse("[DONE]")
    finally:
        answer.cancel()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port); OSError when it is taken."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def url_of(sock: socket.socket) -> str:
    """http://host:port of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class DrainingServer(uvicorn.Server):
    """uvicorn's server that stops gracefully on the first SIGTERM or SIGINT: no new requests (new connections are
    refused, requests on open ones get 503 and /ready says "draining"), the queued and running ones go on for
    `timeout_s` (`--shutdown-timeout`), then those left end with a 503 that says the server is stopping; uvicorn
    then closes the connections and the app's lifespan stops the scheduler. A second SIGINT exits at once."""

    def __init__(self, config: uvicorn.Config, worker: BatchScheduler, timeout_s: float) -> None:
        super().__init__(config)
        self.worker, self.timeout_s = worker, timeout_s
        self.deadline: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.deadline is None:
            self.worker.drain()
            busy = self.worker.busy
            log.warning("stopping: %d request(s) in flight get up to %g s to finish", busy, self.timeout_s)
            message = f"the server is stopping: this request did not finish within --shutdown-timeout ({self.timeout_s:g} s)"
            self.deadline = threading.Timer(self.timeout_s, self._end, args=(message,))
            self.deadline.daemon = True
            self.deadline.start()
        super().handle_exit(sig, frame)

    def _end(self, message: str) -> None:
        if ended := self.worker.end_all(message):
            log.warning("stopping: %d request(s) ended unfinished", ended)


def serve(engine, host: str = "127.0.0.1", port: int = 8000, config: ServeConfig | None = None, *,
          chat_template: ChatTemplate | None = None, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve `engine` within `config` until interrupted (SIGTERM or Ctrl-C: `DrainingServer`); `on_ready(url)`
    once bound."""
    config = config or ServeConfig()
    sock = bind_socket(host, port)
    app = create_app(engine, config, chat_template=chat_template)
    # uvicorn's own limit only backs ours up: by then the scheduler has ended what was left
    server = DrainingServer(uvicorn.Config(app, log_level=logging.getLogger().getEffectiveLevel(), access_log=False,
                                           timeout_graceful_shutdown=int(config.shutdown_timeout) + 5),
                            app.state.worker, config.shutdown_timeout)
    if on_ready is not None:
        on_ready(url_of(sock))
    try:
        server.run(sockets=[sock])
    finally:
        if server.deadline is not None:
            server.deadline.cancel()
        sock.close()
