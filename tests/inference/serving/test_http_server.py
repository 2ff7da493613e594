"""The OpenAI-compatible server, run as a real uvicorn server on 127.0.0.1 and spoken to over HTTP."""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import uvicorn
from helpers.hf_models import add_word_tokenizer, make_hf_checkpoint
from prometheus_client.parser import text_string_to_metric_families

from inference.chat_template import FALLBACK_TEMPLATE, ChatTemplate, ChatTemplateError, load_chat_template
from inference.engine import Engine
from inference.engine_config import EngineConfig
from inference.serving.serve_config import ServeConfig
from inference.serving.http_server import DrainingServer, bind_socket, create_app
from inference.serving.incremental_text import TextAssembler
from semoe.decode.loop import SamplingConfig
from helpers.kernels import needs_kernels
from helpers.procs import ROOT, child_env, serving_port

MAX_POSITION = 128  # of the tiny checkpoints
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {{ eos_token }} "
                 "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}")


class LiveServer:
    """A uvicorn server on a free loopback port, in a background thread."""

    def __init__(self, app) -> None:
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class ScriptedEngine:
    """The real engine behind a gate, with a per-step delay, two failing prompts, no tokenizer and no
    stop ids (so that generation always runs to max_tokens). The batch scheduler calls `step`."""

    FAIL_TOKEN = 7  # a prompt starting with this id fails its first step
    FAIL_LATE_TOKEN = 8  # a prompt starting with this id fails the step after its second token
    NAN_TOKEN = 6  # a prompt starting with this id gets NaN logits from its third token on

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.model = engine.model
        self.model_config = engine.model_config
        self.new_cache = engine.new_cache
        self.tokenizer = None
        self.offload = None
        self.name = "scripted"
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.token_delay_s = 0.0
        self.counts: list[list[int]] = []  # each step's rows a request
        # id(cache) -> (the cache, its first prompt token computed, its prompt's length)
        self._prompts: dict[int, tuple[weakref.ref, int, int]] = {}

    def stop_ids(self) -> tuple[int, ...]:
        return ()

    def kv_cache_bytes(self, positions: int) -> int:
        return self._engine.kv_cache_bytes(positions)

    def storage_read_bytes(self) -> int:
        return self._engine.storage_read_bytes()

    def step(self, ids, caches, counts, rows):
        self.counts.append(list(counts))
        self.started.set()
        if not self.gate.wait(20):
            raise TimeoutError("gate never opened")
        start = 0
        for cache, n in zip(caches, counts):
            seen = self._prompts.get(id(cache))
            if seen is None or seen[0]() is not cache:  # a prompt's (whole) prefill, after a prefix it reused
                self._prompts[id(cache)] = (weakref.ref(cache), ids[start], cache.length + n)
            _, first, length = self._prompts[id(cache)]
            if first == self.FAIL_TOKEN:
                raise RuntimeError("scripted failure")
            if first == self.FAIL_LATE_TOKEN and cache.length == length + 1:  # two tokens out
                raise RuntimeError("scripted failure mid-stream")
            start += n
        time.sleep(self.token_delay_s)
        logits = self._engine.step(ids, caches, counts, rows)
        ends = [sum(counts[:i + 1]) for i in range(len(counts))]
        for j, row in enumerate(rows):  # the sequence whose tokens end at or after the row
            cache = caches[next(i for i, end in enumerate(ends) if row < end)]
            _, first, length = self._prompts[id(cache)]
            if first == self.NAN_TOKEN and cache.length >= length + 3:
                logits[j] = float("nan")
        return logits


# -- HTTP helpers --------------------------------------------------------------------------------

def request(port: int, method: str, path: str, body: object = None, *, raw: bytes | None = None,
            timeout: float = 30) -> tuple[int, object]:
    """Status and parsed JSON (or text) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        text = resp.read().decode()
        is_json = resp.getheader("Content-Type", "").startswith("application/json")
        return resp.status, json.loads(text) if is_json else text
    finally:
        conn.close()


def post(port: int, path: str, body: object, **kw) -> tuple[int, object]:
    return request(port, "POST", path, body, **kw)


def stream(port: int, path: str, body: dict) -> list:
    """The server-sent events of a streamed request, read line by line: JSON objects, then "[DONE]"."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("Content-Type").startswith("text/event-stream")
        events = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode().rstrip("\r\n")
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events
    finally:
        conn.close()


def metrics(port: int) -> dict[tuple[str, tuple], float]:
    """Samples of /metrics as {(name, sorted labels): value}."""
    status, text = request(port, "GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def requests_total(m: dict, endpoint: str, status: int) -> float:
    return m.get(("semoe_requests_total", (("endpoint", endpoint), ("status", str(status)))), 0.0)


def wait_for(predicate, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# -- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_hf_checkpoint("mixtral", tmp_path_factory.mktemp("serve") / "tiny", seed=5)
    add_word_tokenizer(path, chat_template=CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = Engine.load(str(model_dir), EngineConfig())
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    """A second engine on the same checkpoint: expected outputs never touch the served instance."""
    eng = Engine.load(str(model_dir), EngineConfig())
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def served(engine, model_dir):
    server = LiveServer(create_app(engine, chat_template=load_chat_template(str(model_dir))))
    yield server
    server.close()


@pytest.fixture(scope="module")
def scripted(engine):
    """A server over ScriptedEngine that runs one request and admits one waiting request."""
    eng = ScriptedEngine(engine)
    server = LiveServer(create_app(eng, ServeConfig(max_queue=1, max_batch=1)))
    server.engine = eng
    yield server
    eng.gate.set()
    server.close()


def direct(engine: Engine, ids: list[int], max_tokens: int):
    return engine.generate(ids, SamplingConfig(max_new_tokens=max_tokens, stop_ids=engine.stop_ids()))


# -- tests ---------------------------------------------------------------------------------------

def test_concurrent_clients_match_direct_generation(served, reference):
    tok = reference.tokenizer
    chat_a = [{"role": "user", "content": "the cat sat"}]
    chat_b = [{"role": "system", "content": "one two"}, {"role": "user", "content": "big red dog"}]
    cases = {  # name -> (path, body, prompt ids the server must have used)
        "text": ("/v1/completions", {"prompt": "the cat sat on a mat", "max_tokens": 12},
                 tok.encode("the cat sat on a mat", add_bos=tok.add_bos_default)),
        "ids": ("/v1/completions", {"prompt": [1, 5, 9, 14], "max_tokens": 10}, [1, 5, 9, 14]),
        "chat_a": ("/v1/chat/completions", {"messages": chat_a, "max_tokens": 9},
                   tok.encode("<s>user the cat sat </s> assistant")),
        "chat_b": ("/v1/chat/completions", {"messages": chat_b, "max_tokens": 11},
                   tok.encode("<s>system one two </s> user big red dog </s> assistant")),
    }
    want = {name: direct(reference, ids, body["max_tokens"]) for name, (_, body, ids) in cases.items()}
    results: dict[tuple[str, bool], object] = {}
    errors: list[BaseException] = []

    def client(name: str, streamed: bool) -> None:
        path, body, _ = cases[name]
        try:
            results[name, streamed] = stream(served.port, path, body) if streamed else post(served.port, path, body)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(name, s)) for name in cases for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for name, (path, body, ids) in cases.items():
        chat = "chat" in path
        status, full = results[name, False]
        assert status == 200, full
        choice = full["choices"][0]
        assert full["object"] == ("chat.completion" if chat else "text_completion")
        assert full["id"] and full["model"] == reference.name and isinstance(full["created"], int)
        assert choice["token_ids"] == want[name].tokens
        text = choice["message"]["content"] if chat else choice["text"]
        assert text == tok.decode(want[name].tokens)
        if chat:
            assert choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] == ("stop" if want[name].tokens[-1] in reference.stop_ids() else "length")
        assert full["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want[name].tokens),
                                 "total_tokens": len(ids) + len(want[name].tokens)}
        events = results[name, True]
        assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
        chunks = events[:-1]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
        assert len({c["id"] for c in chunks}) == 1
        pieces = [c["choices"][0]["delta"].get("content", "") if chat else c["choices"][0]["text"] for c in chunks]
        assert "".join(pieces) == text
        assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == want[name].tokens
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == choice["finish_reason"]
        if chat:
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_requests_joining_mid_stream_decode_together_and_get_their_own_tokens(engine, reference):
    """Continuous batching: a long streamed request, then seven more of different prompt and output
    lengths, streamed and not, joining while it streams. Each gets the greedy tokens it gets alone
    (log-probs within 1e-4: a batch sums a row's experts in the order of their ids, a request alone in
    the router's), and the steps decoded several requests at once."""
    eng = ScriptedEngine(engine)  # no stop ids: every request runs to its max_tokens
    eng.token_delay_s = 0.01  # a step of the tiny model takes a millisecond: slow it so that requests overlap
    server = LiveServer(create_app(eng, ServeConfig(max_batch=8, max_batch_tokens=16)))
    try:
        # (prompts starting with 7 or 8 fail in ScriptedEngine)
        cases = [([2, 9, 4, 11], 60)] + [([10 + i, 5, 7 + i, 2, 6, 1, 12][:1 + (2 * i) % 7], 4 + 3 * i) for i in range(7)]
        want = [reference.generate(ids, SamplingConfig(max_new_tokens=n)) for ids, n in cases]
        results: dict[int, tuple[list[int], list[float]]] = {}
        errors: list[BaseException] = []

        def client(i: int) -> None:
            ids, n = cases[i]
            body = {"prompt": ids, "max_tokens": n, "logprobs": 0}
            try:
                if i % 2:
                    events = stream(server.port, "/v1/completions", body)
                    chunks = [e["choices"][0] for e in events[:-1]]
                    results[i] = ([t for c in chunks for t in c["token_ids"]],
                                  [x for c in chunks for x in (c["logprobs"] or {}).get("token_logprobs", [])])
                else:
                    status, out = post(server.port, "/v1/completions", body)
                    assert status == 200, out
                    choice = out["choices"][0]
                    results[i] = (choice["token_ids"], choice["logprobs"]["token_logprobs"])
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        steps = lambda: metrics(server.port).get(("semoe_batch_requests_count", ()), 0.0)  # noqa: E731
        first = threading.Thread(target=client, args=(0,))
        first.start()
        wait_for(lambda: steps() >= 5, "the long request to stream a few tokens")
        others = [threading.Thread(target=client, args=(i,)) for i in range(1, len(cases))]
        for t in others:
            t.start()
        for t in [first, *others]:
            t.join(60)
        assert not errors, errors
        for i, res in enumerate(want):
            tokens, logprobs = results[i]
            assert tokens == res.tokens, i
            assert logprobs == pytest.approx(res.logprobs, abs=1e-4), i
        m = metrics(server.port)
        alone = m[("semoe_batch_requests_bucket", (("le", "1.0"),))]
        assert m[("semoe_batch_requests_count", ())] - alone >= 10  # steps that computed two requests or more
        assert m[("semoe_requests_running", ())] == 0 and m[("semoe_kv_cache_bytes", ())] == 0
    finally:
        server.close()


def test_chunked_prefill_gives_a_whole_prompts_tokens_and_decoding_waits_one_chunk(engine, reference):
    """A 90-token prompt arriving while another request decodes is prefilled 8 rows a step (--prefill-chunk 8)
    beside the decoding row, which every step carries; both get the greedy tokens they get alone, the prompt
    prefilled whole (log-probs within 1e-4, as above). With nothing decoding, a prompt goes in whole."""
    eng = ScriptedEngine(engine)
    eng.token_delay_s = 0.01
    server = LiveServer(create_app(eng, ServeConfig(max_batch=4, max_batch_tokens=128, prefill_chunk=8)))
    try:
        long_prompt = [(5 * i) % 30 + 2 for i in range(90)]
        cases = {"decoding": ([2, 9, 4, 11], 60), "long prompt": (long_prompt, 12)}
        results: dict[str, dict] = {}

        def client(name: str) -> None:
            ids, n = cases[name]
            results[name] = post(server.port, "/v1/completions", {"prompt": ids, "max_tokens": n, "logprobs": 0})

        first = threading.Thread(target=client, args=("decoding",))
        first.start()
        wait_for(lambda: len(eng.counts) >= 5, "the first request to decode a few tokens")
        second = threading.Thread(target=client, args=("long prompt",))
        second.start()
        first.join(60)
        second.join(60)
        for name, (ids, n) in cases.items():
            status, out = results[name]
            want = reference.generate(ids, SamplingConfig(max_new_tokens=n))
            assert status == 200 and out["choices"][0]["token_ids"] == want.tokens, name
            assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-4), name
        chunks = [c[1] for c in eng.counts if len(c) == 2 and c[0] == 1]  # beside the decoding row
        assert sum(chunks) + sum(c[0] for c in eng.counts if len(c) == 1 and c[0] > 1) >= 90
        assert len(chunks) >= 11 and max(chunks) == 8  # 90 rows, 8 a step, the decoding row in each
        eng.counts.clear()
        other = [(7 * i) % 29 + 3 for i in range(90)]  # no kept prefix begins it: computed whole
        assert post(server.port, "/v1/completions", {"prompt": other, "max_tokens": 1})[0] == 200
        assert eng.counts[0] == [90]  # nothing decoding: the prompt in one step
    finally:
        server.close()


