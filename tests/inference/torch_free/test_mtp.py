"""Drafting with a checkpoint's multi-token-prediction layer (inference/torch_free/mtp.py): import keeps the
layer (its experts as chunks of layer N), the runner's drafts are transformers' `MtpModel`'s (the layer
over the model's hidden states of a prompt, then chained on its own output), and speculative decoding with
them gives greedy decoding's tokens exactly, rejections included.

Tolerances: the layer's logits within DRAFT_ATOL of transformers' (float32 throughout: 1e-7 measured, the
bound leaves room for summation order); log-probs within LOGPROB_ATOL (a verification pass computes its
rows as the prompt pass does, a step as decoding does)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.mtp_checkpoints import MTP_ARCHS, make_mtp_checkpoint, mtp_oracle

from inference.torch_free import mtp
from inference.torch_free.prompt_prefill import prefill
from inference.torch_free.runner import LeanConfig, LeanModel
from semoe.checkpoints.hf_convert import import_checkpoint
from semoe.decode.loop import PromptLookup, SamplingConfig
from storage.errors import BadInputError
from storage.store import Store

PROMPT = [3, 7, 11, 2, 9, 4, 30, 12]
DRAFT_ATOL = 1e-5
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module", params=MTP_ARCHS)
def made(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_mtp_checkpoint(request.param, root / "hf")
    return hf, import_checkpoint(str(hf), str(root / "store"))


def test_import_keeps_the_layer_its_experts_as_chunks_of_layer_n(made, tmp_path):
    hf, store = made
    n = store.manifest.model["num_layers"]
    written = [k for k in store.manifest.model["hf"]["files"]["mtp.safetensors"]["tensors"]]
    info = store.describe()
    assert info["mtp"]["layers"] == [n] and info["mtp"]["tensors"] == len(written) and info["skipped"] is None
    assert mtp.mtp_layers(store) == [n]
    E = store.manifest.expert_layers()[n]  # the layer's experts, each one chunk, as the model's are
    assert E == store.manifest.expert_layers()[n - 1]
    assert all(".experts." in t.name and t.name in written for t in store.manifest.chunk_tensors(store.manifest.chunk(n, 0)))
    left = import_checkpoint(str(hf), str(tmp_path / "without"), mtp=False).describe()
    assert left["mtp"] is None and left["skipped"]["layers"] == [n] and n not in left["experts_per_layer"]


def test_the_layers_drafts_are_transformers_mtp_models(made):
    """The depth-1 pass over every prompt row (the model's normed hidden state at i, the token at i + 1),
    then one chained row (the layer's normed output and the token it drafted): logits equal to
    transformers' MtpModel run the same way, with its own cache."""
    from transformers.cache_utils import MtpCache

    hf, store = made
    model, oracle = mtp_oracle(hf)
    P = len(PROMPT)
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), output_hidden_states=True)
        nxt = int(out.logits[0, -1].argmax())
        cache = MtpCache(config=model.config.get_mtp_config())
        hs = oracle.forward_layer(0, out.hidden_states[-1], torch.arange(1, P + 1)[None], cache,
                                  input_ids=torch.tensor([PROMPT[1:] + [nxt]]))
        want1 = oracle._project_to_logits(hs[:, -1:])[0, -1]
        d1 = int(want1.argmax())
        hs2 = oracle.forward_layer(0, hs[:, -1:], torch.tensor([[P + 1]]), cache, input_ids=torch.tensor([[d1]]))
        want2 = oracle._project_to_logits(hs2)[0, -1]
    with LeanModel(store.root, LeanConfig(cache_bytes=None, dense="float")) as lean, lean.sequence(32) as seq:
        drafter = mtp.default_draft(lean, seq, PROMPT)
        assert isinstance(drafter, mtp.Drafter)
        assert int(np.argmax(prefill(seq, PROMPT))) == nxt
        layer, (pos0, rows) = lean._mtp, seq.rows
        assert pos0 == 0 and rows.shape == (P, lean.config.hidden_size)
        hidden = mtp.rms(rows, layer.norm, lean.config.rms_norm_eps)
        np.testing.assert_allclose(hidden, out.hidden_states[-1][0].numpy(), atol=DRAFT_ATOL)
        got1, h1 = layer.rows(drafter.cache, 32, hidden, PROMPT[1:] + [nxt], 0)
        np.testing.assert_allclose(got1, want1.numpy(), atol=DRAFT_ATOL)
        np.testing.assert_allclose(h1, hs[0, -1].numpy(), atol=DRAFT_ATOL)
        got2, _ = layer.rows(drafter.cache, 32, h1[None], [d1], P)
        np.testing.assert_allclose(got2, want2.numpy(), atol=DRAFT_ATOL)
        # the drafter itself: the same two tokens, from the rows the prompt left
        seq.rows = (0, rows)
        assert drafter([nxt], 2) == [d1, int(want2.argmax())]


