"""DecodePlan: a decoding step as a run of kernel calls, the same bits as the step through the modules;
and, for a model whose weights are all in memory, the whole step in one call (`decode_step`).

Models are small and random; each test steps the same tokens through the plan and through the modules
(`decode_one_token`) from the same prefilled cache and asserts equal logits, or equal tokens and
log-probs for whole generations, resident and offloaded. The one-call step computes the router's
softmax and float experts' SiLU with C's expf instead of torch's ops: its logits must agree within
WHOLE_ATOL (float32 rounding through a few layers is about 1e-7 at these logits of magnitude ~1;
the bound leaves a hundredfold margin and still catches any wrong weight, scale or bias, which move
logits by 1e-2 or more), with the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from helpers.arch_stores import ARCHS, CASES  # the arch_stores fixture: tests/conftest.py
from helpers.kernels import needs_kernels

from inference.engine import Engine
from inference.engine_config import EngineConfig
from semoe.kernels import loader
from semoe.model.attention import KVCache
from semoe.checkpoints.model_io import load_store, save_store
from semoe.model.config import MoEConfig
from semoe.decode.plan import DecodePlan
from semoe.decode.support import NotOnFastPath, step_refusal
from semoe.decode.loop import SamplingConfig
from semoe.decode.generate import decode_one_token, generate, prefill
from semoe.model.moe_gpt import MoEGPT
from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store
from storage.store import Store
import semoe.decode.generate

pytestmark = needs_kernels

PROMPT = [3, 17, 5, 29, 11, 2, 40, 8]
TOKENS = [7, 61, 23, 4, 90, 12, 33, 5, 71, 18, 2, 44]
WHOLE_ATOL = 1e-5
SHAPE = dict(vocab_size=96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, ffn_size=128,
             moe_ffn_size=128, num_experts=4, top_k=2, max_position=64, rms_norm_eps=1e-5)


def _model(**over) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(MoEConfig(**{"arch": "mixtral", **SHAPE, **over})).eval()


def _steps(model: MoEGPT, plan: DecodePlan | None) -> tuple[torch.Tensor, int]:
    """Logits of each of TOKENS' steps after PROMPT, and how many steps the plan took."""
    cache = KVCache.empty(model.config, 1, len(PROMPT) + len(TOKENS))
    with torch.no_grad():
        prefill(model, torch.tensor([PROMPT]), cache)
    out, planned = [], 0
    for t in TOKENS:
        if plan is not None and plan.takes(cache):
            out.append(plan.step(t, cache))
            planned += 1
        else:
            out.append(decode_one_token(model, torch.tensor([[t]]), cache))
    return torch.cat(out), planned


def _held(cache: KVCache) -> list[torch.Tensor]:
    """What a cache holds: every layer's k and v (of no elements for a linear layer) and the layers' own
    states (the convolution's and the delta rule's; DeepSeek-V4's window, pending tokens and entries)."""
    return [t for t in (*cache.k, *cache.v, *cache.state_tensors()) if t.numel()]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """bits -> a store of the Mixtral-shaped model (32: float32; 8 and 4: its quantized experts)."""
    root = tmp_path_factory.mktemp("plan")
    save_store(_model(), str(root / "f32"))
    paths = {32: str(root / "f32")}
    for bits in (8, 4):
        quantize_store(paths[32], str(root / f"int{bits}"), QuantizeConfig(bits=bits, group_size=64))
        paths[bits] = str(root / f"int{bits}")
    return paths


@pytest.mark.parametrize("bits", [32, 8, 4])
@pytest.mark.parametrize("dense", ["auto", "float", "int4"])
@pytest.mark.parametrize("whole", [False, True])
def test_the_plans_steps_are_the_module_steps(stores, bits, dense, whole):
    """Resident stores: float32 experts and dense weights, int8/int4 experts with dense weights float,
    int8 (auto) or int4 (q int4, k/v int8: three products instead of one). Kernel by kernel: the
    same bits; in one call: within WHOLE_ATOL, the same greedy tokens."""
    model = load_store(stores[bits], dense=dense)
    plan = DecodePlan(model, whole=whole)
    assert (plan.net is not None) == whole
    got, planned = _steps(model, plan)
    want, _ = _steps(model, None)
    assert planned == len(TOKENS)
    _agree(got, want, whole)


