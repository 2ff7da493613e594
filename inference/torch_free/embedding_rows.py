"""The token embedding read from storage, one row a token (the lean runner keeps it out of memory):
float32 or bfloat16 rows, or GGUF blocks (a `store quantize --kquant` store's Q6_K rows), decoded by
the `gguf` package's own dequantization."""

from __future__ import annotations

import os

import numpy as np

from semoe.decode.support import NotOnFastPath
from storage.errors import BadInputError
from storage.manifest import TensorEntry
from storage.numpy_codecs import bf16_to_f32


class EmbeddingRows:
    """Rows of a stored (V, D) embedding, by token id."""

    def __init__(self, path: str, entry: TensorEntry, file_path: str) -> None:
        self.ggml_type = None
        if entry.quant and entry.quant.get("scheme") == "ggml":
            self.ggml_type = entry.quant["ggml_type"]
            self.shape = tuple(entry.quant["shape"])
            self.row_bytes = entry.shape[1]
        elif entry.dtype in ("F32", "BF16") and not entry.quant:
            self.shape = tuple(entry.shape)
            self.row_bytes = self.shape[1] * (4 if entry.dtype == "F32" else 2)
        else:
            raise NotOnFastPath(f"{path}: the token embedding is {entry.dtype}; the lean runner reads F32, BF16 "
                                f"or GGUF blocks")
        self.dtype = entry.dtype
        self.offset = entry.offset
        self.fd = os.open(file_path, os.O_RDONLY)

    def read(self, token: int, x: np.ndarray) -> None:
        """Token `token`'s row into x (D,) float32."""
        V, D = self.shape
        if not 0 <= token < V:
            raise BadInputError(f"token id {token} is outside the vocabulary (0..{V - 1})")
        raw = np.frombuffer(os.pread(self.fd, self.row_bytes, self.offset + token * self.row_bytes), np.uint8)
        if self.ggml_type is not None:
            import gguf

            x[:] = gguf.quants.dequantize(raw[None], gguf.GGMLQuantizationType[self.ggml_type])[0]
        elif self.dtype == "F32":
            x[:] = raw.view(np.float32)
        else:
            x[:] = bf16_to_f32(raw.view(np.uint16))

    def close(self) -> None:
        os.close(self.fd)
