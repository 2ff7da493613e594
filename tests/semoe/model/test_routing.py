"""Gating maths: invariants on seeded random logits, hand-made cases with exact answers, parity
with HuggingFace routers and fairscale's top-2 gate, and numerical gradient checks.

Shape legend: T tokens, E experts, K top-k, C capacity, N kept assignments.
"""

from __future__ import annotations

import math

import pytest
import torch

from semoe.model.routing import (Routing, capacity_keep_mask, dispatch_order, expert_capacity, gather_rows,
                                 load_balancing_loss, route_grouped, route_topk, route_topk_softmax, router_z_loss)

SHAPES_TEK = [(1, 2, 1), (7, 4, 2), (33, 8, 2), (64, 16, 4), (10, 3, 3), (50, 8, 1)]


def _logits(num_tokens: int, num_experts: int, *, seed: int = 0, skew: float = 0.0,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded random logits; `skew` favours low expert ids so that capacity actually drops tokens."""
    gen = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(num_tokens, num_experts, generator=gen, dtype=torch.float64)
    logits_TE = logits_TE + skew * torch.linspace(1.0, 0.0, num_experts, dtype=torch.float64)
    return logits_TE.to(dtype)


def _keep_reference(ids_TK: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """GShard's rule as a plain loop: all first choices in token order, then second choices..."""
    num_tokens, top_k = ids_TK.shape
    used = [0] * num_experts
    keep = [[False] * top_k for _ in range(num_tokens)]
    for k in range(top_k):
        for t in range(num_tokens):
            e = int(ids_TK[t, k])
            if used[e] < capacity:
                keep[t][k] = True
                used[e] += 1
    return torch.tensor(keep, dtype=torch.bool).reshape(num_tokens, top_k)


def _dispatch_reference(ids_TK: torch.Tensor, keep_TK: torch.Tensor, num_experts: int):
    num_tokens, top_k = ids_TK.shape
    tokens, choices, counts = [], [], []
    for e in range(num_experts):
        count = 0
        for t in range(num_tokens):
            for k in range(top_k):
                if keep_TK[t, k] and int(ids_TK[t, k]) == e:
                    tokens.append(t)
                    choices.append(k)
                    count += 1
        counts.append(count)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return as_long(tokens), as_long(choices), as_long(counts)


# --- route_topk -----------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", SHAPES_TEK)
def test_route_topk_invariants(num_tokens, num_experts, top_k, normalize):
    logits_TE = _logits(num_tokens, num_experts, seed=num_tokens * 100 + num_experts)
    routing = route_topk(logits_TE, top_k, normalize=normalize)

    assert isinstance(routing, Routing)
    assert routing.weights_TK.shape == routing.ids_TK.shape == (num_tokens, top_k)
    assert routing.weights_TK.dtype == routing.probs_TE.dtype == torch.float32
    assert routing.ids_TK.dtype == torch.int64
    assert routing.logits_TE is logits_TE
    assert ((routing.weights_TK >= 0) & (routing.weights_TK <= 1)).all()
    assert ((routing.ids_TK >= 0) & (routing.ids_TK < num_experts)).all()
    for row in routing.ids_TK.tolist():
        assert len(set(row)) == top_k, f"repeated expert in {row}"
    torch.testing.assert_close(routing.probs_TE.sum(-1), torch.ones(num_tokens), rtol=0, atol=1e-6)
    # best expert first, and the first choice is the argmax
    assert (routing.weights_TK[:, :-1] >= routing.weights_TK[:, 1:]).all()
    assert torch.equal(routing.ids_TK[:, 0], logits_TE.argmax(-1))

    chosen_TK = routing.probs_TE.gather(-1, routing.ids_TK)
    if normalize:
        torch.testing.assert_close(routing.weights_TK.sum(-1), torch.ones(num_tokens), rtol=0, atol=1e-6)
        torch.testing.assert_close(routing.weights_TK, chosen_TK / chosen_TK.sum(-1, keepdim=True))
    else:
        assert torch.equal(routing.weights_TK, chosen_TK)


def test_route_topk_computes_in_float32_for_half_precision_logits():
    logits_TE = _logits(16, 8, dtype=torch.bfloat16)
    routing = route_topk(logits_TE, 2, normalize=True)
    reference = route_topk(logits_TE.float(), 2, normalize=True)
    assert routing.weights_TK.dtype == torch.float32
    assert torch.equal(routing.weights_TK, reference.weights_TK)
    assert torch.equal(routing.ids_TK, reference.ids_TK)


@pytest.mark.parametrize(
    "logits,top_k,error,match",
    [
        (torch.zeros(8), 1, ValueError, "2-D"),
        (torch.zeros(2, 3, 4), 1, ValueError, "2-D"),
        (torch.zeros(4, 3), 0, ValueError, "top_k"),
        (torch.zeros(4, 3), 4, ValueError, "top_k"),
        (torch.zeros(4, 3, dtype=torch.int64), 1, TypeError, "floating-point"),
    ],
)
def test_route_topk_rejects_bad_input(logits, top_k, error, match):
    with pytest.raises(error, match=match):
        route_topk(logits, top_k, normalize=True)


# --- HuggingFace parity -----------------------------------------------------------------------


def _run_hf_router(router: torch.nn.Module, hidden_size: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(router.weight.shape, generator=gen)
    hidden_BSD = torch.randn(2, 5, hidden_size, generator=gen).to(dtype)
    router = router.to(dtype)
    with torch.no_grad():
        router.weight.copy_(weight.to(dtype))
        hf_logits_TE, hf_weights_TK, hf_ids_TK = router(hidden_BSD)
    # Our logits come from the same linear map, so only the gating maths is being compared.
    logits_TE = torch.nn.functional.linear(hidden_BSD.reshape(-1, hidden_size), router.weight.detach())
    assert torch.equal(logits_TE, hf_logits_TE)
    return logits_TE, hf_weights_TK, hf_ids_TK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_mixtral_router(dtype):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
    logits_TE, hf_weights_TK, hf_ids_TK = _run_hf_router(MixtralTopKRouter(config), 16, dtype, seed=1)

    routing = route_topk(logits_TE, config.num_experts_per_tok, normalize=True)
    assert hf_weights_TK.dtype == torch.float32
    assert torch.equal(routing.weights_TK, hf_weights_TK)
    assert torch.equal(routing.ids_TK, hf_ids_TK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk_prob", [None, False, True])  # None: the config's default
@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe"])
def test_matches_hf_qwen2_moe_and_olmoe_routers(arch, norm_topk_prob, dtype):
    if arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig as Config
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter as Router
    else:
        from transformers import OlmoeConfig as Config
        from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter as Router

    extra = {} if norm_topk_prob is None else {"norm_topk_prob": norm_topk_prob}
    config = Config(hidden_size=16, num_experts=12, num_experts_per_tok=4, **extra)
    assert config.norm_topk_prob is (norm_topk_prob or False)
    logits_TE, hf_weights_TK, hf_ids_TK = _run_hf_router(Router(config), 16, dtype, seed=2)

    routing = route_topk(logits_TE, config.num_experts_per_tok, normalize=config.norm_topk_prob)
    # These routers cast the weights back to the logits' dtype; for float32 the cast is a no-op,
    # so the float32 comparison is exact on our own output.
    assert torch.equal(routing.weights_TK.to(hf_weights_TK.dtype), hf_weights_TK)
    assert torch.equal(routing.ids_TK, hf_ids_TK)


# --- expert_capacity --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,factor,expected",
    [
        (8, 4, 2, 1.0, 4),  # exact share
        (10, 4, 2, 1.25, 7),  # ceil(6.25)
        (9, 4, 1, 1.0, 3),  # ceil(2.25)
        (1, 64, 1, 1.0, 1),  # floor of 1 for a single decoding token
        (0, 8, 2, 1.0, 1),
        (16, 4, 2, 2.0, 16),
    ],
)
def test_expert_capacity(num_tokens, num_experts, top_k, factor, expected):
    assert expert_capacity(num_tokens, num_experts, top_k, factor) == expected


@pytest.mark.parametrize(
    "args,match",
    [
        ((-1, 4, 2, 1.0), "num_tokens"),
        ((8, 0, 1, 1.0), "num_experts"),
        ((8, 4, 0, 1.0), "top_k"),
        ((8, 4, 5, 1.0), "top_k"),
        ((8, 4, 2, 0.0), "capacity_factor"),
        ((8, 4, 2, float("nan")), "capacity_factor"),
        ((8, 4, 2, float("inf")), "capacity_factor"),
    ],
)
def test_expert_capacity_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        expert_capacity(*args)


# --- capacity_keep_mask -----------------------------------------------------------------------


def test_keep_mask_hand_example():
    ids_TK = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    # expert 0 queue: t0k0, t1k0 | t2k0, t3k1 dropped; expert 1: t3k0, t0k1 | t2k1; expert 2: t1k1
    expected = torch.tensor([[True, True], [True, True], [False, False], [True, False]])
    assert torch.equal(capacity_keep_mask(ids_TK, 3, capacity=2), expected)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", SHAPES_TEK)
def test_keep_mask_invariants(num_tokens, num_experts, top_k, factor):
    logits_TE = _logits(num_tokens, num_experts, seed=num_tokens + 7, skew=3.0)
    ids_TK = route_topk(logits_TE, top_k, normalize=True).ids_TK
    capacity = expert_capacity(num_tokens, num_experts, top_k, factor)
    keep_TK = capacity_keep_mask(ids_TK, num_experts, capacity)

    assert keep_TK.dtype == torch.bool and keep_TK.shape == ids_TK.shape
    assert torch.equal(keep_TK, _keep_reference(ids_TK, num_experts, capacity))
    for e in range(num_experts):
        routed_TK = ids_TK == e
        kept = int((routed_TK & keep_TK).sum())
        # never over capacity, and nothing is dropped while the expert still has room
        assert kept == min(capacity, int(routed_TK.sum()))
        # an expert keeps a later choice only once every earlier choice routed to it is kept
        for k in range(1, top_k):
            if (routed_TK[:, k] & keep_TK[:, k]).any():
                assert keep_TK[:, :k][routed_TK[:, :k]].all(), f"expert {e} kept choice {k} too early"


def test_keep_mask_drops_second_choices_before_first_choices():
    # Four tokens all pick expert 0 first and expert 1 second, and expert 1 also gets two first
    # choices: with capacity 2, expert 1 must keep the first choices of tokens 4-5, not the second
    # choices of tokens 0-1 that came earlier in token order.
    ids_TK = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1], [1, 0], [1, 0]])
    keep_TK = capacity_keep_mask(ids_TK, 2, capacity=2)
    assert keep_TK[:, 0].tolist() == [True, True, False, False, True, True]
    assert keep_TK[:, 1].tolist() == [False] * 6


