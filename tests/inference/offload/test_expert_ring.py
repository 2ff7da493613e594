"""Offloaded generation gives exactly the resident model's tokens and log-probs, at every budget."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from helpers.hf_models import make_hf_checkpoint
from helpers.kernels import needs_kernels
from helpers.store_opens import record_store_opens

from inference.engine import Engine
from inference.engine_config import EngineConfig
from semoe.decode.plan import DecodePlan
from semoe.decode.support import plan_refusal
from semoe.decode.generate import GenerationResult, generate
from semoe.decode.loop import SamplingConfig
from semoe.checkpoints.hf_convert import import_checkpoint
from storage.reader import StoreReader
from helpers.procs import ROOT, child_env

OLDER_ARCHS = ["mixtral", "qwen2_moe", "olmoe"]
NEWER_ARCHS = ["qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "minimax_m2", "dots1", "kimi_k25",
               "ernie4_5_moe", "hunyuan_v1_moe", "llama4",
               "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe", "deepseek_v4"]
PROMPT = [3, 17, 5, 29, 11, 2, 40, 8, 19, 23]


def _answer(engine: Engine) -> GenerationResult:
    """What `engine` generates after PROMPT; the engine is closed afterwards."""
    try:
        return engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
    finally:
        engine.close()


def _resident_answer(hf) -> GenerationResult:
    """The resident model's answer through the decode plan's kernel-by-kernel step, the one the
    offloaded engine takes. Resident, the plan would take the one-call C step where it applies, whose
    softmax and SiLU use C's expf where the loop uses torch's ops: the two agree to float32 rounding
    (bounded in tests/semoe/decode/test_plan.py), not to the bit, so exactness is asked of the same step.
    A model no plan takes (`plan_refusal`: Qwen3-Next's linear attention) decodes on the module path, resident
    and offloaded alike."""
    engine = Engine.load(str(hf), EngineConfig())
    try:
        plan = None if plan_refusal(engine.model.config) else DecodePlan.build(engine.model, whole=False)
        return generate(engine.model, PROMPT, SamplingConfig(max_new_tokens=24), plan=plan)
    finally:
        engine.close()


def _slot_bytes(store) -> int:
    from inference.offload.expert_ring import OffloadedExperts

    return OffloadedExperts.slot_bytes(store, torch.float32)


# Stores are made on a test's first use of an architecture and kept for the module, so each is made
# once whatever the order the tests run in, and each test names the architectures it runs on.

@pytest.fixture(scope="module")
def _float32_stores(tmp_path_factory):
    def make(arch):
        root = tmp_path_factory.mktemp(f"offload-{arch}")
        hf = make_hf_checkpoint(arch, root / "hf", seed=5)
        store = import_checkpoint(str(hf), str(root / "store"))
        expert_bytes = sum(c.bytes for c in store.manifest.chunks)  # what the experts take in memory
        biggest = max(c.bytes for c in store.manifest.chunks)
        return arch, store, expert_bytes, biggest, _resident_answer(hf)

    return functools.cache(make)


@pytest.fixture
def model_store(arch, _float32_stores):
    """A float32 store of `arch`, its experts' bytes, its biggest expert and the resident model's answer."""
    return _float32_stores(arch)


BUDGETS = {
    "cache-100%-default-ring": lambda eb, big, slot: dict(cpu_cache_bytes=eb + big),
    "cache-50%": lambda eb, big, slot: dict(cpu_cache_bytes=eb // 2),
    "cache-25%-ring-2": lambda eb, big, slot: dict(cpu_cache_bytes=eb // 4, ring_slots=2),
    "cache-25%-lfu-aging": lambda eb, big, slot: dict(cpu_cache_bytes=eb // 4, cache_policy="lfu-aging"),
    "ring-3-no-prefetch": lambda eb, big, slot: dict(ring_slots=3, prefetch=False),
    "buffered-reads": lambda eb, big, slot: dict(cpu_cache_bytes=eb // 2, read_mode="drop"),
    # A copying ring (the GPU's path) on the float32 store: nothing is cast, so still exact. In place,
    # the CPU cache must hold the ring and a layer's experts, which is the whole of qwen3_moe's tiny
    # model (one MoE layer of 4 experts); only a copying ring makes every architecture evict. An
    # expert stays in the CPU cache until its copy lands: the cache holds both slots' sources.
    "cache-25%-device-2-slots": lambda eb, big, slot: dict(cpu_cache_bytes=max(eb // 4, 2 * big),
                                                           device_memory_bytes=2 * slot),
}
SMALLEST = "cache-25%-device-2-slots"
# The whole matrix runs on the older three; the newer five run three budgets (a partial cache with
# the default ring, a quarter in place with a 2-slot ring, and the smallest, copying) to keep the
# default suite's time in check: the ring and cache code is the same for every architecture.
NEWER_BUDGETS = ("cache-50%", "cache-25%-ring-2", SMALLEST)
MATRIX = [(a, b) for a in OLDER_ARCHS for b in BUDGETS] + [(a, b) for a in NEWER_ARCHS for b in NEWER_BUDGETS]

# The ring's and the cache's mechanics do not depend on the architecture; their tests also assume two
# MoE layers or more and more experts than an in-place ring keeps cached, which qwen3_moe's tiny
# model (one MoE layer of 4 experts) does not have.
ON_OLDER_ARCHS = pytest.mark.parametrize("arch", OLDER_ARCHS)


@pytest.mark.parametrize("arch, budget", MATRIX)
def test_offloaded_equals_resident(model_store, budget):
    arch, store, expert_bytes, biggest, want = model_store
    engine = Engine.load(store.root, EngineConfig(**BUDGETS[budget](expert_bytes, biggest, _slot_bytes(store))))
    try:
        got = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
        assert got.tokens == want.tokens
        assert got.logprobs == want.logprobs  # exactly: same kernels, same summation order
        s = got.stats
        for key in ("ring_hit_rate", "cpu_hit_rate", "ssd_bytes_per_token", "device_copy_bytes_per_token",
                    "ideal_bytes_per_token", "prefetch_precision", "prefetch_recall", "peak_rss_bytes"):
            assert key in s and s[key] >= 0, key
        assert 0 <= s["ring_hit_rate"] <= 1 and 0 <= s["cpu_hit_rate"] <= 1
        # in place, the CPU is the device: experts are used where the cache holds them
        assert (s["device_copy_bytes_per_token"] > 0) == engine.offload.copies
        if budget == SMALLEST:
            tier = engine.offload.tier.stats()
            # the cache was filled before the request (preload): more misses than there are experts
            # means experts were evicted and read again
            assert engine.offload.ring_slots == 2
            assert tier.evictions > 0 and tier.misses > len(store.manifest.chunks), (tier.evictions, tier.misses)
        # a second request on a warm engine still gives the same answer
        again = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
        assert again.tokens == want.tokens and again.logprobs == want.logprobs
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["mixtral"])
@pytest.mark.parametrize("offloaded", [False, True])
def test_loading_a_store_opens_it_once(model_store, offloaded, monkeypatch):
    """Model, tokenizer and (offloaded) ring read the one open store handed down to them."""
    arch, store, expert_bytes, biggest, want = model_store
    opened = record_store_opens(monkeypatch)
    engine = Engine.load(store.root, EngineConfig(cpu_cache_bytes=expert_bytes + biggest if offloaded else None))
    try:
        assert opened == [store.root]
        assert (engine.offload is not None) == offloaded
        assert engine.generate(PROMPT, SamplingConfig(max_new_tokens=8)).tokens == want.tokens[:8]
    finally:
        engine.close()


@ON_OLDER_ARCHS
def test_small_cache_reads_more_than_a_full_one(model_store):
    arch, store, expert_bytes, biggest, want = model_store
    read = {}
    for name, budget in (("full", expert_bytes + biggest), ("quarter", expert_bytes // 4)):
        engine = Engine.load(store.root, EngineConfig(cpu_cache_bytes=budget, preload=False))
        try:
            engine.generate(PROMPT, SamplingConfig(max_new_tokens=16))  # the same request warms the cache
            read[name] = engine.generate(PROMPT, SamplingConfig(max_new_tokens=16)).stats["ssd_bytes_per_token"]
        finally:
            engine.close()
    assert read["full"] == 0  # every expert the request needs stayed in the CPU cache
    assert read["quarter"] > 0


def test_corrupt_expert_fails_the_request_and_names_the_tensor(tmp_path):
    hf = make_hf_checkpoint("mixtral", tmp_path / "hf", seed=1)
    store = import_checkpoint(str(hf), str(tmp_path / "store"))
    victim = store.manifest.chunk_tensors(store.manifest.chunk(1, 2))[0]
    with open(store.path(victim.file), "r+b") as f:
        f.seek(victim.offset)
        f.write(b"\xff\xff\xff\xff")
    engine = Engine.load(store.root, EngineConfig(ring_slots=8, cpu_cache_bytes=10**9, prefetch=False))
    try:
        from storage.errors import CorruptTensorError

        with pytest.raises(CorruptTensorError, match=victim.name.replace(".", r"\.")):
            for start in range(0, 90, 3):  # some prompt routes to the broken expert
                engine.generate([start, start + 1, start + 2], SamplingConfig(max_new_tokens=4))
    finally:
        engine.close()
    torch.manual_seed(0)


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_generate_cli_offloaded_json_has_stats_and_resident_tokens(tmp_path):
    """`semoe generate --cpu-cache SIZE` alone on CPU decodes in the torch-free runner with that cache
    (stderr says so); with an engine flag beside it, or another budget flag, the engine's offloaded
    path. Every way gives the resident greedy tokens, and logprobs within 1e-6 of the resident engine's:
    the runner takes the log-softmax in float64 (the engine in float32), and the offloaded engine runs
    the prompt through the model's modules where the resident one runs the C prompt pass, so the first
    logprob carries torch's matmul summation order, which differs by CPU (5e-7 on an AMD Zen 4)."""
    import json
    import subprocess
    import sys

    hf = make_hf_checkpoint("olmoe", tmp_path / "hf", seed=2)
    store = import_checkpoint(str(hf), str(tmp_path / "store"))

    def run(*flags):
        res = subprocess.run([sys.executable, "-m", "tools.cli", "generate", "--model", store.root, "--prompt-ids",
                              "4,8,15,16,23,42", "--max-new-tokens", "12", "--ignore-eos", "--device", "cpu", "--json",
                              *flags], capture_output=True, text=True, env=child_env(), cwd=ROOT)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout), res.stderr

    resident, _ = run()
    assert "stats" not in resident
    for flags in (["--cpu-cache", "25%", "--cache-policy", "lfu"], ["--cpu-cache", "50%", "--ring-slots", "2"],
                  ["--device-memory", "1MiB"]):
        out, err = run(*flags)
        assert "without torch" not in err
        assert out["tokens"] == resident["tokens"]
        assert out["logprobs"] == pytest.approx(resident["logprobs"], rel=1e-6, abs=1e-6)
        assert sorted(out["stats"]) == sorted(["ring_hit_rate", "cpu_hit_rate", "ssd_bytes_per_token",
                                               "device_copy_bytes_per_token", "ideal_bytes_per_token",
                                               "prefetch_precision", "prefetch_recall", "cpu_cache_bytes",
                                              "peak_rss_bytes"])
    expert_bytes = StoreReader.open(store.root).manifest.expert_bytes()
    for size, cache in (("25%", expert_bytes // 4), ("auto", None)):
        out, err = run("--cpu-cache", size)
        assert f"sized as --cpu-cache {size} asks" in err and "decoding in a process without torch" in err, err
        assert out["tokens"] == resident["tokens"]
        assert out["logprobs"] == pytest.approx(resident["logprobs"], rel=1e-6, abs=1e-6)
        if cache is not None:  # slots of whole experts within the named bytes, less the dense weights it maps
            assert 0 < out["stats"]["cache_slots"] * StoreReader.open(store.root).manifest.chunks[0].bytes <= cache


@ON_OLDER_ARCHS
def test_speculative_reads_follow_the_precision_threshold(model_store):
    arch, store, expert_bytes, biggest, want = model_store
    read, total = {}, {}
    for name, threshold in (("never", 2.0), ("always", 0.0)):
        engine = Engine.load(store.root, EngineConfig(cpu_cache_bytes=expert_bytes // 4, preload=False,
                                                      speculate_min_precision=threshold))
        try:
            res = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
            assert res.tokens == want.tokens and res.logprobs == want.logprobs
            read[name] = res.stats
            total[name] = engine.offload.tier.stats().ssd_bytes  # every read since the engine loaded
        finally:
            engine.close()
    # An independent floor on the bytes read: the resident model's own routing (router hooks, no ring
    # involved) names the experts the request uses; the cache starts empty (no preload), so each of
    # them is read from the store at least once, and the tier's count must reach their chunk bytes.
    # (The tier's total, not the request's: the idle fill at the request's start may read some of
    # them before its counters start.)
    used = _routed_experts(store, want)
    floor = sum(c.bytes for c in store.manifest.chunks if (c.layer, c.expert) in used)
    for name in read:
        assert total[name] >= floor > 0, name
    # guesses read ahead are waiting in the ring when the layer asks for them
    assert read["always"]["ring_hit_rate"] > read["never"]["ring_hit_rate"]


def _routed_experts(store, want: GenerationResult) -> set[tuple[int, int]]:
    """(layer, expert) pairs the resident model routes to while it generates `want` after PROMPT."""
    engine = Engine.load(store.root, EngineConfig())
    used: set[tuple[int, int]] = set()
    hooks = [ffn.router.register_forward_hook(
        lambda mod, args, out, layer=ffn.layer: used.update((layer, int(e)) for e in out.ids_TK.flatten()))
        for ffn in engine.model.moe_layers()]
    try:
        assert engine.offload is None  # resident: every expert in memory, no ring
        assert engine.generate(PROMPT, SamplingConfig(max_new_tokens=24)).tokens == want.tokens
    finally:
        for h in hooks:
            h.remove()
        engine.close()
    return used


@ON_OLDER_ARCHS
def test_preload_fills_the_cache_up_to_its_budget(model_store):
    arch, store, expert_bytes, biggest, want = model_store
    engine = Engine.load(store.root, EngineConfig(cpu_cache_bytes=expert_bytes + biggest))
    try:
        tier = engine.offload.tier
        assert tier.cache.used_bytes == expert_bytes  # every expert, before the first request
        res = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
        assert res.tokens == want.tokens and res.stats["ssd_bytes_per_token"] == 0
    finally:
        engine.close()


@ON_OLDER_ARCHS
def test_in_place_cache_hits_fill_on_the_calling_thread_and_reuse_their_weights(model_store):
    """In place, an expert the CPU cache holds takes its ring slot on the decoding thread: with
    every expert cached and nothing guessed, no fill goes through the worker queue. The weights
    built on a cache entry are handed out again while the entry lives, not rebuilt per use."""
    _, store, expert_bytes, biggest, want = model_store
    experts = max(c.expert for c in store.manifest.chunks) + 1  # a slot for each of a layer's experts: the prompt
    engine = Engine.load(store.root, EngineConfig(cpu_cache_bytes=expert_bytes + biggest, ring_slots=experts,
                                                  prefetch=False))
    try:
        ring = engine.offload
        assert ring.in_place
        handed: dict = {}
        stream = ring.stream

        def spy(layer, experts, x):
            for e, w in stream(layer, experts, x):
                handed.setdefault((layer, e), set()).add(id(w))
                yield e, w

        ring.stream = spy  # the instance attribute is what the layers call
        submitted = ring.queue.stats.submitted
        res = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
        assert res.tokens == want.tokens and res.logprobs == want.logprobs
        assert ring.queue.stats.submitted == submitted  # every fill ran on this thread
        assert handed  # the spy saw the request's experts
        # every expert, however often the request used it, got the very same weights object
        assert all(len(ids) == 1 for ids in handed.values()), {k: len(v) for k, v in handed.items()}
    finally:
        engine.close()


@pytest.mark.parametrize("threshold", [2.0, 0.0], ids=["no-guesses", "guesses"])
@ON_OLDER_ARCHS
def test_cache_policy_sees_every_use_once(model_store, threshold):
    """Uses served from a ring slot (kept across tokens, or filled by a right guess) never pass a
    CPU-cache lookup; the cache's policy must still count them, or it ranks the experts in use as
    unused and evicts them. A use counted twice would skew it the other way."""
    arch, store, expert_bytes, biggest, want = model_store
    engine = Engine.load(store.root, EngineConfig(cpu_cache_bytes=expert_bytes // 4, preload=False,
                                                  speculate_min_precision=threshold))
    try:
        policy = engine.offload.tier.cache.policy
        seen = []
        original = policy.on_access
        policy.on_access = lambda key: (seen.append(key[:2]), original(key))[1]
        res = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
        assert res.tokens == want.tokens
        counters = engine.offload.counters
        assert counters.ring_hits > 0  # the case this is about happened
        assert len(seen) == counters.uses
    finally:
        engine.close()


@ON_OLDER_ARCHS
def test_routing_replay_predicts_every_expert_and_changes_no_number(model_store):
    """A replay of the request's recorded routing is a perfect next-layer predictor (the ceiling the
    benchmark reports); the tokens stay the resident model's. A record that does not match stops
    the predictions instead of steering reads wrongly for the rest of the request."""
    from inference.offload.ring_bookkeeping import RoutingReplay

    arch, store, expert_bytes, biggest, want = model_store
    config = EngineConfig(cpu_cache_bytes=expert_bytes // 4, preload=False)
    engine = Engine.load(store.root, config)
    try:
        engine.offload.replay = RoutingReplay()
        engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
        visits = engine.offload.replay.visits
    finally:
        engine.close()
    moe_layers = len(engine.model.moe_layers())
    assert len(visits) == 24 * moe_layers  # the prompt's pass, then one per generated token but the last
    for record, diverges in ((visits, False), (visits[:5] + [(visits[5][0], [])] + visits[6:], True)):
        engine = Engine.load(store.root, config)
        try:
            engine.offload.replay = RoutingReplay(record)
            res = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
            assert res.tokens == want.tokens and res.logprobs == want.logprobs
            assert engine.offload.replay.diverged == diverges
            if not diverges:
                assert res.stats["prefetch_precision"] == 1.0 and res.stats["prefetch_recall"] == 1.0
        finally:
            engine.close()


# -- the copying ring: the GPU's path, run on CPU ------------------------------------------------

LOGPROB_ATOL = 1e-6  # the ring casts bfloat16 to float32 exactly, so this is equality up to noise


# The older three and the two newer layouts that differ most: gpt-oss's fused experts with biases
# (four tensors a slot) and DeepSeek-V3's shared experts behind a dense first layer.
COPYING_ARCHS = OLDER_ARCHS + ["gpt_oss", "deepseek_v3"]


@pytest.fixture(scope="module")
def _bfloat16_stores(tmp_path_factory):
    def make(arch):
        root = tmp_path_factory.mktemp(f"offload-bf16-{arch}")
        hf = make_hf_checkpoint(arch, root / "hf", seed=7)
        store = import_checkpoint(str(hf), str(root / "store"), dtype="bfloat16")
        return arch, store, _answer(Engine.load(store.root, EngineConfig(dtype="float32")))

    return functools.cache(make)


@pytest.fixture
def bf16_store(arch, _bfloat16_stores):
    """A bfloat16 store of `arch` and what the resident model, loaded from it in float32, generates."""
    return _bfloat16_stores(arch)


def _assert_same(got, want) -> None:
    assert got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=LOGPROB_ATOL, rel=0)


@pytest.mark.parametrize("slots", [2, 3, 6])
@pytest.mark.parametrize("arch", COPYING_ARCHS)
def test_copying_ring_serves_a_bfloat16_store_in_float32_like_the_resident_model(bf16_store, slots):
    arch, store, want = bf16_store
    config = EngineConfig(dtype="float32", device_memory_bytes=slots * _slot_bytes(store),
                          cpu_cache_bytes=sum(c.bytes for c in store.manifest.chunks) // 2)
    engine = Engine.load(store.root, config)
    try:
        assert engine.offload.copies and engine.offload.ring_slots == slots
        got = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
        _assert_same(got, want)
        assert got.stats["device_copy_bytes_per_token"] > 0
    finally:
        engine.close()


@pytest.mark.parametrize("arch", COPYING_ARCHS)
def test_fake_cuda_stream_finds_no_hazard_and_compute_never_waits_on_the_host(bf16_store):
    """Copies delayed and reordered at random, destinations poisoned at issue, sources checked
    twice, queued compute modelled by late events: the tokens stay the resident model's, no copy
    broke the stream contract, and only the copy workers ever block on a copy."""
    from storage.streams import FakeCudaCopyStream, copy_stream_factory

    arch, store, want = bf16_store
    config = EngineConfig(dtype="float32", device_memory_bytes=3 * _slot_bytes(store),
                          cpu_cache_bytes=sum(c.bytes for c in store.manifest.chunks) // 2)
    with copy_stream_factory(lambda device: FakeCudaCopyStream(device, seed=3)) as made:
        engine = Engine.load(store.root, config)
        try:
            got = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
        finally:
            engine.close()
    (stream,) = made
    _assert_same(got, want)
    assert stream.violations == []
    assert stream.copies > 0
    assert stream.syncs_by_thread[threading.main_thread().name] == 0


@pytest.mark.parametrize("arch", COPYING_ARCHS)
@needs_kernels  # the counts are those of the decode plan's steps, which run on the kernels
def test_host_syncs_per_decode_step_are_the_resident_models_plus_one_per_moe_layer(bf16_store, monkeypatch):
    """The ring adds one host read per MoE layer (the next layer's predicted experts, read right
    after the layer's own dispatch has synchronised); the copies add none; the embedding left in the
    store one per forward (its ids pick the rows to read). The resident model compared steps kernel
    by kernel, as an offloaded one must (its experts arrive during the step); its one-call step
    (`decode_step`) reads nothing back per layer."""
    from semoe.decode.plan import DecodePlan
    from semoe.decode.support import one_call_refusal
    from storage.host_sync_counter import HostSyncCounter

    arch, store, want = bf16_store
    new_tokens = 8
    counts = {}
    engine = Engine.load(store.root, EngineConfig(dtype="float32"))
    try:
        with HostSyncCounter() as syncs:
            engine.generate(PROMPT, SamplingConfig(max_new_tokens=new_tokens))
        counts["resident-one-call"] = syncs.total
        one_call = engine._plan is not None and engine._plan.net is not None  # the one-call step's models
    finally:
        engine.close()
    init = DecodePlan.__init__
    monkeypatch.setattr(DecodePlan, "__init__", lambda self, model, whole=True: init(self, model, whole=False))
    for name, config in (("resident", EngineConfig(dtype="float32")),
                         ("ring", EngineConfig(dtype="float32", device_memory_bytes=3 * _slot_bytes(store),
                                               prefetch=True)),
                         ("ring-no-prefetch", EngineConfig(dtype="float32", device_memory_bytes=3 * _slot_bytes(store),
                                                           prefetch=False))):
        engine = Engine.load(store.root, config)
        try:
            with HostSyncCounter() as syncs:
                engine.generate(PROMPT, SamplingConfig(max_new_tokens=new_tokens))
            counts[name] = syncs.total
        finally:
            engine.close()
    moe_layers = len(engine.model.moe_layers())
    forwards = new_tokens  # the prompt's pass, then one per generated token but the last
    predicting = moe_layers - 1  # the last MoE layer has no next layer to predict
    assert counts["ring-no-prefetch"] == counts["resident"] + forwards
    if one_call:
        assert counts["resident-one-call"] <= counts["resident"] - (forwards - 1) * moe_layers
    else:
        assert counts["resident-one-call"] == counts["resident"]
    assert one_call == (one_call_refusal(engine.model.config) is None)
    assert counts["ring"] - counts["resident"] == forwards * predicting + forwards


def test_default_compute_dtype_on_cuda_is_bfloat16():
    assert EngineConfig(device="cuda").dtype == "bfloat16"
    assert EngineConfig(device="cpu").dtype == "float32"


def test_a_needed_expert_waits_for_read_ahead_that_fills_the_cache(tmp_path, monkeypatch):
    """Reads ahead of use (the request's idle warm-up) held back until they hold the whole CPU
    cache while still loading: the first needed expert waits for them to land instead of failing
    with CacheFullError (the held reads go on only once it waits), and the answer is the resident
    one."""
    from storage.cache import ExpertCache
    from storage.tiered_experts import TieredExpertStore

    hf = make_hf_checkpoint("deepseek_v3", tmp_path / "hf", seed=5)
    store = import_checkpoint(str(hf), str(tmp_path / "store"))
    resident = Engine.load(str(hf), EngineConfig())
    try:
        want = resident.generate(PROMPT, SamplingConfig(max_new_tokens=4))
    finally:
        resident.close()
    gate, waited = threading.Event(), []
    job = TieredExpertStore._prefetch_job
    monkeypatch.setattr(TieredExpertStore, "_prefetch_job",
                        lambda self, key, chunk: (gate.wait(60), job(self, key, chunk))[1])
    wait_for_room = ExpertCache.wait_for_room

    def waiting(self, nbytes, timeout=None, **kw):  # a needed expert waits for room: let the reads land
        waited.append(nbytes)
        gate.set()
        return wait_for_room(self, nbytes, timeout, **kw)

    monkeypatch.setattr(ExpertCache, "wait_for_room", waiting)
    expert_bytes = sum(c.bytes for c in store.manifest.chunks)
    engine = Engine.load(store.root, EngineConfig(cpu_cache_bytes=expert_bytes // 4, ring_slots=2, preload=False))
    try:
        got = engine.generate(PROMPT, SamplingConfig(max_new_tokens=4))
    finally:
        gate.set()
        engine.close()
    assert waited  # the path under test ran: a needed expert found the cache full of reads in flight
    # resident: the whole step in one call; offloaded: kernel by kernel (the same kernels, the routers'
    # softmax and the attention's sums in another order): log-probs within float32 rounding
    assert got.tokens == want.tokens and got.logprobs == pytest.approx(want.logprobs, rel=0, abs=1e-5)


def test_a_copying_ring_gets_a_cpu_cache_that_holds_one_expert_per_slot(tmp_path):
    """Each slot's source stays pinned in the CPU cache until its copy lands: a cache smaller than the
    ring is raised to one expert per slot (it used to fail mid-request with CacheFullError)."""
    hf = make_hf_checkpoint("qwen3_moe", tmp_path / "hf", seed=7)
    store = import_checkpoint(str(hf), str(tmp_path / "store"), dtype="bfloat16")
    resident = Engine.load(store.root, EngineConfig(dtype="float32"))
    try:
        want = resident.generate(PROMPT, SamplingConfig(max_new_tokens=12))
    finally:
        resident.close()
    chunk = max(c.bytes for c in store.manifest.chunks)
    engine = Engine.load(store.root, EngineConfig(dtype="float32", device_memory_bytes=3 * _slot_bytes(store),
                                                  cpu_cache_bytes=2 * chunk))
    try:
        assert engine.offload.copies and engine.offload.ring_slots == 3
        assert engine.offload.tier.cache.capacity_bytes >= 3 * chunk
        _assert_same(engine.generate(PROMPT, SamplingConfig(max_new_tokens=12)), want)
    finally:
        engine.close()
