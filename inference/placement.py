"""Where a model's experts live when the user names no budget: all in memory where the model fits
what the machine has available, behind a CPU cache sized from that memory (`--cpu-cache auto`)
where it does not.

The model's bytes in memory are counted from the store's manifest or the checkpoint's headers, as
loading would hold them: compact (quantized) tensors as stored, float ones in the compute dtype
(float32 on CPU: a bfloat16 checkpoint takes twice its file size). It is an upper bound: `--dense
auto` quantizes the dense weights at load beside compact experts, and a resident model holds its
KV cache besides. What is available is the kernel's MemAvailable on CPU and the free device memory
on a GPU, less the reserve `--cpu-cache auto` keeps (`memory_guard`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

from inference.memory_guard import CPU_CACHE_AUTO, spare_bytes
from storage.formats import int8_rows_spec
from storage.process_memory import available_ram_bytes
from storage.reader import StoreReader, is_store

FLOAT_DTYPES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}  # safetensors dtypes held in the compute dtype


@dataclass(frozen=True)
class ModelBytes:
    """A model's bytes in memory once loaded resident, and its experts' share; and both as stored
    (what a load reads)."""

    total: int
    experts: int
    stored: int = 0
    stored_experts: int = 0


def _text_prefix(config: dict) -> str:
    """What the names of the tensors the model loads start with: a multimodal checkpoint's text
    model's prefix (`semoe.model.hf_names.TEXT_MODELS`), else ""."""
    from semoe.model.hf_names import TEXT_MODELS

    return TEXT_MODELS.get(str(config.get("model_type", "")), (None, ""))[1]


def model_bytes(path: str, compute_itemsize: int = 4, manifest=None) -> ModelBytes:
    """The bytes a resident load of the store or HuggingFace directory at `path` holds, weights only
    (headers and manifest only, `manifest` where the caller read it; no tensor data is read)."""
    def held(dtype: str, numel: int, stored: int, compact: bool) -> int:
        return stored if compact or dtype not in FLOAT_DTYPES else numel * compute_itemsize

    total = experts = stored = stored_experts = 0
    if manifest is not None or is_store(path):
        manifest = manifest or StoreReader.open(path).manifest
        prefix = _text_prefix((manifest.model or {}).get("config") or {})
        for t in manifest.tensors:
            # a training run's optimizer states, and a multimodal checkpoint's vision tower: never loaded
            if t.kind != "weight" or not t.name.startswith(prefix):
                continue
            b = held(t.dtype, math.prod(t.shape), t.bytes, t.quant is not None)
            total += b
            if t.group == "expert":
                experts += b
            else:
                stored += t.bytes
        # an expert is read as its chunk file: its tensors, each padded to a block
        stored_experts = sum(c.bytes for c in manifest.chunks if c.kind == "weight")
        return ModelBytes(total, experts, stored + stored_experts, stored_experts)
    from semoe.checkpoints.hf_convert import open_checkpoint

    ck = open_checkpoint(path)
    expert_names = {part.ref.name for by_expert in ck.experts.values() for parts in by_expert.values()
                    for part in parts}
    prefix = _text_prefix(ck.config)
    for name, ref in ck.tensors.items():
        if not name.startswith(prefix):
            continue
        b = held(ref.dtype, math.prod(ref.shape), ref.nbytes, name in ck.quant)
        total += b
        stored += ref.nbytes
        if name in expert_names:
            experts += b
            stored_experts += ref.nbytes
    return ModelBytes(total, experts, stored, stored_experts)


@dataclass(frozen=True)
class Placement:
    """The choice for one model: `cpu_cache` is None (every expert resident) or CPU_CACHE_AUTO."""

    cpu_cache: str | None
    model: ModelBytes
    available: int
    where: str  # "memory" on CPU, "device memory" on a GPU

    def describe(self) -> str:
        """What was chosen and why, in a phrase."""
        gib = 2 ** 30
        sizes = f"{self.model.total / gib:.2f} GiB of weights, {self.available / gib:.2f} GiB of {self.where} available"
        if self.cpu_cache is None:
            return f"{sizes}: every expert resident"
        return f"{sizes}: experts offloaded to the store behind a CPU cache sized from the memory left"

    def describe_lean(self, how: str = "decoding in a process without torch (as --lean)", cache: str | None = None,
                      engine: str = "--resident or a budget flag") -> str:
        """The same where the runner's model takes the model (`lean_refusal`), in a phrase; `how`: the
        path's words (generate's process without torch, serve's kernels); `cache`: the flag that sized the
        runner's cache, where one did; `engine`: the flags that would have kept the engine."""
        gib = 2 ** 30
        sized = f"sized as {cache} asks" if cache else "sized from the memory left"
        return (f"{self.model.total / gib:.2f} GiB of weights, {self.available / gib:.2f} GiB of memory available: "
                f"{how}, experts read from the store into a cache {sized} ({engine}: the engine)")


