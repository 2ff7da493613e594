"""semoe serve under load: continuous batching with closed-loop clients, beside its floor and its peer.

A real `semoe serve` process on bench_offload's Mixtral-shaped checkpoint (--workdir's store, float32
experts by default; --store names another), with every expert in memory (100%: no budget flag, the
server's own choice, resident where the model fits) and with a CPU cache of 25% of them (--cache). Closed-loop clients (each sends its next request when its last one ends; the
server's --max-batch is the largest client count) stream completions of distinct 16-token prompts,
a fixed --new-tokens each (`ignore_eos`), --rounds requests per client. Per point:

    tok/s        generated tokens of every client / the wall time from the first request to the last
                 answer
    TTFT, ITL    p50 and p99 of each request's time to its first token and of the gaps between its
                 tokens, as the client sees the streamed chunks arrive
    bytes/tok    storage bytes read per generated token: the server process's /proc/PID/io read_bytes
                 and its own counter (semoe_storage_read_bytes_total)
    bound        at a partial cache: B / max(compute time of a step of B, that step's storage bytes /
                 the disk's raw read rate) = min(tok/s at 100% with B clients, raw rate / bytes/tok),
                 the raw rate measured in the same run (every expert file read as the server reads
                 them: whole chunks in a random order, O_DIRECT, 16 in flight; the best of 3 passes)

The prefix part (--parts prefix) serves --store with no budget flag (the server's own choice, as a
user runs it) and times a chat's next turn: a --system-tokens system prompt and a user turn, then the
whole conversation again with a new turn (its KV reused: `--prefix-cache`), then another system
prompt of the same length.

The limited part (--parts limited) serves with memory short: a balloon process leaves --memory percent
of the store's bytes available (33 by default), the page cache dropped, while `semoe serve` with no
budget flag (its own choice: where the model does not fit, the compiled kernels over the runner's
expert cache, each step reading the union of its rows' experts once a layer) and then llama-server
(mmap and the page cache) serve the same clients, each from a cold start; bytes read per token and
peak RSS beside tok/s.

    python bench/bench_serve.py --workdir DIR --store store-int4 --gguf llama-q4_0.gguf --parts limited \
        --memory 33 --clients 1,32 --rounds 1

With the load part in the same run (--parts limited,load --cache 100), each of semoe's limited points gets its
bound as above: min(tok/s at 100% with B clients, the raw rate / the bytes it read from storage a token).

    python bench/bench_serve.py --workdir DIR --parts limited,load --cache 100 --clients 1,8,32 --no-peer

The stall part (--parts stall) is the case chunked prefill is for: --stall-clients clients stream --stall-tokens
greedy tokens each from `semoe serve` with no flag, while a prompt of --stall-prompt tokens arrives every
--stall-every seconds. A gap between two of a client's tokens is "quiet" where no prompt was in flight during it;
the report gives the quiet gaps' p50, the others' p99 and their ratio (the goal: at most 2.5), and the prompts'
latency. The same run serves them again with --prefill-chunk set to --max-batch-tokens, a step taking a prompt
whole beside the decoding rows as before chunked prefill.

    python bench/bench_serve.py --workdir DIR --parts stall

In the same run: transformers generating one request at a time (the floor: what serving without a
batching engine gives), and llama.cpp's llama-server (built once from bench/llama_peer.py's sources,
or --llama-server PATH) on the same checkpoint as bench_quant.py converted it (--gguf, f32 for the
float32 store), with --parallel N slots for N clients. With every expert cached both servers stay up and warm,
and at each client count their loads run in turn (--pairs times each, medians), so that this machine's drift
hits both alike.
On 2 cores, nothing else should run meanwhile.

    python bench/bench_serve.py --workdir /path/of/bench_quant [--clients 1,8,32,64] [--cache 100,25]
        [--gguf llama-f32.gguf] [--no-peer] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

from bench_offload import SHAPE, drop_cache  # noqa: E402

PROMPT_TOKENS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.read()


class Server:
    """A server process (`cmd` with {port} filled in), up once `health` answers; stopped on exit."""

    def __init__(self, cmd: list[str], health: str, log_path: str, startup_s: float = 900) -> None:
        self.port = _free_port()
        self.cmd = [c.format(port=self.port) for c in cmd]
        self.health, self.log_path, self.startup_s = health, log_path, startup_s

    def __enter__(self) -> Server:
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=ROOT)
        deadline = time.monotonic() + self.startup_s
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.cmd[0]} exited with {self.proc.returncode} before serving; see {self.log_path}")
            try:
                _get(self.port, self.health)
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{self.cmd[0]} did not answer {self.health} within {self.startup_s:.0f} s") \
                        from None
                time.sleep(0.5)

    def read_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _prompt(client: int, round_: int) -> list[int]:
    import random

    rng = random.Random(client * 1000 + round_)
    return [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(PROMPT_TOKENS)]


def _one_request(port: int, prompt: list[int], new_tokens: int) -> dict:
    """One streamed completion: its token count, time to first token and gaps between tokens."""
    import http.client

    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        stamps, ids = [], []
        while line := resp.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            choice = (event.get("choices") or [{}])[0]
            n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
            stamps += [time.perf_counter()] * n
            ids += choice.get("token_ids") or []
    finally:
        conn.close()
    if not stamps:
        raise RuntimeError("the stream held no tokens")
    return {"tokens": len(stamps), "ttft": stamps[0] - t0, "gaps": [b - a for a, b in itertools.pairwise(stamps)],
            "ids": ids, "stamps": stamps}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def load(port: int, clients: int, new_tokens: int, rounds: int) -> dict:
    """Closed-loop clients: each sends `rounds` requests one after the other."""
    results: list[dict] = []
    errors: list[str] = []

    def client(i: int) -> None:
        for r in range(rounds):
            try:
                results.append(_one_request(port, _prompt(i, r), new_tokens))
            except Exception as e:  # noqa: BLE001 - reported below, the bench fails on it
                errors.append(f"client {i}: {e}")
                return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[0]}")
    tokens = sum(r["tokens"] for r in results)
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results]
    return {"clients": clients, "tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p99_s": _pct(ttfts, 0.99),
            "itl_p50_s": _pct(gaps, 0.5), "itl_p99_s": _pct(gaps, 0.99)}


def _storage_counter(port: int) -> float:
    for line in _get(port, "/metrics").decode().splitlines():
        if line.startswith("semoe_storage_read_bytes_total "):
            return float(line.split()[1])
    return 0.0


def _semoe_cmd(args: argparse.Namespace, store: str, cache: int, clients: list[int]) -> list[str]:
    # 100%: no budget flag, the server's own choice (every expert resident where the model fits, its
    # steps on the compiled kernels), as a user runs it; below, the offload engine's CPU cache
    return [sys.executable, "-m", "tools.cli", "serve", "--model", store, "--port", "{port}",
            *([] if cache == 100 else ["--cpu-cache", f"{cache}%"]), "--max-batch", str(max(clients)),
            "--max-queue", str(max(64, max(clients))), *args.serve_flags.split()]


def _measured(args: argparse.Namespace, srv: Server, engine: str, cache: int, n: int) -> dict:
    """One closed-loop load of n clients on srv, with the bytes it read from storage a token (/proc/PID/io, and
    semoe's own counter)."""
    io0, own0 = srv.read_bytes(), _storage_counter(srv.port) if engine == "semoe" else 0.0
    r = load(srv.port, n, args.new_tokens, args.rounds)
    r["read_bytes_per_token"] = (srv.read_bytes() - io0) / r["tokens"]
    if engine == "semoe":
        r["storage_bytes_per_token"] = (_storage_counter(srv.port) - own0) / r["tokens"]
    return {"engine": engine, "cache_pct": cache, **r}


def ours(args: argparse.Namespace, store: str, cache: int, clients: list[int]) -> list[dict]:
    drop_cache(store)
    out = []
    cmd = _semoe_cmd(args, store, cache, clients)
    with Server(cmd, "/health", os.path.join(args.logs, f"semoe-{cache}.log")) as srv:
        _one_request(srv.port, _prompt(999, 0), 4)  # warm-up
        for n in clients:
            print(f"semoe, {cache}% cache, {n} clients ...", file=sys.stderr)
            out.append(_measured(args, srv, "semoe", cache, n))
    return out


def prefix_reuse(args: argparse.Namespace, store: str) -> dict:
    """A chat's next turn, as clients send it: the whole conversation again. `semoe serve` as a user runs
    it (no budget flag) gets a --system-tokens system prompt and a 16-token user turn, then the same
    with its answer and a new turn, then another system prompt of the same length (nothing to reuse);
    the time to the first token of each."""
    import random

    from storage.reader import StoreReader

    vocab = json.loads(StoreReader.open(store).read_file("config.json"))["vocab_size"]
    rng = random.Random(7)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    system, turn, again, other = words(args.system_tokens), words(16), words(16), words(args.system_tokens)
    cmd = [sys.executable, "-m", "tools.cli", "serve", "--model", store, "--port", "{port}"]
    drop_cache(store)
    with Server(cmd, "/health", os.path.join(args.logs, "semoe-prefix.log")) as srv:
        _one_request(srv.port, words(16), 4)  # warm-up
        print(f"semoe, a {args.system_tokens}-token system prompt and its next turn ...", file=sys.stderr)
        first = _one_request(srv.port, system + turn, args.new_tokens)
        second = _one_request(srv.port, system + turn + first["ids"] + again, args.new_tokens)
        fresh = _one_request(srv.port, other + turn, args.new_tokens)
        reused = next((float(line.split()[1]) for line in _get(srv.port, "/metrics").decode().splitlines()
                       if line.startswith("semoe_prefix_cache_reused_tokens_total ")), 0.0)
    return {"system_tokens": args.system_tokens, "first_ttft_s": first["ttft"], "next_turn_ttft_s": second["ttft"],
            "fresh_ttft_s": fresh["ttft"], "reused_tokens": reused,
            "next_turn_prompt_tokens": len(system + turn + first["ids"] + again)}


def stall(args: argparse.Namespace, store: str) -> list[dict]:
    """Streaming clients while long prompts arrive (the module's docstring), chunked (the default) and whole."""
    import random

    rng = random.Random(11)
    out = []
    for name, flags in (("auto", []), ("whole", ["--prefill-chunk", "256"])):
        cmd = [sys.executable, "-m", "tools.cli", "serve", "--model", store, "--port", "{port}", *flags]
        with Server(cmd, "/health", os.path.join(args.logs, f"semoe-stall-{name}.log")) as srv:
            _one_request(srv.port, _prompt(998, 0), 4)  # warm-up
            print(f"semoe, {args.stall_clients} streams while {args.stall_prompt}-token prompts arrive, "
                  f"--prefill-chunk {name} ...", file=sys.stderr)
            streams: list[dict] = []
            prompts: list[tuple[float, float]] = []  # (sent, answered)
            done = threading.Event()

            def client(i: int) -> None:
                streams.append(_one_request(srv.port, _prompt(i, 7), args.stall_tokens))

            def prompter() -> None:
                while not done.wait(args.stall_every):
                    t0 = time.perf_counter()
                    _one_request(srv.port, [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(args.stall_prompt)], 1)
                    prompts.append((t0, time.perf_counter()))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(args.stall_clients)]
            feeder = threading.Thread(target=prompter)
            for t in [*threads, feeder]:
                t.start()
            for t in threads:
                t.join()
            done.set()
            feeder.join()
        quiet, busy = [], []
        for s in streams:
            for a, b in itertools.pairwise(s["stamps"]):
                (busy if any(p0 < b and a < p1 for p0, p1 in prompts) else quiet).append(b - a)
        q50, b99 = _pct(quiet, 0.5), _pct(busy, 0.99)
        out.append({"prefill_chunk": name, "quiet_gap_p50_s": q50, "busy_gap_p99_s": b99, "ratio": b99 / q50,
                    "prompts": len(prompts), "prompt_latency_p50_s": _pct([b - a for a, b in prompts], 0.5),
                    "quiet_gaps": len(quiet), "busy_gaps": len(busy)})
        print(f"  quiet gaps p50 {q50 * 1e3:.0f} ms, gaps with a prompt in flight p99 {b99 * 1e3:.0f} ms "
              f"({b99 / q50:.2f}x); {len(prompts)} prompts, each answered in "
              f"{out[-1]['prompt_latency_p50_s']:.2f} s (p50)", file=sys.stderr)
    return out


