"""semoe's own 4-bit (`semoe store quantize --bits 4 --kquant [--calibrate FILE]`): the mix's types within its
budget, the blocks the kernels compute on against the plain reference, the torch-free runner against the
engine, the importance matrix against hooks of its own, export as GGUF and back, and refusals in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from helpers.gguf_files import add_bpe_tokenizer, runner_gives_the_engines_tokens
from helpers.hf_models import make_hf_checkpoint
from helpers.procs import ROOT, child_env

from semoe.checkpoints.hf_convert import import_checkpoint
from semoe.checkpoints.model_io import load_store
from semoe.checkpoints.quantize_store import KQUANT_LADDER, QuantizeConfig, kquant_mix, quantize_store
from storage import kquants
from storage.errors import BadInputError
from storage.reader import StoreReader
from storage.store import Store

IDS = torch.tensor([[1, 5, 9, 33, 100, 200, 250, 17, 3, 64]])
VOCAB = 300
TEXT = ("the cat sat on the mat and the dog ran to the big red house; one two three four five six seven eight "
        "nine ten. def main(): return 0\n") * 12


def _store(tmp_path, arch="qwen3_moe"):
    kw = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256)
    if arch == "qwen3_moe":
        kw.update(moe_intermediate_size=256, mlp_only_layers=[])
    hf = make_hf_checkpoint(arch, tmp_path / f"hf_{arch}", **kw)
    add_bpe_tokenizer(hf, VOCAB)
    return import_checkpoint(str(hf), str(tmp_path / "f32"))


def test_the_mix_steps_up_in_order_within_its_budget():
    weights = {"expert": 1000, "dense": 35, "lm_head": 54, "embedding": 54}  # the 3 GB bench model's shares
    assert kquant_mix(weights, 4.5) == {k: "Q4_K" for k in weights}  # no room: every weight Q4_K
    mix = kquant_mix(weights, 4.9)
    bits = sum(kquants.bits_per_weight(mix[k]) * n for k, n in weights.items())
    assert bits <= 4.9 * sum(weights.values())
    assert mix["expert"] == "Q4_K" and mix["dense"] == "Q8_0"  # the first rung, then as many as fit
    assert mix == {"expert": "Q4_K", "dense": "Q8_0", "lm_head": "Q6_K", "embedding": "Q6_K"}
    for kind, t in KQUANT_LADDER:  # each rung left out would not have fit beside those taken
        if kquants.bits_per_weight(t) <= kquants.bits_per_weight(mix[kind]):
            continue
        trial = {**mix, kind: t}
        assert sum(kquants.bits_per_weight(trial[k]) * n for k, n in weights.items()) > 4.9 * sum(weights.values())
    top = kquant_mix(weights, 8.5)  # every rung: the dense kinds at Q8_0, experts stay 4-bit
    assert top == {"expert": "Q4_K", "dense": "Q8_0", "lm_head": "Q8_0", "embedding": "Q8_0"}
    assert {k for k, _ in KQUANT_LADDER} == {"dense", "lm_head", "embedding"}


def test_kquant_store_computes_on_its_blocks(tmp_path):
    """Experts Q4_K, the dense kinds as the mix says, routers and norms float; the kernels on the blocks
    give the plain reference's logits (dequantize, x as the kernels see it) within 1e-4 of their scale,
    and the float model's within the quantization's error; the torch-free runner gives the engine's
    greedy tokens (log-probs within 1e-4)."""
    src = _store(tmp_path)
    out = str(tmp_path / "k4")
    report = quantize_store(src.root, out, QuantizeConfig(bits=4, kquant=True))
    m = StoreReader.open(out).manifest
    mix = m.model["quantization"]["mix"]
    assert m.model["quantization"]["format"] == "k4" and mix["expert"] == "Q4_K"
    types = {t.name: (t.quant or {}).get("ggml_type") for t in m.tensors}
    experts = [n for n in types if ".experts." in n]
    assert experts and all(types[n] == "Q4_K" for n in experts)
    assert types["lm_head.weight"] == mix["lm_head"] and types["model.embed_tokens.weight"] == mix["embedding"]
    assert types["model.layers.0.self_attn.q_proj.weight"] == mix["dense"]
    assert types["model.layers.0.mlp.gate.weight"] is None  # the router stays float
    assert report.quantized == len(experts) and not report.kept
    with torch.no_grad():
        # the dense weights widened from their blocks: the experts' kernels against the reference alone
        got = load_store(out, dense="float")(IDS).logits
        ref = load_store(out, dense="float", kernel="reference")(IDS).logits
        want = load_store(src.root)(IDS).logits
    scale = want.abs().max()
    assert (got - ref).abs().max() / scale < 1e-4
    assert (got - want).abs().mean() / scale < 3e-2  # 4-bit experts, int8 activations
    with torch.no_grad():  # and the dense weights' kernels on their blocks
        blocks = load_store(out)(IDS).logits
    assert (blocks - want).abs().mean() / scale < 3e-2
    runner_gives_the_engines_tokens(out)


def test_calibration_weighs_columns_by_their_mean_square(tmp_path):
    """The importance of a dense weight is the mean square of its input columns over the text's tokens (a
    forward hook of the test's own on the same model), and an expert's gate, up and down see its routed
    rows and the activation between; the calibrated store differs from the plain one and computes."""
    from semoe.evaluation.calibrate import collect_importance
    from semoe.checkpoints.model_io import load_model, load_model_tokenizer
    from semoe.evaluation.perplexity import gather_tokens, window_bounds
    from semoe.train.data import eval_documents
    from storage.store import Store

    src = _store(tmp_path)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    model = load_model(Store.open(src.root), dense="float")
    tok = load_model_tokenizer(Store.open(src.root), model.config)
    ids = gather_tokens(eval_documents(str(text)), tok.encode, eos_id=tok.eos_id, limit=300)
    imp = collect_importance(src.root, ids, seq_len=128)
    assert imp.tokens == 300
    seen = []
    mod = dict(model.named_modules())
    name = next(n for n in mod if n.endswith("1.attn.q") or n.endswith("1.attn.q_proj"))
    q = mod[name]
    q.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for s, e in window_bounds(len(ids), 128, len(ids)):
            model(torch.tensor([ids[s:max(e, s + 2)]]))
    x = torch.cat(seen)
    want = (x * x).mean(0)
    got = imp.dense["model.layers.1.self_attn.q_proj.weight"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    # every (layer, expert) reached has its three weights' importances, of the right widths
    keys = {(lay, e) for lay, e, _ in imp.experts}
    assert keys and all(imp.experts[(lay, e, p)].shape == (256,) for lay, e in keys for p in range(3))
    assert imp.unreached == len(model.moe_layers()) * model.config.num_experts - len(keys)
    plain, cal = str(tmp_path / "k4"), str(tmp_path / "k4i")
    quantize_store(src.root, plain, QuantizeConfig(bits=4, kquant=True))
    quantize_store(src.root, cal, QuantizeConfig(bits=4, kquant=True, importance=imp))
    a, b = Store.open(plain), Store.open(cal)
    assert b.manifest.model["quantization"]["format"] == "k4-imatrix"
    assert b.manifest.model["quantization"]["calibration"]["tokens"] == 300
    layer, expert = next(iter(keys))  # an expert's Q4_K blocks, fitted with its columns weighed
    assert any(not torch.equal(x, y) for x, y in zip(a.read_expert(layer, expert).values(),
                                                     b.read_expert(layer, expert).values()))
    with torch.no_grad():
        assert torch.isfinite(load_store(cal)(IDS).logits).all()


def test_recorded_expert_sees_the_activation_between(tmp_path):
    from semoe.evaluation.calibrate import _Recorded, _Sums
    from semoe.model.experts import SwiGLU

    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(s, generator=g) for s in ((6, 4), (6, 4), (4, 6)))
    x = torch.randn(3, 4, generator=g)
    sums = _Sums()
    y = _Recorded((gate, up, down), SwiGLU(), key=(0, 1), sums=sums).apply(x)
    h = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    torch.testing.assert_close(y, h @ down.T)
    torch.testing.assert_close(sums.means()[(0, 1, 2)], (h * h).mean(0))
    torch.testing.assert_close(sums.means()[(0, 1, 0)], (x * x).mean(0))


def test_export_as_gguf_keeps_the_blocks(tmp_path):
    """`store export --format gguf` writes every block as the quantizer made it, Mixtral's permuted query
    and key rows included: imported back, each block is byte for byte the store's."""
    from semoe.checkpoints.gguf_export import export_gguf

    src = _store(tmp_path, "mixtral")
    out = str(tmp_path / "k4")
    quantize_store(src.root, out, QuantizeConfig(bits=4, kquant=True))
    path = tmp_path / "k4.gguf"
    export_gguf(Store.open(out), str(path))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == "Q4_K" and types["token_embd.weight"] in ("Q4_K", "Q6_K", "Q8_0")
    again = Store.open(import_checkpoint(str(path), str(tmp_path / "again")).root)
    mine = Store.open(out)
    for t in mine.manifest.tensors:  # every block back as the quantizer made it
        if (t.quant or {}).get("scheme") == "ggml" and t.name != "model.embed_tokens.weight":
            got = again.read_tensor(t.name) if t.group == "dense" else \
                again.read_expert(t.layer, t.expert)[t.name]
            assert torch.equal(got, mine.read_tensor(t.name) if t.group == "dense" else
                               mine.read_expert(t.layer, t.expert)[t.name]), t.name
    # the embedding, widened to bfloat16 by the import, within its rounding
    emb = "model.embed_tokens.weight"
    torch.testing.assert_close(again.read_dense(emb).float(), mine.read_dense(emb).float(), rtol=2 ** -8, atol=0)
    size = os.path.getsize(path)
    typed = sum(t.bytes for t in StoreReader.open(out).manifest.tensors)
    assert size < typed * 1.05  # the file holds the blocks, not widened floats


