"""Fused communication: coalesce many small tensors into a few large flat buffers per collective.

A collective has a fixed cost per call (a launch, a handshake, a ring set-up) that dominates for
small tensors, and a model's gradients are hundreds of small tensors. SE-MoE and DDP therefore pack
them into buckets of a few MiB, run one collective per bucket and split the result back.

The pieces, bookkeeping first, data movement after:
    `FlatLayout`          where each tensor of a list lives in one flat 1-D buffer (pure bookkeeping,
                          plus `pack` / `unpack` / `unpack_into`)
    `bucketize`           greedy, order-keeping grouping of tensors into buckets of bounded bytes
    `fused_all_reduce`    one async all_reduce per bucket, all in flight together, then unpacked
    `GradBucketReducer`   DDP-style gradient all-reduce overlapped with backward

Everything goes through torch.distributed; buffers are allocated on the tensors' own device, so
the same code runs on `gloo` with CPU tensors and on `nccl` with CUDA tensors.

Shape legend:
    N  elements of a flat buffer, alignment padding included
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "DEFAULT_ALIGN_ELEMS",
    "DEFAULT_BUCKET_BYTES",
    "BucketConfig",
    "FlatLayout",
    "bucketize",
    "fused_all_reduce",
    "GradBucketReducer",
]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default: large enough to amortise a collective's set-up
# 16 elements keep every slice 64-byte aligned for float32 (32 bytes for bf16), which vectorised
# copies and NCCL's kernels prefer; the padding costs at most 15 elements per tensor.
DEFAULT_ALIGN_ELEMS = 16


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass, but `bucket_bytes=True` is always a mistake.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(kw_only=True)
class BucketConfig:
    """How tensors are grouped and laid out for fused collectives."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # upper bound on one bucket's flat buffer, in bytes
    align_elems: int = DEFAULT_ALIGN_ELEMS  # every slice starts at a multiple of this many elements

    def __post_init__(self) -> None:
        _check_positive_int("bucket_bytes", self.bucket_bytes)
        _check_positive_int("align_elems", self.align_elems)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _slice_start(end: int, numel: int, align_elems: int) -> int:
    # An empty tensor occupies no bytes, so it is not aligned: that would only add padding and could
    # put its (empty) slice past the end of the buffer.
    return _round_up(end, align_elems) if numel else end


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a list lives in one flat 1-D buffer of `total_numel` elements.

    Slices keep the list's order; each non-empty slice starts at a multiple of `align_elems`.
    There is padding between slices but none after the last one. An empty list gives an empty
    float32 CPU layout.
    """

    dtype: torch.dtype
    device: torch.device
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    total_numel: int  # N, padding between slices included
    align_elems: int = DEFAULT_ALIGN_ELEMS

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor], *, align_elems: int = DEFAULT_ALIGN_ELEMS) -> FlatLayout:
        """The layout of `tensors`, which must share one dtype and one device."""
        _check_positive_int("align_elems", align_elems)
        if not tensors:
            return cls(dtype=torch.float32, device=torch.device("cpu"), shapes=(), offsets=(), numels=(),
                       total_numel=0, align_elems=align_elems)
        dtype, device = tensors[0].dtype, tensors[0].device
        offsets, end = [], 0
        for i, t in enumerate(tensors):
            if t.dtype != dtype or t.device != device:
                raise ValueError(f"tensor {i} is {t.dtype} on {t.device}, but tensor 0 is {dtype} on {device}; "
                                 "a flat layout holds one dtype on one device (bucketize groups them)")
            offsets.append(_slice_start(end, t.numel(), align_elems))
            end = offsets[-1] + t.numel()
        return cls(dtype=dtype, device=device, shapes=tuple(t.shape for t in tensors), offsets=tuple(offsets),
                   numels=tuple(t.numel() for t in tensors), total_numel=end, align_elems=align_elems)

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer, padding included."""
        return self.total_numel * self.dtype.itemsize

    def new_buffer(self, numel: int | None = None) -> Tensor:
        """A zeroed flat buffer (N,) on the layout's device; `numel` may ask for a larger one."""
        numel = self.total_numel if numel is None else numel
        if numel < self.total_numel:
            raise ValueError(f"numel must be at least the layout's total_numel {self.total_numel}, got {numel}")
        return torch.zeros(numel, dtype=self.dtype, device=self.device)

    def pack(self, tensors: Sequence[Tensor | None], *, out: Tensor | None = None) -> Tensor:
        """Copy `tensors` into one flat buffer (`out`, or a new zeroed one) and return it.

        A `None` entry packs as zeros. Padding of a new buffer is zero; padding of `out` is left as
        it was (zero if it came from `new_buffer` and only ever held packed or reduced data).
        """
        if len(tensors) != len(self):
            raise ValueError(f"the layout holds {len(self)} tensors, got {len(tensors)}")
        flat_N = self.new_buffer() if out is None else out
        for i, (t, view) in enumerate(zip(tensors, self.unpack(flat_N, name="out"))):
            if t is None:
                view.zero_()
                continue
            if t.shape != view.shape or t.dtype != self.dtype:
                raise ValueError(f"tensor {i} is {t.dtype} {tuple(t.shape)}, the layout expects "
                                 f"{self.dtype} {tuple(view.shape)}")
            view.copy_(t)
        return flat_N

    def unpack(self, flat_N: Tensor, *, name: str = "flat") -> list[Tensor]:
        """Views of `flat_N`, one per tensor, in the layout's shapes (no copies)."""
        if flat_N.dim() != 1 or flat_N.dtype != self.dtype or flat_N.numel() < self.total_numel:
            raise ValueError(f"{name} must be a 1-D {self.dtype} tensor of at least {self.total_numel} elements, "
                             f"got {flat_N.dtype} {tuple(flat_N.shape)}")
        return [flat_N.narrow(0, offset, numel).view(shape)
                for offset, numel, shape in zip(self.offsets, self.numels, self.shapes)]

    def unpack_into(self, flat_N: Tensor, tensors: Sequence[Tensor]) -> None:
        """Copy each slice of `flat_N` back into the matching tensor, in place."""
        if len(tensors) != len(self):
            raise ValueError(f"the layout holds {len(self)} tensors, got {len(tensors)}")
        for i, (t, view) in enumerate(zip(tensors, self.unpack(flat_N))):
            if t.shape != view.shape:
                raise ValueError(f"tensor {i} has shape {tuple(t.shape)}, the layout expects {tuple(view.shape)}")
            t.copy_(view)