@pytest.mark.parametrize("num_tokens,num_experts,top_k", SHAPES_TEK)
def test_keep_mask_keeps_everything_when_capacity_covers_all_assignments(num_tokens, num_experts, top_k):
    logits_TE = _logits(num_tokens, num_experts, seed=3, skew=10.0)  # heavily collapsed routing
    ids_TK = route_topk(logits_TE, top_k, normalize=False).ids_TK
    assert capacity_keep_mask(ids_TK, num_experts, num_tokens * top_k).all()
    # a capacity factor of E guarantees the same
    capacity = expert_capacity(num_tokens, num_experts, top_k, float(num_experts))
    assert capacity_keep_mask(ids_TK, num_experts, capacity).all()


def test_keep_mask_with_zero_capacity_drops_everything():
    ids_TK = route_topk(_logits(5, 4), 2, normalize=False).ids_TK
    assert not capacity_keep_mask(ids_TK, 4, 0).any()


@pytest.mark.parametrize(
    "ids,num_experts,capacity,error,match",
    [
        (torch.zeros(4, dtype=torch.int64), 2, 1, ValueError, "2-D"),
        (torch.zeros(4, 0, dtype=torch.int64), 2, 1, ValueError, "at least one choice"),
        (torch.zeros(4, 1), 2, 1, TypeError, "integer"),
        (torch.zeros(4, 1, dtype=torch.int64), 0, 1, ValueError, "num_experts"),
        (torch.zeros(4, 1, dtype=torch.int64), 2, -1, ValueError, "capacity"),
    ],
)
def test_keep_mask_rejects_bad_input(ids, num_experts, capacity, error, match):
    with pytest.raises(error, match=match):
        capacity_keep_mask(ids, num_experts, capacity)