def test_prefill_room_keeps_a_step_within_twice_a_decoding_step():
    """Steps timed as 120 ms plus 3 ms a row (with 1% noise) give that line back; the chunk beside 32
    decoding rows is what keeps the step within `stall` times theirs."""
    from inference.serving.prefill_policy import PREFILL_FIRST, PREFILL_LEAST, StepTimes, prefill_room

    times = StepTimes()
    assert prefill_room(times.fit(), 32) == PREFILL_FIRST  # not timed yet
    for i in range(10):
        times.add(8, 0.144)
    assert times.fit() is None  # one size of step: no slope
    rng = random.Random(0)
    for i in range(300):
        rows = rng.randrange(1, 80)
        times.add(rows, (0.120 + 0.003 * rows) * rng.uniform(0.99, 1.01))
    fixed, per_row = times.fit()
    assert fixed == pytest.approx(0.120, rel=0.05) and per_row == pytest.approx(0.003, rel=0.05)
    assert prefill_room(times.fit(), 32, stall=2.0) == pytest.approx((0.120 + 0.003 * 32) / 0.003, rel=0.05)  # 72
    assert prefill_room((0.120, 0.003), 32, stall=1.5) == 36
    assert prefill_room((0.001, 0.003), 1) == PREFILL_LEAST  # a prompt always moves on


def test_prefill_stall_grows_with_the_requests_starting_beside_those_decoding():
    """A stream beside one new prompt keeps the 1.75; clients that sent their next requests together (28
    starting beside 4 decoding) get a step 7 times as long, so that their prompts go in almost whole."""
    from inference.serving.prefill_policy import PREFILL_STALL, prefill_room, prefill_stall

    assert prefill_stall(1, 8) == PREFILL_STALL
    assert prefill_stall(8, 8) == PREFILL_STALL
    assert prefill_stall(28, 4) == pytest.approx(7 * PREFILL_STALL)
    assert prefill_stall(3, 0) == pytest.approx(3 * PREFILL_STALL)  # never a division by zero
    # 120 ms a step plus 3 ms a row, 4 decoding rows: 33 prompt rows beside one starting request, 28 x 16 beside 28
    assert prefill_room((0.120, 0.003), 4, prefill_stall(1, 4)) == 33
    assert prefill_room((0.120, 0.003), 4, prefill_stall(28, 4)) >= 28 * 16


def test_batched_requests_over_offloaded_experts_get_the_resident_tokens(model_dir, reference):
    """Continuous batching over the offload ring: each MoE layer streams the union of the batch's
    experts through two slots behind a quarter-size CPU cache; four concurrent requests (a step of at
    most 16 rows: the per-row kernels, so the same bits) get the resident engine's tokens and
    log-probs."""
    eng = Engine.load(str(model_dir), EngineConfig(cpu_cache_bytes=1, ring_slots=2, preload=False))
    server = LiveServer(create_app(eng, ServeConfig(max_batch=4)))
    try:
        _answers_as_alone(server.port, reference, atol=0.0)
    finally:
        server.close()
        eng.close()


def _answers_as_alone(port: int, reference, atol: float) -> None:
    """Four requests sent at once (steps of prompts and decoding rows together) each get the reference
    engine's greedy tokens alone and its log-probs within `atol`; the storage counter shows the reads,
    and steps took several requests."""
    cases = [([1, 5, 9, 14], 12), ([3, 2], 9), ([20, 11, 4], 15), ([6], 7)]
    results: dict[int, tuple[int, object]] = {}

    def client(i: int) -> None:
        ids, n = cases[i]
        results[i] = post(port, "/v1/completions", {"prompt": ids, "max_tokens": n, "logprobs": 0})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, (ids, n) in enumerate(cases):
        want = direct(reference, ids, n)
        status, out = results[i]
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["token_ids"] == want.tokens, i
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, rel=0, abs=atol), i
    m = metrics(port)
    assert m[("semoe_storage_read_bytes_total", ())] > 0
    assert m[("semoe_batch_requests_count", ())] > m[("semoe_batch_requests_bucket", (("le", "1.0"),))]


LOGPROB_ATOL = 1e-4  # the runner's rotary tables (numpy's cos and sin) against torch's: ~1e-7 in a logit here


