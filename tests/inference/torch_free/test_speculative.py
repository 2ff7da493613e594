"""Speculative decoding on the torch-free runner (inference/torch_free/speculative.py, semoe.decode.loop's
`run_speculative`): drafted tokens verified in one pass give greedy decoding's tokens exactly, whatever the
drafts, on a model of attention layers, on one with Gated DeltaNet layers and on DeepSeek-V4 (whose states
a rejection rolls back); with memory short a pass reads each expert its rows chose once. Log-probs within LOGPROB_ATOL:
a pass computes its rows as the prompt pass does, a step as decoding does (float32 rounding apart)."""

from __future__ import annotations

import json

import pytest
from helpers.hf_models import make_hf_checkpoint

from inference.torch_free.runner import LeanConfig, LeanModel
from semoe.checkpoints.hf_convert import import_checkpoint
from semoe.decode.loop import PromptLookup, SamplingConfig, prompt_lookup
from tools.cli import main

PROMPT = [3, 17, 5, 29, 11, 2, 40, 8, 19, 23]
NEW = 24
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module", params=["mixtral", "qwen3_next", "deepseek_v4"])
def store(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, root / "hf", seed=7)
    return import_checkpoint(str(hf), str(root / "store")).root


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    assert prompt_lookup([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]  # the longest suffix first
    assert prompt_lookup([5, 6], 2, history=[1, 2, 5, 6, 7, 8]) == [7, 8]  # the prompt counts
    assert prompt_lookup([7, 9, 7], 5) == [9, 7]  # no more than there is
    assert prompt_lookup([9], 2) == [] and prompt_lookup([1, 2, 3], 0) == []
    lookup, tokens = PromptLookup([4, 1, 4, 2]), []  # kept across a generation's calls: the same drafts
    for t in [4, 1, 4, 4, 2, 1, 4]:
        tokens.append(t)
        assert lookup(tokens, 2) == prompt_lookup(tokens, 2, history=[4, 1, 4, 2])


@pytest.mark.parametrize("cache", [None, 1], ids=["resident", "least-cache"])
def test_speculative_decoding_gives_greedy_tokens_across_rejections(store, cache):
    """Drafts from the greedy tokens themselves, every third one made wrong (a rejection every pass or
    two, whose rows after it are undone), then always right, then empty: each run's tokens are plain
    decoding's; right drafts are all kept, in fewer passes; wrong ones are counted as drafted, not kept."""
    cfg = SamplingConfig(max_new_tokens=NEW)
    with LeanModel(store, LeanConfig(cache_bytes=cache)) as lean:
        want = lean.generate(PROMPT, cfg)
        drawn = [0]

        def oracle(wrong_every: int):
            def draft(tokens: list[int], n: int) -> list[int]:
                out = []
                for t in want.tokens[len(tokens):len(tokens) + n]:
                    drawn[0] += 1
                    out.append((t + 1) % 64 if wrong_every and drawn[0] % wrong_every == 0 else t)
                return out
            return draft

        runs = {name: lean.generate(PROMPT, cfg, speculative=3, draft=oracle(every))
                for name, every in (("rejected", 3), ("right", 0))}
        runs["none"] = lean.generate(PROMPT, cfg, speculative=3, draft=lambda tokens, n: [])
    for name, got in runs.items():
        assert got.tokens == want.tokens, name
        assert got.logprobs == pytest.approx(want.logprobs, abs=LOGPROB_ATOL), name
    rejected, right, none = (runs[n].stats for n in ("rejected", "right", "none"))
    assert 0 < rejected["accepted"] < rejected["drafted"]
    assert right["accepted"] == right["drafted"] == NEW - 1 - right["passes"]
    assert right["passes"] == -(-(NEW - 1) // 4)  # four tokens a pass
    assert none["passes"] == NEW - 1 and none["drafted"] == 0


def test_generate_speculative_from_the_command_line(store, capsys):
    """`--speculative K` implies the torch-free runner, gives greedy decoding's tokens and says what the
    drafts bought; with sampling, or a negative K, one line and exit 2."""
    args = ["generate", "--model", store, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "16",
            "--ignore-eos", "--json"]
    assert main(args) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    assert main([*args, "--speculative", "3"]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out)
    assert got["tokens"] == want and got["stats"]["speculative"] == 3
    assert got["stats"]["passes"] + got["stats"]["accepted"] == 15
    assert "--speculative decodes in the torch-free runner" in out.err
    for bad, named in ((["--speculative", "2", "--temperature", "0.7"], "--speculative decodes greedily"),
                       (["--speculative", "-1"], "--speculative must be >= 0"),
                       (["--speculative", "some"], "--speculative must be auto or a count")):
        assert main([*args, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert named in err and "\n" not in err
