"""DeepSeek-V4 in the model: compressed attention's entries and choices against plain references, its state
across calls, and the path each front-end takes.

Parity with transformers from the directory and the store (logits, 32 greedy tokens, a cache's steps against
the whole sequence) is in tests/semoe/checkpoints/test_parity.py, offloaded in
tests/inference/offload/test_expert_ring.py, the server's budget, preemption and prefix reuse in
tests/inference/serving/test_http_server.py. float32 throughout; outputs within 1e-5 (summation order only).
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import make_hf_checkpoint

from inference.engine import Engine
from inference.engine_config import EngineConfig
from inference.placement import lean_refusal
from inference.torch_free.runner import LeanConfig, LeanModel
from semoe.checkpoints.hf_convert import import_checkpoint
from semoe.checkpoints.model_io import load_hf
from semoe.decode.generate import generate
from semoe.decode.loop import SamplingConfig
from semoe.decode.plan import DecodePlan
from semoe.decode.support import NotOnFastPath
from semoe.model.attention import KVCache

ATOL = 1e-5
SEQ = [(7 * i + 3) % 90 for i in range(23)]
WHY_STEP = "deepseek_v4's compressed attention and hyper-connections with experts offloaded"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v4")
    hf = make_hf_checkpoint("deepseek_v4", root / "hf", seed=5)
    return hf, import_checkpoint(str(hf), str(root / "store")).root


def _reference(attn, x, reads_of):
    """The layer's output computed query by query: its keys are the window's (the last `sliding_window`
    positions up to it) and the compressed entries `reads_of(t)` names, a plain softmax with the sink,
    then the output rotated back and projected. `attn`'s own pieces make q, the keys and the entries."""
    c = attn.config
    T, H, Dh = x.shape[1], c.num_heads, c.head_dim
    pos = torch.arange(T)
    from semoe.model.attention import grouped_output, unit_rms

    q = attn._rotate(unit_rms(attn.wq_b(attn.q_norm(attn.wq_a(x))).view(1, T, H, Dh), c.rms_norm_eps), pos)[0]
    kv = attn._rotate(attn.norm(attn.wkv(x)), pos)[0]
    state = attn.compressor(x, attn.compressor.empty(1, x), attn._rotate) if attn.compressor is not None else None
    outs = []
    for t in range(T):
        keys = [kv[s] for s in range(max(0, t - c.sliding_window + 1), t + 1)]
        keys += [state.entries[0, w] for w in reads_of(t)]
        K = torch.stack(keys)
        row = []
        for h in range(H):
            logits = torch.cat((K @ q[t, h] * Dh ** -0.5, attn.attn_sink[h:h + 1]))
            row.append(torch.softmax(logits, 0)[:-1] @ K)
        outs.append(torch.stack(row))
    out = attn._rotate(torch.stack(outs)[None], pos, inverse=True)
    return grouped_output(out, attn.wo_a.weight.view(c.o_groups, c.o_lora_rank, -1), attn.wo_b)


def _indexer_reference(attn, x, t):
    """The entries CSA's query t reads, scored one by one: the sum over the indexer's heads of its weight
    times ReLU(q . k), over the entries whose windows end at or before t, the index_topk best."""
    c, ix = attn.config, attn.indexer
    T = x.shape[1]
    pos = torch.arange(T)
    entries = ix.compressor(x, ix.compressor.empty(1, x), attn._rotate_index).entries[0]
    q_res = attn.q_norm(attn.wq_a(x))
    q = attn._rotate_index(ix.wq_b(q_res).view(1, T, ix.heads, ix.dim), pos)[0, t]
    w = ix.weights_proj(x)[0, t] * ix.heads ** -0.5
    passed = (t + 1) // attn.compressor.rate
    scores = [sum(w[h] * torch.relu(q[h] @ entries[e]) * ix.dim ** -0.5 for h in range(ix.heads))
              for e in range(passed)]
    return sorted(sorted(range(passed), key=lambda e: -float(scores[e]))[:c.index_topk])


