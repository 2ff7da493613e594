"""Executor: every technique and a mixed plan reproduce the no-plan loss and gradients bit for bit
(swapping is a copy; recomputation replays the same float32 ops with the same RNG state on CPU),
through a CPU copy stream and through one with CUDA's hazards (copies delayed and reordered,
destinations poisoned, compute that completes late: a missing wait shows); the accounting is the
profile's, a budget holds, swap space is sized from the plan and given back only once its copies
ran, and D2D stripes really live in a peer's memory: in this process (InProcessPeers) and across 2
gloo ranks (SharedMemoryPeers in /dev/shm).

The model is helpers.mlp_blocks' (legend: T tokens per micro-batch, D model width, H hidden width).
"""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_ranks
from helpers.gated_stream import GatedStream
from helpers.mlp_blocks import D, H, LAYERS, T, cuda_step, make_input, make_layers
from torch import nn

from mpress.space import (HOST_ALIGNMENT, MIN_SWAP_BYTES, SwapSpaceError, host_pool_bytes_for, host_swap_bytes,
                          peer_capacity_bytes_for, split_bytes)
from mpress.swap_core import BudgetExceededError, State, byte_view
from mpress.executor import Executor
from mpress.peer_memory import InProcessPeers, PeerMemoryFullError, SharedMemoryPeers, SliceAllocator, segment_path
from mpress.profile import Decision, LayerProfile, PipelineProfile, Plan, SavedTensor, StageProfile, Stripe
from mpress.model_tensors import is_parameter, param_storages
from mpress.profiler import profile_layers
from storage.host_buffers import HostBufferPool, HostBufferPoolConfig, round_up
from storage.streams import FakeCudaCopyStream, copy_stream_factory

PEER_BYTES = 1 << 22


def forward(layers, x_TD: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1234)  # dropout masks: the same in every run
    for layer in layers:
        x_TD = layer(x_TD)
    return x_TD.square().mean()


def fresh_forward(layers, params, micro_batches: int = 1) -> list[torch.Tensor]:
    """The gradients cleared, then each micro-batch's forward: its loss, the graph kept."""
    for p in params:
        p.grad = None
    return [forward(layers, make_input(m)) for m in range(micro_batches)]


def step(layers, params, micro_batches: int = 1):
    """Loss per micro-batch and the accumulated gradients (forwards first, then backwards: GPipe)."""
    losses = fresh_forward(layers, params, micro_batches)
    for loss in losses:
        loss.backward()
    return [loss.detach() for loss in losses], [p.grad.clone() for p in params]


def assert_identical(got, want) -> None:
    (got_losses, got_grads), (want_losses, want_grads) = got, want
    for g, w in zip(got_losses, want_losses):
        assert torch.equal(g, w), f"loss {g.item()!r} != {w.item()!r}"
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert torch.equal(g, w), f"gradient {i} differs by up to {(g - w).abs().max().item()}"


STRIPES_3_1 = (Stripe(device=1, bytes=3), Stripe(device=2, bytes=1))  # 3/4 to rank 1, 1/4 to rank 2


def plan_of(*techniques: str, stripes=STRIPES_3_1) -> Plan:
    return Plan(decisions=[Decision(stage=0, layer=i, technique=t, stripes=list(stripes) if t == "d2d" else [])
                           for i, t in enumerate(techniques)])


def stage_profile(layers, micro_batches: int = 2) -> PipelineProfile:
    """A one-stage GPipe profile of `layers` on one micro-batch (its saved tensors' sizes)."""
    profiled = profile_layers([(f"block{i}", layer) for i, layer in enumerate(layers)], make_input(), repeats=1)
    return PipelineProfile(stages=[StageProfile(stage=0, layers=profiled)], micro_batches=micro_batches,
                           schedule="gpipe")


def planned(plan: Plan, layers, **kwargs):
    """An executor for stage 0 of `plan` (its host pool sized from the profile of `layers` for two
    micro-batches, unless given) and `layers` wrapped by it."""
    if any(d.technique == "host" for d in plan.decisions) and "host_pool" not in kwargs:
        kwargs.setdefault("host_pool_bytes", host_pool_bytes_for(stage_profile(layers), plan, 0))
    ex = Executor(plan, 0, device="cpu", **kwargs)
    return ex, [ex.wrap(i, layer) for i, layer in enumerate(layers)]