def _llama_cmd(args: argparse.Namespace, n: int) -> list[str]:
    return [args.llama_server, "-m", args.gguf, "--port", "{port}", "--host", "127.0.0.1", "-t", "2",
            "--parallel", str(n), "-c", str(n * (PROMPT_TOKENS + args.new_tokens + 8)), "--no-warmup"]


def _median_point(runs: list[dict]) -> dict:
    """Each figure's median over `runs` of one engine and client count (the first run's other fields)."""
    import statistics

    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in runs)
    out["runs_tok_s"] = [round(r["tok_s"], 2) for r in runs]
    return out


def side_by_side(args: argparse.Namespace, store: str, clients: list[int]) -> list[dict]:
    """Every expert cached, semoe and llama-server both up and warm, their loads in turn at each client count
    (--pairs times: semoe, llama-server, semoe, ...), so that the machine's drift hits both; medians."""
    drop_cache(store)
    out = []
    with Server(_semoe_cmd(args, store, 100, clients), "/health",
                os.path.join(args.logs, "semoe-100.log")) as ours_srv:
        _one_request(ours_srv.port, _prompt(999, 0), 4)  # warm-up
        for n in clients:
            with Server(_llama_cmd(args, n), "/health", os.path.join(args.logs, f"llama-server-{n}.log")) as peer:
                _one_request(peer.port, _prompt(999, 0), 4)
                runs: dict[str, list[dict]] = {"semoe": [], "llama-server": []}
                for i in range(args.pairs):
                    for engine, srv in (("semoe", ours_srv), ("llama-server", peer)):
                        print(f"{engine}, every expert cached, {n} clients ({i + 1} of {args.pairs}) ...",
                              file=sys.stderr)
                        runs[engine].append(_measured(args, srv, engine, 100, n))
                out += [_median_point(runs["semoe"]), _median_point(runs["llama-server"])]
    return out


