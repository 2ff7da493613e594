"""Qwen3-Next in the model: Gated DeltaNet layers beside gated full attention, their state in the KV cache.

Parity with transformers from the directory and the store is in tests/semoe/checkpoints/test_parity.py,
offloaded in tests/inference/offload/test_expert_ring.py, int8/int4 in tests/semoe/model/test_compact_experts.py,
the server's budget, preemption and prefix reuse in tests/inference/serving/test_http_server.py. Here: the
cache's state (its size fixed, counted, copied only whole), several sequences in one packed call, and the
path each front-end takes, said by name. Logits of float32 models within 1e-5 (as the parity tests: the
paths differ in summation order only).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from helpers.hf_models import make_hf_checkpoint

from inference.engine import Engine
from inference.engine_config import EngineConfig
from inference.placement import lean_refusal
from semoe.checkpoints.hf_convert import import_checkpoint
from semoe.checkpoints.model_io import load_hf
from semoe.decode.generate import generate
from semoe.decode.loop import SamplingConfig
from semoe.decode.plan import DecodePlan
from semoe.decode.support import NotOnFastPath
from semoe.model.attention import KVCache
from tools.cli import main

ATOL = 1e-5
PROMPT = [3, 17, 5, 29, 11, 2, 40, 8, 19, 23]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (its tiny checkpoint, its store), made on first use: Qwen3-Next, and Qwen3.5-MoE's
    multimodal checkpoint (the same text model with its projections apart, beside a vision tower)."""
    made = {}

    def get(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            hf = make_hf_checkpoint(family, root / "hf", seed=5)
            made[family] = hf, import_checkpoint(str(hf), str(root / "store")).root
        return made[family]

    return get


@pytest.fixture
def hf(checkpoints):
    return checkpoints("qwen3_next")[0]


def test_the_cache_keeps_a_fixed_state_for_linear_layers_and_positions_for_the_others(hf):
    """Linear layers cache no positions (k and v of no elements) and hold a state of the configured
    shape; the bytes counted are what the cache holds, and only the attention layers' part grows."""
    model = load_hf(str(hf))
    c = model.config
    assert c.linear_layers == (0, 1, 2)
    cache = KVCache.empty(c, 1, 8)
    for i in range(c.num_layers):
        if c.is_linear(i):
            assert cache.k[i].numel() == 0 and cache.states[i].recurrent.shape == (1, 4, 8, 8)
            assert cache.states[i].conv.shape == (1, 2 * 2 * 8 + 4 * 8, 3)
        else:
            assert cache.k[i].shape == (1, c.num_kv_heads, 8, c.head_dim) and cache.states[i] is None
    held = lambda k: sum(t.nbytes for t in (*k.k, *k.v)) + k.state_bytes()  # noqa: E731
    assert held(cache) == KVCache.bytes_for(c, 1, 8, torch.float32)
    cache.grow(20)
    assert held(cache) == KVCache.bytes_for(c, 1, 20, torch.float32)
    assert cache.state_bytes() == c.linear_state_bytes(1) == 3 * (64 * 3 + 4 * 8 * 8) * 4


def test_a_copied_or_trimmed_cache_answers_as_the_original_and_a_prefix_is_refused(hf):
    """The state goes with a whole copy (`copy_from` of every position, `trimmed`); the state of a
    prefix is not kept, so taking fewer positions than the source holds is refused."""
    model = load_hf(str(hf))
    c = model.config
    with torch.no_grad():
        cache = KVCache.empty(c, 1, 16)
        model(torch.tensor([PROMPT]), cache)
        copy, trimmed = KVCache.empty(c, 1, 16), cache.trimmed()
        copy.copy_from(cache, cache.length)
        trimmed.grow(16)
        outs = [model(torch.tensor([[7]]), k).logits for k in (cache, copy, trimmed)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(ValueError, match="per-layer state is that of its 11 tokens, not of a prefix"):
        KVCache.empty(c, 1, 16).copy_from(cache, 5)


def test_packed_sequences_are_each_sequence_alone(hf):
    """Three sequences in one packed call (two continuing their caches, one starting), then one token
    each: every sequence's logits those it gets alone, and its state advanced by its own tokens only."""
    model = load_hf(str(hf))
    c = model.config
    seqs = [PROMPT, [9, 8, 7], [4, 4, 21, 30, 1]]
    with torch.no_grad():
        alone = []
        for s in seqs:
            k = KVCache.empty(c, 1, 20)
            first = model(torch.tensor([s[:2]]), k).logits[0] if len(s) > 3 else None
            rest = model(torch.tensor([s[2:] if first is not None else s]), k).logits[0]
            alone.append((rest, model(torch.tensor([[6]]), k).logits[0]))
        caches = [KVCache.empty(c, 1, 20) for _ in seqs]
        for k, s in zip(caches, seqs):
            if len(s) > 3:
                model(torch.tensor([s[:2]]), k)
        todo = [s[2:] if len(s) > 3 else s for s in seqs]
        packed = model.forward_packed(torch.tensor(sum(todo, [])), caches, [len(t) for t in todo]).logits[0]
        step = model.forward_packed(torch.tensor([6, 6, 6]), caches, [1, 1, 1]).logits[0]
    at = 0
    for i, t in enumerate(todo):
        torch.testing.assert_close(packed[at:at + len(t)], alone[i][0], atol=ATOL, rtol=0)
        torch.testing.assert_close(step[i:i + 1], alone[i][1], atol=ATOL, rtol=0)
        at += len(t)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_every_fast_path_takes_linear_attention_and_gives_the_modules_tokens(checkpoints, family, capsys):
    """The plan takes Gated DeltaNet, the gated attention output and the zero-centred norms: the one-call
    step (and its prompt pass), the kernel-by-kernel step, the engine resident and offloaded, the torch-free
    runner (`--lean`, and `--cpu-cache` alone, which picks it) all give the modules' greedy tokens, each
    path saying which it is; log-probs within ATOL."""
    hf, store = checkpoints(family)
    model = load_hf(str(hf))
    cfg = SamplingConfig(max_new_tokens=12)
    want = generate(model, PROMPT, cfg, plan=None)
    whole, kernels = DecodePlan(model), DecodePlan(model, whole=False)
    assert whole.net is not None and kernels.net is None
    for plan in (whole, kernels):
        got = generate(model, PROMPT, cfg, plan=plan)
        assert got.tokens == want.tokens
        assert got.logprobs == pytest.approx(want.logprobs, abs=ATOL)
    for config, path in ((EngineConfig(), "the whole step in one call"), (EngineConfig(cpu_cache_bytes=1),
                                                                             "kernel by kernel")):
        engine = Engine.load(store, config)
        try:
            assert path in engine.decode_path()
            got = engine.generate(PROMPT, cfg)
        finally:
            engine.close()
        assert got.tokens == want.tokens
        assert got.logprobs == pytest.approx(want.logprobs, abs=ATOL)
    assert lean_refusal(store) is None
    capsys.readouterr()  # what making the checkpoint printed
    args = ["generate", "--model", store, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12",
            "--json"]
    for flags in (["--lean"], ["--cpu-cache", "50%"]):
        assert main([*args, *flags]) == 0
        got = json.loads(capsys.readouterr().out)
        assert "computed_while_reading" in got["stats"] and got["tokens"] == want.tokens  # the runner's stats


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_the_chunked_prompt_pass_equals_the_recurrence_and_the_modules(checkpoints, family):
    """The kernels' prompt pass runs a sequence's consecutive rows in the chunked form (deltanet.c's
    `head_chunk`); forced to the recurrence (`deltanet_chunk_min`), stepped token by token, or through the
    modules (torch's chunked form), the logits and every linear layer's state after 100 positions (two
    blocks of rows, the second from the first's state) agree within ATOL; so does a prompt continuing a
    cache, and three sequences in one batch (each its own runs) against each alone."""
    from semoe.kernels import torch_ops
    model = load_hf(str(checkpoints(family)[0]))
    c, lib, plan = model.config, torch_ops._lib(), DecodePlan(model)
    tokens = [int(t) for t in torch.randint(0, c.vocab_size, (100,), generator=torch.Generator().manual_seed(3))]

    def run(how):
        k = KVCache.empty(c, 1, 110)
        with torch.no_grad():
            if how == "modules":
                logits = model(torch.tensor([tokens]), k).logits[:, -1]
            elif how == "steps":
                for t in tokens:
                    logits = plan.step(t, k)
            elif how == "continued":
                plan.prefill(tokens[:37], k)
                logits = plan.prefill(tokens[37:], k)
            else:
                logits = plan.prefill(tokens, k)
        return logits, k.state_tensors()

    old = lib.deltanet_chunk_min(0)
    try:
        got = {how: run(how) for how in ("chunked", "continued", "steps", "modules")}
        lib.deltanet_chunk_min(10 ** 9)
        got["recurrence"] = run("chunked")
    finally:
        lib.deltanet_chunk_min(old)
    want_logits, want_states = got.pop("modules")
    for how, (logits, states) in got.items():
        torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=0, msg=how)
        for s, w in zip(states, want_states, strict=True):
            torch.testing.assert_close(s, w, atol=ATOL, rtol=0, msg=how)
    seqs = [tokens[:20], tokens[20:23], tokens[50:90]]
    alone = []
    for s in seqs:
        k = KVCache.empty(c, 1, 50)
        alone.append(plan.prefill(s, k))
    caches = [KVCache.empty(c, 1, 50) for _ in seqs]
    rows = list(itertools.accumulate(len(s) for s in seqs))
    batch = plan.batch(sum(seqs, []), caches, [len(s) for s in seqs], [r - 1 for r in rows])
    for i, want in enumerate(alone):
        torch.testing.assert_close(batch[i:i + 1], want, atol=ATOL, rtol=0)