@pytest.fixture(params=["thread", "fake-cuda"])
def streams(request):
    """The copy streams the test's executors make: worker threads (None), or the CUDA-hazard fake
    (the list of streams made, for `check_streams`)."""
    if request.param == "thread":
        yield None
        return
    with copy_stream_factory(FakeCudaCopyStream) as made:
        yield made


def check_streams(made) -> None:
    """Every fake stream made reported no hazard (a copy that raced compute or a reused source)."""
    if made is not None:
        assert made and all(isinstance(s, FakeCudaCopyStream) for s in made)
        assert [v for s in made for v in s.violations] == []


@pytest.fixture
def layers():
    return make_layers()


@pytest.fixture
def params(layers):
    return [p for layer in layers for p in layer.parameters()]


@pytest.fixture
def reference(layers, params):
    return step(layers, params)


@pytest.fixture
def peers():
    return InProcessPeers.group(3, PEER_BYTES)


# -- pure pieces --------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes, weights", [(4096, [3, 1]), (1001, [1, 1, 1]), (7, [5, 0, 2]), (0, [1, 2])])
def test_split_bytes_follows_the_weights(nbytes, weights):
    pieces = split_bytes(nbytes, weights)
    assert sum(pieces) == nbytes
    for piece, w in zip(pieces, weights):
        assert abs(piece - nbytes * w / sum(weights)) < 1


def test_split_bytes_rejects_weights_without_bytes():
    with pytest.raises(ValueError, match="weights"):
        split_bytes(10, [0, 0])


def test_byte_view_keeps_a_permuted_layout():
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).permute(2, 0, 1)
    assert byte_view(x).numel() == 24 * 4
    back = torch.empty_strided(x.shape, x.stride())
    byte_view(back).copy_(byte_view(x))
    assert torch.equal(back, x) and back.stride() == x.stride()


def test_slice_allocator_first_fit_aligned_and_full():
    a = SliceAllocator(1024, alignment=64)
    assert [a.alloc(100), a.alloc(64), a.alloc(1)] == [0, 128, 192]
    a.free(128)
    assert a.alloc(10) == 128  # the freed gap is reused first
    assert a.used_bytes == 128 + 64 + 64
    with pytest.raises(PeerMemoryFullError, match="no gap of 832 bytes in a slice of 1024 bytes"):
        a.alloc(800)
    assert a.alloc(768) == 256
    with pytest.raises(ValueError, match="no block allocated at offset 5"):
        a.free(5)


def test_peer_memory_views_are_disjoint_slices(peers):
    data = torch.arange(100, dtype=torch.uint8)
    off = peers[0].alloc(1, 100)
    peers[0].put(1, off, data)
    assert torch.equal(peers[0].get(1, off, 100), data)
    start, _ = peers[0].slice_range(0)
    assert torch.equal(peers[1].segment(1)[start + off:start + off + 100], data)  # in rank 1's segment
    assert peers[2].segment(1)[peers[2].slice_range(2)[0]:].count_nonzero() == 0  # not in another's slice
    with pytest.raises(ValueError, match="cannot use itself as a peer"):
        peers[0].alloc(0, 10)
    with pytest.raises(ValueError, match="outside the slice"):
        peers[0].view(1, peers[0].slice_bytes - 10, 20)


# -- every technique reproduces the reference ---------------------------------------------------