def llama_server(args: argparse.Namespace, clients: list[int]) -> list[dict]:
    out = []
    for n in clients:
        with Server(_llama_cmd(args, n), "/health", os.path.join(args.logs, f"llama-server-{n}.log")) as srv:
            _one_request(srv.port, _prompt(999, 0), 4)
            print(f"llama-server, {n} clients ...", file=sys.stderr)
            out.append({"engine": "llama-server", "cache_pct": 100, **load(srv.port, n, args.new_tokens, args.rounds)})
    return out


def peak_rss(pid: int) -> int:
    """A process's peak resident bytes so far (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def limited(args: argparse.Namespace, store: str, clients: list[int]) -> list[dict]:
    """Serving with memory short: at each --memory share of the store's bytes (SIZE), a balloon process
    leaves SIZE available (bench_vs_llamacpp' `Balloon`, the page cache dropped first) while one server runs
    from a cold start: `semoe serve` as a user runs it (no budget flag: its own choice; where the model
    does not fit, the kernels over the runner's expert cache) and llama-server on --gguf (mmap, the page
    cache). Per client count: tok/s, TTFT, ITL, bytes read from storage per token (/proc/PID/io), peak
    RSS. A server the kernel's OOM killer stopped, or a balloon it took, is reported as such."""
    from bench_vs_llamacpp import Balloon, model_bytes

    total = model_bytes(os.path.dirname(store), os.path.basename(store))
    out = []
    for share in args.memory:
        size = total * share // 100
        servers = [("semoe", [sys.executable, "-m", "tools.cli", "serve", "--model", store, "--port", "{port}",
                              "--max-batch", str(max(clients)), "--max-queue", str(max(64, max(clients)))])]
        if not args.no_peer:
            servers.append(("llama-server", [args.llama_server, "-m", args.gguf, "--port", "{port}", "--host",
                                             "127.0.0.1", "-t", "2", "--parallel", str(max(clients)), "-c",
                                             str(max(clients) * (PROMPT_TOKENS + args.new_tokens + 8)),
                                             "--no-warmup"]))
        for engine, cmd in servers:
            log = os.path.join(args.logs, f"{engine}-limited-{share}.log")
            with Balloon(size) as balloon, Server(cmd, "/health", log) as srv:
                _one_request(srv.port, _prompt(999, 0), 4)  # warm-up
                for n in clients:
                    print(f"{engine}, {share}% of the model's bytes available ({size / 2**30:.2f} GiB), {n} clients "
                          f"...", file=sys.stderr)
                    io0 = srv.read_bytes()
                    r = load(srv.port, n, args.new_tokens, args.rounds)
                    r["read_bytes_per_token"] = (srv.read_bytes() - io0) / r["tokens"]
                    r["peak_rss_bytes"] = peak_rss(srv.proc.pid)
                    r["balloon_alive"] = balloon.alive
                    out.append({"engine": engine, "cache_pct": 100, "memory_pct": share, "size_bytes": size, **r})
                    print(f"  {json.dumps(out[-1])}", file=sys.stderr)  # each point as it is measured
    return out


def transformers_floor(args: argparse.Namespace) -> dict:
    """One request at a time through transformers' generate (greedy, 2 threads), in its own process."""
    code = f"""
import json, time, torch, transformers
torch.set_num_threads(2)
m = transformers.AutoModelForCausalLM.from_pretrained({os.path.join(args.workdir, 'hf')!r}, dtype=torch.float32)
ids = torch.tensor([{_prompt(0, 0)!r}])
m.generate(ids, max_new_tokens=2, do_sample=False)
t = time.perf_counter()
out = m.generate(ids, max_new_tokens={args.new_tokens}, min_new_tokens={args.new_tokens}, do_sample=False)
print(json.dumps({{"tok_s": (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t)}}))
"""
    print("transformers, one request at a time ...", file=sys.stderr)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"the transformers floor failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def raw_disk_rate(store: str, passes: int = 3, in_flight: int = 16) -> float:
    """Bytes/s the disk gives the expert files of `store` read as a server reads them: whole chunks in
    a random order, O_DIRECT, `in_flight` at a time, each file first dropped from the page cache; the
    best of `passes` passes (a virtual disk's host may cache what was read before, for the server's
    reads too, so passes after the first are what the server sees)."""
    import random

    from storage.chunk_io import ALIGN, ChunkReader, ChunkReaderConfig, ReadRequest, drop_from_page_cache
    from storage.host_buffers import aligned_empty
    from storage.store import Store, iter_expert_chunks

    st = Store.open(store)
    chunks = list(iter_expert_chunks(st.manifest, "weight"))
    bufs = [aligned_empty(max(c.bytes for c in chunks), alignment=ALIGN, pin=False)[1] for _ in range(in_flight)]
    reader = ChunkReader(ChunkReaderConfig(mode="direct"))
    rng = random.Random(0)
    best = 0.0
    for _ in range(passes):
        rng.shuffle(chunks)
        for c in chunks:
            drop_from_page_cache(st.path(c.file))
        t0 = time.perf_counter()
        for i in range(0, len(chunks), in_flight):
            group = chunks[i:i + in_flight]
            reader.read_many([ReadRequest(path=st.path(c.file), buf=memoryview(b.numpy()), nbytes=c.bytes)
                              for c, b in zip(group, bufs)])
        best = max(best, sum(c.bytes for c in chunks) / (time.perf_counter() - t0))
    return best


def report(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    if "transformers_tok_s" in result:
        floor = result["transformers_tok_s"]
        print(f"transformers, one request at a time: {'not run' if floor is None else f'{floor:.2f} tok/s'}; "
              f"raw disk read {result['raw_disk_bytes_s'] / 1e9:.2f} GB/s")
    for r in result["points"]:
        where = f"memory {r['memory_pct']:3d}%" if "memory_pct" in r else f"cache {r['cache_pct']:3d}%"
        line = (f"{r['engine']:12s} {where} {r['clients']:3d} clients: {r['tok_s']:7.2f} tok/s | "
                f"TTFT p50 {r['ttft_p50_s']:.3f} p99 {r['ttft_p99_s']:.3f} s | ITL p50 {r['itl_p50_s'] * 1e3:.1f} "
                f"p99 {r['itl_p99_s'] * 1e3:.1f} ms")
        if "read_bytes_per_token" in r:
            line += f" | read {r['read_bytes_per_token'] / 2**20:.2f} MiB/tok" + (
                f" (own counter {r['storage_bytes_per_token'] / 2**20:.2f})" if "storage_bytes_per_token" in r else "")
        if "peak_rss_bytes" in r:
            line += f" | peak RSS {r['peak_rss_bytes'] / 2**30:.2f} of {r['size_bytes'] / 2**30:.2f} GiB" + (
                "" if r["balloon_alive"] else " (the balloon was killed: more than SIZE was used)")
        if "bound_tok_s" in r:
            line += f" | bound {r['bound_tok_s']:.2f} tok/s ({r['tok_s'] / r['bound_tok_s']:.2f}x)"
        print(line)
    for line in result["ratios"]:
        print(line)
    for s in result.get("stall", []):
        print(f"streams while prompts arrive, --prefill-chunk {s['prefill_chunk']}: quiet gaps p50 "
              f"{s['quiet_gap_p50_s'] * 1e3:.0f} ms, with a prompt in flight p99 {s['busy_gap_p99_s'] * 1e3:.0f} ms "
              f"({s['ratio']:.2f}x); prompts answered in {s['prompt_latency_p50_s']:.2f} s (p50 of {s['prompts']})")
    p = result.get("prefix")
    if p:
        print(f"prefix reuse, a {p['system_tokens']}-token system prompt: first turn {p['first_ttft_s']:.2f} s to "
              f"the first token; the next turn ({p['next_turn_prompt_tokens']} prompt tokens, "
              f"{p['reused_tokens']:.0f} reused) {p['next_turn_ttft_s']:.2f} s: "
              f"{p['next_turn_ttft_s'] / p['first_ttft_s']:.3f}x; another system prompt {p['fresh_ttft_s']:.2f} s")


def ratios(points: list[dict]) -> list[str]:
    lines = []
    short = {(p["engine"], p["memory_pct"], p["clients"]): p for p in points if "memory_pct" in p}
    for (engine, share, n), p in sorted(short.items()):
        peer = short.get(("llama-server", share, n))
        if engine == "semoe" and peer is not None:
            lines.append(f"{n} clients, {share}% of the model's bytes available: semoe / llama-server = "
                         f"{p['tok_s'] / peer['tok_s']:.2f}x tok/s, {p['read_bytes_per_token'] / 2**20:.1f} against "
                         f"{peer['read_bytes_per_token'] / 2**20:.1f} MiB read per token")
    by = {(p["engine"], p["cache_pct"], p["clients"]): p for p in points if "memory_pct" not in p}
    for (engine, cache, n), p in sorted(by.items()):
        one = by.get((engine, cache, 1))
        if one is not None and n > 1:
            lines.append(f"{engine} {cache}%: {n} clients / 1 = {p['tok_s'] / one['tok_s']:.2f}x tok/s" + (
                f", {p['storage_bytes_per_token'] / one['storage_bytes_per_token']:.2f}x storage bytes per token"
                if engine == "semoe" and one.get("storage_bytes_per_token") else ""))
        peer = by.get(("llama-server", 100, n))
        if engine == "semoe" and cache == 100 and peer is not None:
            lines.append(f"{n} clients at 100%: semoe / llama-server = {p['tok_s'] / peer['tok_s']:.2f}x tok/s")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="bench_quant's --workdir (hf/ checkpoint and its stores)")
    ap.add_argument("--store", default="store", help="the store served, in WORKDIR (default: store, float32)")
    ap.add_argument("--clients", default="1,8,32,64", help="closed-loop client counts")
    ap.add_argument("--cache", default="100,25", help="CPU cache sizes, percent of the expert bytes")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens each request generates")
    ap.add_argument("--rounds", type=int, default=2, help="requests each client sends, one after the other")
    ap.add_argument("--pairs", type=int, default=1,
                    help="with every expert cached and llama-server: how many times each engine's load runs at a "
                         "client count, in turn with the other's; each figure is the median (default 1)")
    ap.add_argument("--gguf", default="llama-f32.gguf",
                    help="llama-server's checkpoint, in WORKDIR (default: bench_quant.py's llama-f32.gguf)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary (default: built once from the sources "
                                           "of bench/llama_peer.py's environment)")
    ap.add_argument("--no-peer", action="store_true", help="skip llama-server")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip transformers one request at a time (skipped too where WORKDIR has no hf/)")
    ap.add_argument("--logs", default=None, help="where the servers' logs go (default WORKDIR/serve-logs)")
    ap.add_argument("--parts", default="load,prefix",
                    help="load: the closed-loop clients against each cache and llama-server; prefix: a chat's "
                         "next turn reusing its system prompt's KV (default both); limited: both servers with "
                         "--memory of the model's bytes available (a balloon holds the rest); stall: streams while "
                         "long prompts arrive, chunked prefill against whole")
    ap.add_argument("--memory", default="33", help="the limited part's memory available, percent of the store's "
                                                   "bytes (default 33)")
    ap.add_argument("--system-tokens", type=int, default=1024, help="the prefix part's system prompt (default 1024)")
    ap.add_argument("--stall-clients", type=int, default=8, help="the stall part's streaming clients (default 8)")
    ap.add_argument("--stall-tokens", type=int, default=96, help="tokens each of them streams (default 96)")
    ap.add_argument("--stall-prompt", type=int, default=300, help="the arriving prompts' tokens (default 300)")
    ap.add_argument("--stall-every", type=float, default=1.5, help="seconds between arriving prompts (default 1.5)")
    ap.add_argument("--serve-flags", default="", help="more flags for `semoe serve` in the load part, one string "
                                                     "(\"--prefill-chunk 256\")")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if parts - {"load", "prefix", "limited", "stall"}:
        raise SystemExit(f"--parts takes load, prefix, limited and stall, got {args.parts!r}")
    args.memory = [int(m) for m in args.memory.split(",")]
    clients = [int(c) for c in args.clients.split(",")]
    caches = [int(c) for c in args.cache.split(",")]
    store = os.path.join(args.workdir, args.store)
    if not os.path.exists(os.path.join(store, "manifest.json")):
        raise SystemExit(f"{store} is not a store: run bench_quant.py --workdir {args.workdir} first")
    if not args.no_peer:
        args.gguf = os.path.join(args.workdir, args.gguf)
        if not os.path.exists(args.gguf):
            raise SystemExit(f"{args.gguf} is missing: run bench_quant.py --workdir {args.workdir} (its peer part), "
                             f"or give --no-peer")
        if not args.llama_server:
            import llama_peer as peer

            args.llama_server = peer.ensure_server(peer.ensure_env())
    args.logs = args.logs or os.path.join(args.workdir, "serve-logs")
    os.makedirs(args.logs, exist_ok=True)
    # the limited part first: the balloon needs this process free of torch (raw_disk_rate imports it)
    short = limited(args, store, clients) if "limited" in parts else []
    stalls = {"stall": stall(args, store)} if "stall" in parts else {}
    if "load" not in parts:
        report({"points": short, "ratios": ratios(short), **stalls,
                **({"prefix": prefix_reuse(args, store)} if "prefix" in parts else {})}, args.json)
        return 0
    # the floor where the HuggingFace checkpoint is there (a real-size workdir may keep only its store)
    floor = transformers_floor(args)["tok_s"] if os.path.isdir(os.path.join(args.workdir, "hf")) and not args.no_floor \
        else None
    result = {"raw_disk_bytes_s": raw_disk_rate(store), "transformers_tok_s": floor, **stalls}
    points = short
    paired = not args.no_peer and 100 in caches  # every expert cached: both engines up, their loads in turn
    for cache in sorted(caches, reverse=True):
        points += (side_by_side(args, store, clients) if paired and cache == 100
                   else ours(args, store, cache, clients))
    full = {p["clients"]: p for p in points if p["cache_pct"] == 100 and "memory_pct" not in p}
    for p in points:
        if p["clients"] not in full or p["engine"] != "semoe":
            continue
        if p["cache_pct"] < 100 and p["storage_bytes_per_token"] > 0:
            p["bound_tok_s"] = min(full[p["clients"]]["tok_s"], result["raw_disk_bytes_s"] / p["storage_bytes_per_token"])
        elif "memory_pct" in p:  # the limited part: the bytes it read from storage (/proc/PID/io) at the disk's rate
            p["bound_tok_s"] = min(full[p["clients"]]["tok_s"],
                                   result["raw_disk_bytes_s"] / p["read_bytes_per_token"] if p["read_bytes_per_token"]
                                   else float("inf"))
    if not args.no_peer and not paired:
        points += llama_server(args, clients)
    result["points"] = points
    result["ratios"] = ratios(points)
    if "prefix" in parts:
        result["prefix"] = prefix_reuse(args, store)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
