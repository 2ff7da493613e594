"""The torch-free runner (`inference.torch_free.runner`) against the engine's one-call decoding step.

The models are Mixtral checkpoints written by transformers, imported into stores (float32 experts)
and quantized (`store quantize`, int8 and int4). The runner computes with the same kernels as the
engine's one-call step (`DecodePlan`'s `decode_step`) on the same weights, so fed the engine's
rotary tables its logits are the step's bit for bit, at every precision and cache size. With its
own tables (numpy's cos and sin, which may differ from torch's in the last bit) a float32 model
gives the engine's greedy tokens, and log-probs within LOGPROB_ATOL: the last bit of a rotary
table moves a logit by about 1e-7 here, and the engine's prompt goes through batched products
(another order of the same sums, about 1e-6); 1e-4 still catches a wrong weight, scale or position,
which move log-probs by 1e-2 or more. (int8 and int4 experts quantize each layer's input in blocks;
there a last-bit change of the input can move one code, so only the bit-for-bit test above covers
them.)
"""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc

import numpy as np
import pytest
import torch

from helpers.hf_models import add_word_tokenizer
from helpers.kernels import needs_kernels
from inference.engine import Engine
from inference.engine_config import EngineConfig
from inference.torch_free.runner import LeanConfig, LeanModel, dense_load_bytes
from inference.torch_free.sequence_memory import KV16_SHARE, auto_kv_cache, sequence_bytes, sequence_parts
from inference.torch_free.prompt_prefill import prefill
from storage.numpy_codecs import quantize_int8_rows
from semoe.model.attention import KVCache, rope_tables
from semoe.checkpoints.model_io import load_store
from semoe.decode.loop import SamplingConfig
from semoe.decode.plan import DecodePlan
from semoe.decode.support import NotOnFastPath
from semoe.checkpoints.hf_convert import import_checkpoint
from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store
from storage.errors import BadInputError, CorruptTensorError, NotAStoreError
from storage.keys import ExpertKey
from storage.quant import quantize
from storage.reader import StoreReader
from tools.cli import main

pytestmark = needs_kernels

PROMPT = [3, 17, 5, 29, 11, 2, 40, 8]
TOKENS = [1, 7, 61, 23, 4, 90, 12, 33, 5, 71, 18, 2, 44, 9, 60, 31]
LOGPROB_ATOL = 1e-4
PREFILL_RTOL = 1e-5  # float32 sums in another order, through a few layers (measured: at most 7e-7)
KV16_RTOL = 1e-3  # a float16 KV cache's logits against a float32 one's, relative to the largest (measured: 4.1e-5)



def _stacked(seq, i: int) -> np.ndarray:
    """A sequence's keys (i = 0) or values (1), every layer's stacked."""
    return np.stack([kv[i] for kv in seq.caches])

def expert_bytes(store: str) -> int:
    return StoreReader.open(store).manifest.expert_bytes()


def _hf_mixtral(path):
    """A Mixtral of 3 layers, 4 experts (top 2), hidden 64, expert FFN 128 (int4 takes rows in blocks
    of 64), with a word tokenizer; saved by transformers."""
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, bos_token_id=1,
                                     eos_token_id=2)
    torch.manual_seed(3)
    model = transformers.MixtralForCausalLM(cfg)
    model.save_pretrained(str(path))
    add_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """bits -> a store of the checkpoint (32: float32 experts; 8, 4: quantized)."""
    root = tmp_path_factory.mktemp("lean")
    import_checkpoint(str(_hf_mixtral(root / "hf")), str(root / "f32"))
    paths = {32: str(root / "f32")}
    for bits in (8, 4):
        quantize_store(paths[32], str(root / f"int{bits}"), QuantizeConfig(bits=bits, group_size=64))
        paths[bits] = str(root / f"int{bits}")
    return paths


def _engine_rope(config):
    def rope(pos, cos, sin):
        c, s = rope_tables(config, torch.arange(pos, pos + 1)[None], torch.float32)
        cos[:], sin[:] = c.numpy().ravel(), s.numpy().ravel()
    return rope


