"""What an engine is asked for: device, compute dtype and, for offload, each tier's budget and
policies. Its own module so that the ring, which the engine builds, can take it too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.memory_guard import CPU_CACHE_AUTO
from inference.offload.hybrid_placement import EXPERTS_ON
from semoe.model.compact_linear import DENSE_CHOICES
from storage.chunk_io import ReadMode

__all__ = ["EngineConfig"]


@dataclass(kw_only=True)
class EngineConfig:
    """Where the model runs and, for offload, the memory budgets of each tier."""

    device: str = "cpu"
    dtype: str | None = None  # None: bfloat16 on CUDA (tensor-core rate), float32 on CPU
    # Offload budgets: any of them set keeps the experts in the store. Bytes; the CPU cache also
    # "auto" (CPU_CACHE_AUTO): what the machine has available once the dense weights are loaded, less
    # a reserve (inference.memory_guard.auto_cpu_cache_bytes)
    cpu_cache_bytes: int | str | None = None
    keep_bytes: int = 0  # what an auto CPU cache leaves free beside its reserve (a server's --kv-memory)
    device_memory_bytes: int | None = None  # expert ring in device memory (GPU); sets ring_slots
    ring_slots: int | None = None
    prefetch: bool = True  # routing-aware prefetch of the next layer's experts
    # read predicted experts from SSD ahead of use only while at least this share of guesses is
    # right (0: always; above 1: never). Guesses read only while the disk is otherwise idle and
    # stop when proved wrong, but each one takes CPU-cache room from an expert that may be needed
    # again: with a small cache, mostly wrong guesses cost more hits than they save reads.
    speculate_min_precision: float = 0.8
    read_mode: ReadMode = ReadMode.DIRECT  # how the store is read: direct (O_DIRECT) | drop | cached
    # which expert the CPU cache evicts; next-use knows that layers run in a cycle, where LRU and
    # LFU's LRU tie-break evict the next layer's experts (see storage.policies.NextUsePolicy)
    cache_policy: str = "next-use"
    # lower the CPU cache's budget while the process keeps faulting its own pages (its code) back in
    # from storage: a budget too large for the memory left (inference.memory_guard)
    memory_guard: bool = True
    # fill the CPU cache with experts, in layer order, up to its budget while loading (as a
    # resident model reads all its weights before its first request); False: fill it lazily
    preload: bool = True
    # the weights outside the experts: float, int8, int4, or auto (int8 on CPU beside int8, int4 or
    # MXFP4 experts: decode streams every dense weight for each token, as it does the experts)
    dense: str = "auto"
    # where routed experts run when offloaded (`inference.offload.hybrid`): hybrid (each where it costs
    # less: the device's cache, the CPU's kernels, or copied for many rows), cpu (every routed expert on
    # the CPU), device (every one streamed to the device through the ring), or auto: hybrid on a GPU,
    # the ring on CPU
    experts_on: str = "auto"
    # hybrid decode's rates (`inference.offload.hybrid_placement.HybridRates`); None: measured at load
    hybrid_rates: object | None = None

    def __post_init__(self) -> None:
        if self.dtype is None:
            self.dtype = "bfloat16" if torch.device(self.device).type == "cuda" else "float32"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        try:
            self.read_mode = ReadMode(self.read_mode)
        except ValueError:
            raise ValueError(f"read_mode must be one of {[m.value for m in ReadMode]}, got {self.read_mode!r}") from None
        if self.dense not in DENSE_CHOICES:
            raise ValueError(f"dense must be one of {', '.join(DENSE_CHOICES)}, got {self.dense!r}")
        if self.experts_on not in EXPERTS_ON:
            raise ValueError(f"experts_on must be {', '.join(EXPERTS_ON[:-1])} or {EXPERTS_ON[-1]}, "
                             f"got {self.experts_on!r}")
        if self.cache_policy == "belady":
            raise ValueError("cache_policy belady needs the future accesses: it is for simulation only")
        if isinstance(self.cpu_cache_bytes, str) and self.cpu_cache_bytes != CPU_CACHE_AUTO:
            raise ValueError(f"cpu_cache_bytes must be a number of bytes or {CPU_CACHE_AUTO!r}, "
                             f"got {self.cpu_cache_bytes!r}")
        for name in ("cpu_cache_bytes", "device_memory_bytes", "ring_slots"):
            v = getattr(self, name)
            if v is not None and v != CPU_CACHE_AUTO and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")

    @property
    def hybrid(self) -> bool:
        """Whether offloaded experts run where each costs less (or all on the CPU) rather than all
        streamed through the device ring: asked for, or by default on a GPU."""
        if self.experts_on == "auto":
            return torch.device(self.device).type == "cuda"
        return self.experts_on in ("hybrid", "cpu")

    @property
    def offloaded(self) -> bool:
        """Whether experts stay in the store (any budget given)."""
        return any(v is not None for v in (self.cpu_cache_bytes, self.device_memory_bytes, self.ring_slots))