# --- dispatch_order ---------------------------------------------------------------------------


def test_dispatch_order_hand_example():
    ids_TK = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    keep_TK = torch.tensor([[True, True], [True, True], [False, False], [True, False]])
    token_idx_N, choice_idx_N, counts_E = dispatch_order(ids_TK, keep_TK, 3)
    assert token_idx_N.tolist() == [0, 1, 0, 3, 1]
    assert choice_idx_N.tolist() == [0, 0, 1, 0, 1]
    assert counts_E.tolist() == [2, 2, 1]


@pytest.mark.parametrize("factor", [0.5, 1.0, None])  # None: no dropping
@pytest.mark.parametrize("num_tokens,num_experts,top_k", SHAPES_TEK)
def test_dispatch_order_matches_loop_reference(num_tokens, num_experts, top_k, factor):
    logits_TE = _logits(num_tokens, num_experts, seed=11, skew=2.0)
    ids_TK = route_topk(logits_TE, top_k, normalize=True).ids_TK
    if factor is None:
        keep_TK = torch.ones_like(ids_TK, dtype=torch.bool)
    else:
        capacity = expert_capacity(num_tokens, num_experts, top_k, factor)
        keep_TK = capacity_keep_mask(ids_TK, num_experts, capacity)

    token_idx_N, choice_idx_N, counts_E = dispatch_order(ids_TK, keep_TK, num_experts)
    ref_tokens, ref_choices, ref_counts = _dispatch_reference(ids_TK, keep_TK, num_experts)
    assert torch.equal(token_idx_N, ref_tokens)
    assert torch.equal(choice_idx_N, ref_choices)
    assert torch.equal(counts_E, ref_counts)
    assert int(counts_E.sum()) == int(keep_TK.sum())
    # every row lands in the block of the expert it was routed to
    experts_N = ids_TK[token_idx_N, choice_idx_N]
    assert torch.equal(experts_N, torch.repeat_interleave(torch.arange(num_experts), counts_E))


