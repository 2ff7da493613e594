"""The decode profile: it times decoding steps only, its parts add up, and it counts the weights touched."""

from __future__ import annotations

import pytest
import torch

from semoe.model.config import named_config
from semoe.decode.profile import DecodeProfile, format_report
from semoe.decode.loop import SamplingConfig
from semoe.decode.generate import generate
from semoe.model.moe_gpt import MoEGPT


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEGPT(named_config("tiny")).eval()


def test_only_decoding_steps_are_profiled_and_the_parts_add_up(model):
    with DecodeProfile(model) as prof:
        generate(model, [1, 2, 3, 4, 5], SamplingConfig(max_new_tokens=6))
    assert len(prof.steps) == 5  # the prompt's forward is not a decoding step; 6 tokens take 5 steps
    r = prof.report(memory_gbps=10.0)
    parts = r["parts"]
    assert set(parts) == {"attention", "router", "experts", "dense_ffn", "lm_head", "rest"}
    assert all(p["ms_per_token"] >= 0 for p in parts.values())
    assert sum(p["ms_per_token"] for p in parts.values()) == pytest.approx(r["ms_per_token"], rel=1e-9)
    assert r["bound_ms_per_token"] == pytest.approx(r["mb_per_token"] / 10.0)
    assert len(format_report(r)) == 7
    # the hooks are gone afterwards: a forward outside the block records nothing
    model(torch.tensor([[1]]))
    assert len(prof.steps) == 5


def test_weight_bytes_are_every_dense_weight_and_the_routed_experts(model):
    c = model.config
    with DecodeProfile(model) as prof:
        generate(model, [7, 8, 9], SamplingConfig(max_new_tokens=2))
    parts = prof.report()["parts"]
    attn = sum(p.numel() * 4 for b in model.layers for p in b.attn.parameters())
    assert parts["attention"]["mb_per_token"] == pytest.approx(attn / 1e6)
    assert parts["lm_head"]["mb_per_token"] == pytest.approx(model.lm_head.weight.numel() * 4 / 1e6)
    # one token routes to top_k distinct experts in every MoE layer
    per_expert = 3 * c.hidden_size * c.moe_ffn_size * 4
    moe_layers = len(list(model.moe_layers()))
    assert parts["experts"]["mb_per_token"] == pytest.approx(moe_layers * c.top_k * per_expert / 1e6)


@pytest.mark.parametrize("budget", [[], ["--cpu-cache", "50%"]])
def test_generate_profile_through_the_command_line(capsys, tmp_path, budget):
    """`semoe generate --profile`, resident and offloaded: the profile in --json, its lines on stderr."""
    import json

    from helpers.hf_models import make_hf_checkpoint

    from semoe.checkpoints.hf_convert import import_checkpoint
    from tools.cli import main

    store = import_checkpoint(str(make_hf_checkpoint("mixtral", tmp_path / "hf")), str(tmp_path / "store"))
    assert main(["generate", "--model", store.root, "--prompt-ids", "4,8,15", "--max-new-tokens", "4",
                 "--ignore-eos", "--profile", "--json", "--device", "cpu", *budget]) == 0
    out = capsys.readouterr()
    prof = json.loads(out.out)["profile"]
    assert prof["steps"] == 3 and prof["memory_gbps"] > 0
    # the experts are counted as their provider holds them (float32 here, resident or in the CPU cache):
    # two per token in each of the two layers
    per_expert = sum(t.bytes for t in store.manifest.chunk_tensors(store.manifest.chunk(0, 0)))
    assert prof["parts"]["experts"]["mb_per_token"] * 1e6 == pytest.approx(2 * 2 * per_expert, rel=1e-9)
    assert "decode profile (through the modules) over 3 tokens" in out.err
