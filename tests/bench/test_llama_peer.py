"""bench/llama_peer.py's copy of llama.cpp's converter: the lines it patches are found or refused by name,
and the patched Hunyuan parameters take transformers' integers as Tencent's per-layer lists."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import llama_peer as peer  # noqa: E402

# the shape of the converter's Hunyuan class around the lines patched (the real file is in the peer's sdist)
HUNYUAN = f'''
class HunYuanMoEModel:
    def set_vocab(self):
        from transformers import AutoTokenizer
{peer._HY_VOCAB}        self.vocab = "ranks"

    def set_gguf_parameters(self):
{peer._HY_PARAMS}hparams["intermediate_size"])
        self.out = (hparams["moe_intermediate_size"], hparams["moe_topk"], hparams["num_shared_expert"])


class HunYuanModel:  # the dense one: the same line, deeper in, left as it is
    def set_vocab(self):
        if False:
            pass
        else:
            from transformers import AutoTokenizer
    {peer._HY_VOCAB.lstrip(chr(10))}            self.vocab = "ranks"
'''


def _llama_src(root, hunyuan: str = HUNYUAN) -> str:
    conv = root / "conversion"
    conv.mkdir(parents=True)
    (root / "convert_hf_to_gguf.py").write_text("# the script\n")
    (conv / "base.py").write_text(f"def pre():\n    {peer._PRETOK_RAISE}\n")
    (conv / "deepseek.py").write_text(f"def f(tokenizer):\n    {peer._DSV32_BOS}\n")
    (conv / "hunyuan.py").write_text(hunyuan)
    return str(root)


def _hunyuan_class(dest: str):
    ns: dict = {}
    exec(open(os.path.join(dest, "conversion", "hunyuan.py")).read(), ns)
    return ns["HunYuanMoEModel"]


def test_the_converter_copy_takes_transformers_hunyuan_files(tmp_path, monkeypatch):
    dest = str(tmp_path / "converter")
    script = peer._patched_converter(_llama_src(tmp_path / "src"), dest)
    assert os.path.exists(script) and open(os.path.join(dest, "semoe-patches")).read() == peer._PATCHES
    assert 'res = "gpt-2"' in open(os.path.join(dest, "conversion", "base.py")).read()
    patched = open(os.path.join(dest, "conversion", "hunyuan.py")).read()
    assert patched.count('hasattr(tokenizer, "mergeable_ranks")') == 1  # the MoE class's only
    model = _hunyuan_class(dest)()
    written = []
    model.gguf_writer = types.SimpleNamespace(add_expert_shared_feed_forward_length=written.append)
    # transformers' config: integers, no shared-expert count (one), experts as wide as intermediate_size
    model.hparams = {"intermediate_size": 384, "moe_topk": 2, "num_hidden_layers": 3}
    model.set_gguf_parameters()
    assert model.out == ([384] * 3, [2] * 3, [1] * 3) and written == [384]
    # Tencent's lists pass as they are
    model.hparams = {"intermediate_size": 384, "moe_intermediate_size": [256, 256], "moe_topk": [8, 8],
                     "num_shared_expert": [2, 2], "num_hidden_layers": 2}
    model.set_gguf_parameters()
    assert model.out == ([256, 256], [8, 8], [2, 2])
    # a tokenizer without tiktoken ranks takes the BPE path
    gpt2 = []
    model._set_vocab_gpt2 = lambda: gpt2.append(True)
    model.dir_model = "unused"
    fake = types.ModuleType("transformers")
    fake.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: object())
    monkeypatch.setitem(sys.modules, "transformers", fake)
    model.set_vocab()
    assert gpt2 == [True] and not hasattr(model, "vocab")
    fake.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: types.SimpleNamespace(mergeable_ranks={}))
    model.set_vocab()
    assert gpt2 == [True] and model.vocab == "ranks"


def test_a_converter_without_a_line_to_patch_is_refused_by_name(tmp_path):
    src = _llama_src(tmp_path / "src", HUNYUAN.replace("trust_remote_code=True", "trust_remote_code=False"))
    with pytest.raises(RuntimeError, match=r"hunyuan\.py: cannot find the line to patch"):
        peer._patched_converter(src, str(tmp_path / "converter"))
    assert not os.path.exists(tmp_path / "converter")  # nothing half-made where the copy goes


def test_the_converter_is_told_when_a_qwen3_next_checkpoint_has_no_mtp_layers(tmp_path):
    """llama.cpp's converter counts Qwen3-Next's multi-token-prediction layers from its `mtp.*` tensors and
    stops where there are none unless told (`--no-mtp`); other model types get no such flag."""
    import torch
    from safetensors.torch import save_file

    for model_type, names, want in (("qwen3_next", ["model.embed_tokens.weight"], ["--no-mtp"]),
                                    ("qwen3_5_moe_text", ["model.embed_tokens.weight", "mtp.fc.weight"], []),
                                    ("mixtral", ["model.embed_tokens.weight"], [])):
        d = tmp_path / model_type
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
        save_file({n: torch.zeros(1) for n in names}, str(d / "model.safetensors"))
        assert peer._mtp_flags(str(d)) == want, model_type