@pytest.mark.parametrize("techniques", [
    ("keep",) * LAYERS, ("recompute",) * LAYERS, ("host",) * LAYERS, ("d2d",) * LAYERS,
    ("host", "recompute", "d2d", "keep"),
], ids=["keep", "recompute", "host", "d2d", "mixed"])
def test_gradients_equal_the_reference(techniques, layers, params, reference, peers, streams):
    ex, wrapped = planned(plan_of(*techniques), layers, peers=peers[0])
    with ex:
        assert_identical(step(wrapped, params, micro_batches=2), step(layers, params, micro_batches=2))
        assert_identical(step(wrapped, params), reference)
        stats = ex.stats()
    check_streams(streams)
    assert ex.table == {} and stats.resident_bytes == 0  # every saved tensor freed after backward
    assert peers[0].used_bytes(1) == peers[0].used_bytes(2) == 0
    assert (stats.host_bytes > 0) == ("host" in techniques)
    assert (stats.peer_bytes > 0) == ("d2d" in techniques)
    assert stats.recomputed == 3 * techniques.count("recompute")  # one replay per forward


def test_recompute_replays_dropout_with_the_same_masks():
    layers = make_layers(dropout=0.5)
    params = [p for layer in layers for p in layer.parameters()]
    ex, wrapped = planned(plan_of(*("recompute",) * LAYERS), layers)
    with ex:
        assert_identical(step(wrapped, params), step(layers, params))


def test_swapped_tensors_really_come_from_host_and_peers(layers, params, reference, peers, streams):
    """Corrupting the swapped copies after the forward changes the gradients: the backward reads
    them, not tensors kept on the side."""
    for technique in ("host", "d2d"):
        ex, wrapped = planned(plan_of(technique, "keep", "keep", "keep"), layers, peers=peers[0])
        with ex:
            loss, = fresh_forward(wrapped, params)
            ex.synchronize()
            swapped = [r for r in ex.table.values() if r.technique == technique]
            assert swapped and all(r.state is State.OUT for r in swapped)
            for r in swapped:
                if technique == "host":
                    r.host.payload.fill_(0)
                for c in r.chunks:
                    peers[0].view(c.peer, c.offset, c.nbytes).fill_(0)
            loss.backward()
            assert not all(torch.equal(p.grad, g) for p, g in zip(params, reference[1]))
    check_streams(streams)


# -- accounting and budget ----------------------------------------------------------------------


def test_keep_all_peak_is_the_profiled_saved_bytes(layers):
    profiled = profile_layers([(f"block{i}", layer) for i, layer in enumerate(layers)], make_input(), repeats=1)
    ex, wrapped = planned(plan_of(*("keep",) * LAYERS), layers)
    with ex:
        loss = forward(wrapped, make_input())
        assert ex.stats().resident_bytes == ex.peak_bytes == sum(lp.saved_bytes for lp in profiled)
        loss.backward()