def test_dispatch_order_rejects_bad_input():
    ids_TK = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="keep_TK has shape"):
        dispatch_order(ids_TK, torch.ones(4, 1, dtype=torch.bool), 2)
    with pytest.raises(TypeError, match="bool"):
        dispatch_order(ids_TK, torch.ones(4, 2, dtype=torch.int64), 2)


@pytest.mark.parametrize("factor", [0.5, None])  # None: no dropping
@pytest.mark.parametrize("num_tokens,num_experts,top_k", SHAPES_TEK)
def test_gather_rows_is_the_plain_gather_with_its_gradient(num_tokens, num_experts, top_k, factor):
    """Forward: exactly `x[token_idx]`. Backward: autograd's accumulating index_put sums a token's
    choices in dispatch order, gather_rows in choice order. For K <= 2 that is the same sum bit
    for bit (float addition commutes; 0 + a is a); for K = 3 and 4 the two orders may differ by the
    rounding of a sum of K terms, so they are checked to K * eps * the largest term, absolute."""
    logits_TE = _logits(num_tokens, num_experts, seed=5, skew=1.0)
    ids_TK = route_topk(logits_TE, top_k, normalize=True).ids_TK
    keep_TK = (torch.ones_like(ids_TK, dtype=torch.bool) if factor is None else
               capacity_keep_mask(ids_TK, num_experts, expert_capacity(num_tokens, num_experts, top_k, factor)))
    token_idx_N, choice_idx_N, _ = dispatch_order(ids_TK, keep_TK, num_experts)
    for dtype in (torch.float32, torch.float64):
        gen = torch.Generator().manual_seed(3)
        x_TD = torch.randn(num_tokens, 6, generator=gen, dtype=dtype)
        grad_ND = torch.randn(token_idx_N.shape[0], 6, generator=gen, dtype=dtype)
        plain = x_TD.clone().requires_grad_()
        ours = x_TD.clone().requires_grad_()
        rows_plain, rows_ours = plain[token_idx_N], gather_rows(ours, token_idx_N, choice_idx_N, top_k)
        assert torch.equal(rows_ours, rows_plain)
        rows_plain.backward(grad_ND)
        rows_ours.backward(grad_ND)
        if top_k <= 2:
            assert torch.equal(ours.grad, plain.grad)
        else:
            bound = top_k * torch.finfo(dtype).eps * float(grad_ND.abs().max())
            torch.testing.assert_close(ours.grad, plain.grad, rtol=0, atol=bound)
        dropped_T = ~keep_TK.any(1)
        assert not ours.grad[dropped_T].any()  # a token every expert dropped gets no gradient