def _plan_agrees(model: MoEGPT, whole: bool, rtol: float | None = None) -> None:
    """Every step through the plan (in one call where `whole`) and logits that agree with the
    modules': kernel by kernel the same bits, or within `rtol` relative where the plan computes in
    another order (latent attention); within WHOLE_ATOL in one call; the same greedy tokens."""
    plan = DecodePlan(model, whole=whole)
    assert (plan.net is not None) == whole, plan.whole_refusal
    got, planned = _steps(model, plan)
    want, _ = _steps(model, None)
    assert planned == len(TOKENS)
    if rtol is None or whole:
        _agree(got, want, whole)
    else:
        assert _relative(got, want) < rtol and torch.equal(got.argmax(-1), want.argmax(-1))


def _agree(got: torch.Tensor, want: torch.Tensor, whole: bool) -> None:
    if not whole:
        assert torch.equal(got, want)
        return
    torch.testing.assert_close(got, want, rtol=0, atol=WHOLE_ATOL)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("window", [None, 12])
def test_biases_dense_layers_three_choices_and_a_window(whole, window):
    """q/k/v and output biases, a dense feed-forward layer, the sum of three choices per token, and a
    sliding window that the later steps reach: every step through the plan, the same bits as the
    modules' kernel by kernel (their step takes the same attention kernel, window and all), within
    WHOLE_ATOL in one call."""
    model = _model(attention_bias=True, o_proj_bias=True, moe_layers=(0, 2), top_k=3, sliding_window=window)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape) * 0.1)
    _plan_agrees(model, whole)


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("variant", [dict(qk_norm="head"), dict(qk_norm="full", clip_qkv=0.5),
                                     dict(attention_sinks=True, rope_dim=8, sliding_window=12)],
                         ids=["head-norms", "full-norms-clip", "sinks-partial-rotary-window"])
def test_attention_variants_kernel_by_kernel_and_in_one_call(whole, variant):
    """q/k norms per head (Qwen3-MoE, GLM) and over all heads with clipping (OLMoE), sinks with half of
    each head's dims rotated and a window the later steps reach: kernel by kernel the modules' bits,
    within WHOLE_ATOL in one call. Norm weights and sinks are drawn away from their initial values,
    so that a step leaving one out moves the logits."""
    model = _model(**variant)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinks" in name or "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 1.5)
    _plan_agrees(model, whole)


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("variant", [dict(rope_interleave=True), dict(qk_norm="head_after_rope", rope_dim=8)],
                         ids=["interleaved-pairs", "head-norms-after-partial-rotation"])
def test_rotation_before_the_attention_kernel(whole, variant):
    """Rotary over interleaved pairs (ERNIE) and per-head q/k norms after a partial rotation (Hunyuan):
    q and k rotated (and normed) before the attention kernel, which then rotates nothing. The
    modules attend through torch's ops there, the plan through the kernel (the same sums in another
    order): within ARCH_RTOL kernel by kernel, WHOLE_ATOL in one call. Attention weights are drawn
    eight times larger, and norm weights away from 1, so that the rotation and the norms move the logits."""
    model = _model(**variant)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attn." in name and p.dim() == 2:
                p.mul_(8.0)
            elif "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 1.5)
    _plan_agrees(model, whole, rtol=ARCH_RTOL)


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("variant", [dict(q_lora_rank=None, rope_interleave=True),
                                     dict(q_lora_rank=24, rope_interleave=False, attention_bias=True)],
                         ids=["direct-query-interleaved", "low-rank-query-halves-biased"])
