"""Compact (int8, int4) experts from `semoe store quantize` to compute: kernels against the plain reference,
offloaded equal to resident, compact bytes in the cache and the ring, export, training, and the CLI.

Models are transformers' own classes with dimensions the int4 layout can hold (out features a multiple of
64, in features of the group size): Mixtral (SwiGLU experts, weights (out, in)) and gpt-oss (fused
experts, weights (in, out), with biases).
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.hf_models import load_safetensors_dir

from inference.engine import Engine
from inference.engine_config import EngineConfig
from semoe.kernels import torch_ops
from semoe.checkpoints.hf_config import store_model_config
from semoe.model.compact_linear import CompactWeight
from semoe.decode.loop import SamplingConfig
from semoe.checkpoints.hf_convert import export_checkpoint, import_checkpoint
from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store
from storage.errors import BadInputError
from storage.quant import QuantSpec, dequantize, quantize
from storage.store import Store
from tools.cli import main

PROMPT = [3, 17, 5, 29, 11, 2, 40, 8, 19, 23]
SHAPE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128)


def _hf(arch: str, path):
    import transformers

    if arch in ("llama4", "qwen3_next", "qwen3_5_moe", "deepseek_v4"):  # Llama-4: experts (in, out) with gate and up as halves, its input scaled
        # by the router; Qwen3-Next: its linear-attention layers' projections compact too
        from helpers.hf_models import make_hf_checkpoint

        return make_hf_checkpoint(arch, path, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
                                  moe_intermediate_size=64, shared_expert_intermediate_size=64)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(**SHAPE, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
    else:
        cfg = transformers.GptOssConfig(**SHAPE, intermediate_size=64, head_dim=16, num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=6)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # biases random, so a kernel that drops them cannot pass
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.copy_(torch.randn(p.shape) * 0.05)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(arch, bits, dense) -> store path; 32 is the float32 import; dense: the quantized store's dense
    linear weights, int8 (`store quantize`'s default) or float."""
    made = {}

    def get(arch: str, bits: int, dense: str = "int8") -> str:
        if (arch, bits, dense) not in made:
            root = tmp_path_factory.mktemp(f"{arch}-{bits}-{dense}")
            if bits == 32:
                import_checkpoint(str(_hf(arch, root / "hf")), str(root / "store"))
            else:
                quantize_store(get(arch, 32), str(root / "store"),
                               QuantizeConfig(bits=bits, group_size=64, dense=dense))
            made[(arch, bits, dense)] = str(root / "store")
        return made[(arch, bits, dense)]

    return get


# -- kernels ------------------------------------------------------------------------------------

