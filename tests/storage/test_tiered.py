"""SSD -> CPU tier: cached reads equal plain reads, pins hold, prefetch avoids duplicate reads."""

from __future__ import annotations

import random

import pytest
import torch

from storage.errors import CorruptTensorError
from storage.store import ExpertTensor, Store
from storage.tiered import TieredExpertStore, TieredStoreConfig

LAYERS, EXPERTS = 3, 6


@pytest.fixture()
def store(tmp_path):
    gen = torch.Generator().manual_seed(0)
    s = Store.create(str(tmp_path / "s"))
    with s.writer() as w:
        for layer in range(LAYERS):
            for e in range(EXPERTS):
                w.put_expert(layer, e, [
                    ExpertTensor(name=f"l{layer}.e{e}.w1", tensor=torch.randn(64, 48, generator=gen)),
                    ExpertTensor(name=f"l{layer}.e{e}.w2", tensor=torch.randn(48, 64, generator=gen).bfloat16()),
                ], num_experts=EXPERTS)
        w.commit()
    return s


def _tier(store, experts_in_cache: int, **kw) -> TieredExpertStore:
    chunk = store.manifest.chunk(0, 0).bytes
    return TieredExpertStore(store, TieredStoreConfig(cpu_cache_bytes=experts_in_cache * chunk,
                                                      read_mode="drop", **kw))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("policy", ["lfu-aging", "lfu", "lru"])
def test_cached_reads_equal_plain_reads_under_eviction(store, policy):
    rng = random.Random(1)
    chunk = store.manifest.chunk(0, 0).bytes
    with _tier(store, 5, policy=policy) as tier:
        for _ in range(200):
            layer, e = rng.randrange(LAYERS), min(rng.randrange(EXPERTS), rng.randrange(EXPERTS))
            with tier.get(layer, e) as h:
                assert _same(h.tensors, store.read_expert(layer, e))
            assert tier.cache.used_bytes <= 5 * chunk
        s = tier.stats()
        assert s.hits + s.misses + s.inflight_hits == 200
        assert s.ssd_reads == s.misses and s.evictions > 0 and 0 < s.hit_rate < 1
        assert s.ssd_bytes == s.ssd_reads * chunk


def test_pinned_experts_are_never_evicted_or_overwritten(store):
    with _tier(store, 3) as tier:
        held = [tier.get(0, 0), tier.get(0, 1)]
        snapshot = [{k: v.clone() for k, v in h.tensors.items()} for h in held]
        for layer in range(LAYERS):
            for e in range(2, EXPERTS):
                with tier.get(layer, e):
                    pass
        assert tier.cached(0, 0) and tier.cached(0, 1)
        for h, snap in zip(held, snapshot):
            assert _same(h.tensors, snap)  # the buffers were not reused for other experts
            h.release()
        # with everything pinned, a prefetch is dropped rather than waited for
        pins = [tier.get(1, 0), tier.get(1, 1), tier.get(1, 2)]
        assert tier.prefetch([(2, 5)]) == [] and tier.stats().prefetch_dropped == 1
        for h in pins:
            h.release()


def test_prefetch_reads_each_expert_once(store):
    with _tier(store, 12) as tier:
        wanted = [(1, e) for e in range(EXPERTS)]
        assert tier.prefetch(wanted) == [(layer, e, "weight") for layer, e in wanted]
        assert tier.prefetch(wanted) == []  # already cached or in flight
        for layer, e in wanted:
            with tier.get(layer, e) as h:
                assert _same(h.tensors, store.read_expert(layer, e))
        s = tier.stats()
        assert s.ssd_reads == EXPERTS and s.misses == 0 and s.prefetch_issued == EXPERTS
        assert s.hits + s.inflight_hits == EXPERTS


def test_cancelled_prefetch_is_loaded_on_demand(store):
    with _tier(store, 12, prefetch_workers=1) as tier:
        tier.prefetch([(0, e) for e in range(EXPERTS)], priority=5.0)
        cancelled = tier.cancel_prefetch([(0, e, "weight") for e in range(EXPERTS)])
        for e in range(EXPERTS):
            with tier.get(0, e) as h:
                assert _same(h.tensors, store.read_expert(0, e))
        assert tier.stats().ssd_reads == EXPERTS
        assert 0 <= cancelled <= EXPERTS and tier.stats().prefetch_issued == EXPERTS


def test_corrupt_chunk_raises_naming_the_tensor_and_leaves_no_entry(store):
    entry = store.manifest.tensor("l2.e3.w2")
    with open(store.path(entry.file), "r+b") as f:
        f.seek(entry.offset + 10)
        b = f.read(1)
        f.seek(entry.offset + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    with _tier(store, 4) as tier:
        with pytest.raises(CorruptTensorError, match=r"tensor l2\.e3\.w2 \(weight\) is corrupt"):
            tier.get(2, 3)
        assert not tier.cached(2, 3)
        assert len(tier.prefetch([(2, 3)])) == 1
        with pytest.raises(CorruptTensorError):
            tier.get(2, 3)
        with tier.get(2, 2) as h:
            assert _same(h.tensors, store.read_expert(2, 2))
        assert tier.cache.used_bytes <= tier.cache.capacity_bytes


def test_budget_smaller_than_one_expert_is_refused(store):
    with pytest.raises(ValueError, match="cannot hold one expert chunk"):
        TieredExpertStore(store, TieredStoreConfig(cpu_cache_bytes=100))