def choose(path: str, *, device: str = "cpu", compute_itemsize: int = 4, keep_bytes: int = 0,
           available: Callable[[], int] | None = None, mb: ModelBytes | None = None) -> Placement:
    """Resident where the model's bytes fit what is available less the reserve and `keep_bytes` (a
    server's KV memory); else offloaded behind an auto-sized CPU cache. `mb`: the model's bytes where
    the caller has them (`model_bytes` with the same `compute_itemsize`)."""
    mb = mb or model_bytes(path, compute_itemsize)
    where = "memory"
    if available is None:
        if device.startswith("cuda"):
            import torch

            free, _ = torch.cuda.mem_get_info(torch.device(device))
            available, where = (lambda: free), "device memory"
        else:
            available = available_ram_bytes
    have = available()
    fits = mb.total <= spare_bytes(have, keep_bytes)
    return Placement(None if fits or mb.experts == 0 else CPU_CACHE_AUTO, mb, have, where)


def gpu_present() -> bool:
    """Whether the machine shows an NVIDIA GPU (its driver's list), asked without loading torch."""
    gpus = "/proc/driver/nvidia/gpus"
    return os.path.isdir(gpus) and bool(os.listdir(gpus))


def tensor_refusal(t) -> str | None:
    """Why the torch-free runner would not read a store's tensor (`t`, a `storage.manifest.TensorEntry`)
    as stored, in a phrase; None where it would: float32, bfloat16, FP8, int8 or GGUF-block dense weights (and
    a hash router's int64 table), and
    experts stored as its kernels take them (`EXPERT_KINDS`), FP8 with scales per square tile only."""
    from inference.torch_free.runner import EXPERT_KINDS

    if t.kind != "weight":
        return None
    scheme = (t.quant or {}).get("scheme")
    if t.group != "expert":
        if t.dtype == "I64" and not scheme and t.name.endswith(".tid2eid"):  # DeepSeek-V4's hash table
            return None
        if not (scheme in ("fp8", "ggml") or int8_rows_spec(t.quant)) and (scheme or t.dtype not in ("F32", "BF16")):
            return (f"it reads dense weights stored F32, BF16, FP8, int8 or GGUF blocks, not {scheme or t.dtype} "
                    f"({t.name})")
        return None
    scales = "scales_of" in (t.quant or {})  # a compact weight's scales, read with its codes
    if not scales and (scheme or t.dtype) not in EXPERT_KINDS:
        return f"it reads experts stored {', '.join(EXPERT_KINDS)}, not {scheme or t.dtype} ({t.name})"
    if scheme == "fp8" and len(set(t.quant["block"])) != 1:
        return f"it takes fp8 experts with scales per square tile, not per {t.quant['block']} block ({t.name})"
    return None


def lean_refusal(path: str) -> str | None:
    """Why the torch-free runner (`inference.torch_free.runner`) would not decode the model at `path`, in a phrase;
    None where it would: it reads stores, computes with the compiled CPU kernels, and takes what the
    one-call step takes (`semoe.decode.support`). Imports no torch."""
    if not is_store(path):
        return "it reads stores, not HuggingFace directories"
    from semoe.kernels import loader
    from semoe.decode.support import one_call_refusal
    from semoe.checkpoints.hf_config import store_model_config

    if loader.library() is None:
        return f"semoe's compiled CPU kernels are {loader.status()}"
    store = StoreReader.open(path)
    if not store.manifest.has_file("config.json"):
        return "the store holds no model (no config.json)"
    why = one_call_refusal(store_model_config(store))  # the model's parts first: what it is, then how it is stored
    if why is not None:
        return f"it does not take {why}"
    return next((why for t in store.manifest.tensors if (why := tensor_refusal(t))), None)