def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("scheme, g", [("int8", None), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [7, 40], ids=["semoe-kernels", "torch-ops"])
def test_the_fast_path_equals_the_reference(scheme, g, transposed, dtype, rows):
    torch.manual_seed(0)
    w = torch.randn(256, 128)  # (O, I), or (I, O) when transposed
    codes, scales = quantize(w, scheme, group_size=g, transposed=transposed)
    spec = QuantSpec(scheme=scheme, dtype="F32", shape=tuple(w.shape), scales="s", group_size=g,
                     transposed=transposed)
    x = torch.randn(rows, spec.out_in[1]).to(dtype)
    fast = CompactWeight(codes, scales, spec).linear(x)
    ref = CompactWeight(codes, scales, spec, kernel="reference").linear(x)
    assert fast.dtype == dtype and fast.shape == (rows, spec.out_in[0])
    dense = dequantize(codes, scales, spec)
    plain = x.float() @ dense if transposed else x.float() @ dense.T
    # the path CUDA takes (dequantize into a scratch weight, then the dense product in x's dtype)
    scratch = CompactWeight(codes, scales, spec, kernel="dequantize").linear(x)
    assert _relative(scratch, plain) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    if rows <= torch_ops.MAX_ROWS and torch_ops.available():  # without them, torch's ops below
        # semoe's kernels quantize x per block of 32 inputs, then sum exactly: the reference computes
        # the same on x as they see it, to float32's rounding (1e-5), or bfloat16's (1e-2) for a
        # bfloat16 result
        assert _relative(fast, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
        xs = torch_ops.activations_as_seen(x)
        # and x's quantization moves the product by little (7 bits per block of 32)
        assert _relative(fast, plain) < 2e-2
    else:
        # torch's packed ops take bfloat16 activations and scales (8 bits of mantissa: 2^-8 relative
        # per factor, partly cancelling over the sum)
        assert _relative(fast, ref) < 1e-2
        xs = x.float()
    # and the reference is the dequantized weight's product
    want = xs @ dense if transposed else xs @ dense.T
    assert _relative(ref, want) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("width", [24, 40, 48])
def test_int8_products_of_many_rows_take_any_input_width(width):
    """Many rows of an int8 weight whose input width is not a multiple of TORCH_INT8_K (latent
    attention's small ranks, the test models' widths): torch 2.13's packed int8 product crashes the
    process there on an AVX-512 CPU, so those go through the dequantized weight; every width gives the
    reference's product (bfloat16 activations and scales on torch's path: 1e-2)."""
    torch.manual_seed(0)
    w = torch.randn(64, width)
    codes, scales = quantize(w, "int8")
    spec = QuantSpec(scheme="int8", dtype="F32", shape=(64, width), scales="s")
    x = torch.randn(40, width)
    fast = CompactWeight(codes, scales, spec).linear(x)
    ref = CompactWeight(codes, scales, spec, kernel="reference").linear(x)
    assert fast.shape == (40, 64) and _relative(fast, ref) < 1e-2


@pytest.mark.parametrize("shape, tile", [((256, 384), 128), ((100, 72), 24), ((96, 64), 32)],
                         ids=["deepseek-tiles", "ragged-scalar-tail", "small-tiles"])
@pytest.mark.parametrize("rows", [1, 7, 40], ids=["one-row", "semoe-kernel", "dequantized"])
def test_fp8_computed_as_fp8_equals_the_reference(shape, tile, rows):
    """FP8 (e4m3) codes with a scale per square tile, as DeepSeek-V3 ships them, every code value
    among them (subnormals, zeros of both signs, the largest): semoe's kernel sums each tile in float32,
    then scales it; the reference kernel dequantizes to float32 and multiplies. Equal to float32's
    rounding (1e-6 of the largest output) where the kernel applies; with more rows, the dequantized
    bfloat16 weight's product, within bfloat16's rounding of each weight (2^-9, 1e-2 over a sum)."""
    torch.manual_seed(0)
    O, I = shape
    codes = torch.randint(0, 256, (O, I), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # e4m3fn's NaN: no weight holds one
    codes[0, :4] = torch.tensor([0x00, 0x80, 0x01, 0x87], dtype=torch.uint8)
    codes = codes.view(torch.float8_e4m3fn)
    scales = torch.rand(-(-O // tile), -(-I // tile)) * 1e-2 + 1e-3
    spec = QuantSpec(scheme="fp8", dtype="BF16", shape=(O, I), scales="s", block=(tile, tile))
    x = torch.randn(rows, I)
    fast = CompactWeight(codes, scales, spec).linear(x)
    ref = CompactWeight(codes, scales, spec, kernel="reference").linear(x)
    plain = x.double() @ dequantize(codes, scales, spec, torch.float32).double().T
    if rows <= torch_ops.MAX_ROWS and torch_ops.available():
        assert _relative(fast, plain) < 1e-6 and _relative(ref, plain) < 1e-6
    else:
        assert _relative(fast, plain) < 1e-2 and _relative(fast, ref) < 1e-2


# -- quantize_store -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_makes_expert_weights_compact_and_copies_the_rest(stores, arch, bits):
    """Experts compact; the dense linear weights int8 with the loader's own quantizer (the codes and
    scales `compact_dense_linears` makes of the float weights); routers, norms, the embedding and
    biases byte for byte."""
    from semoe.checkpoints.quantize_store import dense_int8_names

    src, dst = Store.open(stores(arch, 32)), Store.open(stores(arch, bits))
    linears = dense_int8_names(store_model_config(src))
    assert "lm_head.weight" in linears and "model.layers.0.self_attn.q_proj.weight" in linears
    for t in src.manifest.dense():
        if t.name not in linears:
            assert torch.equal(dst.read_tensor(t.name).view(torch.uint8), src.read_tensor(t.name).view(torch.uint8))
            continue
        spec = QuantSpec.from_json(dst.manifest.tensor(t.name).quant)
        assert (spec.scheme, spec.dtype, spec.shape, spec.group_size) == ("int8", t.dtype, tuple(t.shape), None)
        codes, scales = quantize(src.read_tensor(t.name), "int8")
        assert torch.equal(dst.read_tensor(t.name), codes) and torch.equal(dst.read_tensor(spec.scales), scales)
    assert dst.manifest.model["quantization"]["dense_tensors"] == len(linears)
    scheme = "int8" if bits == 8 else "int4"
    info = dst.describe()
    n_weights = 2 * (3 if arch == "mixtral" else 2)  # per MoE layer: SwiGLU gate/up/down; fused gate_up/down
    n_weights *= 1 if arch == "gpt_oss" else 4
    assert info["schemes"]["int8"]["tensors"] == len(linears) + (n_weights if bits == 8 else 0)
    if bits == 4:
        assert info["schemes"]["int4"]["tensors"] == n_weights
    # bits per weight: the codes plus one float32 scale per row of 32 to 64 (int8) or scale and zero
    # per 64 (int4)
    bpw = info["schemes"][scheme]["bits_per_weight"]
    assert (8.25 < bpw <= 9.0) if bits == 8 else bpw == pytest.approx(4 + 64 / 64)
    assert info["quantization"]["format"] == ("int8" if bits == 8 else "int4-g64")
    if arch == "mixtral":  # (gpt-oss's float biases stay float, and weigh at these tiny sizes)
        ratio = info["expert_bytes"] / src.describe()["expert_bytes"]
        assert ratio < (0.27 if bits == 8 else 0.16), ratio
    for layer, e in [(0, 0), (1, 3)]:  # each weight decodes to within half a step of the float one
        before, after = src.read_expert(layer, e), dst.read_expert(layer, e)
        for entry in dst.manifest.chunk_tensors(dst.manifest.chunk(layer, e)):
            if entry.quant and "scheme" in entry.quant:
                spec = QuantSpec.from_json(entry.quant)
                back = dequantize(after[entry.name], after[spec.scales], spec)
                err = (back - before[entry.name]).abs().max()
                assert err <= before[entry.name].abs().max() / (15 if bits == 4 else 127)


def test_weights_the_scheme_cannot_hold_stay_and_are_listed(tmp_path, capsys):
    """The tiny Mixtral's experts are (48, 32) and (32, 48): no int4 row block of 64 fits them."""
    from helpers.hf_models import make_hf_checkpoint

    import_checkpoint(str(make_hf_checkpoint("mixtral", tmp_path / "hf")), str(tmp_path / "f32"))
    assert main(["store", "quantize", str(tmp_path / "f32"), str(tmp_path / "q4"), "--bits", "4",
                 "--group-size", "32", "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["quantized"] == 0 and len(report["kept"]) == 2 * 4 * 3
    assert all("not a multiple of" in why for why in report["kept"].values())  # of 64 rows, or of the group
    assert "kept as it is: model.layers.0.block_sparse_moe.experts.0.w1.weight: 48 output features" in out.err
    store = Store.open(str(tmp_path / "q4"))
    assert not store.is_compact() and store.describe()["quantization"]["kept"] == sorted(report["kept"])


# -- compute: offloaded equals resident -----------------------------------------------------------

BUDGETS = {
    "cache-25%-in-place": lambda eb, slot: dict(cpu_cache_bytes=eb // 4, ring_slots=2),
    "device-ring-3": lambda eb, slot: dict(device_memory_bytes=3 * slot),
    "cache-25%-no-prefetch": lambda eb, slot: dict(cpu_cache_bytes=eb // 4, prefetch=False),
    # hybrid decode (`inference.offload.hybrid`), every routed expert on the CPU's kernels in its stored format
    "hybrid-cpu": lambda eb, slot: dict(cpu_cache_bytes=eb // 4, device_memory_bytes=3 * slot, experts_on="cpu"),
}


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "llama4", "qwen3_next", "deepseek_v4"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_offloaded_quantized_experts_give_the_resident_quantized_models_tokens(stores, arch, bits, budget):
    from inference.offload.expert_ring import OffloadedExperts
    from semoe.decode.support import step_refusal

    path = stores(arch, bits)
    store = Store.open(path)
    sampling = SamplingConfig(max_new_tokens=16)
    resident = Engine.load(path, EngineConfig(dtype="float32"))
    try:
        want = resident.generate(PROMPT, sampling)
        one_call = resident._plan is not None and resident._plan.net is not None
    finally:
        resident.close()
    eb = sum(c.bytes for c in store.manifest.chunks)
    config = EngineConfig(dtype="float32", **BUDGETS[budget](eb, OffloadedExperts.slot_bytes(store, torch.float32)))
    engine = Engine.load(path, config)
    try:
        got = engine.generate(PROMPT, sampling)
        on_modules = step_refusal(engine.model_config) is not None  # offloaded, only the modules take it
    finally:
        engine.close()
    # the same bytes through the same kernels: exactly the same tokens and log-probs, where the
    # resident model steps kernel by kernel as the offloaded one does; in one call (its routers'
    # softmax in C, not torch) within float32 rounding of log-probs of magnitude ~5: 1e-5
    assert got.tokens == want.tokens
    if one_call and on_modules:
        # DeepSeek-V4 offloaded decodes on its modules (hybrid or not), whose prompt products multiply
        # float activations where the one-call step's int4 and int8 products quantize them to int8 per
        # block of 32: about 1e-3 of the activations, 3e-4 of a log-prob measured with int4; 2e-3
        assert got.logprobs == pytest.approx(want.logprobs, rel=0, abs=2e-3)
    elif budget.startswith("hybrid"):
        # the model's modules around the same expert kernels: float32 sums in other orders, 1e-4
        assert got.logprobs == pytest.approx(want.logprobs, rel=0, abs=1e-4)
    elif one_call:
        assert got.logprobs == pytest.approx(want.logprobs, rel=0, abs=1e-5)
    else:
        assert got.logprobs == want.logprobs


# Decode's log-probs, fast kernels against the reference, along the same tokens. Within a step the
# two differ in the order of float32 sums only, but each layer quantizes its input to int8 codes
# again, and a value on a rounding boundary takes the neighbouring code (one step, amax / 127 of its
# block): seen up to 3.3e-3 on these random models. A wrong scale, sum or bias moves them by O(1).
DECODE_LOGPROB_ATOL = 1e-2


def _decode_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probs (len(tokens), V) of each step of decoding `tokens` after `prompt`, one token a step."""
    from semoe.model.attention import KVCache
    from semoe.decode.generate import decode_one_token, prefill

    cache = KVCache.empty(model.config, 1, len(prompt) + len(tokens), dtype=torch.float32)
    logits = prefill(model, torch.tensor([prompt]), cache)
    steps = []
    for t in tokens:
        steps.append(torch.log_softmax(logits.float(), dim=-1)[0])
        logits = decode_one_token(model, torch.tensor([[t]]), cache)
    return torch.stack(steps)


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("bits", [8, 4])
def test_decode_with_the_fast_kernels_follows_the_reference_kernels(stores, arch, bits):
    """Greedy decoding, resident: semoe's CPU kernels (int8 activations, integer block sums, the fused
    expert) against the plain reference of the same arithmetic, step by step along the reference's
    own greedy tokens: log-probs within DECODE_LOGPROB_ATOL, and the same next token wherever the
    reference's lead over its runner-up exceeds twice that (a smaller lead is a tie that the order
    of float32 sums may break either way, after which free-running sequences part). The offloaded
    engine gives the resident one's tokens exactly (above)."""
    from semoe.checkpoints.model_io import load_store
    from semoe.decode.generate import generate

    ref_model = load_store(stores(arch, bits), kernel="reference")
    tokens = generate(ref_model, PROMPT, SamplingConfig(max_new_tokens=16)).tokens
    ref = _decode_logprobs(ref_model, PROMPT, tokens)
    fast = _decode_logprobs(load_store(stores(arch, bits)), PROMPT, tokens)
    assert float((fast - ref).abs().max()) < DECODE_LOGPROB_ATOL
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * DECODE_LOGPROB_ATOL
    assert int(clear.sum()) >= len(tokens) // 2  # the comparison below is not empty
    assert torch.equal(fast.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "llama4", "qwen3_next", "qwen3_5_moe", "deepseek_v4"])
def test_the_resident_quantized_model_follows_the_reference_kernel(stores, arch):
    from semoe.checkpoints.model_io import load_store

    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        f32 = load_store(stores(arch, 32))(ids)
        for bits in (8, 4):
            fast = load_store(stores(arch, bits))(ids).logits
            ref = load_store(stores(arch, bits), kernel="reference")(ids)
            # the fast kernels against the reference: x quantized per block of 32 or bfloat16 activations
            # and scales (see the kernel test)
            assert _relative(fast, ref.logits) < 2e-2, bits
            # and quantization moves the float32 model's logits by little, int8 less than int4, at every
            # position whose experts it did not change (a near tie of this random router may flip)
            same = torch.stack([(ref.router[k].ids_NK == f32.router[k].ids_NK).all(-1) for k in f32.router]).all(0)
            assert int(same.sum()) >= len(PROMPT) - 2, bits
            # (DeepSeek-V4's int4: 0.109 measured; every layer of its tiny model is MoE, and its routed
            # output is scaled by 1.5 before two streams carry it on)
            int4 = 0.15 if arch == "deepseek_v4" else 0.1
            assert _relative(ref.logits[0, same], f32.logits[0, same]) < (0.02 if bits == 8 else int4), bits


def test_auto_dense_is_int8_only_on_cpu_beside_int8_or_int4_experts():
    """The choice a GPU load makes, checked without one: CUDA keeps dense weights as stored (its
    products dequantize compact weights into scratch, slower than the float weight), as do a
    checkpoint's own FP8/MXFP4 experts; an explicit scheme is taken anywhere."""
    from semoe.model.compact_linear import resolve_dense

    assert resolve_dense("auto", device="cpu", expert_schemes={"int8"}) == "int8"
    assert resolve_dense("auto", device="cpu", expert_schemes={"int4"}) == "int8"
    assert resolve_dense("auto", device="cuda", expert_schemes={"int8"}) == "float"
    assert resolve_dense("auto", device="cpu", expert_schemes={"mxfp4"}) == "int8"  # gpt-oss as shipped
    assert resolve_dense("auto", device="cuda", expert_schemes={"mxfp4"}) == "float"
    assert resolve_dense("auto", device="cpu", expert_schemes={"fp8"}) == "float"
    assert resolve_dense("auto", device="cpu", expert_schemes=set()) == "float"
    assert resolve_dense("int4", device="cuda:1", expert_schemes=set()) == "int4"
    with pytest.raises(ValueError, match="dense must be one of auto, float, int8, int4, got 'int3'"):
        resolve_dense("int3", device="cpu", expert_schemes=set())


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("bits", [8, 4])
def test_dense_weights_are_int8_on_cpu_beside_quantized_experts_unless_asked_otherwise(stores, arch, bits, capsys,
                                                                                      monkeypatch):
    from torch import nn

    from semoe.checkpoints.model_io import load_store
    import semoe.checkpoints.model_io
    import storage.quant
    from semoe.model.compact_linear import CompactLinear, compact_dense_linears, stack_projections, weight_bytes

    for module in (semoe.checkpoints.model_io, storage.quant):  # several blocks of rows per weight of the tiny models
        monkeypatch.setattr(module, "QUANTIZE_ROWS", 64)
    q = load_store(stores(arch, bits))
    # auto on CPU: every dense linear (attention with its biases, lm_head) int8; the routers, the
    # embedding and the norms as stored
    assert isinstance(q.lm_head, CompactLinear) and q.lm_head.weight.spec.scheme == "int8"
    for b in q.layers:  # q, k and v stacked into one product
        for n in ("qkv_proj", "o_proj"):
            lin = getattr(b.attn, n)
            assert isinstance(lin, CompactLinear) and lin.weight.spec.scheme == "int8", n
        assert b.attn.qkv_sizes == [b.attn.config.num_heads * b.attn.config.head_dim,
                                    *[b.attn.config.num_kv_heads * b.attn.config.head_dim] * 2]
        assert not hasattr(b.attn, "q_proj")
    assert not [n for n, m in q.named_modules() if isinstance(m, nn.Linear)]
    V, D = q.config.vocab_size, q.config.hidden_size
    assert weight_bytes(q.lm_head) == V * D + 4 * V  # codes and a float32 scale per row
    # int4 on request: where it holds the shape (out features in blocks of 64), the lm_head int8
    q4 = load_store(stores(arch, bits, "float"), dense="int4")  # from float dense weights
    assert q4.lm_head.weight.spec.scheme == "int8"
    for b in q4.layers:  # q int4, k and v int8 (32 rows here): not stacked
        assert b.attn.qkv_proj is None
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(b.attn, n)
            assert lin.weight.spec.scheme == ("int4" if lin.out_features % 64 == 0 else "int8"), n
    assert any(getattr(b.attn, "q_proj").weight.spec.scheme == "int4" for b in q4.layers)
    plain = load_store(stores(arch, bits, "float"), dense="float")  # compact experts, float dense weights
    assert isinstance(plain.lm_head, nn.Linear)
    # the store's int8 dense weights are those the loader makes of float ones: the same logits
    at_load = load_store(stores(arch, bits, "float"))
    with torch.no_grad():
        assert torch.equal(q(torch.tensor([PROMPT])).logits, at_load(torch.tensor([PROMPT])).logits)
    # stored as the loader quantizes float weights a block of rows at a time: the codes and scales of
    # the float store's weights
    again = load_store(stores(arch, 32), dense="float")
    compact_dense_linears(again, "int8")
    stack_projections(again)
    for name, lin in q.named_modules():
        if isinstance(lin, CompactLinear):
            other = again.get_submodule(name).weight
            assert torch.equal(lin.weight.codes, other.codes) and torch.equal(lin.weight.scales, other.scales), name
    assert isinstance(load_store(stores(arch, 32)).lm_head, nn.Linear)  # float experts: dense as stored
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        a, b, c = q(ids), plain(ids), q4(ids)
        # quantized dense weights move the logits by little wherever the routing stayed the same
        for got, tol in ((a, 0.02), (c, 0.1)):
            same = torch.stack([(got.router[k].ids_NK == b.router[k].ids_NK).all(-1) for k in b.router]).all(0)
            assert int(same.sum()) >= len(PROMPT) - 2
            assert _relative(got.logits[0, same], b.logits[0, same]) < tol
    # the flag: float keeps them, anything else is refused by name
    ids = ",".join(map(str, PROMPT))
    assert main(["generate", "--model", stores(arch, bits), "--prompt-ids", ids, "--max-new-tokens", "2",
                 "--device", "cpu", "--dense", "float", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", stores(arch, bits), "--prompt-ids", ids, "--dense", "int3"])
    assert e.value.code == 2 and "--dense: invalid choice: 'int3'" in capsys.readouterr().err


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int4", 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_projections_give_each_ones_bits(scheme, group, bias):
    """q, k and v as one compact product (`stacked_rows`): the outputs side by side, bit for bit, for
    a decoding step's row (semoe's kernels) and for a prompt's rows (torch's packed ops); weights that
    cannot share a product are not stacked."""
    from torch import nn

    from semoe.model.compact_linear import compact_dense_linears, stacked_rows

    torch.manual_seed(8)
    parts = nn.ModuleList([nn.Linear(96, o, bias=bias) for o in (128, 64, 64)])
    compact_dense_linears(parts, scheme, group_size=group or 32)
    stacked = stacked_rows(list(parts))
    for rows in (1, 5):
        x = torch.randn(rows, 96)
        with torch.no_grad():
            assert torch.equal(stacked(x), torch.cat([p(x) for p in parts], dim=-1)), rows
    mixed = nn.ModuleList([nn.Linear(96, 64), nn.Linear(96, 64, bias=False)])
    compact_dense_linears(mixed, scheme, group_size=group or 32)
    assert stacked_rows(list(mixed)) is None  # one has a bias, the other not


def test_the_cache_and_the_ring_hold_compact_bytes(stores):
    from inference.offload.expert_ring import OffloadedExperts

    f32, q8, q4 = (Store.open(stores("mixtral", b)) for b in (32, 8, 4))
    slot = {b: OffloadedExperts.slot_bytes(s, torch.float32) for b, s in ((32, f32), (8, q8), (4, q4))}
    assert slot[8] / slot[32] < 0.27 and slot[4] / slot[32] < 0.16
    # a CPU cache the size of the int8 chunk files (a third of the float32 ones here: at these tiny sizes
    # the block padding of each tensor in a chunk weighs) holds every int8 expert: nothing is read per token
    budget = sum(c.bytes for c in q8.manifest.chunks) + max(c.bytes for c in q8.manifest.chunks)
    assert budget < 0.5 * sum(c.bytes for c in f32.manifest.chunks)
    per_token = {}
    for bits, store in ((32, f32), (8, q8)):
        engine = Engine.load(store.root, EngineConfig(dtype="float32", cpu_cache_bytes=budget))
        try:
            per_token[bits] = engine.generate(PROMPT, SamplingConfig(max_new_tokens=8)).stats["ssd_bytes_per_token"]
        finally:
            engine.close()
    assert per_token[8] == 0 and per_token[32] > 0


# -- export, training, CLI ----------------------------------------------------------------------

def test_export_of_a_quantized_store_is_dequantized_in_the_source_dtype_and_says_so(stores, tmp_path, capsys):
    import transformers

    path = stores("gpt_oss", 4)
    assert main(["store", "export", path, str(tmp_path / "out")]) == 0
    assert "lossy" in capsys.readouterr().err
    got = load_safetensors_dir(tmp_path / "out")
    plain = load_safetensors_dir(tmp_path / "out")  # names, dtypes and shapes of a float checkpoint
    src = load_safetensors_dir(stores("gpt_oss", 32).replace("store", "hf"))
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in src.items()}
    store = Store.open(path)
    name = "model.layers.1.mlp.experts.down_proj"
    views = store.read_expert(1, 2)
    spec = QuantSpec.from_json(store.manifest.tensor(name, stack_index=2).quant)
    assert torch.equal(plain[name][2], dequantize(views[name], views[spec.scales], spec))
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))  # loads as a plain checkpoint


def test_training_from_a_quantized_store_starts_from_its_dequantized_weights(stores, tmp_path, caplog):
    """The first loss of a run from the int8 store is the loss of its lossy export (dequantized weights)."""
    import torch.nn.functional as F
    from helpers.hf_models import add_word_tokenizer

    from semoe.checkpoints.model_io import load_hf
    from semoe.train.data import BatchSampler, ShardSet
    from semoe.train.trainer import Trainer
    from semoe.train.config import TrainConfig

    words = "the cat sat on a mat and dog ran to big red blue one two three".split()
    text = tmp_path / "words.txt"
    text.write_text("\n".join(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(200)))
    hf = tmp_path / "hf"
    export_checkpoint(Store.open(stores("mixtral", 8)), str(hf))
    add_word_tokenizer(hf)
    import_checkpoint(str(hf), str(tmp_path / "tok-f32"))  # for the tokenizer only
    q8 = tmp_path / "q8"
    quantize_store(str(tmp_path / "tok-f32"), str(q8), QuantizeConfig(bits=8))
    cfg = TrainConfig(out=str(tmp_path / "run"), data=str(text), init_from=str(q8), steps=1, batch_size=2,
                      seq_len=16, lr=1e-4, checkpoint_every=1)
    with caplog.at_level("WARNING"):
        trainer = Trainer(cfg)
        first = next(iter(trainer.run())).loss
    assert trainer.source.is_compact()
    # one warning names the store and its format (the record's arguments, not its prose)
    assert [r.args for r in caplog.records if r.name == "semoe.train.trainer" and r.levelname == "WARNING"] == \
        [(str(q8), "int8")]
    ids, tgt = BatchSampler(ShardSet.open(str(tmp_path / "run" / "data" / "train")), 2, 16, seed=0).batch(0)
    # the oracle: the int8 store's own export of tok-f32, i.e. the weights dequantized
    export_checkpoint(Store.open(str(q8)), str(tmp_path / "deq"))
    with torch.no_grad():
        logits = load_hf(str(tmp_path / "deq"))(ids).logits
    want = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1)))
    assert first == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--bits", "3"], "--bits must be 8 or 4, got 3"),
    (["--bits", "4", "--group-size", "100"], "--group-size must be one of 32, 64, 128, 256, got 100"),
])
def test_bad_quantize_flags_give_one_line_exit_2_and_write_nothing(stores, tmp_path, capsys, args, message):
    assert main(["store", "quantize", stores("mixtral", 32), str(tmp_path / "out"), *args]) == 2
    assert capsys.readouterr().err.splitlines() == [f"semoe: error: {message}"]
    assert not (tmp_path / "out").exists()


def test_quantize_refuses_a_non_empty_target_and_a_quantized_source(stores, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["store", "quantize", stores("mixtral", 32), str(tmp_path / "full"), "--bits", "8"]) == 2
    assert capsys.readouterr().err.strip() == f"semoe: error: {tmp_path / 'full'}: target directory is not empty"
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert main(["store", "quantize", stores("mixtral", 8), str(tmp_path / "again"), "--bits", "4"]) == 2
    assert "its experts are already quantized (int8)" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()
    with pytest.raises(BadInputError):
        QuantizeConfig(bits=16)


def test_a_store_quantized_with_float_dense_weights_gets_them_int8_by_quantizing_it_again(stores, tmp_path, capsys):
    """`store quantize --bits N` of a store quantized to the same format with --dense float: its experts
    copied as they are, its dense weights made int8: every tensor as quantizing the float store gives;
    another format is refused."""
    assert main(["store", "quantize", stores("mixtral", 4, "float"), str(tmp_path / "up"), "--bits", "4",
                 "--group-size", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dense_quantized"] > 0 and report["dense_bytes_after"] < report["dense_bytes_before"] / 3
    up, direct = Store.open(str(tmp_path / "up")), Store.open(stores("mixtral", 4))
    assert sorted(t.name for t in up.manifest.tensors) == sorted(t.name for t in direct.manifest.tensors)
    for t in direct.manifest.dense():
        assert torch.equal(up.read_tensor(t.name).view(torch.uint8), direct.read_tensor(t.name).view(torch.uint8))
    for c in direct.manifest.chunks:
        assert torch.equal(up.read_chunk(c.layer, c.expert), direct.read_chunk(c.layer, c.expert))
    q = up.manifest.model["quantization"]
    assert (q["format"], q["dense"], q["tensors"]) == ("int4-g64", "int8", direct.manifest.model["quantization"]["tensors"])
    assert main(["store", "quantize", stores("mixtral", 4, "float"), str(tmp_path / "other"), "--bits", "8"]) == 2
    assert "its experts are already quantized (int4-g64)" in capsys.readouterr().err


def test_import_quantize_verify_ls_gc_and_info_cover_compact_experts(stores, tmp_path, capsys):
    hf = stores("mixtral", 32).replace("store", "hf")
    assert main(["store", "import", hf, str(tmp_path / "q"), "--quantize", "int4", "--group-size", "64"]) == 0
    capsys.readouterr()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".import-")]  # the staging copy is gone
    q = Store.open(str(tmp_path / "q"))
    ours = Store.open(stores("mixtral", 4))
    for c in q.manifest.chunks:  # the same bytes as quantizing the imported store
        assert torch.equal(q.read_chunk(c.layer, c.expert), ours.read_chunk(c.layer, c.expert))
    assert main(["store", "verify", str(tmp_path / "q"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["store", "ls", str(tmp_path / "q"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["tensors"]
    assert {r["scheme"] for r in rows if r["group"] == "expert"} == {"int4", "scales"}
    assert {r["scheme"] for r in rows if r["group"] == "dense"} == {None, "int8", "scales"}
    assert main(["store", "gc", str(tmp_path / "q"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed_files"] == 0
    assert main(["store", "info", str(tmp_path / "q")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "quantized     int4-g64 by semoe store quantize (24 tensors)" in lines
    assert any(line.startswith("scheme int4   24 weights, ") and line.endswith("5.00 bits per weight")
               for line in lines), lines
    # a damaged scale is found by verify, named
    entry = next(t for t in q.manifest.tensors if t.name.endswith("experts.1.w2.weight_scale_zero"))
    path = q.path(entry.file)
    with open(path, "r+b") as f:
        f.seek(entry.offset)
        b = f.read(1)
        f.seek(entry.offset)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["store", "verify", str(tmp_path / "q")]) == 1
    assert entry.name in capsys.readouterr().err