@pytest.mark.parametrize("cache", [None, 1], ids=["resident", "least-cache"])
def test_speculative_decoding_with_the_layers_drafts_gives_greedy_tokens(made, cache):
    """The default draft where the store has the layer is the layer's; whatever it drafts (random
    weights: mostly wrong, so rows are rejected and undone), the tokens are plain greedy decoding's."""
    _, store = made
    cfg = SamplingConfig(max_new_tokens=20)
    with LeanModel(store.root, LeanConfig(cache_bytes=cache)) as lean:
        want = lean.generate(PROMPT, cfg)
        for k in (1, 3):
            got = lean.generate(PROMPT, cfg, speculative=k)
            assert got.tokens == want.tokens, k
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=LOGPROB_ATOL)
            s = got.stats
            # every pass drafted but the last (which has room for no more), and each kept draft saved a pass
            assert s["drafted"] >= s["passes"] - 1 > 0 and 0 <= s["accepted"] <= s["drafted"]
            assert s["passes"] <= len(want.tokens) - 1 - s["accepted"] + 1


def test_no_layer_means_lookup_and_asking_for_one_says_so(tmp_path):
    from helpers.hf_models import make_hf_checkpoint

    store = import_checkpoint(str(make_hf_checkpoint("mixtral", tmp_path / "hf")), str(tmp_path / "store"))
    with LeanModel(store.root, LeanConfig(cache_bytes=None)) as lean, lean.sequence(16) as seq:
        assert isinstance(mtp.default_draft(lean, seq, PROMPT), PromptLookup)
        with pytest.raises(BadInputError, match="holds no multi-token-prediction layer"):
            mtp.MTP(lean)


def test_the_engine_and_a_quantized_store_take_a_store_with_the_layer(made, tmp_path):
    """The layer's chunks beside the model's change nothing for the engine (resident and offloaded: its
    tokens are transformers' greedy ones) nor for `semoe store quantize`, whose int4 store keeps the layer
    quantized and drafts with it, its speculative tokens plain decoding's."""
    from inference.engine import Engine
    from inference.engine_config import EngineConfig
    from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store

    hf, store = made
    model, _ = mtp_oracle(hf)
    with torch.no_grad():
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    cfg = SamplingConfig(max_new_tokens=8)
    for config in (EngineConfig(), EngineConfig(cpu_cache_bytes=1)):
        engine = Engine.load(store.root, config)
        try:
            assert engine.generate(PROMPT, cfg).tokens == want
        finally:
            engine.close()
    quantize_store(store.root, str(tmp_path / "int8"), QuantizeConfig(bits=8))
    q = Store.open(str(tmp_path / "int8"))
    n = store.manifest.model["num_layers"]
    assert q.describe()["mtp"] == store.describe()["mtp"]
    assert any(t.quant for t in q.manifest.chunk_tensors(q.manifest.chunk(n, 0)))
    with LeanModel(q.root, LeanConfig(cache_bytes=1)) as lean:
        plain = lean.generate(PROMPT, SamplingConfig(max_new_tokens=16))
        got = lean.generate(PROMPT, SamplingConfig(max_new_tokens=16), speculative=2)
    assert got.tokens == plain.tokens and got.stats["drafted"] > 0