@pytest.mark.parametrize("bits", [32, 8, 4])
@pytest.mark.parametrize("dense", ["float", "int8"])
@pytest.mark.parametrize("cache", ["every expert", "top_k + 1 experts", "top_k experts"])
def test_with_the_engines_rotary_tables_the_logits_are_the_one_call_steps_bits(stores, bits, dense, cache):
    """TOKENS stepped from position 0 through the engine's one-call step and through the runner: equal
    logits at every step. The smallest cache (top_k slots) evicts and reads at nearly every layer; with
    one slot more, layers find one chosen expert cached and read the other, and compute the first
    while the second is read (`decode_experts` in two calls, then `decode_ffn_done`): the same bits."""
    model = load_store(stores[bits], dense=dense)
    plan = DecodePlan(model)
    assert plan.net is not None
    kv = KVCache.empty(model.config, 1, len(TOKENS))
    chunk = -(-expert_bytes(stores[bits]) // (4 * 3) // 4096) * 4096  # a slot: one chunk, page-aligned
    size = {"every expert": expert_bytes(stores[bits]), "top_k + 1 experts": 3 * chunk, "top_k experts": 0}[cache]
    with LeanModel(stores[bits], LeanConfig(cache_bytes=size, dense=dense)) as lean, \
            lean.sequence(len(TOKENS)) as seq:
        lean.rope = _engine_rope(model.config)
        for t in TOKENS:
            want = plan.step(t, kv)[0].numpy()
            got = seq.step(t)
            np.testing.assert_array_equal(got, want)
        if cache == "every expert":
            assert lean.cache.n == 4 * 3 and lean.cache.misses <= 4 * 3  # each chunk read once at most
        else:
            assert lean.cache.n == {"top_k + 1 experts": 3, "top_k experts": 2}[cache]
            assert lean.cache.misses > 4 * 3
        if cache == "top_k + 1 experts":  # (two slots hold the last layer's pair: a layer finds neither)
            assert lean.computed_while_reading > 0  # the path under test was taken


def test_its_own_tables_give_the_engines_greedy_tokens(stores):
    """A float32 model, the prompt through the engine's batched prefill and through the runner's step
    token by token: the same 24 greedy tokens, log-probs within LOGPROB_ATOL."""
    engine = Engine.load(stores[32], EngineConfig())
    try:
        want = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24))
    finally:
        engine.close()
    with LeanModel(stores[32], LeanConfig(cache_bytes=0)) as lean:
        got = lean.generate(PROMPT, SamplingConfig(max_new_tokens=24))
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_both_front_ends_stop_on_the_same_ids_when_eos_is_reached(stores, tmp_path):
    """A checkpoint whose config names as its EOS a token the model does generate, and whose tokenizer
    names another: the engine and the torch-free runner take the same stop ids (the config's first),
    and both stop right after generating it."""
    engine = Engine.load(stores[32], EngineConfig())
    try:
        free = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24)).tokens  # no stop ids: all 24
        tokenizer_eos = engine.tokenizer.eos_id
    finally:
        engine.close()
    i, eos = next((i, t) for i, t in enumerate(free) if i >= 3 and t not in free[:i] and t != tokenizer_eos)
    hf = tmp_path / "hf"
    shutil.copytree(os.path.join(os.path.dirname(stores[32]), "hf"), hf)
    config = json.loads((hf / "config.json").read_text())
    config["eos_token_id"] = eos
    (hf / "config.json").write_text(json.dumps(config))
    store = str(tmp_path / "store")
    import_checkpoint(str(hf), store)
    engine = Engine.load(store, EngineConfig())
    try:
        stop = engine.stop_ids()
        want = engine.generate(PROMPT, SamplingConfig(max_new_tokens=24, stop_ids=stop)).tokens
    finally:
        engine.close()
    assert stop == (eos,) and want == free[:i + 1]  # stopped on reaching it
    with LeanModel(store, LeanConfig(cache_bytes=0)) as lean:
        assert lean.stop_ids() == stop
        assert lean.generate(PROMPT, SamplingConfig(max_new_tokens=24, stop_ids=lean.stop_ids())).tokens == want


@pytest.mark.parametrize("shape", [(7, 33), (130, 1), (64, 256)])
def test_int8_quantization_is_storage_quants_bits(shape):
    """Odd shapes, a row of zeros, a row of one repeated value and one of halves (ties round to even)."""
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=g) * 0.3
    w[0] = 0.0
    w[-1] = 0.25
    if shape[1] > 2:
        w[1, :3] = torch.tensor([127.0, 63.5, -0.5])
    codes, scales = quantize(w, "int8")
    got_codes, got_scales = quantize_int8_rows(w.numpy())
    np.testing.assert_array_equal(got_codes, codes.numpy())
    np.testing.assert_array_equal(got_scales, scales.numpy())