@pytest.mark.slow
def test_the_command_line_refuses_in_one_line_and_writes_nothing(tmp_path):
    src = _store(tmp_path)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    cases = [(["--bits", "4", "--calibrate", str(text)], "add --kquant"),
             (["--bits", "8", "--kquant"], "takes --bits 4"),
             (["--bits", "4", "--kquant", "--target-bits", "3"], "--target-bits must be"),
             (["--bits", "4", "--kquant", "--calibrate", str(tmp_path / "none.txt")], "no such file")]
    for i, (flags, msg) in enumerate(cases):
        out = tmp_path / f"out{i}"
        r = subprocess.run([sys.executable, "-m", "tools.cli", "store", "quantize", src.root, str(out), *flags],
                           cwd=ROOT, env=child_env(), capture_output=True, text=True)
        assert r.returncode != 0 and msg in r.stderr, (flags, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
    out = tmp_path / "ok"
    r = subprocess.run([sys.executable, "-m", "tools.cli", "store", "quantize", src.root, str(out), "--bits", "4",
                        "--kquant", "--calibrate", str(text), "--calibrate-tokens", "200", "--json"],
                       cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["scheme"] == "k4-imatrix"
    info = subprocess.run([sys.executable, "-m", "tools.cli", "store", "info", str(out)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True).stdout
    mix = next(line for line in info.splitlines() if line.startswith("mix"))
    assert "expert Q4_K" in mix and "within 4.9 bits" in mix and "calibrated on 200 tokens" in mix


@pytest.mark.parametrize("arch", ["gpt_oss", "llama4_text"])
def test_in_out_experts_are_cut_into_rows_of_outputs(tmp_path, arch):
    """gpt-oss's and Llama-4's (in, out) experts take the mix's Q4_K as rows of outputs (the logical weight
    transposed, as llama.cpp's converter lays them out): the kernels give the plain reference's logits within
    1e-4 of their scale and the float model's within the quantization's error; the torch-free runner the
    engine's tokens; gpt-oss's export as GGUF writes the experts' blocks back byte for byte, gate's and up's
    rows apart."""
    from semoe.checkpoints.gguf_export import export_gguf

    src = _store(tmp_path, arch)
    out = str(tmp_path / "k4")
    quantize_store(src.root, out, QuantizeConfig(bits=4, kquant=True))
    m = StoreReader.open(out).manifest
    experts = [t for t in m.tensors if t.name.endswith(("gate_up_proj", "down_proj"))]
    assert experts and all(t.quant["ggml_type"] == "Q4_K" and t.quant["transposed"] for t in experts)
    with torch.no_grad():
        got = load_store(out, dense="float")(IDS).logits
        ref = load_store(out, dense="float", kernel="reference")(IDS).logits
        want = load_store(src.root)(IDS).logits
    scale = want.abs().max()
    # float sums in another order: 1e-4 of the scale on the whole; where one of them puts an activation between
    # gate_up and down on the other side of an int8 rounding, that row moves by up to 2e-3 here, and the
    # rows after it through attention
    assert (got - ref).abs().median() / scale < 1e-4 and (got - ref).abs().max() / scale < 5e-3
    # 4-bit experts and int8 activations: 3.4e-2 on Llama-4's, whose every token also passes a shared expert
    assert (got - want).abs().mean() / scale < 4e-2
    runner_gives_the_engines_tokens(out)
    if arch != "gpt_oss":
        return
    export_gguf(Store.open(out), str(tmp_path / "k4.gguf"))
    f = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "k4.gguf")).tensors}
    store = Store.open(out)
    gu = store.read_tensor("model.layers.0.mlp.experts.gate_up_proj", stack_index=1).numpy()
    assert f["blk.0.ffn_gate_exps.weight"].tensor_type.name == "Q4_K"
    assert np.array_equal(np.asarray(f["blk.0.ffn_gate_exps.weight"].data[1]), gu[0::2])
    assert np.array_equal(np.asarray(f["blk.0.ffn_up_exps.weight"].data[1]), gu[1::2])