def test_paying_drafts_while_drafting_is_faster_a_token_and_probes_again():
    """`loop.Paying` on a scripted clock: a pass costs 1 s; with drafts it emits `made` tokens, without one.
    Where drafted passes emit 2 tokens, it keeps drafting through the hold; where they emit 1 (no draft
    kept: slower a token, as a wider pass is), it holds plain passes, asking its drafter for none (but
    calling it, so the drafter sees every row), and probes drafting again after the hold."""
    from semoe.decode.loop import Paying

    for made, held in ((2, "draft"), (1, "plain")):
        t, asked, tokens = [0.0], [], [1]
        paying = Paying(lambda toks, n: asked.append(n) or [0] * n, probe=2, hold=5, clock=lambda: t[0])
        kinds = []
        for _ in range(2 + 2 + 5 + 2 + 2):
            drafts = paying(tokens, 3)
            kinds.append("draft" if drafts else "plain")
            t[0] += 1.0 if drafts else (0.9 if made == 2 else 0.5)  # a drafted pass is the wider one
            tokens = tokens + [0] * (made if drafts else 1)
        assert kinds == ["draft"] * 2 + ["plain"] * 2 + [held] * 5 + ["draft"] * 2 + ["plain"] * 2, made
        assert len(asked) == len(kinds) and asked.count(0) == kinds.count("plain")


def test_generate_drafts_with_the_layer_by_itself_where_it_runs_in_the_runner(made, capsys):
    """`semoe generate --lean` on a store with the layer drafts with it by default, saying so; the tokens
    are `--speculative 0`'s. Sampling turns it off (no line); --speculative K drafts with the layer too."""
    from tools.cli import main

    _, store = made
    args = ["generate", "--model", store.root, "--lean", "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-new-tokens", "24", "--ignore-eos", "--json"]
    assert main([*args, "--speculative", "0"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert "speculative" not in want["stats"]
    assert main(args) == 0
    out = capsys.readouterr()
    got = json.loads(out.out)
    assert got["tokens"] == want["tokens"] and got["stats"]["drafter"] == "Drafter"
    assert got["stats"]["passes"] + got["stats"]["accepted"] == 23
    assert "drafting 3 tokens a step with the checkpoint's multi-token-prediction layer" in out.err
    assert main([*args, "--temperature", "0.8"]) == 0
    out = capsys.readouterr()
    assert "speculative" not in json.loads(out.out)["stats"] and "drafting" not in out.err


def test_paying_probes_half_as_often_each_turn_the_same_kind_wins():
    from semoe.decode.loop import Paying

    t, tokens = [0.0], [1]
    paying = Paying(lambda toks, n: [0] * n, probe=1, hold=2, clock=lambda: t[0])
    kinds = []
    for _ in range(1 + 1 + 2 + 2 + 4 + 2 + 8 + 2):
        drafting = bool(paying(tokens, 2))
        kinds.append("d" if drafting else "p")
        t[0] += 1.0 if drafting else 0.5  # a drafted pass emits one token in twice the time: never pays
        tokens = tokens + [0]
    assert "".join(kinds) == "dp" + "pp" + "dp" + "pppp" + "dp" + "pppppppp" + "dp"


def test_a_layer_drafting_does_not_read_falls_back_to_lookup_saying_why(made, monkeypatch):
    """A store whose MTP layer lacks a part drafting reads (MiniMax-M2's modules are laid out otherwise)
    drafts by lookup, and `--speculative auto` stays off there."""
    _, store = made
    with LeanModel(store.root, LeanConfig(cache_bytes=None)) as lean, lean.sequence(16) as seq:
        assert mtp.mtp_refusal(lean.store) is None
        real = lean.store.manifest.has_tensor
        monkeypatch.setattr(lean.store.manifest, "has_tensor", lambda n, *a, **k: "eh_proj" not in n and
                            "mtp.fc" not in n and real(n, *a, **k))
        assert "not laid out as drafting reads it" in mtp.mtp_refusal(lean.store)
        assert isinstance(mtp.default_draft(lean, seq, PROMPT), PromptLookup)


def test_model_types_whose_layout_drafting_does_not_read_leave_the_layer_out(tmp_path):
    """MiniMax-M2's multi-token-prediction modules (layers past the last, `use_mtp`) are left out at import,
    as before, the manifest's `skipped` saying so."""
    import json as _json

    from helpers.hf_models import make_hf_checkpoint
    from safetensors.torch import save_file

    hf = make_hf_checkpoint("minimax_m2", tmp_path / "hf")
    cfg = _json.loads((hf / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    cfg.update(use_mtp=True, num_mtp_modules=1)
    (hf / "config.json").write_text(_json.dumps(cfg))
    save_file({f"model.layers.{n}.enorm.weight": torch.ones(cfg["hidden_size"])}, str(hf / "extra.safetensors"))
    info = import_checkpoint(str(hf), str(tmp_path / "store")).describe()
    assert info["mtp"] is None and info["skipped"]["layers"] == [n] and info["skipped"]["tensors"] == 1
