"""Count the operations that make the host wait for the device.

On CUDA, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``), copying
it to the CPU, or asking for a data-dependent shape (``nonzero``, ``repeat_interleave`` without
``output_size``, boolean-mask indexing) blocks until every kernel queued before it has run; in a
per-layer path that stalls the copy/compute overlap. The same calls run on CPU, so a test on CPU
can pin how many a decode step or a training step makes.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
# Always a sync when the tensor lives on a GPU.
_READS = {
    _T.item: "item", _T.tolist: "tolist", _T.__bool__: "bool", _T.__int__: "int", _T.__float__: "float",
    _T.__index__: "index", _T.numpy: "numpy", _T.cpu: "cpu",
}
# Output shape depends on the values.
_SHAPES = {
    torch.nonzero: "nonzero", _T.nonzero: "nonzero", torch.argwhere: "nonzero", torch.where: "where",
    torch.unique: "unique", _T.unique: "unique", torch.masked_select: "masked_select",
    _T.masked_select: "masked_select",
}


def _is_tensor_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is not _T.to:
        return False
    for a in list(args[1:]) + list(kwargs.values()):
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


class HostSyncCounter(TorchFunctionMode):
    """A torch function mode that counts host-synchronising calls by kind (``counts``) and in
    total (``total``). Use as a context manager around the code to measure."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        """All counted calls."""
        return sum(self.counts.values())

    def reset(self) -> None:
        """Forget what was counted."""
        self.counts.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _READS.get(func) or _SHAPES.get(func)
        if func is torch.where and len(args) + len(kwargs) != 1:
            name = None  # the three-argument where is elementwise
        if name is None and func in (torch.repeat_interleave, _T.repeat_interleave):
            if "output_size" not in kwargs and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                          torch.Tensor):
                name = "repeat_interleave"
        if name is None and _is_tensor_to_host(func, args, kwargs):
            name = "to_cpu"
        if name is None and func is _T.__getitem__ and _has_bool_index(args[1] if len(args) > 1 else None):
            name = "mask_index"
        if name is not None:
            self.counts[name] += 1
        return func(*args, **kwargs)


def _has_bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