def test_offloaded_model_reads_its_embedding_rows_from_their_blocks(tmp_path):
    """Offloaded, the embedding stays in the store as Q6_K (or the mix's) blocks and each looked-up row is
    decoded as read: the same greedy tokens as the resident model, which decodes the table once, and
    log-probs within 1e-4 (the same values; offloaded decoding runs kernel by kernel, resident in one
    call, summing in another order)."""
    from inference.engine import Engine
    from inference.engine_config import EngineConfig
    from semoe.checkpoints.model_io import StoredEmbedding
    from semoe.decode.loop import SamplingConfig

    src = _store(tmp_path)
    out = str(tmp_path / "k4")
    quantize_store(src.root, out, QuantizeConfig(bits=4, kquant=True))
    runs = {}
    for name, cfg in (("resident", EngineConfig()), ("offloaded", EngineConfig(cpu_cache_bytes=1 << 20))):
        engine = Engine.load(out, cfg)
        try:
            if name == "offloaded":
                emb = engine.model.embed
                assert isinstance(emb, StoredEmbedding) and emb.ggml_type in ("Q4_K", "Q6_K", "Q8_0")
            runs[name] = engine.generate([1, 5, 9, 33, 100], SamplingConfig(max_new_tokens=8))
        finally:
            engine.close()
    assert runs["offloaded"].tokens == runs["resident"].tokens
    np.testing.assert_allclose(runs["offloaded"].logprobs, runs["resident"].logprobs, rtol=0, atol=1e-4)
