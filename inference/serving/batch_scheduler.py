"""Continuous batching: the server's requests decode together, one packed forward a step.

`BatchScheduler` owns one thread. Each step it drops requests whose client has left, admits waiting
ones in arrival order while there is room (up to `max_batch` running, their KV caches within
`kv_memory_bytes`; a request waits rather than fails while the caches are full), and builds one
packed batch
(`MoEGPT.forward_packed`): one token for every decoding request, then prompt tokens of requests
still prefilling, up to `max_batch_tokens` rows in all; a prompt longer than what is left waits for
the next step's room. The forward returns logits only for the rows sampled (each decoding request's
row and the last prompt row of a prefill that completed), and each request samples with its own
generator, temperature, top-p, stop ids, stop strings and `max_tokens`. Requests join and leave
between steps. The forward is `Engine.step`: with every expert in memory on CPU, the decode plan's
compiled kernels (`DecodePlan.batch`: every row's products at once, each row's attention over its own
cache, each chosen expert once over the rows that chose it; one request decoding alone, its one-call
step, as `Engine.generate` uses), else the model's packed forward.

Every row of a packed batch is computed as it would be alone (per-row arithmetic, attention against
its own cache, each MoE layer over the union of the batch's experts). A row's experts are summed in
the order of their ids in a batch and of the router's choice alone, and the modules' packed forward
hands more than 16 rows to torch's matrix products: tokens agree with a request run alone unless its
top two logits nearly tie, log-probs to float32 rounding.

KV caches grow: a request holds its prompt and up to `kv_grow_tokens` more positions when admitted,
and `kv_grow_tokens` more each time it fills them, so one that may run to the end of the context
(a chat without `max_tokens`) does not hold it all from the start. When a cache cannot grow within
`kv_memory_bytes`, the newest running request is preempted (vLLM's recompute policy): its cache is
freed, and it waits ahead of the queue until there is room again, then computes its prompt and the
tokens it had generated as one prefill and goes on where it stopped, with its own sampler. A request
whose whole cache fits the budget alone (the server refuses the others) therefore always finishes.

A request that fails fails alone: where a step of several raises, each is stepped again alone
(from the positions it had) and only those that raise again end with their error; a request whose
logits are not finite, or whose sampling raises, ends with its error.

Prefixes: a finished request's cache is kept (`inference.serving.prefix_cache`, within `--prefix-cache`, by
default sharing the KV memory, whose running requests evict kept ones before any waits); a new or
resumed request copies the positions it shares with one and computes the rest.

Offloaded experts: the offload counters start when the scheduler goes from idle to busy and are read
(draining queued speculative reads) only when it is idle again, so one request ending does not
cancel reads the others need.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inference.serving.scheduler_events import DoneEvent, ErrorEvent, TokenEvent
from inference.serving.openai_protocol import GenRequest
from inference.serving.prefill_policy import StepTimes, prefill_room, prefill_stall
from inference.serving.prefix_cache import PrefixCache
from inference.serving.serve_config import ServeConfig
from inference.serving.incremental_text import TextAssembler
from semoe.model.attention import KVCache
from semoe.decode.generate import choose
from semoe.decode.loop import Paying, PromptLookup
from storage.process_memory import peak_rss_bytes

log = logging.getLogger(__name__)


def rolls_back(config) -> bool:
    """Whether a sequence of this model (`MoEConfig`) rolls back to a position by its caches' length
    alone: attention caches only (no linear layer's state, no compressed entries)."""
    return config is not None and not config.linear_layers and config.attention != "compressed"


class QueueFullError(Exception):
    """More requests are waiting than the server admits."""


class ServerStoppingError(Exception):
    """The server is stopping (`BatchScheduler.drain`): it takes no new requests."""


class KVMemoryError(ValueError):
    """A request whose KV cache can never fit the server's KV memory."""


@dataclass(kw_only=True, eq=False)
class Job:
    """One request on its way through the scheduler; events go back to `loop` through `events`."""

    request: GenRequest
    loop: asyncio.AbstractEventLoop
    id: str  # the answer's id (`Reply.id`), which the request log names
    index: int = 0  # which of the answer's choices
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stopped: bool = False  # cancelled by the server stopping (`end_all`), not by its client
    arrived: float = field(default_factory=time.perf_counter)

    def post(self, event: TokenEvent | DoneEvent | ErrorEvent) -> None:
        """Hand an event to the event loop (called from the scheduler's thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            self.cancelled.set()


@dataclass(eq=False)
class _Running:
    """A request between admission and its last token: its cache, sampler and what it produced."""

    job: Job
    cache: KVCache | None  # None while preempted
    generator: torch.Generator
    text: TextAssembler
    kv_bytes: int
    todo: list[int]  # prompt tokens not yet through the model
    started: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    t_first: float | None = None
    t_last: float = 0.0
    lookup: object = None  # its drafts' source where it drafts (`BatchScheduler._drafter`)


class BatchScheduler:
    """One thread stepping every running request together; at most `max_queue` requests may wait
    for a place among the `max_batch` running ones."""

    def __init__(self, engine, metrics, config: ServeConfig,
                 on_finished: Callable[[Job, dict], None] | None = None) -> None:
        self.config = config
        self.kv_grow_tokens = config.kv_grow_tokens
        self.kv_memory_bytes = config.kv_memory_bytes  # the running requests' KV caches together; None: no limit
        self.engine = engine
        self.metrics = metrics
        self.max_queue = config.max_queue
        self.max_batch = config.max_batch
        self.max_batch_tokens = config.max_batch_tokens
        self.on_finished = on_finished  # (job, record) once a job ends, however it ends
        # finished requests' KV caches, for prompts that begin with their tokens (the scheduler's thread
        # alone touches it); within the KV memory where it is limited
        self.prefix = PrefixCache(config.prefix_bytes, engine.kv_cache_bytes)
        self._pending: collections.deque[Job] = collections.deque()
        self._running: list[_Running] = []  # in admission order: the newest last
        self._preempted: list[_Running] = []  # waiting for room to go on, ahead of `_pending`
        self._cv = threading.Condition()
        self._closing = False
        self._draining = False  # `drain`: no new requests; the queued and running ones go on
        self._busy_tokens = 0  # prompt and generated tokens since the scheduler was last idle
        # tokens drafted a decoding row (`_drafts`), where every state rolls back by the caches' length
        self.speculative = config.speculative if rolls_back(getattr(engine, "model_config", None)) else 0
        if config.speculative and not self.speculative:
            log.warning("--speculative %d: this model's state (linear attention or compressed entries) is not "
                        "rolled back by its length; serving without drafts", config.speculative)
        self.drafted = self.accepted = 0
        self.emitted = 0  # tokens emitted since start: what `paying` times steps by
        self.paying = Paying(None) if config.paying and self.speculative else None
        self._drafting = True  # whether this step drafts (`paying`'s turn)
        self._times = StepTimes()  # chunked prefill's (`prefill_room`)
        self._thread = threading.Thread(target=self._run, name="semoe-batch", daemon=True)

    # -- the server's side ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def sized(self, req: GenRequest) -> GenRequest:
        """The request as the KV memory admits it: one without max_tokens that could never fit its
        cache runs as far as the memory holds; KVMemoryError where even that, or its max_tokens, cannot
        fit (it would wait forever)."""
        budget = self.kv_memory_bytes
        if budget is None or self.kv_bytes_of(req) <= budget:
            return req
        if not req.max_tokens_set:  # no max_tokens: as far as the budget holds, rather than the rest of the context
            fit = budget // self.engine.kv_cache_bytes(1) - len(req.prompt_ids)
            if fit >= 1:
                req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, max_new_tokens=fit))
                if self.kv_bytes_of(req) <= budget:
                    return req
        raise KVMemoryError(f"this request's KV cache ({self.kv_bytes_of(req)} bytes for {len(req.prompt_ids)} prompt "
                            f"tokens + max_tokens {req.sampling.max_new_tokens}) exceeds the server's KV memory "
                            f"limit of {budget} bytes (--kv-memory); ask for fewer max_tokens or a shorter prompt")

    def submit(self, *jobs: Job) -> None:
        """Queue jobs (an answer's choices: all or none); QueueFullError when they would make more than
        `max_queue` wait, KVMemoryError when one can never fit the KV memory (`sized` says which do)."""
        for job in jobs:
            if self.kv_memory_bytes is not None and self.kv_bytes_of(job.request) > self.kv_memory_bytes:
                raise KVMemoryError(f"a request's KV cache ({self.kv_bytes_of(job.request)} bytes) exceeds the KV "
                                    f"memory limit of {self.kv_memory_bytes} bytes: queue it as `sized` returns it")
        with self._cv:
            if self._closing or self._draining:
                raise ServerStoppingError("the server is stopping: it takes no new requests")
            if len(self._pending) + len(jobs) > self.max_queue:
                raise QueueFullError(f"the request queue is full ({len(self._pending)} waiting"
                                     + (f", {len(jobs)} choices asked" if len(jobs) > 1 else "") + "); retry later")
            self._pending.extend(jobs)
            self.metrics.queue_depth.set(len(self._pending))
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Give up a job whose client has left: a waiting one leaves the queue at once, a running one
        at the next step (freeing its place and its cache)."""
        with self._cv:
            job.cancelled.set()
            if job in self._pending:
                self._pending.remove(job)
                self.metrics.queue_depth.set(len(self._pending))
                self.metrics.cancelled.inc()
                self._record(job, "cancelled", [], None, time.perf_counter())
            self._cv.notify()

    @property
    def waiting(self) -> int:
        """Jobs queued, not yet admitted."""
        return len(self._pending)

    def drain(self) -> None:
        """Take no new requests (`submit` raises ServerStoppingError); the queued and running ones go on."""
        with self._cv:
            self._draining = True

    @property
    def draining(self) -> bool:
        """Whether `drain` (or `stop`) was called."""
        return self._draining or self._closing

    @property
    def busy(self) -> int:
        """Jobs queued, waiting to go on, or running."""
        with self._cv:
            return len(self._pending) + len(self._preempted) + len(self._running)

    def end_all(self, message: str) -> int:
        """End every queued and running job now with `message`, HTTP 503 where its answer has not begun
        (the running ones leave the batch at the next step); how many there were."""
        with self._cv:
            now = time.perf_counter()
            waiting = [*(r.job for r in self._preempted), *self._pending]
            jobs = [j for j in [*waiting, *(r.job for r in self._running)] if not j.cancelled.is_set()]
            for job in jobs:
                job.stopped = True
                job.cancelled.set()
                job.post(ErrorEvent(message=message, status=503))
            for job in waiting:
                self._record(job, "stopped", [], None, now)
            self._pending.clear()
            self._preempted.clear()
            self.metrics.queue_depth.set(0)
            self._cv.notify()
        return len(jobs)

    def stop(self, timeout_s: float = 10.0) -> None:
        """End every job with an error (`end_all`), join the thread."""
        self.end_all("the server is stopping")
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the generation thread did not stop within %.0f s", timeout_s)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._running and not self._preempted and not self._closing:
                    self._cv.wait()
                if self._closing and not self._running:
                    return
                was_idle = not self._running
                resumed, admitted = self._take_admissible()
                self.metrics.queue_depth.set(len(self._pending))
            for r in resumed:
                self._resume(r)
            for job in admitted:  # caches are allocated outside the lock: submit() never waits on them
                try:
                    self._running.append(self._admit(job))
                except ValueError as e:  # a request the model cannot take (`check_prompt`): its error alone
                    self.metrics.failed.inc()
                    job.post(ErrorEvent(message=f"generation failed: {type(e).__name__}: {e}"))
                    self._record(job, "error", [], None, time.perf_counter())
            self.metrics.running.set(len(self._running))
            if was_idle and self._running:
                self._busy_tokens = 0
                if self.engine.offload is not None:
                    self.engine.offload.begin_request()
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - a step of one request, or the step's own work, failed: the
                log.exception("a generation step failed")  # requests it held end; the server keeps serving
                for r in list(self._running):
                    self._fail(r, e)
            self.metrics.running.set(len(self._running))

    def kv_bytes_of(self, req: GenRequest) -> int:
        """KV cache bytes a request holds at most: its prompt and max_tokens positions."""
        return self.engine.kv_cache_bytes(len(req.prompt_ids) + req.sampling.max_new_tokens)

    def _positions(self, req: GenRequest, done: int) -> int:
        """Positions of the cache a request is admitted (or readmitted) with, `done` tokens generated:
        its prompt and those, and `kv_grow_tokens` more, within its prompt and max_tokens."""
        return len(req.prompt_ids) + min(req.sampling.max_new_tokens, done + self.kv_grow_tokens)

    def _take_admissible(self) -> tuple[list[_Running], list[Job]]:
        """Preempted requests, then waiting jobs, in arrival order, while the batch has places and their
        KV caches fit beside the running ones' (the first that does not fit waits, and those behind
        it); called under the lock. Every queued job's whole cache fits the budget alone (`submit`), so
        the first always fits when nothing runs."""
        resumed: list[_Running] = []
        taken: list[Job] = []
        reserved = sum(r.kv_bytes for r in self._running)
        for r in [r for r in self._preempted if r.job.cancelled.is_set() or self._closing]:
            self._preempted.remove(r)
            self._record(r.job, self._cancelled_as(r.job), r.tokens, r.t_first, time.perf_counter())
        while (self._preempted or self._pending) and not self._closing \
                and len(self._running) + len(resumed) + len(taken) < self.max_batch:
            if self._preempted:
                r = self._preempted[0]
                need = self.engine.kv_cache_bytes(self._positions(r.job.request, len(r.tokens)))
            else:
                need = self.engine.kv_cache_bytes(self._positions(self._pending[0].request, 0))
            self._make_room(reserved + need)
            if self.kv_memory_bytes is not None and reserved + need > self.kv_memory_bytes \
                    and (reserved or taken or resumed):
                break
            if self._preempted:
                resumed.append(self._preempted.pop(0))
            else:
                taken.append(self._pending.popleft())
            reserved += need
        return resumed, taken

    def _make_room(self, held: int) -> None:
        """Evict kept prefixes until `held` bytes of running caches fit beside them in the KV memory: they
        go before a running request waits or is preempted."""
        if self.kv_memory_bytes is not None and held + self.prefix.bytes > self.kv_memory_bytes:
            self.prefix.evict(held + self.prefix.bytes - self.kv_memory_bytes)

    def _admit(self, job: Job) -> _Running:
        req = job.request
        tok = self.engine.tokenizer
        positions = self._positions(req, 0)
        cache = self.engine.new_cache(req.prompt_ids, positions - len(req.prompt_ids))
        need = self.engine.kv_cache_bytes(positions)
        reused = self._reuse(req.prompt_ids, cache)
        self._busy_tokens += len(req.prompt_ids) - reused
        self.metrics.kv_bytes.inc(need)
        return _Running(job=job, cache=cache, generator=torch.Generator().manual_seed(req.sampling.seed),
                        text=TextAssembler(tok.decode if tok is not None else (lambda ids: ""), req.stops),
                        kv_bytes=need, todo=list(req.prompt_ids[reused:]), lookup=self._drafter(req))

    def _reuse(self, tokens: list[int], cache: KVCache) -> int:
        """Copy into `cache` the positions a kept prefix shares with `tokens` (`PrefixCache.lookup`); how many."""
        src, n = self.prefix.lookup(tokens)
        if n:
            cache.copy_from(src, n)
            log.info("prefix cache: %d of %d prompt tokens reused", n, len(tokens))
        return n

    def _resume(self, r: _Running) -> None:
        """Readmit a preempted request: a new cache, and its prompt and tokens to compute again (the
        last prompt row's logits then give its next token, as its next decoding step would have)."""
        req = r.job.request
        positions = self._positions(req, len(r.tokens))
        r.cache = self.engine.new_cache(req.prompt_ids, positions - len(req.prompt_ids))
        r.kv_bytes = self.engine.kv_cache_bytes(positions)
        todo = list(req.prompt_ids) + r.tokens
        r.todo = todo[self._reuse(todo, r.cache):]
        self._busy_tokens += len(r.todo)
        self.metrics.kv_bytes.inc(r.kv_bytes)
        self._running.append(r)

    def _grow(self, r: _Running) -> None:
        """Room for r's next tokens: its cache grows by `kv_grow_tokens` positions (within its
        max_tokens), preempting the newest running requests while that does not fit the budget (r
        itself when it is the newest)."""
        req = r.job.request
        positions = min(len(req.prompt_ids) + req.sampling.max_new_tokens, r.cache.capacity + self.kv_grow_tokens)
        extra = self.engine.kv_cache_bytes(positions) - r.kv_bytes
        self._make_room(sum(x.kv_bytes for x in self._running) + extra)
        while self.kv_memory_bytes is not None \
                and sum(x.kv_bytes for x in self._running) + extra > self.kv_memory_bytes:
            victim = self._running[-1]
            self._preempt(victim)
            if victim is r:
                return
        r.cache.grow(positions)
        r.kv_bytes += extra
        self.metrics.kv_bytes.inc(extra)

    def _preempt(self, r: _Running) -> None:
        """Free r's cache and put it ahead of the queue, in arrival order, to go on when there is room."""
        log.info("KV memory full: request %s preempted after %d tokens", r.job.id, len(r.tokens))
        self._running.remove(r)
        # the gauges before the answer goes out: a client that reads /metrics after its answer sees
        # its request gone
        self.metrics.running.set(len(self._running))
        self.metrics.kv_bytes.dec(r.kv_bytes)
        self.metrics.preempted.inc()
        r.kv_bytes = 0
        r.cache = None
        with self._cv:
            self._preempted.append(r)
            self._preempted.sort(key=lambda x: x.job.arrived)

    def _step(self) -> None:
        """One packed forward over the running requests, and a token for each one it completes."""
        for r in [r for r in self._running if r.job.cancelled.is_set() or self._closing]:
            status = self._cancelled_as(r.job)
            log.info("%s: generation stopped after %d tokens",
                     "client left" if status == "cancelled" else "the server is stopping", len(r.tokens))
            self._end(r, status)
        for r in list(self._running):  # oldest first: a full cache grows, or the newest make room
            if r in self._running and not r.todo and r.cache.length >= r.cache.capacity:
                self._grow(r)
        if not self._running:
            return
        parts: list[tuple[_Running, list[int], int]] = []  # (request, its tokens this step, the rows sampled)
        room = self.max_batch_tokens
        self._drafting = self.paying.turn(self.emitted) if self.paying is not None else True
        for r in self._running:  # decoding requests first: a long prompt never stalls them
            if not r.todo:
                drafts = self._drafts(r, room - 1)
                parts.append((r, [r.tokens[-1], *drafts], 1 + len(drafts)))
                room -= 1 + len(drafts)
        decoding = self.max_batch_tokens - room  # rows
        if decoding:  # prompts get a chunk that keeps the decoding rows' step short; alone, the whole budget
            starting = sum(1 for r in self._running if r.todo)
            chunk = self.config.prefill_chunk or prefill_room(self._times.fit(), decoding,
                                                              prefill_stall(starting, len(parts)))
            room = min(room, chunk)
        for r in self._running:
            if r.todo and room > 0:
                n = min(len(r.todo), room)
                parts.append((r, r.todo[:n], int(n == len(r.todo))))  # its last prompt row gives its first token
                del r.todo[:n]
                room -= n
        self.metrics.batch.observe(len(parts))
        starts = [r.cache.length for r, _, _ in parts]
        try:
            t0 = time.perf_counter()
            sampled = self._split(parts, self._forward(parts))
            self._times.add(sum(len(t) for _, t, _ in parts), time.perf_counter() - t0)
            feed = True
        except Exception as e:  # noqa: BLE001 - one request's failure is its own: each alone finds whose
            log.exception("a generation step of %d requests failed", len(parts))
            sampled, feed = [], False  # the drafters miss this step's rows: they start again after it
            for part, start in zip(parts, starts):
                if len(parts) == 1:
                    self._fail(part[0], e)
                    break
                part[0].cache.length = start  # what the failed step wrote is written again
                try:
                    sampled += self._split([part], self._forward([part]))
                except Exception as alone:  # noqa: BLE001
                    log.warning("request %s fails alone too: %s", part[0].job.id, alone)
                    self._fail(part[0], alone)
        for (r, tokens, n), logits in sampled:
            base = r.cache.length - n  # a drafted row's: its cache before the step
            if n > 1:  # drafted: its rows up to the first whose greedy token is not the draft after it
                kept = 1
                while kept < n and int(logits[kept - 1].argmax()) == tokens[kept]:
                    kept += 1
                self.drafted += n - 1
                self.accepted += kept - 1
                logits = logits[:kept]
            for j, row in enumerate(logits):
                if r not in self._running:
                    break
                if n > 1:  # the positions of the tokens it has emitted (the rows past are written over later)
                    r.cache.length = base + j + 1
                try:
                    self._emit(r, row[None])
                except Exception as e:  # noqa: BLE001 - its sampling's failure (a NaN, a parameter) is its own
                    self._fail(r, e)
        if feed and self.speculative:
            self._feed(parts, starts)

    def _drafts(self, r: _Running, room: int) -> list[int]:
        """Up to `speculative` tokens to follow r's, verified in r's next row's pass (the step's spare
        `room` rows, r's cache and tokens allowing), from its drafter (`_drafter`), for a greedy request
        of a model whose state is its attention caches alone (rolled back by their length); none otherwise."""
        req = r.job.request
        n = min(self.speculative, room, r.cache.capacity - r.cache.length - 1,
                req.sampling.max_new_tokens - len(r.tokens) - 1)
        if n < 1 or r.lookup is None or not self._drafting:
            return []
        return r.lookup(r.tokens, n)[:n]

    def _drafter(self, req: GenRequest):
        """A greedy request's drafts' source where the server drafts: the engine's (the checkpoint's
        multi-token-prediction layer, fed every row of the request's steps), else lookup in its prompt and
        tokens (`semoe.decode.loop.PromptLookup`); None where it does not draft."""
        if not self.speculative or not req.sampling.greedy:
            return None
        made = getattr(self.engine, "drafter", lambda *a: None)(list(req.prompt_ids),
                                                                len(req.prompt_ids) + req.sampling.max_new_tokens)
        return made if made is not None else PromptLookup(list(req.prompt_ids))

    def _feed(self, parts: list[tuple[_Running, list[int], int]], starts: list[int]) -> None:
        """Hand each request's rows of the step (the engine's `rows`) to its drafter where it reads them: a
        drafted row's up to the tokens kept (its cache's length), the others' whole."""
        rows, at = getattr(self.engine, "rows", None), 0
        for (r, tokens, _), start in zip(parts, starts):
            if rows is not None and hasattr(r.lookup, "feed") and r.cache is not None and r.cache.length > start:
                r.lookup.feed(start, rows[at:at + min(len(tokens), r.cache.length - start)].copy())
            at += len(tokens)

    @staticmethod
    def _split(parts: list[tuple[_Running, list[int], int]], logits: torch.Tensor) -> list[tuple[tuple, torch.Tensor]]:
        """Each part that sampled rows, with its rows of the step's logits."""
        out, at = [], 0
        for part in parts:
            if part[2]:
                out.append((part, logits[at:at + part[2]]))
                at += part[2]
        return out

    def _forward(self, parts: list[tuple[_Running, list[int], int]]) -> torch.Tensor:
        """The engine's packed forward of the requests' tokens: logits of the rows sampled (each part's last
        `sampled` rows)."""
        ids, caches, counts, rows = [], [], [], []
        for r, tokens, sampled in parts:
            ids += tokens
            caches.append(r.cache)
            counts.append(len(tokens))
            rows += range(len(ids) - sampled, len(ids))
        with self.engine.lock:
            return self.engine.step(ids, caches, counts, rows)

    def _fail(self, r: _Running, e: BaseException) -> None:
        """End r with an error naming e; the others go on."""
        self.metrics.failed.inc()
        r.job.post(ErrorEvent(message=f"generation failed: {type(e).__name__}: {e}"))
        if r in self._running:
            self._end(r, "error")

    def _emit(self, r: _Running, logits_1V: torch.Tensor) -> None:
        """Sample r's next token as `semoe.decode.generate.generate` does, and hand it to the client."""
        req = r.job.request
        if not bool(torch.isfinite(logits_1V).all()):
            raise FloatingPointError("the model's logits for this request are not finite (NaN or infinity)")
        token, logprob, top = choose(logits_1V, req.sampling, r.generator, req.top_logprobs)
        r.tops.append(top)
        now = time.perf_counter()
        if r.t_first is None:
            r.t_first = now
            self.metrics.ttft.observe(now - r.job.arrived)
        else:
            self.metrics.itl.observe(now - r.t_last)
        r.t_last = now
        r.tokens.append(token)
        r.logprobs.append(logprob)
        self._busy_tokens += 1
        self.emitted += 1
        delta = r.text.add(token)
        if req.stream:
            r.job.post(TokenEvent(token_id=token, logprob=logprob, text=delta, top=top))
        if r.text.stopped or token in req.sampling.stop_ids:
            self._end(r, "stop")
        elif len(r.tokens) == req.sampling.max_new_tokens:
            self._end(r, "length")

    def _cancelled_as(self, job: Job) -> str:
        """A cancelled job's status: "stopped" where the server stopping ended it, else "cancelled" (its client
        left), which this counts in semoe_cancelled_requests."""
        if job.stopped or self._closing:
            return "stopped"
        self.metrics.cancelled.inc()
        return "cancelled"

    def _end(self, r: _Running, status: str) -> None:
        """Take r out of the batch, keep its cache's positions for later prompts that begin with its
        tokens (unless it failed), free its cache, and answer it (stop, length) or record it."""
        self._running.remove(r)
        self.metrics.kv_bytes.dec(r.kv_bytes)
        if status != "error" and r.cache is not None:
            self.prefix.add(list(r.job.request.prompt_ids) + r.tokens, r.cache)
        t_end = time.perf_counter()
        self._record(r.job, status, r.tokens, r.t_first, t_end)
        if status not in ("stop", "length"):
            return
        job, req = r.job, r.job.request
        self.metrics.e2e.observe(t_end - job.arrived)
        stats: dict = {"peak_rss_bytes": peak_rss_bytes()}
        if not self._running and self.engine.offload is not None:  # idle: the busy period's counters
            stats.update(self.engine.offload.request_stats(tokens=self._busy_tokens))
        first = r.t_first if r.t_first is not None else t_end
        decode_s = t_end - first
        self.metrics.observe(prompt_tokens=len(req.prompt_ids), tokens=len(r.tokens), seconds=t_end - r.started,
                             ttft_s=first - job.arrived,
                             decode_tok_s=(len(r.tokens) - 1) / decode_s if decode_s > 0 else 0.0, stats=stats)
        tail = r.text.finish()
        job.post(DoneEvent(tokens=r.tokens, logprobs=r.logprobs, top_logprobs=r.tops if req.top_logprobs else [],
                           text=r.text.text, tail=tail, finish_reason=status))

    def _record(self, job: Job, status: str, tokens: list[int], t_first: float | None, t_end: float) -> None:
        """Hand the job's record (`RequestLog`'s line) to `on_finished`."""
        if self.on_finished is None:
            return
        n = len(tokens)
        record = {"id": job.id, "choice": job.index, "status": status, "prompt_tokens": len(job.request.prompt_ids), "tokens": n,
                  "ttft_s": None if t_first is None else round(t_first - job.arrived, 6),
                  "mean_itl_s": round((t_end - t_first) / (n - 1), 6) if t_first is not None and n > 1 else None,
                  "latency_s": round(t_end - job.arrived, 6)}
        self.on_finished(job, record)
