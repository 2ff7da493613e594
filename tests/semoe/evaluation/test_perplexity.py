"""Evaluation maths against plain references: NLL by cross_entropy, KL by hand, windows by construction."""

from __future__ import annotations

import math

import pytest
import torch

from semoe.evaluation.perplexity import (EvalConfig, evaluate, gather_tokens, kl_divergence, token_nll,
                                         top_token_agreement, window_bounds)

V = 11


def _table_logits(table_VV: torch.Tensor):
    """A fake model whose logits depend on the current token only (a bigram table)."""
    return lambda ids_1T: table_VV[ids_1T]


def test_token_nll_is_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits_TV = torch.randn(7, V, generator=g, dtype=torch.float64).to(torch.bfloat16)
    targets_T = torch.randint(0, V, (7,), generator=g)
    want = torch.nn.functional.cross_entropy(logits_TV.float(), targets_T, reduction="none")
    torch.testing.assert_close(token_nll(logits_TV, targets_T), want)  # float32 whatever the input dtype
    assert token_nll(logits_TV, targets_T).dtype == torch.float32


def test_kl_of_identical_logits_is_zero_and_of_a_known_pair_matches_by_hand():
    logits_TV = torch.randn(5, V)
    assert kl_divergence(logits_TV, logits_TV).abs().max() < 1e-6
    # p_ref = (1/4, 3/4), p_model = (1/2, 1/2)
    ref = torch.tensor([[0.0, math.log(3.0)]])
    model = torch.tensor([[0.0, 0.0]])
    want = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert kl_divergence(ref, model).item() == pytest.approx(want, rel=1e-6)
    assert kl_divergence(model, ref).item() == pytest.approx(0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75),
                                                              rel=1e-6)
    # a token the reference rules out contributes nothing (not nan)
    assert kl_divergence(torch.tensor([[0.0, -math.inf]]), model).item() == pytest.approx(math.log(2.0), rel=1e-6)


def test_top_token_agreement():
    ref = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    model = torch.tensor([[0.0, 3.0, 1.0], [0.0, 0.0, 1.0]])
    assert top_token_agreement(ref, model).tolist() == [True, False]


def test_windows_cover_every_scored_token_once():
    assert window_bounds(50, 16, 40) == [(0, 16), (16, 32), (32, 40)]
    assert window_bounds(20, 16, 4096) == [(0, 16), (16, 19)]  # 19 targets after 20 tokens
    assert window_bounds(1, 16, 4096) == []
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        EvalConfig(seq_len=1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        EvalConfig(max_tokens=0)


def test_perplexity_is_exp_of_the_cross_entropy_of_every_scored_position():
    g = torch.Generator().manual_seed(1)
    table_VV = torch.randn(V, V, generator=g)
    ids_N = torch.randint(0, V, (50,), generator=g)
    seen = []
    res = evaluate(ids_N, _table_logits(table_VV), config=EvalConfig(seq_len=16, max_tokens=40), on_window=seen.append)
    want = torch.nn.functional.cross_entropy(table_VV[ids_N[:40]], ids_N[1:41]).item()
    assert (res.tokens, res.windows, seen) == (40, 3, [16, 16, 8])
    assert res.mean_nll == pytest.approx(want, rel=1e-6)
    assert res.perplexity == pytest.approx(math.exp(want), rel=1e-6)
    assert res.kl_divergence is None and res.top_token_agreement is None


def test_against_a_reference():
    g = torch.Generator().manual_seed(2)
    table_VV, other_VV = torch.randn(V, V, generator=g), torch.randn(V, V, generator=g)
    ids_N = torch.randint(0, V, (33,), generator=g)
    cfg = EvalConfig(seq_len=8)
    same = evaluate(ids_N, _table_logits(table_VV), config=cfg, reference_fn=_table_logits(table_VV))
    assert abs(same.kl_divergence) < 1e-6 and same.top_token_agreement == 1.0
    diff = evaluate(ids_N, _table_logits(table_VV), config=cfg, reference_fn=_table_logits(other_VV))
    want_kl = kl_divergence(other_VV[ids_N[:32]], table_VV[ids_N[:32]]).mean().item()
    want_agree = (other_VV[ids_N[:32]].argmax(-1) == table_VV[ids_N[:32]].argmax(-1)).float().mean().item()
    assert diff.kl_divergence == pytest.approx(want_kl, rel=1e-5) and diff.kl_divergence > 0
    assert diff.top_token_agreement == pytest.approx(want_agree)
    per_token = kl_divergence(other_VV[ids_N[:32]], table_VV[ids_N[:32]]).double()
    for q in (0.5, 0.99, 0.999):  # the tail llama.cpp reports, over every scored position
        assert diff.kl_quantile(q) == pytest.approx(torch.quantile(per_token, q).item(), rel=1e-5)
    assert same.kl_quantile(0.999) < 1e-6 and diff.kl_quantile(0.999) > diff.kl_quantile(0.5)


def test_gather_tokens_puts_eos_after_each_non_empty_document_and_stops_at_the_limit():
    def encode(text):
        return [ord(c) for c in text]

    docs = [iter(["ab", "c"]), iter([]), iter(["de"])]
    assert gather_tokens(docs, encode, eos_id=0, limit=100) == [97, 98, 99, 0, 100, 101, 0]
    pulled = []

    def lazy():
        for piece in ("ab", "cd", "ef"):
            pulled.append(piece)
            yield piece

    assert gather_tokens([lazy()], encode, eos_id=0, limit=3) == [97, 98, 99]
    assert pulled == ["ab", "cd"]  # the rest of the text is never read
