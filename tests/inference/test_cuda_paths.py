"""The CUDA paths, run on a GPU machine: `bash tools/run.sh test -m cuda` (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from storage.streams import CudaCopyStream, make_copy_stream

pytestmark = pytest.mark.cuda


def test_copy_stream_round_trips_a_pinned_tensor():
    src = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    with make_copy_stream("cuda") as stream:
        assert isinstance(stream, CudaCopyStream)
        on_device = stream.copy_to_device(src).wait()
        assert on_device.is_cuda
        back = on_device.to("cpu")  # on the compute stream, ordered after the copy by wait()
    torch.testing.assert_close(back, src, rtol=0, atol=0)


@pytest.fixture(scope="module")
def bf16_store(tmp_path_factory):
    from helpers.hf_models import make_hf_checkpoint

    from semoe.checkpoints.hf_convert import import_checkpoint

    root = tmp_path_factory.mktemp("cuda-offload")
    hf = make_hf_checkpoint("mixtral", root / "hf", seed=7)
    return import_checkpoint(str(hf), str(root / "store"), dtype="bfloat16")


PROMPT = [3, 17, 5, 29, 11, 2, 40, 8, 19, 23]


def _resident(store, dtype: str, cfg):
    """What the resident model generates on the GPU after PROMPT, and its config."""
    from inference.engine import Engine
    from inference.engine_config import EngineConfig

    resident = Engine.load(store.root, EngineConfig(device="cuda", dtype=dtype))
    try:
        return resident.generate(PROMPT, cfg), resident.model.config
    finally:
        resident.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offloaded_generation_on_cuda_equals_resident_cuda(bf16_store, dtype):
    """The ring on a GPU: slots in device memory, copies on the copy stream from pinned CPU-cache
    buffers, compute ordered by events; the same tokens as the resident model on the same GPU.
    Log-probs within 1e-5 (float32) / 2e-2 (bfloat16): the same kernels, but cuBLAS may pick
    another algorithm for a weight that is a slot view rather than a parameter."""
    from inference.engine import Engine
    from inference.engine_config import EngineConfig
    from inference.offload.expert_ring import OffloadedExperts
    from semoe.decode.loop import SamplingConfig

    prompt, cfg = PROMPT, SamplingConfig(max_new_tokens=24)
    want, config = _resident(bf16_store, dtype, cfg)
    slot = OffloadedExperts.slot_bytes(bf16_store, getattr(torch, dtype))
    for budget in (dict(device_memory_bytes=3 * slot), dict(ring_slots=2, cpu_cache_bytes=4 * slot)):
        engine = Engine.load(bf16_store.root, EngineConfig(device="cuda", dtype=dtype, experts_on="device", **budget))
        try:
            assert engine.offload.copies and engine.offload.tier.pool.pinned_bytes > 0
            got = engine.generate(prompt, cfg)
        finally:
            engine.close()
        assert got.tokens == want.tokens
        tol = 1e-5 if dtype == "float32" else 2e-2
        assert got.logprobs == pytest.approx(want.logprobs, abs=tol, rel=0)
        assert got.stats["device_copy_bytes_per_token"] > 0



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["hybrid", "cpu"])
def test_hybrid_generation_on_cuda_equals_resident_cuda(bf16_store, dtype, mode):
    """Hybrid decode on a GPU (the default for an offloaded engine there): the CPU's share crosses to
    pinned host memory on the copy stream and back, computed by semoe's kernels on the bfloat16 experts
    as stored, while the GPU computes its own; the resident model's tokens on the same GPU. Rates that
    put one decoding row on the CPU and a prompt's several rows on the GPU, so both sides run. Log-probs
    within 1e-4 (float32: the CPU kernels' sums against cuBLAS's) / 2e-2 (bfloat16)."""
    from inference.engine import Engine
    from inference.engine_config import EngineConfig
    from inference.offload.expert_ring import OffloadedExperts
    from inference.offload.hybrid_placement import HybridRates
    from semoe.decode.loop import SamplingConfig

    prompt, cfg = PROMPT, SamplingConfig(max_new_tokens=24)
    want, config = _resident(bf16_store, dtype, cfg)
    slot = OffloadedExperts.slot_bytes(bf16_store, getattr(torch, dtype))
    c = config
    T, flops = 1e-3, 6 * c.hidden_size * c.moe_ffn_size
    rates = HybridRates(h2d_bytes_s=slot / (1.5 * T), cpu_bytes_s=1e30, cpu_flops_s=flops / T, device_bytes_s=1e30,
                        device_flops_s=1e30)
    engine = Engine.load(bf16_store.root, EngineConfig(device="cuda", dtype=dtype, device_memory_bytes=3 * slot,
                                                       cpu_cache_bytes=8 * slot, experts_on=mode, hybrid_rates=rates))
    try:
        assert engine.decode_path().startswith("hybrid decode: dense and attention on cuda")
        assert engine.offload.tier.pool.pinned_bytes > 0
        got = engine.generate(prompt, cfg)
    finally:
        engine.close()
    assert got.tokens == want.tokens
    tol = 1e-4 if dtype == "float32" else 2e-2
    assert got.logprobs == pytest.approx(want.logprobs, abs=tol, rel=0)
    h = got.stats["hybrid"]
    assert h["cpu_share"] > 0 and (mode == "cpu" or h["device_copy_share"] > 0)


def test_hybrid_measures_its_rates_on_the_gpu(bf16_store):
    """At load, with no rates given: the link, the CPU's kernels and the GPU, each positive; the link's
    from a 32 MiB pinned copy, above 1 GB/s on any PCIe (the tiny model's experts time launches, not
    bytes, on the other sides)."""
    from inference.engine import Engine
    from inference.engine_config import EngineConfig

    engine = Engine.load(bf16_store.root, EngineConfig(device="cuda", cpu_cache_bytes=1 << 30))
    try:
        r = engine.offload.rates
        assert r.h2d_bytes_s > 1e9 and min(r.cpu_bytes_s, r.cpu_flops_s, r.device_bytes_s, r.device_flops_s) > 0
    finally:
        engine.close()


@pytest.mark.parametrize("bits", [8, 4])
def test_offloaded_compact_experts_on_cuda_equal_resident_cuda(tmp_path, bits):
    """Compact (int8/int4) experts on a GPU: the ring copies codes and scales as stored into its slots,
    and each weight is dequantized into a scratch tensor for its product; the resident model holds the
    same placed bytes, so the tokens are the same."""
    import transformers

    from inference.engine import Engine
    from inference.engine_config import EngineConfig
    from inference.offload.expert_ring import OffloadedExperts
    from semoe.decode.loop import SamplingConfig
    from semoe.checkpoints.hf_convert import import_checkpoint
    from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store
    from storage.store import Store

    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "hf"))
    import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "f32"))
    quantize_store(str(tmp_path / "f32"), str(tmp_path / "q"), QuantizeConfig(bits=bits, group_size=64))
    prompt, sampling = [3, 17, 5, 29, 11, 2, 40, 8, 19, 23], SamplingConfig(max_new_tokens=16)
    resident = Engine.load(str(tmp_path / "q"), EngineConfig(device="cuda", dtype="float32"))
    try:
        want = resident.generate(prompt, sampling)
    finally:
        resident.close()
    slot = OffloadedExperts.slot_bytes(Store.open(str(tmp_path / "q")), torch.float32)
    engine = Engine.load(str(tmp_path / "q"), EngineConfig(device="cuda", dtype="float32", experts_on="device",
                                                           device_memory_bytes=3 * slot))
    try:
        got = engine.generate(prompt, sampling)
    finally:
        engine.close()
    assert got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5, rel=0)
