"""SSD -> CPU tier: cached reads equal what was written, pins hold, prefetch avoids duplicate reads.

Reads are checked against the tensors the fixture wrote (regenerated from their seed), and a tier's
raw bytes against a plain `open()` + `read()` of the chunk file: neither reference shares the
store's read path. Concurrency is arranged with events, never with sleeps: a demand read is held
inside the reader until the test lets it go, so "still waiting" and "did not wait" are facts, not
timings.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import CancelledError

import pytest
import torch

from storage.errors import CorruptTensorError
from storage.keys import ExpertKey
from storage.store import ExpertTensor, Store
from storage.tiered_experts import TieredExpertStore, TieredStoreConfig

LAYERS, EXPERTS = 3, 6
TIMEOUT_S = 30  # only ever reached if something is broken


def written(layer: int, e: int) -> dict[str, torch.Tensor]:
    """The tensors the fixture stores for one expert (seeded per expert, so tests can rebuild them)."""
    gen = torch.Generator().manual_seed(1000 * layer + e)
    return {f"l{layer}.e{e}.w1": torch.randn(64, 48, generator=gen),
            f"l{layer}.e{e}.w2": torch.randn(48, 64, generator=gen).bfloat16()}


@pytest.fixture()
def store(tmp_path):
    s = Store.create(str(tmp_path / "s"))
    with s.writer() as w:
        for layer in range(LAYERS):
            for e in range(EXPERTS):
                w.put_expert(layer, e, [ExpertTensor(name=n, tensor=t) for n, t in written(layer, e).items()],
                             num_experts=EXPERTS)
        w.commit()
    return s


def _tier(store, experts_in_cache: int, **kw) -> TieredExpertStore:
    chunk = store.manifest.chunk(0, 0).bytes
    return TieredExpertStore(store, TieredStoreConfig(cpu_cache_bytes=experts_in_cache * chunk,
                                                      read_mode="drop", **kw))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _file_bytes(store, layer: int, e: int) -> bytes:
    """The chunk file read with plain Python I/O, not the store's reader."""
    with open(store.path(store.manifest.chunk(layer, e).file), "rb") as f:
        return f.read()


class HeldReads:
    """Demand reads of the tier wait inside its reader until `release()`; `entered` is set once
    the first one is in flight. Guesses use a reader of their own and are not held."""

    def __init__(self, tier: TieredExpertStore) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        real = tier.reader.read_many

        def held(requests):
            self.entered.set()
            if not self.released.wait(TIMEOUT_S):
                raise TimeoutError("held read never released")
            return real(requests)

        tier.reader.read_many = held

    def wait_entered(self) -> None:
        if not self.entered.wait(TIMEOUT_S):
            raise TimeoutError("no read entered the reader")

    def release(self) -> None:
        self.released.set()


def _gate_entered(tier: TieredExpertStore) -> threading.Event:
    """An event set when a guess first asks the disk gate whether it may read."""
    event = threading.Event()
    real_gate = tier._gate

    def gate(spec):
        event.set()
        return real_gate(spec)

    tier._gate = gate
    return event


def _wait(event: threading.Event) -> None:
    if not event.wait(TIMEOUT_S):
        raise TimeoutError("event never set")


@pytest.mark.parametrize("policy", ["lfu-aging", "lfu", "lru"])
def test_cached_reads_equal_written_tensors_under_eviction(store, policy):
    rng = random.Random(1)
    chunk = store.manifest.chunk(0, 0).bytes
    with _tier(store, 5, policy=policy) as tier:
        for _ in range(200):
            layer, e = rng.randrange(LAYERS), min(rng.randrange(EXPERTS), rng.randrange(EXPERTS))
            with tier.get(ExpertKey(layer, e)) as h:
                assert _same(h.tensors, written(layer, e))
            assert tier.cache.used_bytes <= 5 * chunk
        s = tier.stats()
        assert s.hits + s.misses + s.inflight_hits == 200
        assert s.ssd_reads == s.misses and s.evictions > 0 and 0 < s.hit_rate < 1
        assert s.ssd_bytes == s.ssd_reads * chunk


def test_raw_bytes_equal_a_plain_read_of_the_chunk_file(store):
    with _tier(store, 4) as tier:
        for layer, e in [(0, 0), (2, 5), (1, 3)]:
            with tier.get(ExpertKey(layer, e)) as h:
                assert h.raw.numpy().tobytes() == _file_bytes(store, layer, e)


def test_pinned_experts_are_never_evicted_or_overwritten(store):
    with _tier(store, 3) as tier:
        held = [tier.get(ExpertKey(0, 0)), tier.get(ExpertKey(0, 1))]
        for layer in range(LAYERS):
            for e in range(2, EXPERTS):
                with tier.get(ExpertKey(layer, e)):
                    pass
        assert tier.cached(ExpertKey(0, 0)) and tier.cached(ExpertKey(0, 1))
        for h, e in zip(held, (0, 1)):
            assert _same(h.tensors, written(0, e))  # the buffers were not reused for other experts
            h.release()
        # with everything pinned, a prefetch is dropped rather than waited for
        pins = [tier.get(ExpertKey(1, 0)), tier.get(ExpertKey(1, 1)), tier.get(ExpertKey(1, 2))]
        assert tier.prefetch([ExpertKey(2, 5)]) == [] and tier.stats().prefetch_dropped == 1
        for h in pins:
            h.release()


