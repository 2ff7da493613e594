"""`semoe eval`, `--routing-trace` and `semoe store cache-sim --plot` through the real command line (in-process)."""

from __future__ import annotations

import json
import math
import random

import pytest
from helpers.hf_models import add_word_tokenizer, make_hf_checkpoint, tiny_config

from semoe.checkpoints.hf_convert import import_checkpoint
from storage.cache_sim import read_trace
from tools.cli import main
from helpers.procs import ROOT, child_env

MOE_LAYERS = 2  # tiny mixtral: every layer is MoE
WORDS = "the cat sat on a mat and dog ran to big red blue one two three four five six seven".split()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A tiny float32 Mixtral store with a word-level tokenizer."""
    root = tmp_path_factory.mktemp("eval")
    hf = make_hf_checkpoint("mixtral", root / "hf", seed=3)
    add_word_tokenizer(hf)
    return import_checkpoint(str(hf), str(root / "store")).root


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """A text file of ~600 words the tokenizer knows."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(50)) + "\n")
    return str(path)


def semoe(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def eval_json(capsys, *args: str) -> dict:
    rc, out, err = semoe(capsys, "eval", "--device", "cpu", "--json", *args)
    assert rc == 0, err
    return json.loads(out)


def test_eval_json_is_finite_and_the_same_model_as_reference_agrees(capsys, store, text):
    out = eval_json(capsys, "--model", store, "--data", text, "--seq-len", "32", "--max-tokens", "200",
                    "--reference", store)
    assert sorted(out) == sorted(["model", "reference", "tokens", "mean_nll", "perplexity", "kl_divergence",
                                  "kl_median", "kl_p99", "kl_p99_9", "top_token_agreement", "seq_len", "windows"])
    assert (out["tokens"], out["windows"], out["seq_len"]) == (200, 7, 32)
    assert math.isfinite(out["mean_nll"]) and out["mean_nll"] > 0
    assert out["perplexity"] == pytest.approx(math.exp(out["mean_nll"]))
    assert abs(out["kl_divergence"]) < 1e-6 and out["top_token_agreement"] == 1.0 and abs(out["kl_p99_9"]) < 1e-6
    alone = eval_json(capsys, "--model", store, "--data", text, "--seq-len", "32", "--max-tokens", "200")
    assert alone["mean_nll"] == out["mean_nll"]
    assert alone["kl_divergence"] is None and alone["top_token_agreement"] is None and alone["kl_p99_9"] is None


def test_eval_text_output_and_the_default_validation_text(capsys, store):
    rc, out, err = semoe(capsys, "eval", "--model", store, "--device", "cpu", "--seq-len", "64", "--max-tokens", "128")
    assert rc == 0, err
    assert "128 tokens in 2 windows of 64" in out and "perplexity" in out


def test_offloaded_eval_equals_resident_and_traces_the_same_routing(capsys, store, text, tmp_path):
    flags = ("--model", store, "--data", text, "--seq-len", "40", "--max-tokens", "200")
    resident = eval_json(capsys, *flags, "--routing-trace", str(tmp_path / "resident.jsonl"))
    offloaded = eval_json(capsys, *flags, "--cpu-cache", "25%", "--routing-trace", str(tmp_path / "offloaded.jsonl"))
    assert offloaded["mean_nll"] == pytest.approx(resident["mean_nll"], rel=1e-5)
    trace = read_trace(tmp_path / "resident.jsonl")
    assert len(trace) == resident["windows"] * MOE_LAYERS == 5 * MOE_LAYERS  # one per window and MoE layer
    assert [layer for layer, _ in trace] == [0, 1] * 5  # layer-major within each forward
    assert all(experts == sorted(set(experts)) and experts for _, experts in trace)
    assert read_trace(tmp_path / "offloaded.jsonl") == trace


def test_generate_appends_one_record_per_forward_and_moe_layer(capsys, store, tmp_path):
    path = tmp_path / "gen.jsonl"
    for n in (1, 2):
        rc, out, err = semoe(capsys, "generate", "--model", store, "--device", "cpu", "--prompt-ids", "4,8,15,16",
                             "--max-new-tokens", "5", "--ignore-eos", "--json", "--routing-trace", str(path))
        assert rc == 0, err
        assert len(json.loads(out)["tokens"]) == 5
        # a prefill and 4 decoding steps (the 5th token needs no forward), each through both MoE layers
        trace = read_trace(path)
        assert len(trace) == n * 5 * MOE_LAYERS
    assert all(len(experts) == 2 for _, experts in trace[2:10])  # a decoding step: one token's top-2


def test_cache_sim_plot_writes_a_png(capsys, store, text, tmp_path):
    path, png = tmp_path / "t.jsonl", tmp_path / "hit.png"
    eval_json(capsys, "--model", store, "--data", text, "--seq-len", "8", "--max-tokens", "64",
              "--routing-trace", str(path))
    rc, out, err = semoe(capsys, "store", "cache-sim", "--trace", str(path), "--plot", str(png), "--json")
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = json.loads(out)
    caps = sweep["capacities"]
    assert caps == list(range(caps[0], caps[-1] + 1)) and caps[-1] == 4 * MOE_LAYERS
    for name, results in sweep["policies"].items():
        assert len(results) == len(caps)
        assert all(r["hit_rate"] <= b["hit_rate"] + 1e-12 for r, b in zip(results, sweep["policies"]["belady"]))
    # --capacity still prints today's table; with --plot as well, the same numbers
    rc, out, err = semoe(capsys, "store", "cache-sim", "--trace", str(path), "--capacity", str(caps[-1]), "--json")
    rc2, out2, err2 = semoe(capsys, "store", "cache-sim", "--trace", str(path), "--capacity", str(caps[-1]), "--json",
                            "--plot", str(tmp_path / "again.png"))
    assert rc == rc2 == 0 and json.loads(out) == json.loads(out2)
    assert json.loads(out)["lru"] == sweep["policies"]["lru"][-1]


def _other_vocab(path) -> str:
    import transformers

    cfg = tiny_config("mixtral")
    cfg.vocab_size = 100
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("args, message", [
    (["--model", "{tmp}/nope"], "--model {tmp}/nope: no such file or directory"),
    (["--data", "{tmp}/nope.txt"], "--data {tmp}/nope.txt: no such file or directory"),
    (["--data", "{tmp}/empty.txt"], "--data {tmp}/empty.txt: 0 token(s)"),
    (["--data", "{tmp}"], "no *.txt, *.md, *.py files"),
    (["--seq-len", "1"], "--seq-len must be >= 2, got 1"),
    (["--seq-len", "4096"], "exceeds the model's max_position 128"),
    (["--reference", "OTHER"], "vocabulary of 100 tokens, but --model has 96"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, store, tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("")
    empty_dir = tmp_path / "dir"
    empty_dir.mkdir()
    args = [a.format(tmp=tmp_path) for a in args]
    if "--data" in args and args[-1] == str(tmp_path):
        args[-1] = str(empty_dir)
    if "OTHER" in args:
        args[args.index("OTHER")] = _other_vocab(tmp_path / "other")
    argv = ["eval", "--device", "cpu", *args]
    if "--model" not in args:
        argv += ["--model", store]
    rc, out, err = semoe(capsys, *argv)
    assert rc == 2 and out == ""
    lines = [line for line in err.splitlines() if line.startswith("semoe: error:")]
    assert len(lines) == 1 and message.format(tmp=tmp_path) in lines[0], err


@pytest.mark.slow  # a server process
def test_serve_records_the_routing_of_its_requests(store, tmp_path):
    import re
    import signal
    import subprocess
    import sys
    import urllib.request

    path = tmp_path / "serve.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", "--model", store, "--port", "0", "--device",
                             "cpu", "--cpu-cache", "50%", "--routing-trace", str(path)], stderr=subprocess.PIPE,
                            text=True, env=child_env(), cwd=ROOT)
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line, f"semoe serve exited {proc.wait()}"
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1))
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": [1, 5, 9, 14], "max_tokens": 6}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            out = json.loads(r.read())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    trace = read_trace(path)
    assert len(trace) == out["usage"]["completion_tokens"] * MOE_LAYERS
    assert [layer for layer, _ in trace] == [0, 1] * out["usage"]["completion_tokens"]


def test_a_model_without_a_tokenizer_is_one_line_and_exit_2(capsys, tmp_path, text):
    hf = make_hf_checkpoint("mixtral", tmp_path / "hf", seed=4)  # no tokenizer.json
    capsys.readouterr()  # what save_pretrained wrote
    rc, out, err = semoe(capsys, "eval", "--model", str(hf), "--device", "cpu", "--data", text)
    assert rc == 2 and err.strip() == f"semoe: error: --model {hf}: no tokenizer (tokenizer.json) to tokenize the " \
                                      "evaluation text with"