def bucketize(tensors: Sequence[Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
              align_elems: int = DEFAULT_ALIGN_ELEMS) -> list[list[int]]:
    """Group tensor indices into buckets whose flat buffers hold at most `bucket_bytes` each.

    Greedy and order-keeping: a bucket takes consecutive tensors of its (dtype, device) until the
    next one would overflow it; a tensor larger than a bucket gets a bucket of its own. Buckets are
    returned ordered by their first index, indices ascending within each, so every rank that sees
    the same shapes and dtypes derives the same buckets.
    """
    BucketConfig(bucket_bytes=bucket_bytes, align_elems=align_elems)
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}  # -> (indices, end)
    done: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        indices, end = open_buckets.get(key, ([], 0))
        new_end = _slice_start(end, t.numel(), align_elems) + t.numel()
        if indices and new_end * t.element_size() > bucket_bytes:
            done.append(indices)
            indices, new_end = [], t.numel()
        open_buckets[key] = (indices + [i], new_end)
    done.extend(indices for indices, _ in open_buckets.values())
    return sorted(done, key=lambda indices: indices[0])


def _check_floating(tensors: Sequence[Tensor]) -> None:
    # Averaging divides by the world size, which integer tensors cannot represent.
    for i, t in enumerate(tensors):
        if not t.is_floating_point() and not t.is_complex():
            raise TypeError(f"average=True needs floating-point tensors, but tensor {i} is {t.dtype}")


def _packed_buckets(tensors: Sequence[Tensor], cfg: BucketConfig) -> Iterator[tuple[list[int], FlatLayout, Tensor]]:
    """(indices, layout, packed flat buffer) for each bucket of `tensors`."""
    for indices in bucketize(tensors, cfg.bucket_bytes, align_elems=cfg.align_elems):
        members = [tensors[i] for i in indices]
        layout = FlatLayout.from_tensors(members, align_elems=cfg.align_elems)
        yield indices, layout, layout.pack(members)


def fused_all_reduce(tensors: Sequence[Tensor], *, group: dist.ProcessGroup | None = None,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, average: bool = True,
                     align_elems: int = DEFAULT_ALIGN_ELEMS) -> None:
    """All-reduce (sum, or mean with `average`) `tensors` in place, one collective per bucket.

    Every bucket's all_reduce is issued before any is waited on, so transfers overlap each other
    and the packing of later buckets. All ranks must pass tensors of the same shapes and dtypes.
    """
    cfg = BucketConfig(bucket_bytes=bucket_bytes, align_elems=align_elems)
    if average:
        _check_floating(tensors)
    pending = [(indices, layout, flat_N, dist.all_reduce(flat_N, group=group, async_op=True))
               for indices, layout, flat_N in _packed_buckets(tensors, cfg)]
    world_size = dist.get_world_size(group)
    for indices, layout, flat_N, work in pending:
        work.wait()
        if average:
            flat_N.div_(world_size)
        layout.unpack_into(flat_N, [tensors[i] for i in indices])


