"""GGUF files (`semoe.checkpoints.gguf_import`): a file the `gguf` package writes as llama.cpp's converter lays
it out (tests/helpers/gguf_files.py) imports to the store importing the HuggingFace directory gives: the same
logits, exactly for F32/F16/BF16, and for quantized types each tensor the package's own dequantization of the
file; the tokenizer and chat template rebuilt from the metadata; split files; bad files refused in one line
with nothing written."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.gguf_files import (CHAT_TEMPLATE, add_bpe_tokenizer, dequantized_state, gguf_tensors,
                                runner_gives_the_engines_tokens, write_gguf)
from helpers.hf_models import load_safetensors_dir, make_hf_checkpoint
from helpers.procs import ROOT, child_env, serving_port

from semoe.checkpoints.hf_convert import import_checkpoint
from semoe.checkpoints.model_io import load_model_tokenizer, load_store
from storage.errors import BadInputError
from storage.reader import StoreReader

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss")
IDS = torch.tensor([[1, 5, 9, 33, 100, 200, 250, 17, 3, 64]])
VOCAB = 300  # a byte-level BPE's 256 bytes, 3 specials and merges


def _checkpoint(arch: str, root, **over):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64)
    if arch not in ("mixtral", "olmoe", "gpt_oss"):
        kw["moe_intermediate_size"] = 64
    if arch == "qwen3_moe":
        kw["mlp_only_layers"] = []  # llama.cpp's qwen3moe has no dense layers
    hf = make_hf_checkpoint(arch, root / f"hf_{arch}", **{**kw, **over})
    add_bpe_tokenizer(hf, VOCAB)
    return hf


def _logits(store_root: str) -> torch.Tensor:
    with torch.no_grad():
        return load_store(store_root)(IDS).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_a_float32_gguf_gives_the_logits_of_its_huggingface_directory_exactly(tmp_path, arch):
    hf = _checkpoint(arch, tmp_path)
    gguf_file = write_gguf(hf, tmp_path / f"{arch}.gguf")
    want = import_checkpoint(str(hf), str(tmp_path / "from_hf"))
    got = import_checkpoint(str(gguf_file), str(tmp_path / "from_gguf"))
    assert torch.equal(_logits(got.root), _logits(want.root))  # F32 stays F32, every layout undone exactly
    info = StoreReader.open(got.root).manifest.model
    assert info["source"] == "gguf" and info["gguf"]["types"] == ["F32"]


def test_deepseeks_older_layout_with_one_kv_b_imports_the_same(tmp_path):
    """Files from older converters hold DeepSeek's kv_b_proj whole (`attn_kv_b`), newer ones split (`attn_k_b`,
    `attn_v_b`): both give the HuggingFace directory's logits, exactly."""
    hf = _checkpoint("deepseek_v2", tmp_path)
    want = _logits(import_checkpoint(str(hf), str(tmp_path / "from_hf")).root)
    for whole in (True, False):
        path = write_gguf(hf, tmp_path / f"m{whole}.gguf", whole_kv_b=whole)
        import gguf

        names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
        assert ("blk.0.attn_kv_b.weight" in names) == whole and ("blk.0.attn_k_b.weight" in names) != whole
        assert torch.equal(_logits(import_checkpoint(str(path), str(tmp_path / f"s{whole}")).root), want)


@pytest.mark.parametrize("arch,qtype", [("qwen3_moe", "F16"), ("deepseek_v3", "BF16")])
def test_half_precision_tensors_are_kept_as_stored(tmp_path, arch, qtype):
    """The file's halves are stored as they are ("keep"), the converter's float32 norms as float32: each
    tensor written back is the HuggingFace one rounded to the file's type, bit for bit."""
    from semoe.checkpoints.hf_convert import export_checkpoint
    from storage.store import Store

    hf = _checkpoint(arch, tmp_path)
    half = {"F16": torch.float16, "BF16": torch.bfloat16}[qtype]
    got = import_checkpoint(str(write_gguf(hf, tmp_path / "m.gguf", qtype=qtype)), str(tmp_path / "from_gguf"))
    export_checkpoint(Store.open(got.root), str(tmp_path / "back"))
    back, want = load_safetensors_dir(tmp_path / "back"), load_safetensors_dir(hf)
    assert sorted(back) == sorted(want)
    kinds = set()
    for name, t in back.items():
        kinds.add(t.dtype)
        ref = want[name].to(half) if t.dtype == half else want[name]
        assert t.dtype in (half, torch.float32) and torch.equal(t, ref), name
    assert kinds == {half, torch.float32}