# --- losses -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (8, 2), (6, 3)])
def test_load_balancing_loss_is_one_for_uniform_routing(num_experts, top_k):
    num_tokens = 4 * num_experts
    # uniform assignment counts (round robin) with arbitrary probabilities...
    ids_TK = (torch.arange(num_tokens * top_k) % num_experts).reshape(num_tokens, top_k)
    probs_TE = route_topk(_logits(num_tokens, num_experts, seed=5), top_k, normalize=False).probs_TE
    loss = load_balancing_loss(probs_TE, ids_TK, num_experts)
    torch.testing.assert_close(loss, torch.tensor(1.0), rtol=0, atol=1e-6)
    # ...and uniform probabilities with arbitrary (here fully collapsed) assignments
    uniform = route_topk(torch.zeros(num_tokens, num_experts), top_k, normalize=False)
    loss = load_balancing_loss(uniform.probs_TE, uniform.ids_TK, num_experts)
    torch.testing.assert_close(loss, torch.tensor(1.0), rtol=0, atol=1e-6)


def test_load_balancing_loss_grows_when_routing_collapses():
    num_tokens, num_experts = 64, 8
    balanced = route_topk(_logits(num_tokens, num_experts, seed=6), 1, normalize=False)
    collapsed_logits_TE = _logits(num_tokens, num_experts, seed=6)
    collapsed_logits_TE[:, 0] += 30.0
    collapsed = route_topk(collapsed_logits_TE, 1, normalize=False)

    balanced_loss = load_balancing_loss(balanced.probs_TE, balanced.ids_TK, num_experts)
    collapsed_loss = load_balancing_loss(collapsed.probs_TE, collapsed.ids_TK, num_experts)
    assert float(balanced_loss) < 1.5
    # everything on expert 0 with probability ~1: f_0 = P_0 = 1, so the loss reaches E
    torch.testing.assert_close(collapsed_loss, torch.tensor(float(num_experts)), rtol=1e-5, atol=0)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", SHAPES_TEK)
def test_load_balancing_loss_is_hf_mixtral_loss_over_top_k(num_tokens, num_experts, top_k):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits_TE = _logits(num_tokens, num_experts, seed=8, skew=1.0)
    routing = route_topk(logits_TE, top_k, normalize=True)
    ours = load_balancing_loss(routing.probs_TE, routing.ids_TK, num_experts)
    hf = load_balancing_loss_func((logits_TE,), num_experts=num_experts, top_k=top_k)
    # HuggingFace divides assignment counts by T, we divide by T * K
    torch.testing.assert_close(hf, top_k * ours, rtol=1e-6, atol=0)