@needs_kernels
def test_batched_requests_through_the_kernels_over_the_runners_cache_get_their_own_tokens(model_dir, reference,
                                                                                          tmp_path):
    """The server's step over `LeanEngine` (the compiled kernels, experts read from the store into the
    runner's cache of top_k slots as each step chooses them): four concurrent requests, whose steps mix
    prompts and decoding rows, get the resident engine's greedy tokens, and log-probs within LOGPROB_ATOL;
    the storage counter shows the reads."""
    from inference.torch_free.runner import LeanConfig, LeanModel
    from inference.serving.torch_free_engine import LeanEngine
    from semoe.checkpoints.hf_convert import import_checkpoint

    import_checkpoint(str(model_dir), str(tmp_path / "store"))
    eng = LeanEngine(LeanModel(str(tmp_path / "store"), LeanConfig(cache_bytes=0)), name="lean")
    server = LiveServer(create_app(eng, ServeConfig(max_batch=4)))
    try:
        _answers_as_alone(server.port, reference, atol=LOGPROB_ATOL)
    finally:
        server.close()
        eng.close()


def _stop_case(reference) -> tuple[list[int], str, str]:
    """A prompt whose greedy text has a word after its first; that word is the stop string."""
    for first in range(3, 40):
        ids = [first, 4, 5]
        text = reference.tokenizer.decode(direct(reference, ids, 12).tokens)
        words = text.split()
        if len(words) >= 3 and words[1] != words[0]:
            return ids, words[1], text[:text.index(words[1])]
    raise AssertionError("no prompt of the tiny model generates three words")


def test_stop_strings_and_logprobs(served, reference):
    ids, stop, want_text = _stop_case(reference)
    body = {"prompt": ids, "max_tokens": 12, "stop": [stop, "no such words"], "logprobs": 0}
    status, full = post(served.port, "/v1/completions", body)
    assert status == 200, full
    choice = full["choices"][0]
    assert choice["text"] == want_text and choice["finish_reason"] == "stop"
    ref = direct(reference, ids, 12)
    n = len(choice["token_ids"])
    assert choice["token_ids"] == ref.tokens[:n] and n < len(ref.tokens)
    lp = choice["logprobs"]
    assert lp["tokens"] == [reference.tokenizer.decode([t]) for t in ref.tokens[:n]]
    assert lp["token_logprobs"] == pytest.approx(ref.logprobs[:n], abs=1e-6)
    events = stream(served.port, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == want_text
    assert [o for e in events[:-2] for o in (e["choices"][0]["logprobs"] or {}).get("text_offset", [])] == \
        lp["text_offset"]
    assert events[-2]["choices"] == [] and events[-2]["usage"] == full["usage"] and events[-1] == "[DONE]"
    status, chat = post(served.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 5, "logprobs": True})
    assert status == 200
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(
        direct(reference, reference.tokenizer.encode("<s>user the cat </s> assistant"), 5).logprobs, abs=1e-6)


def _teacher_forced_logprobs(eng: Engine, ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Log-probabilities over the vocabulary at each generated position: after the prompt, then after
    each token fed back."""
    from semoe.decode.generate import decode_one_token, new_cache, prefill

    cache = new_cache(eng.model, ids, len(tokens))
    out = [prefill(eng.model, torch.tensor([ids]), cache)]
    for t in tokens[:-1]:
        out.append(decode_one_token(eng.model, torch.tensor([[t]]), cache))
    return [torch.log_softmax(x.float(), dim=-1)[0] for x in out]


def test_top_logprobs_are_the_most_likely_tokens_at_each_position(served, reference):
    """A completion's `logprobs: k` and a chat's `top_logprobs: k` give, at each position, the k most
    likely tokens with their log-probabilities: those of the model's own distribution there (within
    1e-4, another summation order), most likely first, the greedy choice on top; streamed the same."""
    tok = reference.tokenizer
    ids = tok.encode("the cat sat", add_bos=tok.add_bos_default)
    want = direct(reference, ids, 6)
    dists = _teacher_forced_logprobs(reference, ids, want.tokens)
    status, out = post(served.port, "/v1/completions", {"prompt": ids, "max_tokens": 6, "logprobs": 3})
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert out["choices"][0]["token_ids"] == want.tokens and len(lp["top_logprobs"]) == len(want.tokens)
    for chosen, top, dist in zip(lp["tokens"], lp["top_logprobs"], dists):
        values, top_ids = torch.topk(dist, 3)
        assert list(top) == [tok.decode([int(t)]) for t in top_ids] and next(iter(top)) == chosen
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
    events = stream(served.port, "/v1/completions", {"prompt": ids, "max_tokens": 6, "logprobs": 3})
    assert [t for e in events[:-1] for t in (e["choices"][0]["logprobs"] or {}).get("top_logprobs", [])] == \
        lp["top_logprobs"]  # the same request alone: the same bits
    chat_ids = tok.encode("<s>user the cat </s> assistant")
    chat_want = direct(reference, chat_ids, 4)
    status, chat = post(served.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2})
    assert status == 200, chat
    content = chat["choices"][0]["logprobs"]["content"]
    for entry, dist in zip(content, _teacher_forced_logprobs(reference, chat_ids, chat_want.tokens)):
        values, top_ids = torch.topk(dist, 2)
        assert [t["token"] for t in entry["top_logprobs"]] == [tok.decode([int(t)]) for t in top_ids]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["bytes"] == list(entry["token"].encode())


def test_n_choices_are_the_requests_with_seed_plus_their_index(served):
    """`n` > 1: choice i is what the same request alone gives with seed + i, whole or streamed (each
    chunk naming its choice); the usage counts every choice's tokens."""
    body = {"prompt": [3, 4, 5], "max_tokens": 6, "temperature": 1.3, "seed": 21, "n": 3}
    status, out = post(served.port, "/v1/completions", body)
    assert status == 200, out
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for i, c in enumerate(choices):
        status, alone = post(served.port, "/v1/completions", {**body, "n": 1, "seed": 21 + i})
        assert status == 200 and c["token_ids"] == alone["choices"][0]["token_ids"]
        assert c["text"] == alone["choices"][0]["text"]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1  # three samples, not one copied
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    events = stream(served.port, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished = set()
    for e in events[:-2]:
        (c,) = e["choices"]
        got[c["index"]] += c["token_ids"]
        if c["finish_reason"]:
            finished.add(c["index"])
    assert got == {i: c["token_ids"] for i, c in enumerate(choices)} and finished == {0, 1, 2}
    assert events[-2]["usage"] == out["usage"] and events[-1] == "[DONE]"
    chat = stream(served.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "the cat"}],
                                                        "max_tokens": 3, "n": 2})
    assert [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in chat[:2]] == \
        [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    texts = ["".join(e["choices"][0]["delta"].get("content", "") for e in chat[:-1] if e["choices"][0]["index"] == i)
             for i in range(2)]
    assert texts[0] == texts[1] != ""  # greedy: both choices the same tokens


def test_sampling_is_seeded(served):
    body = {"prompt": [3, 4, 5], "max_tokens": 8, "temperature": 1.5, "top_p": 0.9, "seed": 11}
    a, b = post(served.port, "/v1/completions", body), post(served.port, "/v1/completions", body)
    assert a[0] == b[0] == 200 and a[1]["choices"][0]["token_ids"] == b[1]["choices"][0]["token_ids"]


BAD_REQUESTS = [  # (path, body or raw bytes, param the error must name, message fragment)
    ("/v1/completions", b"{not json", None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", None, "JSON object"),
    ("/v1/completions", {"max_tokens": 4}, "prompt", "prompt is required"),
    ("/v1/completions", {"prompt": 5}, "prompt", "string or a list of token ids"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "string or a list of token ids"),
    ("/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("/v1/completions", {"prompt": [1, 96]}, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "the", "max_tokens": "5"}, "max_tokens", "must be a integer"),
    ("/v1/completions", {"prompt": "the", "max_tokens": 0}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "the", "max_tokens": -3}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "the", "max_tokens": 1.5}, "max_tokens", "must be a integer"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": MAX_POSITION - 2}, "max_tokens", "exceeds"),
    ("/v1/completions", {"prompt": [1] * MAX_POSITION}, "prompt", "no room"),
    ("/v1/completions", {"prompt": "the", "temperature": -0.5}, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "the", "temperature": "hot"}, "temperature", "must be a number"),
    ("/v1/completions", {"prompt": "the", "top_p": 0}, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "the", "top_p": 1.5}, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "the", "n": 0}, "n", "n must be in [1, 16]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 17}, "n", "n must be in [1, 16]"),
    ("/v1/completions", {"prompt": "the", "stream": "yes"}, "stream", "must be a boolean"),
    ("/v1/completions", {"prompt": "the", "stop": 3}, "stop", "stop must be"),
    ("/v1/completions", {"prompt": "the", "stop": [""]}, "stop", "stop must be"),
    ("/v1/completions", {"prompt": "the", "seed": -1}, "seed", "seed must be"),
    ("/v1/completions", {"prompt": "the", "logprobs": 9}, "logprobs", "logprobs must be"),
    ("/v1/chat/completions", {"max_tokens": 4}, "messages", "messages is required"),
    ("/v1/chat/completions", {"messages": []}, "messages", "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "wizard"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]", "object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "temperature": -1}, "temperature",
     ">= 0"),
    # fields the server does not implement: refused by name, never silently ignored
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs",
     "needs logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "the", "logit_bias": {"5": 3}}, "logit_bias", "not supported"),
    ("/v1/completions", {"prompt": "the", "presence_penalty": 0.5}, "presence_penalty", "only 0 is accepted"),
    ("/v1/completions", {"prompt": "the", "frequency_penalty": -1}, "frequency_penalty", "not supported"),
    ("/v1/completions", {"prompt": "the", "guided_json": {}}, "guided_json", "not supported"),
    ("/v1/completions", {"prompt": "the", "top_logprobs": 1}, "top_logprobs", "not supported"),
    ("/v1/completions", {"prompt": "the", "stop_token_ids": [3, 96]}, "stop_token_ids", "token ids in 0..95"),
    ("/v1/completions", {"prompt": "the", "stop_token_ids": 3}, "stop_token_ids", "must be a array"),
    ("/v1/completions", {"prompt": "the", "ignore_eos": 1}, "ignore_eos", "must be a boolean"),
]


