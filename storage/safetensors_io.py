"""Streaming access to safetensors files: header checks, ranged reads, and a bounded-memory writer.

The safetensors library loads whole files or memory-maps them; a store import must read one tensor
at a time into buffers it owns (peak memory near the largest tensor, not the model), and an export
must write one tensor at a time. Both only need the header, which this module parses and checks
strictly so that truncated or corrupt files are refused before anything is written. The files it
writes are read back with the safetensors library in the tests.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from storage.formats import itemsize
from storage.dtypes import torch_dtype
from storage.errors import BadInputError

MAX_HEADER_BYTES = 100 << 20


@dataclass(kw_only=True, frozen=True)
class TensorRef:
    """Where one tensor lies in a safetensors file."""

    name: str
    path: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int

    def read_into(self, out: memoryview, *, offset: int = 0, nbytes: int | None = None) -> None:
        """Read the tensor's bytes (or `nbytes` from `offset` within it) into `out`."""
        n = self.nbytes - offset if nbytes is None else nbytes
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < n:
                got = os.preadv(f.fileno(), [out[done:n]], self.start + offset + done)
                if got == 0:
                    raise BadInputError(f"{self.path}: truncated safetensors file (tensor {self.name} is cut short)")
                done += got

    def read(self) -> np.ndarray:
        """The tensor's bytes as a new uint8 array."""
        buf = np.empty(self.nbytes, dtype=np.uint8)
        self.read_into(memoryview(buf))
        return buf


def read_header(path: str) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Parse and check a safetensors header: tensors by name, and the file's __metadata__."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BadInputError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise BadInputError(f"{path}: corrupt or truncated safetensors file (header of {n} bytes in a "
                                    f"{size}-byte file)")
            raw = f.read(n)
    except FileNotFoundError:
        raise BadInputError(f"{path}: file is missing") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadInputError(f"{path}: corrupt safetensors file (header is not JSON)") from None
    if not isinstance(doc, dict):
        raise BadInputError(f"{path}: corrupt safetensors file (header is not a JSON object)")
    meta = doc.pop("__metadata__", None) or {}
    base = 8 + n
    refs: dict[str, TensorRef] = {}
    for name, info in doc.items():
        try:
            dtype = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise BadInputError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
        try:
            want = itemsize(dtype) * int(np.prod(shape, dtype=np.int64))
        except BadInputError:
            raise BadInputError(f"{path}: tensor {name} has unsupported dtype {dtype!r}") from None
        if end - start != want or start < 0:
            raise BadInputError(f"{path}: tensor {name} spans {end - start} bytes, its dtype and shape need {want}")
        if base + end > size:
            raise BadInputError(f"{path}: truncated safetensors file (tensor {name} ends at byte {base + end}, "
                                f"file has {size})")
        refs[name] = TensorRef(name=name, path=path, dtype=dtype, shape=shape, start=base + start, nbytes=want)
    return refs, {str(k): str(v) for k, v in meta.items()}


@dataclass(kw_only=True, frozen=True)
class OutTensor:
    """A tensor to write: its header fields and a function that yields its bytes when its turn comes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    data: Callable[[], bytes | memoryview | np.ndarray]


def write_file(path: str, tensors: Iterable[OutTensor], metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file one tensor at a time; returns its size. Data is fsynced."""
    tensors = list(tensors)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    pos = 0
    for t in tensors:
        torch_dtype(t.dtype)  # refuses unknown dtypes before anything is written
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned, as the safetensors library does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors:
            data = t.data()
            n = memoryview(data).nbytes
            if n != t.nbytes:
                raise BadInputError(f"tensor {t.name}: got {n} bytes to write, header says {t.nbytes}")
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()