def test_load_balancing_loss_rejects_mismatched_input():
    probs_TE = torch.full((4, 3), 1 / 3)
    with pytest.raises(ValueError, match="num_experts"):
        load_balancing_loss(probs_TE, torch.zeros(4, 1, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="tokens"):
        load_balancing_loss(probs_TE, torch.zeros(5, 1, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="at least one token"):
        load_balancing_loss(probs_TE[:0], torch.zeros(0, 1, dtype=torch.int64), 3)


def test_router_z_loss_values():
    # all-zero logits: logsumexp = log E for every token
    torch.testing.assert_close(router_z_loss(torch.zeros(5, 8)), torch.tensor(math.log(8) ** 2))
    logits_TE = _logits(6, 4, seed=9, dtype=torch.float64)
    expected = torch.mean(torch.log(torch.exp(logits_TE).sum(-1)) ** 2)
    torch.testing.assert_close(router_z_loss(logits_TE), expected, rtol=1e-12, atol=0)
    # large logits must not overflow, which a naive exp would
    big_TE = torch.tensor([[1000.0, 1000.0]])
    torch.testing.assert_close(router_z_loss(big_TE), torch.tensor((1000.0 + math.log(2)) ** 2))


def test_router_z_loss_runs_in_float32_for_bfloat16_logits():
    logits_TE = _logits(16, 8, seed=10, dtype=torch.bfloat16) * 20
    loss = router_z_loss(logits_TE)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, router_z_loss(logits_TE.float()))


# --- gradients --------------------------------------------------------------------------------


def _grad_logits(num_tokens: int = 5, num_experts: int = 4, seed: int = 12) -> torch.Tensor:
    # float64, and well-separated values so the finite-difference steps never flip a top-k choice
    return _logits(num_tokens, num_experts, seed=seed, dtype=torch.float64).requires_grad_(True)


def test_gradcheck_load_balancing_loss():
    def loss_fn(logits_TE):
        routing = route_topk(logits_TE, 2, normalize=False)
        return load_balancing_loss(routing.probs_TE, routing.ids_TK, logits_TE.shape[1])

    logits_TE = _grad_logits()
    assert torch.autograd.gradcheck(loss_fn, (logits_TE,))
    (grad_TE,) = torch.autograd.grad(loss_fn(logits_TE), logits_TE)
    assert grad_TE.abs().sum() > 0  # the loss does push the router


def test_gradcheck_router_z_loss():
    assert torch.autograd.gradcheck(router_z_loss, (_grad_logits(),))


@pytest.mark.parametrize("normalize", [True, False])
def test_gradcheck_routing_weights(normalize):
    logits_TE = _grad_logits(num_experts=6)
    assert route_topk(logits_TE, 3, normalize=normalize).weights_TK.dtype == torch.float64
    assert torch.autograd.gradcheck(lambda x: route_topk(x, 3, normalize=normalize).weights_TK, (logits_TE,))


# --- fairscale top-2 gating (test reference only) ---------------------------------------------


@pytest.fixture
def fairscale_top2gating(monkeypatch):
    """fairscale's `top2gating` with its Gumbel noise on the second choice switched off.

    Without noise its second expert is the deterministic runner-up, which is what top-2 routing
    here picks; everything else (choice-major capacity priority, renormalisation over the kept
    choices) is GShard's rule, so the two can be compared exactly.
    """
    try:  # a test dependency that tools/run.sh installs: missing, the comparison fails rather than skips
        from fairscale.nn.moe import top2gate
    except ImportError as e:
        missing = str(e)
    else:
        missing = None
    if missing:
        pytest.fail(f"fairscale is needed for the gating reference ({missing}); install it with "
                    "`pip install --no-deps fairscale==0.4.13` as tools/run.sh does", pytrace=False)
    monkeypatch.setattr(top2gate, "gumbel_rsample", lambda shape, device: torch.zeros(shape, device=device))
    return top2gate.top2gating


def _scatter_TE(values_TK: torch.Tensor, ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    out_TE = torch.zeros(ids_TK.shape[0], num_experts, dtype=values_TK.dtype)
    return out_TE.scatter_add_(1, ids_TK, values_TK)


@pytest.mark.parametrize("num_tokens,num_experts,skew", [(8, 4, 0.0), (32, 8, 3.0), (64, 4, 1.0), (12, 12, 5.0)])
def test_matches_fairscale_top2gating(fairscale_top2gating, num_tokens, num_experts, skew):
    logits_TE = _logits(num_tokens, num_experts, seed=13, skew=skew)
    l_aux, combine_TEC, dispatch_TEC = fairscale_top2gating(logits_TE)
    capacity = combine_TEC.shape[2]
    # fairscale's 2T/E (it requires E | T) is a capacity factor of 1.0 here
    assert capacity == expert_capacity(num_tokens, num_experts, 2, 1.0)

    routing = route_topk(logits_TE, 2, normalize=False)
    keep_TK = capacity_keep_mask(routing.ids_TK, num_experts, capacity)
    assert torch.equal(routing.ids_TK[:, 0], logits_TE.argmax(-1))
    # same assignments survive dropping
    assert torch.equal(dispatch_TEC.any(-1), _scatter_TE(keep_TK.float(), routing.ids_TK, num_experts).bool())
    # fairscale renormalises the gate over the choices that were kept
    kept_weights_TK = routing.weights_TK * keep_TK
    denom_T1 = kept_weights_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
    expected_TE = _scatter_TE(kept_weights_TK / denom_T1, routing.ids_TK, num_experts)
    torch.testing.assert_close(combine_TEC.sum(-1), expected_TE, rtol=0, atol=1e-6)
    # its aux loss counts first choices only and averages over experts: mean_e(f_e * P_e)
    first_choice_loss = load_balancing_loss(routing.probs_TE, routing.ids_TK[:, :1], num_experts)
    torch.testing.assert_close(l_aux * num_experts**2, first_choice_loss, rtol=1e-5, atol=0)


def test_matches_fairscale_top2gating_without_drops(fairscale_top2gating):
    # Token t prefers expert t % E, then (t + 1) % E: each expert gets exactly 2T/E assignments,
    # fairscale's capacity, so nothing is dropped and its combine weights are the normalised top-2.
    num_tokens, num_experts = 16, 4
    gen = torch.Generator().manual_seed(14)
    logits_TE = torch.full((num_tokens, num_experts), -4.0)
    tokens = torch.arange(num_tokens)
    logits_TE[tokens, tokens % num_experts] = 2.0 + torch.rand(num_tokens, generator=gen)
    logits_TE[tokens, (tokens + 1) % num_experts] = 1.0 + torch.rand(num_tokens, generator=gen)

    _, combine_TEC, _ = fairscale_top2gating(logits_TE)
    routing = route_topk(logits_TE, 2, normalize=True)
    capacity = expert_capacity(num_tokens, num_experts, 2, 1.0)
    assert capacity_keep_mask(routing.ids_TK, num_experts, capacity).all()
    expected_TE = _scatter_TE(routing.weights_TK, routing.ids_TK, num_experts)
    torch.testing.assert_close(combine_TEC.sum(-1), expected_TE, rtol=0, atol=1e-6)


# -- the newer routers against transformers' own ------------------------------------------------
# Compared as sets per token (transformers picks with sorted=False): the chosen ids exactly, and each
# chosen expert's weight within 1e-6 (float32; the same elementwise arithmetic, so only summation
# order in the renormalisation can differ).


def _hf_router(kind: str, E: int, D: int, K: int, **kw):
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    base = dict(hidden_size=D, num_experts_per_tok=K, num_attention_heads=4, num_hidden_layers=1)
    if kind == "v2":
        return DeepseekV2TopkRouter(transformers.DeepseekV2Config(**base, n_routed_experts=E, **kw))
    if kind == "v3":
        return DeepseekV3TopkRouter(transformers.DeepseekV3Config(**base, n_routed_experts=E, **kw))
    if kind == "glm":
        return Glm4MoeTopkRouter(transformers.Glm4MoeConfig(**base, n_routed_experts=E, **kw))
    return GptOssTopKRouter(transformers.GptOssConfig(**base, num_local_experts=E, **kw))


def _by_expert(ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist())) for i, w in zip(ids_TK, weights_TK)]


