"""Shared by the trainer's tests: the tiny model shape, its CLI flags, running `semoe`, reading back
what a run wrote (logged losses, every tensor of its store), and comparing stores kind by kind."""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from semoe.model.config import named_config
from storage.store import Store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_size=128, moe_ffn_size=96,
             num_experts=4, max_position=256)
SHAPE_FLAGS = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
               "--expert-ffn", "96", "--experts", "4"]


def tiny_config(**kw):
    """The small MoE GPT of SHAPE, with `kw` overriding any field."""
    return named_config("gpt-moe-small", **{**SHAPE, **kw})


def store_tensors(path: str) -> dict[tuple, torch.Tensor]:
    """Every tensor of a store's committed version, dense and expert, by (name, kind)."""
    store = Store.open(path)
    out = {}
    for t in store.manifest.dense():
        out[(t.name, "weight")] = store.read_tensor(t.name)
    for c in store.manifest.chunks:
        for name, t in store.read_expert(c.layer, c.expert, c.kind).items():
            out[(name, c.kind)] = t
    return out


def optimizer_state(path: str) -> dict:
    """The dense optimizer's state a trainer saved in its store."""
    store = Store.open(path)
    return torch.load(io.BytesIO(store.read_file("optimizer.pt")), weights_only=False)["dense_optimizer"]


def cli(*args, check=True, **kw) -> subprocess.CompletedProcess:
    """`semoe ARGS` in a subprocess from the repository root; with `check`, exit 0 is asserted."""
    p = subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, **kw)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def log_losses(path: str) -> list[float]:
    """The per-step losses of a `--log-json` file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["loss"] for line in f]


def log_entries(path: str) -> list[dict]:
    """Every step's record of a `--log-json` file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@dataclass(frozen=True)
class Tol:
    """A tolerance: `rtol` of each element, plus `atol` absolute and `ulps_of_max` float32 eps times
    the tensor's largest magnitude (a sum whose terms cancel is off by ulps of its largest term)."""

    rtol: float
    atol: float = 0.0
    ulps_of_max: float = 0.0


def assert_stores_close(got: dict[tuple, torch.Tensor], want: dict[tuple, torch.Tensor],
                        tolerances: dict[str, Tol]) -> None:
    """`store_tensors` of two runs hold the same tensors, each within the tolerance of its kind."""
    assert got.keys() == want.keys()
    for key, w in want.items():
        tol = tolerances[key[1]]
        largest = float(w.abs().max()) if w.numel() else 0.0
        atol = tol.atol + tol.ulps_of_max * torch.finfo(torch.float32).eps * largest
        torch.testing.assert_close(got[key], w, rtol=tol.rtol, atol=atol, msg=lambda m: f"{key}: {m}")


def checkpoint_step(store, run_file: str) -> int:
    """The step of a run store's last checkpoint, from its run file (trainer.json, pipeline.json);
    -1 before the first."""
    try:
        return json.loads(Store.open(str(store)).read_file(run_file))["step"]
    except Exception:  # not created yet
        return -1


def kill_mid_run(args: list[str], out, run_file: str, *, after_step: int, timeout_s: float) -> int:
    """Start `semoe ARGS --out OUT` in a session of its own, its step log (`--log-json`) going into a
    pipe; read the log until the line of the step after `after_step`, which the trainer writes
    once the checkpoint at `after_step` (a multiple of --checkpoint-every) is committed; then kill
    every process of the session at once (SIGKILL, as a machine crash would: the launcher and its
    ranks) and return the step of the last checkpoint, which the caller checks lies before the
    run's end. The kill follows the run's own progress, not a timer."""
    with tempfile.TemporaryDirectory(prefix="semoe-kill-") as tmp:
        fifo = os.path.join(tmp, "steps.jsonl")
        os.mkfifo(fifo)
        proc = subprocess.Popen([sys.executable, "-m", "tools.cli", *args, "--out", str(out), "--log-json", fifo],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        # read and write: opening waits for no writer, and the pipe never reads as closed (a run
        # that ends or dies early is seen by `poll` when no line has come for a second)
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        try:
            _read_log_until(fd, proc, after_step + 1, time.time() + timeout_s)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            os.close(fd)
    return checkpoint_step(os.path.join(out, "store"), run_file)


def _read_log_until(fd: int, proc: subprocess.Popen, step: int, deadline: float) -> None:
    """Block on the step log's pipe until a line of `step` or later arrives, the run exits, or the
    deadline passes."""
    pending = b""
    while time.time() < deadline and proc.poll() is None:
        readable, _, _ = select.select([fd], [], [], min(1.0, max(deadline - time.time(), 0)))
        if not readable:
            continue
        pending += os.read(fd, 1 << 16)
        *lines, pending = pending.split(b"\n")
        if any(json.loads(line)["step"] >= step for line in lines if line.strip()):
            return

