"""The memory guard lowers the CPU cache while forward steps keep faulting the process's pages in."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import make_hf_checkpoint

from inference.engine import Engine
from inference.engine_config import EngineConfig
from inference import memory_guard
from inference.memory_guard import AUTO_RESERVE_BYTES, CPU_CACHE_AUTO, HOT_STEPS, MemoryGuard, auto_cpu_cache_bytes
from semoe.decode.loop import SamplingConfig
from semoe.checkpoints.hf_convert import import_checkpoint
from storage.keys import ExpertKey
from storage.store import ExpertTensor, Store
from storage.tiered_experts import TieredExpertStore, TieredStoreConfig


class Faults:
    """A major-fault counter the test advances."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        return self.count


@pytest.fixture()
def tier(tmp_path):
    s = Store.create(str(tmp_path / "s"))
    with s.writer() as w:
        for e in range(16):
            w.put_expert(0, e, [ExpertTensor(name=f"e{e}", tensor=torch.full((256, 16), float(e)))], num_experts=16)
        w.commit()
    chunk = s.manifest.chunk(0, 0).bytes
    t = TieredExpertStore(s, TieredStoreConfig(cpu_cache_bytes=16 * chunk, read_mode="drop"))
    for e in range(16):
        with t.get(ExpertKey(0, e)):
            pass
    yield t, chunk
    t.close()


def test_a_cold_start_does_not_shrink_the_cache_but_steps_that_keep_faulting_do(tier):
    t, chunk = tier
    faults = Faults()
    guard = MemoryGuard(t, floor_bytes=4 * chunk, step_bytes=chunk, faults=faults)
    # a cold start: the first steps fault their code in, then no more
    for n in [500] * (HOT_STEPS - 1) + [0, 0]:
        faults.count += n
        assert guard.step() == 0
    assert t.cache.capacity_bytes == 16 * chunk and guard.shrinks == 0
    # thrashing: every step faults
    for _ in range(HOT_STEPS):
        faults.count += 500
        lowered = guard.step()
    assert lowered == chunk and guard.shrinks == 1  # a sixteenth of 16 experts, at least one expert
    assert t.cache.capacity_bytes == 15 * chunk and t.cache.used_bytes <= 15 * chunk
    # it goes on while the faults do, never below the floor
    for _ in range(100 * HOT_STEPS):
        faults.count += 500
        guard.step()
    assert t.cache.capacity_bytes == 4 * chunk and t.cache.used_bytes <= 4 * chunk
    assert guard.shrinks == 12


def test_a_few_faults_a_step_are_not_pressure(tier):
    t, chunk = tier
    faults = Faults()
    guard = MemoryGuard(t, floor_bytes=chunk, step_bytes=chunk, faults=faults, faults_per_step=32)
    for _ in range(10 * HOT_STEPS):
        faults.count += 31
        guard.step()
    assert guard.shrinks == 0 and t.cache.capacity_bytes == 16 * chunk


def test_an_offloaded_engine_under_pressure_shrinks_its_cache_and_keeps_its_answer(tmp_path):
    hf = make_hf_checkpoint("mixtral", tmp_path / "hf", seed=2)
    store = import_checkpoint(str(hf), str(tmp_path / "store"))
    expert_bytes = sum(c.bytes for c in store.manifest.chunks)
    prompt = [3, 17, 5, 29, 11]
    sampling = SamplingConfig(max_new_tokens=12)
    calm = Engine.load(store.root, EngineConfig(cpu_cache_bytes=expert_bytes, ring_slots=2, memory_guard=False))
    try:
        assert calm.offload.guard is None
        want = calm.generate(prompt, sampling)
    finally:
        calm.close()
    faults = Faults()

    def thrashing() -> int:  # every read of the counter: another step's worth of faults
        faults.count += 1000
        return faults.count

    engine = Engine.load(store.root, EngineConfig(cpu_cache_bytes=expert_bytes, ring_slots=2))
    try:
        guard = engine.offload.guard
        guard.faults = thrashing  # the default argument was bound at import: the engine's guard reads this one
        res = engine.generate(prompt, sampling)
        # the same kernels on the same weights: exactly the same answer, whatever the cache holds
        assert res.tokens == want.tokens and res.logprobs == want.logprobs
        assert guard.shrinks > 0
        assert guard.floor_bytes <= engine.offload.tier.cache.capacity_bytes < expert_bytes
    finally:
        engine.close()