def test_prefetch_reads_each_expert_once(store):
    with _tier(store, 12) as tier:
        wanted = [ExpertKey(1, e) for e in range(EXPERTS)]
        assert tier.prefetch(wanted) == [(1, e, "weight") for e in range(EXPERTS)]
        assert tier.prefetch(wanted) == []  # already cached or in flight
        for layer, e, _ in wanted:
            with tier.get(ExpertKey(layer, e)) as h:
                assert _same(h.tensors, written(layer, e))
        s = tier.stats()
        assert s.ssd_reads == EXPERTS and s.misses == 0 and s.prefetch_issued == EXPERTS
        assert s.hits + s.inflight_hits == EXPERTS


def test_prefetched_reads_overlap_the_callers_compute(store):
    """A layer loop as the engines run one: prefetch layer i + 1, then compute layer i. The read of
    layer i + 1 (inside the reader the tier calls) and the compute of layer i meet at a barrier that
    only two things running at once can pass: a tier reading in the caller's thread, or only when
    asked by `get`, breaks it. Layer 0, never prefetched, is read on demand in the caller's thread."""
    meet = threading.Barrier(2, timeout=TIMEOUT_S)
    layer_of = {store.path(store.manifest.chunk(layer, 0).file): layer for layer in range(LAYERS)}
    reads = []
    caller = threading.get_ident()
    with _tier(store, LAYERS) as tier:
        real = tier.reader.read_many

        def read_many(requests):
            (request,) = requests  # the tier reads one chunk per call
            layer = layer_of[request.path]
            reads.append((layer, threading.get_ident() == caller))
            if layer > 0:
                meet.wait()  # the caller is computing layer - 1 at this moment
            return real(requests)

        tier.reader.read_many = read_many
        for layer in range(LAYERS):
            if layer + 1 < LAYERS:
                assert tier.prefetch([ExpertKey(layer + 1, 0)]) == [(layer + 1, 0, "weight")]
            with tier.get(ExpertKey(layer, 0)) as h:
                if layer + 1 < LAYERS:
                    meet.wait()  # compute of this layer, while the next one is read
                assert _same(h.tensors, written(layer, 0))
        assert sorted(reads) == [(0, True)] + [(layer, False) for layer in range(1, LAYERS)]
        s = tier.stats()
        assert s.ssd_reads == LAYERS and s.misses == 1 and s.prefetch_issued == LAYERS - 1


def test_cancelled_prefetch_is_loaded_on_demand(store):
    """One worker, held inside the first read: the other five reads are still queued, so exactly
    those five are cancelled; the running one finishes and is used."""
    with _tier(store, 12, prefetch_workers=1) as tier:
        reads = HeldReads(tier)
        tier.prefetch([ExpertKey(0, e) for e in range(EXPERTS)], priority=5.0)
        reads.wait_entered()  # (0, 0): equal priorities run in submission order
        assert tier.cancel_prefetch([(0, e, "weight") for e in range(EXPERTS)]) == EXPERTS - 1
        assert tier.cached(ExpertKey(0, 0)) and not any(tier.cached(ExpertKey(0, e)) for e in range(1, EXPERTS))
        reads.release()
        for e in range(EXPERTS):
            with tier.get(ExpertKey(0, e)) as h:
                assert _same(h.tensors, written(0, e))
        s = tier.stats()
        assert s.ssd_reads == EXPERTS and s.prefetch_issued == EXPERTS
        assert s.misses == EXPERTS - 1 and s.hits + s.inflight_hits == 1


