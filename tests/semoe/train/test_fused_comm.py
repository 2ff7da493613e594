"""Fused communication: flat layouts and buckets as pure bookkeeping, then the collectives on two
real `gloo` processes bound to 127.0.0.1, each checked against plain per-tensor collectives or a
single-process reference.

Children assert; `torch.multiprocessing` re-raises a child's exception in the parent, so a failed
check fails the test. Collectives time out after a few seconds, so a deadlock fails instead of hanging.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers.dist import WORLD, run_ranks
from torch import nn

from semoe.train.fused_comm import BucketConfig, FlatLayout, GradBucketReducer, bucketize, fused_all_reduce

WORLD_SIZE = WORLD
SHAPES = [(3, 4), (5,), (), (0,), (2, 3, 2), (1,), (17,)]


def _tensors(seed: int, shapes=SHAPES, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for shape in shapes]


# ---------------------------------------------------------------------------------------------
# FlatLayout and bucketize: single process


@pytest.mark.parametrize("align", [1, 7, 16])
def test_layout_round_trip_is_aligned_and_views(align):
    tensors = _tensors(0)
    layout = FlatLayout.from_tensors(tensors, align_elems=align)
    assert layout.shapes == tuple(t.shape for t in tensors)
    assert layout.numels == tuple(t.numel() for t in tensors)
    for offset, numel in zip(layout.offsets, layout.numels):
        assert numel == 0 or offset % align == 0
    ends = [o + n for o, n in zip(layout.offsets, layout.numels)]
    assert all(end <= nxt for end, nxt in zip(ends, layout.offsets[1:]))  # no overlap, order kept
    assert layout.total_numel == max(ends)
    assert layout.nbytes == layout.total_numel * 4

    flat = layout.pack(tensors)
    assert flat.shape == (layout.total_numel,) and flat.is_contiguous()
    covered = torch.zeros(layout.total_numel, dtype=torch.bool)
    for offset, numel in zip(layout.offsets, layout.numels):
        covered[offset:offset + numel] = True
    assert torch.all(flat[~covered] == 0)  # padding of a new buffer is zero

    views = layout.unpack(flat)
    for t, v in zip(tensors, views):
        assert torch.equal(t, v) and v.shape == t.shape
    views[0].fill_(7.0)  # views share the buffer's storage
    assert torch.all(flat[layout.offsets[0]:layout.offsets[0] + 12] == 7.0)

    targets = [torch.zeros_like(t) for t in tensors]
    layout.unpack_into(layout.pack(tensors), targets)
    for t, target in zip(tensors, targets):
        assert torch.equal(t, target)


def test_layout_packs_into_a_preallocated_buffer_and_noncontiguous_tensors():
    tensors = [torch.arange(12.0).view(3, 4).t(), torch.ones(5)]  # the first is a transposed view
    layout = FlatLayout.from_tensors(tensors, align_elems=16)
    out = layout.new_buffer(layout.total_numel + 10)
    assert layout.pack(tensors, out=out) is out
    assert torch.equal(layout.unpack(out)[0], tensors[0])
    assert torch.equal(out[16:21], torch.ones(5))
    assert torch.equal(layout.pack([None, tensors[1]], out=out)[:12], torch.zeros(12))  # None packs as zeros


def test_layout_of_empty_list():
    layout = FlatLayout.from_tensors([])
    assert len(layout) == 0 and layout.total_numel == 0
    flat = layout.pack([])
    assert flat.numel() == 0
    assert layout.unpack(flat) == []
    layout.unpack_into(flat, [])


def test_layout_rejects_mismatches_naming_the_tensor():
    with pytest.raises(ValueError, match=r"tensor 2 is torch.float64 on cpu, but tensor 0 is torch.float32"):
        FlatLayout.from_tensors([torch.zeros(2), torch.zeros(3), torch.zeros(2, dtype=torch.float64)])
    layout = FlatLayout.from_tensors([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match=r"tensor 1 is torch.float32 \(4,\), the layout expects torch.float32 \(3,\)"):
        layout.pack([torch.zeros(2), torch.zeros(4)])
    with pytest.raises(ValueError, match="holds 2 tensors, got 1"):
        layout.pack([torch.zeros(2)])
    with pytest.raises(ValueError, match=r"flat must be a 1-D torch.float32 tensor of at least 19 elements"):
        layout.unpack(torch.zeros(18))
    with pytest.raises(ValueError, match="align_elems must be a positive integer, got 0"):
        FlatLayout.from_tensors([torch.zeros(2)], align_elems=0)


def _bucket_nbytes(tensors, indices, align):
    return FlatLayout.from_tensors([tensors[i] for i in indices], align_elems=align).nbytes


@pytest.mark.parametrize("align", [1, 16])
def test_bucketize_keeps_order_and_bound(align):
    sizes = [10, 30, 5, 100, 1, 1, 64, 3, 40, 0, 7]
    tensors = [torch.zeros(n) for n in sizes]
    bucket_bytes = 256  # 64 float32 elements
    buckets = bucketize(tensors, bucket_bytes, align_elems=align)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))  # one dtype: plain consecutive runs
    for b in buckets:
        assert len(b) == 1 or _bucket_nbytes(tensors, b, align) <= bucket_bytes
    assert [3] in buckets  # 400 bytes: larger than a bucket, so alone
    # greedy: no bucket could have taken the next tensor without overflowing
    for b, nxt in zip(buckets, buckets[1:]):
        assert _bucket_nbytes(tensors, b + [nxt[0]], align) > bucket_bytes


def test_bucketize_groups_by_dtype_keeping_order():
    tensors = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4), torch.zeros(4, dtype=torch.int64),
               torch.zeros(4, dtype=torch.float64)]
    assert bucketize(tensors, 1024) == [[0, 2], [1, 4], [3]]
    assert bucketize(tensors, 32, align_elems=1) == [[0, 2], [1], [3], [4]]
    assert bucketize([], 1024) == []


@pytest.mark.parametrize("field, value", [("bucket_bytes", 0), ("bucket_bytes", True), ("align_elems", -1),
                                          ("align_elems", 2.0)])
def test_bucket_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got {value!r}"):
        BucketConfig(**{field: value})


# ---------------------------------------------------------------------------------------------
# Two gloo processes


class _CountAllReduce:
    """Stands in for dist.all_reduce in a child, counting calls and passing them on."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def _all_reduce_child(rank: int) -> None:
    shapes = SHAPES * 3
    per_rank = _tensors(rank, shapes) + _tensors(10 + rank, shapes, torch.float64)
    reference = [t.clone() for t in per_rank]
    for t in reference:
        dist.all_reduce(t)
    counter = _CountAllReduce(dist.all_reduce)
    dist.all_reduce = counter
    try:
        for bucket_bytes in (64, 200, 2**20):
            summed = [t.clone() for t in per_rank]
            counter.calls = 0
            fused_all_reduce(summed, bucket_bytes=bucket_bytes, average=False)
            assert counter.calls == len(bucketize(per_rank, bucket_bytes)), (bucket_bytes, counter.calls)
            for i, (got, want) in enumerate(zip(summed, reference)):
                assert torch.equal(got, want), (bucket_bytes, i)  # a sum of two values is exact
            averaged = [t.clone() for t in per_rank]
            fused_all_reduce(averaged, bucket_bytes=bucket_bytes, align_elems=5)
            for got, want in zip(averaged, reference):
                assert torch.equal(got, want / WORLD_SIZE)
        assert len(bucketize(per_rank, 2**20)) == 2  # one bucket per dtype
        ints = [torch.full((3,), rank + 1, dtype=torch.int64)]
        fused_all_reduce(ints, average=False)
        assert torch.equal(ints[0], torch.full((3,), 3, dtype=torch.int64))
        try:
            fused_all_reduce(ints)
        except TypeError as e:
            assert "tensor 0 is torch.int64" in str(e)
        else:
            raise AssertionError("averaging integer tensors must raise TypeError")
    finally:
        dist.all_reduce = counter.real


