"""A soak of `semoe serve`: hours of mixed and hostile load on loopback, then what the server still holds.

A real `semoe serve` process (--workdir's --store, no budget flag, --max-batch and --max-queue as given) takes
--clients client threads for --minutes (default 30). Each client sends one request after another, every one
bounded in tokens (at most 32 new) and in time (--request-timeout), drawn from this mix:
- completions and chats, streamed and not, some with `n` = 2;
- chats that share one system prompt (the prefix cache's case);
- prompts that fill the context exactly, and prompts over it (a 400 naming the prompt is the right answer);
- streams left mid-way, and requests whose client hangs up before the answer;
- malformed JSON, fields of the wrong type (a 400 naming the field), unknown fields (semoe refuses them: a 400
  naming the field; an answer would do too);
- every --burst-every seconds, a burst of 4 x --max-batch clients at once (503 with Retry-After is the right
  answer beyond the queue).

The first --warm-minutes (5) are the warm-up phase, then steady, and the bursts are a phase of their own. The
report gives:
- requests by kind and outcome (5xx that the request did not cause are the failures);
- the server's RSS over time, and its growth after the warm-up (goal: at most 5%); the same less the KV bytes the
  prefix cache keeps (/metrics), which fills up to its bound (`--prefix-cache`, 1 GiB by default) by design;
- the KV bytes, running requests and queue still held at the end, from /metrics (goal: 0);
- latency percentiles per phase (time to the first token and between tokens of streams, whole latency of
  the rest);
- for a sample of greedy requests that completed under load, whether the same request asked alone on the idle
  server gets the same tokens.

    python bench/bench_soak.py --workdir DIR [--minutes 30] [--clients 12] [--max-batch 8] [--json FILE]

Exit status 0 where every goal held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import socket
import sys
import threading
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

from bench_serve import Server, _get, _pct  # noqa: E402

KINDS = {  # kind: weight in the mix
    "completion": 6, "completion_stream": 6, "chat": 4, "chat_stream": 4, "n2": 2, "shared_system": 4,
    "at_context": 1, "over_context": 1, "cancel_stream": 2, "hang_up": 1, "bad_json": 1, "wrong_type": 1,
    "unknown_field": 1,
}
MAX_NEW = 32


class Soak:
    def __init__(self, args: argparse.Namespace, port: int, vocab: int, context: int, chat: bool) -> None:
        self.args, self.port, self.vocab, self.context, self.chat = args, port, vocab, context, chat
        self.lock = threading.Lock()
        self.outcomes: collections.Counter = collections.Counter()  # (kind, outcome)
        self.lat: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
        self.greedy: list[tuple[dict, list[int]]] = []  # (body, tokens) of greedy completions that completed
        self.problems: list[str] = []
        self.t0 = time.monotonic()
        self.bursting = threading.Event()
        self.system = [3 + (i * 7919) % (vocab - 3) for i in range(200)]

    def phase(self) -> str:
        if self.bursting.is_set():
            return "burst"
        return "warm" if time.monotonic() - self.t0 < self.args.warm_minutes * 60 else "steady"

    def note(self, kind: str, outcome: str, problem: str | None = None) -> None:
        with self.lock:
            self.outcomes[kind, outcome] += 1
            if problem and len(self.problems) < 50:
                self.problems.append(f"{kind}: {problem}")

    # -- one request ----------------------------------------------------------------------------
    def words(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(3, self.vocab) for _ in range(n)]

    def body(self, kind: str, rng: random.Random) -> tuple[str, object]:
        """(path, JSON body, or raw bytes for bad_json) of a request of `kind`."""
        new = rng.randrange(1, MAX_NEW + 1)
        greedy = rng.random() < 0.5
        sampling = {"temperature": 0} if greedy else {"temperature": 0.8, "seed": rng.randrange(1 << 30)}
        if kind in ("chat", "chat_stream", "shared_system") and self.chat:
            system = "You answer briefly. " * (40 if kind == "shared_system" else 1)
            msgs = [{"role": "system", "content": system},
                    {"role": "user", "content": f"question {rng.randrange(10**6)}: what comes next?"}]
            return "/v1/chat/completions", {"messages": msgs, "max_tokens": new, **sampling,
                                            "stream": kind == "chat_stream"}
        prompt = self.words(rng, rng.randrange(4, 64))
        if kind == "shared_system":
            prompt = self.system + prompt
        if kind == "at_context":
            prompt, new = self.words(rng, self.context - 4), 4
        if kind == "over_context":
            prompt = self.words(rng, self.context + 8)
        body = {"prompt": prompt, "max_tokens": new, **sampling,
                "stream": kind in ("completion_stream", "cancel_stream", "chat_stream")}
        if kind == "n2":
            body["n"] = 2
        if kind == "wrong_type":
            body[rng.choice(["max_tokens", "temperature", "stream"])] = "ten"
        if kind == "unknown_field":
            body["frobnicate"] = {"level": 3}
        if kind == "bad_json":
            return "/v1/completions", json.dumps(body).encode()[:-7] + b"{,"
        return "/v1/completions", body

    def send(self, kind: str, rng: random.Random) -> None:
        path, body = self.body(kind, rng)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        phase = self.phase()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.args.request_timeout)
        t0 = time.perf_counter()
        try:
            conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
            if kind == "hang_up":
                conn.sock.shutdown(socket.SHUT_RDWR)
                self.note(kind, "hung up")
                return
            resp = conn.getresponse()
            if resp.status != 200:
                self.answer_error(kind, body, resp.status, resp.getheader("Retry-After"), resp.read())
                return
            if isinstance(body, dict) and body.get("stream"):
                self.read_stream(kind, resp, t0, phase, leave=rng.randrange(1, 4) if kind == "cancel_stream" else 0)
                return
            out = json.loads(resp.read())
            self.lat[phase]["latency_s"].append(time.perf_counter() - t0)
            if kind in ("over_context", "bad_json", "wrong_type"):  # an unknown field may be ignored
                self.note(kind, "200 to a bad request", f"200 for {str(body)[:120]}")
                return
            self.note(kind, "ok")
            if path == "/v1/completions" and body.get("temperature") == 0 and body.get("n", 1) == 1 \
                    and rng.random() < self.args.sample and len(self.greedy) < 200:
                with self.lock:
                    self.greedy.append((body, out["choices"][0]["token_ids"]))
        except (OSError, http.client.HTTPException) as e:
            self.note(kind, "connection error" if not isinstance(e, TimeoutError) else "timeout", repr(e)[:160])
        finally:
            conn.close()

    def answer_error(self, kind: str, body: object, status: int, retry_after: str | None, data: bytes) -> None:
        try:
            err = json.loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            self.note(kind, f"{status} without an error object", data[:120].decode(errors="replace"))
            return
        if status >= 500:
            if status == 503 and err.get("type") == "server_overloaded":
                self.note(kind, "503 overloaded" if retry_after else "503 overloaded without Retry-After",
                          None if retry_after else err["message"])
            else:
                self.note(kind, f"{status}", err.get("message", "")[:160])
            return
        if kind == "wrong_type":
            named = next((f for f in ("max_tokens", "temperature", "stream") if body.get(f) == "ten"), "")
            ok = named in (err.get("message", "") + str(err.get("param")))
            self.note(kind, "4xx naming the field" if ok else "4xx not naming the field", None if ok else err["message"])
        elif kind == "over_context":
            ok = "prompt" in (err.get("message", "") + str(err.get("param")))
            self.note(kind, "4xx naming the field" if ok else "4xx not naming the field", None if ok else err["message"])
        elif kind == "unknown_field":  # refused rather than ignored (docs/serving.md): it must be named
            ok = "frobnicate" in (err.get("message", "") + str(err.get("param")))
            self.note(kind, "4xx naming the field" if ok else "4xx not naming the field", None if ok else err["message"])
        elif kind == "bad_json":
            self.note(kind, f"{status}")
        else:
            self.note(kind, f"{status} unexpected", err.get("message", "")[:160])

    def read_stream(self, kind: str, resp, t0: float, phase: str, leave: int) -> None:
        stamps = []
        while line := resp.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                self.note(kind, "error in the stream", event["error"].get("message", "")[:160])
                return
            if any(c.get("token_ids") or c.get("text") or (c.get("delta") or {}).get("content")
                   for c in event.get("choices", [])):
                stamps.append(time.perf_counter())
                if leave and len(stamps) >= leave:
                    resp.close()  # leave mid-stream
                    self.note(kind, "left mid-stream")
                    return
        if stamps:
            self.lat[phase]["ttft_s"].append(stamps[0] - t0)
            self.lat[phase]["itl_s"] += [b - a for a, b in zip(stamps, stamps[1:])]
        self.note(kind, "ok")

    # -- the clients ----------------------------------------------------------------------------
    def client(self, i: int, until: float) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        kinds, weights = zip(*KINDS.items())
        while time.monotonic() < until:
            self.send(rng.choices(kinds, weights)[0], rng)

    def burst(self, until: float) -> None:
        n = 4 * self.args.max_batch
        while time.monotonic() + self.args.burst_every < until:
            time.sleep(self.args.burst_every)
            self.bursting.set()
            rng = random.Random(time.monotonic_ns())
            threads = [threading.Thread(target=self.send, args=("completion_stream", random.Random(rng.random())))
                       for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.bursting.clear()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def gauges(port: int) -> dict[str, float]:
    out = {}
    for line in _get(port, "/metrics").decode().splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()[:2]
            out[name] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="a directory holding the store (bench_offload's --workdir)")
    ap.add_argument("--store", default="store", help="the store served, in WORKDIR (default: store)")
    ap.add_argument("--minutes", type=float, default=30, help="how long the soak runs (default 30)")
    ap.add_argument("--warm-minutes", type=float, default=5, help="the warm-up phase, before RSS is the baseline")
    ap.add_argument("--clients", type=int, default=12, help="client threads, each one request after another")
    ap.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8)")
    ap.add_argument("--max-queue", type=int, default=16, help="the server's --max-queue (default 16)")
    ap.add_argument("--burst-every", type=float, default=120, help="seconds between bursts (default 120)")
    ap.add_argument("--request-timeout", type=float, default=300, help="seconds a request may take (default 300)")
    ap.add_argument("--sample", type=float, default=0.2, help="share of greedy completions checked alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-flags", default="", help="more flags for `semoe serve`, one string (\"--prefix-cache 0\")")
    ap.add_argument("--json", default="", help="also write the report to this file")
    args = ap.parse_args()
    store = os.path.join(args.workdir, args.store)
    if not os.path.exists(os.path.join(store, "manifest.json")):
        raise SystemExit(f"{store} is not a store")
    from storage.reader import StoreReader

    cfg = json.loads(StoreReader.open(store).read_file("config.json"))
    context = int(cfg.get("max_position_embeddings", 4096))
    logs = os.path.join(args.workdir, "serve-logs")
    os.makedirs(logs, exist_ok=True)
    cmd = [sys.executable, "-m", "tools.cli", "serve", "--model", store, "--port", "{port}",
           "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue), *args.serve_flags.split()]
    with Server(cmd, "/ready", os.path.join(logs, "semoe-soak.log")) as srv:
        probe = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        probe.request("POST", "/v1/chat/completions", body=json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}), headers={"Content-Type": "application/json"})
        chat = probe.getresponse().status == 200
        probe.close()
        soak = Soak(args, srv.port, int(cfg["vocab_size"]), context, chat)
        until = time.monotonic() + args.minutes * 60
        threads = [threading.Thread(target=soak.client, args=(i, until)) for i in range(args.clients)]
        threads.append(threading.Thread(target=soak.burst, args=(until,)))
        for t in threads:
            t.start()
        rss: list[tuple[float, int, float]] = []  # (seconds, RSS, the prefix cache's kept KV bytes)
        while any(t.is_alive() for t in threads):
            try:
                kept = gauges(srv.port).get("semoe_prefix_cache_bytes", 0.0)
            except OSError:
                kept = rss[-1][2] if rss else 0.0
            rss.append((time.monotonic() - soak.t0, rss_bytes(srv.proc.pid), kept))
            print(f"{rss[-1][0] / 60:5.1f} min: RSS {rss[-1][1] / 2**30:.2f} GiB (prefix cache {kept / 2**30:.2f}), "
                  f"{sum(soak.outcomes.values())} requests", file=sys.stderr, flush=True)
            time.sleep(10)
        time.sleep(2)  # a step for the last cancelled ones to leave
        held = gauges(srv.port)
        alone = [(body, tokens, json.loads(_post(srv.port, body))["choices"][0]["token_ids"])
                 for body, tokens in soak.greedy]
    base = [b for t, b, _ in rss if t >= args.warm_minutes * 60]
    growth = (max(base) / base[0] - 1) if len(base) > 1 else 0.0
    # the same less the KV the prefix cache keeps, which fills up to its bound (--prefix-cache) by design
    net = [b - k for t, b, k in rss if t >= args.warm_minutes * 60]
    net_growth = (max(net) / net[0] - 1) if len(net) > 1 else 0.0
    fails = {k: v for k, v in soak.outcomes.items() if k[1][0] == "5" and not k[1].startswith("503 overloaded")
             or k[1] in ("4xx not naming the field", "200 to a bad request", "timeout", "error in the stream",
                         "connection error")
             or k[1].endswith("unexpected") or k[1] == "503 overloaded without Retry-After"}
    same = sum(a == b for _, a, b in alone)
    report = {
        "minutes": args.minutes, "requests": sum(soak.outcomes.values()),
        "outcomes": {f"{k} {o}": n for (k, o), n in sorted(soak.outcomes.items())},
        "failures": {f"{k} {o}": n for (k, o), n in sorted(fails.items())}, "problems": soak.problems,
        "rss_gib": [(round(t / 60, 2), round(b / 2**30, 3), round(k / 2**30, 3)) for t, b, k in rss],
        "rss_growth_after_warmup": growth, "rss_less_prefix_cache_growth_after_warmup": net_growth,
        "held_at_end": {k: held.get(k) for k in ("semoe_kv_cache_bytes", "semoe_requests_running", "semoe_queue_depth")},
        "latency": {ph: {k: {"p50": _pct(v, 0.5), "p99": _pct(v, 0.99), "n": len(v)} for k, v in d.items()}
                    for ph, d in soak.lat.items()},
        "greedy_alone_same": same, "greedy_checked": len(alone),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"{report['requests']} requests in {args.minutes:g} min; outcomes:")
    for name, n in report["outcomes"].items():
        print(f"  {name}: {n}")
    for ph, d in report["latency"].items():
        print(f"  {ph}: " + ", ".join(f"{k} p50 {v['p50']:.3f} p99 {v['p99']:.3f} (n {v['n']})" for k, v in d.items()))
    goals = {
        "no 5xx the request did not cause, every bad request a 4xx naming its field": not fails,
        "nothing held at the end": all(not v for v in report["held_at_end"].values()),
        f"RSS growth after the warm-up {growth * 100:.1f}% <= 5%": growth <= 0.05,
        f"RSS less the prefix cache's kept KV, growth after the warm-up {net_growth * 100:.1f}% <= 5%": net_growth <= 0.05,
        f"greedy answers as alone: {same} of {len(alone)}": same == len(alone),
    }
    for goal, held_ in goals.items():
        print(f"{'holds' if held_ else 'FAILS'}: {goal}")
    for p in soak.problems[:10]:
        print(f"  {p}")
    return 0 if all(goals.values()) else 1


def _post(port: int, body: dict) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        return conn.getresponse().read()
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
