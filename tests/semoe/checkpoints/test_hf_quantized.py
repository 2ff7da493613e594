"""Quantized HuggingFace checkpoints (DeepSeek-V3's FP8 block-scale, gpt-oss's MXFP4) imported compact and
exported bit-exact, read dequantized as transformers reads them, multi-token-prediction layers skipped, and
unsupported checkpoints refused in one line.

The checkpoints are tiny transformers models saved in float32, quantized here into the published layouts
and written with the safetensors library; the expected tensors are dequantized independently in the test.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers.hf_models import load_safetensors_dir
from helpers.quantized_checkpoints import (FP8_QUANTIZED, dequantize_fp8_reference, write_fp8_checkpoint,
                                           write_mxfp4_checkpoint)
from helpers.kernels import needs_kernels
from safetensors.torch import save_file

from storage.errors import BadInputError
from semoe.checkpoints.hf_convert import INDEX_FILE, check_supported, export_checkpoint, import_checkpoint
from semoe.model.hf_names import SUPPORTED_MODEL_TYPES
from storage.store import Store

# -- checkpoints ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dsv3_f32(tmp_path_factory):
    """A tiny DeepSeek-V3 (layer 0 dense, layer 1 MoE with 4 experts) saved by transformers in float32."""
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, num_nextn_predict_layers=1)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "dsv3_f32"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def gpt_oss_f32(tmp_path_factory):
    """A tiny gpt-oss (fused experts with biases) saved by transformers in float32; gate_up_proj is square
    (hidden 64, 2 * intermediate 64) so that an orientation mistake cannot hide behind a shape check."""
    import transformers

    cfg = transformers.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "gpt_oss_f32"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return path


def stored(store: Store) -> dict[str, torch.Tensor]:
    """Every weight of a store by checkpoint name; fused expert tensors restacked."""
    out = {t.name: store.read_tensor(t.name) for t in store.manifest.tensors if t.group == "dense"}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for layer, n in store.manifest.expert_layers().items():
        for e in range(n):
            for name, t in store.read_expert(layer, e).items():
                experts.setdefault(name, {})[e] = t
    for name, by_expert in experts.items():
        entry = next(t for t in store.manifest.tensors if t.name == name)
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)]) if entry.stacked else \
            next(iter(by_expert.values()))
    return out


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


# -- FP8 ------------------------------------------------------------------------------------------

def quant_of(store: Store, name: str) -> dict | None:
    return next(t.quant for t in store.manifest.tensors if t.name == name)


@pytest.mark.parametrize("block", [(128, 128), (16, 16)])
def test_fp8_import_keeps_every_weight_compact_and_the_mtp_layer(dsv3_f32, tmp_path, block):
    written = write_fp8_checkpoint(dsv3_f32, tmp_path / "fp8", block)
    if block == (16, 16):  # edge blocks are exercised: some dimension is not a multiple of the block
        assert any(t.shape[0] % 16 or t.shape[1] % 16 for k, t in written.items() if FP8_QUANTIZED.match(k))
    store = import_checkpoint(str(tmp_path / "fp8"), str(tmp_path / "store"))
    got = stored(store)
    # the expected store: every tensor byte for byte as the checkpoint ships it, the MTP layer's (2) too
    want = written
    assert sorted(got) == sorted(want)
    for name in want:
        assert_bitwise_equal(got[name], want[name], name)
    fp8 = [k for k, t in want.items() if t.dtype == torch.float8_e4m3fn]
    for name in fp8:  # each codes tensor names its scales and the weight it stands for
        assert quant_of(store, name) == {"scheme": "fp8", "dtype": "BF16", "shape": list(want[name].shape),
                                         "scales": name + "_scale_inv", "transposed": False, "block": list(block)}
        assert quant_of(store, name + "_scale_inv") == {"scales_of": name}
    mtp = {k: t for k, t in written.items() if k.startswith("model.layers.2.")}
    info = store.describe()
    assert info["quantization"] == {"format": f"fp8-e4m3-block{block[0]}x{block[1]}", "source": "checkpoint",
                                    "tensors": len(fp8)}
    assert info["mtp"] == {"layers": [2], "tensors": len(mtp), "bytes": sum(t.nbytes for t in mtp.values())}
    assert info["skipped"] is None
    assert info["experts_per_layer"] == {"1": 4, "2": 4}  # the MTP layer's experts: chunks of layer 2
    assert info["schemes"]["fp8"]["tensors"] == len(fp8)
    # an expert is one contiguous read: its codes and their scales share its chunk
    chunk = store.manifest.chunk(1, 3)
    assert sorted(e.name for e in store.manifest.chunk_tensors(chunk)) == sorted(
        f"model.layers.1.mlp.experts.3.{w}_proj.weight{s}" for w in ("down", "gate", "up") for s in ("", "_scale_inv"))
    config = json.loads(store.read_file("config.json"))  # kept as shipped
    assert config["quantization_config"]["quant_method"] == "fp8" and config["num_nextn_predict_layers"] == 1


def test_fp8_dense_weights_load_dequantized_as_transformers_dequantizes_them(dsv3_f32, tmp_path):
    """The independent oracle is transformers' own FP8 dequantization (`Fp8Dequantize`). It derives the
    block from the scale grid, so it is only right where blocks divide the shape: with 128x128 blocks
    every tiny weight is one block."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    written = write_fp8_checkpoint(dsv3_f32, tmp_path / "fp8", (128, 128))
    store = import_checkpoint(str(tmp_path / "fp8"), str(tmp_path / "store"))
    for name in ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.down_proj.weight"):
        oracle = Fp8Dequantize(None)._dequantize_one(written[name], written[name + "_scale_inv"],
                                                     output_dtype=torch.bfloat16)
        assert_bitwise_equal(store.read_dense(name), oracle, name)
    plain = "model.layers.0.input_layernorm.weight"
    assert_bitwise_equal(store.read_dense(plain), written[plain], plain)