@pytest.mark.parametrize("arch,qtype", [("qwen3_moe", "Q8_0"), ("mixtral", "Q4_0"), ("olmoe", "Q4_1"),
                                        ("deepseek_v3", "Q5_0"), ("glm4_moe", "Q5_1"), ("gpt_oss", "MXFP4")])
def test_quantized_tensors_are_the_packages_dequantization(tmp_path, arch, qtype, capfd):
    """Stored widened to float32, every tensor equals gguf.quants.dequantize of the file's, laid out again
    (compared in GGUF's layout: the store's tensors written back through the test's own converter); the logits
    stay near the float model's (within the quantization's error: 4 bits of 64 inputs, well under 0.5)."""
    hf = _checkpoint(arch, tmp_path)
    gguf_file = write_gguf(hf, tmp_path / "m.gguf", qtype=qtype)
    got = import_checkpoint(str(gguf_file), str(tmp_path / "from_gguf"), dtype="float32")
    assert f"{qtype} tensors decoded and stored as F32" in capfd.readouterr().err
    exported = tmp_path / "exported"
    from semoe.checkpoints.hf_convert import export_checkpoint
    from storage.store import Store

    export_checkpoint(Store.open(got.root), str(exported))
    import json

    cfg = json.loads((hf / "config.json").read_text())
    back = gguf_tensors(cfg["model_type"], cfg, load_safetensors_dir(exported))
    ref = dequantized_state(gguf_file)
    assert sorted(back) == sorted(ref)
    for name, a in ref.items():
        np.testing.assert_array_equal(back[name].reshape(a.shape), a, err_msg=name)  # bit for bit
    want = import_checkpoint(str(hf), str(tmp_path / "from_hf"))
    diff = (_logits(got.root) - _logits(want.root)).abs().max().item()
    assert 0 < diff < 0.5


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    from semoe.checkpoints.hf_config import from_hf_config
    from semoe.checkpoints.tokenizer import load_tokenizer

    hf = _checkpoint("qwen3_moe", tmp_path)
    gguf_file = write_gguf(hf, tmp_path / "m.gguf")
    store = import_checkpoint(str(gguf_file), str(tmp_path / "store"))
    tok = load_model_tokenizer(store, from_hf_config(store.manifest.model["config"]))
    want = load_tokenizer(str(hf))
    text = "The quick brown fox, the lazy dog; def main(): return 0 -- héllo wörld 123"
    assert tok.encode(text) == want.encode(text) and len(tok.encode(text)) > 10
    assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_id, tok.eos_id) == (want.bos_id, want.eos_id) == (1, 2)
    reader = StoreReader.open(store.root)
    files = {f.name: reader.read_file(f.name) for f in reader.manifest.files}
    assert CHAT_TEMPLATE.encode() in files.get("chat_template.jinja", b"") + files["tokenizer_config.json"]


def test_a_split_file_imports_as_the_whole(tmp_path):
    hf = _checkpoint("olmoe", tmp_path)
    whole = import_checkpoint(str(write_gguf(hf, tmp_path / "whole.gguf")), str(tmp_path / "whole"))
    first = write_gguf(hf, tmp_path / "m.gguf", split=7)
    parts = sorted(p.name for p in tmp_path.glob("m-*.gguf"))
    assert len(parts) > 2 and first.name == parts[0]
    split = import_checkpoint(str(tmp_path / parts[1]), str(tmp_path / "split"))  # any part names the whole
    assert torch.equal(_logits(split.root), _logits(whole.root))
    os.remove(tmp_path / parts[-1])
    with pytest.raises(BadInputError, match=f"{parts[-1]}: missing"):
        import_checkpoint(str(first), str(tmp_path / "incomplete"))
    assert not (tmp_path / "incomplete").exists()


