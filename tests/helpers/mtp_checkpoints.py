"""Checkpoints with a multi-token-prediction (MTP) layer as DeepSeek-V3, GLM-4.5 and Qwen3-Next publish
them, and transformers' own MTP model of one (`MtpModel`), the drafting tests' oracle."""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file

from helpers.hf_models import load_safetensors_dir, make_hf_checkpoint

MTP_ARCHS = ("deepseek_v3", "glm4_moe", "qwen3_next")


def make_mtp_checkpoint(arch: str, path: pathlib.Path, *, seed: int = 5) -> pathlib.Path:
    """A tiny random checkpoint of `arch` (sharded, with an index) and its MTP layer: a decoder layer of
    the model's kind (made by transformers as layer N of an N + 1-layer model, so named as it saves
    them), its input norms and projection and its output norm, in a shard of its own, named as the
    published checkpoints name them (DeepSeek's and GLM's `model.layers.N.*`, Qwen3-Next's `mtp.*`)."""
    hf = make_hf_checkpoint(arch, path, seed=seed, max_shard_size="200KB")
    cfg = json.loads((hf / "config.json").read_text())
    n, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    over = {"num_hidden_layers": n + 1}
    if arch == "qwen3_next":
        over["layer_types"] = cfg["layer_types"] + ["full_attention"]
    bigger = make_hf_checkpoint(arch, path.parent / (path.name + "-n+1"), seed=seed + 1, **over)
    block = {k: v for k, v in load_safetensors_dir(bigger).items() if k.startswith(f"model.layers.{n}.")}
    if arch == "qwen3_next":  # named apart; its norms are zero-centred (1 + w)
        block = {k.replace(f"model.layers.{n}.", "mtp.layers.0."): v for k, v in block.items()}
        names, one = {"enorm": "mtp.pre_fc_norm_embedding", "hnorm": "mtp.pre_fc_norm_hidden", "proj": "mtp.fc",
                      "post": "mtp.norm"}, 0.0
        cfg["mtp_num_hidden_layers"] = 1
    else:
        p = f"model.layers.{n}."
        names, one = {"enorm": p + "enorm", "hnorm": p + "hnorm", "proj": p + "eh_proj",
                      "post": p + "shared_head.norm"}, 1.0
        cfg["num_nextn_predict_layers"] = 1
    g = torch.Generator().manual_seed(seed)
    for k in ("enorm", "hnorm", "post"):  # away from 1 (or 0), so that each counts
        block[names[k] + ".weight"] = one + 0.2 * torch.randn(D, generator=g)
    block[names["proj"] + ".weight"] = torch.randn(D, 2 * D, generator=g) * (2 * D) ** -0.5
    save_file(block, str(hf / "mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "mtp.safetensors" for k in block})
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf


def mtp_oracle(hf: pathlib.Path):
    """transformers' model of the checkpoint and its MtpModel (the MTP layer as `generate(use_mtp=True)`
    drafts with it). Its name patterns for the layer are the released models' (layer 61 of DeepSeek-V3,
    92 and 46 of GLM's), so the tiny model's are given; Qwen3-Next's config names no MTP layer count."""
    import transformers
    from transformers.modeling_layers import MtpModel

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    text = model.config.get_text_config()
    if text.model_type == "qwen3_next":
        text.num_mtp_layers, text.mtp_layer_types = 1, ["full_attention"]
    else:
        model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{text.num_hidden_layers}\..*"]
    return model, MtpModel.from_pretrained(model).eval()
