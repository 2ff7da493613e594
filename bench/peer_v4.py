"""DeepSeek-V4 for llama.cpp's converter, which reads only the release layout: the tensors under DeepSeek's own
names (`embed.weight`, `layers.N.attn.kv_norm.weight`, `hc_head_fn`, ...), the routed experts as MXFP4 (codes
packed two to a byte, an E8M0 exponent per 32 inputs) and the config's release keys (`compress_ratios`,
`num_hash_layers`). The bench's checkpoint holds experts whose float32 values MXFP4 represents exactly
(`mxfp4_exact`), so that llama.cpp's MXFP4 experts, taken to f32, q8_0 or q4_0 by llama-quantize, start from
the very numbers semoe's stores hold.

It imports torch: bench_vs_llamacpp runs it in a process of its own (`peer_checkpoints`)."""

from __future__ import annotations

import json
import os
import re

# E2M1's values, code c and c + 8 (negative) alike
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_exact(w):
    """(w rounded to MXFP4: each row's groups of 32 over the power of two that puts their largest at or
    under 6, to the nearest E2M1 value; codes uint8 (rows, cols / 2), element 2i in the low nibble;
    exponents uint8 (rows, cols / 32), biased by 127)."""
    import torch

    rows, cols = w.shape
    g = w.float().reshape(rows, cols // 32, 32)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -120)
    e = torch.floor(torch.log2(amax)) - 2  # E2M1's largest exponent is 2 (6 = 1.5 x 2^2)
    scale = torch.exp2(e)
    values = torch.tensor(FP4_VALUES)
    mag = (g.abs() / scale).clamp(max=6.0)
    code = (mag[..., None] - values).abs().argmin(-1)  # nearest, the lower value at a tie
    rounded = values[code] * scale * torch.sign(g)
    code = code + 8 * (g < 0)
    pairs = code.reshape(rows, cols // 2, 2).to(torch.uint8)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return rounded.reshape(rows, cols).to(w.dtype), packed, (e[..., 0] + 127).to(torch.uint8)


def round_experts(model) -> None:
    """Every routed expert's weights of a transformers DeepSeek-V4 model rounded to MXFP4 in place."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name and p.dim() == 3:
                for e in range(p.shape[0]):
                    p[e].copy_(mxfp4_exact(p[e])[0])


_ROOT = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
         "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
         "model.hc_head.hc_scale": "hc_head_scale", "head.weight": "head.weight", "lm_head.weight": "head.weight"}
_RATIO_KIND = {"sliding_attention": 0}


def release_copy(hf_dir: str, out_dir: str) -> None:
    """`hf_dir` (a checkpoint transformers wrote) in the release layout in `out_dir`, tokenizer files along."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    rates = cfg.get("compress_rates") or {}
    ratio = {"sliding_attention": 0, "compressed_sparse_attention": rates.get("compressed_sparse_attention", 4),
             "heavily_compressed_attention": rates.get("heavily_compressed_attention", 128)}
    cfg["compress_ratios"] = [ratio[t] for t in cfg["layer_types"]]
    cfg["num_hash_layers"] = sum(1 for t in cfg["mlp_layer_types"] if t == "hash_moe")
    os.makedirs(out_dir, exist_ok=True)
    files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    for i, name in enumerate(files):
        out = {}
        with safe_open(os.path.join(hf_dir, name), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                if k in _ROOT:
                    out[_ROOT[k]] = t
                    continue
                k = k.removeprefix("model.").replace(".attn.norm.weight", ".attn.kv_norm.weight")
                if re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", k):
                    rounded, packed, exps = mxfp4_exact(t)
                    if not torch.equal(rounded, t.to(rounded.dtype)):
                        raise ValueError(f"{name}: tensor {k} is not MXFP4-exact (round_experts)")
                    out[k], out[k.removesuffix(".weight") + ".scale"] = packed, exps
                else:
                    out[k] = t
        save_file(out, os.path.join(out_dir, f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    for n in os.listdir(hf_dir):
        if n.startswith("tokenizer") or n in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(os.path.join(hf_dir, n), out_dir)
