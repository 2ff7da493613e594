"""Hybrid decode (`inference.offload.hybrid`): each routed expert on the device or the CPU, at the same
time, through the CUDA-semantics fake copy stream on CPU. It gives the resident model's tokens on every
architecture; its placement picks the cheaper side at each row count; admission into the device cache
is throttled; the thread that queues compute never waits on the device."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from helpers.hf_models import make_hf_checkpoint

from inference.engine import Engine
from inference.engine_config import EngineConfig
from inference.offload.expert_ring import OffloadedExperts
from inference.offload.hybrid_placement import DeviceAdmission, HybridRates, Placement
from semoe.checkpoints.hf_convert import import_checkpoint
from semoe.decode.generate import generate
from semoe.decode.loop import SamplingConfig
from storage.keys import ExpertKey
from storage.streams import FakeCudaCopyStream, copy_stream_factory

ARCHS = ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss",
         "minimax_m2", "dots1", "kimi_k25", "ernie4_5_moe", "hunyuan_v1_moe", "llama4", "deepseek_v32", "glm_moe_dsa"]
PROMPT = [3, 17, 5, 29, 11, 2, 40, 8, 19, 23]
NEW = 12
# Log-probs of the hybrid model (the model's modules, experts through the CPU kernels or torch on the
# fake device) against the resident engine (the decode plan's kernels): the same float32 products in
# other orders of summation, through every layer; log-probs of magnitude ~5. A wrong expert, weight or
# row moves them by O(0.1) or more.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def _stores(tmp_path_factory):
    def make(arch):
        root = tmp_path_factory.mktemp(f"hybrid-{arch}")
        store = import_checkpoint(str(make_hf_checkpoint(arch, root / "hf", seed=5)), str(root / "store"))
        resident = Engine.load(store.root, EngineConfig())
        try:
            want = resident.generate(PROMPT, SamplingConfig(max_new_tokens=NEW))
        finally:
            resident.close()
        return store, want

    return functools.cache(make)


def _slot(store) -> int:
    return OffloadedExperts.slot_bytes(store, torch.float32)


def _rates_crossing_at_two_rows(store) -> HybridRates:
    """Rates under which an expert not on the device runs on the CPU for one row and is copied to the
    device for two or more: the CPU's time is its rows' arithmetic (T a row), the device's the copy
    (1.5 T) and nothing else."""
    from semoe.checkpoints.hf_config import store_model_config

    c = store_model_config(store)
    T, flops = 1e-3, 6 * c.hidden_size * c.moe_ffn_size
    return HybridRates(h2d_bytes_s=_slot(store) / (1.5 * T), cpu_bytes_s=1e30, cpu_flops_s=flops / T,
                       device_bytes_s=1e30, device_flops_s=1e30)


def _hybrid(store, **kw) -> EngineConfig:
    eb = sum(c.bytes for c in store.manifest.chunks)
    return EngineConfig(cpu_cache_bytes=max(eb // 2, 4 * _slot(store)), device_memory_bytes=3 * _slot(store), **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_gives_the_resident_tokens_with_experts_on_both_sides(arch, _stores):
    store, want = _stores(arch)
    with copy_stream_factory(lambda device: FakeCudaCopyStream(device, seed=3)) as made:
        engine = Engine.load(store.root, _hybrid(store, experts_on="hybrid",
                                                 hybrid_rates=_rates_crossing_at_two_rows(store)))
        try:
            assert engine.decode_path().startswith("hybrid decode: dense and attention on cpu")
            assert "3 of 8 experts in device memory" in engine.decode_path() or arch != "mixtral"
            syncs_at_load = made[0].syncs_by_thread[threading.main_thread().name]
            got = engine.generate(PROMPT, SamplingConfig(max_new_tokens=NEW))
        finally:
            engine.close()
    assert got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=LOGPROB_ATOL, rel=0)
    h = got.stats["hybrid"]
    # decoding rows (one a step) on the CPU; the prompt's experts of several rows copied to the device
    assert h["cpu_share"] > 0 and h["device_copy_share"] > 0 and h["cpu_rows"] > 0 and h["device_rows"] > 0
    (stream,) = made
    assert stream.violations == []
    # the thread that queues compute never waits on a copy while generating: the CPU side's worker does
    assert stream.syncs_by_thread[threading.main_thread().name] == syncs_at_load
    assert stream.syncs_by_thread["hybrid-cpu_0"] > 0


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("mode", ["cpu", "device"])
def test_both_ends_stay_selectable(arch, mode, _stores):
    """experts_on=cpu: every routed expert on the CPU; device: every one streamed (the ring alone)."""
    store, want = _stores(arch)
    engine = Engine.load(store.root, _hybrid(store, experts_on=mode))
    try:
        got = engine.generate(PROMPT, SamplingConfig(max_new_tokens=NEW))
    finally:
        engine.close()
    assert got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=LOGPROB_ATOL, rel=0)
    if mode == "cpu":
        assert got.stats["hybrid"]["cpu_share"] == 1.0 and got.stats["hybrid"]["admitted"] == 0
    else:
        assert "hybrid" not in got.stats and got.stats["device_copy_bytes_per_token"] > 0


def test_host_syncs_per_step_are_the_modules_plus_one_per_predicted_layer(_stores):
    """On the thread that queues compute, hybrid decode adds to the model's own host reads (each MoE
    layer's routed ids, the embedding's rows) only the next layer's prediction, one per MoE layer but
    the last and forward; the rows' crossings add none (the CPU's worker waits for them)."""
    from storage.host_sync_counter import HostSyncCounter

    store, _ = _stores("mixtral")
    sampling = SamplingConfig(max_new_tokens=NEW)
    counts = {}
    for name, kw in (("hybrid", dict(experts_on="hybrid", prefetch=True)),
                     ("hybrid-no-prefetch", dict(experts_on="hybrid", prefetch=False)),
                     ("cpu-no-prefetch", dict(experts_on="cpu", prefetch=False))):
        engine = Engine.load(store.root, _hybrid(store, hybrid_rates=_rates_crossing_at_two_rows(store), **kw))
        try:
            with HostSyncCounter() as syncs:
                engine.generate(PROMPT, sampling)
            counts[name] = syncs.total
            moe_layers = len(engine.model.config.moe_layer_ids)
        finally:
            engine.close()
    forwards = NEW  # the prompt's forward and one per new token but the last
    assert counts["hybrid"] - counts["hybrid-no-prefetch"] == forwards * (moe_layers - 1)
    assert counts["hybrid-no-prefetch"] == counts["cpu-no-prefetch"]
    resident = Engine.load(store.root, EngineConfig())
    try:
        with HostSyncCounter() as syncs:  # the modules' own reads, on the resident model
            generate(resident.model, PROMPT, sampling, plan=None)
    finally:
        resident.close()
    # the offloaded model leaves its embedding in the store: one read of the ids a forward
    assert counts["hybrid-no-prefetch"] == syncs.total + forwards


# -- the placement and the admission, with fixed numbers --------------------------------------------

RATES = HybridRates(h2d_bytes_s=25e9, cpu_bytes_s=80e9, cpu_flops_s=2e12, device_bytes_s=3e12, device_flops_s=400e12)


@pytest.mark.parametrize("host_bytes, device_bytes", [(44 << 20, 44 << 20), (12 << 20, 24 << 20)])
def test_the_placement_picks_the_cheaper_side_at_each_row_count(host_bytes, device_bytes):
    p = Placement(RATES)
    flops = 2 * 3 * 4096 * 14336 // 4
    for rows in (1, 2, 8, 32, 64, 128, 256, 512, 1024, 4096):
        cpu = max(host_bytes / 80e9, rows * flops / 2e12)
        dev = device_bytes / 25e9 + max(device_bytes / 3e12, rows * flops / 400e12)
        assert p.side(host_bytes, device_bytes, flops, rows, resident=False) == ("device" if dev < cpu else "cpu")
        assert p.side(host_bytes, device_bytes, flops, rows, resident=True) == "device"
    cross = p.crossing_rows(host_bytes, device_bytes, flops)
    assert p.side(host_bytes, device_bytes, flops, cross - 1, resident=False) == "cpu"
    assert p.side(host_bytes, device_bytes, flops, cross, resident=False) == "device"
    # a faster link moves the crossing down; with these rates one decoding row never crosses
    faster = Placement(HybridRates(**{**RATES.__dict__, "h2d_bytes_s": 56e9}))
    assert faster.crossing_rows(host_bytes, device_bytes, flops) < cross and cross > 1


def test_rates_must_be_positive():
    with pytest.raises(ValueError, match="h2d_bytes_s must be > 0"):
        HybridRates(h2d_bytes_s=0, cpu_bytes_s=1, cpu_flops_s=1, device_bytes_s=1, device_flops_s=1)


def test_admission_needs_repeated_use_and_is_throttled_per_step():
    a = DeviceAdmission(min_uses=2.0, per_step=1, decay=0.5)
    k1, k2, k3 = (ExpertKey(0, e) for e in range(3))
    a.step()
    for k in (k1, k2, k3):
        a.used(k)
    assert [a.admit(k, cached=False) for k in (k1, k2, k3)] == [False, False, False]  # one use each
    a.step()  # counts halve: 0.5 each
    for k in (k1, k2, k1, k2, k3):
        a.used(k)
    # k1 and k2 at 2.5, k3 at 1.5: only one admission this step, the first asked of the two
    assert [a.admit(k, cached=False) for k in (k1, k2, k3)] == [True, False, False]
    a.step()  # k2 at 1.25 and no longer enough without another use; cached keys are never admitted
    a.used(k2)
    assert a.admit(k1, cached=True) is False and a.admit(k2, cached=False) is True
    for _ in range(10):
        a.step()
    assert a.uses == {}  # aged below the floor: forgotten


@pytest.mark.parametrize("fmt", ["gpt_oss-mxfp4", "deepseek_v3-fp8", "qwen3_moe-bf16"])
def test_the_cpu_side_computes_the_checkpoints_own_formats(fmt, tmp_path):
    """MXFP4 (gpt-oss as published), FP8 with square tiles (DeepSeek-V3 as published) and bfloat16
    experts, each computed by the CPU side as stored, on rows of the engine's float32: the resident
    model's tokens."""
    from helpers.quantized_checkpoints import write_fp8_checkpoint, write_mxfp4_checkpoint

    arch, kind = fmt.split("-")
    hf = make_hf_checkpoint(arch, tmp_path / "hf", seed=5, hidden_size=64, intermediate_size=64,
                            **({"moe_intermediate_size": 64} if arch == "deepseek_v3" else {}))
    if kind == "mxfp4":
        write_mxfp4_checkpoint(hf, tmp_path / "q")
    elif kind == "fp8":
        write_fp8_checkpoint(hf, tmp_path / "q", (32, 32), mtp=False)
    store = import_checkpoint(str(tmp_path / "q") if kind != "bf16" else str(hf), str(tmp_path / "store"),
                              **({"dtype": "bfloat16"} if kind == "bf16" else {}))
    schemes = {(t.quant or {}).get("scheme", t.dtype) for t in store.manifest.tensors if t.group == "expert"}
    assert {"mxfp4": "mxfp4", "fp8": "fp8", "bf16": "BF16"}[kind] in schemes
    sampling = SamplingConfig(max_new_tokens=NEW)
    resident = Engine.load(store.root, EngineConfig(dtype="float32"))
    try:
        want = resident.generate(PROMPT, sampling)
    finally:
        resident.close()
    engine = Engine.load(store.root, _hybrid(store, experts_on="cpu", dtype="float32"))
    try:
        got = engine.generate(PROMPT, sampling)
    finally:
        engine.close()
    assert got.tokens == want.tokens and got.stats["hybrid"]["cpu_share"] == 1.0
    assert got.logprobs == pytest.approx(want.logprobs, abs=LOGPROB_ATOL, rel=0)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_the_servers_packed_steps_split_their_experts_alike(arch, _stores):
    """`Engine.step`, the batching server's forward: two prompts, then both decoding beside a third's
    prompt, then all three decoding. Hybrid (crossing at two rows, so batches put experts on both
    sides) gives the resident engine's logits."""
    store, _ = _stores(arch)
    resident = Engine.load(store.root, EngineConfig())
    engine = Engine.load(store.root, _hybrid(store, experts_on="hybrid", hybrid_rates=_rates_crossing_at_two_rows(store)))
    try:
        prompts = [PROMPT[:6], PROMPT[1:10], PROMPT[3:7]]
        ours = [engine.new_cache(p, 4) for p in prompts]
        theirs = [resident.new_cache(p, 4) for p in prompts]
        steps = [(prompts[0] + prompts[1], [6, 9], [5, 14]), ([3, 9, *prompts[2]], [1, 1, 4], [0, 1, 5]),
                 ([11, 4, 60], [1, 1, 1], [0, 1, 2])]
        engine.offload.begin_request()
        for ids, counts, rows in steps:
            n = len(counts)
            got = engine.step(ids, ours[:n], counts, rows)
            want = resident.step(ids, theirs[:n], counts, rows)
            # log-prob-sized logits through the modules against the kernels' batch: float32 sums in
            # other orders over every layer (1e-4, as LOGPROB_ATOL)
            torch.testing.assert_close(got, want, rtol=0, atol=LOGPROB_ATOL)
        h = engine.offload.request_stats(tokens=1)["hybrid"]
        assert h["cpu_share"] > 0 and h["device_copy_share"] + h["device_hit_share"] > 0
    finally:
        engine.close()
        resident.close()


