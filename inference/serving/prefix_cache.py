"""Prompt prefixes reused across requests, as llama-server's prompt cache and vLLM's prefix caching do:
chat clients send the whole conversation, and the same system prompt, with every turn.

`PrefixCache` keeps the KV caches of finished requests (the tokens their positions hold: prompt and
generated), trimmed to those positions, most recently used last, within `capacity_bytes`. A new
request takes the longest run of leading tokens it shares with one of them (all of its prompt but the
last token at most: that token's row gives the first new token's logits): those positions are copied
into its own cache and its prompt pass starts after them. An entry whose tokens begin another's is
dropped for the longer one. The scheduler owns it (one thread) and evicts from it, least recently
used first, before it makes a running request wait for KV memory.

The positions reused hold what the earlier request computed for those tokens: the same values a
prompt pass computes for them, up to the rounding of the step that computed each (a decoding step
or a prompt pass sums in another order), so an answer from a reused prefix is the answer from scratch
to float32 rounding.

A model with linear-attention layers (Qwen3-Next's Gated DeltaNet) keeps, for those layers, one state
that holds all of a sequence's tokens at once, not one entry per position: a kept cache's state is that
of its whole length, and no state of a shorter prefix is kept (no snapshots at block boundaries). Such
an entry is reused only where all of its tokens begin the prompt, which is a chat's next turn (the
conversation so far, then the new message); a prompt that leaves it earlier computes from scratch."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from semoe.model.attention import KVCache


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: KVCache
    bytes: int


class PrefixCache:
    """Finished sequences' KV caches by their tokens; `bytes_of(positions)` the bytes of a cache of that
    many positions (`Engine.kv_cache_bytes`)."""

    def __init__(self, capacity_bytes: int, bytes_of) -> None:
        self.capacity_bytes = capacity_bytes
        self._bytes_of = bytes_of
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # least recent first
        self._next = 0
        self.bytes = 0
        self.hits = self.tokens_reused = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[KVCache | None, int]:
        """The cache sharing the most leading tokens with `prompt`, and how many of its positions to
        take (at most all of the prompt but its last token); (None, 0) where none shares one."""
        best, n = None, 0
        for key, e in self._entries.items():
            k = _common(e.tokens, prompt, len(prompt) - 1)
            if e.cache.states is not None and k < len(e.tokens):  # a state holds the whole entry, or nothing
                continue
            if k > n:
                best, n = key, k
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        self.hits += 1
        self.tokens_reused += n
        return self._entries[best].cache, n

    def add(self, tokens: list[int], cache: KVCache) -> None:
        """Keep the first `cache.length` positions of a finished sequence whose tokens are `tokens`,
        evicting the least recently used entries as needed; one larger than the capacity is not kept."""
        n = cache.length
        size = self._bytes_of(n)
        if n < 1 or size > self.capacity_bytes:
            return
        key = tuple(tokens[:n])
        for k, e in list(self._entries.items()):
            if e.tokens[:n] == key and (cache.states is None or len(e.tokens) == n):  # kept already (a longer
                # entry's recurrent state is not this one's)
                self._entries.move_to_end(k)
                return
            if key[:len(e.tokens)] == e.tokens:  # a prefix of the new one: superseded
                self._drop(k)
        self.evict(self.bytes + size - self.capacity_bytes)
        self._entries[self._next] = _Entry(key, cache.trimmed(), size)
        self._next += 1
        self.bytes += size

    def evict(self, need: int) -> int:
        """Free at least `need` bytes (as many entries as there are, least recently used first); the
        bytes freed."""
        freed = 0
        while freed < need and self._entries:
            freed += self._drop(next(iter(self._entries)))
            self.evictions += 1
        return freed

    def _drop(self, key: int) -> int:
        e = self._entries.pop(key)
        self.bytes -= e.bytes
        return e.bytes


def _common(a: tuple[int, ...], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, up to `limit`."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
