"""Synthetic Mixtral-layout checkpoints for the demo and the benchmarks (no network, no transformers).

The tensors are random but the layout, names, config and sharding are those of a real Mixtral
checkpoint, so the store import treats it exactly as it would a downloaded one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from storage.dtypes import dtype_name
from storage.safetensors_io import OutTensor, write_file


@dataclass(kw_only=True)
class SyntheticMoE:
    """Shape of a synthetic Mixtral-layout model."""

    layers: int = 4
    experts: int = 8
    hidden: int = 256
    ffn: int = 512
    vocab: int = 1024
    heads: int = 8
    kv_heads: int = 2
    top_k: int = 2
    dtype: str = "bfloat16"
    shard_bytes: int = 32 << 20  # split into files of about this size, with an index

    def __post_init__(self) -> None:
        for name in ("layers", "experts", "hidden", "ffn", "vocab", "heads", "kv_heads", "top_k", "shard_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden ({self.hidden}) must divide by heads ({self.heads}), heads by kv_heads")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def config(self) -> dict:
        """A config.json as transformers writes it for MixtralForCausalLM."""
        return {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": self.vocab,
            "hidden_size": self.hidden, "intermediate_size": self.ffn, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "num_local_experts": self.experts, "num_experts_per_tok": self.top_k, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "torch_dtype": self.dtype, "hidden_act": "silu",
        }

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and shape, in checkpoint order."""
        h, f, kv = self.hidden, self.ffn, self.hidden // self.heads * self.kv_heads
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                    (f"{p}.self_attn.q_proj.weight", (h, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                    (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, h)),
                    (f"{p}.block_sparse_moe.gate.weight", (self.experts, h))]
            for e in range(self.experts):
                q = f"{p}.block_sparse_moe.experts.{e}"
                out += [(f"{q}.w1.weight", (f, h)), (f"{q}.w2.weight", (h, f)), (f"{q}.w3.weight", (f, h))]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return out

    def expert_bytes(self) -> int:
        """Bytes of all expert tensors."""
        return self.layers * self.experts * 3 * self.hidden * self.ffn * getattr(torch, self.dtype).itemsize


def write_checkpoint(spec: SyntheticMoE, path: str, *, seed: int = 0) -> str:
    """Write the checkpoint (sharded safetensors + index + config.json) into a new directory."""
    os.makedirs(path, exist_ok=False)
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(seed)

    def make(shape: tuple[int, ...]):
        def data():
            t = torch.randn(shape, generator=gen) * 0.02 if len(shape) > 1 else torch.ones(shape)
            return t.to(dtype).reshape(-1).view(torch.uint8).numpy()
        return data

    shards: list[list[OutTensor]] = [[]]
    size = 0
    for name, shape in spec.tensor_shapes():
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > spec.shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(OutTensor(name=name, dtype=dtype_name(dtype), shape=shape, nbytes=nbytes, data=make(shape)))
        size += nbytes
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_file(os.path.join(path, fname), tensors, {"format": "pt"})
        weight_map.update({t.name: fname for t in tensors})
    total = sum(t.nbytes for s in shards for t in s)
    with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(spec.config(), f, indent=2)
    return path
