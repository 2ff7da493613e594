"""Where a store keeps things and how a chunk is laid out: the version folders' names, the expert
arrays' paths, tensors packed in a chunk (offsets padded for O_DIRECT) and typed views of them.
Pure helpers under `storage.store` and its writers."""

from __future__ import annotations

import os

import numpy as np
import torch

from storage.dtypes import torch_dtype
from storage.chunk_io import ALIGN
from storage.manifest import TensorEntry

TENSOR_ALIGN = ALIGN  # tensors in a chunk start on block boundaries: each can be read (O_DIRECT) and
# checksummed by its own thread


def vdir(version: int) -> str:
    return f"v{version:08d}"


def expert_array_rel(version: int, layer: int, kind: str) -> str:
    """Store-relative path of one layer's (experts, chunk_bytes) array of one kind in a version: the
    one naming scheme of expert arrays, for writers in this process and in others."""
    return os.path.join("arrays", vdir(version), "experts", f"L{layer:04d}.{kind}")


def chunk_layout(tensors: list[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Offsets of tensors packed in a chunk and the chunk's size, padded for O_DIRECT."""
    offsets, pos = [], 0
    for dtype, shape in tensors:
        pos = -(-pos // TENSOR_ALIGN) * TENSOR_ALIGN
        offsets.append(pos)
        pos += dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    return offsets, max(ALIGN, -(-pos // ALIGN) * ALIGN)


def tensor_view(buf: torch.Tensor, entry: TensorEntry, base: int = 0) -> torch.Tensor:
    """A typed view of one tensor's bytes inside a uint8 buffer holding its file from `base`."""
    start = entry.offset - base
    raw = buf[start:start + entry.bytes]
    return raw.view(torch_dtype(entry.dtype)).view(entry.shape)


def array_of_chunk(chunk_path: str) -> tuple[str, tuple[int, ...]]:
    """Split a chunk file path into its array directory and chunk index."""
    parts = chunk_path.split(os.sep)
    i = len(parts) - 1
    while i >= 0 and parts[i] != "c":
        i -= 1
    if i < 0:
        return os.path.dirname(chunk_path), ()
    return os.sep.join(parts[:i]), tuple(int(p) for p in parts[i + 1:])


def version_of(name: str) -> int | None:
    if name.startswith("v") and name.endswith(".json") and name[1:-5].isdigit():
        return int(name[1:-5])
    return None