def test_bad_files_are_refused_in_one_line_and_nothing_is_written(tmp_path):
    hf = _checkpoint("qwen3_moe", tmp_path)
    good = write_gguf(hf, tmp_path / "m.gguf")
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 5000])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"NOPE" + data[4:])
    cases = [(cut, r"cut\.gguf: .*(truncated|not a readable GGUF)"), (garbage, r"garbage\.gguf: not a readable GGUF"),
             (tmp_path / "absent.gguf", "no such file")]
    for path, pattern in cases:
        target = tmp_path / f"store_{path.stem}"
        with pytest.raises(BadInputError, match=pattern):
            import_checkpoint(str(path), str(target))
        assert not target.exists()


def test_unknown_architectures_and_types_are_named(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(BadInputError, match=r"bert\.gguf: general\.architecture='bert' is not supported"):
        import_checkpoint(str(tmp_path / "bert.gguf"), str(tmp_path / "s1"))
    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "olmoe")  # one ternary tensor: not a type users' MoE files hold
    w.add_tensor("token_embd.weight", gguf.quants.quantize(np.zeros((4, 256), np.float32), gguf.GGMLQuantizationType.TQ2_0),
                 raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(BadInputError, match=r"odd\.gguf: tensor token_embd\.weight has type TQ2_0"):
        import_checkpoint(str(tmp_path / "odd.gguf"), str(tmp_path / "s2"))
    assert not (tmp_path / "s1").exists() and not (tmp_path / "s2").exists()


@pytest.mark.slow  # a CLI run: CI runs it with -m slow
def test_store_import_takes_a_gguf_file_on_the_command_line(tmp_path):
    hf = _checkpoint("mixtral", tmp_path)
    gguf_file = write_gguf(hf, tmp_path / "m.gguf", qtype="Q8_0")
    res = subprocess.run([sys.executable, "-m", "tools.cli", "store", "import", str(gguf_file), str(tmp_path / "s")],
                         capture_output=True, text=True, env=child_env(), cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert f"imported {gguf_file}" in res.stdout and "Q8_0 weights kept as their blocks" in res.stderr
    bad = subprocess.run([sys.executable, "-m", "tools.cli", "store", "import", str(tmp_path / "x.gguf"),
                          str(tmp_path / "t")], capture_output=True, text=True, env=child_env(), cwd=ROOT)
    assert bad.returncode != 0 and "x.gguf: no such file" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # CLI runs: CI runs it with -m slow
def test_generate_takes_a_gguf_file_imported_on_first_use(tmp_path):
    """`semoe generate --model FILE.gguf` imports it into a store under the cache on first use (saying where),
    opens that store the next time, and decodes the tokens the HuggingFace directory's store gives."""
    import json

    hf = _checkpoint("qwen3_moe", tmp_path)
    gguf_file = write_gguf(hf, tmp_path / "m.gguf")
    store = import_checkpoint(str(hf), str(tmp_path / "from_hf"))
    env = child_env(SEMOE_CACHE_DIR=str(tmp_path / "cache"))

    def run(model):
        res = subprocess.run([sys.executable, "-m", "tools.cli", "generate", "--model", model, "--prompt-ids",
                              "1,5,9,33", "--max-new-tokens", "8", "--ignore-eos", "--json"],
                             capture_output=True, text=True, env=env, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)["tokens"], res.stderr

    want, _ = run(store.root)
    first, err = run(str(gguf_file))
    made = [p for p in (tmp_path / "cache" / "gguf").iterdir()]
    assert len(made) == 1 and made[0].name.startswith("m-") and f"importing it into {made[0]}" in err
    again, err = run(str(gguf_file))
    assert "imported from it on first use" in err and first == again == want


WIDE = dict(hidden_size=256, intermediate_size=256)  # rows of whole super-blocks (256) for the K-quants


@pytest.mark.parametrize("arch,qtype", [("qwen3_moe", "Q4_K"), ("mixtral", "Q6_K"), ("deepseek_v3", "Q5_K"),
                                        ("olmoe", "IQ4_XS"), ("glm4_moe", "Q8_0"), ("qwen2_moe", "Q4_0"),
                                        ("gpt_oss", "Q4_K"), ("gpt_oss", "Q8_0")])
def test_expert_blocks_are_kept_as_stored_and_computed_on(tmp_path, arch, qtype, capfd):
    """The default import keeps quantized experts block for block (scheme `ggml`); the kernels on them give
    the logits of the same file widened to float32, within int8 activations' error (2e-2 of the logits'
    scale), and the plain reference kernel (dequantize, x as the kernels see it) within 3e-4; the
    torch-free runner's greedy tokens are the engine's, log-probs within 1e-4; export writes the
    package's dequantization."""
    over = dict(WIDE, moe_intermediate_size=256) if arch not in ("mixtral", "olmoe", "gpt_oss") else dict(WIDE)
    if arch == "deepseek_v3":
        over.update(kv_lora_rank=32, q_lora_rank=64)
    hf = _checkpoint(arch, tmp_path, **over)
    gguf_file = write_gguf(hf, tmp_path / "m.gguf", qtype=qtype)
    kept = import_checkpoint(str(gguf_file), str(tmp_path / "kept"))
    assert f"{qtype} weights kept as their blocks" in capfd.readouterr().err
    tensors = StoreReader.open(kept.root).manifest.tensors
    experts = [t for t in tensors if ".experts." in t.name and not t.name.endswith("_bias")]  # gpt-oss's: float
    assert experts and all(t.quant["scheme"] == "ggml" and t.quant["ggml_type"] == qtype and t.dtype == "U8"
                           for t in experts)
    if qtype in ("Q8_0", "Q4_0"):  # the writer quantized the dense matrices too: kept as blocks as well
        outs = [t for t in tensors if t.name.endswith("self_attn.o_proj.weight")]
        assert outs and all((t.quant or {}).get("ggml_type") == qtype for t in outs)
    wide = import_checkpoint(str(gguf_file), str(tmp_path / "wide"), dtype="float32")
    with torch.no_grad():
        got = load_store(kept.root, dense="float")(IDS).logits  # the dense weights as the file holds them
        ref = load_store(kept.root, dense="float", kernel="reference")(IDS).logits
        want = load_store(wide.root)(IDS).logits
    scale = want.abs().max()
    # float sums in another order, and where one of them puts an activation on the other side of an int8
    # rounding, a code apart: 3e-4 of the scale
    assert (got - ref).abs().max() / scale < 3e-4
    # int8 activations' error, and where it tips a router's near tie, another expert: on average small
    assert (got - want).abs().mean() / scale < 2e-2
    runner_gives_the_engines_tokens(kept.root)
    from semoe.checkpoints.hf_convert import export_checkpoint
    from storage.store import Store

    export_checkpoint(Store.open(kept.root), str(tmp_path / "back"))
    import json

    cfg = json.loads((hf / "config.json").read_text())
    back = gguf_tensors(cfg["model_type"], cfg, load_safetensors_dir(tmp_path / "back"))
    for name, a in dequantized_state(gguf_file).items():
        if "_exps.weight" in name:  # the blocks as stored, dequantized on the way out: the package's values exactly
            np.testing.assert_array_equal(back[name].reshape(a.shape), a, err_msg=name)
        else:  # a quantized dense weight (gpt-oss's float expert biases too) is widened to bfloat16 at import
            np.testing.assert_allclose(back[name].reshape(a.shape), a, rtol=2 ** -8, atol=0, err_msg=name)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_export_as_gguf_imports_back_to_the_same_logits(tmp_path, arch):
    """A store imported from HuggingFace, exported as GGUF (`gguf_export`) and imported again: the same
    logits, exactly (F32 throughout); the file's tokenizer is the store's."""
    from semoe.checkpoints.gguf_export import export_gguf

    hf = _checkpoint(arch, tmp_path)
    store = import_checkpoint(str(hf), str(tmp_path / "store"))
    out = tmp_path / "out.gguf"
    n = export_gguf(store, str(out))
    again = import_checkpoint(str(out), str(tmp_path / "again"))
    assert n > 10 and torch.equal(_logits(again.root), _logits(store.root))
    from semoe.checkpoints.hf_config import from_hf_config

    text = "the quick brown fox jumps over the lazy dog"
    toks = [load_model_tokenizer(s, from_hf_config(s.manifest.model["config"])).encode(text) for s in (store, again)]
    assert toks[0] == toks[1] and len(toks[0]) > 3
    with pytest.raises(BadInputError, match="exists"):
        export_gguf(store, str(out))


@pytest.mark.parametrize("arch,qtype", [("qwen3_moe", "Q4_K"), ("mixtral", "Q8_0"), ("gpt_oss", "Q6_K")])
def test_export_writes_kept_blocks_back_byte_for_byte(tmp_path, arch, qtype):
    """Every quantized tensor kept as blocks goes back to the file as it came (Mixtral's permuted q/k rows
    reordered twice); the token embedding, decoded at import, comes back as floats."""
    import gguf

    from semoe.checkpoints.gguf_export import export_gguf

    over = dict(WIDE, moe_intermediate_size=256) if arch == "qwen3_moe" else dict(WIDE) if arch == "gpt_oss" else {}
    hf = _checkpoint(arch, tmp_path, **over)
    src = write_gguf(hf, tmp_path / "m.gguf", qtype=qtype)
    store = import_checkpoint(str(src), str(tmp_path / "kept"))
    out = tmp_path / "out.gguf"
    export_gguf(store, str(out))
    a = {t.name: t for t in gguf.GGUFReader(str(src)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    kept = [n for n in a if a[n].tensor_type.name == qtype and n != "token_embd.weight"]
    assert any("_exps" in n for n in kept) and sorted(a) == sorted(b)
    assert qtype != "Q8_0" or "blk.0.attn_q.weight" in kept
    for name in kept:
        assert b[name].tensor_type == a[name].tensor_type
        assert np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data)), name


def test_gpt_oss_mxfp4_experts_are_kept_as_its_checkpoints_mxfp4(tmp_path):
    """gpt-oss's GGUF MXFP4 experts become the checkpoint's own layout (semoe's `mxfp4`: blocks and exponents,
    gate and up interleaved), the same codes repacked: the MXFP4 kernels compute on them, the reference
    kernel within 1e-4 of the logits' scale, the file widened to float32 on average within int8
    activations' error; the torch-free runner's greedy tokens are the engine's."""
    hf = _checkpoint("gpt_oss", tmp_path)
    gguf_file = write_gguf(hf, tmp_path / "m.gguf", qtype="MXFP4")
    kept = import_checkpoint(str(gguf_file), str(tmp_path / "kept"))
    blocks = [t for t in StoreReader.open(kept.root).manifest.tensors if t.name.endswith("gate_up_proj_blocks")]
    assert blocks and all(t.quant["scheme"] == "mxfp4" and t.quant["transposed"] for t in blocks)
    wide = import_checkpoint(str(gguf_file), str(tmp_path / "wide"), dtype="float32")
    with torch.no_grad():
        got = load_store(kept.root, dense="float")(IDS).logits
        ref = load_store(kept.root, dense="float", kernel="reference")(IDS).logits
        want = load_store(wide.root)(IDS).logits
    scale = want.abs().max()
    assert (got - ref).abs().max() / scale < 1e-4 and (got - want).abs().mean() / scale < 2e-2
    runner_gives_the_engines_tokens(kept.root)


@pytest.mark.slow  # starts a server process
def test_serve_takes_a_gguf_file_and_answers_as_generate_does(tmp_path):
    """`semoe serve --model FILE.gguf`: imported into the cache on first use, served from its blocks; a greedy
    completion's tokens are those `semoe generate` gives on the same file."""
    import json
    import signal
    import urllib.request

    hf = _checkpoint("qwen3_moe", tmp_path, **dict(WIDE, moe_intermediate_size=256))
    gguf_file = write_gguf(hf, tmp_path / "m.gguf", qtype="Q4_K")
    env = child_env(SEMOE_CACHE_DIR=str(tmp_path / "cache"))
    gen = subprocess.run([sys.executable, "-m", "tools.cli", "generate", "--model", str(gguf_file), "--prompt-ids",
                          "1,5,9,33", "--max-new-tokens", "8", "--ignore-eos", "--json"],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert gen.returncode == 0, gen.stderr
    want = json.loads(gen.stdout)["tokens"]
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", "--model", str(gguf_file), "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        port, lines = serving_port(proc)
        assert any("imported from it on first use" in line for line in lines)
        body = json.dumps({"prompt": [1, 5, 9, 33], "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["token_ids"] == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_a_bfloat16_store_exports_its_norms_routers_and_biases_in_float32(tmp_path):
    """llama.cpp's CPU ops take norms (and its converter writes routers and biases) in float32 only: a
    bfloat16 store's export widens those, exactly, and keeps its matrices bfloat16; imported back, the
    same logits."""
    import gguf

    from semoe.checkpoints.gguf_export import export_gguf

    hf = _checkpoint("qwen2_moe", tmp_path)
    store = import_checkpoint(str(hf), str(tmp_path / "bf16"), dtype="bfloat16")
    out = tmp_path / "out.gguf"
    export_gguf(store, str(out))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    narrow = [n for n in types if n.endswith(("_norm.weight", "ffn_gate_inp.weight", ".bias"))]
    assert narrow and all(types[n] == "F32" for n in narrow)
    assert types["blk.0.attn_q.weight"] == "BF16" and types["blk.0.ffn_down_exps.weight"] == "BF16"
    again = import_checkpoint(str(out), str(tmp_path / "again"))
    assert torch.equal(_logits(again.root), _logits(store.root))


@pytest.mark.parametrize("gate,up", [("Q4_K", "IQ4_NL"), ("MXFP4", "Q5_1")])
def test_experts_whose_gate_and_up_differ_in_type_are_computed_on_both(tmp_path, gate, up):
    """Mixes may give an expert's gate and up projections different types: both are kept as their blocks
    and computed on (a product at a time: the whole step in one call takes one kind for both), within the
    plain reference kernel's 3e-4 of the logits' scale, as above."""
    from inference.engine import Engine
    from inference.engine_config import EngineConfig

    hf = _checkpoint("qwen3_moe", tmp_path, **dict(WIDE, moe_intermediate_size=256))
    gguf_file = write_gguf(hf, tmp_path / "m.gguf", qtype=gate, types={"ffn_up_exps": up})
    kept = import_checkpoint(str(gguf_file), str(tmp_path / "kept"))
    tensors = StoreReader.open(kept.root).manifest.tensors
    for proj, want in (("gate_proj", gate), ("up_proj", up)):
        mine = [t for t in tensors if ".experts." in t.name and proj in t.name]
        assert mine and all(t.quant["ggml_type"] == want for t in mine)
    with torch.no_grad():
        got = load_store(kept.root, dense="float")(IDS).logits
        ref = load_store(kept.root, dense="float", kernel="reference")(IDS).logits
    assert (got - ref).abs().max() / ref.abs().max() < 3e-4
    engine = Engine.load(kept.root, EngineConfig())
    try:
        assert "kernel by kernel" in engine.decode_path()
    finally:
        engine.close()