def test_malformed_requests_get_400_naming_the_param(served):
    for path, body, param, fragment in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else None
        status, out = post(served.port, path, None if raw else body, raw=raw)
        assert status == 400, (body, out)
        err = out["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        assert fragment in err["message"], (body, err)
    status, out = request(served.port, "GET", "/v1/nothing")
    assert status == 404 and "error" in out
    status, out = post(served.port, "/v1/completions", {"prompt": "the cat", "max_tokens": 2})
    assert status == 200 and len(out["choices"][0]["token_ids"]) >= 1


def test_fields_asking_for_nothing_pass_and_the_eos_and_stop_id_fields_set_the_stop_ids(served, reference):
    """Clients that send the neutral value of a field the server does not implement (penalties of 0,
    no tools, no logit bias) are served; `stop_token_ids` adds ids that end generation, `ignore_eos`
    removes the model's; without a seed each request draws its own."""
    from inference.serving.openai_protocol import parse_chat, parse_completion

    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "user": "u1",
               "response_format": {"type": "text"}, "model": reference.name}
    status, out = post(served.port, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 3, **neutral})
    assert status == 200, out
    eos = reference.stop_ids()
    assert eos and parse_completion({"prompt": [1]}, reference).sampling.stop_ids == eos
    assert parse_completion({"prompt": [1], "ignore_eos": True}, reference).sampling.stop_ids == ()
    assert parse_completion({"prompt": [1], "stop_token_ids": [5, eos[0]]}, reference).sampling.stop_ids == \
        (*eos, 5)
    chat = parse_chat({"messages": [{"role": "user", "content": "a"}], "stop_token_ids": [9], "ignore_eos": True},
                      reference, ChatTemplate.default())
    assert chat.sampling.stop_ids == (9,)
    seeds = {parse_completion({"prompt": [1], "temperature": 1.0}, reference).sampling.seed for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= x < 2**63 for x in seeds)
    assert parse_completion({"prompt": [1], "seed": 7}, reference).sampling.seed == 7
    # a stop id ends the text where it is generated, as an EOS does
    ids = [1, 5, 9, 14]
    ref = reference.generate(ids, SamplingConfig(max_new_tokens=10))
    cut = next(i for i, t in enumerate(ref.tokens) if i >= 2 and t not in ref.tokens[:i])
    status, out = post(served.port, "/v1/completions", {"prompt": ids, "max_tokens": 10, "ignore_eos": True,
                                                        "stop_token_ids": [ref.tokens[cut]]})
    assert status == 200 and out["choices"][0]["token_ids"] == ref.tokens[:cut + 1]
    assert out["choices"][0]["finish_reason"] == "stop"