def _assert_same_choice(ours, hf_ids, hf_weights) -> None:
    got, want = _by_expert(ours.ids_TK, ours.weights_TK), _by_expert(hf_ids, hf_weights)
    for t, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"token {t}: experts {sorted(g)} != {sorted(w)}"
        for e in g:
            assert g[e] == pytest.approx(w[e], abs=1e-6), f"token {t} expert {e}"


def _ours(kind: str, router, x_TD: torch.Tensor, K: int, **kw):
    logits = torch.nn.functional.linear(x_TD.float(), router.weight.float(),
                                        router.bias if kind == "oss" else None)
    if kind == "oss":
        return route_topk_softmax(logits, K)
    if kind == "v2":
        return route_grouped(logits, K, scores="softmax", n_group=kw["n_group"], topk_group=kw["topk_group"],
                             group_score="max", normalize=False, scale=kw["routed_scaling_factor"])
    return route_grouped(logits, K, scores="sigmoid", correction_bias_E=router.e_score_correction_bias,
                         n_group=kw["n_group"], topk_group=kw["topk_group"], group_score="top2",
                         normalize=kw["norm_topk_prob"], scale=kw["routed_scaling_factor"])


GROUPED = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)


@pytest.mark.parametrize("kind, kw", [
    ("v2", dict(GROUPED, topk_method="group_limited_greedy")),
    ("v3", dict(GROUPED, norm_topk_prob=True)), ("v3", dict(GROUPED, norm_topk_prob=False)),
    ("glm", dict(GROUPED, norm_topk_prob=True)), ("oss", {}),
], ids=["v2", "v3-norm", "v3-raw", "glm", "gpt-oss"])
@pytest.mark.parametrize("K", [2, 4])
def test_newer_routers_match_transformers(kind, kw, K):
    E, D, T = 16, 24, 64
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        router = _hf_router(kind, E, D, K, **kw)
        with torch.no_grad():
            router.weight.copy_(torch.randn(E, D, generator=g))
            if kind == "oss":
                router.bias.copy_(torch.randn(E, generator=g))
            if kind in ("v3", "glm"):
                router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.3)
            x = torch.randn(T, D, generator=g)
            _, hf_w, hf_ids = router(x)
        ours = _ours(kind, router, x, K, **kw)
        _assert_same_choice(ours, hf_ids, hf_w)
        assert (ours.weights_TK >= 0).all() and torch.isfinite(ours.weights_TK).all()
        assert all(len(set(r)) == K for r in ours.ids_TK.tolist())
        if kind == "oss":
            torch.testing.assert_close(ours.weights_TK.sum(-1), torch.ones(T), rtol=0, atol=1e-6)


