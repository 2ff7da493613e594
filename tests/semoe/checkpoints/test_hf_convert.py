"""HuggingFace checkpoints written by transformers: import, export, round trips and bad input."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers.hf_models import assert_bit_exact, load_hf_model, load_safetensors_dir

from storage.errors import BadInputError
from inference.engine import Engine
from inference.engine_config import EngineConfig
from semoe.checkpoints.hf_convert import (INDEX_FILE, check_supported, export_checkpoint, import_checkpoint,
                                         open_checkpoint)
from semoe.model.hf_names import SUPPORTED_MODEL_TYPES
from storage.safetensors_io import OutTensor, write_file
from storage.store import Store


def _round_trip(src, tmp_path) -> Store:
    store = import_checkpoint(str(src), str(tmp_path / "store"))
    export_checkpoint(Store.open(store.root), str(tmp_path / "out"))
    assert_bit_exact(load_safetensors_dir(src), load_safetensors_dir(tmp_path / "out"))
    return store


def _assert_transformers_computes_the_same_logits(src, out) -> None:
    """transformers loads the export and computes exactly the logits it computes from the original."""

    ids = torch.tensor([[1, 5, 9, 2, 33, 7]])
    a, b = load_hf_model(src).eval(), load_hf_model(out).eval()
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_mixtral_sharded_bfloat16_round_trip(hf_mixtral_sharded_bf16, tmp_path):
    src = hf_mixtral_sharded_bf16
    assert (src / INDEX_FILE).exists() and len(list(src.glob("*.safetensors"))) > 2
    store = _round_trip(src, tmp_path)
    info = store.describe()
    assert info["architecture"] == "MixtralForCausalLM" and info["dtypes"] == ["BF16"]
    assert info["experts_per_layer"] == {"0": 4, "1": 4}
    chunk = store.manifest.chunk(1, 3)
    names = sorted(e.name for e in store.manifest.chunk_tensors(chunk))
    assert names == [f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")]
    out = tmp_path / "out"
    assert json.loads((out / INDEX_FILE).read_text())["weight_map"] == json.loads((src / INDEX_FILE).read_text())[
        "weight_map"]
    _assert_transformers_computes_the_same_logits(src, out)


def test_qwen2_moe_round_trip_keeps_shared_expert_dense(hf_qwen2_moe, tmp_path):
    store = _round_trip(hf_qwen2_moe, tmp_path)
    m = store.manifest
    shared = [t for t in m.tensors if "shared_expert" in t.name]
    assert shared and all(t.group == "dense" for t in shared)
    assert {t.name.split("experts.")[1].split(".", 1)[1] for t in m.tensors if t.group == "expert"} == {
        "gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert store.describe()["experts_per_layer"] == {"0": 4, "1": 4}


def test_olmoe_round_trip(hf_olmoe, tmp_path):
    store = _round_trip(hf_olmoe, tmp_path)
    assert store.describe()["model_type"] == "olmoe"
    assert (tmp_path / "out" / "config.json").read_bytes() == (hf_olmoe / "config.json").read_bytes()


NEW_ARCHS = ["qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "minimax_m2", "dots1", "kimi_k25",
               "ernie4_5_moe", "hunyuan_v1_moe", "llama4",
               "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe", "deepseek_v4"]


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_newer_architectures_round_trip_bit_exact(arch, dtype, sharded, tmp_path):
    """Import then export keeps every name, dtype, shape and byte (gpt-oss's fused experts split per
    expert and stacked again; DeepSeek's shared experts and correction bias stay dense) and the
    shards' layout; transformers reads the export as the original, and the model computes the same
    logits from the store as from the directory."""
    from helpers.hf_models import make_hf_checkpoint

    from semoe.checkpoints.model_io import load_hf, load_store

    src = make_hf_checkpoint(arch, tmp_path / "hf", dtype=dtype, max_shard_size="30KB" if sharded else "5GB", seed=2)
    assert (src / INDEX_FILE).exists() == sharded and (len(list(src.glob("*.safetensors"))) > 2) == sharded
    store = _round_trip(src, tmp_path)
    out = tmp_path / "out"
    dense = {t.name for t in store.manifest.tensors if t.group == "dense"}
    assert not any(".experts." in n and "shared" not in n for n in dense), arch
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    if sharded:
        assert json.loads((out / INDEX_FILE).read_text())["weight_map"] == json.loads(
            (src / INDEX_FILE).read_text())["weight_map"]
    _assert_transformers_computes_the_same_logits(src, out)
    ids = torch.tensor([[1, 5, 9, 2, 33, 7]])
    with torch.no_grad():
        assert torch.equal(load_store(store.root)(ids).logits, load_hf(str(src))(ids).logits)
    # the engine's model computes its float q, k and v as one product (`stack_qkv`): the same logits
    engine = Engine.load(store.root, EngineConfig())
    try:
        assert all(b.attn.qkv_proj is not None for b in engine.model.layers if hasattr(b.attn, "qkv_proj"))
        with torch.no_grad():
            assert torch.equal(engine.model(ids).logits, load_hf(str(src))(ids).logits)
    finally:
        engine.close()


def test_fused_3d_experts_are_split_per_expert_and_restacked(tmp_path):
    src = tmp_path / "fused"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 3,
                                                 "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 16,
                                                 "hidden_size": 12, "num_hidden_layers": 1, "num_attention_heads": 2,
                                                 "intermediate_size": 4, "moe_intermediate_size": 4,
                                                 "num_experts_per_tok": 1}))
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 8, 12, generator=gen),
        "model.layers.0.mlp.experts.down_proj": torch.randn(3, 6, 8, generator=gen),
        "model.layers.0.mlp.gate.weight": torch.randn(3, 8, generator=gen),
    }
    from safetensors.torch import save_file

    save_file(tensors, str(src / "model.safetensors"))
    store = import_checkpoint(str(src), str(tmp_path / "store"))
    got = store.read_expert(0, 2)
    assert torch.equal(got["model.layers.0.mlp.experts.gate_up_proj"], tensors["model.layers.0.mlp.experts.gate_up_proj"][2])
    assert torch.equal(got["model.layers.0.mlp.experts.down_proj"], tensors["model.layers.0.mlp.experts.down_proj"][2])
    assert store.manifest.tensor("model.layers.0.mlp.gate.weight").group == "dense"
    export_checkpoint(store, str(tmp_path / "out"))
    assert_bit_exact(tensors, load_safetensors_dir(tmp_path / "out"))


def test_import_can_cast_floating_tensors(hf_olmoe, tmp_path):
    store = import_checkpoint(str(hf_olmoe), str(tmp_path / "store"), dtype="bfloat16")
    assert store.describe()["dtypes"] == ["BF16"]
    src = load_safetensors_dir(hf_olmoe)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert torch.equal(store.read_expert(1, 2)[name], src[name].bfloat16())
    assert store.verify() == []


@pytest.mark.slow  # starts processes
def test_import_peak_memory_stays_near_the_largest_tensor(tmp_path):
    """Import streams: a 96 MiB checkpoint imports with far less than 96 MiB of extra peak RSS."""
    import subprocess
    import sys

    src = tmp_path / "big"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8, "vocab_size": 32,
                                                 "hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 3,
                                                 "num_attention_heads": 8, "num_experts_per_tok": 2}))
    outs = []
    for layer in range(3):
        for e in range(8):
            for w in ("w1", "w2"):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                outs.append(OutTensor(name=name, dtype="F32", shape=(512, 512), nbytes=1 << 20,
                                      data=lambda: torch.ones(512 * 512).numpy()))
    write_file(str(src / "model.safetensors"), outs)
    code = (
        "import resource, sys\n"
        "from semoe.checkpoints.hf_convert import import_checkpoint\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "import_checkpoint(sys.argv[1], sys.argv[2])\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)\n"
    )
    # a fresh process: the baseline includes torch and tensorstore, the growth is the import's
    res = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "store")], capture_output=True,
                         text=True, check=True)
    growth = int(res.stdout.strip().splitlines()[-1])
    model_bytes = 48 << 20
    assert growth < model_bytes // 2, f"import grew RSS by {growth} bytes for a {model_bytes}-byte model"
    assert Store.open(str(tmp_path / "store")).verify() == []


# -- bad input --------------------------------------------------------------------------------

def _copy(src, tmp_path, name="ck"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_missing_config_json(hf_olmoe, tmp_path):
    ck = _copy(hf_olmoe, tmp_path)
    os.remove(ck / "config.json")
    with pytest.raises(BadInputError, match=r"config\.json: missing"):
        import_checkpoint(str(ck), str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


def test_import_accepts_the_model_types_the_model_builds():
    from semoe.model.config import ARCHITECTURES

    # gpt_moe is trained here and saved as semoe_gpt
    assert SUPPORTED_MODEL_TYPES == (*(a for a in ARCHITECTURES if a != "gpt_moe"), "semoe_gpt")


@pytest.mark.parametrize("change, reason", [
    ({"model_type": "llama"}, "unknown architecture model_type='llama'; supported: "),
    ({"vision_config": {"hidden_size": 32}}, "multimodal checkpoint (vision_config) is not supported"),
], ids=["llama", "vision_config"])
def test_unsupported_architecture_is_refused_alike_by_import_and_by_the_model(hf_olmoe, tmp_path, change, reason):
    from semoe.checkpoints.model_io import load_model
    from semoe.model.config import ARCHITECTURES

    ck = _copy(hf_olmoe, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, **change}))
    messages = set()
    for refuse in (open_checkpoint, lambda path: import_checkpoint(path, str(tmp_path / "store")), load_model):
        with pytest.raises(BadInputError) as e:
            refuse(str(ck))
        messages.add(str(e.value))
    (message,) = messages  # word for word the same
    assert message.startswith(f"{ck / 'config.json'}: {reason}") and "\n" not in message
    if change.get("model_type") == "llama":  # a type refused for no named reason: the line lists what is supported
        listed = message.split("; supported: ")[1].split(", ")
        assert listed == [a for a in ARCHITECTURES if a != "gpt_moe"] + ["semoe_gpt"]
    assert not (tmp_path / "store").exists()


def test_truncated_safetensors_leaves_nothing_behind(hf_mixtral_sharded_bf16, tmp_path):
    ck = _copy(hf_mixtral_sharded_bf16, tmp_path)
    victim = sorted(ck.glob("*.safetensors"))[-1]
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(BadInputError, match=rf"{victim.name}: truncated safetensors file"):
        import_checkpoint(str(ck), str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


def test_corrupt_safetensors_header(hf_olmoe, tmp_path):
    ck = _copy(hf_olmoe, tmp_path)
    with open(ck / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe garbage")
    with pytest.raises(BadInputError, match=r"model\.safetensors: corrupt safetensors file \(header is not JSON\)"):
        import_checkpoint(str(ck), str(tmp_path / "store"))


def test_failure_mid_import_removes_the_target(hf_mixtral_sharded_bf16, tmp_path, monkeypatch):
    """Data is cut short after the header was checked (the file shrinks during the import)."""
    from storage import safetensors_io

    calls = [0]
    real = safetensors_io.TensorRef.read_into

    def flaky(self, out, **kw):
        calls[0] += 1
        if calls[0] == 20:
            raise BadInputError(f"{self.path}: truncated safetensors file (tensor {self.name} is cut short)")
        return real(self, out, **kw)

    monkeypatch.setattr(safetensors_io.TensorRef, "read_into", flaky)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="is cut short"):
        import_checkpoint(str(hf_mixtral_sharded_bf16), str(tmp_path / "empty"))
    assert os.listdir(tmp_path / "empty") == []


def test_non_empty_target_is_refused(hf_olmoe, tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "keep.txt").write_text("user data")
    with pytest.raises(BadInputError, match="target directory is not empty"):
        import_checkpoint(str(hf_olmoe), str(tmp_path / "store"))
    assert (tmp_path / "store" / "keep.txt").read_text() == "user data"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    store = import_checkpoint(str(hf_olmoe), str(tmp_path / "store2"))
    with pytest.raises(BadInputError, match="target directory is not empty"):
        export_checkpoint(store, str(tmp_path / "out"))


def test_index_naming_a_missing_tensor(hf_mixtral_sharded_bf16, tmp_path):
    ck = _copy(hf_mixtral_sharded_bf16, tmp_path)
    index = json.loads((ck / INDEX_FILE).read_text())
    index["weight_map"]["model.layers.9.ghost.weight"] = sorted(set(index["weight_map"].values()))[0]
    (ck / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(BadInputError, match=r"tensor model\.layers\.9\.ghost\.weight listed in"):
        open_checkpoint(str(ck))


@pytest.mark.parametrize("arch, text_arch, tower, projector", [
    ("kimi_k25", "deepseek_v3", "vision_tower.", "mm_projector"),
    ("llama4", "llama4_text", "vision_model.", "multi_modal_projector")])
def test_a_multimodal_checkpoint_gives_its_text_model_and_keeps_the_rest(tmp_path, caplog, arch, text_arch, tower,
                                                                          projector):
    """Kimi-K2.5 and Llama-4: the text model (`language_model.*`, as published) is imported and runs;
    the vision tower and the projector stay in the store as they are (one warning says so, though
    the checkpoint is opened twice), and export writes the whole checkpoint back bit for bit."""
    from helpers.hf_models import make_hf_checkpoint
    from semoe.checkpoints.model_io import load_store

    hf = make_hf_checkpoint(arch, tmp_path / "hf")
    with caplog.at_level("WARNING", logger="semoe.checkpoints.hf_convert"):
        open_checkpoint(str(hf))
        store = import_checkpoint(str(hf), str(tmp_path / "store"))
    lines = [r.getMessage() for r in caplog.records]
    outside = [t.name for t in store.manifest.tensors if not t.name.startswith("language_model.")]
    assert len(lines) == 1 and lines[0].startswith(f"{arch}: {len(outside)} tensors outside the text model")
    assert any(n.startswith(tower) for n in outside) and any(projector in n for n in outside)
    model = load_store(store)
    assert model.config.arch == text_arch and model.config.weights_prefix == "language_model."
    # the memory a resident load takes counts the text model only (float32 as stored: its bytes)
    from inference.placement import model_bytes

    text = sum(t.bytes for t in store.manifest.tensors if t.name.startswith("language_model."))
    assert model_bytes(store.root).total == model_bytes(str(hf)).total == text
    assert text == sum(p.numel() * 4 for p in model.parameters()) < sum(t.bytes for t in store.manifest.tensors)
    export_checkpoint(store, str(tmp_path / "out"))
    assert_bit_exact(load_safetensors_dir(hf), load_safetensors_dir(tmp_path / "out"))


@pytest.mark.parametrize("model_type", [t for t in SUPPORTED_MODEL_TYPES if t != "semoe_gpt"]
                         + ["kimi_k25", "llama4", "qwen3_5_moe"])
def test_a_config_without_its_fields_is_refused_in_one_line_for_every_model_type(model_type):
    """Every model type import takes, from a config.json that names only the type: one BadInputError line
    naming the file (never a KeyError from deep in a builder)."""
    with pytest.raises(BadInputError) as e:
        check_supported({"model_type": model_type}, "ck/config.json")
    assert str(e.value).startswith("ck/config.json: ") and "\n" not in str(e.value)
