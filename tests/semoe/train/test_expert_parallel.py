"""Expert parallelism over 2 gloo ranks on 127.0.0.1, checked against the single-device layer and model.

Both ranks build identical full weights from one seed and feed DIFFERENT tokens. Each rank's output
must equal the single-device layer on that rank's tokens; each rank's expert gradients must equal
the matching slices of the single-device gradients over both ranks' tokens; router, shared-expert
and input gradients must equal the single-device ones for the rank's own tokens. float32
tolerances: 1e-6 absolute and relative on outputs, 1e-6 absolute + 1e-5 relative on gradients (only the batch
sizes of the expert matmuls differ from the reference).

Workers run in child processes started by `torch.multiprocessing.spawn`, which re-raises a child's
failure (with its traceback) in the test; the process group's timeout turns a hang into a failure.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.dist import WORLD, run_ranks

from semoe.model.config import named_config
from semoe.train.expert_parallel import (ExpertParallelMoE, all_to_all_rows, expert_major_order, local_expert_ids,
                                         shard_experts)
from semoe.model.moe_gpt import MoEFeedForward, MoEGPT

OUT_TOL = dict(atol=1e-6, rtol=1e-6)
GRAD_TOL = dict(atol=1e-6, rtol=1e-5)


# -- process plumbing ---------------------------------------------------------------------------


@pytest.fixture
def spawn() -> Callable[..., None]:
    """`spawn(worker, *args)` runs `worker(rank, *args)` on 2 ranks; a failing rank's exception is raised here."""
    return run_ranks


def _tokens(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + rank))


def _projection(rank: int, like: torch.Tensor) -> torch.Tensor:
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(200 + rank))


def _full_layer(**overrides) -> MoEFeedForward:
    torch.manual_seed(0)  # the same full weights on every rank
    return MoEFeedForward(named_config("tiny", **overrides), 0)


# -- pure pieces --------------------------------------------------------------------------------