def test_hybrid_is_what_an_offloaded_engine_takes_on_a_gpu_by_default():
    assert EngineConfig(device="cuda", cpu_cache_bytes=1).hybrid
    assert not EngineConfig(device="cpu", cpu_cache_bytes=1).hybrid  # the ring, or the torch-free runner
    assert EngineConfig(device="cpu", experts_on="cpu").hybrid and EngineConfig(experts_on="hybrid").hybrid
    assert not EngineConfig(device="cuda", experts_on="device").hybrid
    with pytest.raises(ValueError, match="experts_on must be auto, hybrid, cpu or device, got 'gpu'"):
        EngineConfig(experts_on="gpu")


def test_a_layers_experts_are_balanced_between_the_two_sides():
    """Both sides run at once: the layer takes the longer side's total. `assign` never takes longer than
    each expert on its cheaper side, nor than either side alone, over random layers; and where every
    expert is cheaper on the CPU but eight of them there take longer than moving some, it moves them."""
    import random

    p = Placement(RATES)
    flops = 2 * 3 * 2048 * 768

    def makespan(experts, sides):
        cpu = sum(p.cpu_seconds(h, f, n) for (h, d, f, n, r), s in zip(experts, sides) if s == "cpu")
        dev = sum(p.device_seconds(d, f, n, resident=r) for (h, d, f, n, r), s in zip(experts, sides) if s == "device")
        return max(cpu, dev)

    rng = random.Random(0)
    for _ in range(200):
        experts = [(b := rng.choice([3 << 20, 9 << 20]), b, flops, rng.choice([1, 1, 2, 8, 64, 512]), rng.random() < 0.2)
                   for _ in range(rng.randint(1, 12))]
        got = makespan(experts, p.assign(experts))
        cheaper = [p.side(h, d, f, n, resident=r) for h, d, f, n, r in experts]
        assert got <= makespan(experts, cheaper) + 1e-12
        assert got <= makespan(experts, ["cpu"] * len(experts)) + 1e-12
        assert got <= makespan(experts, ["device" if r else "device" for *_, r in experts]) + 1e-12
    eight = [(9 << 20, 9 << 20, flops, 1, False)] * 8  # one decoding row each: each cheaper on the CPU
    assert all(p.side(*e[:4], resident=False) == "cpu" for e in eight)
    sides = p.assign(eight)
    assert 0 < sides.count("device") < 8 and makespan(eight, sides) < makespan(eight, ["cpu"] * 8)


def test_the_device_cache_takes_the_free_device_memory_less_its_reserve():
    """`default_slots` on a GPU asks the device for its free memory (the one CUDA-only line) and sizes the
    cache with `cache_slots`: an eighth kept back (at least 1 GiB) and the server's KV memory."""
    from inference.offload.hybrid import HybridExperts

    gib, mib = 1 << 30, 1 << 20
    assert HybridExperts.cache_slots(16 * gib, 0, 100 * mib, 10_000) == (14 * gib) // (100 * mib)  # 1/8 = 2 GiB
    assert HybridExperts.cache_slots(4 * gib, 512 * mib, 100 * mib, 10_000) == (2 * gib + 512 * mib) // (100 * mib)
    assert HybridExperts.cache_slots(80 * gib, 0, 100 * mib, 300) == 300  # one slot per expert at most
    assert HybridExperts.cache_slots(gib, 0, 100 * mib, 300) == 2  # no room: the ring's least