@pytest.mark.parametrize("layer, kind", [(0, "hca"), (1, "csa"), (2, "sliding")])
def test_each_layer_kind_equals_attention_over_the_entries_it_names(checkpoint, layer, kind):
    """Each kind of layer against a query-by-query reference: HCA reads every entry whose window the query
    has passed, CSA the indexer's top-k of those (chosen by a per-entry scoring loop), the sliding layer
    its window alone. With index_topk at least the entries there are, CSA's choice is every passed entry:
    the sparse layer is then the dense one over the same entries."""
    model = load_hf(str(checkpoint[0]))
    attn = model.layers[layer].attn
    assert attn.kind == kind
    x = torch.randn(1, len(SEQ), model.config.hidden_size, generator=torch.Generator().manual_seed(layer))
    passed = lambda t: range((t + 1) // attn.compressor.rate)  # noqa: E731
    reads = {"hca": passed, "sliding": lambda t: (), "csa": lambda t: _indexer_reference(attn, x, t)}[kind]
    with torch.no_grad():
        got = attn(x, None, 0)[0]
        torch.testing.assert_close(got, _reference(attn, x, reads), atol=ATOL, rtol=0)
        if kind == "csa":
            assert any(len(reads(t)) < len(passed(t)) for t in range(len(SEQ)))  # the top-k left entries out
            attn.indexer.topk = len(SEQ)
            try:
                torch.testing.assert_close(attn(x, None, 0)[0], _reference(attn, x, passed), atol=ATOL, rtol=0)
            finally:
                attn.indexer.topk = model.config.index_topk


def test_a_sequence_in_uneven_pieces_gives_the_whole_sequences_logits(checkpoint):
    """Pieces that end inside compression windows (3, 7, then single tokens): the waiting tokens, CSA's
    overlap with the last full window and the window's keys carry across calls, and every position's
    logits are those of the whole sequence at once. A copy of the whole cache continues alike; a prefix
    of it is refused, its state being that of all its tokens."""
    model = load_hf(str(checkpoint[0]))
    c = model.config
    with torch.no_grad():
        full = model(torch.tensor([SEQ])).logits[0]
        cache = KVCache.empty(c, 1, len(SEQ))
        parts, at = [], 0
        for n in (3, 7, *[1] * (len(SEQ) - 10)):
            parts.append(model(torch.tensor([SEQ[at:at + n]]), cache).logits[0])
            at += n
        torch.testing.assert_close(torch.cat(parts), full, atol=ATOL, rtol=0)
        states = [s.to_state(cache.length) for s in cache.states]
        assert states[1].compressor.entries.shape[1] == len(SEQ) // c.compress_rates[0]
        assert states[0].compressor.entries.shape[1] == len(SEQ) // c.compress_rates[1]
        assert states[2].window.shape[1] == c.sliding_window - 1
        assert cache.state_bytes() == KVCache.bytes_for(c, 1, len(SEQ), torch.float32)
        copy = KVCache.empty(c, 1, len(SEQ) + 1)
        copy.copy_from(cache, cache.length)
        trimmed = cache.trimmed()
        trimmed.grow(len(SEQ) + 1)
        cache.grow(len(SEQ) + 1)
        nxt = [model(torch.tensor([[5]]), k).logits for k in (cache, copy, trimmed)]
    assert torch.equal(nxt[0], nxt[1]) and torch.equal(nxt[0], nxt[2])
    with pytest.raises(ValueError, match="per-layer state is that of its 24 tokens, not of a prefix"):
        KVCache.empty(c, 1, 30).copy_from(cache, 10)


def test_each_path_says_which_it_takes_and_gives_the_module_paths_tokens(checkpoint):
    """The one-call step and the torch-free runner take the model (the plan kernel by kernel, and so the
    engine's offloaded experts, name what they do not take): the resident engine decodes in one call, the
    offloaded one on the modules, saying why, the runner resident and with its least cache; each gives the
    module path's tokens, and log-probs within ATOL."""
    hf, store = checkpoint
    model = load_hf(str(hf))
    want = generate(model, SEQ[:9], SamplingConfig(max_new_tokens=12), plan=None)
    assert DecodePlan(model).net is not None
    with pytest.raises(NotOnFastPath, match=f"does not take {WHY_STEP}"):
        DecodePlan(model, whole=False)
    assert lean_refusal(store) is None
    for config, path in ((EngineConfig(), "the whole step in one call"),
                         (EngineConfig(cpu_cache_bytes=1), "the model's modules on cpu")):
        engine = Engine.load(store, config)
        try:
            assert path in engine.decode_path()
            assert config.cpu_cache_bytes is None or WHY_STEP in engine.decode_path()
            got = engine.generate(SEQ[:9], SamplingConfig(max_new_tokens=12))
        finally:
            engine.close()
        assert got.tokens == want.tokens and got.logprobs == pytest.approx(want.logprobs, abs=ATOL)
    for cache in (None, 0):
        with LeanModel(store, LeanConfig(cache_bytes=cache, dense="float")) as lean:
            got = lean.generate(SEQ[:9], SamplingConfig(max_new_tokens=12))
        assert got.tokens == want.tokens and got.logprobs == pytest.approx(want.logprobs, abs=ATOL)


def test_the_checkpoints_fp8_experts_stay_compact_and_compute_as_their_dequantized_weights(tmp_path):
    """DeepSeek-V4 in its published precision: its attention's and experts' products FP8 in 32 x 32 blocks
    with float32 scales. The store keeps them FP8 (a byte a weight), and the model computes what the same
    checkpoint dequantized by the reference to bfloat16 (as the dense ones load) computes: logits within 2e-3
    of the largest (2^-9, bfloat16's rounding: a prompt's rows multiply the experts' dequantized bfloat16
    weights in bfloat16; 5.6e-4 measured); offloaded gives the resident tokens."""
    from helpers.arch_stores import WIDER
    from helpers.quantized_checkpoints import FP8_QUANTIZED_V4, dequantize_fp8_reference, write_fp8_checkpoint
    from safetensors.torch import save_file

    from semoe.checkpoints.model_io import load_store
    from storage.store import Store

    hf = make_hf_checkpoint("deepseek_v4", tmp_path / "hf", seed=5, **WIDER)
    written = write_fp8_checkpoint(hf, tmp_path / "fp8", (32, 32), mtp=False, quantized=FP8_QUANTIZED_V4)
    fp8 = [n for n in written if n.endswith("_scale_inv")]
    assert any(".experts." in n for n in fp8) and any(".attn.wq_a." in n for n in fp8)
    plain = {n: (dequantize_fp8_reference(t, written[n + "_scale_inv"], (32, 32)).float()
                 if n + "_scale_inv" in written else t) for n, t in written.items() if not n.endswith("_scale_inv")}
    (tmp_path / "deq").mkdir()
    (tmp_path / "deq" / "config.json").write_text((hf / "config.json").read_text())
    save_file(plain, str(tmp_path / "deq" / "model.safetensors"), metadata={"format": "pt"})
    store = import_checkpoint(str(tmp_path / "fp8"), str(tmp_path / "store"))
    schemes = Store.open(store.root).describe()["schemes"]
    assert schemes["fp8"]["tensors"] == len(fp8) and 8 <= schemes["fp8"]["bits_per_weight"] < 9
    ids = torch.tensor([SEQ])
    with torch.no_grad():
        got, want = load_store(store.root)(ids).logits, load_hf(str(tmp_path / "deq"))(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 2e-3
    resident = Engine.load(store.root, EngineConfig())
    offloaded = Engine.load(store.root, EngineConfig(cpu_cache_bytes=1))
    try:
        a, b = (e.generate(SEQ[:9], SamplingConfig(max_new_tokens=10)) for e in (resident, offloaded))
    finally:
        resident.close()
        offloaded.close()
    assert a.tokens == b.tokens


def test_the_release_names_are_refused_in_one_line_naming_the_way_round(checkpoint, tmp_path, capsys):
    """A checkpoint under DeepSeek-V4's release names (`embed.weight`, `layers.N...`, not the names
    transformers writes): one line naming the tensor and what to do, exit 2, no store left."""
    from safetensors.torch import load_file, save_file

    from tools.cli import main

    hf = checkpoint[0]
    src = tmp_path / "release"
    src.mkdir()
    (src / "config.json").write_text((hf / "config.json").read_text())
    tensors = load_file(str(hf / "model.safetensors"))
    renamed = {("embed.weight" if n == "model.embed_tokens.weight" else n.removeprefix("model.")): t
               for n, t in tensors.items()}
    save_file(renamed, str(src / "model.safetensors"))
    assert main(["store", "import", str(src), str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "tensor embed.weight: DeepSeek-V4's release names" in err and "save_pretrained" in err
    assert not (tmp_path / "store").exists()