def test_the_official_openai_client(served, reference):
    """The `openai` package against the server: completions and chat, whole and streamed, the
    tokens a direct generation gives; a field the server does not implement is an error it raises."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="none", max_retries=0)
    tok = reference.tokenizer
    want = direct(reference, tok.encode("the cat sat", add_bos=tok.add_bos_default), 8)
    text = tok.decode(want.tokens)
    done = client.completions.create(model=reference.name, prompt="the cat sat", max_tokens=8)
    assert done.choices[0].text == text and done.usage.completion_tokens == len(want.tokens)
    parts = client.completions.create(model=reference.name, prompt="the cat sat", max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in parts) == text
    chat_want = direct(reference, tok.encode("<s>user the cat </s> assistant"), 6)
    messages = [{"role": "user", "content": "the cat"}]
    reply = client.chat.completions.create(model=reference.name, messages=messages, max_tokens=6, logprobs=True)
    assert reply.choices[0].message.content == tok.decode(chat_want.tokens)
    assert [c.logprob for c in reply.choices[0].logprobs.content] == pytest.approx(chat_want.logprobs, abs=1e-6)
    chunks = list(client.chat.completions.create(model=reference.name, messages=messages, max_tokens=6, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tok.decode(chat_want.tokens)
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    two = client.chat.completions.create(model=reference.name, messages=messages, max_tokens=6, n=2, logprobs=True,
                                         top_logprobs=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [reply.choices[0].message.content] * 2  # greedy
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in two.choices[1].logprobs.content)
    assert [m.id for m in client.models.list()] == [reference.name]
    with pytest.raises(openai.BadRequestError, match="response_format is not supported"):
        client.chat.completions.create(model=reference.name, messages=messages, response_format={"type": "json_object"})


def test_no_tokenizer_rejects_text(scripted):
    for path, body, param in (("/v1/completions", {"prompt": "the cat"}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "messages"),
                              ("/v1/completions", {"prompt": [3], "stop": "x"}, "stop")):
        status, out = post(scripted.port, path, body)
        assert status == 400 and out["error"]["param"] == param and "no tokenizer" in out["error"]["message"]


def test_health_models_and_metrics(served, engine):
    status, health = request(served.port, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["draining"] is False
    status, ready = request(served.port, "GET", "/ready")
    assert status == 200 and ready["status"] == "ready"
    status, models = request(served.port, "GET", "/v1/models")
    assert status == 200 and models["object"] == "list" and [m["id"] for m in models["data"]] == [engine.name]
    status, card = request(served.port, "GET", f"/v1/models/{engine.name}")
    assert status == 200 and card == models["data"][0]
    status, missing = request(served.port, "GET", "/v1/models/no-such-model")
    assert status == 404 and "no-such-model" in missing["error"]["message"]
    before = metrics(served.port)
    status, out = post(served.port, "/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 6})
    assert status == 200
    assert post(served.port, "/v1/completions", {"prompt": [3], "top_p": 7})[0] == 400
    after = metrics(served.port)
    assert requests_total(after, "/v1/completions", 200) == requests_total(before, "/v1/completions", 200) + 1
    assert requests_total(after, "/v1/completions", 400) == requests_total(before, "/v1/completions", 400) + 1
    assert requests_total(after, "/metrics", 200) == requests_total(before, "/metrics", 200) + 1
    n = out["usage"]["completion_tokens"]
    assert after["semoe_generated_tokens_total", ()] == before["semoe_generated_tokens_total", ()] + n
    assert after["semoe_prompt_tokens_total", ()] == before["semoe_prompt_tokens_total", ()] + 3
    assert after["semoe_queue_depth", ()] == 0
    assert after["semoe_tokens_per_second", ()] > 0 and after["semoe_last_request_ttft_seconds", ()] > 0
    assert after["semoe_peak_rss_bytes", ()] > 0
    assert ("semoe_offload_ring_hit_rate", ()) in after  # exported; stays 0 for a resident engine


def test_latency_histograms_kv_bytes_and_the_request_log(engine, model_dir, tmp_path):
    """Per request: one time-to-first-token and one end-to-end observation, an inter-token one per
    token after the first; KV bytes while it generates and none after; a JSON line in the request log
    for each finished request, a client that left included."""
    log_path = tmp_path / "requests.jsonl"
    eng = ScriptedEngine(engine)
    server = LiveServer(create_app(eng, ServeConfig(request_log=str(log_path))))
    try:
        before = metrics(server.port)
        eng.gate.clear()
        box = {}
        t = threading.Thread(target=lambda: box.update(r=post(server.port, "/v1/completions",
                                                             {"prompt": [3, 4, 5], "max_tokens": 6})))
        t.start()
        assert eng.started.wait(10)
        held = metrics(server.port)["semoe_kv_cache_bytes", ()]
        assert held == engine.kv_cache_bytes(3 + 6) > 0
        eng.gate.set()
        t.join(30)
        status, out = box["r"]
        assert status == 200 and out["usage"]["completion_tokens"] == 6
        after = metrics(server.port)
        for name, n in (("semoe_time_to_first_token_seconds_count", 1), ("semoe_request_latency_seconds_count", 1),
                        ("semoe_inter_token_latency_seconds_count", 5)):
            assert after[name, ()] == before.get((name, ()), 0) + n, name
        assert after["semoe_kv_cache_bytes", ()] == 0 and after["semoe_storage_read_bytes_total", ()] == 0
        eng.token_delay_s = 0.2  # a streamed request whose client leaves after its first event
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [3, 4], "max_tokens": 50, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.readline()
        conn.close()
        wait_for(lambda: log_path.exists() and len(log_path.read_text().splitlines()) == 2, "the second log line")
    finally:
        eng.gate.set()
        server.close()
    first, second = (json.loads(x) for x in log_path.read_text().splitlines())
    assert first["status"] == "length" and (first["prompt_tokens"], first["tokens"]) == (3, 6)
    assert first["ttft_s"] > 0 and first["mean_itl_s"] > 0 and first["latency_s"] >= first["ttft_s"]
    assert second["status"] == "cancelled" and 1 <= second["tokens"] < 50 and second["id"] != first["id"]
    assert first["id"] == out["id"]  # the answer's id


def test_queue_full_gets_503(scripted):
    eng = scripted.engine
    eng.gate.clear()
    eng.started.clear()
    results: dict[str, tuple] = {}
    body = {"prompt": [3, 4], "max_tokens": 3}

    def client(name: str) -> None:
        results[name] = post(scripted.port, "/v1/completions", body)

    running = threading.Thread(target=client, args=("running",))
    running.start()
    assert eng.started.wait(10)  # the first request is running, the one place in the batch taken
    waiting = threading.Thread(target=client, args=("waiting",))
    waiting.start()
    wait_for(lambda: request(scripted.port, "GET", "/health")[1]["queue_depth"] == 1, "the second request to queue")
    conn = http.client.HTTPConnection("127.0.0.1", scripted.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    # back-pressure that says so: 503 at once, with when to come back, not a time-out
    assert resp.status == 503 and "queue is full" in out["error"]["message"]
    assert out["error"]["type"] == "server_overloaded" and int(resp.getheader("Retry-After")) >= 1
    status, _ = post(scripted.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400  # checked before queueing
    eng.gate.set()
    running.join(20)
    waiting.join(20)
    assert results["running"][0] == results["waiting"][0] == 200
    assert results["running"][1]["choices"][0]["token_ids"] == results["waiting"][1]["choices"][0]["token_ids"]
    assert requests_total(metrics(scripted.port), "/v1/completions", 503) == 1


def test_stopping_lets_requests_finish_within_the_deadline_and_ends_the_rest_with_503(engine, tmp_path):
    """SIGTERM's path: draining first (/ready and new requests on an open connection say so), then
    `DrainingServer.handle_exit` as the signal handler calls it: a request that can finish within
    --shutdown-timeout does, with its tokens; one that cannot gets 503 naming the stop, streamed or not (its
    status line gone out, in the stream); the server then exits by itself. The request log says "stopped" for
    those, and no client is counted as having left."""
    eng = ScriptedEngine(engine)
    eng.token_delay_s = 0.05  # a step: 3 tokens take 0.15 s, 100 take 5 s
    log_path = tmp_path / "requests.jsonl"
    app = create_app(eng, ServeConfig(max_batch=4, shutdown_timeout=1.5, request_log=str(log_path)))
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = DrainingServer(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"),
                            app.state.worker, 1.5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, "the server to start")
    results: dict[str, object] = {}
    short, long = {"prompt": [3, 4], "max_tokens": 3}, {"prompt": [3, 5], "max_tokens": 100}

    def client(name: str, body: dict) -> None:
        results[name] = stream(port, "/v1/completions", body) if body.get("stream") else post(
            port, "/v1/completions", body)

    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # open before the stop: it may still ask
    kept.request("GET", "/ready")
    resp = kept.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["status"] == "ready"
    eng.gate.clear()
    eng.started.clear()
    threads = [threading.Thread(target=client, args=args) for args in
               (("short", short), ("long", long), ("long stream", {**long, "stream": True}))]
    for t in threads:
        t.start()
    assert eng.started.wait(10)
    wait_for(lambda: app.state.worker.busy == 3, "three requests in flight")
    app.state.worker.drain()  # handle_exit's first act, here before uvicorn starts closing idle connections
    kept.request("GET", "/ready")
    resp = kept.getresponse()
    assert resp.status == 503 and json.loads(resp.read())["status"] == "draining"
    kept.request("POST", "/v1/completions", body=json.dumps(short), headers={"Content-Type": "application/json"})
    resp = kept.getresponse()
    out = json.loads(resp.read())
    assert resp.status == 503 and out["error"]["type"] == "server_stopping", out
    kept.close()
    server.handle_exit(signal.SIGTERM, None)
    eng.gate.set()
    for t in threads:
        t.join(30)
    thread.join(30)
    sock.close()
    assert not thread.is_alive()  # uvicorn stopped by itself once the requests were answered
    status, out = results["short"]
    assert status == 200 and len(out["choices"][0]["token_ids"]) == 3
    status, out = results["long"]
    assert status == 503 and "the server is stopping" in out["error"]["message"]
    assert out["error"]["type"] == "server_stopping"
    events = results["long stream"]  # its status line went out with the first token: the error ends the stream
    assert any("the server is stopping" in e["error"]["message"] for e in events if isinstance(e, dict) and "error" in e)
    assert app.state.worker.busy == 0
    assert sorted(json.loads(line)["status"] for line in log_path.read_text().splitlines()) == [
        "length", "stopped", "stopped"]
    counted = {m.name: m.value for m in app.state.worker.metrics.cancelled.collect()[0].samples}
    assert counted["semoe_cancelled_requests_total"] == 0


def test_the_kv_memory_budget_queues_requests_and_refuses_one_that_never_fits(engine):
    """--kv-memory: a second request waits while the first holds the room (though the batch has places),
    runs when it frees, and a request whose cache alone exceeds the budget gets 400 naming the limit."""
    eng = ScriptedEngine(engine)
    body = {"prompt": [3, 4], "max_tokens": 3}
    one = engine.kv_cache_bytes(5)
    server = LiveServer(create_app(eng, ServeConfig(max_batch=4, kv_memory_bytes=one + one // 2)))
    try:
        eng.gate.clear()
        results = []
        threads = [threading.Thread(target=lambda: results.append(post(server.port, "/v1/completions", body)))
                   for _ in range(2)]
        threads[0].start()
        assert eng.started.wait(10)
        threads[1].start()
        wait_for(lambda: request(server.port, "GET", "/health")[1]["queue_depth"] == 1, "the second to wait for room")
        m = metrics(server.port)
        assert m[("semoe_requests_running", ())] == 1 and m[("semoe_kv_cache_bytes", ())] == one
        status, out = post(server.port, "/v1/completions", {"prompt": [3, 4], "max_tokens": 20})
        assert status == 400 and "--kv-memory" in out["error"]["message"] and out["error"]["param"] == "max_tokens"
        eng.gate.set()
        for t in threads:
            t.join(20)
        assert [r[0] for r in results] == [200, 200]
        assert results[0][1]["choices"][0]["token_ids"] == results[1][1]["choices"][0]["token_ids"]
        assert metrics(server.port)[("semoe_kv_cache_bytes", ())] == 0
    finally:
        eng.gate.set()
        server.close()


@pytest.mark.parametrize("model", ["mixtral", "deepseek_v32", "qwen3_next", "deepseek_v4"])
def test_kv_caches_grow_and_a_preempted_request_goes_on_with_its_own_tokens(engine, reference, family_engines, model):
    """Caches start at the prompt and 4 positions and grow by 4: three requests that together need more
    than the budget all run at first; when a cache cannot grow, the newest is preempted and, once
    there is room, computes its prompt and tokens again and goes on. Each gets the tokens it gets
    alone (log-probs within 1e-4: its recomputed positions sum in another order); preemptions are
    counted and every byte is given back. With sparse attention (DeepSeek-V3.2) the budget counts
    the indexer's keys, which grow and come back with the rest of the cache. With linear attention
    (Qwen3-Next) it counts each Gated DeltaNet layer's state, whose size does not grow; a preempted
    request's state is computed again with its positions. DeepSeek-V4's count bounds what its layers hold
    (the window's keys, an entry per m tokens, the tokens waiting for the next)."""
    if model != "mixtral":
        engine, reference = family_engines(model)
        c = engine.model.config
    if model == "deepseek_v32":
        assert engine.kv_cache_bytes(10) == 10 * c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim
                                                                 + c.index_head_dim) * 4
    if model == "qwen3_next":
        (_, conv, k), (_, hv, dk, dv) = c.linear_state_shapes(1)
        state = len(c.linear_layers) * (conv * k + hv * dk * dv) * 4
        attending = c.num_layers - len(c.linear_layers)
        for n in (10, 40):
            assert engine.kv_cache_bytes(n) == attending * 2 * n * c.num_kv_heads * c.head_dim * 4 + state
            cache = engine.new_cache(list(range(n // 2)), n - n // 2)
            held = sum(t.nbytes for t in (*cache.k, *cache.v)) + cache.state_bytes()
            assert held == engine.kv_cache_bytes(n) and cache.state_bytes() == state
    if model == "deepseek_v4":
        for n in (3, 9, 40):
            cache = engine.new_cache(list(range(1, n)), 1)
            engine.model(torch.tensor([list(range(1, n + 1))]), cache)
            held, bound = cache.state_bytes(), engine.kv_cache_bytes(n)
            assert 0 < held <= bound <= held + c.compressed_state_bytes(1, 0, 4), (n, held, bound)
    eng = ScriptedEngine(engine)
    prompts = [[3, 4, 5, 6, 7 + i] for i in range(3)]
    want = [reference.generate(p, SamplingConfig(max_new_tokens=20)) for p in prompts]
    # 40 positions among the three requests, beside what each holds whatever its length (a state of fixed size)
    budget = engine.kv_cache_bytes(40) + 2 * engine.kv_cache_bytes(0)
    server = LiveServer(create_app(eng, ServeConfig(max_batch=4, kv_memory_bytes=budget, kv_grow_tokens=4)))
    try:
        eng.gate.clear()
        results: dict[int, tuple] = {}
        threads = [threading.Thread(target=lambda i=i: results.update({i: post(
            server.port, "/v1/completions", {"prompt": prompts[i], "max_tokens": 20, "logprobs": 0})}))
            for i in range(3)]
        threads[0].start()
        assert eng.started.wait(10)
        for t in threads[1:]:
            t.start()
        wait_for(lambda: request(server.port, "GET", "/health")[1]["queue_depth"] == 2, "all three to arrive")
        eng.gate.set()
        for t in threads:
            t.join(60)
        for i in range(3):
            status, out = results[i]
            assert status == 200, out
            choice = out["choices"][0]
            assert choice["token_ids"] == want[i].tokens
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(want[i].logprobs, abs=1e-4)
        m = metrics(server.port)
        assert m[("semoe_preempted_requests_total", ())] >= 1 and m[("semoe_kv_cache_bytes", ())] == 0
        assert m[("semoe_batch_requests_bucket", (("le", "4.0"),))] > m[("semoe_batch_requests_bucket", (("le", "2.0"),))]
    finally:
        eng.gate.set()
        server.close()


def test_a_chat_without_max_tokens_runs_as_far_as_the_kv_budget_holds(engine, model_dir):
    """No max_tokens: the rest of the context, capped at what --kv-memory holds (a length finish, not a
    400); a max_tokens the budget cannot hold is still refused."""
    server = LiveServer(create_app(engine, ServeConfig(kv_memory_bytes=engine.kv_cache_bytes(30), kv_grow_tokens=8),
                                   chat_template=load_chat_template(str(model_dir))))
    try:
        status, out = post(server.port, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "the cat"}], "ignore_eos": True})
        assert status == 200, out
        prompt = out["usage"]["prompt_tokens"]
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 30 - prompt
        status, out = post(server.port, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 40})
        assert status == 400 and "--kv-memory" in out["error"]["message"]  # asked for: refused, not cut
    finally:
        server.close()