@dataclass(eq=False)
class _GradBucket:
    """One flat gradient buffer and its progress through the current step."""

    params: list[Tensor]  # reverse parameter order, as gradients become ready
    names: list[str]
    layout: FlatLayout
    flat_N: Tensor  # reused every step
    ready: list[bool] = field(init=False)
    num_ready: int = 0
    work: dist.Work | None = None

    def __post_init__(self) -> None:
        self.ready = [False] * len(self.params)

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.work = None


def _named_trainable(module_or_params: nn.Module | Iterable[Tensor]) -> list[tuple[str, Tensor]]:
    named = (module_or_params.named_parameters() if isinstance(module_or_params, nn.Module)
             else ((f"parameter {i}", p) for i, p in enumerate(module_or_params)))
    seen: set[int] = set()  # a tied parameter must be hooked, and reduced, once
    unique = []
    for name, p in named:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            unique.append((name, p))
    return unique


class GradBucketReducer:
    """Averages gradients over ranks, in buckets launched during backward as their grads become ready.

    Buckets follow reverse parameter order, since the last layers' gradients are ready first, and
    are launched strictly in bucket order so every rank issues the same collectives in the same
    order. Every rank must call `finish()` after each backward: it launches any bucket still
    waiting (a parameter that got no gradient this step, such as an unused expert, counts as
    zeros), waits for all, and writes the averaged gradients into `.grad`. After `finish()` every
    parameter has a `.grad`, zeros if no rank produced one. Zero the gradients before each backward
    (as with DDP); accumulating over several backward calls between `finish()` calls is an error.
    """

    def __init__(self, module_or_params: nn.Module | Iterable[Tensor], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 group: dist.ProcessGroup | None = None, align_elems: int = DEFAULT_ALIGN_ELEMS) -> None:
        self.config = BucketConfig(bucket_bytes=bucket_bytes, align_elems=align_elems)
        self.group = group
        named = _named_trainable(module_or_params)[::-1]
        if not named:
            raise ValueError("module_or_params has no parameters with requires_grad=True")
        for name, p in named:
            if not p.is_floating_point():
                raise TypeError(f"{name} is {p.dtype}; gradients to average must be floating point")
        params = [p for _, p in named]
        self.buckets: list[_GradBucket] = []
        self._hooks = []
        for b, indices in enumerate(bucketize(params, self.config.bucket_bytes, align_elems=self.config.align_elems)):
            members = [params[i] for i in indices]
            layout = FlatLayout.from_tensors(members, align_elems=self.config.align_elems)
            self.buckets.append(_GradBucket(params=members, names=[named[i][0] for i in indices], layout=layout,
                                            flat_N=layout.new_buffer()))
            for j, p in enumerate(members):
                self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b, j)))
        self._next_launch = 0  # buckets before this one have been launched this step
        logger.debug("GradBucketReducer: %d parameters in %d buckets of at most %d bytes",
                     len(params), len(self.buckets), self.config.bucket_bytes)

    def _on_grad_ready(self, b: int, j: int, _param: Tensor) -> None:
        bucket = self.buckets[b]
        if b < self._next_launch:
            raise RuntimeError(f"the gradient of {bucket.names[j]} changed after its bucket was all-reduced; "
                               "call finish() after every backward (accumulating over several backward calls "
                               "is not supported)")
        if not bucket.ready[j]:
            bucket.ready[j] = True
            bucket.num_ready += 1
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if nxt.num_ready < len(nxt.params):
                break
            self._launch_next()

    def _launch_next(self) -> None:
        bucket = self.buckets[self._next_launch]
        # A gradient not accumulated this step contributes zeros, even if a stale .grad exists.
        grads = [p.grad if ready else None for p, ready in zip(bucket.params, bucket.ready)]
        bucket.layout.pack(grads, out=bucket.flat_N)
        bucket.work = dist.all_reduce(bucket.flat_N, group=self.group, async_op=True)
        self._next_launch += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Launch the remaining buckets, wait for all, write averaged grads into `.grad`, reset."""
        while self._next_launch < len(self.buckets):
            self._launch_next()
        world_size = dist.get_world_size(self.group)
        try:
            for bucket in self.buckets:
                bucket.work.wait()
                bucket.flat_N.div_(world_size)
                for p, avg in zip(bucket.params, bucket.layout.unpack(bucket.flat_N)):
                    if p.grad is None:
                        p.grad = avg.clone()  # the flat buffer is reused next step
                    else:
                        p.grad.copy_(avg)
        finally:
            for bucket in self.buckets:
                bucket.reset()
            self._next_launch = 0

    def remove(self) -> None:
        """Detach the gradient hooks; the reducer is unusable afterwards."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
