"""The server's engine over the runner's expert cache (`inference.serving.torch_free_engine.LeanEngine`) against the
resident engine's batched step (`DecodePlan.batch`).

Both run the same kernels over the same weights (the runner's `Net` from the store, the plan's from the
loaded modules: `tests/inference/torch_free/test_runner.py` holds those equal bit for bit). Fed the engine's rotary
tables, a step of several sequences (decoding rows beside a prompt) gives the same logits and caches bit
for bit, whichever experts the cache holds: with top_k slots every layer reads nearly all the experts
its rows chose, one group computed while the next is read, the groups in the order of the experts' ids
as the resident step sums them.
"""

from __future__ import annotations

import pytest
import torch

from helpers.arch_stores import CASES
from helpers.kernels import needs_kernels
from inference.torch_free.runner import LeanConfig, LeanModel
from inference.serving.torch_free_engine import LeanEngine
from semoe.model.attention import KVCache, rope_tables
from semoe.checkpoints.model_io import load_store
from semoe.decode.plan import DecodePlan

pytestmark = needs_kernels

LONG = [1, 7, 61, 23, 4, 90, 12, 33, 5, 71, 18, 2, 44, 9, 60, 31, 8, 15, 27, 3, 50, 6, 19, 40, 11, 29, 64, 13, 36,
        21, 10, 17, 58, 25]


def _engine_rope(config):
    def rope(pos, cos, sin):
        c, s = rope_tables(config, torch.arange(pos, pos + 1)[None], torch.float32)
        cos[:], sin[:] = c.numpy().ravel(), s.numpy().ravel()
    return rope


def _held(cache: KVCache) -> list[torch.Tensor]:
    """What a cache holds: every layer's k and v (of no elements for a linear layer) and the layers' own
    states (the convolution's and the delta rule's; DeepSeek-V4's window, pending tokens and entries)."""
    return [t for t in (*cache.k, *cache.v, *cache.state_tensors()) if t.numel()]


@pytest.mark.parametrize("arch, fmt", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_a_step_over_the_runners_cache_is_the_resident_batch_for_every_architecture(arch_stores, arch, fmt):
    """Two sequences' prompts, then a step of both decoding beside a third's prompt, then all three
    decoding, through `LeanEngine.step` with the least cache (top_k slots) and through the resident
    plan's `batch`: the logits of the rows asked for and every layer's k and v the same bits; the caches
    advanced alike; the experts read from the store (the cache could not hold a layer's)."""
    store = arch_stores(arch, fmt)
    model = load_store(store)
    plan, c = DecodePlan(model), model.config
    assert plan.net is not None, plan.whole_refusal
    prompts = [LONG[:6], LONG[10:19], LONG[30:34]]
    with LeanModel(store, LeanConfig(cache_bytes=0)) as lean:
        lean.rope = _engine_rope(c)
        engine = LeanEngine(lean, name=arch)
        assert lean.cache.n == max(c.top_k, 1)
        ours = [engine.new_cache(p, 8) for p in prompts]
        theirs = [KVCache.empty(c, 1, len(p) + 8) for p in prompts]
        steps = [(prompts[0] + prompts[1], [6, 9], [5, 14]), ([3, 9, *prompts[2]], [1, 1, 4], [0, 1, 5]),
                 ([11, 4, 60], [1, 1, 1], [0, 1, 2])]
        for ids, counts, rows in steps:
            n = len(counts)
            got = engine.step(ids, ours[:n], counts, rows)
            want = plan.batch(ids, theirs[:n], counts, rows)
            assert got.shape == (len(rows), c.vocab_size)
            assert torch.equal(got, want)
        assert lean.cache.read_bytes > 0 and engine.storage_read_bytes() == lean.cache.read_bytes
    for a, b in zip(ours, theirs):
        assert a.length == b.length
        for x, y in zip(_held(a), _held(b), strict=True):
            assert torch.equal(x, y)


def test_bad_steps_and_caches_are_refused(arch_stores):
    """A KV cache too short for a step's tokens, or a runner keeping a float16 cache (the scheduler's
    caches are float32), is refused naming what is wrong; the cache is left as it was."""
    store = arch_stores("qwen3_moe", "f32")
    with LeanModel(store, LeanConfig(cache_bytes=0)) as lean:
        engine = LeanEngine(lean, name="q")
        cache = engine.new_cache([1, 2], 1)
        with pytest.raises(ValueError, match="4 rows at position 0 of a cache of 3 positions"):
            engine.step([1, 2, 3, 4], [cache], [4], [3])
        assert cache.length == 0
        with pytest.raises(ValueError, match="max_position"):
            engine.new_cache([1], 10**6)
    with LeanModel(store, LeanConfig(cache_bytes=0, kv_cache="f16")) as lean:
        with pytest.raises(ValueError, match="float32"):
            LeanEngine(lean, name="q")
