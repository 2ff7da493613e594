"""The server's prefix cache (`inference.serving.prefix_cache`): which kept sequence a prompt takes, how much
of it, and what gives way when it is full."""

from __future__ import annotations

import torch

from inference.serving.prefix_cache import PrefixCache
from semoe.model.attention import KVCache

LAYERS, HEADS, DH = 2, 1, 4


def _cache(tokens: list[int], capacity: int | None = None) -> KVCache:
    """A cache whose position p of every layer holds the value tokens[p] (so copies can be read back)."""
    cap = capacity or len(tokens)
    k = [torch.zeros(1, HEADS, cap, DH) for _ in range(LAYERS)]
    v = [torch.zeros(1, HEADS, cap, DH) for _ in range(LAYERS)]
    for t in (*k, *v):
        t[:, :, :len(tokens)] = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None]
    return KVCache(k=k, v=v, length=len(tokens))


def _bytes(positions: int) -> int:
    return 2 * LAYERS * HEADS * DH * 4 * positions


def test_a_prompt_takes_the_longest_shared_run_but_its_last_token():
    p = PrefixCache(_bytes(100), _bytes)
    p.add([1, 2, 3, 4, 5], _cache([1, 2, 3, 4, 5], capacity=9))
    p.add([1, 2, 7], _cache([1, 2, 7]))
    src, n = p.lookup([1, 2, 3, 4, 9, 9])
    assert n == 4 and src.length == 5 and src.capacity == 5  # kept trimmed to its positions
    mine = KVCache(k=[torch.zeros(1, HEADS, 8, DH) for _ in range(LAYERS)],
                   v=[torch.zeros(1, HEADS, 8, DH) for _ in range(LAYERS)])
    mine.copy_from(src, n)
    assert mine.length == 4 and mine.k[1][0, 0, :, 0].tolist() == [1, 2, 3, 4, 0, 0, 0, 0]
    assert p.lookup([1, 2, 3, 4, 5])[1] == 4  # the whole kept run, but the prompt's last token
    assert p.lookup([1, 2, 3])[1] == 2
    assert p.lookup([9, 1, 2]) == (None, 0)
    assert (p.hits, p.tokens_reused) == (3, 10)


def test_a_longer_run_supersedes_its_prefix_and_the_least_recent_goes_first():
    p = PrefixCache(_bytes(10), _bytes)
    p.add([1, 2, 3], _cache([1, 2, 3]))
    p.add([1, 2, 3, 4, 5], _cache([1, 2, 3, 4, 5]))  # [1, 2, 3] was its prefix: dropped
    assert len(p) == 1 and p.bytes == _bytes(5) and p.evictions == 0
    p.add([1, 2], _cache([1, 2]))  # held already by the longer one
    assert len(p) == 1
    p.add([7, 8, 9, 6], _cache([7, 8, 9, 6]))
    p.lookup([1, 2, 3, 0])  # [1 .. 5] used last: [7, 8, 9, 6] is the least recent
    p.add([5, 5, 5], _cache([5, 5, 5]))  # 5 + 4 + 3 > 10: one goes
    assert p.lookup([7, 8, 9, 0]) == (None, 0) and p.lookup([1, 2, 0])[1] == 2
    assert p.bytes == _bytes(8) and p.evictions == 1
    assert p.evict(1) == _bytes(3) and p.bytes == _bytes(5)  # the least recent of what is left: [5, 5, 5]
    p.add(list(range(20)), _cache(list(range(20))))  # larger than the whole cache: not kept
    assert p.lookup(list(range(20))) == (None, 0) and len(p) == 1


def test_a_zero_capacity_keeps_nothing():
    p = PrefixCache(0, _bytes)
    p.add([1, 2, 3], _cache([1, 2, 3]))
    assert len(p) == 0 and p.lookup([1, 2, 3, 4]) == (None, 0)
