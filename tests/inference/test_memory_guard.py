"""The memory guard lowers the CPU cache while forward steps keep faulting the process's pages in."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import make_hf_checkpoint

from inference.engine import Engine, EngineConfig
from inference.memory_guard import HOT_STEPS, MemoryGuard
from semoe.generate import SamplingConfig
from semoe.hf_import import import_checkpoint
from storage.keys import ExpertKey
from storage.store import ExpertTensor, Store
from storage.tiered import TieredExpertStore, TieredStoreConfig


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