@pytest.mark.parametrize("rows, r0, block", [(64, 0, (16, 16)), (40, 24, (16, 8)), (7, 128, (128, 128))])
def test_fp8_dequantization_is_the_engines_bits(rows, r0, block):
    """FP8 rows read from row r0 on, every code among them (subnormals, zeros of both signs, the
    largest), dequantized to bfloat16 by numpy: `storage.dequant`'s bits (one float32 product
    rounded to nearest even), the block scales taken from the rows' own place in the weight."""
    from storage.dequant import dequantize_fp8_blocks
    from storage.numpy_codecs import fp8_bf16_rows

    g = torch.Generator().manual_seed(rows)
    O, I = r0 + rows, 256
    codes = torch.randint(0, 256, (O, I), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # e4m3fn's NaN codes: no weight holds one
    codes[r0, :2] = torch.tensor([0x00, 0x80], dtype=torch.uint8)
    scales = torch.rand(-(-O // block[0]), -(-I // block[1]), generator=g) * 3e-3
    want = dequantize_fp8_blocks(codes.view(torch.float8_e4m3fn), scales, block, torch.bfloat16)[r0:]
    got = fp8_bf16_rows(codes[r0:].numpy(), scales.numpy(), r0, block)
    np.testing.assert_array_equal(got, want.view(torch.uint16).numpy())


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_int8_dequantization_is_the_engines_bits(dtype):
    """int8 dense rows (`semoe store quantize`) dequantized by numpy for `--dense float`:
    `storage.quant.dequantize`'s bits, one float32 product rounded once to a bfloat16 model's dtype."""
    from storage.numpy_codecs import int8_rows
    from storage.quant import QuantSpec, dequantize, quantize

    g = torch.Generator().manual_seed(5)
    w = torch.randn(37, 96, generator=g) * 0.02
    codes, scales = quantize(w, "int8")
    want = dequantize(codes, scales, QuantSpec(scheme="int8", dtype=dtype, shape=(37, 96), scales="s")).float()
    np.testing.assert_array_equal(int8_rows(codes.numpy(), scales.numpy(), dtype), want.numpy())


def test_reads_are_counted_and_a_smaller_cache_reads_more(stores):
    with LeanModel(stores[4], LeanConfig(cache_bytes=0)) as small, \
            LeanModel(stores[4], LeanConfig(cache_bytes=expert_bytes(stores[4]))) as full:
        a, b = (m.generate(PROMPT, SamplingConfig(max_new_tokens=16)) for m in (small, full))
        assert a.tokens == b.tokens  # the same weights, whichever slot holds them
        assert a.stats["ssd_bytes"] == a.stats["expert_reads"] * small.slot_bytes
        assert b.stats["expert_reads"] <= 4 * 3 < a.stats["expert_reads"]


def test_every_dense_weight_stored_int8_is_mapped_not_copied(stores):
    """`store quantize` stores the dense linear weights int8; the runner maps every one of them (q, k
    and v as three products rather than one stacked copy), so none takes anonymous memory."""
    store = StoreReader.open(stores[4])
    stored = sum(t.bytes for t in store.manifest.dense() if (t.quant or {}).get("scheme") == "int8")
    with LeanModel(stores[4], LeanConfig(cache_bytes=0)) as lean:
        assert lean.mapped_bytes == stored > 0
        assert all(layer.n_qkv == 3 for layer in lean.layers)


@pytest.mark.parametrize("bits,dense", [(32, "float"), (4, "int8")])
def test_load_progress_counts_every_dense_byte_it_reads(stores, bits, dense):
    """The progress callback's updates sum to `dense_load_bytes` (the bar's total), as the dense weights
    are read as float32 or quantized at load; the embedding, which stays on storage, is not among them."""
    seen = []
    with LeanModel(stores[bits], LeanConfig(cache_bytes=0, dense=dense), progress=seen.append):
        pass
    store = StoreReader.open(stores[bits])
    assert len(seen) > 1 and sum(seen) == dense_load_bytes(store)
    assert dense_load_bytes(store) < sum(t.bytes for t in store.manifest.dense())


def test_a_corrupt_chunk_is_refused_naming_its_tensor(stores, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(stores[8], bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    chunk = next(c for c in manifest["chunks"] if c["layer"] == 0 and c["expert"] == 1)
    name = chunk["tensors"][0][0]
    entry = next(t for t in manifest["tensors"] if t["name"] == name)
    path = bad / chunk["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with LeanModel(str(bad), LeanConfig(cache_bytes=expert_bytes(str(bad)))) as lean:
        slots = lean.cache
        with pytest.raises(CorruptTensorError, match=name.replace(".", r"\.")):
            slots.ensure(0, [0, 1])
        # neither expert stays cached (both were read in one request), and no slot is lost
        assert ExpertKey(0, 1) not in slots.cache and ExpertKey(0, 0) not in slots.cache
        assert len(slots.free) == slots.n and len(slots.cache) == 0
        slots.ensure(0, [0])  # the sound one reads into a slot of its own
        assert ExpertKey(0, 0) in slots.cache and len(slots.free) == slots.n - 1


def test_what_it_does_not_take_is_refused_in_one_line(tmp_path, stores):
    from semoe.checkpoints.model_io import save_store
    from semoe.model.config import MoEConfig
    from semoe.model.moe_gpt import MoEGPT

    # more groups than the compiled router takes (`semoe.decode.support.MAX_GROUPS`)
    config = MoEConfig(arch="glm4_moe", vocab_size=96, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                       ffn_size=128, moe_ffn_size=8, num_experts=257, top_k=1, max_position=64, router="grouped",
                       router_scores="sigmoid", n_group=257, topk_group=1)
    save_store(MoEGPT(config), str(tmp_path / "groups"))
    with pytest.raises(NotOnFastPath, match=r"a grouped router of 257 groups \(at most 256\)") as e:
        LeanModel(str(tmp_path / "groups"), LeanConfig(cache_bytes=0))
    assert "\n" not in str(e.value)
    with pytest.raises(NotAStoreError, match="not a semoe store"):
        LeanModel(str(tmp_path), LeanConfig(cache_bytes=0))


def test_a_cache_under_top_k_is_raised_to_it_with_a_warning_as_the_engines(stores, caplog):
    """One rule for every path (`inference.memory_guard.cpu_cache_size`): a budget under what a step
    may use at once is raised to it and said in one warning; 0 asks for that least quietly."""
    with caplog.at_level("WARNING", logger="inference.memory_guard"):
        with LeanModel(stores[32], LeanConfig(cache_bytes=4096)) as model:
            least = model.config.top_k * model.slot_bytes
            assert model.cache.n == model.config.top_k
        assert [r.getMessage() for r in caplog.records] == [
            f"--cpu-cache 4096 bytes is under the {least} bytes decoding needs (the experts a step may use at "
            f"once); taking {least}"]
        caplog.clear()
        with LeanModel(stores[32], LeanConfig(cache_bytes=0)) as model:
            assert model.cache.n == model.config.top_k
        assert caplog.records == []


def test_a_store_it_cannot_read_as_stored_keeps_the_engine(tmp_path):
    """`semoe generate`'s own choice asks `lean_refusal` first: FP8 experts with scales per
    non-square block, and float16 experts, are not the runner's kernels', so a short memory keeps the
    engine for them; DeepSeek-V3 as published (square tiles) and the same model in float32 are the
    runner's. What the refusal says and what the runner refuses agree."""
    from helpers.hf_models import make_hf_checkpoint
    from helpers.quantized_checkpoints import write_fp8_checkpoint
    from inference.placement import lean_refusal

    hf = make_hf_checkpoint("deepseek_v3", tmp_path / "hf")
    for block in ((16, 16), (16, 8)):
        write_fp8_checkpoint(hf, tmp_path / f"fp8-{block[1]}", block, mtp=False)
        import_checkpoint(str(tmp_path / f"fp8-{block[1]}"), str(tmp_path / f"store-fp8-{block[1]}"))
    import_checkpoint(str(hf), str(tmp_path / "store"))
    why = lean_refusal(str(tmp_path / "store-fp8-8"))
    assert why is not None and "fp8" in why and "[16, 8]" in why and "\n" not in why
    with pytest.raises(NotOnFastPath, match=r"fp8 with scales per \[16, 8\] block"):
        LeanModel(str(tmp_path / "store-fp8-8"), LeanConfig(cache_bytes=0))
    assert lean_refusal(str(tmp_path / "store-fp8-16")) is None
    assert lean_refusal(str(tmp_path / "store")) is None
    import_checkpoint(str(hf), str(tmp_path / "store-f16"), dtype="float16")
    why = lean_refusal(str(tmp_path / "store-f16"))
    assert why is not None and why.startswith("it reads dense weights stored F32, BF16, FP8, int8 or GGUF blocks, not F16")
    with pytest.raises(NotOnFastPath, match="F16"):
        LeanModel(str(tmp_path / "store-f16"), LeanConfig(cache_bytes=0))
    # experts alone in float16 (dense weights it takes): refused by the expert rule, as the runner's
    # chunk reader refuses a scheme outside EXPERT_KINDS
    from types import SimpleNamespace

    from inference.placement import tensor_refusal
    from inference.torch_free.runner import EXPERT_KINDS

    expert = SimpleNamespace(kind="weight", group="expert", dtype="F16", quant=None, name="e")
    assert "F16" not in EXPERT_KINDS and tensor_refusal(expert) == (
        "it reads experts stored F32, BF16, int8, int4, mxfp4, fp8, ggml, not F16 (e)")
    assert lean_refusal(str(hf)) == "it reads stores, not HuggingFace directories"


def test_generate_lean_on_the_command_line(stores, capsys):
    """`semoe generate --lean`: the runner's tokens and text, its counters under --json; the engine's
    own flags are refused with one line naming them."""
    assert main(["generate", "--model", stores[4], "--prompt", "the cat sat", "--max-new-tokens", "6", "--lean",
                 "--cpu-cache", "50%", "--json", "--ignore-eos"]) == 0
    out = json.loads(capsys.readouterr().out)
    with LeanModel(stores[4], LeanConfig(cache_bytes=expert_bytes(stores[4]) // 2)) as lean:
        prompt = lean.tokenizer.encode("the cat sat", add_bos=lean.tokenizer.add_bos_default)
        want = lean.generate(prompt, SamplingConfig(max_new_tokens=6))
        assert out["text"] == lean.tokenizer.decode(want.tokens)
    assert out["tokens"] == want.tokens and out["stats"]["dense"] == "int8"
    assert out["stats"]["cache_slots"] == 6  # half of 12 chunks
    assert main(["generate", "--model", stores[4], "--prompt-ids", "1,2", "--lean", "--profile"]) == 2
    assert "--profile is the engine's" in capsys.readouterr().err


def test_a_model_trained_here_takes_prompt_text_torch_free(tmp_path, capsys):
    """A store of a model trained here (`gpt_moe`, 259 embeddings, no tokenizer.json) takes --prompt
    text in the runner as in the engine: the byte tokenizer encodes it and its end-of-sequence id
    stops both, so `--cpu-cache` alone (the runner) gives the engine's tokens and text."""
    from semoe.checkpoints.model_io import load_model_tokenizer, save_store
    from semoe.checkpoints.tokenizer import ByteTokenizer
    from semoe.model.config import MoEConfig
    from semoe.model.moe_gpt import MoEGPT

    config = MoEConfig(vocab_size=ByteTokenizer.VOCAB_SIZE, hidden_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=2, ffn_size=64, moe_ffn_size=64, num_experts=4, top_k=2, max_position=64)
    torch.manual_seed(5)
    store = str(tmp_path / "store")
    save_store(MoEGPT(config).eval(), store)
    assert isinstance(load_model_tokenizer(store, config), ByteTokenizer)
    args = ["generate", "--model", store, "--prompt", "def main(", "--max-new-tokens", "8", "--json"]
    assert main([*args, "--resident"]) == 0
    engine = json.loads(capsys.readouterr().out)
    assert main([*args, "--cpu-cache", "50%"]) == 0
    captured = capsys.readouterr()
    assert "without torch" in captured.err
    lean = json.loads(captured.out)
    assert lean["tokens"] == engine["tokens"] and lean["text"] == engine["text"]
    with LeanModel(store, LeanConfig(cache_bytes=0)) as model:
        assert isinstance(model.tokenizer, ByteTokenizer) and ByteTokenizer.EOS in model.stop_ids()


def test_the_sampling_distribution_is_the_engines():
    """The torch-free loop's distribution (temperature, then top-p) equals the engine's
    `logits_to_probs` within float32 rounding (1e-6 on probabilities of ~1e-2), tokens the top-p cut
    leaves out included (exactly 0 in both)."""
    from semoe.decode import loop
    from semoe.decode.generate import logits_to_probs

    rng = np.random.default_rng(0)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (0.5, 0.05)):
        logits = rng.normal(size=96).astype(np.float32) * 3
        want = logits_to_probs(torch.from_numpy(logits)[None], temperature, top_p)[0].numpy()
        got = loop.probs(logits, temperature, top_p)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        assert np.array_equal(got == 0, want == 0)


def test_sampling_and_chat_run_torch_free(stores, capsys):
    """Sampled decoding in the torch-free runner: a seed repeats its draws, another seed draws other
    tokens than greedy decoding, and a top-p that keeps only the most likely token is greedy. With
    --chat the command line gives the engine's tokens on CPU (float32, as the runner) for the same conversation."""
    with LeanModel(stores[32], LeanConfig(cache_bytes=None)) as lean:
        greedy = lean.generate(PROMPT, SamplingConfig(max_new_tokens=12)).tokens
        sampled = [lean.generate(PROMPT, SamplingConfig(max_new_tokens=12, greedy=False, temperature=1.5,
                                                        seed=seed)).tokens for seed in (0, 0, 1)]
        narrow = lean.generate(PROMPT, SamplingConfig(max_new_tokens=12, greedy=False, top_p=1e-6, seed=3)).tokens
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2] and greedy not in sampled
    assert narrow == greedy
    outs = []
    for extra in (["--lean"], ["--resident"]):
        assert main(["generate", "--model", stores[32], "--prompt", "the cat", "--chat", "--system", "be brief",
                     "--max-new-tokens", "6", "--ignore-eos", "--json", "--device", "cpu", *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["tokens"] == outs[1]["tokens"] and outs[0]["text"] == outs[1]["text"]


def test_generate_takes_the_torch_free_process_by_itself_where_memory_is_short(stores, capsys, monkeypatch,
                                                                              machine_without_gpu):
    """`semoe generate` with no budget flag: where the model does not fit the memory available, it
    decodes in the torch-free runner, says so in one line, and sizes the runner's cache from the memory
    left (here a third of the experts, less room for the dense weights it maps and for the sequence's
    KV cache and buffers, `sequence_bytes`, which it leaves free); where it fits, or a flag asks for
    what only the engine does (here its cache policy), the engine decodes; `--cpu-cache SIZE` alone takes
    the runner with that cache, fitting or not. The same greedy tokens all four ways."""
    import inference.torch_free.runner
    import inference.memory_guard
    import inference.placement

    store, mb = stores[4], inference.placement.model_bytes(stores[4])
    third = expert_bytes(store) // 3
    keep = sequence_bytes(load_store(store).config, 3, 3 + 8)  # the prompt and the new tokens
    assert keep >= StoreReader.open(store).manifest.chunks[0].bytes  # a cache that ignored it would hold more
    monkeypatch.setattr(inference.memory_guard, "available_ram_bytes", lambda: third + keep + (48 << 20))
    made = []
    init = inference.torch_free.runner.LeanModel.__init__
    monkeypatch.setattr(inference.torch_free.runner.LeanModel, "__init__",
                        lambda self, *a, **k: made.append((a[1].cache_bytes, a[1].keep_bytes)) or init(self, *a, **k))
    args = ["generate", "--model", store, "--prompt-ids", "3,17,5", "--max-new-tokens", "8", "--ignore-eos", "--json"]
    runs = {}
    for name, available, extra in (("short", mb.total // 2, []), ("roomy", 8 * mb.total + (1 << 30), []),
                                   ("engine's flag", mb.total // 2, ["--cache-policy", "lfu"]),
                                   ("named cache", 8 * mb.total + (1 << 30), ["--cpu-cache", "25%"])):
        monkeypatch.setattr(inference.placement, "available_ram_bytes", lambda a=available: a)
        assert main(args + extra) == 0
        out = capsys.readouterr()
        runs[name] = json.loads(out.out), out.err, len(made)
    out, err, lean_runs = runs["short"]
    assert lean_runs == 1 and made[0] == (None, keep) and "decoding in a process without torch" in err
    with LeanModel(store, LeanConfig(cache_bytes=0)) as lean:
        mapped = lean.mapped_bytes
    assert mapped > 0  # the lm_head and o_proj, stored int8 by `store quantize`
    assert out["stats"]["cache_slots"] == (third - mapped) // StoreReader.open(store).manifest.chunks[0].bytes
    out_roomy, err_roomy, lean_after = runs["roomy"]
    assert lean_after == 1 and "every expert resident" in err_roomy and out_roomy["tokens"] == out["tokens"]
    out_e, err_e, lean_after = runs["engine's flag"]
    assert lean_after == 1 and "offloaded" in err_e and out_e["tokens"] == out["tokens"]
    # --cpu-cache alone: the runner, with the cache the flag names, where the model fits as well
    out_n, err_n, lean_after = runs["named cache"]
    assert lean_after == 2 and made[1][0] == expert_bytes(store) // 4 and "sized as --cpu-cache 25% asks" in err_n
    assert out_n["tokens"] == out["tokens"]


@pytest.mark.slow
def test_the_command_line_decodes_in_a_process_that_never_loads_torch(stores):
    """`semoe generate --lean` in a process of its own: it runs to the end without torch (nor
    tensorstore) ever imported, and gives the in-process runner's tokens; so does a sampled chat."""
    import subprocess
    import sys

    from helpers.procs import ROOT, child_env

    probe = ("import json, sys\nfrom tools.cli import main\nrc = main(sys.argv[1:])\n"
             "print(json.dumps({'rc': rc, 'loaded': sorted(m for m in ('torch', 'tensorstore', 'transformers') "
             "if m in sys.modules)}), file=sys.stderr)\n")
    res = subprocess.run([sys.executable, "-c", probe, "generate", "--model", stores[4], "--prompt-ids", "3,17,5",
                          "--max-new-tokens", "8", "--ignore-eos", "--lean", "--json"],
                         capture_output=True, text=True, env=child_env(), cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stderr.strip().splitlines()[-1]) == {"rc": 0, "loaded": []}
    with LeanModel(stores[4], LeanConfig(cache_bytes=expert_bytes(stores[4]))) as lean:
        assert json.loads(res.stdout)["tokens"] == lean.generate([3, 17, 5], SamplingConfig(max_new_tokens=8)).tokens
    chat = subprocess.run([sys.executable, "-c", probe, "generate", "--model", stores[4], "--prompt", "the cat",
                           "--chat", "--temperature", "0.8", "--max-new-tokens", "8", "--lean", "--json"],
                          capture_output=True, text=True, env=child_env(), cwd=ROOT)
    assert chat.returncode == 0, chat.stderr
    assert json.loads(chat.stderr.strip().splitlines()[-1]) == {"rc": 0, "loaded": []}
    assert 1 <= len(json.loads(chat.stdout)["tokens"]) <= 8


def _prefill_is_the_steps(store: str, cache_bytes: int | None = 0) -> None:
    """The prompt a layer at a time (`lean_prefill`) against the same tokens stepped one by one, by
    default with the least cache (top_k slots, so each layer's experts come in several groups): the
    last position's logits within PREFILL_RTOL of the largest (each routed expert's output is the
    step's; only their sum's order differs), every layer's KV cache alike, and each expert the prompt
    chose (or the pass read ahead, guessing the next layer's) read from the store once."""
    with LeanModel(store, LeanConfig(cache_bytes=cache_bytes)) as lean:
        asked: set[tuple[int, int]] = set()
        guessed: set[tuple[int, int]] = set()
        begin = lean.cache.begin

        def counted(layer, experts, *, speculative=False):
            (guessed if speculative else asked).update((layer, e) for e in experts)
            return begin(layer, experts, speculative=speculative)

        lean.cache.begin = counted
        with lean.sequence(len(TOKENS)) as a, lean.sequence(len(TOKENS)) as b:
            got = prefill(a, TOKENS).copy()
            reads = lean.cache.misses
            assert reads == len(asked | guessed)  # the union of each layer's choices, each read once
            if cache_bytes:  # 16 positions choose 2 of 4 experts: every later MoE layer is read ahead
                assert {lay for lay, _ in guessed} == set(sorted(lean._parts)[1:])
            for t in TOKENS[:-1]:
                b.step(t, logits=False)
            want = b.step(TOKENS[-1])
            scale = np.abs(want).max()
            np.testing.assert_allclose(got, want, rtol=0, atol=PREFILL_RTOL * scale)
            for i in (0, 1):
                x, y = _stacked(a, i), _stacked(b, i)
                np.testing.assert_allclose(x, y, rtol=0, atol=PREFILL_RTOL * np.abs(y).max())
            assert a.length == b.length == len(TOKENS)
        if cache_bytes == 0:
            assert lean.cache.misses - reads > 0  # token by token, the same cache reads again


@pytest.mark.parametrize("bits", [32, 8, 4])
@pytest.mark.parametrize("cache", ["every expert", "top_k experts"])
def test_the_prompt_pass_is_the_steps_and_reads_each_expert_once_a_layer(stores, bits, cache):
    _prefill_is_the_steps(stores[bits], expert_bytes(stores[bits]) if cache == "every expert" else 0)


def test_the_prompt_pass_continues_a_sequence_and_refuses_what_does_not_fit(stores):
    """A prompt pass at position 5 (after five steps) gives the logits of stepping all of it; a prompt
    past the sequence's capacity, or an empty one, is refused in one line with nothing run."""
    with LeanModel(stores[8], LeanConfig(cache_bytes=None)) as lean, \
            lean.sequence(len(TOKENS)) as a, lean.sequence(len(TOKENS)) as b:
        for t in TOKENS[:5]:
            a.step(t, logits=False)
        done = []
        got = prefill(a, TOKENS[5:], lambda n, layers: done.append((n, layers))).copy()
        assert done == [(n, len(a._kv)) for n in range(1, len(a._kv) + 1)]  # progress after each layer
        for t in TOKENS:
            want = b.step(t)
        np.testing.assert_allclose(got, want, rtol=0, atol=PREFILL_RTOL * np.abs(want).max())
        with pytest.raises(BadInputError, match="the sequence holds"):
            prefill(a, [1])
        assert a.length == len(TOKENS)
    with LeanModel(stores[8], LeanConfig(cache_bytes=0)) as lean, lean.sequence(4) as c:
        with pytest.raises(BadInputError, match="empty"):
            prefill(c, [])


def _lean_is_the_one_call_step(store: str) -> None:
    """The store's model takes the one-call step; the runner with the engine's rotary tables gives its
    logits bit for bit, and with its own tables the engine's greedy tokens (log-probs within
    LOGPROB_ATOL); its prompt pass is its step's (`_prefill_is_the_steps`)."""
    _prefill_is_the_steps(store)
    model = load_store(store)
    plan = DecodePlan(model)
    assert plan.net is not None, plan.whole_refusal
    kv = KVCache.empty(model.config, 1, len(TOKENS))
    with LeanModel(store, LeanConfig(cache_bytes=0)) as lean, lean.sequence(len(TOKENS)) as seq:
        lean.rope = _engine_rope(model.config)
        for t in TOKENS:
            np.testing.assert_array_equal(seq.step(t), plan.step(t, kv)[0].numpy())
    engine = Engine.load(store, EngineConfig())
    try:
        want = engine.generate(PROMPT, SamplingConfig(max_new_tokens=16, stop_ids=()))
    finally:
        engine.close()
    with LeanModel(store, LeanConfig(cache_bytes=0)) as lean:
        held = []

        def numpy_bytes(done: int, layers: int) -> None:  # the sequence's numpy buffers, the prompt's pass's too
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
            held.append(sum(t.size for t in snap.traces))

        tracemalloc.start()  # numpy's buffers are traced from here (the kernels' own are not)
        try:
            got = lean.generate(PROMPT, SamplingConfig(max_new_tokens=16), on_prompt_layer=numpy_bytes)
        finally:
            tracemalloc.stop()
        # what an auto cache leaves free for the sequence counts at least its numpy buffers (the kernels'
        # own, "layer", are not traced)
        part = sequence_parts(lean.config, len(PROMPT), len(PROMPT) + 16)
        assert part["kv"] + part["step"] + part["rows"] >= max(held) > 0
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_yarn_and_a_sliding_window_run_torch_free(tmp_path):
    """A model with YaRN rotary frequencies (cos and sin scaled by its attention factor) and a sliding
    window of 6 that the steps pass: the runner with the engine's tables gives the one-call step's
    logits bit for bit, and with its own tables the engine's greedy tokens."""
    from semoe.checkpoints.model_io import save_store
    from semoe.model.config import MoEConfig
    from semoe.model.moe_gpt import MoEGPT

    config = MoEConfig(arch="mixtral", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_size=128, moe_ffn_size=128, num_experts=4, top_k=2, max_position=64, sliding_window=6,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    torch.manual_seed(3)
    save_store(MoEGPT(config).eval(), str(tmp_path / "store"))
    store = str(tmp_path / "store")
    assert load_store(store).config.window(0) == 6 and len(PROMPT) + 16 > 6
    with LeanModel(store, LeanConfig(cache_bytes=0)) as lean:
        assert lean.rope_scale > 1  # YaRN's attention factor
    _lean_is_the_one_call_step(store)


def _arch_store(arch: str, tmp_path) -> str:
    """A store of a real HuggingFace checkpoint of `arch` (transformers' own class, tiny), or, for
    "variants", a model of semoe's own with every attention variant the step takes at once: q/k norms
    over all heads, clipping, sinks and half the head's dims rotated."""
    from helpers.hf_models import make_hf_checkpoint
    from semoe.checkpoints.model_io import save_store
    from semoe.model.config import MoEConfig
    from semoe.model.moe_gpt import MoEGPT

    store = str(tmp_path / arch)
    if arch.startswith("gpt_oss"):  # float32 or bfloat16 as imported, its experts int4, or MXFP4 as published
        from helpers.quantized_checkpoints import write_mxfp4_checkpoint
        from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store
        hf = make_hf_checkpoint("gpt_oss", tmp_path / "hf", hidden_size=64, intermediate_size=64,
                                dtype="bfloat16" if arch.endswith("bf16") else "float32")
        if arch.endswith("mxfp4"):
            write_mxfp4_checkpoint(hf, tmp_path / "mxfp4")
            hf = tmp_path / "mxfp4"
        import_checkpoint(str(hf), store)
        if arch.endswith("int4"):
            quantize_store(store, store + "-q", QuantizeConfig(bits=4, group_size=32))
            store += "-q"
        return store
    if arch == "deepseek_v3-fp8":  # as published: FP8 dense weights and experts with scales per tile
        from helpers.quantized_checkpoints import write_fp8_checkpoint
        hf = make_hf_checkpoint("deepseek_v3", tmp_path / "hf", hidden_size=64, intermediate_size=64,
                                moe_intermediate_size=64)
        write_fp8_checkpoint(hf, tmp_path / "fp8", (32, 32), mtp=False)
        import_checkpoint(str(tmp_path / "fp8"), store)
        return store
    if arch == "glm5-shared":  # GLM-5 with "shared" layers, which read the choice of the indexing layer before
        import_checkpoint(str(make_hf_checkpoint("glm_moe_dsa", tmp_path / "hf",
                                                 indexer_types=["full", "shared", "shared"])), store)
        return store
    if arch != "variants":
        import_checkpoint(str(make_hf_checkpoint(arch, tmp_path / "hf")), store)
        return store
    config = MoEConfig(arch="mixtral", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_size=128, moe_ffn_size=128, num_experts=4, top_k=2, max_position=64, qk_norm="full",
                       clip_qkv=0.5, attention_sinks=True, rope_dim=8)
    torch.manual_seed(5)
    model = MoEGPT(config).eval()
    with torch.no_grad():  # sinks and norms away from their initial values, so that each one counts
        for name, p in model.named_parameters():
            if "sinks" in name or "_norm" in name:
                p.uniform_(0.5, 1.5)
    save_store(model, store)
    return store


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                  "deepseek_v3-fp8", "glm4_moe", "gpt_oss", "gpt_oss-bf16", "gpt_oss-int4",
                                  "gpt_oss-mxfp4", "minimax_m2", "dots1", "kimi_k25", "ernie4_5_moe",
                                  "hunyuan_v1_moe", "llama4", "deepseek_v32", "glm_moe_dsa",
                                  "glm5-shared", "variants"])
def test_every_architecture_of_the_one_call_step_runs_torch_free(arch, tmp_path):
    """q/k norms per head (Qwen3-MoE, GLM-4.5), over all heads with clipping (OLMoE), sinks with
    partial rotary; shared experts gated (Qwen2-MoE) or not, grouped routers with a correction
    bias and dense first layers (GLM-4.5); latent attention with a direct query and no YaRN
    (DeepSeek-V2), with a low-rank query and YaRN (DeepSeek-V3), and as published in FP8 (dense
    weights dequantized to bfloat16 as the engine's, experts computed as FP8); gpt-oss's sinks, alternating windows and clamped experts
    with biases, float32 and bfloat16 (in-major), int4 and MXFP4 (with bfloat16 biases, converted as
    read): `_lean_is_the_one_call_step` (numpy's cos and sin against torch's: LOGPROB_ATOL)."""
    _lean_is_the_one_call_step(_arch_store(arch, tmp_path))


def test_a_float16_kv_cache_holds_half_the_bytes_and_stays_near_float32(tmp_path, capsys):
    """--kv-cache f16 (`LeanConfig.kv_cache`), on gpt-oss (grouped-query attention with sinks and a
    sliding window): the cache holds float16, half the float32 cache's bytes. The first layer's keys and
    values are the float32 run's rounded to float16 (the same inputs); the prompt pass gives the steps'
    logits and caches over it (within PREFILL_RTOL of the largest, as over float32); the logits stay
    within KV16_RTOL of the float32 cache's (keys and values to 11 significant bits). The command line
    takes it with --lean and refuses it for the engine; latent attention (DeepSeek) is refused."""
    store = _arch_store("gpt_oss", tmp_path)
    got = {}
    for kv in ("f32", "f16"):
        with LeanModel(store, LeanConfig(cache_bytes=None, kv_cache=kv)) as lean, \
                lean.sequence(len(TOKENS)) as a, lean.sequence(len(TOKENS)) as b:
            first = prefill(a, TOKENS).copy()
            for t in TOKENS[:-1]:
                b.step(t, logits=False)
            stepped = b.step(TOKENS[-1])
            np.testing.assert_allclose(first, stepped, rtol=0, atol=PREFILL_RTOL * np.abs(stepped).max())
            for x, y in ((_stacked(a, 0), _stacked(b, 0)), (_stacked(a, 1), _stacked(b, 1))):
                np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), rtol=0,
                                           atol=PREFILL_RTOL * np.abs(y.astype(np.float32)).max())
            got[kv] = stepped.copy(), _stacked(a, 0).copy(), _stacked(a, 1).copy()
    (l32, k32, v32), (l16, k16, v16) = got["f32"], got["f16"]
    assert k16.dtype == v16.dtype == np.float16 and k16.nbytes * 2 == k32.nbytes
    assert np.array_equal(k16[0], k32[0].astype(np.float16)) and np.array_equal(v16[0], v32[0].astype(np.float16))
    assert not np.array_equal(l16, l32)  # the rounding reached the logits
    np.testing.assert_allclose(l16, l32, rtol=0, atol=KV16_RTOL * np.abs(l32).max())
    args = ["generate", "--model", store, "--prompt-ids", "3,17,5", "--max-new-tokens", "4", "--ignore-eos", "--json"]
    assert main(args + ["--lean", "--kv-cache", "f16"]) == 0
    with LeanModel(store, LeanConfig(cache_bytes=None, kv_cache="f16")) as lean:
        assert json.loads(capsys.readouterr().out)["tokens"] == \
            lean.generate([3, 17, 5], SamplingConfig(max_new_tokens=4)).tokens
    assert main(args + ["--resident", "--kv-cache", "f16"]) == 2
    assert "--kv-cache f16 is the torch-free runner's" in capsys.readouterr().err
    latent = _arch_store("deepseek_v2", tmp_path)
    with pytest.raises(BadInputError, match="latent attention"):
        LeanModel(latent, LeanConfig(cache_bytes=0, kv_cache="f16"))
    assert auto_kv_cache(load_store(latent).config, 3, 11, available=0) == "f32"  # auto never asks for it


def test_kv_cache_auto_takes_float16_where_a_float32_cache_would_crowd_memory(stores, capsys, monkeypatch):
    """--kv-cache auto (the default): float16 where a float32 cache for the prompt and the new tokens
    would take more than 1/KV16_SHARE of the memory available, else float32 (the engine's values); the
    command says so on stderr where it takes float16, and its stats say which."""
    import storage.process_memory

    c = load_store(stores[4]).config
    kv = sequence_parts(c, 3, 3 + 8)["kv"]
    assert auto_kv_cache(c, 3, 11, kv * KV16_SHARE) == "f32" and auto_kv_cache(c, 3, 11, kv * KV16_SHARE - 1) == "f16"
    args = ["generate", "--model", stores[4], "--prompt-ids", "3,17,5", "--max-new-tokens", "8", "--ignore-eos",
            "--json", "--lean", "--cpu-cache", "50%"]
    for available, want in ((kv * KV16_SHARE, "f32"), (kv * KV16_SHARE - 1, "f16")):
        monkeypatch.setattr(storage.process_memory, "available_ram_bytes", lambda a=available: a)
        assert main(args) == 0
        out = capsys.readouterr()
        assert json.loads(out.out)["stats"]["kv_cache"] == want
        assert ("keeping it in float16" in out.err) == (want == "f16")


@pytest.mark.parametrize("omp, want", [("3", 3), ("3,1", 3), (" 4 ", 4), ("0", None), ("many", None), ("", None)])
def test_the_runners_threads_follow_omp_num_threads_where_it_is_set(monkeypatch, omp, want):
    """Processes that share a machine (servers side by side, test workers) set OMP_NUM_THREADS, as torch's
    ops take it; the runner's kernels take it too, else every core the process may run on."""
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    cores = len(os.sched_getaffinity(0))
    assert LeanConfig(cache_bytes=0).threads == (want or cores)
    assert LeanConfig(cache_bytes=0, threads=5).threads == 5