def test_an_auto_cache_grows_while_steps_are_calm_and_memory_is_available_and_stops_where_faults_begin(tier):
    t, chunk = tier
    t.shrink(2 * chunk)
    faults, free = Faults(), [AUTO_RESERVE_BYTES + 5 * chunk]  # 5 experts beyond the reserve
    guard = MemoryGuard(t, floor_bytes=2 * chunk, step_bytes=chunk, faults=faults, ceiling_bytes=16 * chunk,
                        available=lambda: free[0], calm_steps=2)
    # a cold start faults: no growth
    for _ in range(4):
        faults.count += 500
        assert guard.step() == 0
    assert t.cache.capacity_bytes == 2 * chunk and guard.grows == 0
    # calm: every second step raises it by a quarter, at least an expert, within what is available
    raised = []
    for _ in range(4):
        raised.append(guard.step())
        free[0] -= -raised[-1] if raised[-1] < 0 else 0  # the cache takes what it grew by
    assert raised == [0, -chunk, 0, -chunk] and t.cache.capacity_bytes == 4 * chunk
    free[0] = AUTO_RESERVE_BYTES + 100 * chunk  # memory given back by others: a quarter a time
    assert [guard.step() for _ in range(2)] == [0, -chunk] and t.cache.capacity_bytes == 5 * chunk
    # entries fill the room it grew into without evicting
    for e in range(5):
        with t.get(ExpertKey(0, e)):
            pass
    assert t.cache.used_bytes == 5 * chunk
    # faults for HOT_STEPS steps: it shrinks, and never grows past that level again
    for _ in range(HOT_STEPS):
        faults.count += 500
        guard.step()
    assert guard.shrinks == 1 and t.cache.capacity_bytes == 4 * chunk == guard.ceiling_bytes
    assert all(guard.step() == 0 for _ in range(10)) and t.cache.capacity_bytes == 4 * chunk


def test_a_fixed_cache_never_grows(tier):
    t, chunk = tier
    t.shrink(2 * chunk)
    guard = MemoryGuard(t, floor_bytes=chunk, step_bytes=chunk, faults=Faults(), available=lambda: 1 << 40)
    assert all(guard.step() == 0 for _ in range(10)) and t.cache.capacity_bytes == 2 * chunk


def test_auto_cache_takes_the_available_memory_less_a_reserve():
    MiB = 1 << 20
    # a small machine: the fixed reserve; a large one: a sixteenth; every expert where they all fit
    assert auto_cpu_cache_bytes(10_000 * MiB, available=lambda: 200 * MiB) == 200 * MiB - AUTO_RESERVE_BYTES
    assert auto_cpu_cache_bytes(10_000 * MiB, available=lambda: 4096 * MiB) == 4096 * MiB - 256 * MiB
    assert auto_cpu_cache_bytes(1000 * MiB, available=lambda: 4096 * MiB) == 1000 * MiB
    assert auto_cpu_cache_bytes(1000 * MiB, available=lambda: AUTO_RESERVE_BYTES // 2) == 0
    # a server's KV memory is left free too
    assert auto_cpu_cache_bytes(10_000 * MiB, keep_bytes=100 * MiB, available=lambda: 4096 * MiB) == 3740 * MiB


def test_an_engine_with_an_auto_cache_sizes_it_from_the_memory_available(tmp_path, monkeypatch):
    hf = make_hf_checkpoint("mixtral", tmp_path / "hf", seed=2)
    store = import_checkpoint(str(hf), str(tmp_path / "store"))
    chunks = [c.bytes for c in store.manifest.chunks if c.kind == "weight"]
    expert_bytes, biggest = sum(chunks), max(chunks)
    prompt, sampling = [3, 17, 5, 29, 11], SamplingConfig(max_new_tokens=8)
    resident = Engine.load(store.root, EngineConfig())
    try:
        want = resident.generate(prompt, sampling)
    finally:
        resident.close()
    for available, cache in ((AUTO_RESERVE_BYTES + 5 * biggest, 5 * biggest),  # what is left, less the reserve
                             (10 * expert_bytes + AUTO_RESERVE_BYTES, expert_bytes),  # all of them fit
                             (AUTO_RESERVE_BYTES, 4 * biggest)):  # nothing left: what a ring of 2 needs (top-2)
        monkeypatch.setattr(memory_guard, "available_ram_bytes", lambda a=available: a)
        engine = Engine.load(store.root, EngineConfig(cpu_cache_bytes=CPU_CACHE_AUTO, ring_slots=2))
        try:
            assert engine.offload.tier.cache.capacity_bytes == cache
            res = engine.generate(prompt, sampling)
            assert res.tokens == want.tokens  # offloaded through any cache: the resident model's tokens
        finally:
            engine.close()


def test_a_cache_budget_is_bytes_or_auto():
    assert EngineConfig(cpu_cache_bytes=CPU_CACHE_AUTO).offloaded
    with pytest.raises(ValueError, match="cpu_cache_bytes must be a number of bytes or 'auto', got 'half'"):
        EngineConfig(cpu_cache_bytes="half")