def test_generation_error_is_500_for_that_request_only(scripted):
    fail = [ScriptedEngine.FAIL_TOKEN, 3]
    status, out = post(scripted.port, "/v1/completions", {"prompt": fail, "max_tokens": 2})
    assert status == 500 and "scripted failure" in out["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", scripted.port, timeout=10)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": fail, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 500 and "scripted failure" in json.loads(resp.read())["error"]["message"]
    conn.close()
    events = stream(scripted.port, "/v1/completions", {"prompt": [ScriptedEngine.FAIL_LATE_TOKEN], "max_tokens": 5})
    assert [len(e["choices"][0]["token_ids"]) for e in events[:2]] == [1, 1]
    assert "mid-stream" in events[2]["error"]["message"] and events[3:] == ["[DONE]"]
    status, out = post(scripted.port, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2})
    assert status == 200 and len(out["choices"][0]["token_ids"]) == 2


def test_a_failing_request_fails_alone_while_others_decode_beside_it(engine, reference):
    """Requests decoding together, one failing in a step they share (its engine step raises), one
    failing mid-stream, one whose logits turn NaN: each of those gets its error, the others the
    tokens and log-probs they get alone (1e-4: see the continuous batching test), and the server
    serves on."""
    eng = ScriptedEngine(engine)
    eng.token_delay_s = 0.01  # so that the requests overlap
    server = LiveServer(create_app(eng, ServeConfig(max_batch=8, max_batch_tokens=32)))
    try:
        good = [([2, 9, 4, 11], 24), ([3, 5], 16), ([12, 1, 10], 20)]
        bad = {"fails": [ScriptedEngine.FAIL_TOKEN, 3], "late": [ScriptedEngine.FAIL_LATE_TOKEN, 2],
               "nan": [ScriptedEngine.NAN_TOKEN, 4]}
        want = [reference.generate(ids, SamplingConfig(max_new_tokens=n)) for ids, n in good]
        results: dict[object, object] = {}

        def client(key, ids: list[int], n: int) -> None:
            results[key] = post(server.port, "/v1/completions", {"prompt": ids, "max_tokens": n, "logprobs": 0})

        steps = lambda: metrics(server.port).get(("semoe_batch_requests_count", ()), 0.0)  # noqa: E731
        threads = [threading.Thread(target=client, args=(i, ids, n)) for i, (ids, n) in enumerate(good)]
        for t in threads:
            t.start()
        wait_for(lambda: steps() >= 3, "the good requests to decode")
        threads += [threading.Thread(target=client, args=(k, ids, 10)) for k, ids in bad.items()]
        for t in threads[len(good):]:
            t.start()
        for t in threads:
            t.join(60)
        for i, res in enumerate(want):
            status, out = results[i]
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == res.tokens, i
            assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(res.logprobs, abs=1e-4), i
        for key, message in (("fails", "scripted failure"), ("late", "mid-stream"), ("nan", "not finite")):
            status, out = results[key]
            assert status == 500 and message in out["error"]["message"], (key, out)
        m = metrics(server.port)
        assert m[("semoe_failed_generations_total", ())] == 3
        assert m[("semoe_requests_running", ())] == 0 and m[("semoe_kv_cache_bytes", ())] == 0
        status, out = post(server.port, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2})
        assert status == 200 and len(out["choices"][0]["token_ids"]) == 2
    finally:
        server.close()


@pytest.fixture(scope="module")
def family_engines(tmp_path_factory):
    """arch -> an engine and a reference on a tiny checkpoint of `arch`, made on first use: DeepSeek-V3.2
    (sparse attention: its indexer reads the top 4 of the cached positions, from the indexer's keys the
    KV cache keeps beside the latents), Qwen3-Next (linear attention's fixed-size state beside the KV
    cache of its full-attention layers)."""
    made: dict[str, list[Engine]] = {}

    def get(arch: str) -> list[Engine]:
        if arch not in made:
            path = make_hf_checkpoint(arch, tmp_path_factory.mktemp(arch) / "tiny", seed=5)
            made[arch] = [Engine.load(str(path), EngineConfig()) for _ in range(2)]
        return made[arch]

    yield get
    for engines in made.values():
        for e in engines:
            e.close()


@pytest.mark.parametrize("model", ["mixtral", "deepseek_v32", "qwen3_next", "qwen3_5_moe", "deepseek_v4"])
def test_a_prompt_beginning_with_an_earlier_conversation_reuses_its_kv(engine, reference, family_engines, model):
    """Prefix reuse: a conversation's second turn resends the first turn and its answer. The server
    takes the positions the first request computed (its prompt and answer but the last token) instead
    of computing them, counts that in /metrics, and answers as from scratch: the same greedy tokens,
    log-probs within 1e-4 (the reused positions were computed by decoding steps, whose sums run in
    another order than a prompt pass's). A prompt sharing no token reuses nothing. With sparse
    attention (DeepSeek-V3.2), the reused positions bring the indexer's keys with them. With linear
    attention (Qwen3-Next) or compressed attention (DeepSeek-V4), whose kept state is that of the whole first
    conversation, a prompt that leaves it part way computes from scratch; a model with positions alone reuses
    the shared part."""
    if model != "mixtral":
        engine, reference = family_engines(model)
    server = LiveServer(create_app(engine))
    try:
        first = [1, 5, 9, 14, 3, 22, 17, 8, 30, 2, 11, 4, 6, 19, 12, 7]  # a "system prompt" and a turn
        status, out = post(server.port, "/v1/completions", {"prompt": first, "max_tokens": 6})
        assert status == 200
        answer = out["choices"][0]["token_ids"]
        second = first + answer + [25, 13, 9]
        status, out = post(server.port, "/v1/completions", {"prompt": second, "max_tokens": 8, "logprobs": 0})
        assert status == 200
        want = direct(reference, second, 8)
        assert out["choices"][0]["token_ids"] == want.tokens
        assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-4)
        m = metrics(server.port)
        # the first request's cache held its prompt and every answer token but the last
        assert m[("semoe_prefix_cache_hits_total", ())] == 1
        assert m[("semoe_prefix_cache_reused_tokens_total", ())] == len(first) + len(answer) - 1
        assert m[("semoe_prefix_cache_entries", ())] >= 1 and m[("semoe_prefix_cache_bytes", ())] > 0
        status, out = post(server.port, "/v1/completions", {"prompt": [40, 41, 42], "max_tokens": 2})
        assert status == 200 and metrics(server.port)[("semoe_prefix_cache_hits_total", ())] == 1
        branch = first[:8] + [50, 51, 52]  # the first conversation's start, then elsewhere
        status, out = post(server.port, "/v1/completions", {"prompt": branch, "max_tokens": 6, "logprobs": 0})
        want = direct(reference, branch, 6)
        assert status == 200 and out["choices"][0]["token_ids"] == want.tokens
        assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-4)
        m = metrics(server.port)
        whole_only = model in ("qwen3_next", "qwen3_5_moe", "deepseek_v4")  # a state of the entry's whole tokens
        assert m[("semoe_prefix_cache_hits_total", ())] == (1 if whole_only else 2)
        assert m[("semoe_prefix_cache_reused_tokens_total", ())] == len(first) + len(answer) - 1 + (
            0 if whole_only else 8)
    finally:
        server.close()


