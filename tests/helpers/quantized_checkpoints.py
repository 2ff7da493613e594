"""DeepSeek-V3's FP8 block-scaled and gpt-oss's MXFP4 checkpoints, written from a float32 one in the
published layouts with the safetensors library (transformers writes neither on CPU)."""

from __future__ import annotations

import json
import math
import re

import torch
from safetensors.torch import save_file

from helpers.hf_models import load_safetensors_dir
from semoe.checkpoints.hf_convert import INDEX_FILE

FP8_MAX = 448.0
# DeepSeek-V3 quantizes every linear of its decoder layers (attention, dense MLP, shared and routed
# experts); embeddings, norms, the router and lm_head stay in high precision
FP8_QUANTIZED = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")
FP4_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])



def quantize_fp8(w_OI: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax float8_e4m3fn quantization, as DeepSeek-V3 ships it: (weight, weight_scale_inv)."""
    (rows, cols), (b0, b1) = w_OI.shape, block
    padded = torch.zeros(math.ceil(rows / b0) * b0, math.ceil(cols / b1) * b1)
    padded[:rows, :cols] = w_OI
    amax = padded.unflatten(0, (-1, b0)).unflatten(2, (-1, b1)).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w_OI / expand_blocks(scale_inv, block, w_OI.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]


def dequantize_fp8_reference(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (q.to(torch.float32) * expand_blocks(scale_inv, block, q.shape)).to(dtype)


# DeepSeek-V4's products, as its checkpoints name them: the attention's and every expert's (shared included)
FP8_QUANTIZED_V4 = re.compile(r"^model\.layers\.\d+\.(attn\.w(q_a|q_b|kv|o_b)|ffn\.(experts\.\d+|shared_experts)"
                              r"\.w[123])\.weight$")


def write_fp8_checkpoint(src, dst, block: tuple[int, int], *, mtp: bool = True,
                         quantized: re.Pattern = FP8_QUANTIZED) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's published layout: FP8 weights (those `quantized` names) with float32 `weight_scale_inv`,
    sharded, and (with `mtp`, for the 2-layer model of hidden size 32 that test_hf_quantized makes) a
    multi-token-prediction layer (layer 2 of 2) spread over both shards. Returns what was written."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    plain = load_safetensors_dir(src)
    if not mtp:
        written = {}
        for name, t in plain.items():
            if quantized.match(name):
                written[name], written[name + "_scale_inv"] = quantize_fp8(t, block)
            else:
                written[name] = t
        save_file(written, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return written
    mtp = {k.replace("layers.1.", "layers.2."): v for k, v in plain.items() if k.startswith("model.layers.1.")}
    mtp.update({f"model.layers.2.{k}": torch.ones(32) for k in ("enorm.weight", "hnorm.weight",
                                                               "shared_head.norm.weight")})
    mtp["model.layers.2.eh_proj.weight"] = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    mtp["model.layers.2.embed_tokens.weight"] = plain["model.embed_tokens.weight"]
    mtp["model.layers.2.shared_head.head.weight"] = plain["lm_head.weight"]
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for i, tensors in enumerate((plain, mtp)):
        for name, t in tensors.items():
            if FP8_QUANTIZED.match(name):
                shards[i][name], shards[i][name + "_scale_inv"] = quantize_fp8(t, block)
            else:
                shards[i][name] = t
    shards[0]["model.layers.2.enorm.weight"] = shards[1].pop("model.layers.2.enorm.weight")
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {k: v for shard in shards for k, v in shard.items()}


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's published layout of a fused (E, in, out) expert weight: blocks (E, out, in/32, 16) packing
    two e2m1 codes per byte (low nibble first), and e8m0 scales (E, out, in/32) biased by 127."""
    groups = w.transpose(1, 2).unflatten(-1, (-1, 32))  # (E, out, G, 32)
    amax = groups.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - FP4_E2M1[:8]).abs().argmin(-1) + 8 * (scaled < 0)  # nearest, sign bit
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def write_mxfp4_checkpoint(src, dst) -> dict[str, torch.Tensor]:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {}
    for name, t in load_safetensors_dir(src).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(t)
        else:
            tensors[name] = t.to(torch.bfloat16)  # gpt-oss ships the rest in bfloat16
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return tensors
