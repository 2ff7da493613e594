"""`semoe demo`, the README's first command, run as a user runs it (shorter): it trains and learns,
verifies its store, generates with experts offloaded, and refuses bad flags in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.procs import ROOT, child_env


def demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", "demo", *args], capture_output=True, text=True,
                          env=child_env(), cwd=ROOT, timeout=600)


@pytest.mark.slow  # a training run and a generation in a process of their own
def test_the_demo_learns_verifies_and_generates_offloaded(tmp_path):
    work = tmp_path / "run"
    res = demo("--steps", "30", "--batch-size", "4", "--seq-len", "64", "--max-new-tokens", "8", "--workdir",
               str(work), "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    train, gen = out["train"], out["generate"]
    assert train["steps"] == 30
    # bytes start near uniform (ln 259 = 5.56 nats); 30 steps at the default rate take off a nat or more
    assert train["first_loss"] > 5.0 and train["final_loss"] < train["first_loss"] - 1.0, train
    assert train["val_loss_after"] < train["val_loss_before"] - 1.0, train
    assert 0 < train["cpu_cache_bytes"] < train["expert_state_bytes"]  # states on SSD behind a smaller cache
    assert gen["tokens"] == 8 and gen["decode_tok_s"] > 0 and 0 <= gen["stats"]["cpu_hit_rate"] <= 1
    assert "store version" in res.stderr and "every checksum good" in res.stderr
    assert os.path.exists(work / "store" / "manifest.json") or any(work.rglob("manifest.json"))


@pytest.mark.slow  # a process of its own
def test_a_bad_flag_is_one_line(tmp_path):
    res = demo("--cpu-cache", "1.5")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["semoe: error: --cpu-cache must be a fraction in (0, 1], got 1.5"]