def test_fp8_import_to_float32_keeps_the_codes_and_dequantizes_to_float32(dsv3_f32, tmp_path):
    written = write_fp8_checkpoint(dsv3_f32, tmp_path / "fp8", (16, 16))
    store = import_checkpoint(str(tmp_path / "fp8"), str(tmp_path / "store"), dtype="float32")
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert quant_of(store, name)["dtype"] == "F32"
    assert_bitwise_equal(store.read_tensor(name), written[name], name)  # the codes are not touched
    want = dequantize_fp8_reference(written[name], written[name + "_scale_inv"], (16, 16), torch.float32)
    assert_bitwise_equal(store.read_dense(name), want, name)


def test_fp8_import_then_export_is_bit_exact(dsv3_f32, tmp_path):
    written = write_fp8_checkpoint(dsv3_f32, tmp_path / "fp8", (16, 16))
    store = import_checkpoint(str(tmp_path / "fp8"), str(tmp_path / "store"))
    assert export_checkpoint(store, str(tmp_path / "out")) == 0  # nothing dequantized: not lossy
    # both shards written back, the multi-token-prediction layer's (kept at import) too; without it
    # (--no-mtp), the shard holding only its tensors is not
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    without = import_checkpoint(str(tmp_path / "fp8"), str(tmp_path / "store-without"), mtp=False)
    assert export_checkpoint(without, str(tmp_path / "out-without")) == 0
    assert sorted(p.name for p in (tmp_path / "out-without").glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors"]
    for out, want in ((tmp_path / "out", written),
                      (tmp_path / "out-without", {k: t for k, t in written.items() if not k.startswith("model.layers.2.")})):
        got = load_safetensors_dir(out)
        assert sorted(got) == sorted(want)
        for name in want:
            assert_bitwise_equal(got[name], want[name], name)
    assert (tmp_path / "out" / "config.json").read_bytes() == (tmp_path / "fp8" / "config.json").read_bytes()


# -- MXFP4 ----------------------------------------------------------------------------------------

def test_mxfp4_import_keeps_the_blocks_and_decodes_them_as_transformers_does(gpt_oss_f32, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from storage.quant import QuantSpec, dequantize

    written = write_mxfp4_checkpoint(gpt_oss_f32, tmp_path / "mxfp4")
    store = import_checkpoint(str(tmp_path / "mxfp4"), str(tmp_path / "store"))
    got = stored(store)
    assert sorted(got) == sorted(written)
    for name in written:
        assert_bitwise_equal(got[name], written[name], name)
    assert store.describe()["experts_per_layer"] == {"0": 4, "1": 4}
    plain = load_safetensors_dir(gpt_oss_f32)
    n = 0
    for name in plain:
        if name + "_blocks" not in written:
            continue
        n += 1
        codes = name + "_blocks"
        entry = store.manifest.tensor(codes, stack_index=2)
        assert entry.stacked and entry.quant["scales"] == name + "_scales" and entry.quant["transposed"]
        spec = QuantSpec.from_json(entry.quant)
        assert spec.shape == tuple(plain[name].shape[1:])  # the logical shape: a plain checkpoint's slice
        # the oracle: transformers' own dequantization, expert by expert from the stored slices
        want = convert_moe_packed_tensors(written[codes], written[name + "_scales"], dtype=torch.bfloat16)
        for e in range(4):
            views = store.read_expert(int(name.split(".")[2]), e)
            assert_bitwise_equal(dequantize(views[codes], views[name + "_scales"], spec), want[e], f"{name}[{e}]")
        # and the orientation is the model's: near the float32 weights it was quantized from (4-bit
        # rounding errs by ~12% in norm here; the transposed weights would differ by ~140%)
        err = torch.linalg.vector_norm(want.float() - plain[name]) / torch.linalg.vector_norm(plain[name])
        assert err < 0.2, (name, err)
        if want.shape[1] == want.shape[2]:
            transposed = torch.linalg.vector_norm(want.float().transpose(1, 2) - plain[name])
            assert transposed > torch.linalg.vector_norm(plain[name]), name
    assert n == 4
    info = store.describe()
    assert info["quantization"] == {"format": "mxfp4", "source": "checkpoint", "tensors": 4}
    assert info["skipped"] is None
    # 4.25 bits per weight: 4 per code and 8 per group of 32
    assert info["schemes"]["mxfp4"]["bits_per_weight"] == pytest.approx(4.25)


def test_mxfp4_import_then_export_is_bit_exact(gpt_oss_f32, tmp_path):
    write_mxfp4_checkpoint(gpt_oss_f32, tmp_path / "mxfp4")
    store = import_checkpoint(str(tmp_path / "mxfp4"), str(tmp_path / "store"))
    assert export_checkpoint(store, str(tmp_path / "out")) == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "mxfp4" / "model.safetensors").read_bytes()


# -- store info -----------------------------------------------------------------------------------

def test_store_info_says_what_import_kept(dsv3_f32, tmp_path, capsys):
    from tools.cli import main

    written = write_fp8_checkpoint(dsv3_f32, tmp_path / "fp8", (16, 16))
    n_fp8 = sum(1 for k, t in written.items() if t.dtype == torch.float8_e4m3fn and ".layers.2." not in k)
    mtp = [t.nbytes for k, t in written.items() if k.startswith("model.layers.2.")]
    assert n_fp8 == 28 and len(mtp) == 53 and sum(mtp) == 44136  # so that the lines below can be read
    assert main(["store", "import", str(tmp_path / "fp8"), str(tmp_path / "kept")]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "quantized: fp8-e4m3-block16x16 as the checkpoint ships it (49 tensors)",
        "mtp: multi-token prediction layers [2] kept for drafting (53 tensors, 43.1 KiB)"]
    assert main(["store", "import", "--no-mtp", str(tmp_path / "fp8"), str(tmp_path / "store")]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "quantized: fp8-e4m3-block16x16 as the checkpoint ships it (28 tensors)",
        "skipped: multi-token prediction layers [2] at import (53 tensors, 43.1 KiB)"]
    assert main(["store", "info", str(tmp_path / "store")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:-1] == [
        "quantized     fp8-e4m3-block16x16 as the checkpoint ships it (28 tensors)",
        "skipped       multi-token prediction layers [2] at import (53 tensors, 43.1 KiB)"]
    assert re.fullmatch(r"scheme fp8    28 weights, [\d.]+ (KiB|MiB), 8\.\d\d bits per weight", lines[-1].strip()), lines[-1]
    assert main(["store", "info", str(tmp_path / "store"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quantization"]["format"] == "fp8-e4m3-block16x16" and info["skipped"]["layers"] == [2]


# -- refusals -------------------------------------------------------------------------------------

REFUSALS = [
    ({"model_type": "deepseek_v3", "index_topk": 2048},
     "sparse-attention indexer (index_topk=2048) in a deepseek_v3 config is not supported: DeepSeek sparse attention "
     "is taken for model types deepseek_v32, glm_moe_dsa"),
    ({"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]},
     "field 'num_hidden_layers' is missing"),  # a model type it takes, from a config it cannot build
    ({"model_type": "qwen3_moe", "vision_config": {}},
     "multimodal checkpoint (vision_config) is not supported: multimodal towers are not implemented"),
    ({"model_type": "gpt_oss", "architectures": ["GptOssForConditionalGeneration"]},
     "(architecture GptOssForConditionalGeneration) is not supported: multimodal towers are not implemented"),
    ({"model_type": "mixtral", "quantization_config": {"quant_method": "awq", "bits": 4}},
     "quantization_config.quant_method='awq' is not supported; supported: fp8 (block-scale, e4m3), mxfp4"),
    ({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8", "weight_block_size": None}},
     "quantization_config.weight_block_size=None is not supported"),
    ({"model_type": "llama"},
     f"unknown architecture model_type='llama'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"),
    ({"model_type": "kimi_k2", "architectures": ["KimiForCausalLM"]},
     "model_type='kimi_k2' (kimi_k2 is supported with architectures ['DeepseekV3ForCausalLM'])"),
]


@pytest.mark.parametrize("config, message", REFUSALS, ids=[c["model_type"] + str(i) for i, (c, _) in
                                                            enumerate(REFUSALS)])
def test_unsupported_checkpoints_are_refused_in_one_line(dsv3_f32, tmp_path, capsys, config, message):
    from tools.cli import main

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(config))
    (ck / "model.safetensors").write_bytes((dsv3_f32 / "model.safetensors").read_bytes())
    with pytest.raises(BadInputError) as e:
        check_supported(config, str(ck / "config.json"))
    assert str(e.value) == f"{ck / 'config.json'}: " + str(e.value).split(": ", 1)[1]
    assert message in str(e.value) and "\n" not in str(e.value)
    assert main(["store", "import", str(ck), str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"semoe: error: {e.value}"]
    assert not (tmp_path / "store").exists()


def test_kimi_k2_with_deepseek_v3_architecture_is_deepseek_v3(dsv3_f32, tmp_path):
    ck = tmp_path / "kimi"
    ck.mkdir()
    cfg = json.loads((dsv3_f32 / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    (ck / "model.safetensors").write_bytes((dsv3_f32 / "model.safetensors").read_bytes())
    store = import_checkpoint(str(ck), str(tmp_path / "store"))
    assert store.describe()["model_type"] == "deepseek_v3" and store.describe()["experts_per_layer"] == {"1": 4}
    assert json.loads(store.read_file("config.json"))["model_type"] == "kimi_k2"  # kept as the checkpoint has it


def test_layers_past_the_mtp_layers_are_an_error(dsv3_f32, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text((dsv3_f32 / "config.json").read_text())
    tensors = load_safetensors_dir(dsv3_f32)
    tensors["model.layers.3.input_layernorm.weight"] = torch.ones(32)
    save_file(tensors, str(ck / "model.safetensors"))
    with pytest.raises(BadInputError, match=r"model\.safetensors: tensor model\.layers\.3\.input_layernorm\.weight "
                                            r"is in layer 3, but .*config\.json has num_hidden_layers=2 and "
                                            r"num_nextn_predict_layers=1"):
        import_checkpoint(str(ck), str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


def test_fp8_weight_without_its_scale_is_refused(dsv3_f32, tmp_path):
    from safetensors.torch import load_file

    write_fp8_checkpoint(dsv3_f32, tmp_path / "fp8", (16, 16))
    path = tmp_path / "fp8" / "model-00001-of-00002.safetensors"
    victim = "model.layers.1.mlp.experts.0.up_proj.weight"
    shard = load_file(str(path))
    del shard[victim + "_scale_inv"]
    save_file(shard, str(path))
    index = json.loads((tmp_path / "fp8" / INDEX_FILE).read_text())
    del index["weight_map"][victim + "_scale_inv"]
    (tmp_path / "fp8" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(BadInputError, match=rf"{path.name}: tensor {re.escape(victim)} is float8 but "
                                            rf"{re.escape(victim)}_scale_inv is missing"):
        import_checkpoint(str(tmp_path / "fp8"), str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_the_model_runs_a_quantized_directory_as_its_imported_store(dsv3_f32, gpt_oss_f32, tmp_path, fmt):
    """`semoe generate --model DIR` on a quantized directory reads the tensors dequantized (gpt-oss's fused
    experts one expert slice at a time); its imported store keeps the experts compact and computes on
    them, dequantizing each into its logical dtype and layout (the `dequantize` kernel: the CPU decode
    kernels quantize x, tested below): identical logits."""
    from semoe.checkpoints.model_io import load_hf, load_store

    q = tmp_path / fmt
    if fmt == "fp8":
        write_fp8_checkpoint(dsv3_f32, q, (16, 16))
    else:
        write_mxfp4_checkpoint(gpt_oss_f32, q)
    store = import_checkpoint(str(q), str(tmp_path / "store"))
    ids = torch.tensor([[1, 5, 9, 2, 7, 30, 4]])
    with torch.no_grad():
        # dense weights as stored (`auto` makes them int8 beside MXFP4 experts on CPU): the experts' arithmetic alone
        got = load_store(store.root, kernel="dequantize", dense="float")(ids).logits
        assert torch.equal(load_hf(str(q))(ids).logits, got)


@needs_kernels
def test_mxfp4_experts_decode_through_the_cpu_kernel_as_the_reference_does(gpt_oss_f32, tmp_path, monkeypatch):
    """A decoding step's rows multiply the stored MXFP4 blocks in semoe's CPU kernel: kernel by kernel
    each expert in one call (counted, so the test cannot pass without it), or the whole step in one
    call; greedy tokens equal the reference kernel's (the same arithmetic: x quantized per block of
    32, times the dequantized blocks), log-probs within 1e-4 (float32 sums in another order, C's
    expf in the sigmoid)."""
    from semoe.kernels import torch_ops
    from semoe.checkpoints.model_io import load_store
    from semoe.decode.plan import DecodePlan
    from semoe.decode.loop import SamplingConfig
    from semoe.decode.generate import generate

    write_mxfp4_checkpoint(gpt_oss_f32, tmp_path / "mxfp4")
    store = import_checkpoint(str(tmp_path / "mxfp4"), str(tmp_path / "store"))
    calls, kernel = [], torch_ops.clamped_swiglu
    monkeypatch.setattr(torch_ops, "clamped_swiglu", lambda *a: calls.append(a[1]) or kernel(*a))
    prompt, sampling = [1, 5, 9, 2, 7, 30, 4], SamplingConfig(max_new_tokens=12)
    # dense weights as stored (float) on every side, so that the experts' arithmetic alone differs: int8
    # dense ones (`auto` beside MXFP4 experts) quantize each product's x per block of 32, where the
    # reference's float32 rounding of the same sums (1e-7) can move an activation across a rounding
    # step and its product by a step's weight (logits apart by 1e-3, seen on an AVX-512 CPU)
    floats = load_store(store.root, dense="float")
    stepped = generate(floats, prompt, sampling, plan=DecodePlan(floats, whole=False))
    assert calls.count("mxfp4") >= 2 * 2 * 12  # layers x top-k x tokens, at least
    whole = DecodePlan(floats)
    assert whole.net is not None
    one_call = generate(floats, prompt, sampling, plan=whole)
    ref = generate(load_store(store.root, kernel="reference", dense="float"), prompt, sampling)
    for fast in (stepped, one_call):
        assert fast.tokens == ref.tokens
        assert max(abs(a - b) for a, b in zip(fast.logprobs, ref.logprobs)) < 1e-4


# -- compressed-tensors int4 (Kimi-K2.5 as published) ---------------------------------------------

CT_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                           "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 32, "dynamic": False,
                                                       "actorder": None}}},
             "ignore": ["lm_head"]}


def _ct_pack(q_OI: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' packing, written out here from its description: q + 8 in 4 bits, eight
    to an int32, the first in the lowest bits."""
    u = (q_OI + 8).to(torch.int64).view(q_OI.shape[0], -1, 8)
    words = torch.zeros(u.shape[:2], dtype=torch.int64)
    for i in range(8):
        words |= u[..., i] << (4 * i)
    return words.to(torch.uint32).view(torch.int32)


@pytest.fixture(scope="module")
def kimi_ct(tmp_path_factory):
    """Kimi-K2.5 (a DeepSeek-V3 text model beside a vision tower) with its routed experts in
    compressed-tensors' pack-quantized int4 (groups of 32, bf16 scales), and the oracle: the same
    checkpoint in float32 with those experts dequantized. Scales are powers of two, so that q * scale
    is exact in bfloat16 as in float32 and every path's weights are the same numbers."""
    from helpers.hf_models import make_hf_checkpoint

    root = tmp_path_factory.mktemp("kimi_ct")
    src = make_hf_checkpoint("kimi_k25", root / "f32", hidden_size=64, intermediate_size=64, moe_intermediate_size=64)
    tensors = load_safetensors_dir(src)
    quantized, oracle = {}, {}
    for name, w in tensors.items():
        if ".mlp.experts." not in name or not name.endswith(".weight"):
            quantized[name] = oracle[name] = w
            continue
        o, i = w.shape
        amax = w.view(o, i // 32, 32).abs().amax(-1).clamp_min(1e-8)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 7)))  # (O, G), powers of two
        q = torch.clamp(torch.round(w.view(o, i // 32, 32) / scale[..., None]), -8, 7)
        oracle[name] = (q * scale[..., None]).view(o, i)
        quantized[name + "_packed"] = _ct_pack(q.view(o, i).to(torch.int8))
        quantized[name + "_scale"] = scale.to(torch.bfloat16)
        quantized[name + "_shape"] = torch.tensor([o, i], dtype=torch.int32)
    cfg = json.loads((src / "config.json").read_text())
    paths = {}
    for kind, weights, config in (("ct", quantized, {**cfg, "quantization_config": CT_CONFIG}),
                                  ("oracle", oracle, cfg)):
        path = root / kind
        path.mkdir()
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(config))
        paths[kind] = path
    return paths


def test_ct_int4_experts_are_kept_as_semoes_int4_and_compute_the_checkpoints_weights(kimi_ct, tmp_path):
    """Import keeps each packed expert weight as semoe int4 (codes in the kernel's layout, the
    checkpoint's scales, zero points 0), which dequantize to the checkpoint's own weights bit for bit.
    Reading the checkpoint in place (`load_hf`, dequantized) gives the oracle's float32 logits (relative
    1e-5); the store's int4 kernels, fast and reference, are within their activation quantization of
    them (2e-2, dense weights kept float as the oracle's)."""
    from helpers.hf_models import load_hf_model
    from semoe.checkpoints.model_io import load_hf, load_store
    from storage.quant import QuantSpec, dequantize

    store = import_checkpoint(str(kimi_ct["ct"]), str(tmp_path / "store"), dtype="float32")
    assert store.manifest.model["quantization"]["format"] == "int4-compressed-tensors-group32"
    name = "language_model.model.layers.1.mlp.experts.0.gate_proj.weight"
    q = quant_of(store, name)
    assert q["scheme"] == "int4" and q["group_size"] == 32 and q["packing"] == "compressed-tensors"
    assert q["packed_scales"] == "BF16" and quant_of(store, name + "_scale_zero") == {"scales_of": name}
    assert not any(t.name.endswith(("_packed", "_shape")) for t in store.manifest.tensors)
    oracle, kept = load_safetensors_dir(kimi_ct["oracle"]), stored(store)
    packed = [n for n in oracle if ".mlp.experts." in n]
    assert packed and all(quant_of(store, n)["packing"] == "compressed-tensors" for n in packed)
    for n in packed:
        spec = QuantSpec.from_json(quant_of(store, n))
        assert torch.equal(dequantize(kept[n], kept[spec.scales], spec), oracle[n]), n
    ids = torch.tensor([[3, 17, 5, 29, 11, 2, 40, 8, 19, 23]])
    with torch.no_grad():
        want = load_hf_model(kimi_ct["oracle"], dtype=torch.float32).eval()(ids).logits
        in_place = load_hf(str(kimi_ct["ct"]))(ids).logits  # dequantized to bfloat16: exact here
        fast = load_store(store, dense="float")(ids).logits
        ref = load_store(store, kernel="reference", dense="float")(ids).logits
    scale = float(want.abs().max())
    assert float((in_place - want).abs().max()) / scale < 1e-5
    assert float((fast - want).abs().max()) / scale < 2e-2
    assert float((ref - want).abs().max()) / scale < 2e-2


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_ct_int4_import_then_export_is_bit_exact(kimi_ct, tmp_path, where):
    """Export packs the codes back: weight_packed int32, weight_scale bfloat16 and weight_shape as
    the checkpoint has them, every other tensor as it was; the quantization_config read at the top
    of the multimodal config or in its text model's."""
    import shutil

    src = kimi_ct["ct"]
    if where == "text_config":
        src = tmp_path / "ct"
        shutil.copytree(kimi_ct["ct"], src)
        cfg = json.loads((src / "config.json").read_text())
        cfg["text_config"]["quantization_config"] = cfg.pop("quantization_config")
        (src / "config.json").write_text(json.dumps(cfg))
    store = import_checkpoint(str(src), str(tmp_path / "store"))
    assert store.manifest.model["quantization"]["format"] == "int4-compressed-tensors-group32"
    export_checkpoint(store, str(tmp_path / "out"))
    want, got = load_safetensors_dir(src), load_safetensors_dir(tmp_path / "out")
    assert sorted(want) == sorted(got)
    for name in want:
        assert_bitwise_equal(got[name], want[name], name)


@pytest.mark.parametrize("change, message", [
    ({"format": "int-quantized"}, "quantization_config.format='int-quantized' is not supported"),
    ({"weights": {"symmetric": False}}, "weights.symmetric=False is not supported"),
    ({"weights": {"num_bits": 8}}, "weights.num_bits=8 is not supported"),
    ({"weights": {"actorder": "group"}}, "weights.actorder='group' is not supported"),
    ({"weights": {"group_size": 16}}, "weights.group_size=16 is not supported"),
    ({"input_activations": {"num_bits": 8}}, "input_activations is set"),
], ids=["format", "asymmetric", "int8", "actorder", "group16", "activations"])
def test_ct_configs_other_than_weight_only_int4_groups_are_refused_in_one_line(kimi_ct, tmp_path, change, message):
    q = json.loads(json.dumps(CT_CONFIG))
    group = q["config_groups"]["group_0"]
    if "format" in change:
        q["format"] = change["format"]
    elif "weights" in change:
        group["weights"].update(change["weights"])
    else:
        group.update(change)
    cfg = json.loads((kimi_ct["ct"] / "config.json").read_text())
    with pytest.raises(BadInputError) as e:
        check_supported({**cfg, "quantization_config": q}, "config.json")
    assert message in str(e.value) and "\n" not in str(e.value)