def test_group_limits_and_correction_bias_change_the_choice_as_transformers_does():
    """The best single expert sits in a group whose second best is poor: top2 group scoring drops
    that group, so plain top-k would differ. The bias moves the choice; the weights stay the
    unbiased sigmoid scores."""
    E, D, K = 8, 8, 2
    kw = dict(n_group=4, topk_group=2, routed_scaling_factor=1.0, norm_topk_prob=False)
    router = _hf_router("v3", E, D, K, **kw)
    logits = torch.tensor([[6.0, -6.0, 1.0, 1.0, 0.5, 0.5, -1.0, -1.0]])  # group 0: one star, one dud
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        _, hf_w, hf_ids = router(logits)
    ours = _ours("v3", router, logits, K, **kw)
    _assert_same_choice(ours, hf_ids, hf_w)
    assert 0 not in ours.ids_TK[0].tolist()  # the global best expert lost with its group
    assert set(route_topk(logits, K, normalize=False).ids_TK[0].tolist()) != set(ours.ids_TK[0].tolist())
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0])
    with torch.no_grad():
        router.e_score_correction_bias.copy_(bias)
        _, hf_w, hf_ids = router(logits)
    biased = _ours("v3", router, logits, K, **kw)
    _assert_same_choice(biased, hf_ids, hf_w)
    assert 4 in biased.ids_TK[0].tolist()  # chosen because of its bias...
    torch.testing.assert_close(biased.weights_TK, torch.sigmoid(logits)[0, biased.ids_TK[0]][None], rtol=0,
                               atol=0)  # ...weighted by its own score


@pytest.mark.parametrize("kind", ["v2", "v3", "oss"])
def test_ties_break_as_in_transformers(kind):
    """All-equal logits, and values duplicated across groups: the same ids as transformers."""
    E, D, K = 8, 8, 2
    kw = dict(n_group=4, topk_group=2, routed_scaling_factor=1.0)
    kw = {**kw, "topk_method": "group_limited_greedy"} if kind == "v2" else \
        ({**kw, "norm_topk_prob": True} if kind == "v3" else {})
    router = _hf_router(kind, E, D, K, **kw)
    for logits in (torch.zeros(3, E), torch.tensor([[1.0, 0.0] * 4, [0.5, 0.5, 2.0, 2.0, 0.5, 0.5, 2.0, 2.0]])):
        with torch.no_grad():
            router.weight.copy_(torch.eye(E))
            if kind == "oss":
                router.bias.zero_()
            _, hf_w, hf_ids = router(logits)
        _assert_same_choice(_ours(kind, router, logits, K, **kw), hf_ids, hf_w)


def test_grouped_router_rejects_bad_groups():
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="n_group"):
        route_grouped(logits, 2, scores="sigmoid", n_group=3, topk_group=1, normalize=True)
    with pytest.raises(ValueError, match="topk_group"):
        route_grouped(logits, 2, scores="sigmoid", n_group=4, topk_group=5, normalize=True)
    with pytest.raises(ValueError, match="scores must be one of softmax, sigmoid, sqrtsoftplus"):
        route_grouped(logits, 2, scores="tanh", normalize=True)
