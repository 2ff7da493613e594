"""What `semoe serve` is asked for beside the engine: the queue, the batch and the KV memory. Built
once from the flags (or by a caller of `create_app`) and checked once, here; the server and its batch
scheduler take it as it is."""

from __future__ import annotations

from dataclasses import dataclass

KV_GROW_TOKENS = 256  # positions a request's KV cache holds beyond its prompt at first, and grows by
PREFIX_CACHE_DEFAULT = 1 << 30  # finished requests' KV kept for prefix reuse, where the KV memory has no limit


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """The server's limits: `max_queue` requests may wait for one of `max_batch` places; a step
    computes at most `max_batch_tokens` rows; the running requests' KV caches together take at most
    `kv_memory_bytes` (None: no limit), each growing `kv_grow_tokens` positions at a time; finished
    requests' caches are kept for prompts that begin with their tokens within `prefix_cache_bytes` (None:
    the KV memory, shared with the running requests, which evict them, or PREFIX_CACHE_DEFAULT where it
    has no limit; 0: none kept); `request_log`, a file that gets a JSON line per finished request; `speculative`: tokens drafted a greedy
    decoding row and verified in its step (`BatchScheduler._drafts`); `shutdown_timeout`: seconds the requests in
    flight get to finish on SIGTERM (`http_server.DrainingServer`); `prefill_chunk`: prompt rows a step takes beside
    decoding rows (None: as many as keep that step within 1.75 times a decoding-only step, as timed, the 1.75
    multiplied by how many times more requests start than decode: `prefill_policy.prefill_room`, `prefill_stall`)."""

    max_queue: int = 64
    max_batch: int = 16
    max_batch_tokens: int = 256
    kv_memory_bytes: int | None = None
    kv_grow_tokens: int = KV_GROW_TOKENS
    prefix_cache_bytes: int | None = None
    request_log: str | None = None
    speculative: int = 0  # tokens drafted a greedy decoding row, verified in its step
    paying: bool = False  # draft only in steps while drafting pays (`semoe.decode.loop.Paying`)
    shutdown_timeout: float = 30.0  # seconds the requests in flight get to finish once the server is told to stop
    prefill_chunk: int | None = None  # prompt rows a step takes beside decoding rows; None: timed (`prefill_room`)

    def __post_init__(self) -> None:
        """ValueError naming the flag, for a value no server can run with."""
        for flag, v, least in (("--max-queue", self.max_queue, 0), ("--max-batch", self.max_batch, 1),
                               ("--kv-grow-tokens", self.kv_grow_tokens, 1), ("--speculative", self.speculative, 0)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{flag} must be an integer, got {v!r}")
            if v < least:
                raise ValueError(f"{flag} must be >= {least}, got {v}")
        if not isinstance(self.max_batch_tokens, int) or self.max_batch_tokens < self.max_batch:
            raise ValueError(f"--max-batch-tokens must be >= --max-batch ({self.max_batch}), "
                             f"got {self.max_batch_tokens!r}")
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int) or isinstance(self.prefill_chunk, bool)
                                               or self.prefill_chunk < 1):
            raise ValueError(f"--prefill-chunk must be auto or an integer >= 1, got {self.prefill_chunk!r}")
        if isinstance(self.shutdown_timeout, bool) or not isinstance(self.shutdown_timeout, (int, float)) \
                or not 0 <= self.shutdown_timeout < float("inf"):
            raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {self.shutdown_timeout!r}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 1:
            raise ValueError(f"--kv-memory must be at least 1 byte, got {self.kv_memory_bytes}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError(f"--prefix-cache must be 0 (off) or a size, got {self.prefix_cache_bytes}")
        if None not in (self.kv_memory_bytes, self.prefix_cache_bytes) and self.prefix_cache_bytes > self.kv_memory_bytes:
            raise ValueError(f"--prefix-cache ({self.prefix_cache_bytes} bytes) takes its memory from --kv-memory "
                             f"({self.kv_memory_bytes} bytes): give at most that")

    @property
    def prefix_bytes(self) -> int:
        """The prefix cache's capacity (see the class)."""
        if self.prefix_cache_bytes is not None:
            return self.prefix_cache_bytes
        return self.kv_memory_bytes if self.kv_memory_bytes is not None else PREFIX_CACHE_DEFAULT