def test_under_autocast_the_weight_copies_are_not_counted_or_swapped(layers):
    """bf16 autocast: matmuls save autocast's cached bf16 copy of each weight. It is held once per
    step (model data in the profile), so the executor neither counts it per forward nor swaps it:
    the peak is the profile's saved bytes, and the host swap moves exactly those bytes."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        profiled = profile_layers([(f"block{i}", layer) for i, layer in enumerate(layers)], make_input(), repeats=1)
        saved = sum(lp.saved_bytes for lp in profiled)
        ex, wrapped = planned(plan_of(*("keep",) * LAYERS), layers)
        with ex:
            loss = forward(wrapped, make_input())
            assert ex.peak_bytes == saved
            loss.backward()
        ex, wrapped = planned(plan_of(*("host",) * LAYERS), layers, host_pool_bytes=1 << 22, min_swap_bytes=0)
        with ex:
            loss = forward(wrapped, make_input())
            ex.synchronize()
            assert ex.stats().host_bytes == saved
            loss.backward()


def test_recompute_holds_only_the_layer_inputs(layers):
    ex, wrapped = planned(plan_of(*("recompute",) * LAYERS), layers)
    with ex:
        loss = forward(wrapped, make_input())
        assert ex.peak_bytes == LAYERS * T * D * 4
        loss.backward()


@pytest.mark.parametrize("techniques", [
    ("recompute",) * LAYERS, ("host",) * LAYERS, ("d2d",) * LAYERS, ("host", "recompute", "d2d", "keep"),
], ids=["recompute", "host", "d2d", "mixed"])
def test_a_plan_fits_a_budget_that_keep_all_exceeds(techniques, layers, params, reference, peers, streams):
    keep_ex, keep_wrapped = planned(plan_of(*("keep",) * LAYERS), layers)
    with keep_ex:
        step(keep_wrapped, params)
    budget = keep_ex.peak_bytes // 2

    ex, wrapped = planned(plan_of(*techniques), layers, peers=peers[0], budget_bytes=budget)
    with ex:
        assert_identical(step(wrapped, params), reference)
    assert 0 < ex.peak_bytes <= budget < keep_ex.peak_bytes

    over, over_wrapped = planned(plan_of(*("keep",) * LAYERS), layers, budget_bytes=budget)
    with over, pytest.raises(BudgetExceededError, match=rf"stage 0, layer 2: .* over budget_bytes={budget}"):
        forward(over_wrapped, make_input())
    check_streams(streams)


def test_a_dropped_graph_frees_its_records(layers, peers):
    host_pool = HostBufferPool(HostBufferPoolConfig(capacity_bytes=1 << 22))
    ex, wrapped = planned(plan_of("host", "d2d", "keep", "keep"), layers, peers=peers[0], host_pool=host_pool)
    with ex:
        loss = forward(wrapped, make_input())
        ex.synchronize()
        assert ex.table and host_pool.in_use_bytes > 0 and peers[0].used_bytes(1) > 0
        del loss
        assert ex.table == {} and ex.stats().resident_bytes == 0
        assert host_pool.in_use_bytes == 0 and peers[0].used_bytes(1) == peers[0].used_bytes(2) == 0


@pytest.mark.parametrize("technique", ["keep", "host"])
def test_a_dropped_graph_with_saved_outputs_frees_its_records(technique):
    # ReLU saves its output, whose grad_fn holds the ticket of that very tensor
    layer = nn.Sequential(nn.Linear(D, H), nn.ReLU())
    ex, (wrapped,) = planned(plan_of(technique), [layer])
    with ex:
        loss = wrapped(make_input()).sum()
        assert any(r.nbytes == T * H * 4 for r in ex.table.values())
        del loss
        assert ex.table == {} and ex.stats().resident_bytes == 0


# -- swap space: sized from the plan, given back once its copies ran ----------------------------


def swapped_sizes(layer: nn.Module) -> list[int]:
    """Bytes of each tensor `layer` saves that the executor swaps, for one micro-batch."""
    _, saved = saved_activations(layer, make_input())
    return [t.numel() * t.element_size() for t in saved]


def test_the_host_pool_sized_from_the_profile_holds_a_gpipe_step_exactly(layers, params):
    plan = plan_of("host", "keep", "host", "keep")
    need = host_swap_bytes(stage_profile(layers, micro_batches=2), plan, 0)
    # every swapped tensor of layers 0 and 2, rounded to the pool's alignment, for 2 micro-batches
    assert need == 2 * sum(round_up(b, HOST_ALIGNMENT) for i in (0, 2) for b in swapped_sizes(layers[i])) > 0
    pool = HostBufferPool(HostBufferPoolConfig(capacity_bytes=need, slab_bytes=HOST_ALIGNMENT))
    reference = step(layers, params, micro_batches=2)
    ex, wrapped = planned(plan, layers, host_pool=pool)
    with ex:
        assert_identical(step(wrapped, params, micro_batches=2), reference)
    assert pool.peak_in_use_bytes == need  # both micro-batches' tensors out at once, no more


def test_a_plan_needing_more_host_memory_than_allowed_fails_before_any_forward(layers):
    plan = plan_of("host", "keep", "host", "keep")
    profile = stage_profile(layers)
    need = host_swap_bytes(profile, plan, 0)
    assert host_pool_bytes_for(profile, plan, 0) == need + need // 4  # slack for MoE layers' varying sizes
    assert host_pool_bytes_for(profile, plan, 0, limit_bytes=need) == need
    with pytest.raises(SwapSpaceError, match=rf"^stage 0: the plan swaps layers \[0, 2\] to host memory, "
                                             rf"{need} bytes at the peak, more than the {need - 1} bytes of host "
                                             rf"memory allowed$"):
        host_pool_bytes_for(profile, plan, 0, limit_bytes=need - 1)
    with pytest.raises(ValueError, match=r"stage 0 swaps layers \[0, 2\] to host memory: pass host_pool_bytes"):
        Executor(plan, 0, device="cpu")
    with pytest.raises(ValueError, match="the plan swaps layer 7 of stage 0, which the profile does not have"):
        host_swap_bytes(profile, plan_of(*("keep",) * 7, "host"), 0)


def test_peer_capacity_holds_the_most_one_stage_writes_into_one_peer():
    # stage 0 of 3 swaps tensors of 8192, 16384 and 100 bytes (too small: kept), 3:1 to ranks 1 and 2
    saved = [SavedTensor(name=f"t{b}", bytes=b) for b in (8192, 16384, 100)]
    layer = LayerProfile(index=0, name="block0", forward_s=1e-3, backward_s=2e-3, saved=saved)
    profile = PipelineProfile(stages=[StageProfile(stage=0, layers=[layer]),
                                      StageProfile(stage=1, layers=[]), StageProfile(stage=2, layers=[])],
                              micro_batches=2, schedule="gpipe")
    most = 2 * (6144 + 12288)  # two micro-batches of rank 1's 3/4 (each stripe aligned to 64 bytes)
    assert peer_capacity_bytes_for(profile, plan_of("d2d")) == 3 * round_up(most + most // 4, 64)
    assert peer_capacity_bytes_for(profile, plan_of("keep")) == 0


def test_peers_sized_from_the_profile_hold_a_gpipe_step(layers, params):
    plan = plan_of("d2d", "d2d", "keep", "keep")
    one_stage = stage_profile(layers)
    profile = PipelineProfile(stages=[*one_stage.stages, StageProfile(stage=1, layers=[]),
                                      StageProfile(stage=2, layers=[])], micro_batches=2, schedule="gpipe")
    group = InProcessPeers.group(3, peer_capacity_bytes_for(profile, plan))
    reference = step(layers, params, micro_batches=2)
    ex, wrapped = planned(plan, layers, peers=group[0])
    with ex:
        assert_identical(step(wrapped, params, micro_batches=2), reference)
    to_rank1 = sum(round_up(b * 3 // 4, 64) for i in (0, 1) for b in swapped_sizes(layers[i]))
    assert to_rank1 * 2 <= group[0].slice_bytes < to_rank1 * 2 * 2  # room for both micro-batches, not far more


def test_forward_and_backward_never_block_the_host(layers, params, reference, peers):
    """With room to spare, a swapped step (prefetch included) makes no host synchronisation: copies
    wait on events, compute waits on copies, and finished copies are noticed by polling."""
    with copy_stream_factory(FakeCudaCopyStream) as made:
        ex, wrapped = planned(plan_of("host", "d2d", "host", "keep"), layers, peers=peers[0])
        with ex:
            loss, = fresh_forward(wrapped, params)
            for layer in reversed(range(LAYERS)):
                ex.prefetch(layer)
            loss.backward()
            assert made[0].host_syncs == 0 and made[0].copies > 0
    assert_identical(([loss.detach()], [p.grad.clone() for p in params]), reference)
    check_streams(made)


def test_a_tensor_asked_back_before_its_swap_out_ran_is_used_in_place(layers, params, reference, peers):
    """Its swap-out has not even started: the backward reads the tensor still on the device,
    without waiting for the copy, and its swap space is given back only once the copy ran."""
    stream = GatedStream()
    host_pool = HostBufferPool(HostBufferPoolConfig(capacity_bytes=1 << 22))
    ex, wrapped = planned(plan_of("host", "d2d", "host", "d2d"), layers, peers=peers[0], host_pool=host_pool,
                          copy_stream=stream)
    with ex:
        loss, = fresh_forward(wrapped, params)
        loss.backward()
        assert not stream.gate.is_set()  # no copy has run
        assert_identical(([loss.detach()], [p.grad.clone() for p in params]), reference)
        assert ex.table == {} and host_pool.in_use_bytes > 0 and peers[0].used_bytes(1) > 0  # copies queued
        stream.gate.set()
        ex.synchronize()
        assert host_pool.in_use_bytes == 0 and peers[0].used_bytes(1) == peers[0].used_bytes(2) == 0
    stream.close()


def test_the_space_of_a_dropped_graph_waits_for_its_copies(layers, peers):
    stream = GatedStream()
    host_pool = HostBufferPool(HostBufferPoolConfig(capacity_bytes=1 << 22))
    ex, wrapped = planned(plan_of("host", "d2d", "keep", "keep"), layers, peers=peers[0], host_pool=host_pool,
                          copy_stream=stream)
    with ex:
        loss = forward(wrapped, make_input())
        del loss
        assert ex.table == {} and ex.stats().resident_bytes == 0
        # the queued copies still write the buffer and the stripes: neither may be handed out again
        assert host_pool.in_use_bytes > 0 and peers[0].used_bytes(1) > 0
        stream.gate.set()
        ex.synchronize()
        assert host_pool.in_use_bytes == 0 and peers[0].used_bytes(1) == peers[0].used_bytes(2) == 0
    stream.close()


def test_synchronize_waits_for_swap_ins_too(layers):
    """After prefetches, `synchronize` returns only once every swap-in has landed (the profiler
    relies on it to keep copy waits out of a layer's measured cost)."""
    stream = GatedStream()
    ex, wrapped = planned(plan_of(*("host",) * LAYERS), layers, copy_stream=stream)
    with ex:
        loss = forward(wrapped, make_input())
        stream.gate.set()
        ex.synchronize()  # the swap-outs ran
        stream.gate.clear()
        for layer in reversed(range(LAYERS)):
            assert ex.prefetch(layer) > 0
        swapping_in = [r for r in ex.table.values() if r.state is State.SWAPPING_IN]
        assert swapping_in and not any(h.done() for r in swapping_in for h in r.copies)
        waiter = threading.Thread(target=ex.synchronize)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # held by the gated swap-ins
        stream.gate.set()
        waiter.join()
        assert all(h.done() for r in swapping_in for h in r.copies)
        loss.backward()
    stream.close()


# -- prefetch and d2d metadata ------------------------------------------------------------------


def test_prefetch_swaps_in_the_oldest_forward_first(layers, params, streams):
    reference = step(layers, params, micro_batches=2)
    ex, wrapped = planned(plan_of(*("host",) * LAYERS), layers)
    with ex:
        losses = fresh_forward(wrapped, params, 2)
        ex.synchronize()
        last = sorted((r for r in ex.table.values() if r.layer == LAYERS - 1 and r.technique == "host"),
                      key=lambda r: r.id)
        first_mb, second_mb = last[:len(last) // 2], last[len(last) // 2:]
        assert ex.prefetch(LAYERS - 1) == sum(r.nbytes for r in first_mb)
        assert all(r.state in (State.SWAPPING_IN, State.RESIDENT) for r in first_mb)
        assert all(r.state is State.OUT for r in second_mb)
        assert ex.stats().resident_bytes >= sum(r.nbytes for r in first_mb)
        for loss in losses:
            loss.backward()
        assert ex.prefetch(LAYERS - 1) == 0  # the second forward's tensors are gone
        assert_identical(([loss.detach() for loss in losses], [p.grad.clone() for p in params]), reference)
    check_streams(streams)


@pytest.mark.parametrize("technique", ["host", "d2d"])
def test_prefetch_right_after_the_forward(technique, layers, params, reference, peers, streams):
    """Swap-outs may still be in flight: those tensors are still on the device and stay there."""
    ex, wrapped = planned(plan_of(*(technique,) * LAYERS), layers, peers=peers[0])
    with ex:
        loss, = fresh_forward(wrapped, params)
        for layer in reversed(range(LAYERS)):
            assert ex.prefetch(layer) > 0
        assert all(r.state in (State.SWAPPING_IN, State.RESIDENT) for r in ex.table.values())
        loss.backward()
        assert_identical(([loss.detach()], [p.grad.clone() for p in params]), reference)
    check_streams(streams)


def test_d2d_stripes_split_bytes_in_the_decision_proportions(layers, peers):
    ex, wrapped = planned(plan_of("d2d", "keep", "keep", "keep"), layers, peers=peers[0])
    with ex:
        loss = forward(wrapped, make_input())
        records = [r for r in ex.table.values() if r.technique == "d2d"]
        assert {r.nbytes for r in records} == {T * D * 4, T * H * 4}
        for r in records:
            assert [c.peer for c in r.chunks] == [1, 2]
            assert [c.nbytes for c in r.chunks] == [r.nbytes * 3 // 4, r.nbytes // 4]
            assert r.dtype == torch.float32 and r.nbytes == r.shape.numel() * 4
        assert peers[0].used_bytes(1) == sum(r.chunks[0].nbytes for r in records)
        loss.backward()


def test_small_tensors_and_parameters_are_not_swapped(layers, peers):
    ex, wrapped = planned(plan_of(*("d2d",) * LAYERS), layers, peers=peers[0])
    with ex:
        loss = forward(wrapped, make_input())
        storages = set().union(*(param_storages(layer) for layer in layers))
        for r in ex.table.values():
            assert (r.technique == "d2d") == (r.nbytes >= MIN_SWAP_BYTES)
            assert r.tensor is None or not is_parameter(r.tensor, storages)
        loss.backward()


# -- bad plans and full swap space --------------------------------------------------------------


def test_bad_d2d_decisions_are_refused(peers):
    with pytest.raises(ValueError, match="stage 0, layer 0 .* needs peers"):
        Executor(plan_of("d2d"), 0, device="cpu")
    with pytest.raises(ValueError, match="peers.rank=1 must be the stage"):
        Executor(plan_of("d2d"), 0, device="cpu", peers=peers[1])
    with pytest.raises(ValueError, match="stripe device 0 is rank 0, not a peer of rank 0"):
        Executor(plan_of("d2d", stripes=[Stripe(device=0, bytes=1)]), 0, device="cpu", peers=peers[0])
    mapped = Plan(decisions=plan_of("d2d", stripes=[Stripe(device=7, bytes=1)]).decisions, mapping=[5, 6, 4])
    with pytest.raises(ValueError, match="no stage runs on stripe device 7"):
        Executor(mapped, 0, device="cpu", peers=peers[0])


def test_stripe_device_maps_to_the_stage_that_runs_on_it(layers, peers):
    # stage 0 on device 5, stage 1 on device 4, stage 2 on device 6: device 4 is rank 1
    mapped = Plan(decisions=plan_of("d2d", stripes=[Stripe(device=4, bytes=1)]).decisions, mapping=[5, 4, 6])
    ex = Executor(mapped, 0, device="cpu", peers=peers[0])
    with ex:
        loss = ex.wrap(0, layers[0])(make_input()).sum()
        assert {c.peer for r in ex.table.values() for c in r.chunks} == {1}
        loss.backward()


def test_full_peer_slice_names_the_stage_and_layer(layers):
    small = InProcessPeers.group(3, 3 * 8192)
    ex, wrapped = planned(plan_of("keep", "d2d", "keep", "keep"), layers, peers=small[0])
    with ex, pytest.raises(SwapSpaceError, match="stage 0, layer 1: rank 0's slice of peer 1's segment is full"):
        forward(wrapped, make_input())
    assert small[0].used_bytes(1) == small[0].used_bytes(2) == 0  # nothing leaked by the failed pack


# -- across 2 gloo ranks through /dev/shm -------------------------------------------------------


def saved_activations(layer: nn.Module, x_TD: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`layer`'s output and what it saves that the executor would swap, in pack order."""
    storages, saved = param_storages(layer), []

    def pack(t):
        if not is_parameter(t, storages) and t.numel() * t.element_size() >= MIN_SWAP_BYTES:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return layer(x_TD), saved


def d2d_worker(rank: int, name: str) -> None:
    world = dist.get_world_size()
    peers = SharedMemoryPeers(rank, world, PEER_BYTES, name)
    try:
        if rank == 0:
            d2d_stage0(peers)
        else:
            dist.barrier()  # rank 0 has run its forward
            start, stop = peers.slice_range(0)
            dist.send(peers.segment(1)[start:stop].clone(), dst=0)  # what rank 0 wrote into our memory
            dist.barrier()  # rank 0 has run its backward
    finally:
        peers.close()


def d2d_stage0(peers: SharedMemoryPeers) -> None:
    layers = make_layers()
    params = [p for layer in layers for p in layer.parameters()]
    reference = step(layers, params)
    _, expected = saved_activations(layers[1], layers[0](make_input()))
    # layer 1 (one stripe) and layer 2 (two stripes, 1:3) go to rank 1's memory
    plan = Plan(decisions=[Decision(stage=0, layer=1, technique="d2d", stripes=[Stripe(device=1, bytes=1)]),
                           Decision(stage=0, layer=2, technique="d2d",
                                    stripes=[Stripe(device=1, bytes=1), Stripe(device=1, bytes=3)])])
    ex, wrapped = planned(plan, layers, peers=peers)
    with ex:
        loss, = fresh_forward(wrapped, params)
        ex.synchronize()
        dist.barrier()
        slice_on_rank1 = torch.empty(peers.slice_bytes, dtype=torch.uint8)
        dist.recv(slice_on_rank1, src=1)

        records = sorted((r for r in ex.table.values() if r.technique == "d2d"), key=lambda r: r.id)
        layer1 = [r for r in records if r.layer == 1]
        assert len(layer1) == len(expected) and all(r.state is State.OUT for r in records)
        for r, want in zip(layer1, expected):  # rank 1's own mapping holds layer 1's saved bytes
            (c,) = r.chunks
            assert c.peer == 1 and c.nbytes == r.nbytes
            assert torch.equal(slice_on_rank1[c.offset:c.offset + c.nbytes], byte_view(want.contiguous()))
        for r in (r for r in records if r.layer == 2):
            assert [c.nbytes for c in r.chunks] == split_bytes(r.nbytes, [1, 3])
            assert torch.equal(torch.cat([slice_on_rank1[c.offset:c.offset + c.nbytes] for c in r.chunks]),
                               torch.cat([peers.get(1, c.offset, c.nbytes) for c in r.chunks]))

        assert ex.prefetch(1) == sum(r.nbytes for r in layer1)
        for r in layer1:  # the swap-ins run on the copy stream: read them only once they landed
            for h in r.copies:
                h.wait()
        for r, want in zip(layer1, expected):
            assert torch.equal(r.tensor, want) and r.tensor.stride() == want.stride()  # back identical
        loss.backward()
        assert_identical(([loss.detach()], [p.grad.clone() for p in params]), reference)
        assert ex.table == {} and peers.used_bytes(1) == 0
    dist.barrier()


@pytest.mark.slow  # starts processes
def test_d2d_across_two_gloo_ranks_through_shared_memory():
    name = f"test-executor-{uuid.uuid4().hex[:12]}"
    run_ranks(d2d_worker, name)
    assert not os.path.exists(segment_path(name, 0)) and not os.path.exists(segment_path(name, 1))
    shm = os.path.dirname(segment_path(name, 0))
    assert [f for f in os.listdir(shm) if name in f] == []


# -- on a GPU: pinned host pool, the CUDA copy stream, its events ------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("techniques", [("host",) * LAYERS, ("host", "recompute", "keep", "host")],
                         ids=["host", "mixed"])
def test_swapping_on_cuda_keeps_the_numbers(techniques):
    layers = [layer.cuda() for layer in make_layers()]
    params = [p for layer in layers for p in layer.parameters()]
    want = cuda_step(layers, params)
    plan = plan_of(*techniques)
    profile = stage_profile([layer.cpu() for layer in make_layers()])
    with Executor(plan, 0, device="cuda", host_pool_bytes=host_pool_bytes_for(profile, plan, 0)) as ex:
        wrapped = [ex.wrap(i, layer) for i, layer in enumerate(layers)]
        got = cuda_step(wrapped, params)
        assert ex.stats().host_bytes > 0
    # a swap is a copy: float32 results within the rounding of kernels cuBLAS may pick differently
    for g, w in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