def test_local_expert_ids_are_contiguous_blocks():
    assert [list(local_expert_ids(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(local_expert_ids(3, 0, 1)) == [0, 1, 2]


@pytest.mark.parametrize("args, match", [
    ((6, 0, 4), "num_experts 6 must be a positive multiple of the expert-parallel world size 4"),
    ((4, 2, 2), r"rank must be in 0\.\.1 \(world 2\), got 2"),
    ((4, 0, 0), "world must be >= 1, got 0"),
])
def test_local_expert_ids_rejects_bad_layouts(args, match):
    with pytest.raises(ValueError, match=match):
        local_expert_ids(*args)


def test_expert_major_order_groups_rows_by_expert_then_source_rank():
    # rank 0 sent 1 row for expert 0 and 2 for expert 1; rank 1 sent 3 rows for expert 0
    order = expert_major_order(torch.tensor([[1, 2], [3, 0]]))
    assert order.tolist() == [0, 3, 4, 5, 1, 2]
    assert expert_major_order(torch.zeros(2, 2, dtype=torch.int64)).tolist() == []


def test_building_without_a_process_group_names_the_missing_step():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ExpertParallelMoE(_full_layer())


# -- one layer on 2 ranks -----------------------------------------------------------------------


def _forward_worker(rank: int, mode: str) -> None:
    for shared in (0, 48):
        for normalize in (True, False):
            case = f"rank {rank}, mode {mode}, shared {shared}, normalize {normalize}"
            full = _full_layer(shared_expert_size=shared, norm_topk_prob=normalize,
                               capacity_factor=0.5 if mode == "train" else None)
            full.train(mode == "train")
            ep = ExpertParallelMoE(full)
            assert ep.experts.w_gate.shape == (2, 64, 64) and ep.training == full.training, case
            x = _tokens(rank, (2, 9, 64))
            with torch.no_grad():
                want, want_stats = full(x)
                got, got_stats = ep(x)
            torch.testing.assert_close(got, want, **OUT_TOL, msg=lambda m: f"{case}: {m}")
            assert torch.equal(got_stats.ids_NK, want_stats.ids_NK), case
            assert got_stats.dropped == want_stats.dropped, case
            if mode == "train":  # capacity 5 for 36 assignments over 4 experts: some must drop
                assert got_stats.dropped > 0, case
            torch.testing.assert_close(got_stats.aux_loss, want_stats.aux_loss, msg=case)
            torch.testing.assert_close(got_stats.z_loss, want_stats.z_loss, msg=case)


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_forward_equals_single_device_layer_on_each_ranks_tokens(spawn, mode):
    spawn(_forward_worker, mode)


def _loss(out: torch.Tensor, stats, proj: torch.Tensor) -> torch.Tensor:
    return (out * proj).sum() + 0.01 * stats.aux_loss + 0.001 * stats.z_loss


def _backward_case(rank: int, full: MoEFeedForward, xs: list[torch.Tensor], case: str,
                   check_input: bool = True) -> None:
    """Compare one layer's expert-parallel gradients on `xs[rank]` with the single-device ones."""
    ref = copy.deepcopy(full)
    ep = ExpertParallelMoE(full)
    lo, hi = ep.expert_ids.start, ep.expert_ids.stop
    x = xs[rank].clone().requires_grad_(check_input)
    out, stats = ep(x)
    _loss(out, stats, _projection(rank, out)).backward()

    experts = [ref.experts.w_gate, ref.experts.w_up, ref.experts.w_down]
    own = [p for name, p in ref.named_parameters() if not name.startswith("experts.")]
    ref_xs = [xr.clone().requires_grad_(r == rank and check_input) for r, xr in enumerate(xs)]
    losses = [_loss(*ref(xr), _projection(r, xr)) for r, xr in enumerate(ref_xs)]
    want_experts = torch.autograd.grad(sum(losses), experts, retain_graph=True)
    want_own = torch.autograd.grad(losses[rank], own + ([ref_xs[rank]] if check_input else []))

    got_experts = [ep.experts.w_gate.grad, ep.experts.w_up.grad, ep.experts.w_down.grad]
    for name, got, want in zip(("w_gate", "w_up", "w_down"), got_experts, want_experts):
        torch.testing.assert_close(got, want[lo:hi], **GRAD_TOL, msg=lambda m: f"{case}, {name}: {m}")
    got_own = [p.grad for name, p in ep.named_parameters() if not name.startswith("experts.")]
    if check_input:
        got_own.append(x.grad)
    assert len(got_own) == len(want_own), case
    for got, want in zip(got_own, want_own):
        torch.testing.assert_close(got, want, **GRAD_TOL, msg=lambda m: f"{case}: {m}")


def _backward_worker(rank: int) -> None:
    xs = [_tokens(r, (2, 9, 64)) for r in range(WORLD)]
    # Training, with token dropping (capacity 7 for 36 assignments over 4 experts) and without.
    for shared, normalize, capacity in ((48, False, 0.75), (0, True, None)):
        full = _full_layer(shared_expert_size=shared, norm_topk_prob=normalize, capacity_factor=capacity)
        _backward_case(rank, full.train(), xs, f"rank {rank}, shared {shared}, capacity {capacity}")

    # Every token picks experts 0 and 1 (rank 0's), so rank 1 receives no rows, and with an input
    # that needs no gradient only rank 0's experts would put the exchanges in the backward graph:
    # the layer must still run the same collectives on both ranks and give rank 1 zero gradients.
    full = _full_layer().eval()
    with torch.no_grad():
        full.router.weight.copy_(torch.tensor([1.0, 0.5, -1.0, -1.0])[:, None].expand(-1, 64) / 64)
    positive = [x.abs() for x in xs]
    assert full.route(positive[rank].reshape(-1, 64)).ids_TK.max() == 1
    _backward_case(rank, full, positive, f"rank {rank}, no rows for rank 1", check_input=False)


@pytest.mark.slow  # starts processes
def test_backward_equals_single_device_gradients(spawn):
    spawn(_backward_worker)


def _errors_worker(rank: int) -> None:
    with pytest.raises(ValueError, match="num_experts 3 must be a positive multiple of the expert-parallel "
                                         "world size 2"):
        ExpertParallelMoE(_full_layer(num_experts=3))
    ep = ExpertParallelMoE(_full_layer())
    with pytest.raises(TypeError, match="layer 0 is already expert-parallel"):
        ExpertParallelMoE(ep)
    offloaded = _full_layer()
    offloaded.use_experts(object())
    with pytest.raises(TypeError, match="layer 0: ExpertParallelMoE slices resident expert weights"):
        ExpertParallelMoE(offloaded)
    with pytest.raises(ValueError, match=r"x_RD has 3 rows but send_splits \[1, 1\] add up to 2"):
        all_to_all_rows(torch.zeros(3, 4), [1, 1], [1, 1])


@pytest.mark.slow  # starts processes
def test_bad_layouts_fail_with_a_clear_error(spawn):
    spawn(_errors_worker)


# -- a whole model ------------------------------------------------------------------------------


def _model_worker(rank: int) -> None:
    cfg = named_config("tiny", shared_expert_size=32, capacity_factor=1.0)
    torch.manual_seed(0)
    model = MoEGPT(cfg)
    ref = copy.deepcopy(model)
    rng = torch.get_rng_state()
    shard_experts(model)
    assert torch.equal(torch.get_rng_state(), rng)  # sharding draws no random numbers
    assert all(isinstance(m, ExpertParallelMoE) for m in model.moe_layers()) and len(model.moe_layers()) == 2
    ids = [torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(300 + r))
           for r in range(WORLD)]

    for train in (False, True):
        model.train(train)
        ref.train(train)
        with torch.no_grad():
            got, want = model(ids[rank]), ref(ids[rank])
        case = f"rank {rank}, train {train}"
        torch.testing.assert_close(got.logits, want.logits, **OUT_TOL, msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(got.aux_loss, want.aux_loss)

    # Training step: dense gradients are this rank's own; expert gradients cover both ranks' tokens.
    def loss_of(net: MoEGPT, ids_BT: torch.Tensor) -> torch.Tensor:
        out = net(ids_BT)
        return F.cross_entropy(out.logits[:, :-1].reshape(-1, cfg.vocab_size), ids_BT[:, 1:].reshape(-1)) \
            + cfg.aux_loss_coef * out.aux_loss + cfg.z_loss_coef * out.z_loss

    loss_of(model, ids[rank]).backward()
    losses = [loss_of(ref, i) for i in ids]
    dense = [n for n, _ in ref.named_parameters() if ".experts." not in n]
    experts = [n for n, _ in ref.named_parameters() if ".experts." in n]
    want_dense = torch.autograd.grad(losses[rank], [ref.get_parameter(n) for n in dense], retain_graph=True)
    want_experts = torch.autograd.grad(sum(losses), [ref.get_parameter(n) for n in experts])
    assert sorted(n for n, _ in model.named_parameters()) == sorted(dense + experts)
    for name, want in zip(dense, want_dense):
        torch.testing.assert_close(model.get_parameter(name).grad, want, **GRAD_TOL, msg=name)
    local = local_expert_ids(cfg.num_experts, rank, WORLD)
    for name, want in zip(experts, want_experts):
        torch.testing.assert_close(model.get_parameter(name).grad, want[local.start:local.stop], **GRAD_TOL,
                                   msg=name)


@pytest.mark.slow  # starts processes
def test_sharded_model_matches_single_device_model(spawn):
    spawn(_model_worker)


def test_expert_major_order_with_the_row_count_needs_no_host_sync():
    from storage.host_sync_counter import HostSyncCounter

    counts = torch.tensor([[1, 2], [3, 0]])
    with HostSyncCounter() as c:
        order = expert_major_order(counts, rows=6)
    assert order.tolist() == expert_major_order(counts).tolist() == [0, 3, 4, 5, 1, 2]
    assert c.total == 0


def _sync_worker(rank: int) -> None:
    from storage.host_sync_counter import HostSyncCounter

    # Training with token dropping: routing's nonzero and one read of the exchanged counts are the
    # layer's only host syncs (the splits and each expert's rows are sizes the host must know).
    ep = ExpertParallelMoE(_full_layer(capacity_factor=0.75).train())
    x = _tokens(rank, (2, 9, 64))
    with HostSyncCounter() as c:
        _, stats = ep(x)
    assert dict(c.counts) == {"nonzero": 1, "tolist": 1}, (rank, dict(c.counts))
    assert isinstance(stats.dropped, torch.Tensor)


@pytest.mark.slow  # starts processes
def test_forward_syncs_with_the_host_once_for_the_counts(spawn):
    spawn(_sync_worker)