def test_latent_attention_kernel_by_kernel_and_in_one_call(whole, variant):
    """DeepSeek's latent attention in the absorbed form, its query straight from h or through a
    normed low rank, rotary over interleaved pairs or halves: within ARCH_RTOL of the modules
    kernel by kernel (attention in another order of the same sums), WHOLE_ATOL in one call. The
    attention weights are drawn eight times larger than at initialisation so that scores, and with
    them the rotary parts, move the logits (at initialisation each head's softmax is near uniform)."""
    model = _model(attention="mla", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                   **variant)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attn." in name and p.dim() == 2:
                p.mul_(8.0)
            elif ".attn." in name and name.endswith("bias"):
                p.copy_(torch.randn(p.shape) * 0.1)
    _plan_agrees(model, whole, rtol=ARCH_RTOL)


ROUTERS = {
    "grouped-sigmoid-top2-corrected-shared": dict(router="grouped", router_scores="sigmoid", score_correction_bias=True,
                                                  n_group=2, topk_group=1, group_score="top2", norm_topk_prob=True,
                                                  routed_scaling_factor=2.5, shared_expert_size=64,
                                                  shared_expert_gate=False),
    "grouped-softmax-max": dict(router="grouped", router_scores="softmax", n_group=2, topk_group=1,
                                norm_topk_prob=False, routed_scaling_factor=1.5),
    "topk-softmax-biased-gated-shared": dict(router="topk_softmax", router_bias=True, shared_expert_size=64,
                                             shared_expert_gate=True),
}


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_routers_and_shared_experts_kernel_by_kernel_and_in_one_call(whole, router):
    """Grouped routers (sigmoid or softmax scores, groups by their best one or two, a correction
    bias on the choice, routed scaling), top-k then softmax with a router bias, and shared experts
    with and without a gate: kernel by kernel the modules' bits, within WHOLE_ATOL in one call.
    Biases are drawn large enough to change which experts are chosen."""
    model = _model(**ROUTERS[router])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "correction" in name or name.endswith("router.bias"):
                p.copy_(torch.randn(p.shape) * 0.5)
    _plan_agrees(model, whole)


def _clamped_model(root, bits: int, limit: float) -> MoEGPT:
    """A model of gpt-oss's experts with weights and biases drawn large enough for `limit` to bite,
    through a store: float32, or its experts int8/int4."""
    model = _model(expert_mlp="clamped_swiglu", swiglu_limit=limit)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("b_gate_up", "b_down")):
                p.copy_(torch.randn(p.shape) * 0.05)
            elif name.endswith(("w_gate_up", "w_down")):
                p.mul_(3.0)
    save_store(model, str(root / "f32"))
    if bits == 32:
        return load_store(str(root / "f32"))
    quantize_store(str(root / "f32"), str(root / "q"), QuantizeConfig(bits=bits, group_size=32))
    return load_store(str(root / "q"), dense="float")


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("bits", [32, 8, 4])
def test_clamped_experts_kernel_by_kernel_and_in_one_call(tmp_path, whole, bits):
    """gpt-oss's experts (gate and up interleaved in one weight, with biases; float ones multiplied
    in-major as stored, int8/int4 ones out-major) under a limit that gate and up cross, up on both
    sides: kernel by kernel the modules' bits, within WHOLE_ATOL in one call. The limit bites: at
    the default one the same weights' logits differ by more than a hundred times WHOLE_ATOL."""
    model = _clamped_model(tmp_path / "tight", bits, 0.05)
    plan = DecodePlan(model, whole=whole)
    assert (plan.net is not None) == whole
    got, planned = _steps(model, plan)
    want, _ = _steps(model, None)
    assert planned == len(TOKENS)
    _agree(got, want, whole)
    unclamped, _ = _steps(_clamped_model(tmp_path / "default", bits, 7.0), None)
    assert (unclamped - want).abs().max() > 100 * WHOLE_ATOL