def test_kept_prefixes_give_way_to_running_requests_within_the_kv_memory(engine, reference):
    """Kept prefixes share --kv-memory with the running requests: a request that needs the room evicts
    them (counted) rather than waiting, and every answer is still the one computed from scratch."""
    budget = engine.kv_cache_bytes(40)
    server = LiveServer(create_app(engine, ServeConfig(max_batch=2, kv_memory_bytes=budget, kv_grow_tokens=8)))
    try:
        prompts = [[2 + i, 9, 4, 11, 5 + i, 3] for i in range(4)]
        for ids in prompts:
            status, out = post(server.port, "/v1/completions", {"prompt": ids, "max_tokens": 8})
            assert status == 200 and out["choices"][0]["token_ids"] == direct(reference, ids, 8).tokens
        before = metrics(server.port)
        assert before[("semoe_prefix_cache_bytes", ())] > budget // 2  # the kept prefixes fill most of it
        long = [3, 9, 4, 11, 5, 3, 1, 2]
        status, out = post(server.port, "/v1/completions", {"prompt": long, "max_tokens": 24})
        assert status == 200 and out["choices"][0]["token_ids"] == direct(reference, long, 24).tokens
        m = metrics(server.port)
        assert m[("semoe_prefix_cache_evictions_total", ())] > before[("semoe_prefix_cache_evictions_total", ())]
        assert m[("semoe_prefix_cache_bytes", ())] + m[("semoe_kv_cache_bytes", ())] <= budget
    finally:
        server.close()


def test_client_disconnect_mid_stream_does_not_wedge(scripted):
    eng = scripted.engine
    cancelled = metrics(scripted.port).get(("semoe_cancelled_requests_total", ()), 0.0)
    eng.token_delay_s = 0.02  # 100 tokens would take 2 s
    try:
        conn = http.client.HTTPConnection("127.0.0.1", scripted.port, timeout=10)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [3, 4], "max_tokens": 100, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")
        steps = len(eng.counts)
        conn.sock.close()  # leave mid-stream
        conn.close()
        wait_for(lambda: metrics(scripted.port).get(("semoe_cancelled_requests_total", ()), 0.0) == cancelled + 1,
                 "the abandoned generation to stop", timeout_s=5)
        # its sequence freed within a step of the server finding it gone: the step in flight when it left, the
        # one whose token found no reader, and none after (of 100 tokens' steps)
        assert len(eng.counts) - steps <= 3, len(eng.counts) - steps
        m = metrics(scripted.port)
        assert m[("semoe_requests_running", ())] == 0 and m[("semoe_kv_cache_bytes", ())] == 0
    finally:
        eng.token_delay_s = 0.0
    events = stream(scripted.port, "/v1/completions", {"prompt": [3, 4], "max_tokens": 4})
    assert events[-1] == "[DONE]" and len([e for e in events[:-1] if e["choices"][0]["token_ids"]]) == 4
    assert request(scripted.port, "GET", "/health")[0] == 200


def test_a_client_leaving_an_n_choice_stream_frees_every_choice(engine):
    """A streamed request of n=2 whose client leaves mid-stream: both choices stop, their places and
    KV caches are freed."""
    eng = ScriptedEngine(engine)
    eng.token_delay_s = 0.02  # 100 tokens would take 2 s
    server = LiveServer(create_app(eng, ServeConfig(max_batch=4)))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"prompt": [3, 4], "max_tokens": 100, "stream": True, "n": 2}))
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        assert metrics(server.port)[("semoe_requests_running", ())] == 2
        conn.sock.close()  # leave mid-stream
        conn.close()
        wait_for(lambda: metrics(server.port).get(("semoe_cancelled_requests_total", ()), 0.0) == 2,
                 "both choices to stop", timeout_s=5)
        m = metrics(server.port)
        assert m[("semoe_requests_running", ())] == 0 and m[("semoe_kv_cache_bytes", ())] == 0
    finally:
        server.close()


def test_client_leaving_while_queued_is_skipped(scripted):
    eng = scripted.engine
    eng.gate.clear()
    eng.started.clear()
    cancelled = metrics(scripted.port).get(("semoe_cancelled_requests_total", ()), 0.0)
    results = []
    running = threading.Thread(target=lambda: results.append(
        post(scripted.port, "/v1/completions", {"prompt": [3], "max_tokens": 2})))
    running.start()
    assert eng.started.wait(10)
    for streamed in (False, True):  # a non-streamed and a streamed client, each leaving while queued
        conn = http.client.HTTPConnection("127.0.0.1", scripted.port, timeout=10)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [4], "max_tokens": 2, "stream": streamed}),
                     headers={"Content-Type": "application/json"})
        wait_for(lambda: request(scripted.port, "GET", "/health")[1]["queue_depth"] == 1, "the request to queue")
        conn.sock.close()
        conn.close()
        # the server polls every 0.5 s and then withdraws the request from the queue
        wait_for(lambda: request(scripted.port, "GET", "/health")[1]["queue_depth"] == 0, "the server to notice",
                 timeout_s=3)
    eng.gate.set()
    running.join(20)
    assert results[0][0] == 200
    assert metrics(scripted.port)[("semoe_cancelled_requests_total", ())] == cancelled + 2


# -- pieces ------------------------------------------------------------------------------------

def test_text_assembler_holds_back_partial_stops():
    pieces = {1: "the", 2: " ca", 3: "t", 4: " sat", 5: "\ufffd", 6: "é"}

    def decode(ids):  # a byte-level tokenizer's view: 5 then 6 completes one character
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffdé", "é")

    a = TextAssembler(decode, ["cat s"])
    assert [a.add(1), a.add(2), a.add(3)] == ["the", " ", ""]  # "ca", "cat" could begin "cat s"
    assert a.add(4) == "" and a.stopped and a.text == "the "
    b = TextAssembler(decode, ["zz"])
    assert [b.add(1), b.add(5), b.add(6), b.finish()] == ["the", "", "é", ""]
    c = TextAssembler(decode, ["cat s"])
    assert [c.add(1), c.add(2), c.finish()] == ["the", " ", "ca"]  # generation ended: release what was held
    assert c.text == "the ca"