@pytest.mark.slow  # starts processes
def test_fused_all_reduce_matches_per_tensor_all_reduce():
    run_ranks(_all_reduce_child)


class _Net(nn.Module):
    """A small MLP with a middle branch that a forward pass may skip (an expert nobody routed to)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, use_branch: bool):
        h = torch.tanh(self.inp(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(torch.tanh(self.hidden(h)))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)


def _loss(model: _Net, step: int, rank: int, use_branch: bool) -> torch.Tensor:
    x, y = _batch(step, rank)
    return nn.functional.mse_loss(model(x, use_branch), y)


def _reference_grads(model: _Net, step: int, uses: list[bool]) -> list[list[torch.Tensor]]:
    """Each rank's single-process gradients on an identical copy (zeros where a rank got none)."""
    per_rank = []
    for r in range(WORLD_SIZE):
        ref = copy.deepcopy(model)
        ref.zero_grad(set_to_none=True)
        _loss(ref, step, r, uses[r]).backward()
        per_rank.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in ref.parameters()])
    return per_rank


def _reducer_child(rank: int) -> None:
    torch.manual_seed(0)  # identical initial weights on both ranks
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reducer = GradBucketReducer(model, bucket_bytes=1100)
    num_buckets = len(reducer.buckets)
    assert num_buckets >= 3
    assert reducer.buckets[0].names[0] == "out.bias"  # reverse parameter order
    counter = _CountAllReduce(dist.all_reduce)
    dist.all_reduce = counter
    try:
        # step 0: only rank 0 uses the branch; step 1: both do; step 2: only rank 1 does
        for step, uses in enumerate([[True, False], [True, True], [False, True]]):
            per_rank = _reference_grads(model, step, uses)
            optimizer.zero_grad(set_to_none=True)
            counter.calls = 0
            _loss(model, step, rank, uses[rank]).backward()
            launched_in_backward = counter.calls
            if uses[rank]:
                assert launched_in_backward == num_buckets  # all overlapped with backward
            else:
                assert launched_in_backward < num_buckets  # held back at the bucket waiting for the branch
            reducer.finish()
            assert counter.calls == num_buckets
            for (name, p), g0, g1 in zip(model.named_parameters(), *per_rank):
                torch.testing.assert_close(p.grad, (g0 + g1) / 2, rtol=1e-6, atol=1e-6, msg=f"step {step} {name}")
                if name.startswith("branch") and not all(uses):
                    torch.testing.assert_close(p.grad, (g0 if uses[0] else g1) / 2, rtol=1e-6, atol=1e-6)
            optimizer.step()
        # a second backward before finish() would have its gradients silently dropped, so it raises
        optimizer.zero_grad(set_to_none=True)
        _loss(model, 3, rank, True).backward()
        try:
            _loss(model, 3, rank, True).backward()
        except RuntimeError as e:
            assert "call finish() after every backward" in str(e)
        else:
            raise AssertionError("a second backward before finish() must raise")
        reducer.finish()  # keeps both ranks' collectives matched
    finally:
        dist.all_reduce = counter.real
        reducer.remove()
    # the replicas saw different data but stayed identical
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    others = [torch.empty_like(weights) for _ in range(WORLD_SIZE)]
    dist.all_gather(others, weights)
    assert torch.equal(others[0], others[1])


@pytest.mark.slow  # starts processes
def test_grad_bucket_reducer_averages_grads_and_tolerates_unused_parameters():
    run_ranks(_reducer_child)


def test_grad_bucket_reducer_rejects_bad_input():
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        GradBucketReducer([nn.Parameter(torch.zeros(2), requires_grad=False)])
    with pytest.raises(ValueError, match="bucket_bytes must be a positive integer, got 0"):
        GradBucketReducer(nn.Linear(2, 2), bucket_bytes=0)
