"""zarr v3 arrays through tensorstore: the store's on-disk format, for writing and for checked reads.

Every array uses the plain `bytes` codec (little-endian, no compression), so a chunk file is the
raw tensor bytes and the hot path can read it directly. Dense tensors are typed arrays of one
chunk; the experts of one layer and kind form a uint8 array of shape (experts, chunk_bytes) with
one chunk per expert, whose attributes describe the tensors packed in each chunk.
"""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch

from storage.dtypes import zarr_dtype

_NUMPY = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.bfloat16: ml_dtypes.bfloat16, torch.int64: np.int64, torch.int32: np.int32,
    torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2,
}

_context: ts.Context | None = None


def context() -> ts.Context:
    """One tensorstore context for the process; file writes are synced before they complete."""
    global _context
    if _context is None:
        _context = ts.Context({"file_io_sync": True, "data_copy_concurrency": {"limit": 4}})
    return _context


def tensor_as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes with the matching element type (bfloat16 included)."""
    t = t.detach().contiguous().cpu()
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return raw.view(_NUMPY[t.dtype]).reshape(tuple(t.shape))


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 numpy view (no copy for contiguous CPU tensors)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def chunk_file(array_path: str, index: tuple[int, ...]) -> str:
    """Path of a chunk file under the default v3 chunk key encoding ("c/i/j", "c" for rank 0)."""
    return os.path.join(array_path, "c", *(str(i) for i in index)) if index else os.path.join(array_path, "c")


def _spec(path: str, shape: list[int], chunk: list[int], dtype: str, attrs: dict[str, Any] | None) -> dict:
    meta: dict[str, Any] = {
        "shape": shape,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
        "data_type": dtype,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "fill_value": 0,
    }
    if attrs:
        meta["attributes"] = attrs
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": path},
        "metadata": meta,
        # an all-zero tensor must still be written, or it would read back as "missing"
        "store_data_equal_to_fill_value": True,
        "create": True,
    }


def write_dense(path: str, t: torch.Tensor, attrs: dict[str, Any] | None = None) -> str:
    """Create a one-chunk typed array holding `t`; returns the chunk file's path."""
    shape = list(t.shape)
    arr = ts.open(_spec(path, shape, [max(d, 1) for d in shape], zarr_dtype(t.dtype), attrs),
                  context=context()).result()
    arr.write(tensor_as_numpy(t)).result()
    return chunk_file(path, tuple(0 for _ in shape))


def create_expert_array(path: str, num_experts: int, chunk_bytes: int, attrs: dict[str, Any]) -> ts.TensorStore:
    """Create the (experts, chunk_bytes) uint8 array of one layer and kind."""
    return ts.open(_spec(path, [num_experts, chunk_bytes], [1, chunk_bytes], "uint8", attrs),
                   context=context()).result()


def write_expert_chunk(arr: ts.TensorStore, expert: int, chunk: np.ndarray) -> None:
    """Write one expert's packed bytes as its chunk."""
    arr[expert:expert + 1, :].write(chunk.reshape(1, -1)).result()


def open_array(path: str) -> ts.TensorStore:
    """Open an existing array read-only."""
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}, "open": True},
                   read=True, context=context()).result()