def test_text_assembler_streams_a_byte_level_tokenizers_text_decoding_small_windows():
    """A byte-level BPE (characters split across tokens, words carrying their leading space): the
    streamed pieces add up to the whole decode, and each token decodes a window of a few ids, not
    the generation so far (which made a long generation quadratic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "the café sat on the mat, naïve dogs ran 🐕 to the big red barn; " * 3
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    ids = tok.encode(text * 10).ids
    windows = []

    def decode(part):
        windows.append(len(part))
        return tok.decode(part)

    a = TextAssembler(decode, ["zebra"])
    streamed = "".join(a.add(i) for i in ids) + a.finish()
    assert streamed == tok.decode(ids) == text * 10 and not a.stopped
    assert len(ids) > 500 and max(windows) <= 6, max(windows)  # 🐕 is 4 bytes: a few ids at most
    b = TextAssembler(tok.decode, ["naïve dogs"])  # a stop string found across tokens, far into the text
    out = "".join(b.add(i) for i in ids if not b.stopped) + b.finish()
    assert b.stopped and out == "the café sat on the mat, "


def test_chat_templates(model_dir, tmp_path):
    from semoe.checkpoints.hf_convert import import_checkpoint

    messages = [{"role": "user", "content": "the cat"}]
    assert load_chat_template(str(model_dir)).render(messages) == "<s>user the cat </s> assistant"
    store = import_checkpoint(str(model_dir), str(tmp_path / "store"))
    assert load_chat_template(store.root).render(messages) == "<s>user the cat </s> assistant"
    plain = tmp_path / "plain"
    plain.mkdir()
    fallback = load_chat_template(str(plain))
    assert fallback.fallback and fallback.source == FALLBACK_TEMPLATE
    assert fallback.render(messages + [{"role": "assistant", "content": "a mat"}]) == \
        "user: the cat\nassistant: a mat\nassistant:"
    strict = ChatTemplate("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="system first"):
        strict.render(messages)
    with pytest.raises(ChatTemplateError, match="failed"):  # the sandbox refuses attribute games
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(messages)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_engine_config_from_budget_flags(model_dir):
    from semoe.checkpoints.hf_convert import open_checkpoint
    from tools.cli_output import UsageError
    from tools.engine_flags import engine_config_from_args, expert_bytes
    from tools.serve_cmd import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    ck = open_checkpoint(str(model_dir))
    total = sum(t.nbytes for name, t in ck.tensors.items() if ".experts." in name)
    assert expert_bytes(str(model_dir)) == total
    args = parser.parse_args(["serve", "--model", str(model_dir), "--device", "cpu", "--cpu-cache", "50%",
                              "--device-memory", "2KiB", "--ring-slots", "3"])
    cfg = engine_config_from_args(args)
    assert (cfg.device, cfg.dtype, cfg.cpu_cache_bytes, cfg.device_memory_bytes, cfg.ring_slots) == \
        ("cpu", "float32", total // 2, 2048, 3) and cfg.offloaded
    assert not engine_config_from_args(parser.parse_args(["serve", "--model", str(model_dir), "--device", "cpu"])
                                       ).offloaded
    auto = engine_config_from_args(parser.parse_args(["serve", "--model", str(model_dir), "--cpu-cache", "auto"]))
    assert auto.cpu_cache_bytes == "auto" and auto.offloaded
    for flags, message in ((["--cpu-cache", "lots"], "--cpu-cache"), (["--device-memory", "150%"], "--device-memory"),
                           (["--device-memory", "auto"], "--device-memory takes a size"),
                           (["--ring-slots", "0"], "--ring-slots")):
        with pytest.raises(UsageError, match=message):
            engine_config_from_args(parser.parse_args(["serve", "--model", str(model_dir), *flags]))


# `semoe serve` without tools/cli.py: the subcommand's own parser and handler in a child process.
_SERVE = ("import argparse, sys; from tools import serve_cmd; p = argparse.ArgumentParser(); "
          "serve_cmd.add_parser(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.handler(a))")


@pytest.mark.slow  # starts processes
def test_serve_command_offloaded_stops_cleanly_on_sigterm(model_dir, reference, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = child_env(TMPDIR=str(tmp))
    log_path = tmp_path / "requests.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, "serve", "--model", str(model_dir), "--port", "0",
                             "--device", "cpu", "--cpu-cache", "50%", "--ring-slots", "2",
                             "--request-log", str(log_path)],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        port, lines = serving_port(proc)
        assert "offloaded on cpu" in lines[-1]
        assert any(tmp.glob("semoe-store-*"))  # the directory was imported into a temporary store
        status, out = post(port, "/v1/completions", {"prompt": [1, 5, 9, 14], "max_tokens": 10})
        assert status == 200 and out["choices"][0]["token_ids"] == direct(reference, [1, 5, 9, 14], 10).tokens
        m = metrics(port)
        assert 0 <= m["semoe_offload_cpu_hit_rate", ()] <= 1 and m["semoe_offload_ssd_bytes_per_token", ()] > 0
        assert m["semoe_storage_read_bytes_total", ()] > 0  # experts read from the store
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert "stopped" in proc.stderr.read()
        (line,) = log_path.read_text().splitlines()  # written and closed by the time the server exits
        record = json.loads(line)
        assert record["status"] == "length" and record["prompt_tokens"] == 4 and record["tokens"] == 10
        assert 0 < record["ttft_s"] <= record["latency_s"] and record["mean_itl_s"] > 0
        assert not any(tmp.glob("semoe-store-*"))  # engine.close() ran
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@pytest.mark.slow  # starts processes
def test_sigterm_with_a_stream_in_flight_finishes_it_exits_0_and_the_store_verifies(model_dir, reference, tmp_path):
    """`semoe serve` on a store, a streaming request in flight (its first token read) when SIGTERM comes: the
    request completes with its tokens, the process exits 0 saying it stopped, and `semoe store verify` passes."""
    from semoe.checkpoints.hf_convert import import_checkpoint

    store = import_checkpoint(str(model_dir), str(tmp_path / "store")).root
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, "serve", "--model", store, "--port", "0",
                             "--shutdown-timeout", "60"], stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    try:
        port, _ = serving_port(proc)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [1, 5, 9, 14], "max_tokens": 100,
                                                                  "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")  # the first token is out
        proc.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        conn.close()
        assert rest.rstrip().endswith("data: [DONE]") and '"error"' not in rest
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        assert "stopping" in err and "stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    res = subprocess.run([sys.executable, "-m", "tools.cli", "store", "verify", store], capture_output=True, text=True,
                         env=child_env(), cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr


def test_serve_reads_a_store_once_and_builds_its_limits_once(model_dir, tmp_path, monkeypatch):
    """`semoe serve --cpu-cache 25%` on a store: its manifest is read once (the percentage, the
    placement, the chat template and the load share the store opened), and the server runs with the
    one ServeConfig the flags made."""
    import inference.serving.http_server
    import storage.reader
    from semoe.checkpoints.hf_convert import import_checkpoint
    from tools.cli import main

    store = str(tmp_path / "store")
    import_checkpoint(str(model_dir), store)
    reads, got = [], {}
    real = storage.reader.load_manifest
    monkeypatch.setattr(storage.reader, "load_manifest", lambda root: reads.append(root) or real(root))
    monkeypatch.setattr(inference.serving.http_server, "serve", lambda engine, host, port, config, **kw: got.update(
        config=config, offloaded=engine.offload is not None))
    assert main(["serve", "--model", store, "--cpu-cache", "25%", "--max-batch", "4", "--kv-memory", "1MiB"]) == 0
    assert reads == [store]
    assert got == {"config": ServeConfig(max_batch=4, kv_memory_bytes=1 << 20), "offloaded": True}


@needs_kernels
def test_serve_takes_the_kernels_by_itself_where_memory_is_short(model_dir, tmp_path, monkeypatch, capsys,
                                                                   machine_without_gpu):
    """`semoe serve` with no budget flag on a store: where the model does not fit the memory available
    less --kv-memory, it serves through the kernels over the runner's cache (`LeanEngine`) and says so;
    where it fits, the resident engine. Without --kv-memory there, the KV memory is an eighth of the
    memory available, said on stderr. `--lean` refuses the engine's flags and a HuggingFace directory in
    one line."""
    import inference.placement
    import inference.serving.http_server
    from semoe.checkpoints.hf_convert import import_checkpoint
    from tools.cli import main

    store = str(tmp_path / "store")
    import_checkpoint(str(model_dir), store)
    mb = inference.placement.model_bytes(store)
    got = []
    monkeypatch.setattr(inference.serving.http_server, "serve", lambda engine, host, port, config, **kw: got.append(
        (type(engine).__name__, config)))
    for available in (mb.total // 2, 8 * mb.total + (1 << 30)):
        monkeypatch.setattr(inference.placement, "available_ram_bytes", lambda a=available: a)
        assert main(["serve", "--model", store, "--kv-memory", "1MiB", "--max-batch", "4"]) == 0
        err = capsys.readouterr().err
        assert ("serving through the compiled kernels" in err) == (available < mb.total)
    assert got == [("LeanEngine", ServeConfig(max_batch=4, kv_memory_bytes=1 << 20)),
                   ("Engine", ServeConfig(max_batch=4, kv_memory_bytes=1 << 20))]
    assert main(["serve", "--model", store, "--lean"]) == 0
    assert "an eighth of the memory available" in capsys.readouterr().err
    assert got[-1][0] == "LeanEngine" and got[-1][1].kv_memory_bytes > 0
    for flags, message in ((["--model", store, "--ring-slots", "2"], "--ring-slots is the engine's"),
                           (["--model", str(model_dir)], "is not one")):
        assert main(["serve", "--lean", *flags]) == 2
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("semoe: error:")]
        assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("flags, message", [
    (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["--max-batch", "8", "--max-batch-tokens", "4"], "--max-batch-tokens must be >= --max-batch (8), got 4"),
    (["--kv-memory", "25%"], "--kv-memory: a percentage is not allowed here"),
    (["--kv-memory", "lots"], "--kv-memory: expected a size like 512MiB"),
])
def test_serve_rejects_bad_batching_flags_in_one_line(model_dir, capsys, flags, message):
    from tools.cli import main

    rc = main(["serve", "--model", str(model_dir), "--device", "cpu", *flags])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("semoe: error:")]
    assert rc == 2 and len(lines) == 1 and message in lines[0], err
