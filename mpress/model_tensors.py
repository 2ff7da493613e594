"""Which tensors a saved-tensor hook sees are model data (parameters, buffers and autocast's copies
of weights, held all step anyway) rather than activations: shared by the profiler, which leaves them
out of a layer's saved bytes, and the executor, which lets them pass untouched."""

from __future__ import annotations

import torch
from torch import nn


def param_storages(module: nn.Module) -> set[int]:
    """Addresses of the storages of `module`'s parameters and buffers."""
    tensors = [*module.parameters(), *module.buffers()]
    return {t.untyped_storage().data_ptr() for t in tensors}


def is_parameter(tensor: torch.Tensor, storages: set[int]) -> bool:
    """True when `tensor` is (a view of) one of the parameters whose `param_storages` are given."""
    return tensor.untyped_storage().data_ptr() in storages


_VIEWS = frozenset({"TBackward0", "TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0", "PermuteBackward0",
                    "ExpandBackward0", "AliasBackward0"})


def is_weight_cast(tensor: torch.Tensor, param_ids: set[int]) -> bool:
    """True when `tensor` is (a view of) a dtype cast of one of the parameters whose ids are
    given: under autocast, the low-precision copy of a weight that autocast caches for the whole
    autocast region and a matmul saves for its backward. It is held once, however many forwards
    save it, so it is model data (`LayerProfile.param_bytes`), not an activation."""
    fn = tensor.grad_fn
    while fn is not None and fn.name() in _VIEWS:
        fn = fn.next_functions[0][0]
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    source = fn.next_functions[0][0]
    return source is not None and id(getattr(source, "variable", None)) in param_ids


class ModelDataTensors:
    """Which tensors a saved-tensor hook sees are model data rather than activations: `kind(t)`
    is "parameter" for (views of) the modules' parameters and buffers, "cast" for autocast's
    copies of their weights (`is_weight_cast`), None for an activation."""

    def __init__(self, *modules: nn.Module) -> None:
        self.storages = set().union(*(param_storages(m) for m in modules))
        self.ids = {id(p) for m in modules for p in m.parameters()}

    def kind(self, tensor: torch.Tensor) -> str | None:
        if is_parameter(tensor, self.storages):
            return "parameter"
        return "cast" if is_weight_cast(tensor, self.ids) else None