def test_corrupt_chunk_raises_naming_the_tensor_and_leaves_no_entry(store):
    entry = store.manifest.tensor("l2.e3.w2")
    with open(store.path(entry.file), "r+b") as f:
        f.seek(entry.offset + 10)
        b = f.read(1)
        f.seek(entry.offset + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    with _tier(store, 4) as tier:
        with pytest.raises(CorruptTensorError, match=r"tensor l2\.e3\.w2 \(weight\) is corrupt"):
            tier.get(ExpertKey(2, 3))
        assert not tier.cached(ExpertKey(2, 3))
        assert len(tier.prefetch([ExpertKey(2, 3)])) == 1
        with pytest.raises(CorruptTensorError):
            tier.get(ExpertKey(2, 3))
        with tier.get(ExpertKey(2, 2)) as h:
            assert _same(h.tensors, written(2, 2))
        assert tier.cache.used_bytes <= tier.cache.capacity_bytes


def test_budget_smaller_than_one_expert_is_refused(store):
    with pytest.raises(ValueError, match="cannot hold one expert chunk"):
        TieredExpertStore(store, TieredStoreConfig(cpu_cache_bytes=100))


def test_a_guess_waits_for_needed_reads_and_a_wrong_one_is_abandoned(store):
    chunk = store.manifest.chunk(0, 0).bytes
    with _tier(store, 6, io_threads=1) as tier:
        reads, asked = HeldReads(tier), _gate_entered(tier)
        demand = threading.Thread(target=lambda: tier.get(ExpertKey(0, 0)).release())
        demand.start()
        reads.wait_entered()  # the demand read is in flight (and held): guesses must not touch the disk
        outcome = {}

        def guess():
            try:
                tier.get(ExpertKey(1, 1), speculative=True).release()
                outcome["done"] = True
            except CancelledError:
                outcome["cancelled"] = True

        g = threading.Thread(target=guess)
        g.start()
        _wait(asked)  # the guess asked to read; the gate holds it while the demand read is in flight
        assert tier.stats().ssd_bytes == 0 and g.is_alive()
        assert tier.cancel_guesses([ExpertKey(1, 1)]) == 1
        g.join(TIMEOUT_S)
        assert not g.is_alive() and outcome == {"cancelled": True}  # gave up with the demand read still held
        reads.release()
        demand.join(TIMEOUT_S)
        s = tier.stats()
        assert s.guesses_cancelled == 1 and s.guess_wasted_bytes == 0  # gave up before reading a byte
        assert s.ssd_bytes == chunk and not tier.cached(ExpertKey(1, 1))
        with tier.get(ExpertKey(1, 1)) as h:  # the abandoned guess left nothing half-read behind
            assert _same(h.tensors, written(1, 1))


def test_a_guess_that_is_needed_is_hurried_and_used(store):
    with _tier(store, 6, io_threads=1) as tier:
        reads, asked = HeldReads(tier), _gate_entered(tier)
        demand = threading.Thread(target=lambda: tier.get(ExpertKey(0, 0)).release())
        demand.start()
        reads.wait_entered()
        got = {}
        g = threading.Thread(target=lambda: got.setdefault("h", tier.get(ExpertKey(2, 3), speculative=True)))
        g.start()
        _wait(asked)
        assert g.is_alive()  # paused behind the held demand read
        needed = threading.Thread(target=lambda: got.setdefault("needed", tier.get(ExpertKey(2, 3))))
        needed.start()
        needed.join(TIMEOUT_S)
        # now needed, the guess read at once: the demand read it used to wait for is still held
        assert not needed.is_alive() and not reads.released.is_set()
        g.join(TIMEOUT_S)
        assert not g.is_alive()
        for h in (got["needed"], got["h"]):
            assert _same(h.tensors, written(2, 3))
            h.release()
        reads.release()
        demand.join(TIMEOUT_S)
        s = tier.stats()
        assert s.guesses_cancelled == 0 and s.ssd_reads == 2


def test_cancelling_a_guess_mid_read_counts_the_bytes_it_read(store):
    from storage.chunk_io import ChunkReaderConfig

    with _tier(store, 6, io_threads=1) as tier:
        reader = tier._guesses_reader()
        reader.config = ChunkReaderConfig(mode="drop", threads=1, piece_bytes=1 << 20, io_bytes=4096)
        steps = []
        real_gate = tier._gate

        def gate(spec):  # the guess is found wrong after its third page (gate calls: open, pages 2, 3, 4)
            steps.append(1)
            if len(steps) == 4:
                tier.cancel_guesses([ExpertKey(0, 5)])
            return real_gate(spec)

        tier._gate = gate
        with pytest.raises(CancelledError):
            tier.get(ExpertKey(0, 5), speculative=True)
        s = tier.stats()
        assert s.guesses_cancelled == 1 and s.guess_wasted_bytes == 3 * 4096 == s.ssd_bytes
        assert not tier.cached(ExpertKey(0, 5))


def test_close_gives_the_host_pool_back(store):
    tier = _tier(store, experts_in_cache=3)
    with tier.get(ExpertKey(0, 1)):
        pass
    assert tier.pool.allocated_bytes > 0
    tier.close()
    assert tier.pool.allocated_bytes == 0  # evicted or not, no slab outlives the tier


def test_shrink_lowers_the_cache_and_gives_the_pool_memory_back(store):
    tier = _tier(store, experts_in_cache=6)
    chunk = store.manifest.chunk(0, 0).bytes
    for e in range(6):
        with tier.get(ExpertKey(0, e)):
            pass
    assert tier.pool.allocated_bytes == 6 * chunk
    assert tier.shrink(2 * chunk) == 4 * chunk
    assert tier.cache.capacity_bytes == 2 * chunk and tier.cache.used_bytes == 2 * chunk
    # the pool keeps its slack of two experts beside the cache, and no more
    assert tier.pool.capacity_bytes == 4 * chunk and tier.pool.allocated_bytes <= 4 * chunk
    for e in range(EXPERTS):  # still serves every expert, within the lowered budget
        with tier.get(ExpertKey(1, e)) as h:
            assert _same(h.tensors, written(1, e))
        assert tier.cache.used_bytes <= 2 * chunk and tier.pool.allocated_bytes <= 4 * chunk
    tier.close()