def test_generation_resident_and_offloaded_equals_the_module_path(stores):
    """`generate` decodes through the plan; with it switched off, the same tokens and log-probs, for
    the resident int4 model (its step in one call: log-probs within WHOLE_ATOL) and for its experts
    offloaded behind a quarter-size CPU cache (kernel by kernel: the same bits)."""
    sampling = SamplingConfig(max_new_tokens=12)
    budget = {"cpu_cache_bytes": sum(c.bytes for c in Store.open(stores[4]).manifest.chunks) // 4, "ring_slots": 2}
    results = {}
    for name, cfg in (("resident", {}), ("offloaded", budget)):
        for planned in (True, False):
            engine = Engine.load(stores[4], EngineConfig(dtype="float32", **cfg))
            try:
                if planned:  # resident experts are all in memory: the one-call step; offloaded ones arrive
                    assert (engine._plan.net is not None) == (name == "resident")
                else:  # the engine's plan is what `generate` decodes with: none, the modules
                    engine._plan = None
                results[name, planned] = engine.generate(PROMPT, sampling)
            finally:
                engine.close()
    ref = results["resident", False]
    for key, res in results.items():
        assert res.tokens == ref.tokens, key
        if key == ("resident", True):
            assert res.logprobs == pytest.approx(ref.logprobs, rel=0, abs=WHOLE_ATOL)
        else:
            assert res.logprobs == ref.logprobs, key


def test_hooks_send_the_step_through_the_modules():
    """A forward hook anywhere (the decode profile's, a routing trace's) expects the module calls."""
    model = _model()
    plan = DecodePlan.build(model)
    cache = KVCache.empty(model.config, 1, 16)
    assert plan.takes(cache)
    handle = model.layers[1].ffn.register_forward_hook(lambda *a: None)
    assert not plan.takes(cache)
    handle.remove()
    assert plan.takes(cache)
    model.train()
    assert not plan.takes(cache)


def test_models_the_plan_does_not_take():
    with pytest.raises(NotOnFastPath, match="not float32 on CPU"):
        DecodePlan(_model().to(torch.bfloat16))


def test_the_engine_generates_with_its_own_plan(stores, monkeypatch):
    """The engine owns one plan for its model and hands it to `generate`: no second plan is built
    per request, and the plan the engine holds is the one that stepped the tokens."""
    engine = Engine.load(stores[4], EngineConfig(dtype="float32"))
    try:
        plan, stepped = engine._plan, []
        step = plan.step
        monkeypatch.setattr(plan, "step", lambda token, cache: stepped.append(token) or step(token, cache))
        monkeypatch.setattr(semoe.decode.generate.DecodePlan, "build",
                            classmethod(lambda cls, m: pytest.fail("generate built a second plan")))
        res = engine.generate(PROMPT, SamplingConfig(max_new_tokens=6))
        assert stepped == res.tokens[:-1]  # every token after the prefill's, through the engine's plan
    finally:
        engine.close()


def test_generate_with_a_plan_gives_the_tokens_without():
    model = _model()
    sampling = SamplingConfig(max_new_tokens=10, temperature=0.8, seed=3)
    a = generate(model, PROMPT, sampling)
    b = generate(model, PROMPT, sampling, plan=None)
    assert a.tokens == b.tokens and a.logprobs == pytest.approx(b.logprobs, rel=0, abs=WHOLE_ATOL)


# -- every architecture -----------------------------------------------------------------------------

# float32 sums in another order (per-head norms of many heads, latent attention in the absorbed form
# against the module path's expanded K and V) move logits of magnitude ~1 by ~1e-7; a wrong weight,
# scale, bias or mask moves them by 1e-2 or more
ARCH_RTOL = 1e-5


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# the kernels quantize activations to int8 for int8, int4 and MXFP4 weights, where the modules keep
# them float: the prompt pass's last logits sit up to 1.4% of the largest from the modules' (measured
# over every architecture and format of CASES); twice that, and still far under a wrong weight's move
LOW_PRECISION_RTOL = 3e-2


def _same_greedy_or_near_tie(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The same greedy token as `ref`, or one `ref` scores within the two paths' largest difference of
    its own best: a near tie that int8 activations can flip (random weights make a few)."""
    mine, best = got.argmax(-1), ref.argmax(-1)
    margin = (ref.gather(-1, best[..., None]) - ref.gather(-1, mine[..., None])).max().item()
    assert torch.equal(mine, best) or margin <= (got - ref).abs().max().item(), (mine, best, margin)


# int8, int4 and MXFP4 weights multiply int8 activations: an activation within float32 rounding of a
# code boundary can round to the next code in one path and not the other, which moves that step's
# logits by up to 0.7% of the largest (measured: glm_moe_dsa int8, step 0, its last layer's output
# product after latent attention's absorbed sums). Such a flip is rare; a wrong weight moves every step.
FLIP_RTOL = 2e-2
QUANTIZED_ACTIVATIONS = ("int8", "int4", "mxfp4")


@pytest.mark.parametrize("arch, fmt", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_every_architecture_decodes_through_the_plan(arch_stores, arch, fmt):
    """Each architecture's decoding steps all go through the plan (never the modules), in its stored
    format: the one-call step (grouped, biased and top-k-then-softmax routers, shared experts, latent
    attention, DeepSeek sparse attention's indexer, Llama-4's parts, clamped experts and FP8 experts
    included), and kernel by kernel. Logits within ARCH_RTOL of the modules' kernel by kernel,
    WHOLE_ATOL in one call (with int8 activations: every step within FLIP_RTOL and most within
    WHOLE_ATOL); the same greedy tokens."""
    model = load_store(arch_stores(arch, fmt))
    plan = DecodePlan.build(model)
    assert plan is not None
    assert plan.net is not None, plan.whole_refusal  # FP8 and MXFP4 experts included, as stored
    want, _ = _steps(model, None)
    by_kernel = DecodePlan.build(model, whole=False)  # None where only the one-call step takes the model
    assert (by_kernel is None) == (step_refusal(model.config) is not None)
    for p in (plan, by_kernel) if by_kernel is not None else (plan,):
        got, planned = _steps(model, p)
        assert planned == len(TOKENS)
        if p.net is None:
            assert _relative(got, want) < ARCH_RTOL
        elif fmt in QUANTIZED_ACTIVATIONS:
            steps = [_relative(g, w) for g, w in zip(got, want)]
            if model.config.attention == "compressed":
                # DeepSeek-V4 keeps a flipped step's key and compressed entry for every later step (and its
                # indexer may then choose other entries): every step within FLIP_RTOL, the first within
                # WHOLE_ATOL (measured on the AVX2 build: a flip at step 3, 1.2e-2 at most after it)
                assert max(steps) < FLIP_RTOL and steps[0] < WHOLE_ATOL, steps
            else:
                assert max(steps) < FLIP_RTOL and sorted(steps)[len(steps) // 2] < WHOLE_ATOL, steps
        else:
            assert _relative(got, want) < WHOLE_ATOL
        assert torch.equal(got.argmax(-1), want.argmax(-1))


# 80 positions: past the prompt pass's first block of 64 rows
LONG = [(7 * i + 3) % 90 for i in range(80)]


@pytest.mark.parametrize("arch, fmt", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_the_prompt_pass_is_the_plans_steps_for_every_architecture(arch_stores, arch, fmt):
    """`DecodePlan.prefill` (the torch-free runner's layer-major prompt pass over the resident
    experts) against the plan's one-call step token by token: the last position's logits within
    WHOLE_ATOL relative to the largest (the same products row by row; attention's sums may run in
    another order), every layer's k and v within WHOLE_ATOL of the largest, the cache advanced alike,
    and the steps after it the same. The modules' float prefill is a looser reference for the integer
    and low-precision formats (the kernels quantize activations to int8 for int8, int4 and MXFP4
    weights; FP8 weights go through other code there), so it is held to the same greedy token."""
    model = load_store(arch_stores(arch, fmt))
    plan = DecodePlan(model)
    assert plan.net is not None, plan.whole_refusal
    c = model.config
    caches = [KVCache.empty(c, 1, len(LONG) + 2) for _ in range(3)]
    got = plan.prefill(LONG, caches[0])
    for t in LONG:
        want = plan.step(t, caches[1])
    floats = prefill(model, torch.tensor([LONG]), caches[2])
    assert caches[0].length == caches[1].length == len(LONG)
    assert _relative(got, want) < WHOLE_ATOL
    for a, b in zip(_held(caches[0]), _held(caches[1]), strict=True):
        assert _relative(a, b) < WHOLE_ATOL
    if fmt == "f32":  # float32 throughout: the modules' path within ARCH_RTOL too
        assert _relative(got, floats) < ARCH_RTOL
        _same_greedy_or_near_tie(got, floats)
    elif c.index_topk is None:
        assert _relative(got, floats) < LOW_PRECISION_RTOL
        _same_greedy_or_near_tie(got, floats)
    # (else: DeepSeek sparse attention reads the top 4 of the indexer's scores, which the modules' float
    # activations move by about 1%: enough to choose other positions, so the float prefill is no
    # reference for the quantized kernels there; the steps above are, and the f32 store holds it to
    # the modules)
    assert _relative(plan.step(5, caches[0]), plan.step(5, caches[1])) < WHOLE_ATOL


@pytest.mark.parametrize("arch, fmt", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_a_batch_of_sequences_is_each_sequence_alone_for_every_architecture(arch_stores, arch, fmt):
    """`DecodePlan.batch`, the server's step: two decoding sequences at other positions and a third's
    prompt in one step, then the three decoding together. Each row's logits and each sequence's k and
    v are the bits of that sequence stepped alone by `batch` (a row's arithmetic never depends on the
    rows beside it: the products row by row, attention over its own cache, its experts summed in the
    order of their ids), and within WHOLE_ATOL relative of the one-call step's and the prompt pass's
    (which sum a row's experts in the router's order). Latent attention takes a prompt alone in its
    expanded form and beside other sequences in the absorbed one (decoding's): that sequence's rows
    and cache within WHOLE_ATOL of alone, the others' the same bits."""
    model = load_store(arch_stores(arch, fmt))
    plan, c = DecodePlan(model), model.config
    prompts = [LONG[:6], LONG[10:19], LONG[30:34]]

    def started() -> list[KVCache]:
        caches = [KVCache.empty(c, 1, 24) for _ in prompts]
        for p, k in zip(prompts[:2], caches):
            plan.prefill(p, k)
        return caches

    steps = [([3, 9, *prompts[2]], [1, 1, 4], [0, 1, 5]), ([11, 4, 60], [1, 1, 1], [0, 1, 2])]
    batched, alone, one_call = started(), started(), started()
    for ids, counts, rows in steps:
        got = plan.batch(ids, batched, counts, rows)
        assert got.shape == (3, c.vocab_size)
        starts = [sum(counts[:i]) for i in range(3)]
        for i, (k, n) in enumerate(zip(alone, counts)):
            seq_ids = ids[starts[i]:starts[i] + n]
            one = plan.batch(seq_ids, [k], [n], [n - 1])[0]
            if i == 2 and c.attention == "mla":  # its prompt's attention took the other form
                assert _relative(got[i], one) < WHOLE_ATOL
            else:
                assert torch.equal(one, got[i]), i
            ref = plan.step(seq_ids[0], one_call[i]) if n == 1 else plan.prefill(seq_ids, one_call[i])
            assert _relative(got[i], ref[0]) < WHOLE_ATOL, i
    for i, (a, b) in enumerate(zip(batched, alone)):
        assert a.length == b.length
        for x, y in zip(_held(a), _held(b), strict=True):
            assert _relative(x, y) < WHOLE_ATOL if i == 2 and c.attention == "mla" else torch.equal(x, y)


@pytest.mark.parametrize("arch, fmt", [("deepseek_v2", "f32"), ("deepseek_v3", "f32"), ("deepseek_v3", "int4")])
def test_a_prompts_latent_attention_expanded_and_absorbed(arch_stores, arch, fmt):
    """Latent attention's prompt rows attend in the expanded form (each position's latent taken out to
    every head's keys and values once) where its buffers fit `prefill_expand_limit`, and in decoding's
    absorbed form past it: both within WHOLE_ATOL of the one-call steps (the same products; attention's
    sums in another order). In float32 they are not the same bits (so each form ran); int4's int8
    activations may round both to the same codes. The second prompt continues the cache: the expanded
    form takes the earlier positions' latents out too."""
    model = load_store(arch_stores(arch, fmt))
    plan = DecodePlan(model)
    lib, c = plan.lib, model.config
    head, rest = LONG[:20], LONG[20:]
    got, default = {}, lib.prefill_expand_limit(0)
    assert default == loader.EXPAND_LIMIT  # the runner's sizing counts by it (`sequence_bytes`)
    try:
        for limit in (default, 0):
            lib.prefill_expand_limit(limit)
            cache = KVCache.empty(c, 1, len(LONG) + 1)
            plan.prefill(head, cache)
            got[limit] = plan.prefill(rest, cache)
    finally:
        lib.prefill_expand_limit(default)
    cache = KVCache.empty(c, 1, len(LONG) + 1)
    for t in LONG:
        want = plan.step(t, cache)
    expanded, absorbed = got.values()
    assert _relative(expanded, want) < WHOLE_ATOL and _relative(absorbed, want) < WHOLE_ATOL
    assert fmt != "f32" or not torch.equal(expanded, absorbed)


def test_the_prompt_pass_leaves_what_it_does_not_take_to_the_modules(arch_stores):
    """None, the cache untouched, where the prompt does not fit the cache, a hook is set, or the plan
    has no one-call step; `generate` then runs the modules' prefill and gives the same tokens."""
    model = load_store(arch_stores("qwen3_moe", "f32"))
    plan = DecodePlan(model)
    short = KVCache.empty(model.config, 1, len(PROMPT) - 1)
    assert plan.prefill(PROMPT, short) is None and short.length == 0
    assert DecodePlan(model, whole=False).prefill(PROMPT, KVCache.empty(model.config, 1, 16)) is None
    handle = model.layers[0].register_forward_hook(lambda *a: None)
    try:
        cache = KVCache.empty(model.config, 1, 16)
        assert plan.prefill(PROMPT, cache) is None and cache.length == 0
    finally:
        handle.remove()


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_takes_the_plan_for_every_architecture(arch_stores, arch, monkeypatch):
    """`generate`, with no say from its caller, runs the prompt through the plan's prompt pass and
    steps every token after it through the plan, and gives the tokens the module path gives."""
    model = load_store(arch_stores(arch, "int8"))
    stepped, prompts = [], []
    step, pass_ = DecodePlan.step, DecodePlan.prefill
    monkeypatch.setattr(DecodePlan, "step", lambda self, token, cache: stepped.append(token) or step(self, token, cache))
    monkeypatch.setattr(DecodePlan, "prefill",
                        lambda self, tokens, cache: prompts.append(list(tokens)) or pass_(self, tokens, cache))
    res = generate(model, PROMPT, SamplingConfig(max_new_tokens=8))
    assert stepped == res.tokens[:-1] and prompts == [PROMPT]
    ref = generate(model, PROMPT, SamplingConfig(max_new_tokens=8), plan=None)
    assert res.tokens == ref.tokens
